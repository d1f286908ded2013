//! foxedge: Forgetting Attention (FoX) inference for edge devices. The facade: the FoX model
//! runner over memory-mapped reference checkpoints, sessions with a certified retention
//! (KV) cache, backend selection, and the helpers the `foxedge` command line uses.
//!
//! ```no_run
//! use foxedge::{Model, Session, SessionOptions};
//! use std::sync::Arc;
//! let model = Arc::new(Model::open("models/fox-tiny-pro")?);
//! let mut session = Session::new(model.clone(), SessionOptions::default())?;
//! let mut logits = vec![0.0f32; model.info().vocab];
//! session.feed(&[0, b'i' as u32, b'm' as u32], Some(&mut logits))?;
//! # Ok::<(), foxedge::Error>(())
//! ```

pub mod aligned;
pub mod backend;
pub mod config;
pub mod error;
pub mod hybrid;
pub mod model;
mod npy;
mod ops;
pub mod sample;
pub mod session;
#[cfg(feature = "vulkan")]
mod vulkan_backend;
mod weights;

pub use backend::BackendKind;
pub use config::Config;
pub use error::{Error, ErrorKind, Result};
pub use model::{Model, ModelInfo};
pub use sample::{Rng, sample};
pub use session::{Budget, Session, SessionOptions, SessionStats};

/// The bundled tiny model's directory relative to the repository root.
pub const BUNDLED_MODEL: &str = "models/fox-tiny-pro";
