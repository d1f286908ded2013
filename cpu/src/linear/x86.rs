//! x86-64 kernels of the packed block formats: AVX-512 VNNI (`vpdpbusd`) and AVX2
//! (`vpmaddubsw` + `vpmaddwd`). Both follow the order of [`super::int8`] exactly.
//!
//! VNNI multiplies unsigned by signed bytes: the weights enter as `q_w + 128` (Q8: the
//! sign bit flipped; Q4: a table of `level + 128`) and each block's sum starts from the
//! activation's `-128 sum(q_x)`. AVX2 multiplies `|q_w|` by `q_x` carrying the sign of
//! `q_w` (`vpsignb`); a pair of products stays below `2 * 128 * 127 < 2^15`, so the 16-bit
//! pair sums never saturate.

use super::Out;
use super::act::{QuantBlock, QuantRows, inverse, rows_with};
use super::int8::{GroupKernel, drive};
use super::pack::{GROUP, HEAD, PackedView, block_bytes, tile_bytes};
use core::arch::x86_64::*;
use foxedge_core::quant::{Q4_LEVELS, WeightFormat};

/// AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C.
pub(crate) fn has_vnni() -> bool {
    has_avx2()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// AVX2 with FMA and F16C.
pub(crate) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// [`drive`] with the VNNI kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn vnni(
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    drive::<Vnni>(p, xq, range, y);
}

/// [`drive`] with the AVX2 kernel.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn avx2(
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    drive::<Avx2>(p, xq, range, y);
}

/// Four activation bytes `x[4c..4c+4]` as one `i32`.
#[inline(always)]
fn four(x: &[i8], c: usize) -> i32 {
    let b = &x[4 * c..4 * c + 4];
    i32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

/// `Q4_LEVELS[i] + 128` as unsigned bytes (VNNI's weight operand).
const LEVELS_U8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (Q4_LEVELS[i] as i16 + 128) as u8;
        i += 1;
    }
    t
};

/// `Q4_LEVELS` as bytes (AVX2's signed weights).
const LEVELS_I8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = Q4_LEVELS[i] as u8;
        i += 1;
    }
    t
};

struct Vnni;

// SAFETY (every `unsafe` block of the two kernels): the intrinsics need the features that
// `vnni` / `avx2` are compiled for, which their callers detected; every load reads a
// slice whose length was checked by the slicing on the same line (64, 32 or 16 bytes).
impl Vnni {
    /// 16 lanes (the group's rows) of `dw * dx` for block `b` of `tile` and each row.
    #[inline(always)]
    fn block_scales<const R: usize>(
        tile: &[u8],
        b: usize,
        xq: &QuantRows,
        t0: usize,
        k: usize,
    ) -> [__m512; R] {
        let s = &tile[32 * b..32 * b + 32];
        // SAFETY: see above the impl.
        let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().cast())) };
        // No closures around intrinsics: a closure does not inherit the target features.
        let mut sc = [dw; R];
        for (r, v) in sc.iter_mut().enumerate() {
            // SAFETY: see above the impl.
            *v = unsafe { _mm512_mul_ps(dw, _mm512_set1_ps(xq.d[(t0 + r) * xq.blocks + k])) };
        }
        sc
    }

    #[inline(always)]
    fn group<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        let f = if Q4 {
            WeightFormat::Q4
        } else {
            WeightFormat::Q8
        };
        // SAFETY: see above the impl.
        let (flip, low4, table) = unsafe {
            (
                _mm512_set1_epi8(-128),
                _mm512_set1_epi8(15),
                _mm512_broadcast_i32x4(_mm_loadu_si128(LEVELS_U8.as_ptr().cast())),
            )
        };
        // SAFETY: see above the impl.
        let mut acc = [unsafe { _mm512_setzero_ps() }; R];
        for (p, tile) in tiles.chunks_exact(tile_bytes(f)).take(pairs).enumerate() {
            for b in 0..2 {
                let k = 2 * p + b;
                let q = &tile[HEAD + b * block_bytes(f)..HEAD + (b + 1) * block_bytes(f)];
                let x: [&[i8]; R] = core::array::from_fn(|r| xq.block(t0 + r, k));
                // SAFETY: see above the impl.
                let mut s = [unsafe { _mm512_setzero_si512() }; R];
                for (r, v) in s.iter_mut().enumerate() {
                    // SAFETY: see above the impl.
                    *v = unsafe { _mm512_set1_epi32(xq.bias[(t0 + r) * xq.blocks + k]) };
                }
                // SAFETY: see above the impl.
                unsafe {
                    if Q4 {
                        for c in 0..4 {
                            let v = _mm512_loadu_si512(q[64 * c..64 * c + 64].as_ptr().cast());
                            let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
                            let hi = _mm512_shuffle_epi8(
                                table,
                                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4),
                            );
                            for r in 0..R {
                                s[r] =
                                    _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(four(x[r], c)));
                                s[r] = _mm512_dpbusd_epi32(
                                    s[r],
                                    hi,
                                    _mm512_set1_epi32(four(x[r], c + 4)),
                                );
                            }
                        }
                    } else {
                        for c in 0..8 {
                            let v = _mm512_loadu_si512(q[64 * c..64 * c + 64].as_ptr().cast());
                            let w = _mm512_xor_si512(v, flip);
                            for r in 0..R {
                                s[r] =
                                    _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four(x[r], c)));
                            }
                        }
                    }
                }
                let sc = Self::block_scales::<R>(tile, b, xq, t0, k);
                for r in 0..R {
                    // SAFETY: see above the impl.
                    acc[r] = unsafe { _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), sc[r], acc[r]) };
                }
            }
        }
        let mut out = [[0.0f32; GROUP]; R];
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: see above the impl; `o` holds 16 f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
        }
        out
    }
}

impl GroupKernel for Vnni {
    #[inline(always)]
    fn kernel<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        Self::group::<R, Q4>(tiles, pairs, xq, t0)
    }
}

struct Avx2;

impl Avx2 {
    /// `s += sum of 4 products` per row lane: `|w| * (x with the sign of w)`.
    #[inline(always)]
    fn dot4(s: __m256i, w: __m256i, aw: __m256i, x4: i32) -> __m256i {
        // SAFETY: see above the Vnni impl.
        unsafe {
            let xs = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
            let pairs = _mm256_maddubs_epi16(aw, xs);
            _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    /// One half (rows `8h..8h+8`) of a group.
    #[inline(always)]
    fn half<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
        h: usize,
    ) -> [__m256; R] {
        let f = if Q4 {
            WeightFormat::Q4
        } else {
            WeightFormat::Q8
        };
        // SAFETY: see above the Vnni impl.
        let (low4, table) = unsafe {
            (
                _mm256_set1_epi8(15),
                _mm256_broadcastsi128_si256(_mm_loadu_si128(LEVELS_I8.as_ptr().cast())),
            )
        };
        // SAFETY: see above the Vnni impl.
        let mut acc = [unsafe { _mm256_setzero_ps() }; R];
        for (p, tile) in tiles.chunks_exact(tile_bytes(f)).take(pairs).enumerate() {
            for b in 0..2 {
                let k = 2 * p + b;
                let q = &tile[HEAD + b * block_bytes(f)..HEAD + (b + 1) * block_bytes(f)];
                let x: [&[i8]; R] = core::array::from_fn(|r| xq.block(t0 + r, k));
                // SAFETY: see above the Vnni impl.
                let mut s = [unsafe { _mm256_setzero_si256() }; R];
                // SAFETY: see above the Vnni impl.
                unsafe {
                    if Q4 {
                        for c in 0..4 {
                            let v = _mm256_loadu_si256(
                                q[64 * c + 32 * h..64 * c + 32 * h + 32].as_ptr().cast(),
                            );
                            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
                            let hi = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4),
                            );
                            let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                            for r in 0..R {
                                s[r] = Self::dot4(s[r], lo, alo, four(x[r], c));
                                s[r] = Self::dot4(s[r], hi, ahi, four(x[r], c + 4));
                            }
                        }
                    } else {
                        for c in 0..8 {
                            let w = _mm256_loadu_si256(
                                q[64 * c + 32 * h..64 * c + 32 * h + 32].as_ptr().cast(),
                            );
                            let aw = _mm256_abs_epi8(w);
                            for r in 0..R {
                                s[r] = Self::dot4(s[r], w, aw, four(x[r], c));
                            }
                        }
                    }
                }
                let sw = &tile[32 * b + 16 * h..32 * b + 16 * h + 16];
                // SAFETY: see above the Vnni impl.
                let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(sw.as_ptr().cast())) };
                for r in 0..R {
                    let dx = xq.d[(t0 + r) * xq.blocks + k];
                    // SAFETY: see above the Vnni impl.
                    acc[r] = unsafe {
                        _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s[r]),
                            _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
                            acc[r],
                        )
                    };
                }
            }
        }
        acc
    }

    #[inline(always)]
    fn group<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        let mut out = [[0.0f32; GROUP]; R];
        for h in 0..2 {
            let acc = Self::half::<R, Q4>(tiles, pairs, xq, t0, h);
            for (o, a) in out.iter_mut().zip(acc) {
                let dst = &mut o[8 * h..8 * h + 8];
                // SAFETY: see above the Vnni impl; `dst` holds 8 f32.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), a) };
            }
        }
        out
    }
}

impl GroupKernel for Avx2 {
    #[inline(always)]
    fn kernel<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        Self::group::<R, Q4>(tiles, pairs, xq, t0)
    }
}

/// [`rows_with`] with the AVX-512 block quantizer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn quantize_row_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], bias: &mut [i32]) {
    rows_with::<Quant512>(x, qs, d, bias);
}

/// [`rows_with`] with the AVX2 block quantizer.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn quantize_row_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], bias: &mut [i32]) {
    rows_with::<Quant256>(x, qs, d, bias);
}

struct Quant512;

impl QuantBlock for Quant512 {
    /// `vcvtps2dq` rounds to nearest even (the default MXCSR mode); `vpmovsdb` narrows.
    #[inline(always)]
    fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, i32) {
        // SAFETY: AVX-512 F/BW/VL are enabled in the caller (`quantize_row_avx512`); the
        // loads read 2 x 16 f32 of `x`, the stores write 2 x 16 bytes of `q`.
        unsafe {
            let v = [
                _mm512_loadu_ps(x.as_ptr()),
                _mm512_loadu_ps(x.as_ptr().add(16)),
            ];
            let a = [_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])];
            let inf = _mm512_set1_ps(f32::INFINITY);
            // Lanes not below +inf: infinities and NaNs.
            let bad = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a[0], inf)
                | _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a[1], inf);
            if bad != 0 {
                q.fill(0);
                return (f32::NAN, 0);
            }
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]));
            let id = _mm512_set1_ps(inverse(amax));
            let i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], id));
            let i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], id));
            _mm_storeu_si128(q.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(i0));
            _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), _mm512_cvtsepi32_epi8(i1));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            (amax / 127.0, -128 * sum)
        }
    }
}

struct Quant256;

impl QuantBlock for Quant256 {
    #[inline(always)]
    fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, i32) {
        // SAFETY: AVX2 is enabled in the caller (`quantize_row_avx2`); the loads read
        // 4 x 8 f32 of `x`, the store writes the 32 bytes of `q`.
        unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let inf = _mm256_set1_ps(f32::INFINITY);
            let mut v = [_mm256_setzero_ps(); 4];
            let mut m = _mm256_setzero_ps();
            let mut bad = 0;
            for (j, vj) in v.iter_mut().enumerate() {
                *vj = _mm256_loadu_ps(x.as_ptr().add(8 * j));
                let a = _mm256_andnot_ps(sign, *vj);
                bad |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
                m = _mm256_max_ps(m, a);
            }
            if bad != 0 {
                q.fill(0);
                return (f32::NAN, 0);
            }
            let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            let amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)));
            let id = _mm256_set1_ps(inverse(amax));
            let mut i = [_mm256_setzero_si256(); 4];
            for (ij, vj) in i.iter_mut().zip(v) {
                *ij = _mm256_cvtps_epi32(_mm256_mul_ps(vj, id));
            }
            // packs work within 128-bit lanes: [0a 1a 2a 3a | 0b 1b 2b 3b] in 4-byte groups
            // (a, b: the low and high halves of each i[j]); the permute restores the order.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), p);
            let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            (amax / 127.0, -128 * _mm_cvtsi128_si32(s))
        }
    }
}
