//! Continuation prefill in sessions: a stream fed in chunks of any size (each chunk after
//! the first attends the retained cache through the tiled continuation kernel) gives the
//! logits of the same stream fed one token at a time, within the kernels' summation-order
//! tolerance, with ACP, certified eviction and budgets, on the bundled model and on a
//! model without QK-norm.

mod common;

use common::synth::{Synth, write_model};
use common::*;
use foxedge::{Budget, Model, Session, SessionOptions};
use std::sync::Arc;

/// Every token's logits (`[n, vocab]`) of `ids` fed in calls of `sizes` (cycled), and the
/// session. A size of 1 is a decode step.
fn feed_in(
    model: &Arc<Model>,
    opts: &SessionOptions,
    ids: &[u32],
    sizes: &[usize],
) -> (Vec<f32>, Session) {
    let v = model.info().vocab;
    let mut s = session(model, opts.clone());
    let mut out = vec![0.0f32; ids.len() * v];
    let (mut at, mut i) = (0, 0);
    while at < ids.len() {
        let n = sizes[i % sizes.len()].min(ids.len() - at);
        let rows = &mut out[at * v..(at + n) * v];
        if opts.scored {
            let sc: Vec<f32> = (at..at + n).map(score).collect();
            s.feed_scored(&ids[at..at + n], &sc, Some(rows)).unwrap();
        } else {
            s.feed(&ids[at..at + n], Some(rows)).unwrap();
        }
        at += n;
        i += 1;
    }
    (out, s)
}

/// A caller score of position `p` (scored sessions): high for multiples of 3.
fn score(p: usize) -> f32 {
    if p.is_multiple_of(3) {
        5.0
    } else {
        -((p % 7) as f32)
    }
}

/// Random chunk sizes from a seeded LCG (1 = decode steps among them).
fn chunking(seed: u64) -> Vec<usize> {
    let mut x = seed;
    (0..16)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            [1, 2, 3, 7, 16, 33, 64, 100, 257][(x >> 33) as usize % 9]
        })
        .collect()
}

/// Feeds `ids` token by token and in several chunkings (the first chunk of each is long,
/// so continuation runs at depth); returns the worst max-abs logit difference.
fn worst_vs_token_by_token(
    model: &Arc<Model>,
    opts: &SessionOptions,
    ids: &[u32],
    check: impl Fn(&Session, &Session),
) -> f64 {
    let (want, one) = feed_in(model, opts, ids, &[1]);
    let mut worst = 0.0f64;
    for seed in 1..=3 {
        let mut sizes = vec![150];
        sizes.extend(chunking(seed));
        let (got, s) = feed_in(model, opts, ids, &sizes);
        worst = worst.max(errors(&got, &want).0);
        check(&s, &one);
        assert_eq!(s.position(), one.position());
        assert!(s.stats().prefill_tokens > 0);
    }
    worst
}

fn same_cache(a: &Session, b: &Session) {
    let info = a.model().info();
    for l in 0..info.layers {
        for h in 0..info.heads {
            let (mut x, mut y) = (
                a.cache_positions(l, h).unwrap(),
                b.cache_positions(l, h).unwrap(),
            );
            x.sort_unstable();
            y.sort_unstable();
            assert_eq!(x, y, "layer {l} head {h}");
        }
    }
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        (sa.live_entries, sa.evicted_certified, sa.evicted_forced),
        (sb.live_entries, sb.evicted_certified, sb.evicted_forced)
    );
}

/// Dense (no ACP, full cache): the same keys, summed in another order. Logits of the tiny
/// model are O(10); f32 reordering in 4 layers moves them by ~1e-5.
#[test]
fn dense_chunks_equal_token_by_token() {
    let model = tiny();
    let ids = input_ids();
    let w = worst_vs_token_by_token(&model, &dense_opts(), &ids[..700], same_cache);
    eprintln!("dense: worst logit difference {w:.3e}");
    assert!(w <= 2e-4, "{w}");
}

/// ACP without eviction: the chunks prune other tiles than the decode steps do (each
/// pruned row loses < eps = e^-10 of its mass); and certified eviction, which evicts the
/// same entries up to decisions at the certificate's edge (on this model it evicts every
/// entry that ACP would skip, so nothing is left to prune). Within the certified test's
/// 1e-3.
#[test]
fn acp_and_certified_chunks_equal_token_by_token() {
    let model = tiny();
    let ids = input_ids();
    let acp = SessionOptions {
        certified_eviction: false,
        ..SessionOptions::default()
    };
    let w = worst_vs_token_by_token(&model, &acp, &ids[..900], |s, one| {
        for st in [s.stats(), one.stats()] {
            assert_eq!(st.evicted_certified + st.evicted_forced, 0);
            assert!(st.kept_pairs < st.total_pairs, "{st:?}");
        }
    });
    eprintln!("acp: worst logit difference {w:.3e}");
    assert!(w <= 1e-3, "{w}");
    let w = worst_vs_token_by_token(&model, &SessionOptions::default(), &ids[..900], |s, one| {
        let (a, b) = (s.stats(), one.stats());
        assert!(a.evicted_certified > 0);
        let diff = a.evicted_certified.abs_diff(b.evicted_certified);
        assert!(diff * 100 <= b.evicted_certified, "{a:?} vs {b:?}");
    });
    eprintln!("certified: worst logit difference {w:.3e}");
    assert!(w <= 1e-3, "{w}");
}

/// Budgets force evictions inside chunks: each query sees only what it would have seen
/// fed alone. Caller scores make the evictions independent of the activations, so the
/// caches end identical; the weight-bound order is checked on the logits.
#[test]
fn budget_chunks_equal_token_by_token() {
    let model = tiny();
    let ids = input_ids();
    let scored = SessionOptions {
        budget: Some(Budget::EntriesPerHead(40)),
        window: 4,
        sinks: 2,
        scored: true,
        certified_eviction: false,
        ln_eps: None,
        ..Default::default()
    };
    let w = worst_vs_token_by_token(&model, &scored, &ids[..600], same_cache);
    eprintln!("scored budget: worst logit difference {w:.3e}");
    assert!(w <= 2e-4, "{w}");
    for budget in [Budget::EntriesPerHead(48), Budget::EntriesPerLayer(150)] {
        let opts = SessionOptions {
            budget: Some(budget),
            window: 16,
            sinks: 4,
            ..Default::default()
        };
        let w = worst_vs_token_by_token(&model, &opts, &ids[..600], |s, _| {
            assert!(s.stats().evicted_forced > 0);
            for l in 0..4 {
                let total: usize = (0..4).map(|h| s.cache_len(l, h).unwrap()).sum();
                assert!(total <= 4 * 48, "layer {l} holds {total}");
            }
        });
        eprintln!("{budget:?}: worst logit difference {w:.3e}");
        assert!(w <= 1e-3, "{budget:?}: {w}");
    }
}

/// A long feed split by `prefill_chunk` runs chunk after chunk through the continuation.
#[test]
fn small_prefill_chunks_equal_token_by_token() {
    let model = tiny();
    let ids = input_ids();
    let opts = SessionOptions {
        prefill_chunk: 48,
        ..dense_opts()
    };
    let v = model.info().vocab;
    let (want, one) = feed_in(&model, &opts, &ids[..500], &[1]);
    let mut s = session(&model, opts);
    let mut got = vec![0.0f32; 500 * v];
    s.feed(&ids[..500], Some(&mut got)).unwrap();
    same_cache(&s, &one);
    let w = errors(&got, &want).0;
    assert!(w <= 2e-4, "{w}");
    // Last-row logits of the same feed agree with the all-rows ones.
    let mut last = vec![0.0f32; v];
    let mut s2 = session(
        &model,
        SessionOptions {
            prefill_chunk: 48,
            ..dense_opts()
        },
    );
    s2.feed(&ids[..500], Some(&mut last)).unwrap();
    assert_eq!(&last[..], &got[499 * v..]);
}

/// Without QK-norm the logit bound comes from the observed norms of each call.
#[test]
fn model_without_qk_norm() {
    let dir = write_model(
        &Synth {
            pro: false,
            hidden: 64,
            heads: 2,
            ..Default::default()
        },
        "continuation-plain",
    );
    let model = Arc::new(Model::open(&dir).unwrap());
    let ids: Vec<u32> = (0..300u32).map(|i| (i * 7 + i / 5) % 32).collect();
    for opts in [dense_opts(), SessionOptions::default()] {
        let w = worst_vs_token_by_token(&model, &opts, &ids, |_, _| {});
        assert!(w <= 1e-3, "{opts:?}: {w}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
