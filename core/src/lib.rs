//! foxedge-core: the decisions of forgetting attention, with no tensors and no allocation.
//!
//! Gate math, ACP logit bounds and thresholds, the pruning boundary over a block grid,
//! certified eviction bounds and the retention-cache policy. Kernels (`foxedge-cpu`,
//! `foxedge-vulkan`) compute what this crate decides; nothing here touches tensor memory.
#![no_std]
#![forbid(unsafe_code)]

pub mod boundary;
pub mod error;
pub mod eviction;
pub mod gate;
pub mod retention;
pub mod shape;
pub mod threshold;

pub use error::{Error, Result};
pub use shape::{AttentionShape, Layout};
