//! What a GPU decode step costs after the CPU ran `S` steps of the same cache: the device's
//! mirror is then `S` rows per head behind (each step writes one row per head), and the
//! step sends them. `auto` pays this on the first call of every GPU re-check of a class
//! the CPU leads (a call it does not record, see `src/placement.rs`).
//! The idle control sleeps as long as the `S` CPU steps took, with the mirror one row
//! behind, so the GPU's own wake-up after idling is told apart from the rows.
//!
//!     cargo bench -p foxedge --bench catch_up
//!     FOXEDGE_BENCH_LENGTHS=4k,16k FOXEDGE_BENCH_BEHIND=0,64,256,1024 FOXEDGE_BENCH_REPS=7 \
//!         cargo bench -p foxedge --bench catch_up
//!
//! Real gates (the bundled fox-tiny-pro over the long fixture, 16 heads). Prints per
//! length, pruning and `S`: the median over the repeats of the first GPU step after the
//! CPU steps, of the GPU step after it, and of the first GPU step after the idle control,
//! in milliseconds, and the CPU steps' own time. Without a Vulkan device it says so and
//! exits.

mod common;

use foxedge::BackendKind;
use foxedge::attention::Engine;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> foxedge::Result<()> {
    let lens = common::lengths("4k");
    let Some(&max_len) = lens.iter().max() else {
        eprintln!("FOXEDGE_BENCH_LENGTHS names no length >= 2");
        return Ok(());
    };
    let behind: Vec<usize> = std::env::var("FOXEDGE_BENCH_BEHIND")
        .unwrap_or_else(|_| "0,16,64,128,256,512,1024".into())
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    let reps: usize = common::env_or("FOXEDGE_BENCH_REPS", 5).max(1);
    let gpu = match Engine::new(BackendKind::Vulkan) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("catch_up: no Vulkan device ({e}); nothing to measure");
            return Ok(());
        }
    };
    let cpu = Engine::new(BackendKind::Cpu)?;
    let big = common::workload(max_len)?;
    println!("# a GPU decode step after S CPU steps of its cache ({reps} repeats, medians)");
    println!("acp        L      S  first ms  next ms  idle-first ms  cpu steps ms");
    for &len in &lens {
        let d = big.prefix(len)?.decode_at(len)?;
        let mut out = vec![0.0f32; d.heads * d.head_dim];
        for (name, acp) in common::MODES {
            for _ in 0..20 {
                gpu.decode(&d, acp, &mut out)?;
            }
            for &s in &behind {
                let (mut first, mut next, mut idle, mut cpu_s) = (vec![], vec![], vec![], vec![]);
                for _ in 0..reps {
                    gpu.decode(&d, acp, &mut out)?;
                    let t = Instant::now();
                    for _ in 0..s {
                        cpu.decode(&d, acp, &mut out)?;
                    }
                    let w = t.elapsed();
                    cpu_s.push(w.as_secs_f64());
                    let t = Instant::now();
                    gpu.decode(&d, acp, &mut out)?;
                    first.push(t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    gpu.decode(&d, acp, &mut out)?;
                    next.push(t.elapsed().as_secs_f64());
                    std::thread::sleep(w.max(Duration::from_micros(1)));
                    let t = Instant::now();
                    gpu.decode(&d, acp, &mut out)?;
                    idle.push(t.elapsed().as_secs_f64());
                }
                println!(
                    "{name:<5} {len:>6} {s:>6}  {:>8.3}  {:>7.3}  {:>13.3}  {:>12.3}",
                    median(first) * 1e3,
                    median(next) * 1e3,
                    median(idle) * 1e3,
                    median(cpu_s) * 1e3
                );
            }
        }
    }
    Ok(())
}
