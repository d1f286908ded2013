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

/// Checks that every log gate is finite and `<= 0`.
///
/// Errors: [`Error::BadLogGate`] with the index (into `log_f`) of the first bad value.
pub fn validate_log_gates(log_f: &[f32]) -> Result<()> {
    for (i, &v) in log_f.iter().enumerate() {
        check_gate(i, v)?;
    }
    Ok(())
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
    use super::*;

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
}
