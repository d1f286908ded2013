//! Attention backends compared: prefill and decode x cpu / vulkan / hybrid (/ auto) x
//! dense / ACP x L in {1k, 4k, 16k, 64k}, on real q/k/v/gates: the bundled fox-tiny-pro run
//! over the held-out long fixture (8 x 16384 tokens), all 4 layers' 4 heads stacked into one
//! 16-head call. 64k joins the inputs of the model run over rows 0..3 (16k each) in time.
//!
//!     cargo bench --bench backends                      # the whole grid (slow on 2 cores)
//!     FOXEDGE_BENCH_LENGTHS=1k,4k cargo bench --bench backends
//!     cargo bench --bench backends -- 'prefill/.*/acp'  # criterion's name filter
//!     cargo bench --bench auto_overhead                 # auto's own time per decode step
//!
//! Throughput is kept FLOPs (`4 * head_dim * kept_pairs`) per second. Backends without a
//! Vulkan device are left out with a message (the CPU is always measured), and so is a cell
//! whose first call took longer than `FOXEDGE_BENCH_MAX_CALL_S` seconds (default 10: ten
//! samples of it would take minutes; lavapipe's dense 4k prefill takes ~90 s per call).
//! Decode calls are steps of one cache (`Engine::decode`): a backend that keeps the cache
//! resident sends it once, then one changed row per head per step, as in a session.

mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use foxedge::BackendKind;
use foxedge::attention::{Engine, PrefillInputs};
use std::time::Duration;

fn max_call_s() -> f64 {
    let s: f64 = common::env_or("FOXEDGE_BENCH_MAX_CALL_S", 10.0);
    if s.is_finite() && s > 0.0 { s } else { 10.0 }
}

/// [`workload`], or `None` after saying why it could not be built.
fn workload_or_say(max_len: usize) -> Option<PrefillInputs> {
    common::workload(max_len)
        .map_err(|e| eprintln!("cannot build the real-gate workload: {e}"))
        .ok()
}

fn bench(c: &mut Criterion) {
    let lens = common::lengths("1k,4k,16k,64k");
    let max_call = max_call_s();
    let Some(&max_len) = lens.iter().max() else {
        eprintln!("FOXEDGE_BENCH_LENGTHS names no length >= 2");
        return;
    };
    let Some(big) = workload_or_say(max_len) else {
        return;
    };
    let mut engines = Vec::new();
    for k in [
        BackendKind::Cpu,
        BackendKind::Vulkan,
        BackendKind::Hybrid,
        BackendKind::Auto,
    ] {
        match Engine::new(k) {
            Ok(e) => {
                if let Err(err) = e.calibrate(big.heads, big.head_dim) {
                    eprintln!("{k}: calibration failed: {err}");
                    continue;
                }
                engines.push((k, e));
            }
            Err(e) => eprintln!("{k}: not measured: {e}"),
        }
    }
    for op in ["prefill", "decode"] {
        let mut g = c.benchmark_group(op);
        g.sample_size(10);
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(3));
        for &len in &lens {
            let Ok(p) = big.prefix(len) else { continue };
            let dp = match op {
                "decode" => match p.decode_at(len) {
                    Ok(d) => Some(d),
                    Err(_) => continue,
                },
                _ => None,
            };
            for (acp_name, acp) in common::MODES {
                for (k, eng) in &engines {
                    let n_out = if dp.is_some() {
                        p.heads * p.head_dim
                    } else {
                        p.q.len()
                    };
                    let mut out = vec![0.0f32; n_out];
                    let t0 = std::time::Instant::now();
                    let st = match &dp {
                        Some(d) => eng.decode(d, acp, &mut out),
                        None => eng.prefill(&p, acp, &mut out),
                    };
                    let Ok(st) = st else {
                        eprintln!("{op} {k} L={len}: failed, not measured");
                        continue;
                    };
                    let first = t0.elapsed().as_secs_f64();
                    if first > max_call {
                        eprintln!(
                            "{op}/{k}/{acp_name}/{len}: one call took {first:.1} s > \
                             FOXEDGE_BENCH_MAX_CALL_S={max_call}: not measured"
                        );
                        continue;
                    }
                    let flops = 4 * p.head_dim as u64 * st.kept_pairs();
                    g.throughput(Throughput::Elements(flops));
                    let id = BenchmarkId::new(format!("{k}/{acp_name}"), len);
                    g.bench_function(id, |b| {
                        b.iter(|| match &dp {
                            Some(d) => eng.decode(d, acp, &mut out).map(|_| ()),
                            None => eng.prefill(&p, acp, &mut out).map(|_| ()),
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
