//! Streaming with a bounded cache: certified eviction, budgets, windows, sinks, scores,
//! and a 1,000,000-token stream that exercises re-basing of the gate origin.

mod common;

use common::synth::{Synth, write_model};
use common::*;
use foxedge::{Budget, Model, SessionOptions};
use std::sync::Arc;

/// Certified eviction (ln eps = -10) against the full cache on the golden text: entries
/// leave, every head's certificate stays <= eps, and the logits move by far less than
/// the fp32 golden tolerance (each layer's attention output changes by at most
/// 2·B_t·max|v| with B_t <= e^-10 = 4.5e-5).
#[test]
fn certified_eviction_matches_full_cache_within_bound() {
    let model = tiny();
    let ids = input_ids();
    let mut full = session(
        &model,
        SessionOptions {
            certified_eviction: false,
            ..Default::default()
        },
    );
    let mut cert = session(&model, SessionOptions::default());
    let (mut a, mut b) = (vec![0.0f32; 256], vec![0.0f32; 256]);
    let mut worst = 0.0f64;
    // Prefill 200 tokens, then stream the rest one at a time.
    full.feed(&ids[..200], Some(&mut a)).unwrap();
    cert.feed(&ids[..200], Some(&mut b)).unwrap();
    for &id in &ids[200..] {
        full.feed(&[id], Some(&mut a)).unwrap();
        cert.feed(&[id], Some(&mut b)).unwrap();
        worst = worst.max(errors(&b, &a).0);
    }
    let st = cert.stats();
    eprintln!(
        "certified: live {} evicted {} max B_t {:?} worst logit diff {worst:.3e}",
        st.live_entries, st.evicted_certified, st.max_bound
    );
    assert!(st.evicted_certified > 0, "local heads must shed entries");
    assert_eq!(st.evicted_forced, 0);
    let eps = (-10f64).exp() * (1.0 + 1e-9);
    assert!(st.max_bound.is_some_and(|b| b <= eps), "{:?}", st.max_bound);
    assert!(
        st.bound_per_head
            .iter()
            .all(|b| b.is_some_and(|b| b <= eps))
    );
    assert_eq!(st.live_entries + st.evicted_certified, 16 * 1024);
    assert!(
        worst <= 1e-3,
        "certified eviction moved a logit by {worst:.3e}"
    );
    assert!(full.stats().evicted_certified == 0);
}

/// A hard budget per head with a window and sinks: no head ever holds more than the
/// budget, protected tokens stay, and the certificate is reported (above eps when forced).
#[test]
fn budget_window_sinks_are_respected() {
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(48)),
        window: 16,
        sinks: 4,
        ..Default::default()
    };
    let mut s = session(&model, opts);
    let mut logits = vec![0.0f32; 256];
    s.feed(&ids[..100], Some(&mut logits)).unwrap();
    for (i, &id) in ids[100..600].iter().enumerate() {
        s.feed(&[id], Some(&mut logits)).unwrap();
        for l in 0..4 {
            for h in 0..4 {
                let n = s.cache_len(l, h).unwrap();
                assert!(n <= 48, "step {i}: layer {l} head {h} holds {n}");
            }
        }
        assert!(logits.iter().all(|x| x.is_finite()));
    }
    let st = s.stats();
    assert!(st.evicted_forced > 0);
    assert!(
        st.peak_cache_bytes
            <= 16 * 48 * foxedge::session::entry_bytes(64, foxedge::CacheDtype::default()) as u64
    );
    // Forced evictions: per head a certificate in (0, 1), or no guarantee; the largest is
    // None exactly when some head has none.
    assert!(
        st.bound_per_head
            .iter()
            .flatten()
            .all(|&b| b > 0.0 && b < 1.0)
    );
    let worst = st
        .bound_per_head
        .iter()
        .try_fold(0.0f64, |m, b| b.map(|b| m.max(b)));
    assert_eq!(st.max_bound, worst);
    assert!(st.max_bound != Some(0.0));
    for l in 0..4 {
        for h in 0..4 {
            let pos = s.cache_positions(l, h).unwrap();
            for p in 0..4u64 {
                assert!(pos.contains(&p), "sink {p} evicted from {l}/{h}");
            }
            for p in 584..600u64 {
                assert!(pos.contains(&p), "window token {p} evicted from {l}/{h}");
            }
        }
    }
}

/// A layer budget and a byte budget bound the total; caller scores choose the victims.
#[test]
fn layer_byte_and_scored_budgets() {
    let model = tiny();
    let ids = input_ids();
    let eb = foxedge::session::entry_bytes(64, foxedge::CacheDtype::default());
    for budget in [Budget::EntriesPerLayer(100), Budget::Bytes(4 * 100 * eb)] {
        let mut s = session(
            &model,
            SessionOptions {
                budget: Some(budget),
                window: 8,
                ..Default::default()
            },
        );
        for &id in &ids[..300] {
            s.feed(&[id], None).unwrap();
            for l in 0..4 {
                let total: usize = (0..4).map(|h| s.cache_len(l, h).unwrap()).sum();
                assert!(total <= 100, "{budget:?}: layer {l} holds {total}");
            }
        }
    }
    // Scores: even positions get high scores, so the budget evicts odd ones first.
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(40)),
        window: 4,
        scored: true,
        certified_eviction: false,
        ..Default::default()
    };
    let mut s = session(&model, opts);
    assert!(
        s.feed(&ids[..3], None).is_err(),
        "scored session refuses feed without scores"
    );
    for (t, &id) in ids[..200].iter().enumerate() {
        let score = if t % 2 == 0 { 10.0 } else { -10.0 };
        s.feed_scored(&[id], &[score], None).unwrap();
    }
    for l in 0..4 {
        for h in 0..4 {
            let pos = s.cache_positions(l, h).unwrap();
            assert_eq!(pos.len(), 40);
            let old_odd = pos.iter().filter(|&&p| p % 2 == 1 && p < 196).count();
            assert_eq!(
                old_odd, 0,
                "odd (low-score) entries outside the window must go first: {pos:?}"
            );
        }
    }
}

/// Models are shared across threads; sessions move between threads.
#[test]
fn model_is_shareable_and_session_movable() {
    fn sync_send<T: Send + Sync>() {}
    fn send<T: Send>() {}
    sync_send::<foxedge::Model>();
    send::<foxedge::Session>();
    let model = tiny();
    let ids = input_ids();
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let m = model.clone();
            let ids = ids[i * 10..i * 10 + 50].to_vec();
            std::thread::spawn(move || {
                let mut s = foxedge::Session::new(m, SessionOptions::default()).unwrap();
                let mut l = vec![0.0f32; 256];
                s.feed(&ids, Some(&mut l)).unwrap();
                l
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap();
        let mut s = session(&model, SessionOptions::default());
        let mut want = vec![0.0f32; 256];
        s.feed(&ids[i * 10..i * 10 + 50], Some(&mut want)).unwrap();
        assert_eq!(got, want);
    }
}

/// A budget too small for sinks + window, and other bad options, are refused up front.
#[test]
fn bad_options_are_errors() {
    let model = tiny();
    for opts in [
        SessionOptions {
            budget: Some(Budget::EntriesPerHead(8)),
            window: 8,
            sinks: 4,
            ..Default::default()
        },
        SessionOptions {
            prefill_chunk: 0,
            ..Default::default()
        },
        SessionOptions {
            ln_eps: Some(1.0),
            ..Default::default()
        },
        SessionOptions {
            ln_eps: Some(f64::NAN),
            ..Default::default()
        },
        SessionOptions {
            budget: Some(Budget::Bytes(10)),
            ..Default::default()
        },
    ] {
        let e = foxedge::Session::new(model.clone(), opts.clone()).err();
        assert!(
            matches!(e, Some(foxedge::Error::InvalidArgument(_))),
            "{opts:?}: {e:?}"
        );
    }
}

/// Failed calls leave the session unchanged: a bad token or a wrong logits length in the
/// middle of a stream, then the stream continues exactly as an uninterrupted one.
#[test]
fn failed_feed_leaves_session_unchanged() {
    let model = tiny();
    let ids = input_ids();
    let mut a = session(&model, SessionOptions::default());
    let mut b = session(&model, SessionOptions::default());
    let (mut la, mut lb) = (vec![0.0f32; 256], vec![0.0f32; 256]);
    a.feed(&ids[..50], None).unwrap();
    b.feed(&ids[..50], None).unwrap();
    assert!(b.feed(&[1, 2, 300], None).is_err());
    assert!(b.feed(&[], None).is_err());
    assert!(b.feed(&[1, 2], Some(&mut vec![0.0; 100])).is_err());
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        (
            sa.tokens,
            sa.live_entries,
            sa.evicted_certified,
            sa.kept_pairs,
            sa.bound_per_head
        ),
        (
            sb.tokens,
            sb.live_entries,
            sb.evicted_certified,
            sb.kept_pairs,
            sb.bound_per_head
        )
    );
    a.feed(&ids[50..60], Some(&mut la)).unwrap();
    b.feed(&ids[50..60], Some(&mut lb)).unwrap();
    assert_eq!(la, lb);
    b.reset().unwrap();
    assert_eq!(b.position(), 0);
}

/// 1,000,000 tokens through a 1-layer Pro model with a constant forget gate
/// (log f = logsigmoid(-3) ≈ -0.0486 per token: |c| reaches 4.9e4, so the origin is
/// re-based several times) under a budget of 64 entries per head with 8 sinks and a
/// window of 16. At the end, the engine's logits for one more token must match an f64
/// recomputation from scratch over exactly the retained positions: keys and values rebuilt
/// from the token stream (one layer: k_j depends on tokens j-1 and j only), decay
/// D = (t - j)·log f in f64 from positions. Tolerance 1e-4 relative (f32 activations).
#[test]
fn million_token_stream_rebases_exactly() {
    let syn = Synth {
        vocab: 16,
        hidden: 16,
        layers: 1,
        heads: 2,
        pro: true,
        seed: 5,
        const_gate_logit: Some(-3.0),
    };
    let dir = write_model(&syn, "million");
    let model = Arc::new(Model::open(&dir).unwrap());
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(64)),
        window: 16,
        sinks: 8,
        prefill_chunk: 4096,
        ..Default::default()
    };
    let mut s = session(&model, opts);
    let n = 1_000_000usize;
    let mut rng = 0x1234_5678u64;
    let mut toks = Vec::with_capacity(n + 1);
    for _ in 0..=n {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        toks.push((rng % 16) as u32);
    }
    // One worker thread: the caches here are tiny, so the work is per-token overhead that
    // thread hand-offs would only add to.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        for c in toks[..n].chunks(4096) {
            s.feed(c, None).unwrap();
        }
    });
    let mut got = vec![0.0f32; 16];
    s.feed(&toks[n..], Some(&mut got)).unwrap();
    let st = s.stats();
    assert_eq!(st.tokens, n as u64 + 1);
    assert!(st.live_entries <= 2 * 64);

    let r = reference::RefModel::load(&dir);
    let pos: Vec<Vec<u64>> = (0..2).map(|h| s.cache_positions(0, h).unwrap()).collect();
    let log_f = -(1.0 + 3.0f64.exp()).ln(); // logsigmoid(-3)
    let want = r.step_with_retained(&toks, &pos, log_f);
    let (max, rel) = errors(&got, &want.iter().map(|&x| x as f32).collect::<Vec<_>>());
    eprintln!("1M stream: logits vs f64 over retained entries: max {max:.3e} rel {rel:.3e}");
    assert!(rel <= 1e-4, "rel {rel:.3e} max {max:.3e}");
    std::fs::remove_dir_all(dir).ok();
}

/// Honest statistics: a budget of 4 entries per head forces evictions far past the
/// certificate, so heads report no guarantee (`None`) instead of a bound of 1 or more, and
/// the largest is `None` too.
#[test]
fn forced_evictions_past_the_certificate_report_no_guarantee() {
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(4)),
        window: 2,
        sinks: 0,
        ..Default::default()
    };
    let mut s = session(&model, opts);
    s.feed(&ids[..300], None).unwrap();
    let st = s.stats();
    assert!(st.evicted_forced > 0);
    assert_eq!(st.max_bound, None);
    assert!(st.bound_per_head.iter().any(Option::is_none));
    assert!(
        st.bound_per_head
            .iter()
            .flatten()
            .all(|&b| (0.0..1.0).contains(&b))
    );
    // A reset starts with nothing evicted: a bound of 0 everywhere.
    s.reset().unwrap();
    let st = s.stats();
    assert_eq!(st.max_bound, Some(0.0));
    assert!(st.bound_per_head.iter().all(|&b| b == Some(0.0)));
}

/// A session's own thread pool (`threads`) computes what the shared pool computes: the
/// kernels split work by heads and rows, so the sums are the same up to f32 reordering
/// (relative L2 1e-5). More than MAX_THREADS is refused.
#[test]
fn a_session_pool_of_any_size_gives_the_same_logits() {
    let model = tiny();
    let ids = input_ids();
    let run = |threads: usize| {
        let opts = SessionOptions {
            threads,
            ..Default::default()
        };
        let mut s = session(&model, opts);
        let mut logits = vec![0.0f32; 256];
        s.feed(&ids[..200], Some(&mut logits)).unwrap();
        s.feed(&ids[200..210], Some(&mut logits)).unwrap();
        logits
    };
    let want = run(0);
    for threads in [1, 3] {
        let (_, rel) = errors(&run(threads), &want);
        assert!(rel <= 1e-5, "{threads} threads: relative L2 {rel:.3e}");
    }
    let e = foxedge::Session::new(
        model.clone(),
        SessionOptions {
            threads: foxedge::session::MAX_THREADS + 1,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("threads"), "{e}");
}
