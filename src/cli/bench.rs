//! `foxedge bench`: attention prefill and decode on each backend, dense and with ACP, over
//! context lengths, on the bundled model's real q/k/v/gates (all layers' heads in one call).
//!
//! Reported per cell: best-of-N wall time, kept GFLOP/s (`4 · head_dim · kept_pairs`
//! FLOPs), that as a fraction of this machine's measured fp32 FMA peak (all threads),
//! the kept fraction, and speedups: against the CPU (same op, length and pruning) and of
//! ACP against dense (same backend).

use super::args::Args;
use foxedge::hybrid::{AcpMode, CallStats, Engine, read_token_rows, real_gate_problem};
use foxedge::plot::{PALETTE, Series, line_chart};
use foxedge::{BackendKind, Error, Model, Result};
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
    /// Best wall time of `reps` runs (seconds).
    pub seconds: f64,
    pub reps: usize,
    pub gflops: f64,
    pub peak_fraction: f64,
    pub kept_fraction: f64,
    /// CPU time / this time (same op, len, acp).
    pub vs_cpu: f64,
    /// Dense time / ACP time (same backend, op, len); 1 for dense rows.
    pub acp_speedup: f64,
    /// Heads on the GPU in the last run (hybrid/auto), of `heads`.
    pub gpu_heads: Option<usize>,
    /// Largest |difference| from the CPU output (same op, len, acp).
    pub max_abs_diff_vs_cpu: f32,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    machine_peak_gflops: f64,
    threads: usize,
    heads: usize,
    head_dim: usize,
    device: Option<String>,
    calibration: Option<String>,
    cells: Vec<Cell>,
    /// auto time / best single-backend time, per (op, len, acp).
    auto_vs_best: Vec<(String, f64)>,
}

pub fn run(rest: Vec<String>) -> Result<()> {
    let mut a = Args::new(rest);
    let json = a.flag("--json");
    let json_out = a.value("--out")?.map(PathBuf::from);
    let full = a.flag("--full");
    let plot_dir = a.value("--plot")?.map(PathBuf::from);
    let model_dir = a.value("--model")?;
    let ids_path = a.value("--ids")?.map(PathBuf::from);
    let device = a.value("--device")?;
    let backends_arg = a.value("--backend")?;
    let lens_arg = a.value("--lengths")?;
    let max_reps: usize = a.parsed("--reps")?.unwrap_or(5);
    let ln_eps: f64 = a.parsed("--log-eps")?.unwrap_or(-10.0);
    a.finish()?;
    if max_reps == 0 {
        return Err(Error::InvalidArgument("--reps must be > 0".into()));
    }
    if !(ln_eps.is_finite() && ln_eps < 0.0) {
        return Err(Error::InvalidArgument(
            "--log-eps must be finite and < 0".into(),
        ));
    }
    let backends: Vec<BackendKind> = match backends_arg.as_deref() {
        None | Some("all") => vec![
            BackendKind::Cpu,
            BackendKind::Vulkan,
            BackendKind::Hybrid,
            BackendKind::Auto,
        ],
        Some(s) => s
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<BackendKind>>>()?,
    };
    let lens: Vec<usize> = match lens_arg {
        Some(s) => s
            .split(',')
            .map(|x| parse_len(x.trim()))
            .collect::<Result<_>>()?,
        None if full => vec![1024, 4096, 16384, 65536],
        None => vec![1024, 4096],
    };
    let dir = match model_dir {
        Some(m) => PathBuf::from(m),
        None => super::default_model_dir()?,
    };
    let ids_path = match ids_path {
        Some(p) => p,
        None => fixture_ids(&dir)?,
    };
    let model = Arc::new(Model::open(&dir)?);
    let rows = read_token_rows(&ids_path)?;
    let max_len = lens.iter().copied().max().unwrap_or(1024);
    eprintln!(
        "[bench] running the model over {max_len} tokens of {} for real gates",
        ids_path.display()
    );
    let t0 = Instant::now();
    let big = real_gate_problem(&model, &rows, max_len)?;
    eprintln!(
        "[bench] captured in {:.1} s; measuring the FMA peak",
        t0.elapsed().as_secs_f64()
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let peak = foxedge_cpu::limits::fma_peak_gflops(threads, 0.3);

    let mut engines: Vec<(BackendKind, Engine)> = Vec::new();
    for &k in &backends {
        match Engine::with_device(k, device.as_deref()) {
            Ok(e) => engines.push((k, e)),
            Err(e) => eprintln!("[bench] skipping {k}: {e}"),
        }
    }
    if !engines.iter().any(|(k, _)| *k == BackendKind::Cpu) {
        engines.insert(0, (BackendKind::Cpu, Engine::new(BackendKind::Cpu)?));
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
    for op in ["prefill", "decode"] {
        for &len in &lens {
            let p = big.prefix(len)?;
            let dp = if op == "decode" {
                Some(p.decode_at(len)?)
            } else {
                None
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
                let run = |eng: &Engine, out: &mut [f32]| -> Result<CallStats> {
                    match &dp {
                        Some(d) => eng.decode(d, mode, out),
                        None => eng.prefill(&p, mode, out),
                    }
                };
                // Warm-up (and the output) of every backend, then the timed rounds with the
                // backends interleaved, so that load drifting on a shared machine hits them
                // alike; a backend whose warm-up took > 1 s keeps that one timing.
                let mut outs = Vec::with_capacity(engines.len());
                let mut best = Vec::with_capacity(engines.len());
                let mut inner = Vec::with_capacity(engines.len());
                let mut stats = Vec::with_capacity(engines.len());
                let mut splits = Vec::with_capacity(engines.len());
                for (_, eng) in &engines {
                    let mut out = vec![0.0f32; n_out];
                    let t0 = Instant::now();
                    stats.push(run(eng, &mut out)?);
                    let first = t0.elapsed().as_secs_f64();
                    splits.push(eng.last_split().map(|s| s.gpu_heads.len()));
                    best.push(first);
                    // Decode steps are batched so that one timing covers >= ~5 ms.
                    inner.push(if op == "decode" {
                        ((5e-3 / first.max(1e-6)) as usize).clamp(1, 1000)
                    } else {
                        1
                    });
                    outs.push(out);
                }
                let firsts = best.clone();
                let mut reps = vec![1usize; engines.len()];
                let mut scratch = vec![0.0f32; n_out];
                for _ in 0..max_reps {
                    for (i, (_, eng)) in engines.iter().enumerate() {
                        if best[i] > 1.0 {
                            continue;
                        }
                        if reps[i] == 1 {
                            best[i] = f64::INFINITY;
                            reps[i] = 0;
                        }
                        // An untimed run first: the previous backend's traffic must not
                        // leave this one a cold cache (the order would bias the timings).
                        if firsts[i] < 0.1 {
                            run(eng, &mut scratch)?;
                        }
                        let t0 = Instant::now();
                        for _ in 0..inner[i] {
                            run(eng, &mut scratch)?;
                        }
                        best[i] = best[i].min(t0.elapsed().as_secs_f64() / inner[i] as f64);
                        reps[i] += 1;
                    }
                }
                let cpu_i = engines.iter().position(|(k, _)| *k == BackendKind::Cpu);
                for (i, (kind, _)) in engines.iter().enumerate() {
                    let diff = cpu_i.map_or(0.0, |c| max_abs_diff(&outs[c], &outs[i]));
                    let secs = best[i];
                    let gflops = stats[i].flops(p.head_dim) / secs / 1e9;
                    cells.push(Cell {
                        op,
                        len,
                        acp,
                        backend: kind.name().to_string(),
                        seconds: secs,
                        reps: reps[i],
                        gflops,
                        peak_fraction: gflops / peak,
                        kept_fraction: stats[i].kept_fraction(),
                        vs_cpu: 1.0,
                        acp_speedup: 1.0,
                        gpu_heads: splits[i],
                        max_abs_diff_vs_cpu: diff,
                    });
                    eprintln!(
                        "[bench] {op} L={len} {} {kind}: {:.3} ms",
                        if acp { "acp" } else { "dense" },
                        secs * 1e3
                    );
                }
            }
        }
    }
    // Speedups.
    let find = |cells: &[Cell], op: &str, len: usize, acp: bool, b: &str| {
        cells
            .iter()
            .find(|c| c.op == op && c.len == len && c.acp == acp && c.backend == b)
            .map(|c| c.seconds)
    };
    let snapshot = cells.clone();
    for c in &mut cells {
        if let Some(t) = find(&snapshot, c.op, c.len, c.acp, "cpu") {
            c.vs_cpu = t / c.seconds;
        }
        if c.acp
            && let Some(t) = find(&snapshot, c.op, c.len, false, &c.backend)
        {
            c.acp_speedup = t / c.seconds;
        }
    }
    let mut auto_vs_best = Vec::new();
    for c in cells.iter().filter(|c| c.backend == "auto") {
        let best = ["cpu", "vulkan", "hybrid"]
            .iter()
            .filter_map(|b| find(&cells, c.op, c.len, c.acp, b))
            .fold(f64::INFINITY, f64::min);
        if best.is_finite() {
            auto_vs_best.push((
                format!(
                    "{} L={} {}",
                    c.op,
                    c.len,
                    if c.acp { "acp" } else { "dense" }
                ),
                best / c.seconds,
            ));
        }
    }

    let report = Report {
        machine_peak_gflops: peak,
        threads,
        heads: big.heads,
        head_dim: big.head_dim,
        device: device_name,
        calibration,
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
        for op in ["prefill", "decode"] {
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

/// `1024`, `4k`, `64K` → tokens.
fn parse_len(s: &str) -> Result<usize> {
    let (num, mul) = match s.strip_suffix(['k', 'K']) {
        Some(n) => (n, 1024),
        None => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n >= 2)
        .ok_or_else(|| Error::InvalidArgument(format!("--lengths: bad length `{s}` (>= 2)")))
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
    println!(
        "{:<8} {:>6} {:<5} {:<7} {:>11} {:>9} {:>7} {:>6} {:>7} {:>7} {:>5} {:>9}",
        "op",
        "L",
        "acp",
        "backend",
        "time ms",
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
            "{:<8} {:>6} {:<5} {:<7} {:>11.3} {:>9.1} {:>7} {:>6.3} {:>7.2} {:>7.2} {:>5} {:>9.1e}",
            c.op,
            c.len,
            if c.acp { "acp" } else { "dense" },
            c.backend,
            c.seconds * 1e3,
            c.gflops,
            pct,
            c.kept_fraction,
            c.vs_cpu,
            c.acp_speedup,
            c.gpu_heads.map_or("-".to_string(), |g| g.to_string()),
            c.max_abs_diff_vs_cpu
        );
    }
    if !r.auto_vs_best.is_empty() {
        println!("# auto / best single backend (>= 0.95 wanted):");
        for (k, v) in &r.auto_vs_best {
            println!("#   {k}: {v:.3}");
        }
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
