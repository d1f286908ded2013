//! `auto`'s own time per decode step, outside the kernels: the choice, the bookkeeping and
//! the learning (`PlanCounts::scheduler_ns`), beside the whole step on the plan it runs.
//! Real gates: the bundled fox-tiny-pro over the long fixture, 16 heads (4 layers x 4), one
//! query per step. Without a Vulkan device `auto` is the CPU backend (no placement, nothing
//! of its own to measure): it says so and exits.
//!
//!     cargo bench -p foxedge --bench auto_overhead
//!     FOXEDGE_BENCH_LENGTHS=4k,16k FOXEDGE_BENCH_STEPS=50000 FOXEDGE_BENCH_THRASH=4000000 \
//!         cargo bench -p foxedge --bench auto_overhead
//!
//! `FOXEDGE_BENCH_THRASH` = bytes written between steps (untimed), so each step finds the
//! scheduler's data out of cache, as between the real kernels' steps. Prints, per cell and
//! for two repeats: the whole step (idle device included) and the scheduler's own time, in
//! microseconds.

mod common;

use foxedge::BackendKind;
use foxedge::attention::Engine;
use std::time::Instant;

fn main() -> foxedge::Result<()> {
    let lens = common::lengths("4k,16k");
    let Some(&max_len) = lens.iter().max() else {
        eprintln!("FOXEDGE_BENCH_LENGTHS names no length >= 2");
        return Ok(());
    };
    let steps: usize = common::env_or("FOXEDGE_BENCH_STEPS", 20_000).max(1);
    let thrash: usize = common::env_or("FOXEDGE_BENCH_THRASH", 0);
    let big = common::workload(max_len)?;
    let mut junk = vec![0u8; thrash.max(1)];
    println!("# auto's own time per decode step ({steps} steps, {thrash} bytes written between)");
    println!("repeat  acp       L   step us  sched us  plans (cpu gpu split)");
    for repeat in 0..2 {
        for &len in &lens {
            let d = big.prefix(len)?.decode_at(len)?;
            let mut out = vec![0.0f32; d.heads * d.head_dim];
            for (name, acp) in common::MODES {
                let eng = Engine::new(BackendKind::Auto)?;
                if eng.calibrate(big.heads, big.head_dim)?.is_none() {
                    eprintln!(
                        "auto_overhead: no Vulkan device, auto is the CPU; nothing to measure"
                    );
                    return Ok(());
                }
                for _ in 0..2000 {
                    eng.decode(&d, acp, &mut out)?;
                }
                let c0 = eng.plan_counts();
                let mut untimed = 0.0;
                let t0 = Instant::now();
                for i in 0..steps {
                    if thrash > 0 {
                        let t = Instant::now();
                        for j in (0..thrash).step_by(64) {
                            junk[j] = junk[j].wrapping_add(i as u8);
                        }
                        std::hint::black_box(&junk);
                        untimed += t.elapsed().as_secs_f64();
                    }
                    eng.decode(&d, acp, &mut out)?;
                }
                let step_s = (t0.elapsed().as_secs_f64() - untimed) / steps as f64;
                let c1 = eng.plan_counts();
                let sched_ns = (c1.scheduler_ns - c0.scheduler_ns) as f64 / steps as f64;
                println!(
                    "{repeat:>6}  {name:<5} {len:>6}  {:>8.2}  {:>8.2}  {} {} {}",
                    step_s * 1e6,
                    sched_ns / 1e3,
                    c1.cpu - c0.cpu,
                    c1.gpu - c0.gpu,
                    c1.split - c0.split
                );
            }
        }
    }
    Ok(())
}
