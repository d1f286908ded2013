//! Quick timings of the CPU kernels and this machine's limits (no criterion: for
//! iterating; the figures in BENCHMARKS.md come from `benches/attention.rs`).
//!
//! ```text
//! cargo run --release -p foxedge-cpu --example speed -- limits
//! cargo run --release -p foxedge-cpu --example speed -- prefill 8192 [acp] [f32|f16|bf16] [isa]
//! cargo run --release -p foxedge-cpu --example speed -- decode 32768 [acp] [f32|f16|bf16]
//! cargo run --release -p foxedge-cpu --example speed -- ratio 2048 [rounds=9]
//! ```
use foxedge_cpu::{
    Acp, AttentionShape, CacheHead, DecodeArgs, DecodeOptions, Isa, Layout, PrefillArgs,
    PrefillOptions, Storage, decode, prefill, prefill_with_isa,
};
use half::{bf16, f16};
use std::time::Instant;

#[path = "common/fixture_gates.rs"]
mod fixture_gates;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// CPU time used so far by all threads of this process, seconds (Linux: the run time in
/// `/proc/self/task/*/schedstat`; 0 elsewhere). On a shared machine, work per CPU-second
/// compares kernels even while other jobs take turns on the cores.
fn cpu_seconds() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e9
}

/// One sequence of `l` tokens attending to itself, `heads` heads of `d`, seq-first.
fn self_attention(heads: usize, l: usize, d: usize) -> AttentionShape {
    AttentionShape {
        batch: 1,
        heads_q: heads,
        heads_kv: heads,
        seq_q: l,
        seq_k: l,
        head_dim: d,
        layout: Layout::SeqFirst,
    }
}

/// Median of `reps` timings of `f`, seconds.
fn time<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

fn arg(name: &str, default: usize) -> usize {
    std::env::args()
        .find_map(|a| a.strip_prefix(name).and_then(|v| v.parse().ok()))
        .unwrap_or(default)
}

/// `{what}: median R% (min R%, max R%)` of the per-round fractions `fr`.
fn print_fractions(what: &str, mut fr: Vec<f64>) {
    fr.sort_by(f64::total_cmp);
    println!(
        "{what}: median {:.0}% (min {:.0}%, max {:.0}%)",
        100.0 * fr[fr.len() / 2],
        100.0 * fr[0],
        100.0 * fr[fr.len() - 1]
    );
}

fn prefill_run<T: Storage>(l: usize, acp: bool, isa: Isa) {
    let h = 8;
    let d = 64;
    let shape = self_attention(h, l, d);
    let mut s = 1;
    let q: Vec<T> = (0..shape.q_len())
        .map(|_| T::from_f32(lcg(&mut s)))
        .collect();
    let k: Vec<T> = (0..shape.kv_len())
        .map(|_| T::from_f32(lcg(&mut s)))
        .collect();
    let v: Vec<T> = (0..shape.kv_len())
        .map(|_| T::from_f32(lcg(&mut s)))
        .collect();
    // Log gates: -0.02 average decay with spread, a mix of local and global heads.
    let g: Vec<f32> = (0..shape.gate_len())
        .map(|i| -(0.001 + 0.05 * (i % h) as f32 / h as f32) * (1.0 + lcg(&mut s).abs()))
        .collect();
    let args = PrefillArgs {
        shape,
        q: &q,
        k: &k,
        v: &v,
        log_fgate: &g,
        seq_start: None,
    };
    let u = [4.0f64; 8];
    let opts = PrefillOptions {
        acp: if acp {
            Acp::Bound {
                u: &u,
                ln_eps: -10.0,
            }
        } else {
            Acp::Off
        },
        block_q: arg("bq=", 64),
        block_k: arg("bk=", 64),
        ..Default::default()
    };
    let mut out = vec![0.0f32; shape.q_len()];
    let mut kept = 0;
    let reps = arg("reps=", if l >= 8192 { 3 } else { 7 });
    let c0 = cpu_seconds();
    let t = time(reps, || {
        let st = prefill_with_isa(isa, &args, &opts, &mut out, None).unwrap();
        kept = st.kept_pairs();
    });
    let cpu = (cpu_seconds() - c0) / (reps + 1) as f64;
    let gf = 4.0 * d as f64 * kept as f64 / t / 1e9;
    println!(
        "prefill {:?} L={l} acp={acp} {isa:?} bq={} bk={}: {:.2} ms, kept pairs {kept}, {gf:.1} GFLOP/s ({:.1} GFLOP per CPU-second)",
        T::DTYPE,
        opts.block_q,
        opts.block_k,
        t * 1e3,
        4.0 * d as f64 * kept as f64 / cpu / 1e9
    );
    // `frac=R`: R rounds, each a 2-thread FMA-peak measurement (0.5 s) right before a
    // prefill timing (median of 3): the fraction of the peak measured in the same seconds.
    let rounds = arg("frac=", 0);
    if rounds > 0 {
        let mut fr = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let peak = foxedge_cpu::limits::fma_peak_gflops(2, 0.5);
            let t = time(3, || {
                prefill_with_isa(isa, &args, &opts, &mut out, None).unwrap();
            });
            let got = 4.0 * d as f64 * kept as f64 / t / 1e9;
            println!(
                "  round: peak {peak:.1} GFLOP/s, prefill {:.2} ms = {got:.1} GFLOP/s = {:.0}%",
                t * 1e3,
                100.0 * got / peak
            );
            fr.push(got / peak);
        }
        print_fractions(
            &format!("prefill L={l} fraction of same-round FMA peak"),
            fr,
        );
    }
}

/// `ratio L rounds=R`: f32 prefill (8 heads, d = 64, random q/k/v) on the fixture model's
/// real gates, dense and ACP measured in the same seconds. Each round: the 2-thread FMA
/// peak (0.5 s), then `pairs=P` (default 5) alternating dense / ACP timings, median of
/// each. Per round it prints the dense fraction of that peak and the ACP time ratio over
/// the kept-pair fraction (issue 3's two prefill goals: >= 50% and <= 1.2x); the summary
/// is the median (min, max) over rounds. Pairing cancels the load drift of a shared host.
fn ratio_run(l: usize) {
    use fixture_gates::{HEADS, real_gates};
    let d = 64;
    let shape = self_attention(HEADS, l, d);
    let mut s = 1;
    let mut gen_t = |n| (0..n).map(|_| lcg(&mut s)).collect::<Vec<f32>>();
    let (q, k, v) = (
        gen_t(shape.q_len()),
        gen_t(shape.kv_len()),
        gen_t(shape.kv_len()),
    );
    let (g, u) = real_gates(l);
    let args = PrefillArgs {
        shape,
        q: &q,
        k: &k,
        v: &v,
        log_fgate: &g,
        seq_start: None,
    };
    let dense = PrefillOptions::default();
    let acp = PrefillOptions {
        acp: Acp::Bound {
            u: &u,
            ln_eps: -10.0,
        },
        ..Default::default()
    };
    let mut out = vec![0.0f32; shape.q_len()];
    let mut run = |o: &PrefillOptions<'_>| {
        let s = Instant::now();
        let st = prefill(&args, o, &mut out, None).unwrap();
        (s.elapsed().as_secs_f64(), st)
    };
    let (_, st_d) = run(&dense);
    let (_, st_a) = run(&acp);
    let kept = st_a.kept_pairs() as f64 / st_d.kept_pairs() as f64;
    let flops = 4.0 * d as f64 * st_d.kept_pairs() as f64;
    println!(
        "ratio L={l}: ACP keeps {} of {} pairs ({:.1}%), {} of {} blocks",
        st_a.kept_pairs(),
        st_d.kept_pairs(),
        100.0 * kept,
        st_a.heads.iter().map(|h| h.kept_blocks).sum::<u64>(),
        st_d.heads.iter().map(|h| h.kept_blocks).sum::<u64>(),
    );
    let pairs = arg("pairs=", 5);
    let (mut fr, mut rr) = (Vec::new(), Vec::new());
    for _ in 0..arg("rounds=", 9) {
        let peak = foxedge_cpu::limits::fma_peak_gflops(2, 0.5);
        let (mut td, mut ta) = (Vec::new(), Vec::new());
        for _ in 0..pairs {
            td.push(run(&dense).0);
            ta.push(run(&acp).0);
        }
        td.sort_by(f64::total_cmp);
        ta.sort_by(f64::total_cmp);
        let (td, ta) = (td[pairs / 2], ta[pairs / 2]);
        let f = flops / td / 1e9 / peak;
        let r = ta / td / kept;
        println!(
            "  round: peak {peak:.1} GFLOP/s, dense {:.2} ms = {:.0}%, ACP {:.2} ms, ratio/kept {r:.3}",
            td * 1e3,
            100.0 * f,
            ta * 1e3
        );
        fr.push(f);
        rr.push(r);
    }
    print_fractions(
        &format!("dense prefill L={l} fraction of same-round FMA peak"),
        fr,
    );
    rr.sort_by(f64::total_cmp);
    println!(
        "ACP time ratio / kept fraction L={l}: median {:.3} (min {:.3}, max {:.3})",
        rr[rr.len() / 2],
        rr[0],
        rr[rr.len() - 1]
    );
}

fn decode_run<T: Storage>(n: usize, acp: bool) {
    let (h, d) = (arg("heads=", 8), arg("d=", 64));
    let mut s = 7;
    let k: Vec<Vec<T>> = (0..h)
        .map(|_| (0..n * d).map(|_| T::from_f32(lcg(&mut s))).collect())
        .collect();
    let v: Vec<Vec<T>> = (0..h)
        .map(|_| (0..n * d).map(|_| T::from_f32(lcg(&mut s))).collect())
        .collect();
    // c_j of a stream in position order (entry j at position j), a different decay rate
    // per head: c_j = -rate_h * j, so D = c_t - c_j = -rate_h (n - 1 - j) <= 0.
    let c: Vec<Vec<f64>> = (0..h)
        .map(|hh| {
            (0..n)
                .map(|j| -(0.002 * (hh + 1) as f64) * j as f64)
                .collect()
        })
        .collect();
    let heads: Vec<CacheHead<T>> = (0..h)
        .map(|i| CacheHead {
            k: &k[i],
            v: &v[i],
            c: &c[i],
            pos: None,
        })
        .collect();
    let q: Vec<f32> = (0..h * d).map(|_| lcg(&mut s)).collect();
    let q_c: Vec<f64> = c.iter().map(|x| x[n - 1]).collect();
    let args = DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: &q,
        q_c: &q_c,
        q_pos: None,
        heads: &heads,
    };
    let u = vec![2.0f64; h];
    let opts = DecodeOptions {
        acp: if acp {
            Acp::Bound {
                u: &u,
                ln_eps: -10.0,
            }
        } else {
            Acp::Off
        },
        block_k: arg("bk=", 64),
        split: arg("split=", 2048),
        ..Default::default()
    };
    let mut out = vec![0.0f32; h * d];
    let mut kept = 0;
    let t = time(arg("reps=", 21), || {
        kept = decode(&args, &opts, &mut out, None).unwrap().kept_pairs();
    });
    let bytes = kept as f64 * d as f64 * 2.0 * std::mem::size_of::<T>() as f64;
    println!(
        "decode {:?} n={n} acp={acp}: {:.3} ms, kept {kept}, {:.1} GB/s K/V",
        T::DTYPE,
        t * 1e3,
        bytes / t / 1e9
    );
    // `frac=R`: R rounds, each a DRAM-read measurement (2 threads, best of 3 passes over
    // 512 MiB) right before a decode timing (median of 9): the fraction of the limit
    // measured in the same seconds.
    let rounds = arg("frac=", 0);
    if rounds > 0 {
        let buf: Vec<f32> = (0..1usize << 27).map(|i| i as f32).collect();
        let mut fr = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let bw = foxedge_cpu::limits::dram_read_gbps(&buf, 2, 3);
            let t = time(9, || {
                decode(&args, &opts, &mut out, None).unwrap();
            });
            let got = bytes / t / 1e9;
            println!(
                "  round: DRAM read {bw:.1} GB/s, decode {:.3} ms = {got:.1} GB/s = {:.0}%",
                t * 1e3,
                100.0 * got / bw
            );
            fr.push(got / bw);
        }
        print_fractions(
            &format!("decode {:?} fraction of same-round DRAM read", T::DTYPE),
            fr,
        );
    }
}

/// The machine's limits (foxedge_cpu::limits): fp32 FMA peak and DRAM read, 1 and 2 threads.
fn limits() {
    for threads in [1usize, 2] {
        println!(
            "fp32 FMA peak, {threads} thread(s): {:.1} GFLOP/s",
            foxedge_cpu::limits::fma_peak_gflops(threads, 1.0)
        );
    }
    let buf: Vec<f32> = (0..1usize << 28).map(|i| i as f32).collect(); // 1 GiB
    for threads in [1usize, 2] {
        println!(
            "DRAM read, {threads} thread(s): {:.1} GB/s",
            foxedge_cpu::limits::dram_read_gbps(&buf, threads, 5)
        );
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let what = a.get(1).map_or("limits", String::as_str);
    let n: usize = a.get(2).and_then(|x| x.parse().ok()).unwrap_or(2048);
    let acp = a.iter().any(|x| x == "acp");
    let isa = if a.iter().any(|x| x == "scalar") {
        Isa::Scalar
    } else if a.iter().any(|x| x == "portable") {
        Isa::Portable
    } else {
        Isa::detect()
    };
    let dt = if a.iter().any(|x| x == "f16") {
        "f16"
    } else if a.iter().any(|x| x == "bf16") {
        "bf16"
    } else {
        "f32"
    };
    match (what, dt) {
        ("limits", _) => limits(),
        ("prefill", "f16") => prefill_run::<f16>(n, acp, isa),
        ("prefill", "bf16") => prefill_run::<bf16>(n, acp, isa),
        ("prefill", _) => prefill_run::<f32>(n, acp, isa),
        ("decode", "f16") => decode_run::<f16>(n, acp),
        ("decode", "bf16") => decode_run::<bf16>(n, acp),
        ("decode", _) => decode_run::<f32>(n, acp),
        ("ratio", _) => ratio_run(n),
        _ => eprintln!(
            "usage: speed limits | prefill L [acp] [f16|bf16] [scalar|portable] | decode N [acp] [f16|bf16] | ratio L [rounds=R] [pairs=P]"
        ),
    }
}
