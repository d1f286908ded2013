//! Where an attention call runs: all on the CPU, all on the GPU, or whole heads split
//! between them (`hybrid`), and `auto`, which picks one of these per call from measured
//! times.
//!
//! # Split
//! Heads are independent in attention, so a call can run some heads on the CPU and the
//! rest on the GPU at once, both sides writing their heads of one output in place. Work
//! is proportional to the kept query-key pairs (ACP paper, section 3), which the call's
//! ACP decisions give per head before any kernel runs ([`crate::decisions`]; both sides
//! then run on those decisions). The GPU takes the heaviest heads until it holds the
//! share `s = T_cpu / (T_cpu + T_gpu)` of the pairs, `T_x` the estimated seconds of the
//! whole call on side x: both sides then end together, after `T_cpu T_gpu / (T_cpu +
//! T_gpu)`. The GPU side packs and submits on the calling thread; the CPU side starts in a
//! pool of one thread fewer once the GPU's host work is done. Where the Vulkan device is
//! itself a CPU implementation (lavapipe) the sides share the cores and run one after the
//! other.
//!
//! # Auto
//! A short calibration ([`crate::calibration`], once per process, device and (heads,
//! head_dim)) fits `secs = a + b P` per side and kind of call on synthetic dense calls,
//! `P` the call's dense query-key pairs. A call's size class is (prefill or decode, ACP or dense, heads,
//! `floor(log2 P)`). In its class a plan's estimate is the fit's seconds times the median
//! of measured / fitted seconds over the plan's last [`WINDOW`] recorded calls (the fit
//! alone before any; times [`SPLIT_PRIOR`] for a split). A call runs the plan of the
//! smallest estimate, except that a plan within [`EXPLORE`] of it is tried when the class
//! has not measured it yet, and the runner-up is re-checked every [`RECHECK_EVERY`] calls
//! of the class when it is within [`EXPLORE`]; either runs twice. The first call after a
//! change of plan is not recorded: it pays for the change (a device mirror catching up
//! with the steps the CPU took, cold caches). A split is a candidate only where the sides
//! run concurrently.
//!
//! # Failure
//! A Vulkan device missing at open time makes `auto` use the CPU (said once). One lost (or
//! out of memory) during a call makes the placement rerun that call's GPU heads on the CPU
//! and use only the CPU from then on (said once; [`AttentionBackend::kind`] is then `cpu`).
//! Backends hold no stream state (the session owns the cache), so nothing is lost.

use crate::backend::{
    AttentionBackend, BackendKind, CpuBackend, DecodeCall, KvElem, PrefillCall, is_device_failure,
    merge_stats,
};
use crate::calibration::{self, Calibration};
use crate::decisions::{Boundary, decode_kept, prefill_decisions};
use crate::error::{Error, Result};
use foxedge_core::contract::{Acp, AttentionStats};
use half::f16;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Recorded calls per plan and class whose median is the plan's correction.
const WINDOW: usize = 7;
/// A plan is tried, or re-checked, when its estimate is within this factor of the best.
const EXPLORE: f64 = 2.0;
/// Calls of a class between re-checks of its runner-up.
const RECHECK_EVERY: u64 = 64;
/// A split's correction before its class has measured one: a split's sides slow each
/// other (host cores, memory bandwidth), which the fit of each side alone misses.
const SPLIT_PRIOR: f64 = 1.25;

/// Which heads of a call ran where, ascending.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Split {
    pub gpu_heads: Vec<usize>,
    pub cpu_heads: Vec<usize>,
}

impl Split {
    /// Every one of `n` heads on one side.
    fn whole(n: usize, on_gpu: bool) -> Split {
        let (all, none) = ((0..n).collect(), Vec::new());
        let (gpu_heads, cpu_heads) = if on_gpu { (all, none) } else { (none, all) };
        Split {
            gpu_heads,
            cpu_heads,
        }
    }

    /// Heads of `weights` (two or more) split so that the GPU holds about `share` of the
    /// weight: the heaviest heads (ties: lower index first), each taken while its middle
    /// stays within the share, and at least one head per side.
    fn of(weights: &[u64], share: f64) -> Split {
        let n = weights.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| weights[b].cmp(&weights[a]).then(a.cmp(&b)));
        let want = share.clamp(0.0, 1.0) * weights.iter().sum::<u64>() as f64;
        let (mut g, mut acc) = (0, 0.0);
        while g < n && acc + weights[order[g]] as f64 / 2.0 <= want {
            acc += weights[order[g]] as f64;
            g += 1;
        }
        let g = g.clamp(1, n.saturating_sub(1).max(1));
        let (mut gpu_heads, mut cpu_heads) = (order[..g].to_vec(), order[g..].to_vec());
        gpu_heads.sort_unstable();
        cpu_heads.sort_unstable();
        Split {
            gpu_heads,
            cpu_heads,
        }
    }
}

/// Calls by plan, and the placement's own time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Every head on the CPU.
    pub cpu: u64,
    /// Every head on the GPU.
    pub gpu: u64,
    /// Heads on both sides.
    pub split: u64,
    /// Nanoseconds spent outside the backends' dispatch: calibration, the choice, the
    /// bookkeeping (a split's decisions count as its dispatch: its kernels reuse them).
    pub scheduler_ns: u64,
}

/// Where a call's heads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Cpu = 0,
    Gpu = 1,
    Split = 2,
}

const PLANS: [Plan; 3] = [Plan::Cpu, Plan::Gpu, Plan::Split];

/// (decode, ACP on, heads, floor log2 of the dense pairs).
type Class = (bool, bool, usize, u32);

/// What `auto` measured in one size class.
#[derive(Debug, Default)]
struct Record {
    /// Per plan: measured / fitted seconds of its last recorded calls, oldest first.
    ratios: [Vec<f64>; 3],
    calls: u64,
    /// The plan of the class's previous call.
    last: Option<Plan>,
    /// The plan of a try or re-check whose second call is due.
    again: Option<Plan>,
}

impl Record {
    /// The median of `p`'s ratios (the lower of two middles), None before any.
    fn factor(&self, p: Plan) -> Option<f64> {
        let (r, mut v) = (&self.ratios[p as usize], [0.0; WINDOW]);
        let v = &mut v[..r.len()];
        v.copy_from_slice(r);
        v.sort_by(f64::total_cmp);
        v.get(v.len().saturating_sub(1) / 2).copied()
    }

    /// The plan of the next call from each candidate's estimate (None: not a candidate),
    /// and whether the class's previous call ran it too (then this call is recorded).
    fn pick(&mut self, est: &[Option<f64>; 3]) -> (Plan, bool) {
        self.calls += 1;
        let mut ranked = PLANS.map(|p| (p, est[p as usize].unwrap_or(f64::INFINITY)));
        ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
        let best = ranked[0];
        let near = |x: &(Plan, f64)| x.1 <= EXPLORE * best.1;
        // A plan the class has not measured is tried once the class has run a call.
        let untried = ranked[1..]
            .iter()
            .find(|x| near(x) && self.last.is_some() && self.ratios[x.0 as usize].is_empty());
        let recheck =
            Some(&ranked[1]).filter(|x| near(x) && self.calls.is_multiple_of(RECHECK_EVERY));
        let plan = match (self.again.take(), untried.or(recheck)) {
            (Some(p), _) if est[p as usize].is_some() => p,
            (_, Some(&(p, _))) => {
                self.again = Some(p);
                p
            }
            _ => best.0,
        };
        let warm = self.last == Some(plan);
        self.last = Some(plan);
        (plan, warm)
    }

    /// Records a warm call of `p` that took `ratio` times its fitted seconds.
    fn learn(&mut self, p: Plan, ratio: f64) {
        let r = &mut self.ratios[p as usize];
        if ratio.is_finite() && ratio > 0.0 {
            if r.len() == WINDOW {
                r.remove(0);
            }
            r.push(ratio);
        }
    }
}

/// A plan for one call: its fitted seconds (what a measurement is divided by), the GPU's
/// share of a split, and whether the call is recorded in its class.
struct Choice {
    class: Class,
    plan: Plan,
    fitted: f64,
    share: f64,
    warm: bool,
}

/// What [`Placement`] keeps between calls.
#[derive(Debug, Default)]
struct State {
    costs: HashMap<(usize, usize), Calibration>,
    classes: HashMap<Class, Record>,
    last_split: Option<Split>,
    counts: PlanCounts,
}

/// The GPU side of a placement.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub backend: Box<dyn AttentionBackend>,
    /// The device's name (messages, the process-wide calibrations' key).
    pub name: String,
    /// CPU and GPU work overlap in time (false for a CPU Vulkan device).
    pub concurrent: bool,
}

/// The `hybrid` (every call split) and `auto` backends (see the module docs).
#[derive(Debug)]
pub(crate) struct Placement {
    auto: bool,
    gpu: Gpu,
    fell_back: AtomicBool,
    state: Mutex<State>,
    /// A split's CPU side where the sides overlap: one thread fewer than the machine has,
    /// so the GPU's submitting thread keeps a core.
    pool: OnceLock<Option<rayon::ThreadPool>>,
}

impl Placement {
    pub(crate) fn new(auto: bool, gpu: Gpu) -> Placement {
        Placement {
            auto,
            gpu,
            fell_back: AtomicBool::new(false),
            state: Mutex::default(),
            pool: OnceLock::new(),
        }
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Internal("placement state lock poisoned".into()))
    }

    pub(crate) fn fell_back(&self) -> bool {
        self.fell_back.load(Ordering::Acquire)
    }

    pub(crate) fn gpu_name(&self) -> &str {
        &self.gpu.name
    }

    pub(crate) fn plan_counts(&self) -> PlanCounts {
        self.state().map(|s| s.counts).unwrap_or_default()
    }

    pub(crate) fn last_split(&self) -> Option<Split> {
        self.state().ok()?.last_split.clone()
    }

    /// The costs for calls of `heads` x `d`, calibrated now if this placement has none.
    pub(crate) fn calibration(&self, heads: usize, d: usize) -> Result<Calibration> {
        self.costs(&mut *self.state()?, heads, d)
    }

    /// This placement's costs for (heads, d) ([`calibration::for_device`] at first use).
    fn costs(&self, st: &mut State, heads: usize, d: usize) -> Result<Calibration> {
        if let Some(c) = st.costs.get(&(heads, d)) {
            return Ok(*c);
        }
        let cal = calibration::for_device(self.gpu.backend.as_ref(), &self.gpu.name, heads, d)?;
        st.costs.insert((heads, d), cal);
        Ok(cal)
    }

    /// The plan of a call of `heads` x `d` over `pairs` dense query-key pairs.
    fn choose(
        &self,
        decode: bool,
        acp: bool,
        (heads, d): (usize, usize),
        pairs: u64,
    ) -> Result<Choice> {
        let mut st = self.state()?;
        let cal = self.costs(&mut st, heads, d)?;
        let k = usize::from(decode);
        let fitted = [cal.cpu[k].secs(pairs), cal.gpu[k].secs(pairs)];
        let class = (decode, acp, heads, pairs.max(1).ilog2());
        let rec = st.classes.entry(class).or_default();
        let [c, g] =
            [Plan::Cpu, Plan::Gpu].map(|p| fitted[p as usize] * rec.factor(p).unwrap_or(1.0));
        let share = c / (c + g);
        let split = match self.gpu.concurrent {
            true => c * g / (c + g),
            false => share * g + (1.0 - share) * c,
        };
        let fitted = [fitted[0], fitted[1], split];
        let (plan, warm) = if self.auto {
            let can_split = self.gpu.concurrent && heads >= 2;
            let s = can_split.then(|| split * rec.factor(Plan::Split).unwrap_or(SPLIT_PRIOR));
            rec.pick(&[Some(c), Some(g), s])
        } else if heads >= 2 {
            (Plan::Split, false)
        } else {
            (Plan::Cpu, false)
        };
        Ok(Choice {
            class,
            plan,
            fitted: fitted[plan as usize],
            share,
            warm,
        })
    }

    /// Books a call's result `r` (its plan `choice`, dispatched at `t0`; `entered` when the
    /// call began) and returns its statistics.
    fn finish(
        &self,
        choice: &Choice,
        r: Result<(AttentionStats, Split)>,
        t0: Instant,
        entered: Instant,
    ) -> Result<AttentionStats> {
        let ran = t0.elapsed().as_secs_f64();
        let (stats, split) = r?;
        let mut st = self.state()?;
        // A call that fell back measured the CPU's rerun, not its plan.
        if choice.warm
            && !self.fell_back()
            && let Some(rec) = st.classes.get_mut(&choice.class)
        {
            rec.learn(choice.plan, ran / choice.fitted);
        }
        let c = &mut st.counts;
        *[&mut c.cpu, &mut c.gpu, &mut c.split][choice.plan as usize] += 1;
        let own = entered.elapsed().as_secs_f64() - ran;
        c.scheduler_ns += (own.max(0.0) * 1e9) as u64;
        st.last_split = Some(split);
        Ok(stats)
    }

    /// `r` from the GPU, or `cpu()`'s rerun when the GPU failed as a device (then every
    /// later call runs on the CPU).
    fn or_cpu<R>(&self, r: Result<R>, cpu: impl FnOnce() -> Result<R>) -> Result<R> {
        match r {
            Err(e) if is_device_failure(&e) => {
                if !self.fell_back.swap(true, Ordering::AcqRel) {
                    let kind = if self.auto { "auto" } else { "hybrid" };
                    eprintln!("foxedge: {kind} backend: {e}; attention continues on the CPU");
                }
                cpu()
            }
            r => r,
        }
    }

    /// The pool a split's CPU side runs in (None: the sides run one after the other).
    fn pool(&self) -> Option<&rayon::ThreadPool> {
        self.pool
            .get_or_init(|| {
                let n = rayon::current_num_threads();
                if !self.gpu.concurrent || n < 4 {
                    return None;
                }
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n - 1)
                    .thread_name(|i| format!("foxedge-split-{i}"))
                    .build()
                    .ok()
            })
            .as_ref()
    }

    /// A split's two sides: `gpu` on this thread, `cpu` in the split pool from the moment
    /// `gpu` calls its argument (once its host work is done; at once if it never does),
    /// so the two do not fight over cores. Without a pool they run one after the other. A
    /// panic on the GPU side becomes an error, so the call can fall back.
    fn beside<G: Send, C: Send>(
        &self,
        gpu: impl FnOnce(&mut dyn FnMut()) -> Result<G> + Send,
        cpu: impl FnOnce() -> Result<C> + Send,
    ) -> (Result<G>, Result<C>) {
        let gpu = |start: &mut dyn FnMut()| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gpu(start)))
                .unwrap_or_else(|_| Err(Error::Internal("the GPU side of a split panicked".into())))
        };
        let Some(pool) = self.pool() else {
            let c = cpu();
            return (gpu(&mut || {}), c);
        };
        let mut c = Err(Error::Internal("a split's CPU side did not run".into()));
        let mut pending = Some((cpu, &mut c));
        let g = pool.in_place_scope(|s| {
            let g = gpu(&mut || {
                if let Some((cpu, slot)) = pending.take() {
                    s.spawn(move |_| *slot = cpu());
                }
            });
            if let Some((cpu, slot)) = pending.take() {
                *slot = cpu();
            }
            g
        });
        (g, c)
    }

    /// A prefill split: both sides read the call's tensors and run on the call's
    /// decisions in place, each writing its heads of `out`.
    fn prefill_split(
        &self,
        call: &PrefillCall<'_>,
        share: f64,
        out: &mut [f32],
    ) -> Result<(AttentionStats, Split)> {
        let decided = match call.acp() {
            Acp::Off => None,
            _ => Some(prefill_decisions(call)?),
        };
        let weights = decided
            .as_ref()
            .map_or(vec![1; call.heads()], |d| d.kept_pairs.clone());
        let split = Split::of(&weights, share);
        let acp = decided.as_ref().map_or(call.acp(), Boundary::acp);
        let side = |heads| call.with_acp(acp).with_heads(Some(heads));
        let (g, c) = (side(&split.gpu_heads), side(&split.cpu_heads));
        let gpu = self.gpu.backend.as_ref();
        let (gran, cres) = self.beside(
            |packed| gpu.prefill_run(&g, packed),
            || CpuBackend.prefill(&c, out),
        );
        let cs = cres?;
        let gres = gran.and_then(|run| run.finish(out));
        let gs = self.or_cpu(gres, || CpuBackend.prefill(&g, out))?;
        Ok((
            merge_stats(
                call.heads(),
                [(&split.gpu_heads[..], gs), (&split.cpu_heads[..], cs)],
            ),
            split,
        ))
    }

    /// A decode split: the sides' queries are gathered, their cache heads are views.
    fn decode_split<T: KvElem>(
        &self,
        call: &DecodeCall<'_, T>,
        share: f64,
        out: &mut [f32],
    ) -> Result<(AttentionStats, Split)> {
        use rayon::prelude::*;
        let (nh, nq, d) = (
            call.args.heads.len(),
            call.args.n_queries,
            call.args.head_dim,
        );
        let weights = (0..nh)
            .into_par_iter()
            .map(|h| decode_kept(call, h))
            .collect::<Result<Vec<_>>>()?;
        let split = Split::of(&weights, share);
        let (gp, cp) = (call.part(&split.gpu_heads), call.part(&split.cpu_heads));
        let (g, c) = (gp.call(call), cp.call(call));
        let mut g_out = vec![0.0f32; split.gpu_heads.len() * nq * d];
        let mut c_out = vec![0.0f32; split.cpu_heads.len() * nq * d];
        let gpu = self.gpu.backend.as_ref();
        let (gres, cres) = self.beside(
            |start| {
                start();
                T::decode(gpu, &g, &mut g_out)
            },
            || T::decode(&CpuBackend, &c, &mut c_out),
        );
        let cs = cres?;
        let gs = self.or_cpu(gres, || T::decode(&CpuBackend, &g, &mut g_out))?;
        for (part, heads) in [(&g_out, &split.gpu_heads), (&c_out, &split.cpu_heads)] {
            for (rows, &h) in part.chunks_exact(nq * d).zip(heads) {
                out[h * nq * d..(h + 1) * nq * d].copy_from_slice(rows);
            }
        }
        Ok((
            merge_stats(nh, [(&split.gpu_heads[..], gs), (&split.cpu_heads[..], cs)]),
            split,
        ))
    }
}

impl AttentionBackend for Placement {
    fn kind(&self) -> BackendKind {
        match (self.fell_back(), self.auto) {
            (true, _) => BackendKind::Cpu,
            (false, true) => BackendKind::Auto,
            (false, false) => BackendKind::Hybrid,
        }
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let (t, heads) = (call.t(), call.heads());
        if out.len() != t * heads * call.head_dim() {
            return Err(Error::invalid("prefill out: [t, heads, head_dim] values"));
        }
        if self.fell_back() {
            return CpuBackend.prefill(call, out);
        }
        let entered = Instant::now();
        let pairs = (t * (t + 1) / 2 * heads) as u64;
        let acp = !matches!(call.acp(), Acp::Off);
        let choice = self.choose(false, acp, (heads, call.head_dim()), pairs)?;
        let t0 = Instant::now();
        let r = match choice.plan {
            Plan::Cpu => CpuBackend
                .prefill(call, out)
                .map(|s| (s, Split::whole(heads, false))),
            Plan::Gpu => {
                let r = self.gpu.backend.prefill(call, out);
                let on_gpu = r.is_ok();
                self.or_cpu(r, || CpuBackend.prefill(call, out))
                    .map(|s| (s, Split::whole(heads, on_gpu)))
            }
            Plan::Split => self.prefill_split(call, choice.share, out),
        };
        self.finish(&choice, r, t0, entered)
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.decode_any(call, out)
    }

    fn decode_f16(&self, call: &DecodeCall<'_, f16>, out: &mut [f32]) -> Result<AttentionStats> {
        self.decode_any(call, out)
    }

    fn release_cache(&self, ids: &[u64]) {
        self.gpu.backend.release_cache(ids);
    }
}

impl Placement {
    /// A decode step over `T` cache rows, placed as the module docs say.
    fn decode_any<T: KvElem>(
        &self,
        call: &DecodeCall<'_, T>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        let a = &call.args;
        let (nh, nq) = (a.heads.len(), a.n_queries);
        if out.len() != nh * nq * a.head_dim {
            return Err(Error::invalid(
                "decode out: [heads, n_queries, head_dim] values",
            ));
        }
        if self.fell_back() {
            return T::decode(&CpuBackend, call, out);
        }
        let entered = Instant::now();
        let pairs = a.heads.iter().map(|h| h.c.len() as u64).sum::<u64>() * nq as u64;
        let acp = !matches!(call.acp, Acp::Off);
        let choice = self.choose(true, acp, (nh, a.head_dim), pairs)?;
        let t0 = Instant::now();
        let r = match choice.plan {
            Plan::Cpu => T::decode(&CpuBackend, call, out).map(|s| (s, Split::whole(nh, false))),
            Plan::Gpu => {
                let r = T::decode(self.gpu.backend.as_ref(), call, out);
                let on_gpu = r.is_ok();
                self.or_cpu(r, || T::decode(&CpuBackend, call, out))
                    .map(|s| (s, Split::whole(nh, on_gpu)))
            }
            Plan::Split => self.decode_split(call, choice.share, out),
        };
        self.finish(&choice, r, t0, entered)
    }
}

#[cfg(test)]
mod tests;
