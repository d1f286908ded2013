//! `auto`'s measured corrections of the cost model, per call size class.
//!
//! For each plan kind (all CPU, all GPU, split) a class keeps the ratios measured seconds /
//! predicted seconds of its last [`WINDOW`] warm calls; a plan's corrected prediction is
//! the model's raw prediction times the median of those ratios (the lower median: the
//! faster of two), a prior before the kind has a warm call.
//!
//! A call is warm when the class's previous call ran the same kind, and not after an idle
//! gap far longer than the class's usual ones ([`IDLE_GAP`]). The first call after a
//! switch carries what the switch costs: a plan's first call in a class (device buffers
//! sized, pool threads woken), a GPU left idle while the CPU plan ran, a decode mirror
//! catching up with the steps the CPU took. It counts in the class's time, never in a
//! factor. On the H100 host, with every call counted, a prefill ACP 1k class whose GPU
//! plan was 1.29x faster ran the CPU plan for 811 of 960 calls: once the CPU led, each
//! re-check of the GPU was one call after CPU calls, and the GPU plan's factor was made of
//! such calls alone. So a probe runs twice in a row, a warm-up, then its sample (with warm
//! samples only, that cell read 0.955-0.989 of the best backend in 7 of 8 later runs).
//!
//! The median of five: two slow calls of five (a preempted call, a driver's hiccup) do not
//! move it, and every kind is judged by the same statistic whatever the spread of its
//! times. On the H100 host, a low quantile (the second fastest of five) favoured the plan
//! whose times spread wider (an 11-head split, 8% slower than the all-GPU plan at decode
//! 64k, kept winning on its fast tail); a mean without the slowest moves with any second
//! slow call.
//!
//! Choice, given the raw predictions of the candidate plans:
//! - the smallest corrected prediction wins; the incumbent (the plan last run as the
//!   winner) stays while it is within [`HYSTERESIS`] of that, so two plans within noise of
//!   each other do not alternate. A challenger whose last sample is [`STALE_CALLS`] calls
//!   old is re-checked before it takes over, and a fresh sample replaces stale ones: plans
//!   are compared on calls close in time (on the H100 host the noise comes in bursts of
//!   seconds, and a plan measured before a burst looked best against one measured in it);
//! - a call that switched to a kind not yet sampled, or to a probe, is followed by another
//!   call of that kind (its sample);
//! - once the winner has run, one other plan may be probed instead: a plan never run whose
//!   corrected prediction is within `explore` of the winner's, whatever the budget (once
//!   per class: two calls of a plan at most `explore` times slower; on the H100 host a
//!   decode dense 64k class, whose cells run 400 calls, never tried the all-GPU plan, 7%
//!   faster than the split it ran, while the first send it predicted held it beyond the
//!   budget); else a plan due for a re-check (`RECHECK_GAP · 2^k` calls of the class since
//!   it last ran, `k` = its re-checks since it last ran as the winner that did not beat the
//!   winner's prediction by more than [`HYSTERESIS`]) and within `explore` of the winner
//!   when it has at most one sample, [`RECHECK`] after that. A plan idle for
//!   [`STALE_CALLS`] calls, or whose last sample beat the winner, is re-checked whatever
//!   its factor, expected at its fastest recent sample or its prospect (the median of
//!   about its last 100 warm calls, see [`LONG_WINDOW`]; its prior while it has one
//!   sample). Of the plans due, the one expected fastest goes first. Re-checks of a plan
//!   that keeps losing, or ties, thin out geometrically; one that beats the winner is
//!   re-checked again soon, and one that beats it by more than [`RECHECK`] replaces its
//!   window with that sample, so a leader that lost to a burst of slow calls wins back in
//!   a few calls;
//! - a likely re-check is one of a plan whose prospect beats the winner's corrected
//!   prediction by [`RECHECK`] (after [`LIKELY_SAMPLES`] warm calls of it): it is due at
//!   its gap whatever its factor, outside the budget (its gaps still double while it keeps
//!   losing). On the H100 host a decode ACP 16k
//!   class whose CPU plan (0.46 ms a call) met a burst (3.3 ms calls, factor 10.5) ran the
//!   GPU plan (1.1 ms) for 323 calls before the CPU was re-checked within the budget. Through
//!   simulated bursts (`through_bursts_auto_stays_close_to_the_best_plan`'s workloads, 2000
//!   of them) the 90th percentile of auto / the best plan fell from 1.097 to 1.032, and the
//!   worst workload without bursts stayed at 1.040;
//! - any other re-check must fit the budget: the time probing took beyond the winner's
//!   prediction (the probes' calls and the winner's first call after each, cold in its
//!   turn), this probe's expected excess over its two calls included, stays within
//!   [`PROBE_BUDGET`] of all the time the class has run (a call's excess counted up to
//!   [`CHARGE_CAP`] times the prediction, plus a probe's known catch-up: the rows its
//!   first call sends to a GPU mirror behind by the CPU's steps, which the model amortizes
//!   and [`ClassRecord::pick_paying`] counts in full; a plan's first try is not charged).
//!   So beyond
//!   each plan's first try probing costs about that fraction of a workload, however wrong
//!   the model is, spread over it: a plan measured 2x slower is re-checked about once
//!   per 2 / PROBE_BUDGET = 133 calls of the winner.

use super::PlanKind;

/// Warm calls of one kind whose ratios are kept (their median is the factor).
pub(super) const WINDOW: usize = 5;

/// The plan run last is kept while its corrected prediction is within this factor of the
/// best one.
pub(super) const HYSTERESIS: f64 = 1.03;

/// A plan sampled more than once is re-checked only while its corrected prediction is
/// within this factor of the best one.
pub(super) const RECHECK: f64 = 1.3;

/// Probing's time beyond the winner's prediction, as a fraction of the class's time. Small
/// beside the 5% that `auto` may lose to the best single backend: timing noise on a shared
/// host takes most of the rest (2-6% between two identical CPU engines on the H100 host).
/// At 2%, with the switches back to the winner not charged, a decode dense 16k class of the
/// H100 host ran 5% slower than the CPU plan it chose for 95% of its calls. With them
/// charged, of 1%, 1.5%, 2% and 3% (`through_bursts_auto_stays_close_to_the_best_plan`'s
/// workloads, 2000 of each), 1.5% is the largest whose worst workload without bursts stays
/// within 1.05x of the best plan (1.040); its 90th percentile through bursts is 1.097 (1%:
/// 1.145).
pub(super) const PROBE_BUDGET: f64 = 0.015;

/// Calls of the class between the re-checks of a plan that has run, or that has just lost
/// the lead; doubled with each re-check since it last ran as the winner (capped at
/// 2^[`RECHECK_MAX_DOUBLINGS`] times). A plan that led for long and then lost, maybe to a
/// burst of slow calls, is re-checked soon (on the H100 host the CPU plan, 1.5x faster,
/// lost a 1k prefill class for good when its gap was counted from its runs).
pub(super) const RECHECK_GAP: u64 = 4;
const RECHECK_MAX_DOUBLINGS: u64 = 8;

/// Warm calls of one kind whose median is its prospect: what it takes outside a burst (a
/// burst that fills [`WINDOW`] leaves it). Prospects cost a split's two sides, and what a
/// stale re-check is expected to take: on the H100 host three slow CPU calls (6-16x their
/// prediction) of a decode ACP 16k class made its factor 8.9, and the GPU plan (1.7 ms a
/// call against the CPU's 0.6 ms) took over for 220 calls.
pub(super) const LONG_WINDOW: usize = 25;

/// After its first [`LONG_WINDOW`], one warm call in this many joins the long window, so
/// it spans 100 calls: on the H100 host (decode dense 16k), with the last 25 warm CPU
/// calls as the window, a burst made the CPU's prospect 1.7x its model, against 1.2x
/// outside it.
const LONG_STRIDE: u64 = 4;

/// Warm calls in a plan's long window before its prospect can make a re-check likely: a
/// prospect of one or two calls is a guess, and a likely re-check is not budgeted.
const LIKELY_SAMPLES: usize = 5;

/// Warm split calls at one GPU head count before their CPU sides' lower median judges a
/// split probe's sample there ([`ClassRecord::settled_cpu_side`]).
const SETTLED_SIDES: usize = 5;

/// A plan not run for this many calls of the class is re-checked whatever its factor says
/// (within the budget): that factor may be a burst of slow calls long past.
pub(super) const STALE_CALLS: u64 = 32;

/// A probing call's excess is charged up to this many times the winner's prediction:
/// beyond that the call met a hiccup, not its plan's cost. On the H100 host one cold GPU
/// call of a decode ACP 64k class took 21 ms against 1.9 ms predicted, and its whole
/// excess held off every re-check for 640 calls while a 2x slower plan ran.
const CHARGE_CAP: f64 = 2.0;

/// A call that starts more than this many times the class's usual idle gap (the lower
/// median of its last [`LONG_WINDOW`] gaps between one call's end and the next one's
/// start) after the class's last call is not warm, whatever kind ran last: the device and
/// the pool's threads idled, or other work took the caches. On the H100 host a GPU call
/// after another engine's turn took 1.3-2.9 ms against 0.7 (decode 64k, run 48), and in
/// `foxedge bench`, where each of auto's batches follows the other backends' turns, such
/// calls went into the factors of whichever plan led and auto switched between two tied
/// plans 73 times in 3100 calls (decode ACP 16k, trace 54).
const IDLE_GAP: f64 = 10.0;

/// Gaps up to this many seconds never make a call cold.
const IDLE_FLOOR_S: f64 = 1e-3;

/// Calls a probe takes: a warm-up and its sample.
const PROBE_CALLS: f64 = 2.0;

/// The last `N` values pushed (a ring; the first `len` slots are valid), with a sorted copy
/// kept up to date on each push (one removal and one insertion, O(N), no sort): `auto` reads
/// medians many times a call (a split's sides per GPU head count) and pushes a few values
/// per call.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ring<const N: usize> {
    vals: [f64; N],
    /// The valid values, ascending by `f64::total_cmp` (the first `len` slots).
    sorted: [f64; N],
    len: usize,
    next: usize,
}

impl<const N: usize> Default for Ring<N> {
    fn default() -> Self {
        Ring {
            vals: [0.0; N],
            sorted: [0.0; N],
            len: 0,
            next: 0,
        }
    }
}

impl<const N: usize> Ring<N> {
    fn push(&mut self, x: f64) {
        if self.len == N {
            // Drop the value this push overwrites from the sorted copy.
            let old = self.vals[self.next];
            let i = self.sorted[..self.len].partition_point(|v| v.total_cmp(&old).is_lt());
            self.sorted.copy_within(i + 1..self.len, i);
            self.len -= 1;
        }
        self.vals[self.next] = x;
        self.next = (self.next + 1) % N;
        let i = self.sorted[..self.len].partition_point(|v| v.total_cmp(&x).is_le());
        self.sorted.copy_within(i..self.len, i + 1);
        self.sorted[i] = x;
        self.len += 1;
    }

    fn clear(&mut self) {
        (self.len, self.next) = (0, 0);
    }

    #[cfg(test)]
    fn values(&self) -> &[f64] {
        &self.vals[..self.len]
    }

    /// The lower median (the faster of two middle values; None when empty).
    fn lower_median(&self) -> Option<f64> {
        (self.len > 0).then(|| self.sorted[(self.len - 1) / 2])
    }

    /// The smallest value (None when empty).
    fn min(&self) -> Option<f64> {
        (self.len > 0).then(|| self.sorted[0])
    }
}

/// `auto`'s CPU shortcut: every head on the CPU, with no work count and no plan search,
/// when the CPU's predicted time for the call with every pair kept is within the GPU's
/// fixed cost. The prediction is corrected by the lower median of the last [`WINDOW`]
/// ratios measured / predicted of auto's all-CPU calls (shortcut or planned; 1 before
/// any), so a calibration that under-predicts the CPU does not hold auto there: the
/// shortcut lasts while the CPU's measured time stays within the GPU's fixed cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Shortcut {
    window: Ring<WINDOW>,
}

impl Shortcut {
    /// Folds one all-CPU call's measured / predicted seconds (ignored unless finite, > 0).
    pub(super) fn record(&mut self, ratio: f64) {
        if ratio.is_finite() && ratio > 0.0 {
            self.window.push(ratio);
        }
    }

    /// What the CPU's predictions are multiplied by for the shortcut's check.
    pub(super) fn factor(&self) -> f64 {
        self.window.lower_median().unwrap_or(1.0)
    }
}

/// One plan kind's record in a size class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct KindRecord {
    /// The last [`WINDOW`] warm ratios (measured / predicted).
    window: Ring<WINDOW>,
    /// Calls of this kind recorded (warm or not), and the class's call count at the last.
    runs: u64,
    last_call: u64,
    /// Probes of it since it last ran as the winner whose sample did not beat the winner's
    /// prediction: its re-check gaps double with these.
    rechecks: u64,
    /// Its last sample was a probe that beat the winner's prediction: it is re-checked at
    /// its next gap whatever its factor (a leader that lost to a burst wins back).
    promising: bool,
    /// The class's call count at its last sample.
    sampled_at: u64,
    /// Warm calls recorded.
    warm: u64,
    /// [`LONG_WINDOW`] warm ratios, the first ones and then one in [`LONG_STRIDE`] (never
    /// reset when stale): their median is the plan's prospect, what it takes outside bursts.
    long: Ring<LONG_WINDOW>,
}

impl KindRecord {
    /// The lower median of the window's ratios (the faster of two; see the module docs).
    fn factor(&self) -> Option<f64> {
        self.window.lower_median()
    }

    /// The lower median of the long window: the prospect (see [`LONG_WINDOW`]).
    fn prospect(&self) -> Option<f64> {
        self.long.lower_median()
    }

    /// The window's fastest ratio: with the prospect, what a plan re-checked against its
    /// factor (stale, or promising) is expected to take (a burst may fill a window).
    fn fastest(&self) -> Option<f64> {
        self.window.min()
    }
}

/// The record of one size class (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct ClassRecord {
    kinds: [KindRecord; 3],
    /// Calls recorded in this class (all kinds).
    calls: u64,
    /// The kind last run as the winner (not as a probe).
    incumbent: Option<PlanKind>,
    /// The kind of the class's last call: the next call of the same kind is warm.
    last: Option<PlanKind>,
    /// The last call switched kind and needs its sample: the next pick repeats it, with
    /// the reason it was picked for.
    follow_up: Option<(PlanKind, Reason)>,
    /// The last call was a charged probe (not a first try): the winner's next call is its
    /// return, charged to probing.
    last_probe: bool,
    /// Seconds of every recorded call, and of probing beyond the winner's prediction (the
    /// probes' calls and the winner's first call after them).
    spent: f64,
    probe_loss: f64,
    /// A split's sides as measured, per GPU head count (ascending); see
    /// [`ClassRecord::side_factors`].
    sides: Vec<Sides>,
    /// Bumped whenever a split's measured sides change ([`ClassRecord::record_sides`]).
    sides_version: u64,
    /// Seconds between the end of one call of the class and the start of the next.
    gaps: Ring<LONG_WINDOW>,
    /// The next call follows an unusually long gap (see [`IDLE_GAP`]): it is not warm.
    rested: bool,
    /// When the class's last call ended ([`ClassRecord::spanned`]).
    last_end: Option<std::time::Instant>,
}

/// A split's two sides at one GPU head count: each side's seconds / its raw prediction, of
/// the last [`LONG_WINDOW`] warm split calls with that many GPU heads. Long, not
/// [`WINDOW`]: sides that moved with every call moved the split's costed time with them
/// (one 12-head split of a decode dense 4k class of the H100 host was costed at 0.17-0.32
/// ms from call to call, trace 512) and its plan with it; the split's own factor
/// ([`ClassRecord::record_judged`]) follows the short-term changes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sides {
    gpu_heads: usize,
    cpu: Ring<LONG_WINDOW>,
    gpu: Ring<LONG_WINDOW>,
}

impl Sides {
    fn factors(&self) -> Option<(f64, f64)> {
        Some((self.cpu.lower_median()?, self.gpu.lower_median()?))
    }
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
    /// For a probe: what its first call pays beyond its prediction to switch (a GPU
    /// mirror's catch-up), seconds; 0 otherwise.
    pub catch_up_s: f64,
    /// For a pick by [`Reason::Best`] among corrected predictions: the nearest other
    /// plan's over the winner's (infinite when it is the only plan); 0 otherwise.
    pub margin: f64,
    /// [`Pick::margin`] over the whole plans alone (all-CPU, all-GPU): a split left out.
    pub whole_margin: f64,
}

/// What [`ClassRecord::record_judged`] charges a probe's call against ([`Pick::probe_of`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Probe {
    /// The winner's corrected prediction (seconds): the call's excess is counted from it.
    pub best_s: f64,
    /// Seconds the call may be charged beyond [`CHARGE_CAP`]: its switch's known cost
    /// ([`Pick::catch_up_s`]), not a hiccup.
    pub catch_up_s: f64,
}

impl From<f64> for Probe {
    /// A probe against a winner predicted at `best_s`, with no catch-up.
    fn from(best_s: f64) -> Probe {
        Probe {
            best_s,
            catch_up_s: 0.0,
        }
    }
}

impl Pick {
    /// This pick's terms when it is a probe, None for the winner itself.
    pub(super) fn probe_of(&self) -> Option<Probe> {
        (self.reason != Reason::Best).then_some(Probe {
            best_s: self.best_s,
            catch_up_s: self.catch_up_s,
        })
    }

    fn reason_of(probe_of: Option<Probe>, explored: bool) -> Reason {
        match (probe_of, explored) {
            (None, _) => Reason::Best,
            (Some(_), true) => Reason::Explore,
            (Some(_), false) => Reason::Recheck,
        }
    }
}

impl ClassRecord {
    /// Folds a call of `kind` predicted (raw) at `raw_s` that took `secs`; `probe_of` is
    /// [`Pick::probe_of`] of the pick that chose it.
    #[cfg(test)]
    pub(super) fn record(
        &mut self,
        kind: PlanKind,
        raw_s: f64,
        secs: f64,
        probe_of: Option<Probe>,
    ) {
        self.record_against(kind, raw_s, raw_s, secs, probe_of);
    }

    /// [`ClassRecord::record_judged`] of a call judged as it ran.
    #[cfg(test)]
    pub(super) fn record_against(
        &mut self,
        kind: PlanKind,
        raw_s: f64,
        ratio_s: f64,
        secs: f64,
        probe_of: Option<Probe>,
    ) {
        self.record_judged(kind, raw_s, ratio_s, secs, secs, probe_of);
    }

    /// Folds a call of `kind` predicted (raw) at `raw_s` that took `secs`; `probe_of` is
    /// [`Pick::probe_of`] of the pick that chose it.
    ///
    /// The kind's ratio is taken against `ratio_s` seconds, not `raw_s`: a split's against
    /// its cost at its head count's side factors as they stand after the call (see
    /// [`Sides`]), so its factor holds what those factors miss (the slower of two noisy
    /// sides among it), whatever they were when it was picked: a 2-head split explored
    /// before its sides were measured ran 2x its prediction, and that factor then priced
    /// the 15-head split of the next calls (decode ACP 16k, trace 550).
    ///
    /// That ratio, and whether a probe beat the winner, come from `judged_s` seconds: the
    /// call's `secs`, or for a split probe's sample its time with its cold CPU side at its
    /// settled factor ([`ClassRecord::settled_cpu_side`]). The class's time and probing's
    /// charge stay the call's `secs`: that is what it cost.
    pub(super) fn record_judged(
        &mut self,
        kind: PlanKind,
        raw_s: f64,
        ratio_s: f64,
        secs: f64,
        judged_s: f64,
        probe_of: Option<Probe>,
    ) {
        let ratio = judged_s / ratio_s;
        if !(ratio.is_finite() && ratio > 0.0) {
            return;
        }
        let warm = self.last == Some(kind) && !self.rested;
        self.rested = false;
        let back = !warm && self.last_probe && probe_of.is_none();
        // A plan's first try (its two calls and the winner's return) is not charged: it is
        // bounded by itself (once per plan and class), and the budget is for re-checks.
        let first_try = probe_of.is_some()
            && (self.kinds[kind as usize].runs == 0
                || self.follow_up == Some((kind, Reason::Explore)));
        self.last = Some(kind);
        self.last_probe = probe_of.is_some() && !first_try;
        self.calls += 1;
        self.spent += secs;
        // What the call would have taken as the winner, and what it may be charged beyond.
        let expected = match probe_of {
            Some(p) if !first_try => {
                let catch_up = if p.catch_up_s.is_finite() {
                    p.catch_up_s.max(0.0)
                } else {
                    0.0
                };
                Some((p.best_s, catch_up))
            }
            None if back => self.factor(kind).map(|f| (f * raw_s, 0.0)),
            _ => None,
        };
        if let Some((e, catch_up)) = expected {
            self.probe_loss += (secs - e).clamp(0.0, CHARGE_CAP * e + catch_up);
        }
        if probe_of.is_none() {
            self.incumbent = Some(kind);
        }
        let k = &mut self.kinds[kind as usize];
        let explored = k.runs == 0;
        k.runs += 1;
        k.last_call = self.calls;
        self.follow_up = (!warm && (probe_of.is_some() || k.window.len == 0))
            .then(|| (kind, Pick::reason_of(probe_of, explored)));
        if probe_of.is_none() {
            (k.rechecks, k.promising) = (0, false);
        }
        if !warm {
            return;
        }
        if let Some(p) = probe_of {
            k.promising = judged_s * HYSTERESIS < p.best_s;
            if !k.promising {
                k.rechecks += 1;
            }
        }
        // Its samples are stale, or a probe beat the winner by more than noise does (by
        // RECHECK: its window holds a burst that has ended): the fresh sample replaces them.
        let clear_win = probe_of.is_some_and(|p| judged_s * RECHECK < p.best_s);
        if self.calls - k.sampled_at > STALE_CALLS || clear_win {
            k.window.clear();
        }
        k.sampled_at = self.calls;
        k.window.push(ratio);
        k.warm += 1;
        if k.long.len < LONG_WINDOW || k.warm.is_multiple_of(LONG_STRIDE) {
            k.long.push(ratio);
        }
    }

    /// Notes the wall-clock span of the call about to be recorded: the idle gap since the
    /// class's last call ended ([`ClassRecord::idled`]), and its end for the next one's gap.
    pub(super) fn spanned(&mut self, started: std::time::Instant, ended: std::time::Instant) {
        if let Some(end) = self.last_end {
            self.idled(started.saturating_duration_since(end).as_secs_f64());
        }
        self.last_end = Some(ended);
    }

    /// Notes the idle seconds before the next call (from the end of the class's last call
    /// to the start of this one); call it before that call's [`ClassRecord::record_judged`].
    pub(super) fn idled(&mut self, gap_s: f64) {
        if !gap_s.is_finite() {
            return;
        }
        let gap_s = gap_s.max(0.0);
        self.rested = gap_s > IDLE_FLOOR_S
            && self
                .gaps
                .lower_median()
                .is_some_and(|g| gap_s > IDLE_GAP * g);
        self.gaps.push(gap_s);
    }

    /// Folds the sides of a split call with `gpu_heads` GPU heads, each side's measured /
    /// raw predicted seconds (the CPU's heads on the split pool, the GPU thread's heads),
    /// before [`ClassRecord::record_judged`] folds the call itself; only a warm call's (the
    /// class's last call was a split).
    pub(super) fn record_sides(&mut self, gpu_heads: usize, cpu: f64, gpu: f64) {
        let ok = |r: f64| r.is_finite() && r > 0.0;
        if self.last != Some(PlanKind::Split) || !(ok(cpu) && ok(gpu)) {
            return;
        }
        let i = match self.sides.binary_search_by_key(&gpu_heads, |s| s.gpu_heads) {
            Ok(i) => i,
            Err(i) => {
                let fresh = Sides {
                    gpu_heads,
                    ..Sides::default()
                };
                self.sides.insert(i, fresh);
                i
            }
        };
        self.sides[i].cpu.push(cpu);
        self.sides[i].gpu.push(gpu);
        self.sides_version += 1;
    }

    /// The most a split call's CPU side may count, over its raw prediction, when the call
    /// is a probe's sample (`probe`, and warm: the second call of a split probe): the lower
    /// median of the CPU sides of the last warm split calls at `gpu_heads` GPU heads, once
    /// [`SETTLED_SIDES`] of them are kept there. None for any other call.
    ///
    /// A split re-checked after a long lead of another plan runs its CPU side cold (the
    /// split pool's threads and cores idled), for more than its warm-up call: over the 63
    /// such re-checks of the H100 host's decode 16k and 64k classes (traces 550-552, 602),
    /// every one ran the same GPU head count in both calls, and the CPU side took a median
    /// 2.11x its settled factor at the first call, 1.46x at the second (the sample) and
    /// 1.18x at the third. Of 35 of them whose split was faster than the all-GPU plan
    /// when steady, 6 won their re-check on that sample, 13 with it judged here, and no
    /// slower split won (`docs/results/hybin_scripts/settled_sample.py`).
    pub(super) fn settled_cpu_side(&self, gpu_heads: usize, probe: bool) -> Option<f64> {
        if !(probe && self.last == Some(PlanKind::Split) && !self.rested) {
            return None;
        }
        let i = self
            .sides
            .binary_search_by_key(&gpu_heads, |s| s.gpu_heads)
            .ok()?;
        let cpu = &self.sides[i].cpu;
        (cpu.len >= SETTLED_SIDES).then(|| cpu.lower_median())?
    }

    /// Forgets the measurements of the plans `kinds` (their factors, prospects, re-check
    /// state, and a split's sides): they were ratios to costs that changed. The class's
    /// calls, time and the other plans' records stay.
    pub(super) fn forget(&mut self, kinds: &[PlanKind]) {
        for &k in kinds {
            self.kinds[k as usize] = KindRecord::default();
            if k == PlanKind::Split {
                self.sides.clear();
                self.sides_version += 1;
            }
        }
    }

    /// Calls recorded in this class (all kinds).
    pub(super) fn calls(&self) -> u64 {
        self.calls
    }

    /// Changes with every change of a split's measured sides (what
    /// [`ClassRecord::side_factors`] reads).
    pub(super) fn sides_version(&self) -> u64 {
        self.sides_version
    }

    /// What the (CPU, GPU) sides of a split with `gpu_heads` GPU heads take over their raw
    /// predictions (None before any warm split call): at a head count measured, the lower
    /// medians of its window; between two, interpolated linearly; beyond them, the nearest.
    ///
    /// A split's heads are divided by these. Each side is measured as it runs in a split,
    /// beside the other (the CPU on the split pool, the GPU thread's host work), at the
    /// head count that ran: on the H100 host the all-GPU plan of a decode ACP 64k class
    /// ran 2.7x its model, and costed at that, a split's GPU side was worth one head (1.36
    /// ms a call against the CPU plan's 1.18), while a 6-head split ran 1.04 ms. The
    /// model's excess there grows with the GPU's heads, so one ratio for every head count
    /// would chase its own tail (measured at few heads, it sends many; at many, few); per
    /// head count, the heads settle where the two sides' measured times meet.
    pub(super) fn side_factors(&self, gpu_heads: usize) -> Option<(f64, f64)> {
        // Every entry holds a sample (`record_sides` makes one with its first); no
        // allocation: this runs per head count at every call.
        let at = |s: &Sides| Some((s.gpu_heads as f64, s.factors()?));
        let i = self.sides.partition_point(|s| s.gpu_heads < gpu_heads);
        let below = i
            .checked_sub(1)
            .and_then(|j| self.sides.get(j))
            .and_then(at);
        let above = self.sides.get(i).and_then(at);
        let k = gpu_heads as f64;
        match (below, above) {
            (_, Some((k1, f))) if k1 == k => Some(f),
            (Some((k0, f0)), Some((k1, f1))) => {
                let w = (k - k0) / (k1 - k0);
                let lerp = |a: f64, b: f64| a + (b - a) * w;
                Some((lerp(f0.0, f1.0), lerp(f0.1, f1.1)))
            }
            (Some((_, f)), None) | (None, Some((_, f))) => Some(f),
            (None, None) => None,
        }
    }

    /// Seconds of every call recorded.
    #[cfg(test)]
    pub(super) fn spent(&self) -> f64 {
        self.spent
    }

    /// The measured / predicted factor of `kind` (None before it has a warm call).
    pub(super) fn factor(&self, kind: PlanKind) -> Option<f64> {
        self.kinds[kind as usize].factor()
    }

    /// The prospect of `kind`: the median ratio of about its last 100 warm calls (see
    /// [`LONG_WINDOW`]).
    pub(super) fn prospect(&self, kind: PlanKind) -> Option<f64> {
        self.kinds[kind as usize].prospect()
    }

    /// [`ClassRecord::pick_paying`] with no catch-up for any kind.
    #[cfg(test)]
    pub(super) fn pick(
        &self,
        raw: &[(f64, PlanKind)],
        prior: impl Fn(PlanKind) -> f64,
        explore: f64,
    ) -> Pick {
        self.pick_paying(raw, prior, explore, |_| 0.0)
    }

    /// The plan to run among `raw` (raw model predictions, seconds, of the candidate
    /// plans), with `prior(kind)` as the factor of a kind not sampled yet; see the module
    /// docs. A probe of kind `k` also pays `catch_up(k)` seconds on its first call (a GPU
    /// mirror's catch-up after CPU steps, which the raw predictions amortize): counted in
    /// what a re-check within the budget is expected to cost.
    pub(super) fn pick_paying(
        &self,
        raw: &[(f64, PlanKind)],
        prior: impl Fn(PlanKind) -> f64,
        explore: f64,
        catch_up: impl Fn(PlanKind) -> f64,
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
                catch_up_s: 0.0,
                margin: 0.0,
                whole_margin: 0.0,
            };
        };
        let mut best_t = min_t;
        if let Some(inc) = self.incumbent
            && let Some(&(t, _)) = corrected.iter().find(|(_, k)| *k == inc)
            && t <= HYSTERESIS * min_t
        {
            (best, best_t) = (inc, t);
        }
        let rec = |k: PlanKind| &self.kinds[k as usize];
        // A challenger whose samples are stale does not take over on them: it is re-checked
        // first, within the budget, and the incumbent runs meanwhile.
        let mut confirm = None;
        if let Some(inc) = self.incumbent
            && best != inc
            && rec(best).window.len > 0
            && self.calls - rec(best).sampled_at >= STALE_CALLS
            && let Some(&(t, _)) = corrected.iter().find(|(_, k)| *k == inc)
        {
            confirm = Some((best, best_t));
            (best, best_t) = (inc, t);
        }
        // The nearest other plan's corrected prediction over the winner's (a split left out
        // for `whole`).
        let nearest_over = |kind: PlanKind, whole: bool| {
            let others = corrected
                .iter()
                .filter(|(_, k)| *k != kind && !(whole && *k == PlanKind::Split));
            others.fold(f64::INFINITY, |m, &(t, _)| m.min(t)) / best_t
        };
        let pick = |kind, reason| Pick {
            kind,
            reason,
            best_s: best_t,
            catch_up_s: match reason {
                Reason::Best => 0.0,
                _ => catch_up(kind).max(0.0),
            },
            margin: match reason {
                Reason::Best => nearest_over(kind, false),
                _ => 0.0,
            },
            whole_margin: match reason {
                Reason::Best => nearest_over(kind, true),
                _ => 0.0,
            },
        };
        let affordable = |k: PlanKind, t: f64| {
            self.probe_loss + PROBE_CALLS * (t - best_t).max(0.0) + catch_up(k).max(0.0)
                <= PROBE_BUDGET * (self.spent + PROBE_CALLS * best_t)
        };
        if let Some((k, reason)) = self.follow_up
            && corrected.iter().any(|&(_, c)| c == k)
        {
            // A probe's sample; a winner's, when it has just become the winner again.
            let reason = match reason {
                _ if k == best => Reason::Best,
                Reason::Best => Reason::Recheck,
                r => r,
            };
            return pick(k, reason);
        }
        if let Some((k, t)) = confirm
            && affordable(k, t)
        {
            return pick(k, Reason::Recheck);
        }
        if rec(best).runs == 0 {
            return pick(best, Reason::Best);
        }
        if let Some(&(_, k)) = corrected
            .iter()
            .find(|(t, k)| *k != best && rec(*k).runs == 0 && *t <= explore * best_t)
        {
            return pick(k, Reason::Explore);
        }
        // A plan due for a re-check, and what it is expected to take (None: not due).
        let due = |k: PlanKind, raw_t: f64, t: f64| -> Option<f64> {
            let r = rec(k);
            let within = if r.window.len <= 1 { explore } else { RECHECK };
            let idle = self.calls.saturating_sub(r.last_call);
            let hopeful = r.promising || idle >= STALE_CALLS;
            let prospect = r.prospect().map(|f| raw_t * f);
            let gap = RECHECK_GAP << r.rechecks.min(RECHECK_MAX_DOUBLINGS);
            // A hopeful plan is expected at its fastest recent sample or its prospect (a
            // burst may fill its window), or its prior while it has one sample (maybe
            // unlucky); not at the prior after that (a GPU plan 2-3x its model re-checked
            // as if free spent the budget of a decode ACP 64k class on the H100 host).
            let expected = match (r.fastest(), prospect) {
                (Some(f), Some(p)) if hopeful => {
                    let e = (raw_t * f).min(p);
                    if r.long.len <= 1 {
                        e.min(raw_t * prior(k))
                    } else {
                        e
                    }
                }
                _ => t,
            };
            let likely =
                r.long.len >= LIKELY_SAMPLES && prospect.is_some_and(|p| p * RECHECK <= best_t);
            (r.runs > 0
                && idle >= gap
                && (t <= within * best_t || hopeful || likely)
                && (affordable(k, expected) || likely))
                .then_some(expected)
        };
        // The due plan expected fastest goes first: a cheap re-check of a near plan is not
        // kept waiting behind a costly one of a far plan.
        if let Some((_, k)) = corrected
            .iter()
            .zip(raw)
            .filter(|((_, k), _)| *k != best)
            .filter_map(|((t, k), (raw_t, _))| due(*k, *raw_t, *t).map(|e| (e, *k)))
            .min_by(|x, y| x.0.total_cmp(&y.0))
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

    /// `k`'s sample: a cold call (not a sample) when the class last ran another kind, then
    /// `secs`, both as the winner.
    fn sampled(r: &mut ClassRecord, k: PlanKind, secs: f64) {
        if r.last != Some(k) {
            won(r, k, secs);
        }
        won(r, k, secs);
    }

    /// Runs `calls` picks over `raw`, each plan taking `truth(kind, warm)` seconds (warm:
    /// the class's last call ran the same kind; called once per call, in order); returns
    /// the picks (their total time is `r.spent`).
    fn simulate(
        r: &mut ClassRecord,
        raw: &[(f64, PlanKind)],
        explore: f64,
        calls: usize,
        mut truth: impl FnMut(PlanKind, bool) -> f64,
    ) -> Vec<Pick> {
        (0..calls)
            .map(|_| {
                let p = r.pick(raw, one, explore);
                let raw_s = raw.iter().find(|x| x.1 == p.kind).map_or(1.0, |x| x.0);
                let warm = r.last == Some(p.kind);
                r.record(p.kind, raw_s, truth(p.kind, warm), p.probe_of());
                p
            })
            .collect()
    }

    /// The GPU sampled at 1.2 s, then the CPU at 1.0 s for `calls` calls, then a burst of
    /// slow CPU calls (1.5 s) filling its window.
    fn burst_after_cpu_lead(calls: usize) -> ClassRecord {
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 1.2);
        sampled(&mut r, CPU, 1.0);
        for _ in 0..calls {
            won(&mut r, CPU, 1.0);
        }
        for _ in 0..WINDOW {
            won(&mut r, CPU, 1.5);
        }
        r
    }

    /// Picks of `kind`.
    fn count(picks: &[Pick], kind: PlanKind) -> usize {
        picks.iter().filter(|p| p.kind == kind).count()
    }

    #[test]
    fn a_ratio_is_taken_against_what_it_is_given() {
        // A split picked at 1 ms, re-costed at 2 ms with its sides' factors after the call,
        // that took 2.2 ms: its factor is 1.1; the CPU's, recorded plainly, is over its
        // prediction.
        let mut r = ClassRecord::default();
        r.record_against(SPLIT, 1e-3, 2e-3, 2.2e-3, None);
        r.record_against(SPLIT, 1e-3, 2e-3, 2.2e-3, None);
        let f = r.factor(SPLIT).unwrap();
        assert!((f - 1.1).abs() < 1e-12, "{f}");
        r.record(CPU, 1e-3, 3e-3, None);
        r.record(CPU, 1e-3, 3e-3, None);
        assert_eq!(r.factor(CPU), Some(3.0));
    }

    /// Forgetting the CPU's measurements leaves the GPU plan's and the class's time.
    #[test]
    fn forgetting_the_cpu_keeps_the_gpu() {
        let mut r = ClassRecord::default();
        for k in [PlanKind::Cpu, PlanKind::Gpu, PlanKind::Split] {
            won(&mut r, k, 1.0);
            won(&mut r, k, 1.0);
        }
        r.record_sides(2, 1.0, 1.0);
        assert!(r.factor(PlanKind::Cpu).is_some() && r.side_factors(2).is_some());
        let (spent, gpu, version) = (r.spent(), r.factor(PlanKind::Gpu), r.sides_version());
        r.forget(&[PlanKind::Cpu, PlanKind::Split]);
        assert_eq!(r.factor(PlanKind::Cpu), None);
        assert_eq!(r.factor(PlanKind::Split), None);
        assert_eq!(r.side_factors(2), None);
        assert!(r.sides_version() > version);
        assert_eq!((r.spent(), r.factor(PlanKind::Gpu)), (spent, gpu));
    }

    #[test]
    fn the_shortcut_follows_the_cpus_measured_time() {
        let mut s = Shortcut::default();
        assert_eq!(s.factor(), 1.0);
        // Run 67's calibration: predicted 350 us, measured 0.78 ms a step.
        for _ in 0..3 {
            s.record(0.78e-3 / 350e-6);
        }
        assert!(s.factor() * 350e-6 > 362e-6);
        // Two slow calls of five do not move it; three fast ones bring it back.
        s.record(f64::NAN);
        s.record(0.0);
        for _ in 0..3 {
            s.record(0.9);
        }
        assert_eq!(s.factor(), 0.9);
        s.record(5.0);
        s.record(5.0);
        assert_eq!(s.factor(), 0.9);
    }

    #[test]
    fn factor_is_the_lower_median_of_the_warm_calls() {
        let mut r = ClassRecord::default();
        assert_eq!(r.factor(CPU), None);
        // The class's first call is cold: counted in its time, not in a factor.
        won(&mut r, CPU, 10.0);
        assert_eq!(r.factor(CPU), None);
        won(&mut r, CPU, 1.3);
        assert_eq!(r.factor(CPU), Some(1.3));
        // Two: the faster.
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
        // A switch: the GPU's first call and the CPU's first call after it are cold.
        won(&mut r, GPU, 1.0);
        assert_eq!(r.factor(GPU), None);
        won(&mut r, CPU, 50.0);
        assert_eq!(r.factor(CPU), Some(2.0));
        // Non-finite or non-positive ratios teach nothing.
        won(&mut r, CPU, f64::NAN);
        won(&mut r, CPU, 0.0);
        r.record(CPU, 0.0, 1.0, None);
        assert_eq!(r.factor(CPU), Some(2.0));
        assert_eq!(r.calls, 13);
        assert!((r.spent - 93.6).abs() < 1e-9, "{}", r.spent);
    }

    #[test]
    fn a_probe_runs_twice_and_its_second_call_is_the_sample() {
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        // The winner's first call is cold, so it runs again at once.
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (CPU, Reason::Best));
        won(&mut r, CPU, 1.5);
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        won(&mut r, CPU, 1.0);
        // The GPU, never run and within `explore`: a warm-up (slow: one-time work), then
        // the sample, which makes it the winner.
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Explore));
        r.record(GPU, 1.0, 3.0, p.probe_of());
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Explore));
        r.record(GPU, 1.0, 0.8, p.probe_of());
        assert_eq!(r.factor(GPU), Some(0.8));
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Best));
        // A first try is not charged to the probe budget.
        assert_eq!(r.probe_loss, 0.0);
    }

    #[test]
    fn cold_rechecks_do_not_lock_out_the_faster_plan() {
        // H100 prefill ACP 1k: the GPU plan takes 0.78 of the CPU's time warm, 1.6 on its
        // first call after CPU calls; a burst of slow GPU calls (2x) hands the CPU the
        // lead. Re-checks measure the GPU warm, and it wins back within a few hundred
        // calls; over 2000 calls it runs >= 85% of them.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let truth = |k: PlanKind, warm: bool| match (k, warm) {
            (CPU, true) => 1.0,
            (CPU, false) => 1.1,
            (_, true) => 0.78,
            (_, false) => 1.6,
        };
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        for _ in 0..100 {
            sampled(&mut r, GPU, 0.78);
        }
        for _ in 0..WINDOW {
            won(&mut r, GPU, 2.0);
        }
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        let picks = simulate(&mut r, &raw, 1.25, 2000, truth);
        let back = picks
            .iter()
            .position(|p| (p.kind, p.reason) == (GPU, Reason::Best))
            .expect("back");
        assert!(
            back <= (STALE_CALLS + 3 * (RECHECK_GAP + 2)) as usize,
            "{back}"
        );
        assert!(count(&picks, GPU) >= 1700, "{}", count(&picks, GPU));
    }

    #[test]
    fn a_stale_challenger_is_rechecked_before_it_takes_over() {
        // The GPU was sampled at 1.2 s long ago; the CPU (1.0 s) has run since. A burst
        // slows every plan by 1.5x: the CPU's factor rises to 1.5, above the GPU's stale
        // 1.2. The GPU is re-checked first (the burst's 1.8 s replaces its stale samples),
        // and the CPU stays.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = burst_after_cpu_lead(300);
        for _ in 0..2 {
            let p = r.pick(&raw, one, 1.25);
            assert_eq!((p.kind, p.reason, p.best_s), (GPU, Reason::Recheck, 1.5));
            r.record(GPU, 1.0, 1.8, p.probe_of());
        }
        assert_eq!(r.factor(GPU), Some(1.8));
        let p = r.pick(&raw, one, 1.25);
        assert_eq!((p.kind, p.reason), (CPU, Reason::Best));
        // Re-checked while fresh, a challenger takes over on its samples.
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            40,
            |k, _| if k == GPU { 1.1 } else { 1.5 },
        );
        assert_eq!(
            picks.last().map(|p| (p.kind, p.reason)),
            Some((GPU, Reason::Best))
        );
    }

    #[test]
    fn plans_are_judged_by_their_median_not_their_fast_tail() {
        // The split's calls spread wide (1.7-2.5 ms, median 2.2) and the GPU's are tight
        // (2.04 ms): a low quantile would keep the split; the median takes the GPU.
        let raw = [(1.0, GPU), (1.0, SPLIT)];
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 2.04);
        sampled(&mut r, SPLIT, 1.7);
        for x in [2.5, 2.2, 2.4, 2.2] {
            won(&mut r, SPLIT, x);
        }
        assert_eq!(r.pick(&raw, one, 2.5).kind, GPU);
    }

    #[test]
    fn a_burst_of_slow_calls_does_not_lock_out_a_plan() {
        // CPU 1.0 s, GPU 1.2 s (raw predictions equal): the CPU is best...
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 1.2);
        sampled(&mut r, CPU, 1.0);
        won(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        // ... two very slow CPU calls (15x, 2x) leave its factor at 1.0. (The GPU may come
        // up for its re-check, never as the best.)
        for x in [15.0, 2.0] {
            won(&mut r, CPU, x);
            assert_eq!(r.factor(CPU), Some(1.0));
            let p = r.pick(&raw, one, 1.25);
            assert!(p.kind == CPU || p.reason == Reason::Recheck, "{p:?}");
        }
    }

    #[test]
    fn an_unlucky_first_sample_is_rechecked() {
        // The split really takes 0.9 s but its first sample, its first try, took 2.0 s; the
        // CPU takes 1.0 s. Idle for STALE_CALLS calls, it is re-checked, expected at its
        // prior (1.0 s, no excess; the first try was not charged); then it stays.
        let raw = [(1.0, CPU), (1.0, SPLIT)];
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        r.record(SPLIT, 1.0, 1.0, Some(1.0.into()));
        r.record(SPLIT, 1.0, 2.0, Some(1.0.into()));
        let picks = simulate(
            &mut r,
            &raw,
            2.5,
            200,
            |k, _| {
                if k == SPLIT { 0.9 } else { 1.0 }
            },
        );
        let first = picks
            .iter()
            .position(|p| p.kind == SPLIT)
            .expect("a recheck");
        assert_eq!(picks[first].reason, Reason::Recheck);
        let due = STALE_CALLS as usize;
        assert!((due - 4..=due).contains(&first), "{first}");
        // (The CPU, the leader it replaced, has its own re-checks.)
        assert!(
            picks[first + 1..]
                .iter()
                .all(|p| p.kind == SPLIT || p.reason == Reason::Recheck),
            "{picks:?}"
        );
        // Sampled twice far above the best (3x > RECHECK), a plan is re-checked only when
        // stale, and within the budget, expected at its samples (3 s, not its prior of
        // 1 s): its two calls' 4 s of excess fit once the class has run 4 / PROBE_BUDGET
        // s, the next two once it has run twice that. Twice (four calls) in 600 calls.
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        sampled(&mut r, GPU, 3.0);
        won(&mut r, GPU, 3.0);
        won(&mut r, CPU, 1.0);
        let picks = simulate(&mut r, &[(1.0, CPU), (1.0, GPU)], 2.5, 600, |k, _| {
            if k == GPU { 3.0 } else { 1.0 }
        });
        assert_eq!(count(&picks, GPU), 4, "{picks:?}");
        let first = picks.iter().position(|p| p.kind == GPU).unwrap_or(0);
        let due = (4.0 / PROBE_BUDGET) as usize - 11;
        assert!((due - 5..=due + 5).contains(&first), "{first} vs {due}");
        assert!(r.probe_loss <= PROBE_BUDGET * r.spent + 4.0);
    }

    #[test]
    fn a_first_call_far_off_does_not_lock_out_the_plan_predicted_best() {
        // The GPU is predicted best (0.9 s) and really takes 0.85 s, but its first call
        // took 4x its prediction: a cold call, not a sample. Its second call comes next,
        // and it stays.
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
            |k, _| {
                if k == GPU { 0.85 } else { 1.0 }
            },
        );
        assert_eq!(picks[0].kind, GPU, "{picks:?}");
        assert!(
            picks
                .iter()
                .all(|p| p.kind == GPU || p.reason != Reason::Best),
            "{picks:?}"
        );
    }

    #[test]
    fn a_leader_that_lost_to_a_burst_is_rechecked_soon() {
        // The CPU (1.0 s) leads for 200 calls; a burst of slow calls (1.5 s) fills its
        // window and the GPU (1.2 s), re-checked, takes over. The CPU's re-checks start again at
        // RECHECK_GAP and, as each beats the GPU, do not thin out: three samples (the
        // window's median is then 1.0) bring it back within 3 x (4 + 2) calls, not after
        // 2^8 x 4 of them.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = burst_after_cpu_lead(200);
        assert_eq!(r.pick(&raw, one, 1.25).kind, GPU);
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            40,
            |k, _| {
                if k == CPU { 1.0 } else { 1.2 }
            },
        );
        let back = picks
            .iter()
            .position(|p| (p.kind, p.reason) == (CPU, Reason::Best))
            .expect("back");
        assert!(back <= 3 * (RECHECK_GAP as usize + 2), "{back}: {picks:?}");
        assert!(
            picks[back..]
                .iter()
                .all(|p| p.kind == CPU || p.reason == Reason::Recheck),
            "{picks:?}"
        );
    }

    #[test]
    fn a_burst_does_not_hand_the_lead_to_a_slow_plan_for_long() {
        // The H100 trace: the CPU (1 s) leads, then three calls of a burst (10 s) make its
        // factor 10 and the GPU (4 s) takes over. Stale after STALE_CALLS calls, the CPU is
        // re-checked, expected at its prospect (1 s, which the burst did not reach); its
        // sample beats the GPU by more than RECHECK, so it replaces the burst in its window,
        // and the CPU leads again.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 4.0);
        sampled(&mut r, CPU, 1.0);
        for _ in 0..300 {
            won(&mut r, CPU, 1.0);
        }
        for _ in 0..3 {
            won(&mut r, CPU, 10.0);
        }
        assert_eq!(r.factor(CPU), Some(10.0));
        assert_eq!(r.prospect(CPU), Some(1.0));
        let picks = simulate(
            &mut r,
            &raw,
            2.5,
            80,
            |k, _| if k == CPU { 1.0 } else { 4.0 },
        );
        assert_eq!(picks[0].kind, GPU);
        let back = picks
            .iter()
            .position(|p| (p.kind, p.reason) == (CPU, Reason::Best))
            .expect("back");
        assert!(back <= STALE_CALLS as usize + 4, "{back}: {picks:?}");
        assert!(count(&picks[back..], GPU) <= 2, "{picks:?}");
    }

    #[test]
    fn a_plan_whose_prospect_fails_is_rechecked_ever_more_rarely() {
        // The CPU led at 1 s for 300 calls, then became 3 s for good (the GPU takes 2 s):
        // its prospect still says 1 s, but its failed re-checks double their gaps, so over
        // 2000 calls it runs about 2 (log2(2000 / 4) + 1) times, not every few calls.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 2.0);
        sampled(&mut r, CPU, 1.0);
        for _ in 0..300 {
            won(&mut r, CPU, 1.0);
        }
        let picks = simulate(
            &mut r,
            &raw,
            2.5,
            2000,
            |k, _| if k == CPU { 3.0 } else { 2.0 },
        );
        let cpu = count(&picks, CPU);
        assert!(cpu <= 40, "{cpu}");
        assert!(count(&picks[1000..], CPU) <= 6, "{picks:?}");
    }

    #[test]
    fn rechecks_thin_out_geometrically() {
        // GPU 10% slower than the CPU, always: its re-checks over 1000 calls.
        let raw = [(1.0, CPU), (1.0, GPU)];
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 1.1);
        sampled(&mut r, CPU, 1.0);
        let picks = simulate(
            &mut r,
            &raw,
            1.25,
            1000,
            |k, _| {
                if k == GPU { 1.1 } else { 1.0 }
            },
        );
        let rechecks = picks.iter().filter(|p| p.reason == Reason::Recheck).count();
        // Two calls each, at gaps 4, 8, 16, ..., 512: about 2 (log2(1000 / 4) + 1).
        assert!((10..=20).contains(&rechecks), "{rechecks}");
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
            4000,
            |k, _| {
                if k == GPU { 2.4 } else { 1.0 }
            },
        );
        let probes = count(&picks, GPU) as f64;
        let excess = 1.4 * probes;
        assert!(probes >= 2.0, "the GPU is tried");
        assert!(
            excess <= PROBE_BUDGET * r.spent + 2.0 * 1.4,
            "{excess} of {}",
            r.spent
        );
    }

    #[test]
    fn a_probes_catch_up_is_budgeted_and_charged() {
        // The CPU (1 s) leads; the GPU (1.2 s) is re-checked now and then. When a GPU
        // probe's first call also pays a catch-up of 20 s (a mirror behind by the CPU's
        // steps), the budget counts it: over 4000 calls the GPU is probed at most a fifth
        // as often (measured: 10 probes without the catch-up, 2 with), and probing stays
        // within the budget, the catch-ups included (40.8 s of 4045).
        let raw = [(1.0, CPU), (1.0, GPU)];
        let probes = |catch_up_s: f64| {
            let mut r = ClassRecord::default();
            sampled(&mut r, GPU, 1.2);
            sampled(&mut r, CPU, 1.0);
            let mut prev = Some(CPU);
            let mut n = 0;
            for _ in 0..4000 {
                let p = r.pick_paying(&raw, one, 2.5, |k| if k == GPU { catch_up_s } else { 0.0 });
                let switched = prev != Some(p.kind);
                let secs = match p.kind {
                    GPU if switched => 1.2 + catch_up_s,
                    GPU => 1.2,
                    _ => 1.0,
                };
                n += usize::from(p.kind == GPU && switched);
                r.record(p.kind, 1.0, secs, p.probe_of());
                prev = Some(p.kind);
            }
            let loss: f64 = r.probe_loss;
            (n, loss, r.spent)
        };
        let (free, _, _) = probes(0.0);
        let (paid, loss, spent) = probes(20.0);
        assert!(free >= 8, "{free}");
        assert!(5 * paid <= free, "{paid} vs {free}");
        assert!(paid >= 1, "the GPU is still re-checked");
        assert!(
            loss <= PROBE_BUDGET * spent + 2.0 * 21.2,
            "{loss} of {spent}"
        );
    }

    #[test]
    fn a_hiccup_is_charged_up_to_the_cap() {
        // A probe's cold call met a hiccup (20x the winner's 1 s): CHARGE_CAP x 1 s of it is
        // charged, and its sample (1.5 s) 0.5 s; the winner's return (1.2 s, its factor 1)
        // 0.2 s.
        let mut r = ClassRecord::default();
        sampled(&mut r, GPU, 1.5);
        sampled(&mut r, CPU, 1.0);
        r.record(GPU, 1.0, 20.0, Some(1.0.into()));
        assert_eq!(r.probe_loss, CHARGE_CAP);
        r.record(GPU, 1.0, 1.5, Some(1.0.into()));
        won(&mut r, CPU, 1.2);
        assert!(
            (r.probe_loss - (CHARGE_CAP + 0.7)).abs() < 1e-12,
            "{}",
            r.probe_loss
        );
    }

    #[test]
    fn a_call_after_an_unusual_idle_gap_is_not_warm() {
        let mut r = ClassRecord::default();
        for _ in 0..6 {
            r.idled(1e-5);
            won(&mut r, CPU, 1.0);
        }
        assert_eq!(r.factor(CPU), Some(1.0));
        // 20 ms after calls 10 us apart: cold, kept out of the factor.
        r.idled(0.02);
        won(&mut r, CPU, 9.0);
        assert_eq!(
            r.kinds[CPU as usize]
                .window
                .values()
                .iter()
                .filter(|&&x| x == 9.0)
                .count(),
            0
        );
        // A gap under the floor never is: timer noise between back-to-back calls.
        r.idled(5e-4);
        won(&mut r, CPU, 2.0);
        assert!(r.kinds[CPU as usize].window.values().contains(&2.0));
        // Where long gaps are the rhythm, they are warm.
        let mut r = ClassRecord::default();
        for x in [1.0, 1.1, 0.9, 1.0, 1.2, 1.0] {
            r.idled(0.05);
            won(&mut r, GPU, x);
        }
        assert_eq!(r.kinds[GPU as usize].window.len, WINDOW);
    }

    #[test]
    fn the_whole_margin_leaves_a_split_out() {
        // The GPU wins by 5% over a split and 2x over the CPU: its margin is the split's,
        // its whole margin the CPU's (what starts an ACP prefill ahead of its count).
        let raw = [(2.0, CPU), (1.0, GPU), (1.05, SPLIT)];
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        sampled(&mut r, SPLIT, 1.0);
        sampled(&mut r, GPU, 1.0);
        let p = r.pick(&raw, one, 1.0);
        assert_eq!((p.kind, p.reason), (GPU, Reason::Best));
        assert!((p.margin - 1.05).abs() < 1e-12 && (p.whole_margin - 2.0).abs() < 1e-12);
    }

    #[test]
    fn hysteresis_keeps_the_incumbent_among_near_ties() {
        let raw = [(1.0, CPU), (1.02, GPU)];
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        sampled(&mut r, GPU, 1.0);
        // The GPU won last and is within 3% of the CPU: it stays.
        assert_eq!(r.pick(&raw, one, 1.25).kind, GPU);
        sampled(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
        // A probe does not make the incumbent.
        r.record(GPU, 1.02, 1.02, Some(1.0.into()));
        r.record(GPU, 1.02, 1.02, Some(1.0.into()));
        assert_eq!(r.pick(&raw, one, 1.25).kind, CPU);
    }

    #[test]
    fn exploration_tries_near_plans_once_after_the_best() {
        // Split predicted best (0.5) with the prior 1/0.7; never run: it runs first, twice.
        let raw = [(1.0, CPU), (1.1, GPU), (0.5, SPLIT)];
        let prior = |k: PlanKind| if k == SPLIT { 1.0 / 0.7 } else { 1.0 };
        let mut r = ClassRecord::default();
        for _ in 0..2 {
            let p = r.pick(&raw, prior, 1.25);
            assert_eq!((p.kind, p.reason), (SPLIT, Reason::Best));
            r.record(SPLIT, 0.5, 1.2, p.probe_of());
        }
        // It measured 2.4x: the CPU (never run) becomes best and runs twice (its first
        // call is cold).
        for _ in 0..2 {
            let p = r.pick(&raw, prior, 1.25);
            assert_eq!((p.kind, p.reason), (CPU, Reason::Best));
            r.record(CPU, 1.0, 1.0, None);
        }
        // The GPU (never run, within 1.25) is explored next, whatever the budget: two
        // calls. Then the measured best stays.
        for _ in 0..2 {
            let p = r.pick(&raw, prior, 1.25);
            assert_eq!((p.kind, p.reason), (GPU, Reason::Explore));
            r.record(GPU, 1.1, 1.43, p.probe_of());
        }
        assert_eq!(r.pick(&raw, prior, 1.25).kind, CPU);
        // A plan never run but far slower is not explored.
        let mut r = ClassRecord::default();
        sampled(&mut r, CPU, 1.0);
        assert_eq!(r.pick(&[(1.0, CPU), (10.0, GPU)], prior, 1.25).kind, CPU);
    }

    /// U(0, 1) draws from a xorshift64 seeded with `seed` (nonzero).
    fn uniform_from(seed: u64) -> impl FnMut() -> f64 {
        let mut rng = seed;
        move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Calls of the three plans (CPU, GPU, split) under CPU bursts: plan `k` at call `c`
    /// takes `truth[k]` times the call's noise, the CPU slowed by `slow[c]`, the split by
    /// half as much, the GPU not at all.
    struct Bursts {
        truth: [f64; 3],
        slow: Vec<f64>,
        noise: Vec<f64>,
    }

    impl Bursts {
        /// `slow` per call, each call's noise U(0.85, 1.15) drawn from `uniform`.
        fn new(truth: [f64; 3], slow: Vec<f64>, uniform: &mut impl FnMut() -> f64) -> Self {
            let noise = (0..slow.len()).map(|_| 0.85 + 0.3 * uniform()).collect();
            Bursts { truth, slow, noise }
        }

        fn time(&self, k: usize, c: usize) -> f64 {
            let s = match k {
                0 => self.slow[c],
                1 => 1.0,
                _ => 1.0 + (self.slow[c] - 1.0) / 2.0,
            };
            self.truth[k] * s * self.noise[c]
        }

        /// The best single plan's time over every call.
        fn best_plan(&self) -> f64 {
            (0..3)
                .map(|k| (0..self.slow.len()).map(|c| self.time(k, c)).sum::<f64>())
                .fold(f64::INFINITY, f64::min)
        }
    }

    /// One bursty workload (see `through_bursts_auto_stays_close_to_the_best_plan`): auto's
    /// time over 3000 calls / the best single plan's under the same bursts.
    fn bursty_ratio(seed: u64) -> f64 {
        let mut uniform = uniform_from(seed);
        let kinds = [CPU, GPU, SPLIT];
        let truth = [(); 3].map(|_| 0.5 + 1.5 * uniform());
        let raw: Vec<(f64, PlanKind)> = (0..3)
            .map(|i| (truth[i] * (0.9 + 0.2 * uniform()), kinds[i]))
            .collect();
        let calls = 3000;
        // The CPU's slowdown per call: 1, or 2-8x in bursts of 10-60 calls.
        let mut slow = vec![1.0; calls];
        let mut i = 0;
        while i < calls {
            if uniform() < 1.0 / 300.0 {
                let len = 10 + (uniform() * 50.0) as usize;
                let x = 2.0 + 6.0 * uniform();
                for s in slow.iter_mut().skip(i).take(len) {
                    *s = x;
                }
                i += len;
            } else {
                i += 1;
            }
        }
        let b = Bursts::new(truth, slow, &mut uniform);
        let mut r = ClassRecord::default();
        let mut c = 0;
        simulate(&mut r, &raw, 1.25, calls, |kind, warm| {
            let k = kinds.iter().position(|&x| x == kind).unwrap_or(0);
            c += 1;
            b.time(k, c - 1) * if warm { 1.0 } else { 1.5 }
        });
        r.spent / b.best_plan()
    }

    /// How much slower the first calls after a switch are than the plan's later ones, per
    /// plan (CPU, GPU, split), as trace 54 measured them on the H100 host.
    const AFTER_SWITCH: [&[f64]; 3] = [
        &[1.28, 1.13, 1.03],
        &[1.79, 1.19, 1.10, 1.07, 1.06],
        &[3.2, 1.22, 1.01],
    ];

    /// The decode ACP 16k class of the H100 host (trace 54): warm calls CPU 0.532 ms, GPU
    /// 0.500, split 0.62, predicted 0.393, 0.253 and about 0.55; the first calls after a
    /// switch slower, by what the trace measured per position (the GPU's 1st-5th calls
    /// 1.79, 1.19, 1.10, 1.07, 1.06x its later ones; the CPU's 1.28, 1.13, 1.03; the
    /// split's 3.2, 1.22, 1.01); each call's noise U(0.85, 1.15). With `batch`, as in
    /// `foxedge bench`: batches of that many calls, 20 ms apart (10 us between calls
    /// otherwise), the first two calls of a batch 2.5x and 1.5x slower whatever the plan.
    /// Auto's time over 3000 calls / the GPU plan's under the same batches.
    fn entry_ratio(seed: u64, batch: Option<usize>) -> f64 {
        let mut uniform = uniform_from(seed);
        let kinds = [CPU, GPU, SPLIT];
        let truth = [0.532, 0.500, 0.62];
        let raw: Vec<(f64, PlanKind)> = [0.393, 0.253, 0.55].into_iter().zip(kinds).collect();
        let rested = [2.5, 1.5];
        let prior = |k: PlanKind| if k == SPLIT { 1.0 / 0.7 } else { 1.0 };
        let mut r = ClassRecord::default();
        let (mut prev, mut pos) = (None, 0usize);
        let calls = 3000;
        let mut best = 0.0;
        for c in 0..calls {
            let in_batch = batch.map_or(c, |b| c % b);
            r.idled(if in_batch == 0 && c > 0 { 0.02 } else { 1e-5 });
            let p = r.pick(&raw, prior, 1.25);
            let i = kinds.iter().position(|&k| k == p.kind).unwrap_or(0);
            pos = if prev == Some(p.kind) { pos + 1 } else { 0 };
            prev = Some(p.kind);
            let slow = AFTER_SWITCH[i].get(pos).copied().unwrap_or(1.0);
            let cold = match batch {
                Some(_) => rested.get(in_batch).copied().unwrap_or(1.0),
                None => 1.0,
            };
            let noise = 0.85 + 0.3 * uniform();
            let secs = truth[i] * slow.max(cold) * noise;
            best += truth[1] * cold * noise;
            r.record(p.kind, raw[i].0, secs, p.probe_of());
        }
        r.spent / best
    }

    /// (median, 90th percentile) of `ratio(seed)` over `workloads` fixed seeds.
    fn median_p90(workloads: u64, ratio: impl Fn(u64) -> f64) -> (f64, f64) {
        let mut v: Vec<f64> = (1..=workloads)
            .map(|s| ratio(s.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() * 9 / 10])
    }

    fn entry_ratios(batch: Option<usize>) -> (f64, f64) {
        median_p90(200, |s| entry_ratio(s, batch))
    }

    #[test]
    fn slow_calls_after_a_switch_cost_auto_little() {
        // Over 200 workloads of that class: median <= 1.03, 90th percentile <= 1.06
        // (measured 1.022, 1.052). Deflating a probe's sample (the second call after its
        // switch) by the slowdown measured on the winner's own second calls made it worse
        // (1.044, 1.053): the slowdowns differ by plan, and CPU re-checks then won on it.
        let (median, p90) = entry_ratios(None);
        eprintln!("after a switch: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.03 && p90 <= 1.06, "median {median}, p90 {p90}");
        // In batches, as the bench times it: median <= 1.035, 90th percentile <= 1.07
        // (measured 1.030, 1.062; with the batches' first calls taken as warm, 1.043).
        let (median, p90) = entry_ratios(Some(35));
        eprintln!("after a switch, in batches: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.035 && p90 <= 1.07, "median {median}, p90 {p90}");
    }

    /// A decode ACP 4k class of the H100 host (trace 65): warm calls CPU 0.26 ms, GPU
    /// 0.37, split 0.50, predicted 0.15, 0.30 and 0.45; the first calls after a switch
    /// slower as in [`entry_ratio`]; each call's noise U(0.85, 1.15). Short bursts of slow
    /// CPU calls, as the trace's: at 6% of calls one starts, of 1 call (57%), 2 (24%), 3
    /// (10%), 4 (4%) or 5-12 (5%), each call 1.5-9.5x slower (the split half as much).
    /// Auto's time over 3000 calls / the best single plan's under the same bursts.
    fn short_burst_ratio(seed: u64) -> f64 {
        let mut uniform = uniform_from(seed);
        let kinds = [CPU, GPU, SPLIT];
        let truth = [0.26, 0.37, 0.50];
        let raw: Vec<(f64, PlanKind)> = [0.15, 0.30, 0.45].into_iter().zip(kinds).collect();
        let calls = 3000;
        let mut slow = vec![1.0; calls];
        let mut i = 0;
        while i < calls {
            if uniform() < 0.06 {
                let u = uniform();
                let len = match u {
                    _ if u < 0.57 => 1,
                    _ if u < 0.81 => 2,
                    _ if u < 0.91 => 3,
                    _ if u < 0.95 => 4,
                    _ => 5 + (uniform() * 8.0) as usize,
                };
                for s in slow.iter_mut().skip(i).take(len) {
                    let u = uniform();
                    *s = 1.5 + 8.0 * u * u;
                }
                i += len;
            } else {
                i += 1;
            }
        }
        let b = Bursts::new(truth, slow, &mut uniform);
        let prior = |k: PlanKind| if k == SPLIT { 1.0 / 0.7 } else { 1.0 };
        let mut r = ClassRecord::default();
        let (mut prev, mut pos) = (None, 0usize);
        for c in 0..calls {
            let p = r.pick(&raw, prior, 2.5);
            let k = kinds.iter().position(|&x| x == p.kind).unwrap_or(0);
            pos = if prev == Some(p.kind) { pos + 1 } else { 0 };
            prev = Some(p.kind);
            let s = AFTER_SWITCH[k].get(pos).copied().unwrap_or(1.0);
            r.record(p.kind, raw[k].0, b.time(k, c) * s, p.probe_of());
        }
        r.spent / b.best_plan()
    }

    #[test]
    fn short_bursts_cost_auto_little() {
        // Over 400 workloads: median <= 1.02, 90th percentile <= 1.035 (measured 1.011,
        // 1.023). Judging the incumbent, once its last call was back to normal, by that
        // call or its prospect rather than a window a burst inflated read the same (1.012,
        // 1.023): most of these bursts end before they move the lower median of five.
        let (median, p90) = median_p90(400, short_burst_ratio);
        eprintln!("short bursts: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.02 && p90 <= 1.035, "median {median}, p90 {p90}");
    }

    #[test]
    fn through_bursts_auto_stays_close_to_the_best_plan() {
        // As the property test below, with bursts as on the H100 host: from a random call
        // on, for 10-60 calls, the CPU plan takes 2-8x its time (its cores are busy; the
        // GPU plan is not slowed, the split by half as much), about 10 bursts in 3000
        // calls. Auto's time / the best single plan's under the same bursts, over 400
        // fixed workloads: median <= 1.01, 90th percentile <= 1.05 (measured 1.000, 1.033;
        // on 2000 workloads 1.000, 1.032; without the likely re-checks 1.010, 1.097; before
        // prospects, clear wins and a 1.5% budget 1.018, 1.175). Auto can run around the
        // bursts, which no single plan does.
        let (median, p90) = median_p90(400, bursty_ratio);
        eprintln!("through bursts: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.01 && p90 <= 1.05, "median {median}, p90 {p90}");
    }

    proptest::proptest! {
        /// The kept sorted copy is the last `N` values pushed since the last clear, sorted
        /// from scratch (ties included: half the values are small integers), and the median
        /// and minimum are read from it.
        #[test]
        fn a_rings_kept_median_is_its_windows_lower_median(
            xs in proptest::collection::vec(
                proptest::prop_oneof![
                    0.0f64..10.0,
                    proptest::strategy::Strategy::prop_map(0u8..4, f64::from)
                ],
                0..40,
            ),
            clear_at in 0usize..40,
        ) {
            let mut r: Ring<5> = Ring::default();
            let mut kept: Vec<f64> = Vec::new();
            for (i, &x) in xs.iter().enumerate() {
                if i == clear_at {
                    r.clear();
                    kept.clear();
                }
                r.push(x);
                kept.push(x);
                let mut last: Vec<f64> = kept.iter().rev().take(5).copied().collect();
                last.sort_by(f64::total_cmp);
                proptest::prop_assert_eq!(r.lower_median(), Some(last[(last.len() - 1) / 2]));
                proptest::prop_assert_eq!(r.min(), Some(last[0]));
                proptest::prop_assert_eq!(&r.sorted[..r.len], &last[..]);
            }
        }
    }

    proptest::proptest! {
        /// Three plans whose true times are 0.5-2 s, predicted within 10% (so the best is
        /// within `explore` of any other); each call's time is its plan's times U(0.85, 1.15),
        /// and 1.5x on the first call after a switch. Over 3000 calls auto takes at most
        /// 1.05x the time of always running the best plan.
        #[test]
        fn auto_stays_within_five_percent_of_the_best_plan(
            truth in proptest::collection::vec(0.5f64..2.0, 3),
            err in proptest::collection::vec(0.9f64..1.1, 3),
            seed in 1u64..u64::MAX,
        ) {
            let kinds = [CPU, GPU, SPLIT];
            let raw: Vec<(f64, PlanKind)> =
                (0..3).map(|i| (truth[i] * err[i], kinds[i])).collect();
            let mut rng = seed;
            let mut noise = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                0.85 + 0.3 * (rng >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut r = ClassRecord::default();
            let calls = 3000;
            simulate(&mut r, &raw, 1.25, calls, |kind, warm| {
                let i = kinds.iter().position(|&k| k == kind).unwrap_or(0);
                truth[i] * noise() * if warm { 1.0 } else { 1.5 }
            });
            let total = r.spent;
            let best = truth.iter().copied().fold(f64::INFINITY, f64::min) * calls as f64;
            proptest::prop_assert!(total <= 1.05 * best, "{} vs {}", total, best);
        }
    }
}
