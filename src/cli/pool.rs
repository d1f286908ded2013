//! `foxedge bench --pool a.json,b.json,...`: `auto` against the best single backend per
//! cell, pooled over repeated `foxedge bench --out` runs.
//!
//! One run's ratio of a cell moves with its host: on the H100 host two identical engines
//! read up to 6% apart in one cell of one run. So whether `auto` holds 0.95x the best
//! backend on a shape is judged over runs. Per cell, with `r_i = ln(best_i / auto_i)` over
//! the `n` runs that measured it (each a separate process with its own calibration, so its
//! runs are independent):
//!
//! - pooled ratio = `exp(mean r)`, the geometric mean of the runs' ratios;
//! - its one-sided 95% lower bound = `exp(mean r - t(0.95, n-1) · sd(r) / sqrt(n))`
//!   (Student's t, [`t95`]; none with one run).
//!
//! Beside each cell, what `auto`'s two known costs took, as fractions of the best
//! backend's median, averaged over the runs: its own time per call (`scheduler_us`), and
//! its calls on other plans than the best backend's (each all-CPU, all-GPU or split call
//! costed at the `cpu`, `vulkan` or `hybrid` median less the best: an estimate, as a
//! split of `auto` need not be `hybrid`'s).
//!
//! The same pooling of each run's ratio by total time (the single backend with the
//! smallest mean call time over its samples / auto's mean, as `bench` prints it): the
//! median says what one call usually costs, the mean what the cell's calls cost in all, and
//! beside a busy neighbour the two part (see `bench`'s `total_ratio`).
//!
//! The control pairs of `--control` runs (`cpu`/`cpu2`, `vulkan`/`vulkan2`: two identical
//! engines of one cell) give the noise one run's ratio carries: the sample deviation of
//! their ln ratios over every cell and run, and how many of them read outside
//! `[0.95, 1/0.95]`.

use foxedge::{Error, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The bar `auto` is held to against the best single backend.
const BAR: f64 = 0.95;

/// One run's report, as far as pooling reads it.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    path: PathBuf,
    method: String,
    device: String,
    /// (cell, best median / auto median).
    ratios: Vec<(String, f64)>,
    /// (cell, best mean / auto mean over the samples): by total time.
    totals: Vec<(String, f64)>,
    /// (cell, first engine's median / its twin's): cpu/cpu2 and vulkan/vulkan2.
    controls: Vec<(String, f64)>,
    /// (cell, auto's own time, its off-best plans' excess), fractions of the best median.
    costs: Vec<(String, f64, f64)>,
}

/// One cell pooled over the runs that measured it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Pooled {
    pub cell: String,
    /// best / auto of each run, in the order the files were given.
    pub ratios: Vec<f64>,
    /// Geometric mean of `ratios`.
    pub pooled: f64,
    /// One-sided 95% lower bound of the pooled ratio (None with one run).
    pub lower95: Option<f64>,
    /// auto's own time per call over the best median, mean of the runs that report it.
    pub own_time: Option<f64>,
    /// auto's calls on other plans than the best backend's: their estimated excess over
    /// the best median, per call of auto, over the best median (mean of the runs).
    pub off_best: Option<f64>,
    /// By total time: each run's ratio, their geometric mean and its lower bound (None
    /// without samples; no bound with one run).
    pub totals: Vec<f64>,
    pub total_pooled: Option<f64>,
    pub total_lower95: Option<f64>,
}

/// Every cell pooled, and the identical engines' noise.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    pub runs: Vec<String>,
    pub cells: Vec<Pooled>,
    /// Sample deviation of ln(engine / twin) over the control pairs of every cell and run.
    pub control_ln_sd: Option<f64>,
    /// Control pairs read outside [0.95, 1/0.95], of all.
    pub control_outside: (usize, usize),
    /// The runs' `method` lines differ (their cells were timed differently).
    pub methods_differ: bool,
    /// The runs' devices differ.
    pub devices_differ: bool,
}

/// A cell's name in `bench`'s summary lines and its report's `auto_vs_best`
/// (`decode L=4096 acp`); pooling matches cells across reports by it.
pub(super) fn cell_label(op: &str, len: u64, acp: bool) -> String {
    format!("{op} L={len} {}", if acp { "acp" } else { "dense" })
}

/// Mean seconds a call over a cell's samples (each a batch's seconds per call, all batches
/// of a cell the same length): None without samples or when not finite and > 0.
pub(super) fn sample_mean(samples: &[f64]) -> Option<f64> {
    let m = samples.iter().sum::<f64>() / samples.len() as f64;
    (m.is_finite() && m > 0.0).then_some(m)
}

/// One-sided 95% quantile of Student's t with `df` degrees of freedom (`df >= 1`): table
/// values to 30, then `1.645 + 1.6 / df` (within 0.002 of the quantile from 40 up).
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771,
        1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706,
        1.703, 1.701, 1.699, 1.697,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        _ => 1.645 + 1.6 / df as f64,
    }
}

/// Mean and sample deviation (None below two values).
fn mean_sd(x: &[f64]) -> (f64, Option<f64>) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let sd = (x.len() >= 2)
        .then(|| (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0)).sqrt());
    (m, sd)
}

fn bad(path: &Path, why: &str) -> Error {
    Error::InvalidArgument(format!(
        "--pool {}: {why} (expected a `foxedge bench --out` report)",
        path.display()
    ))
}

/// A positive finite number at `v[key]`.
fn positive(v: &Value, key: &str) -> Option<f64> {
    v.get(key)
        .and_then(Value::as_f64)
        .filter(|x| x.is_finite() && *x > 0.0)
}

/// Reads one report from `text` (`path` for errors).
fn parse(path: &Path, text: &str) -> Result<Run> {
    let v: Value = serde_json::from_str(text).map_err(|e| bad(path, &format!("not JSON: {e}")))?;
    let str_of = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let ratios = v
        .get("auto_vs_best")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(path, "no `auto_vs_best` list"))?
        .iter()
        .map(|a| {
            let cell = a.get("cell").and_then(Value::as_str);
            match (cell, positive(a, "ratio")) {
                (Some(c), Some(r)) => Ok((c.to_string(), r)),
                _ => Err(bad(
                    path,
                    "an `auto_vs_best` entry without a cell or a ratio > 0",
                )),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let cells = v
        .get("cells")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(path, "no `cells` list"))?;
    // (cell, backend, entry) of every cell, named as `bench` names them.
    let mut named = Vec::with_capacity(cells.len());
    for c in cells {
        let (Some(op), Some(len), Some(acp), Some(backend)) = (
            c.get("op").and_then(Value::as_str),
            c.get("len").and_then(Value::as_u64),
            c.get("acp").and_then(Value::as_bool),
            c.get("backend").and_then(Value::as_str),
        ) else {
            return Err(bad(path, "a cell without op, len, acp or backend"));
        };
        named.push((cell_label(op, len, acp), backend, c));
    }
    let entry = |cell: &str, b: &str| {
        named
            .iter()
            .find(|(c, k, _)| c == cell && *k == b)
            .map(|m| m.2)
    };
    let median = |cell: &str, b: &str| entry(cell, b).and_then(|m| positive(m, "seconds"));
    let mean = |cell: &str, b: &str| {
        let v: Vec<f64> = entry(cell, b)?
            .get("samples")?
            .as_array()?
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        sample_mean(&v)
    };
    let mut totals = Vec::new();
    let mut costs = Vec::new();
    for (cell, _, c) in named.iter().filter(|(_, b, _)| *b == "auto") {
        if let (Some(best), Some(a)) = (
            ["cpu", "vulkan", "hybrid"]
                .iter()
                .filter_map(|b| mean(cell, b))
                .reduce(f64::min),
            mean(cell, "auto"),
        ) {
            totals.push((cell.clone(), best / a));
        }
        let plan_t: Vec<Option<f64>> = ["cpu", "vulkan", "hybrid"]
            .iter()
            .map(|b| median(cell, b))
            .collect();
        let Some(best) = plan_t.iter().flatten().copied().reduce(f64::min) else {
            continue;
        };
        let plans: Vec<f64> = c
            .get("plans")
            .and_then(Value::as_array)
            .map(|p| p.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        let own = positive(c, "scheduler_us").map_or(0.0, |us| us * 1e-6 / best);
        let calls: f64 = plans.iter().sum();
        let excess: f64 = plans
            .iter()
            .zip(&plan_t)
            .map(|(&n, t)| n * t.map_or(0.0, |t| (t - best).max(0.0)))
            .sum();
        if plans.len() == 3 && calls > 0.0 {
            costs.push((cell.clone(), own, excess / (calls * best)));
        }
    }
    let mut controls = Vec::new();
    for (cell, b) in named.iter().map(|(c, b, _)| (c, *b)) {
        if (b == "cpu" || b == "vulkan")
            && let (Some(s), Some(t)) = (median(cell, b), median(cell, &format!("{b}2")))
        {
            controls.push((cell.clone(), s / t));
        }
    }
    Ok(Run {
        path: path.to_path_buf(),
        method: str_of("method"),
        device: str_of("device"),
        ratios,
        totals,
        controls,
        costs,
    })
}

/// The geometric mean of `ratios` and its one-sided 95% lower bound (see the module docs;
/// none with fewer than two).
fn geo_bound(ratios: &[f64]) -> (f64, Option<f64>) {
    let logs: Vec<f64> = ratios.iter().map(|x| x.ln()).collect();
    let (m, sd) = mean_sd(&logs);
    let n = logs.len();
    (
        m.exp(),
        sd.map(|s| (m - t95(n - 1) * s / (n as f64).sqrt()).exp()),
    )
}

/// Pools `runs` (see the module docs). Cells in first-seen order.
fn pool(runs: &[Run]) -> Summary {
    let mut names: Vec<&str> = Vec::new();
    for r in runs {
        for (c, _) in &r.ratios {
            if !names.contains(&c.as_str()) {
                names.push(c);
            }
        }
    }
    let cells = names
        .iter()
        .map(|&name| {
            let ratios: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.ratios.iter().find(|(c, _)| c == name).map(|x| x.1))
                .collect();
            let (m, lower95) = geo_bound(&ratios);
            let totals: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.totals.iter().find(|(c, _)| c == name).map(|x| x.1))
                .collect();
            let (tm, total_lower95) = geo_bound(&totals);
            let costs: Vec<(f64, f64)> = runs
                .iter()
                .filter_map(|r| r.costs.iter().find(|(c, ..)| c == name).map(|x| (x.1, x.2)))
                .collect();
            let mean_of = |f: fn(&(f64, f64)) -> f64| {
                (!costs.is_empty()).then(|| costs.iter().map(f).sum::<f64>() / costs.len() as f64)
            };
            Pooled {
                own_time: mean_of(|c| c.0),
                off_best: mean_of(|c| c.1),
                cell: name.to_string(),
                pooled: m,
                lower95,
                ratios,
                total_pooled: (!totals.is_empty()).then_some(tm),
                total_lower95,
                totals,
            }
        })
        .collect();
    let control_logs: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.controls.iter().map(|c| c.1.ln()))
        .collect();
    let outside = control_logs.iter().filter(|l| l.abs() > -BAR.ln()).count();
    Summary {
        runs: runs.iter().map(|r| r.path.display().to_string()).collect(),
        cells,
        control_ln_sd: if control_logs.is_empty() {
            None
        } else {
            mean_sd(&control_logs).1
        },
        control_outside: (outside, control_logs.len()),
        methods_differ: runs.windows(2).any(|w| w[0].method != w[1].method),
        devices_differ: runs.windows(2).any(|w| w[0].device != w[1].device),
    }
}

/// Reads the reports named in `list` (comma-separated paths) and pools them.
pub fn pool_files(list: &str) -> Result<Summary> {
    let paths: Vec<PathBuf> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    if paths.is_empty() {
        return Err(Error::InvalidArgument(
            "--pool: expected report files, comma-separated".into(),
        ));
    }
    let runs = paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| Error::Io {
                path: p.clone(),
                source: e,
            })?;
            parse(p, &text)
        })
        .collect::<Result<Vec<Run>>>()?;
    Ok(pool(&runs))
}

/// The pooled table, in Markdown with `#` summary lines.
pub fn print(s: &Summary) {
    println!(
        "# auto / best single backend pooled over {} runs (geometric mean; one-sided 95% lower \
         bound, Student's t over the runs): {}",
        s.runs.len(),
        s.runs.join(", ")
    );
    if s.methods_differ {
        println!("# note: the runs' timing methods differ");
    }
    if s.devices_differ {
        println!("# note: the runs' devices differ");
    }
    println!(
        "| cell | runs | auto/best per run | pooled | 95% lower bound | auto's own time | \
         off-best plans (est.) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for c in &s.cells {
        let per: Vec<String> = c.ratios.iter().map(|r| format!("{r:.3}")).collect();
        let pct = |x: Option<f64>| x.map_or("-".into(), |x| format!("{:.1}%", 100.0 * x));
        println!(
            "| {} | {} | {} | {:.3} | {} | {} | {} |",
            c.cell,
            c.ratios.len(),
            per.join(" "),
            c.pooled,
            c.lower95.map_or("-".into(), |l| format!("{l:.3}")),
            pct(c.own_time),
            pct(c.off_best)
        );
    }
    let n = s.cells.len();
    let held = s.cells.iter().filter(|c| c.pooled >= BAR).count();
    let bound = s
        .cells
        .iter()
        .filter(|c| c.lower95.is_some_and(|l| l >= BAR))
        .count();
    let (below, all) = s.cells.iter().fold((0, 0), |(b, a), c| {
        (
            b + c.ratios.iter().filter(|&&r| r < BAR).count(),
            a + c.ratios.len(),
        )
    });
    println!(
        "# pooled >= {BAR} in {held} of {n} cells; 95% lower bound >= {BAR} in {bound} of {n}; \
         single runs below {BAR} in {below} of {all} cell readings"
    );
    let totals: Vec<String> = s
        .cells
        .iter()
        .filter_map(|c| {
            let p = c.total_pooled?;
            let l = c.total_lower95.map_or("-".into(), |l| format!("{l:.3}"));
            Some(format!("{} {p:.3} [{l}]", c.cell))
        })
        .collect();
    if !totals.is_empty() {
        let bound = s
            .cells
            .iter()
            .filter(|c| c.total_lower95.is_some_and(|l| l >= BAR))
            .count();
        println!(
            "# by total time (mean call time over each run's samples), pooled [95% lower \
             bound]: {}; lower bound >= {BAR} in {bound} of {}",
            totals.join(", "),
            totals.len()
        );
    }
    match s.control_ln_sd {
        Some(sd) => println!(
            "# identical engines (control pairs): ln-ratio deviation {sd:.3} per run and cell; \
             outside [{BAR}, {:.3}] in {} of {}",
            1.0 / BAR,
            s.control_outside.0,
            s.control_outside.1
        ),
        None => println!("# no control pairs (runs without --control)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(ratios: &[(&str, f64)], cpu: f64, cpu2: f64) -> String {
        let r: Vec<Value> = ratios
            .iter()
            .map(|(c, x)| serde_json::json!({"cell": c, "ratio": x, "best": "cpu"}))
            .collect();
        serde_json::json!({
            "method": "m",
            "device": "d",
            "auto_vs_best": r,
            "cells": [
                {"op": "decode", "len": 1024, "acp": false, "backend": "cpu", "seconds": cpu},
                {"op": "decode", "len": 1024, "acp": false, "backend": "cpu2", "seconds": cpu2},
                {"op": "decode", "len": 1024, "acp": false, "backend": "auto", "seconds": 1.0},
            ],
        })
        .to_string()
    }

    fn run_of(text: &str) -> Run {
        parse(Path::new("r.json"), text).expect("a valid report")
    }

    #[test]
    fn pooled_ratio_is_the_geometric_mean_with_a_t_bound() {
        let runs: Vec<Run> = [0.9, 1.0, 1.1, 1.0]
            .iter()
            .map(|&x| run_of(&report(&[("decode L=1024 dense", x)], 1.0, 1.0)))
            .collect();
        let s = pool(&runs);
        let c = &s.cells[0];
        let logs: Vec<f64> = [0.9f64, 1.0, 1.1, 1.0].iter().map(|x| x.ln()).collect();
        let m = logs.iter().sum::<f64>() / 4.0;
        let sd = (logs.iter().map(|l| (l - m).powi(2)).sum::<f64>() / 3.0).sqrt();
        assert!((c.pooled - m.exp()).abs() < 1e-12);
        let lo = (m - 2.353 * sd / 2.0).exp();
        assert!((c.lower95.expect("4 runs") - lo).abs() < 1e-12);
        assert_eq!(c.ratios, vec![0.9, 1.0, 1.1, 1.0]);
    }

    #[test]
    fn one_run_has_no_bound_and_identical_runs_bound_at_their_ratio() {
        let one = pool(&[run_of(&report(&[("a", 0.97)], 1.0, 1.0))]);
        assert_eq!(one.cells[0].lower95, None);
        let same: Vec<Run> = (0..3)
            .map(|_| run_of(&report(&[("a", 0.97)], 1.0, 1.0)))
            .collect();
        let s = pool(&same);
        assert!((s.cells[0].lower95.expect("3 runs") - 0.97).abs() < 1e-12);
        assert!(!s.methods_differ && !s.devices_differ);
    }

    #[test]
    fn controls_count_the_pairs_outside_the_bar() {
        let runs = [
            run_of(&report(&[("a", 1.0)], 1.0, 1.0)),
            run_of(&report(&[("a", 1.0)], 1.0, 1.1)),
            run_of(&report(&[("a", 1.0)], 1.04, 1.0)),
        ];
        let s = pool(&runs);
        assert_eq!(s.control_outside, (1, 3));
        let logs = [0.0, (1.0f64 / 1.1).ln(), 1.04f64.ln()];
        let (_, sd) = mean_sd(&logs);
        assert!((s.control_ln_sd.expect("3 pairs") - sd.expect("3")).abs() < 1e-12);
    }

    #[test]
    fn cells_missing_from_some_runs_pool_over_the_others() {
        let runs = [
            run_of(&report(&[("a", 1.0), ("b", 0.9)], 1.0, 1.0)),
            run_of(&report(&[("a", 0.98)], 1.0, 1.0)),
        ];
        let s = pool(&runs);
        assert_eq!(s.cells.len(), 2);
        assert_eq!(s.cells[1].ratios, vec![0.9]);
        assert_eq!(s.cells[0].ratios.len(), 2);
    }

    #[test]
    fn auto_costs_are_fractions_of_the_best_median() {
        let cell = |b: &str, s: f64| serde_json::json!({"op": "decode", "len": 4096, "acp": true, "backend": b, "seconds": s});
        let mut auto = cell("auto", 0.5);
        auto["plans"] = serde_json::json!([90, 6, 4]);
        auto["scheduler_us"] = serde_json::json!(4.0);
        let text = serde_json::json!({
            "auto_vs_best": [{"cell": "decode L=4096 acp", "ratio": 0.8}],
            "cells": [cell("cpu", 0.4e-3), cell("vulkan", 0.6e-3), cell("hybrid", 0.8e-3), auto],
        })
        .to_string();
        let s = pool(&[run_of(&text), run_of(&text)]);
        let c = &s.cells[0];
        // 4 us of 0.4 ms; 6 calls 0.2 ms and 4 calls 0.4 ms over, per call of 100, of 0.4 ms.
        assert!((c.own_time.expect("reported") - 0.01).abs() < 1e-12);
        let off = (6.0 * 0.2e-3 + 4.0 * 0.4e-3) / (100.0 * 0.4e-3);
        assert!((c.off_best.expect("reported") - off).abs() < 1e-12);
    }

    #[test]
    fn total_time_ratios_pool_from_the_samples() {
        // Run 119's pattern: by the median auto loses to the CPU, by total time it beats
        // every backend (the CPU's slow rounds count).
        let cell = |b: &str, samples: &[f64]| {
            let mut v = samples.to_vec();
            v.sort_by(f64::total_cmp);
            serde_json::json!({"op": "decode", "len": 1024, "acp": false, "backend": b,
                "seconds": v[v.len() / 2], "samples": samples})
        };
        let text = serde_json::json!({
            "auto_vs_best": [{"cell": "decode L=1024 dense", "ratio": 0.5}],
            "cells": [
                cell("cpu", &[0.1, 0.1, 0.1, 2.0, 2.0]),
                cell("vulkan", &[0.3, 0.3, 0.3, 0.5, 0.5]),
                cell("auto", &[0.1, 0.3, 0.3, 0.5, 0.5]),
            ],
        })
        .to_string();
        let one = run_of(&text);
        assert_eq!(one.totals.len(), 1);
        assert!(
            (one.totals[0].1 - 1.9 / 1.7).abs() < 1e-12,
            "{:?}",
            one.totals
        );
        let s = pool(&[one.clone(), one]);
        let c = &s.cells[0];
        assert!((c.total_pooled.expect("pooled") - 1.9 / 1.7).abs() < 1e-12);
        assert!((c.total_lower95.expect("two runs") - 1.9 / 1.7).abs() < 1e-12);
        // Reports without samples pool no total.
        let s = pool(&[run_of(&report(&[("c", 1.0)], 1.0, 1.0))]);
        assert!(s.cells[0].total_pooled.is_none());
    }

    #[test]
    fn bad_reports_are_clear_errors() {
        let p = Path::new("x.json");
        for text in [
            "",
            "{",
            "[]",
            r#"{"cells": []}"#,
            r#"{"auto_vs_best": [{"cell": "a", "ratio": -1}], "cells": []}"#,
            r#"{"auto_vs_best": [{"cell": "a", "ratio": "x"}], "cells": []}"#,
            r#"{"auto_vs_best": [], "cells": [{"op": "decode"}]}"#,
        ] {
            let e = parse(p, text).expect_err(text);
            assert!(e.to_string().contains("x.json"), "{e}");
        }
        assert!(pool_files("").is_err());
        assert!(pool_files("/nonexistent/foxedge/run.json").is_err());
    }

    #[test]
    fn t_quantiles_fall_toward_the_normal() {
        assert!(t95(0).is_infinite());
        let mut prev = f64::INFINITY;
        for df in 1..200 {
            let t = t95(df);
            assert!(t < prev && t > 1.645, "df {df}: {t}");
            prev = t;
        }
        assert!((t95(40) - 1.684).abs() < 0.002);
        assert!((t95(120) - 1.658).abs() < 0.002);
    }
}
