//! The kernel contract: what a caller hands every backend (CPU and Vulkan kernels alike),
//! what it gets back, and the ACP decisions all of them make the same way.
//!
//! Math (per batch row `b`, query head `h`, scale `s`):
//!
//! ```text
//! o_i = Σ_j w_ij v_j / Σ_j w_ij,   w_ij = exp(s q_i·k_j + D_ij),   D_ij = c_i − c_j
//! c_i = Σ_{l ≤ i} log f_l          (inclusive prefix sum over key positions)
//! ```
//!
//! with `j` over the attended keys: `seq_start[b] <= j <= i` (causal, left padding
//! excluded) and, under ACP, not inside a pruned key block ([`acp`]).
//!
//! - [`types`]: element types ([`Storage`]), call arguments and options, statistics, and
//!   the change tracking of a device-resident cache head ([`HeadSync`]).
//! - [`acp`]: per head the threshold `delta` from an [`Acp`] and the number of keys; the
//!   start blocks of each query block (prefill); which cache blocks a step skips (decode);
//!   which (query tile, key tile) a continuation prefill skips.
//! - what a valid call is: [`PrefillArgs::check`], [`DecodeArgs::check`],
//!   [`ContinueArgs::check`].
//!
//! [`AttentionStats`] holds a `Vec`: it needs the `alloc` feature (`std` implies it).

pub mod acp;
mod check;
pub mod types;

pub use acp::{
    SERIAL_DECISIONS, block_min, check_decisions, check_decode_acp, continue_tile_pruned,
    decide_slab, decode_block_pruned, decode_delta, decode_kept_entries, head_stats,
    observed_bound, prefill_delta,
};
#[cfg(feature = "alloc")]
pub use types::AttentionStats;
pub use types::{
    Acp, CacheHead, ContinueArgs, ContinueOptions, DType, Decisions, DecodeArgs, DecodeOptions,
    HeadStats, HeadSync, Journal, PrefillArgs, PrefillOptions, SelectedSlabs, Storage,
    selected_slabs,
};
