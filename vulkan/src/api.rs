//! Argument, option and statistics types of the forgetting-attention kernels.
//!
//! One contract for every backend: these are `foxedge_cpu`'s types, re-exported, so the
//! facade hands the same call to either backend and their statistics compare directly.
//! On the GPU, bf16 storage is widened to f32 on upload (GLSL has no bf16 type); f16 stays
//! f16 where the device has 16-bit storage.
//!
//! Math (per batch row `b`, query head `h`, scale `s`):
//!
//! ```text
//! o_i = Σ_j w_ij v_j / Σ_j w_ij,   w_ij = exp(s q_i·k_j + D_ij),   D_ij = c_i − c_j
//! c_i = Σ_{l ≤ i} log f_l          (inclusive prefix sum over key positions)
//! ```
//!
//! with `j` over the attended keys: `seq_start[b] <= j <= i` (causal, left padding
//! excluded) and, under ACP, not inside a pruned key block.

pub use foxedge_cpu::{
    Acp, AttentionStats, CacheHead, DType, Decisions, DecodeArgs, DecodeOptions, HeadStats,
    PrefillArgs, PrefillOptions, Storage,
};
