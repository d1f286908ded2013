//! The hybrid CPU/GPU scheduler, `auto` backend selection, and a kernel-level [`Engine`]
//! that benchmarks and tools drive directly.
//!
//! # Cost model
//! Per backend and per kind of call (prefill, decode), one call over a set of heads costs
//! `time ≈ a + b · P` seconds, `P` = kept query-key pairs of those heads (ACP paper,
//! section 3: work is proportional to the kept pairs, FLOPs = `4 · head_dim · P`). `a` and
//! `b` come from a short calibration (two or three dense sizes per call kind on synthetic
//! data, the minimum of a few runs), made once per process for each (device, heads, head_dim) and
//! kept for the backend's life; the costs of a calibration that met a busy host are
//! measured again once the host is quiet (see `share`).
//!
//! # Split
//! ACP's boundary (foxedge-core's `start_blocks` / `count_pairs`) gives each head's kept
//! pairs `P_h` before any kernel runs. Whole heads go to one side: with heads sorted by
//! `P_h`, every prefix of the heaviest (and of the lightest) heads is a candidate GPU set;
//! the predicted time of a split is `max(cpu(P_cpu), gpu(P_gpu))` when the two run
//! concurrently (a real GPU) and `cpu + gpu` when the Vulkan device is itself a CPU
//! implementation (lavapipe shares the cores), each side first costed as the two slow each
//! other ([`Contention`], measured at calibration). The GPU side runs on the calling
//! thread; the CPU side runs in a pool of one thread fewer, from when the GPU side's host
//! packing is done; both read the call's tensors and write their heads of its output in
//! place. Decode recomputes the split at every call from the current cache (lengths and
//! pruned blocks change per step).
//!
//! # Failure
//! A Vulkan device that is missing at open time makes `auto` use the CPU; one lost (or out
//! of memory) during a call makes the scheduler rerun that call's GPU heads on the CPU and
//! use only the CPU from then on. Either is said once on stderr and shows in
//! [`AttentionBackend::kind`] (`cpu`), hence in the session statistics. Backends hold no
//! stream state (the session owns the cache), so nothing of the stream is lost.

use crate::aligned::AlignedF32;
use crate::backend::{
    Acp, AttentionBackend, AttentionStats, BackendKind, CacheHead, CacheSync, CpuBackend,
    DecodeCall, PrefillCall, WriteJournal,
};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::session::{Session, SessionOptions};
use foxedge_core::boundary::{self, BlockGrid};
use foxedge_core::{gate, threshold};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

mod ahead;
mod feedback;
mod share;
use feedback::{ClassRecord, Pick, Probe, Reason, Shortcut};
use share::Remeasure;

/// ACP block size (tokens) of both backends' kernels (their default options).
pub const BLOCK: usize = 64;

/// `time ≈ a + b · pairs + c · rows` (seconds): `b` per kept query-key pair (compute),
/// `c` per row (a token of one head in prefill, a cache entry of one head in decode: the
/// bytes moved, which dominate a discrete GPU's call through host memory).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCost {
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

/// One calibration measurement: kept pairs, rows, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    pairs: u64,
    rows: u64,
    secs: f64,
}

impl LinearCost {
    /// Predicted seconds for `pairs` kept pairs over `rows` rows; 0 for an empty call.
    pub fn predict(&self, pairs: u64, rows: u64, empty: bool) -> f64 {
        if empty {
            0.0
        } else {
            self.a + self.b * pairs as f64 + self.c * rows as f64
        }
    }

    /// Fits from a small and a large dense sample (`d1`, `d2`) and a pruned sample `p` of
    /// `d2`'s rows: `b` from `d2 - p` (same rows), then `c` and `a` from `d1`, `d2` less
    /// their pair term. Every coefficient is clamped to `>= 0`.
    fn fit(d1: Sample, d2: Sample, p: Sample) -> LinearCost {
        let dp = d2.pairs.saturating_sub(p.pairs) as f64;
        let b = if dp > 0.0 {
            ((d2.secs - p.secs) / dp).max(0.0)
        } else {
            0.0
        };
        let r1 = d1.secs - b * d1.pairs as f64;
        let r2 = d2.secs - b * d2.pairs as f64;
        let dr = d2.rows.saturating_sub(d1.rows) as f64;
        let c = if dr > 0.0 {
            ((r2 - r1) / dr).max(0.0)
        } else {
            0.0
        };
        let a = (r1 - c * d1.rows as f64).max(0.0);
        let mut lc = LinearCost { a, b, c };
        if b == 0.0 && c == 0.0 {
            // Degenerate samples (timer noise): charge the large call's time per pair.
            lc.b = d2.secs / d2.pairs.max(1) as f64;
        }
        lc
    }
}

/// Measured costs of both backends (see the module docs), for one (heads, head_dim).
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub cpu_prefill: LinearCost,
    pub gpu_prefill: LinearCost,
    pub cpu_decode: LinearCost,
    /// Decode on the GPU; when `gpu_decode_resident`, `c` is per row sent (the changed
    /// rows of a cache head the device mirrors, all rows of one it does not hold yet).
    pub gpu_decode: LinearCost,
    /// The GPU keeps decode caches resident (measured: a step that changes one row per
    /// head ran in < 0.7x the time of one that sends the whole cache).
    pub gpu_decode_resident: bool,
    /// Whether CPU and GPU work overlap in time (false for a CPU Vulkan device).
    pub concurrent: bool,
    /// Extra seconds of a split call: handing its CPU side to a pool thread and waiting
    /// for it. Both sides read the call's inputs and write their heads' output in place
    /// (a decode split gathers only its queries).
    pub split_fixed: f64,
    /// What a prefill's and a decode's split sides cost each other (identity where the
    /// sides do not overlap); see [`Contention`].
    pub split_prefill: Contention,
    pub split_decode: Contention,
    /// Wall time the calibration took (seconds).
    pub seconds: f64,
    /// The fraction of a core the CPU pool's threads got when they wanted one, around the
    /// prefill and the decode samples of both backends (the lower of a probe before and
    /// one after; None where the platform gives no thread CPU time). Below 0.75 the
    /// samples met a busy host, and both backends' costs of that kind are measured again
    /// later in the engine's life, the faster kept (see the `share` module).
    pub cpu_prefill_share: Option<f64>,
    pub cpu_decode_share: Option<f64>,
}

impl fmt::Display for Calibration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |c: &LinearCost| {
            format!(
                "{:.0} us + {:.3} ns/pair + {:.1} ns/row",
                c.a * 1e6,
                c.b * 1e9,
                c.c * 1e9
            )
        };
        write!(
            f,
            "prefill cpu {} | gpu {}; decode cpu {} | gpu {}{}; split {:.0} us, sides \
             prefill {}, decode {}; {} ({:.2} s); CPU share prefill {}, decode {}",
            g(&self.cpu_prefill),
            g(&self.gpu_prefill),
            g(&self.cpu_decode),
            g(&self.gpu_decode),
            if self.gpu_decode_resident {
                " (resident: rows = rows sent)"
            } else {
                ""
            },
            self.split_fixed * 1e6,
            self.split_prefill,
            self.split_decode,
            if self.concurrent {
                "concurrent"
            } else {
                "shared cores"
            },
            self.seconds,
            share_words(self.cpu_prefill_share),
            share_words(self.cpu_decode_share)
        )
    }
}

/// What a split's two sides cost each other while they run at once, measured at
/// calibration on one split of half the heads a side (see [`Scheduler::calibrate_sides`]).
/// With `cpu`, `gpu` each side's time alone by the backends' costs, a split's
///
/// - CPU side starts once the GPU side's host work is done (a Vulkan prefill's packing,
///   `pack · gpu`), then runs `cpu` plus `(cpu_factor - 1) · overlap`;
/// - GPU side runs `gpu` plus `(gpu_factor - 1) · overlap`,
///
/// where `overlap = min(cpu, (1 - pack) · gpu)` is how long both run: the factors are the
/// sides' slowdowns while the other runs (one thread fewer for the CPU, and both sides'
/// host work sharing cores and memory bandwidth). A split with a small CPU side costs its
/// GPU side little. On the H100 host, a split's sides ran at 1.6-2.9x (CPU) and 1.3-2.3x
/// (GPU) the backends' costs without this (trace 364), which priced 1K prefill splits
/// 10-30% below the GPU alone where they ran 0-7% above it (runs 350-355).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Contention {
    pub cpu_factor: f64,
    pub gpu_factor: f64,
    pub pack: f64,
}

impl Contention {
    /// Sides that do not slow each other (and that run one after the other: shared cores).
    pub const NONE: Contention = Contention {
        cpu_factor: 1.0,
        gpu_factor: 1.0,
        pack: 0.0,
    };

    /// The contention that makes [`Self::sides`] of one split's sides alone (`cpu`, `gpu`;
    /// `packed`: when the GPU side alone finished its host work) equal the same split's
    /// sides together (`cpu_split`, counted from the split's start; `gpu_split`), seconds.
    /// Factors below 1 are noise (a side does not speed up beside another), above
    /// [`Self::MAX_FACTOR`] a hiccup; sides that did not overlap measure no factor.
    fn measured(cpu: f64, gpu: f64, packed: f64, cpu_split: f64, gpu_split: f64) -> Contention {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !(ok(cpu) && ok(gpu) && ok(cpu_split) && ok(gpu_split)) {
            return Contention::NONE;
        }
        let packed = if packed.is_finite() {
            packed.clamp(0.0, gpu)
        } else {
            0.0
        };
        let overlap = cpu.min(gpu - packed);
        let f = |extra: f64| {
            if overlap > 0.0 {
                (1.0 + extra / overlap).clamp(1.0, Self::MAX_FACTOR)
            } else {
                1.0
            }
        };
        Contention {
            cpu_factor: f(cpu_split - packed - cpu),
            gpu_factor: f(gpu_split - gpu),
            pack: packed / gpu,
        }
    }

    const MAX_FACTOR: f64 = 4.0;

    /// The (CPU, GPU) sides' seconds of a split whose sides alone take `cpu` and `gpu`.
    fn sides(&self, cpu: f64, gpu: f64) -> (f64, f64) {
        let overlap = cpu.min((1.0 - self.pack) * gpu).max(0.0);
        (
            self.pack * gpu + cpu + (self.cpu_factor - 1.0) * overlap,
            gpu + (self.gpu_factor - 1.0) * overlap,
        )
    }
}

impl fmt::Display for Contention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cpu x{:.2} after {:.2} of gpu, gpu x{:.2}",
            self.cpu_factor, self.pack, self.gpu_factor
        )
    }
}

/// What `cost` predicts for a reference call of `heads` heads, to compare two quiet
/// measurements: a dense decode step over 1024 and one over 16384 entries per head (the
/// decode calibration's sizes; one row sent per head where the GPU keeps caches
/// resident), or a dense prefill of 1024 tokens.
fn reference_seconds(cost: LinearCost, heads: usize, decode: bool, resident: bool) -> f64 {
    let h = heads as u64;
    if decode {
        [1024u64, 16384]
            .iter()
            .map(|&n| cost.predict(n * h, if resident { h } else { n * h }, false))
            .sum()
    } else {
        cost.predict(1024 * 1025 / 2 * h, 1024 * h, false)
    }
}

/// The calibration's costs of decode or prefill.
fn kind_costs(c: &Calibration, decode: bool) -> KindCosts {
    if decode {
        KindCosts {
            cpu: c.cpu_decode,
            gpu: c.gpu_decode,
            resident: c.gpu_decode_resident,
            share: c.cpu_decode_share,
        }
    } else {
        KindCosts {
            cpu: c.cpu_prefill,
            gpu: c.gpu_prefill,
            resident: false,
            share: c.cpu_prefill_share,
        }
    }
}

/// Whether `new`'s CPU and GPU costs should replace `old`'s: each where it predicts less
/// for the reference call (see `share`: contention only slows a measurement); a GPU decode
/// measured with another residency never replaces (its per-row cost means another thing).
fn improves(new: &KindCosts, old: &KindCosts, heads: usize, decode: bool) -> (bool, bool) {
    let judged = |k: &KindCosts, gpu: bool| {
        let cost = if gpu { k.gpu } else { k.cpu };
        reference_seconds(cost, heads, decode, gpu && k.resident)
    };
    (
        judged(new, false) < judged(old, false),
        new.resident == old.resident && judged(new, true) < judged(old, true),
    )
}

/// Sets the CPU's (`cpu`) and the GPU's (`gpu`) costs of decode or prefill to `new`'s;
/// the kind's share becomes the calmer of the two.
fn set_kind(c: &mut Calibration, decode: bool, new: &KindCosts, cpu: bool, gpu: bool) {
    let (cc, gc, sh) = if decode {
        (
            &mut c.cpu_decode,
            &mut c.gpu_decode,
            &mut c.cpu_decode_share,
        )
    } else {
        (
            &mut c.cpu_prefill,
            &mut c.gpu_prefill,
            &mut c.cpu_prefill_share,
        )
    };
    if cpu {
        *cc = new.cpu;
    }
    if gpu {
        *gc = new.gpu;
    }
    if cpu || gpu {
        *sh = share::calmer(new.share, *sh);
    }
}

/// A CPU share in words: its value, and whether it met a busy host.
fn share_words(s: Option<f64>) -> String {
    match s {
        Some(x) if share::busy(s) => format!("{x:.2} (busy host)"),
        Some(x) => format!("{x:.2}"),
        None => "unknown".into(),
    }
}

/// Which heads a call ran where.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Split {
    /// Head indices that ran on the GPU, ascending.
    pub gpu_heads: Vec<usize>,
    /// Head indices that ran on the CPU, ascending.
    pub cpu_heads: Vec<usize>,
    /// The cost model's predicted seconds of the chosen plan (before the measured
    /// corrections `auto` applies when choosing).
    pub predicted_seconds: f64,
}

impl Split {
    /// Every one of `n` heads on one side (the GPU or the CPU).
    fn whole(n: usize, on_gpu: bool, predicted_seconds: f64) -> Split {
        let all = (0..n).collect();
        let (gpu_heads, cpu_heads) = if on_gpu {
            (all, Vec::new())
        } else {
            (Vec::new(), all)
        };
        Split {
            gpu_heads,
            cpu_heads,
            predicted_seconds,
        }
    }
}

/// How many calls ran on which plan (see [`Engine::plan_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Every head on the CPU.
    pub cpu: u64,
    /// Every head on the GPU.
    pub gpu: u64,
    /// Heads on both sides.
    pub split: u64,
    /// Nanoseconds these calls spent in the scheduler, outside the backends' dispatch:
    /// the calibration check, the work count, the choice, the bookkeeping and learning
    /// (for an ACP prefill, also the boundary the kernels then reuse; for the first call,
    /// the calibration).
    pub scheduler_ns: u64,
}

/// What the scheduler may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Every head on the GPU (the `vulkan` backend, with CPU fallback on device loss).
    GpuOnly,
    /// At least one head on each side when there are two or more heads.
    Hybrid,
    /// Whatever the cost model predicts fastest: all CPU, all GPU or a split.
    Auto,
}

/// Prior for a split's measured/predicted time before `auto` has run one of its size class:
/// the sides' contention is measured on one split at calibration ([`Contention`]), and a
/// class's splits still miss it (on the H100 host, before it was costed, splits predicted
/// 10-30% faster ran up to 2x slower; with it, a decode split's CPU side still ran at a
/// median 1.85x its costed time, trace 440).
const SPLIT_PRIOR: f64 = 1.0 / 0.7;

/// A prefill split must be predicted this much faster than the best whole plan before
/// `auto` runs it (its prediction is multiplied by this when plans are compared, not when
/// it is learned from). Since a split reads and writes the call's tensors in place, its
/// own cost is a pool hand-off (10-13 us on the H100 host), so the model without
/// [`Contention`] saw splits of a 16-head 1K prefill as 10-30% faster than the GPU alone;
/// measured, they ran 0-7% slower than the GPU (runs 350-355). Below this margin the gain
/// is within what the model misses, and trying splits cost `auto` 3-5% (plans switching
/// on near ties).
const SPLIT_MARGIN_PREFILL: f64 = 1.1;

/// `auto` tries a plan it has not run in a size class when its corrected prediction is
/// within this factor of the winner's, and re-checks one sampled once within it when the
/// probe budget allows ([`feedback`]).
const EXPLORE: f64 = 1.25;

/// [`EXPLORE`] for decode: a step is cheap and a session runs many, while the decode model
/// extrapolates from synthetic steps (its CPU/GPU crossover was off by 2-3x on the H100 host).
const EXPLORE_DECODE: f64 = 2.5;

/// [`EXPLORE_DECODE`] while the decode costs come from a busy host (their CPU share below
/// [`share::BUSY_SHARE`]): every plan gets its first try in a class, whatever its prediction.
/// Such costs price the CPU 20-60x too high, and a plan priced out of reach is never run to
/// correct them (on the H100 host, while the re-measure waited for a quiet host, `auto` ran
/// 1918-2440 of a dense 1k cell's steps on the GPU at 0.35 ms while the CPU took 0.14-0.16:
/// traces 211 and 213). A first try is two steps.
const EXPLORE_BUSY_DECODE: f64 = 1e12;

/// One head's work in a call: kept query-key pairs, rows the CPU reads (tokens or cache
/// entries), rows the GPU must be sent (all of them, but only the changed ones of a decode
/// head resident on the device).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Work {
    pairs: u64,
    rows: u64,
    gpu_rows: u64,
}

impl std::ops::Add for Work {
    type Output = Work;
    fn add(self, o: Work) -> Work {
        Work {
            pairs: self.pairs + o.pairs,
            rows: self.rows + o.rows,
            gpu_rows: self.gpu_rows + o.gpu_rows,
        }
    }
}

impl std::ops::Sub for Work {
    type Output = Work;
    fn sub(self, o: Work) -> Work {
        Work {
            pairs: self.pairs - o.pairs,
            rows: self.rows - o.rows,
            gpu_rows: self.gpu_rows - o.gpu_rows,
        }
    }
}

/// Plan kinds, for the measured corrections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PlanKind {
    Cpu = 0,
    Gpu = 1,
    Split = 2,
}

/// Predicted seconds of every plan: all CPU, all GPU, and the best split found (its GPU
/// heads). Raw model times, before corrections.
#[derive(Debug, Clone, PartialEq)]
struct Candidates {
    cpu: f64,
    gpu: f64,
    split: Option<(f64, Vec<usize>)>,
    /// The split's (CPU side, GPU side) by the model alone (no side factors, no split
    /// cost): what its measured sides are divided by ([`ClassRecord::record_sides`]).
    split_sides: (f64, f64),
}

/// Seconds of a plan whose CPU side takes `cpu` and GPU side `gpu`: the longer where
/// they run at once (`concurrent`), their sum on shared cores.
fn both_sides(cpu: f64, gpu: f64, concurrent: bool) -> f64 {
    if concurrent { cpu.max(gpu) } else { cpu + gpu }
}

/// A split's cost with `gpu_heads` GPU heads, raw sides `(cpu, gpu)` and `fixed` seconds, at
/// its head count's side factors as they stand in `rec`: what a split's call time is taken
/// over for its factor ([`ClassRecord::record_judged`]). None before its sides are measured.
fn recosted_split(
    rec: &ClassRecord,
    gpu_heads: usize,
    (cpu, gpu): (f64, f64),
    fixed: f64,
    concurrent: bool,
) -> Option<f64> {
    let (fc, fg) = rec.side_factors(gpu_heads)?;
    Some(fixed + both_sides(fc * cpu, fg * gpu, concurrent))
}

/// Folds a split call's measured sides `(c, g)` (seconds; `raw`: their raw predictions)
/// into `rec` at `gpu_heads` GPU heads, and returns the seconds the split's factor is taken
/// from: the call's `secs`, less what its CPU side took on its critical path beyond its
/// settled factor when the call is a probe's sample ([`ClassRecord::settled_cpu_side`];
/// that side is recorded at the settled factor too). Call it after the call's
/// [`ClassRecord::spanned`] and before its [`ClassRecord::record_judged`].
fn fold_split_sides(
    rec: &mut ClassRecord,
    gpu_heads: usize,
    raw: (f64, f64),
    (c, g): (f64, f64),
    (secs, probe): (f64, bool),
    concurrent: bool,
) -> f64 {
    let (mut rc, rg) = (c / raw.0, g / raw.1);
    let mut judged = secs;
    if let Some(fc) = rec
        .settled_cpu_side(gpu_heads, probe)
        .filter(|&fc| rc.is_finite() && rc > fc)
    {
        let settled = fc * raw.0;
        judged -= both_sides(c, g, concurrent) - both_sides(settled, g, concurrent);
        rc = fc;
    }
    rec.record_sides(gpu_heads, rc, rg);
    judged
}

/// The model's terms for costing the plans of one call: `work` per head, CPU
/// `cpu.predict(pairs, rows)`, GPU `gpu.predict(pairs, gpu_rows)`, combined by `max` when
/// they run concurrently (a real GPU) or `+` on shared cores (lavapipe), plus `split_cost`
/// seconds for a split ([`Calibration::split_fixed`]); a split's sides are first costed as
/// they slow each other (`contention`, [`Contention::sides`]).
///
/// `side(k)` = (CPU, GPU) factors of the two sides of a split with `k` GPU heads
/// ([`split_side_factors`]): the sides are costed with them, so the heads are divided by
/// what each side was seen to take (the all-GPU plan of an ACP decode ran 5x its model on
/// the H100, and one split factor over 1- and 11-head splits could not express that). The
/// split's own factor is its wall time over its cost at its head count's side factors as
/// they stand after the call ([`ClassRecord::record_judged`]): what costing the sides by
/// their factors misses (the merge, the fixed cost's error, the slower of two noisy
/// sides), whatever head count it was measured at.
struct Costing<'w, S> {
    work: &'w [Work],
    total: Work,
    cpu: LinearCost,
    gpu: LinearCost,
    side: S,
    concurrent: bool,
    split_cost: f64,
    contention: Contention,
}

impl<'w, S: Fn(usize) -> (f64, f64)> Costing<'w, S> {
    fn new(
        work: &'w [Work],
        cpu: LinearCost,
        gpu: LinearCost,
        side: S,
        concurrent: bool,
        split_cost: f64,
    ) -> Self {
        Costing {
            work,
            total: work.iter().fold(Work::default(), |a, &w| a + w),
            cpu,
            gpu,
            side,
            concurrent,
            split_cost,
            contention: Contention::NONE,
        }
    }

    /// Costs a split's sides as they slow each other ([`Contention`]).
    fn contended(self, contention: Contention) -> Self {
        Costing { contention, ..self }
    }

    /// (seconds, raw CPU side, raw GPU side) of the plan that sends `g_heads` heads doing
    /// `g` to the GPU and the rest to the CPU.
    fn cost(&self, g: Work, g_heads: usize) -> (f64, f64, f64) {
        let n = self.work.len();
        let split = g_heads != 0 && g_heads != n;
        let (extra, fc, fg) = if split {
            let (fc, fg) = (self.side)(g_heads);
            (self.split_cost, fc, fg)
        } else {
            (0.0, 1.0, 1.0)
        };
        let c = self.total - g;
        let (tc, tg) = (
            self.cpu.predict(c.pairs, c.rows, g_heads == n),
            self.gpu.predict(g.pairs, g.gpu_rows, g_heads == 0),
        );
        let (tc, tg) = if split {
            self.contention.sides(tc, tg)
        } else {
            (tc, tg)
        };
        (
            extra + both_sides(fc * tc, fg * tg, self.concurrent),
            tc,
            tg,
        )
    }

    /// The candidates with `split` (its GPU heads) as the split, costed for this work.
    fn with_split(&self, split: Option<&[usize]>) -> Candidates {
        let split = split.map(|heads| {
            let g = heads.iter().fold(Work::default(), |a, &h| a + self.work[h]);
            (self.cost(g, heads.len()), heads.to_vec())
        });
        Candidates {
            cpu: self.cost(Work::default(), 0).0,
            gpu: self.cost(self.total, self.work.len()).0,
            split_sides: split.as_ref().map_or((0.0, 0.0), |((_, c, g), _)| (*c, *g)),
            split: split.map(|((t, _, _), heads)| (t, heads)),
        }
    }

    /// Every plan's prediction; split candidates: every prefix of the heads sorted heaviest
    /// first, lightest first and densest (pairs per GPU row) first, the fastest kept.
    fn search(&self) -> Candidates {
        let work = self.work;
        let n = work.len();
        // Ties in head order, so every order is deterministic.
        let mut desc: Vec<usize> = (0..n).collect();
        desc.sort_unstable_by_key(|&h| (std::cmp::Reverse(work[h].pairs), h));
        let asc: Vec<usize> = desc.iter().rev().copied().collect();
        let density: Vec<f64> = work
            .iter()
            .map(|w| w.pairs as f64 / w.gpu_rows.max(1) as f64)
            .collect();
        let mut dense: Vec<usize> = (0..n).collect();
        dense.sort_unstable_by(|&x, &y| density[y].total_cmp(&density[x]).then(x.cmp(&y)));
        // (seconds, order, GPU heads): the best prefix of the three orders. The
        // densest-first order is the heaviest-first one when every head sends as many rows
        // (a resident decode's steady state): it is searched once.
        let mut best: Option<(f64, &[usize], usize)> = None;
        let orders: &[&Vec<usize>] = if dense == desc {
            &[&desc, &asc]
        } else {
            &[&desc, &asc, &dense]
        };
        for &order in orders {
            let mut g = Work::default();
            for k in 1..n {
                g = g + work[order[k - 1]];
                let t = self.cost(g, k).0;
                if best.is_none_or(|b| t < b.0) {
                    best = Some((t, order, k));
                }
            }
        }
        self.with_split(best.map(|(_, order, k)| &order[..k]))
    }
}

/// Predicted seconds of every plan for `work` (see [`Costing`], [`Costing::search`]).
#[cfg(test)]
fn candidates(
    work: &[Work],
    cpu: LinearCost,
    gpu: LinearCost,
    side: impl Fn(usize) -> (f64, f64),
    concurrent: bool,
    split_cost: f64,
) -> Candidates {
    Costing::new(work, cpu, gpu, side, concurrent, split_cost).search()
}

/// The (CPU, GPU) factors the sides of a split with `gpu_heads` GPU heads are costed with
/// in `rec`'s class: the split's own measured sides ([`ClassRecord::side_factors`]) once
/// it has run warm; before that the prospects of the all-CPU and all-GPU plans (see
/// [`feedback::LONG_WINDOW`]; 1 where not measured). Prospects, not factors: a factor
/// moves with a burst of a few calls, and the split's heads with it (a decode ACP 16k class
/// of the H100 host ran 1- to 15-head splits from call to call).
fn split_side_factors(rec: &ClassRecord, gpu_heads: usize) -> (f64, f64) {
    rec.side_factors(gpu_heads).unwrap_or((
        rec.prospect(PlanKind::Cpu).unwrap_or(1.0),
        rec.prospect(PlanKind::Gpu).unwrap_or(1.0),
    ))
}

/// Heads on the GPU under `mode`: `GpuOnly` all; `Hybrid` the best split (at least one
/// head per side when there are two or more); `Auto` what `rec` picks among the three plans
/// from their raw predictions (see [`feedback`]: measured corrections, [`SPLIT_PRIOR`] for a
/// split not yet run, probes within `explore`). Returns the split, with the model's
/// (uncorrected) prediction of it, and the pick.
///
/// `catch_up_s`: what a GPU step's catch-up takes beyond its prediction, all heads (the
/// all-GPU plan's; a split's in proportion to its GPU heads): a probe pays it.
/// `split_margin`: multiplies the split's prediction where `auto` compares the plans
/// ([`SPLIT_MARGIN_PREFILL`]).
fn plan(
    n: usize,
    c: &Candidates,
    mode: Mode,
    rec: &ClassRecord,
    explore: f64,
    catch_up_s: f64,
    split_margin: f64,
) -> (Split, Pick) {
    let split_of = |gpu_heads: &[usize], predicted_seconds: f64| {
        let mut gpu_heads = gpu_heads.to_vec();
        gpu_heads.sort_unstable();
        let cpu_heads = (0..n)
            .filter(|h| gpu_heads.binary_search(h).is_err())
            .collect();
        Split {
            gpu_heads,
            cpu_heads,
            predicted_seconds,
        }
    };
    let fixed = |kind| Pick {
        kind,
        reason: Reason::Best,
        best_s: 0.0,
        catch_up_s: 0.0,
        margin: 0.0,
        whole_margin: 0.0,
    };
    let pick = match mode {
        Mode::GpuOnly => fixed(PlanKind::Gpu),
        Mode::Hybrid if c.split.is_some() => fixed(PlanKind::Split),
        Mode::Hybrid => fixed(PlanKind::Cpu),
        Mode::Auto => {
            let mut raw = vec![(c.cpu, PlanKind::Cpu), (c.gpu, PlanKind::Gpu)];
            if let Some((t, _)) = &c.split {
                raw.push((*t * split_margin, PlanKind::Split));
            }
            let prior = |k: PlanKind| {
                if k == PlanKind::Split {
                    SPLIT_PRIOR
                } else {
                    1.0
                }
            };
            let split_share = c
                .split
                .as_ref()
                .map_or(0.0, |(_, g)| g.len() as f64 / n.max(1) as f64);
            let catch_up = |k: PlanKind| match k {
                PlanKind::Cpu => 0.0,
                PlanKind::Gpu => catch_up_s,
                PlanKind::Split => catch_up_s * split_share,
            };
            rec.pick_paying(&raw, prior, explore, catch_up)
        }
    };
    let split = match (pick.kind, &c.split) {
        (PlanKind::Gpu, _) => Split::whole(n, true, c.gpu),
        (PlanKind::Split, Some((ts, g))) => split_of(g, *ts),
        _ => Split::whole(n, false, c.cpu),
    };
    (split, pick)
}

/// Kept pairs per head of a prefill call, from the same boundary the kernels use
/// (`start_blocks` + `count_pairs` over `BLOCK`-token blocks, threshold from core).
/// Also returns each head's start blocks (`[heads, q_blocks]`) and threshold.
pub(crate) fn prefill_boundary(call: &PrefillCall<'_>) -> Result<PrefillBoundary> {
    use rayon::prelude::*;
    let (t, nh) = (call.t, call.heads);
    let grid = BlockGrid::new(BLOCK, BLOCK, t, t).map_err(core_err)?;
    let nqb = grid.q_blocks();
    let mut pb = PrefillBoundary {
        block: BLOCK,
        q_blocks: nqb,
        start_blocks: vec![0; nh * nqb],
        kept_pairs: vec![0; nh],
        total_pairs: vec![0; nh],
        delta: vec![None; nh],
        c: vec![0.0; nh * t],
    };
    // `auto` and the split run this before every prefill they plan (the CPU plan and both
    // sides of a split then reuse it through `PrefillCall::decided`). A small call is
    // decided on this thread, every head's `c` in one pass over the gate rows; a large one
    // head by head on the pool (`foxedge_cpu::SERIAL_DECISIONS`).
    let heavy = matches!(call.acp, Acp::ObservedNorms { .. });
    let serial = !heavy && t * nh <= foxedge_cpu::SERIAL_DECISIONS;
    if serial {
        gate::cumsum_rows(call.log_f, nh, 0.0, &mut pb.c).map_err(core_err)?;
    } else {
        gate::validate_log_gates(call.log_f.get(..t * nh).unwrap_or(call.log_f))
            .map_err(core_err)?;
    }
    let one = |(h, (c, st)): (usize, (&mut [f64], &mut [u32]))| {
        if !serial {
            gate::cumsum_strided(&call.log_f[h..], nh, 0.0, c).map_err(core_err)?;
        }
        let delta = head_boundary(call, &grid, h, c, st)?;
        Ok::<_, Error>((delta, boundary::count_pairs(&grid, st, 0)))
    };
    let heads: Vec<_> = if serial {
        let parts =
            pb.c.chunks_mut(t.max(1))
                .zip(pb.start_blocks.chunks_mut(nqb.max(1)));
        parts.enumerate().map(one).collect()
    } else {
        let parts = (pb.c.par_chunks_mut(t.max(1))).zip(pb.start_blocks.par_chunks_mut(nqb.max(1)));
        parts.enumerate().map(one).collect()
    };
    for (h, r) in heads.into_iter().enumerate() {
        let (delta, pc) = r?;
        (pb.delta[h], pb.kept_pairs[h], pb.total_pairs[h]) = (delta, pc.kept_pairs, pc.total_pairs);
    }
    Ok(pb)
}

/// Per head of a prefill of `t` tokens: its work under the boundary `b`.
fn prefill_work(b: &PrefillBoundary, t: usize) -> Vec<Work> {
    b.kept_pairs
        .iter()
        .map(|&pairs| Work {
            pairs,
            rows: t as u64,
            gpu_rows: t as u64,
        })
        .collect()
}

/// Head `h` of [`prefill_boundary`]: its start blocks from its `c` (formed already); returns
/// its threshold.
fn head_boundary(
    call: &PrefillCall<'_>,
    grid: &BlockGrid,
    h: usize,
    c: &[f64],
    st: &mut [u32],
) -> Result<Option<f64>> {
    let (t, nh, d) = (call.t, call.heads, call.head_dim);
    let delta = match call.acp {
        Acp::Off => None,
        Acp::Bound { u, ln_eps } => {
            let uh = *u
                .get(h)
                .ok_or_else(|| Error::invalid("ACP bound: one U per head"))?;
            Some(threshold::threshold(uh, t, ln_eps).map_err(core_err)?)
        }
        Acp::ObservedNorms { ln_eps } => {
            let norm = |x: &[f32], r: usize| {
                let row = &x[(r * nh + h) * d..][..d];
                row.iter()
                    .map(|v| f64::from(*v) * f64::from(*v))
                    .sum::<f64>()
                    .sqrt()
            };
            let (mut qn, mut kn) = (0.0f64, 0.0f64);
            for r in 0..t {
                qn = qn.max(norm(call.q, r));
                kn = kn.max(norm(call.k, r));
            }
            let scale = 1.0 / (d as f64).sqrt();
            let u = threshold::bound_from_norms(qn, kn, scale).map_err(core_err)?;
            Some(threshold::threshold(u, t, ln_eps).map_err(core_err)?)
        }
    };
    boundary::start_blocks(grid, c, delta, 0, st).map_err(core_err)?;
    Ok(delta)
}

/// The ACP boundary of one prefill call (see [`prefill_boundary`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PrefillBoundary {
    /// Tile size (tokens, queries and keys) the decisions are for: [`BLOCK`].
    pub block: usize,
    pub q_blocks: usize,
    /// `[heads, q_blocks]`: first visited key block of each query block.
    pub start_blocks: Vec<u32>,
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
    pub delta: Vec<Option<f64>>,
    /// `[heads, t]`: cumulative log gates `c_i`.
    pub c: Vec<f64>,
}

/// Kept (query, entry) pairs of head `h` of a decode call: entries in `BLOCK`-entry blocks
/// (slot order, as the kernels split them) where some query has `c_t - c_j >= delta`.
fn decode_kept(call: &DecodeCall<'_>, h: usize) -> Result<u64> {
    let nq = call.n_queries;
    let head = call
        .heads
        .get(h)
        .ok_or_else(|| Error::Internal("decode_kept: no such head".into()))?;
    let n = head.c.len();
    let qc = call
        .q_c
        .get(h * nq..(h + 1) * nq)
        .ok_or_else(|| Error::invalid("decode: q_c holds [heads, n_queries] values"))?;
    let delta = match call.acp {
        Acp::Bound { u, ln_eps } if n > 0 => {
            let uh = *u
                .get(h)
                .ok_or_else(|| Error::invalid("ACP bound: one U per head"))?;
            Some(threshold::threshold(uh, n, ln_eps).map_err(core_err)?)
        }
        _ => None,
    };
    let kept = match delta {
        None => n,
        Some(delta) => {
            let cmax = qc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            head.c
                .chunks(BLOCK)
                .filter(|blk| {
                    let cmin = blk.iter().copied().fold(f64::INFINITY, f64::min);
                    cmax - cmin >= delta
                })
                .map(<[f64]>::len)
                .sum()
        }
    };
    Ok(kept as u64 * nq as u64)
}

/// [`decode_kept`] of every head, heads in parallel.
fn decode_work(call: &DecodeCall<'_>) -> Result<Vec<u64>> {
    use rayon::prelude::*;
    (0..call.heads.len())
        .into_par_iter()
        .map(|h| decode_kept(call, h))
        .collect()
}

fn core_err(e: foxedge_core::Error) -> Error {
    Error::invalid(format!("attention input: {e}"))
}

/// A map keyed by the scheduler's own small keys (cache ids, size classes), looked up per
/// head at every call: hashed by [`IdHasher`], not SipHash (no untrusted keys here; SipHash
/// was 8% of `auto`'s per-call time on the dev machine).
type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// A multiply-rotate hasher for integer keys: each word is folded in as
/// `h = (h.rotl(5) ^ w) * K` with `K` odd (a bijection per word), the top bits mixed down
/// at the end.
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl IdHasher {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;

    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(Self::K);
    }
}

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
    }
    fn write_u8(&mut self, x: u8) {
        self.add(u64::from(x));
    }
    fn write_u32(&mut self, x: u32) {
        self.add(u64::from(x));
    }
    fn write_u64(&mut self, x: u64) {
        self.add(x);
    }
    fn write_usize(&mut self, x: usize) {
        self.add(x as u64);
    }
}

/// Process-wide calibrations, keyed by (device, heads, head_dim).
type CalibrationCache = Mutex<HashMap<(String, usize, usize), Calibration>>;

fn calibration_cache() -> &'static CalibrationCache {
    static CACHE: OnceLock<CalibrationCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift64*), for calibration inputs.
fn fill_random(x: &mut [f32], seed: u64) {
    let mut s = seed | 1;
    for v in x {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
        *v = ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    }
}

/// Minimum seconds of the runs of `f` after one untimed warm-up: at least one, then more
/// while the timed runs total under [`TIME_MIN_SECS`], at most [`TIME_MIN_RUNS`]. Slow
/// devices (lavapipe) keep the calibration short with one run; a call whose warm-up is
/// slow but whose runs are fast (a resident decode step, after the whole cache's first
/// send) still takes the minimum of several: on a fresh H100 host one run after a 65 ms
/// first send read 1.96 ms for a step that run 51 put at 0.26 ms, and
/// with that as the GPU's fixed cost `auto` never tried the GPU at decode 16k (0.45x).
fn time_min(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    let mut total = 0.0;
    for _ in 0..TIME_MIN_RUNS {
        let t0 = Instant::now();
        f()?;
        let secs = t0.elapsed().as_secs_f64();
        best = best.min(secs);
        total += secs;
        if total > TIME_MIN_SECS {
            break;
        }
    }
    Ok(best)
}

/// Timed seconds after which [`time_min`] stops adding runs.
const TIME_MIN_SECS: f64 = 0.05;

/// Most timed runs of one [`time_min`].
const TIME_MIN_RUNS: usize = 5;

/// Synthetic prefill inputs: q, k, v uniform from a seed, every log gate `log_f`, every
/// logit bound 1.
struct SyntheticPrefill {
    t: usize,
    heads: usize,
    d: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    log_f: Vec<f32>,
    u: Vec<f64>,
}

impl SyntheticPrefill {
    fn new(t: usize, heads: usize, d: usize, seed: u64, log_f: f32) -> SyntheticPrefill {
        let mut x = [(); 3].map(|_| vec![0.0f32; t * heads * d]);
        for (i, x) in x.iter_mut().enumerate() {
            fill_random(x, seed + 10 * i as u64);
        }
        let [q, k, v] = x;
        SyntheticPrefill {
            t,
            heads,
            d,
            q,
            k,
            v,
            log_f: vec![log_f; t * heads],
            u: vec![1.0; heads],
        }
    }

    /// The call over these inputs, pruned under ACP (`ln eps = -10`) or dense.
    fn call(&self, pruned: bool) -> PrefillCall<'_> {
        PrefillCall {
            t: self.t,
            heads: self.heads,
            head_dim: self.d,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            log_f: &self.log_f,
            decided: None,
            only: None,
            acp: if pruned {
                Acp::Bound {
                    u: &self.u,
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
        }
    }
}

/// One prefill of `t` tokens on synthetic data: dense (`pruned = false`) or with strong
/// gates under ACP so that little more than the diagonal blocks are kept.
fn prefill_sample(
    b: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    t: usize,
    pruned: bool,
) -> Result<Sample> {
    let x = SyntheticPrefill::new(t, heads, d, 1 + t as u64, if pruned { -1.0 } else { -0.01 });
    let call = x.call(pruned);
    let pairs = prefill_boundary(&call)?.kept_pairs.iter().sum();
    let mut out = vec![0.0f32; x.q.len()];
    let secs = time_min(|| b.prefill(&call, &mut out).map(|_| ()))?;
    Ok(Sample {
        pairs,
        rows: (t * heads) as u64,
        secs,
    })
}

/// Dense prefills of 64, 256, 1024, 4096 tokens (stopping after two sizes once one takes
/// over 20 ms: the fit uses the two largest, nearest the lengths that matter), then a pruned
/// one at the last size.
fn calibrate_prefill(b: &dyn AttentionBackend, heads: usize, d: usize) -> Result<LinearCost> {
    let mut dense: Vec<(usize, Sample)> = Vec::new();
    for t in [64usize, 256, 1024, 4096] {
        let smp = prefill_sample(b, heads, d, t, false)?;
        dense.push((t, smp));
        if dense.len() >= 2 && smp.secs > 0.02 {
            break;
        }
    }
    let n = dense.len();
    let (d1, (t2, d2)) = (dense[n - 2].1, dense[n - 1]);
    let p = prefill_sample(b, heads, d, t2, true)?;
    Ok(LinearCost::fit(d1, d2, p))
}

/// `count` fresh [`CacheSync::id`]s for caches this module makes (calibration data,
/// [`DecodeProblem`]s). Sessions number their heads from 1 up; these start at 2^62 so the
/// two never meet.
fn fresh_cache_ids(count: usize) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1 << 62);
    NEXT.fetch_add(count as u64, Ordering::Relaxed)
}

/// Version bookkeeping of a cache that stands still between decode steps except that each
/// step rewrites one row, as a session's step writes its token's key. Row `j` was written at
/// version `j + 1`; step `s` (1, 2, ...) rewrites row `n - 1 - (s - 1) mod n` at version
/// `n + s`: a different row each step (newest first, cycling), so the rows written since any
/// version are as many as the steps since (up to `n`), as in a session whose steps append
/// (what the scheduler's model of rows to send assumes; rewriting one row over and over would
/// make it over-count). Every head shares the rows' versions; ids are `base + head`.
#[derive(Debug)]
struct StepSync {
    heads: usize,
    base: u64,
    version: u64,
    row_version: Vec<u64>,
    /// The steps' writes, as a session journals its heads'.
    journal: WriteJournal,
}

impl StepSync {
    fn new(heads: usize, n: usize) -> StepSync {
        StepSync {
            heads,
            base: fresh_cache_ids(heads),
            version: n as u64,
            row_version: (1..=n as u64).collect(),
            journal: {
                let mut j = WriteJournal::default();
                j.rewrote_all(n as u64);
                j
            },
        }
    }

    /// The next step: the next row (see the type docs) gets a fresh version.
    fn step(&mut self) {
        let n = self.row_version.len() as u64;
        if n == 0 {
            return;
        }
        let s = self.version - n;
        self.version += 1;
        let row = (n - 1 - s % n) as usize;
        self.row_version[row] = self.version;
        self.journal.wrote(row, self.version, n as usize);
    }

    fn sync(&self, head: usize) -> CacheSync<'_> {
        CacheSync {
            id: self.base + head as u64,
            version: self.version,
            row_version: &self.row_version,
            journal: Some(self.journal.view()),
        }
    }
}

/// One decode step over `n` synthetic entries per head, dense or with strong decay under
/// ACP (most blocks pruned). `resident`: the heads carry [`CacheSync`] and every timed step
/// changes one row per head (a session's steady state; the warm-up step sends the whole
/// cache to a device that mirrors it), so `rows` = `heads`; else `rows` = `n · heads`.
fn decode_sample(
    b: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    n: usize,
    pruned: bool,
    resident: bool,
) -> Result<Sample> {
    let rate = if pruned { 1.0 } else { 0.01 };
    let x = SyntheticCache::new(n, heads, d, (31 + n as u64, 51), rate);
    let base = x.heads(0..heads, None);
    let pairs = decode_work(&x.call(0..heads, &base, pruned))?.iter().sum();
    let mut sync = StepSync::new(heads, n);
    let mut out = vec![0.0f32; heads * d];
    let secs = time_min(|| {
        sync.step();
        let hs = x.heads(0..heads, resident.then_some(&sync));
        b.decode(&x.call(0..heads, &hs, pruned), &mut out)
            .map(|_| ())
    })?;
    if resident {
        b.release_cache(&(0..heads as u64).map(|h| sync.base + h).collect::<Vec<_>>());
    }
    Ok(Sample {
        pairs,
        rows: if resident { heads } else { n * heads } as u64,
        secs,
    })
}

/// A synthetic decode step: one cache of `n` entries that every head reads (k, v uniform
/// from a seed, `c` falling by `rate` an entry), one query per head at the last entry,
/// every logit bound 1.
struct SyntheticCache {
    d: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    c: Vec<f64>,
    q: Vec<f32>,
    q_c: Vec<f64>,
    u: Vec<f64>,
}

impl SyntheticCache {
    /// `(kv_seed, q_seed)`: k from `kv_seed`, v from `kv_seed + 10`, q from `q_seed`.
    fn new(n: usize, heads: usize, d: usize, (kv_seed, q_seed): (u64, u64), rate: f64) -> Self {
        let mut k = vec![0.0f32; n * d];
        let mut v = k.clone();
        fill_random(&mut k, kv_seed);
        fill_random(&mut v, kv_seed + 10);
        let c: Vec<f64> = (0..n).map(|j| -rate * j as f64).collect();
        let mut q = vec![0.0f32; heads * d];
        fill_random(&mut q, q_seed);
        let q_c = vec![c.last().copied().unwrap_or(0.0); heads];
        SyntheticCache {
            d,
            k,
            v,
            c,
            q,
            q_c,
            u: vec![1.0; heads],
        }
    }

    /// Heads `range` of the step, with `sync`'s versions where given.
    fn heads<'a>(
        &'a self,
        range: std::ops::Range<usize>,
        sync: Option<&'a StepSync>,
    ) -> Vec<CacheHead<'a>> {
        range
            .map(|h| CacheHead {
                k: &self.k,
                v: &self.v,
                c: &self.c,
                pos: None,
                sync: sync.map(|s| s.sync(h)),
            })
            .collect()
    }

    /// The step of heads `range` ([`Self::heads`] of it), pruned under ACP (`ln eps =
    /// -10`) or dense.
    fn call<'a>(
        &'a self,
        range: std::ops::Range<usize>,
        heads: &'a [CacheHead<'a>],
        pruned: bool,
    ) -> DecodeCall<'a> {
        DecodeCall {
            head_dim: self.d,
            n_queries: 1,
            q: &self.q[range.start * self.d..range.end * self.d],
            q_c: &self.q_c[range.clone()],
            q_pos: None,
            heads,
            acp: if pruned {
                Acp::Bound {
                    u: &self.u[range],
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
        }
    }
}

/// Decode steps over 1024 and 16384 entries per head, dense, and 16384 pruned (whole
/// sends). `resident` (a GPU): also resident dense steps (one changed row per head) over
/// 4096 and 16384 entries; when the 4096 one runs in < 0.7x a whole send of 4096 the device keeps
/// caches resident (`Ok((cost, true))`): `b` is the slope between the two resident steps
/// (a GPU step is latency-bound below a few thousand entries per head, so the slope is taken
/// where the kernel reads enough to show it), `c` = seconds per row sent (whole minus
/// resident 4096 step over the rows between), `a` the rest. Else the plain fit.
///
/// [`DecodeFit::Resident`] (a re-measure of a device known to keep caches resident) takes
/// the resident samples alone: the whole sends of 16384 entries are what make a GPU decode
/// calibration long (on the H100 host a re-measure with them stalled its decode step
/// 1.1-1.4 s, traces 209-210; without them 340-646 ms, traces 211-213).
fn calibrate_decode(
    b: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    fit: DecodeFit,
) -> Result<(LinearCost, bool)> {
    let whole = || -> Result<LinearCost> {
        // 16384 entries: below that a 16-head step is dominated by fixed costs (thread
        // wake-up, submission) and the pruned/dense difference that gives `b` drowns in noise.
        let d1 = decode_sample(b, heads, d, 1024, false, false)?;
        let d2 = decode_sample(b, heads, d, 16384, false, false)?;
        let p = decode_sample(b, heads, d, 16384, true, false)?;
        Ok(LinearCost::fit(d1, d2, p))
    };
    if fit == DecodeFit::Whole {
        return Ok((whole()?, false));
    }
    let r1 = decode_sample(b, heads, d, 4096, false, true)?;
    let d4 = decode_sample(b, heads, d, 4096, false, false)?;
    if fit == DecodeFit::TryResident && r1.secs >= 0.7 * d4.secs {
        return Ok((whole()?, false));
    }
    let r2 = decode_sample(b, heads, d, 16384, false, true)?;
    let bb = ((r2.secs - r1.secs) / r2.pairs.saturating_sub(r1.pairs).max(1) as f64).max(0.0);
    let c = ((d4.secs - r1.secs) / d4.rows.saturating_sub(r1.rows).max(1) as f64).max(0.0);
    let a = (r1.secs - bb * r1.pairs as f64 - c * r1.rows as f64).max(0.0);
    Ok((LinearCost { a, b: bb, c }, true))
}

/// Which decode samples [`calibrate_decode`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeFit {
    /// Whole sends only (the CPU; a GPU known not to keep caches resident).
    Whole,
    /// Whole sends, and resident steps to find out whether the device keeps caches.
    TryResident,
    /// Resident steps only: the device is known to keep caches (a re-measure).
    Resident,
}

/// Runs the GPU's kinds of call once each, small (64 tokens), untimed: what an engine whose
/// calibration came from another engine's (the process-wide cache) does instead of its own
/// calibration's runs. Each device context compiles its pipelines on first use; on the H100
/// host that took 128-192 ms at a decode step's first use and 254-397 ms at a prefill's
/// (`FOXEDGE_VULKAN_PROFILE=1`), and `auto`'s first GPU step in a session whose calibration
/// was cached took 224 ms against 0.44 for the next (trace 141): a stall in the middle of a
/// stream, moved here to the session's start.
fn warm_gpu(gpu: &dyn AttentionBackend, heads: usize, d: usize, resident: bool) -> Result<()> {
    for pruned in [false, true] {
        prefill_sample(gpu, heads, d, 64, pruned)?;
        decode_sample(gpu, heads, d, 64, pruned, resident)?;
    }
    Ok(())
}

/// One kind of call's costs on both backends (see [`calibrate_kind`]).
#[derive(Debug, Clone, Copy)]
struct KindCosts {
    cpu: LinearCost,
    gpu: LinearCost,
    /// Decode: the GPU keeps caches resident (its `c` is per row sent).
    resident: bool,
    /// The CPU share around the samples.
    share: Option<f64>,
}

/// Both backends' costs of decode (`decode`) or prefill, and the CPU pool's share: the
/// lower of [`share::probe`]'s before and after the samples (None where unknown). The
/// GPU's fixed and per-row costs are host work too (packing, uploads, submission): on the
/// H100 host calibrations beside 20 spinning processes priced a GPU prefill at 0.7-3.1 us
/// a row (14 of runs 160-177) against 51 ns quiet (run 150). `probed`: the probe before, if
/// already taken. `again`: a re-measure of these kept costs; a GPU known to keep decode
/// caches resident takes its resident samples only ([`DecodeFit::Resident`]), and with
/// `true` (CPU only) the GPU's costs are kept as they are.
fn calibrate_kind(
    cpu: &dyn AttentionBackend,
    gpu: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    decode: bool,
    probed: Option<Option<f64>>,
    again: Option<(&KindCosts, bool)>,
) -> Result<KindCosts> {
    let before = probed.unwrap_or_else(share::probe);
    let (gpu_cost, resident) = match again {
        Some((kept, true)) => (kept.gpu, kept.resident),
        Some((kept, false)) if decode && kept.resident => {
            calibrate_decode(gpu, heads, d, DecodeFit::Resident)?
        }
        _ if decode => calibrate_decode(gpu, heads, d, DecodeFit::TryResident)?,
        _ => (calibrate_prefill(gpu, heads, d)?, false),
    };
    let cpu_cost = if decode {
        calibrate_decode(cpu, heads, d, DecodeFit::Whole)?.0
    } else {
        calibrate_prefill(cpu, heads, d)?
    };
    let after = share::probe();
    Ok(KindCosts {
        cpu: cpu_cost,
        gpu: gpu_cost,
        resident,
        share: before
            .zip(after)
            .map(|(a, b)| a.min(b))
            .or(before)
            .or(after),
    })
}

/// Measures both backends on synthetic calls of `heads` heads of `d` dims.
fn calibrate(
    cpu: &dyn AttentionBackend,
    gpu: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    concurrent: bool,
) -> Result<Calibration> {
    let t0 = Instant::now();
    let split_fixed = calibrate_split()?;
    let dec = calibrate_kind(cpu, gpu, heads, d, true, None, None)?;
    let pre = calibrate_kind(cpu, gpu, heads, d, false, None, None)?;
    Ok(Calibration {
        cpu_prefill: pre.cpu,
        gpu_prefill: pre.gpu,
        cpu_decode: dec.cpu,
        gpu_decode: dec.gpu,
        gpu_decode_resident: dec.resident,
        concurrent,
        split_fixed,
        split_prefill: Contention::NONE,
        split_decode: Contention::NONE,
        seconds: t0.elapsed().as_secs_f64(),
        cpu_prefill_share: pre.share,
        cpu_decode_share: dec.share,
    })
}

/// The split's own cost: a job handed to a pool thread beside this one, and the wait for
/// it (a split's CPU side; the pool's threads may sleep between calls).
fn calibrate_split() -> Result<f64> {
    time_min(|| {
        rayon::in_place_scope(|s| s.spawn(|_| std::hint::black_box(())));
        Ok(())
    })
}

/// The GPU side of a [`Scheduler`]: an attention backend and how it relates to the CPU.
pub(crate) struct Gpu {
    pub backend: Box<dyn AttentionBackend>,
    /// Name for messages and the calibration cache key.
    pub name: String,
    /// CPU and GPU work overlap in time.
    pub concurrent: bool,
}

/// Runs calls on the CPU, the GPU or both (see the module docs).
pub(crate) struct Scheduler {
    mode: Mode,
    cpu: CpuBackend,
    gpu: Gpu,
    /// Set once the GPU failed: every later call runs on the CPU only.
    fallen_back: AtomicBool,
    calibration: Mutex<Option<Calibration>>,
    /// When the (prefill, decode) costs are measured again: after a calibration that met a
    /// busy host (see [`share`]).
    remeasure: Mutex<[Remeasure; 2]>,
    last_split: Mutex<Option<Split>>,
    /// Calls run all on the CPU, all on the GPU, split.
    plan_counts: [AtomicU64; 3],
    /// Nanoseconds of all calls spent outside the dispatch (see [`PlanCounts`]).
    scheduler_ns: AtomicU64,
    /// Measured / predicted seconds per size class and plan kind (see [`feedback`]).
    feedback: Mutex<IdMap<SizeClass, ClassRecord>>,
    /// Per decode cache id: the version the GPU last received (its mirror's state).
    gpu_synced: Mutex<IdMap<u64, u64>>,
    /// Per decode cache id: (entries, kept pairs, pruning tag, queries) when last counted;
    /// reused only for the same pruning ([`acp_tag`]) and query count.
    kept_counts: Mutex<IdMap<u64, (u64, u64, u64, usize)>>,
    /// Per decode cache id (of a call's first head): the last split search of its calls.
    searches: Mutex<IdMap<u64, SplitSearch>>,
    /// `auto`'s all-CPU calls' measured / predicted seconds (of their upper bounds), for
    /// (prefill, decode): the CPU shortcut's check.
    shortcut: Mutex<[Shortcut; 2]>,
    /// (prefill, decode): the fastest GPU call or split GPU side measured so far, in
    /// nanoseconds (u64::MAX: none), an upper bound on the GPU's fixed cost that the
    /// shortcut trusts over a calibration's (run 291: a fit of 2586 us + 0 ns a row, while
    /// the GPU ran dense 1k prefills in 1.2 ms, held ACP 1k on the CPU at 1.5x the time).
    gpu_fastest_ns: [AtomicU64; 2],
    /// ACP prefill shapes whose next call starts on the GPU before its count ([`ahead`]),
    /// with the margin their last count found.
    ahead: Mutex<IdMap<ahead::Shape, f64>>,
    /// Calls that started on the GPU before their count.
    ahead_calls: AtomicU64,
    /// The CPU side of a split on a concurrent device: one thread fewer than the machine
    /// has, so the GPU submission thread (host packing, uploads) keeps a core.
    split_pool: OnceLock<Option<rayon::ThreadPool>>,
}

/// Calls of a decode class that reuse its last split search ([`SplitSearch`]).
const SEARCH_CALLS: u64 = 16;

/// How far the CPU or GPU prospect (which costs a split's sides before a split has run
/// warm) may move before a kept split search is redone.
const SEARCH_DRIFT: f64 = 0.02;

/// A decode call's last split search: the GPU heads it chose are re-costed for each later
/// call of the same caches (one sum and one prediction instead of `3 · heads` of them)
/// while that call is of the same size class and head count, its pairs, rows and rows to
/// send are within 1/[`RECOUNT_FRACTION`] of the searched ones, the class has run fewer
/// than [`SEARCH_CALLS`] calls since, no warm split call has changed the measured sides,
/// and the CPU and GPU prospects moved less than [`SEARCH_DRIFT`]. The CPU and GPU plans
/// are costed afresh at every call; a decode step grows the work by one row per head.
#[derive(Debug, Clone, PartialEq)]
struct SplitSearch {
    class: SizeClass,
    heads: usize,
    total: Work,
    at_calls: u64,
    sides_version: u64,
    prospects: (f64, f64),
    split: Option<Vec<usize>>,
}

impl SplitSearch {
    fn prospects(rec: &ClassRecord) -> (f64, f64) {
        (
            rec.prospect(PlanKind::Cpu).unwrap_or(1.0),
            rec.prospect(PlanKind::Gpu).unwrap_or(1.0),
        )
    }

    fn of(class: SizeClass, rec: &ClassRecord, total: Work, heads: usize, c: &Candidates) -> Self {
        SplitSearch {
            class,
            heads,
            total,
            at_calls: rec.calls(),
            sides_version: rec.sides_version(),
            prospects: Self::prospects(rec),
            split: c.split.as_ref().map(|(_, g)| g.clone()),
        }
    }

    /// Whether a call of `class`, `heads` heads doing `total`, may reuse this search.
    fn holds(&self, class: SizeClass, rec: &ClassRecord, total: Work, heads: usize) -> bool {
        let near = |a: u64, b: u64| a.abs_diff(b) <= b / RECOUNT_FRACTION;
        let still = |a: f64, b: f64| (a / b - 1.0).abs() <= SEARCH_DRIFT;
        let (pc, pg) = Self::prospects(rec);
        self.class == class
            && self.heads == heads
            && near(total.pairs, self.total.pairs)
            && near(total.rows, self.total.rows)
            && near(total.gpu_rows, self.total.gpu_rows)
            && rec.calls() < self.at_calls + SEARCH_CALLS
            && rec.sides_version() == self.sides_version
            && still(pc, self.prospects.0)
            && still(pg, self.prospects.1)
    }
}

/// A call's size class for the measured corrections: (decode, floor log2 rows, floor log2
/// kept pairs), rows and pairs of the whole call.
type SizeClass = (bool, u32, u32);

fn size_class(decode: bool, w: Work) -> SizeClass {
    (decode, w.rows.max(1).ilog2(), w.pairs.max(1).ilog2())
}

/// Writes one `FOXEDGE_TRACE_AUTO` line to stderr in one write: stderr is unbuffered, and
/// `eprintln!` writes each formatted piece on its own (on the H100 host the trace's two
/// lines a decode call took about 45 us of the call's 50 us scheduling).
macro_rules! trace_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($arg)*);
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

/// `FOXEDGE_TRACE_AUTO=1`: `auto` prints each choice (raw predictions, measured factors,
/// the plan and why) and each measurement to stderr.
fn trace_auto() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FOXEDGE_TRACE_AUTO").is_some_and(|v| v != "0"))
}

/// A decode head's kept-pair count is reused while its entry count stays within this
/// fraction of the count's (the split is still revisited at every step from the reused
/// counts and the current rows; the count is redone as the cache grows or shrinks).
const RECOUNT_FRACTION: u64 = 32;

/// A resident cache head's first send (the whole cache) is charged to one step as
/// `1 / AMORTIZE_STEPS` of it: it is paid once and the mirror serves every later step of
/// the session (otherwise a head the GPU does not hold yet would never be moved to it).
/// Likewise the catch-up of a mirror that fell behind while the CPU ran.
const AMORTIZE_STEPS: u64 = 256;

/// Rows of `head` the GPU must be sent for a decode step that writes `per_step` rows per
/// head: with a resident GPU and change tracking, the rows written since the version the
/// GPU last received, those beyond one step's charged `1 / AMORTIZE_STEPS` (a catch-up, or
/// the whole cache when it holds none, is paid once; on the H100 host, charged whole it
/// made every split look worse the longer the CPU plan ran, until auto no longer probed a
/// split 1.2x faster than the CPU); otherwise every row.
///
/// Returns (the rows charged, the rows behind: what a GPU step sends now).
fn rows_to_send(
    head: &CacheHead<'_>,
    resident: bool,
    synced: &IdMap<u64, u64>,
    per_step: u64,
) -> (u64, u64) {
    let n = head.c.len() as u64;
    match head.sync {
        Some(s) if resident => {
            let behind = synced
                .get(&s.id)
                .map_or(n, |&v0| s.version.saturating_sub(v0).min(n));
            let step = behind.min(per_step);
            (step + (behind - step).div_ceil(AMORTIZE_STEPS), behind)
        }
        _ => (n, n),
    }
}

/// Identifies how head `h` of a call is pruned (its bound and `ln eps`), so a kept-pair
/// count is never reused under other pruning (the same cache decoded dense, then with ACP).
fn acp_tag(acp: Acp<'_>, h: usize) -> u64 {
    match acp {
        Acp::Off => 0,
        Acp::Bound { u, ln_eps } => {
            let uh = u.get(h).copied().unwrap_or(f64::NAN);
            (uh.to_bits() ^ ln_eps.to_bits().rotate_left(17)) | 1
        }
        Acp::ObservedNorms { ln_eps } => ln_eps.to_bits().rotate_left(29) | 2,
    }
}

/// What [`Scheduler::choose`] decided.
struct Choice {
    split: Split,
    kind: PlanKind,
    /// For a probe of `auto` (see [`feedback`]): the winner's corrected prediction and the
    /// probe's catch-up.
    probe_of: Option<Probe>,
    /// The size class and the model's raw prediction, when the plan came from the model.
    class: Option<(SizeClass, f64)>,
    /// A split's (CPU side, GPU side) by the model alone ([`Candidates::split_sides`]).
    sides: (f64, f64),
    /// When the choice began (the trace reports the scheduler's time around the kernels).
    started: Instant,
    /// For an all-CPU plan of `auto`: the CPU's predicted seconds of the call's upper
    /// bound, what its measured time is divided by for the shortcut's check ([`Shortcut`]).
    cpu_upper_s: Option<f64>,
    /// `auto`'s [`Pick::whole_margin`] (0 for the other modes, a probe, or no model
    /// pick): what [`ahead`] starts a prefill by.
    whole_margin: f64,
    /// A split's fixed seconds beyond its sides ([`Calibration::split_fixed`]).
    split_fixed: f64,
}

impl fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("mode", &self.mode)
            .field("gpu", &self.gpu.name)
            .field("fallen_back", &self.fallen_back.load(Ordering::Relaxed))
            .finish()
    }
}

/// Heads selected by `idx` of a head-major `[heads, per]` tensor.
fn gather_major<T: Copy>(x: &[T], per: usize, idx: &[usize]) -> Vec<T> {
    let mut o = Vec::with_capacity(per * idx.len());
    for &h in idx {
        o.extend_from_slice(&x[h * per..(h + 1) * per]);
    }
    o
}

fn scatter_major(part: &[f32], per: usize, idx: &[usize], out: &mut [f32]) {
    for (i, &h) in idx.iter().enumerate() {
        out[h * per..(h + 1) * per].copy_from_slice(&part[i * per..(i + 1) * per]);
    }
}

fn merge_stats(n: usize, parts: &[(&[usize], &AttentionStats)]) -> AttentionStats {
    let mut st = AttentionStats {
        kept_pairs: vec![0; n],
        total_pairs: vec![0; n],
    };
    for (idx, s) in parts {
        for (i, &h) in idx.iter().enumerate() {
            st.kept_pairs[h] = s.kept_pairs.get(i).copied().unwrap_or(0);
            st.total_pairs[h] = s.total_pairs.get(i).copied().unwrap_or(0);
        }
    }
    st
}

/// Whether a GPU error means "stop using the GPU" (rather than bad input).
fn is_device_failure(e: &Error) -> bool {
    matches!(e, Error::BackendUnavailable(_) | Error::OutOfMemory { .. })
}

impl Scheduler {
    fn new(mode: Mode, gpu: Gpu) -> Scheduler {
        Scheduler {
            mode,
            cpu: CpuBackend,
            gpu,
            fallen_back: AtomicBool::new(false),
            calibration: Mutex::new(None),
            remeasure: Mutex::default(),
            last_split: Mutex::new(None),
            plan_counts: Default::default(),
            scheduler_ns: AtomicU64::new(0),
            feedback: Mutex::default(),
            gpu_synced: Mutex::default(),
            kept_counts: Mutex::default(),
            searches: Mutex::default(),
            shortcut: Mutex::default(),
            gpu_fastest_ns: [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)],
            ahead: Mutex::default(),
            ahead_calls: AtomicU64::new(0),
            split_pool: OnceLock::new(),
        }
    }

    /// The pool a split's CPU side runs in (None: the global pool).
    fn split_pool(&self) -> Option<&rayon::ThreadPool> {
        self.split_pool
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

    /// Folds a call's measured seconds into its size class's record for its kind, a
    /// split's measured (CPU side, GPU side) seconds into its side factors, and an all-CPU
    /// call of `auto` into the CPU shortcut's check (prefill or `decode`). `ran`: when the
    /// call's kernels started and how long they took.
    fn learn(
        &self,
        choice: &Choice,
        decode: bool,
        ran: (Instant, std::time::Duration),
        sides: Option<(f64, f64)>,
    ) {
        let secs = ran.1.as_secs_f64();
        let gpu_s = match choice.kind {
            PlanKind::Gpu => Some(secs),
            PlanKind::Split => sides.map(|(_, g)| g),
            PlanKind::Cpu => None,
        };
        if let Some(g) = gpu_s.filter(|g| g.is_finite() && *g > 0.0) {
            // (A saturating cast: seconds past u64 nanoseconds read as u64::MAX.)
            self.gpu_fastest_ns[decode as usize].fetch_min((g * 1e9) as u64, Ordering::Relaxed);
        }
        if let Some(cpu_s) = choice.cpu_upper_s
            && let Ok(mut s) = self.shortcut.lock()
        {
            s[decode as usize].record(secs / cpu_s);
        }
        let Some((class, raw)) = choice.class else {
            return;
        };
        if !(raw > 0.0 && secs.is_finite()) {
            return;
        }
        let split_sides = sides.filter(|_| choice.kind == PlanKind::Split);
        if trace_auto() && self.mode == Mode::Auto {
            trace_line!(
                "[auto] {class:?} ran {:?}: {:.3} ms = {:.2} x predicted (+{:.0} us choosing){}",
                choice.kind,
                secs * 1e3,
                secs / raw,
                (choice.started.elapsed().as_secs_f64() - secs) * 1e6,
                split_sides.map_or(String::new(), |(c, g)| format!(
                    "; sides cpu {:.3} ms = {:.2} x, gpu {:.3} ms = {:.2} x",
                    c * 1e3,
                    c / choice.sides.0,
                    g * 1e3,
                    g / choice.sides.1
                ))
            );
        }
        if let Ok(mut fb) = self.feedback.lock() {
            let rec = fb.entry(class).or_default();
            rec.spanned(choice.started, ran.0 + ran.1);
            // A split's factor: over its cost with its sides' factors as now measured at its
            // head count (this call's sides included).
            let (judged, ratio_s) = match split_sides {
                Some(cg) => {
                    let heads = choice.split.gpu_heads.len();
                    let (fixed, conc) = (choice.split_fixed, self.gpu.concurrent);
                    let sample = (secs, choice.probe_of.is_some());
                    let judged = fold_split_sides(rec, heads, choice.sides, cg, sample, conc);
                    let recosted = recosted_split(rec, heads, choice.sides, fixed, conc);
                    (judged, recosted.unwrap_or(raw))
                }
                None => (secs, raw),
            };
            if judged < secs && trace_auto() && self.mode == Mode::Auto {
                trace_line!(
                    "[auto] {class:?} split sample judged at its settled CPU side: {:.3} ms",
                    judged * 1e3
                );
            }
            rec.record_judged(choice.kind, raw, ratio_s, secs, judged, choice.probe_of);
        }
    }

    fn fall_back(&self, why: &Error) {
        if !self.fallen_back.swap(true, Ordering::AcqRel) {
            eprintln!(
                "foxedge: {} backend: the Vulkan device {} failed ({why}); attention runs on \
                 the CPU from now on",
                self.kind_name(),
                self.gpu.name
            );
        }
    }

    fn kind_name(&self) -> &'static str {
        match self.mode {
            Mode::GpuOnly => "vulkan",
            Mode::Hybrid => "hybrid",
            Mode::Auto => "auto",
        }
    }

    /// The calibration a call (a decode step if `decode`, else a prefill) plans with:
    /// [`Scheduler::costs`], its costs of that kind measured again first when due
    /// ([`Scheduler::remeasure`]); None when the scheduler runs the GPU alone or has fallen
    /// back to the CPU (and no calibration). The schedule ([`Remeasure`]) is consulted until it is
    /// done (two quiet re-measures, or thirty tries), whatever the kept costs' share reads:
    /// one quiet measurement can still be a bad fit (run 163: a 342 us fixed cost against
    /// 49-95 us in the other runs), and the second one replaces it when faster.
    fn planned_costs(&self, heads: usize, d: usize, decode: bool) -> Result<Option<Calibration>> {
        if self.mode == Mode::GpuOnly || self.fell_back() {
            return Ok(None);
        }
        match self.costs(heads, d)? {
            Some(c) => Ok(Some(self.remeasure(c, heads, d, decode)?)),
            None => Ok(None),
        }
    }

    /// Measures the costs of one kind of call again when the calibration's were measured
    /// on a busy host and a re-measure is due ([`Remeasure`]): both backends' until one
    /// measurement read quiet, then the CPU's alone. Keeps for each backend the faster of
    /// the two ([`improves`]), here and in the process-wide cache. A faster one that another engine put in the cache is taken
    /// without measuring; a host whose [`share::probe`] still reads busy is not measured
    /// (on the H100 host, tries that measured there added 95-145 us to every step of a
    /// decode dense 1k cell: runs 167-172). When a backend's costs change, what was learned
    /// against the old ones goes ([`Scheduler::forget_factors`]). A re-measure that fails
    /// leaves the calibration as it was. Returns the calibration to plan with.
    fn remeasure(
        &self,
        c: Calibration,
        heads: usize,
        d: usize,
        decode: bool,
    ) -> Result<Calibration> {
        let mut sched = lock(&self.remeasure)?;
        let k = decode as usize;
        // (No clock read per call once the schedule is done, or never began.)
        if !sched[k].pending() {
            return Ok(c);
        }
        let now = Instant::now();
        if !sched[k].is_due(now) {
            return Ok(c);
        }
        let key = (self.gpu.name.clone(), heads, d);
        let mine = kind_costs(&c, decode);
        let cached = lock(calibration_cache())?.get(&key).cloned();
        let from_cache = cached.as_ref().map(|x| kind_costs(x, decode)).filter(|x| {
            let (cpu, gpu) = improves(x, &mine, heads, decode);
            cpu || gpu
        });
        // The share this try read: a cached one's, a probe's that found the host still
        // busy (no samples then), or the measurement's (None if it failed). With a new
        // measurement, the split's own costs (CPU work too: a thread's spawn, gathers),
        // measured again or the cache's.
        let (fresh, read, split) = match from_cache {
            Some(x) => (Some(x), x.share, cached.map(|x| x.split_fixed)),
            None => match share::probe() {
                p if share::busy(p) => (None, p, None),
                p => {
                    // After a quiet measurement, the CPU's costs alone: a fit gone wrong on
                    // a quiet host (run 163) was the CPU's, and a GPU decode measurement
                    // stalls the step far longer (H100 host, decode: both backends 340-646
                    // ms, the CPU alone 63-70 ms; traces 211-213).
                    let cpu_only = sched[k].quiet() > 0;
                    let m = calibrate_kind(
                        &self.cpu,
                        self.gpu.backend.as_ref(),
                        heads,
                        d,
                        decode,
                        Some(p),
                        Some((&mine, cpu_only)),
                    )
                    .ok();
                    (m, m.and_then(|x| x.share), calibrate_split().ok())
                }
            },
        };
        let mut kept = c;
        if let Some(new) = fresh {
            let (cpu, gpu) = improves(&new, &mine, heads, decode);
            if cpu || gpu {
                // The lower split costs: a split priced too low is tried, and its factor
                // corrects it; one priced too high (on a busy host: 3.9 ms for a thread's
                // spawn and join, runs 160 and 166, against 57-144 us in quiet runs
                // 91-150) never runs.
                let adopt = |x: &mut Calibration, cpu: bool, gpu: bool| {
                    set_kind(x, decode, &new, cpu, gpu);
                    if let Some(f) = split {
                        x.split_fixed = x.split_fixed.min(f);
                    }
                };
                adopt(&mut kept, cpu, gpu);
                *lock(&self.calibration)? = Some(kept.clone());
                let mut cache = lock(calibration_cache())?;
                if let Some(x) = cache.get_mut(&key) {
                    let (cc, gc) = improves(&new, &kind_costs(x, decode), heads, decode);
                    adopt(x, cc, gc);
                }
                drop(cache);
                self.forget_factors(decode, cpu, gpu);
            }
        }
        if trace_auto() {
            trace_line!(
                "[{}] {} re-measure (try {}, {:.1} ms): share {} -> {}{}; {kept}",
                self.kind_name(),
                if decode { "decode" } else { "prefill" },
                sched[k].tries() + 1,
                now.elapsed().as_secs_f64() * 1e3,
                share_words(mine.share),
                share_words(read),
                if fresh.is_none() {
                    " (not measured)"
                } else {
                    ""
                },
            );
        }
        sched[k].tried(read, now);
        Ok(kept)
    }

    /// Forgets what was learned against one kind's old costs of the CPU (`cpu`) and the
    /// GPU (`gpu`): those plans' factors (and the split's, which has a side on each), the
    /// CPU shortcut's window, the kept split searches.
    fn forget_factors(&self, decode: bool, cpu: bool, gpu: bool) {
        if cpu && let Ok(mut s) = self.shortcut.lock() {
            s[decode as usize] = Shortcut::default();
        }
        let kinds: Vec<PlanKind> = [(cpu, PlanKind::Cpu), (gpu, PlanKind::Gpu)]
            .into_iter()
            .filter(|&(on, _)| on)
            .map(|(_, k)| k)
            .chain([PlanKind::Split])
            .collect();
        if let Ok(mut fb) = self.feedback.lock() {
            for (class, rec) in fb.iter_mut() {
                if class.0 == decode {
                    rec.forget(&kinds);
                }
            }
        }
        if decode && let Ok(mut s) = self.searches.lock() {
            s.clear();
        }
    }

    /// Re-measures for a calibration just taken: due for each kind whose CPU share was busy.
    fn schedule_remeasure(&self, c: &Calibration) -> Result<()> {
        let now = Instant::now();
        *lock(&self.remeasure)? =
            [false, true].map(|decode| Remeasure::after(kind_costs(c, decode).share, now));
        Ok(())
    }

    /// The calibration for (heads, d), measuring it on first use.
    fn costs(&self, heads: usize, d: usize) -> Result<Option<Calibration>> {
        if self.mode == Mode::GpuOnly {
            return Ok(None);
        }
        let mut slot = lock(&self.calibration)?;
        if let Some(c) = slot.as_ref() {
            return Ok(Some(c.clone()));
        }
        let key = (self.gpu.name.clone(), heads, d);
        let cached = lock(calibration_cache())?.get(&key).cloned();
        if let Some(c) = cached {
            match warm_gpu(self.gpu.backend.as_ref(), heads, d, c.gpu_decode_resident) {
                Ok(()) => {}
                Err(e) if is_device_failure(&e) => {
                    self.fall_back(&e);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
            *slot = Some(c.clone());
            // (Locks in one order: the re-measure schedule before the calibration.)
            drop(slot);
            self.schedule_remeasure(&c)?;
            return Ok(Some(c));
        }
        let measured = calibrate(
            &self.cpu,
            self.gpu.backend.as_ref(),
            heads,
            d,
            self.gpu.concurrent,
        )
        .and_then(|mut c| {
            // A side that fails here for another reason than the device leaves the sides
            // uncosted (as before they were measured), not the engine without costs.
            let t0 = Instant::now();
            match self.calibrate_sides(heads, d, c.gpu_decode_resident) {
                Ok(k) => (c.split_prefill, c.split_decode) = k,
                Err(e) if is_device_failure(&e) => return Err(e),
                Err(_) => {}
            }
            c.seconds += t0.elapsed().as_secs_f64();
            Ok(c)
        });
        match measured {
            Ok(c) => {
                lock(calibration_cache())?.insert(key, c.clone());
                *slot = Some(c.clone());
                drop(slot);
                self.schedule_remeasure(&c)?;
                Ok(Some(c))
            }
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The plan of a call of `heads` heads entered at `started`, from `cal`
    /// ([`Scheduler::planned_costs`]); `work` (per head) is
    /// computed only when the choice depends on it; `upper` bounds the whole call's work
    /// (every pair kept); `search_id` (a decode call's first cache id) keys the call's
    /// [`SplitSearch`].
    fn choose(
        &self,
        (heads, decode): (usize, bool),
        cal: Option<Calibration>,
        started: Instant,
        (upper, catch_up_rows): (Work, u64),
        search_id: Option<u64>,
        work: impl FnOnce() -> Result<Vec<Work>>,
    ) -> Result<Choice> {
        let side = |gpu: bool| Choice {
            split: Split::whole(heads, gpu, 0.0),
            kind: if gpu { PlanKind::Gpu } else { PlanKind::Cpu },
            probe_of: None,
            class: None,
            sides: (0.0, 0.0),
            started,
            cpu_upper_s: None,
            whole_margin: 0.0,
            split_fixed: 0.0,
        };
        if self.fell_back() {
            return Ok(side(false));
        }
        if self.mode == Mode::GpuOnly {
            return Ok(side(true));
        }
        let Some(c) = cal else {
            return Ok(side(!self.fell_back()));
        };
        let (cc, gc) = if decode {
            (c.cpu_decode, c.gpu_decode)
        } else {
            (c.cpu_prefill, c.gpu_prefill)
        };
        // `auto` skips the per-head work count when the calibration decides alone. On
        // shared cores a split never beats the side that is no slower at any size.
        // Concurrently, a GPU >= 19x slower per pair and per row can take < 5% of the
        // work, not worth a split. And any plan using the GPU takes its fixed cost: when
        // the CPU does the whole call faster unpruned, the CPU alone is the plan.
        let cpu_upper_s = cc.predict(upper.pairs, upper.rows, false);
        if self.mode == Mode::Auto {
            let gpu_slower = gc.a >= cc.a && gc.b >= cc.b && gc.c >= cc.c;
            let cpu_slower = cc.a >= gc.a && cc.b >= gc.b && cc.c >= gc.c;
            if !c.concurrent && gpu_slower {
                return Ok(side(false));
            }
            if !c.concurrent && cpu_slower {
                return Ok(side(true));
            }
            // (Only where the GPU is sent every row: a resident GPU's `c` is per row sent.)
            if c.concurrent
                && upper.gpu_rows == upper.rows
                && gc.b >= 19.0 * cc.b
                && gc.c >= 19.0 * cc.c
            {
                return Ok(side(false));
            }
            // When every row goes to the GPU, a row costs it at least `gc.c` and the CPU at
            // most `cc.c + cc.b * ppr` (`ppr` = most pairs per row: the queries of a decode
            // step, the tokens of a prefill): a GPU >= 19x slower per row at best cannot
            // take a useful share.
            let ppr = if decode {
                upper.pairs / upper.rows.max(1)
            } else {
                upper.rows.max(1) / heads.max(1) as u64
            };
            if c.concurrent
                && upper.gpu_rows == upper.rows
                && gc.c >= 19.0 * (cc.c + cc.b * ppr as f64)
            {
                return Ok(side(false));
            }
            // As measured: the CPU's prediction times what its all-CPU calls took over it
            // (on the H100 host a calibration that predicted a dense 4k step at 350 us
            // against a GPU fixed cost of 362 us kept auto on the CPU, 0.78 ms a step, while
            // the GPU took 0.40: run 67).
            // The GPU's fixed cost: the calibration's, or less where a GPU call ran faster.
            let fastest = self.gpu_fastest_ns[decode as usize].load(Ordering::Relaxed);
            let gpu_fixed = gc.a.min(fastest as f64 * 1e-9);
            if lock(&self.shortcut)?[decode as usize].factor() * cpu_upper_s <= gpu_fixed {
                return Ok(Choice {
                    cpu_upper_s: Some(cpu_upper_s),
                    ..side(false)
                });
            }
        }
        let split_cost = c.split_fixed;
        let t_work = trace_auto().then(Instant::now);
        let work = work()?;
        let work_s = t_work.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let total = work.iter().fold(Work::default(), |a, &w| a + w);
        let class = size_class(decode, total);
        // The class's record is read in place (held for the search, microseconds).
        let fb = lock(&self.feedback)?;
        let unseen = ClassRecord::default();
        let rec = fb.get(&class).unwrap_or(&unseen);
        let mut searches = lock(&self.searches)?;
        let kept = search_id
            .and_then(|id| searches.get(&id))
            .filter(|s| s.holds(class, rec, total, heads));
        let contention = if decode {
            c.split_decode
        } else {
            c.split_prefill
        };
        let cands = if let Some(s) = kept {
            let side = |k: usize| split_side_factors(rec, k);
            Costing::new(&work, cc, gc, side, c.concurrent, split_cost)
                .contended(contention)
                .with_split(s.split.as_deref())
        } else {
            // Per GPU head count, once per search (it costs 3 · heads splits).
            let sides: Vec<(f64, f64)> = (0..=heads).map(|k| split_side_factors(rec, k)).collect();
            let side = |k: usize| sides.get(k).copied().unwrap_or((1.0, 1.0));
            let cands = Costing::new(&work, cc, gc, side, c.concurrent, split_cost)
                .contended(contention)
                .search();
            if let Some(id) = search_id {
                searches.insert(id, SplitSearch::of(class, rec, total, heads, &cands));
            }
            cands
        };
        drop(searches);
        let explore = match decode {
            true if share::busy(c.cpu_decode_share) => EXPLORE_BUSY_DECODE,
            true => EXPLORE_DECODE,
            false => EXPLORE,
        };
        let catch_up_s = catch_up_rows as f64 * gc.c;
        let split_margin = if decode { 1.0 } else { SPLIT_MARGIN_PREFILL };
        let (split, pick) = plan(
            heads,
            &cands,
            self.mode,
            rec,
            explore,
            catch_up_s,
            split_margin,
        );
        let (kind, why) = (pick.kind, pick.reason);
        let (margin, whole_margin) = (pick.margin, pick.whole_margin);
        let raw = split.predicted_seconds;
        if trace_auto() && self.mode == Mode::Auto {
            let f = |k: PlanKind| rec.factor(k).map_or("-".into(), |x| format!("{x:.2}"));
            trace_line!(
                "[auto] {class:?} raw ms cpu {:.3} gpu {:.3} split {} | factors {} {} {} -> {kind:?} \
                 ({why:?} by {margin:.2}, {} gpu heads; work counted in {:.0} us, chosen after {:.0} us)",
                cands.cpu * 1e3,
                cands.gpu * 1e3,
                cands.split.as_ref().map_or("-".into(), |(t, g)| format!(
                    "{:.3} ({} heads)",
                    t * 1e3,
                    g.len()
                )),
                f(PlanKind::Cpu),
                f(PlanKind::Gpu),
                f(PlanKind::Split),
                split.gpu_heads.len(),
                work_s * 1e6,
                started.elapsed().as_secs_f64() * 1e6
            );
        }
        drop(fb);
        Ok(Choice {
            split,
            kind,
            probe_of: pick.probe_of(),
            class: Some((class, raw)),
            sides: cands.split_sides,
            started,
            cpu_upper_s: (self.mode == Mode::Auto && kind == PlanKind::Cpu).then_some(cpu_upper_s),
            whole_margin,
            split_fixed: split_cost,
        })
    }

    /// Per head of a decode call: the rows the GPU must be sent ([`rows_to_send`]) and
    /// whether the GPU holds no mirror of it yet (a resident head with change tracking
    /// that it never received). One look-up per head.
    ///
    /// Also returns the rows a GPU step would send now beyond those charged (a catch-up
    /// after CPU steps, amortized in the charge; see [`rows_to_send`]), over all heads.
    fn sends(&self, call: &DecodeCall<'_>, resident: bool) -> Result<(Vec<(u64, bool)>, u64)> {
        let synced = lock(&self.gpu_synced)?;
        let nq = call.n_queries as u64;
        let mut catch_up = 0;
        let sends = call
            .heads
            .iter()
            .map(|head| {
                let unsent = resident && head.sync.is_some_and(|s| !synced.contains_key(&s.id));
                let (charged, behind) = rows_to_send(head, resident, &synced, nq);
                catch_up += behind - charged;
                (charged, unsent)
            })
            .collect();
        Ok((sends, catch_up))
    }

    /// Per-head work of a decode call: kept pairs (reused per cache id while the entry
    /// count moved less than 1/[`RECOUNT_FRACTION`]), entries, and rows the GPU must be
    /// sent (a resident head: the rows written since the version it last received).
    #[cfg(test)]
    fn decode_work(&self, call: &DecodeCall<'_>, resident: bool) -> Result<Vec<Work>> {
        self.counted(call, &self.sends(call, resident)?.0)
    }

    /// [`Scheduler::decode_work`] with the rows to send known ([`Scheduler::sends`]).
    fn counted(&self, call: &DecodeCall<'_>, sends: &[(u64, bool)]) -> Result<Vec<Work>> {
        let nh = call.heads.len();
        let mut kept: Vec<Option<u64>> = vec![None; nh];
        {
            let cache = lock(&self.kept_counts)?;
            for (h, head) in call.heads.iter().enumerate() {
                let n = head.c.len() as u64;
                if let Some(&(n0, k0, tag, nq)) = head.sync.and_then(|s| cache.get(&s.id))
                    && tag == acp_tag(call.acp, h)
                    && nq == call.n_queries
                    && n.abs_diff(n0) <= n0 / RECOUNT_FRACTION
                {
                    kept[h] = Some(
                        (k0 + n.saturating_sub(n0) * call.n_queries as u64)
                            .min(n * call.n_queries as u64),
                    );
                }
            }
        }
        let missing: Vec<usize> = (0..nh).filter(|&h| kept[h].is_none()).collect();
        if !missing.is_empty() {
            use rayon::prelude::*;
            let counted = missing
                .par_iter()
                .map(|&h| decode_kept(call, h))
                .collect::<Result<Vec<u64>>>()?;
            let mut cache = lock(&self.kept_counts)?;
            for (&h, k) in missing.iter().zip(counted) {
                kept[h] = Some(k);
                if let Some(s) = call.heads[h].sync {
                    let n = call.heads[h].c.len() as u64;
                    cache.insert(s.id, (n, k, acp_tag(call.acp, h), call.n_queries));
                }
            }
        }
        Ok(call
            .heads
            .iter()
            .zip(kept)
            .zip(sends)
            .map(|((head, k), &(gpu_rows, _))| {
                let n = head.c.len() as u64;
                Work {
                    pairs: k.unwrap_or(n),
                    rows: n,
                    gpu_rows,
                }
            })
            .collect())
    }

    /// Notes that the GPU received these heads of a decode call at their versions.
    fn note_gpu_synced(&self, call: &DecodeCall<'_>, heads: &[usize]) {
        if let Ok(mut m) = self.gpu_synced.lock() {
            for &h in heads {
                if let Some(s) = call.heads.get(h).and_then(|x| x.sync) {
                    m.insert(s.id, s.version);
                }
            }
        }
    }

    fn record(&self, split: &Split) -> Result<()> {
        let i = match (split.cpu_heads.is_empty(), split.gpu_heads.is_empty()) {
            (_, true) => 0,
            (true, false) => 1,
            (false, false) => 2,
        };
        self.plan_counts[i].fetch_add(1, Ordering::Relaxed);
        let mut last = lock(&self.last_split)?;
        match last.as_mut() {
            // The same heads as the last call (the common case): no copy of them.
            Some(l) if l.gpu_heads == split.gpu_heads && l.cpu_heads == split.cpu_heads => {
                l.predicted_seconds = split.predicted_seconds;
            }
            _ => *last = Some(split.clone()),
        }
        Ok(())
    }

    /// Adds a call's time since `entered` less `dispatched` (its backends' dispatch) to
    /// [`Scheduler::scheduler_ns`]. A first calibration inside the call is counted too.
    fn count_overhead(&self, entered: Instant, dispatched: std::time::Duration) {
        let ns = entered.elapsed().saturating_sub(dispatched).as_nanos();
        self.scheduler_ns
            .fetch_add(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Calls so far: (all CPU, all GPU, split), and the scheduler's own time.
    pub(crate) fn plan_counts(&self) -> PlanCounts {
        let g = |i: usize| self.plan_counts[i].load(Ordering::Relaxed);
        PlanCounts {
            cpu: g(0),
            gpu: g(1),
            split: g(2),
            scheduler_ns: self.scheduler_ns.load(Ordering::Relaxed),
        }
    }

    /// `r` when it is not a device failure; else says so (once), stops using the GPU and
    /// returns `rerun()` (the same work on the CPU).
    fn or_cpu(
        &self,
        r: Result<AttentionStats>,
        rerun: impl FnOnce() -> Result<AttentionStats>,
    ) -> Result<AttentionStats> {
        match r {
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                rerun()
            }
            other => other,
        }
    }

    /// The last call's split (None before the first call).
    pub(crate) fn last_split(&self) -> Option<Split> {
        self.last_split.lock().ok().and_then(|s| s.clone())
    }

    /// The calibration in use (None before the first call, or when not needed).
    pub(crate) fn calibration(&self) -> Option<Calibration> {
        self.calibration.lock().ok().and_then(|s| s.clone())
    }

    pub(crate) fn fell_back(&self) -> bool {
        self.fallen_back.load(Ordering::Acquire)
    }

    pub(crate) fn gpu_name(&self) -> &str {
        &self.gpu.name
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Internal("hybrid scheduler lock poisoned".into()))
}

/// The queries, cache views and bounds of some heads of a decode call.
struct DecodePart<'c> {
    q: Vec<f32>,
    q_c: Vec<f64>,
    q_pos: Option<Vec<u64>>,
    heads: Vec<CacheHead<'c>>,
    u: Vec<f64>,
}

impl<'c> DecodePart<'c> {
    fn gather(call: &DecodeCall<'c>, idx: &[usize]) -> DecodePart<'c> {
        let (nq, d) = (call.n_queries, call.head_dim);
        DecodePart {
            q: gather_major(call.q, nq * d, idx),
            q_c: gather_major(call.q_c, nq, idx),
            q_pos: call.q_pos.map(|p| gather_major(p, nq, idx)),
            heads: idx.iter().map(|&h| call.heads[h]).collect(),
            u: match call.acp {
                Acp::Bound { u, .. } => idx
                    .iter()
                    .map(|&h| u.get(h).copied().unwrap_or(f64::NAN))
                    .collect(),
                _ => Vec::new(),
            },
        }
    }

    fn call<'a>(&'a self, whole: &DecodeCall<'_>) -> DecodeCall<'a>
    where
        'c: 'a,
    {
        DecodeCall {
            head_dim: whole.head_dim,
            n_queries: whole.n_queries,
            q: &self.q,
            q_c: &self.q_c,
            q_pos: self.q_pos.as_deref(),
            heads: &self.heads,
            acp: match whole.acp {
                Acp::Bound { ln_eps, .. } => Acp::Bound { u: &self.u, ln_eps },
                Acp::Off => Acp::Off,
                Acp::ObservedNorms { ln_eps } => Acp::ObservedNorms { ln_eps },
            },
        }
    }
}

/// `f`'s result and the seconds it took.
fn timed<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed().as_secs_f64())
}

impl AttentionBackend for Scheduler {
    fn kind(&self) -> BackendKind {
        if self.fell_back() {
            return BackendKind::Cpu;
        }
        match self.mode {
            Mode::GpuOnly => BackendKind::Vulkan,
            Mode::Hybrid => BackendKind::Hybrid,
            Mode::Auto => BackendKind::Auto,
        }
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let (t, nh, d) = (call.t, call.heads, call.head_dim);
        if out.len() != t * nh * d {
            return Err(Error::invalid("prefill out: [t, heads, head_dim] values"));
        }
        let entered = Instant::now();
        let rows = (t * nh) as u64;
        let upper = Work {
            pairs: (t * (t + 1) / 2 * nh) as u64,
            rows,
            gpu_rows: rows,
        };
        let mut decided = None;
        let cal = self.planned_costs(nh, d, false)?;
        let shape = (t, nh, d);
        let acp = !matches!(call.acp, Acp::Off);
        if acp
            && let Some(c) = &cal
            && let Some(margin) = self.starts_ahead(shape, c)
        {
            return self.prefill_ahead(call, c, (shape, margin), (entered, upper), out);
        }
        let choice = self.choose((nh, false), cal, entered, (upper, 0), None, || {
            // Dense: every head keeps every causal pair; the kernels form their own c.
            if !acp {
                let w = Work {
                    pairs: (t * (t + 1) / 2) as u64,
                    rows: t as u64,
                    gpu_rows: t as u64,
                };
                return Ok(vec![w; nh]);
            }
            let b = prefill_boundary(call)?;
            let w = prefill_work(&b, t);
            decided = Some(b);
            Ok(w)
        })?;
        if acp {
            self.plan_ahead(shape, &choice);
        }
        let split = &choice.split;
        self.record(split)?;
        let t0 = Instant::now();
        // The kernels reuse the decisions the plan was made from.
        let call = &PrefillCall {
            decided: decided.as_ref(),
            ..*call
        };
        let mut sides = None;
        let r = if split.gpu_heads.is_empty() {
            self.cpu.prefill(call, out)
        } else if split.cpu_heads.is_empty() {
            let r = self.gpu.backend.prefill(call, out);
            self.or_cpu(r, || self.cpu.prefill(call, out))
        } else {
            self.prefill_split(call, split, decided.as_ref(), out, &mut sides)
        };
        let ran = t0.elapsed();
        if r.is_ok() {
            self.learn(&choice, false, (t0, ran), sides);
        }
        self.count_overhead(entered, ran);
        r
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let (nh, nq, d) = (call.heads.len(), call.n_queries, call.head_dim);
        if out.len() != nh * nq * d {
            return Err(Error::invalid(
                "decode out: [heads, n_queries, head_dim] values",
            ));
        }
        let entered = Instant::now();
        // Measured on first use: residency is known before the work is counted.
        let cal = self.planned_costs(nh, d, true)?;
        let resident = cal.as_ref().is_some_and(|c| c.gpu_decode_resident);
        let (sends, catch_up) = self.sends(call, resident)?;
        let nq = nq as u64;
        let upper =
            call.heads
                .iter()
                .zip(&sends)
                .fold(Work::default(), |a, (head, &(gpu_rows, _))| {
                    let n = head.c.len() as u64;
                    a + Work {
                        pairs: n * nq,
                        rows: n,
                        gpu_rows,
                    }
                });
        let search_id = call.heads.first().and_then(|h| h.sync).map(|s| s.id);
        let choice = self.choose(
            (nh, true),
            cal,
            entered,
            (upper, catch_up),
            search_id,
            || self.counted(call, &sends),
        )?;
        let split = &choice.split;
        self.record(split)?;
        // A step that first sends a cache to the GPU measures the send, not the steady
        // state the model predicts: it teaches nothing.
        let first_send = split.gpu_heads.iter().any(|&h| sends[h].1);
        let t0 = Instant::now();
        let mut sides = None;
        let r = if split.gpu_heads.is_empty() {
            self.cpu.decode(call, out)
        } else if split.cpu_heads.is_empty() {
            let r = self.gpu.backend.decode(call, out);
            if r.is_ok() {
                self.note_gpu_synced(call, &split.gpu_heads);
            }
            self.or_cpu(r, || self.cpu.decode(call, out))
        } else {
            self.decode_split(call, split, out, &mut sides)
        };
        let ran = t0.elapsed();
        if r.is_ok() && !first_send {
            self.learn(&choice, true, (t0, ran), sides);
        }
        self.count_overhead(entered, ran);
        r
    }

    fn release_cache(&self, ids: &[u64]) {
        self.forget(ids);
    }
}

impl Scheduler {
    /// Forgets the cache heads `ids` (and has the GPU free its mirrors of them).
    fn forget(&self, ids: &[u64]) {
        if let Ok(mut m) = self.gpu_synced.lock() {
            for id in ids {
                m.remove(id);
            }
        }
        if let Ok(mut m) = self.kept_counts.lock() {
            for id in ids {
                m.remove(id);
            }
        }
        if let Ok(mut m) = self.searches.lock() {
            for id in ids {
                m.remove(id);
            }
        }
        self.gpu.backend.release_cache(ids);
    }

    /// Whether an ACP prefill of `shape` starts on the GPU before its count ([`ahead`]):
    /// the margin its shape's last count found, if so.
    fn starts_ahead(&self, shape: ahead::Shape, cal: &Calibration) -> Option<f64> {
        if self.mode != Mode::Auto || !cal.concurrent || self.fell_back() {
            return None;
        }
        self.ahead.lock().ok()?.get(&shape).copied()
    }

    /// After a count of an ACP prefill of `shape` planned `next`: its next call starts on
    /// the GPU before its count when `next` is the GPU's, not a probe, by [`ahead::MARGIN`]
    /// over the all-CPU plan ([`ahead`]; a split near it does not hold the call back).
    fn plan_ahead(&self, shape: ahead::Shape, next: &Choice) {
        if self.mode != Mode::Auto {
            return;
        }
        let Ok(mut a) = self.ahead.lock() else {
            return;
        };
        if next.kind == PlanKind::Gpu
            && next.probe_of.is_none()
            && next.whole_margin >= ahead::MARGIN
        {
            if a.len() >= ahead::SHAPES && !a.contains_key(&shape) {
                a.clear();
            }
            a.insert(shape, next.whole_margin);
        } else {
            a.remove(&shape);
        }
    }

    /// An ACP prefill of `shape` started on the GPU before its count ([`ahead`]; `margin`:
    /// what the shape's last count found): the GPU runs it (deciding its blocks) while a
    /// pool thread counts its work; then the count teaches the call's size class its
    /// measured time, as a counted GPU call's, and plans the shape's next call.
    /// `(entered, upper)`: when the call began, its work's bound.
    fn prefill_ahead(
        &self,
        call: &PrefillCall<'_>,
        cal: &Calibration,
        (shape, margin): (ahead::Shape, f64),
        (entered, upper): (Instant, Work),
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        // The GPU runs on this thread, as the `vulkan` backend's would; the count goes to
        // the pool (done long before the GPU is, so the scope's end rarely waits: a wait
        // counts as the scheduler's time, not the dispatch's).
        let mut counted = Err(Error::Internal("prefill count did not run".into()));
        let t0 = Instant::now();
        let (r, ran) = rayon::in_place_scope(|s| {
            s.spawn(|_| counted = prefill_boundary(call));
            let r = self.gpu.backend.prefill(call, out);
            (r, t0.elapsed())
        });
        self.ahead_calls.fetch_add(1, Ordering::Relaxed);
        let gpu_ran = r.is_ok();
        let rerun = Instant::now();
        let r = self.or_cpu(r, || self.cpu.prefill(call, out));
        let dispatched = ran + rerun.elapsed();
        let counted = match counted {
            Ok(b) if gpu_ran => b,
            _ => {
                if let Ok(mut a) = self.ahead.lock() {
                    a.remove(&shape);
                }
                self.count_overhead(entered, dispatched);
                return r;
            }
        };
        let work = prefill_work(&counted, call.t);
        let total = work.iter().fold(Work::default(), |a, &w| a + w);
        let raw = cal.gpu_prefill.predict(total.pairs, total.gpu_rows, false);
        let this = Choice {
            split: Split::whole(call.heads, true, raw),
            kind: PlanKind::Gpu,
            probe_of: None,
            class: Some((size_class(false, total), raw)),
            sides: (0.0, 0.0),
            started: entered,
            cpu_upper_s: None,
            whole_margin: 0.0,
            split_fixed: 0.0,
        };
        if trace_auto() {
            trace_line!(
                "[auto] prefill started on the GPU ahead of its count (the last count's margin \
                 {margin:.2})"
            );
        }
        self.record(&this.split)?;
        self.learn(&this, false, (t0, ran), None);
        let next = self.choose(
            (call.heads, false),
            Some(cal.clone()),
            entered,
            (upper, 0),
            None,
            || Ok(work),
        )?;
        self.plan_ahead(shape, &next);
        self.count_overhead(entered, dispatched);
        r
    }

    /// A prefill split: the GPU side packs and submits its heads on this thread; the CPU
    /// side then computes its heads into `out` in the split pool while the GPU works, and
    /// the GPU side's rows are unpacked into `out` after both ([`Self::beside`]). Both
    /// sides read the call's tensors and `decided` (the plan's decisions) in place, so
    /// neither decides again. `sides` receives the (CPU, GPU) sides' seconds when both ran.
    fn prefill_split(
        &self,
        call: &PrefillCall<'_>,
        split: &Split,
        decided: Option<&PrefillBoundary>,
        out: &mut [f32],
        sides: &mut Option<(f64, f64)>,
    ) -> Result<AttentionStats> {
        let side = |heads| PrefillCall {
            decided,
            only: Some(heads),
            ..*call
        };
        let (gcall, ccall) = (side(&split.gpu_heads), side(&split.cpu_heads));
        let gpu = self.gpu.backend.as_ref();
        let ((gran, g_s), (cres, c_s)) = self.beside(
            |packed| gpu.prefill_run(&gcall, packed),
            || self.cpu.prefill(&ccall, out),
        );
        let cs = cres?;
        let (gres, finish_s) = timed(|| gran.and_then(|run| run.finish(out)));
        if gres.is_ok() {
            *sides = Some((c_s, g_s + finish_s));
        }
        if trace_auto() {
            trace_line!(
                "[auto] prefill split {}+{} heads: CPU side {:.3} ms, GPU side {:.3} + {:.3} ms",
                split.cpu_heads.len(),
                split.gpu_heads.len(),
                c_s * 1e3,
                g_s * 1e3,
                finish_s * 1e3
            );
        }
        let gs = self.or_cpu(gres, || self.cpu.prefill(&gcall, out))?;
        Ok(merge_stats(
            call.heads,
            &[(&split.gpu_heads, &gs), (&split.cpu_heads, &cs)],
        ))
    }

    /// A decode split: cache heads are views (only queries are gathered); the CPU side runs
    /// in the split pool while the GPU side runs on this thread. `sides` receives the (CPU,
    /// GPU) sides' seconds when both ran.
    fn decode_split(
        &self,
        call: &DecodeCall<'_>,
        split: &Split,
        out: &mut [f32],
        sides: &mut Option<(f64, f64)>,
    ) -> Result<AttentionStats> {
        let (nh, nq, d) = (call.heads.len(), call.n_queries, call.head_dim);
        let gp = DecodePart::gather(call, &split.gpu_heads);
        let cp = DecodePart::gather(call, &split.cpu_heads);
        let (gcall, ccall) = (gp.call(call), cp.call(call));
        let mut g_out = vec![0.0f32; split.gpu_heads.len() * nq * d];
        let mut c_out = vec![0.0f32; split.cpu_heads.len() * nq * d];
        let gpu = self.gpu.backend.as_ref();
        let ((gres, g_s), (cres, c_s)) = self.beside(
            |start| {
                start();
                gpu.decode(&gcall, &mut g_out)
            },
            || self.cpu.decode(&ccall, &mut c_out),
        );
        let cs = cres?;
        if gres.is_ok() {
            self.note_gpu_synced(call, &split.gpu_heads);
            *sides = Some((c_s, g_s));
        }
        let gs = self.or_cpu(gres, || self.cpu.decode(&gcall, &mut g_out))?;
        scatter_major(&g_out, nq * d, &split.gpu_heads, out);
        scatter_major(&c_out, nq * d, &split.cpu_heads, out);
        Ok(merge_stats(
            nh,
            &[(&split.gpu_heads, &gs), (&split.cpu_heads, &cs)],
        ))
    }

    /// What a split's sides cost each other ([`Contention`]), for (prefill, decode): one
    /// split of half the heads a side, dense, 1024 tokens (prefill) and one step over
    /// 4096 entries per head (decode; with resident caches where the GPU keeps them), each
    /// side timed alone and then both at once as [`Self::beside`] runs them (the minimum
    /// of [`time_min`]'s runs of each). Identity where a split's sides do not overlap (no
    /// split pool) or a call has one head.
    fn calibrate_sides(
        &self,
        heads: usize,
        d: usize,
        resident: bool,
    ) -> Result<(Contention, Contention)> {
        if heads < 2 || self.split_pool().is_none() {
            return Ok((Contention::NONE, Contention::NONE));
        }
        Ok((
            self.prefill_sides(heads, d)?,
            self.decode_sides(heads, d, resident)?,
        ))
    }

    /// [`Self::calibrate_sides`] of a dense prefill of 1024 tokens.
    fn prefill_sides(&self, heads: usize, d: usize) -> Result<Contention> {
        let gpu = self.gpu.backend.as_ref();
        let (cpu_heads, gpu_heads): (Vec<usize>, Vec<usize>) =
            ((0..heads / 2).collect(), (heads / 2..heads).collect());
        let x = SyntheticPrefill::new(1024, heads, d, 71, -0.01);
        let whole = x.call(false);
        let (ccall, gcall) = (
            PrefillCall {
                only: Some(&cpu_heads),
                ..whole
            },
            PrefillCall {
                only: Some(&gpu_heads),
                ..whole
            },
        );
        let mut out = vec![0.0f32; x.q.len()];
        let cpu_alone = time_min(|| self.cpu.prefill(&ccall, &mut out).map(|_| ()))?;
        let mut packed = f64::INFINITY;
        let gpu_alone = time_min(|| {
            let t0 = Instant::now();
            let run = gpu.prefill_run(&gcall, &mut || {
                packed = packed.min(t0.elapsed().as_secs_f64())
            })?;
            run.finish(&mut out).map(|_| ())
        })?;
        let (mut cpu_split, mut gpu_split) = (f64::INFINITY, f64::INFINITY);
        time_min(|| {
            let ((gran, g_s), (cres, c_s)) = self.beside(
                |on_packed| gpu.prefill_run(&gcall, on_packed),
                || self.cpu.prefill(&ccall, &mut out),
            );
            cres?;
            let (fin, f_s) = timed(|| gran.and_then(|run| run.finish(&mut out)));
            fin?;
            cpu_split = cpu_split.min(c_s);
            gpu_split = gpu_split.min(g_s + f_s);
            Ok(())
        })?;
        Ok(Contention::measured(
            cpu_alone, gpu_alone, packed, cpu_split, gpu_split,
        ))
    }

    /// [`Self::calibrate_sides`] of a dense decode step over 4096 entries per head (with
    /// caches the GPU keeps `resident`, one changed row per head and step).
    fn decode_sides(&self, heads: usize, d: usize, resident: bool) -> Result<Contention> {
        let gpu = self.gpu.backend.as_ref();
        let n = 4096;
        let x = SyntheticCache::new(n, heads, d, (74, 76), 0.01);
        let mut sync = StepSync::new(heads, n);
        let h0 = heads / 2;
        let (cpu_heads, gpu_heads) = (0..h0, h0..heads);
        let (mut c_out, mut g_out) = (vec![0.0f32; h0 * d], vec![0.0f32; (heads - h0) * d]);
        let cpu_alone = time_min(|| {
            let hs = x.heads(cpu_heads.clone(), resident.then_some(&sync));
            let call = x.call(cpu_heads.clone(), &hs, false);
            self.cpu.decode(&call, &mut c_out).map(|_| ())
        })?;
        let gpu_alone = time_min(|| {
            sync.step();
            let hs = x.heads(gpu_heads.clone(), resident.then_some(&sync));
            let call = x.call(gpu_heads.clone(), &hs, false);
            gpu.decode(&call, &mut g_out).map(|_| ())
        })?;
        let (mut cpu_split, mut gpu_split) = (f64::INFINITY, f64::INFINITY);
        let timed_split = time_min(|| {
            sync.step();
            let (ch, gh) = (
                x.heads(cpu_heads.clone(), resident.then_some(&sync)),
                x.heads(gpu_heads.clone(), resident.then_some(&sync)),
            );
            let ccall = x.call(cpu_heads.clone(), &ch, false);
            let gcall = x.call(gpu_heads.clone(), &gh, false);
            let ((gres, g_s), (cres, c_s)) = self.beside(
                |start| {
                    start();
                    gpu.decode(&gcall, &mut g_out)
                },
                || self.cpu.decode(&ccall, &mut c_out),
            );
            cres?;
            gres?;
            cpu_split = cpu_split.min(c_s);
            gpu_split = gpu_split.min(g_s);
            Ok(())
        });
        if resident {
            gpu.release_cache(&(0..heads as u64).map(|h| sync.base + h).collect::<Vec<_>>());
        }
        timed_split?;
        Ok(Contention::measured(
            cpu_alone, gpu_alone, 0.0, cpu_split, gpu_split,
        ))
    }

    /// A split's two sides with their seconds: `gpu` on this thread, `cpu` in the split
    /// pool from the moment `gpu` calls its argument (once its host work is done: a Vulkan
    /// prefill's packing; at once if it never does), so the two do not fight over cores.
    /// The CPU side's seconds count from the split's start. Where the CPU and the GPU share
    /// cores (no split pool) the sides run one after the other. A panic on the GPU side
    /// becomes an error, so the call can fall back.
    #[allow(clippy::type_complexity)]
    fn beside<G: Send, C: Send>(
        &self,
        gpu: impl FnOnce(&mut dyn FnMut()) -> Result<G> + Send,
        cpu: impl FnOnce() -> Result<C> + Send,
    ) -> ((Result<G>, f64), (Result<C>, f64)) {
        let gpu = |start: &mut dyn FnMut()| {
            timed(|| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gpu(start)))
                    .unwrap_or_else(|_| {
                        Err(Error::Internal("the GPU side of a split panicked".into()))
                    })
            })
        };
        let Some(pool) = self.split_pool() else {
            let c = timed(cpu);
            return (gpu(&mut || {}), c);
        };
        let t0 = Instant::now();
        let mut c = (
            Err(Error::Internal("a split's CPU side did not run".into())),
            0.0,
        );
        let mut pending = Some((cpu, &mut c));
        let g = pool.in_place_scope(|s| {
            let g = gpu(&mut || {
                if let Some((cpu, slot)) = pending.take() {
                    s.spawn(move |_| *slot = (cpu(), t0.elapsed().as_secs_f64()));
                }
            });
            if let Some((cpu, slot)) = pending.take() {
                *slot = (cpu(), t0.elapsed().as_secs_f64());
            }
            g
        });
        (g, c)
    }
}

/// Opens the Vulkan side: `device` as in `FOXEDGE_VULKAN_DEVICE` (None = that variable,
/// else the best device).
#[cfg(feature = "vulkan")]
fn open_gpu(device: Option<&str>) -> Result<Gpu> {
    let vb = crate::vulkan_backend::open(device)?;
    Ok(Gpu {
        name: vb.device_name(),
        concurrent: !vb.is_cpu_device(),
        backend: Box::new(vb),
    })
}

#[cfg(not(feature = "vulkan"))]
fn open_gpu(_device: Option<&str>) -> Result<Gpu> {
    Err(Error::BackendUnavailable(
        "vulkan: this build has no Vulkan backend (cargo feature `vulkan`)".into(),
    ))
}

/// Says once per process that `auto` found no Vulkan device and uses the CPU.
fn note_auto_cpu(why: &Error) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::AcqRel) {
        eprintln!("foxedge: auto backend: {why}; attention runs on the CPU");
    }
}

/// The session's backend for `kind` (`device` as in `FOXEDGE_VULKAN_DEVICE`).
///
/// `cpu` always works; `vulkan` and `hybrid` need a Vulkan device
/// ([`Error::BackendUnavailable`] otherwise); `auto` uses the CPU when there is none.
pub(crate) fn resolve(
    kind: BackendKind,
    device: Option<&str>,
) -> Result<Box<dyn AttentionBackend>> {
    let mode = match kind {
        BackendKind::Cpu => return Ok(Box::new(CpuBackend)),
        BackendKind::Vulkan => Mode::GpuOnly,
        BackendKind::Hybrid => Mode::Hybrid,
        BackendKind::Auto => Mode::Auto,
    };
    match open_gpu(device) {
        Ok(gpu) => Ok(Box::new(Scheduler::new(mode, gpu))),
        Err(e) if mode == Mode::Auto => {
            note_auto_cpu(&e);
            Ok(Box::new(CpuBackend))
        }
        Err(e) => Err(e),
    }
}

/// How a [`Problem`] is pruned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AcpMode {
    /// Dense.
    Off,
    /// ACP with the problem's logit bounds `u` and this `ln eps` (< 0):
    /// `delta_h = -2 U_h - ln N + ln eps` (ACP paper, section 3).
    Bound { ln_eps: f64 },
}

impl AcpMode {
    fn to_acp<'a>(self, u: &'a [f64]) -> Acp<'a> {
        match self {
            AcpMode::Off => Acp::Off,
            AcpMode::Bound { ln_eps } => Acp::Bound { u, ln_eps },
        }
    }
}

/// Per-head work of one call (query-key pairs; FLOPs = `4 · head_dim · kept`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallStats {
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
}

impl CallStats {
    /// Sum of kept pairs over heads.
    pub fn kept(&self) -> u64 {
        self.kept_pairs.iter().sum()
    }
    /// Sum of attendable pairs over heads.
    pub fn total(&self) -> u64 {
        self.total_pairs.iter().sum()
    }
    /// `kept / total` (1 when there is no pair).
    pub fn kept_fraction(&self) -> f64 {
        let t = self.total();
        if t == 0 {
            1.0
        } else {
            self.kept() as f64 / t as f64
        }
    }
    /// Kept FLOPs: `4 · head_dim · kept` (QK^T and PV, a multiply-add = 2 FLOPs).
    pub fn flops(&self, head_dim: usize) -> f64 {
        4.0 * head_dim as f64 * self.kept() as f64
    }
}

impl From<AttentionStats> for CallStats {
    fn from(s: AttentionStats) -> Self {
        CallStats {
            kept_pairs: s.kept_pairs,
            total_pairs: s.total_pairs,
        }
    }
}

/// One causal prefill from an empty cache: `t` tokens, `heads` heads of `head_dim`.
///
/// `q`, `k`, `v`: `[t, heads, head_dim]`; `log_f`: `[t, heads]` log forget gates (finite,
/// `<= 0`); `u`: `[heads]` logit bounds `U_h >= max |s q·k|` used by [`AcpMode::Bound`].
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub log_f: Vec<f32>,
    pub u: Vec<f64>,
}

/// The ACP boundary of a [`Problem`] (what both kernels skip), per head.
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// Tokens per block (query and key).
    pub block: usize,
    /// Query blocks per head.
    pub q_blocks: usize,
    /// `[heads, q_blocks]`: key blocks `< start` are pruned for that query block.
    pub start_blocks: Vec<u32>,
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
    /// The threshold of each head (None: dense).
    pub delta: Vec<Option<f64>>,
    /// `[heads, t]` cumulative log gates `c_i = sum_{l<=i} log f_l` (f64).
    pub c: Vec<f64>,
}

impl Problem {
    /// Checks sizes, gates (finite, `<= 0`) and bounds (finite, `>= 0`).
    pub fn validate(&self) -> Result<()> {
        let (t, h, d) = (self.t, self.heads, self.head_dim);
        if t == 0 || h == 0 || d == 0 {
            return Err(Error::invalid("problem: t, heads and head_dim must be > 0"));
        }
        let n = t
            .checked_mul(h)
            .and_then(|x| x.checked_mul(d))
            .ok_or_else(|| Error::invalid("problem: t * heads * head_dim overflows"))?;
        for (name, len, want) in [
            ("q", self.q.len(), n),
            ("k", self.k.len(), n),
            ("v", self.v.len(), n),
            ("log_f", self.log_f.len(), t * h),
            ("u", self.u.len(), h),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "problem: {name} has {len} values, expected {want}"
                )));
            }
        }
        gate::validate_log_gates(&self.log_f).map_err(core_err)?;
        if self.u.iter().any(|u| !(u.is_finite() && *u >= 0.0)) {
            return Err(Error::invalid(
                "problem: logit bounds must be finite and >= 0",
            ));
        }
        Ok(())
    }

    fn call(&self, acp: AcpMode) -> PrefillCall<'_> {
        PrefillCall {
            t: self.t,
            heads: self.heads,
            head_dim: self.head_dim,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            log_f: &self.log_f,
            acp: acp.to_acp(&self.u),
            decided: None,
            only: None,
        }
    }

    /// The pruning boundary both backends use for this problem under `acp`.
    pub fn boundary(&self, acp: AcpMode) -> Result<Boundary> {
        self.validate()?;
        let b = prefill_boundary(&self.call(acp))?;
        Ok(Boundary {
            block: BLOCK,
            q_blocks: b.q_blocks,
            start_blocks: b.start_blocks,
            kept_pairs: b.kept_pairs,
            total_pairs: b.total_pairs,
            delta: b.delta,
            c: b.c,
        })
    }

    /// The first `t` tokens.
    pub fn prefix(&self, t: usize) -> Result<Problem> {
        if t == 0 || t > self.t {
            return Err(Error::invalid(format!(
                "prefix of {t} tokens of a {}-token problem",
                self.t
            )));
        }
        let (h, d) = (self.heads, self.head_dim);
        Ok(Problem {
            t,
            heads: h,
            head_dim: d,
            q: self.q[..t * h * d].to_vec(),
            k: self.k[..t * h * d].to_vec(),
            v: self.v[..t * h * d].to_vec(),
            log_f: self.log_f[..t * h].to_vec(),
            u: self.u.clone(),
        })
    }

    /// The heads of every part side by side (same `t` and `head_dim`): heads are
    /// independent in attention, so layers' calls can be run as one wider call.
    pub fn concat_heads(parts: &[Problem]) -> Result<Problem> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat_heads: no problem"))?;
        let (t, d) = (first.t, first.head_dim);
        if parts.iter().any(|p| p.t != t || p.head_dim != d) {
            return Err(Error::invalid(
                "concat_heads: parts differ in t or head_dim",
            ));
        }
        let heads: usize = parts.iter().map(|p| p.heads).sum();
        let mut o = Problem {
            t,
            heads,
            head_dim: d,
            q: Vec::with_capacity(t * heads * d),
            k: Vec::with_capacity(t * heads * d),
            v: Vec::with_capacity(t * heads * d),
            log_f: Vec::with_capacity(t * heads),
            u: parts.iter().flat_map(|p| p.u.iter().copied()).collect(),
        };
        for r in 0..t {
            for p in parts {
                let row = r * p.heads * d..(r + 1) * p.heads * d;
                o.q.extend_from_slice(&p.q[row.clone()]);
                o.k.extend_from_slice(&p.k[row.clone()]);
                o.v.extend_from_slice(&p.v[row]);
                o.log_f
                    .extend_from_slice(&p.log_f[r * p.heads..(r + 1) * p.heads]);
            }
        }
        Ok(o)
    }

    /// The parts one after another in time (same heads and `head_dim`; `u` = the largest
    /// bound of each head, so it bounds every part).
    pub fn concat_time(parts: &[Problem]) -> Result<Problem> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat_time: no problem"))?;
        let (h, d) = (first.heads, first.head_dim);
        if parts.iter().any(|p| p.heads != h || p.head_dim != d) {
            return Err(Error::invalid(
                "concat_time: parts differ in heads or head_dim",
            ));
        }
        let mut o = Problem {
            t: parts.iter().map(|p| p.t).sum(),
            heads: h,
            head_dim: d,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            log_f: Vec::new(),
            u: vec![0.0; h],
        };
        for p in parts {
            o.q.extend_from_slice(&p.q);
            o.k.extend_from_slice(&p.k);
            o.v.extend_from_slice(&p.v);
            o.log_f.extend_from_slice(&p.log_f);
            for (a, b) in o.u.iter_mut().zip(&p.u) {
                *a = a.max(*b);
            }
        }
        Ok(o)
    }

    /// A decode step at position `n - 1`: the cache holds tokens `0..n` of every head (the
    /// query's own key included), the query is token `n - 1`'s q.
    pub fn decode_at(&self, n: usize) -> Result<DecodeProblem> {
        self.validate()?;
        if n == 0 || n > self.t {
            return Err(Error::invalid(format!(
                "decode at {n} entries of a {}-token problem",
                self.t
            )));
        }
        let (h, d) = (self.heads, self.head_dim);
        let mut p = DecodeProblem {
            heads: h,
            head_dim: d,
            n,
            k: AlignedF32::with_capacity(h * n * d),
            v: AlignedF32::with_capacity(h * n * d),
            c: vec![0.0; h * n],
            q: Vec::with_capacity(h * d),
            q_c: Vec::with_capacity(h),
            u: self.u.clone(),
            steps: StepState::new(h, n),
        };
        for head in 0..h {
            for r in 0..n {
                p.k.extend_from_slice(&self.k[(r * h + head) * d..][..d]);
                p.v.extend_from_slice(&self.v[(r * h + head) * d..][..d]);
            }
            let c = &mut p.c[head * n..(head + 1) * n];
            gate::cumsum_strided(&self.log_f[head..], h, 0.0, c).map_err(core_err)?;
            p.q.extend_from_slice(&self.q[((n - 1) * h + head) * d..][..d]);
            p.q_c.push(c[n - 1]);
        }
        Ok(p)
    }
}

/// One decode step of one query per head against `n` cached entries per head.
///
/// A backend may keep the cache resident between [`Engine::decode`] calls (each call is a
/// step that rewrote only the newest row): after changing `k`, `v` or `c` in place, call
/// [`Engine::release`] or decode a clone (a clone is a new cache).
///
/// `k`, `v`: `[heads, n, head_dim]`; `c`: `[heads, n]` (f64, non-increasing);
/// `q`: `[heads, head_dim]`; `q_c`: `[heads]`; `u`: `[heads]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeProblem {
    pub heads: usize,
    pub head_dim: usize,
    pub n: usize,
    /// 64-byte aligned, as a session's cache is ([`AlignedF32`]).
    pub k: AlignedF32,
    pub v: AlignedF32,
    pub c: Vec<f64>,
    pub q: Vec<f32>,
    pub q_c: Vec<f64>,
    pub u: Vec<f64>,
    /// Cache identity and row versions: each [`Engine::decode`] is one step of a session
    /// whose newest row was just written (see [`StepSync`]), so a backend that keeps the
    /// cache resident sends one row per head per step after the first.
    steps: StepState,
}

/// [`StepSync`] behind a lock, so that steps can run through `&DecodeProblem`. A clone is
/// a new cache (fresh ids); equality ignores it.
#[derive(Debug)]
struct StepState(Mutex<StepSync>);

impl StepState {
    fn new(heads: usize, n: usize) -> StepState {
        StepState(Mutex::new(StepSync::new(heads, n)))
    }
}

impl Clone for StepState {
    fn clone(&self) -> StepState {
        let (h, n) = self
            .0
            .lock()
            .map(|s| (s.heads, s.row_version.len()))
            .unwrap_or((0, 0));
        StepState::new(h, n)
    }
}

impl PartialEq for StepState {
    fn eq(&self, _: &StepState) -> bool {
        true
    }
}

impl DecodeProblem {
    /// Views of each head's cache, with `sync(head)` as its change tracking.
    fn cache_heads<'a>(
        &'a self,
        sync: impl Fn(usize) -> Option<CacheSync<'a>>,
    ) -> Vec<CacheHead<'a>> {
        let (n, d) = (self.n, self.head_dim);
        (0..self.heads)
            .map(|h| CacheHead {
                k: &self.k[h * n * d..(h + 1) * n * d],
                v: &self.v[h * n * d..(h + 1) * n * d],
                c: &self.c[h * n..(h + 1) * n],
                pos: None,
                sync: sync(h),
            })
            .collect()
    }

    /// The decode call of this problem's one query per head over `heads` (from
    /// [`DecodeProblem::cache_heads`]).
    fn call<'a>(&'a self, heads: &'a [CacheHead<'a>], acp: Acp<'a>) -> DecodeCall<'a> {
        DecodeCall {
            head_dim: self.head_dim,
            n_queries: 1,
            q: &self.q,
            q_c: &self.q_c,
            q_pos: None,
            heads,
            acp,
        }
    }

    /// The cache ids ([`CacheSync::id`]) of this problem's heads.
    pub fn cache_ids(&self) -> Vec<u64> {
        let base = self.steps.0.lock().map_or(0, |s| s.base);
        (0..self.heads as u64).map(|h| base + h).collect()
    }

    /// Checks sizes and finiteness.
    pub fn validate(&self) -> Result<()> {
        self.check_sizes()?;
        if self.c.iter().chain(&self.q_c).any(|c| !c.is_finite()) {
            return Err(Error::invalid("decode problem: c must be finite"));
        }
        Ok(())
    }

    /// Checks sizes and the bounds (finite, `>= 0`); O(heads), not O(cache).
    pub fn check_sizes(&self) -> Result<()> {
        let (h, n, d) = (self.heads, self.n, self.head_dim);
        if h == 0 || n == 0 || d == 0 {
            return Err(Error::invalid(
                "decode problem: heads, n, head_dim must be > 0",
            ));
        }
        for (name, len, want) in [
            ("k", self.k.len(), h * n * d),
            ("v", self.v.len(), h * n * d),
            ("c", self.c.len(), h * n),
            ("q", self.q.len(), h * d),
            ("q_c", self.q_c.len(), h),
            ("u", self.u.len(), h),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "decode problem: {name} has {len} values, expected {want}"
                )));
            }
        }
        if self.u.iter().any(|u| !(u.is_finite() && *u >= 0.0)) {
            return Err(Error::invalid(
                "decode problem: bounds must be finite and >= 0",
            ));
        }
        Ok(())
    }
}

/// A backend driven directly on [`Problem`]s (benchmarks, tools, tests), with the same
/// selection and fallback rules as a session's.
#[derive(Debug)]
pub struct Engine {
    inner: EngineInner,
}

#[derive(Debug)]
enum EngineInner {
    Cpu(CpuBackend),
    Sched(Box<Scheduler>),
}

impl Engine {
    /// The backend `kind` on the device `FOXEDGE_VULKAN_DEVICE` names (or the best one).
    pub fn new(kind: BackendKind) -> Result<Engine> {
        Engine::with_device(kind, None)
    }

    /// The backend `kind` on `device` (an index or a name substring; None = the
    /// environment variable, else the best device). `auto` without a device is the CPU.
    pub fn with_device(kind: BackendKind, device: Option<&str>) -> Result<Engine> {
        let mode = match kind {
            BackendKind::Cpu => {
                return Ok(Engine {
                    inner: EngineInner::Cpu(CpuBackend),
                });
            }
            BackendKind::Vulkan => Mode::GpuOnly,
            BackendKind::Hybrid => Mode::Hybrid,
            BackendKind::Auto => Mode::Auto,
        };
        let inner = match open_gpu(device) {
            Ok(gpu) => EngineInner::Sched(Box::new(Scheduler::new(mode, gpu))),
            Err(e) if mode == Mode::Auto => {
                note_auto_cpu(&e);
                EngineInner::Cpu(CpuBackend)
            }
            Err(e) => return Err(e),
        };
        Ok(Engine { inner })
    }

    /// An `auto` engine whose GPU side does no work: its decode writes zeros and returns,
    /// its prefill runs the CPU kernels; concurrent, so every plan is weighed. A decode
    /// step's time is then `auto`'s own (counting, planning, bookkeeping): what
    /// `benches/backends.rs` measures as `auto_overhead`. Its decode outputs are not
    /// attention; for benches only.
    #[doc(hidden)]
    pub fn auto_over_idle_device() -> Engine {
        let gpu = Gpu {
            backend: Box::new(IdleDevice),
            name: "idle device (benches)".into(),
            concurrent: true,
        };
        Engine {
            inner: EngineInner::Sched(Box::new(Scheduler::new(Mode::Auto, gpu))),
        }
    }

    fn backend(&self) -> &dyn AttentionBackend {
        match &self.inner {
            EngineInner::Cpu(c) => c,
            EngineInner::Sched(s) => s.as_ref(),
        }
    }

    /// The backend in effect (`cpu` after a fallback).
    pub fn kind(&self) -> BackendKind {
        self.backend().kind()
    }

    /// The Vulkan device's name, if one is open.
    pub fn device(&self) -> Option<String> {
        match &self.inner {
            EngineInner::Sched(s) => Some(s.gpu_name().to_string()),
            EngineInner::Cpu(_) => None,
        }
    }

    /// Whether the GPU failed and the CPU took over.
    pub fn fell_back(&self) -> bool {
        matches!(&self.inner, EngineInner::Sched(s) if s.fell_back())
    }

    /// The cost calibration (after the first call of a `hybrid` or `auto` engine).
    pub fn calibration(&self) -> Option<Calibration> {
        match &self.inner {
            EngineInner::Sched(s) => s.calibration(),
            EngineInner::Cpu(_) => None,
        }
    }

    /// Where the heads of the last call ran (`cpu`: all on the CPU).
    pub fn last_split(&self) -> Option<Split> {
        match &self.inner {
            EngineInner::Sched(s) => s.last_split(),
            EngineInner::Cpu(_) => None,
        }
    }

    /// Frees what the backend keeps of `p`'s cache (a device mirror); a later decode of
    /// `p` sends its whole cache again.
    pub fn release(&self, p: &DecodeProblem) {
        self.backend().release_cache(&p.cache_ids());
    }

    /// Calls so far by plan (a `cpu` engine counts none).
    pub fn plan_counts(&self) -> PlanCounts {
        match &self.inner {
            EngineInner::Sched(s) => s.plan_counts(),
            EngineInner::Cpu(_) => PlanCounts::default(),
        }
    }

    /// Runs the calibration now (a no-op for `cpu` and `vulkan`, and once calibrated).
    pub fn calibrate(&self, heads: usize, head_dim: usize) -> Result<Option<Calibration>> {
        match &self.inner {
            EngineInner::Sched(s) => s.costs(heads, head_dim),
            EngineInner::Cpu(_) => Ok(None),
        }
    }

    /// Prefill of `p` into `out` (`[t, heads, head_dim]`).
    pub fn prefill(&self, p: &Problem, acp: AcpMode, out: &mut [f32]) -> Result<CallStats> {
        p.validate()?;
        if out.len() != p.q.len() {
            return Err(Error::invalid(format!(
                "prefill out has {} values, expected {}",
                out.len(),
                p.q.len()
            )));
        }
        Ok(self.backend().prefill(&p.call(acp), out)?.into())
    }

    /// One decode step of `p` into `out` (`[heads, head_dim]`).
    ///
    /// Checks sizes and bounds only, as a session's step does: every backend's kernel
    /// rejects a non-finite `c` itself (a scan of `heads · n` values here would be a
    /// serial pass over the cache at every step, ~0.5 ms at 16 x 64k entries).
    pub fn decode(&self, p: &DecodeProblem, acp: AcpMode, out: &mut [f32]) -> Result<CallStats> {
        p.check_sizes()?;
        if out.len() != p.q.len() {
            return Err(Error::invalid(format!(
                "decode out has {} values, expected {}",
                out.len(),
                p.q.len()
            )));
        }
        let mut steps = lock(&p.steps.0)?;
        if steps.row_version.len() != p.n || steps.heads != p.heads {
            // The sizes were changed through the public fields: a new cache.
            *steps = StepSync::new(p.heads, p.n);
        }
        steps.step();
        let heads = p.cache_heads(|h| Some(steps.sync(h)));
        let call = p.call(&heads, acp.to_acp(&p.u));
        Ok(self.backend().decode(&call, out)?.into())
    }
}

/// The GPU side of [`Engine::auto_over_idle_device`]: decode does no work.
#[derive(Debug)]
struct IdleDevice;

impl AttentionBackend for IdleDevice {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        CpuBackend.prefill(call, out)
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        out.fill(0.0);
        let n = call.heads.len();
        Ok(AttentionStats {
            kept_pairs: vec![0; n],
            total_pairs: vec![0; n],
        })
    }
}

/// Records each prefill call's inputs, then runs it on the CPU.
#[derive(Debug)]
struct Recorder {
    calls: Arc<Mutex<Vec<Problem>>>,
}

impl AttentionBackend for Recorder {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let u = match call.acp {
            Acp::Bound { u, .. } => u.to_vec(),
            // Observed norms: U from this call's q and k (Cauchy-Schwarz), per head.
            _ => {
                let (nh, d) = (call.heads, call.head_dim);
                let scale = 1.0 / (d as f64).sqrt();
                (0..nh)
                    .map(|h| {
                        let mx = |x: &[f32]| {
                            (0..call.t)
                                .map(|r| {
                                    x[(r * nh + h) * d..][..d]
                                        .iter()
                                        .map(|v| f64::from(*v) * f64::from(*v))
                                        .sum::<f64>()
                                        .sqrt()
                                })
                                .fold(0.0f64, f64::max)
                        };
                        scale * mx(call.q) * mx(call.k)
                    })
                    .collect()
            }
        };
        lock(&self.calls)?.push(Problem {
            t: call.t,
            heads: call.heads,
            head_dim: call.head_dim,
            q: call.q.to_vec(),
            k: call.k.to_vec(),
            v: call.v.to_vec(),
            log_f: call.log_f.to_vec(),
            u,
        });
        CpuBackend.prefill(call, out)
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        CpuBackend.decode(call, out)
    }
}

/// Runs `model` over `tokens` (one prefill chunk, a fresh session) and returns the
/// attention inputs of every layer (q and k after QK-norm, log gates as the kernels get
/// them, the layer's logit bounds): one [`Problem`] per layer.
pub fn capture_prefill(model: &Arc<Model>, tokens: &[u32]) -> Result<Vec<Problem>> {
    if tokens.len() < 2 {
        return Err(Error::invalid("capture_prefill needs at least 2 tokens"));
    }
    let opts = SessionOptions {
        prefill_chunk: tokens.len(),
        max_entries_per_head: tokens
            .len()
            .max(SessionOptions::default().max_entries_per_head),
        certified_eviction: false,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model.clone(), opts)?;
    let calls = Arc::new(Mutex::new(Vec::new()));
    s.set_backend(Box::new(Recorder {
        calls: calls.clone(),
    }));
    s.feed(tokens, None)?;
    let mut v = lock(&calls)?;
    let layers = model.info().layers;
    if v.len() != layers {
        return Err(Error::Internal(format!(
            "capture_prefill: {} attention calls for {layers} layers",
            v.len()
        )));
    }
    Ok(std::mem::take(&mut *v))
}

/// Token rows of an int32 `.npy` of shape `[B, T]` (or `[T]`), e.g. the fixture
/// `long_input_ids.npy` (8 x 16384 held-out bytes).
pub fn read_token_rows(path: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    let arr = crate::npy::NpyArray::read(path)?;
    let ids = arr.to_i32()?;
    let (b, t) = match arr.shape.as_slice() {
        [t] => (1, *t),
        [b, t] => (*b, *t),
        s => {
            return Err(Error::invalid(format!(
                "{}: token ids must be [T] or [B, T], got {s:?}",
                path.display()
            )));
        }
    };
    if b == 0 || t == 0 {
        return Err(Error::invalid(format!("{}: no tokens", path.display())));
    }
    ids.chunks(t)
        .map(|row| {
            row.iter()
                .map(|&x| {
                    u32::try_from(x).map_err(|_| {
                        Error::invalid(format!("{}: negative token {x}", path.display()))
                    })
                })
                .collect()
        })
        .collect()
}

/// The attention of every layer of `model` on real text, as one problem of
/// `layers * heads` heads (heads are independent, so the layers' calls stack side by side)
/// and `len` tokens. Up to one row's length it is the model run over the start of row 0;
/// beyond, the model runs over whole rows 0, 1, ... and their inputs are joined in time
/// (real gates of consecutive documents; `c` keeps falling across the joins).
pub fn real_gate_problem(model: &Arc<Model>, rows: &[Vec<u32>], len: usize) -> Result<Problem> {
    let row_len = rows.first().map_or(0, Vec::len);
    if len == 0 || row_len < 2 {
        return Err(Error::invalid(
            "real_gate_problem: need len > 0 and rows of >= 2 tokens",
        ));
    }
    if len <= row_len {
        let layers = capture_prefill(model, &rows[0][..len.max(2)])?;
        return Problem::concat_heads(&layers)?.prefix(len);
    }
    let need = len.div_ceil(row_len);
    if need > rows.len() {
        return Err(Error::invalid(format!(
            "real_gate_problem: {len} tokens need {need} rows of {row_len}, have {}",
            rows.len()
        )));
    }
    let parts = rows[..need]
        .iter()
        .map(|r| Problem::concat_heads(&capture_prefill(model, r)?))
        .collect::<Result<Vec<_>>>()?;
    Problem::concat_time(&parts)?.prefix(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cost(a: f64, b: f64) -> LinearCost {
        LinearCost { a, b, c: 0.0 }
    }

    /// Work with one row per head (row costs are tested separately).
    fn w(pairs: &[u64]) -> Vec<Work> {
        pairs
            .iter()
            .map(|&p| Work {
                pairs: p,
                rows: 1,
                gpu_rows: 1,
            })
            .collect()
    }

    /// `plan` with no measurements yet.
    fn plan0(
        work: &[Work],
        c: LinearCost,
        g: LinearCost,
        conc: bool,
        mode: Mode,
        split_cost: f64,
    ) -> Split {
        plan(
            work.len(),
            &candidates(work, c, g, |_| (1.0, 1.0), conc, split_cost),
            mode,
            &ClassRecord::default(),
            EXPLORE,
            0.0,
            1.0,
        )
        .0
    }

    /// Predicted time of putting `gpu` heads on the GPU (the rule `candidates` minimises).
    fn predicted(work: &[Work], gpu: &[usize], c: LinearCost, g: LinearCost, conc: bool) -> f64 {
        let gw = gpu.iter().fold(Work::default(), |a, &h| a + work[h]);
        let cw = work.iter().fold(Work::default(), |a, &x| a + x) - gw;
        let (tc, tg) = (
            c.predict(cw.pairs, cw.rows, gpu.len() == work.len()),
            g.predict(gw.pairs, gw.gpu_rows, gpu.is_empty()),
        );
        if conc { tc.max(tg) } else { tc + tg }
    }

    #[test]
    fn contention_is_measured_from_the_sides_alone_and_together() {
        // CPU side 1 ms alone, 2.5 ms in the split of which 0.3 ms waited for the GPU's
        // packing; GPU side 1 ms alone (packed after 0.3), 1.5 ms in the split. Both ran
        // at once for 0.7 ms: the CPU side took 1.2 ms more (x2.71 while both ran), the
        // GPU side 0.5 more (x1.71).
        let k = Contention::measured(1e-3, 1e-3, 0.3e-3, 2.5e-3, 1.5e-3);
        assert!((k.cpu_factor - (1.0 + 1.2 / 0.7)).abs() < 1e-9, "{k}");
        assert!((k.gpu_factor - (1.0 + 0.5 / 0.7)).abs() < 1e-9, "{k}");
        assert!((k.pack - 0.3).abs() < 1e-9, "{k}");
        // The sides of that split come back.
        let (c, g) = k.sides(1e-3, 1e-3);
        assert!(
            (c - 2.5e-3).abs() < 1e-12 && (g - 1.5e-3).abs() < 1e-12,
            "{c} {g}"
        );
        // A small CPU side overlaps the GPU side briefly and slows it little.
        let (c, g) = k.sides(0.1e-3, 1e-3);
        assert!(
            (c - (0.3e-3 + 0.1e-3 * (1.0 + 1.2 / 0.7))).abs() < 1e-12,
            "{c}"
        );
        assert!((g - (1e-3 + 0.05e-3 / 0.7)).abs() < 1e-12, "{g}");
        // A side faster beside the other is noise (1); a hiccup is capped; bad timings
        // measure nothing.
        let k = Contention::measured(1e-3, 1e-3, f64::INFINITY, 0.5e-3, 90e-3);
        assert_eq!(
            (k.cpu_factor, k.gpu_factor, k.pack),
            (1.0, Contention::MAX_FACTOR, 0.0)
        );
        for bad in [0.0, f64::NAN, f64::INFINITY, -1.0] {
            assert_eq!(
                Contention::measured(bad, 1e-3, 0.0, 1e-3, 1e-3),
                Contention::NONE
            );
            assert_eq!(
                Contention::measured(1e-3, 1e-3, 0.0, 1e-3, bad),
                Contention::NONE
            );
        }
    }

    #[test]
    fn contention_prices_the_splits_a_free_model_prefers() {
        // 16 equal heads; the GPU costs 0.4 ms a call + 0.05 ms a head, the CPU 0.3 ms a
        // head: free of contention, 13 GPU heads + 3 CPU heads (1.05 vs 0.9 ms) win over the
        // GPU alone (1.2 ms). With contention as on the H100 host, every split costs more
        // than the GPU alone (13 + 3: GPU side 1.34, CPU side 1.80 ms; 15 + 1: GPU side
        // 1.27), so auto keeps the GPU, while hybrid still splits.
        let work: Vec<Work> = (0..16)
            .map(|_| Work {
                pairs: 1,
                rows: 1000,
                gpu_rows: 1000,
            })
            .collect();
        let (c, g) = (
            LinearCost {
                a: 0.0,
                b: 0.0,
                c: 0.3e-6,
            },
            LinearCost {
                a: 0.4e-3,
                b: 0.0,
                c: 0.05e-6,
            },
        );
        let free = Costing::new(&work, c, g, |_| (1.0, 1.0), true, 10e-6).search();
        let (t, heads) = free.split.clone().unwrap();
        assert!(t < free.gpu && heads.len() < 16, "{free:?}");
        let k = Contention {
            cpu_factor: 1.8,
            gpu_factor: 1.4,
            pack: 0.3,
        };
        let contended = Costing::new(&work, c, g, |_| (1.0, 1.0), true, 10e-6)
            .contended(k)
            .search();
        let (t, _) = contended.split.clone().unwrap();
        assert!(t > contended.gpu, "{contended:?}");
        assert_eq!((contended.cpu, contended.gpu), (free.cpu, free.gpu));
        let rec = ClassRecord::default();
        let (s, _) = plan(16, &contended, Mode::Auto, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!(s.gpu_heads.len(), 16);
        let (s, _) = plan(16, &contended, Mode::Hybrid, &rec, EXPLORE, 0.0, 1.0);
        assert!(!s.gpu_heads.is_empty() && !s.cpu_heads.is_empty());
    }

    #[test]
    fn measured_side_factors_divide_a_split() {
        // 16 equal heads, CPU and GPU equally fast by the model: half each. Measured, the
        // all-GPU plan ran 5x its model: the split gives the GPU 2 heads (max(5 g, 16 - g) is
        // least there: 14 ms), and the plain plans keep their raw predictions.
        let work = w(&[1_000_000; 16]);
        let (c, g) = (cost(0.0, 1e-9), cost(0.0, 1e-9));
        let even = candidates(&work, c, g, |_| (1.0, 1.0), true, 0.0);
        assert_eq!(even.split.as_ref().map(|s| s.1.len()), Some(8));
        let slow_gpu = candidates(&work, c, g, |_| (1.0, 5.0), true, 0.0);
        let (t, heads) = slow_gpu.split.clone().unwrap();
        assert_eq!(heads.len(), 2);
        assert!((t - 14.0 * 1e-3).abs() < 1e-12, "{t}");
        assert_eq!((slow_gpu.cpu, slow_gpu.gpu), (even.cpu, even.gpu));
    }

    #[test]
    fn heavy_heads_go_to_a_faster_gpu() {
        // GPU 4x faster per pair, larger fixed cost; two global heads, six local ones.
        let work = w(&[10, 1_000_000, 12, 9, 900_000, 11, 10, 8]);
        let s = plan0(
            &work,
            cost(1e-5, 4e-9),
            cost(1e-4, 1e-9),
            true,
            Mode::Hybrid,
            0.0,
        );
        assert_eq!(s.gpu_heads, vec![1, 4]);
        assert_eq!(s.cpu_heads, vec![0, 2, 3, 5, 6, 7]);
    }

    #[test]
    fn row_costly_gpu_takes_the_densest_heads() {
        // Equal rows; the GPU is cheap per pair but pays per row (host transfers): the
        // heads with the most kept pairs per row go to it, the pruned ones stay.
        let work: Vec<Work> = [2_000, 8_000_000, 3_000, 7_000_000]
            .iter()
            .map(|&pairs| Work {
                pairs,
                rows: 4096,
                gpu_rows: 4096,
            })
            .collect();
        let cpu = LinearCost {
            a: 1e-5,
            b: 1e-9,
            c: 0.0,
        };
        let gpu = LinearCost {
            a: 1e-4,
            b: 1e-10,
            c: 2e-7,
        };
        let s = plan0(&work, cpu, gpu, true, Mode::Auto, 0.0);
        assert_eq!(s.gpu_heads, vec![1, 3]);
        // Calibration fit recovers a, b, c from exact samples.
        let truth = LinearCost {
            a: 2e-4,
            b: 3e-10,
            c: 5e-8,
        };
        let smp = |pairs: u64, rows: u64| Sample {
            pairs,
            rows,
            secs: truth.predict(pairs, rows, false),
        };
        let f = LinearCost::fit(smp(8_000, 1_000), smp(500_000, 4_000), smp(60_000, 4_000));
        for (x, y) in [(f.a, truth.a), (f.b, truth.b), (f.c, truth.c)] {
            assert!((x - y).abs() <= 1e-9 * y.abs().max(1e-12) + 1e-18, "{f:?}");
        }
    }

    #[test]
    fn resident_heads_cost_only_their_changed_rows() {
        // Decode: the GPU pays 300 ns per row sent; a head it mirrors sends 1 row, a new
        // one all 65536. The resident heavy heads go to the GPU, nothing else.
        let n = 65_536;
        let work: Vec<Work> = (0..4)
            .map(|h| Work {
                pairs: if h < 2 { n } else { n / 16 },
                rows: n,
                gpu_rows: if h < 2 { 1 } else { n },
            })
            .collect();
        let cpu = LinearCost {
            a: 5e-5,
            b: 2e-9,
            c: 1e-9,
        };
        let gpu = LinearCost {
            a: 5e-5,
            b: 2e-11,
            c: 3e-7,
        };
        let s = plan0(&work, cpu, gpu, true, Mode::Hybrid, 1e-5);
        assert_eq!(s.gpu_heads, vec![0, 1]);
    }

    /// `calls` calls of `auto` in one class of 16 equal heads whose split sides are costed
    /// by `side(rec, k)`, each plan taking `truth(gpu heads)` = (seconds, split sides);
    /// returns the total seconds and the last call's GPU heads.
    fn run_class(
        calls: usize,
        side: impl Fn(&ClassRecord, usize) -> (f64, f64),
        truth: impl Fn(usize) -> (f64, Option<(f64, f64)>),
    ) -> (f64, usize) {
        let work = w(&[1_000_000; 16]);
        let (cpu, gpu) = (cost(50e-6, 5.9375e-11), cost(630e-6, 1.0625e-11));
        let mut rec = ClassRecord::default();
        let mut last = 0;
        for _ in 0..calls {
            let cands = candidates(&work, cpu, gpu, |k| side(&rec, k), true, 50e-6);
            let (split, pick) = plan(16, &cands, Mode::Auto, &rec, EXPLORE_DECODE, 0.0, 1.0);
            let (secs, sides) = truth(split.gpu_heads.len());
            let raw = split.predicted_seconds;
            let (mut ratio_s, mut judged) = (raw, secs);
            if let (PlanKind::Split, Some(cg)) = (pick.kind, sides) {
                let heads = split.gpu_heads.len();
                let sample = (secs, pick.probe_of().is_some());
                judged = fold_split_sides(&mut rec, heads, cands.split_sides, cg, sample, true);
                if let Some(r) = recosted_split(&rec, heads, cands.split_sides, 50e-6, true) {
                    ratio_s = r;
                }
            }
            rec.record_judged(pick.kind, raw, ratio_s, secs, judged, pick.probe_of());
            last = split.gpu_heads.len();
        }
        (rec.spent(), last)
    }

    /// The class of [`run_class`] as at the H100 host's decode ACP 64k: the model (CPU
    /// 1.0 ms, GPU 0.8 ms for all 16 heads) misses a GPU cost of 0.11 ms per head (all 16:
    /// 2.11 ms), and the CPU runs 1.1x its model, 1.21x on the split pool. With `k` GPU
    /// heads: (seconds, split sides), each time scaled by a call of `noise`.
    fn split_truth(k: usize, noise: impl FnMut() -> f64) -> (f64, Option<(f64, f64)>) {
        class_truth(k, 1.1e-3, |k| 0.35e-3 + 0.11e-3 * k as f64, 1.0, noise)
    }

    /// A [`run_class`] truth: with `k` GPU heads of 16, (seconds, split sides). The CPU plan
    /// takes `cpu_all`, the GPU plan `gpu_side(16)`; a split's CPU side is its heads on the
    /// split pool (the CPU's model at 1.21x) times `cold`, its GPU side `gpu_side(k)`, and it
    /// takes the slower side plus 50 us. Each time (each side) is scaled by a call of `noise`.
    fn class_truth(
        k: usize,
        cpu_all: f64,
        gpu_side: impl Fn(usize) -> f64,
        cold: f64,
        mut noise: impl FnMut() -> f64,
    ) -> (f64, Option<(f64, f64)>) {
        let cpu_side = |heads: usize| 1.21 * (50e-6 + 5.9375e-11 * 1e6 * heads as f64);
        match k {
            0 => (cpu_all * noise(), None),
            16 => (gpu_side(16) * noise(), None),
            k => {
                let c = cpu_side(16 - k) * cold * noise();
                let g = gpu_side(k) * noise();
                (c.max(g) + 50e-6, Some((c, g)))
            }
        }
    }

    /// `ratio(rng)` over 100 seeds, each with its own xorshift state for [`unit`]: (median,
    /// 90th percentile).
    fn over_seeds(ratio: impl Fn(&std::cell::Cell<u64>) -> f64) -> (f64, f64) {
        let mut ratios: Vec<f64> = (1..=100u64)
            .map(|seed| {
                ratio(&std::cell::Cell::new(
                    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                ))
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        (ratios[50], ratios[90])
    }

    #[test]
    fn split_heads_settle_where_the_measured_sides_meet() {
        // `split_truth` without noise: the best plan is the 5-head split (0.95 ms against
        // the CPU's 1.1).
        let truth = |k: usize| split_truth(k, || 1.0);
        let best = (0..=16).map(|k| truth(k).0).fold(f64::INFINITY, f64::min);
        assert!((best - 0.95e-3).abs() < 1e-9, "{best}");
        let calls = 600;
        let (spent, heads) = run_class(calls, split_side_factors, truth);
        let ratio = spent / (calls as f64 * best);
        assert!(ratio <= 1.05, "{ratio}");
        assert!((4..=6).contains(&heads), "{heads}");
        // Costed with the all-CPU and all-GPU plans' prospects alone (the learner before
        // the sides were measured), the split is a 1-head split, slower than the CPU plan.
        let prospects = |rec: &ClassRecord, _| {
            (
                rec.prospect(PlanKind::Cpu).unwrap_or(1.0),
                rec.prospect(PlanKind::Gpu).unwrap_or(1.0),
            )
        };
        let (spent, _) = run_class(calls, prospects, truth);
        let ratio = spent / (calls as f64 * best);
        assert!(ratio >= 1.12, "{ratio}");
    }

    /// The next of a xorshift sequence in `rng`, as a uniform number in [0, 1).
    fn unit(rng: &std::cell::Cell<u64>) -> f64 {
        let mut x = rng.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        rng.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn noisy_sides_still_settle_near_the_best_split() {
        // `split_truth`, each plan's call and each side of a split 0.9-1.3x its time at
        // random (100 seeds). Against the best fixed plan under the same noise (a 4- to
        // 6-head split; the CPU plan is 1.12-1.13x it), auto's median is 1.025 and its 90th
        // percentile 1.033 (1.039 and 1.062 with the sides' windows of 5 calls and the
        // split's factor over its cost when picked); costed with the prospects alone (the
        // earlier learner), seeds 1-5 read 1.145-1.173.
        let (median, p90) = over_seeds(|rng| {
            let noise = || 0.9 + 0.4 * unit(rng);
            let truth = |k: usize| split_truth(k, &noise);
            let (spent, _) = run_class(600, split_side_factors, truth);
            let fixed = |k: usize| (0..600).map(|_| truth(k).0).sum::<f64>();
            spent / (0..=16).map(fixed).fold(f64::INFINITY, f64::min)
        });
        eprintln!("noisy sides: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.05 && p90 <= 1.07, "{median} {p90}");
    }

    /// auto / the best fixed plan over 100 seeds of 2000 calls of a class as at the H100
    /// host's decode dense 4k: CPU and GPU plans within 2% of each other, and a 7-head split
    /// 22% faster than either. Each plan's call and each side of a split take 0.9-1.3x their
    /// time at random, and with `burst` probability 2.5x that. Returns (median, 90th
    /// percentile).
    fn near_tie_ratios(burst: f64) -> (f64, f64) {
        over_seeds(|rng| {
            let u = || unit(rng);
            let noise = || {
                let b = if u() < burst { 2.5 } else { 1.0 };
                b * (0.9 + 0.4 * u())
            };
            let gpu_side = |k: usize| 0.6e-3 + 0.03e-3 * k as f64;
            let truth = |k: usize| class_truth(k, 1.1e-3, gpu_side, 1.0, noise);
            let (spent, _) = run_class(2000, split_side_factors, truth);
            let fixed = |k: usize| (0..2000).map(|_| truth(k).0).sum::<f64>();
            spent / (0..=16).map(fixed).fold(f64::INFINITY, f64::min)
        })
    }

    #[test]
    fn a_near_tie_split_holds_through_bursts() {
        // (median, 90th percentile). With the sides' windows of 5 calls (`feedback::WINDOW`)
        // the split's costed time moved with every call (0.17-0.32 ms for one 12-head split
        // of a decode dense 4k class, trace 512): 1.024 / 1.038 without bursts, 1.077 /
        // 1.172 with 5% of them. With windows of `feedback::LONG_WINDOW`: 1.014 / 1.021 and
        // 1.040 / 1.087; with the split's factor taken over its cost at its sides' factors
        // as they stand after the call (`ClassRecord::record_against`): 1.014 / 1.020 and
        // 1.038 / 1.096; with a probe's sample judged at its settled CPU side
        // (`fold_split_sides`): 1.014 / 1.020 and 1.038 / 1.090.
        let (median, p90) = near_tie_ratios(0.0);
        eprintln!("near tie, no bursts: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.02 && p90 <= 1.03, "{median} {p90}");
        let (median, p90) = near_tie_ratios(0.05);
        eprintln!("near tie, 5% bursts: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.05 && p90 <= 1.11, "{median} {p90}");
    }

    /// auto / the best fixed plan (median, 90th percentile over 100 seeds of 2000 calls) in
    /// a class like the H100 host's decode ACP 64k (trace 602): the GPU plan 0.5 ms, the
    /// CPU's 1.7 ms, a 12-head split 10% faster than the GPU. A split's CPU side runs cold
    /// after a run of other plans: after more than 5 calls without a split, 2x its time in
    /// the run's first call and 1.6x in its second (1.2x in the first after a shorter
    /// gap), as its CPU side over its GPU side read in traces 550-552 and 602. Each call
    /// and side 0.9-1.3x.
    fn cold_split_ratios() -> (f64, f64) {
        use std::cell::Cell;
        over_seeds(|rng| {
            let noise = || 0.9 + 0.4 * unit(rng);
            // Calls since the last split; the current run of splits; the gap before it.
            let (since, run, gap) = (Cell::new(usize::MAX / 2), Cell::new(0), Cell::new(0));
            let gpu_side = |k: usize| 0.1e-3 + 0.025e-3 * k as f64;
            let truth = |k: usize| {
                if k != 0 && k != 16 {
                    if since.get() > 0 {
                        gap.set(since.get());
                        run.set(0);
                    }
                    run.set(run.get() + 1);
                    since.set(0);
                } else {
                    since.set(since.get() + 1);
                }
                let cold = match (run.get(), gap.get() > 5) {
                    (1, true) => 2.0,
                    (2, true) => 1.6,
                    (1, false) => 1.2,
                    _ => 1.0,
                };
                class_truth(k, 1.7e-3, gpu_side, cold, noise)
            };
            let (spent, _) = run_class(2000, split_side_factors, truth);
            let steady = |k: usize| {
                since.set(0);
                run.set(10);
                (0..2000).map(|_| truth(k).0).sum::<f64>()
            };
            spent / (0..=16).map(steady).fold(f64::INFINITY, f64::min)
        })
    }

    #[test]
    fn a_split_probes_cold_cpu_side_is_judged_at_its_settled_factor() {
        // Raw sides of 1 s each (units kept exact); warm splits ran the CPU side at 1.0-1.4x
        // (lower median 1.2) and the GPU side at 0.9x, on a concurrent GPU.
        let raw = (1.0, 1.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let mut rec = ClassRecord::default();
        let probe = Some(Probe::from(1.0));
        rec.record(PlanKind::Split, 1.0, 1.3, None);
        for x in [1.0, 1.4, 1.2, 1.3, 1.1] {
            let secs = x + 0.05;
            let judged = fold_split_sides(&mut rec, 4, raw, (x, 0.9), (secs, false), true);
            assert_eq!(
                judged, secs,
                "a warm call that is no probe is taken as it ran"
            );
            rec.record_judged(PlanKind::Split, 1.0, 1.0, secs, judged, None);
        }
        // The GPU leads; the split is re-checked. Its first call (cold) is not warm.
        rec.record(PlanKind::Gpu, 1.0, 1.0, None);
        rec.record(PlanKind::Gpu, 1.0, 1.0, None);
        assert_eq!(
            rec.settled_cpu_side(4, true),
            None,
            "after a GPU call: not a sample"
        );
        rec.record(PlanKind::Split, 1.0, 2.1, probe);
        assert_eq!(rec.settled_cpu_side(4, true), Some(1.2));
        assert_eq!(rec.settled_cpu_side(4, false), None, "not a probe");
        assert_eq!(
            rec.settled_cpu_side(3, true),
            None,
            "no settled side at 3 heads"
        );
        // Its sample: the CPU side 1.8x, the GPU side 0.9x, 2.1 s in all. It is judged with
        // the CPU side at 1.2x: 0.6 s less on the critical path, and that side is recorded
        // at 1.2x.
        let v = rec.sides_version();
        let judged = fold_split_sides(&mut rec, 4, raw, (1.8, 0.9), (2.1, true), true);
        assert!(close(judged, 1.5), "{judged}");
        assert!(rec.sides_version() > v);
        assert_eq!(rec.side_factors(4), Some((1.2, 0.9)));
        // On shared cores the sides add up: the same 0.6 s comes off.
        let mut shared = rec.clone();
        let judged = fold_split_sides(&mut shared, 4, raw, (1.8, 0.9), (2.8, true), false);
        assert!(close(judged, 2.2), "{judged}");
        // A sample whose CPU side beat its settled factor is taken as it ran, and so is one
        // whose GPU side is its critical path.
        let mut fast = rec.clone();
        let judged = fold_split_sides(&mut fast, 4, raw, (1.1, 0.9), (1.2, true), true);
        assert_eq!(judged, 1.2);
        let mut gpu_bound = rec.clone();
        let judged = fold_split_sides(&mut gpu_bound, 4, raw, (1.3, 2.0), (2.1, true), true);
        assert_eq!(judged, 2.1);
        // The class's time counts what the call cost; its factor takes the judged time:
        // warm ratios 1.45, 1.25, 1.35, 1.15 and 1.5 / 1.25 = 1.2 (taken as it ran, 1.68,
        // the factor would read 1.35).
        let spent = rec.spent();
        rec.record_judged(PlanKind::Split, 1.0, 1.25, 2.1, 1.5, probe);
        assert!(close(rec.spent() - spent, 2.1));
        let f = rec.factor(PlanKind::Split).unwrap_or(0.0);
        assert!(close(f, 1.25), "{f}");
    }

    #[test]
    fn a_split_sampled_while_its_cpu_side_is_cold_costs_auto_six_percent() {
        // A known weakness: auto takes a split's sample at its second call, where its CPU
        // side is still cold, and runs the GPU plan. Median 1.058, 90th percentile 1.091;
        // with the sample's CPU side judged at its settled factor (`fold_split_sides`),
        // 1.062 and 1.080: here the cold side is often not the call's critical path.
        // Sampled at its third call (always): 1.026 and 1.074, but a workload of
        // `auto_stays_within_five_percent_of_the_best_plan` then read 1.05002 of its best
        // plan; sampled at its third after 32 calls without a split, the batches of
        // `slow_calls_after_a_switch_cost_auto_little` read 1.072 at the 90th percentile.
        let (median, p90) = cold_split_ratios();
        eprintln!("cold split sides: median {median:.3}, p90 {p90:.3}");
        assert!(median <= 1.07 && p90 <= 1.10, "{median} {p90}");
    }

    #[test]
    fn measured_factors_steer_auto() {
        // The model prefers a split (0.5 s vs 1 s on either side)...
        let c = Candidates {
            cpu: 1.0,
            gpu: 1.1,
            split: Some((0.5, vec![0])),
            split_sides: (0.25, 0.25),
        };
        let mut rec = ClassRecord::default();
        let (s, p) = plan(2, &c, Mode::Auto, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!((p.kind, s.gpu_heads.clone()), (PlanKind::Split, vec![0]));
        assert_eq!(s.predicted_seconds, 0.5);
        // ... but it measured 2.4x its prediction (its first call is cold, the second is
        // the sample): the CPU (never run) is next, and its split has no GPU heads.
        rec.record(PlanKind::Split, 0.5, 5.0, None);
        let (_, p) = plan(2, &c, Mode::Auto, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!(p.kind, PlanKind::Split);
        rec.record(PlanKind::Split, 0.5, 1.2, None);
        let (s, p) = plan(2, &c, Mode::Auto, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!(
            (p.kind, s.gpu_heads.len(), s.predicted_seconds),
            (PlanKind::Cpu, 0, 1.0)
        );
        rec.record(PlanKind::Cpu, 1.0, 1.0, None);
        rec.record(PlanKind::Cpu, 1.0, 1.0, None);
        // The GPU, probed (two calls), measured 1.3x: the CPU stays.
        rec.record(PlanKind::Gpu, 1.1, 1.43, Some(1.0.into()));
        rec.record(PlanKind::Gpu, 1.1, 1.43, Some(1.0.into()));
        let (s, p) = plan(2, &c, Mode::Auto, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!((p.kind, s.cpu_heads), (PlanKind::Cpu, vec![0, 1]));
        // Hybrid and GpuOnly ignore the measurements.
        let (_, p) = plan(2, &c, Mode::Hybrid, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!(p.kind, PlanKind::Split);
        let (s, _) = plan(2, &c, Mode::GpuOnly, &rec, EXPLORE, 0.0, 1.0);
        assert_eq!(s.gpu_heads, vec![0, 1]);
    }

    #[test]
    fn shared_cores_never_split_in_auto() {
        let work = w(&[1000, 2000, 3000]);
        let s = plan0(
            &work,
            cost(1e-5, 1e-9),
            cost(1e-5, 5e-9),
            false,
            Mode::Auto,
            0.0,
        );
        assert!(s.gpu_heads.is_empty(), "{s:?}");
        // Hybrid must still split, and puts the lightest head on the slower GPU.
        let s = plan0(
            &work,
            cost(1e-5, 1e-9),
            cost(1e-5, 5e-9),
            false,
            Mode::Hybrid,
            0.0,
        );
        assert_eq!(s.gpu_heads, vec![0]);
    }

    /// A kept split search holds for the next calls of its caches while they stay in
    /// their class and size, and is redone after [`SEARCH_CALLS`] calls, when the call's
    /// size moves by more than 1/[`RECOUNT_FRACTION`], when a split's measured sides
    /// change, or when a prospect moves by more than [`SEARCH_DRIFT`].
    #[test]
    fn a_split_search_is_redone_when_its_inputs_move() {
        let work = vec![
            Work {
                pairs: 4000,
                rows: 4000,
                gpu_rows: 1,
            };
            4
        ];
        let total = work.iter().fold(Work::default(), |a, &w| a + w);
        let class = size_class(true, total);
        let costing = Costing::new(
            &work,
            cost(0.0, 1e-9),
            cost(1e-4, 1e-10),
            |_| (1.0, 1.0),
            true,
            0.0,
        );
        let cands = costing.search();
        // Two GPU calls: the second, warm, is the GPU's first prospect sample (ratio 1).
        let mut rec = ClassRecord::default();
        rec.record(PlanKind::Gpu, 1e-3, 1e-3, None);
        rec.record(PlanKind::Gpu, 1e-3, 1e-3, None);
        let s = SplitSearch::of(class, &rec, total, 4, &cands);
        assert_eq!(s.split, cands.split.as_ref().map(|(_, h)| h.clone()));
        assert!(s.holds(class, &rec, total, 4));
        let step = Work {
            pairs: 4,
            rows: 4,
            gpu_rows: 0,
        };
        assert!(s.holds(class, &rec, total + step, 4), "one decode step");
        let far = Work {
            rows: total.rows + total.rows / RECOUNT_FRACTION + 1,
            ..total
        };
        assert!(!s.holds(class, &rec, far, 4), "rows moved");
        assert!(!s.holds((true, 0, 0), &rec, total, 4), "another class");
        assert!(!s.holds(class, &rec, total, 5), "another head count");
        let mut later = rec.clone();
        for _ in 0..SEARCH_CALLS {
            later.record(PlanKind::Gpu, 1e-3, 1e-3, None);
        }
        assert!(
            !s.holds(class, &later, total, 4),
            "{SEARCH_CALLS} calls later"
        );
        let mut split = rec.clone();
        split.record(PlanKind::Split, 1e-3, 1e-3, None);
        let s2 = SplitSearch::of(class, &split, total, 4, &cands);
        split.record_sides(2, 1.2, 0.9);
        assert!(!s2.holds(class, &split, total, 4), "measured sides changed");
        // The GPU's prospect: 1 (its only ratio), then the lower median of 1 and 1.5 (1),
        // then of 1, 1.5 and 1.5 (1.5).
        let mut drift = rec.clone();
        drift.record(PlanKind::Gpu, 1e-3, 1.5e-3, None);
        assert!(s.holds(class, &drift, total, 4), "prospect unmoved");
        drift.record(PlanKind::Gpu, 1e-3, 1.5e-3, None);
        assert!(!s.holds(class, &drift, total, 4), "prospect moved");
    }

    proptest! {
        /// A split's sides never run faster than alone, grow with each side's work, and
        /// the sides of the split a contention was measured from come back (unless a
        /// factor was clamped).
        #[test]
        fn contention_only_slows_and_reproduces_its_split(
            cpu in 1e-5f64..1e-2, gpu in 1e-5f64..1e-2, pack in 0.0f64..1.0,
            extra_c in 0.0f64..2.0, extra_g in 0.0f64..2.0,
            other_c in 1e-6f64..1e-2, other_g in 1e-6f64..1e-2,
        ) {
            let packed = pack * gpu;
            let overlap = cpu.min(gpu - packed);
            let (cs, gs) = (
                packed + cpu + extra_c * overlap,
                gpu + extra_g * overlap,
            );
            let k = Contention::measured(cpu, gpu, packed, cs, gs);
            prop_assert!(k.cpu_factor >= 1.0 && k.gpu_factor >= 1.0);
            prop_assert!((0.0..=1.0).contains(&k.pack));
            let (c, g) = k.sides(cpu, gpu);
            let tol = 1e-9 * (cs + gs);
            if overlap > 0.0 && extra_c + 1.0 <= Contention::MAX_FACTOR {
                prop_assert!((c - cs).abs() <= tol, "{c} vs {cs} ({k})");
            }
            if overlap > 0.0 && extra_g + 1.0 <= Contention::MAX_FACTOR {
                prop_assert!((g - gs).abs() <= tol, "{g} vs {gs} ({k})");
            }
            let (c2, g2) = k.sides(other_c, other_g);
            prop_assert!(c2 >= other_c && g2 >= other_g);
            let (c3, g3) = k.sides(other_c * 2.0, other_g * 2.0);
            prop_assert!(c3 >= c2 && g3 >= g2);
        }

        #[test]
        fn plan_is_consistent(
            raw in proptest::collection::vec((0u64..1_000_000, 1u64..100_000), 1..12),
            ca in 0.0f64..1e-3, cb in 1e-10f64..1e-8, cc in 0.0f64..1e-7,
            ga in 0.0f64..1e-3, gb in 1e-10f64..1e-8, gc in 0.0f64..1e-7,
            conc: bool,
        ) {
            let work: Vec<Work> = raw
                .iter()
                .map(|&(pairs, rows)| Work { pairs, rows, gpu_rows: rows })
                .collect();
            let c = LinearCost { a: ca, b: cb, c: cc };
            let g = LinearCost { a: ga, b: gb, c: gc };
            let n = work.len();
            for mode in [Mode::Auto, Mode::Hybrid, Mode::GpuOnly] {
                let s = plan0(&work, c, g, conc, mode, 0.0);
                let mut all: Vec<usize> = s.gpu_heads.iter().chain(&s.cpu_heads).copied().collect();
                all.sort_unstable();
                prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
                let p = predicted(&work, &s.gpu_heads, c, g, conc);
                prop_assert!((p - s.predicted_seconds).abs() <= 1e-12 + 1e-9 * p);
                let t_cpu = predicted(&work, &[], c, g, conc);
                let t_gpu = predicted(&work, &(0..n).collect::<Vec<_>>(), c, g, conc);
                match mode {
                    // A split only when the model predicts it 30% faster.
                    Mode::Auto => prop_assert!(
                        p <= t_cpu.min(t_gpu) + 1e-15
                            && (s.gpu_heads.is_empty()
                                || s.cpu_heads.is_empty()
                                || p * SPLIT_PRIOR <= t_cpu.min(t_gpu) + 1e-15)
                    ),
                    Mode::Hybrid if n >= 2 => {
                        prop_assert!(!s.gpu_heads.is_empty() && !s.cpu_heads.is_empty());
                        // The optimum over every heaviest- and lightest-first prefix.
                        let mut desc: Vec<usize> = (0..n).collect();
                        desc.sort_by_key(|&h| std::cmp::Reverse(work[h].pairs));
                        for k in 1..n {
                            prop_assert!(p <= predicted(&work, &desc[..k], c, g, conc) + 1e-15);
                            prop_assert!(p <= predicted(&work, &desc[n - k..], c, g, conc) + 1e-15);
                        }
                    }
                    Mode::GpuOnly => prop_assert_eq!(s.gpu_heads.len(), n),
                    _ => {}
                }
            }
        }

        /// A kept split search re-costs its heads as the search costed them: on the work
        /// it was made for, the candidates equal the search's; on grown work, the CPU and
        /// GPU plans equal a fresh search's and the split costs its heads' work.
        #[test]
        fn a_kept_split_search_is_costed_as_searched(
            raw in proptest::collection::vec((0u64..1_000_000, 1u64..100_000, 0u64..3), 1..12),
            ca in 0.0f64..1e-3, cb in 1e-10f64..1e-8, cc in 0.0f64..1e-7,
            ga in 0.0f64..1e-3, gb in 1e-10f64..1e-8, gc in 0.0f64..1e-7,
            fc in 0.5f64..3.0, fg in 0.5f64..3.0, conc: bool, grow in 1u64..40,
        ) {
            let work: Vec<Work> = raw
                .iter()
                .map(|&(pairs, rows, sent)| Work { pairs, rows, gpu_rows: sent })
                .collect();
            let (c, g) = (cost(ca, cb), cost(ga, gb));
            let (c, g) = (LinearCost { c: cc, ..c }, LinearCost { c: gc, ..g });
            let side = |k: usize| (fc + 0.01 * k as f64, fg);
            let split_cost = 1e-5;
            let searched = Costing::new(&work, c, g, side, conc, split_cost).search();
            let heads = searched.split.as_ref().map(|(_, h)| h.clone());
            let again = Costing::new(&work, c, g, side, conc, split_cost).with_split(heads.as_deref());
            prop_assert_eq!(&again, &searched);
            let grown: Vec<Work> = work
                .iter()
                .map(|w| Work { pairs: w.pairs + grow, rows: w.rows + 1, gpu_rows: w.gpu_rows })
                .collect();
            let costing = Costing::new(&grown, c, g, side, conc, split_cost);
            let (fresh, kept) = (costing.search(), costing.with_split(heads.as_deref()));
            prop_assert_eq!((kept.cpu, kept.gpu), (fresh.cpu, fresh.gpu));
            if let (Some((t, h)), Some(hs)) = (&kept.split, &heads) {
                prop_assert_eq!(h, hs);
                let gw = hs.iter().fold(Work::default(), |a, &x| a + grown[x]);
                prop_assert_eq!(*t, costing.cost(gw, hs.len()).0);
            }
        }
    }

    /// A calibration under which auto's decode takes the CPU shortcut: the CPU predicted
    /// at 1e-12 s a pair, the GPU at a fixed `gpu_fixed` seconds a step.
    fn shortcut_calibration(gpu_fixed: f64) -> Calibration {
        Calibration {
            cpu_prefill: cost(0.0, 0.0),
            gpu_prefill: cost(0.0, 0.0),
            cpu_decode: cost(0.0, 1e-12),
            gpu_decode: cost(gpu_fixed, 0.0),
            gpu_decode_resident: true,
            concurrent: true,
            split_fixed: 0.0,
            split_prefill: Contention::NONE,
            split_decode: Contention::NONE,
            seconds: 0.0,
            cpu_prefill_share: None,
            cpu_decode_share: None,
        }
    }

    /// A calibration that predicts the CPU far faster than it runs does not hold auto on
    /// the CPU shortcut: a step predicted at 1 ns on the CPU against a GPU fixed cost of
    /// 100 ns takes the shortcut until its measured time (>= 100 ns for any real step)
    /// says otherwise; then the full plan runs (it keeps a class record, the shortcut
    /// none), and its all-CPU calls keep the shortcut's measure up to date.
    #[test]
    fn the_cpu_shortcut_yields_to_measured_time() {
        let eng = Engine::auto_over_idle_device();
        let EngineInner::Sched(s) = &eng.inner else {
            panic!("auto is a scheduler");
        };
        let mut cal = shortcut_calibration(1e-7);
        *s.calibration.lock().unwrap() = Some(cal.clone());
        // 2 heads x 512 entries: 1024 pairs, 1 ns predicted.
        let d = problem(512, 2, 16).decode_at(512).unwrap();
        let mut out = vec![0.0f32; d.q.len()];
        let planned = || -> f64 { s.feedback.lock().unwrap().values().map(|r| r.spent()).sum() };
        eng.decode(&d, AcpMode::Off, &mut out).unwrap();
        assert_eq!(planned(), 0.0, "the shortcut ran");
        let factor = s.shortcut.lock().unwrap()[1].factor();
        assert!(
            factor * 1.024e-9 > 1e-7,
            "measured {factor} x the prediction"
        );
        for _ in 0..3 {
            eng.decode(&d, AcpMode::Off, &mut out).unwrap();
        }
        let after = planned();
        assert!(after > 0.0, "the full plan ran");
        // Planned all-CPU calls are measured too; a GPU fixed cost above what they took
        // brings the shortcut back.
        let factor = s.shortcut.lock().unwrap()[1].factor();
        cal.gpu_decode.a = 10.0 * factor * 1.024e-9;
        *s.calibration.lock().unwrap() = Some(cal);
        eng.decode(&d, AcpMode::Off, &mut out).unwrap();
        assert_eq!(planned(), after, "the shortcut ran again");
        assert_eq!(s.shortcut.lock().unwrap()[0], Shortcut::default());
    }

    /// A calibration under which the GPU is `auto`'s prefill plan by far: the CPU and a
    /// split cost 1000 s fixed, the GPU 1 us (its measured factor then grows to thousands,
    /// and 1000 s stays far above).
    fn gpu_calibration() -> Calibration {
        Calibration {
            cpu_prefill: cost(1000.0, 1e-9),
            gpu_prefill: cost(1e-6, 0.0),
            split_fixed: 1000.0,
            split_prefill: Contention::NONE,
            split_decode: Contention::NONE,
            ..shortcut_calibration(0.0)
        }
    }

    /// After a count that picks the GPU by far, the next ACP prefill of the shape starts on
    /// the GPU before its count; the count still teaches its class and plans the next
    /// call. Outputs equal the CPU's throughout. A count that picks the CPU ends it (the
    /// next call counts first and runs on the CPU); dense calls and a GPU that is not
    /// concurrent never start ahead.
    #[test]
    fn an_acp_prefill_starts_on_the_gpu_ahead_of_its_count() {
        let eng = Engine::auto_over_idle_device();
        let EngineInner::Sched(s) = &eng.inner else {
            panic!("auto is a scheduler");
        };
        *s.calibration.lock().unwrap() = Some(gpu_calibration());
        let p = problem(300, 3, 16);
        let acp = AcpMode::Bound { ln_eps: -10.0 };
        let mut want = vec![0.0f32; p.q.len()];
        CpuBackend.prefill(&p.call(acp), &mut want).unwrap();
        let ahead = || s.ahead_calls.load(Ordering::Relaxed);
        let learned = || -> u64 { s.feedback.lock().unwrap().values().map(|r| r.calls()).sum() };
        for i in 0..5u64 {
            let mut out = vec![f32::NAN; p.q.len()];
            eng.prefill(&p, acp, &mut out).unwrap();
            assert_eq!(out, want, "call {i}");
            assert_eq!(
                ahead(),
                i,
                "the first call counts first, the others start ahead"
            );
            assert_eq!(learned(), i + 1, "every call teaches its class");
        }
        assert_eq!(eng.plan_counts().gpu, 5);
        let mut out = vec![0.0f32; p.q.len()];
        eng.prefill(&p, AcpMode::Off, &mut out).unwrap();
        assert_eq!(ahead(), 4, "dense calls count nothing");

        // The CPU now far cheaper: the call already ahead runs on the GPU; its count picks
        // the CPU, so the next call counts first and runs there.
        let mut cheap = gpu_calibration();
        cheap.cpu_prefill = cost(0.0, 1e-15);
        cheap.gpu_prefill = cost(1.0, 0.0);
        *s.calibration.lock().unwrap() = Some(cheap);
        eng.prefill(&p, acp, &mut out).unwrap();
        assert_eq!((ahead(), eng.plan_counts().gpu), (5, 7));
        eng.prefill(&p, acp, &mut out).unwrap();
        assert_eq!((ahead(), eng.plan_counts().cpu), (5, 1));
        assert_eq!(out, want);
        assert!(s.ahead.lock().unwrap().is_empty());

        // Not concurrent (the device shares the CPU's cores): counted first.
        let mut shared = gpu_calibration();
        shared.concurrent = false;
        *s.calibration.lock().unwrap() = Some(shared);
        for _ in 0..3 {
            eng.prefill(&p, acp, &mut out).unwrap();
        }
        assert_eq!(ahead(), 5);
    }

    /// A calibration whose GPU fixed cost is far above what GPU calls take does not hold
    /// auto on the CPU shortcut: once a GPU call ran faster than the shortcut's bound, the
    /// full plan runs (with its probes and class records); GPU calls and split GPU sides
    /// are what set that bound.
    #[test]
    fn a_measured_gpu_call_bounds_the_shortcuts_fixed_cost() {
        let eng = Engine::auto_over_idle_device();
        let EngineInner::Sched(s) = &eng.inner else {
            panic!("auto is a scheduler");
        };
        *s.calibration.lock().unwrap() = Some(shortcut_calibration(1.0));
        let d = problem(512, 2, 16).decode_at(512).unwrap();
        let mut out = vec![0.0f32; d.q.len()];
        let planned = || -> f64 { s.feedback.lock().unwrap().values().map(|r| r.spent()).sum() };
        for _ in 0..3 {
            eng.decode(&d, AcpMode::Off, &mut out).unwrap();
        }
        assert_eq!(planned(), 0.0, "a 1 s fixed cost: the shortcut ran");
        // A GPU decode step of 1 us: the shortcut's bound is now 1 us, below the CPU's.
        s.gpu_fastest_ns[1].store(1_000, Ordering::Relaxed);
        eng.decode(&d, AcpMode::Off, &mut out).unwrap();
        assert!(planned() > 0.0, "the full plan ran");
        assert_eq!(s.gpu_fastest_ns[0].load(Ordering::Relaxed), u64::MAX);
        // learn() keeps the fastest of GPU calls and split GPU sides, per kind.
        let mut choice = Choice {
            split: Split::whole(2, true, 1e-3),
            kind: PlanKind::Gpu,
            probe_of: None,
            class: None,
            sides: (0.0, 0.0),
            started: Instant::now(),
            cpu_upper_s: None,
            whole_margin: 0.0,
            split_fixed: 0.0,
        };
        let ran = |us: u64| (Instant::now(), std::time::Duration::from_micros(us));
        s.learn(&choice, false, ran(700), None);
        s.learn(&choice, false, ran(900), None);
        assert_eq!(s.gpu_fastest_ns[0].load(Ordering::Relaxed), 700_000);
        choice.kind = PlanKind::Split;
        s.learn(&choice, false, ran(100), Some((1e-4, 5e-4)));
        assert_eq!(s.gpu_fastest_ns[0].load(Ordering::Relaxed), 500_000);
        choice.kind = PlanKind::Cpu;
        s.learn(&choice, false, ran(1), None);
        assert_eq!(s.gpu_fastest_ns[0].load(Ordering::Relaxed), 500_000);
    }

    /// A calibration whose decode costs met a busy host (share 0, CPU costs 1000x, a split's
    /// fixed cost 1 s) is measured again at the first decode step once due: the costs come
    /// down (the faster replace them), the share is measured, the split's cost is measured
    /// again, the CPU shortcut's measure of the old costs is forgotten, and no further
    /// re-measure is due right away; a second quiet one, once due, replaces a bad quiet fit
    /// and ends the schedule. Then a faster calibration in the process-wide cache
    /// is taken as it is, without measuring. Then a busy prefill calibration (the GPU's
    /// fixed cost 100 s) is measured again on both backends at the first prefill. (The
    /// margins are wide: other tests load the cores while this one measures.)
    #[test]
    fn a_calibration_from_a_busy_host_is_measured_again() {
        share::ASSUME_QUIET.with(|q| q.set(true));
        let eng = Engine::auto_over_idle_device();
        let EngineInner::Sched(s) = &eng.inner else {
            panic!("auto is a scheduler");
        };
        let (heads, d) = (3, 8);
        let real = s.costs(heads, d).unwrap().unwrap();
        let mut busy = real.clone();
        busy.cpu_decode.a *= 1000.0;
        busy.cpu_decode.b *= 1000.0;
        busy.cpu_decode.c *= 1000.0;
        busy.cpu_decode_share = Some(0.0);
        busy.split_fixed = 1.0;
        let past = Instant::now()
            .checked_sub(std::time::Duration::from_secs(2))
            .unwrap();
        let make_busy = || {
            *s.calibration.lock().unwrap() = Some(busy.clone());
            s.remeasure.lock().unwrap()[1] = Remeasure::after(Some(0.0), past);
            for _ in 0..3 {
                s.shortcut.lock().unwrap()[1].record(1e6);
            }
        };
        make_busy();
        let p = problem(256, heads, d).decode_at(256).unwrap();
        let mut out = vec![0.0f32; p.q.len()];
        eng.decode(&p, AcpMode::Off, &mut out).unwrap();
        let now = s.calibration.lock().unwrap().clone().unwrap();
        assert!(now.cpu_decode_share.unwrap() > 0.0, "{now}");
        let refd = |c: LinearCost| reference_seconds(c, heads, true, false);
        assert!(
            refd(now.cpu_decode) < refd(busy.cpu_decode),
            "measured again: {now}"
        );
        assert_eq!(now.cpu_prefill, real.cpu_prefill, "prefill untouched");
        assert!(now.split_fixed < 0.1, "split measured again: {now}");
        // Forgotten: three ratios of 1e6 would stay the window's lower median.
        assert!(s.shortcut.lock().unwrap()[1].factor() < 1e5);
        assert!(!s.remeasure.lock().unwrap()[1].is_due(Instant::now()));
        assert!(!s.remeasure.lock().unwrap()[0].is_due(Instant::now()));

        // One quiet measurement that fitted a bad fixed cost (run 163) is not the end: the
        // schedule's second quiet re-measure, once due, replaces it with faster costs, and
        // then the schedule is done.
        // (The GPU's costs priced high too, and the cache's faster costs gone: the second
        // re-measure measures the CPU alone.)
        let mut bad = now.clone();
        for c in [&mut bad.cpu_decode, &mut bad.gpu_decode] {
            c.a = 100.0 * c.a.max(1e-5);
            c.b *= 100.0;
            c.c *= 100.0;
        }
        assert!(!share::busy(bad.cpu_decode_share));
        let key = (s.gpu.name.clone(), heads, d);
        let cached_before = calibration_cache().lock().unwrap().remove(&key);
        *s.calibration.lock().unwrap() = Some(bad.clone());
        {
            let mut r = s.remeasure.lock().unwrap();
            r[1] = r[1].due_at(past);
        }
        eng.decode(&p, AcpMode::Off, &mut out).unwrap();
        let second = s.calibration.lock().unwrap().clone().unwrap();
        assert!(
            refd(second.cpu_decode) < refd(bad.cpu_decode),
            "measured a second time: {second}"
        );
        assert_eq!(second.gpu_decode, bad.gpu_decode, "the CPU alone: {second}");
        if let Some(c) = cached_before {
            calibration_cache().lock().unwrap().insert(key, c);
        }
        {
            let mut r = s.remeasure.lock().unwrap();
            assert_eq!(r[1].tries(), 2);
            r[1] = r[1].due_at(past);
            assert!(!r[1].is_due(Instant::now()), "two quiet: done");
        }

        // The process-wide cache holds faster costs than the busy ones (the first
        // calibration's, or this re-measure's): taken as they are.
        let key = (s.gpu.name.clone(), heads, d);
        let cached = calibration_cache().lock().unwrap()[&key].clone();
        assert!(cached.cpu_decode_share.unwrap() > 0.0);
        make_busy();
        eng.decode(&p, AcpMode::Off, &mut out).unwrap();
        let taken = s.calibration.lock().unwrap().clone().unwrap();
        assert_eq!(taken.cpu_decode, cached.cpu_decode);
        assert_eq!(taken.cpu_decode_share, cached.cpu_decode_share);

        // Prefill: both backends' costs (the GPU's fixed cost priced at 1 s) are measured
        // again at the first prefill once due, whatever the cache holds.
        calibration_cache().lock().unwrap().remove(&key);
        let mut busy = s.calibration.lock().unwrap().clone().unwrap();
        busy.cpu_prefill.b *= 1000.0;
        busy.cpu_prefill.c *= 1000.0;
        busy.gpu_prefill.a = 100.0;
        busy.cpu_prefill_share = Some(0.0);
        *s.calibration.lock().unwrap() = Some(busy.clone());
        s.remeasure.lock().unwrap()[0] = Remeasure::after(Some(0.0), past);
        let pp = problem(128, heads, d);
        let mut out = vec![0.0f32; pp.q.len()];
        eng.prefill(&pp, AcpMode::Off, &mut out).unwrap();
        let now = s.calibration.lock().unwrap().clone().unwrap();
        assert!(now.gpu_prefill.a < 1.0, "GPU measured again: {now}");
        let refs = |c: LinearCost| reference_seconds(c, heads, false, false);
        assert!(refs(now.cpu_prefill) < refs(busy.cpu_prefill), "{now}");
        assert!(now.cpu_prefill_share.unwrap() > 0.0);
        assert_eq!(now.cpu_decode, busy.cpu_decode, "decode untouched");
    }

    /// While the decode costs read busy, `auto` gives every plan its first try in a class
    /// whatever it predicts: a CPU priced 1000x too high still runs (two steps) and then
    /// loses to the idle GPU on its measured time. The same costs read quiet: never run.
    #[test]
    fn busy_decode_costs_let_every_plan_be_tried() {
        share::ASSUME_QUIET.with(|q| q.set(true));
        for busy in [true, false] {
            let eng = Engine::auto_over_idle_device();
            let EngineInner::Sched(s) = &eng.inner else {
                panic!("auto is a scheduler");
            };
            let (heads, d) = (5, 8);
            let mut c = s.costs(heads, d).unwrap().unwrap();
            c.cpu_decode.a = 1000.0 * c.cpu_decode.a.max(1e-5);
            c.cpu_decode.b *= 1000.0;
            c.cpu_decode.c *= 1000.0;
            c.cpu_decode_share = Some(if busy { 0.2 } else { 0.95 });
            *s.calibration.lock().unwrap() = Some(c);
            // Nothing pending: the costs stay as planted.
            *s.remeasure.lock().unwrap() = [Remeasure::default(); 2];
            let p = problem(256, heads, d).decode_at(256).unwrap();
            let mut out = vec![0.0f32; p.q.len()];
            for _ in 0..24 {
                eng.decode(&p, AcpMode::Off, &mut out).unwrap();
            }
            let n = eng.plan_counts();
            if busy {
                assert!(n.cpu >= 1 && n.gpu > n.cpu, "busy: {n:?}");
            } else {
                assert_eq!(n.cpu, 0, "quiet: {n:?}");
            }
        }
    }

    /// A re-measure's resident-only fit ([`DecodeFit::Resident`]) on a device that keeps
    /// caches: finite, non-negative costs, resident (its samples: resident steps over 4096
    /// and 16384 entries, one whole send of 4096).
    #[test]
    fn a_resident_re_measure_fits_from_resident_samples() {
        let test = "a_resident_re_measure_fits_from_resident_samples";
        let open = crate::vulkan_backend::open(None);
        let Some(vk) = crate::test_device::or_skip(open, test, "Vulkan") else {
            return;
        };
        let (again, resident) = calibrate_decode(&vk, 2, 8, DecodeFit::Resident).unwrap();
        assert!(resident);
        for x in [again.a, again.b, again.c] {
            assert!(x.is_finite() && x >= 0.0, "{again:?}");
        }
        // The CPU never keeps caches: its fit is the whole one whatever it is asked.
        let (_, cpu_resident) = calibrate_decode(&CpuBackend, 2, 8, DecodeFit::Whole).unwrap();
        assert!(!cpu_resident);
    }

    /// ACP with `d`'s bounds and `ln eps = -10`.
    fn acp_bound(d: &DecodeProblem) -> Acp<'_> {
        Acp::Bound {
            u: &d.u,
            ln_eps: -10.0,
        }
    }

    fn problem(t: usize, heads: usize, d: usize) -> Problem {
        let n = t * heads * d;
        let mut q = vec![0.0; n];
        let mut k = vec![0.0; n];
        let mut v = vec![0.0; n];
        fill_random(&mut q, 5);
        fill_random(&mut k, 6);
        fill_random(&mut v, 7);
        let log_f = (0..t * heads)
            .map(|i| -0.001 * (1 + 50 * (i % heads)) as f32)
            .collect();
        Problem {
            t,
            heads,
            head_dim: d,
            q,
            k,
            v,
            log_f,
            u: vec![(d as f64).sqrt(); heads],
        }
    }

    #[test]
    fn boundary_equals_each_heads_own_serially_and_on_the_pool() {
        // 700 x 5 gate entries are decided on this thread; 4200 x 16 on the pool.
        for (t, nh) in [(700, 5), (4200, 16)] {
            let p = problem(t, nh, 8);
            let b = p.boundary(AcpMode::Bound { ln_eps: -10.0 }).unwrap();
            let grid = BlockGrid::new(BLOCK, BLOCK, t, t).unwrap();
            let nqb = grid.q_blocks();
            let (mut c, mut st) = (vec![0.0; t], vec![0u32; nqb]);
            for h in 0..nh {
                gate::cumsum_strided(&p.log_f[h..], nh, 0.0, &mut c).unwrap();
                let delta = threshold::threshold(p.u[h], t, -10.0).unwrap();
                boundary::start_blocks(&grid, &c, Some(delta), 0, &mut st).unwrap();
                let pc = boundary::count_pairs(&grid, &st, 0);
                assert_eq!(&b.c[h * t..][..t], &c[..]);
                assert_eq!(&b.start_blocks[h * nqb..][..nqb], &st[..]);
                assert_eq!(b.delta[h], Some(delta));
                assert_eq!(
                    (b.kept_pairs[h], b.total_pairs[h]),
                    (pc.kept_pairs, pc.total_pairs)
                );
            }
            assert!(b.kept_pairs.iter().zip(&b.total_pairs).any(|(k, n)| k < n));
        }
    }

    #[test]
    fn boundary_counts_equal_the_cpu_kernels() {
        let p = problem(700, 5, 16);
        for acp in [AcpMode::Off, AcpMode::Bound { ln_eps: -10.0 }] {
            let b = p.boundary(acp).unwrap();
            let mut out = vec![0.0; p.q.len()];
            let st = CpuBackend.prefill(&p.call(acp), &mut out).unwrap();
            assert_eq!(b.kept_pairs, st.kept_pairs);
            assert_eq!(b.total_pairs, st.total_pairs);
        }
        // Observed norms too.
        let mut call = p.call(AcpMode::Off);
        call.acp = Acp::ObservedNorms { ln_eps: -10.0 };
        let b = prefill_boundary(&call).unwrap();
        let mut out = vec![0.0; p.q.len()];
        let st = CpuBackend.prefill(&call, &mut out).unwrap();
        assert_eq!(b.kept_pairs, st.kept_pairs);
        assert!(b.kept_pairs.iter().zip(&b.total_pairs).any(|(k, t)| k < t));
    }

    #[test]
    fn decode_work_equals_the_cpu_kernels() {
        let p = problem(3000, 4, 16);
        let d = p.decode_at(3000).unwrap();
        let n = d.n;
        let heads = d.cache_heads(|_| None);
        let call = d.call(&heads, acp_bound(&d));
        let w = decode_work(&call).unwrap();
        let mut out = vec![0.0; 4 * 16];
        let st = CpuBackend.decode(&call, &mut out).unwrap();
        assert_eq!(w, st.kept_pairs);
        assert!(w.iter().any(|&x| (x as usize) < n), "something pruned");
    }

    /// A second CPU backend standing in for the GPU side, failing on demand (the only way
    /// to exercise device loss without a device that can be lost).
    #[derive(Debug)]
    struct FlakyGpu {
        fail: Arc<AtomicBool>,
    }

    impl AttentionBackend for FlakyGpu {
        fn kind(&self) -> BackendKind {
            BackendKind::Vulkan
        }
        fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            if self.fail.load(Ordering::Acquire) {
                return Err(Error::BackendUnavailable("vulkan: device lost".into()));
            }
            CpuBackend.prefill(call, out)
        }
        fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            if self.fail.load(Ordering::Acquire) {
                return Err(Error::BackendUnavailable("vulkan: device lost".into()));
            }
            CpuBackend.decode(call, out)
        }
    }

    /// The CPU kernels standing in for a GPU, counting the calls made on it.
    #[derive(Debug)]
    struct CountingGpu {
        calls: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl AttentionBackend for CountingGpu {
        fn kind(&self) -> BackendKind {
            BackendKind::Vulkan
        }
        fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            CpuBackend.prefill(call, out)
        }
        fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            CpuBackend.decode(call, out)
        }
    }

    #[test]
    fn an_engine_with_a_cached_calibration_still_warms_its_gpu() {
        // Two engines on one device: the first calibrates, the second takes the cached
        // calibration but still runs the GPU's kinds of call once (compiling its own
        // context's pipelines at the start, not at its first GPU step), and no more.
        let counting = |calls: &Arc<std::sync::atomic::AtomicUsize>| {
            Scheduler::new(
                Mode::Auto,
                Gpu {
                    backend: Box::new(CountingGpu {
                        calls: calls.clone(),
                    }),
                    name: "counting test gpu".into(),
                    concurrent: true,
                },
            )
        };
        let (first, second) = (
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        );
        let a = counting(&first);
        let ca = a.costs(2, 8).unwrap().expect("calibrated");
        assert!(first.load(Ordering::Relaxed) > 0);
        let b = counting(&second);
        let cb = b.costs(2, 8).unwrap().expect("cached");
        assert_eq!(ca, cb, "the cached calibration");
        let warm = second.load(Ordering::Relaxed);
        assert!(
            warm >= 4,
            "{warm} GPU calls: a prefill and a decode, dense and pruned"
        );
        assert!(
            warm < first.load(Ordering::Relaxed),
            "fewer than a calibration"
        );
        b.costs(2, 8).unwrap();
        assert_eq!(second.load(Ordering::Relaxed), warm, "once per engine");
    }

    #[test]
    fn split_sides_are_calibrated_where_they_overlap() {
        // A pool of 4 threads gives the scheduler a split pool of 3; its "GPU" runs the CPU
        // kernels (on this thread), so the sides do slow each other. Every factor is >= 1
        // and finite, the packing a fraction of the GPU side; a decode GPU side starts
        // the CPU side at once.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let fail = Arc::new(AtomicBool::new(false));
        let s = scheduler(Mode::Hybrid, &fail);
        let (pre, dec) = pool.install(|| s.calibrate_sides(4, 16, false)).unwrap();
        for k in [pre, dec] {
            assert!(
                k.cpu_factor >= 1.0 && k.cpu_factor <= Contention::MAX_FACTOR,
                "{k}"
            );
            assert!(
                k.gpu_factor >= 1.0 && k.gpu_factor <= Contention::MAX_FACTOR,
                "{k}"
            );
            assert!((0.0..=1.0).contains(&k.pack), "{k}");
        }
        assert_eq!(dec.pack, 0.0);
        // Without a split pool (shared cores, or too few threads) nothing is measured.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let s = scheduler(Mode::Hybrid, &fail);
        let k = one.install(|| s.calibrate_sides(4, 16, false)).unwrap();
        assert_eq!(k, (Contention::NONE, Contention::NONE));
    }

    fn scheduler(mode: Mode, fail: &Arc<AtomicBool>) -> Scheduler {
        Scheduler::new(
            mode,
            Gpu {
                backend: Box::new(FlakyGpu { fail: fail.clone() }),
                name: format!("flaky test gpu {mode:?}"),
                concurrent: true,
            },
        )
    }

    #[test]
    fn auto_reuses_its_decisions_and_matches_the_cpu() {
        // Whatever auto picks (the test GPU runs the CPU kernels), every call's output and
        // statistics equal the CPU backend's: the CPU plan and both sides of a split run on
        // the decisions the plan was made from (`Acp::Decided`), the GPU plan decides again.
        let fail = Arc::new(AtomicBool::new(false));
        let s = scheduler(Mode::Auto, &fail);
        let p = problem(300, 4, 16);
        for acp in [AcpMode::Off, AcpMode::Bound { ln_eps: -10.0 }] {
            let mut want = vec![0.0; p.q.len()];
            let st_want = CpuBackend.prefill(&p.call(acp), &mut want).unwrap();
            // The CPU backend on the scheduler's decisions: bit-identical.
            let decided = prefill_boundary(&p.call(acp)).unwrap();
            let call = PrefillCall {
                decided: Some(&decided),
                only: None,
                ..p.call(acp)
            };
            let mut got = vec![0.0; p.q.len()];
            assert_eq!(CpuBackend.prefill(&call, &mut got).unwrap(), st_want);
            assert_eq!(got, want);
            for _ in 0..6 {
                let mut got = vec![0.0; p.q.len()];
                let st = s.prefill(&p.call(acp), &mut got).unwrap();
                assert_eq!(got, want);
                assert_eq!(st, st_want);
            }
        }
    }

    #[test]
    fn a_side_computes_its_heads_in_place_on_the_whole_calls_decisions() {
        // A split's sides run the whole call with `only` their heads and the scheduler's
        // decisions for every head: each writes exactly its heads' rows, as the whole call
        // would, and reports their statistics in order.
        let p = problem(300, 5, 16);
        let (nh, d) = (5, 16);
        for acp in [AcpMode::Off, AcpMode::Bound { ln_eps: -10.0 }] {
            let whole = p.call(acp);
            let all = prefill_boundary(&whole).unwrap();
            let mut want = vec![0.0; p.q.len()];
            let st_want = CpuBackend.prefill(&whole, &mut want).unwrap();
            for idx in [vec![0usize, 3], vec![4], vec![1, 2, 4]] {
                for decided in [None, Some(&all)] {
                    let call = PrefillCall {
                        decided,
                        only: Some(&idx),
                        ..whole
                    };
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
                    let pick = |x: &[u64]| idx.iter().map(|&h| x[h]).collect::<Vec<_>>();
                    assert_eq!(st.kept_pairs, pick(&st_want.kept_pairs), "{idx:?}");
                    assert_eq!(st.total_pairs, pick(&st_want.total_pairs), "{idx:?}");
                }
            }
        }
    }

    #[test]
    fn split_scatter_is_exact_and_device_loss_falls_back() {
        let fail = Arc::new(AtomicBool::new(false));
        let s = scheduler(Mode::Hybrid, &fail);
        let p = problem(257, 6, 16);
        let acp = AcpMode::Bound { ln_eps: -10.0 };
        let mut want = vec![0.0; p.q.len()];
        let st_want = CpuBackend.prefill(&p.call(acp), &mut want).unwrap();
        let mut got = vec![0.0; p.q.len()];
        let st = s.prefill(&p.call(acp), &mut got).unwrap();
        let split = s.last_split().unwrap();
        assert!(!split.gpu_heads.is_empty() && !split.cpu_heads.is_empty());
        // Same kernels on both sides: the split output is bit-identical.
        assert_eq!(got, want);
        assert_eq!(st, st_want);
        assert_eq!(s.kind(), BackendKind::Hybrid);

        fail.store(true, Ordering::Release);
        let mut got = vec![0.0; p.q.len()];
        let st = s.prefill(&p.call(acp), &mut got).unwrap();
        assert_eq!(got, want, "the lost device's heads reran on the CPU");
        assert_eq!(st, st_want);
        assert!(s.fell_back());
        assert_eq!(s.kind(), BackendKind::Cpu);
        let d = p.decode_at(200).unwrap();
        let e = Engine {
            inner: EngineInner::Sched(Box::new(s)),
        };
        let cpu = Engine {
            inner: EngineInner::Cpu(CpuBackend),
        };
        let (mut a, mut b) = (vec![0.0; d.q.len()], vec![0.0; d.q.len()]);
        e.decode(&d, acp, &mut a).unwrap();
        cpu.decode(&d, acp, &mut b).unwrap();
        assert_eq!(a, b);
        assert!(e.last_split().unwrap().gpu_heads.is_empty());
    }

    #[test]
    fn synthetic_steps_write_as_many_rows_as_steps() {
        // The rows written since a version are as many as the steps since (up to n), the
        // count the scheduler charges a resident GPU for; versions only grow.
        let n = 5;
        let mut st = StepSync::new(1, n);
        let v0 = st.version;
        for k in 1..=12u64 {
            st.step();
            let newer = st.row_version.iter().filter(|&&v| v > v0).count() as u64;
            assert_eq!(newer, k.min(n as u64), "after {k} steps");
            assert_eq!(st.sync(0).version - v0, k);
            assert!(st.row_version.iter().all(|&v| v <= st.version));
        }
        assert_eq!(st.row_version[n - 1], v0 + 11, "newest first, cycling");
    }

    #[test]
    fn decode_rows_sent_follow_the_gpu_mirror() {
        // A head the GPU received at some version needs only the rows written since; a
        // head it never got needs all; kept counts are reused within 1/32 of growth.
        let fail = Arc::new(AtomicBool::new(false));
        let s = scheduler(Mode::GpuOnly, &fail);
        let p = problem(700, 3, 16);
        let d = p.decode_at(700).unwrap();
        let n = d.n;
        let mut steps = StepSync::new(3, n);
        let call_of = |steps: &StepSync, with: &[usize]| -> Vec<Work> {
            let heads = d.cache_heads(|h| with.contains(&h).then(|| steps.sync(h)));
            let call = d.call(&heads, acp_bound(&d));
            s.note_gpu_synced(&call, &[0]);
            s.decode_work(&call, true).unwrap()
        };
        steps.step();
        // Head 0 is noted as received at the current version just before each look; head
        // 1 has sync but was never sent; head 2 has no sync.
        let w = call_of(&steps, &[0, 1]);
        assert_eq!(w[0].gpu_rows, 0);
        let nq = {
            let heads = d.cache_heads(|_| None);
            d.call(&heads, Acp::Off).n_queries as u64
        };
        assert_eq!(
            w[1].gpu_rows,
            nq + (n as u64 - nq).div_ceil(AMORTIZE_STEPS),
            "first send"
        );
        {
            // 40 steps behind: one step's rows, the other 39 charged as a catch-up.
            let mut behind = StepSync::new(3, n);
            behind.step();
            let heads = d.cache_heads(|h| (h == 0).then(|| behind.sync(h)));
            s.note_gpu_synced(&d.call(&heads, acp_bound(&d)), &[0]);
            for _ in 0..40 {
                behind.step();
            }
            let heads = d.cache_heads(|h| (h == 0).then(|| behind.sync(h)));
            let call = d.call(&heads, acp_bound(&d));
            let w = s.decode_work(&call, true).unwrap();
            assert_eq!(w[0].gpu_rows, nq + (40 - nq).div_ceil(AMORTIZE_STEPS));
        }
        assert_eq!(w[2].gpu_rows, n as u64);
        steps.step();
        steps.step();
        let w2 = call_of(&steps, &[0, 1]);
        assert_eq!(w2[0].gpu_rows, 0, "noted again at the new version");
        assert_eq!(w2[0].pairs, w[0].pairs, "count reused");
        {
            // The same cache decoded dense: its own count, not the ACP one.
            let heads = d.cache_heads(|h| Some(steps.sync(h)));
            let call = d.call(&heads, Acp::Off);
            let wd = s.decode_work(&call, true).unwrap();
            assert!(
                wd.iter().all(|x| x.pairs == n as u64),
                "dense counts every entry"
            );
        }
        assert_eq!(
            call_of(&steps, &[0, 1])[0].pairs,
            w[0].pairs,
            "ACP count again"
        );
        let mut out = vec![0.0; 3 * 16];
        let heads = d.cache_heads(|_| None);
        let call = d.call(&heads, acp_bound(&d));
        let st = CpuBackend.decode(&call, &mut out).unwrap();
        assert_eq!(
            w2.iter().map(|x| x.pairs).collect::<Vec<_>>(),
            st.kept_pairs
        );
    }

    #[test]
    fn gpu_only_falls_back_mid_decode() {
        let fail = Arc::new(AtomicBool::new(false));
        let e = Engine {
            inner: EngineInner::Sched(Box::new(scheduler(Mode::GpuOnly, &fail))),
        };
        let p = problem(300, 3, 16);
        let d = p.decode_at(300).unwrap();
        let (mut a, mut b) = (vec![0.0; d.q.len()], vec![0.0; d.q.len()]);
        e.decode(&d, AcpMode::Off, &mut a).unwrap();
        assert_eq!(e.kind(), BackendKind::Vulkan);
        fail.store(true, Ordering::Release);
        e.decode(&d, AcpMode::Off, &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(e.kind(), BackendKind::Cpu);
        assert!(e.fell_back());
    }
}
