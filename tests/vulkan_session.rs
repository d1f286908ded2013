//! Sessions on the Vulkan backend, whose decode runs against device-resident cache mirrors
//! (only rows written since the last step are uploaded), against the same sessions on the
//! CPU: a bounded cache (forced evictions move rows by swap-delete), gate-origin re-basing
//! (every row's c changes), and reset.
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.
//!
//! Tolerance: logits |diff| <= 2e-3 (logits are O(10); the kernels differ by ~1e-6 relative
//! per attention output, carried through the layers). A stale mirror row is far outside it:
//! a stale c after re-basing is off by ~1e4 nats (a non-finite softmax, an error), a stale
//! k/v row moves outputs by O(0.1).

mod common;

use common::synth::{Synth, write_model};
use common::*;
use foxedge::{BackendKind, Budget, Model, Session, SessionOptions};
use std::sync::Arc;

fn vulkan_or_skip(model: &Arc<Model>, opts: &SessionOptions, test: &str) -> Option<Session> {
    let opts = SessionOptions {
        backend: BackendKind::Vulkan,
        ..opts.clone()
    };
    or_skip(Session::new(model.clone(), opts), test, "Vulkan")
}

fn worst(a: &[f32], b: &[f32]) -> f64 {
    errors(a, b).0
}

#[test]
fn vulkan_session_with_budget_eviction_matches_cpu() {
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(40)),
        window: 8,
        sinks: 4,
        ..Default::default()
    };
    let Some(mut gpu) = vulkan_or_skip(
        &model,
        &opts,
        "vulkan_session_with_budget_eviction_matches_cpu",
    ) else {
        return;
    };
    assert_eq!(gpu.backend(), BackendKind::Vulkan);
    let mut cpu = session(&model, opts);
    let v = model.info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..100], Some(&mut a)).unwrap();
    gpu.feed(&ids[..100], Some(&mut b)).unwrap();
    let mut max = worst(&b, &a);
    for &t in &ids[100..260] {
        cpu.feed(&[t], Some(&mut a)).unwrap();
        gpu.feed(&[t], Some(&mut b)).unwrap();
        max = max.max(worst(&b, &a));
    }
    let (sc, sg) = (cpu.stats(), gpu.stats());
    eprintln!(
        "budget 40/head: forced {} certified {}, worst logit diff {max:.2e}",
        sg.evicted_forced, sg.evicted_certified
    );
    assert!(sg.evicted_forced > 0, "the budget must move rows");
    assert!(max <= 2e-3, "logits differ by {max}");
    // Pair counts follow the calls, which differ here: the CPU runs the 100-token prompt
    // (past the budget) as one continuation call, its queries seeing what token-by-token
    // feeding sees, ACP pruning per tile; the device prefills the first 40 tokens (what
    // the budget holds) as a chunk and the rest one token per run, ACP per block of keys.
    assert!(sg.kept_pairs <= sg.total_pairs && sc.kept_pairs <= sc.total_pairs);
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// Gates of logit -12 (log f ~ -12 per token) re-base the gate origin every ~830 tokens,
/// which rewrites every cached c; a bounded cache keeps moving rows. Then both sessions are
/// reset and streamed again: the new cache heads must not see the old mirrors.
#[test]
fn vulkan_session_rebases_and_resets_like_cpu() {
    let syn = Synth {
        vocab: 16,
        hidden: 16,
        layers: 1,
        heads: 2,
        pro: true,
        seed: 9,
        const_gate_logit: Some(-12.0),
    };
    let dir = write_model(&syn, "vulkan_rebase");
    let model = Arc::new(Model::open(&dir).unwrap());
    let opts = SessionOptions {
        ln_eps: None,
        certified_eviction: false,
        budget: Some(Budget::EntriesPerHead(24)),
        window: 4,
        ..Default::default()
    };
    let Some(mut gpu) = vulkan_or_skip(&model, &opts, "vulkan_session_rebases_and_resets_like_cpu")
    else {
        std::fs::remove_dir_all(dir).ok();
        return;
    };
    let mut cpu = session(&model, opts);
    let mut rng = 0x9e37_79b9u64;
    let toks: Vec<u32> = (0..2000)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % 16) as u32
        })
        .collect();
    let (mut a, mut b) = (vec![0.0f32; 16], vec![0.0f32; 16]);
    let mut max = 0.0f64;
    for (round, stream) in [&toks[..1800], &toks[1800..]].into_iter().enumerate() {
        for &t in stream {
            cpu.feed(&[t], Some(&mut a)).unwrap();
            gpu.feed(&[t], Some(&mut b)).unwrap();
            max = max.max(worst(&b, &a));
        }
        assert!(max <= 2e-3, "round {round}: logits differ by {max}");
        cpu.reset().unwrap();
        gpu.reset().unwrap();
    }
    eprintln!("re-basing stream + reset: worst logit diff {max:.2e}");
    std::fs::remove_dir_all(dir).ok();
}
