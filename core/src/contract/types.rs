//! The data of a kernel call: element types, arguments, options and statistics.
//!
//! Plain data only (sizes, slices, thresholds), so every backend takes the same call and
//! the statistics of two backends compare directly. Math: see [`crate::contract`].

use crate::error::{Error, Result};
use crate::shape::AttentionShape;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

mod sealed {
    /// Only this module's element types implement [`super::Storage`].
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// Element type of q, k, v and outputs in memory. Compute is always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
}

/// A storage element type: `f32`, `half::f16` or `half::bf16` (sealed).
///
/// Conversions to f32 are exact; conversions from f32 round to nearest even.
pub trait Storage: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widens `src` into `dst` (equal lengths; the caller guarantees it).
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (equal lengths; the caller guarantees it).
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
    /// The slice itself when the storage is already f32 (no copy needed).
    fn as_f32(src: &[Self]) -> Option<&[f32]>;
    /// One element widened to f32.
    fn to_f32(self) -> f32;
    /// One f32 rounded to this type.
    fn from_f32(x: f32) -> Self;
    /// The raw 16-bit patterns of an f16 or bf16 slice (`None` for f32).
    fn bits16(src: &[Self]) -> Option<&[u16]>;
}

impl Storage for f32 {
    const DTYPE: DType = DType::F32;
    #[inline]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn as_f32(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn bits16(_: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl Storage for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn bits16(src: &[Self]) -> Option<&[u16]> {
        Some(src.reinterpret_cast())
    }
}

impl Storage for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which the compiler vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(*s);
        }
    }
    #[inline]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn bits16(src: &[Self]) -> Option<&[u16]> {
        Some(src.reinterpret_cast())
    }
}

/// Adaptive computation pruning (ACP paper, section 3): skip key blocks whose largest
/// decay `max D` is below a threshold `delta`, so that each pruned weight is below
/// `eps / N` (N keys) and the pruned weights of a row sum below `eps` (appendix A).
///
/// The threshold always comes from [`super::acp`]; kernels only compare.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Acp<'a> {
    /// Dense: every causal key is attended.
    #[default]
    Off,
    /// A ready threshold `delta` (natural-log units, `<= 0`) per (batch, query head),
    /// index `b * heads_q + h`; in decode, per query head. A `-inf` entry disables
    /// pruning for that head.
    Threshold(&'a [f64]),
    /// A logit bound `U >= max |s q_i·k_j|` and `ln eps < 0`; [`super::acp`] derives
    /// `delta = -2U - ln N + ln eps` per (batch, head), N = the keys a query can attend
    /// (`seq_k - seq_start[b]` in prefill, the head's cache length in decode).
    /// `u` holds one bound per query head (`heads_q` values) or one per (batch, query
    /// head) (`batch * heads_q` values, index `b * heads_q + h`; prefill only).
    Bound { u: &'a [f64], ln_eps: f64 },
    /// Prefill only: U from the max norms of this call's q and k per (batch, head)
    /// ([`crate::threshold::bound_from_norms`]), valid for this call only; the
    /// reference kernel's `adaptive_threshold="auto"`.
    ObservedNorms { ln_eps: f64 },
    /// Prefill only: the decisions themselves, already made with foxedge-core for this
    /// call's gates and tile grid (a caller that planned the call from them need not pay
    /// for them twice); the kernel reads neither the gates nor a threshold.
    Decided(Decisions<'a>),
}

/// What [`Acp::Decided`] carries, per (batch b, query head h), index `bh = b * heads_q + h`.
///
/// Invariant (the caller's): `c` is [`crate::gate::cumsum_strided`] of the call's log
/// gates from 0 and `start_blocks` is [`crate::boundary::start_blocks`] for the call's
/// [`crate::boundary::BlockGrid`] (block sizes of the options), key start and threshold
/// `delta`. The kernel checks ([`super::acp::check_decisions`]) lengths, that `c` is finite
/// and that no query block starts after its diagonal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decisions<'a> {
    /// `[batch * heads_q, seq_k]`: cumulative log gate `c_j` of every key position.
    pub c: &'a [f64],
    /// `[batch * heads_q, q_blocks]`: first visited key block of each query block.
    pub start_blocks: &'a [u32],
    /// `[batch * heads_q]`: the threshold each head was pruned with (None: dense), for the
    /// statistics.
    pub delta: &'a [Option<f64>],
}

/// Options of a prefill call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillOptions<'a> {
    /// Logit scale `s`; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
    /// Pruning mode.
    pub acp: Acp<'a>,
    /// Query rows per tile (tokens), > 0. Also the ACP decision granularity.
    pub block_q: usize,
    /// Keys per tile (tokens), > 0. Blocks are aligned to key position 0.
    pub block_k: usize,
    /// The query heads to compute, strictly increasing, each `< heads_q`, for every batch
    /// row; `None`: all. The output rows (and lse) of other heads are left as they are,
    /// and the statistics hold one entry per computed (batch, head), in that order. Lets
    /// two backends share one call's heads in place, without gathering them (the hybrid
    /// split). [`Acp::Threshold`], [`Acp::Bound`] and [`Acp::Decided`] stay indexed by
    /// the whole call's heads.
    pub heads: Option<&'a [usize]>,
}

impl Default for PrefillOptions<'_> {
    fn default() -> Self {
        Self {
            sm_scale: None,
            acp: Acp::Off,
            block_q: 64,
            block_k: 64,
            heads: None,
        }
    }
}

/// Inputs of one prefill call. Layouts follow `shape.layout` (see
/// [`crate::Layout`]); `log_fgate` is f32 log forget gates (finite, `<= 0`) per
/// (batch, key position, query head).
#[derive(Debug, Clone, Copy)]
pub struct PrefillArgs<'a, T: Storage> {
    pub shape: AttentionShape,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub log_fgate: &'a [f32],
    /// Left padding: for batch row `b`, keys `< seq_start[b]` are never attended and
    /// query rows at key positions `< seq_start[b]` output zeros (lse `-inf`).
    /// `batch` values, each `< seq_k`.
    pub seq_start: Option<&'a [usize]>,
}

/// Kept and total work of one (batch, query head), in query-key pairs and tiles.
///
/// `total_pairs` counts every attendable pair (causal, after left padding);
/// `kept_pairs` those in blocks the kernel computed. FLOPs = `4 * head_dim * kept_pairs`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HeadStats {
    pub kept_pairs: u64,
    pub total_pairs: u64,
    pub kept_blocks: u64,
    pub total_blocks: u64,
    /// The threshold applied (`None` when ACP was off).
    pub delta: Option<f64>,
}

/// Per-call statistics: one [`HeadStats`] per (batch, query head), index `b * heads_q + h`
/// (decode: per query head). Needs the `alloc` feature.
#[cfg(feature = "alloc")]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttentionStats {
    pub heads: alloc::vec::Vec<HeadStats>,
}

#[cfg(feature = "alloc")]
impl AttentionStats {
    /// Sum of kept pairs over heads.
    pub fn kept_pairs(&self) -> u64 {
        self.heads.iter().map(|h| h.kept_pairs).sum()
    }
    /// Sum of attendable pairs over heads.
    pub fn total_pairs(&self) -> u64 {
        self.heads.iter().map(|h| h.total_pairs).sum()
    }
    /// `kept_pairs / total_pairs` (1 when there is no pair).
    pub fn kept_fraction(&self) -> f64 {
        let t = self.total_pairs();
        if t == 0 {
            1.0
        } else {
            self.kept_pairs() as f64 / t as f64
        }
    }
}

/// One query head's view of the decode cache.
///
/// Layout: `n` entries in any order (swap-delete leaves them out of position order);
/// entry `j` has key `k[j*d .. (j+1)*d]`, value `v[j*d .. (j+1)*d]` and prefix sum
/// `c[j]` (f64, relative to the head's origin, the same origin as the query's `c_t`).
/// Grouped-query heads may share `k`/`v` slices; `c` is per query head because gates are.
///
/// Any alignment is accepted; rows that start on 64-byte boundaries load fastest (an
/// AVX-512 load from elsewhere spans two cache lines). The facade's session cache is
/// aligned so (`foxedge::aligned`).
#[derive(Debug, Clone, Copy)]
pub struct CacheHead<'a, T: Storage> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub c: &'a [f64],
    /// Token position of each entry (`n` values). Needed only when a step has several
    /// queries: query `t` attends entry `j` iff `pos[j] <= q_pos[t]`. `None`: every
    /// query attends every entry.
    pub pos: Option<&'a [u64]>,
}

/// Inputs of one decode step over `heads.len()` query heads with `n_queries` new queries
/// each. The cache must already hold the new tokens' own keys and values.
#[derive(Debug, Clone, Copy)]
pub struct DecodeArgs<'a, Q: Storage, T: Storage> {
    pub head_dim: usize,
    pub n_queries: usize,
    /// `[heads, n_queries, head_dim]`.
    pub q: &'a [Q],
    /// `c_t` of each query, `[heads, n_queries]`, relative to its head's origin.
    pub q_c: &'a [f64],
    /// Positions of the queries, `[heads, n_queries]`; required iff some head has `pos`.
    pub q_pos: Option<&'a [u64]>,
    pub heads: &'a [CacheHead<'a, T>],
}

impl<'a, Q: Storage, T: Storage> DecodeArgs<'a, Q, T> {
    /// The usual step: one query per head (`q`: `[heads, head_dim]`, `q_c`: `[heads]`), no
    /// positions.
    pub fn one_query(
        head_dim: usize,
        q: &'a [Q],
        q_c: &'a [f64],
        heads: &'a [CacheHead<'a, T>],
    ) -> Self {
        DecodeArgs {
            head_dim,
            n_queries: 1,
            q,
            q_c,
            q_pos: None,
            heads,
        }
    }
}

/// Options of a decode step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeOptions<'a> {
    /// Logit scale `s`; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
    /// Pruning: `Threshold` (one delta per head) or `Bound` (one U per head).
    /// A block of `block_k` consecutive entries is skipped when, for every query,
    /// `max_j (c_t - c_j) < delta`; other entries are all attended.
    pub acp: Acp<'a>,
    /// Entries per block (the ACP granularity and the softmax tile), > 0.
    pub block_k: usize,
    /// Entries per parallel task (flash-decoding split); rounded up to a multiple of
    /// `block_k`. Partial softmaxes of the splits are merged exactly.
    pub split: usize,
}

impl Default for DecodeOptions<'_> {
    fn default() -> Self {
        Self {
            sm_scale: None,
            acp: Acp::Off,
            block_k: 64,
            split: 2048,
        }
    }
}

/// Inputs of a continuation prefill: `n_queries` new tokens per head attend that head's
/// retained cache (every entry of which precedes them in the stream) and, causally, the
/// new tokens' own keys. The new tokens are both the queries and the new keys, so their
/// `c` is `q_c` for both.
///
/// ```text
/// o_r = Σ_j w_rj v_j / Σ_j w_rj,   w_rj = exp(s q_r·k_j + c_r - c_j)
/// j over: cache entries e with r < cache_end[e],  new keys i with i <= r < key_end[i]
/// ```
///
/// The ends say which query first no longer sees a key: an entry evicted while the chunk's
/// tokens were appended one by one (a budget or the certificate) is seen by the queries
/// before its eviction only, exactly as in token-by-token feeding. `None`: every query
/// sees every cache entry, and new key `i` is seen by queries `i..n_queries`.
///
/// Layouts: `q`, `k`, `v` are `[n_queries, heads, head_dim]` (the model's rows);
/// `q_c`, `key_end` are `[n_queries, heads]`; `cache_end[h]` has one value per entry of
/// `cache[h]`. `c` values share each head's origin (that of `q_c`). Cache positions
/// (`CacheHead::pos`) are not read.
#[derive(Debug, Clone, Copy)]
pub struct ContinueArgs<'a, T: Storage> {
    pub head_dim: usize,
    pub n_queries: usize,
    pub q: &'a [f32],
    pub k: &'a [T],
    pub v: &'a [T],
    pub q_c: &'a [f64],
    pub key_end: Option<&'a [u32]>,
    /// One per head.
    pub cache: &'a [CacheHead<'a, T>],
    pub cache_end: Option<&'a [&'a [u32]]>,
}

impl<T: Storage> ContinueArgs<'_, T> {
    /// Heads of the call (`cache.len()`).
    pub fn heads(&self) -> usize {
        self.cache.len()
    }
}

/// Options of a continuation prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContinueOptions<'a> {
    /// Logit scale `s`; `None` means `1 / sqrt(head_dim)`.
    pub sm_scale: Option<f32>,
    /// Pruning: `Off`, `Threshold` (one delta per head) or `Bound` (one U per head, with
    /// `N` = the head's cache entries plus the new tokens). A (query tile, key tile) is
    /// skipped when its largest decay is below delta
    /// ([`super::acp::continue_tile_pruned`]).
    pub acp: Acp<'a>,
    /// Queries per tile, > 0.
    pub block_q: usize,
    /// Keys per tile (cache entries in slot order, or new keys), > 0.
    pub block_k: usize,
}

impl Default for ContinueOptions<'_> {
    fn default() -> Self {
        Self {
            sm_scale: None,
            acp: Acp::Off,
            block_q: 64,
            block_k: 64,
        }
    }
}

/// Change tracking of one cache head, from its owner, for a backend that mirrors the head
/// on a device and uploads only the rows written since it last synced.
///
/// Invariant (the caller's): `row_version[j] <= version` for every live row `j`, and a row
/// whose contents change (k, v, c or position), or an index that becomes live, gets a
/// version greater than every version this `id` had before. `id` is never reused.
#[derive(Debug, Clone, Copy)]
pub struct HeadSync<'a> {
    pub id: u64,
    /// The newest row version of the head.
    pub version: u64,
    /// `[n]` the version at which each row was last written.
    pub row_version: &'a [u64],
    /// The head's latest writes, if its owner keeps them.
    pub journal: Option<Journal<'a>>,
}

/// The latest writes of one cache head, oldest first: `rows[i]` is the row written at
/// version `since + 1 + i` (every version after `since` wrote exactly one row).
///
/// Invariant (the caller's): `since + rows.len()` is the head's `version`, and every row
/// write after version `since` is listed. A write that changes many rows at once (a
/// re-basing of every `c`) empties the journal and sets `since` to its version. Rows
/// listed that are no longer live (`>= n`, the head shrank) are skipped.
#[derive(Debug, Clone, Copy)]
pub struct Journal<'a> {
    pub since: u64,
    pub rows: &'a [u32],
}

/// The (batch, query head) slabs `b * heads_q + h` that a prefill with
/// [`PrefillOptions::heads`] = `heads` computes, in increasing order (every slab for
/// `None`). Errors ([`Error::BadArgument`]): a head `>= heads_q`, or heads not strictly
/// increasing.
pub fn selected_slabs<'a>(
    shape: &AttentionShape,
    heads: Option<&'a [usize]>,
) -> Result<SelectedSlabs<'a>> {
    if let Some(sel) = heads {
        if sel.iter().any(|&h| h >= shape.heads_q) {
            return Err(Error::BadArgument("selected heads must be < heads_q"));
        }
        if sel.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::BadArgument(
                "selected heads must be strictly increasing",
            ));
        }
    }
    Ok(SelectedSlabs {
        heads_q: shape.heads_q,
        sel: heads,
        next: 0,
        end: shape
            .batch
            .saturating_mul(heads.map_or(shape.heads_q, <[usize]>::len)),
    })
}

/// Iterator of [`selected_slabs`].
#[derive(Debug, Clone)]
pub struct SelectedSlabs<'a> {
    heads_q: usize,
    sel: Option<&'a [usize]>,
    next: usize,
    end: usize,
}

impl Iterator for SelectedSlabs<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.next >= self.end {
            return None;
        }
        let i = self.next;
        self.next += 1;
        Some(match self.sel {
            None => i,
            Some(sel) => (i / sel.len()) * self.heads_q + sel[i % sel.len()],
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for SelectedSlabs<'_> {}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::shape::Layout;
    use proptest::prelude::*;
    use std::vec::Vec;

    fn shape(batch: usize, heads_q: usize) -> AttentionShape {
        AttentionShape {
            batch,
            heads_q,
            heads_kv: 1,
            seq_q: 1,
            seq_k: 1,
            head_dim: 8,
            layout: Layout::SeqFirst,
        }
    }

    proptest! {
        /// The slabs are `b * heads_q + h` for every batch row and selected head, in order.
        #[test]
        fn selected_slabs_are_every_batch_rows_heads(
            batch in 1usize..4,
            heads_q in 1usize..9,
            pick in proptest::collection::vec(any::<bool>(), 8),
            all in any::<bool>(),
        ) {
            let sh = shape(batch, heads_q);
            let sel: Vec<usize> = (0..heads_q).filter(|&h| pick[h]).collect();
            let heads = (!all).then_some(&sel[..]);
            let want: Vec<usize> = (0..batch)
                .flat_map(|b| {
                    let hs: Vec<usize> = heads.map_or((0..heads_q).collect(), <[usize]>::to_vec);
                    hs.into_iter().map(move |h| b * heads_q + h)
                })
                .collect();
            let it = selected_slabs(&sh, heads).unwrap();
            prop_assert_eq!(it.len(), want.len());
            prop_assert_eq!(it.collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn selected_slabs_errors() {
        let sh = shape(2, 4);
        assert!(matches!(
            selected_slabs(&sh, Some(&[1, 4])),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            selected_slabs(&sh, Some(&[2, 2])),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            selected_slabs(&sh, Some(&[3, 1])),
            Err(Error::BadArgument(_))
        ));
        assert_eq!(selected_slabs(&sh, Some(&[])).unwrap().count(), 0);
    }

    #[test]
    fn storage_round_trips() {
        let x = [1.0f32, -2.5, 0.1, 65504.0];
        let mut h = [f16::ZERO; 4];
        let mut b = [bf16::ZERO; 4];
        let mut back = [0.0f32; 4];
        f16::from_f32_slice(&x, &mut h);
        bf16::from_f32_slice(&x, &mut b);
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(h[i], f16::from_f32(v));
            assert_eq!(b[i], bf16::from_f32(v));
            assert_eq!(f16::bits16(&h).unwrap()[i], h[i].to_bits());
            assert_eq!(bf16::bits16(&b).unwrap()[i], b[i].to_bits());
        }
        f16::to_f32_slice(&h, &mut back);
        assert!(back.iter().zip(&h).all(|(a, e)| *a == e.to_f32()));
        bf16::to_f32_slice(&b, &mut back);
        assert!(back.iter().zip(&b).all(|(a, e)| *a == e.to_f32()));
        assert!(f32::bits16(&x).is_none());
        assert_eq!(f32::as_f32(&x), Some(&x[..]));
        assert_eq!(
            (f32::DTYPE, f16::DTYPE, bf16::DTYPE),
            (DType::F32, DType::F16, DType::Bf16)
        );
    }
}
