//! Forget-gate math: a stable log-sigmoid, validation of log gates, and the cumulative
//! log gate `c_t = sum_{l<=t} log f_l` kept in f64.
//!
//! Forgetting attention adds `D_ij = c_i - c_j` to the logits (ACP paper, section 2). `c`
//! falls without bound on long streams, and an f32 sum loses D (at |c| = 1e6 the f32 spacing
//! is 0.06), so `c` is summed in f64 and kept relative to a movable origin: D only uses
//! differences, which re-basing leaves exact.
//!
//! A log gate must be finite and `<= 0` (`f = sigmoid(z)` lies in (0, 1]); anything else
//! is bad input and is reported with its position, never clamped.
//!
//! A valid gate below [`LOG_GATE_FLOOR`] enters the sums as the floor. That changes no
//! attention weight: every pair separated by such a gate has `D <= -1e4`, so its weight
//! `exp(s q.k + D) <= exp(2U - 1e4)` underflows to 0 in f64 for any logit bound
//! `U < 4.6e3`. It keeps `|c|` below `1e4` nats per token, so an f64 sum over a long
//! sequence keeps its spacing far under the gates it must resolve (one gate of
//! `f32::MIN` would otherwise swallow every later gate into rounding).

use crate::error::{Error, Result};
use crate::shape::{AttentionShape, Layout};

/// `ln sigmoid(x) = min(x, 0) - ln(1 + exp(-|x|))`, stable for every finite `x`
/// (no overflow of `exp`, no cancellation for large `|x|`). Returns a value `<= 0`;
/// NaN maps to NaN, `+inf` to 0 and `-inf` to `-inf`.
#[inline]
pub fn logsigmoid(x: f32) -> f32 {
    x.min(0.0) - libm::log1pf(libm::expf(-x.abs()))
}

/// f64 version of [`logsigmoid`].
#[inline]
pub fn logsigmoid_f64(x: f64) -> f64 {
    x.min(0.0) - libm::log1p(libm::exp(-x.abs()))
}

/// The smallest log gate that enters a cumulative sum as itself (see the module doc).
pub const LOG_GATE_FLOOR: f32 = -1.0e4;

/// `Ok` when the log gate is finite and `<= 0`, else [`Error::BadLogGate`] at `index`.
#[inline]
fn check_gate(index: usize, value: f32) -> Result<()> {
    // is_finite rejects NaN and +-inf; then only positive values remain to reject.
    if !value.is_finite() || value > 0.0 {
        return Err(Error::BadLogGate { index, value });
    }
    Ok(())
}

/// A finite gate `<= 0`, branch-free (NaN fails both comparisons, `-inf` the second).
#[inline]
fn gate_ok(value: f32) -> bool {
    (f32::MIN..=0.0).contains(&value)
}

/// Gates checked per pass of [`validate_log_gates`]'s branch-free reduction (1 KiB).
const CHECK_CHUNK: usize = 256;

/// Checks that every log gate is finite and `<= 0`.
///
/// Each [`CHECK_CHUNK`] of gates is reduced without branches (it vectorizes: 16K gates in
/// about 2 us, against 31 us for a check that returns at the first bad value); only a
/// chunk that fails is searched for its first bad gate.
///
/// Errors: [`Error::BadLogGate`] with the index (into `log_f`) of the first bad value.
pub fn validate_log_gates(log_f: &[f32]) -> Result<()> {
    for (n, chunk) in log_f.chunks(CHECK_CHUNK).enumerate() {
        if !chunk.iter().fold(true, |ok, &v| ok & gate_ok(v)) {
            for (i, &v) in chunk.iter().enumerate() {
                check_gate(n * CHECK_CHUNK + i, v)?;
            }
        }
    }
    Ok(())
}

/// Heads summed together by [`cumsum_rows`]: eight independent f64 chains per row.
const ROW_LANES: usize = 8;

/// [`cumsum_strided`] of every head of a row-major `[rows, heads]` log-gate tensor, in one
/// pass over its rows: `out[h * rows + r] = origin + sum_{l<=r} max(log_f[l * heads + h],
/// LOG_GATE_FLOOR)`, with `rows = out.len() / heads` (`out` is `[heads, rows]`).
///
/// Each head's sum is the same f64 additions in the same order as [`cumsum_strided`] of
/// that head (bit-identical). Groups of [`ROW_LANES`] heads run as independent chains, so
/// a row costs one contiguous read instead of a strided one per head and the f64 adds'
/// latency overlaps (16 heads x 1024 rows: 12-15 us on the dev machine and the H100
/// host, against 46-65 us head by head).
///
/// Errors: `heads == 0` or `out.len()` not a multiple of `heads` ([`Error::BadArgument`]);
/// `log_f` shorter than `out.len()` ([`Error::BadLength`]); a bad gate among the first
/// `out.len()` ([`Error::BadLogGate`] with its index into `log_f`, as
/// [`validate_log_gates`] gives it). On error `out` is unchanged.
pub fn cumsum_rows(log_f: &[f32], heads: usize, origin: f64, out: &mut [f64]) -> Result<()> {
    if heads == 0 || out.len() % heads != 0 {
        return Err(Error::BadArgument(
            "cumsum_rows: heads must be > 0 and divide out.len()",
        ));
    }
    let log_f = log_f.get(..out.len()).ok_or(Error::BadLength {
        what: "cumsum_rows log_f (minimum)",
        expected: out.len(),
        got: log_f.len(),
    })?;
    validate_log_gates(log_f)?;
    sum_rows(log_f, heads, origin, out);
    Ok(())
}

/// [`cumsum_rows`] of gates already checked, `log_f.len() >= out.len()`, `heads > 0`
/// dividing `out.len()`.
fn sum_rows(log_f: &[f32], heads: usize, origin: f64, out: &mut [f64]) {
    let rows = out.len() / heads;
    let mut h0 = 0;
    while h0 < heads {
        let w = ROW_LANES.min(heads - h0);
        let group = &mut out[h0 * rows..(h0 + w) * rows];
        if w == ROW_LANES {
            sum_lanes::<ROW_LANES>(log_f, heads, h0, origin, group);
        } else {
            for (l, o) in group.chunks_exact_mut(rows.max(1)).enumerate() {
                sum_lanes::<1>(log_f, heads, h0 + l, origin, o);
            }
        }
        h0 += w;
    }
}

/// `c` of every (batch, query head) of a call: `out[(b * heads_q + h) * seq_k + t] =
/// sum_{l<=t} max(log_f[gate_at(b, l, h)], LOG_GATE_FLOOR)` (`out` is `[batch * heads_q,
/// seq_k]`), each head bit-identical to [`cumsum_strided`] of it. The gates are checked
/// once; a `SeqFirst` tensor is then summed by rows ([`cumsum_rows`], one batch at a time),
/// a `HeadFirst` one head by head.
///
/// Errors: `log_f.len() != shape.gate_len()` or `out.len()` not that ([`Error::BadLength`]);
/// a bad gate ([`Error::BadLogGate`] with its index into `log_f`, the first in memory
/// order, as [`validate_log_gates`] gives it).
pub fn cumsum_heads(shape: &AttentionShape, log_f: &[f32], out: &mut [f64]) -> Result<()> {
    let n = shape.gate_len();
    for (what, got) in [
        ("cumsum_heads log_f", log_f.len()),
        ("cumsum_heads out", out.len()),
    ] {
        if got != n {
            return Err(Error::BadLength {
                what,
                expected: n,
                got,
            });
        }
    }
    validate_log_gates(log_f)?;
    let seq = shape.seq_k;
    match shape.layout {
        Layout::SeqFirst => {
            let per_batch = seq * shape.heads_q;
            for (g, o) in log_f.chunks(per_batch).zip(out.chunks_mut(per_batch)) {
                sum_rows(g, shape.heads_q, 0.0, o);
            }
        }
        Layout::HeadFirst => {
            for (g, o) in log_f.chunks(seq).zip(out.chunks_mut(seq)) {
                sum_rows(g, 1, 0.0, o);
            }
        }
    }
    Ok(())
}

/// Heads `h0..h0 + W` of [`cumsum_rows`] (gates already checked): `out` is `[W, rows]`.
#[inline]
fn sum_lanes<const W: usize>(log_f: &[f32], heads: usize, h0: usize, origin: f64, out: &mut [f64]) {
    let rows = out.len() / W;
    let mut acc = [origin; W];
    for (r, row) in log_f.chunks_exact(heads).take(rows).enumerate() {
        let Some(g) = row.get(h0..h0 + W) else { return };
        for l in 0..W {
            acc[l] += f64::from(g[l].max(LOG_GATE_FLOOR));
            out[l * rows + r] = acc[l];
        }
    }
}

/// Inclusive prefix sum of strided log gates in f64:
/// `out[t] = origin + sum_{l<=t} max(log_f[l * stride], LOG_GATE_FLOOR)` for `t < out.len()`.
///
/// `stride` is the distance between consecutive positions of one head in the log-gate
/// tensor ([`crate::AttentionShape::gate_stride`]); pass `&log_f[gate_at(b, 0, h)..]`.
/// `origin` is the head's gate origin (0 for a fresh sequence; the previous `c` for a
/// prefill chunk that continues a stream).
///
/// Errors: `stride == 0` ([`Error::BadArgument`]); `log_f` shorter than
/// `(out.len() - 1) * stride + 1` ([`Error::BadLength`], `expected` is that minimum);
/// a bad gate ([`Error::BadLogGate`] with `index = t`, the position, not the flat index).
/// On error `out` may be partly written.
pub fn cumsum_strided(log_f: &[f32], stride: usize, origin: f64, out: &mut [f64]) -> Result<()> {
    if stride == 0 {
        return Err(Error::BadArgument("cumsum_strided: stride must be > 0"));
    }
    if out.is_empty() {
        return Ok(());
    }
    let need = (out.len() - 1)
        .checked_mul(stride)
        .and_then(|x| x.checked_add(1))
        .ok_or(Error::BadArgument(
            "cumsum_strided: length * stride overflows",
        ))?;
    if log_f.len() < need {
        return Err(Error::BadLength {
            what: "cumsum_strided log_f (minimum)",
            expected: need,
            got: log_f.len(),
        });
    }
    let mut acc = origin;
    for (t, (o, &g)) in out.iter_mut().zip(log_f.iter().step_by(stride)).enumerate() {
        check_gate(t, g)?;
        acc += f64::from(g.max(LOG_GATE_FLOOR));
        *o = acc;
    }
    Ok(())
}

/// Streaming cumulative log gate of one head, kept in f64 relative to a movable origin.
///
/// State: `origin` (absolute, for reporting only) and `c` (relative to `origin`). After
/// `n` pushes, `origin + c = sum of all n gates` (up to f64 rounding of the running sums).
/// Every `c_j` that the caller stores (a cache entry's gate value) must be relative to the
/// same origin: [`GateStream::rebase`] moves the origin and the caller must then subtract
/// the same `shift` from every stored relative `c_j` of this head
/// (`RetentionPolicy::rebase` in [`crate::retention`] does it for the cache it indexes, and
/// [`crate::eviction::Certificate::rebase`] for the eviction certificate). Differences
/// `c_t - c_j` are unchanged by a rebase.
///
/// A useful rule: rebase by the `c` of the oldest live cache entry once `|c|` exceeds, say,
/// 1e6, so that the stored values stay small and their f64 spacing stays below 1e-10.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateStream {
    origin: f64,
    c: f64,
    count: u64,
}

impl Default for GateStream {
    fn default() -> Self {
        Self::new()
    }
}

impl GateStream {
    /// A stream with no gates yet: origin 0, `c = 0`.
    pub const fn new() -> Self {
        Self {
            origin: 0.0,
            c: 0.0,
            count: 0,
        }
    }

    /// A stream in a saved state: `origin`, `c` relative to it, `count` gates pushed.
    ///
    /// Errors ([`Error::BadArgument`]): `origin` or `c` not finite, or `c > 0` (`c` starts
    /// at 0, only decreases, and a re-basing moves it to 0 at most).
    pub fn from_parts(origin: f64, c: f64, count: u64) -> Result<Self> {
        if !(origin.is_finite() && c.is_finite() && c <= 0.0) {
            return Err(Error::BadArgument(
                "GateStream::from_parts: origin and c must be finite, c <= 0",
            ));
        }
        Ok(Self { origin, c, count })
    }

    /// Adds the next log gate and returns the new `c_t` relative to the current origin.
    ///
    /// Errors: [`Error::BadLogGate`] with `index` = the stream position of this gate
    /// (number of gates pushed before it, saturated at `usize::MAX`); the state is unchanged.
    pub fn push(&mut self, log_f: f32) -> Result<f64> {
        let index = usize::try_from(self.count).unwrap_or(usize::MAX);
        check_gate(index, log_f)?;
        self.c += f64::from(log_f.max(LOG_GATE_FLOOR));
        self.count += 1;
        Ok(self.c)
    }

    /// `c` of the last pushed position, relative to the current origin (0 before any push).
    #[inline]
    pub fn current(&self) -> f64 {
        self.c
    }

    /// Number of gates pushed so far (= the next stream position).
    #[inline]
    pub fn len(&self) -> u64 {
        self.count
    }

    /// True before the first push.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The current origin (absolute units: sum of log gates).
    #[inline]
    pub fn origin(&self) -> f64 {
        self.origin
    }

    /// Moves the origin by `shift`: `origin += shift`, `c -= shift`. The caller must apply
    /// `c_j -= shift` to every stored relative `c_j` of this head. A non-finite `shift`
    /// would destroy the state, so it is ignored (nothing changes); use
    /// [`GateStream::try_rebase`] to get an error instead.
    pub fn rebase(&mut self, shift: f64) {
        let _ = self.try_rebase(shift);
    }

    /// [`GateStream::rebase`] that reports a non-finite `shift` as [`Error::BadArgument`].
    pub fn try_rebase(&mut self, shift: f64) -> Result<()> {
        if !shift.is_finite() {
            return Err(Error::BadArgument(
                "GateStream::rebase: shift must be finite",
            ));
        }
        self.origin += shift;
        self.c -= shift;
        Ok(())
    }

    /// `origin + c`: the absolute cumulative log gate, for reporting (its f64 rounding grows
    /// with the magnitude; use relative values for attention).
    #[inline]
    pub fn absolute(&self) -> f64 {
        self.origin + self.c
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::strategy::Strategy;
    use std::vec;
    use std::vec::Vec;

    #[test]
    fn logsigmoid_matches_naive_and_is_stable() {
        for &x in &[-100.0f32, -20.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 20.0, 100.0] {
            let naive = -libm::log1p(libm::exp(-f64::from(x)));
            assert!((f64::from(logsigmoid(x)) - naive).abs() <= 1e-6 * naive.abs().max(1e-3));
            assert!((logsigmoid_f64(f64::from(x)) - naive).abs() <= 1e-12 * naive.abs().max(1.0));
        }
        assert_eq!(logsigmoid(-1000.0), -1000.0);
        assert_eq!(logsigmoid(1000.0), 0.0);
        assert!(logsigmoid(f32::NAN).is_nan());
        assert_eq!(logsigmoid(f32::INFINITY), 0.0);
        assert_eq!(logsigmoid(f32::NEG_INFINITY), f32::NEG_INFINITY);
    }

    #[test]
    fn validate_rejects_bad_gates_with_index() {
        assert_eq!(validate_log_gates(&[0.0, -1.0, -0.0]), Ok(()));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-30] {
            match validate_log_gates(&[-1.0, -2.0, bad, 1.0]) {
                Err(Error::BadLogGate { index: 2, value }) => {
                    assert!(value.to_bits() == bad.to_bits())
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn cumsum_strided_sums_and_errors() {
        let g = [-1.0f32, 9.0, -2.0, 9.0, -0.5];
        let mut out = [0.0f64; 3];
        cumsum_strided(&g, 2, 10.0, &mut out).unwrap();
        assert_eq!(out, [9.0, 7.0, 6.5]);
        assert!(matches!(
            cumsum_strided(&g, 0, 0.0, &mut out),
            Err(Error::BadArgument(_))
        ));
        let mut out4 = [0.0f64; 4];
        assert_eq!(
            cumsum_strided(&g, 2, 0.0, &mut out4),
            Err(Error::BadLength {
                what: "cumsum_strided log_f (minimum)",
                expected: 7,
                got: 5
            })
        );
        let bad = [-1.0f32, 0.5];
        let mut out2 = [0.0f64; 2];
        assert_eq!(
            cumsum_strided(&bad, 1, 0.0, &mut out2),
            Err(Error::BadLogGate {
                index: 1,
                value: 0.5
            })
        );
        assert!(cumsum_strided(&g, usize::MAX, 0.0, &mut out).is_err());
        assert_eq!(cumsum_strided(&[], 1, 0.0, &mut []), Ok(()));
    }

    #[test]
    fn validate_finds_the_first_bad_gate_past_a_chunk() {
        let mut g = vec![-0.5f32; 3 * CHECK_CHUNK + 7];
        assert_eq!(validate_log_gates(&g), Ok(()));
        g[2 * CHECK_CHUNK + 3] = f32::NAN;
        g[3 * CHECK_CHUNK + 1] = 2.0;
        assert!(matches!(
            validate_log_gates(&g),
            Err(Error::BadLogGate { index, .. }) if index == 2 * CHECK_CHUNK + 3
        ));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

        /// Every head of `cumsum_rows` is `cumsum_strided` of that head, bit for bit.
        #[test]
        fn cumsum_rows_equals_cumsum_strided_bit_for_bit(
            (heads, g) in (1usize..20, 1usize..200).prop_flat_map(|(h, r)| {
                (proptest::prelude::Just(h), proptest::collection::vec(
                    proptest::prop_oneof![8 => -5.0f32..=0.0, 1 => proptest::prelude::Just(f32::MIN)],
                    h * r,
                ))
            }),
            origin in -1e6f64..=0.0,
        ) {
            let rows = g.len() / heads;
            let mut out = vec![0.0f64; rows * heads];
            cumsum_rows(&g, heads, origin, &mut out).unwrap();
            let mut one = vec![0.0f64; rows];
            for h in 0..heads {
                cumsum_strided(&g[h..], heads, origin, &mut one).unwrap();
                let got = &out[h * rows..(h + 1) * rows];
                proptest::prop_assert!(got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn cumsum_heads_sums_each_head_in_either_layout() {
        for layout in [Layout::SeqFirst, Layout::HeadFirst] {
            let sh = AttentionShape {
                batch: 2,
                heads_q: 3,
                heads_kv: 1,
                seq_q: 5,
                seq_k: 7,
                head_dim: 8,
                layout,
            };
            let g: Vec<f32> = (0..sh.gate_len())
                .map(|i| -0.01 * (i % 11) as f32)
                .collect();
            let mut out = vec![0.0f64; sh.gate_len()];
            cumsum_heads(&sh, &g, &mut out).unwrap();
            let mut one = vec![0.0f64; sh.seq_k];
            for b in 0..sh.batch {
                for h in 0..sh.heads_q {
                    cumsum_strided(&g[sh.gate_at(b, 0, h)..], sh.gate_stride(), 0.0, &mut one)
                        .unwrap();
                    assert_eq!(
                        &out[(b * sh.heads_q + h) * sh.seq_k..][..sh.seq_k],
                        &one[..]
                    );
                }
            }
            let mut bad = g.clone();
            bad[sh.gate_at(1, 4, 2)] = f32::NAN;
            assert!(matches!(
                cumsum_heads(&sh, &bad, &mut out),
                Err(Error::BadLogGate { index, .. }) if index == sh.gate_at(1, 4, 2)
            ));
            assert!(matches!(
                cumsum_heads(&sh, &g[1..], &mut out),
                Err(Error::BadLength { .. })
            ));
        }
    }

    #[test]
    fn cumsum_rows_errors_leave_out_unchanged() {
        let mut out = [1.0f64; 6];
        let g = [-1.0f32, -1.0, -1.0, 0.5, -1.0, -1.0];
        assert_eq!(
            cumsum_rows(&g, 2, 0.0, &mut out),
            Err(Error::BadLogGate {
                index: 3,
                value: 0.5
            })
        );
        assert!(matches!(
            cumsum_rows(&g, 0, 0.0, &mut out),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            cumsum_rows(&g, 4, 0.0, &mut out),
            Err(Error::BadArgument(_))
        ));
        assert_eq!(
            cumsum_rows(&g[..4], 2, 0.0, &mut out),
            Err(Error::BadLength {
                what: "cumsum_rows log_f (minimum)",
                expected: 6,
                got: 4
            })
        );
        assert_eq!(out, [1.0; 6]);
        assert_eq!(cumsum_rows(&[], 3, 0.0, &mut []), Ok(()));
    }

    #[test]
    fn gate_stream_rebase_keeps_differences() {
        let mut s = GateStream::new();
        assert!(s.is_empty());
        let a = s.push(-1.5).unwrap();
        let b = s.push(-0.25).unwrap();
        assert_eq!((a, b, s.len()), (-1.5, -1.75, 2));
        s.rebase(b);
        assert_eq!(s.current(), 0.0);
        assert_eq!((s.origin(), s.absolute()), (-1.75, -1.75));
        let a_rel = a - b; // the caller shifts its stored value
        let c = s.push(-1.0).unwrap();
        assert_eq!(c - a_rel, -1.25); // = -2.75 - (-1.5), as without the rebase
        assert!(matches!(
            s.push(f32::NAN),
            Err(Error::BadLogGate { index: 3, .. })
        ));
        assert_eq!(s.len(), 3);
        assert!(s.try_rebase(f64::NAN).is_err());
        s.rebase(f64::INFINITY);
        assert_eq!(s.absolute(), -2.75);
        assert_eq!(s.current(), -1.0);
    }

    #[test]
    fn f64_stream_keeps_differences_far_from_origin() {
        // 2e6 gates of -0.75: |c| = 1.5e6, where f32 would have spacing 0.125.
        let mut s = GateStream::new();
        let mut prev = 0.0;
        for _ in 0..2_000_000 {
            prev = s.current();
            s.push(-0.75).unwrap();
        }
        assert_eq!(prev - s.current(), 0.75);
    }

    #[test]
    fn huge_negative_gates_keep_later_differences_exact() {
        // One gate of f32::MIN must not swallow the gates after it into rounding.
        let log_f = [-0.5f32, f32::MIN, -0.25, -0.125];
        let mut c = [0.0f64; 4];
        cumsum_strided(&log_f, 1, 0.0, &mut c).unwrap();
        assert_eq!(c[1] - c[0], f64::from(LOG_GATE_FLOOR));
        assert_eq!(c[2] - c[1], -0.25);
        assert_eq!(c[3] - c[2], -0.125);
        let mut s = GateStream::new();
        for &g in &log_f {
            s.push(g).unwrap();
        }
        assert_eq!(s.current(), c[3]);
    }

    #[test]
    fn from_parts_restores_a_stream() {
        let mut s = GateStream::new();
        for g in [-0.5f32, -0.25, -2.0] {
            s.push(g).unwrap();
        }
        s.rebase(-1.0);
        let mut r = GateStream::from_parts(s.origin(), s.current(), s.len()).unwrap();
        assert_eq!(r, s);
        assert_eq!(r.push(-0.125).unwrap(), s.push(-0.125).unwrap());
        for (o, c) in [
            (f64::NAN, 0.0),
            (0.0, f64::NEG_INFINITY),
            (0.0, 1e-9),
            (f64::INFINITY, -1.0),
        ] {
            assert!(GateStream::from_parts(o, c, 3).is_err());
        }
    }
}
