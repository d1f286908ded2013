//! Matrix-vector weight bandwidth against DRAM read bandwidth, measured in alternation so
//! that both see the same machine load (the criterion bench `linear` measures them minutes
//! apart). Each round reads a 256 MiB pool of copies of `W` once with `linear` (one
//! activation row) and a 256 MiB buffer once with `limits::read_pass`, on `t` threads.
//!
//! `cargo run --release -p foxedge-cpu --example linear_bw -- [ROUNDS] [SHAPE..]`
//! (SHAPE = OUTxIN, default 768x768 3584x768 768x1792). Prints per format and thread count
//! the best GB/s of each side and the median of the per-round ratios.
//!
//! With `matmul` as the first argument: 64 and 512 activation rows per format and the gemm
//! crate (f32), rounds alternating between them; best GFLOP/s (int8 GOP/s) of each.
//!
//! With `cache` as the first argument: the same matrix-vector products on one matrix that
//! stays in L2 (the kernels' compute ceiling, weight GB/s), one thread.
//!
//! `rows=N` among the arguments: `N` activation rows per product instead of one (several
//! sessions decoding in one batch); the weight GB/s then counts `W` once per product.
//!
//! `FOXEDGE_CLOCK=cpu` times one-thread runs by the calling thread's CPU time instead of
//! the wall clock (on a machine shared with other work, a descheduled thread then does not
//! count as slow); two-thread runs always use the wall clock. `q8-canonical` is the
//! bench's row-by-row kernel over the canonical blocks (x86-64 with AVX-512 VNNI).

use foxedge_core::quant::{WeightFormat, encode_row};
use foxedge_cpu::limits;
use foxedge_cpu::linear::{Matrix, PackedWeights, Weights, linear};
use half::{bf16, f16};
use std::hint::black_box;
use std::time::Instant;

#[path = "../benches/common/canonical.rs"]
mod canonical;
#[path = "../benches/common/gemm_ref.rs"]
mod gemm_ref;
use gemm_ref::gemm_f32;

/// Seconds on the clock chosen by `FOXEDGE_CLOCK` (`cpu`: this thread's CPU time, used
/// only when `threads == 1`).
fn now(threads: usize) -> f64 {
    if threads == 1 && std::env::var("FOXEDGE_CLOCK").is_ok_and(|v| v == "cpu") {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; the clock id is a constant.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        return ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
    }
    thread_local!(static T0: Instant = Instant::now());
    T0.with(|t| t.elapsed().as_secs_f64())
}

const POOL: usize = 256 << 20;

#[derive(Clone)]
enum Held {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    Packed(PackedWeights),
    Canonical(Vec<u8>),
}

impl Held {
    fn matrix(&self, out: usize, inp: usize) -> Matrix<'_> {
        let w = match self {
            Held::F32(v) => Weights::f32(v, out, inp),
            Held::F16(v) => Weights::f16(v, out, inp),
            Held::Bf16(v) => Weights::bf16(v, out, inp),
            Held::Packed(p) => return p.into(),
            Held::Canonical(b) => Weights::from_bytes(WeightFormat::Q8, b, out, inp),
        };
        w.expect("shape").into()
    }

    fn run(&self, out: usize, inp: usize, x: &[f32], rows: usize, y: &mut [f32], threads: usize) {
        match self {
            Held::Canonical(b) => canonical::matvec(b, inp, x, y, threads),
            h => linear(h.matrix(out, inp), x, rows, y, false, threads).expect("shapes"),
        }
    }
}

fn held(f: WeightFormat, canonical: bool, w: &[f32], out: usize, inp: usize) -> Held {
    match f {
        WeightFormat::F32 => Held::F32(w.to_vec()),
        WeightFormat::F16 => Held::F16(w.iter().map(|&v| f16::from_f32(v)).collect()),
        WeightFormat::Bf16 => Held::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
        _ => {
            let rb = f.row_bytes(inp).expect("size");
            let mut b = vec![0u8; out * rb];
            for (r, d) in w.chunks_exact(inp).zip(b.chunks_exact_mut(rb)) {
                encode_row(f, r, d).expect("finite");
            }
            if canonical {
                return Held::Canonical(b);
            }
            let ws = Weights::from_bytes(f, &b, out, inp).expect("shape");
            Held::Packed(PackedWeights::pack(&ws, 2).expect("block format"))
        }
    }
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mode = match args.first().map(String::as_str) {
        Some(m @ ("matmul" | "cache")) => m.to_string(),
        _ => String::new(),
    };
    if !mode.is_empty() {
        args.remove(0);
    }
    let rows: usize = args
        .iter()
        .find_map(|a| a.strip_prefix("rows=")?.parse().ok())
        .unwrap_or(1)
        .max(1);
    args.retain(|a| !a.starts_with("rows="));
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(15);
    let mut shapes: Vec<(usize, usize)> = args
        .iter()
        .filter_map(|a| a.split_once('x'))
        .filter_map(|(o, i)| Some((o.parse().ok()?, i.parse().ok()?)))
        .collect();
    if shapes.is_empty() {
        shapes = vec![(768, 768), (3584, 768), (768, 1792)];
    }
    println!(
        "fp32 FMA peak GFLOP/s: 1 thread {:.0}, 2 threads {:.0}",
        limits::fma_peak_gflops(1, 0.5),
        limits::fma_peak_gflops(2, 0.5)
    );
    match mode.as_str() {
        "matmul" => return matmuls(rounds, &shapes),
        "cache" => return in_cache(rounds, rows, &shapes),
        _ => {}
    }
    let dram: Vec<f32> = (0..POOL / 4).map(|i| i as f32).collect();
    println!(
        "{rows} row(s); shape fmt threads | weight GB/s best | dram GB/s best | ratio median (min..max)"
    );
    for (out, inp) in shapes {
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
            .collect();
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| (i % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut y = vec![0.0f32; rows * out];
        let canon = canonical::available().then_some((WeightFormat::Q8, true));
        let canon = canon.filter(|_| rows == 1);
        let kinds = WeightFormat::ALL.iter().map(|&f| (f, false)).chain(canon);
        for (f, canonical) in kinds {
            let bytes = f.matrix_bytes(out, inp).expect("size");
            let copies = POOL.div_ceil(bytes).max(2);
            let one = held(f, canonical, &w, out, inp);
            let pool: Vec<Held> = (0..copies).map(|_| one.clone()).collect();
            let name = if canonical {
                "q8-canonical".to_string()
            } else {
                f.to_string()
            };
            for threads in [1usize, 2] {
                let parts: Vec<&[f32]> = dram.chunks(dram.len().div_ceil(threads)).collect();
                let (mut best_w, mut best_d, mut ratios) = (0.0f64, 0.0f64, Vec::new());
                for _ in 0..rounds {
                    let t0 = now(threads);
                    for h in &pool {
                        h.run(out, inp, black_box(&x), rows, &mut y, threads);
                    }
                    let gw = (copies * bytes) as f64 / (now(threads) - t0) / 1e9;
                    let t0 = now(threads);
                    if threads == 1 {
                        black_box(limits::read_pass(&dram));
                    } else {
                        rayon::broadcast(|c| {
                            parts
                                .get(c.index())
                                .map(|p| black_box(limits::read_pass(p)))
                        });
                    }
                    let gd = POOL as f64 / (now(threads) - t0) / 1e9;
                    (best_w, best_d) = (best_w.max(gw), best_d.max(gd));
                    ratios.push(gw / gd);
                }
                ratios.sort_by(f64::total_cmp);
                println!(
                    "{out}x{inp} {name} {threads}t | {best_w:.1} | {best_d:.1} | {:.2} ({:.2}..{:.2})",
                    ratios[ratios.len() / 2],
                    ratios[0],
                    ratios[ratios.len() - 1]
                );
            }
        }
    }
}

/// Best GFLOP/s of each format's matmul and of gemm, rounds alternating between them.
fn matmuls(rounds: usize, shapes: &[(usize, usize)]) {
    println!("shape rows threads | GFLOP/s (int8: GOP/s) best per kernel");
    for &(out, inp) in shapes {
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
            .collect();
        let held: Vec<Held> = WeightFormat::ALL
            .iter()
            .map(|&f| held(f, false, &w, out, inp))
            .collect();
        for rows in [64usize, 512] {
            let x: Vec<f32> = (0..rows * inp)
                .map(|i| (i % 13) as f32 / 13.0 - 0.5)
                .collect();
            let mut y = vec![0.0f32; rows * out];
            let flop = (2 * rows * out * inp) as f64;
            for threads in [1usize, 2] {
                let mut best = [0.0f64; 6];
                for _ in 0..rounds {
                    for (k, h) in held.iter().enumerate() {
                        let t0 = now(threads);
                        h.run(out, inp, black_box(&x), rows, &mut y, threads);
                        best[k] = best[k].max(flop / (now(threads) - t0) / 1e9);
                    }
                    let t0 = now(threads);
                    gemm_f32(&w, out, inp, black_box(&x), rows, &mut y, threads);
                    best[5] = best[5].max(flop / (now(threads) - t0) / 1e9);
                }
                let names = ["f32", "f16", "bf16", "q8", "q4", "f32-gemm"];
                let cells: Vec<String> = names
                    .iter()
                    .zip(best)
                    .map(|(n, b)| format!("{n} {b:.0}"))
                    .collect();
                println!("{out}x{inp} rows{rows} {threads}t | {}", cells.join(" | "));
            }
        }
    }
}

/// Best weight GB/s of one-thread matrix-vector products on a matrix already in cache.
fn in_cache(rounds: usize, rows: usize, shapes: &[(usize, usize)]) {
    println!("{rows} row(s); shape fmt | weight GB/s best, one thread, matrix in cache");
    for &(out, inp) in shapes {
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
            .collect();
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| (i % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut y = vec![0.0f32; rows * out];
        let canon = canonical::available().then_some((WeightFormat::Q8, true));
        let canon = canon.filter(|_| rows == 1);
        for (f, canonical) in WeightFormat::ALL.iter().map(|&f| (f, false)).chain(canon) {
            let h = held(f, canonical, &w, out, inp);
            let bytes = f.matrix_bytes(out, inp).expect("size") as f64;
            let mut best = 0.0f64;
            for _ in 0..rounds {
                let t0 = now(1);
                for _ in 0..100 {
                    h.run(out, inp, black_box(&x), rows, &mut y, 1);
                }
                best = best.max(100.0 * bytes / (now(1) - t0) / 1e9);
            }
            let name = if canonical {
                "q8-canonical".to_string()
            } else {
                f.to_string()
            };
            println!("{out}x{inp} {name} | {best:.1}");
        }
    }
}
