//! A model whose weights exceed the device budget (`FOXEDGE_DEVICE_MODEL_BUDGET`) runs on
//! the CPU under `--backend vulkan` (attention on the device's attention kernels), with
//! the CPU session's logits within 2e-3 (1 + |logit|). Its own test binary: it sets an
//! environment variable that every model upload reads.

mod common;

use common::synth::{Synth, write_model_dtype};
use common::*;
use foxedge::{BackendKind, Model, Session, SessionOptions};
use std::sync::Arc;

#[test]
fn a_model_over_the_device_budget_runs_on_the_cpu() {
    let s = Synth {
        vocab: 64,
        hidden: 32,
        layers: 1,
        heads: 2,
        seed: 9,
        ..Synth::default()
    };
    let dir = write_model_dtype(&s, "devbudget", "F32");
    let model = Arc::new(Model::open(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: this binary's only test; nothing else reads or writes the environment
    // while it runs.
    unsafe { std::env::set_var("FOXEDGE_DEVICE_MODEL_BUDGET", "1000") };
    let r = Session::new(
        model.clone(),
        SessionOptions {
            backend: BackendKind::Vulkan,
            ..SessionOptions::default()
        },
    );
    // SAFETY: as above.
    unsafe { std::env::remove_var("FOXEDGE_DEVICE_MODEL_BUDGET") };
    let Some(mut gpu) = or_skip(
        r,
        "a_model_over_the_device_budget_runs_on_the_cpu",
        "Vulkan",
    ) else {
        return;
    };
    assert!(!gpu.on_device());
    let mut cpu = session(&model, SessionOptions::default());
    let v = s.vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&[1, 2, 3], Some(&mut a)).unwrap();
    gpu.feed(&[1, 2, 3], Some(&mut b)).unwrap();
    // Its layers run on the CPU, its attention on the Vulkan attention backend.
    for (&x, &y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 2e-3 * (1.0 + x.abs()), "{x} vs {y}");
    }
    assert_eq!(gpu.stats().device_layers, 0);
}
