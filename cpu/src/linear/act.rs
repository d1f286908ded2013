//! Activations quantized per block of 32 for the integer kernels.
//!
//! Block `k` of row `t` (zero-padded past `inp`): `d = max|x| / 127` (f32) and
//! `q_i = round_ties_even(x_i * (127 / max|x|))`, so `|q_i| <= 127` and
//! `|x_i - d q_i| <= d / 2` up to f32 rounding; `q = 0` for an all-zero block and for a
//! block with `max|x| < 127 / f32::MAX` (there `|x_i - d q_i| < 3.7e-37`);
//! `d = NaN, q = 0` for a block holding a NaN or an infinity, so the outputs it feeds are
//! NaN. Each block also keeps `-128 sum(q)`, the correction of kernels that multiply
//! `q_w + 128` (unsigned) by `q` (AVX-512 VNNI).
//!
//! The SIMD block quantizers (`x86`, `neon`) perform the same f32 operations (`127 / amax`
//! once, one multiply and a round-to-nearest-even conversion per value), so they give the
//! reference's bits.

use crate::simd::Isa;

/// Quantized activation rows, `blocks` blocks per row (the weight's padded count).
#[derive(Debug)]
pub(crate) struct QuantRows {
    pub blocks: usize,
    /// `[rows, blocks, 32]`.
    pub qs: Vec<i8>,
    /// `[rows, blocks]`: the block scales `d`.
    pub d: Vec<f32>,
    /// `[rows, blocks]`: `-128 * sum(q)` of each block.
    pub bias: Vec<i32>,
}

impl QuantRows {
    /// Quantizes `rows` rows of `inp` values from `x` (`x.len() == rows * inp`) into
    /// `blocks >= ceil(inp / 32)` blocks per row. `isa` only picks how the same code is
    /// compiled (the result is the same bits for every `isa`).
    pub fn new(isa: Isa, x: &[f32], rows: usize, inp: usize, blocks: usize) -> Self {
        let mut q = Self {
            blocks,
            qs: vec![0; rows * blocks * 32],
            d: vec![0.0; rows * blocks],
            bias: vec![0; rows * blocks],
        };
        for (t, xr) in x.chunks_exact(inp).enumerate().take(rows) {
            let (qs, d, bias) = (
                &mut q.qs[t * blocks * 32..(t + 1) * blocks * 32],
                &mut q.d[t * blocks..(t + 1) * blocks],
                &mut q.bias[t * blocks..(t + 1) * blocks],
            );
            quantize_row_with(isa, xr, qs, d, bias);
        }
        q
    }

    /// Row `t`'s 32 values of block `k`.
    #[inline(always)]
    pub fn block(&self, t: usize, k: usize) -> &[i8] {
        let at = (t * self.blocks + k) * 32;
        &self.qs[at..at + 32]
    }
}

/// One block's quantizer: `q` and `(d, -128 sum(q))` as in the module docs.
pub(super) trait QuantBlock {
    fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, i32);
}

/// [`quantize_row`] with the block quantizer of `isa` (every one gives the same bits).
fn quantize_row_with(isa: Isa, x: &[f32], qs: &mut [i8], d: &mut [f32], bias: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        Isa::Avx512 if super::x86::has_vnni() => {
            // SAFETY: the features `quantize_row_avx512` is compiled for were detected.
            return unsafe { super::x86::quantize_row_avx512(x, qs, d, bias) };
        }
        Isa::Avx512 | Isa::Avx2 if super::x86::has_avx2() => {
            // SAFETY: the features `quantize_row_avx2` is compiled for were detected.
            return unsafe { super::x86::quantize_row_avx2(x, qs, d, bias) };
        }
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Portable {
        return rows_with::<super::neon::Quant>(x, qs, d, bias);
    }
    let _ = isa;
    quantize_row(x, qs, d, bias);
}

/// The scalar reference of the module docs for one row: `x` (any length), `d.len()`
/// blocks into `qs` (`32 d.len()` values) and `bias`.
pub(crate) fn quantize_row(x: &[f32], qs: &mut [i8], d: &mut [f32], bias: &mut [i32]) {
    rows_with::<Scalar>(x, qs, d, bias);
}

/// The row loop: blocks of 32 (the last one zero-padded; blocks past `x` all zero).
#[inline(always)]
pub(super) fn rows_with<B: QuantBlock>(x: &[f32], qs: &mut [i8], d: &mut [f32], bias: &mut [i32]) {
    let blocks = qs
        .as_chunks_mut::<32>()
        .0
        .iter_mut()
        .zip(d.iter_mut())
        .zip(bias.iter_mut());
    for (k, ((q, dk), bk)) in blocks.enumerate() {
        let mut v = [0.0f32; 32];
        let src = x.get(k * 32..x.len().min(k * 32 + 32)).unwrap_or(&[]);
        v[..src.len()].copy_from_slice(src);
        (*dk, *bk) = B::block(&v, q);
    }
}

/// The plain block quantizer.
pub(super) struct Scalar;

impl QuantBlock for Scalar {
    #[inline(always)]
    fn block(v: &[f32; 32], q: &mut [i8; 32]) -> (f32, i32) {
        let mut amax = 0.0f32;
        let mut finite = true;
        for &a in v {
            finite &= a.is_finite();
            amax = amax.max(a.abs());
        }
        if !finite {
            q.fill(0);
            return (f32::NAN, 0);
        }
        let id = inverse(amax);
        let mut sum = 0i32;
        for (qi, &a) in q.iter_mut().zip(v) {
            *qi = (a * id).round_ties_even() as i8;
            sum += i32::from(*qi);
        }
        (amax / 127.0, -128 * sum)
    }
}

/// `127 / amax`, or 0 (every `q` is 0) for an all-zero block and for one so small that
/// `127 / amax` overflows (`amax < 127 / f32::MAX`, about 3.7e-37).
#[inline(always)]
pub(super) fn inverse(amax: f32) -> f32 {
    let id = 127.0 / amax;
    if amax > 0.0 && id.is_finite() {
        id
    } else {
        0.0
    }
}
