// Not built: copy to benches/exp_cpu_auto.rs and add to Cargo.toml:
//   [[bench]] name = "exp_cpu_auto", harness = false
// Run: cargo bench -p foxedge --bench exp_cpu_auto  (env: L=1024 ACP=1 B=batch R=rounds ONLY=k SHARE=1 PRE=n)
// Interleaves cpu, cpu2, auto, auto2 engines on one decode cell and prints per-call medians.
mod common;
use foxedge::hybrid::Engine;
use foxedge::BackendKind;
use std::time::Instant;

fn main() -> foxedge::Result<()> {
    let len: usize = common::env_or("L", 1024);
    let big = common::workload(len)?;
    let d = big.prefix(len)?.decode_at(len)?;
    let (_, acp) = common::MODES[if common::env_or("ACP", 1) == 1 { 1 } else { 0 }];
    let names = ["cpu", "cpu2", "auto", "auto2"];
    let engs = [
        Engine::new(BackendKind::Cpu)?,
        Engine::new(BackendKind::Cpu)?,
        Engine::new(BackendKind::Auto)?,
        Engine::new(BackendKind::Auto)?,
    ];
    let probs: Vec<_> = engs.iter().map(|_| d.clone()).collect();
    // SHARE=1: auto2 steps the cpu engine's cache object (the same memory).
    let pidx = if common::env_or("SHARE", 0) == 1 { [0, 1, 2, 0] } else { [0, 1, 2, 3] };
    let mut out = vec![0.0f32; d.heads * d.head_dim];
    let pre: usize = common::env_or("PRE", 0);
    for (k, e) in engs.iter().enumerate() {
        let p = &probs[pidx[k]];
        for _ in 0..pre {
            e.decode(p, common::MODES[0].1, &mut out)?;
        }
        e.calibrate(big.heads, big.head_dim)?;
        for _ in 0..500 {
            e.decode(p, acp, &mut out)?;
        }
    }
    let batch: usize = common::env_or("B", 200);
    let mut t = vec![Vec::new(); 4];
    let mut seed = 12345u64;
    for _ in 0..common::env_or("R", 40) {
        let mut order = [0usize, 1, 2, 3];
        for i in (1..4).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let only: usize = common::env_or("ONLY", 9);
        let only: usize = common::env_or("ONLY", 9);
        for &k in &order {
            if only != 9 && k != only { continue; }
            if only != 9 && k != only { continue; }
            engs[k].decode(&probs[pidx[k]], acp, &mut out)?;
            let t0 = Instant::now();
            for _ in 0..batch {
                engs[k].decode(&probs[pidx[k]], acp, &mut out)?;
            }
            t[k].push(t0.elapsed().as_secs_f64() / batch as f64 * 1e6);
        }
    }
    for k in 0..4 {
        if t[k].is_empty() { continue; }
        if t[k].is_empty() { continue; }
        let mut v = t[k].clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let pc = engs[k].plan_counts();
        println!(
            "{:6} median {:7.2} us  min {:7.2}  p90 {:7.2}  plans {} {} {} sched {:.2} us/call",
            names[k], v[v.len() / 2], v[0], v[v.len() * 9 / 10], pc.cpu, pc.gpu, pc.split,
            pc.scheduler_ns as f64 / (pc.cpu + pc.gpu + pc.split).max(1) as f64 / 1e3
        );
    }
    Ok(())
}
