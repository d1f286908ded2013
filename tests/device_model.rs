//! The whole model on the Vulkan device (`--backend vulkan`: every op a shader, weights and
//! cache resident) against the CPU backend on the same model: the bundled model and random
//! models of other shapes (head_dim 32 and 16, FoX Pro and plain FoX, QK-norm per head and
//! shared, weights stored as f32, f16 and bf16, more heads than one dispatch's group of 8),
//! and a 512-token greedy stream with certified eviction under a budget; decode tokens the
//! retention policy cannot evict at run as one device submission each.
//!
//! Tolerance: |logit - cpu| <= 2e-3 (1 + |cpu|). Both sides compute in f32 from the same
//! f32 weights; they differ only in summation order (~1e-6 relative per op), carried
//! through at most 4 layers. A wrong op (a missed shift, a stale cache row, a wrong gate)
//! moves logits by O(0.1).
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.

mod common;

use common::synth::{Synth, config_json, safetensors_bytes, tensors, with_weights};
use common::*;
use foxedge::{Budget, Model, Session, SessionOptions};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn close(cpu: &[f32], dev: &[f32], what: &str) {
    for (j, (&c, &d)) in cpu.iter().zip(dev).enumerate() {
        let tol = 2e-3 * (1.0 + f64::from(c).abs());
        assert!(
            (f64::from(c) - f64::from(d)).abs() <= tol,
            "{what}: logit {j}: device {d} vs cpu {c}"
        );
    }
}

/// A prompt with every row's logits, then `steps` greedy tokens (the CPU's choice fed to
/// both), compared row by row; returns the two sessions.
fn compare(model: &Arc<Model>, opts: &SessionOptions, prompt: &[u32], steps: usize, test: &str) {
    let Some((mut cpu, mut gpu)) = device_pair(model, opts, test) else {
        return;
    };
    let v = model.info().vocab;
    let n = prompt.len();
    let (mut a, mut b) = (vec![0.0f32; n * v], vec![0.0f32; n * v]);
    cpu.feed(prompt, Some(&mut a)).unwrap();
    gpu.feed(prompt, Some(&mut b)).unwrap();
    for r in 0..n {
        close(
            &a[r * v..(r + 1) * v],
            &b[r * v..(r + 1) * v],
            &format!("{test}: prompt row {r}"),
        );
    }
    let mut last = a[(n - 1) * v..].to_vec();
    let (mut x, mut y) = (vec![0.0f32; v], vec![0.0f32; v]);
    for s in 0..steps {
        let t = (0..v).max_by(|&i, &j| last[i].total_cmp(&last[j])).unwrap() as u32;
        cpu.feed(&[t], Some(&mut x)).unwrap();
        gpu.feed(&[t], Some(&mut y)).unwrap();
        close(&x, &y, &format!("{test}: step {s}"));
        last.copy_from_slice(&x);
    }
    let st = gpu.stats();
    assert_eq!(st.device_layers, model.info().layers as u64);
    // One run for the prompt up to what the budget holds, one continuation run for the
    // rest, then one per token.
    let room = match opts.budget {
        Some(Budget::EntriesPerHead(b)) => b.min(n),
        _ => n,
    };
    assert_eq!(st.device_runs, (1 + usize::from(n > room) + steps) as u64);
    // ACP: the device's decisions (fused steps decide on the device) are the CPU's. A
    // prompt past the budget is one continuation call on the CPU (pruned per tile, its
    // queries blind to keys evicted before them) and a prefill then a continuation on the
    // device: other tiles.
    if n == room {
        assert_eq!(st.total_pairs, cpu.stats().total_pairs, "{test}");
        assert_eq!(st.kept_pairs, cpu.stats().kept_pairs, "{test}");
    } else {
        assert!(st.total_pairs >= cpu.stats().total_pairs, "{test}");
    }
    assert!(st.device_bytes_uploaded > 0);
    let layers = model.info().layers;
    for l in 0..layers {
        for h in 0..model.info().heads {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

#[test]
fn bundled_model_on_the_device_matches_cpu() {
    let model = tiny();
    let ids = input_ids();
    compare(&model, &dense_opts(), &ids[..80], 30, "bundled_model_dense");
    compare(
        &model,
        &SessionOptions::default(),
        &ids[..80],
        30,
        "bundled_model_acp",
    );
}

/// A random model of `s` stored as `dtype`, QK-norm weights shared across heads when
/// `shared`.
fn random_model(s: &Synth, dtype: &str, shared: bool, tag: &str) -> Arc<Model> {
    let mut ts = tensors(s);
    let mut cfg = config_json(s);
    if shared {
        let hd = s.hidden / s.heads;
        cfg = cfg.replace(
            r#""qk_norm_share_param_across_head": false"#,
            r#""qk_norm_share_param_across_head": true"#,
        );
        for (name, shape, vals) in &mut ts {
            if name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight") {
                *shape = vec![hd];
                vals.truncate(hd);
            }
        }
    }
    let dir = with_weights(&cfg, &safetensors_bytes(&ts, dtype), tag);
    let m = Model::open(&dir).expect("random model loads");
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(m)
}

#[test]
fn random_models_of_other_shapes_on_the_device_match_cpu() {
    let cases = [
        // head_dim 32, FoX Pro, per-head QK-norm, bf16 storage.
        (
            Synth {
                vocab: 300,
                hidden: 96,
                layers: 3,
                heads: 3,
                seed: 5,
                ..Synth::default()
            },
            "BF16",
            false,
        ),
        // head_dim 16, FoX Pro, shared QK-norm, f16 storage.
        (
            Synth {
                vocab: 200,
                hidden: 64,
                layers: 2,
                heads: 4,
                seed: 6,
                ..Synth::default()
            },
            "F16",
            true,
        ),
        // head_dim 48, plain FoX (no shifts, gates or norms), f32.
        (
            Synth {
                vocab: 128,
                hidden: 96,
                layers: 2,
                heads: 2,
                pro: false,
                seed: 7,
                ..Synth::default()
            },
            "F32",
            false,
        ),
        // head_dim 16, 10 heads: two groups of heads per attention dispatch, FoX Pro, f32.
        (
            Synth {
                vocab: 96,
                hidden: 160,
                layers: 2,
                heads: 10,
                seed: 8,
                ..Synth::default()
            },
            "F32",
            false,
        ),
    ];
    for (i, (s, dtype, shared)) in cases.iter().enumerate() {
        let model = random_model(s, dtype, *shared, &format!("devmodel{i}"));
        let mut r = rand::rngs::StdRng::seed_from_u64(11 + i as u64);
        let prompt: Vec<u32> = (0..40).map(|_| r.gen_range(0..s.vocab as u32)).collect();
        let opts = SessionOptions {
            budget: Some(Budget::EntriesPerHead(32)),
            window: 4,
            sinks: 2,
            ..SessionOptions::default()
        };
        compare(
            &model,
            &opts,
            &prompt,
            24,
            &format!("random model {i} ({dtype})"),
        );
    }
}

#[test]
fn a_512_token_stream_with_certified_eviction_and_a_budget_matches_cpu() {
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(96)),
        window: 16,
        sinks: 4,
        ..SessionOptions::default()
    };
    assert!(opts.certified_eviction && opts.ln_eps.is_some());
    let test = "a_512_token_stream_with_certified_eviction_and_a_budget_matches_cpu";
    let Some((mut cpu, mut gpu)) = device_pair(&model, &opts, test) else {
        return;
    };
    let v = model.info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..64], Some(&mut a)).unwrap();
    gpu.feed(&ids[..64], Some(&mut b)).unwrap();
    close(&a, &b, "prompt");
    let prompt_subs = gpu.stats().device_submissions;
    // Each side picks its own greedy token: the streams must agree token for token.
    for s in 64..512 {
        let ta = (0..v).max_by(|&i, &j| a[i].total_cmp(&a[j])).unwrap() as u32;
        let tb = (0..v).max_by(|&i, &j| b[i].total_cmp(&b[j])).unwrap() as u32;
        assert_eq!(ta, tb, "token {s}");
        cpu.feed(&[ta], Some(&mut a)).unwrap();
        gpu.feed(&[tb], Some(&mut b)).unwrap();
        close(&a, &b, &format!("token {s}"));
    }
    let (sc, sg) = (cpu.stats(), gpu.stats());
    assert!(
        sg.evicted_forced + sg.evicted_certified > 0,
        "the budget must evict"
    );
    assert_eq!(sg.evicted_forced, sc.evicted_forced);
    assert_eq!(sg.evicted_certified, sc.evicted_certified);
    assert_eq!(sg.tokens, 512);
    assert_eq!(sg.device_layers, 4);
    assert!(gpu.on_device());
    // Every decode token, evictions included, is one submission.
    assert_eq!(sg.device_submissions - prompt_subs, 512 - 64);
    assert_eq!(sg.total_pairs, sc.total_pairs);
    assert_eq!(sg.kept_pairs, sc.kept_pairs);
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// Every decode token is one device submission: its gates' cumulative sums, ACP decisions,
/// the retention policy's evictions (certified ones decided on the device from the host's
/// thresholds, forced ones by the budget) and its cache row are made on the device. Its
/// logits, cache positions, evictions and ACP decisions (kept / total pairs) equal the
/// CPU's, with certified eviction and without, under a budget that forces evictions.
#[test]
fn decode_tokens_with_evictions_are_one_submission() {
    let model = tiny();
    let ids = input_ids();
    let prompt = 180usize;
    for (i, certified_eviction) in [true, false].into_iter().enumerate() {
        let opts = SessionOptions {
            ln_eps: Some(if certified_eviction { -6.0 } else { -3.0 }),
            certified_eviction,
            budget: Some(Budget::EntriesPerHead(160)),
            window: 8,
            sinks: 2,
            ..SessionOptions::default()
        };
        let test = format!("decode_tokens_with_evictions_are_one_submission {i}");
        let Some((mut cpu, mut gpu)) = device_pair(&model, &opts, &test) else {
            return;
        };
        let v = model.info().vocab;
        let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
        cpu.feed(&ids[..prompt], Some(&mut a)).unwrap();
        gpu.feed(&ids[..prompt], Some(&mut b)).unwrap();
        close(&a, &b, "prompt");
        let (kept0, total0) = (cpu.stats().kept_pairs, cpu.stats().total_pairs);
        // The prompt is past the budget: a continuation on the CPU (pairs counted per
        // tile), tokens on the device; the decode steps' pairs are compared.
        let (gkept0, gtotal0) = (gpu.stats().kept_pairs, gpu.stats().total_pairs);
        let (cert0, forced0) = (cpu.stats().evicted_certified, cpu.stats().evicted_forced);
        for (j, &t) in ids[prompt..prompt + 60].iter().enumerate() {
            let before = gpu.stats().device_submissions;
            cpu.feed(&[t], Some(&mut a)).unwrap();
            gpu.feed(&[t], Some(&mut b)).unwrap();
            close(&a, &b, &format!("{test}: token {j}"));
            assert_eq!(
                gpu.stats().device_submissions - before,
                1,
                "{test}: token {j}"
            );
        }
        assert!(gpu.on_device());
        let (sc, sg) = (cpu.stats(), gpu.stats());
        assert!(sc.evicted_forced > forced0, "{test}: the budget must evict");
        if certified_eviction {
            assert!(sc.evicted_certified > cert0, "{test}: certified evictions");
        }
        assert_eq!(sg.evicted_forced, sc.evicted_forced);
        assert_eq!(sg.evicted_certified, sc.evicted_certified);
        assert_eq!(sg.total_pairs - gtotal0, sc.total_pairs - total0);
        assert_eq!(sg.kept_pairs - gkept0, sc.kept_pairs - kept0);
        // With certified eviction the cache holds few rows ACP could skip.
        assert!(
            certified_eviction || sc.kept_pairs - kept0 < sc.total_pairs - total0,
            "{test}: ACP must prune in decode: kept {} of {}",
            sc.kept_pairs - kept0,
            sc.total_pairs - total0
        );
        for l in 0..model.info().layers {
            for h in 0..model.info().heads {
                assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
            }
        }
    }
}

/// Scored forced evictions (the lowest caller score first) are no prefix of the age order
/// that a one-token step can decide on the device: those tokens take the per-layer path
/// (layers + 1 submissions), the others one submission, and the stream is the CPU's.
#[test]
fn scored_evictions_take_the_per_layer_path() {
    let model = tiny();
    let ids = input_ids();
    let (budget, prompt) = (48usize, 40usize);
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(budget)),
        window: 4,
        sinks: 2,
        scored: true,
        ..SessionOptions::default()
    };
    let test = "scored_evictions_take_the_per_layer_path";
    let Some((mut cpu, mut gpu)) = device_pair(&model, &opts, test) else {
        return;
    };
    let v = model.info().vocab;
    let layers = model.info().layers as u64;
    let score = |i: usize| ((i * 37) % 11) as f32;
    let sc: Vec<f32> = (0..prompt).map(score).collect();
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed_scored(&ids[..prompt], &sc, Some(&mut a)).unwrap();
    gpu.feed_scored(&ids[..prompt], &sc, Some(&mut b)).unwrap();
    close(&a, &b, "prompt");
    let (mut one, mut per_layer) = (0, 0);
    for (i, &t) in ids[prompt..prompt + 30].iter().enumerate() {
        let before = gpu.stats().device_submissions;
        let s = [score(prompt + i)];
        cpu.feed_scored(&[t], &s, Some(&mut a)).unwrap();
        gpu.feed_scored(&[t], &s, Some(&mut b)).unwrap();
        close(&a, &b, &format!("token {i}"));
        match gpu.stats().device_submissions - before {
            1 => one += 1,
            n => {
                assert_eq!(n, layers + 1, "token {i}");
                per_layer += 1;
            }
        }
    }
    assert!(
        one > 0 && per_layer > 0,
        "{one} one-submission, {per_layer} per-layer"
    );
    let (sc, sg) = (cpu.stats(), gpu.stats());
    assert!(sg.evicted_forced > 0);
    assert_eq!(sg.evicted_forced, sc.evicted_forced);
    assert_eq!(sg.evicted_certified, sc.evicted_certified);
    for l in 0..model.info().layers {
        for h in 0..model.info().heads {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// A prompt longer than `prefill_chunk`: the first chunk runs the prefill kernels, every
/// later chunk is one continuation run (`layers + 1` submissions); every row's logits,
/// the ACP pair counts and the cache equal the CPU's.
#[test]
fn prompt_chunks_after_the_first_are_one_run_each() {
    let model = tiny();
    let ids = input_ids();
    let (chunk, n) = (32usize, 80usize);
    let opts = SessionOptions {
        prefill_chunk: chunk,
        ..SessionOptions::default()
    };
    let test = "prompt_chunks_after_the_first_are_one_run_each";
    let Some((mut cpu, mut gpu)) = device_pair(&model, &opts, test) else {
        return;
    };
    let v = model.info().vocab;
    let (mut a, mut b) = (vec![0.0f32; n * v], vec![0.0f32; n * v]);
    cpu.feed(&ids[..n], Some(&mut a)).unwrap();
    gpu.feed(&ids[..n], Some(&mut b)).unwrap();
    for r in 0..n {
        close(
            &a[r * v..(r + 1) * v],
            &b[r * v..(r + 1) * v],
            &format!("{test}: row {r}"),
        );
    }
    let layers = model.info().layers as u64;
    let st = gpu.stats();
    assert_eq!(
        st.device_submissions,
        (layers + 1) * n.div_ceil(chunk) as u64
    );
    assert_eq!(st.kept_pairs, cpu.stats().kept_pairs);
    for l in 0..model.info().layers {
        for h in 0..model.info().heads {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// Continuation: a stream fed in chunks of random sizes after a long first chunk. A chunk
/// after the first runs the continuation kernel, on the device (`continue.comp`, one run)
/// and on the CPU. Every row's logits within
/// the tolerance, with certified eviction and a budget; the caches hold the same positions.
#[test]
fn continuation_chunks_on_the_device_match_cpu() {
    let test = "continuation_chunks_on_the_device_match_cpu";
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(96)),
        window: 8,
        sinks: 2,
        ..SessionOptions::default()
    };
    let Some((mut cpu, mut gpu)) = device_pair(&model, &opts, test) else {
        return;
    };
    let v = model.info().vocab;
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let mut at = 0;
    let mut n = 120;
    while at < 400 {
        let (mut a, mut b) = (vec![0.0f32; n * v], vec![0.0f32; n * v]);
        cpu.feed(&ids[at..at + n], Some(&mut a)).unwrap();
        gpu.feed(&ids[at..at + n], Some(&mut b)).unwrap();
        for r in 0..n {
            let (x, y) = (&a[r * v..(r + 1) * v], &b[r * v..(r + 1) * v]);
            close(x, y, &format!("{test}: token {}", at + r));
        }
        at += n;
        n = [1, 2, 5, 17, 40][rng.gen_range(0..5)].min(400 - at).max(1);
    }
    // The stream is the CPU's whether or not the device kept it to the end (a one-token
    // step whose evictions the host's policy does not confirm moves the session to the CPU).
    assert!(gpu.stats().evicted_forced > 0, "the budget must evict");
    for l in 0..4 {
        for h in 0..4 {
            let sorted = |s: &Session| {
                let mut p = s.cache_positions(l, h).unwrap();
                p.sort_unstable();
                p
            };
            assert_eq!(sorted(&cpu), sorted(&gpu), "layer {l} head {h}");
        }
    }
}
