//! Property tests over shapes: odd lengths, seq_q < seq_k, left padding, GQA, head dims
//! 8..256, odd block sizes, both layouts, ACP thresholds. Every kernel output must equal
//! the f64 reference restricted to the key blocks core kept (rel L2 <= 1e-5), and the
//! fast instruction set must agree with the scalar reference path. A call that selects
//! some heads writes exactly those heads' rows, as the whole call does.
mod common;

use common::*;
use foxedge_core::boundary::{BlockGrid, start_blocks};
use foxedge_cpu::reference::prefill_f64;
use foxedge_cpu::{
    Acp, Decisions, Isa, Layout, PrefillArgs, PrefillOptions, prefill, prefill_with_isa,
};
use proptest::prelude::*;

const CASES: u32 = if cfg!(target_arch = "aarch64") {
    16
} else {
    80
};

#[derive(Debug, Clone)]
struct Case {
    batch: usize,
    heads_kv: usize,
    group: usize,
    seq_q: usize,
    seq_k: usize,
    d: usize,
    head_first: bool,
    pad: Vec<usize>,
    block_q: usize,
    block_k: usize,
    delta: Option<f64>,
    gate_mu: f32,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=2, 1usize..=2, 1usize..=3, 1usize..=90, 0usize..=40),
        (
            prop::sample::select(vec![8usize, 16, 24, 32, 64, 72, 128, 256]),
            any::<bool>(),
        ),
        (
            1usize..=70,
            1usize..=70,
            prop::option::of(-30.0f64..0.0),
            -2.0f32..5.0,
            any::<u64>(),
        ),
        prop::collection::vec(0usize..1000, 2),
    )
        .prop_map(
            |(
                (batch, heads_kv, group, seq_q, extra),
                (d, head_first),
                (bq, bk, delta, gate_mu, seed),
                pad,
            )| {
                let seq_k = seq_q + extra;
                Case {
                    batch,
                    heads_kv,
                    group,
                    seq_q,
                    seq_k,
                    d,
                    head_first,
                    pad: pad
                        .iter()
                        .take(batch)
                        .map(|p| if p % 3 == 0 { p % seq_k } else { 0 })
                        .collect(),
                    block_q: bq,
                    block_k: bk,
                    delta,
                    gate_mu,
                    seed,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn prefill_matches_reference_on_kept_blocks(c in case()) {
        let layout = if c.head_first { Layout::HeadFirst } else { Layout::SeqFirst };
        let hq = c.heads_kv * c.group;
        let p = problem(c.seed, c.batch, hq, c.heads_kv, c.seq_q, c.seq_k, c.d, layout, c.gate_mu);
        let a = PrefillArgs { shape: p.shape, q: &p.q, k: &p.k, v: &p.v, log_fgate: &p.g, seq_start: Some(&c.pad) };
        let deltas = vec![c.delta.unwrap_or(0.0); c.batch * hq];
        let opts = PrefillOptions {
            acp: if c.delta.is_some() { Acp::Threshold(&deltas) } else { Acp::Off },
            block_q: c.block_q,
            block_k: c.block_k,
            sm_scale: None,
            heads: None,
        };
        // Core's boundary for every (b, h), to restrict the reference to kept blocks.
        let grid = BlockGrid::new(c.block_q, c.block_k, c.seq_q, c.seq_k).unwrap();
        let mut starts = vec![vec![0u32; grid.q_blocks()]; c.batch * hq];
        for b in 0..c.batch {
            for h in 0..hq {
                let mut cs = vec![0.0; c.seq_k];
                foxedge_core::gate::cumsum_strided(&p.g[p.shape.gate_at(b, 0, h)..], p.shape.gate_stride(), 0.0, &mut cs).unwrap();
                start_blocks(&grid, &cs, c.delta, c.pad[b], &mut starts[b * hq + h]).unwrap();
            }
        }
        let fk = |b: usize, h: usize, t: usize| starts[b * hq + h][t / c.block_q] as usize * c.block_k;
        let (want, _) = prefill_f64(&a, None, Some(&fk));
        let mut fast = vec![0.0f32; p.shape.q_len()];
        let st = prefill_with_isa(Isa::detect(), &a, &opts, &mut fast, None).unwrap();
        let mut scalar = vec![0.0f32; p.shape.q_len()];
        let st2 = prefill_with_isa(Isa::Scalar, &a, &opts, &mut scalar, None).unwrap();
        prop_assert_eq!(&st, &st2);
        prop_assert!(st.kept_pairs() <= st.total_pairs());
        let want_norm: f64 = want.iter().map(|x| x * x).sum();
        if want_norm > 0.0 {
            let e = rel_l2(&to_f64(&fast), &want);
            prop_assert!(e <= 1e-5, "fast vs reference {}", e);
            let e = rel_l2(&to_f64(&scalar), &want);
            prop_assert!(e <= 1e-5, "scalar vs reference {}", e);
        } else {
            prop_assert!(fast.iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn selected_heads_equal_the_whole_call_on_those_heads(c in case(), mask in any::<u32>(), decided in any::<bool>()) {
        let layout = if c.head_first { Layout::HeadFirst } else { Layout::SeqFirst };
        let hq = c.heads_kv * c.group;
        let p = problem(c.seed, c.batch, hq, c.heads_kv, c.seq_q, c.seq_k, c.d, layout, c.gate_mu);
        let a = PrefillArgs { shape: p.shape, q: &p.q, k: &p.k, v: &p.v, log_fgate: &p.g, seq_start: Some(&c.pad) };
        let sel: Vec<usize> = (0..hq).filter(|h| mask & (1 << h) != 0).collect();
        let deltas = vec![c.delta.unwrap_or(0.0); c.batch * hq];
        let whole = PrefillOptions {
            acp: if c.delta.is_some() { Acp::Threshold(&deltas) } else { Acp::Off },
            block_q: c.block_q,
            block_k: c.block_k,
            ..Default::default()
        };
        let rows = c.batch * hq * c.seq_q;
        let mut want = vec![0.0f32; p.shape.q_len()];
        let mut want_lse = vec![0.0f32; rows];
        let st_want = prefill(&a, &whole, &mut want, Some(&mut want_lse)).unwrap();
        // The whole call's decisions, as a split's sides get them.
        let grid = BlockGrid::new(c.block_q, c.block_k, c.seq_q, c.seq_k).unwrap();
        let nqb = grid.q_blocks();
        let mut cs = vec![0.0; c.batch * hq * c.seq_k];
        let mut st = vec![0u32; c.batch * hq * nqb];
        let delta: Vec<Option<f64>> = vec![c.delta; c.batch * hq];
        for b in 0..c.batch {
            for h in 0..hq {
                let bh = b * hq + h;
                let cb = &mut cs[bh * c.seq_k..][..c.seq_k];
                foxedge_core::gate::cumsum_strided(&p.g[p.shape.gate_at(b, 0, h)..], p.shape.gate_stride(), 0.0, cb).unwrap();
                start_blocks(&grid, cb, c.delta, c.pad[b], &mut st[bh * nqb..][..nqb]).unwrap();
            }
        }
        // (Decisions cannot start a block after its diagonal, as left padding may.)
        let decided = decided && c.pad.iter().all(|&x| x == 0);
        let opts = PrefillOptions {
            heads: Some(&sel),
            acp: if decided {
                Acp::Decided(Decisions { c: &cs, start_blocks: &st, delta: &delta })
            } else {
                whole.acp
            },
            ..whole
        };
        let mut got = vec![-7.0f32; p.shape.q_len()];
        let mut got_lse = vec![-7.0f32; rows];
        let st_got = prefill(&a, &opts, &mut got, Some(&mut got_lse)).unwrap();
        let mut picked = Vec::new();
        for b in 0..c.batch {
            for h in 0..hq {
                let on = sel.contains(&h);
                if on {
                    picked.push(st_want.heads[b * hq + h]);
                }
                for t in 0..c.seq_q {
                    let i = p.shape.q_at(b, t, h);
                    let row = &got[i..i + c.d];
                    if on {
                        prop_assert_eq!(row, &want[i..i + c.d]);
                    } else {
                        prop_assert!(row.iter().all(|&x| x == -7.0));
                    }
                    let l = (b * hq + h) * c.seq_q + t;
                    prop_assert_eq!(got_lse[l], if on { want_lse[l] } else { -7.0 });
                }
            }
        }
        prop_assert_eq!(st_got.heads, picked);
    }
}

#[test]
fn a_bad_selection_is_refused() {
    let p = problem(3, 1, 4, 4, 8, 8, 8, Layout::SeqFirst, 0.0);
    let a = PrefillArgs {
        shape: p.shape,
        q: &p.q,
        k: &p.k,
        v: &p.v,
        log_fgate: &p.g,
        seq_start: None,
    };
    let mut out = vec![0.0f32; p.shape.q_len()];
    for sel in [vec![4usize], vec![2, 1], vec![1, 1]] {
        let opts = PrefillOptions {
            heads: Some(&sel),
            ..Default::default()
        };
        assert!(
            matches!(
                prefill(&a, &opts, &mut out, None),
                Err(foxedge_cpu::Error::BadArgument(_))
            ),
            "{sel:?}"
        );
    }
    assert!(out.iter().all(|&x| x == 0.0));
}
