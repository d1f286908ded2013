//! Helpers shared by the Vulkan examples (`vk_bench`, `vk_decode_bench`).

/// The comma-separated list after `name` in `args`, or `default`.
pub fn arg_list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per call of a prepared run (`run(reps)` returns the time of `reps` calls):
/// `run(warm)` as warm-up, `run(probe)` to size reps to ~`target_s` seconds (clamped to
/// `reps_range`), then the median of 5 samples; and the spread (max - min) / min.
pub fn time_it(
    run: &dyn Fn(usize) -> foxedge_vulkan::Result<std::time::Duration>,
    warm: usize,
    probe: usize,
    target_s: f64,
    reps_range: (usize, usize),
) -> (f64, f64) {
    let _ = run(warm);
    let one = run(probe)
        .map(|d| d.as_secs_f64() / probe as f64)
        .unwrap_or(1.0);
    let reps = ((target_s / one.max(1e-6)) as usize).clamp(reps_range.0, reps_range.1);
    let samples: Vec<f64> = (0..5)
        .map(|_| {
            run(reps)
                .map(|d| d.as_secs_f64() / reps as f64)
                .unwrap_or(f64::NAN)
        })
        .collect();
    let lo = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = samples.iter().copied().fold(0.0, f64::max);
    (median(samples), (hi - lo) / lo)
}

/// Relative L2 error of `a` against `b`.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut n, mut d) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let e = f64::from(*x) - f64::from(*y);
        n += e * e;
        d += f64::from(*y) * f64::from(*y);
    }
    (n / d.max(1e-300)).sqrt()
}
