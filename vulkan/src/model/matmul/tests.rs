//! The n-row products (`mm.glsl`, `mmq.glsl`, `mmt.glsl` at every tile) on the device
//! against an f64 product of the stored weights (f16 / bf16 widened, Q8 / Q4 dequantized:
//! `w = d q`, exact in f32), in every weight format, on fresh random inputs: ragged token
//! counts, row counts and row lengths (K a multiple of 8 but not of the 16-deep k slice),
//! matrices in one binding and in chunks, adding into Y and not.
//!
//! Tolerance: |y - ref| <= (K + 8) 2^-24 (sum_k |w_k x_k| + |y0|): each output is one f32
//! sum of K products in the order of k (each product, or fused product and sum, rounded
//! once), so by the bound of recursive summation its error is at most K units of 2^-24 of
//! the sum of magnitudes, and adding y0 one more.
//!
//! The cooperative-matrix kernel (`mmc.glsl`, where the device has KHR cooperative
//! matrices; skipped, saying so, elsewhere) rounds x and w to f16 first: each product is
//! off by at most (2^-11 + 2^-11 + 2^-22) of its magnitude for factors in f16's normal
//! range, by at most 2^-25 |other factor| + 2^-50 for smaller ones (|x| <= 2, |w| <= 1
//! here), and the tensor units' f32 accumulation (not always rounded to nearest) by at
//! most 2 (K + 8) 2^-24 of the magnitudes: |y - ref| <= (2^-10 + 2^-22 + 2 (K + 8) 2^-24)
//! (sum |w x| + |y0|) + 3 K 2^-25.
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.

use super::{MmKernel, coop_available};
use crate::model::ops::Rec;
use crate::model::ops::tests::{FORMATS, matrix};
use crate::model::weights::tests::device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn words(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn floats(w: &[u32]) -> Vec<f32> {
    w.iter().map(|&v| f32::from_bits(v)).collect()
}

/// Checks `got` (`n` rows of `ldy`, outputs at `y_off`) against `y0 (+) X W^T` in f64
/// (within the f32 bound, or the f16 one with `half`), and that the other columns kept `y0`.
#[allow(clippy::too_many_arguments)]
fn check(
    got: &[f32],
    y0: &[f32],
    w: &[f32],
    x: &[f32],
    (n, rows, k): (usize, usize, usize),
    (y_off, ldy): (usize, usize),
    acc: bool,
    half: bool,
    what: &str,
) {
    let u = f64::powi(2.0, -24);
    for t in 0..n {
        for r in 0..rows {
            let (mut s, mut mag) = (0.0f64, 0.0f64);
            for i in 0..k {
                let p = f64::from(w[r * k + i]) * f64::from(x[t * k + i]);
                s += p;
                mag += p.abs();
            }
            let o = t * ldy + y_off + r;
            let base = if acc { f64::from(y0[o]) } else { 0.0 };
            let want = base + s;
            let tol = if half {
                let rel = f64::powi(2.0, -10) + f64::powi(2.0, -22) + 2.0 * (k + 8) as f64 * u;
                rel * (mag + base.abs()) + 3.0 * k as f64 * f64::powi(2.0, -25)
            } else {
                (k + 8) as f64 * u * (mag + base.abs()) + 1e-30
            };
            let g = f64::from(got[o]);
            assert!(
                (g - want).abs() <= tol,
                "{what}: token {t} row {r}: {g} vs {want} (tol {tol:e})"
            );
        }
        for c in (0..ldy).filter(|&c| c < y_off || c >= y_off + rows) {
            assert_eq!(
                got[t * ldy + c].to_bits(),
                y0[t * ldy + c].to_bits(),
                "{what}: column {c} outside the rows"
            );
        }
    }
}

const SIMT: [MmKernel; 3] = [
    MmKernel::Simt { tm: 8, tn: 8 },
    MmKernel::Simt { tm: 8, tn: 4 },
    MmKernel::Simt { tm: 4, tn: 4 },
];

#[test]
fn the_64x64_kernel_matches_the_f64_product_in_every_format() {
    matches_the_f64_product("matmul_tile64", &[MmKernel::Tile64], 11);
}

#[test]
fn the_register_tiled_kernel_matches_the_f64_product_in_every_format() {
    matches_the_f64_product("matmul_simt", &SIMT, 13);
}

/// `kernels` against the f64 product in every format, shape and token count.
fn matches_the_f64_product(name: &str, kernels: &[MmKernel], seed: u64) {
    let Some(ctx) = device(name) else {
        return;
    };
    let mut r = StdRng::seed_from_u64(seed);
    for fmt in FORMATS {
        let block = fmt.starts_with('q');
        // (rows, K): K ragged against the 16-deep slice where the format allows it.
        let shapes: [(usize, usize); 3] = if block {
            [(37, 96), (130, 64), (16, 288)]
        } else {
            [(37, 72), (130, 40), (16, 264)]
        };
        for (si, (rows, k)) in shapes.into_iter().enumerate() {
            // One binding, or chunks of about 48 rows (whole groups of 16 for Q8 / Q4).
            let row_words = match fmt {
                "f32" => k,
                "f16" | "bf16" => k / 2,
                "q8" => k.div_ceil(64) * 272 / 16,
                _ => k.div_ceil(64) * 144 / 16,
            };
            let limit = if si == 1 { 48 * row_words } else { 1 << 24 };
            let (m, w) = matrix(&ctx, fmt, (rows, k), limit, &mut r);
            if si == 1 {
                assert!(m.chunks.len() > 1, "{fmt}: chunked");
            }
            // ACC a specialization constant: one value per shape (each a pipeline per kernel).
            let acc = si == 1;
            for n in [2, 17, 70, 129] {
                let x: Vec<f32> = (0..n * k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let (y_off, ldy) = (3, rows + 5);
                let y0: Vec<f32> = (0..n * ldy).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                for &kernel in kernels {
                    let bufs = ctx.upload(&[&words(&x), &words(&y0)]).expect("upload");
                    let mut rec = Rec::new(&ctx).expect("recorder");
                    rec.matmul_with(kernel, &m, n, &bufs[0], &bufs[1], y_off, ldy, acc)
                        .expect("records");
                    ctx.submit(rec.b).expect("runs");
                    let got = floats(&ctx.download(&[&bufs[1]]).expect("download")[0]);
                    let what = format!("{kernel:?} {fmt} {n} x {rows}x{k} acc {acc}");
                    check(
                        &got,
                        &y0,
                        &w,
                        &x,
                        (n, rows, k),
                        (y_off, ldy),
                        acc,
                        false,
                        &what,
                    );
                }
            }
        }
    }
}

#[test]
fn the_cooperative_matrix_kernel_matches_the_f64_product_within_f16_rounding() {
    let Some(ctx) = device("matmul_coopmat") else {
        return;
    };
    if !coop_available(&ctx) {
        eprintln!(
            "SKIPPED matmul_coopmat: {} lists no KHR cooperative-matrix f16 x f16 -> f32 \
             16x16x16 subgroup product",
            ctx.info.name
        );
        return;
    }
    let mut r = StdRng::seed_from_u64(12);
    for fmt in FORMATS {
        let block = fmt.starts_with('q');
        let shapes: [(usize, usize); 3] = if block {
            [(37, 96), (300, 256), (16, 1792)]
        } else {
            [(37, 72), (300, 264), (16, 1544)]
        };
        for (si, (rows, k)) in shapes.into_iter().enumerate() {
            let (m, w) = matrix(&ctx, fmt, (rows, k), 1 << 24, &mut r);
            let acc = si == 1;
            for n in [2, 17, 70, 129, 300] {
                let x: Vec<f32> = (0..n * k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let (y_off, ldy) = (3, rows + 5);
                let y0: Vec<f32> = (0..n * ldy).map(|_| r.gen_range(-1.0f32..1.0)).collect();
                for fnn in [2, 4] {
                    let kernel = MmKernel::Coop { fnn };
                    let bufs = ctx.upload(&[&words(&x), &words(&y0)]).expect("upload");
                    let mut rec = Rec::new(&ctx).expect("recorder");
                    rec.matmul_with(kernel, &m, n, &bufs[0], &bufs[1], y_off, ldy, acc)
                        .expect("records");
                    ctx.submit(rec.b).expect("runs");
                    let got = floats(&ctx.download(&[&bufs[1]]).expect("download")[0]);
                    let what = format!("{kernel:?} {fmt} {n} x {rows}x{k} acc {acc}");
                    check(
                        &got,
                        &y0,
                        &w,
                        &x,
                        (n, rows, k),
                        (y_off, ldy),
                        acc,
                        true,
                        &what,
                    );
                }
            }
        }
    }
}

/// The KHR kernels run on no CI device (lavapipe has no cooperative matrices): vulkano must
/// at least parse them, and they must declare KHR matrices only (check.sh runs spirv-val).
#[test]
fn the_cooperative_matrix_kernels_are_khr_spirv() {
    use vulkano::shader::spirv::{Capability, Instruction, Spirv};
    for (name, spv) in super::COOP {
        let words: Vec<u32> = spv
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let spirv = Spirv::new(&words).unwrap_or_else(|e| panic!("{name}: {e}"));
        let caps: Vec<Capability> = spirv
            .capabilities()
            .iter()
            .filter_map(|i| match i {
                Instruction::Capability { capability } => Some(*capability),
                _ => None,
            })
            .collect();
        assert!(caps.contains(&Capability::CooperativeMatrixKHR), "{name}");
        assert!(!caps.contains(&Capability::CooperativeMatrixNV), "{name}");
    }
}

#[test]
fn the_choice_keeps_few_rows_on_the_small_tile_and_fills_the_device() {
    let Some(ctx) = device("matmul_choice") else {
        return;
    };
    if std::env::var_os(super::MM_ENV).is_some() {
        eprintln!(
            "matmul_choice: {} is set, the choice is forced",
            super::MM_ENV
        );
        return;
    }
    assert_eq!(MmKernel::choose(&ctx, 2, 4096), MmKernel::Tile64);
    assert_eq!(MmKernel::choose(&ctx, 16, 4096), MmKernel::Tile64);
    if coop_available(&ctx) && !super::coop_off() {
        assert_eq!(
            MmKernel::choose(&ctx, 1024, 10752),
            MmKernel::Coop { fnn: 4 }
        );
        assert_eq!(MmKernel::choose(&ctx, 40, 64), MmKernel::Coop { fnn: 2 });
        return;
    }
    // 760M at a 1024-token chunk: the MLP's 10752 rows take the largest tile, the 1536-row
    // projections a narrower one, so each product still has a wave of workgroups.
    assert_eq!(
        MmKernel::choose(&ctx, 1024, 10752),
        MmKernel::Simt { tm: 8, tn: 8 }
    );
    let k = MmKernel::choose(&ctx, 1024, 1536);
    assert!(k.groups(1024, 1536) >= super::WAVE, "{k:?}");
    // Too small for a wave at any tile: the smallest.
    assert_eq!(
        MmKernel::choose(&ctx, 40, 64),
        MmKernel::Simt { tm: 4, tn: 4 }
    );
}
