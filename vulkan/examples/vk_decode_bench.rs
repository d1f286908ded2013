//! Decode benchmark and on-device check of the fused decode kernel and the resident cache.
//!
//! `cargo run --release -p foxedge-vulkan --example vk_decode_bench -- [--quick]
//!  [--kernel 4096,32768] [--session 1024,4096,16384,65536] [--steps 200]`
//!
//! 1. Kernel: 8 heads x N cached entries, d = 64, one query per head, dense (the ggml
//!    decode shapes), f16 and f32 K/V, a sweep of split (entries per workgroup) and launch
//!    shapes. Inputs resident; `reps` steps recorded in one command buffer (built before the
//!    clock starts), wall time submit-to-fence / reps, median of 5 samples. Every variant is
//!    checked against the CPU backend first (rel L2 <= 1e-4).
//! 2. Session-like step: a `ResidentCache` holding 8 heads x N entries (f32 and f16 mirrors);
//!    each step appends one row per head (a new version), then decodes against the mirrors:
//!    upload of the new rows, the kernel and the read-back in one submission, host planning
//!    included. Wall time per step, median over `--steps` steps; beside it the same step
//!    with a whole-cache upload (`Vulkan::decode`) and the CPU backend's decode.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use bench::{arg_list, median, rel_l2};
use foxedge_vulkan::{
    CacheHead, DecodeArgs, DecodeOptions, DecodeTuning, HeadSync, ResidentCache, ResidentOptions,
    Storage, Vulkan,
};
use half::f16;
use std::time::Instant;

/// Seconds per step: warm-up, reps sized to ~0.05 s, median of 5; and the spread.
fn time_it(run: &dyn Fn(usize) -> foxedge_vulkan::Result<std::time::Duration>) -> (f64, f64) {
    bench::time_it(run, 2, 8, 0.05, (8, 1000))
}

struct Cache {
    d: usize,
    heads: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    c: Vec<Vec<f64>>,
    row_version: Vec<Vec<u64>>,
    version: u64,
    /// Rows appended since version 1 (one per head and version): every head's journal.
    appended: Vec<u32>,
}

impl Cache {
    fn new(heads: usize, n: usize, d: usize, seed: u64) -> Cache {
        let mut r = common::rng(seed);
        let mut c = Vec::new();
        for _ in 0..heads {
            let g = common::log_gates(&mut r, n, 3.0);
            let mut acc = 0.0f64;
            c.push(
                g.iter()
                    .map(|&x| {
                        acc += f64::from(x);
                        acc
                    })
                    .collect::<Vec<f64>>(),
            );
        }
        Cache {
            d,
            heads,
            k: (0..heads)
                .map(|_| common::randn(&mut r, n * d, 0.5))
                .collect(),
            v: (0..heads)
                .map(|_| common::randn(&mut r, n * d, 0.5))
                .collect(),
            c,
            row_version: (0..heads).map(|_| vec![1; n]).collect(),
            version: 1,
            appended: Vec::new(),
        }
    }

    fn n(&self) -> usize {
        self.c[0].len()
    }

    fn append(&mut self, r: &mut rand::rngs::StdRng) {
        self.version += 1;
        self.appended.push(self.n() as u32);
        for h in 0..self.heads {
            let row = common::randn(r, 2 * self.d, 0.5);
            self.k[h].extend_from_slice(&row[..self.d]);
            self.v[h].extend_from_slice(&row[self.d..]);
            let last = self.c[h].last().copied().unwrap_or(0.0);
            self.c[h].push(last - 0.05);
            self.row_version[h].push(self.version);
        }
    }

    fn q_c(&self) -> Vec<f64> {
        self.c.iter().map(|c| c[c.len() - 1]).collect()
    }
}

fn views<'a, T: Storage>(
    k: &'a [Vec<T>],
    v: &'a [Vec<T>],
    c: &'a [Vec<f64>],
) -> Vec<CacheHead<'a, T>> {
    (0..c.len())
        .map(|h| CacheHead {
            k: &k[h],
            v: &v[h],
            c: &c[h],
            pos: None,
        })
        .collect()
}

/// One session step on the resident cache: every head synced at the cache's version.
fn resident_step(
    rc: &mut ResidentCache,
    cache: &Cache,
    q: &[f32],
    out: &mut [f32],
) -> foxedge_vulkan::Result<()> {
    let hs = views(&cache.k, &cache.v, &cache.c);
    let sync: Vec<_> = (0..cache.heads)
        .map(|h| {
            Some(HeadSync {
                id: h as u64 + 1,
                version: cache.version,
                row_version: &cache.row_version[h],
                journal: Some(foxedge_vulkan::Journal {
                    since: 1,
                    rows: &cache.appended,
                }),
            })
        })
        .collect();
    let q_c = cache.q_c();
    let a = DecodeArgs::one_query(cache.d, q, &q_c, &hs);
    let opts = DecodeOptions {
        split: foxedge_vulkan::auto_split(cache.heads * cache.n()),
        ..Default::default()
    };
    rc.decode(&a, &sync, &opts, out, None).map(|_| ())
}

fn cpu_out(cache: &Cache, q: &[f32]) -> (Vec<f32>, f64) {
    let hs: Vec<_> = (0..cache.heads)
        .map(|h| foxedge_cpu::CacheHead {
            k: &cache.k[h][..],
            v: &cache.v[h][..],
            c: &cache.c[h][..],
            pos: None,
        })
        .collect();
    let q_c = cache.q_c();
    let args = foxedge_cpu::DecodeArgs::one_query(cache.d, q, &q_c, &hs);
    let mut out = vec![0.0f32; cache.heads * cache.d];
    let _ = foxedge_cpu::decode(&args, &Default::default(), &mut out, None);
    let t0 = Instant::now();
    let reps = 5;
    for _ in 0..reps {
        let _ = foxedge_cpu::decode(&args, &Default::default(), &mut out, None);
    }
    (out, t0.elapsed().as_secs_f64() / reps as f64)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let kern_ns = arg_list(
        &args,
        "--kernel",
        if quick { &[4096] } else { &[4096, 32768] },
    );
    let sess_ns = arg_list(
        &args,
        "--session",
        if quick {
            &[1024]
        } else {
            &[1024, 4096, 16384, 65536]
        },
    );
    let steps = arg_list(&args, "--steps", &[if quick { 20 } else { 200 }])[0];
    let vk = match Vulkan::new() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("no Vulkan device: {e}");
            std::process::exit(2);
        }
    };
    println!("device: {}", vk.info());
    let (d, heads) = (64usize, 8usize);
    let mut failures = Vec::new();

    // 1. Kernel sweep.
    let tunings: Vec<DecodeTuning> = if quick {
        vec![DecodeTuning::default()]
    } else {
        [
            (128, 2, 0),
            (128, 4, 0),
            (256, 2, 0),
            (64, 4, 0),
            (128, 4, 4),
        ]
        .iter()
        .map(|&(w, u, l)| DecodeTuning {
            workgroup: w,
            unroll: u,
            lanes_per_entry: l,
        })
        .collect()
    };
    let splits: &[usize] = if quick {
        &[256]
    } else {
        &[128, 256, 512, 1024, 2048]
    };
    println!("\n## kernel: {heads} heads x N cached, d = {d}, one query, dense (us per step)");
    println!("| cached | storage | workgroup | unroll | lanes | split | us | TB/s | spread |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for &n in &kern_ns {
        let cache = Cache::new(heads, n, d, n as u64);
        let mut r = common::rng(7);
        let q = common::randn(&mut r, heads * d, 1.0);
        let q_c = cache.q_c();
        let (want, _) = cpu_out(&cache, &q);
        let k16: Vec<Vec<f16>> = cache
            .k
            .iter()
            .map(|x| x.iter().map(|&y| f16::from_f32(y)).collect())
            .collect();
        let v16: Vec<Vec<f16>> = cache
            .v
            .iter()
            .map(|x| x.iter().map(|&y| f16::from_f32(y)).collect())
            .collect();
        for half in [true, false] {
            let bytes = (2 * heads * n * d * if half { 2 } else { 4 }) as f64;
            let mut best = (f64::INFINITY, String::new());
            let mut all_splits: Vec<usize> = splits.to_vec();
            let auto = foxedge_vulkan::auto_split(heads * n);
            if !all_splits.contains(&auto) {
                all_splits.push(auto);
            }
            for t in &tunings {
                vk.set_decode_tuning(*t);
                for &split in &all_splits {
                    let opts = DecodeOptions {
                        split,
                        ..Default::default()
                    };
                    let p = if half {
                        let hs = views(&k16, &v16, &cache.c);
                        let a = DecodeArgs::one_query(d, &q, &q_c, &hs);
                        vk.prepare_decode(&a, &opts)
                    } else {
                        let hs = views(&cache.k, &cache.v, &cache.c);
                        let a = DecodeArgs::one_query(d, &q, &q_c, &hs);
                        vk.prepare_decode(&a, &opts)
                    };
                    let p = match p {
                        Ok(p) => p,
                        Err(e) => {
                            failures.push(format!("prepare {n} {t:?} {split}: {e}"));
                            continue;
                        }
                    };
                    let mut out = vec![0.0f32; heads * d];
                    if let Err(e) = p.run(1).and_then(|_| p.read(&mut out, None)) {
                        failures.push(format!("run {n} {t:?} {split}: {e}"));
                        continue;
                    }
                    // f16 rows differ from the f32 CPU input by rounding (2^-11 relative).
                    let e = rel_l2(&out, &want);
                    let tol = if half { 2e-3 } else { 1e-4 };
                    if e.is_nan() || e > tol {
                        failures.push(format!(
                            "{n} {t:?} split {split} f16 {half}: rel L2 {e:.2e}"
                        ));
                    }
                    let (s, spread) = time_it(&|r| p.run(r));
                    let row = format!(
                        "| {n} | {} | {} | {} | {} | {split}{} | {:.1} | {:.2} | {:.0}% |",
                        if half { "f16" } else { "f32" },
                        t.workgroup,
                        t.unroll,
                        if t.lanes_per_entry == 0 {
                            "auto".to_string()
                        } else {
                            t.lanes_per_entry.to_string()
                        },
                        if split == auto { " (auto)" } else { "" },
                        s * 1e6,
                        bytes / s / 1e12,
                        spread * 100.0
                    );
                    println!("{row}");
                    if s < best.0 {
                        best = (s, row);
                    }
                }
            }
            println!("best: {}", best.1);
        }
    }
    vk.set_decode_tuning(DecodeTuning::default());

    // 2. Session-like steps against the resident cache.
    println!(
        "\n## session step: {heads} heads x N, d = {d}, append 1 row/head + decode (ms per step)"
    );
    println!(
        "| cached | mirror | resident ms | rows up/step | full-upload ms | cpu ms | resident vs cpu |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &n in &sess_ns {
        for f16_mirror in [false, true] {
            let mut cache = Cache::new(heads, n, d, 99 + n as u64);
            let mut r = common::rng(5);
            let mut rc = vk.resident_cache(ResidentOptions {
                f16: f16_mirror,
                budget_bytes: None,
            });
            let mut times = Vec::with_capacity(steps);
            let mut out = vec![0.0f32; heads * d];
            let mut ok = true;
            let mut q = common::randn(&mut r, heads * d, 1.0);
            // First step uploads every row; not timed.
            if let Err(e) = resident_step(&mut rc, &cache, &q, &mut out) {
                failures.push(format!("resident first step {n}: {e}"));
                ok = false;
            }
            let rows0 = rc.counters().rows_uploaded;
            for _ in 0..steps.max(1) {
                if !ok {
                    break;
                }
                cache.append(&mut r);
                q = common::randn(&mut r, heads * d, 1.0);
                let t0 = Instant::now();
                if let Err(e) = resident_step(&mut rc, &cache, &q, &mut out) {
                    failures.push(format!("resident step {n}: {e}"));
                    ok = false;
                }
                times.push(t0.elapsed().as_secs_f64());
            }
            let cnt = rc.counters();
            let per_step = (cnt.rows_uploaded - rows0) as f64 / steps.max(1) as f64;
            // Check the last step against the CPU (f16 mirror: rounding of the rows).
            let (want, cpu_s) = cpu_out(&cache, &q);
            let e = rel_l2(&out, &want);
            let tol = if f16_mirror { 2e-3 } else { 1e-4 };
            if e.is_nan() || e > tol {
                failures.push(format!("resident {n} f16 {f16_mirror}: rel L2 {e:.2e}"));
            }
            // The same step with a whole-cache upload.
            let hs = views(&cache.k, &cache.v, &cache.c);
            let q_c = cache.q_c();
            let a = DecodeArgs::one_query(d, &q, &q_c, &hs);
            let opts = DecodeOptions {
                split: foxedge_vulkan::auto_split(heads * cache.n()),
                ..Default::default()
            };
            let reps = if n >= 65536 { 3 } else { 10 };
            let t0 = Instant::now();
            for _ in 0..reps {
                if let Err(e) = vk.decode(&a, &opts, &mut out, None) {
                    failures.push(format!("full upload {n}: {e}"));
                    break;
                }
            }
            let full_s = t0.elapsed().as_secs_f64() / reps as f64;
            let res_s = if times.is_empty() {
                f64::NAN
            } else {
                median(times)
            };
            println!(
                "| {n} | {} | {:.3} | {per_step:.1} | {:.3} | {:.3} | {:.2}x |",
                if f16_mirror { "f16" } else { "f32" },
                res_s * 1e3,
                full_s * 1e3,
                cpu_s * 1e3,
                cpu_s / res_s
            );
        }
    }
    if failures.is_empty() {
        println!("\nall correctness checks passed");
    } else {
        println!("\nCORRECTNESS FAILURES:");
        for f in &failures {
            println!("  {f}");
        }
        std::process::exit(1);
    }
}
