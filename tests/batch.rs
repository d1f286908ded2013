//! Batched sessions: several sessions of one model advanced in one step
//! ([`Session::feed_batch`]) end exactly as if each had been fed alone. The decode steps
//! of a batch share one matrix product per dense layer, whose every row is summed in the
//! order of a lone decode step's matrix-vector product (`foxedge_cpu::linear::
//! ROW_EXACT_ROWS`); a chunk is its own product, as alone; attention runs per session. So
//! logits, evictions and ACP decisions are bit-identical.

mod common;

use common::*;
use foxedge::{Budget, CacheDtype, Error, Session, SessionOptions};

fn option_sets() -> Vec<SessionOptions> {
    vec![
        dense_opts(),
        SessionOptions::default(),
        SessionOptions {
            budget: Some(Budget::EntriesPerHead(40)),
            window: 8,
            sinks: 2,
            ..dense_opts()
        },
        SessionOptions {
            cache_dtype: CacheDtype::F16,
            ..dense_opts()
        },
    ]
}

/// Rounds of mixed steps (one session prefilling a chunk while others decode), batched and
/// alone: the same logits after every round, bit for bit, the same positions, caches and
/// statistics.
#[test]
fn a_batch_equals_separate_sessions() {
    let model = tiny();
    let ids = input_ids();
    let v = model.info().vocab;
    let opts = option_sets();
    let n = opts.len();
    let mut batch: Vec<Session> = opts.iter().map(|o| session(&model, o.clone())).collect();
    let mut alone: Vec<Session> = opts.iter().map(|o| session(&model, o.clone())).collect();
    let mut at = vec![0usize; n];
    for round in 0..24 {
        // Session (round % n) takes a chunk; the others decode one token.
        let lens: Vec<usize> = (0..n)
            .map(|i| {
                if i == round % n {
                    17 + 13 * (round % 3)
                } else {
                    1
                }
            })
            .collect();
        let lists: Vec<&[u32]> = (0..n)
            .map(|i| &ids[(at[i] + 97 * i) % 400..][..lens[i]])
            .collect();
        let mut got = vec![0.0f32; n * v];
        {
            let mut refs: Vec<&mut Session> = batch.iter_mut().collect();
            Session::feed_batch(&mut refs, &lists, Some(&mut got)).unwrap();
        }
        for i in 0..n {
            let mut want = vec![0.0f32; v];
            alone[i].feed(lists[i], Some(&mut want)).unwrap();
            assert!(
                got[i * v..(i + 1) * v] == want[..],
                "round {round} session {i}"
            );
            at[i] += lens[i];
            assert_eq!(batch[i].position(), alone[i].position());
        }
    }
    for (a, b) in batch.iter().zip(&alone) {
        let (sa, sb) = (a.stats(), b.stats());
        assert_eq!(
            (sa.live_entries, sa.evicted_certified, sa.evicted_forced),
            (sb.live_entries, sb.evicted_certified, sb.evicted_forced)
        );
        assert_eq!(
            (sa.kept_pairs, sa.total_pairs),
            (sb.kept_pairs, sb.total_pairs)
        );
        assert_eq!(sa.cache_bytes, sb.cache_bytes);
        assert_eq!(sa.bound_per_head, sb.bound_per_head);
        for (l, h) in (0..4).flat_map(|l| (0..4).map(move |h| (l, h))) {
            assert_eq!(a.cache_positions(l, h), b.cache_positions(l, h));
        }
    }
    // Independent budgets: the budgeted session alone is bounded.
    assert!(batch[2].cache_len(0, 0).unwrap() <= 40);
    assert!(batch[0].cache_len(0, 0).unwrap() > 40);
}

/// A bad batch is refused before any session moves.
#[test]
fn a_bad_batch_changes_nothing() {
    let model = tiny();
    let mut a = session(&model, dense_opts());
    let mut b = session(&model, dense_opts());
    a.feed(&[1, 2, 3], None).unwrap();
    let before = (a.save_bytes().unwrap(), b.save_bytes().unwrap());
    let v = model.info().vocab as u32;
    let out_of_vocab = [v];
    let cases: Vec<(Vec<&[u32]>, usize)> = vec![
        (vec![&[1u32][..], &[][..]], 2),
        (vec![&[1u32][..], &out_of_vocab[..]], 2),
        (vec![&[1u32][..]], 2),
        (vec![&[1u32][..], &[2][..]], 1),
    ];
    for (lists, logit_rows) in cases {
        let mut logits = vec![0.0f32; logit_rows * v as usize];
        let mut refs = vec![&mut a, &mut b];
        let r = Session::feed_batch(&mut refs, &lists, Some(&mut logits));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
    assert_eq!((a.save_bytes().unwrap(), b.save_bytes().unwrap()), before);
    let other = std::sync::Arc::new(foxedge::Model::open(model.dir()).unwrap());
    let mut c = session(&other, dense_opts());
    let mut refs = vec![&mut a, &mut c];
    assert!(Session::feed_batch(&mut refs, &[&[1u32][..], &[1][..]], None).is_err());
}
