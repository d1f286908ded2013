//! The split, `auto`'s choice and the fallback, on stand-in GPUs that run the CPU kernels
//! (so every output is bit-identical to the CPU backend's whatever the plan) and fail or
//! count calls on demand: a real device can be neither lost nor counted on demand. Real
//! devices are exercised in `tests/hybrid.rs`.

use super::*;
use crate::decisions::tests::Inputs;
use proptest::prelude::*;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

/// The CPU kernels as a GPU: fails as a lost device once `fail` is set; counts its calls.
#[derive(Debug, Default)]
struct StandIn {
    fail: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl StandIn {
    fn check(&self) -> Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match self.fail.load(Ordering::Acquire) {
            true => Err(Error::BackendUnavailable("vulkan: device lost".into())),
            false => Ok(()),
        }
    }
}

impl AttentionBackend for StandIn {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }
    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check()?;
        CpuBackend.prefill(call, out)
    }
    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check()?;
        CpuBackend.decode(call, out)
    }
}

/// A placement over a [`StandIn`] named `name` (the process-wide calibrations' key).
fn placement(
    auto: bool,
    concurrent: bool,
    name: &str,
) -> (Placement, Arc<AtomicBool>, Arc<AtomicUsize>) {
    let g = StandIn::default();
    let (fail, calls) = (g.fail.clone(), g.calls.clone());
    let gpu = Gpu {
        backend: Box::new(g),
        name: name.into(),
        concurrent,
    };
    (Placement::new(auto, gpu), fail, calls)
}

#[test]
fn a_split_gives_the_heaviest_heads_to_the_gpu() {
    let w = [1u64, 1000, 10, 100];
    assert_eq!(Split::of(&w, 0.9).gpu_heads, vec![1]);
    assert_eq!(Split::of(&w, 0.99).gpu_heads, vec![1, 3]);
    // At least one head a side, whatever the share.
    assert_eq!(Split::of(&w, 0.0).gpu_heads, vec![1]);
    assert_eq!(Split::of(&w, 1.0).cpu_heads, vec![0]);
    // Equal heads: the share in heads, rounded.
    assert_eq!(Split::of(&[1; 8], 0.3).gpu_heads.len(), 2);
}

proptest! {
    /// Every head runs exactly once, both sides have heads, and no CPU head outweighs a
    /// GPU head.
    #[test]
    fn a_split_is_a_partition_by_weight(
        w in proptest::collection::vec(0u64..1_000_000, 2..40),
        share in 0.0f64..1.0,
    ) {
        let s = Split::of(&w, share);
        let mut all: Vec<usize> = s.gpu_heads.iter().chain(&s.cpu_heads).copied().collect();
        all.sort_unstable();
        prop_assert_eq!(all, (0..w.len()).collect::<Vec<_>>());
        prop_assert!(!s.gpu_heads.is_empty() && !s.cpu_heads.is_empty());
        let light_gpu = s.gpu_heads.iter().map(|&h| w[h]).min().unwrap();
        let heavy_cpu = s.cpu_heads.iter().map(|&h| w[h]).max().unwrap();
        prop_assert!(light_gpu >= heavy_cpu);
    }
}

#[test]
fn a_side_computes_its_heads_in_place_on_the_whole_calls_decisions() {
    // A split's sides run the whole call with `only` their heads and the call's decisions
    // for every head: each writes exactly its heads' rows, as the whole call would, and
    // reports their statistics in order.
    let p = Inputs::new(300, 5, 16, 11);
    let (nh, d) = (5, 16);
    for acp in [Acp::Off, p.bound()] {
        let whole = p.call(acp);
        let all = prefill_decisions(&whole).unwrap();
        let mut want = vec![0.0; p.q.len()];
        let st_want = CpuBackend.prefill(&whole, &mut want).unwrap();
        for idx in [vec![0usize, 3], vec![4], vec![1, 2, 4]] {
            for acp in [acp, all.acp()] {
                let call = whole.with_acp(acp).with_heads(Some(&idx));
                let mut got = vec![-7.0f32; p.q.len()];
                let st = CpuBackend.prefill(&call, &mut got).unwrap();
                for (r, (g, w)) in got.chunks(nh * d).zip(want.chunks(nh * d)).enumerate() {
                    for h in 0..nh {
                        let g = &g[h * d..][..d];
                        if idx.contains(&h) {
                            assert_eq!(g, &w[h * d..][..d], "row {r} head {h}");
                        } else {
                            assert!(g.iter().all(|&x| x == -7.0), "row {r} head {h}");
                        }
                    }
                }
                let pick: Vec<_> = idx.iter().map(|&h| st_want.heads[h]).collect();
                assert_eq!(st.heads, pick, "{idx:?}");
            }
        }
    }
}

#[test]
fn split_output_is_exact_and_device_loss_falls_back() {
    let (s, fail, _) = placement(false, true, "stand-in: hybrid loss");
    let p = Inputs::new(257, 6, 16, 13);
    let mut want = vec![0.0; p.q.len()];
    let st_want = CpuBackend.prefill(&p.call(p.bound()), &mut want).unwrap();
    let mut got = vec![0.0; p.q.len()];
    let st = s.prefill(&p.call(p.bound()), &mut got).unwrap();
    let split = s.last_split().unwrap();
    assert!(!split.gpu_heads.is_empty() && !split.cpu_heads.is_empty());
    // Same kernels on both sides: the split output is bit-identical.
    assert_eq!(got, want);
    assert_eq!(st, st_want);
    assert_eq!(s.kind(), BackendKind::Hybrid);
    // A decode split too.
    let step = p.step(200);
    let heads = step.heads();
    let call = step.call(&heads, step.bound());
    let (mut a, mut b) = (vec![0.0; 6 * 16], vec![1.0; 6 * 16]);
    let st_want = CpuBackend.decode(&call, &mut a).unwrap();
    assert_eq!(s.decode(&call, &mut b).unwrap(), st_want);
    assert_eq!(a, b);
    assert!(!s.last_split().unwrap().cpu_heads.is_empty());

    fail.store(true, Ordering::Release);
    let mut got = vec![0.0; p.q.len()];
    let st = s.prefill(&p.call(p.bound()), &mut got).unwrap();
    assert_eq!(got, want, "the lost device's heads reran on the CPU");
    assert_eq!(st.heads.len(), 6);
    assert!(s.fell_back());
    assert_eq!(s.kind(), BackendKind::Cpu);
    b.fill(0.0);
    s.decode(&call, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn auto_matches_the_cpu_whatever_it_runs_and_falls_back_mid_decode() {
    let (s, fail, _) = placement(true, true, "stand-in: auto");
    let p = Inputs::new(300, 4, 16, 17);
    for acp in [Acp::Off, p.bound()] {
        let mut want = vec![0.0; p.q.len()];
        let st_want = CpuBackend.prefill(&p.call(acp), &mut want).unwrap();
        for _ in 0..8 {
            let mut got = vec![0.0; p.q.len()];
            assert_eq!(s.prefill(&p.call(acp), &mut got).unwrap(), st_want);
            assert_eq!(got, want);
        }
    }
    let step = p.step(300);
    let heads = step.heads();
    let call = step.call(&heads, step.bound());
    let mut want = vec![0.0; 4 * 16];
    let st_want = CpuBackend.decode(&call, &mut want).unwrap();
    for step in 0..40 {
        if step == 20 {
            // The device is lost, and the next call is a re-check of the GPU (which plan
            // auto runs otherwise depends on the timings).
            fail.store(true, Ordering::Release);
            for r in s.state.lock().unwrap().classes.values_mut() {
                r.again = Some(Plan::Gpu);
            }
        }
        let mut got = vec![0.0; 4 * 16];
        assert_eq!(s.decode(&call, &mut got).unwrap(), st_want, "step {step}");
        assert_eq!(got, want, "step {step}");
    }
    assert!(s.fell_back());
    assert_eq!(s.kind(), BackendKind::Cpu);
    let before = s.plan_counts();
    let mut got = vec![0.0; 4 * 16];
    s.decode(&call, &mut got).unwrap();
    assert_eq!(got, want);
    assert_eq!(
        s.plan_counts(),
        before,
        "after the loss calls bypass the placement"
    );
}

#[test]
fn shared_cores_never_split_in_auto() {
    // A CPU Vulkan device shares the host's cores: a split's sides run one after the
    // other, never faster than the faster side alone, so auto does not consider one.
    let (s, _, _) = placement(true, false, "stand-in: shared cores");
    let p = Inputs::new(200, 4, 16, 19);
    let mut out = vec![0.0; p.q.len()];
    for _ in 0..30 {
        s.prefill(&p.call(p.bound()), &mut out).unwrap();
    }
    let c = s.plan_counts();
    assert_eq!((c.split, c.cpu + c.gpu), (0, 30), "{c:?}");
}

#[test]
fn a_cached_calibration_still_warms_the_gpu_once() {
    // Two placements on one device: the first calibrates; the second takes that
    // calibration but runs each kind of call on its GPU once (its pipelines are built at
    // the stream's start, not at its first GPU call), and only once.
    let (a, _, first) = placement(true, true, "stand-in: cached calibration");
    let ca = a.calibration(2, 8).unwrap();
    let (b, _, second) = placement(true, true, "stand-in: cached calibration");
    assert_eq!(b.calibration(2, 8).unwrap(), ca);
    let warm = second.load(Ordering::Relaxed);
    assert!(
        warm >= 4,
        "{warm}: a prefill and a decode, each warmed up and timed"
    );
    assert!(
        warm < first.load(Ordering::Relaxed),
        "fewer than a calibration"
    );
    b.calibration(2, 8).unwrap();
    assert_eq!(second.load(Ordering::Relaxed), warm);
    assert!(
        ca.cpu
            .iter()
            .chain(&ca.gpu)
            .all(|l| l.a >= 0.0 && l.b > 0.0),
        "{ca}"
    );
}

#[test]
fn a_try_runs_twice_and_only_its_second_call_is_recorded() {
    let mut r = Record::default();
    let est = [Some(1.0), Some(1.5), None];
    // The best first; then the untried GPU (within EXPLORE) twice; then the best again.
    let picks: Vec<(Plan, bool)> = (0..5)
        .map(|_| {
            let (p, warm) = r.pick(&est);
            if warm {
                r.learn(p, 1.0);
            }
            (p, warm)
        })
        .collect();
    assert_eq!(
        picks,
        [
            (Plan::Cpu, false),
            (Plan::Gpu, false),
            (Plan::Gpu, true),
            (Plan::Cpu, false),
            (Plan::Cpu, true)
        ]
    );
    // A plan beyond EXPLORE is never tried.
    let mut r = Record::default();
    let far = [Some(1.0), Some(EXPLORE * 1.01), None];
    assert!((0..500).all(|_| r.pick(&far).0 == Plan::Cpu));
}

#[test]
fn the_runner_up_is_rechecked_every_recheck_calls() {
    let mut r = Record::default();
    r.ratios[Plan::Gpu as usize].push(1.0);
    r.ratios[Plan::Split as usize].push(1.0);
    // The split is beyond EXPLORE: only the GPU is re-checked, twice every RECHECK_EVERY.
    let est = [Some(1.0), Some(1.8), Some(2.5)];
    let gpu_calls: Vec<u64> = (1..=3 * RECHECK_EVERY + 1)
        .filter(|_| r.pick(&est).0 == Plan::Gpu)
        .collect();
    let k = RECHECK_EVERY;
    assert_eq!(gpu_calls, [k, k + 1, 2 * k, 2 * k + 1, 3 * k, 3 * k + 1]);
}

/// `calls` calls of auto over plans whose true seconds are `truth` and whose fit predicts
/// `fit` (None: not a candidate), each call's time `truth x noise()`: auto's total time
/// over the best plan's.
fn simulate(
    truth: [f64; 3],
    fit: [Option<f64>; 3],
    calls: usize,
    mut noise: impl FnMut() -> f64,
) -> f64 {
    let mut r = Record::default();
    let mut total = 0.0;
    for _ in 0..calls {
        let est = PLANS.map(|p| Some(fit[p as usize]? * r.factor(p).unwrap_or(1.0)));
        let (p, warm) = r.pick(&est);
        let secs = truth[p as usize] * noise();
        total += secs;
        if warm {
            r.learn(p, secs / fit[p as usize].unwrap_or(1.0));
        }
    }
    let best = (0..3)
        .filter(|&i| fit[i].is_some())
        .map(|i| truth[i])
        .fold(f64::INFINITY, f64::min);
    total / (best * calls as f64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Over 2000 calls with +-10% noise per call and fits off by up to 1.3x either way
    /// (so the best plan is always within EXPLORE of the fitted best), auto spends at most
    /// 5% more than the best plan would: its tries and re-checks, nothing more.
    #[test]
    fn auto_stays_within_five_percent_of_the_best_plan(
        truth in proptest::array::uniform3(0.1f64..10.0),
        err in proptest::array::uniform3(1.0 / 1.3f64..1.3),
        split in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let fit = [0, 1, 2].map(|i| (i < 2 || split).then(|| truth[i] * err[i]));
        let mut s = seed | 1;
        let noise = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            0.9 + 0.2 * (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let ratio = simulate(truth, fit, 2000, noise);
        prop_assert!(ratio <= 1.05, "auto / best {ratio}");
    }
}

#[test]
fn measured_medians_overrule_a_wrong_fit() {
    // The fit has the GPU 1.6x faster; truly it is 1.5x slower. Auto tries the CPU (within
    // EXPLORE), measures both and stays on the CPU: about the best plan's time.
    let ratio = simulate(
        [1.0, 1.5, 9.9],
        [Some(1.0), Some(0.625), None],
        1000,
        || 1.0,
    );
    assert!(ratio < 1.03, "{ratio}");
}
