//! Decode against the f64 reference, against prefill, with ACP and bad inputs.
mod common;

use common::*;
use foxedge_cpu::reference::decode_f64;
use foxedge_cpu::{
    Acp, CacheHead, DecodeArgs, DecodeOptions, Error, Isa, Layout, PrefillArgs, PrefillOptions,
    Storage, decode, decode_with_isa, prefill,
};
use half::{bf16, f16};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// A cache of `n` entries per head, shuffled (as swap-delete leaves it), with c_j of a
/// decaying stream relative to an origin far from 0 (|c| ~ 1e5: the f64 differences must
/// stay exact).
struct Cache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    c: Vec<Vec<f64>>,
    pos: Vec<Vec<u64>>,
}

fn cache(seed: u64, heads: usize, n: usize, d: usize) -> Cache {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cc = Cache {
        k: vec![],
        v: vec![],
        c: vec![],
        pos: vec![],
    };
    for _ in 0..heads {
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        let mut c_pos = vec![0.0f64; n];
        let mut acc = -1.0e5;
        for x in c_pos.iter_mut() {
            acc += f64::from(logsigmoid(4.0 + 2.0 * normal(&mut rng)));
            *x = acc;
        }
        cc.k.push((0..n * d).map(|_| normal(&mut rng)).collect());
        cc.v.push((0..n * d).map(|_| normal(&mut rng)).collect());
        cc.c.push(order.iter().map(|&p| c_pos[p]).collect());
        cc.pos.push(order.iter().map(|&p| p as u64).collect());
    }
    cc
}

fn heads<'a, T: Storage>(
    cc: &'a Cache,
    k: &'a [Vec<T>],
    v: &'a [Vec<T>],
    with_pos: bool,
) -> Vec<CacheHead<'a, T>> {
    (0..k.len())
        .map(|h| CacheHead {
            k: &k[h],
            v: &v[h],
            c: &cc.c[h],
            pos: if with_pos { Some(&cc.pos[h][..]) } else { None },
        })
        .collect()
}

fn run_vs_reference<T: Storage>(tol: f64) {
    let (nh, n, d, nq) = (3, 1000, 64, 2);
    let cc = cache(1, nh, n, d);
    let k: Vec<Vec<T>> = cc.k.iter().map(|x| convert(x)).collect();
    let v: Vec<Vec<T>> = cc.v.iter().map(|x| convert(x)).collect();
    let hs = heads(&cc, &k, &v, true);
    let mut rng = StdRng::seed_from_u64(2);
    let q: Vec<f32> = (0..nh * nq * d).map(|_| normal(&mut rng)).collect();
    // Query 0 sits at position 900 (sees 901 entries), query 1 at the newest (n - 1).
    let q_pos: Vec<u64> = (0..nh).flat_map(|_| [900u64, (n - 1) as u64]).collect();
    let q_c: Vec<f64> = (0..nh)
        .flat_map(|h| {
            let at = |p: u64| cc.c[h][cc.pos[h].iter().position(|&x| x == p).unwrap()];
            [at(900), at((n - 1) as u64)]
        })
        .collect();
    let args = DecodeArgs {
        head_dim: d,
        n_queries: nq,
        q: &q,
        q_c: &q_c,
        q_pos: Some(&q_pos),
        heads: &hs,
    };
    let (want, want_lse) = decode_f64(&args, None);
    for isa in Isa::available() {
        for split in [64, 300, 5000] {
            let opts = DecodeOptions {
                split,
                ..Default::default()
            };
            let mut out = vec![0.0f32; nh * nq * d];
            let mut lse = vec![0.0f32; nh * nq];
            let st = decode_with_isa(isa, &args, &opts, &mut out, Some(&mut lse)).unwrap();
            let e = rel_l2(&to_f64(&out), &want);
            assert!(e <= tol, "{:?} {isa:?} split {split}: {e}", T::DTYPE);
            for (x, y) in lse.iter().zip(&want_lse) {
                assert!((f64::from(*x) - y).abs() < 1e-4 * (1.0 + y.abs()));
            }
            assert_eq!(st.heads[0].total_pairs, 901 + 1000);
            assert_eq!(st.kept_pairs(), st.total_pairs());
        }
    }
}

#[test]
fn f32_cache_matches_reference() {
    run_vs_reference::<f32>(1e-5);
}

#[test]
fn f16_and_bf16_caches_match_reference() {
    // The reference reads the same rounded cache; f32 output keeps the f32 tolerance.
    run_vs_reference::<f16>(1e-5);
    run_vs_reference::<bf16>(1e-5);
}

#[test]
fn decode_equals_last_prefill_row() {
    // Prefill over L tokens; the last row must equal decode of its query against the
    // (shuffled) cache of all L keys with c from the same gates.
    let (h, l, d) = (2, 333, 32);
    let p = problem(3, 1, h, h, l, l, d, Layout::HeadFirst, 2.0);
    let pa = PrefillArgs {
        shape: p.shape,
        q: &p.q,
        k: &p.k,
        v: &p.v,
        log_fgate: &p.g,
        seq_start: None,
    };
    let mut out = vec![0.0f32; p.shape.q_len()];
    prefill(&pa, &PrefillOptions::default(), &mut out, None).unwrap();
    let mut rng = StdRng::seed_from_u64(4);
    let mut cc = Cache {
        k: vec![],
        v: vec![],
        c: vec![],
        pos: vec![],
    };
    let mut q = vec![];
    let mut q_c = vec![];
    for hh in 0..h {
        let mut c = vec![0.0f64; l];
        let mut acc = 0.0;
        for (j, x) in c.iter_mut().enumerate() {
            acc += f64::from(p.g[hh * l + j]);
            *x = acc;
        }
        let mut order: Vec<usize> = (0..l).collect();
        order.shuffle(&mut rng);
        let rows = |src: &Vec<f32>| -> Vec<f32> {
            order
                .iter()
                .flat_map(|&j| src[(hh * l + j) * d..][..d].to_vec())
                .collect()
        };
        cc.k.push(rows(&p.k));
        cc.v.push(rows(&p.v));
        cc.c.push(order.iter().map(|&j| c[j]).collect());
        q.extend_from_slice(&p.q[(hh * l + l - 1) * d..][..d]);
        q_c.push(c[l - 1]);
    }
    let hs = heads(&cc, &cc.k, &cc.v, false);
    let args = DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: &q,
        q_c: &q_c,
        q_pos: None,
        heads: &hs,
    };
    let mut dout = vec![0.0f32; h * d];
    decode(
        &args,
        &DecodeOptions {
            split: 128,
            ..Default::default()
        },
        &mut dout,
        None,
    )
    .unwrap();
    for hh in 0..h {
        let pre: Vec<f64> = to_f64(&out[(hh * l + l - 1) * d..][..d]);
        let e = rel_l2(&to_f64(&dout[hh * d..(hh + 1) * d]), &pre);
        assert!(e < 1e-5, "head {hh}: {e}");
    }
}

#[test]
fn acp_skips_old_blocks_within_bound() {
    let (nh, n, d) = (2, 2000, 16);
    let mut cc = cache(5, nh, n, d);
    // Unit-norm keys and queries: |s q.k| <= 1/4 =: U.
    for k in cc.k.iter_mut() {
        for row in k.chunks_exact_mut(d) {
            let nr = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            row.iter_mut().for_each(|x| *x /= nr);
        }
    }
    // Entries sorted by position in blocks (as a retention cache mostly keeps them).
    for h in 0..nh {
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&j| cc.pos[h][j]);
        let perm = |src: &Vec<f32>| -> Vec<f32> {
            idx.iter()
                .flat_map(|&j| src[j * d..][..d].to_vec())
                .collect()
        };
        cc.k[h] = perm(&cc.k[h]);
        cc.v[h] = perm(&cc.v[h]);
        cc.c[h] = idx.iter().map(|&j| cc.c[h][j]).collect();
        cc.pos[h] = idx.iter().map(|&j| cc.pos[h][j]).collect();
    }
    let hs = heads(&cc, &cc.k, &cc.v, false);
    let q: Vec<f32> = (0..nh * d)
        .map(|i| if i % d == 0 { 1.0 } else { 0.0 })
        .collect();
    let q_c: Vec<f64> = (0..nh).map(|h| cc.c[h][n - 1]).collect();
    let args = DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: &q,
        q_c: &q_c,
        q_pos: None,
        heads: &hs,
    };
    let (dense, _) = decode_f64(&args, None);
    let ln_eps = -4.0;
    let opts = DecodeOptions {
        acp: Acp::Bound {
            u: &[0.25; 2],
            ln_eps,
        },
        ..Default::default()
    };
    let mut out = vec![0.0f32; nh * d];
    let st = decode(&args, &opts, &mut out, None).unwrap();
    assert!(st.kept_fraction() < 0.6, "kept {}", st.kept_fraction());
    let eps = f64::exp(ln_eps);
    let vmax = cc.v.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    let err = max_abs(&to_f64(&out), &dense);
    assert!(err <= 2.0 * eps / (1.0 - eps) * vmax + 1e-5, "{err}");
}

#[test]
fn empty_and_fully_masked() {
    let d = 8;
    let empty: [f32; 0] = [];
    let hs = [CacheHead::<f32> {
        k: &empty,
        v: &empty,
        c: &[],
        pos: None,
    }];
    let args = DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: &[1.0; 8],
        q_c: &[0.0],
        q_pos: None,
        heads: &hs,
    };
    let mut out = vec![9.0f32; d];
    let mut lse = [0.0f32];
    decode(&args, &DecodeOptions::default(), &mut out, Some(&mut lse)).unwrap();
    assert!(out.iter().all(|&x| x == 0.0) && lse[0] == f32::NEG_INFINITY);
    let acp = DecodeOptions {
        acp: Acp::Bound {
            u: &[1.0],
            ln_eps: -10.0,
        },
        ..Default::default()
    };
    decode(&args, &acp, &mut out, None).unwrap();
}

#[test]
fn bad_inputs_are_errors() {
    let d = 8;
    let k = vec![0.5f32; 3 * d];
    let c = [0.0, -1.0, -2.0];
    let pos = [0u64, 1, 2];
    let hs = [CacheHead {
        k: &k,
        v: &k,
        c: &c,
        pos: None,
    }];
    let q = [1.0f32; 8];
    let ok = DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: &q,
        q_c: &[-2.0],
        q_pos: None,
        heads: &hs,
    };
    let o = DecodeOptions::default();
    let mut out = vec![0.0f32; d];
    assert!(decode(&ok, &o, &mut out, None).is_ok());
    let bad_k = [CacheHead {
        k: &k[1..],
        v: &k,
        c: &c,
        pos: None,
    }];
    let bad_c = [CacheHead {
        k: &k,
        v: &k,
        c: &[0.0, f64::NAN, 0.0],
        pos: None,
    }];
    let with_pos = [CacheHead {
        k: &k,
        v: &k,
        c: &c,
        pos: Some(&pos),
    }];
    let cases = [
        DecodeArgs {
            heads: &bad_k,
            ..ok
        },
        DecodeArgs {
            heads: &bad_c,
            ..ok
        },
        DecodeArgs {
            heads: &with_pos,
            ..ok
        },
        DecodeArgs {
            q_c: &[f64::INFINITY],
            ..ok
        },
        DecodeArgs { q: &q[1..], ..ok },
        DecodeArgs { head_dim: 4, ..ok },
        DecodeArgs { n_queries: 0, ..ok },
        DecodeArgs { heads: &[], ..ok },
    ];
    for a in &cases {
        assert!(decode(a, &o, &mut out, None).is_err());
    }
    assert!(matches!(
        decode(&ok, &o, &mut out[1..], None),
        Err(Error::BadLength { .. })
    ));
    let bad_opts = [
        DecodeOptions { block_k: 0, ..o },
        DecodeOptions { split: 0, ..o },
        DecodeOptions {
            sm_scale: Some(f32::INFINITY),
            ..o
        },
        DecodeOptions {
            acp: Acp::Threshold(&[0.0, 0.0]),
            ..o
        },
        DecodeOptions {
            acp: Acp::Bound {
                u: &[-1.0],
                ln_eps: -1.0,
            },
            ..o
        },
        DecodeOptions {
            acp: Acp::ObservedNorms { ln_eps: -1.0 },
            ..o
        },
    ];
    for bo in bad_opts {
        assert!(decode(&ok, &bo, &mut out, None).is_err(), "{bo:?}");
    }
}

#[test]
fn non_finite_logits_are_errors_not_zero_rows() {
    let d = 8;
    let k = vec![0.5f32; 3 * d];
    let c = [0.0, -1.0, -2.0];
    let hs = [CacheHead {
        k: &k,
        v: &k,
        c: &c,
        pos: None,
    }];
    let o = DecodeOptions::default();
    let mut out = vec![0.0f32; d];
    // NaN, inf, and finite values whose s*q.k overflows f32 (8 * 0.35 * 3e38 * 0.5).
    for (i, bad) in [(3, f32::NAN), (3, f32::INFINITY), (8, 3.0e38)] {
        let mut q = [1.0f32; 8];
        q[..i.min(8)].fill(bad);
        q[3] = bad;
        let a = DecodeArgs {
            head_dim: d,
            n_queries: 1,
            q: &q,
            q_c: &[-2.0],
            q_pos: None,
            heads: &hs,
        };
        for isa in Isa::available() {
            assert!(
                matches!(
                    foxedge_cpu::decode_with_isa(isa, &a, &o, &mut out, None),
                    Err(Error::BadArgument(_))
                ),
                "{bad} {isa:?}"
            );
        }
    }
}
