//! Shared helpers of the integration tests: fixture paths, .npy loading, error metrics.
#![allow(dead_code)]

use foxedge::{BackendKind, Model, Session, SessionOptions};
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

/// A C-order `.npy` file's shape and elements (npyz); `T` must match its dtype.
pub fn read_npy<T: npyz::Deserialize>(path: &std::path::Path) -> (Vec<usize>, Vec<T>) {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let npy = npyz::NpyFile::new(std::io::BufReader::new(f)).expect(".npy header");
    assert_eq!(npy.order(), npyz::Order::C, "{}", path.display());
    let shape = npy.shape().iter().map(|&d| d as usize).collect();
    (
        shape,
        npy.into_vec().expect(".npy data of the expected dtype"),
    )
}

/// Writes a C-order `.npy` file of `shape` (npyz, the dtype of `T`).
pub fn write_npy<T: npyz::AutoSerialize + Copy>(
    path: &std::path::Path,
    shape: &[usize],
    data: &[T],
) {
    use npyz::WriterBuilder;
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let f = std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape)
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .expect(".npy header");
    w.extend(data.iter().copied()).expect(".npy data");
    w.finish().expect(".npy written");
}

pub fn npy_f32(name: &str) -> (Vec<usize>, Vec<f32>) {
    read_npy(&fixture(name))
}

pub fn input_ids() -> Vec<u32> {
    let (_, ids) = read_npy::<i32>(&fixture("input_ids.npy"));
    ids.into_iter().map(|x| x as u32).collect()
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

/// A CPU session and a whole-model device session on `model` with `opts`, or `None` after
/// [`device::missing`] (no Vulkan device, or the model did not load on it).
pub fn device_pair(
    model: &Arc<Model>,
    opts: &SessionOptions,
    test: &str,
) -> Option<(Session, Session)> {
    let cpu = session(model, opts.clone());
    let gpu = device::or_skip(
        Session::new(
            model.clone(),
            SessionOptions {
                backend: BackendKind::Vulkan,
                ..opts.clone()
            },
        ),
        test,
        "Vulkan",
    )?;
    if !gpu.on_device() {
        device::missing(test, &"the whole model did not load on the device");
        return None;
    }
    Some((cpu, gpu))
}
