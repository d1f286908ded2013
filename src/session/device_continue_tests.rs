//! Continuation chunks of a whole-model device session (`continue.comp`): a chunk fed to a
//! stream that has a cache runs as one device run (one tiled pass per layer), and the
//! stream equals the CPU session's fed the same chunks: logits within 2e-3 absolute (the
//! bundled model's logits are O(10); the device's f32 sums differ from the CPU's by ~1e-6
//! relative per op over 4 layers), the same cache positions and eviction counts, and the
//! same ACP pair counts (the device's tile decisions are the CPU kernel's).
use super::device_model::tests::{ids, pair, worst};
use super::*;
use rand::{Rng, SeedableRng};

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0
}

fn same_caches(cpu: &Session, gpu: &Session, what: &str) {
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(
                gpu.cache_positions(l, h),
                cpu.cache_positions(l, h),
                "{what}: layer {l} head {h}"
            );
        }
    }
}

/// Feeds `ids` in random chunks (1..=`max_chunk` tokens) to both sessions: after every
/// chunk the last logits agree, the caches hold the same positions, the evictions and (with
/// a certified bound, where the device decides from the same f64 `c` and bound) the ACP
/// pair counts are the CPU's, and every multi-token chunk is one device run.
/// Returns the device session's statistics (`None`: skipped).
fn random_chunks(
    test: &str,
    opts: SessionOptions,
    seed: u64,
    max_chunk: usize,
    total: usize,
) -> Option<SessionStats> {
    let (mut cpu, mut gpu) = pair(test, &opts)?;
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut at = 0;
    let mut chunks = 0;
    while at < total {
        let n = rng.gen_range(1..=max_chunk).min(total - at);
        let fresh = at == 0;
        let runs = gpu.stats().device_runs;
        cpu.feed(&ids[at..at + n], Some(&mut a)).unwrap();
        gpu.feed(&ids[at..at + n], Some(&mut b)).unwrap();
        at += n;
        let what = format!("chunk {chunks} ({n} tokens, to {at})");
        assert!(gpu.on_device(), "{what}");
        assert!(worst(&a, &b) <= 2e-3, "{what}: {}", worst(&a, &b));
        same_caches(&cpu, &gpu, &what);
        let (sc, sg) = (cpu.stats(), gpu.stats());
        assert_eq!(sg.evicted_forced, sc.evicted_forced, "{what}");
        assert_eq!(sg.evicted_certified, sc.evicted_certified, "{what}");
        if !fresh && n > 1 {
            assert_eq!(sg.device_runs - runs, 1, "{what}: one run for the chunk");
            assert_eq!(sg.total_pairs, sc.total_pairs, "{what}");
            assert_eq!(sg.kept_pairs, sc.kept_pairs, "{what}");
        }
        chunks += 1;
    }
    Some(gpu.stats())
}

#[test]
fn continuation_chunks_equal_the_cpu() {
    let test = "continuation_chunks_equal_the_cpu";
    random_chunks(test, SessionOptions::default(), 1, 90, 400);
}

/// With a loose eps (ln eps = -0.01: pruned weights below ~1/N each) ACP skips some of the
/// continuation's tiles on this stream, and the device skips the same ones.
#[test]
fn continuation_chunks_with_pruned_tiles_equal_the_cpu() {
    let test = "continuation_chunks_with_pruned_tiles_equal_the_cpu";
    let opts = SessionOptions {
        ln_eps: Some(-0.01),
        ..SessionOptions::default()
    };
    if let Some(st) = random_chunks(test, opts, 6, 200, 1000) {
        assert!(
            st.kept_pairs < st.total_pairs,
            "{} of {}",
            st.kept_pairs,
            st.total_pairs
        );
    }
}

#[test]
fn continuation_chunks_under_a_budget_equal_the_cpu() {
    random_chunks(
        "continuation_chunks_under_a_budget_equal_the_cpu",
        SessionOptions {
            budget: Some(Budget::EntriesPerHead(96)),
            window: 8,
            sinks: 2,
            ..SessionOptions::default()
        },
        2,
        150,
        500,
    );
}

#[test]
fn continuation_chunks_with_forced_evictions_only_equal_the_cpu() {
    random_chunks(
        "continuation_chunks_with_forced_evictions_only_equal_the_cpu",
        SessionOptions {
            certified_eviction: false,
            budget: Some(Budget::EntriesPerHead(64)),
            window: 4,
            sinks: 1,
            ..SessionOptions::default()
        },
        3,
        130,
        400,
    );
}

#[test]
fn continuation_chunks_without_acp_equal_the_cpu() {
    random_chunks(
        "continuation_chunks_without_acp_equal_the_cpu",
        SessionOptions {
            ln_eps: None,
            budget: Some(Budget::EntriesPerHead(80)),
            window: 8,
            ..SessionOptions::default()
        },
        4,
        100,
        300,
    );
}

/// A prompt of more than two `prefill_chunk`s fed at once, then greedy decoding: every
/// chunk after the first is a device continuation, and the stream is the CPU's (the same
/// greedy tokens, logits within the tolerance).
#[test]
fn long_prompt_in_chunks_equals_the_cpu_stream() {
    let test = "long_prompt_in_chunks_equals_the_cpu_stream";
    let opts = SessionOptions {
        prefill_chunk: 96,
        budget: Some(Budget::EntriesPerHead(200)),
        window: 16,
        sinks: 4,
        ..SessionOptions::default()
    };
    let Some((mut cpu, mut gpu)) = pair(test, &opts) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let prompt = &ids[..700];
    let (mut a, mut b) = (
        vec![0.0f32; prompt.len() * v],
        vec![0.0f32; prompt.len() * v],
    );
    cpu.feed(prompt, Some(&mut a)).unwrap();
    gpu.feed(prompt, Some(&mut b)).unwrap();
    assert!(gpu.on_device());
    // One run per chunk.
    assert_eq!(gpu.stats().device_runs, prompt.len().div_ceil(96) as u64);
    assert!(worst(&a, &b) <= 2e-3, "prompt: {}", worst(&a, &b));
    same_caches(&cpu, &gpu, "prompt");
    assert!(cpu.stats().evicted_certified + cpu.stats().evicted_forced > 0);
    let (mut ta, mut tb) = (
        argmax(&a[(prompt.len() - 1) * v..]),
        argmax(&b[(prompt.len() - 1) * v..]),
    );
    let (mut la, mut lb) = (vec![0.0f32; v], vec![0.0f32; v]);
    for i in 0..24 {
        assert_eq!(ta, tb, "greedy token {i}");
        cpu.feed(&[ta as u32], Some(&mut la)).unwrap();
        gpu.feed(&[tb as u32], Some(&mut lb)).unwrap();
        assert!(worst(&la, &lb) <= 2e-3, "token {i}: {}", worst(&la, &lb));
        ta = argmax(&la);
        tb = argmax(&lb);
    }
    same_caches(&cpu, &gpu, "decode");
}

/// Loses the device at submission `k` of a continuation chunk's run (after `k` layers'
/// bookkeeping): the session finishes the chunk on the CPU and the stream stays the CPU
/// session's.
fn loss_in_a_continuation(test: &str, k: u64) {
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(48)),
        window: 8,
        sinks: 2,
        ..SessionOptions::default()
    };
    let Some((mut cpu, mut gpu)) = pair(test, &opts) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..40], Some(&mut a)).unwrap();
    gpu.feed(&ids[..40], Some(&mut b)).unwrap();
    assert!(gpu.inject_device_loss(k));
    cpu.feed(&ids[40..100], Some(&mut a)).unwrap();
    gpu.feed(&ids[40..100], Some(&mut b)).unwrap();
    assert!(!gpu.on_device(), "the device was lost");
    assert!(worst(&a, &b) <= 2e-3, "{}", worst(&a, &b));
    same_caches(&cpu, &gpu, "after the loss");
    for (i, &t) in ids[100..130].iter().enumerate() {
        cpu.feed(&[t], Some(&mut a)).unwrap();
        gpu.feed(&[t], Some(&mut b)).unwrap();
        assert!(worst(&a, &b) <= 2e-3, "token {i}: {}", worst(&a, &b));
    }
    same_caches(&cpu, &gpu, "decode");
    assert_eq!(gpu.stats().tokens, cpu.stats().tokens);
}

#[test]
fn device_loss_in_a_continuation_chunk_keeps_the_stream() {
    for k in [0, 2, 4] {
        loss_in_a_continuation("device_loss_in_a_continuation_chunk_keeps_the_stream", k);
    }
}

/// With the default `prefill_chunk` a device session takes a prompt of up to
/// `DEVICE_PREFILL_CHUNK` tokens in one run (the CPU in chunks of 512): the same stream.
#[test]
fn default_chunks_grow_on_the_device() {
    let test = "default_chunks_grow_on_the_device";
    let Some((mut cpu, mut gpu)) = pair(test, &SessionOptions::default()) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..1000], Some(&mut a)).unwrap();
    gpu.feed(&ids[..1000], Some(&mut b)).unwrap();
    assert_eq!(gpu.stats().device_runs, 1);
    assert!(worst(&a, &b) <= 2e-3, "{}", worst(&a, &b));
    same_caches(&cpu, &gpu, "prompt");
}
