//! Invariant and property tests of the retention policy.

extern crate std;
use super::slots::heap_less;
use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::vec;
use std::vec::Vec;

type VecPolicy = RetentionPolicy<Vec<Slot>, Vec<HeadState>>;

fn policy(cfg: PolicyConfig, u: &[f64]) -> VecPolicy {
    let n = cfg.slots_needed().unwrap();
    RetentionPolicy::new(
        cfg,
        u,
        vec![Slot::EMPTY; n],
        vec![HeadState::EMPTY; cfg.heads],
    )
    .unwrap()
}

/// Every structural invariant of the policy.
fn check_invariants(p: &VecPolicy) {
    let cfg = p.cfg;
    let mut total = 0;
    for h in 0..cfg.heads {
        let (r, hs) = p.head_ref(h);
        let live = hs.live as usize;
        total += live;
        assert!(live <= p.limit);
        for (i, s) in r.iter().enumerate() {
            assert_eq!(s.zone == Zone::Free, i >= live, "head {h} slot {i}");
        }
        for s in &r[..hs.sinks_live as usize] {
            assert!(s.is_sink());
        }
        // age list: all non-sinks once, positions increasing, evictable then protected
        let mut seen = 0;
        let mut node = hs.oldest;
        let mut prev = NONE;
        let mut last_pos = None;
        let mut protected = 0;
        let mut in_protected = false;
        let mut evictable = BTreeSet::new();
        while node != NONE {
            let s = &r[node as usize];
            assert_eq!(s.prev, prev);
            assert!(last_pos.is_none_or(|lp| s.position > lp));
            last_pos = Some(s.position);
            match s.zone {
                Zone::Evictable => {
                    assert!(!in_protected);
                    evictable.insert(node);
                }
                Zone::Protected => {
                    if !in_protected {
                        assert_eq!(hs.first_protected, node);
                    }
                    in_protected = true;
                    protected += 1;
                }
                z => panic!("zone {z:?} in the age list"),
            }
            seen += 1;
            prev = node;
            node = s.next;
        }
        assert_eq!(hs.newest, prev);
        assert_eq!(seen + hs.sinks_live as usize, live);
        assert_eq!(protected, hs.protected);
        if protected == 0 {
            assert_eq!(hs.first_protected, NONE);
        }
        // heap: exactly the evictable entries (Scores order), heap-ordered
        let hl = hs.heap_len as usize;
        if cfg.order == ForcedOrder::Scores {
            let items: BTreeSet<u32> = r[..hl].iter().map(|s| s.heap_item).collect();
            assert_eq!(items, evictable);
            for i in 0..hl {
                assert_eq!(r[r[i].heap_item as usize].heap_pos as usize, i);
                if i > 0 {
                    assert!(!heap_less(r, r[i].heap_item, r[(i - 1) / 2].heap_item));
                }
            }
        } else {
            assert_eq!(hl, 0);
        }
    }
    assert_eq!(total, p.live_total);
    if let Some(lb) = cfg.layer_budget {
        assert!(total <= lb);
    }
}

#[test]
fn config_and_constructor_errors() {
    let ok = PolicyConfig::new(2, 4);
    assert!(ok.validate().is_ok());
    let bad = [
        PolicyConfig { heads: 0, ..ok },
        PolicyConfig {
            head_capacity: 0,
            ..ok
        },
        PolicyConfig {
            head_capacity: u32::MAX as usize,
            ..ok
        },
        PolicyConfig {
            head_budget: Some(0),
            ..ok
        },
        PolicyConfig {
            head_budget: Some(5),
            ..ok
        },
        PolicyConfig { window: 0, ..ok },
        PolicyConfig {
            window: 3,
            sinks: 2,
            ..ok
        },
        PolicyConfig {
            window: 3,
            head_budget: Some(2),
            ..ok
        },
        PolicyConfig {
            window: 2,
            layer_budget: Some(3),
            ..ok
        },
        PolicyConfig {
            sinks: usize::MAX,
            ..ok
        },
        PolicyConfig {
            ln_eps: Some(1.0),
            ..ok
        },
        PolicyConfig {
            ln_eps: Some(f64::NAN),
            ..ok
        },
        PolicyConfig {
            heads: usize::MAX,
            head_capacity: 3,
            ..ok
        },
    ];
    for cfg in bad {
        assert!(cfg.validate().is_err(), "{cfg:?}");
        assert!(
            RetentionPolicy::new(
                cfg,
                &[1.0, 1.0],
                vec![Slot::EMPTY; 8],
                vec![HeadState::EMPTY; 2]
            )
            .is_err()
        );
    }
    let mk = |u: &[f64], ns: usize, nh: usize| {
        RetentionPolicy::new(ok, u, vec![Slot::EMPTY; ns], vec![HeadState::EMPTY; nh]).err()
    };
    assert!(matches!(mk(&[1.0], 8, 2), Some(Error::BadLength { .. })));
    assert!(matches!(
        mk(&[1.0, 1.0], 7, 2),
        Some(Error::BadLength { .. })
    ));
    assert!(matches!(
        mk(&[1.0, 1.0], 8, 1),
        Some(Error::BadLength { .. })
    ));
    assert!(matches!(
        mk(&[1.0, -1.0], 8, 2),
        Some(Error::BadArgument(_))
    ));
    assert!(matches!(
        mk(&[f64::NAN, 1.0], 8, 2),
        Some(Error::BadArgument(_))
    ));
    assert!(mk(&[1.0, 1.0], 8, 2).is_none());
}

#[test]
fn append_and_query_errors_change_nothing() {
    let mut p = policy(PolicyConfig::new(2, 4), &[1.0, 1.0]);
    let no = |_: Eviction| {};
    p.append(5, &[-1.0, -1.0], None, no).unwrap();
    let before = (p.slots(0).unwrap().to_vec(), p.heads.clone(), p.live_total);
    assert!(p.append(5, &[-2.0, -2.0], None, no).is_err()); // no re-entry / repeat
    assert!(p.append(4, &[-2.0, -2.0], None, no).is_err());
    assert!(matches!(
        p.append(6, &[-2.0], None, no),
        Err(Error::BadLength { .. })
    ));
    assert!(p.append(6, &[-2.0, f64::NAN], None, no).is_err());
    assert!(p.append(6, &[-2.0, f64::NEG_INFINITY], None, no).is_err());
    assert!(p.append(6, &[-2.0, -0.5], None, no).is_err()); // c increased
    assert!(p.append(6, &[-2.0, -2.0], Some(&[0.0, 0.0]), no).is_err()); // scores in WB mode
    assert_eq!(
        before,
        (p.slots(0).unwrap().to_vec(), p.heads.clone(), p.live_total)
    );
    assert!(p.slots(2).is_err());
    assert!(p.age_order(2).is_err());
    assert!(p.head_stats(2).is_err());
    assert!(p.rebase(2, 1.0).is_err());
    assert!(p.rebase(0, f64::NAN).is_err());
    assert!(p.certified_evictable(2, -1.0).is_err());
    assert!(p.certified_evictable(0, 1.0).is_err());

    let cfg = PolicyConfig {
        order: ForcedOrder::Scores,
        ..PolicyConfig::new(2, 4)
    };
    let mut q = policy(cfg, &[1.0, 1.0]);
    assert!(q.append(0, &[0.0, 0.0], None, no).is_err());
    assert!(matches!(
        q.append(0, &[0.0, 0.0], Some(&[1.0]), no),
        Err(Error::BadLength { .. })
    ));
    assert!(
        q.append(0, &[0.0, 0.0], Some(&[1.0, f32::NAN]), no)
            .is_err()
    );
    assert_eq!(q.live_total(), 0);
    q.append(0, &[0.0, 0.0], Some(&[1.0, f32::INFINITY]), no)
        .unwrap();
    assert_eq!(q.appended(), 1);
}

#[test]
fn certified_eviction_rebase_and_age_order() {
    // one head, U = 0.5, window 2, one sink, huge capacity: only certified evictions
    let cfg = PolicyConfig {
        window: 2,
        sinks: 1,
        ln_eps: Some(-5.0),
        ..PolicyConfig::new(1, 64)
    };
    let mut p = policy(cfg, &[0.5]);
    let mut evs = Vec::new();
    let mut c = 0.0;
    for t in 0..6u64 {
        c -= 2.0;
        p.append(t, &[c], None, |e| evs.push(e)).unwrap();
        check_invariants(&p);
    }
    // c_t - c_j <= -6 is needed (1 + c_t - c_j <= -5): 3 steps of -2 apart.
    assert!(!evs.is_empty() && evs.iter().all(|e| e.kind == EvictionKind::Certified));
    let st = p.head_stats(0).unwrap();
    assert!(st.ln_bound <= -5.0 && st.evicted_forced == 0);
    let ages: Vec<u64> = p
        .age_order(0)
        .unwrap()
        .map(|s| p.slots(0).unwrap()[s as usize].position())
        .collect();
    assert_eq!(ages[0], 0); // the sink
    assert!(ages.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(ages[ages.len() - 2..], [4, 5]); // the window
    // rebase leaves differences and the bound unchanged
    let lnb = st.ln_bound;
    let d: Vec<f64> = p.slots(0).unwrap().iter().map(|s| c - s.c()).collect();
    p.rebase(0, c).unwrap();
    assert!((p.head_stats(0).unwrap().ln_bound - lnb).abs() < 1e-12);
    let d2: Vec<f64> = p.slots(0).unwrap().iter().map(|s| 0.0 - s.c()).collect();
    assert_eq!(d, d2);
    assert_eq!(p.certified_evictable(0, -5.0).unwrap(), 0);
    assert!(p.certified_evictable(0, 0.0).unwrap() <= ages.len() - 3);
    let ls = p.layer_stats();
    assert_eq!(
        (ls.live, ls.evicted_certified),
        (ages.len(), st.evicted_certified)
    );
}

#[test]
fn forced_order_across_heads() {
    let base = PolicyConfig {
        ln_eps: None,
        layer_budget: Some(4),
        ..PolicyConfig::new(2, 8)
    };
    // weight bound: head 1 has the larger U, so head 0 pays
    let mut p = policy(base, &[0.0, 3.0]);
    let mut evs = Vec::new();
    for t in 0..3u64 {
        let c = -(t as f64) - 1.0;
        p.append(t, &[c, c], None, |e| evs.push(e)).unwrap();
    }
    let got: Vec<(usize, u64)> = evs.iter().map(|e| (e.head, e.position)).collect();
    assert_eq!(got, [(0, 0), (0, 1)]);
    assert!(evs.iter().all(|e| e.kind == EvictionKind::Forced));
    assert_eq!(evs[0].moved(), Some((1, 0))); // slot 0 refilled from the last slot
    assert_eq!(p.head_stats(1).unwrap().live, 3);
    assert_eq!(p.layer_stats().evicted_forced, 2);
    // scores: the lowest score goes first, whichever head holds it
    let cfg = PolicyConfig {
        order: ForcedOrder::Scores,
        ..base
    };
    let mut q = policy(cfg, &[0.0, 3.0]);
    let mut evs = Vec::new();
    for (t, sc) in [[5.0f32, 1.0], [4.0, 2.0], [0.0, 0.0]].iter().enumerate() {
        q.append(t as u64, &[0.0, 0.0], Some(sc), |e| evs.push(e))
            .unwrap();
    }
    let got: Vec<(usize, u64)> = evs.iter().map(|e| (e.head, e.position)).collect();
    assert_eq!(got, [(1, 0), (1, 1)]);
}

#[test]
fn fixed_heapless_storage_and_copy_c() {
    let cfg = PolicyConfig {
        window: 2,
        ..PolicyConfig::new(2, 3)
    };
    assert!(matches!(
        FixedPolicy::<5, 2>::new_fixed(cfg, &[1.0, 1.0]),
        Err(Error::Capacity { capacity: 5, .. })
    ));
    assert!(matches!(
        FixedPolicy::<6, 1>::new_fixed(cfg, &[1.0, 1.0]),
        Err(Error::Capacity { capacity: 1, .. })
    ));
    let mut p = FixedPolicy::<6, 2>::new_fixed(cfg, &[0.0, 0.0]).unwrap();
    for t in 0..5u64 {
        let c = -(t as f64);
        p.append(t, &[c, 2.0 * c], None, |_| {}).unwrap();
    }
    assert_eq!(p.latest_c(1).unwrap(), -8.0);
    let mut out = [0.0; 3];
    assert!(matches!(
        p.copy_c(0, &mut out[..2]),
        Err(Error::BadLength { .. })
    ));
    assert!(p.copy_c(2, &mut out).is_err());
    assert!(p.latest_c(2).is_err());
    let n = p.copy_c(1, &mut out).unwrap();
    let want: Vec<f64> = p.slots(1).unwrap().iter().map(|s| s.c()).collect();
    assert_eq!(&out[..n], &want[..]);
    let (slots, heads) = p.into_storage();
    assert_eq!((slots.len(), heads.len()), (6, 2));
}

#[derive(Debug, Clone)]
struct Case {
    cfg: PolicyConfig,
    u: Vec<f64>,
    gates: Vec<Vec<f32>>,  // [step][head]
    scores: Vec<Vec<f32>>, // [step][head]
    qk: Vec<f64>,          // random q, k components
    rebase_every: usize,
}

const D: usize = 3;

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        1usize..=4,
        0usize..=2,
        1usize..=10,
        any::<bool>(),
        any::<bool>(),
        0u8..=2,
    )
        .prop_flat_map(
            |(heads, window, sinks, extra, scores_mode, certified, budget_kind)| {
                let head_cap = window + sinks + extra;
                let steps = 40usize;
                (
                    Just((
                        heads,
                        window,
                        sinks,
                        head_cap,
                        scores_mode,
                        certified,
                        budget_kind,
                    )),
                    0usize..=extra,
                    0usize..=heads * extra,
                    proptest::collection::vec(0.0f64..=2.0, heads),
                    -8.0f64..=-1.0,
                    proptest::collection::vec(
                        proptest::collection::vec(
                            prop_oneof![-0.01f32..=0.0, -2.0f32..=0.0, -30.0f32..=0.0],
                            heads,
                        ),
                        steps,
                    ),
                    proptest::collection::vec(
                        proptest::collection::vec(-3.0f32..=3.0, heads),
                        steps,
                    ),
                    proptest::collection::vec(-1.0f64..=1.0, 2 * steps * heads * D),
                    0usize..=9,
                )
            },
        )
        .prop_map(
            |(
                (heads, window, sinks, cap, scores_mode, certified, bk),
                hb,
                lb,
                u,
                ln_eps,
                gates,
                scores,
                qk,
                rebase_every,
            )| {
                let mut cfg = PolicyConfig::new(heads, cap);
                cfg.window = window;
                cfg.sinks = sinks;
                cfg.ln_eps = certified.then_some(ln_eps);
                cfg.order = if scores_mode {
                    ForcedOrder::Scores
                } else {
                    ForcedOrder::WeightBound
                };
                if bk == 1 {
                    cfg.head_budget = Some(window + sinks + hb);
                }
                if bk == 2 {
                    cfg.layer_budget = Some(heads * (window + sinks) + lb);
                }
                Case {
                    cfg,
                    u,
                    gates,
                    scores,
                    qk,
                    rebase_every,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Budgets, protection, dense slots with correct move reports, no re-entry, the
    /// eviction orders, and the certificate against the brute-force evicted mass.
    #[test]
    fn policy_invariants(case in case()) {
        let cfg = case.cfg;
        let nh = cfg.heads;
        let steps = case.gates.len();
        let mut p = policy(cfg, &case.u);
        // mirror of the caller's tensor rows: positions by slot
        let mut rows: Vec<Vec<u64>> = vec![Vec::new(); nh];
        let mut evicted: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); nh];
        let mut c_abs: Vec<Vec<f64>> = vec![Vec::new(); nh]; // [head][t]
        let mut origin = vec![0.0f64; nh];
        let mut any_forced = false;
        // q, k per head and token, |s q.k| <= U_h with s = 1/sqrt(D)
        let scale = 1.0 / libm::sqrt(D as f64);
        let vecs: Vec<Vec<f64>> = case.qk.chunks_exact(D).map(|v| v.to_vec()).collect();
        let qk = |h: usize, t: usize, key: bool| -> Vec<f64> {
            let v = &vecs[(2 * (t * nh + h)) + usize::from(key)];
            let n = libm::sqrt(v.iter().map(|x| x * x).sum::<f64>()).max(1e-12);
            let r = libm::sqrt(case.u[h] / scale);
            v.iter().map(|x| x / n * r).collect()
        };
        for t in 0..steps {
            let pos = 3 * t as u64 + 1; // gaps are allowed
            if case.rebase_every > 0 && t % case.rebase_every == case.rebase_every - 1 {
                for (h, o) in origin.iter_mut().enumerate() {
                    let shift = p.heads[h].c_t; // new origin at the latest c
                    p.rebase(h, shift).unwrap();
                    *o += shift;
                }
            }
            let c: Vec<f64> = (0..nh)
                .map(|h| {
                    let prev = c_abs[h].last().copied().unwrap_or(0.0);
                    let a = prev + f64::from(case.gates[t][h]);
                    c_abs[h].push(a);
                    a - origin[h]
                })
                .collect();
            let sc = (cfg.order == ForcedOrder::Scores).then_some(&case.scores[t][..]);
            let live_before: Vec<Vec<u64>> = rows.clone();
            let protected: Vec<u64> = (t.saturating_sub(cfg.window - 1)..t)
                .chain(0..cfg.sinks.min(t))
                .map(|i| 3 * i as u64 + 1)
                .collect();
            let mut events = Vec::new();
            let rep = p.append(pos, &c, sc, |e| events.push(e)).unwrap();
            prop_assert_eq!(rep.certified + rep.forced, events.len());
            for e in &events {
                let r = &mut rows[e.head];
                prop_assert_eq!(r[e.slot as usize], e.position);
                prop_assert!(!protected.contains(&e.position), "evicted a protected token");
                // order: within the head, the chosen entry is the oldest evictable
                // (certified, weight bound) or has the lowest score
                let cand: Vec<u64> = r.iter().copied().filter(|x| !protected.contains(x)).collect();
                if e.kind == EvictionKind::Certified || cfg.order == ForcedOrder::WeightBound {
                    prop_assert_eq!(Some(&e.position), cand.iter().min());
                } else {
                    let score_of = |x: u64| case.scores[((x - 1) / 3) as usize][e.head];
                    let m = cand.iter().map(|&x| score_of(x)).fold(f32::INFINITY, f32::min);
                    prop_assert_eq!(score_of(e.position), m);
                }
                if e.kind == EvictionKind::Forced { any_forced = true; }
                match e.moved_from {
                    Some(f) => {
                        prop_assert_eq!(f as usize, r.len() - 1);
                        prop_assert!(e.slot < f);
                        r[e.slot as usize] = r[f as usize];
                        r.pop();
                    }
                    None => {
                        prop_assert_eq!(e.slot as usize, r.len() - 1);
                        r.pop();
                    }
                }
                evicted[e.head].insert(e.position);
            }
            for h in 0..nh {
                rows[h].push(pos);
                let got: Vec<u64> = p.slots(h).unwrap().iter().map(|s| s.position()).collect();
                prop_assert_eq!(&got, &rows[h], "slots must match the mirror after moves");
                // no re-entry, protected all live, and nothing vanished without a report
                for x in &got { prop_assert!(!evicted[h].contains(x)); }
                for x in &protected { prop_assert!(got.contains(x)); }
                for x in &live_before[h] { prop_assert!(got.contains(x) || evicted[h].contains(x)); }
                // stored c is the token's c relative to the head origin
                for s in p.slots(h).unwrap() {
                    let i = ((s.position() - 1) / 3) as usize;
                    prop_assert!((s.c() - (c_abs[h][i] - origin[h])).abs() < 1e-9);
                }
                prop_assert!(got.len() <= cfg.head_limit());
            }
            if let Some(lb) = cfg.layer_budget { prop_assert!(p.live_total() <= lb); }
            check_invariants(&p);

            // certificate vs the brute-force evicted attention mass of query t
            for h in 0..nh {
                let q = qk(h, t, false);
                let logits: Vec<f64> = (0..=t).map(|j| {
                    let k = qk(h, j, true);
                    scale * q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() + c_abs[h][t] - c_abs[h][j]
                }).collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logits.iter().map(|x| libm::exp(x - m)).sum();
                let mass: f64 = evicted[h].iter().map(|&x| libm::exp(logits[((x - 1) / 3) as usize] - m) / z).sum();
                let st = p.head_stats(h).unwrap();
                prop_assert!(mass <= st.bound * (1.0 + 1e-9) + 1e-300, "mass {} > B {}", mass, st.bound);
                if let (Some(l), false) = (cfg.ln_eps, any_forced) {
                    prop_assert!(st.ln_bound <= l + 1e-9);
                }
            }
            let ls = p.layer_stats();
            let mx = (0..nh).map(|h| p.head_stats(h).unwrap().ln_bound).fold(f64::NEG_INFINITY, f64::max);
            prop_assert_eq!(ls.max_ln_bound, mx);
        }
    }
}

/// Saves `p` as plain data and restores it into fresh storage.
fn save_restore(p: &VecPolicy) -> Result<VecPolicy> {
    let cfg = p.cfg;
    let nh = cfg.heads;
    let u: Vec<f64> = (0..nh).map(|h| p.heads[h].cert.u()).collect();
    let records: Vec<HeadRecord> = (0..nh).map(|h| p.head_record(h).unwrap()).collect();
    let entries: Vec<Vec<EntryRecord>> = (0..nh)
        .map(|h| {
            (0..records[h].live)
                .map(|s| p.entry(h, s).unwrap())
                .collect()
        })
        .collect();
    let ages: Vec<Vec<usize>> = entries
        .iter()
        .map(|es| {
            let mut order: Vec<usize> = (0..es.len())
                .filter(|&s| es[s].zone != EntryZone::Sink)
                .collect();
            order.sort_by_key(|&s| es[s].position);
            order
        })
        .collect();
    RetentionPolicy::restore(
        cfg,
        &u,
        vec![Slot::EMPTY; cfg.slots_needed().unwrap()],
        vec![HeadState::EMPTY; nh],
        p.last_position(),
        &records,
        |h, s| entries[h][s],
        |h, i| ages[h][i],
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// A policy saved at any step and restored makes the same evictions, in the same
    /// order and slots, and reports the same statistics from then on.
    #[test]
    fn restored_policy_makes_the_same_decisions(case in case(), cut in 0usize..40) {
        let cfg = case.cfg;
        let nh = cfg.heads;
        let mut p = policy(cfg, &case.u);
        let mut q = None;
        let mut c = vec![0.0f64; nh];
        for t in 0..case.gates.len() {
            if t == cut {
                let r = save_restore(&p).unwrap();
                check_invariants(&r);
                q = Some(r);
            }
            for (ch, &g) in c.iter_mut().zip(&case.gates[t]) {
                *ch += f64::from(g);
            }
            let sc = (cfg.order == ForcedOrder::Scores).then_some(&case.scores[t][..]);
            let mut ev_p = Vec::new();
            p.append(t as u64 * 2, &c, sc, |e| ev_p.push(e)).unwrap();
            if let Some(q) = q.as_mut() {
                let mut ev_q = Vec::new();
                q.append(t as u64 * 2, &c, sc, |e| ev_q.push(e)).unwrap();
                prop_assert_eq!(&ev_p, &ev_q, "step {}", t);
                check_invariants(q);
                for h in 0..nh {
                    prop_assert_eq!(p.head_stats(h).unwrap(), q.head_stats(h).unwrap());
                    let live = p.head_stats(h).unwrap().live;
                    for s in 0..live {
                        prop_assert_eq!(p.entry(h, s).unwrap(), q.entry(h, s).unwrap());
                    }
                }
                prop_assert_eq!(p.layer_stats(), q.layer_stats());
            }
        }
    }
}

/// Records that no run of the policy could produce are refused.
#[test]
fn restore_refuses_unreachable_states() {
    let mut cfg = PolicyConfig::new(2, 6);
    cfg.window = 2;
    cfg.sinks = 1;
    cfg.ln_eps = None;
    cfg.head_budget = Some(4);
    let mut p = policy(cfg, &[1.0, 1.0]);
    for t in 0..9u64 {
        let c = [-(t as f64), -0.5 * t as f64];
        p.append(t, &c, None, |_| {}).unwrap();
    }
    save_restore(&p).unwrap();
    let nh = 2;
    let u = [1.0, 1.0];
    let records: Vec<HeadRecord> = (0..nh).map(|h| p.head_record(h).unwrap()).collect();
    let entries: Vec<Vec<EntryRecord>> = (0..nh)
        .map(|h| {
            (0..records[h].live)
                .map(|s| p.entry(h, s).unwrap())
                .collect()
        })
        .collect();
    let age = |es: &Vec<EntryRecord>| {
        let mut o: Vec<usize> = (1..es.len()).collect();
        o.sort_by_key(|&s| es[s].position);
        o
    };
    let ages: Vec<Vec<usize>> = entries.iter().map(age).collect();
    let run = |records: &[HeadRecord],
               entries: &[Vec<EntryRecord>],
               ages: &[Vec<usize>],
               last: Option<u64>| {
        RetentionPolicy::restore(
            cfg,
            &u,
            vec![Slot::EMPTY; 12],
            vec![HeadState::EMPTY; nh],
            last,
            records,
            |h, s| entries[h][s],
            |h, i| ages[h][i],
        )
        .map(|_| ())
    };
    let last = p.last_position();
    run(&records, &entries, &ages, last).unwrap();
    assert!(run(&records, &entries, &ages, None).is_err());
    assert!(
        run(&records, &entries, &ages, Some(3)).is_err(),
        "entries after the last"
    );
    assert!(matches!(
        run(&records[..1], &entries, &ages, last),
        Err(Error::BadLength { .. })
    ));
    let mut r = records.clone();
    r[1].pushed += 1;
    assert!(run(&r, &entries, &ages, last).is_err(), "heads out of step");
    let mut r = records.clone();
    r[0].evicted_forced += 1;
    assert!(run(&r, &entries, &ages, last).is_err(), "live + evicted");
    let mut r = records.clone();
    r[0].lse = f64::NEG_INFINITY;
    assert!(
        run(&r, &entries, &ages, last).is_err(),
        "certificate lost its evictions"
    );
    let mut r = records.clone();
    r[0].c_t = f64::NAN;
    assert!(run(&r, &entries, &ages, last).is_err());
    let mut e = entries.clone();
    e[0][2].c = r[0].c_t - 100.0;
    assert!(run(&records, &e, &ages, last).is_err(), "c below c_t");
    let mut e = entries.clone();
    e[0][0].zone = EntryZone::Evictable;
    assert!(run(&records, &e, &ages, last).is_err(), "sink slot");
    let mut e = entries.clone();
    let newest = ages[0][ages[0].len() - 1];
    e[0][newest].zone = EntryZone::Evictable;
    assert!(
        run(&records, &e, &ages, last).is_err(),
        "window lost a token"
    );
    let mut a = ages.clone();
    a[0].swap(0, 1);
    assert!(run(&records, &entries, &a, last).is_err(), "age order");
    let mut a = ages.clone();
    a[0][1] = a[0][0];
    assert!(run(&records, &entries, &a, last).is_err(), "slot twice");
    let mut a = ages.clone();
    a[0][0] = 0;
    assert!(
        run(&records, &entries, &a, last).is_err(),
        "sink in the age list"
    );
    let mut e = entries.clone();
    e[1][1].score = f32::NAN;
    assert!(run(&records, &e, &ages, last).is_err());
}

proptest! {
    /// `next_evictions` predicts `append`: for any gates, the evicted positions are, in
    /// order, the candidates whose threshold is at or above the new `c_t`.
    #[test]
    fn next_evictions_are_the_appended_prefix(
        gates in proptest::collection::vec(-3.0f64..0.0, 1..120),
        budget in 6usize..24,
        window in 1usize..4,
        sinks in 0usize..3,
        certified in any::<bool>(),
    ) {
        let mut cfg = PolicyConfig::new(2, budget);
        cfg.head_budget = Some(budget);
        cfg.window = window;
        cfg.sinks = sinks;
        cfg.ln_eps = certified.then_some(-4.0);
        let mut p = policy(cfg, &[0.5, 1.5]);
        let mut c = [0.0f64; 2];
        let mut cand = [Candidate::default(); 32];
        for (t, &g) in gates.iter().enumerate() {
            let mut want: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
            c[0] += g;
            c[1] += g / 3.0;
            for (h, w) in want.iter_mut().enumerate() {
                let n = p.next_evictions(h, &mut cand).unwrap().expect("a prefix");
                let (r, _) = p.head_ref(h);
                for k in &cand[..n] {
                    if c[h] <= k.evict_at_or_below {
                        w.push(r[k.slot as usize].position);
                    }
                }
            }
            let mut got: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
            p.append(t as u64, &c, None, |ev| got[ev.head].push(ev.position)).unwrap();
            prop_assert_eq!(&got, &want);
        }
    }
}
