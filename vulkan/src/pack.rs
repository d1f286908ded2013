//! Host-side packing between the caller's layouts and the device's head-first slabs.

use crate::api::Storage;
use half::f16;

/// Rows packed as u32 words: f32 bits, or two f16 per word (low half first).
pub(crate) struct Packed {
    pub words: Vec<u32>,
}

/// Gathers `rows` rows of `d` elements, row `r` starting at `src[at(r)..]`, into words.
/// `f16`: store as f16 (exact for f16 input; rounds other types), else as f32.
pub(crate) fn pack_rows<T: Storage>(
    src: &[T],
    f16: bool,
    rows: usize,
    d: usize,
    at: impl Fn(usize) -> usize,
) -> Packed {
    let mut words = Vec::with_capacity(if f16 { rows * d / 2 } else { rows * d });
    for r in 0..rows {
        let row = &src[at(r)..at(r) + d];
        if f16 {
            for pair in row.chunks_exact(2) {
                let lo = f16::from_f32(pair[0].to_f32()).to_bits();
                let hi = f16::from_f32(pair[1].to_f32()).to_bits();
                words.push(u32::from(lo) | (u32::from(hi) << 16));
            }
        } else {
            words.extend(row.iter().map(|x| x.to_f32().to_bits()));
        }
    }
    Packed { words }
}

/// Scatters `rows` rows of `d` f32 words back into `dst` at `at(r)`, rounding to `O`.
pub(crate) fn unpack_rows<O: Storage>(
    words: &[u32],
    dst: &mut [O],
    rows: usize,
    d: usize,
    at: impl Fn(usize) -> usize,
) {
    for r in 0..rows {
        let o = at(r);
        for (x, &w) in dst[o..o + d].iter_mut().zip(&words[r * d..(r + 1) * d]) {
            *x = O::from_f32(f32::from_bits(w));
        }
    }
}

/// Double-float split of f64 values: `out[2i] = hi = f32(x)`, `out[2i+1] = f32(x - hi)`
/// (as f32 bits), so that `hi + lo` carries about 48 bits of `x`.
pub(crate) fn split_f64(c: &[f64], out: &mut [u32]) {
    for (x, o) in c.iter().zip(out.chunks_exact_mut(2)) {
        let hi = *x as f32;
        let lo = (*x - f64::from(hi)) as f32;
        o[0] = hi.to_bits();
        o[1] = lo.to_bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn double_float_keeps_small_differences_of_large_values() {
        let a = -1.0e6_f64 - 0.123_456_789;
        let b = -1.0e6_f64 - 2.5;
        let mut w = [0u32; 4];
        split_f64(&[a, b], &mut w);
        let f = |i: usize| f32::from_bits(w[i]);
        let d = (f(0) - f(2)) + (f(1) - f(3));
        assert!((f64::from(d) - (a - b)).abs() < 1e-6, "{d} vs {}", a - b);
        // A plain f32 difference loses it (spacing 0.0625 at 1e6).
        assert!((f64::from(a as f32 - b as f32) - (a - b)).abs() > 1e-3);
    }
}
