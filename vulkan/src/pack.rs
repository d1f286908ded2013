//! Host-side packing between the caller's layouts and the device's head-first slabs.
//!
//! [`pack_rows`] is the plain serial packer (decode and the resident cache use it; it is
//! also the reference the parallel packers are tested against). Prefill packs with
//! [`pack_f32_into`] / [`pack_f16_into`] straight into mapped staging memory, tiles of
//! rows in parallel, and unpacks with [`unpack_rows`] straight from mapped readback memory.

use foxedge_core::contract::Storage;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::any::TypeId;

/// Below this many elements the parallel packers run on the calling thread (a rayon
/// dispatch from outside the pool costs a cross-thread wake-up, some microseconds).
const PAR_MIN_ELEMS: usize = 1 << 15;

/// Rows per rayon task: about 16 Ki elements.
fn rows_per_task(d: usize) -> usize {
    (1usize << 14).div_ceil(d.max(1))
}

/// `f(row index, row)` over the `d`-element rows of `dst`, in parallel when large.
fn for_rows<E: Send>(dst: &mut [E], d: usize, f: impl Fn(usize, &mut [E]) + Sync + Send) {
    if dst.len() < PAR_MIN_ELEMS {
        dst.chunks_exact_mut(d)
            .enumerate()
            .for_each(|(r, x)| f(r, x));
    } else {
        dst.par_chunks_exact_mut(d)
            .with_min_len(rows_per_task(d))
            .enumerate()
            .for_each(|(r, x)| f(r, x));
    }
}

/// Tokens per packing tile: a tile is this many consecutive rows of every slab.
const TILE_ROWS: usize = 16;

/// `f(row index, row)` over the `d`-element rows of `dst`, which holds slabs of `seq` rows
/// (row `r = slab * seq + t`), in parallel when large, by tiles of [`TILE_ROWS`] tokens
/// across all slabs. A sequence-first source holds a token's heads side by side, so a tile
/// reads `slabs * TILE_ROWS` rows from a few contiguous runs; walking one slab at a time
/// instead reads one row per `heads * d`-element stride (a new page each row at 16 x 64
/// f32): packing a 16-head x 16K x 64 prefill's q, k and v (f32 to f16) took 10.7 ms that
/// way against 4.9 by tiles on the H100 host (BENCHMARKS.md, "Vulkan attention
/// kernels").
fn for_tiles<E: Send>(
    dst: &mut [E],
    d: usize,
    seq: usize,
    f: impl Fn(usize, &mut [E]) + Sync + Send,
) {
    let slab_len = seq * d;
    if dst.len() < PAR_MIN_ELEMS || slab_len == 0 || dst.len() % slab_len != 0 {
        return for_rows(dst, d, f);
    }
    let slabs = dst.len() / slab_len;
    let per_slab = seq.div_ceil(TILE_ROWS);
    // Tile `b` of slab `s` at `tiles[b * slabs + s]` (every slab has `per_slab` tiles).
    let mut cuts: Vec<_> = dst
        .chunks_exact_mut(slab_len)
        .map(|slab| slab.chunks_mut(TILE_ROWS * d))
        .collect();
    let mut tiles = Vec::with_capacity(per_slab * slabs);
    for _ in 0..per_slab {
        tiles.extend(cuts.iter_mut().filter_map(Iterator::next));
    }
    let min_tiles = rows_per_task(d).div_ceil(slabs * TILE_ROWS);
    tiles
        .par_chunks_mut(slabs)
        .with_min_len(min_tiles)
        .enumerate()
        .for_each(|(b, tile)| {
            for (s, part) in tile.iter_mut().enumerate() {
                let r0 = s * seq + b * TILE_ROWS;
                for (i, row) in part.chunks_exact_mut(d).enumerate() {
                    f(r0 + i, row);
                }
            }
        });
}

/// `src` as `&[f16]` when `T` is `f16`.
fn as_f16<T: Storage>(src: &[T]) -> Option<&[f16]> {
    if TypeId::of::<T>() != TypeId::of::<f16>() {
        return None;
    }
    // SAFETY: `T` is `f16` (same TypeId), so this reinterprets a slice as its own type:
    // same pointer, length, alignment and lifetime.
    Some(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f16>(), src.len()) })
}

/// Packs `dst.len() / d` rows of `d` elements as f32, row `r` from `src[at(r)..][..d]`
/// (`dst` in slabs of `seq` rows, by tiles in parallel when large: [`for_tiles`]). Same
/// values as [`pack_rows`] with `f16 = false` (widening f16 or bf16 is exact; only NaN
/// payloads may differ).
pub(crate) fn pack_f32_into<T: Storage>(
    src: &[T],
    dst: &mut [f32],
    d: usize,
    seq: usize,
    at: impl Fn(usize) -> usize + Sync + Send,
) {
    for_tiles(dst, d, seq, |r, row| {
        T::to_f32_slice(&src[at(r)..][..d], row);
    });
}

/// Packs `dst.len() / d` rows of `d` elements as f16, row `r` from `src[at(r)..][..d]`
/// (`dst` in slabs of `seq` rows, by tiles in parallel when large: [`for_tiles`]): f16
/// input is copied bit for bit, f32 rounds to nearest even through `half`'s slice
/// conversion (F16C where the CPU has it, detected at run time; the same rounding as
/// `f16::from_f32`), other types widen to f32 first. Same bits as [`pack_rows`] with
/// `f16 = true`, except NaN payloads (the serial packer's f16 -> f32 -> f16 round trip
/// quiets signalling NaNs).
pub(crate) fn pack_f16_into<T: Storage>(
    src: &[T],
    dst: &mut [f16],
    d: usize,
    seq: usize,
    at: impl Fn(usize) -> usize + Sync + Send,
) {
    if let Some(s) = as_f16(src) {
        for_tiles(dst, d, seq, |r, row| row.copy_from_slice(&s[at(r)..][..d]));
    } else if let Some(s) = T::as_f32(src) {
        for_tiles(dst, d, seq, |r, row| {
            row.convert_from_f32_slice(&s[at(r)..][..d]);
        });
    } else {
        for_tiles(dst, d, seq, |r, row| {
            let mut buf = [0.0f32; 64];
            let s = &src[at(r)..][..d];
            for (i, o) in s.chunks(64).zip(row.chunks_mut(64)) {
                let b = &mut buf[..i.len()];
                T::to_f32_slice(i, b);
                o.convert_from_f32_slice(b);
            }
        });
    }
}

/// Scatters f32 rows back into `dst` (rows of `d` elements), rounding to `O`: destination
/// row `i` (elements `i * d ..`) comes from `row(i)`, and is left as it is where that is
/// `None` (rows in parallel when large).
pub(crate) fn unpack_rows<'a, O: Storage>(
    dst: &mut [O],
    d: usize,
    row: impl Fn(usize) -> Option<&'a [f32]> + Sync + Send,
) {
    for_rows(dst, d, |i, x| {
        if let Some(r) = row(i) {
            O::from_f32_slice(&r[..d], x);
        }
    });
}

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
    use half::bf16;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// Equal bits, or both NaN (the serial packer's round trip may quiet a NaN).
    fn same16(a: u16, b: u16) -> bool {
        a == b || (f16::from_bits(a).is_nan() && f16::from_bits(b).is_nan())
    }

    fn same32(a: u32, b: u32) -> bool {
        a == b || (f32::from_bits(a).is_nan() && f32::from_bits(b).is_nan())
    }

    /// Both parallel packers against `pack_rows` on one source and row map (`rows` in
    /// slabs of `seq`).
    fn check<T: Storage>(
        src: &[T],
        (rows, seq): (usize, usize),
        d: usize,
        at: &(dyn Fn(usize) -> usize + Sync),
    ) {
        let want32 = pack_rows(src, false, rows, d, at).words;
        let mut got32 = vec![f32::NAN; rows * d];
        pack_f32_into(src, &mut got32, d, seq, at);
        for (i, (g, w)) in got32.iter().zip(&want32).enumerate() {
            assert!(same32(g.to_bits(), *w), "f32 {:?} element {i}", T::DTYPE);
        }
        let want16 = pack_rows(src, true, rows, d, at).words;
        let mut got16 = vec![f16::NAN; rows * d];
        pack_f16_into(src, &mut got16, d, seq, at);
        for (i, pair) in got16.chunks_exact(2).enumerate() {
            let w = want16[i];
            assert!(
                same16(pair[0].to_bits(), w as u16) && same16(pair[1].to_bits(), (w >> 16) as u16),
                "f16 {:?} word {i}",
                T::DTYPE
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        /// The parallel packers write what the serial reference packs, for f32, f16 and bf16
        /// input, any bit pattern (NaN, inf, subnormals, values that round to a tie), rows
        /// gathered at any stride, offset and order, in slabs of any length (partial last
        /// tiles), sizes on both sides of the serial cutoff.
        #[test]
        fn parallel_packing_equals_the_serial_reference(
            slabs in 1usize..6,
            seq in 1usize..300,
            d8 in 1usize..17,
            gap in 0usize..70,
            off in 0usize..100,
            order in 0u8..3,
            seed in any::<u64>(),
        ) {
            let rows = slabs * seq;
            let d = 8 * d8;
            let stride = d + gap;
            let n = off + rows * stride;
            let mut r = StdRng::seed_from_u64(seed);
            let perm = |i: usize| match order {
                0 => i,
                1 => rows - 1 - i,
                // A bijection when rows is odd; a gather with repeats otherwise (allowed).
                _ => (i * 7 + 3) % rows,
            };
            let at = move |i: usize| off + perm(i) * stride;
            let mix = |r: &mut StdRng| -> u32 {
                // Half random bits, half values near 1 (ties and ordinary roundings).
                if r.r#gen::<bool>() { r.r#gen() } else { (r.r#gen::<f32>() * 4.0 - 2.0).to_bits() }
            };
            let s32: Vec<f32> = (0..n).map(|_| f32::from_bits(mix(&mut r))).collect();
            check(&s32, (rows, seq), d, &at);
            let s16: Vec<f16> = (0..n).map(|_| f16::from_bits(r.r#gen())).collect();
            check(&s16, (rows, seq), d, &at);
            let sb: Vec<bf16> = (0..n).map(|_| bf16::from_bits(r.r#gen())).collect();
            check(&sb, (rows, seq), d, &at);
        }
    }

    /// A sequence-first gather large enough for the tiled path, the last tile partial.
    #[test]
    fn tiled_packing_of_a_sequence_first_source() {
        let (heads, seq, d) = (3, 16 * 40 + 5, 64);
        assert!(heads * seq * d >= PAR_MIN_ELEMS);
        let src: Vec<f32> = (0..heads * seq * d).map(|i| i as f32 * 0.5 - 7.0).collect();
        let at = |r: usize| ((r % seq) * heads + r / seq) * d;
        check(&src, (heads * seq, seq), d, &at);
    }

    #[test]
    fn f16_packing_rounds_ties_to_even() {
        // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1);
        // 1 + 3 * 2^-11 goes up to 1 + 2^-9.
        let x = [
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            65520.0,
            -0.0,
            1e-8,
            0.0,
            0.0,
            0.0,
        ];
        let mut got = [f16::ZERO; 8];
        pack_f16_into(&x, &mut got, 8, 1, |_| 0);
        assert_eq!(got[0], f16::ONE);
        assert_eq!(got[1].to_f32(), 1.0 + 2f32.powi(-9));
        assert!(got[2].is_infinite());
        assert_eq!(got[3].to_bits(), 0x8000);
        assert_eq!(got[4].to_bits(), 0);
    }

    #[test]
    fn unpack_scatters_rows_in_parallel() {
        let d = 8;
        let rows = 2 * PAR_MIN_ELEMS / d + 3;
        let src: Vec<f32> = (0..rows * d).map(|i| i as f32 + 0.25).collect();
        let mut out = vec![f16::ZERO; rows * d];
        unpack_rows(&mut out, d, |i| Some(&src[(rows - 1 - i) * d..][..d]));
        for i in 0..rows {
            for e in 0..d {
                let want = f16::from_f32(src[(rows - 1 - i) * d + e]);
                assert_eq!(out[i * d + e].to_bits(), want.to_bits());
            }
        }
    }

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
