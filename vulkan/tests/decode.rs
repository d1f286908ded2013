//! Decode on the Vulkan device vs a plain f64 reference and the CPU backend: unordered
//! caches whose entries carry c_j, GQA heads sharing k/v, several queries per step with
//! positions, ACP, an empty head, f16 caches, large |c| (re-basing exactness).
//!
//! Tolerances: f32 storage max |err| <= 2e-5 vs f64 (as prefill); f16 caches vs the f64
//! reference on the same f16-rounded entries, also 2e-5; ACP vs dense within the pruned
//! mass bound 2 eps max|v| (eps = e^-10) plus rounding.
mod common;

use common::*;
use foxedge_vulkan::{Acp, CacheHead, DecodeArgs, DecodeOptions, Storage};
use half::f16;
use rand::seq::SliceRandom;

struct Case {
    d: usize,
    nq: usize,
    q: Vec<f32>,
    q_c: Vec<f64>,
    q_pos: Vec<u64>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    c: Vec<Vec<f64>>,
    pos: Vec<Vec<u64>>,
}

/// `heads` query heads over caches of `lens[h]` entries, shuffled out of position order,
/// with c from random gates (offset by `origin`) and `nq` queries at the newest positions.
fn make(seed: u64, d: usize, nq: usize, lens: &[usize], bias: f32, origin: f64) -> Case {
    let mut r = rng(seed);
    let heads = lens.len();
    let mut case = Case {
        d,
        nq,
        q: randn(&mut r, heads * nq * d, 1.0),
        q_c: vec![],
        q_pos: vec![],
        k: vec![],
        v: vec![],
        c: vec![],
        pos: vec![],
    };
    for &n in lens {
        let g = log_gates(&mut r, n.max(1), bias);
        let mut cs = Vec::with_capacity(n);
        let mut acc = origin;
        for x in &g[..n] {
            acc += f64::from(*x);
            cs.push(acc);
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut r);
        let k = randn(&mut r, n * d, 1.0);
        let v = randn(&mut r, n * d, 1.0);
        let mut kk = vec![0.0; n * d];
        let mut vv = vec![0.0; n * d];
        let mut cc = vec![0.0; n];
        let mut pp = vec![0u64; n];
        for (slot, &src) in order.iter().enumerate() {
            kk[slot * d..(slot + 1) * d].copy_from_slice(&k[src * d..(src + 1) * d]);
            vv[slot * d..(slot + 1) * d].copy_from_slice(&v[src * d..(src + 1) * d]);
            cc[slot] = cs[src];
            pp[slot] = 1000 + src as u64;
        }
        // Query t sits at position n - nq + t (its own entry is in the cache).
        for t in 0..nq {
            let p = n.saturating_sub(nq) + t;
            case.q_c
                .push(if n == 0 { origin } else { cs[p.min(n - 1)] });
            case.q_pos.push(1000 + p as u64);
        }
        case.k.push(kk);
        case.v.push(vv);
        case.c.push(cc);
        case.pos.push(pp);
    }
    case
}

fn reference(case: &Case, k: &[Vec<f64>], v: &[Vec<f64>], with_pos: bool, scale: f64) -> Vec<f64> {
    let (d, nq) = (case.d, case.nq);
    let mut out = vec![0.0; case.c.len() * nq * d];
    for h in 0..case.c.len() {
        for t in 0..nq {
            let r = h * nq + t;
            let q = &case.q[r * d..(r + 1) * d];
            let mut logits = vec![];
            for j in 0..case.c[h].len() {
                if with_pos && case.pos[h][j] > case.q_pos[r] {
                    continue;
                }
                let dot: f64 = (0..d).map(|x| f64::from(q[x]) * k[h][j * d + x]).sum();
                logits.push((j, scale * dot + case.q_c[r] - case.c[h][j]));
            }
            let m = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = logits.iter().map(|x| (x.1 - m).exp()).sum();
            for &(j, x) in &logits {
                let w = (x - m).exp() / l;
                for e in 0..d {
                    out[r * d + e] += w * v[h][j * d + e];
                }
            }
        }
    }
    out
}

fn run<T: Storage>(
    vk: &foxedge_vulkan::Vulkan,
    case: &Case,
    k: &[Vec<T>],
    v: &[Vec<T>],
    with_pos: bool,
    opts: DecodeOptions<'_>,
) -> (Vec<f32>, foxedge_vulkan::AttentionStats) {
    let heads: Vec<CacheHead<'_, T>> = (0..case.c.len())
        .map(|h| CacheHead {
            k: &k[h],
            v: &v[h],
            c: &case.c[h],
            pos: with_pos.then_some(&case.pos[h][..]),
        })
        .collect();
    let args = DecodeArgs {
        head_dim: case.d,
        n_queries: case.nq,
        q: &case.q,
        q_c: &case.q_c,
        q_pos: with_pos.then_some(&case.q_pos[..]),
        heads: &heads,
    };
    let mut out = vec![f32::NAN; case.c.len() * case.nq * case.d];
    let stats = vk
        .decode(&args, &opts, &mut out, None)
        .expect("vulkan decode");
    (out, stats)
}

fn widen(x: &[Vec<f32>]) -> Vec<Vec<f64>> {
    x.iter().map(|h| to_f64(h)).collect()
}

#[test]
fn decode_f32_unordered_cache_several_queries_and_empty_head() {
    let Some(vk) = device() else { return };
    let case = make(11, 64, 3, &[300, 0, 129, 1000], 2.0, 0.0);
    let opts = DecodeOptions {
        split: 256,
        ..Default::default()
    };
    let refo = reference(&case, &widen(&case.k), &widen(&case.v), true, 0.125);
    // Both reductions: lane teams with shuffles, and the shared-memory variant.
    vk.set_decode_without_subgroups(true);
    let (out_nosg, _) = run(&vk, &case, &case.k, &case.v, true, opts);
    vk.set_decode_without_subgroups(false);
    let (out, stats) = run(&vk, &case, &case.k, &case.v, true, opts);
    // Waiting by polling the fence (a GPU's default; lavapipe blocks) gives the same output.
    let before = vk.set_spin_wait(std::time::Duration::from_millis(5));
    let (out_spin, _) = run(&vk, &case, &case.k, &case.v, true, opts);
    vk.set_spin_wait(before);
    assert_eq!(out_spin, out, "decode with a polled fence");
    for (o, what) in [(&out, "teams"), (&out_nosg, "shared-memory")] {
        let (max, rel) = errors(o, &refo);
        eprintln!("decode f32 ({what}): max {max:.2e} rel {rel:.2e}");
        assert!(max <= 2e-5, "{what}: {max}");
    }
    // The empty head attends nothing: zeros.
    assert!(out[3 * 64..6 * 64].iter().all(|&x| x == 0.0));

    // Same statistics and outputs as the CPU backend.
    let heads: Vec<foxedge_cpu::CacheHead<'_, f32>> = (0..4)
        .map(|h| foxedge_cpu::CacheHead {
            k: &case.k[h],
            v: &case.v[h],
            c: &case.c[h],
            pos: Some(&case.pos[h][..]),
        })
        .collect();
    let cargs = foxedge_cpu::DecodeArgs {
        head_dim: 64,
        n_queries: 3,
        q: &case.q,
        q_c: &case.q_c,
        q_pos: Some(&case.q_pos[..]),
        heads: &heads,
    };
    let copts = foxedge_cpu::DecodeOptions {
        split: 256,
        ..Default::default()
    };
    let mut cout = vec![0.0f32; out.len()];
    let cst = foxedge_cpu::decode(&cargs, &copts, &mut cout, None).expect("cpu decode");
    for (a, b) in stats.heads.iter().zip(&cst.heads) {
        assert_eq!(
            (a.kept_pairs, a.total_pairs, a.kept_blocks, a.total_blocks),
            (b.kept_pairs, b.total_pairs, b.kept_blocks, b.total_blocks)
        );
    }
    let worst = out
        .iter()
        .zip(&cout)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 4e-5, "vs cpu {worst}");
}

#[test]
fn decode_acp_within_bound_and_same_stats_as_cpu() {
    let Some(vk) = device() else { return };
    let case = make(12, 32, 1, &[2000, 777], -2.0, 0.0);
    let u = [5.0f64, 5.0];
    let opts = DecodeOptions {
        acp: Acp::Bound {
            u: &u,
            ln_eps: -10.0,
        },
        block_k: 32,
        split: 512,
        ..Default::default()
    };
    // Entries are shuffled, so whole blocks rarely fall under the threshold: sort each
    // head's cache by position (as a fresh cache is) so that ACP prunes.
    let mut case = case;
    for h in 0..2 {
        let n = case.c[h].len();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&j| case.pos[h][j]);
        let d = case.d;
        let perm = |x: &Vec<f32>| {
            idx.iter()
                .flat_map(|&j| x[j * d..(j + 1) * d].to_vec())
                .collect::<Vec<_>>()
        };
        case.k[h] = perm(&case.k[h]);
        case.v[h] = perm(&case.v[h]);
        case.c[h] = idx.iter().map(|&j| case.c[h][j]).collect();
        case.pos[h] = idx.iter().map(|&j| case.pos[h][j]).collect();
    }
    let (out, stats) = run(&vk, &case, &case.k, &case.v, false, opts);
    let dense = reference(
        &case,
        &widen(&case.k),
        &widen(&case.v),
        false,
        1.0 / 32f64.sqrt(),
    );
    let (max, _) = errors(&out, &dense);
    eprintln!(
        "decode ACP: kept {:.3}, max vs dense {max:.2e}",
        stats.kept_fraction()
    );
    assert!(stats.kept_fraction() < 0.2);
    assert!(max <= 2.0 * 4.54e-5 * 3.4 + 2e-5, "{max}");
    let heads: Vec<foxedge_cpu::CacheHead<'_, f32>> = (0..2)
        .map(|h| foxedge_cpu::CacheHead {
            k: &case.k[h],
            v: &case.v[h],
            c: &case.c[h],
            pos: None,
        })
        .collect();
    let cargs = foxedge_cpu::DecodeArgs {
        head_dim: 32,
        n_queries: 1,
        q: &case.q,
        q_c: &case.q_c,
        q_pos: None,
        heads: &heads,
    };
    let copts = foxedge_cpu::DecodeOptions {
        acp: foxedge_cpu::Acp::Bound {
            u: &u,
            ln_eps: -10.0,
        },
        block_k: 32,
        split: 512,
        ..Default::default()
    };
    let mut cout = vec![0.0f32; out.len()];
    let cst = foxedge_cpu::decode(&cargs, &copts, &mut cout, None).expect("cpu decode");
    for (a, b) in stats.heads.iter().zip(&cst.heads) {
        assert_eq!(
            (
                a.kept_pairs,
                a.total_pairs,
                a.kept_blocks,
                a.total_blocks,
                a.delta
            ),
            (
                b.kept_pairs,
                b.total_pairs,
                b.kept_blocks,
                b.total_blocks,
                b.delta
            )
        );
    }
}

#[test]
fn decode_f16_cache_and_large_c_origin() {
    let Some(vk) = device() else { return };
    let case = make(13, 64, 1, &[500, 500], 1.0, 0.0);
    let h = |x: &Vec<Vec<f32>>| {
        x.iter()
            .map(|r| r.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    let (k16, v16) = (h(&case.k), h(&case.v));
    let (out, _) = run(&vk, &case, &k16, &v16, false, DecodeOptions::default());
    let w = |x: &Vec<Vec<f16>>| {
        x.iter()
            .map(|r| r.iter().map(|y| f64::from(y.to_f32())).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    let refo = reference(&case, &w(&k16), &w(&v16), false, 0.125);
    let (max, _) = errors(&out, &refo);
    eprintln!(
        "decode f16 (device 16-bit: {}): max {max:.2e}",
        vk.info().storage_16bit
    );
    assert!(max <= 2e-5, "{max}");

    // |c| ~ 1e6 (a long stream without re-basing): D survives through the double-float
    // upload, so the result equals the origin-0 one to f32 rounding.
    let far = make(13, 64, 1, &[500, 500], 1.0, -1.0e6);
    let (out_far, _) = run(&vk, &far, &far.k, &far.v, false, DecodeOptions::default());
    let (near, _) = run(
        &vk,
        &case,
        &case.k,
        &case.v,
        false,
        DecodeOptions::default(),
    );
    let worst = out_far
        .iter()
        .zip(&near)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 2e-5, "origin -1e6 changed the output by {worst}");
}

#[test]
fn decode_bad_input_is_an_error() {
    let Some(vk) = device() else { return };
    let case = make(14, 16, 1, &[10], 1.0, 0.0);
    let heads = [CacheHead {
        k: &case.k[0][..],
        v: &case.v[0][..8],
        c: &case.c[0][..],
        pos: None,
    }];
    let args = DecodeArgs {
        head_dim: 16,
        n_queries: 1,
        q: &case.q,
        q_c: &case.q_c,
        q_pos: None,
        heads: &heads,
    };
    let mut out = vec![0.0f32; 16];
    let e = vk.decode(&args, &DecodeOptions::default(), &mut out, None);
    assert!(matches!(e, Err(foxedge_vulkan::Error::Input(_))), "{e:?}");
}
