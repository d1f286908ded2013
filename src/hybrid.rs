//! The hybrid CPU/GPU scheduler, `auto` backend selection, and a kernel-level [`Engine`]
//! that benchmarks and tools drive directly.
//!
//! # Cost model
//! Per backend and per kind of call (prefill, decode), one call over a set of heads costs
//! `time ≈ a + b · P` seconds, `P` = kept query-key pairs of those heads (ACP paper,
//! section 3: work is proportional to the kept pairs, FLOPs = `4 · head_dim · P`). `a` and
//! `b` come from a short calibration (two dense sizes per call kind on synthetic data, the
//! minimum of a few runs), made once per process for each (device, heads, head_dim) and
//! kept for the backend's life.
//!
//! # Split
//! ACP's boundary (foxedge-core's `start_blocks` / `count_pairs`) gives each head's kept
//! pairs `P_h` before any kernel runs. Whole heads go to one side: with heads sorted by
//! `P_h`, every prefix of the heaviest (and of the lightest) heads is a candidate GPU set;
//! the predicted time of a split is `max(cpu(P_cpu), gpu(P_gpu))` when the two run
//! concurrently (a real GPU) and `cpu + gpu` when the Vulkan device is itself a CPU
//! implementation (lavapipe shares the cores). The GPU part runs on a scoped thread while
//! rayon runs the CPU heads; both write their heads of one output. Decode recomputes the
//! split at every call from the current cache (lengths and pruned blocks change per step).
//!
//! # Failure
//! A Vulkan device that is missing at open time makes `auto` use the CPU; one lost (or out
//! of memory) during a call makes the scheduler rerun that call's GPU heads on the CPU and
//! use only the CPU from then on. Either is said once on stderr and shows in
//! [`AttentionBackend::kind`] (`cpu`), hence in the session statistics. Backends hold no
//! stream state (the session owns the cache), so nothing of the stream is lost.

use crate::backend::{
    Acp, AttentionBackend, AttentionStats, BackendKind, CacheHead, CpuBackend, DecodeCall,
    PrefillCall,
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

/// ACP block size (tokens) of both backends' kernels (their default options).
pub const BLOCK: usize = 64;

/// `time ≈ a + b · pairs` (seconds; `b` in seconds per kept query-key pair).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCost {
    pub a: f64,
    pub b: f64,
}

impl LinearCost {
    /// Predicted seconds for `pairs` kept pairs; 0 for an empty call (nothing runs).
    pub fn predict(&self, pairs: u64, empty: bool) -> f64 {
        if empty {
            0.0
        } else {
            self.a + self.b * pairs as f64
        }
    }

    /// Fits `a`, `b` through two measurements `(pairs, seconds)` (`p2 > p1`); `a, b >= 0`.
    fn fit(p1: u64, t1: f64, p2: u64, t2: f64) -> LinearCost {
        let b = ((t2 - t1) / (p2 as f64 - p1 as f64)).max(t2 / p2 as f64 * 0.05);
        let a = (t1 - b * p1 as f64).max(0.0);
        LinearCost { a, b }
    }
}

/// Measured costs of both backends (see the module docs), for one (heads, head_dim).
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub cpu_prefill: LinearCost,
    pub gpu_prefill: LinearCost,
    pub cpu_decode: LinearCost,
    pub gpu_decode: LinearCost,
    /// Whether CPU and GPU work overlap in time (false for a CPU Vulkan device).
    pub concurrent: bool,
    /// Wall time the calibration took (seconds).
    pub seconds: f64,
}

impl fmt::Display for Calibration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |c: &LinearCost| format!("{:.0} us + {:.3} ns/pair", c.a * 1e6, c.b * 1e9);
        write!(
            f,
            "prefill cpu {} | gpu {}; decode cpu {} | gpu {}; {} ({:.2} s)",
            g(&self.cpu_prefill),
            g(&self.gpu_prefill),
            g(&self.cpu_decode),
            g(&self.gpu_decode),
            if self.concurrent {
                "concurrent"
            } else {
                "shared cores"
            },
            self.seconds
        )
    }
}

/// Which heads a call ran where.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Split {
    /// Head indices that ran on the GPU, ascending.
    pub gpu_heads: Vec<usize>,
    /// Head indices that ran on the CPU, ascending.
    pub cpu_heads: Vec<usize>,
    /// The predicted seconds of the chosen plan.
    pub predicted_seconds: f64,
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

/// A split is used by `auto` only when predicted at least this much faster than the best
/// single backend (it also pays a gather and a scatter of the heads it moves).
const SPLIT_MARGIN: f64 = 0.9;

/// Heads on the GPU for `work` (kept pairs per head) under `mode`; returns the GPU heads
/// (ascending) and the predicted seconds.
fn plan(work: &[u64], cpu: LinearCost, gpu: LinearCost, concurrent: bool, mode: Mode) -> Split {
    let n = work.len();
    let total: u64 = work.iter().sum();
    let combine = |c: f64, g: f64| if concurrent { c.max(g) } else { c + g };
    let cost = |g_pairs: u64, g_heads: usize| {
        combine(
            cpu.predict(total - g_pairs, g_heads == n),
            gpu.predict(g_pairs, g_heads == 0),
        )
    };
    let all: Vec<usize> = (0..n).collect();
    let split_of = |gpu_heads: Vec<usize>, predicted_seconds: f64| {
        let mut gpu_heads = gpu_heads;
        gpu_heads.sort_unstable();
        let cpu_heads = (0..n).filter(|h| gpu_heads.binary_search(h).is_err()).collect();
        Split {
            gpu_heads,
            cpu_heads,
            predicted_seconds,
        }
    };
    if mode == Mode::GpuOnly || n == 0 {
        return split_of(all, cost(total, n));
    }
    // Heaviest first, then lightest first: every prefix is a candidate GPU set.
    let mut desc = all.clone();
    desc.sort_by_key(|&h| std::cmp::Reverse(work[h]));
    let asc: Vec<usize> = desc.iter().rev().copied().collect();
    let mut best: Option<(f64, Vec<usize>)> = None;
    for order in [&desc, &asc] {
        let mut g_pairs = 0u64;
        for k in 1..n {
            g_pairs += work[order[k - 1]];
            let t = cost(g_pairs, k);
            if best.as_ref().is_none_or(|b| t < b.0) {
                best = Some((t, order[..k].to_vec()));
            }
        }
    }
    match (mode, best) {
        (Mode::Hybrid, Some((t, g))) => split_of(g, t),
        (Mode::Hybrid, None) => split_of(Vec::new(), cost(0, 0)),
        (_, best) => {
            let t_cpu = cost(0, 0);
            let t_gpu = cost(total, n);
            let single = t_cpu.min(t_gpu);
            match best {
                Some((t, g)) if t < SPLIT_MARGIN * single => split_of(g, t),
                _ if t_gpu < t_cpu => split_of(all, t_gpu),
                _ => split_of(Vec::new(), t_cpu),
            }
        }
    }
}

/// Kept pairs per head of a prefill call, from the same boundary the kernels use
/// (`start_blocks` + `count_pairs` over `BLOCK`-token blocks, threshold from core).
/// Also returns each head's start blocks (`[heads, q_blocks]`) and threshold.
pub(crate) fn prefill_boundary(call: &PrefillCall<'_>) -> Result<PrefillBoundary> {
    let (t, nh, d) = (call.t, call.heads, call.head_dim);
    let grid = BlockGrid::new(BLOCK, BLOCK, t, t).map_err(core_err)?;
    let nqb = grid.q_blocks();
    let mut pb = PrefillBoundary {
        q_blocks: nqb,
        start_blocks: vec![0; nh * nqb],
        kept_pairs: Vec::with_capacity(nh),
        total_pairs: Vec::with_capacity(nh),
        delta: Vec::with_capacity(nh),
        c: vec![0.0; nh * t],
    };
    let scale = 1.0 / (d as f64).sqrt();
    for h in 0..nh {
        let c = &mut pb.c[h * t..(h + 1) * t];
        gate::cumsum_strided(&call.log_f[h..], nh, 0.0, c).map_err(core_err)?;
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
                let u = threshold::bound_from_norms(qn, kn, scale).map_err(core_err)?;
                Some(threshold::threshold(u, t, ln_eps).map_err(core_err)?)
            }
        };
        let st = &mut pb.start_blocks[h * nqb..(h + 1) * nqb];
        boundary::start_blocks(&grid, c, delta, 0, st).map_err(core_err)?;
        let pc = boundary::count_pairs(&grid, st, 0);
        pb.kept_pairs.push(pc.kept_pairs);
        pb.total_pairs.push(pc.total_pairs);
        pb.delta.push(delta);
    }
    Ok(pb)
}

/// The ACP boundary of one prefill call (see [`prefill_boundary`]).
#[derive(Debug, Clone)]
pub(crate) struct PrefillBoundary {
    pub q_blocks: usize,
    /// `[heads, q_blocks]`: first visited key block of each query block.
    pub start_blocks: Vec<u32>,
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
    pub delta: Vec<Option<f64>>,
    /// `[heads, t]`: cumulative log gates `c_i`.
    pub c: Vec<f64>,
}

/// Kept (query, entry) pairs per head of a decode call: entries in `BLOCK`-entry blocks
/// (slot order, as the kernels split them) where some query has `c_t - c_j >= delta`.
fn decode_work(call: &DecodeCall<'_>) -> Result<Vec<u64>> {
    let nq = call.n_queries;
    let mut w = Vec::with_capacity(call.heads.len());
    for (h, head) in call.heads.iter().enumerate() {
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
        w.push(kept as u64 * nq as u64);
    }
    Ok(w)
}

fn core_err(e: foxedge_core::Error) -> Error {
    Error::invalid(format!("attention input: {e}"))
}

/// Process-wide calibrations, keyed by (device, heads, head_dim).
fn calibration_cache() -> &'static Mutex<HashMap<(String, usize, usize), Calibration>> {
    static CACHE: OnceLock<Mutex<HashMap<(String, usize, usize), Calibration>>> = OnceLock::new();
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

/// Minimum seconds of `reps` runs of `f` after one warm-up run.
fn time_min(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn calibrate_prefill(b: &dyn AttentionBackend, heads: usize, d: usize) -> Result<LinearCost> {
    let sizes = [256usize, 1024];
    let mut pts = [(0u64, 0.0f64); 2];
    for (i, &t) in sizes.iter().enumerate() {
        let mut q = vec![0.0f32; t * heads * d];
        let mut k = q.clone();
        let mut v = q.clone();
        fill_random(&mut q, 1 + i as u64);
        fill_random(&mut k, 11 + i as u64);
        fill_random(&mut v, 21 + i as u64);
        let log_f = vec![-0.01f32; t * heads];
        let call = PrefillCall {
            t,
            heads,
            head_dim: d,
            q: &q,
            k: &k,
            v: &v,
            log_f: &log_f,
            acp: Acp::Off,
        };
        let mut out = vec![0.0f32; q.len()];
        let secs = time_min(2, || b.prefill(&call, &mut out).map(|_| ()))?;
        pts[i] = ((t * (t + 1) / 2 * heads) as u64, secs);
    }
    Ok(LinearCost::fit(pts[0].0, pts[0].1, pts[1].0, pts[1].1))
}

fn calibrate_decode(b: &dyn AttentionBackend, heads: usize, d: usize) -> Result<LinearCost> {
    let sizes = [512usize, 8192];
    let mut pts = [(0u64, 0.0f64); 2];
    for (i, &n) in sizes.iter().enumerate() {
        let mut k = vec![0.0f32; n * d];
        let mut v = k.clone();
        fill_random(&mut k, 31 + i as u64);
        fill_random(&mut v, 41 + i as u64);
        let c: Vec<f64> = (0..n).map(|j| -0.01 * j as f64).collect();
        let mut q = vec![0.0f32; heads * d];
        fill_random(&mut q, 51);
        let q_c = vec![c[n - 1]; heads];
        let hs: Vec<CacheHead<'_>> = (0..heads)
            .map(|_| CacheHead {
                k: &k,
                v: &v,
                c: &c,
                pos: None,
            })
            .collect();
        let call = DecodeCall {
            head_dim: d,
            n_queries: 1,
            q: &q,
            q_c: &q_c,
            q_pos: None,
            heads: &hs,
            acp: Acp::Off,
        };
        let mut out = vec![0.0f32; heads * d];
        let secs = time_min(3, || b.decode(&call, &mut out).map(|_| ()))?;
        pts[i] = ((n * heads) as u64, secs);
    }
    Ok(LinearCost::fit(pts[0].0, pts[0].1, pts[1].0, pts[1].1))
}

/// Measures both backends on synthetic dense calls of `heads` heads of `d` dims.
fn calibrate(
    cpu: &dyn AttentionBackend,
    gpu: &dyn AttentionBackend,
    heads: usize,
    d: usize,
    concurrent: bool,
) -> Result<Calibration> {
    let t0 = Instant::now();
    Ok(Calibration {
        cpu_prefill: calibrate_prefill(cpu, heads, d)?,
        gpu_prefill: calibrate_prefill(gpu, heads, d)?,
        cpu_decode: calibrate_decode(cpu, heads, d)?,
        gpu_decode: calibrate_decode(gpu, heads, d)?,
        concurrent,
        seconds: t0.elapsed().as_secs_f64(),
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
    last_split: Mutex<Option<Split>>,
    gpu_calls: AtomicU64,
    cpu_calls: AtomicU64,
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

/// Heads of `heads` selected by `idx`, gathered from a `[rows, heads, d]` tensor.
fn gather_seq(x: &[f32], rows: usize, heads: usize, d: usize, idx: &[usize]) -> Vec<f32> {
    let mut o = Vec::with_capacity(rows * idx.len() * d);
    for r in 0..rows {
        for &h in idx {
            o.extend_from_slice(&x[(r * heads + h) * d..][..d]);
        }
    }
    o
}

/// Inverse of [`gather_seq`] into `out`.
fn scatter_seq(part: &[f32], rows: usize, heads: usize, d: usize, idx: &[usize], out: &mut [f32]) {
    let n = idx.len();
    for r in 0..rows {
        for (i, &h) in idx.iter().enumerate() {
            out[(r * heads + h) * d..][..d].copy_from_slice(&part[(r * n + i) * d..][..d]);
        }
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
            last_split: Mutex::new(None),
            gpu_calls: AtomicU64::new(0),
            cpu_calls: AtomicU64::new(0),
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
        if let Some(c) = lock(calibration_cache())?.get(&key) {
            *slot = Some(c.clone());
            return Ok(Some(c.clone()));
        }
        match calibrate(
            &self.cpu,
            self.gpu.backend.as_ref(),
            heads,
            d,
            self.gpu.concurrent,
        ) {
            Ok(c) => {
                lock(calibration_cache())?.insert(key, c.clone());
                *slot = Some(c.clone());
                Ok(Some(c))
            }
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn choose(&self, work: &[u64], heads: usize, d: usize, decode: bool) -> Result<Split> {
        let all_cpu = || Split {
            gpu_heads: Vec::new(),
            cpu_heads: (0..heads).collect(),
            predicted_seconds: 0.0,
        };
        if self.fallen_back.load(Ordering::Acquire) {
            return Ok(all_cpu());
        }
        let split = match self.costs(heads, d)? {
            None if self.fallen_back.load(Ordering::Acquire) => all_cpu(),
            None => plan(
                work,
                LinearCost { a: 0.0, b: 1.0 },
                LinearCost { a: 0.0, b: 1.0 },
                true,
                Mode::GpuOnly,
            ),
            Some(c) => {
                let (cc, gc) = if decode {
                    (c.cpu_decode, c.gpu_decode)
                } else {
                    (c.cpu_prefill, c.gpu_prefill)
                };
                plan(work, cc, gc, c.concurrent, self.mode)
            }
        };
        Ok(split)
    }

    fn record(&self, split: &Split) -> Result<()> {
        if !split.gpu_heads.is_empty() {
            self.gpu_calls.fetch_add(1, Ordering::Relaxed);
        }
        if !split.cpu_heads.is_empty() {
            self.cpu_calls.fetch_add(1, Ordering::Relaxed);
        }
        *lock(&self.last_split)? = Some(split.clone());
        Ok(())
    }

    fn gpu_alone<F: FnOnce() -> Result<AttentionStats>, R: FnOnce() -> Result<AttentionStats>>(
        &self,
        gpu: F,
        rerun: R,
    ) -> Result<AttentionStats> {
        match gpu() {
            Ok(s) => Ok(s),
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                rerun()
            }
            Err(e) => Err(e),
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
        let work = if self.mode == Mode::GpuOnly || self.fell_back() {
            vec![0; nh]
        } else {
            prefill_boundary(call)?.kept_pairs
        };
        let split = self.choose(&work, nh, d, false)?;
        self.record(&split)?;
        if split.gpu_heads.is_empty() {
            return self.cpu.prefill(call, out);
        }
        if split.cpu_heads.is_empty() {
            return self.gpu_alone(
                || self.gpu.backend.prefill(call, out),
                || self.cpu.prefill(call, out),
            );
        }
        let sub = |idx: &[usize], u_buf: &mut Vec<f64>| -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
            if let Acp::Bound { u, .. } = call.acp {
                *u_buf = idx.iter().map(|&h| u.get(h).copied().unwrap_or(f64::NAN)).collect();
            }
            let log_f = gather_seq(call.log_f, t, nh, 1, idx);
            (
                gather_seq(call.q, t, nh, d, idx),
                gather_seq(call.k, t, nh, d, idx),
                gather_seq(call.v, t, nh, d, idx),
                log_f,
            )
        };
        let (mut gu, mut cu) = (Vec::new(), Vec::new());
        let g_in = sub(&split.gpu_heads, &mut gu);
        let c_in = sub(&split.cpu_heads, &mut cu);
        let sub_acp = |u_sub: &'_ [f64]| -> Acp<'_> {
            match call.acp {
                Acp::Bound { ln_eps, .. } => Acp::Bound { u: u_sub, ln_eps },
                Acp::Off => Acp::Off,
                Acp::ObservedNorms { ln_eps } => Acp::ObservedNorms { ln_eps },
            }
        };
        let mk = |x: &'_ (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>), n: usize, u: &'_ [f64]| {
            PrefillCall {
                t,
                heads: n,
                head_dim: d,
                q: &x.0,
                k: &x.1,
                v: &x.2,
                log_f: &x.3,
                acp: sub_acp(u),
            }
        };
        let gcall = mk(&g_in, split.gpu_heads.len(), &gu);
        let ccall = mk(&c_in, split.cpu_heads.len(), &cu);
        let mut g_out = vec![0.0f32; t * split.gpu_heads.len() * d];
        let mut c_out = vec![0.0f32; t * split.cpu_heads.len() * d];
        let gpu = self.gpu.backend.as_ref();
        let (gres, cres) = std::thread::scope(|s| {
            let h = s.spawn(|| gpu.prefill(&gcall, &mut g_out));
            let c = self.cpu.prefill(&ccall, &mut c_out);
            (
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal("the GPU submission thread panicked".into()))
                }),
                c,
            )
        });
        let cs = cres?;
        let gs = match gres {
            Ok(g) => g,
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                self.cpu.prefill(&gcall, &mut g_out)?
            }
            Err(e) => return Err(e),
        };
        scatter_seq(&g_out, t, nh, d, &split.gpu_heads, out);
        scatter_seq(&c_out, t, nh, d, &split.cpu_heads, out);
        Ok(merge_stats(
            nh,
            &[(&split.gpu_heads, &gs), (&split.cpu_heads, &cs)],
        ))
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let (nh, nq, d) = (call.heads.len(), call.n_queries, call.head_dim);
        if out.len() != nh * nq * d {
            return Err(Error::invalid("decode out: [heads, n_queries, head_dim] values"));
        }
        let work = if self.mode == Mode::GpuOnly || self.fell_back() {
            vec![0; nh]
        } else {
            decode_work(call)?
        };
        let split = self.choose(&work, nh, d, true)?;
        self.record(&split)?;
        if split.gpu_heads.is_empty() {
            return self.cpu.decode(call, out);
        }
        if split.cpu_heads.is_empty() {
            return self.gpu_alone(
                || self.gpu.backend.decode(call, out),
                || self.cpu.decode(call, out),
            );
        }
        struct Part<'a> {
            q: Vec<f32>,
            q_c: Vec<f64>,
            q_pos: Option<Vec<u64>>,
            heads: Vec<CacheHead<'a>>,
            u: Vec<f64>,
        }
        let part = |idx: &[usize]| -> Part<'_> {
            Part {
                q: gather_major(call.q, nq * d, idx),
                q_c: gather_major(call.q_c, nq, idx),
                q_pos: call.q_pos.map(|p| gather_major(p, nq, idx)),
                heads: idx.iter().map(|&h| call.heads[h]).collect(),
                u: match call.acp {
                    Acp::Bound { u, .. } => {
                        idx.iter().map(|&h| u.get(h).copied().unwrap_or(f64::NAN)).collect()
                    }
                    _ => Vec::new(),
                },
            }
        };
        let gp = part(&split.gpu_heads);
        let cp = part(&split.cpu_heads);
        let mk = |p: &'_ Part<'_>| DecodeCall {
            head_dim: d,
            n_queries: nq,
            q: &p.q,
            q_c: &p.q_c,
            q_pos: p.q_pos.as_deref(),
            heads: &p.heads,
            acp: match call.acp {
                Acp::Bound { ln_eps, .. } => Acp::Bound { u: &p.u, ln_eps },
                other => other,
            },
        };
        let gcall = mk(&gp);
        let ccall = mk(&cp);
        let mut g_out = vec![0.0f32; split.gpu_heads.len() * nq * d];
        let mut c_out = vec![0.0f32; split.cpu_heads.len() * nq * d];
        let gpu = self.gpu.backend.as_ref();
        let (gres, cres) = std::thread::scope(|s| {
            let h = s.spawn(|| gpu.decode(&gcall, &mut g_out));
            let c = self.cpu.decode(&ccall, &mut c_out);
            (
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal("the GPU submission thread panicked".into()))
                }),
                c,
            )
        });
        let cs = cres?;
        let gs = match gres {
            Ok(g) => g,
            Err(e) if is_device_failure(&e) => {
                self.fall_back(&e);
                self.cpu.decode(&gcall, &mut g_out)?
            }
            Err(e) => return Err(e),
        };
        scatter_major(&g_out, nq * d, &split.gpu_heads, out);
        scatter_major(&c_out, nq * d, &split.cpu_heads, out);
        Ok(merge_stats(
            nh,
            &[(&split.gpu_heads, &gs), (&split.cpu_heads, &cs)],
        ))
    }
}
