//! Costs of the decisions: boundary search at 16K tokens, one decode step's block minima
//! (16 heads x 64K entries, 64 per block, against the plain fold) and one retention-policy
//! step (4 heads, 4096-entry budget per head) in steady state. Run:
//! `cargo bench -p foxedge-core --bench core`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use foxedge_core::boundary::{BlockGrid, first_kept_keys, start_blocks};
use foxedge_core::contract::acp::block_min;
use foxedge_core::gate::cumsum_strided;
use foxedge_core::retention::{ForcedOrder, HeadState, PolicyConfig, RetentionPolicy, Slot};
use foxedge_core::threshold::{DEFAULT_LN_EPS, threshold};
use std::hint::black_box;

/// Deterministic log gates in [-scale, 0] (a small LCG; no RNG dependency needed).
fn gates(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            -scale * ((x >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn boundary(c: &mut Criterion) {
    let l = 16384;
    let mut g = c.benchmark_group("boundary_16k");
    for (name, scale) in [("local", 1.0f32), ("global", 1e-4)] {
        let mut cs = vec![0.0; l];
        cumsum_strided(&gates(l, scale, 7), 1, 0.0, &mut cs).unwrap();
        let delta = threshold(16.0, l, DEFAULT_LN_EPS).unwrap();
        let grid = BlockGrid::new(128, 64, l, l).unwrap();
        let mut out = vec![0u32; grid.q_blocks()];
        g.bench_function(BenchmarkId::new("start_blocks", name), |b| {
            b.iter(|| start_blocks(&grid, black_box(&cs), Some(delta), 0, &mut out).unwrap())
        });
        let mut tok = vec![0u32; l];
        g.bench_function(BenchmarkId::new("first_kept_keys", name), |b| {
            b.iter(|| first_kept_keys(black_box(&cs), Some(delta), 0, 0, &mut tok).unwrap())
        });
    }
    g.finish();
}

fn decode_minima(c: &mut Criterion) {
    let cs: Vec<f64> = (0..16 * 65536).map(|j| -(j as f64) * 1e-3).collect();
    let mut g = c.benchmark_group("decode_block_minima_16x64k");
    g.bench_function("block_min", |b| {
        b.iter(|| black_box(&cs).chunks(64).map(block_min).sum::<f64>())
    });
    g.bench_function("fold", |b| {
        b.iter(|| {
            black_box(&cs)
                .chunks(64)
                .map(|x| x.iter().copied().fold(f64::INFINITY, f64::min))
                .sum::<f64>()
        })
    });
    g.finish();
}

fn retention(c: &mut Criterion) {
    let heads = 4;
    let mut g = c.benchmark_group("retention_step_4heads_budget4096");
    for order in [ForcedOrder::WeightBound, ForcedOrder::Scores] {
        let cfg = PolicyConfig {
            window: 64,
            sinks: 4,
            order,
            ..PolicyConfig::new(heads, 4096)
        };
        let mut p = RetentionPolicy::new(
            cfg,
            &[8.0; 4],
            vec![Slot::EMPTY; cfg.slots_needed().unwrap()],
            vec![HeadState::EMPTY; heads],
        )
        .unwrap();
        // heads 0-1 local (certified evictions), 2-3 global (forced by the budget)
        let steps = 1 << 16;
        let gl = gates(steps * 2, 1.0, 1);
        let gg = gates(steps * 2, 1e-4, 2);
        let sc = gates(steps * heads, 1.0, 3);
        let mut cs = [0.0f64; 4];
        let mut t = 0usize;
        let mut step = |p: &mut RetentionPolicy<Vec<Slot>, Vec<HeadState>>| {
            let i = t % steps;
            for h in 0..heads {
                cs[h] += f64::from(if h < 2 {
                    gl[2 * i + h]
                } else {
                    gg[2 * i + h - 2]
                });
            }
            let scores = (order == ForcedOrder::Scores).then(|| &sc[i * heads..(i + 1) * heads]);
            let mut moves = 0u32;
            p.append(t as u64, &cs, scores, |e| {
                moves += u32::from(e.moved_from.is_some())
            })
            .unwrap();
            t += 1;
            moves
        };
        for _ in 0..8192 {
            step(&mut p); // fill to the budget: steady state
        }
        g.bench_function(BenchmarkId::new("append", format!("{order:?}")), |b| {
            b.iter(|| black_box(step(&mut p)))
        });
        let st = p.layer_stats();
        eprintln!(
            "{order:?}: live {} certified {} forced {} max B_t {:.3e}",
            st.live, st.evicted_certified, st.evicted_forced, st.max_bound
        );
    }
    g.finish();
}

criterion_group!(benches, boundary, decode_minima, retention);
criterion_main!(benches);
