//! The hybrid backend and `auto` selection against the CPU backend.
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing Vulkan device fails the
//! tests that need one; without it they print why and return.
//!
//! Tolerance: both backends compute in f32 with an online softmax; outputs are convex
//! combinations of v (|v| <= ~4 on the model's values), and the two kernels differ only in
//! summation order and `exp` implementation, ~1e-6 relative. We check |diff| <= 1e-4 absolute
//! (+1e-4 relative), far below any real error (a wrong head or a missed block moves outputs
//! by O(1e-2) or more). Kept-pair statistics must match exactly (both come from
//! foxedge-core's boundary).

mod common;

use common::workload::read_token_rows;
use common::{fixture, input_ids, or_skip, tiny};
use foxedge::attention::capture_text;
use foxedge::attention::{AcpMode, Engine, PrefillInputs};
use foxedge::{BackendKind, ErrorKind, Model, Session, SessionOptions};
use std::sync::{Arc, OnceLock};

/// The engine `kind` on the default device, or None (printing why) when there is no Vulkan
/// device and `CI` is unset.
fn engine_or_skip(kind: BackendKind, test: &str) -> Option<Engine> {
    or_skip(Engine::new(kind), test, &kind.to_string())
}

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(tiny).clone()
}

/// The model's 16 real heads (4 layers x 4) over the first `len` tokens of the long fixture.
fn real(len: usize) -> PrefillInputs {
    let rows = read_token_rows(&fixture("long_input_ids.npy"));
    capture_text(&model(), &rows, len).unwrap()
}

/// A random problem with per-head gate strengths from nearly 0 (global) to strong (local).
fn random_problem(t: usize, heads: usize, d: usize, seed: u64) -> PrefillInputs {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let n = t * heads * d;
    let mut g = |k: usize| {
        (0..k)
            .map(|_| r.gen_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    let (q, k, v) = (g(n), g(n), g(n));
    let log_f = (0..t * heads)
        .map(|i| -0.002 * (1 + 40 * (i % heads)) as f32)
        .collect();
    // |s q.k| <= s |q| |k| <= sqrt(d)/... : inputs in [-1,1]^d give |q.k| <= d.
    let u = vec![(d as f64).sqrt(); heads];
    PrefillInputs {
        t,
        heads,
        head_dim: d,
        q,
        k,
        v,
        log_f,
        u,
    }
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f32;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = 1e-4 + 1e-4 * y.abs();
        assert!((x - y).abs() <= tol, "{what}: element {i}: {x} vs {y}");
        worst = worst.max((x - y).abs());
    }
    eprintln!("{what}: max |diff| {worst:.2e}");
}

#[test]
fn hybrid_prefill_equals_cpu_random_and_splits_heads() {
    let Some(hy) = engine_or_skip(BackendKind::Hybrid, "hybrid_prefill") else {
        return;
    };
    let cpu = Engine::new(BackendKind::Cpu).unwrap();
    let p = random_problem(333, 6, 64, 7);
    for acp in [AcpMode::Off, AcpMode::Bound { ln_eps: -10.0 }] {
        let mut a = vec![0.0; p.q.len()];
        let mut b = vec![0.0; p.q.len()];
        let sa = hy.prefill(&p, acp, &mut a).unwrap();
        let sb = cpu.prefill(&p, acp, &mut b).unwrap();
        assert_eq!(sa, sb, "per-head statistics");
        assert_close(&a, &b, &format!("hybrid prefill {acp:?}"));
        let split = hy.last_split().unwrap();
        assert!(!split.gpu_heads.is_empty() && !split.cpu_heads.is_empty());
        let mut all: Vec<usize> = split
            .gpu_heads
            .iter()
            .chain(&split.cpu_heads)
            .copied()
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..6).collect::<Vec<_>>(), "every head exactly once");
    }
    assert_eq!(hy.kind(), BackendKind::Hybrid);
    assert!(hy.calibrate(p.heads, p.head_dim).unwrap().is_some());
}

#[test]
fn hybrid_on_real_gates_prefill_and_decode_equal_cpu() {
    let Some(hy) = engine_or_skip(BackendKind::Hybrid, "hybrid_real") else {
        return;
    };
    let cpu = Engine::new(BackendKind::Cpu).unwrap();
    let p = real(1024);
    assert_eq!(p.heads, 16);
    let acp = AcpMode::Bound { ln_eps: -10.0 };
    let mut a = vec![0.0; p.q.len()];
    let mut b = vec![0.0; p.q.len()];
    let sa = hy.prefill(&p, acp, &mut a).unwrap();
    let sb = cpu.prefill(&p, acp, &mut b).unwrap();
    assert_eq!(sa, sb);
    assert!(sa.kept_fraction() < 1.0, "real gates prune something");
    assert_close(&a, &b, "hybrid prefill, real gates");
    for n in [1024, 700] {
        let d = p.decode_at(n).unwrap();
        let mut a = vec![0.0; d.q.len()];
        let mut b = vec![0.0; d.q.len()];
        let sa = hy.decode(&d, acp, &mut a).unwrap();
        let sb = cpu.decode(&d, acp, &mut b).unwrap();
        assert_eq!(sa, sb);
        assert_close(&a, &b, &format!("hybrid decode at {n}"));
        let s = hy.last_split().unwrap();
        assert!(!s.gpu_heads.is_empty() && !s.cpu_heads.is_empty());
    }
}

#[test]
fn repeated_decode_steps_equal_cpu_on_every_backend() {
    // Engine::decode of one problem is a session's step: a backend that keeps the cache
    // resident sends it once, then only the rewritten newest row. Every step, and a clone
    // (a new cache), must equal the CPU.
    let Some(vk) = engine_or_skip(BackendKind::Vulkan, "repeated_decode") else {
        return;
    };
    let engines = [
        ("vulkan", vk),
        ("hybrid", Engine::new(BackendKind::Hybrid).unwrap()),
        ("auto", Engine::new(BackendKind::Auto).unwrap()),
    ];
    let cpu = Engine::new(BackendKind::Cpu).unwrap();
    let p = random_problem(900, 4, 32, 11);
    let d = p.decode_at(900).unwrap();
    for acp in [AcpMode::Off, AcpMode::Bound { ln_eps: -10.0 }] {
        let mut want = vec![0.0; d.q.len()];
        let sw = cpu.decode(&d, acp, &mut want).unwrap();
        for (name, e) in &engines {
            for step in 0..3 {
                let mut got = vec![0.0; d.q.len()];
                let sg = e.decode(&d, acp, &mut got).unwrap();
                assert_eq!(sg, sw, "{name} step {step}");
                assert_close(&got, &want, &format!("{name} decode step {step} {acp:?}"));
            }
            let mut got = vec![0.0; d.q.len()];
            e.decode(&d.clone(), acp, &mut got).unwrap();
            assert_close(&got, &want, &format!("{name} decode of a clone"));
        }
    }
    let plans = engines[1].1.plan_counts();
    assert!(plans.split > 0, "hybrid split: {plans:?}");
}

#[test]
fn session_on_hybrid_and_auto_matches_cpu_logits() {
    if engine_or_skip(BackendKind::Hybrid, "session_hybrid").is_none() {
        return;
    }
    let m = model();
    let ids = input_ids();
    let v = m.info().vocab;
    let run = |backend: BackendKind| {
        let mut s = Session::new(
            m.clone(),
            SessionOptions {
                backend,
                ..Default::default()
            },
        )
        .unwrap();
        let mut lp = vec![0.0f32; ids.len() * v];
        s.feed(&ids[..512], Some(&mut lp[..512 * v])).unwrap();
        // Then one token at a time: the decode path, split revisited at every step.
        for (i, &t) in ids[512..540].iter().enumerate() {
            let r = 512 + i;
            s.feed(&[t], Some(&mut lp[r * v..(r + 1) * v])).unwrap();
        }
        (lp[..540 * v].to_vec(), s.backend(), s.stats())
    };
    let (cpu, kc, sc) = run(BackendKind::Cpu);
    assert_eq!(kc, BackendKind::Cpu);
    for b in [BackendKind::Hybrid, BackendKind::Auto] {
        let (x, k, st) = run(b);
        assert_eq!(k, b, "no fallback expected");
        assert_eq!(st.kept_pairs, sc.kept_pairs);
        // Logits are O(10); attention differences ~1e-6 pass through 4 layers.
        let worst = x
            .iter()
            .zip(&cpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= 2e-3, "{b}: logits differ by {worst}");
    }
}

#[test]
fn auto_falls_back_to_cpu_without_a_device() {
    let none = Some("no-such-vulkan-device-xyz");
    let auto = Engine::with_device(BackendKind::Auto, none).unwrap();
    assert_eq!(auto.kind(), BackendKind::Cpu);
    assert_eq!(auto.device(), None);
    let p = random_problem(100, 2, 32, 3);
    let mut a = vec![0.0; p.q.len()];
    let mut b = vec![0.0; p.q.len()];
    auto.prefill(&p, AcpMode::Off, &mut a).unwrap();
    Engine::new(BackendKind::Cpu)
        .unwrap()
        .prefill(&p, AcpMode::Off, &mut b)
        .unwrap();
    assert_eq!(a, b);
    for k in [BackendKind::Vulkan, BackendKind::Hybrid] {
        let e = Engine::with_device(k, none).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BackendUnavailable, "{k}: {e}");
    }
}

#[test]
fn cli_auto_without_device_says_so_and_reports_cpu() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_foxedge"))
        .args([
            "generate",
            "--prompt",
            "def f",
            "--max-tokens",
            "4",
            "--backend",
            "auto",
            "--json",
        ])
        .env("FOXEDGE_VULKAN_DEVICE", "no-such-vulkan-device-xyz")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stderr: {stderr}");
    assert_eq!(
        stderr.matches("auto backend").count(),
        1,
        "said once: {stderr}"
    );
    assert!(
        stdout.contains("\"backend\": \"cpu\"") || stdout.contains("\"backend\":\"cpu\""),
        "{stdout}"
    );
}

#[test]
fn bad_problems_are_errors() {
    let cpu = Engine::new(BackendKind::Cpu).unwrap();
    let mut p = random_problem(10, 2, 8, 1);
    let mut out = vec![0.0; p.q.len()];
    p.log_f[3] = 0.5;
    assert_eq!(
        cpu.prefill(&p, AcpMode::Off, &mut out).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let p = random_problem(10, 2, 8, 1);
    assert!(cpu.prefill(&p, AcpMode::Off, &mut out[..5]).is_err());
    assert!(p.prefix(11).is_err());
    assert!(p.decode_at(0).is_err());
}
