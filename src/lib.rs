//! foxedge: Forgetting Attention (FoX) inference for edge devices. The facade: the FoX model
//! runner over memory-mapped reference checkpoints, sessions with a certified retention
//! (KV) cache, backend selection, standalone forgetting attention ([`attention`]), and text
//! in and out: the model directory's [`Tokenizer`], a [`Sampler`] chain and [`generate`].
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
pub mod attention;
pub mod backend;
mod calibration;
pub mod config;
mod decisions;
pub mod error;
pub mod generate;
mod matrix;
pub mod model;
mod ops;
mod placement;
pub mod sample;
pub mod save;
mod select;
pub mod session;
pub mod tokenizer;
#[cfg(feature = "vulkan")]
mod vulkan_backend;
mod weights;

/// Skip-or-fail for unit tests that need a Vulkan device; shared with the integration tests.
#[cfg(all(test, feature = "vulkan"))]
#[path = "../tests/common/device.rs"]
mod test_device;

pub use backend::BackendKind;
pub use config::Config;
pub use error::{Error, ErrorKind, Result, SessionFileError};
pub use foxedge_core::quant::WeightFormat;
pub use generate::{GenerateOptions, Generation, StopReason};
pub use model::{LoadProgress, Model, ModelInfo, ModelOptions};
pub use sample::{Rng, Sampler, SamplerConfig, sample};
pub use session::{Budget, CacheDtype, Session, SessionOptions, SessionStats};
pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerSource};

/// The bundled tiny model's directory relative to the repository root.
pub const BUNDLED_MODEL: &str = "models/fox-tiny-pro";
