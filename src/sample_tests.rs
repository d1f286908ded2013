use super::Rng;
use super::*;
use proptest::prelude::*;

/// The chain in plain f64, step by step with explicit renormalisation after each filter.
fn reference(logits: &[f32], c: &SamplerConfig, recent: &[u32]) -> Vec<f64> {
    let n = logits.len();
    let mut x: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    let mut seen = recent.to_vec();
    seen.sort_unstable();
    seen.dedup();
    let theta = f64::from(c.repetition_penalty);
    for t in seen {
        let v = &mut x[t as usize];
        *v = if *v > 0.0 { *v / theta } else { *v * theta };
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
    let mut p = vec![0.0; n];
    if c.temperature == 0.0 {
        p[order[0]] = 1.0;
        return p;
    }
    let t = f64::from(c.temperature);
    let max = x[order[0]];
    for i in 0..n {
        p[i] = ((x[i] - max) / t).exp();
    }
    let norm = |p: &mut Vec<f64>| {
        let s: f64 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= s);
    };
    norm(&mut p);
    if c.top_k > 0 {
        for &i in order.iter().skip(c.top_k) {
            p[i] = 0.0;
        }
        norm(&mut p);
    }
    if c.top_p < 1.0 {
        let mut cum = 0.0;
        let mut cut = false;
        for &i in &order {
            if cut {
                p[i] = 0.0;
            } else {
                cum += p[i];
                cut = cum >= f64::from(c.top_p);
            }
        }
        norm(&mut p);
    }
    if c.min_p > 0.0 {
        let pmax = p.iter().cloned().fold(0.0, f64::max);
        for v in p.iter_mut() {
            if *v < f64::from(c.min_p) * pmax {
                *v = 0.0;
            }
        }
        norm(&mut p);
    }
    p
}

/// Whether a top-p or min-p threshold falls within `tol` of a cumulative mass or a relative
/// probability: there the kept set depends on the last bit of rounding.
fn near_boundary(logits: &[f32], c: &SamplerConfig, recent: &[u32]) -> bool {
    let unfiltered = SamplerConfig {
        top_p: 1.0,
        min_p: 0.0,
        ..c.clone()
    };
    if c.temperature == 0.0 {
        return false;
    }
    let p = reference(logits, &unfiltered, recent);
    let mut sorted = p.clone();
    sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let tol = 1e-9;
    let mut cum = 0.0;
    for &v in &sorted {
        cum += v;
        if (cum - f64::from(c.top_p)).abs() < tol {
            return true;
        }
        if (v / sorted[0] - f64::from(c.min_p)).abs() < tol {
            return true;
        }
    }
    false
}

fn config(temperature: f32, top_k: usize, top_p: f32, min_p: f32, pen: f32) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty: pen,
        repetition_window: 8,
        seed: 3,
    }
}

#[test]
fn greedy_takes_the_lowest_id_among_ties() {
    let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
    assert_eq!(s.sample(&[0.0, 0.0]).unwrap(), 0);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let c = SamplerConfig {
        repetition_penalty: 2.0,
        ..SamplerConfig::greedy()
    };
    let mut s = Sampler::new(c.clone()).unwrap();
    s.accept(&[0]);
    // 2.0 / 2 = 1.0 < 1.9.
    assert_eq!(s.sample(&[2.0, 1.9]).unwrap(), 1);
    let mut s = Sampler::new(c).unwrap();
    s.accept(&[0]);
    // -1 * 2 = -2 < -1.5.
    assert_eq!(s.sample(&[-1.0, -1.5]).unwrap(), 1);
}

#[test]
fn the_window_holds_only_the_last_n_tokens() {
    let c = SamplerConfig {
        repetition_penalty: 100.0,
        repetition_window: 2,
        ..SamplerConfig::greedy()
    };
    let mut s = Sampler::new(c).unwrap();
    s.accept(&[0, 1, 2]);
    // 0 fell out of the window: unpenalised, it wins.
    assert_eq!(s.sample(&[5.0, 5.0, 5.0, 1.0]).unwrap(), 0);
    // The window is now [2, 0]: 1 wins.
    assert_eq!(s.sample(&[5.0, 5.0, 5.0, 1.0]).unwrap(), 1);
}

#[test]
fn invalid_configs_are_named_errors() {
    let bad = [
        SamplerConfig {
            temperature: -0.1,
            ..Default::default()
        },
        SamplerConfig {
            temperature: f32::NAN,
            ..Default::default()
        },
        SamplerConfig {
            temperature: f32::INFINITY,
            ..Default::default()
        },
        SamplerConfig {
            top_p: 0.0,
            ..Default::default()
        },
        SamplerConfig {
            top_p: 1.5,
            ..Default::default()
        },
        SamplerConfig {
            top_p: f32::NAN,
            ..Default::default()
        },
        SamplerConfig {
            min_p: -0.1,
            ..Default::default()
        },
        SamplerConfig {
            min_p: f32::NAN,
            ..Default::default()
        },
        SamplerConfig {
            min_p: 1.1,
            ..Default::default()
        },
        SamplerConfig {
            repetition_penalty: 0.0,
            ..Default::default()
        },
        SamplerConfig {
            repetition_penalty: f32::NAN,
            ..Default::default()
        },
        SamplerConfig {
            repetition_penalty: f32::INFINITY,
            ..Default::default()
        },
    ];
    let fields = [
        "temperature",
        "temperature",
        "temperature",
        "top_p",
        "top_p",
        "top_p",
        "min_p",
        "min_p",
        "min_p",
        "repetition_penalty",
        "repetition_penalty",
        "repetition_penalty",
    ];
    for (c, field) in bad.iter().zip(fields) {
        let e = Sampler::new(c.clone()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.to_string().contains(field), "{e}");
    }
    assert!(Sampler::new(SamplerConfig::default()).is_ok());
}

#[test]
fn bad_logits_and_recent_tokens_are_errors() {
    let mut s = Sampler::new(SamplerConfig::default()).unwrap();
    assert!(s.sample(&[]).is_err());
    let e = s.sample(&[0.0, f32::NAN]).unwrap_err();
    assert!(e.to_string().contains("logit 1"), "{e}");
    assert!(s.sample(&[f32::INFINITY]).is_err());
    let mut s = Sampler::new(SamplerConfig {
        repetition_penalty: 1.5,
        ..Default::default()
    })
    .unwrap();
    s.accept(&[7]);
    let e = s.sample(&[0.0; 4]).unwrap_err();
    assert!(e.to_string().contains("recent token 7"), "{e}");
}

#[test]
fn top_k_one_is_greedy() {
    let mut s = Sampler::new(config(1.0, 1, 1.0, 0.0, 1.0)).unwrap();
    for _ in 0..50 {
        assert_eq!(s.sample(&[0.5, 2.0, 2.0, -1.0]).unwrap(), 1);
    }
}

/// Draw frequencies against the reference: with N draws a bin's count is Binomial(N, p),
/// so |f − p| ≤ 5·sqrt(p(1−p)/N) + 1/N holds except with probability < 1e-6 per bin; the
/// seed is fixed, so the outcome is the same on every run.
fn check_frequencies(logits: &[f32], c: &SamplerConfig) {
    const N: usize = 40_000;
    let p = reference(logits, c, &[]);
    let mut s = Sampler::new(SamplerConfig {
        repetition_window: 0,
        ..c.clone()
    })
    .unwrap();
    assert!(
        s.probabilities(logits)
            .unwrap()
            .iter()
            .zip(&p)
            .all(|(a, b)| (a - b).abs() < 1e-12)
    );
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..N {
        counts[s.sample(logits).unwrap() as usize] += 1;
    }
    for (i, (&k, &pi)) in counts.iter().zip(&p).enumerate() {
        let f = k as f64 / N as f64;
        let tol = 5.0 * (pi * (1.0 - pi) / N as f64).sqrt() + 1.0 / N as f64;
        assert!((f - pi).abs() <= tol, "id {i}: {f} vs {pi} (tol {tol})");
        if pi == 0.0 {
            assert_eq!(k, 0, "id {i} is filtered out");
        }
    }
}

#[test]
fn frequencies_match_the_filtered_distribution() {
    let logits = [0.0, 1.0, 2.0, 3.0, -1.0, 2.5];
    check_frequencies(&logits, &config(1.0, 0, 1.0, 0.0, 1.0));
    check_frequencies(&logits, &config(0.7, 4, 1.0, 0.0, 1.0));
    check_frequencies(&logits, &config(1.3, 0, 0.8, 0.0, 1.0));
    check_frequencies(&logits, &config(1.0, 0, 1.0, 0.2, 1.0));
    check_frequencies(&logits, &config(2.0, 5, 0.9, 0.05, 1.0));
}

#[test]
fn legacy_sample_is_greedy_or_softmax() {
    let mut rng = Rng::new(1);
    assert_eq!(sample(&[0.0, 3.0, 1.0], 0.0, &mut rng).unwrap(), 1);
    let mut counts = [0usize; 3];
    for _ in 0..20000 {
        counts[sample(&[0.0, 1.0, 2.0], 1.0, &mut rng).unwrap() as usize] += 1;
    }
    // softmax([0,1,2]) = [0.090, 0.245, 0.665]; 20k draws: sd ≈ 0.003.
    let p2 = counts[2] as f64 / 20000.0;
    assert!((p2 - 0.665).abs() < 0.02, "{counts:?}");
    assert!(sample(&[], 1.0, &mut rng).is_err());
    assert!(sample(&[1.0], -1.0, &mut rng).is_err());
    assert!(sample(&[f32::NAN], 1.0, &mut rng).is_err());
    let mut a = Rng::new(9);
    let mut b = Rng::new(9);
    assert!((0..4).all(|_| a.next_u64() == b.next_u64()));
}

#[test]
fn legacy_sample_draws_as_the_plain_walk() {
    // Softmax sampling walks the ids in order: weights exp((x - max) / T), r = u * total.
    let logits = [0.3f32, -1.0, 2.0, 2.0, 0.7];
    let (mut a, mut b) = (Rng::new(42), Rng::new(42));
    let inv = 1.0 / f64::from(0.8f32);
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - 2.0) * inv).exp())
        .collect();
    let total: f64 = w.iter().sum();
    for _ in 0..2000 {
        let mut r = b.next_f64() * total;
        let want = w
            .iter()
            .position(|&p| {
                let hit = r < p;
                r -= p;
                hit
            })
            .unwrap();
        assert_eq!(sample(&logits, 0.8, &mut a).unwrap() as usize, want);
    }
}

fn arb_case() -> impl Strategy<Value = (Vec<f32>, SamplerConfig, Vec<u32>)> {
    (2usize..40).prop_flat_map(|n| {
        (
            prop::collection::vec(-20.0f32..20.0, n),
            (
                prop_oneof![Just(0.0f32), 0.05f32..4.0],
                0usize..(n + 3),
                prop_oneof![Just(1.0f32), 0.01f32..1.0],
                prop_oneof![Just(0.0f32), 0.0f32..1.0],
                prop_oneof![Just(1.0f32), 0.5f32..3.0],
                any::<u64>(),
            ),
            prop::collection::vec(0..n as u32, 0..10),
        )
            .prop_map(|(logits, (t, k, p, m, pen, seed), recent)| {
                let c = SamplerConfig {
                    temperature: t,
                    top_k: k,
                    top_p: p,
                    min_p: m,
                    repetition_penalty: pen,
                    repetition_window: 16,
                    seed,
                };
                (logits, c, recent)
            })
    })
}

proptest! {
    #[test]
    fn probabilities_match_the_reference((logits, c, recent) in arb_case()) {
        prop_assume!(!near_boundary(&logits, &c, &recent));
        let mut s = Sampler::new(c.clone()).unwrap();
        s.accept(&recent);
        let got = s.probabilities(&logits).unwrap();
        let want = reference(&logits, &c, &recent);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() <= 1e-12, "id {}: {} vs {}", i, a, b);
        }
    }

    #[test]
    fn a_sampled_id_has_nonzero_probability((logits, c, recent) in arb_case()) {
        prop_assume!(!near_boundary(&logits, &c, &recent));
        let mut s = Sampler::new(c.clone()).unwrap();
        s.accept(&recent);
        let mut window = recent.clone();
        for _ in 0..8 {
            let last = &window[window.len().saturating_sub(16)..];
            prop_assume!(!near_boundary(&logits, &c, last));
            let p = reference(&logits, &c, last);
            let id = s.sample(&logits).unwrap();
            prop_assert!(p[id as usize] > 0.0, "id {} has p = 0", id);
            window.push(id);
        }
    }

    #[test]
    fn greedy_is_the_argmax(logits in prop::collection::vec(-5.0f32..5.0, 1..50)) {
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        let id = s.sample(&logits).unwrap() as usize;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        prop_assert_eq!(id, logits.iter().position(|&v| v == max).unwrap());
    }

    #[test]
    fn the_same_seed_gives_the_same_sequence((logits, c, recent) in arb_case()) {
        let run = || {
            let mut s = Sampler::new(c.clone()).unwrap();
            s.accept(&recent);
            (0..16).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        prop_assert_eq!(run(), run());
        let mut s = Sampler::new(c.clone()).unwrap();
        s.accept(&recent);
        let first: Vec<u32> = (0..16).map(|_| s.sample(&logits).unwrap()).collect();
        s.reset();
        s.accept(&recent);
        let again: Vec<u32> = (0..16).map(|_| s.sample(&logits).unwrap()).collect();
        prop_assert_eq!(first, again);
    }
}
