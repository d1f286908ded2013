//! The decode products with their input transform fused in (`xin.glsl` in `mv.glsl`,
//! `mvq.glsl`, single and MULTI): RMSNorm and the gated activation, against an f64
//! reference, on fresh random inputs in every weight format (f16 / bf16 weights and Q8 / Q4
//! blocks taken at their stored values), with rows long enough for the input to be staged
//! in several tiles (8192 floats: more than 32 KiB of shared memory).
//!
//! Tolerance: |y - ref| <= (2K + 64) 2^-24 (sum_i |w_i x'_i| + |y0|), x' the f64 input
//! after the transform. The product alone stays within (K + 8) 2^-24 of that sum
//! (`weights/tests.rs`); the transformed input adds a relative error per element: RMSNorm's
//! r from an f32 sum of K squares (<= K 2^-24), a division and a square root (a few ulp)
//! and two products, so <= (K / 2 + 16) 2^-24 in all; the activation's exp, division and
//! products (Vulkan: exp within 3 + 2|x| ulp, |x| <= 3 here; division 2.5 ulp) <= 32 ulp.
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.

use super::{Rec, XIn};
use crate::device::Context;
use crate::model::weights::tests::device;
use crate::model::weights::{Mat, Uploader};
use crate::model::{Act, Weights};
use foxedge_core::quant::WeightFormat;
use foxedge_cpu::linear::PackedWeights;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use vulkano::buffer::Subbuffer;

fn words(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn floats(w: &[u32]) -> Vec<f32> {
    w.iter().map(|&v| f32::from_bits(v)).collect()
}

/// The weight formats of the tests.
pub(in crate::model) const FORMATS: [&str; 5] = ["f32", "f16", "bf16", "q8", "q4"];

/// A random `rows x k` matrix in `fmt` on the device (chunked at `limit` words) and its
/// stored values as f32.
pub(in crate::model) fn matrix(
    ctx: &Context,
    fmt: &str,
    (rows, k): (usize, usize),
    limit: usize,
    r: &mut StdRng,
) -> (Mat, Vec<f32>) {
    let w: Vec<f32> = (0..rows * k).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    let mut up = Uploader {
        ctx,
        limit_words: limit,
        bytes: 0,
    };
    match fmt {
        "f32" => (up.mat(&Weights::F32(&w), rows, k).expect("uploads"), w),
        "f16" => {
            let h: Vec<half::f16> = w.iter().map(|&x| half::f16::from_f32(x)).collect();
            let back = h.iter().map(|x| x.to_f32()).collect();
            (up.mat(&Weights::F16(&h), rows, k).expect("uploads"), back)
        }
        "bf16" => {
            let h: Vec<half::bf16> = w.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let back = h.iter().map(|x| x.to_f32()).collect();
            (up.mat(&Weights::Bf16(&h), rows, k).expect("uploads"), back)
        }
        _ => {
            let f = if fmt == "q8" {
                WeightFormat::Q8
            } else {
                WeightFormat::Q4
            };
            let p = PackedWeights::quantize(f, rows, k, 1, |i, out: &mut [f32]| {
                out.copy_from_slice(&w[i * k..(i + 1) * k]);
                Ok::<(), foxedge_core::Error>(())
            })
            .expect("quantizes");
            let mut deq = vec![0.0f32; rows * k];
            for (i, row) in deq.chunks_exact_mut(k).enumerate() {
                p.view().row(i, row).expect("row decodes");
            }
            let wt = if fmt == "q8" {
                Weights::Q8(p.view().tiles())
            } else {
                Weights::Q4(p.view().tiles())
            };
            (up.mat(&wt, rows, k).expect("uploads"), deq)
        }
    }
}

/// The transformed input in f64: RMSNorm (`norm` = (weight, eps)) of `x[..k]`, or the gated
/// activation of `x[..2k]`.
fn transformed(x: &[f32], k: usize, norm: Option<(&[f32], f64)>, act: Option<Act>) -> Vec<f64> {
    let f = |i: usize| f64::from(x[i]);
    if let Some((w, eps)) = norm {
        let ms = (0..k).map(|i| f(i) * f(i)).sum::<f64>() / k as f64;
        let r = 1.0 / (ms + eps).sqrt();
        return (0..k).map(|i| f(i) * r * f64::from(w[i])).collect();
    }
    let sig = |g: f64| 1.0 / (1.0 + (-g).exp());
    (0..k)
        .map(|i| {
            let g = f(i);
            let a = match act {
                Some(Act::Silu) => g * sig(g),
                Some(Act::Sigmoid) => sig(g),
                None => g,
            };
            a * f(k + i)
        })
        .collect()
}

/// Checks outputs `y_off .. y_off + rows` of `got` against `y0 (+) W x'`.
fn check(
    got: &[f32],
    y0: &[f32],
    w: &[f32],
    xt: &[f64],
    (rows, y_off): (usize, usize),
    acc: bool,
    what: &str,
) {
    let k = xt.len();
    for r in 0..rows {
        let (mut s, mut mag) = (0.0f64, 0.0f64);
        for i in 0..k {
            let p = f64::from(w[r * k + i]) * xt[i];
            s += p;
            mag += p.abs();
        }
        let base = if acc { f64::from(y0[y_off + r]) } else { 0.0 };
        let want = base + s;
        let tol = (2 * k + 64) as f64 * f64::powi(2.0, -24) * (mag + base.abs()) + 1e-30;
        let g = f64::from(got[y_off + r]);
        assert!(
            (g - want).abs() <= tol,
            "{what}: row {r}: {g} vs {want} (tol {tol:e})"
        );
    }
}

/// Checks that the outputs outside `rows` (index ranges) kept `y0`.
fn untouched(got: &[f32], y0: &[f32], rows: &[(usize, usize)], what: &str) {
    for (c, (&g, &y)) in got.iter().zip(y0).enumerate() {
        if !rows.iter().any(|&(a, n)| c >= a && c < a + n) {
            assert_eq!(
                g.to_bits(),
                y.to_bits(),
                "{what}: output {c} outside the rows"
            );
        }
    }
}

fn run(ctx: &Arc<Context>, f: impl FnOnce(&mut Rec<'_>)) {
    let mut rec = Rec::new(ctx).expect("recorder");
    f(&mut rec);
    ctx.submit(rec.b).expect("runs");
}

fn download(ctx: &Context, b: &Subbuffer<[u32]>) -> Vec<f32> {
    floats(&ctx.download(&[b]).expect("download")[0])
}

#[test]
fn fused_norm_and_activation_products_match_f64() {
    let Some(ctx) = device("fused_norm_and_activation_products") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(42);
    for fmt in FORMATS {
        for (rows, k) in [(16, 32), (37, 96), (70, 768), (21, 1536), (9, 8192)] {
            // A small binding limit splits the matrix into several chunks.
            let limit = if rows > 30 { 16 * k } else { 1 << 24 };
            let (m, w) = matrix(&ctx, fmt, (rows, k), limit, &mut r);
            for (case, acc) in [(0, false), (1, true), (2, false), (3, true)] {
                let (norm, act) = match case {
                    0 | 1 => (true, None),
                    2 => (false, Some(Act::Silu)),
                    _ => (false, Some(Act::Sigmoid)),
                };
                let x_off = if norm { 8 * (case + 1) } else { 0 };
                let xlen = x_off + if norm { k } else { 2 * k };
                let scale = if norm { 4.0 } else { 3.0 };
                let x: Vec<f32> = (0..xlen).map(|_| r.gen_range(-scale..scale)).collect();
                let nw: Vec<f32> = (0..k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let eps = 1e-5;
                let y_off = 3;
                let y0: Vec<f32> = (0..rows + 7).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                let bufs = ctx
                    .upload(&[&words(&x), &words(&nw), &words(&y0)])
                    .expect("upload");
                let xin = match act {
                    None => XIn::Norm(&bufs[1], eps),
                    Some(a) => XIn::Glu(a),
                };
                run(&ctx, |rec| {
                    rec.matvec(&m, xin, &bufs[0], x_off, &bufs[2], y_off, acc)
                        .expect("records")
                });
                let got = download(&ctx, &bufs[2]);
                let xt = transformed(&x[x_off..], k, norm.then_some((&nw[..], eps)), act);
                let what = format!("{fmt} {rows}x{k} case {case} acc {acc}");
                check(&got, &y0, &w, &xt, (rows, y_off), acc, &what);
                untouched(&got, &y0, &[(y_off, rows)], &what);
            }
        }
    }
}

/// Several matrices of one normed input in one dispatch (decode's projections): `mv.glsl`
/// with MULTI for the float formats, `mvq.glsl` with MULTI for Q8 / Q4.
#[test]
fn fused_norm_projections_match_f64() {
    let Some(ctx) = device("fused_norm_projections") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(43);
    let k = 256;
    let shapes = [(48, 0), (5, 60), (16, 70), (33, 90)];
    // One binding per matrix, or chunks of a few rows (Q8 / Q4: of 16): more chunks than
    // one dispatch binds.
    for (fmt, limit) in FORMATS.iter().flat_map(|f| [(*f, 1 << 24), (*f, 1500)]) {
        let mats: Vec<(Mat, Vec<f32>, usize, usize)> = shapes
            .iter()
            .map(|&(rows, off)| {
                let (m, w) = matrix(&ctx, fmt, (rows, k), limit, &mut r);
                (m, w, rows, off)
            })
            .collect();
        let x: Vec<f32> = (0..k).map(|_| r.gen_range(-4.0f32..4.0)).collect();
        let nw: Vec<f32> = (0..k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
        let y0: Vec<f32> = (0..130).map(|_| r.gen_range(-1.0f32..1.0)).collect();
        let bufs = ctx
            .upload(&[&words(&x), &words(&nw), &words(&y0)])
            .expect("upload");
        let pairs: Vec<(Mat, usize)> = mats.iter().map(|(m, _, _, o)| (m.clone(), *o)).collect();
        run(&ctx, |rec| {
            rec.matvec_many(&pairs, XIn::Norm(&bufs[1], 1e-6), &bufs[0], &bufs[2])
                .expect("records")
        });
        let got = download(&ctx, &bufs[2]);
        let xt = transformed(&x, k, Some((&nw, 1e-6)), None);
        for (i, (_, w, rows, off)) in mats.iter().enumerate() {
            let what = format!("{fmt} limit {limit} projection {i}");
            check(&got, &y0, w, &xt, (*rows, *off), false, &what);
        }
        let spans: Vec<(usize, usize)> = shapes.iter().map(|&(n, o)| (o, n)).collect();
        untouched(&got, &y0, &spans, fmt);
    }
}

/// The attention output's norm and gate fused into o_proj (`XIn::Post`, `xin.glsl` XIN 4)
/// against the f64 `attn_post` (GroupRMSNorm per head, then `act(g)`), every format, every
/// norm / gate combination, heads of 64 and of 32.
#[test]
fn fused_attention_output_products_match_f64() {
    let Some(ctx) = device("fused_attention_output_products") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(44);
    for fmt in FORMATS {
        for (rows, k, hd) in [(40, 256, 64), (19, 96, 32)] {
            let nh = k / hd;
            let (m, w) = matrix(&ctx, fmt, (rows, k), 1 << 24, &mut r);
            for (norm, gate) in [
                (true, Some(Act::Sigmoid)),
                (true, Some(Act::Silu)),
                (true, None),
                (false, Some(Act::Sigmoid)),
                (false, None),
            ] {
                let o: Vec<f32> = (0..k).map(|_| r.gen_range(-3.0f32..3.0)).collect();
                let p: Vec<f32> = (0..4 * k + 3 * nh)
                    .map(|_| r.gen_range(-3.0f32..3.0))
                    .collect();
                let nw: Vec<f32> = (0..k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let eps = 1e-5;
                let y0: Vec<f32> = (0..rows).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                let bufs = ctx
                    .upload(&[&words(&o), &words(&nw), &words(&y0), &words(&p)])
                    .expect("upload");
                let xin = XIn::Post {
                    norm: norm.then_some((&bufs[1], eps)),
                    gate,
                    p: &bufs[3],
                    head_dim: hd,
                };
                run(&ctx, |rec| {
                    assert!(rec.stages_whole(&m, hd));
                    rec.matvec(&m, xin, &bufs[0], 0, &bufs[2], 0, true)
                        .expect("records")
                });
                let got = download(&ctx, &bufs[2]);
                let sig = |g: f64| 1.0 / (1.0 + (-g).exp());
                let xt: Vec<f64> = (0..k)
                    .map(|i| {
                        let h = i / hd;
                        let mut v = f64::from(o[i]);
                        if norm {
                            let ss: f64 = (h * hd..(h + 1) * hd)
                                .map(|j| f64::from(o[j]) * f64::from(o[j]))
                                .sum();
                            v *= f64::from(nw[i]) / (ss / hd as f64 + eps).sqrt();
                        }
                        let g = f64::from(p[3 * k + 3 * nh + i]);
                        match gate {
                            Some(Act::Sigmoid) => v * sig(g),
                            Some(Act::Silu) => v * g * sig(g),
                            None => v,
                        }
                    })
                    .collect();
                let what = format!("{fmt} {rows}x{k} hd {hd} norm {norm} gate {gate:?}");
                check(&got, &y0, &w, &xt, (rows, 0), true, &what);
            }
        }
    }
}
