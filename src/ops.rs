//! The small ops of the FoX block: RMSNorm, per-head RMSNorm, activations, dot products.
//! The linear layers run `foxedge_cpu::linear` through [`crate::matrix::WeightMatrix`].
//!
//! All in f32 with f32 accumulation, as the reference's fp32 path (spec §3, §4).

use wide::f32x8;

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
