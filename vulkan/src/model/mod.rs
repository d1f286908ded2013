//! A FoX model resident on the device: weights uploaded once in their storage format
//! ([`DeviceModel`]), and per-stream state (K/V/c cache heads, token-shift states,
//! activations) in [`DeviceStream`], which runs every op of the block as a compute shader
//! (docs/FOX_MODEL_SPEC.md, section 3):
//!
//! - embedding gather (`embed.comp`), RMSNorm (`rmsnorm.comp`);
//! - projections: matrix-vector products for one token (`mv.glsl`; the projections of one
//!   normed row in one dispatch, `mv.glsl` with MULTI) and tiled matrix
//!   products for a chunk (`mm.glsl`), weights f32, f16 or bf16 (`wfmt.glsl`, widened to
//!   f32 in registers; accumulation in f32); Q8 / Q4 blocks in their packed layout
//!   (`qblk.glsl`, `mvq.glsl`, `mmq.glsl`: dequantized in registers or into shared memory,
//!   accumulation in f32);
//! - the token shift of k and v, QK-norm and the forget gate's `log f = logsigmoid(z)`
//!   (`attn_pre.comp`);
//! - forgetting attention: the prefill kernel (`prefill.glsl`) over a fresh chunk, the decode
//!   kernel (`decode.glsl`) over resident cache heads;
//! - output norm and gate (`attn_post.comp`), SwiGLU (`swiglu.comp`), residual additions
//!   (the products accumulate into the residual stream), final norm, LM head, and greedy
//!   selection (`argmax.comp`) so that a decode step can return one token id.
//!
//! The caller keeps the stream's bookkeeping. A chunk ([`DeviceStream::run`], one
//! submission per layer and one more): after each layer's gates it receives `log f` (and
//! the layer's new K/V rows, for a host shadow of the cache) and answers with a
//! [`LayerPlan`]: the cumulative gates `c` (f64, as the CPU keeps them), ACP decisions, and
//! the row operations (swap-delete moves of its retention policy, stores of new rows) that
//! the device applies to its cache heads. One token ([`DeviceStream::step`], one
//! submission): the caller decides before the token what does not depend on its gates
//! ([`StepHead`]: re-bases, the evictions its policy may make with the `c_t` threshold of
//! each, ACP thresholds), the device computes `c_t`, applies the evictions that `c_t`
//! makes, stores the token's row and decides ACP (`head_step.comp`); the caller reads every
//! layer's gates back once. Cache `c` goes to the device as a
//! double-float pair (`pack::split_f64`), as the attention kernels take it.

mod matmul;
mod ops;
mod profile;
mod projections;
mod step;
mod weights;

pub use step::{
    ContinuePlan, DeviceStream, Gates, HeadStep, HostTimes, LayerGates, LayerPlan, OpsAfter,
    Output, RowOp, RunStats, StepAcp, StepEvict, StepHead, StepOutput, TokenPlan,
};
pub use weights::DeviceModel;

use foxedge_core::contract::HeadStats;

/// Activation of the output gate or of the MLP gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Sigmoid,
    Silu,
}

/// QK-norm: none, one weight `[D]` (a slice per head), or one `[head_dim]` shared by all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    Off,
    PerHead,
    Shared,
}

/// Sizes and switches of a FoX model (spec section 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    pub vocab: usize,
    /// D = heads * head_dim.
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// I, the MLP width.
    pub intermediate: usize,
    /// eps of attn_norm, mlp_norm, the final norm and the output norm.
    pub norm_eps: f64,
    /// eps of the QK-norm.
    pub qk_eps: f64,
    pub qk_norm: QkNorm,
    pub k_shift: bool,
    pub v_shift: bool,
    /// The output gate and its activation.
    pub output_gate: Option<Act>,
    pub output_norm: bool,
    /// The MLP's gate activation (`swish` = SiLU).
    pub mlp_act: Act,
}

impl ModelShape {
    /// Floats of one projection row of `attn_pre.comp`: `[q | k | v | k shift | v shift |
    /// gate | output gate]`.
    pub(crate) fn proj_width(&self) -> usize {
        4 * self.hidden + 3 * self.heads
    }
}

/// A weight matrix `[out, in]` (row-major) or vector in its storage format.
///
/// `Q8` / `Q4`: the blocks of `foxedge_core::quant` in foxedge-cpu's packed layout
/// (`foxedge_cpu::linear::PackedView::tiles`, described in `shaders/qblk.glsl`): rows in
/// groups of 16, each cut into tiles of 64 weights (two blocks: 16 rows' f16 scales, then
/// their quants interleaved by 4-byte word); [`packed_bytes`] bytes for `[out, in]`.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
    Bf16(&'a [half::bf16]),
    Q8(&'a [u8]),
    Q4(&'a [u8]),
}

/// Bytes of an `out x inp` matrix of the packed Q8 (`q4 == false`) or Q4 layout: groups of
/// 16 rows times tiles of 64 weights, a tile 64 bytes of scales and 2 x 512 (Q8) or 2 x 256
/// (Q4) bytes of quants (34 or 18 bytes per 32 weights, rows and blocks padded).
pub fn packed_bytes(q4: bool, out: usize, inp: usize) -> Option<usize> {
    let tile = if q4 { 64 + 2 * 256 } else { 64 + 2 * 512 };
    out.div_ceil(16)
        .checked_mul(inp.div_ceil(64))
        .and_then(|n| n.checked_mul(tile))
}

impl Weights<'_> {
    /// Format id of the shaders: 0 f32, 1 f16, 2 bf16 (`wfmt.glsl`), 3 Q8, 4 Q4
    /// (`qblk.glsl`).
    pub(crate) fn format(&self) -> u32 {
        match self {
            Weights::F32(_) => 0,
            Weights::F16(_) => 1,
            Weights::Bf16(_) => 2,
            Weights::Q8(_) => 3,
            Weights::Q4(_) => 4,
        }
    }

    /// Whether the weights are Q8 / Q4 blocks.
    pub(crate) fn is_block(&self) -> bool {
        self.format() >= 3
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> u64 {
        match self {
            Weights::F32(w) => w.len() as u64 * 4,
            Weights::F16(w) => w.len() as u64 * 2,
            Weights::Bf16(w) => w.len() as u64 * 2,
            Weights::Q8(b) | Weights::Q4(b) => b.len() as u64,
        }
    }
}

/// The tensors of one block (spec section 2). Vectors are f32; matrices any [`Weights`].
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    pub attn_norm: &'a [f32],
    pub q: Weights<'a>,
    /// The k / v projection (`linear` with a shift).
    pub k: Weights<'a>,
    pub v: Weights<'a>,
    /// `[H, D]` shift projections, with `k_shift` / `v_shift`.
    pub k_shift: Option<Weights<'a>>,
    pub v_shift: Option<Weights<'a>>,
    /// `[H, D]` forget-gate projection and its bias `[H]`.
    pub fgate: Weights<'a>,
    pub fgate_bias: &'a [f32],
    pub ogate: Option<Weights<'a>>,
    pub output_norm: Option<&'a [f32]>,
    /// QK-norm weights, `[D]` each (or `[head_dim]` when shared).
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub o: Weights<'a>,
    pub mlp_norm: &'a [f32],
    /// `[2I, D]`: rows `0..I` gate, `I..2I` up.
    pub gate_up: Weights<'a>,
    /// `[D, I]`.
    pub down: Weights<'a>,
}

/// Every tensor of a model.
#[derive(Debug, Clone)]
pub struct ModelWeights<'a> {
    /// `[V, D]`.
    pub embeddings: Weights<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    pub norm: &'a [f32],
    /// `[V, D]` (the embeddings again when tied).
    pub lm_head: Weights<'a>,
}

/// Settings of [`crate::Vulkan::load_model`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Most device bytes the weights may take; `None`: 90% of the largest device-local
    /// heap. A model over it is [`crate::Error::DoesNotFit`].
    pub budget_bytes: Option<u64>,
}

/// ACP decisions of one decode head over `c` (its live entries' cumulative gates, slot
/// order) for a query at `c_t`: a flag per `block` entries (1 = attend; empty when every
/// block is attended) and the statistics, by foxedge-core's rule (a block is skipped when
/// `c_t - min_j c_j < delta`), as `foxedge_cpu::decode` decides.
pub fn decode_blocks(
    c: &[f64],
    c_t: f64,
    delta: Option<f64>,
    block: usize,
) -> (Vec<u32>, HeadStats) {
    use foxedge_core::contract::acp;
    let n = c.len();
    let block = block.max(1);
    let blocks = n.div_ceil(block);
    let mut st = HeadStats {
        delta,
        total_pairs: n as u64,
        total_blocks: blocks as u64,
        ..HeadStats::default()
    };
    let Some(dl) = delta else {
        st.kept_pairs = st.total_pairs;
        st.kept_blocks = st.total_blocks;
        return (Vec::new(), st);
    };
    let mut kept: Vec<u32> = c
        .chunks(block)
        .map(|b| u32::from(!acp::decode_block_pruned(&[c_t], acp::block_min(b), dl)))
        .collect();
    for (b, &k) in kept.iter().enumerate() {
        if k != 0 {
            st.kept_blocks += 1;
            st.kept_pairs += (block.min(n - b * block)) as u64;
        }
    }
    if st.kept_blocks == st.total_blocks {
        kept.clear();
    }
    (kept, st)
}

/// Queries and keys per ACP block of a continuation chunk (foxedge-cpu's default
/// `block_q` / `block_k`).
pub const CONTINUE_BLOCK: usize = 64;

/// ACP decisions of one head of a continuation chunk (`continue.comp`), as
/// `foxedge_cpu::prefill_continue` decides them with 64-query by 64-key tiles: for query
/// block `I` (rows `t0..t1` of the chunk, `c_ref = q_c[t0]`, the block's largest `c`) and
/// key block `J` (64 cache rows in slot order, then 64 chunk keys up to the diagonal), the
/// block is skipped when no query of `I` sees a key of `J` (ends, causality), or when
/// `c_ref - min_J c_j < delta` (foxedge-core's `continue_tile_pruned`: every weight of the
/// block is below `eps / N`).
///
/// `cache_c`: the head's cache rows' `c` (slot order); `q_c`: the chunk's `c` (`[n]`, same
/// origin); `ends`: the first query that no longer sees each cache row (`[live]`) then
/// each chunk key (`[n]`), `None` when every query sees every key it follows.
///
/// Returns the flags `[query block][cache blocks + chunk blocks]` (1 = attend; empty when
/// `delta` is `None` and no ends cut a block) and the head's statistics, pair for pair the
/// CPU kernel's.
pub fn continue_blocks(
    cache_c: &[f64],
    q_c: &[f64],
    delta: Option<f64>,
    ends: Option<&[u32]>,
) -> (Vec<u32>, HeadStats) {
    use foxedge_core::contract::acp;
    const B: usize = CONTINUE_BLOCK;
    let (live, t) = (cache_c.len(), q_c.len());
    let end = |j: usize| ends.map_or(t, |e| e[j] as usize);
    let (ncb, nnb) = (live.div_ceil(B), t.div_ceil(B));
    let stride = ncb + nnb;
    let mut kept = vec![0u32; t.div_ceil(B) * stride];
    let mut st = HeadStats {
        delta,
        ..HeadStats::default()
    };
    let cache_min: Vec<f64> = cache_c.chunks(B).map(acp::block_min).collect();
    for qb in 0..t.div_ceil(B) {
        let t0 = qb * B;
        let nq = (t - t0).min(B);
        let c_ref = q_c[t0];
        let row = &mut kept[qb * stride..(qb + 1) * stride];
        let mut count = |pairs: u64, key_min: f64, flag: &mut u32| {
            if pairs == 0 {
                return;
            }
            st.total_pairs += pairs;
            st.total_blocks += 1;
            if delta.is_some_and(|dl| acp::continue_tile_pruned(c_ref, key_min, dl)) {
                return;
            }
            st.kept_pairs += pairs;
            st.kept_blocks += 1;
            *flag = 1;
        };
        for kb in 0..ncb {
            let pairs: u64 = (kb * B..((kb + 1) * B).min(live))
                .map(|j| end(j).saturating_sub(t0).min(nq) as u64)
                .sum();
            count(pairs, cache_min[kb], &mut row[kb]);
        }
        let p_last = t0 + nq - 1;
        for (nb, j0) in (0..=p_last).step_by(B).enumerate() {
            let nk = (p_last + 1 - j0).min(B);
            let pairs: u64 = (j0..j0 + nk)
                .map(|i| {
                    let seen = end(live + i).saturating_sub(t0).min(nq);
                    seen.saturating_sub(i.saturating_sub(t0)) as u64
                })
                .sum();
            count(pairs, acp::block_min(&q_c[j0..j0 + nk]), &mut row[ncb + nb]);
        }
    }
    if delta.is_none() && ends.is_none() {
        kept.clear();
    }
    (kept, st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use foxedge_core::contract::{Acp, CacheHead, ContinueArgs, ContinueOptions};
    use proptest::prelude::*;

    /// A head of `live` cache rows (unordered `c` <= 0), a chunk of `t` queries (`c`
    /// non-increasing below the cache's), optional ends, optional delta.
    fn case() -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Option<Vec<u32>>, Option<f64>)> {
        (0usize..200, 1usize..150).prop_flat_map(|(live, t)| {
            (
                prop::collection::vec(-40.0f64..0.0, live),
                prop::collection::vec(0.0f64..1.5, t),
                prop::collection::vec(0u32..1000, live + t),
                any::<bool>(),
                prop::option::of(-20.0f64..-0.5),
            )
                .prop_map(move |(cache_c, steps, raw, cut, delta)| {
                    let mut q_c = Vec::with_capacity(t);
                    let mut c = 0.0;
                    for s in steps {
                        c -= s;
                        q_c.push(c);
                    }
                    let tt = t as u32;
                    let ends = cut.then(|| {
                        let mut e: Vec<u32> = raw[..live].iter().map(|x| x % (tt + 1)).collect();
                        // A chunk key is seen by its own query: its end is after it.
                        e.extend((0..t).map(|i| i as u32 + 1 + raw[live + i] % (tt - i as u32)));
                        e
                    });
                    (cache_c, q_c, ends, delta)
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The flags' statistics are the CPU continuation kernel's, block for block and pair
        /// for pair, and a flag is set exactly for each kept block.
        #[test]
        fn continue_blocks_count_what_the_cpu_kernel_keeps((cache_c, q_c, ends, delta) in case()) {
            let (live, t, d) = (cache_c.len(), q_c.len(), 8);
            let ck = vec![0.1f32; live * d];
            let (q, k) = (vec![0.2f32; t * d], vec![0.3f32; t * d]);
            let cache = [CacheHead { k: &ck, v: &ck, c: &cache_c, pos: None }];
            let cache_end = ends.as_ref().map(|e| [&e[..live]]);
            let args = ContinueArgs {
                head_dim: d,
                n_queries: t,
                q: &q,
                k: &k,
                v: &k,
                q_c: &q_c,
                key_end: ends.as_ref().map(|e| &e[live..]),
                cache: &cache,
                cache_end: cache_end.as_ref().map(|e| &e[..]),
            };
            let dl = delta.map(|x| [x]);
            let opts = ContinueOptions {
                acp: dl.as_ref().map_or(Acp::Off, |x| Acp::Threshold(x)),
                ..ContinueOptions::default()
            };
            let mut out = vec![0.0f32; t * d];
            let cpu = foxedge_cpu::prefill_continue(&args, &opts, &mut out).unwrap();
            let (kept, st) = continue_blocks(&cache_c, &q_c, delta, ends.as_deref());
            let c = &cpu.heads[0];
            prop_assert_eq!(
                (st.kept_pairs, st.total_pairs, st.kept_blocks, st.total_blocks),
                (c.kept_pairs, c.total_pairs, c.kept_blocks, c.total_blocks)
            );
            if !kept.is_empty() {
                prop_assert_eq!(kept.iter().map(|&x| u64::from(x)).sum::<u64>(), st.kept_blocks);
            } else {
                prop_assert_eq!(st.kept_blocks, st.total_blocks);
            }
        }
    }
}
