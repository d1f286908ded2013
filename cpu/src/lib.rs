//! foxedge-cpu: tiled forgetting-attention kernels for CPUs (x86-64 with AVX2/AVX-512,
//! aarch64 with NEON), with adaptive computation pruning (ACP).
//!
//! - [`prefill`]: `O = softmax(s Q K^T + D) V`, causal, per (batch, query head), with
//!   `D_ij = c_i - c_j` and `c` the f64 prefix sum of the log forget gates. Tiles of
//!   `block_q x block_k`; under ACP each query-block row starts at the key block that
//!   `foxedge_core::boundary::start_blocks` chose (ACP paper, Algorithm 1) and never
//!   touches the pruned blocks before it.
//! - [`decode`]: a few new queries per head against an unordered cache whose entries carry
//!   their `c_j`; split over the cache length (flash-decoding) with an exact merge of the
//!   partial softmaxes.
//! - [`linear`]: dense layers `y = x Wᵀ` with `W` in f32, f16, bf16 or the 8-bit and 4-bit
//!   block formats of `foxedge_core::quant` (integer dot products), one row or many.
//! - [`prefill_continue`]: a chunk of new tokens against the retained cache (unordered,
//!   with each entry's `c_j` and the query where it stops being seen) and, causally, its
//!   own keys, in query x key tiles with ACP per tile.
//!
//! Attention storage is f32, f16 or bf16 ([`Storage`]); compute and accumulation are f32. `c` stays
//! f64 until a tile converts it to f32 relative to the tile's first query row, so `D` near
//! the diagonal is exact even when `|c|` is large.
//!
//! Core decides, kernels compute: the call's types and its ACP decisions (thresholds and
//! boundaries) come from `foxedge_core::contract`.

mod continuation;
mod decode;
pub mod limits;
pub mod linear;
mod prefill;
pub mod reference;
pub mod simd;

pub use continuation::{prefill_continue, prefill_continue_with_isa};
pub use decode::{decode, decode_with_isa};
/// The kernel contract (`foxedge_core::contract`), re-exported at this crate's root.
pub use foxedge_core::contract::{
    Acp, AttentionStats, CacheHead, ContinueArgs, ContinueOptions, DType, Decisions, DecodeArgs,
    DecodeOptions, HeadStats, PrefillArgs, PrefillOptions, SERIAL_DECISIONS, Storage,
    check_decisions, selected_slabs,
};
pub use foxedge_core::{AttentionShape, Error, Layout, Result};
pub use prefill::{NON_FINITE, prefill, prefill_with_isa};
pub use simd::Isa;
