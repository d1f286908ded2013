//! The ACP pruning boundary over a FlashAttention block grid (ACP paper, section 3,
//! Algorithm 1), its token-level counterpart, and FLOP accounting.
//!
//! Coordinates: keys are positions `0..seq_k`; the `seq_q` queries are the last `seq_q`
//! positions (chunked prefill and decoding), so query `t` sits at key position
//! `q_offset + t` with `q_offset = seq_k - seq_q`. `c[j]` is the cumulative log gate at key
//! position `j` (non-increasing), and `D_ij = c[i] - c[j]` for a query at position `i`.
//!
//! Because `c` is non-increasing, the largest `D` inside a block is its top-right entry:
//! `c[r] - c[last key of the block]`, `r` the block's first query position. A block is
//! skipped iff that maximum is `< delta` (strict), and the skipped blocks of each query-block
//! row are a prefix `[0, start)` whose end never decreases down the rows: a two-pointer walk
//! finds all starts in `O(q_blocks + k_blocks)`.

use crate::error::{Error, Result};

/// Block sizes (tokens) and sequence lengths (tokens) of one attention call.
///
/// Invariants (checked by [`BlockGrid::new`]): every field `> 0`, `seq_q <= seq_k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    /// Query rows per block.
    pub block_q: usize,
    /// Keys per block.
    pub block_k: usize,
    /// Number of queries (the last `seq_q` positions).
    pub seq_q: usize,
    /// Number of keys.
    pub seq_k: usize,
}

impl BlockGrid {
    /// Checks the invariants. Errors: [`Error::BadShape`].
    pub fn new(block_q: usize, block_k: usize, seq_q: usize, seq_k: usize) -> Result<Self> {
        let g = Self {
            block_q,
            block_k,
            seq_q,
            seq_k,
        };
        g.validate()?;
        Ok(g)
    }

    /// Checks the invariants of a grid built field by field (what [`BlockGrid::new`] checks).
    /// Errors: [`Error::BadShape`].
    pub fn validate(&self) -> Result<()> {
        if self.block_q == 0 || self.block_k == 0 || self.seq_q == 0 || self.seq_k == 0 {
            return Err(Error::BadShape("block grid: every size must be > 0"));
        }
        if self.seq_q > self.seq_k {
            return Err(Error::BadShape("block grid: seq_q must be <= seq_k"));
        }
        Ok(())
    }

    // The accessors below never panic; on a grid that fails `validate` their values are
    // meaningless (0 where a size is 0).

    /// Key position of query 0: `seq_k - seq_q`.
    #[inline]
    pub fn q_offset(&self) -> usize {
        self.seq_k.saturating_sub(self.seq_q)
    }

    /// Number of query blocks, `ceil(seq_q / block_q)` (the last may be partial).
    #[inline]
    pub fn q_blocks(&self) -> usize {
        if self.block_q == 0 {
            0
        } else {
            self.seq_q.div_ceil(self.block_q)
        }
    }

    /// Number of key blocks, `ceil(seq_k / block_k)`.
    #[inline]
    pub fn k_blocks(&self) -> usize {
        if self.block_k == 0 {
            0
        } else {
            self.seq_k.div_ceil(self.block_k)
        }
    }

    /// Last key block that query block `qb` touches under the causal mask: the block of
    /// key position `q_offset + min((qb + 1) * block_q, seq_q) - 1`. For `qb >= q_blocks`
    /// this is the last key block.
    #[inline]
    pub fn diag_block(&self, qb: usize) -> usize {
        let last_row = qb
            .saturating_add(1)
            .saturating_mul(self.block_q)
            .min(self.seq_q);
        (self.q_offset() + last_row)
            .saturating_sub(1)
            .checked_div(self.block_k)
            .unwrap_or(0)
    }

    /// Key position of the first query row of block `qb` (`qb < q_blocks`).
    #[inline]
    fn first_row(&self, qb: usize) -> usize {
        self.q_offset() + qb * self.block_q
    }
}

/// Checks that `c` is finite and non-increasing (what validated log gates produce): a
/// branch-free pass first (it vectorizes); only a `c` that fails it is walked again for the
/// first fault's message.
fn check_c(c: &[f64]) -> Result<()> {
    let finite = c.iter().fold(true, |ok, x| ok & x.is_finite());
    let falling = c
        .iter()
        .zip(c.iter().skip(1))
        .fold(true, |ok, (a, b)| ok & (b <= a));
    if finite & falling {
        return Ok(());
    }
    let mut prev = f64::INFINITY;
    for &x in c {
        if !x.is_finite() {
            return Err(Error::BadArgument("cumulative log gate c must be finite"));
        }
        if x > prev {
            return Err(Error::BadArgument(
                "cumulative log gate c must be non-increasing",
            ));
        }
        prev = x;
    }
    Ok(())
}

fn check_delta(delta: Option<f64>) -> Result<()> {
    if matches!(delta, Some(d) if d.is_nan()) {
        return Err(Error::BadArgument("ACP threshold delta is NaN"));
    }
    Ok(())
}

fn to_u32(x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::BadArgument("index does not fit in u32"))
}

/// Paper Algorithm 1 with the reference kernel's semantics: for query block `I` (first row
/// at key position `r = q_offset + I * block_q`), `out[I]` is the smallest key block `n`
/// with `c[r] - c[min((n + 1) * block_k, seq_k) - 1] >= delta`, i.e. the first block whose
/// maximum `D` is not below `delta`; blocks `< out[I]` are skipped for the whole row.
/// `out[I]` never passes [`BlockGrid::diag_block`]`(I)` (blocks on the diagonal are never
/// pruned) and is at least `key_start / block_k` (left padding: keys before `key_start`
/// are masked, the reference's `seq_start`). Visit blocks `out[I]..=diag_block(I)`; that
/// range is empty only when every row of block `I` lies before `key_start`.
///
/// `delta = None` turns ACP off: `out[I] = key_start / block_k`.
///
/// Cost: `O(seq_k)` to validate `c`, then `O(q_blocks + k_blocks)`.
///
/// Errors: an invalid grid ([`Error::BadShape`], see [`BlockGrid::validate`]);
/// `c.len() != seq_k` or `out.len() != q_blocks` ([`Error::BadLength`]); `c` not
/// finite and non-increasing, `delta` NaN, `key_start >= seq_k`, or a block index that does
/// not fit in u32 ([`Error::BadArgument`]).
pub fn start_blocks(
    grid: &BlockGrid,
    c: &[f64],
    delta: Option<f64>,
    key_start: usize,
    out: &mut [u32],
) -> Result<()> {
    grid.validate()?;
    if c.len() != grid.seq_k {
        return Err(Error::BadLength {
            what: "start_blocks c",
            expected: grid.seq_k,
            got: c.len(),
        });
    }
    if out.len() != grid.q_blocks() {
        return Err(Error::BadLength {
            what: "start_blocks out",
            expected: grid.q_blocks(),
            got: out.len(),
        });
    }
    if key_start >= grid.seq_k {
        return Err(Error::BadArgument(
            "start_blocks: key_start must be < seq_k",
        ));
    }
    check_delta(delta)?;
    check_c(c)?;
    to_u32(grid.k_blocks())?;

    let first = key_start / grid.block_k;
    // Two pointers: `n` only moves right, because `c[r]` only falls as `I` grows.
    let mut n = first;
    for (qb, o) in out.iter_mut().enumerate() {
        let diag = grid.diag_block(qb);
        if let Some(delta) = delta {
            let cr = c[grid.first_row(qb)];
            while n < diag {
                let last_key = ((n + 1) * grid.block_k).min(grid.seq_k) - 1;
                if cr - c[last_key] >= delta {
                    break;
                }
                n += 1;
            }
        }
        *o = to_u32(n.min(diag).max(first))?;
    }
    Ok(())
}

/// Token-level boundary: for each query `t < out.len()` (key position `i = q_offset + t`),
/// `out[t]` is the first key `j >= key_start` with `c[i] - c[j] >= delta`, capped at `i`
/// (a query always keeps itself). Keys `j < out[t]` have `D_ij < delta`; with `delta`
/// from [`crate::threshold::threshold`] each of them has weight `< eps / L`. When
/// `i < key_start` (a padded query) `out[t] = key_start > i`: nothing to visit.
/// `delta = None`: `out[t] = key_start`. Cost `O(c.len())`.
///
/// Errors: `c.len() != q_offset + out.len()` ([`Error::BadLength`]); `c` not finite and
/// non-increasing, `delta` NaN, `key_start >= c.len()`, or a position that does not fit
/// in u32 ([`Error::BadArgument`]).
pub fn first_kept_keys(
    c: &[f64],
    delta: Option<f64>,
    q_offset: usize,
    key_start: usize,
    out: &mut [u32],
) -> Result<()> {
    let expected = q_offset.checked_add(out.len()).ok_or(Error::BadArgument(
        "first_kept_keys: q_offset + seq_q overflows",
    ))?;
    if c.len() != expected {
        return Err(Error::BadLength {
            what: "first_kept_keys c (q_offset + out.len())",
            expected,
            got: c.len(),
        });
    }
    if key_start >= c.len() {
        return Err(Error::BadArgument(
            "first_kept_keys: key_start must be < number of keys",
        ));
    }
    check_delta(delta)?;
    check_c(c)?;
    to_u32(c.len())?;

    let mut j = key_start;
    for (t, o) in out.iter_mut().enumerate() {
        let i = q_offset + t;
        if let Some(delta) = delta {
            while j < i && c[i] - c[j] < delta {
                j += 1;
            }
        }
        *o = to_u32(j.min(i).max(key_start))?;
    }
    Ok(())
}

/// Query-key pairs and blocks for one (batch, head), kept by ACP vs total under the causal
/// mask. Kept FLOPs of attention are `4 * head_dim * kept_pairs` (QK^T and PV, multiply-add
/// = 2 FLOPs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairCounts {
    /// Causal, unmasked (query, key) pairs inside visited blocks.
    pub kept_pairs: u64,
    /// Causal, unmasked (query, key) pairs.
    pub total_pairs: u64,
    /// Visited blocks (those that hold at least one causal unmasked pair).
    pub kept_blocks: u64,
    /// Blocks that hold at least one causal unmasked pair.
    pub total_blocks: u64,
}

impl PairCounts {
    /// Field-wise sum (saturating), to aggregate heads and batches.
    pub fn add(&mut self, other: &PairCounts) {
        self.kept_pairs = self.kept_pairs.saturating_add(other.kept_pairs);
        self.total_pairs = self.total_pairs.saturating_add(other.total_pairs);
        self.kept_blocks = self.kept_blocks.saturating_add(other.kept_blocks);
        self.total_blocks = self.total_blocks.saturating_add(other.total_blocks);
    }

    /// `kept_pairs / total_pairs`; 1.0 when there are no pairs (nothing was pruned).
    pub fn kept_fraction(&self) -> f64 {
        if self.total_pairs == 0 {
            1.0
        } else {
            self.kept_pairs as f64 / self.total_pairs as f64
        }
    }
}

/// `sum_{p = p0..=p1} max(0, p - lo + 1)` in u64: pairs of rows `p0..=p1` with keys
/// `lo..=p`.
fn pairs_from(p0: usize, p1: usize, lo: usize) -> u64 {
    let a = p0.max(lo);
    if a > p1 {
        return 0;
    }
    let first = (a - lo + 1) as u64;
    let last = (p1 - lo + 1) as u64;
    let n = (p1 - a + 1) as u64;
    // (first + last) * n is even because last - first = n - 1.
    ((first + last) as u128 * n as u128 / 2).min(u64::MAX as u128) as u64
}

/// Counts pairs and blocks for query blocks visited from `start_blocks[I]` to
/// [`BlockGrid::diag_block`]`(I)`. A query at key position `p` attends to keys
/// `key_start..=p` (total) and to those of them in visited blocks (kept). Query blocks with
/// no entry in `start_blocks` (`I >= start_blocks.len()`) count as fully visited; entries
/// past `q_blocks` are ignored. A grid that fails [`BlockGrid::validate`] counts nothing.
/// Cost `O(q_blocks)`.
pub fn count_pairs(grid: &BlockGrid, start_blocks: &[u32], key_start: usize) -> PairCounts {
    let mut pc = PairCounts::default();
    if grid.validate().is_err() {
        return pc;
    }
    let ks_block = key_start / grid.block_k;
    for qb in 0..grid.q_blocks() {
        let p0 = grid.first_row(qb);
        let p1 = grid.q_offset() + ((qb + 1) * grid.block_q).min(grid.seq_q) - 1;
        if p1 < key_start {
            continue; // every row is padding: no pairs, no blocks
        }
        let diag = grid.diag_block(qb);
        let start = start_blocks
            .get(qb)
            .map_or(ks_block, |&s| (s as usize).max(ks_block));
        pc.total_pairs += pairs_from(p0, p1, key_start);
        pc.total_blocks += (diag - ks_block + 1) as u64;
        if start <= diag {
            let lo = (start * grid.block_k).max(key_start);
            pc.kept_pairs += pairs_from(p0, p1, lo);
            pc.kept_blocks += (diag - start + 1) as u64;
        }
    }
    pc
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::gate::cumsum_strided;
    use crate::threshold::threshold;
    use proptest::prelude::*;
    use std::vec;
    use std::vec::Vec;

    fn brute_start_blocks(grid: &BlockGrid, c: &[f64], delta: Option<f64>, ks: usize) -> Vec<u32> {
        let first = ks / grid.block_k;
        (0..grid.q_blocks())
            .map(|qb| {
                let diag = grid.diag_block(qb);
                let rows =
                    grid.first_row(qb)..grid.q_offset() + ((qb + 1) * grid.block_q).min(grid.seq_q);
                let mut s = diag;
                if let Some(delta) = delta {
                    for n in first..=diag {
                        let keys = n * grid.block_k..((n + 1) * grid.block_k).min(grid.seq_k);
                        // max D over every entry of the block (causal or not: non-causal
                        // entries have D >= 0 and only exist in diagonal blocks)
                        let mut m = f64::NEG_INFINITY;
                        for i in rows.clone() {
                            for j in keys.clone() {
                                m = m.max(c[i] - c[j]);
                            }
                        }
                        if m >= delta {
                            s = n;
                            break;
                        }
                    }
                } else {
                    s = first;
                }
                s.min(diag).max(first) as u32
            })
            .collect()
    }

    fn brute_first_kept(c: &[f64], delta: Option<f64>, q_offset: usize, ks: usize) -> Vec<u32> {
        (q_offset..c.len())
            .map(|i| {
                let j = match delta {
                    None => ks,
                    Some(d) => (ks..=i).find(|&j| c[i] - c[j] >= d).unwrap_or(i),
                };
                j.min(i).max(ks) as u32
            })
            .collect()
    }

    fn brute_counts(grid: &BlockGrid, starts: &[u32], ks: usize) -> PairCounts {
        let mut pc = PairCounts::default();
        for (qb, &start) in starts.iter().enumerate().take(grid.q_blocks()) {
            let rows =
                grid.first_row(qb)..grid.q_offset() + ((qb + 1) * grid.block_q).min(grid.seq_q);
            let start = start as usize;
            for n in 0..grid.k_blocks() {
                let keys = n * grid.block_k..((n + 1) * grid.block_k).min(grid.seq_k);
                let mut any = false;
                for i in rows.clone() {
                    for j in keys.clone() {
                        if j <= i && j >= ks {
                            any = true;
                            pc.total_pairs += 1;
                            if n >= start {
                                pc.kept_pairs += 1;
                            }
                        }
                    }
                }
                if any {
                    pc.total_blocks += 1;
                    if n >= start {
                        pc.kept_blocks += 1;
                    }
                }
            }
        }
        pc
    }

    /// Log gates: a mix of exact zeros (global heads), tiny, moderate and extreme (-80)
    /// values (local heads).
    fn gate() -> impl Strategy<Value = f32> {
        prop_oneof![
            Just(0.0f32),
            -1e-3f32..=0.0,
            -3.0f32..=0.0,
            -80.0f32..=-10.0,
            Just(-80.0f32),
        ]
    }

    fn head_gates(n: usize) -> impl Strategy<Value = Vec<f32>> {
        prop_oneof![
            proptest::collection::vec(gate(), n),
            proptest::collection::vec(-1e-4f32..=0.0, n), // all-global
            proptest::collection::vec(-80.0f32..=-5.0, n), // all-local
        ]
    }

    fn case() -> impl Strategy<Value = (BlockGrid, Vec<f32>, Option<f64>, usize)> {
        (1usize..=200, 1usize..=40, 1usize..=40)
            .prop_flat_map(|(seq_k, bq, bk)| {
                (
                    Just(seq_k),
                    Just(bq),
                    Just(bk),
                    1usize..=seq_k,
                    head_gates(seq_k),
                    prop_oneof![
                        Just(None),
                        (-300.0f64..=0.0).prop_map(Some),
                        (-5.0f64..=0.0).prop_map(Some),
                        (0.0f64..=3.0).prop_map(Some),
                    ],
                    prop_oneof![Just(0usize), 0usize..seq_k],
                )
            })
            .prop_map(|(seq_k, bq, bk, seq_q, g, delta, ks)| {
                (BlockGrid::new(bq, bk, seq_q, seq_k).unwrap(), g, delta, ks)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(600))]

        #[test]
        fn start_blocks_equal_brute_force((grid, g, delta, ks) in case(), origin in -1e6f64..=0.0) {
            let mut c = vec![0.0; grid.seq_k];
            cumsum_strided(&g, 1, origin, &mut c).unwrap();
            let mut out = vec![0u32; grid.q_blocks()];
            start_blocks(&grid, &c, delta, ks, &mut out).unwrap();
            prop_assert_eq!(&out, &brute_start_blocks(&grid, &c, delta, ks));
            let pc = count_pairs(&grid, &out, ks);
            prop_assert_eq!(pc, brute_counts(&grid, &out, ks));
            prop_assert!(pc.kept_pairs <= pc.total_pairs && pc.kept_blocks <= pc.total_blocks);

            let mut tok = vec![0u32; grid.seq_q];
            first_kept_keys(&c, delta, grid.q_offset(), ks, &mut tok).unwrap();
            prop_assert_eq!(&tok, &brute_first_kept(&c, delta, grid.q_offset(), ks));
            // the block boundary never skips a key that the token boundary keeps (delta <= 0;
            // a positive delta is clamped at the diagonal differently per level)
            for (t, &j) in tok.iter().enumerate().filter(|_| delta.is_none_or(|d| d <= 0.0)) {
                let qb = t / grid.block_q;
                prop_assert!(out[qb] as usize * grid.block_k <= (j as usize).max(ks));
            }
        }

        /// Appendix A: with delta = -2U - ln L + ln eps, every pruned weight is < eps/L and a
        /// row's pruned weights sum to < eps, for random q, k whose logits respect U.
        #[test]
        fn pruned_weight_is_bounded(
            l in 1usize..=64,
            d in 1usize..=8,
            u in 0.0f64..=4.0,
            ln_eps in -12.0f64..=-0.5,
            g in proptest::collection::vec(prop_oneof![-4.0f32..=0.0, -0.05f32..=0.0, -30.0f32..=0.0], 64),
            qk in proptest::collection::vec(-1.0f64..=1.0, 2 * 64 * 8),
            bq in 1usize..=16,
            bk in 1usize..=16,
        ) {
            let mut c = vec![0.0; l];
            cumsum_strided(&g[..l], 1, 0.0, &mut c).unwrap();
            let scale = 1.0 / libm::sqrt(d as f64);
            // scale q and k to norm <= sqrt(U / scale) so |s q.k| <= U
            let r = libm::sqrt(u / scale);
            let vecs: Vec<Vec<f64>> = (0..2 * l).map(|i| {
                let v = &qk[i * d..(i + 1) * d];
                let n = libm::sqrt(v.iter().map(|x| x * x).sum::<f64>()).max(1e-12);
                let shrink = ((i % 3) as f64 + 1.0) / 3.0; // some vectors shorter than the max
                v.iter().map(|x| x / n * r * shrink).collect()
            }).collect();
            let (q, k) = vecs.split_at(l);
            let delta = threshold(u, l, ln_eps).unwrap();
            let eps = libm::exp(ln_eps);
            let grid = BlockGrid::new(bq, bk, l, l).unwrap();
            let mut sb = vec![0u32; grid.q_blocks()];
            start_blocks(&grid, &c, Some(delta), 0, &mut sb).unwrap();
            let mut tok = vec![0u32; l];
            first_kept_keys(&c, Some(delta), 0, 0, &mut tok).unwrap();
            for i in 0..l {
                let logits: Vec<f64> = (0..=i).map(|j| {
                    let s = scale * q[i].iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f64>();
                    assert!(s.abs() <= u * (1.0 + 1e-12) + 1e-15);
                    s + c[i] - c[j]
                }).collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logits.iter().map(|x| libm::exp(x - m)).sum();
                let w: Vec<f64> = logits.iter().map(|x| libm::exp(x - m) / z).collect();
                let block_cut = sb[i / bq] as usize * bk;
                let mut row_block = 0.0;
                let mut row_tok = 0.0;
                for (j, &wj) in w.iter().enumerate() {
                    // rounding of the f64 softmax is ~1e-15 relative
                    if j < block_cut {
                        prop_assert!(wj <= eps / l as f64 * (1.0 + 1e-9));
                        row_block += wj;
                    }
                    if j < tok[i] as usize {
                        prop_assert!(wj <= eps / l as f64 * (1.0 + 1e-9));
                        row_tok += wj;
                    }
                }
                prop_assert!(row_block <= eps * (1.0 + 1e-9));
                prop_assert!(row_tok <= eps * (1.0 + 1e-9));
            }
        }
    }

    #[test]
    fn grid_geometry() {
        let g = BlockGrid::new(128, 64, 1000, 1030).unwrap();
        assert_eq!((g.q_offset(), g.q_blocks(), g.k_blocks()), (30, 8, 17));
        assert_eq!(g.diag_block(0), (30 + 127) / 64);
        assert_eq!(g.diag_block(7), 1029 / 64);
        assert_eq!(g.diag_block(100), 1029 / 64);
        // decoding: one query over 300 keys
        let d = BlockGrid::new(1, 128, 1, 300).unwrap();
        assert_eq!((d.q_blocks(), d.diag_block(0)), (1, 2));
    }

    #[test]
    fn error_paths() {
        assert!(BlockGrid::new(0, 1, 1, 1).is_err());
        assert!(BlockGrid::new(1, 0, 1, 1).is_err());
        assert!(BlockGrid::new(1, 1, 0, 1).is_err());
        assert!(BlockGrid::new(1, 1, 1, 0).is_err());
        assert!(BlockGrid::new(1, 1, 2, 1).is_err());
        let g = BlockGrid::new(2, 2, 4, 4).unwrap();
        let c = [0.0, -1.0, -2.0, -3.0];
        let mut out = [0u32; 2];
        // grids built field by field: errors or zero counts, never a panic
        for bad in [
            BlockGrid { block_q: 0, ..g },
            BlockGrid { block_k: 0, ..g },
            BlockGrid { seq_q: 0, ..g },
            BlockGrid { seq_q: 5, ..g },
        ] {
            assert!(bad.validate().is_err());
            assert!(matches!(
                start_blocks(&bad, &c, None, 0, &mut out),
                Err(Error::BadShape(_))
            ));
            assert_eq!(count_pairs(&bad, &out, 0), PairCounts::default());
            let _ = (
                bad.q_offset(),
                bad.q_blocks(),
                bad.k_blocks(),
                bad.diag_block(3),
            );
        }
        assert!(matches!(
            start_blocks(&g, &c[..3], None, 0, &mut out),
            Err(Error::BadLength { .. })
        ));
        assert!(matches!(
            start_blocks(&g, &c, None, 0, &mut out[..1]),
            Err(Error::BadLength { .. })
        ));
        assert!(start_blocks(&g, &c, None, 4, &mut out).is_err());
        assert!(start_blocks(&g, &c, Some(f64::NAN), 0, &mut out).is_err());
        assert!(start_blocks(&g, &[0.0, -1.0, 0.5, -3.0], Some(-1.0), 0, &mut out).is_err());
        assert!(start_blocks(&g, &[0.0, -1.0, f64::NAN, -3.0], Some(-1.0), 0, &mut out).is_err());
        assert!(
            start_blocks(&g, &[0.0, -1.0, f64::NEG_INFINITY, -3.0], None, 0, &mut out).is_err()
        );
        let mut tok = [0u32; 2];
        assert!(matches!(
            first_kept_keys(&c, None, 1, 0, &mut tok),
            Err(Error::BadLength { .. })
        ));
        assert!(first_kept_keys(&c, None, usize::MAX, 0, &mut tok).is_err());
        assert!(first_kept_keys(&c, None, 2, 4, &mut tok).is_err());
        assert!(first_kept_keys(&c, Some(f64::NAN), 2, 0, &mut tok).is_err());
        assert!(first_kept_keys(&[0.0, 1.0, 0.0, 0.0], None, 2, 0, &mut tok).is_err());
        first_kept_keys(&c, Some(-1.5), 2, 0, &mut tok).unwrap();
        assert_eq!(tok, [1, 2]);
    }

    #[test]
    fn pair_counts_helpers() {
        let mut a = PairCounts {
            kept_pairs: 1,
            total_pairs: 4,
            kept_blocks: 1,
            total_blocks: 2,
        };
        a.add(&PairCounts {
            kept_pairs: 1,
            total_pairs: 4,
            kept_blocks: 0,
            total_blocks: 1,
        });
        assert_eq!(
            a,
            PairCounts {
                kept_pairs: 2,
                total_pairs: 8,
                kept_blocks: 1,
                total_blocks: 3
            }
        );
        assert_eq!(a.kept_fraction(), 0.25);
        assert_eq!(PairCounts::default().kept_fraction(), 1.0);
        // dense causal 4x4 with 2x2 blocks: 10 pairs, 3 blocks; missing starts count as dense
        let g = BlockGrid::new(2, 2, 4, 4).unwrap();
        let pc = count_pairs(&g, &[], 0);
        assert_eq!(
            pc,
            PairCounts {
                kept_pairs: 10,
                total_pairs: 10,
                kept_blocks: 3,
                total_blocks: 3
            }
        );
        let pc = count_pairs(&g, &[0, 1], 0);
        assert_eq!(
            pc,
            PairCounts {
                kept_pairs: 3 + 3,
                total_pairs: 10,
                kept_blocks: 2,
                total_blocks: 3
            }
        );
    }

    /// Tiny reader for the fixtures' little-endian `.npy` files (version 1.0/2.0, C order).
    fn read_npy(name: &str, descr: &str) -> (Vec<usize>, Vec<u8>) {
        let path = std::format!(
            "{}/../tests/fixtures/fox-tiny-pro/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        let (hlen, hstart) = if bytes[6] == 1 {
            (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
        } else {
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        };
        let header = std::str::from_utf8(&bytes[hstart..hstart + hlen]).unwrap();
        assert!(
            header.contains(&std::format!("'descr': '{descr}'")),
            "{header}"
        );
        let fortran = header.contains("'fortran_order': True");
        let sh = header
            .split("'shape': (")
            .nth(1)
            .unwrap()
            .split(')')
            .next()
            .unwrap();
        let shape: Vec<usize> = sh
            .split(',')
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        let raw = &bytes[hstart + hlen..];
        assert_eq!(raw.len(), shape.iter().product::<usize>() * 4);
        if !fortran || shape.len() < 2 {
            return (shape, raw.to_vec());
        }
        // Fortran order: the first index varies fastest; rewrite in C order.
        let n = raw.len() / 4;
        let mut data = vec![0u8; raw.len()];
        for (ci, dst) in data.chunks_exact_mut(4).enumerate() {
            let (mut rem, mut fi, mut stride) = (ci, 0, 1);
            let mut idx = vec![0usize; shape.len()];
            for (k, &dim) in shape.iter().enumerate().rev() {
                idx[k] = rem % dim;
                rem /= dim;
            }
            for (k, &dim) in shape.iter().enumerate() {
                fi += idx[k] * stride;
                stride *= dim;
            }
            assert!(fi < n);
            dst.copy_from_slice(&raw[fi * 4..fi * 4 + 4]);
        }
        (shape, data)
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect()
    }

    fn i32s(b: &[u8]) -> Vec<i32> {
        b.chunks_exact(4)
            .map(|x| i32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect()
    }

    /// The reference kernel's tile starts on the layer-1 fixture (H100 tiles 128 x 64).
    #[test]
    fn reproduces_reference_start_index() {
        let (gs, g) = read_npy("kernel_l1_log_fgate.npy", "<f4");
        let (ts, th) = read_npy("kernel_l1_threshold.npy", "<f4");
        let (ss, st) = read_npy("kernel_l1_start_index.npy", "<i4");
        assert_eq!(
            (gs.as_slice(), ts.as_slice(), ss.as_slice()),
            (&[4, 1024][..], &[4][..], &[4, 8][..])
        );
        let (g, th, st) = (f32s(&g), f32s(&th), i32s(&st));
        let grid = BlockGrid::new(128, 64, 1024, 1024).unwrap();
        let mut pruned_any = false;
        for h in 0..4 {
            let gates = &g[h * 1024..(h + 1) * 1024];
            let mut c = vec![0.0; 1024];
            cumsum_strided(gates, 1, 0.0, &mut c).unwrap();
            let mut out = vec![0u32; 8];
            start_blocks(&grid, &c, Some(f64::from(th[h])), 0, &mut out).unwrap();
            let keys: Vec<i32> = out.iter().map(|&b| b as i32 * 64).collect();
            assert_eq!(&keys[..], &st[h * 8..(h + 1) * 8], "head {h}");
            pruned_any |= keys.iter().any(|&k| k > 0);
            // a sequential fp32 cumsum (the reference kernel sums in fp32)
            let mut acc = 0.0f32;
            let c32: Vec<f64> = gates
                .iter()
                .map(|&x| {
                    acc += x;
                    f64::from(acc)
                })
                .collect();
            let fp32_err = c
                .iter()
                .zip(&c32)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            // no decision is near a tie: a D (difference of two c) that is further from
            // delta than twice the fp32 sum error cannot flip between fp32 and f64
            let mut margin = f64::INFINITY;
            for (qb, &s) in out.iter().enumerate() {
                let cr = c[qb * 128];
                for n in 0..=(s as usize).min(grid.diag_block(qb)) {
                    let dmax = cr - c[((n + 1) * 64).min(1024) - 1];
                    margin = margin.min((dmax - f64::from(th[h])).abs());
                }
            }
            std::eprintln!(
                "head {h}: starts {keys:?}, closest block decision {margin:.4} nats from \
                 delta, max |c_f32 - c_f64| = {fp32_err:.2e} (|c| <= {:.0})",
                -c[1023]
            );
            assert!(margin > 10.0 * 2.0 * fp32_err, "head {h}: margin {margin}");
            start_blocks(&grid, &c32, Some(f64::from(th[h])), 0, &mut out).unwrap();
            let keys32: Vec<i32> = out.iter().map(|&b| b as i32 * 64).collect();
            assert_eq!(keys32, keys, "head {h} fp32");
        }
        assert!(pruned_any, "fixture should exercise pruning");
    }
}
