//! foxedge-core: the decisions of forgetting attention, with no tensors and no allocation.
//!
//! Gate math, ACP logit bounds and thresholds, the pruning boundary over a block grid,
//! certified eviction bounds, the retention-cache policy, and the kernel call contract.
//! Kernels (`foxedge-cpu`, `foxedge-vulkan`) compute what this crate decides; nothing here
//! writes tensor memory (only an observed-norms threshold reads q and k).
//!
//! - [`gate`]: stable log-sigmoid, validated f64 cumulative log gates `c`, re-basing streams.
//! - [`threshold`]: the logit bound `U` and the ACP threshold `delta = -2U - ln L + ln eps`.
//! - [`boundary`]: Algorithm 1 of the ACP paper (first key block per query block), the
//!   token-level first kept key, and kept/total pair counts.
//! - [`eviction`]: the certificate `B_t = exp(2U + c_t + logsumexp_{evicted}(-c_j))`.
//! - [`quant`]: weight storage formats (f32, f16, bf16, 8-bit and 4-bit blocks), their
//!   byte layouts and the scalar quantize / dequantize references.
//! - [`retention`]: the per-layer cache policy (sinks, window, budgets, swap-delete moves).
//! - [`contract`]: the kernel call contract (arguments, options, statistics) and the ACP
//!   decisions every backend makes with it.
//!
//! A prefill call with ACP, per (batch, head):
//!
//! ```
//! use foxedge_core::{boundary, gate, threshold};
//!
//! let log_f = [-0.5f32; 300]; // one head's log forget gates, positions 0..300
//! let mut c = [0.0f64; 300];
//! gate::cumsum_strided(&log_f, 1, 0.0, &mut c)?;
//! let u = threshold::bound_from_qk_norm(&[1.0; 64], &[1.0; 64], 64)?; // 8 nats
//! let delta = threshold::threshold(u, c.len(), threshold::DEFAULT_LN_EPS)?;
//! let grid = boundary::BlockGrid::new(64, 32, 300, 300)?;
//! let mut start = [0u32; 5]; // grid.q_blocks()
//! boundary::start_blocks(&grid, &c, Some(delta), 0, &mut start)?;
//! // query block I visits key blocks start[I]..=grid.diag_block(I)
//! assert_eq!(start[0], 0);
//! assert!(start[4] > 0);
//! let counts = boundary::count_pairs(&grid, &start, 0);
//! assert!(counts.kept_fraction() < 1.0);
//! # Ok::<(), foxedge_core::Error>(())
//! ```
#![no_std]
#![forbid(unsafe_code)]

#[cfg(feature = "alloc")]
extern crate alloc;

pub mod boundary;
pub mod contract;
pub mod error;
pub mod eviction;
pub mod gate;
pub mod quant;
pub mod retention;
pub mod shape;
pub mod threshold;

pub use error::{Error, Result};
pub use shape::{AttentionShape, Layout};
