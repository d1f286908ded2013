// Timing test behind the dev-machine figures of the tried estimate (not kept): apply
// tried_estimate_overlap.diff, append this to src/hybrid.rs, then run
// `cargo test --release -p foxedge --lib tmp_estimate_parts -- --ignored --nocapture`.
// Prints, at 16 heads x 1K and 4K tokens, the median of 500 calls of
// `prefill_kept_estimate` and of `prefill_boundary` (and of 100 with 64 MB written
// between calls: "cold"), and of `validate_log_gates`.

#[cfg(test)]
mod tmp_timing_est {
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn tmp_estimate_parts() {
        for t in [1024usize, 4096] {
            let (nh, d) = (16usize, 64usize);
            let q = vec![0.1f32; t * nh * d];
            let log_f: Vec<f32> = (0..t * nh).map(|i| -0.001 * (1 + 50 * (i % nh)) as f32).collect();
            let u = vec![(d as f64).sqrt(); nh];
            let call = PrefillCall { t, heads: nh, head_dim: d, q: &q, k: &q, v: &q, log_f: &log_f,
                acp: Acp::Bound { u: &u, ln_eps: -10.0 }, decided: None };
            let med = |f: &mut dyn FnMut()| {
                let mut v: Vec<f64> = (0..500).map(|_| { let s = Instant::now(); f(); s.elapsed().as_secs_f64() * 1e6 }).collect();
                v.sort_by(f64::total_cmp); v[v.len() / 2]
            };
            let e = med(&mut || { std::hint::black_box(prefill_kept_estimate(&call).unwrap()); });
            let b = med(&mut || { std::hint::black_box(prefill_boundary(&call).unwrap()); });
            let v = med(&mut || { gate::validate_log_gates(&log_f).unwrap(); });
            let mut junk = vec![1u8; 64 << 20];
            let mut cold = |f: &mut dyn FnMut()| {
                let mut v: Vec<f64> = (0..100).map(|i| { junk.iter_mut().step_by(64).for_each(|x| *x = x.wrapping_add(i as u8)); let s = Instant::now(); f(); s.elapsed().as_secs_f64() * 1e6 }).collect();
                v.sort_by(f64::total_cmp); v[v.len() / 2]
            };
            let ec = cold(&mut || { std::hint::black_box(prefill_kept_estimate(&call).unwrap()); });
            let bc = cold(&mut || { std::hint::black_box(prefill_boundary(&call).unwrap()); });
            println!("t={t}: estimate {e:.1} us (cold {ec:.1}), boundary {b:.1} (cold {bc:.1}), validate {v:.1}");
        }
    }
}
