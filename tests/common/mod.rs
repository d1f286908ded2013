//! Shared helpers of the integration tests: fixture paths, .npy loading, error metrics.
#![allow(dead_code)]

use foxedge::npy::NpyArray;
use foxedge::{Model, Session, SessionOptions};
use std::path::PathBuf;
use std::sync::Arc;

pub mod device;
pub mod reference;
pub mod synth;
pub mod workload;

#[allow(unused_imports)] // not every test binary needs a device
pub use device::or_skip;

/// `tests/fixtures/fox-tiny-pro/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fox-tiny-pro")
        .join(name)
}

/// The bundled model directory.
pub fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/fox-tiny-pro")
}

pub fn tiny() -> Arc<Model> {
    Arc::new(Model::open(model_dir()).expect("bundled model loads"))
}

pub fn npy_f32(name: &str) -> (Vec<usize>, Vec<f32>) {
    let a = NpyArray::read(fixture(name)).expect("fixture reads");
    let v = a.to_f32().expect("float fixture");
    (a.shape, v)
}

pub fn input_ids() -> Vec<u32> {
    let a = NpyArray::read(fixture("input_ids.npy")).expect("fixture reads");
    a.to_i32().unwrap().into_iter().map(|x| x as u32).collect()
}

/// (max abs difference, relative L2 error ‖a − b‖ / ‖b‖).
pub fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let mut max = 0.0f64;
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&x, &y) in a.iter().zip(b) {
        let d = (f64::from(x) - f64::from(y)).abs();
        max = max.max(d);
        num += d * d;
        den += f64::from(y) * f64::from(y);
    }
    (max, (num / den.max(1e-300)).sqrt())
}

/// A session with ACP and certified eviction off (the dense reference behaviour).
pub fn dense_opts() -> SessionOptions {
    SessionOptions {
        ln_eps: None,
        certified_eviction: false,
        ..SessionOptions::default()
    }
}

pub fn session(model: &Arc<Model>, opts: SessionOptions) -> Session {
    Session::new(model.clone(), opts).expect("session")
}
