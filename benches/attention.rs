//! CPU forgetting-attention benches (foxedge-cpu): dense vs ACP prefill, decode over a
//! 32k cache, f32 / f16 / bf16 storage, plus this machine's limits (fp32 FMA peak, DRAM
//! read bandwidth) so that every figure can be stated as a fraction of the machine.
//!
//! `cargo bench --no-default-features --bench attention [-- FILTER]`
//!
//! Work is counted as in the issue: 4·d FLOPs per kept query-key pair (criterion's
//! "elem/s" is FLOP/s for prefill); decode throughput is K/V bytes read per step.
//! Threads: rayon's global pool (all cores; `RAYON_NUM_THREADS` to change).
//!
//! ACP gates: the fixture model's real log forget gates repeated periodically to length L
//! (`cpu/examples/common/fixture_gates.rs`): per-head gate statistics and decay rates are
//! those of the trained model, and core derives delta at length L with ln eps = -10.
//! q, k, v are random (they do not change which blocks are pruned).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use foxedge_cpu::{
    Acp, AttentionShape, CacheHead, DecodeArgs, DecodeOptions, Layout, PrefillArgs, PrefillOptions,
    Storage, decode, limits, prefill,
};
use half::{bf16, f16};
use std::hint::black_box;
use std::time::Duration;

#[path = "../cpu/examples/common/fixture_gates.rs"]
mod fixture_gates;
use fixture_gates::{HEADS, real_gates};
const D: usize = 64;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

struct Prefill<T> {
    shape: AttentionShape,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    g: Vec<f32>,
    u: Vec<f64>,
}

fn prefill_problem<T: Storage>(l: usize) -> Prefill<T> {
    let shape = AttentionShape {
        batch: 1,
        heads_q: HEADS,
        heads_kv: HEADS,
        seq_q: l,
        seq_k: l,
        head_dim: D,
        layout: Layout::SeqFirst,
    };
    let mut s = 1;
    let mut gen_t = |n| (0..n).map(|_| T::from_f32(lcg(&mut s))).collect::<Vec<T>>();
    let (q, k, v) = (
        gen_t(shape.q_len()),
        gen_t(shape.kv_len()),
        gen_t(shape.kv_len()),
    );
    let (g, u) = real_gates(l);
    Prefill {
        shape,
        q,
        k,
        v,
        g,
        u,
    }
}

fn bench_prefill_one<T: Storage>(c: &mut Criterion, l: usize, modes: &[bool]) {
    let p = prefill_problem::<T>(l);
    let args = PrefillArgs {
        shape: p.shape,
        q: &p.q,
        k: &p.k,
        v: &p.v,
        log_fgate: &p.g,
        seq_start: None,
    };
    let mut out = vec![0.0f32; p.shape.q_len()];
    let mut g = c.benchmark_group(format!("prefill_{:?}", T::DTYPE).to_lowercase());
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(if l >= 16384 { 30 } else { 10 }));
    for &acp in modes {
        let opts = PrefillOptions {
            acp: if acp {
                Acp::Bound {
                    u: &p.u,
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
            ..Default::default()
        };
        let st = prefill(&args, &opts, &mut out, None).expect("prefill");
        let flops = 4 * D as u64 * st.kept_pairs();
        eprintln!(
            "prefill {:?} L={l} acp={acp}: kept pairs {} of {} ({:.1}%), {:.3} GFLOP",
            T::DTYPE,
            st.kept_pairs(),
            st.total_pairs(),
            100.0 * st.kept_fraction(),
            flops as f64 / 1e9
        );
        g.throughput(Throughput::Elements(flops));
        let name = if acp { "acp" } else { "dense" };
        g.bench_with_input(BenchmarkId::new(name, l), &l, |b, _| {
            b.iter(|| prefill(black_box(&args), &opts, &mut out, None).expect("prefill"))
        });
    }
    g.finish();
}

fn bench_prefill(c: &mut Criterion) {
    for l in [2048, 8192, 16384] {
        bench_prefill_one::<f32>(c, l, &[false, true]);
    }
    bench_prefill_one::<f16>(c, 8192, &[false, true]);
    bench_prefill_one::<bf16>(c, 8192, &[false, true]);
}

fn bench_decode_one<T: Storage>(c: &mut Criterion, n: usize) {
    // A cache of n entries per head in position order, c_j from the real gates.
    let (g, u) = real_gates(n);
    let mut s = 7;
    let mut gen_t = |m| (0..m).map(|_| T::from_f32(lcg(&mut s))).collect::<Vec<T>>();
    let k: Vec<Vec<T>> = (0..HEADS).map(|_| gen_t(n * D)).collect();
    let v: Vec<Vec<T>> = (0..HEADS).map(|_| gen_t(n * D)).collect();
    let cs: Vec<Vec<f64>> = (0..HEADS)
        .map(|h| {
            let mut acc = 0.0;
            (0..n)
                .map(|t| {
                    acc += f64::from(g[t * HEADS + h]);
                    acc
                })
                .collect()
        })
        .collect();
    let heads: Vec<CacheHead<T>> = (0..HEADS)
        .map(|h| CacheHead {
            k: &k[h],
            v: &v[h],
            c: &cs[h],
            pos: None,
        })
        .collect();
    let q: Vec<f32> = (0..HEADS * D).map(|_| lcg(&mut s)).collect();
    let q_c: Vec<f64> = cs.iter().map(|x| x[n - 1]).collect();
    let args = DecodeArgs {
        head_dim: D,
        n_queries: 1,
        q: &q,
        q_c: &q_c,
        q_pos: None,
        heads: &heads,
    };
    let mut out = vec![0.0f32; HEADS * D];
    let mut grp = c.benchmark_group(format!("decode_{:?}", T::DTYPE).to_lowercase());
    grp.sample_size(50).measurement_time(Duration::from_secs(5));
    for acp in [false, true] {
        let opts = DecodeOptions {
            acp: if acp {
                Acp::Bound {
                    u: &u,
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
            ..Default::default()
        };
        let st = decode(&args, &opts, &mut out, None).expect("decode");
        let bytes = st.kept_pairs() * 2 * D as u64 * std::mem::size_of::<T>() as u64;
        eprintln!(
            "decode {:?} n={n} acp={acp}: kept entries {} of {} ({:.1}%), K/V bytes {bytes}",
            T::DTYPE,
            st.kept_pairs(),
            st.total_pairs(),
            100.0 * st.kept_fraction()
        );
        grp.throughput(Throughput::Bytes(bytes));
        let name = if acp { "acp" } else { "dense" };
        grp.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
            b.iter(|| decode(black_box(&args), &opts, &mut out, None).expect("decode"))
        });
    }
    grp.finish();
}

fn bench_decode(c: &mut Criterion) {
    bench_decode_one::<f32>(c, 32768);
    bench_decode_one::<f16>(c, 32768);
    bench_decode_one::<bf16>(c, 32768);
}

/// The machine's limits (foxedge_cpu::limits), measured with rayon's pool size of threads:
/// fp32 FMA peak and DRAM read bandwidth (sum over a 1 GiB buffer split across the threads).
fn bench_limits(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let mut g = c.benchmark_group("limits");
    g.sample_size(10);
    let (block_flops, _) = limits::fma_block();
    g.throughput(Throughput::Elements(threads as u64 * block_flops as u64));
    g.bench_function(format!("fp32_fma_peak_{threads}threads"), |b| {
        b.iter(|| rayon::broadcast(|_| black_box(limits::fma_block())))
    });
    let n = 1usize << 28;
    let buf: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let parts: Vec<&[f32]> = buf.chunks(n.div_ceil(threads)).collect();
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function(format!("dram_read_{threads}threads"), |b| {
        b.iter(|| rayon::broadcast(|ctx| black_box(limits::read_pass(parts[ctx.index()]))))
    });
    g.finish();
}

criterion_group!(benches, bench_limits, bench_prefill, bench_decode);
criterion_main!(benches);
