//! Dense layer math of the FoX block: linear layers (`gemm` for many rows, a SIMD
//! matrix-vector kernel for one row), RMSNorm, per-head RMSNorm, activations.
//!
//! All in f32 with f32 accumulation, as the reference's fp32 path (spec §3, §4).

use rayon::prelude::*;
use wide::f32x8;

/// Below this many multiply-adds a product stays on one thread. A single-row product is
/// bound by reading the weights (4 bytes per FMA): 2^17 FMAs = 512 KiB ≈ 20 µs at DRAM speed,
/// well above rayon's few-microsecond fork cost.
const PAR_MATVEC_FMAS: usize = 1 << 17;

/// `y[t, o] (+)= Σ_i x[t, i] · w[o, i]` for `t < rows`: `y = x·wᵀ` with `w` `[out, inp]`
/// row-major (PyTorch's linear convention). `accumulate` adds into `y` instead of
/// overwriting it. One row uses [`matvec`]; more rows use `gemm`.
///
/// Panics (a caller bug, never user input) when a slice is shorter than its shape.
pub fn linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out: usize,
    inp: usize,
    y: &mut [f32],
    accumulate: bool,
) {
    assert!(x.len() >= rows * inp && w.len() >= out * inp && y.len() >= rows * out);
    if rows == 0 || out == 0 {
        return;
    }
    if rows == 1 {
        matvec(&x[..inp], w, out, &mut y[..out], accumulate);
        return;
    }
    let flops = rows * out * inp;
    let par = if flops >= PAR_MATVEC_FMAS {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the assert above keeps every index gemm forms in bounds: dst is `rows × out`
    // with row stride `out`; lhs is `rows × inp` with row stride `inp`; rhs[k][n] = w[n·inp + k]
    // for k < inp, n < out. dst does not alias lhs or rhs (distinct borrows).
    unsafe {
        gemm::gemm(
            rows,
            out,
            inp,
            y.as_mut_ptr(),
            1,
            out as isize,
            accumulate,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            inp as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// `y[o] (+)= Σ_i w[o, i] · x[i]`: SIMD over i, four rows per pass so each load of `x`
/// feeds four independent accumulators; rows split across threads when large.
pub fn matvec(x: &[f32], w: &[f32], out: usize, y: &mut [f32], accumulate: bool) {
    let inp = x.len();
    assert!(w.len() >= out * inp && y.len() >= out);
    let y = &mut y[..out];
    if out * inp >= PAR_MATVEC_FMAS {
        // One contiguous block of rows per thread (a multiple of the 4-row micro-tile):
        // fewer, larger tasks than fixed small chunks, so less hand-off overhead.
        let threads = rayon::current_num_threads().max(1);
        let rows_per = out.div_ceil(threads).next_multiple_of(4).max(4);
        y.par_chunks_mut(rows_per).enumerate().for_each(|(c, yc)| {
            let r0 = c * rows_per;
            matvec_rows(x, &w[r0 * inp..(r0 + yc.len()) * inp], yc, accumulate);
        });
    } else {
        matvec_rows(x, &w[..out * inp], y, accumulate);
    }
}

/// [`matvec_rows_portable`] or, on x86-64 CPUs that have them, the same loop compiled for
/// AVX-512F or AVX2 + FMA (chosen at run time; `wide` alone only uses what the build
/// targets, SSE2 by default).
fn matvec_rows(x: &[f32], w: &[f32], y: &mut [f32], accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked on the line above.
            unsafe { matvec_rows_avx512(x, w, y, accumulate) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked on the line above.
            unsafe { matvec_rows_avx2(x, w, y, accumulate) };
            return;
        }
    }
    matvec_rows_portable(x, w, y, accumulate);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn matvec_rows_avx512(x: &[f32], w: &[f32], y: &mut [f32], accumulate: bool) {
    matvec_rows_lanes(x, w, y, accumulate);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn matvec_rows_avx2(x: &[f32], w: &[f32], y: &mut [f32], accumulate: bool) {
    matvec_rows_lanes(x, w, y, accumulate);
}

/// Lanes of the auto-vectorized micro-kernel: 16 f32 = one AVX-512 or two AVX2 registers.
const LANES: usize = 16;

/// `y[r] (+)= w[r]·x` for each row, four rows per pass, `LANES` independent partial sums per
/// row written as plain arrays so that the compiler vectorizes them for the enclosing
/// `target_feature`. Same summation order as no other path: tests compare with the scalar
/// reference within f32 rounding.
#[inline(always)]
fn matvec_rows_lanes(x: &[f32], w: &[f32], y: &mut [f32], accumulate: bool) {
    let inp = x.len();
    let body = inp - inp % LANES;
    let mut r = 0;
    while r + 4 <= y.len() {
        let w0 = &w[r * inp..(r + 1) * inp];
        let w1 = &w[(r + 1) * inp..(r + 2) * inp];
        let w2 = &w[(r + 2) * inp..(r + 3) * inp];
        let w3 = &w[(r + 3) * inp..(r + 4) * inp];
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
        let tiles = x[..body]
            .chunks_exact(LANES)
            .zip(w0.chunks_exact(LANES))
            .zip(w1.chunks_exact(LANES))
            .zip(w2.chunks_exact(LANES))
            .zip(w3.chunks_exact(LANES));
        for ((((xs, r0), r1), r2), r3) in tiles {
            for l in 0..LANES {
                a0[l] = r0[l].mul_add(xs[l], a0[l]);
                a1[l] = r1[l].mul_add(xs[l], a1[l]);
                a2[l] = r2[l].mul_add(xs[l], a2[l]);
                a3[l] = r3[l].mul_add(xs[l], a3[l]);
            }
        }
        for (k, (a, row)) in [(a0, w0), (a1, w1), (a2, w2), (a3, w3)].iter().enumerate() {
            let mut s: f32 = a.iter().sum();
            for j in body..inp {
                s += row[j] * x[j];
            }
            y[r + k] = if accumulate { y[r + k] + s } else { s };
        }
        r += 4;
    }
    while r < y.len() {
        let row = &w[r * inp..(r + 1) * inp];
        let s: f32 = row.iter().zip(x).map(|(a, b)| a * b).sum();
        y[r] = if accumulate { y[r] + s } else { s };
        r += 1;
    }
}

/// The portable micro-kernel of [`matvec`] (`wide`: NEON on aarch64, SSE2 or better as
/// compiled on x86-64) over `y.len()` consecutive rows of `w`.
fn matvec_rows_portable(x: &[f32], w: &[f32], y: &mut [f32], accumulate: bool) {
    let inp = x.len();
    let body = inp - inp % 8;
    let mut r = 0;
    while r + 4 <= y.len() {
        let rows = [
            &w[r * inp..(r + 1) * inp],
            &w[(r + 1) * inp..(r + 2) * inp],
            &w[(r + 2) * inp..(r + 3) * inp],
            &w[(r + 3) * inp..(r + 4) * inp],
        ];
        let mut acc = [f32x8::ZERO; 4];
        let mut i = 0;
        while i < body {
            let xv = f32x8::from(load8(&x[i..]));
            for (a, row) in acc.iter_mut().zip(rows.iter()) {
                *a = f32x8::from(load8(&row[i..])).mul_add(xv, *a);
            }
            i += 8;
        }
        for k in 0..4 {
            let mut s = acc[k].reduce_add();
            for j in body..inp {
                s += rows[k][j] * x[j];
            }
            y[r + k] = if accumulate { y[r + k] + s } else { s };
        }
        r += 4;
    }
    while r < y.len() {
        let s = dot(x, &w[r * inp..(r + 1) * inp]);
        y[r] = if accumulate { y[r] + s } else { s };
        r += 1;
    }
}

#[inline(always)]
fn load8(s: &[f32]) -> [f32; 8] {
    let mut a = [0.0; 8];
    a.copy_from_slice(&s[..8]);
    a
}

/// `Σ a[i]·b[i]` with 8-lane SIMD.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let body = n - n % 8;
    let mut acc = f32x8::ZERO;
    let mut i = 0;
    while i < body {
        acc = f32x8::from(load8(&a[i..])).mul_add(f32x8::from(load8(&b[i..])), acc);
        i += 8;
    }
    let mut s = acc.reduce_add();
    for j in body..n {
        s += a[j] * b[j];
    }
    s
}

/// Plain scalar `y = x·wᵀ`, the reference the SIMD and gemm paths are tested against.
#[cfg(test)]
pub fn linear_scalar(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
    for t in 0..rows {
        for o in 0..out {
            let mut s = 0.0f32;
            for i in 0..inp {
                s += x[t * inp + i] * w[o * inp + i];
            }
            y[t * out + o] = s;
        }
    }
}

/// RMSNorm of every `w.len()`-wide row of `x` into `y`:
/// `y = x / sqrt(mean(x²) + eps) ⊙ w` (no mean subtraction, no bias).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f64, y: &mut [f32]) {
    let d = w.len();
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let ms = dot(xr, xr) / d as f32;
        let r = 1.0 / (ms + eps as f32).sqrt();
        for ((o, &a), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = a * r * g;
        }
    }
}

/// GroupRMSNorm in place: each `hd`-wide group (one head) of each row is normalized on its
/// own and scaled by the matching `hd`-slice of `w` (`w.len()` = row width, or `hd` when
/// one weight is shared across heads).
pub fn group_rmsnorm_inplace(x: &mut [f32], w: &[f32], hd: usize, eps: f64) {
    let shared = w.len() == hd;
    for (g, grp) in x.chunks_exact_mut(hd).enumerate() {
        let ms = dot(grp, grp) / hd as f32;
        let r = 1.0 / (ms + eps as f32).sqrt();
        let wg = if shared {
            w
        } else {
            let row_groups = w.len() / hd;
            let h = g % row_groups;
            &w[h * hd..(h + 1) * hd]
        };
        for (v, &gw) in grp.iter_mut().zip(wg) {
            *v = *v * r * gw;
        }
    }
}

/// `1 / (1 + e^{-x})`, stable for large |x|.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `x · sigmoid(x)` (SiLU / swish).
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// gemm and the SIMD matvec against the scalar reference, with odd sizes (tails) and
    /// accumulation; relative tolerance 1e-5 covers f32 summation-order differences at
    /// these depths (≤ 300 terms of magnitude ≤ 1).
    #[test]
    fn linear_paths_match_scalar() {
        let mut s = 7u64;
        for &(rows, out, inp) in &[
            (1, 5, 3),
            (1, 37, 259),
            (3, 9, 17),
            (17, 64, 256),
            (1, 1100, 1000),
        ] {
            let x: Vec<f32> = (0..rows * inp).map(|_| lcg(&mut s)).collect();
            let w: Vec<f32> = (0..out * inp).map(|_| lcg(&mut s)).collect();
            let mut want = vec![0.0; rows * out];
            linear_scalar(&x, rows, &w, out, inp, &mut want);
            let mut got = vec![0.0; rows * out];
            linear(&x, rows, &w, out, inp, &mut got, false);
            let mut acc = vec![1.0; rows * out];
            linear(&x, rows, &w, out, inp, &mut acc, true);
            for i in 0..rows * out {
                let tol = 1e-5 * (inp as f32).sqrt().max(1.0);
                assert!((got[i] - want[i]).abs() <= tol, "{rows}x{out}x{inp} {i}");
                assert!((acc[i] - 1.0 - want[i]).abs() <= tol);
            }
        }
    }

    /// Each matvec micro-kernel the CPU can run, against the scalar reference.
    #[test]
    fn matvec_kernels_match_scalar() {
        let mut s = 3u64;
        for &(out, inp) in &[(1, 1), (5, 17), (8, 64), (13, 256), (64, 768)] {
            let x: Vec<f32> = (0..inp).map(|_| lcg(&mut s)).collect();
            let w: Vec<f32> = (0..out * inp).map(|_| lcg(&mut s)).collect();
            let mut want = vec![0.0; out];
            linear_scalar(&x, 1, &w, out, inp, &mut want);
            let mut kernels: Vec<(&str, Vec<f32>)> = Vec::new();
            let mut y = vec![0.0; out];
            matvec_rows_portable(&x, &w, &mut y, false);
            kernels.push(("portable", y.clone()));
            matvec_rows_lanes(&x, &w, &mut y, false);
            kernels.push(("lanes", y.clone()));
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: feature checked above.
                    unsafe { matvec_rows_avx2(&x, &w, &mut y, false) };
                    kernels.push(("avx2", y.clone()));
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: feature checked above.
                    unsafe { matvec_rows_avx512(&x, &w, &mut y, false) };
                    kernels.push(("avx512", y.clone()));
                }
            }
            for (name, got) in kernels {
                for o in 0..out {
                    let tol = 1e-5 * (inp as f32).sqrt().max(1.0);
                    assert!(
                        (got[o] - want[o]).abs() <= tol,
                        "{name} {out}x{inp} row {o}"
                    );
                }
            }
        }
    }

    #[test]
    fn norms_match_definition() {
        let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.0, 0.5, 2.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut y = [0.0; 8];
        rmsnorm(&x, &w, 1e-6, &mut y);
        let r = 1.0 / ((1.0f32 + 4.0 + 9.0 + 16.0) / 4.0 + 1e-6).sqrt();
        assert!((y[2] - 3.0 * r * 2.0).abs() < 1e-6);
        let mut g = x;
        group_rmsnorm_inplace(&mut g, &[1.0, 1.0, 2.0, 2.0], 2, 1e-5);
        let r1 = 1.0 / ((9.0f32 + 16.0) / 2.0 + 1e-5).sqrt();
        assert!((g[3] - 4.0 * r1 * 2.0).abs() < 1e-6);
        assert!((sigmoid(-100.0)).abs() < 1e-30 && (sigmoid(100.0) - 1.0).abs() < 1e-7);
    }
}
