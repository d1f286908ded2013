//! `foxedge bench`: attention prefill and decode on each backend, dense and with ACP, over
//! context lengths, on the bundled model's real q/k/v/gates (all layers' heads in one call).
//!
//! Reported per cell: best-of-N wall time, kept GFLOP/s (`4 · head_dim · kept_pairs`
//! FLOPs), that as a fraction of this machine's measured fp32 FMA peak (all threads),
//! the kept fraction, and speedups: against the CPU (same op, length and pruning) and of
//! ACP against dense (same backend).

mod model;

use super::plot::{PALETTE, Series, line_chart};
use super::pool::{cell_label, sample_mean};
use super::{ModelArg, progress};
use clap::{Args, ValueEnum};
use foxedge::attention::{AcpMode, AttentionStats, Engine};
use foxedge::{BackendKind, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// One measured cell.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    pub op: &'static str,
    pub len: usize,
    pub acp: bool,
    pub backend: String,
    /// Median seconds per call over the timed samples (each sample = a batch of `inner`
    /// calls divided by `inner`).
    pub seconds: f64,
    pub min_seconds: f64,
    pub max_seconds: f64,
    /// Interquartile range of the samples over their median.
    pub iqr_fraction: f64,
    /// Timed samples and calls per sample.
    pub reps: usize,
    pub inner: usize,
    /// Per-call seconds of each timed sample, in round order (for paired ratios).
    pub samples: Vec<f64>,
    /// The backend whose timed batch ran just before each sample's ("" for the first).
    pub after: Vec<String>,
    pub gflops: f64,
    pub peak_fraction: f64,
    pub kept_fraction: f64,
    /// CPU median / this median (same op, len, acp).
    pub vs_cpu: f64,
    /// Dense median / ACP median (same backend, op, len); 1 for dense rows.
    pub acp_speedup: f64,
    /// Heads on the GPU in the last run (hybrid/auto), of `heads`.
    pub gpu_heads: Option<usize>,
    /// Plans of the timed calls (hybrid/auto): all-CPU, all-GPU, split.
    pub plans: Option<[u64; 3]>,
    /// The scheduler's own time per timed call, in microseconds (hybrid/auto): its time
    /// outside the backends' dispatch (`PlanCounts::scheduler_ns`).
    pub scheduler_us: Option<f64>,
    /// Largest |difference| from the CPU output (same op, len, acp).
    pub max_abs_diff_vs_cpu: f32,
}

/// auto against the best single backend of one (op, len, acp).
#[derive(Debug, Clone, serde::Serialize)]
struct AutoRatio {
    cell: String,
    /// The backend with the smallest median among cpu, vulkan, hybrid.
    best: String,
    /// best median / auto median (>= 0.95 wanted).
    ratio: f64,
    /// A 90% bootstrap interval of `ratio` ([`ratio_interval`]).
    ci_lo: f64,
    ci_hi: f64,
    /// The same ratio per round (best's and auto's samples of one round): quartiles.
    paired_q25: f64,
    paired_median: f64,
    paired_q75: f64,
    /// By total time ([`total_ratio`]): the single backend with the smallest mean call time
    /// over its samples, and that mean / auto's.
    best_total: String,
    total_ratio: f64,
    /// auto's plan in words.
    choice: String,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    machine_peak_gflops: f64,
    threads: usize,
    heads: usize,
    head_dim: usize,
    device: Option<String>,
    calibration: Option<String>,
    /// Timing method, in words.
    method: String,
    cells: Vec<Cell>,
    auto_vs_best: Vec<AutoRatio>,
}

/// The timing knobs (see `run`'s flags).
#[derive(Debug, Clone, Copy)]
struct Method {
    /// Rounds of interleaved samples per cell (at most).
    rounds: usize,
    /// Untimed calls per backend before the rounds.
    warm: usize,
    /// Seconds a sample's batch of calls should last.
    batch_s: f64,
    /// Seconds of timed calls per backend and cell (fewer rounds for slow backends, at
    /// least `min_rounds`, except a call slower than the budget: its warm-up is its sample).
    budget_s: f64,
    min_rounds: usize,
}

/// Time attention per backend, or (with --model) the whole model
///
/// With --model DIR: the whole model, like llama-bench: at each --depth, --prompt tokens
/// in one call (prefill at depth 0, continuation after it) and --gen tokens decoded one at
/// a time (after one untimed warm-up pass with --backend vulkan); median, min and max
/// tokens/s over --reps runs, weight bytes, resident memory
/// (after load and peak) and the cache's peak bytes; --weights picks the weight format.
///
/// Without --model: attention prefill and decode per backend, dense and with ACP, on the
/// bundled model's real q/k/v/gates (all layers' heads in one call). Per cell: median,
/// min and IQR time, kept GFLOP/s, % of the measured fp32 FMA peak, kept fraction, speedups,
/// and auto against the best single backend. Each cell: --warm untimed calls per backend,
/// then up to --reps rounds with the backends interleaved (a random order each round), each
/// sample a batch of >= --batch-ms, at most --budget-s of timed calls per backend.
/// FOXEDGE_BENCH_SLOW_MS=X reports timed calls over X ms.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backends, comma-separated: cpu, vulkan, hybrid, auto, or all
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "all", value_parser = backend_or_all)]
    backend: Vec<Option<BackendKind>>,
    /// Operations, comma-separated
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "all"
    )]
    ops: Vec<OpArg>,
    /// Context lengths in tokens, comma-separated, k = 1024 (e.g. 1k,4k) [default: 1k,4k;
    /// with --full 1k,4k,16k,64k]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_len)]
    lengths: Vec<usize>,
    /// The long grid: lengths 1k to 64k, more rounds and a longer budget per cell
    #[arg(long)]
    full: bool,
    /// Rounds of interleaved samples per cell, at most [default: 15; with --full 80];
    /// with --model: runs per depth [default: 5]
    #[arg(long, value_name = "N")]
    reps: Option<usize>,
    /// Untimed calls per backend before each cell's rounds
    #[arg(long, value_name = "N", default_value_t = 3)]
    warm: usize,
    /// Milliseconds a sample's batch of calls should last
    #[arg(long, value_name = "MS", default_value_t = 20.0)]
    batch_ms: f64,
    /// Seconds of timed calls per backend and cell [default: 3; with --full 8]
    #[arg(long, value_name = "S")]
    budget_s: Option<f64>,
    /// Add a second CPU engine and, with a Vulkan device, a second Vulkan engine: their
    /// ratios to the first are the method's noise floor
    #[arg(long)]
    control: bool,
    /// Vulkan device: an index or a name substring [default: FOXEDGE_VULKAN_DEVICE, else
    /// the best device]
    #[arg(long, value_name = "SEL")]
    device: Option<String>,
    /// ln eps of the ACP cells (< 0)
    #[arg(long, value_name = "X", default_value_t = -10.0, allow_negative_numbers = true)]
    log_eps: f64,
    #[command(flatten)]
    model: ModelArg,
    /// Token ids (.npy, [B, T]) the model runs over for its gates [default:
    /// tests/fixtures/fox-tiny-pro/long_input_ids.npy beside the model]
    #[arg(long, value_name = "IDS.npy")]
    ids: Option<PathBuf>,
    /// Print the report as JSON instead of the table
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to FILE (for --pool)
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Write PNG plots into DIR: kept GFLOP/s against context per op, the decay matrix of
    /// four heads with the ACP boundary
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Measure nothing; pool repeated --out reports (comma-separated files): auto/best per
    /// cell by median and by total time (geometric mean, one-sided 95% lower bound over the
    /// runs) and the control pairs' noise
    #[arg(long, value_name = "LIST", conflicts_with_all = [
        "backend", "ops", "lengths", "full", "reps", "warm", "batch_ms", "budget_s",
        "control", "device", "log_eps", "model", "ids", "out", "plot",
    ])]
    pool: Option<String>,
    /// Model bench (--model given): tokens fed in one timed call at each depth
    #[arg(long, value_name = "N", default_value_t = 512)]
    prompt: usize,
    /// Model bench: tokens decoded one at a time after the prompt
    #[arg(long = "gen", value_name = "N", default_value_t = 64)]
    gen_tokens: usize,
    /// Model bench: tokens in the cache before the prompt, comma-separated, k = 1024
    /// (e.g. 0,4k) [default: 0]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_depth)]
    depth: Vec<usize>,
    /// Model bench: ACP off (dense attention)
    #[arg(long)]
    dense: bool,
    /// Model bench: also decode --gen tokens in N sessions at once (forks of the session
    /// after the prompt, advanced together by Session::feed_batch); aggregate tokens/s
    #[arg(long, value_name = "N", default_value_t = 1)]
    batch: usize,
    /// Model bench: also time restoring the session after the prompt from its saved bytes
    /// (tokens in it per second of Session::load_bytes)
    #[arg(long)]
    restore: bool,
    /// Model bench: tokens per prefill chunk (the session's transient memory is
    /// proportional to it) [default: the session default]
    #[arg(long, value_name = "N")]
    chunk: Option<usize>,
    /// Model bench: storage of the cache's K and V rows, f32 or f16
    #[arg(long = "cache", value_name = "DTYPE", default_value_t = foxedge::SessionOptions::default().cache_dtype)]
    cache_dtype: foxedge::CacheDtype,
    /// No progress bar on stderr (also hidden with --json or when stderr is not a terminal)
    #[arg(short, long)]
    quiet: bool,
}

/// `--ops` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Prefill,
    Decode,
    All,
}

/// A `--backend` value: a backend, or None for `all`.
fn backend_or_all(s: &str) -> Result<Option<BackendKind>> {
    match s.trim() {
        "all" => Ok(None),
        b => b.parse().map(Some),
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.model.model.is_some() && a.pool.is_none() {
        return model::run(&a);
    }
    let json = a.json;
    if let Some(list) = a.pool {
        let s = super::pool::pool_files(&list)?;
        if json {
            let js = serde_json::to_string_pretty(&s)
                .map_err(|e| Error::Internal(format!("bench --pool json: {e}")))?;
            println!("{js}");
        } else {
            super::pool::print(&s);
        }
        return Ok(());
    }
    let json_out = a.out;
    let full = a.full;
    let control = a.control;
    let plot_dir = a.plot;
    let ids_path = a.ids;
    let device = a.device;
    // `--full` measures longer cells by default: with 3 s per backend a 0.5 s call got 6
    // samples, and on the H100 host two identical CPU engines then differed by up to 7%;
    // with 25 rounds, cells of 0.1-0.6 ms decode steps still read 0.94 between them (the
    // host's noise comes in bursts of seconds). Cheap cells get 80 rounds: ~6 s more each.
    let (reps0, budget0) = if full { (80, 8.0) } else { (15, 3.0) };
    let rounds: usize = a.reps.unwrap_or(reps0);
    let warm: usize = a.warm;
    let batch_ms: f64 = a.batch_ms;
    let budget_s: f64 = a.budget_s.unwrap_or(budget0);
    let ln_eps: f64 = a.log_eps;
    if rounds == 0 || warm == 0 {
        return Err(Error::InvalidArgument(
            "--reps and --warm must be > 0".into(),
        ));
    }
    if !(batch_ms.is_finite() && batch_ms > 0.0 && budget_s.is_finite() && budget_s > 0.0) {
        return Err(Error::InvalidArgument(
            "--batch-ms and --budget-s must be finite and > 0".into(),
        ));
    }
    if !(ln_eps.is_finite() && ln_eps < 0.0) {
        return Err(Error::InvalidArgument(
            "--log-eps must be finite and < 0".into(),
        ));
    }
    let method = Method {
        rounds,
        warm,
        batch_s: batch_ms * 1e-3,
        budget_s,
        min_rounds: rounds.min(3),
    };
    let mut backends: Vec<BackendKind> = Vec::new();
    for b in &a.backend {
        match b {
            Some(k) => backends.push(*k),
            None => backends.extend([
                BackendKind::Cpu,
                BackendKind::Vulkan,
                BackendKind::Hybrid,
                BackendKind::Auto,
            ]),
        }
    }
    let mut ops: Vec<&'static str> = Vec::new();
    for o in &a.ops {
        match o {
            OpArg::Prefill => ops.push("prefill"),
            OpArg::Decode => ops.push("decode"),
            OpArg::All => ops.extend(["prefill", "decode"]),
        }
    }
    let lens: Vec<usize> = match a.lengths {
        l if !l.is_empty() => l,
        _ if full => vec![1024, 4096, 16384, 65536],
        _ => vec![1024, 4096],
    };
    let dir = a.model.dir()?;
    let ids_path = match ids_path {
        Some(p) => p,
        None => fixture_ids(&dir)?,
    };
    let model = Arc::new(a.model.open(a.quiet || json)?);
    let t = super::npy::read_token_ids(&ids_path)?;
    let rows: Vec<Vec<u32>> = t.ids.chunks(t.row_len()).map(<[u32]>::to_vec).collect();
    let max_len = lens.iter().copied().max().unwrap_or(1024);
    eprintln!(
        "[bench] running the model over {max_len} tokens of {} for real gates",
        ids_path.display()
    );
    let t0 = Instant::now();
    let spinner = progress::spinner("capturing real gates".into(), a.quiet || json);
    let big = foxedge::attention::capture_text(&model, &rows, max_len);
    spinner.finish_and_clear();
    let big = big?;
    eprintln!(
        "[bench] captured in {:.1} s; measuring the FMA peak",
        t0.elapsed().as_secs_f64()
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let peak = foxedge_cpu::limits::fma_peak_gflops(threads, 0.3);

    // (label, engine); `cpu2` and `vulkan2` (--control) are second CPU and Vulkan engines
    // (the latter where a Vulkan engine opened): their ratios to `cpu` and `vulkan` are
    // what the method measures between two identical backends (the noise floor).
    let mut engines: Vec<(String, Engine)> = Vec::new();
    for &k in &backends {
        match Engine::with_device(k, device.as_deref()) {
            Ok(e) => engines.push((k.name().to_string(), e)),
            Err(e) => eprintln!("[bench] skipping {k}: {e}"),
        }
    }
    if !engines.iter().any(|(k, _)| k == "cpu") {
        engines.insert(0, ("cpu".into(), Engine::new(BackendKind::Cpu)?));
    }
    if control {
        engines.push(("cpu2".into(), Engine::new(BackendKind::Cpu)?));
        if engines.iter().any(|(k, _)| k == "vulkan") {
            match Engine::with_device(BackendKind::Vulkan, device.as_deref()) {
                Ok(e) => engines.push(("vulkan2".into(), e)),
                Err(e) => eprintln!("[bench] no second Vulkan engine for the control: {e}"),
            }
        }
    }
    let mut calibration = None;
    for (k, e) in &engines {
        if let Some(c) = e.calibrate(big.heads, big.head_dim)? {
            eprintln!("[bench] {k} calibration: {c}");
            calibration = Some(c.to_string());
        }
    }
    let device_name = engines.iter().find_map(|(_, e)| e.device());

    let mut cells: Vec<Cell> = Vec::new();
    let bar = progress::bar(
        (ops.len() * lens.len() * 2) as u64,
        "cells",
        a.quiet || json,
    );
    for &op in &ops {
        for &len in &lens {
            let p = big.prefix(len)?;
            // Decode: each engine steps its own copy of the cache (a clone is a new cache),
            // as a session of its own would. One cache stepped by every engine left a
            // mirror behind by the other engines' steps: auto's GPU re-checks after a CPU
            // stint of a few rounds re-sent whole 4k caches, 20-53 ms a call (traces 77,
            // 88), where its own steps alone cost 2-5 ms (`benches/catch_up.rs`).
            let dps = if op == "decode" {
                let d = p.decode_at(len)?;
                engines.iter().map(|_| d.clone()).collect()
            } else {
                Vec::new()
            };
            for acp in [false, true] {
                let mode = if acp {
                    AcpMode::Bound { ln_eps }
                } else {
                    AcpMode::Off
                };
                let n_out = if op == "prefill" {
                    p.q.len()
                } else {
                    p.heads * p.head_dim
                };
                let run = |i: usize, out: &mut [f32]| -> Result<AttentionStats> {
                    let eng = &engines[i].1;
                    match dps.get(i) {
                        Some(d) => eng.decode(d, mode, out),
                        None => eng.prefill(&p, mode, out),
                    }
                };
                bar.set_message(cell_label(op, len as u64, acp));
                let m = measure(&engines, n_out, method, run)?;
                bar.inc(1);
                if acp {
                    // This length's caches are done with: device mirrors go.
                    for ((_, e), d) in engines.iter().zip(&dps) {
                        e.release(d);
                    }
                }
                let cpu_i = engines.iter().position(|(k, _)| k == "cpu");
                for (i, (label, _)) in engines.iter().enumerate() {
                    let r = &m[i];
                    if r.samples.is_empty() {
                        continue;
                    }
                    let diff = cpu_i.map_or(0.0, |c| max_abs_diff(&m[c].out, &r.out));
                    let mut sorted = r.samples.clone();
                    sorted.sort_by(f64::total_cmp);
                    let med = quantile(&sorted, 0.5);
                    let gflops = flops(&r.stats, p.head_dim) / med / 1e9;
                    cells.push(Cell {
                        op,
                        len,
                        acp,
                        backend: label.clone(),
                        seconds: med,
                        min_seconds: sorted[0],
                        max_seconds: sorted[sorted.len() - 1],
                        iqr_fraction: (quantile(&sorted, 0.75) - quantile(&sorted, 0.25)) / med,
                        reps: r.samples.len(),
                        inner: r.inner,
                        samples: r.samples.clone(),
                        after: r.after.clone(),
                        gflops,
                        peak_fraction: gflops / peak,
                        kept_fraction: r.stats.kept_fraction(),
                        vs_cpu: 1.0,
                        acp_speedup: 1.0,
                        gpu_heads: r.gpu_heads,
                        plans: r.plans,
                        scheduler_us: r.scheduler_us,
                        max_abs_diff_vs_cpu: diff,
                    });
                    bar.suspend(|| {
                        eprintln!(
                            "[bench] {op} L={len} {} {label}: median {:.3} ms, min {:.3} ms, {} x {}",
                            if acp { "acp" } else { "dense" },
                            med * 1e3,
                            sorted[0] * 1e3,
                            r.samples.len(),
                            r.inner
                        )
                    });
                }
            }
        }
    }
    bar.finish_and_clear();
    // Speedups.
    let snapshot = cells.clone();
    for c in &mut cells {
        if let Some(t) = find_cell(&snapshot, c.op, c.len, c.acp, "cpu") {
            c.vs_cpu = t.seconds / c.seconds;
        }
        if c.acp
            && let Some(t) = find_cell(&snapshot, c.op, c.len, false, &c.backend)
        {
            c.acp_speedup = t.seconds / c.seconds;
        }
    }
    let mut auto_vs_best = Vec::new();
    for c in cells.iter().filter(|c| c.backend == "auto") {
        let singles: Vec<&Cell> = ["cpu", "vulkan", "hybrid"]
            .iter()
            .filter_map(|b| find_cell(&cells, c.op, c.len, c.acp, b))
            .collect();
        let Some(best) = singles
            .iter()
            .copied()
            .min_by(|x, y| x.seconds.total_cmp(&y.seconds))
        else {
            continue;
        };
        let mut paired: Vec<f64> = best
            .samples
            .iter()
            .zip(&c.samples)
            .map(|(b, a)| b / a)
            .collect();
        paired.sort_by(f64::total_cmp);
        let (ci_lo, ci_hi) = ratio_interval(&best.samples, &c.samples);
        let (best_total, total_ratio) = total_ratio(&singles, c);
        auto_vs_best.push(AutoRatio {
            cell: cell_name(c),
            best: best.backend.clone(),
            ratio: best.seconds / c.seconds,
            ci_lo,
            ci_hi,
            paired_q25: quantile(&paired, 0.25),
            paired_median: quantile(&paired, 0.5),
            paired_q75: quantile(&paired, 0.75),
            best_total,
            total_ratio,
            choice: choice_words(c),
        });
    }

    let report = Report {
        machine_peak_gflops: peak,
        threads,
        heads: big.heads,
        head_dim: big.head_dim,
        device: device_name,
        calibration,
        method: format!(
            "per cell: up to {} untimed calls per backend, then up to {} rounds with the backends \
             interleaved (a random order each round), each sample a batch of calls after one \
             untimed call, as many for every backend as make >= {} ms on the fastest (fewer where \
             the minimum rounds would not fit the budget); <= {} s of timed calls per backend and cell \
             (>= {} rounds; a call slower than that: the faster of its two untimed runs is its sample); decode: \
             each backend steps its own copy of the cache; median, min, IQR per backend; auto/best = best \
             median / auto median, paired = per round",
            method.warm,
            method.rounds,
            method.batch_s * 1e3,
            method.budget_s,
            method.min_rounds
        ),
        cells,
        auto_vs_best,
    };
    let js =
        serde_json::to_string_pretty(&report).map_err(|e| Error::Internal(format!("JSON: {e}")))?;
    if json {
        println!("{js}");
    } else {
        print_table(&report);
    }
    if let Some(p) = json_out {
        std::fs::write(&p, js + "\n").map_err(|e| Error::Io { path: p, source: e })?;
    }
    if let Some(d) = plot_dir {
        std::fs::create_dir_all(&d).map_err(|e| Error::Io {
            path: d.clone(),
            source: e,
        })?;
        for &op in &ops {
            let path = d.join(format!("{op}_throughput.png"));
            plot_throughput(&path, op, &report)?;
            eprintln!("[bench] wrote {}", path.display());
        }
        let path = d.join("decay.png");
        let p = big.prefix(lens.iter().copied().min().unwrap_or(1024).max(2))?;
        super::inspect::draw_decay(
            &path,
            &p,
            ln_eps,
            &[(0, 0), (0, 1), (3, 2), (3, 3)],
            4,
            None,
        )?;
        eprintln!("[bench] wrote {}", path.display());
    }
    Ok(())
}

/// One backend's measurement of one cell.
struct Measured {
    after: Vec<String>,
    out: Vec<f32>,
    stats: AttentionStats,
    gpu_heads: Option<usize>,
    plans: Option<[u64; 3]>,
    scheduler_us: Option<f64>,
    inner: usize,
    samples: Vec<f64>,
}

/// Times every engine on `run(i, out)` (one call of engine `i`) by `method` (see
/// [`Report::method`]): warm-up calls, then interleaved rounds in a random order each, so
/// that no backend always follows another (a GPU call's host traffic, or an idle pool
/// waking, then hits every backend alike).
fn measure(
    engines: &[(String, Engine)],
    n_out: usize,
    method: Method,
    run: impl Fn(usize, &mut [f32]) -> Result<AttentionStats>,
) -> Result<Vec<Measured>> {
    let k = engines.len();
    let mut ms: Vec<Measured> = Vec::with_capacity(k);
    let mut est = Vec::with_capacity(k);
    // Whether a backend gets timed samples (else its warm-up call is its sample).
    let mut timed = Vec::with_capacity(k);
    let mut scratch = vec![0.0f32; n_out];
    let mut plans0 = Vec::with_capacity(k);
    let mut cpu_first = 0.0;
    for (i, (label, eng)) in engines.iter().enumerate() {
        if label == "cpu2" && cpu_first >= method.budget_s {
            // The control of a cell whose CPU call alone outlasts the budget: one more slow
            // call would say nothing about the noise of the timed rounds.
            ms.push(Measured {
                after: Vec::new(),
                out: Vec::new(),
                stats: AttentionStats::default(),
                gpu_heads: None,
                plans: None,
                scheduler_us: None,
                inner: 0,
                samples: Vec::new(),
            });
            est.push(f64::INFINITY);
            timed.push(false);
            plans0.push(eng.plan_counts());
            continue;
        }
        let mut out = vec![0.0f32; n_out];
        let t0 = Instant::now();
        let stats = run(i, &mut out)?;
        let first = t0.elapsed().as_secs_f64();
        if label == "cpu" {
            cpu_first = first;
        }
        // More untimed calls (caches, pools, auto's tries): a second one always, even for a
        // slow backend (the first may carry one-time work: a device upload, pipeline builds,
        // auto's first plan of a size class), more while they stay within the budget; `e` =
        // the fastest, which sizes the batches.
        let mut e = first;
        let mut spent = first;
        for w in 1..method.warm {
            if w > 1 && (first >= method.budget_s || spent + e > method.budget_s) {
                break;
            }
            let t0 = Instant::now();
            run(i, &mut scratch)?;
            let t = t0.elapsed().as_secs_f64();
            spent += t;
            e = e.min(t);
        }
        let is_timed = e < method.budget_s;
        est.push(e);
        timed.push(is_timed);
        plans0.push(eng.plan_counts());
        ms.push(Measured {
            after: if is_timed {
                Vec::new()
            } else {
                vec![String::new()]
            },
            out,
            stats,
            gpu_heads: None,
            plans: None,
            scheduler_us: None,
            inner: 1,
            samples: if is_timed { Vec::new() } else { vec![e] },
        });
    }
    // A backend kept from the common batch length by slow warm-up calls (first sends of a
    // cache, auto's tries: on the H100 host auto's fastest warm-up at decode dense 64k took
    // about 150 ms against 0.8 ms steady) gets up to `EXTRA_WARM` more untimed calls, within
    // half the budget, until one is fast enough.
    // The longest batch any timed backend gets.
    let common = est
        .iter()
        .zip(&timed)
        .filter(|&(_, &t)| t)
        .map(|(&e, _)| calls_within_budget(e, method))
        .max()
        .map_or(1, |fit| common_batch(&est, &timed, method).min(fit));
    for (i, (_, eng)) in engines.iter().enumerate() {
        let mut spent = 0.0;
        let mut extra = 0;
        while timed[i]
            && calls_within_budget(est[i], method) < common
            && extra < EXTRA_WARM
            && spent + est[i] <= method.budget_s / 2.0
        {
            let t0 = Instant::now();
            run(i, &mut scratch)?;
            let t = t0.elapsed().as_secs_f64();
            spent += t;
            est[i] = est[i].min(t);
            extra += 1;
        }
        if extra > 0 {
            plans0[i] = eng.plan_counts();
        }
    }
    for (i, inner) in batches(&est, &timed, method).into_iter().enumerate() {
        if timed[i] {
            ms[i].inner = inner;
        }
    }
    // Seconds of timed calls per backend: a backend stops once past the budget (after
    // `min_rounds` samples) or at `rounds` samples.
    let mut spent = vec![0.0f64; k];
    let mut prev = String::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut order: Vec<usize> = (0..k).collect();
    let slow_s = slow_call_s();
    for round in 0..method.rounds {
        // A fresh random order each round (Fisher-Yates, fixed seed): every backend follows
        // every other about equally often, so what one leaves behind (a GPU call's driver
        // work, cache traffic, woken or sleeping threads) is spread over all of them.
        for j in (1..k).rev() {
            order.swap(j, (xorshift(&mut rng) % (j as u64 + 1)) as usize);
        }
        for &i in &order {
            let done = ms[i].samples.len();
            if !timed[i]
                || done >= method.rounds
                || (done >= method.min_rounds && spent[i] >= method.budget_s)
            {
                continue;
            }
            // An untimed call first: the previous backend's traffic must not leave this one
            // cold caches or sleeping pool threads.
            if est[i] < 0.1 {
                run(i, &mut scratch)?;
            }
            let t0 = Instant::now();
            for call in 0..ms[i].inner {
                let t = slow_s.map(|s| (s, Instant::now()));
                run(i, &mut scratch)?;
                if let Some((s, t)) = t {
                    let took = t.elapsed().as_secs_f64();
                    if took > s {
                        eprintln!(
                            "[bench] slow call: {} round {round} call {call}: {:.3} ms",
                            engines[i].0,
                            took * 1e3
                        );
                    }
                }
            }
            let secs = t0.elapsed().as_secs_f64();
            spent[i] += secs;
            let per_call = secs / ms[i].inner as f64;
            ms[i].samples.push(per_call);
            ms[i]
                .after
                .push(std::mem::replace(&mut prev, engines[i].0.clone()));
        }
    }
    for (i, (label, eng)) in engines.iter().enumerate() {
        if label == "cpu" || label == "cpu2" {
            continue;
        }
        ms[i].gpu_heads = eng.last_split().map(|s| s.gpu_heads.len());
        let (a, b) = (plans0[i], eng.plan_counts());
        let p = [b.cpu - a.cpu, b.gpu - a.gpu, b.split - a.split];
        let calls = p.iter().sum::<u64>();
        ms[i].plans = Some(p);
        ms[i].scheduler_us = (calls > 0)
            .then(|| b.scheduler_ns.saturating_sub(a.scheduler_ns) as f64 / calls as f64 / 1e3);
    }
    Ok(ms)
}

/// `FOXEDGE_BENCH_SLOW_MS`: a timed call longer than this many milliseconds is reported on
/// stderr with its backend, round and place in its batch (each call then timed alone; unset:
/// only batches are timed). A batch's mean hides where its time went: auto's decode dense 1k
/// batches on the H100 host held one of 2.0 ms a call against 0.12 (run 101).
fn slow_call_s() -> Option<f64> {
    std::env::var("FOXEDGE_BENCH_SLOW_MS")
        .ok()?
        .parse::<f64>()
        .ok()
        .filter(|ms| ms.is_finite() && *ms > 0.0)
        .map(|ms| ms * 1e-3)
}

/// Most calls per sample (at least 1) for `min_rounds` samples of `e`-second calls to fit
/// the budget.
fn calls_within_budget(e: f64, method: Method) -> usize {
    ((method.budget_s / (method.min_rounds.max(1) as f64 * e.max(1e-9))) as usize).max(1)
}

/// Calls per sample that make `batch_s` on the fastest timed backend (1 when even its call
/// is longer).
fn common_batch(est: &[f64], timed: &[bool], method: Method) -> usize {
    let fastest = est
        .iter()
        .zip(timed)
        .filter(|&(_, &t)| t)
        .map(|(&e, _)| e)
        .fold(f64::INFINITY, f64::min);
    if fastest < method.batch_s {
        ((method.batch_s / fastest.max(1e-7)).ceil() as usize).clamp(1, 100_000)
    } else {
        1
    }
}

/// Most extra untimed calls for a backend whose warm-up was too slow for the common batch.
const EXTRA_WARM: usize = 8;

/// Calls per sample of each backend (`timed[i]`: it gets timed samples) from the fastest
/// warm-up calls `est`.
///
/// One batch length for the cell, from its fastest backend: each sample's first timed calls
/// follow another backend's, and run slower (on the H100 host at decode dense 64k, auto's
/// and hybrid's samples of one call each, the second call after a switch, read 1.0-2.9 ms
/// where the GPU backend's 30-call samples read 0.64-0.90 ms), so a backend given shorter
/// batches would carry more of that cost per call. A backend's warm-up calls may be far
/// from its steady cost (auto's first sends and tries), so it keeps the common length unless
/// `min_rounds` samples of it would outlast the budget at its warm-up speed; then as many
/// calls as fit (at least one).
fn batches(est: &[f64], timed: &[bool], method: Method) -> Vec<usize> {
    let common = common_batch(est, timed, method);
    est.iter()
        .zip(timed)
        .map(|(&e, &t)| {
            if !t {
                return 1;
            }
            common.min(calls_within_budget(e, method))
        })
        .collect()
}

/// Linear-interpolated quantile of sorted values (NaN when empty).
/// The next value of a xorshift64 generator (`state` nonzero): the bench's fixed-seed
/// draws (round orders, bootstrap resamples).
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Resamples of [`ratio_interval`].
const BOOTSTRAP_RESAMPLES: usize = 2000;

/// A 90% bootstrap interval (5th and 95th percentiles) of `median(best) / median(auto)`,
/// samples in round order: the rounds both ran are drawn with replacement, the same rounds
/// for both (a round's noise, shared by the backends timed in it, stays paired),
/// [`BOOTSTRAP_RESAMPLES`] times from a fixed seed. NaN with fewer than 2 such rounds.
/// How far a cell's ratio can move with the rounds it happened to get: two identical
/// engines read up to 5% apart in one cell of the H100 host's runs.
fn ratio_interval(best: &[f64], auto: &[f64]) -> (f64, f64) {
    let n = best.len().min(auto.len());
    if n < 2 {
        return (f64::NAN, f64::NAN);
    }
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let (mut b, mut a) = (vec![0.0; n], vec![0.0; n]);
    let mut ratios = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
    for _ in 0..BOOTSTRAP_RESAMPLES {
        for i in 0..n {
            let j = (xorshift(&mut rng) % n as u64) as usize;
            (b[i], a[i]) = (best[j], auto[j]);
        }
        b.sort_by(f64::total_cmp);
        a.sort_by(f64::total_cmp);
        ratios.push(quantile(&b, 0.5) / quantile(&a, 0.5));
    }
    ratios.sort_by(f64::total_cmp);
    (quantile(&ratios, 0.05), quantile(&ratios, 0.95))
}

/// auto/best by total time: the backend of `singles` whose samples have the smallest mean
/// (seconds a call, over the same rounds and batch lengths as auto's), and that mean / auto's
/// mean. The median ratio is what one call usually costs; this one is the throughput over
/// the cell. They part where calls come in regimes: on the H100 host beside 12-23 spinning
/// processes, decode dense 1k read >= 0.95 by the median in 4 of 16 runs and by total time
/// in 13 (runs 112-127). ("-", NaN) when no backend has samples.
fn total_ratio(singles: &[&Cell], auto: &Cell) -> (String, f64) {
    let auto_mean = sample_mean(&auto.samples).unwrap_or(f64::NAN);
    singles
        .iter()
        .filter_map(|c| Some((c, sample_mean(&c.samples)?)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .map_or(("-".to_string(), f64::NAN), |(c, m)| {
            (c.backend.clone(), m / auto_mean)
        })
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let x = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let i = x.floor() as usize;
            let f = x - i as f64;
            let j = (i + 1).min(n - 1);
            sorted[i] * (1.0 - f) + sorted[j] * f
        }
    }
}

/// auto's plans over its timed calls: `cpu`, `vulkan`, `split 2/16`, or the mix
/// (`cpu 9 + split 3`), and its scheduler's time per call (`; sched 3.1 us`).
fn choice_words(c: &Cell) -> String {
    let Some([cpu, gpu, split]) = c.plans else {
        return "cpu".into();
    };
    let split_name = match c.gpu_heads {
        Some(g) if cpu == 0 && gpu == 0 => format!("split {g} gpu heads"),
        _ => "split".into(),
    };
    let parts: Vec<(u64, String)> = [
        (cpu, "cpu".to_string()),
        (gpu, "vulkan".to_string()),
        (split, split_name),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .collect();
    let plans = match parts.as_slice() {
        [] => "-".into(),
        [(_, s)] => s.clone(),
        _ => parts
            .iter()
            .map(|(n, s)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(" + "),
    };
    match c.scheduler_us {
        Some(us) => format!("{plans}; sched {us:.1} us"),
        None => plans,
    }
}

/// `1024`, `4k`, `64K` → tokens (>= 2).
/// A depth: N or Nk tokens, 0 allowed.
fn parse_depth(s: &str) -> std::result::Result<usize, String> {
    match s.trim() {
        "0" => Ok(0),
        t => parse_len(t),
    }
}

fn parse_len(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.strip_suffix(['k', 'K']) {
        Some(n) => (n, 1024),
        None => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n >= 2)
        .ok_or_else(|| format!("`{s}` is not a length N or Nk of >= 2 tokens"))
}

/// `tests/fixtures/fox-tiny-pro/long_input_ids.npy` beside the model's repository.
fn fixture_ids(model_dir: &Path) -> Result<PathBuf> {
    let rel = Path::new("tests/fixtures/fox-tiny-pro/long_input_ids.npy");
    let mut roots: Vec<PathBuf> = model_dir.ancestors().map(Path::to_path_buf).collect();
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    roots
        .iter()
        .map(|r| r.join(rel))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no --ids given and {} was not found near {}",
                rel.display(),
                model_dir.display()
            ))
        })
}

/// Kept FLOPs of a call: `4 · head_dim · kept` (QK^T and PV, a multiply-add = 2 FLOPs).
fn flops(st: &AttentionStats, head_dim: usize) -> f64 {
    4.0 * head_dim as f64 * st.kept_pairs() as f64
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

fn print_table(r: &Report) {
    println!(
        "# foxedge bench: {} heads x {} dims (all layers of the model), {} threads, fp32 FMA \
         peak {:.0} GFLOP/s; device: {}",
        r.heads,
        r.head_dim,
        r.threads,
        r.machine_peak_gflops,
        r.device.as_deref().unwrap_or("none")
    );
    if let Some(c) = &r.calibration {
        println!("# calibration: {c}");
    }
    println!("# method: {}", r.method);
    println!(
        "{:<8} {:>6} {:<5} {:<7} {:>10} {:>10} {:>6} {:>9} {:>9} {:>7} {:>6} {:>7} {:>7} {:>5} {:>9}",
        "op",
        "L",
        "acp",
        "backend",
        "median ms",
        "min ms",
        "IQR",
        "n x calls",
        "GFLOP/s",
        "%peak",
        "kept",
        "vs cpu",
        "acp x",
        "gpuH",
        "|d| cpu"
    );
    // % of the CPU's FMA peak; not shown for work on a discrete GPU (another machine's peak).
    let gpu_is_cpu = r.device.as_deref().is_some_and(|d| d.contains("(Cpu)"));
    for c in &r.cells {
        let pct = if c.gpu_heads.unwrap_or(0) > 0 && !gpu_is_cpu {
            "-".to_string()
        } else {
            format!("{:.1}%", c.peak_fraction * 100.0)
        };
        println!(
            "{:<8} {:>6} {:<5} {:<7} {:>10.4} {:>10.4} {:>5.1}% {:>9} {:>9.1} {:>7} {:>6.3} {:>7.2} {:>7.2} {:>5} {:>9.1e}",
            c.op,
            c.len,
            if c.acp { "acp" } else { "dense" },
            c.backend,
            c.seconds * 1e3,
            c.min_seconds * 1e3,
            c.iqr_fraction * 100.0,
            format!("{}x{}", c.reps, c.inner),
            c.gflops,
            pct,
            c.kept_fraction,
            c.vs_cpu,
            c.acp_speedup,
            c.gpu_heads.map_or("-".to_string(), |g| g.to_string()),
            c.max_abs_diff_vs_cpu
        );
    }
    if r.auto_vs_best.is_empty() {
        return;
    }
    // The summary as a Markdown table (medians in ms; min in brackets).
    println!();
    println!(
        "| op | L | kept | cpu | vulkan | hybrid (gpu heads) | auto [choice] | auto/best [90% CI] (paired IQR) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let get = |op: &str, len: usize, acp: bool, b: &str| find_cell(&r.cells, op, len, acp, b);
    let ms = |c: Option<&Cell>| {
        c.map_or("-".to_string(), |c| {
            format!("{} ({})", sig(c.seconds * 1e3), sig(c.min_seconds * 1e3))
        })
    };
    for a in &r.auto_vs_best {
        let Some(auto) = r
            .cells
            .iter()
            .find(|c| c.backend == "auto" && a.cell == cell_name(c))
        else {
            continue;
        };
        let (op, len, acp) = (auto.op, auto.len, auto.acp);
        let hy = get(op, len, acp, "hybrid").map_or("-".to_string(), |c| {
            format!("{} ({})", ms(Some(c)), c.gpu_heads.unwrap_or(0))
        });
        println!(
            "| {op} {} | {} | {:.3} | {} | {} | {hy} | {} [{}] | {:.3} [{:.3}-{:.3}] ({:.2}-{:.2}) |",
            if acp { "ACP" } else { "dense" },
            len_name(len),
            auto.kept_fraction,
            ms(get(op, len, acp, "cpu")),
            ms(get(op, len, acp, "vulkan")),
            ms(Some(auto)),
            a.choice,
            a.ratio,
            a.ci_lo,
            a.ci_hi,
            a.paired_q25,
            a.paired_q75
        );
    }
    let pass = r.auto_vs_best.iter().filter(|a| a.ratio >= 0.95).count();
    let below = r.auto_vs_best.iter().filter(|a| a.ci_hi < 0.95).count();
    println!(
        "# auto / best single backend >= 0.95 in {pass} of {} cells; its whole 90% interval \
         below 0.95 in {below} (one run; repeated runs' --out reports pool with --pool)",
        r.auto_vs_best.len()
    );
    let totals: Vec<String> = r
        .auto_vs_best
        .iter()
        .map(|a| format!("{} {:.3} ({})", a.cell, a.total_ratio, a.best_total))
        .collect();
    println!(
        "# auto / best single backend by total time (mean call time over the samples): {}",
        totals.join(", ")
    );
    for (one, two) in [("cpu", "cpu2"), ("vulkan", "vulkan2")] {
        let floor: Vec<String> = r
            .cells
            .iter()
            .filter(|c| c.backend == two)
            .filter_map(|c| {
                let first = get(c.op, c.len, c.acp, one)?;
                Some(format!("{} {:.3}", cell_name(c), first.seconds / c.seconds))
            })
            .collect();
        if !floor.is_empty() {
            println!(
                "# control ({one} / {two}, two identical engines): {}",
                floor.join(", ")
            );
        }
    }
    // Order effect: CPU-run samples split by whether a GPU-using backend ran just before.
    let mut order = Vec::new();
    for c in r.cells.iter().filter(|c| {
        matches!(c.backend.as_str(), "cpu" | "cpu2")
            || (c.backend == "auto" && c.plans.is_some_and(|p| p[1] + p[2] == 0))
    }) {
        let split = |gpu: bool| {
            let mut v: Vec<f64> = c
                .samples
                .iter()
                .zip(&c.after)
                .filter(|(_, a)| {
                    !a.is_empty() && matches!(a.as_str(), "vulkan" | "vulkan2" | "hybrid") == gpu
                })
                .map(|(s, _)| *s)
                .collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (g, n) = (split(true), split(false));
        if g.len() >= 2 && n.len() >= 2 {
            order.push(format!(
                "{} {}: {:.3}",
                cell_name(c),
                c.backend,
                quantile(&g, 0.5) / quantile(&n, 0.5)
            ));
        }
    }
    if !order.is_empty() {
        println!(
            "# order effect (median after vulkan/hybrid / median after a CPU-only backend): {}",
            order.join(", ")
        );
    }
}

/// The cell of `backend` at (op, len, acp).
fn find_cell<'a>(
    cells: &'a [Cell],
    op: &str,
    len: usize,
    acp: bool,
    backend: &str,
) -> Option<&'a Cell> {
    cells
        .iter()
        .find(|c| c.op == op && c.len == len && c.acp == acp && c.backend == backend)
}

fn cell_name(c: &Cell) -> String {
    cell_label(c.op, c.len as u64, c.acp)
}

fn len_name(len: usize) -> String {
    if len.is_multiple_of(1024) {
        format!("{}k", len / 1024)
    } else {
        len.to_string()
    }
}

/// Three significant digits.
fn sig(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn plot_throughput(path: &Path, op: &str, r: &Report) -> Result<()> {
    let mut series = Vec::new();
    let mut names: Vec<&str> = r.cells.iter().map(|c| c.backend.as_str()).collect();
    names.dedup();
    let mut uniq: Vec<&str> = Vec::new();
    for n in names {
        if !uniq.contains(&n) {
            uniq.push(n);
        }
    }
    for (bi, b) in uniq.iter().enumerate() {
        for acp in [false, true] {
            let pts: Vec<(f64, f64)> = r
                .cells
                .iter()
                .filter(|c| c.op == op && c.backend == *b && c.acp == acp)
                .map(|c| (c.len as f64, c.gflops))
                .collect();
            if pts.is_empty() {
                continue;
            }
            series.push(Series {
                name: format!("{b} {}", if acp { "acp" } else { "dense" }),
                color: PALETTE[bi % PALETTE.len()],
                dashed: !acp,
                points: pts,
            });
        }
    }
    line_chart(
        path,
        &format!(
            "{op}: kept GFLOP/s vs context, {} heads x {}",
            r.heads, r.head_dim
        ),
        "context length (tokens)",
        "GFLOP/s",
        &series,
    )
}

#[cfg(test)]
mod tests {
    use super::{Cell, Method, batches, ratio_interval, total_ratio, xorshift};

    fn cell(backend: &str, samples: &[f64]) -> Cell {
        Cell {
            op: "decode",
            len: 1024,
            acp: false,
            backend: backend.into(),
            seconds: f64::NAN,
            min_seconds: f64::NAN,
            max_seconds: f64::NAN,
            iqr_fraction: f64::NAN,
            reps: samples.len(),
            inner: 1,
            samples: samples.to_vec(),
            after: vec![String::new(); samples.len()],
            gflops: 0.0,
            peak_fraction: 0.0,
            kept_fraction: 1.0,
            vs_cpu: 1.0,
            acp_speedup: 1.0,
            gpu_heads: None,
            plans: None,
            scheduler_us: None,
            max_abs_diff_vs_cpu: 0.0,
        }
    }

    /// Runs 112-127's pattern: the CPU is fastest in most rounds (its median wins) but
    /// slow in a few (a busy phase); auto follows the GPU there. By the median auto loses
    /// to the CPU, by total time it beats both.
    #[test]
    fn the_total_time_ratio_counts_every_round() {
        let cpu = cell("cpu", &[0.1, 0.1, 0.1, 2.0, 2.0]);
        let gpu = cell("vulkan", &[0.3, 0.3, 0.3, 0.5, 0.5]);
        let auto = cell("auto", &[0.1, 0.3, 0.3, 0.5, 0.5]);
        let (best, r) = total_ratio(&[&cpu, &gpu], &auto);
        assert_eq!(best, "vulkan");
        assert!((r - 1.9 / 1.7).abs() < 1e-12, "{r}");
        let (best, r) = total_ratio(&[&cell("cpu", &[])], &auto);
        assert_eq!(best, "-");
        assert!(r.is_nan());
    }

    /// The interval holds the whole-sample ratio; a constant ratio gives a point; it
    /// narrows with more rounds.
    #[test]
    fn the_ratio_interval_brackets_the_ratio_and_narrows_with_rounds() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut noise = || 0.8 + 0.4 * (xorshift(&mut rng) >> 11) as f64 / (1u64 << 53) as f64;
        let best: Vec<f64> = (0..320).map(|_| noise()).collect();
        let auto: Vec<f64> = best.iter().map(|b| b / 0.9).collect();
        let (lo, hi) = ratio_interval(&best, &auto);
        assert!(
            (lo - 0.9).abs() < 1e-12 && (hi - 0.9).abs() < 1e-12,
            "{lo} {hi}"
        );
        let auto: Vec<f64> = (0..320).map(|_| noise()).collect();
        let median = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            super::quantile(&s, 0.5)
        };
        let width = |n: usize| {
            let (lo, hi) = ratio_interval(&best[..n], &auto[..n]);
            let r = median(&best[..n]) / median(&auto[..n]);
            assert!(lo <= r && r <= hi, "{n}: {lo} {r} {hi}");
            hi - lo
        };
        let (w20, w320) = (width(20), width(320));
        assert!(w320 < 0.5 * w20, "{w20} {w320}");
        assert!(ratio_interval(&best[..1], &auto[..1]).0.is_nan());
    }

    #[test]
    fn backends_share_the_fastest_backends_batch_length() {
        let m = Method {
            rounds: 80,
            warm: 3,
            batch_s: 0.020,
            budget_s: 8.0,
            min_rounds: 3,
        };
        // H100 decode dense 64k: vulkan 1.19 ms, cpu 6.1 ms, auto and hybrid warming up at
        // 25 and 30 ms (first sends, tries), a 1 s backend, one slower than the budget (not
        // timed) and a skipped one.
        let est = [6.1e-3, 1.19e-3, 25e-3, 0.030, 1.0, 9.0, f64::INFINITY];
        let timed = [true, true, true, true, true, false, false];
        let b = batches(&est, &timed, m);
        // ceil(20 ms / 1.19 ms) = 17 calls for every backend whose 3 samples fit in 8 s.
        assert_eq!(&b[..4], &[17, 17, 17, 17]);
        // 3 samples of 17 one-second calls would not: floor(8 / 3) = 2 calls.
        assert_eq!(b[4], 2);
        assert_eq!(&b[5..], &[1, 1]);
    }
}
