//! The Q8 / Q4 kernels (`mvq.glsl`, `mmq.glsl`, `embed.comp`) on the device against an f64
//! product of the dequantized matrix (`foxedge_cpu::linear::PackedView::row`, `w = d q`
//! exact in f32), on random matrices quantized and packed by foxedge-cpu, uploaded in
//! chunks of whole row groups (a small binding limit forces several).
//!
//! Tolerance: |y - ref| <= (K + 8) 2^-24 (sum_i |w_i x_i| + |y0|). Each output is a sum of
//! K products computed in f32 (each product rounded once, the partial sums at most K + 8
//! additions deep: per block, the block scale, the lanes' tree), so by the standard bound
//! for recursive summation its error is at most that many units of 2^-24 of the sum of
//! magnitudes (y0: the value added into with `acc`). The gather is exact.
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.

use super::{Mat, Uploader};
use crate::device::{Context, DeviceSelection};
use crate::model::Weights;
use crate::model::ops::{Rec, XIn};
use foxedge_core::quant::WeightFormat;
use foxedge_cpu::linear::PackedWeights;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// The test device, or `None` (skipped, said why) without one; with `CI` set a missing
/// device fails the test.
pub(in crate::model) fn device(test: &str) -> Option<Arc<Context>> {
    match Context::new(&DeviceSelection::FromEnv) {
        Ok(c) => Some(Arc::new(c)),
        Err(e) => {
            let ci = std::env::var("CI").is_ok_and(|v| {
                !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false")
            });
            assert!(
                !ci,
                "{test}: CI is set, so a Vulkan device is required: {e}"
            );
            eprintln!("SKIPPED {test}: no Vulkan device ({e}); with CI set this fails");
            None
        }
    }
}

/// A random `rows x k` matrix in `f`, packed, and its dequantized rows.
fn packed(f: WeightFormat, rows: usize, k: usize, r: &mut StdRng) -> (PackedWeights, Vec<f32>) {
    let w: Vec<f32> = (0..rows * k).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    let p = PackedWeights::quantize(f, rows, k, 1, |i, out: &mut [f32]| {
        out.copy_from_slice(&w[i * k..(i + 1) * k]);
        Ok::<(), foxedge_core::Error>(())
    })
    .expect("quantizes");
    let mut deq = vec![0.0f32; rows * k];
    for (i, row) in deq.chunks_exact_mut(k).enumerate() {
        p.view().row(i, row).expect("row decodes");
    }
    (p, deq)
}

fn weights<'a>(f: WeightFormat, p: &'a PackedWeights) -> Weights<'a> {
    match f {
        WeightFormat::Q8 => Weights::Q8(p.view().tiles()),
        _ => Weights::Q4(p.view().tiles()),
    }
}

/// `w` on the device, chunked at `limit_words` per binding.
fn upload(ctx: &Context, w: &Weights<'_>, rows: usize, k: usize, limit_words: usize) -> Mat {
    super::check(w, "test matrix", rows, k).expect("shape");
    let mut up = Uploader {
        ctx,
        limit_words,
        bytes: 0,
    };
    let m = up.mat(w, rows, k).expect("uploads");
    assert_eq!(up.bytes, w.bytes());
    m
}

fn words(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn floats(w: &[u32]) -> Vec<f32> {
    w.iter().map(|&v| f32::from_bits(v)).collect()
}

/// Checks `got` (`n` rows of `ldy`, outputs at `y_off`) against the f64 product.
#[allow(clippy::too_many_arguments)]
fn check_product(
    got: &[f32],
    y0: &[f32],
    deq: &[f32],
    x: &[f32],
    (n, rows, k): (usize, usize, usize),
    (y_off, ldy): (usize, usize),
    acc: bool,
    what: &str,
) {
    for t in 0..n {
        for r in 0..rows {
            let (mut s, mut mag) = (0.0f64, 0.0f64);
            for i in 0..k {
                let p = f64::from(deq[r * k + i]) * f64::from(x[t * k + i]);
                s += p;
                mag += p.abs();
            }
            let o = t * ldy + y_off + r;
            let base = if acc { f64::from(y0[o]) } else { 0.0 };
            let want = base + s;
            let tol = (k + 8) as f64 * f64::powi(2.0, -24) * (mag + base.abs()) + 1e-30;
            let g = f64::from(got[o]);
            assert!(
                (g - want).abs() <= tol,
                "{what}: token {t} row {r}: {g} vs {want} (tol {tol:e})"
            );
        }
    }
    // Outputs outside the written columns keep their values.
    for t in 0..n {
        for c in (0..ldy).filter(|&c| c < y_off || c >= y_off + rows) {
            assert_eq!(
                got[t * ldy + c].to_bits(),
                y0[t * ldy + c].to_bits(),
                "{what}"
            );
        }
    }
}

const SHAPES: [(usize, usize); 6] = [
    (16, 32),
    (37, 96),
    (300, 256),
    (70, 1792),
    (5, 64),
    (33, 4096),
];

#[test]
fn block_matvec_matches_the_f64_product_of_the_dequantized_matrix() {
    let Some(ctx) = device("block_matvec") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(42);
    for f in [WeightFormat::Q8, WeightFormat::Q4] {
        for (rows, k) in SHAPES {
            let (p, deq) = packed(f, rows, k, &mut r);
            let w = weights(f, &p);
            // One binding, and chunks of two groups.
            let group_words = k.div_ceil(64) * (if f == WeightFormat::Q8 { 272 } else { 144 });
            for limit in [1 << 24, 2 * group_words] {
                let m = upload(&ctx, &w, rows, k, limit);
                for acc in [false, true] {
                    let (x_off, y_off) = (8, 3);
                    let mut xs = vec![0.0f32; x_off + k];
                    for v in &mut xs {
                        *v = r.gen_range(-2.0f32..2.0);
                    }
                    let ldy = rows + 5;
                    let y0: Vec<f32> = (0..ldy).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                    let bufs = ctx.upload(&[&words(&xs), &words(&y0)]).expect("upload");
                    let mut rec = Rec::new(&ctx).expect("recorder");
                    rec.matvec(&m, XIn::Plain, &bufs[0], x_off, &bufs[1], y_off, acc)
                        .expect("records");
                    ctx.submit(rec.b).expect("runs");
                    let got = floats(&ctx.download(&[&bufs[1]]).expect("download")[0]);
                    let what = format!("{f} matvec {rows}x{k} limit {limit} acc {acc}");
                    check_product(
                        &got,
                        &y0,
                        &deq,
                        &xs[x_off..],
                        (1, rows, k),
                        (y_off, ldy),
                        acc,
                        &what,
                    );
                }
            }
        }
    }
}

#[test]
fn block_matmul_matches_the_f64_product_of_the_dequantized_matrix() {
    let Some(ctx) = device("block_matmul") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(43);
    for f in [WeightFormat::Q8, WeightFormat::Q4] {
        for (i, (rows, k)) in SHAPES.into_iter().enumerate() {
            let (p, deq) = packed(f, rows, k, &mut r);
            let w = weights(f, &p);
            let group_words = k.div_ceil(64) * (if f == WeightFormat::Q8 { 272 } else { 144 });
            let limit = if i % 2 == 0 { 1 << 24 } else { 4 * group_words };
            let m = upload(&ctx, &w, rows, k, limit);
            for (n, acc) in [(2, false), (70, true), (129, false)] {
                let xs: Vec<f32> = (0..n * k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let (y_off, ldy) = (2, rows + 3);
                let y0: Vec<f32> = (0..n * ldy).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                let bufs = ctx.upload(&[&words(&xs), &words(&y0)]).expect("upload");
                let mut rec = Rec::new(&ctx).expect("recorder");
                rec.matmul(&m, n, &bufs[0], &bufs[1], y_off, ldy, acc)
                    .expect("records");
                ctx.submit(rec.b).expect("runs");
                let got = floats(&ctx.download(&[&bufs[1]]).expect("download")[0]);
                let what = format!("{f} matmul {n} x {rows}x{k} limit {limit} acc {acc}");
                check_product(&got, &y0, &deq, &xs, (n, rows, k), (y_off, ldy), acc, &what);
            }
        }
    }
}

#[test]
fn block_embedding_gather_is_exact() {
    let Some(ctx) = device("block_embed") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(44);
    for f in [WeightFormat::Q8, WeightFormat::Q4] {
        let (rows, d) = (70, 96);
        let (p, deq) = packed(f, rows, d, &mut r);
        let w = weights(f, &p);
        let group_words = d.div_ceil(64) * (if f == WeightFormat::Q8 { 272 } else { 144 });
        let m = upload(&ctx, &w, rows, d, 2 * group_words);
        assert!(m.chunks.len() > 1);
        let ids: Vec<u32> = vec![0, 69, 31, 32, 15, 16, 48, 5];
        let bufs = ctx
            .upload(&[&ids, &vec![0u32; ids.len() * d]])
            .expect("upload");
        let mut rec = Rec::new(&ctx).expect("recorder");
        rec.embed(&m, &bufs[0], ids.len(), &bufs[1])
            .expect("records");
        ctx.submit(rec.b).expect("runs");
        let got = floats(&ctx.download(&[&bufs[1]]).expect("download")[0]);
        for (t, &id) in ids.iter().enumerate() {
            let want = &deq[id as usize * d..][..d];
            assert_eq!(&got[t * d..(t + 1) * d], want, "{f} row {id}");
        }
    }
}

#[test]
fn block_matrices_of_the_wrong_size_or_width_are_refused() {
    let mut r = StdRng::seed_from_u64(45);
    let (p, _) = packed(WeightFormat::Q8, 20, 64, &mut r);
    let w = weights(WeightFormat::Q8, &p);
    assert!(super::check(&w, "m", 20, 64).is_ok());
    assert!(matches!(
        super::check(&w, "m", 40, 64),
        Err(crate::Error::Input(foxedge_core::Error::BadLength { .. }))
    ));
    let (p, _) = packed(WeightFormat::Q4, 16, 48, &mut r);
    assert!(matches!(
        super::check(&weights(WeightFormat::Q4, &p), "m", 16, 48),
        Err(crate::Error::Unsupported(_))
    ));
}
