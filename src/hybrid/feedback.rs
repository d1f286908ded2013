//! `auto`'s measured corrections of the cost model, per call size class.
//!
//! For each plan kind (all CPU, all GPU, split) a class keeps the ratios measured seconds /
//! predicted seconds of its last [`WINDOW`] calls; a plan's corrected prediction is the
//! model's raw prediction times the median of those ratios (the lower median: the faster
//! of two), a prior before the kind has run. Two slow calls of five (a preempted call, a
//! driver's hiccup, a plan's first call in a class with its one-time work: device buffers
//! sized, pool threads woken) do not move it, and every kind is judged by the same
//! statistic whatever the spread of its times. On the H100 host, a low quantile (the second
//! fastest of five) favoured the plan whose times spread wider (an 11-head split, 8% slower
//! than the all-GPU plan at decode 64k, kept winning on its fast tail); a mean without the
//! slowest, tried next, moves with any second slow call.
//!
//! Choice, given the raw predictions of the candidate plans:
//! - the smallest corrected prediction wins; the incumbent (the plan last run as the
//!   winner) stays while it is within [`HYSTERESIS`] of that, so two plans within noise of
//!   each other do not alternate;
//! - once the winner has run, one other plan may be probed instead: a plan never run whose
//!   corrected prediction is within `explore` of the winner's; else a plan due for a
//!   re-check (`RECHECK_GAP · 2^k` calls of the class since it last ran, `k` = its re-checks
//!   since it last ran as the winner that did not beat the winner's prediction) and within
//!   `explore` of the winner when it has run once, [`RECHECK`] after that. Re-checks of a
//!   plan that keeps losing thin out geometrically; one that beats the winner is re-checked
//!   again soon, so a leader that lost to a burst of slow calls wins back in a few calls;
//! - a plan that ran first as the winner (the model predicted it best) and lost on that one
//!   call (measured slower than its prior allowed) gets its second call right after the new
//!   winner's first, outside the budget, if its prediction with the prior (not with the one
//!   slow ratio) is within `explore` of the winner: on the H100 host first calls cost the
//!   best prefill plan 4 calls on the slower one, and a first call 4x slow locked a 1.5x
//!   faster plan out of a 4k prefill class;
//! - a probe must fit the budget: the time probes took beyond the winner's prediction, this
//!   one's expected excess included, stays within [`PROBE_BUDGET`] of all the time the class
//!   has run. So probing never costs more than that fraction of a workload (plus one call),
//!   however wrong the model is, and is spread over it: a plan 2x slower is first tried
//!   after about 1 / PROBE_BUDGET = 50 calls of the winner.

use super::PlanKind;

/// Calls of one kind whose ratios are kept (their median is the factor).
pub(super) const WINDOW: usize = 5;

/// The plan run last is kept while its corrected prediction is within this factor of the
/// best one.
pub(super) const HYSTERESIS: f64 = 1.03;

/// A plan already run is re-checked only while its corrected prediction is within this
/// factor of the best one.
pub(super) const RECHECK: f64 = 1.3;

/// Probes' time beyond the winner's prediction, as a fraction of the class's time. Small
/// beside the 5% that `auto` may lose to the best single backend: timing noise on a shared
/// host takes the rest (2-6% between two identical CPU engines on the H100 host).
pub(super) const PROBE_BUDGET: f64 = 0.02;

/// Calls of the class between the re-checks of a plan that has run once, or that has just
/// lost the lead; doubled with each re-check since it last ran as the winner (capped at
/// 2^[`RECHECK_MAX_DOUBLINGS`] times). A plan that led for long and then lost, maybe to a
/// burst of slow calls, is re-checked soon (on the H100 host the CPU plan, 1.5x faster,
/// lost a 1k prefill class for good when its gap was counted from its runs).
pub(super) const RECHECK_GAP: u64 = 4;
const RECHECK_MAX_DOUBLINGS: u64 = 8;

/// One plan kind's record in a size class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct KindRecord {
    /// Ring of the last [`WINDOW`] ratios (measured / predicted); `len` of them are valid.
    ratios: [f64; WINDOW],
    len: usize,
    next: usize,
    /// Calls of this kind recorded, and the class's call count at the last one.
    runs: u64,
    last_call: u64,
    /// Its first call ran as the winner (not as a probe): the plan was predicted best.
    first_won: bool,
    /// Probes of it since it last ran as the winner that did not beat the winner's
    /// prediction: its re-check gaps double with these.
    rechecks: u64,
}

impl KindRecord {
    /// The lower median of the window's ratios (the faster of two; see the module docs).
    fn factor(&self) -> Option<f64> {
        if self.len == 0 {
            return None;
        }
        let mut r = self.ratios;
        let r = &mut r[..self.len];
        r.sort_by(f64::total_cmp);
        Some(r[(self.len - 1) / 2])
    }
}

/// The record of one size class (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct ClassRecord {
    kinds: [KindRecord; 3],
    /// Calls recorded in this class (all kinds).
    calls: u64,
    /// The kind last run as the winner (not as a probe).
    incumbent: Option<PlanKind>,
    /// Seconds of every recorded call, and of probes beyond the winner's prediction.
    spent: f64,
    probe_loss: f64,
}

/// Why [`ClassRecord::pick`] chose a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    /// Smallest corrected prediction (or the incumbent within [`HYSTERESIS`] of it).
    Best,
    /// A probe: never run, within `explore` of the best.
    Explore,
    /// A probe: run before, re-checked (see the module docs).
    Recheck,
}

/// What [`ClassRecord::pick`] decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pick {
    pub kind: PlanKind,
    pub reason: Reason,
    /// Corrected prediction of the winner (seconds): a probe's excess is counted from it.
    pub best_s: f64,
}

impl Pick {
    /// The winner's prediction when this pick is a probe (what [`ClassRecord::record`]
    /// counts its excess from), None for the winner itself.
    pub(super) fn probe_of(&self) -> Option<f64> {
        (self.reason != Reason::Best).then_some(self.best_s)
    }
}

impl ClassRecord {
    /// Folds a call of `kind` predicted (raw) at `raw_s` that took `secs`; `probe_of` is
    /// [`Pick::probe_of`] of the pick that chose it.
    pub(super) fn record(&mut self, kind: PlanKind, raw_s: f64, secs: f64, probe_of: Option<f64>) {
        let ratio = secs / raw_s;
        if !(ratio.is_finite() && ratio > 0.0) {
            return;
        }
        self.calls += 1;
        self.spent += secs;
        match probe_of {
            Some(best_s) => self.probe_loss += (secs - best_s).max(0.0),
            None => self.incumbent = Some(kind),
        }
        let k = &mut self.kinds[kind as usize];
        if k.runs == 0 {
            k.first_won = probe_of.is_none();
        }
        k.rechecks = match probe_of {
            None => 0,
            Some(best_s) if secs < best_s => k.rechecks,
            Some(_) => k.rechecks + 1,
        };
        k.ratios[k.next] = ratio;
        k.next = (k.next + 1) % WINDOW;
        k.len = (k.len + 1).min(WINDOW);
        k.runs += 1;
        k.last_call = self.calls;
    }

    /// The measured / predicted factor of `kind` (None before it has run).
    pub(super) fn factor(&self, kind: PlanKind) -> Option<f64> {
        self.kinds[kind as usize].factor()
    }

    /// The plan to run among `raw` (raw model predictions, seconds, of the candidate
    /// plans), with `prior(kind)` as the factor of a kind not run yet; see the module docs.
    pub(super) fn pick(
        &self,
        raw: &[(f64, PlanKind)],
        prior: impl Fn(PlanKind) -> f64,
        explore: f64,
    ) -> Pick {
        let corrected: Vec<(f64, PlanKind)> = raw
            .iter()
            .map(|&(t, k)| (t * self.factor(k).unwrap_or_else(|| prior(k)), k))
            .collect();
        let Some(&(min_t, mut best)) = corrected.iter().min_by(|x, y| x.0.total_cmp(&y.0)) else {
            return Pick {
                kind: PlanKind::Cpu,
                reason: Reason::Best,
                best_s: 0.0,
            };
        };
        let mut best_t = min_t;
        if let Some(inc) = self.incumbent
            && let Some(&(t, _)) = corrected.iter().find(|(_, k)| *k == inc)
            && t <= HYSTERESIS * min_t
        {
            (best, best_t) = (inc, t);
        }
        let pick = |kind, reason| Pick {
            kind,
            reason,
            best_s: best_t,
        };
        let rec = |k: PlanKind| &self.kinds[k as usize];
        if rec(best).runs == 0 {
            return pick(best, Reason::Best);
        }
        let affordable = |t: f64| {
            self.probe_loss + (t - best_t).max(0.0) <= PROBE_BUDGET * (self.spent + best_t)
        };
        if let Some(&(_, k)) = corrected.iter().find(|(t, k)| {
            *k != best && rec(*k).runs == 0 && *t <= explore * best_t && affordable(*t)
        }) {
            return pick(k, Reason::Explore);
        }
        let due = |k: PlanKind, raw_t: f64, t: f64| {
            let r = rec(k);
            // A plan predicted best that lost on its one call gets its second call next,
            // judged by its prior rather than by that call.
            let second_chance = r.runs == 1 && r.first_won && r.ratios[0] > prior(k);
            let (gap, t) = if second_chance {
                (1, raw_t * prior(k))
            } else {
                (RECHECK_GAP << r.rechecks.min(RECHECK_MAX_DOUBLINGS), t)
            };
            let within = if r.runs == 1 { explore } else { RECHECK };
            r.runs > 0
                && self.calls.saturating_sub(r.last_call) >= gap
                && t <= within * best_t
                && (second_chance || affordable(t))
        };
        if let Some((&(_, k), _)) = corrected
            .iter()
            .zip(raw)
            .find(|((t, k), (raw_t, _))| *k != best && due(*k, *raw_t, *t))
        {
            return pick(k, Reason::Recheck);
        }
        pick(best, Reason::Best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: PlanKind = PlanKind::Cpu;
    const GPU: PlanKind = PlanKind::Gpu;
    const SPLIT: PlanKind = PlanKind::Split;

    fn one(_: PlanKind) -> f64 {
        1.0
    }

    /// A winner's call predicted at 1 s that took `secs`.
    fn won(r: &mut ClassRecord, k: PlanKind, secs: f64) {
        r.record(k, 1.0, secs, None);
    }

    /// Runs `calls` picks over `raw` (predicted 1 s each), each plan taking `truth(kind)`
    /// seconds; returns the picks.
    fn simulate(
        r: &mut ClassRecord,
        raw: &[(f64, PlanKind)],
        explore: f64,
        calls: usize,
        truth: impl Fn(PlanKind) -> f64,
    ) -> Vec<Pick> {
        (0..calls)
            .map(|_| {
                let p = r.pick(raw, one, explore);
                let raw_s = raw.iter().find(|x| x.1 == p.kind).map_or(1.0, |x| x.0);
                r.record(p.kind, raw_s, truth(p.kind), p.probe_of());
                p
            })
            .collect()
    }

    #[test]
    fn factor_is_the_lower_median_of_the_window() {
        let mut r = ClassRecord::default();
        assert_eq!(r.factor(CPU), None);
        won(&mut r, CPU, 1.3);
        assert_eq!(r.factor(CPU), Some(1.3));
        // Two: the faster (a first call's one-time work is dropped by the second).
        won(&mut r, CPU, 10.0);
        assert_eq!(r.factor(CPU), Some(1.3));
        won(&mut r, CPU, 1.2);
        assert_eq!(r.factor(CPU), Some(1.3));
        won(&mut r, CPU, 1.1);
        assert_eq!(r.factor(CPU), Some(1.2));
        // Two slow calls of five do not move it.
        won(&mut r, CPU, 9.0);
        assert_eq!(r.factor(CPU), Some(1.3));
        // The window forgets the oldest: after 2.0 x 5 the factor is 2.0.
        for _ in 0..5 {
            won(&mut r, CPU, 2.0);
        }
        assert_eq!(r.factor(CPU), Some(2.0));
        // Non-finite or non-positive ratios teach nothing.
        won(&mut r, CPU, f64::NAN);
        won(&mut r, CPU, 0.0);
        r.record(CPU, 0.0, 1.0, None);
        assert_eq!(r.factor(CPU), Some(2.0));
        assert_eq!(r.calls, 10);
    }

    #[test]
    fn plans_are_judged_by_their_median_not_their_fast_tail() {
        // The split's calls spread wide (1.7-2.5 ms, median 2.2) and the GPU's are tight
        // (2.04 ms): a low quantile would keep the split; the median takes the GPU.
        let raw = [(1.0, GPU), (1.0, SPLIT)];
        let mut r = ClassRecord::default();
        r.record(GPU, 1.0, 2.04, Some(2.0));
        for x in [1.7, 2.5, 2.2, 2.4, 2.2] {
            won(&mut r, SPLIT, x);
        }
        assert_eq!(r.pick(&raw, one, 2.5).kind, GPU);
    }

    #[test]
    fn a_burst_of_slow_calls_does_not_lock_out_a_plan() {
        // CPU 1.0 s, GPU 1.2 s (raw predictions equal): the CPU is best...
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        r.record(GPU, 1.0, 1.2, Some(1.0));
        won(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        // ... two very slow CPU calls (15x, 2x) leave its factor at 1.0. (The GPU, measured
        // once, may come up for its re-check, never as the best.)
        won(&mut r, CPU, 1.0);
        for x in [15.0, 2.0] {
            won(&mut r, CPU, x);
            assert_eq!(r.factor(CPU), Some(1.0));
            let p = r.pick(&raw, one, 1.25);
            assert!(p.kind == CPU || p.reason == Reason::Recheck, "{p:?}");
        }
    }

    #[test]
    fn an_unlucky_first_call_is_rechecked() {
        // The split really takes 0.9 s but its first call, a probe, took 2.0 s; the CPU
        // takes 1.0 s. Measured once, it is re-checked (within `explore` = 2.5) once the
        // probe budget holds that probe's 1 s excess and the re-check's expected 1 s, i.e.
        // after 2 / PROBE_BUDGET s of calls, and then stays.
        let raw = [(1.0, CPU), (1.0, SPLIT)];
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        r.record(SPLIT, 1.0, 2.0, Some(1.0));
        let picks = simulate(
            &mut r,
            &raw,
            2.5,
            150,
            |k| if k == SPLIT { 0.9 } else { 1.0 },
        );
        let first = picks
            .iter()
            .position(|p| p.kind == SPLIT)
            .expect("a recheck");
        assert_eq!(picks[first].reason, Reason::Recheck);
        let due = (2.0 / PROBE_BUDGET) as usize;
        assert!((due - 5..=due).contains(&first), "{first}");
        // (The CPU, the leader it replaced, has its own re-checks.)
        assert!(
            picks[first + 1..]
                .iter()
                .all(|p| p.kind == SPLIT || p.reason == Reason::Recheck),
            "{picks:?}"
        );
        // Measured twice far above the best (3x > RECHECK), a plan is never re-checked.
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        won(&mut r, GPU, 3.0);
        won(&mut r, GPU, 3.0);
        let picks = simulate(&mut r, &[(1.0, CPU), (1.0, GPU)], 2.5, 100, |_| 1.0);
        assert!(picks.iter().all(|p| p.kind == CPU), "{picks:?}");
    }

    #[test]
    fn a_plan_predicted_best_that_lost_its_first_call_runs_again_next() {
        // The split is predicted best and run; its first call is slow (one-time work), so
        // the CPU wins the next call. The split's second call comes right after, outside the
        // budget (which holds nothing yet), and as it really is faster it stays.
        let raw = [(1.0, CPU), (0.9, SPLIT)];
        let mut r = ClassRecord::default();
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (SPLIT, Reason::Best));
        r.record(SPLIT, 0.9, 1.2, None);
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (CPU, Reason::Best));
        r.record(CPU, 1.0, 1.0, None);
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (SPLIT, Reason::Recheck));
        r.record(SPLIT, 0.9, 0.9, p.probe_of());
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            20,
            |k| if k == SPLIT { 0.9 } else { 1.0 },
        );
        assert!(
            picks
                .iter()
                .all(|p| p.kind == SPLIT || p.reason == Reason::Recheck),
            "{picks:?}"
        );
        // Slow again on its second call, it is left to the budgeted re-checks.
        let mut r = ClassRecord::default();
        r.record(SPLIT, 0.9, 1.2, None);
        r.record(CPU, 1.0, 1.0, None);
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (SPLIT, Reason::Recheck));
        r.record(SPLIT, 0.9, 1.2, p.probe_of());
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            10,
            |k| if k == SPLIT { 1.2 } else { 1.0 },
        );
        assert!(picks.iter().all(|p| p.kind == CPU), "{picks:?}");
    }

    #[test]
    fn a_first_call_far_off_does_not_lock_out_the_plan_predicted_best() {
        // The GPU is predicted best (0.9 s) and really takes 0.85 s, but its first call
        // took 4x its prediction. Judged by that call (3.6 s, beyond `explore` of the CPU's
        // 1 s) it would never run again; judged by its prior it gets its second call next,
        // which drops the slow one from its factor, and it stays.
        let raw = [(1.0, CPU), (0.9, GPU)];
        let mut r = ClassRecord::default();
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Best));
        r.record(GPU, 0.9, 3.6, None);
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            12,
            |k| if k == GPU { 0.85 } else { 1.0 },
        );
        assert_eq!((picks[0].kind, picks[1].kind), (CPU, GPU), "{picks:?}");
        assert_eq!(picks[1].reason, Reason::Recheck);
        assert!(
            picks[2..]
                .iter()
                .all(|p| p.kind == GPU || p.reason == Reason::Recheck)
        );
    }

    #[test]
    fn a_leader_that_lost_to_a_burst_is_rechecked_soon() {
        // The CPU (1.0 s) leads for 200 calls; a burst of slow calls (1.5 s) fills its
        // window and the GPU (1.2 s) takes over. The CPU's re-checks start again at
        // RECHECK_GAP and, as each beats the GPU, do not thin out: three of them (the
        // window's median is then 1.0) bring it back within 3 x (4 + 1) calls, not after
        // 2^8 of them.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        r.record(GPU, 1.0, 1.2, Some(1.0));
        for _ in 0..200 {
            won(&mut r, CPU, 1.0);
        }
        for _ in 0..WINDOW {
            won(&mut r, CPU, 1.5);
        }
        assert_eq!(r.pick(&raw, one, 1.25).kind, GPU);
        let picks = simulate(&mut r, &raw, 1.25, 40, |k| if k == CPU { 1.0 } else { 1.2 });
        let back = picks
            .iter()
            .position(|p| (p.kind, p.reason) == (CPU, Reason::Best))
            .expect("back");
        assert!(back <= 3 * (RECHECK_GAP as usize + 1), "{back}: {picks:?}");
        assert!(
            picks[back..]
                .iter()
                .all(|p| p.kind == CPU || p.reason == Reason::Recheck),
            "{picks:?}"
        );
    }

    #[test]
    fn rechecks_thin_out_geometrically() {
        // GPU 10% slower than the CPU, always: its re-checks over 1000 calls.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        won(&mut r, GPU, 1.1);
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            1000,
            |k| if k == GPU { 1.1 } else { 1.0 },
        );
        let rechecks = picks.iter().filter(|p| p.reason == Reason::Recheck).count();
        // Gaps 4, 8, 16, ..., 512: about log2(1000 / 4) + 1.
        assert!((5..=10).contains(&rechecks), "{rechecks}");
    }

    #[test]
    fn probes_stay_within_their_budget() {
        // A GPU 2.4x slower than the CPU but within the decode `explore` of 2.5: probes
        // beyond the CPU's time stay within PROBE_BUDGET of all the time (plus one probe).
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        let picks = simulate(
            &mut r,
            &raw,
            2.5,
            2000,
            |k| if k == GPU { 2.4 } else { 1.0 },
        );
        let probes = picks.iter().filter(|p| p.kind == GPU).count() as f64;
        let excess = 1.4 * probes;
        assert!(probes >= 1.0, "the GPU is tried");
        assert!(
            excess <= PROBE_BUDGET * r.spent + 1.4,
            "{excess} of {}",
            r.spent
        );
    }

    #[test]
    fn hysteresis_keeps_the_incumbent_among_near_ties() {
        let raw = [(1.0, CPU), (1.02, GPU)];
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        won(&mut r, GPU, 1.0);
        // The GPU won last and is within 3% of the CPU: it stays.
        assert_eq!(r.pick(&raw, one, 1.25).kind, GPU);
        won(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        // A probe does not make the incumbent.
        r.record(GPU, 1.02, 1.02, Some(1.0));
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
    }

    #[test]
    fn exploration_tries_near_plans_once_after_the_best() {
        // Split predicted best (0.5) with the prior 1/0.7; never run: it runs first.
        let raw = [(1.0, CPU), (1.1, GPU), (0.5, SPLIT)];
        let prior = |k: PlanKind| if k == SPLIT { 1.0 / 0.7 } else { 1.0 };
        let mut r = ClassRecord::default();
        let p = r.pick(&raw, prior, 1.25);
        assert_eq!((p.kind, p.reason), (SPLIT, Reason::Best));
        // It measured 2.4x: the CPU (never run) becomes best, then the split has its second
        // call (1.2 s, within 1.25 of the CPU), 2.4x again. Once the class has run long
        // enough for the GPU's expected excess (0.1 s) to fit the budget, the GPU (never
        // run, within 1.25) is explored once; then the measured best stays.
        r.record(SPLIT, 0.5, 1.2, None);
        assert_eq!(r.pick(&raw, prior, 1.25).kind, CPU);
        r.record(CPU, 1.0, 1.0, None);
        let p = r.pick(&raw, prior, 1.25);
        assert_eq!((p.kind, p.reason), (SPLIT, Reason::Recheck));
        r.record(SPLIT, 0.5, 1.2, p.probe_of());
        while PROBE_BUDGET * (r.spent + 1.0) < r.probe_loss + 0.1 {
            assert_eq!(r.pick(&raw, prior, 1.25).kind, CPU);
            r.record(CPU, 1.0, 1.0, None);
        }
        let p = r.pick(&raw, prior, 1.25);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Explore));
        r.record(GPU, 1.1, 1.43, p.probe_of());
        assert_eq!(r.pick(&raw, prior, 1.25).kind, CPU);
        // A plan never run but far slower is not explored.
        let mut r = ClassRecord::default();
        won(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&[(1.0, CPU), (10.0, GPU)], prior, 1.25).kind, CPU);
    }
}
