//! The ACP decisions of a kernel call (ACP paper, section 3 and appendix A), which every
//! backend makes with these functions.
//!
//! Per (batch, query head) a threshold `delta = -2U - ln N + ln eps` (nats), with `U` a
//! bound on the logits `|s q_i·k_j|` and `N` the keys a query attends. A weight with decay
//! `D_ij < delta` is below `eps / N`, so the pruned weights of a row sum below `eps`
//! (appendix A, eqs. 4-6). A block of keys is pruned iff its largest decay is below
//! `delta` (strict):
//!
//! - prefill, query block `I` (first row at key position `r`), key block `n`:
//!   `max D = c[r] - c[last key of n]` (`c` is non-increasing), so the pruned blocks of a
//!   row are a prefix `[0, start[I])` ([`crate::boundary::start_blocks`], Algorithm 1);
//! - decode, a block of cache entries `J` (any order) and the step's queries `t`:
//!   `max D = c_t - min_J c_j`, and the block is skipped iff that is below `delta` for
//!   every query ([`decode_block_pruned`]).
//!
//! Nothing here reads tensor memory except [`observed_bound`] ([`prefill_delta`] under
//! [`Acp::ObservedNorms`]), which bounds the logits by the norms of the call's q and k
//! (Cauchy-Schwarz).

use super::types::{Acp, Decisions, HeadStats, PrefillArgs, Storage};
use crate::boundary::{self, BlockGrid};
use crate::error::{Error, Result};
use crate::threshold;

/// Gate entries (tokens x heads) up to which a backend forms or reads its ACP decisions on
/// the calling thread. Once `c` is formed, a head's decisions cost 1-2 ns a token (start
/// blocks, and the GPU's split of `c`), while waking a thread pool costs tens of
/// microseconds. On the H100 host, deciding 16 heads x 1K tokens took 82 us median in
/// parallel and takes 28-47 us serially; the Vulkan prefill's decisions phase there fell
/// from 0.40 to 0.30 ms at 16 x 4K (serial now) and from 1.36 to 0.63 ms at 16 x 16K
/// (parallel, with the faster checks). So up to 16 heads x 4K tokens they run serially.
/// Heads whose threshold comes from observed norms (O(tokens x head_dim) each) are decided
/// in parallel at any size.
pub const SERIAL_DECISIONS: usize = 1 << 16;

/// The ACP threshold of prefill slab `bh = b * heads_q + h` (`None`: dense), whose
/// unpadded keys are `key_start..seq_k` (`N = seq_k - key_start`):
///
/// - [`Acp::Off`] gives `None`;
/// - [`Acp::Threshold`]`(d)` gives `d[bh]` (`batch * heads_q` values, none NaN);
/// - [`Acp::Bound`] gives `threshold(U, N, ln_eps)` with `U = u[h]` (`heads_q` values) or
///   `u[bh]` (`batch * heads_q` values);
/// - [`Acp::ObservedNorms`] gives the same with `U = |scale| max_t ||q_t|| max_j ||k_j||`
///   over the slab's unpadded query rows and keys (f64 norms), valid for this call only;
/// - [`Acp::Decided`] gives the caller's `delta[bh]`.
///
/// Errors: an invalid shape ([`Error::BadShape`]); `bh >= batch * heads_q` or
/// `key_start >= seq_k` ([`Error::BadArgument`]); a threshold or bound slice of the wrong
/// length, or q / k too short for the shape ([`Error::BadLength`]); a NaN threshold, and
/// the errors of [`threshold::threshold`] and [`threshold::bound_from_norms`].
pub fn prefill_delta<T: Storage>(
    args: &PrefillArgs<'_, T>,
    acp: &Acp<'_>,
    scale: f32,
    bh: usize,
    key_start: usize,
) -> Result<Option<f64>> {
    let sh = &args.shape;
    sh.validate()?;
    let slabs = sh.batch * sh.heads_q;
    if bh >= slabs {
        return Err(Error::BadArgument(
            "prefill_delta: slab index >= batch * heads_q",
        ));
    }
    if key_start >= sh.seq_k {
        return Err(Error::BadArgument(
            "prefill_delta: key_start must be < seq_k",
        ));
    }
    let h = bh % sh.heads_q;
    let n_keys = sh.seq_k - key_start;
    match *acp {
        Acp::Off => Ok(None),
        Acp::Decided(dec) => dec.delta.get(bh).copied().ok_or(Error::BadLength {
            what: "Decided delta (batch * heads_q)",
            expected: slabs,
            got: dec.delta.len(),
        }),
        Acp::Threshold(d) => {
            if d.len() != slabs {
                return Err(Error::BadLength {
                    what: "ACP thresholds (batch * heads_q)",
                    expected: slabs,
                    got: d.len(),
                });
            }
            if d[bh].is_nan() {
                return Err(Error::BadArgument("ACP threshold is NaN"));
            }
            Ok(Some(d[bh]))
        }
        Acp::Bound { u, ln_eps } => {
            let uh = if u.len() == sh.heads_q {
                u[h]
            } else if u.len() == slabs {
                u[bh]
            } else {
                return Err(Error::BadLength {
                    what: "ACP bounds (heads_q or batch * heads_q)",
                    expected: sh.heads_q,
                    got: u.len(),
                });
            };
            threshold::threshold(uh, n_keys, ln_eps).map(Some)
        }
        Acp::ObservedNorms { ln_eps } => {
            let u = observed_bound(args, scale, bh, key_start)?;
            threshold::threshold(u, n_keys, ln_eps).map(Some)
        }
    }
}

/// The logit bound [`Acp::ObservedNorms`] gives prefill slab `bh = b * heads_q + h`:
/// `U = |scale| max_t ||q_t|| max_j ||k_j||` (Cauchy-Schwarz, f64 norms) over the slab's
/// query rows at key positions `>= key_start` and its keys `key_start..seq_k` (its kv head
/// for grouped queries). Valid for this call's q and k only.
///
/// Errors: an invalid shape ([`Error::BadShape`]); `bh >= batch * heads_q` or
/// `key_start >= seq_k` ([`Error::BadArgument`]); q or k too short for the shape
/// ([`Error::BadLength`]); those of [`threshold::bound_from_norms`].
pub fn observed_bound<T: Storage>(
    args: &PrefillArgs<'_, T>,
    scale: f32,
    bh: usize,
    key_start: usize,
) -> Result<f64> {
    let sh = &args.shape;
    sh.validate()?;
    if bh >= sh.batch * sh.heads_q {
        return Err(Error::BadArgument(
            "observed_bound: slab index >= batch * heads_q",
        ));
    }
    if key_start >= sh.seq_k {
        return Err(Error::BadArgument(
            "observed_bound: key_start must be < seq_k",
        ));
    }
    let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
    let (qn, kn) = observed_norms(args, b, h, key_start)?;
    threshold::bound_from_norms(qn, kn, f64::from(scale.abs()))
}

/// `(max_t ||q_t||, max_j ||k_j||)` of slab (b, h): query rows at key positions
/// `>= key_start`, keys `key_start..seq_k` (its kv head for grouped queries).
fn observed_norms<T: Storage>(
    args: &PrefillArgs<'_, T>,
    b: usize,
    h: usize,
    key_start: usize,
) -> Result<(f64, f64)> {
    let sh = &args.shape;
    let d = sh.head_dim;
    fn row<'x, T>(x: &'x [T], what: &'static str, at: usize, d: usize) -> Result<&'x [T]> {
        x.get(at..at.saturating_add(d)).ok_or(Error::BadLength {
            what,
            expected: at.saturating_add(d),
            got: x.len(),
        })
    }
    let first_t = key_start.saturating_sub(sh.q_offset());
    let mut qn = 0.0f64;
    for t in first_t..sh.seq_q {
        qn = qn.max(norm(row(args.q, "q", sh.q_at(b, t, h), d)?));
    }
    let hk = h / sh.group();
    let mut kn = 0.0f64;
    for j in key_start..sh.seq_k {
        kn = kn.max(norm(row(args.k, "k", sh.kv_at(b, j, hk), d)?));
    }
    Ok((qn, kn))
}

/// L2 norm in f64.
fn norm<T: Storage>(x: &[T]) -> f64 {
    let sq: f64 = x
        .iter()
        .map(|v| {
            let f = f64::from(v.to_f32());
            f * f
        })
        .sum();
    libm::sqrt(sq)
}

/// Pair and block counts of one slab visited from `starts` ([`boundary::count_pairs`]),
/// with the threshold it was pruned with.
pub fn head_stats(
    grid: &BlockGrid,
    starts: &[u32],
    key_start: usize,
    delta: Option<f64>,
) -> HeadStats {
    let pc = boundary::count_pairs(grid, starts, key_start);
    HeadStats {
        kept_pairs: pc.kept_pairs,
        total_pairs: pc.total_pairs,
        kept_blocks: pc.kept_blocks,
        total_blocks: pc.total_blocks,
        delta,
    }
}

/// The whole decision of prefill slab `bh` from its `c` (`seq_k` values, from 0): its
/// threshold ([`prefill_delta`]), the first visited key block of every query block into
/// `starts` (`grid.q_blocks()` values, [`boundary::start_blocks`]) and its statistics.
/// Under [`Acp::Decided`] the caller's start blocks are the decision: a kernel reads them
/// in place and takes [`head_stats`] of them instead.
///
/// Errors: those of [`prefill_delta`] and [`boundary::start_blocks`].
#[allow(clippy::too_many_arguments)]
pub fn decide_slab<T: Storage>(
    args: &PrefillArgs<'_, T>,
    acp: &Acp<'_>,
    scale: f32,
    grid: &BlockGrid,
    bh: usize,
    key_start: usize,
    c: &[f64],
    starts: &mut [u32],
) -> Result<HeadStats> {
    let delta = prefill_delta(args, acp, scale, bh, key_start)?;
    boundary::start_blocks(grid, c, delta, key_start, starts)?;
    Ok(head_stats(grid, starts, key_start, delta))
}

/// Checks [`Acp::Decided`]'s lengths (`heads` = batch x query heads), that `c` is finite
/// and that every query block starts at or before its diagonal block (what the tile loops
/// of every backend rely on).
pub fn check_decisions(
    dec: &Decisions<'_>,
    grid: &BlockGrid,
    heads: usize,
    seq_k: usize,
) -> Result<()> {
    let nqb = grid.q_blocks();
    for (what, expected, got) in [
        ("Decided c", heads * seq_k, dec.c.len()),
        ("Decided start_blocks", heads * nqb, dec.start_blocks.len()),
        ("Decided delta", heads, dec.delta.len()),
    ] {
        if expected != got {
            return Err(Error::BadLength {
                what,
                expected,
                got,
            });
        }
    }
    // Branch-free (16K values on the dev machine: 3.8 us, against 5.3 us for `any`).
    if !dec.c.iter().fold(true, |ok, x| ok & x.is_finite()) {
        return Err(Error::BadArgument("Decided c must be finite"));
    }
    for st in dec.start_blocks.chunks_exact(nqb.max(1)) {
        if st
            .iter()
            .enumerate()
            .any(|(qb, &s)| s as usize > grid.diag_block(qb))
        {
            return Err(Error::BadArgument(
                "Decided start block after its query block's diagonal",
            ));
        }
    }
    Ok(())
}

/// Checks a decode step's ACP for `heads` query heads: one threshold (none NaN) or one
/// bound per head. [`Acp::ObservedNorms`] (it would read every key) and [`Acp::Decided`]
/// (prefill decisions) are refused ([`Error::BadArgument`]).
pub fn check_decode_acp(acp: &Acp<'_>, heads: usize) -> Result<()> {
    let len = |what, got| {
        if got == heads {
            Ok(())
        } else {
            Err(Error::BadLength {
                what,
                expected: heads,
                got,
            })
        }
    };
    match *acp {
        Acp::Off => Ok(()),
        Acp::Threshold(t) => {
            len("decode ACP thresholds (one per head)", t.len())?;
            if t.iter().any(|x| x.is_nan()) {
                return Err(Error::BadArgument("ACP threshold is NaN"));
            }
            Ok(())
        }
        Acp::Bound { u, .. } => len("decode ACP bounds (one per head)", u.len()),
        Acp::ObservedNorms { .. } => Err(Error::BadArgument(
            "ObservedNorms needs every key: pass Bound or Threshold to decode",
        )),
        Acp::Decided(_) => Err(Error::BadArgument(
            "Decided holds prefill decisions: pass Bound or Threshold to decode",
        )),
    }
}

/// The ACP threshold of decode head `h` over its `n` cache entries (`None`: dense):
/// `t[h]` under [`Acp::Threshold`], `threshold(u[h], n, ln_eps)` under [`Acp::Bound`] when
/// `n > 0`, else `None`.
///
/// Errors: no entry `h` in the thresholds or bounds ([`Error::BadLength`]), and those of
/// [`threshold::threshold`].
pub fn decode_delta(acp: &Acp<'_>, h: usize, n: usize) -> Result<Option<f64>> {
    let at = |x: &[f64], what| {
        x.get(h).copied().ok_or(Error::BadLength {
            what,
            expected: h + 1,
            got: x.len(),
        })
    };
    match *acp {
        Acp::Threshold(t) => at(t, "decode ACP thresholds (one per head)").map(Some),
        Acp::Bound { u, ln_eps } if n > 0 => {
            let uh = at(u, "decode ACP bounds (one per head)")?;
            threshold::threshold(uh, n, ln_eps).map(Some)
        }
        _ => Ok(None),
    }
}

/// The least of `c` (+inf when empty), as `fold(inf, f64::min)` (a NaN never wins either
/// way), in 4 independent lanes that the compiler keeps in vector registers: decode's
/// decisions scan every cached entry of every head each step.
#[inline]
pub fn block_min(c: &[f64]) -> f64 {
    let mut m = [f64::INFINITY; 4];
    let mut chunks = c.chunks_exact(4);
    for x in &mut chunks {
        for i in 0..4 {
            m[i] = if x[i] < m[i] { x[i] } else { m[i] };
        }
    }
    let mut r = f64::min(f64::min(m[0], m[1]), f64::min(m[2], m[3]));
    for &x in chunks.remainder() {
        r = r.min(x);
    }
    r
}

/// Whether decode skips a block of cache entries whose least `c` is `c_min`
/// ([`block_min`]): its largest decay `c_t - c_min` is below `delta` for every query
/// `c_t` of the step.
#[inline]
pub fn decode_block_pruned(q_c: &[f64], c_min: f64, delta: f64) -> bool {
    q_c.iter().all(|&ct| ct - c_min < delta)
}

/// Whether a continuation prefill skips the tile of queries whose first (largest) `c` is
/// `q_c_first` against a tile of keys whose least `c` is `key_c_min` ([`block_min`]): its
/// largest decay `q_c_first - key_c_min` is below `delta`. Every pruned pair then has
/// weight below `eps / N` (appendix A), as in prefill and decode.
#[inline]
pub fn continue_tile_pruned(q_c_first: f64, key_c_min: f64, delta: f64) -> bool {
    q_c_first - key_c_min < delta
}

/// The entries of one decode head that a step attends when every query may attend every
/// entry (no positions): with `delta` (the head's [`decode_delta`]) the entries of the
/// `block_k`-entry blocks of `c` (slot order, as the kernels tile it) that are not
/// [`decode_block_pruned`] for the step's queries `q_c`; all of `c` without. The step's
/// kept pairs are this times the queries.
///
/// Errors: `block_k == 0` ([`Error::BadArgument`]).
pub fn decode_kept_entries(
    c: &[f64],
    q_c: &[f64],
    delta: Option<f64>,
    block_k: usize,
) -> Result<usize> {
    if block_k == 0 {
        return Err(Error::BadArgument(
            "decode_kept_entries: block_k must be > 0",
        ));
    }
    Ok(match delta {
        None => c.len(),
        Some(delta) => c
            .chunks(block_k)
            .filter(|blk| !decode_block_pruned(q_c, block_min(blk), delta))
            .map(<[f64]>::len)
            .sum(),
    })
}

#[cfg(test)]
mod tests {
    //! Each decision against its definition, computed by brute force in f64: `delta =
    //! -2U - ln N + ln eps`, and a block pruned iff the largest `D` over its entries is
    //! below `delta`.
    extern crate std;
    use super::*;
    use crate::gate::cumsum_strided;
    use crate::shape::{AttentionShape, Layout};
    use proptest::prelude::*;
    use std::vec;
    use std::vec::Vec;

    /// `delta` as the paper writes it, with std's `ln`. Tolerance: `threshold` evaluates
    /// the same three f64 terms with libm's `log`; the two logs may differ in the last
    /// place, so a few ulps of the largest term.
    fn formula(u: f64, n: usize, ln_eps: f64) -> f64 {
        -2.0 * u - (n as f64).ln() + ln_eps
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-13 * (1.0 + a.abs().max(b.abs()))
    }

    /// A small call with random data: shape, q, k, left padding of every batch row.
    #[derive(Debug, Clone)]
    struct Call {
        shape: AttentionShape,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        gates: Vec<f32>,
        starts: Vec<usize>,
    }

    impl Call {
        fn args(&self) -> PrefillArgs<'_, f32> {
            PrefillArgs {
                shape: self.shape,
                q: &self.q,
                k: &self.k,
                v: &self.v,
                log_fgate: &self.gates,
                seq_start: Some(&self.starts),
            }
        }

        /// `c` of slab (b, h) from 0.
        fn c(&self, b: usize, h: usize) -> Vec<f64> {
            let sh = &self.shape;
            let mut c = vec![0.0; sh.seq_k];
            cumsum_strided(
                &self.gates[sh.gate_at(b, 0, h)..],
                sh.gate_stride(),
                0.0,
                &mut c,
            )
            .unwrap();
            c
        }
    }

    fn call() -> impl Strategy<Value = Call> {
        (
            1usize..3,
            1usize..3,
            1usize..3,
            1usize..60,
            0usize..60,
            any::<bool>(),
        )
            .prop_flat_map(|(batch, heads_kv, group, seq_k, dq, head_first)| {
                let seq_q = seq_k - dq.min(seq_k - 1);
                let shape = AttentionShape {
                    batch,
                    heads_q: heads_kv * group,
                    heads_kv,
                    seq_q,
                    seq_k,
                    head_dim: 8,
                    layout: if head_first {
                        Layout::HeadFirst
                    } else {
                        Layout::SeqFirst
                    },
                };
                (
                    Just(shape),
                    proptest::collection::vec(-3.0f32..3.0, shape.q_len()),
                    proptest::collection::vec(-3.0f32..3.0, shape.kv_len()),
                    proptest::collection::vec(-2.0f32..0.0, shape.gate_len()),
                    proptest::collection::vec(0usize..seq_k, batch),
                )
            })
            .prop_map(|(shape, q, k, gates, starts)| Call {
                shape,
                v: k.clone(),
                q,
                k,
                gates,
                starts,
            })
    }

    /// Brute-force start blocks: for query block `I`, the first key block `n >= key_start
    /// / block_k` whose largest `D_ij` over every (row i, key j) entry is `>= delta`, at
    /// most the diagonal block.
    fn brute_starts(grid: &BlockGrid, c: &[f64], delta: Option<f64>, ks: usize) -> Vec<u32> {
        let first = ks / grid.block_k;
        (0..grid.q_blocks())
            .map(|qb| {
                let diag = grid.diag_block(qb);
                let rows = grid.q_offset() + qb * grid.block_q
                    ..grid.q_offset() + ((qb + 1) * grid.block_q).min(grid.seq_q);
                let kept = |n: usize| {
                    let keys = n * grid.block_k..((n + 1) * grid.block_k).min(grid.seq_k);
                    let mut max_d = f64::NEG_INFINITY;
                    for i in rows.clone() {
                        for j in keys.clone() {
                            max_d = max_d.max(c[i] - c[j]);
                        }
                    }
                    delta.is_none_or(|d| max_d >= d)
                };
                (first..diag).find(|&n| kept(n)).unwrap_or(diag).max(first) as u32
            })
            .collect()
    }

    /// Brute-force kept and total pairs: query at key position `p` attends `ks..=p`; kept
    /// when the key's block is `>= start` of the query's block.
    fn brute_pairs(grid: &BlockGrid, starts: &[u32], ks: usize) -> (u64, u64) {
        let (mut kept, mut total) = (0, 0);
        for t in 0..grid.seq_q {
            let p = grid.q_offset() + t;
            for j in ks..=p {
                total += 1;
                if j / grid.block_k >= starts[t / grid.block_q] as usize {
                    kept += 1;
                }
            }
        }
        (kept, total)
    }

    proptest! {
        #[test]
        fn prefill_delta_is_the_formula(
            call in call(),
            u in proptest::collection::vec(0.0f64..20.0, 1..9),
            ln_eps in -20.0f64..0.0,
            per_batch in any::<bool>(),
        ) {
            let sh = call.shape;
            let args = call.args();
            let slabs = sh.batch * sh.heads_q;
            let u: Vec<f64> = (0..if per_batch { slabs } else { sh.heads_q })
                .map(|i| u[i % u.len()])
                .collect();
            let deltas: Vec<f64> = (0..slabs).map(|i| -(i as f64) - 0.5).collect();
            let decided: Vec<Option<f64>> = (0..slabs).map(|i| Some(i as f64)).collect();
            let dec = Decisions { c: &[], start_blocks: &[], delta: &decided };
            let scale = 0.35f32;
            for bh in 0..slabs {
                let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
                let ks = call.starts[b];
                let n = sh.seq_k - ks;
                let uh = if per_batch { u[bh] } else { u[h] };
                let bound = Acp::Bound { u: &u, ln_eps };
                let got = prefill_delta(&args, &bound, scale, bh, ks).unwrap().unwrap();
                prop_assert!(close(got, formula(uh, n, ln_eps)), "{got} vs {}", formula(uh, n, ln_eps));
                prop_assert_eq!(prefill_delta(&args, &Acp::Off, scale, bh, ks).unwrap(), None);
                prop_assert_eq!(
                    prefill_delta(&args, &Acp::Threshold(&deltas), scale, bh, ks).unwrap(),
                    Some(deltas[bh])
                );
                prop_assert_eq!(
                    prefill_delta(&args, &Acp::Decided(dec), scale, bh, ks).unwrap(),
                    decided[bh]
                );
                // Observed norms: U = |s| max ||q_t|| max ||k_j|| over unpadded rows and keys.
                let l2 = |x: &[f32]| x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                let d = sh.head_dim;
                let qn = (0..sh.seq_q)
                    .filter(|t| sh.q_offset() + t >= ks)
                    .map(|t| l2(&call.q[sh.q_at(b, t, h)..][..d]))
                    .fold(0.0, f64::max);
                let kn = (ks..sh.seq_k)
                    .map(|j| l2(&call.k[sh.kv_at(b, j, h / sh.group())..][..d]))
                    .fold(0.0, f64::max);
                let u_obs = observed_bound(&args, -scale, bh, ks).unwrap();
                prop_assert!(close(u_obs, f64::from(scale) * qn * kn), "{u_obs}");
                let want = formula(f64::from(scale) * qn * kn, n, ln_eps);
                let got = prefill_delta(&args, &Acp::ObservedNorms { ln_eps }, -scale, bh, ks)
                    .unwrap()
                    .unwrap();
                prop_assert!(close(got, want), "{got} vs {want}");
            }
        }

        #[test]
        fn decide_slab_prunes_a_block_iff_its_max_decay_is_below_delta(
            call in call(),
            u in 0.0f64..4.0,
            ln_eps in -12.0f64..0.0,
            block_q in 1usize..20,
            block_k in 1usize..20,
            dense in any::<bool>(),
        ) {
            let sh = call.shape;
            let args = call.args();
            let grid = BlockGrid::new(block_q, block_k, sh.seq_q, sh.seq_k).unwrap();
            let us = vec![u; sh.heads_q];
            let acp = if dense { Acp::Off } else { Acp::Bound { u: &us, ln_eps } };
            let mut starts = vec![0u32; grid.q_blocks()];
            for bh in 0..sh.batch * sh.heads_q {
                let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
                let ks = call.starts[b];
                let c = call.c(b, h);
                let st = decide_slab(&args, &acp, 1.0, &grid, bh, ks, &c, &mut starts).unwrap();
                let delta = (!dense).then(|| formula(u, sh.seq_k - ks, ln_eps));
                prop_assert_eq!(st.delta.is_some(), delta.is_some());
                if let (Some(a), Some(b)) = (st.delta, delta) {
                    prop_assert!(close(a, b));
                }
                // Compared with the delta the kernel used: the prune rule is strict, so a
                // last-place difference in delta could flip a tie.
                prop_assert_eq!(&starts, &brute_starts(&grid, &c, st.delta, ks));
                let (kept, total) = brute_pairs(&grid, &starts, ks);
                prop_assert_eq!((st.kept_pairs, st.total_pairs), (kept, total));
                prop_assert!(st.kept_pairs <= st.total_pairs);
                if dense {
                    prop_assert_eq!(st.kept_pairs, st.total_pairs);
                }
            }
        }

        #[test]
        fn decode_decisions_are_their_definitions(
            u in proptest::collection::vec(0.0f64..10.0, 1..5),
            ln_eps in -15.0f64..0.0,
            n in 0usize..300,
            q_c in proptest::collection::vec(-5.0f64..0.0, 1..4),
            c in proptest::collection::vec(-30.0f64..0.0, 1..70),
            delta in -30.0f64..0.0,
        ) {
            let bound = Acp::Bound { u: &u, ln_eps };
            check_decode_acp(&bound, u.len()).unwrap();
            for (h, &uh) in u.iter().enumerate() {
                let got = decode_delta(&bound, h, n).unwrap();
                if n == 0 {
                    prop_assert_eq!(got, None);
                } else {
                    prop_assert!(close(got.unwrap(), formula(uh, n, ln_eps)));
                }
                prop_assert_eq!(decode_delta(&Acp::Threshold(&u), h, n).unwrap(), Some(uh));
                prop_assert_eq!(decode_delta(&Acp::Off, h, n).unwrap(), None);
            }
            // A block is skipped iff max over (query t, entry j) of c_t - c_j < delta.
            let c_min = block_min(&c);
            prop_assert_eq!(c_min.to_bits(), c.iter().copied().fold(f64::INFINITY, f64::min).to_bits());
            let max_d = q_c
                .iter()
                .flat_map(|&ct| c.iter().map(move |&cj| ct - cj))
                .fold(f64::NEG_INFINITY, f64::max);
            prop_assert_eq!(decode_block_pruned(&q_c, c_min, delta), max_d < delta);
        }

        /// An entry is kept iff some (query t, entry j) of its block has `c_t - c_j >=
        /// delta`; every entry is kept without a threshold.
        #[test]
        fn decode_kept_entries_are_the_unpruned_blocks(
            c in proptest::collection::vec(-30.0f64..0.0, 0..200),
            q_c in proptest::collection::vec(-5.0f64..0.0, 1..4),
            delta in prop_oneof![1 => Just(None), 4 => (-30.0f64..0.0).prop_map(Some)],
            block_k in 1usize..70,
        ) {
            let want: usize = match delta {
                None => c.len(),
                Some(dl) => (0..c.len())
                    .filter(|&j| {
                        let b0 = j / block_k * block_k;
                        let blk = &c[b0..(b0 + block_k).min(c.len())];
                        q_c.iter().any(|&ct| blk.iter().any(|&cj| ct - cj >= dl))
                    })
                    .count(),
            };
            prop_assert_eq!(decode_kept_entries(&c, &q_c, delta, block_k).unwrap(), want);
        }

        #[test]
        fn continuation_tile_is_pruned_iff_every_pair_decays_below_delta(
            steps in proptest::collection::vec(-3.0f64..0.0, 2..80),
            split in any::<proptest::sample::Index>(),
            tile in any::<proptest::sample::Index>(),
            keys in proptest::collection::vec(any::<proptest::sample::Index>(), 1..20),
            delta in -40.0f64..0.0,
        ) {
            // One head's c along the stream; the cache holds positions before `split`
            // (any subset, any order), the queries are `split..`.
            let mut c = Vec::with_capacity(steps.len());
            let mut acc = 0.0;
            for s in &steps {
                acc += s;
                c.push(acc);
            }
            let split = split.index(c.len() - 1) + 1;
            let q0 = split + tile.index(c.len() - split);
            let rows = &c[q0..];
            let key_c: Vec<f64> = keys.iter().map(|k| c[k.index(q0 + 1)]).collect();
            let max_d = rows
                .iter()
                .flat_map(|&ci| key_c.iter().map(move |&cj| ci - cj))
                .fold(f64::NEG_INFINITY, f64::max);
            prop_assert_eq!(
                continue_tile_pruned(rows[0], block_min(&key_c), delta),
                max_d < delta
            );
        }

        #[test]
        fn block_min_is_the_fold(
            c in proptest::collection::vec(
                prop_oneof![
                    8 => -1e6f64..1e3,
                    1 => Just(f64::NAN),
                    1 => Just(f64::NEG_INFINITY),
                ],
                0..70,
            ),
        ) {
            let want = c.iter().copied().fold(f64::INFINITY, f64::min);
            prop_assert_eq!(block_min(&c).to_bits(), want.to_bits());
        }
    }

    fn shape() -> AttentionShape {
        AttentionShape {
            batch: 2,
            heads_q: 2,
            heads_kv: 1,
            seq_q: 4,
            seq_k: 6,
            head_dim: 8,
            layout: Layout::SeqFirst,
        }
    }

    #[test]
    fn prefill_delta_errors() {
        let sh = shape();
        let z = vec![0.0f32; sh.q_len().max(sh.kv_len())];
        let g = vec![0.0f32; sh.gate_len()];
        let args = PrefillArgs {
            shape: sh,
            q: &z[..sh.q_len()],
            k: &z[..sh.kv_len()],
            v: &z[..sh.kv_len()],
            log_fgate: &g,
            seq_start: None,
        };
        let off = Acp::Off;
        assert!(matches!(
            prefill_delta(&args, &off, 1.0, 4, 0),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            prefill_delta(&args, &off, 1.0, 0, 6),
            Err(Error::BadArgument(_))
        ));
        let bad = PrefillArgs {
            shape: AttentionShape { seq_q: 7, ..sh },
            ..args
        };
        assert!(matches!(
            prefill_delta(&bad, &off, 1.0, 0, 0),
            Err(Error::BadShape(_))
        ));
        let t3 = [0.0; 3];
        assert!(matches!(
            prefill_delta(&args, &Acp::Threshold(&t3), 1.0, 0, 0),
            Err(Error::BadLength {
                expected: 4,
                got: 3,
                ..
            })
        ));
        let tn = [f64::NAN; 4];
        assert!(matches!(
            prefill_delta(&args, &Acp::Threshold(&tn), 1.0, 0, 0),
            Err(Error::BadArgument(_))
        ));
        let u3 = [1.0; 3];
        assert!(matches!(
            prefill_delta(
                &args,
                &Acp::Bound {
                    u: &u3,
                    ln_eps: -1.0
                },
                1.0,
                0,
                0
            ),
            Err(Error::BadLength { .. })
        ));
        let u2 = [1.0; 2];
        assert!(
            prefill_delta(
                &args,
                &Acp::Bound {
                    u: &u2,
                    ln_eps: 1.0
                },
                1.0,
                0,
                0
            )
            .is_err()
        );
        let dec = Decisions {
            c: &[],
            start_blocks: &[],
            delta: &[None],
        };
        assert!(matches!(
            prefill_delta(&args, &Acp::Decided(dec), 1.0, 1, 0),
            Err(Error::BadLength { .. })
        ));
        let short = PrefillArgs { q: &z[..8], ..args };
        assert!(matches!(
            prefill_delta(&short, &Acp::ObservedNorms { ln_eps: -1.0 }, 1.0, 3, 0),
            Err(Error::BadLength { what: "q", .. })
        ));
        assert!(matches!(
            observed_bound(&args, 1.0, 4, 0),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            observed_bound(&args, 1.0, 0, 6),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            observed_bound(&short, 1.0, 3, 0),
            Err(Error::BadLength { what: "q", .. })
        ));
        // All-zero q and k: U = 0, delta = -ln N + ln eps.
        let d = prefill_delta(&args, &Acp::ObservedNorms { ln_eps: -1.0 }, 1.0, 3, 2).unwrap();
        assert!(close(d.unwrap(), formula(0.0, 4, -1.0)));
    }

    #[test]
    fn check_decisions_errors() {
        let grid = BlockGrid::new(2, 2, 4, 4).unwrap();
        let c = [0.0, -1.0, -2.0, -3.0];
        let ok = Decisions {
            c: &c,
            start_blocks: &[0, 1],
            delta: &[Some(-1.0)],
        };
        check_decisions(&ok, &grid, 1, 4).unwrap();
        let late = Decisions {
            start_blocks: &[1, 1],
            ..ok
        };
        assert!(matches!(
            check_decisions(&late, &grid, 1, 4),
            Err(Error::BadArgument(_))
        ));
        let short = Decisions {
            start_blocks: &[0],
            ..ok
        };
        assert!(matches!(
            check_decisions(&short, &grid, 1, 4),
            Err(Error::BadLength { .. })
        ));
        let nan = [0.0, f64::NAN, -2.0, -3.0];
        let bad_c = Decisions { c: &nan, ..ok };
        assert!(matches!(
            check_decisions(&bad_c, &grid, 1, 4),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            check_decisions(&ok, &grid, 2, 4),
            Err(Error::BadLength { .. })
        ));
    }

    #[test]
    fn check_decode_acp_errors() {
        let t = [-1.0, f64::NAN];
        check_decode_acp(&Acp::Off, 2).unwrap();
        assert!(matches!(
            check_decode_acp(&Acp::Threshold(&t), 2),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            check_decode_acp(&Acp::Threshold(&t), 3),
            Err(Error::BadLength { .. })
        ));
        let u = [1.0];
        assert!(matches!(
            check_decode_acp(
                &Acp::Bound {
                    u: &u,
                    ln_eps: -1.0
                },
                2
            ),
            Err(Error::BadLength { .. })
        ));
        assert!(check_decode_acp(&Acp::ObservedNorms { ln_eps: -1.0 }, 1).is_err());
        let dec = Decisions {
            c: &[],
            start_blocks: &[],
            delta: &[],
        };
        assert!(check_decode_acp(&Acp::Decided(dec), 1).is_err());
        assert!(matches!(
            decode_delta(&Acp::Threshold(&u), 1, 4),
            Err(Error::BadLength { .. })
        ));
        assert!(
            decode_delta(
                &Acp::Bound {
                    u: &u,
                    ln_eps: -1.0
                },
                1,
                0
            )
            .unwrap()
            .is_none()
        );
        assert!(decode_delta(&Acp::Bound { u: &u, ln_eps: 1.0 }, 0, 4).is_err());
        assert!(matches!(
            decode_kept_entries(&[0.0], &[0.0], None, 0),
            Err(Error::BadArgument(_))
        ));
    }
}
