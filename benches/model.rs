//! Model-runner benchmarks on the bundled fox-tiny-pro (3.8M parameters, 4 layers, 4 heads
//! of 64): prefill and decode throughput at 1k and 16k tokens of context, dense vs ACP
//! (+ certified eviction), on real held-out text (tests/fixtures/.../long_input_ids.npy).
//!
//!     RAYON_NUM_THREADS=2 cargo bench --no-default-features --bench model
//!
//! With `FOXEDGE_STREAM_TOKENS=N` (e.g. 200000) it instead streams N tokens one at a time
//! under a budget and prints resident memory (VmRSS / VmHWM from /proc/self/status) and the
//! decode cost per token every 10k tokens: the flat-memory and flat-cost measurement.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use foxedge::{Budget, Model, Session, SessionOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The repository root: `FOXEDGE_ROOT` when set (a bench binary copied to another
/// machine), else the source tree it was built from.
fn root() -> PathBuf {
    std::env::var_os("FOXEDGE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn model() -> Arc<Model> {
    Arc::new(Model::open(root().join("models/fox-tiny-pro")).expect("bundled model"))
}

/// The 8 held-out 16K-token sequences, each starting with BOS.
fn long_ids() -> Vec<Vec<u32>> {
    let path = root().join("tests/fixtures/fox-tiny-pro/long_input_ids.npy");
    let f = std::fs::File::open(&path).expect("long_input_ids.npy");
    let npy = npyz::NpyFile::new(std::io::BufReader::new(f)).expect(".npy header");
    let row = npy.shape()[1] as usize;
    let v: Vec<u8> = npy.into_vec().expect("uint8 ids");
    v.chunks(row)
        .map(|r| r.iter().map(|&x| u32::from(x)).collect())
        .collect()
}

/// (label, options): dense = ACP off and full cache; acp = ln eps -10 with certified eviction.
fn modes() -> [(&'static str, SessionOptions); 2] {
    [
        (
            "dense",
            SessionOptions {
                ln_eps: None,
                certified_eviction: false,
                ..Default::default()
            },
        ),
        ("acp", SessionOptions::default()),
    ]
}

fn prefill(c: &mut Criterion) {
    let m = model();
    let ids = long_ids();
    let mut g = c.benchmark_group("model_prefill");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8));
    for len in [1024usize, 16384] {
        g.throughput(Throughput::Elements(len as u64));
        for (name, opts) in modes() {
            let mut s = Session::new(m.clone(), opts).expect("session");
            let mut logits = vec![0.0f32; 256];
            g.bench_with_input(BenchmarkId::new(name, len), &len, |b, &len| {
                b.iter_custom(|iters| {
                    let mut t = Duration::ZERO;
                    for _ in 0..iters {
                        s.reset().expect("reset");
                        let start = Instant::now();
                        s.feed(&ids[0][..len], Some(&mut logits)).expect("feed");
                        t += start.elapsed();
                    }
                    t
                })
            });
            let st = s.stats();
            eprintln!(
                "  {name}/{len}: ACP pruned {:.1}% of pairs",
                100.0 * st.pruned_fraction()
            );
        }
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let m = model();
    let ids = long_ids();
    let mut g = c.benchmark_group("model_decode");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(1));
    for ctx in [1024usize, 16384] {
        for (name, opts) in modes() {
            let mut s = Session::new(m.clone(), opts).expect("session");
            let mut logits = vec![0.0f32; 256];
            g.bench_with_input(BenchmarkId::new(name, ctx), &ctx, |b, &ctx| {
                b.iter_custom(|iters| {
                    // Context of `ctx` tokens, then `iters` single-token steps on the same
                    // sequence (the second 16K text continues where the first ends).
                    s.reset().expect("reset");
                    s.feed(&ids[1][..ctx], None).expect("prefill");
                    let start = Instant::now();
                    for i in 0..iters as usize {
                        let tok = ids[2][1 + i % 16000];
                        s.feed(&[tok], Some(&mut logits)).expect("decode");
                    }
                    start.elapsed()
                })
            });
            let st = s.stats();
            eprintln!(
                "  {name}/{ctx}: live {} entries after the run, evicted {} certified, pruned {:.1}%",
                st.live_entries,
                st.evicted_certified,
                100.0 * st.pruned_fraction()
            );
        }
    }
    g.finish();
}

/// `VmRSS` and `VmHWM` in KiB (0 where /proc is unavailable).
fn rss_kib() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Streams `n` tokens one at a time (the 8 texts back to back) under a budget of 512
/// entries per head (window 64, 4 sinks, ACP + certified eviction first) and reports memory
/// and cost per 10k tokens.
fn stream(n: usize) {
    let m = model();
    let text: Vec<u32> = long_ids().concat();
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(512)),
        window: 64,
        sinks: 4,
        ..Default::default()
    };
    let mut s = Session::new(m, opts).expect("session");
    let mut logits = vec![0.0f32; 256];
    let (rss0, _) = rss_kib();
    println!("stream of {n} tokens, budget 512 entries/head (window 64, sinks 4), ln eps -10");
    println!(
        "tokens\tVmRSS_KiB\tVmHWM_KiB\tus_per_token(last 10k)\tlive\tcert\tforced\tcache_KiB\tmax_B_t"
    );
    let mut t0 = Instant::now();
    for i in 0..n {
        s.feed(&[text[i % text.len()]], Some(&mut logits))
            .expect("feed");
        if (i + 1) % 10_000 == 0 {
            let per = t0.elapsed().as_secs_f64() * 1e6 / 10_000.0;
            let (rss, hwm) = rss_kib();
            let st = s.stats();
            println!(
                "{}\t{rss}\t{hwm}\t{per:.0}\t{}\t{}\t{}\t{}\t{}",
                i + 1,
                st.live_entries,
                st.evicted_certified,
                st.evicted_forced,
                st.cache_bytes / 1024,
                st.max_bound
                    .map_or("no guarantee".to_string(), |b| format!("{b:.2e}"))
            );
            t0 = Instant::now();
        }
    }
    println!("VmRSS before the stream: {rss0} KiB");
}

criterion_group!(benches, prefill, decode);

fn main() {
    if let Some(n) = std::env::var("FOXEDGE_STREAM_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        stream(n);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
