//! aarch64 kernels of the packed block formats, in the order of [`super::int8`]:
//! `sdot` (by element) where the CPU has the dot-product extension, else `smull` +
//! pairwise adds (products `<= 128 * 127`, pair sums `< 2^15`: no 16-bit overflow).
//! Also the NEON `fcvtl` widening of f16 used by the float kernels.
//!
//! `sdot` and `fcvtl` are written as inline assembly: their intrinsics are not stable in
//! this toolchain.

use super::Out;
use super::act::{QuantBlock, QuantRows, inverse};
use super::int8::{GroupKernel, drive};
use super::pack::{GROUP, HEAD, PackedView, block_bytes, tile_bytes};
use core::arch::aarch64::*;
use core::arch::asm;
use core::marker::PhantomData;
use foxedge_core::quant::{Q4_LEVELS, WeightFormat};

/// Eight f16 bit patterns `bits[..8]` widened to f32 (`fcvtl`, `fcvtl2`: base NEON).
#[inline(always)]
pub(super) fn widen_f16x8(bits: &[u16]) -> [f32; 8] {
    let b = &bits[..8];
    let mut out = [0.0f32; 8];
    // SAFETY: NEON is part of the aarch64 baseline; `b` holds 8 u16 (16 bytes) and `out`
    // 8 f32. `out(vreg)` operands never share a register with the input.
    unsafe {
        let h = vld1q_u16(b.as_ptr());
        let (lo, hi): (float32x4_t, float32x4_t);
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack),
        );
        vst1q_f32(out.as_mut_ptr(), lo);
        vst1q_f32(out.as_mut_ptr().add(4), hi);
    }
    out
}

/// The group's 16 row scales of one block (`s`: 32 bytes of f16), as four vectors.
#[inline(always)]
fn scales(s: &[u8]) -> [float32x4_t; 4] {
    let s = &s[..32];
    let mut bits = [0u16; 16];
    for (b, two) in bits.iter_mut().zip(s.chunks_exact(2)) {
        *b = u16::from_le_bytes([two[0], two[1]]);
    }
    let (a, b) = (widen_f16x8(&bits[..8]), widen_f16x8(&bits[8..]));
    // SAFETY: NEON is baseline; each source holds 8 f32.
    unsafe {
        [
            vld1q_f32(a.as_ptr()),
            vld1q_f32(a.as_ptr().add(4)),
            vld1q_f32(b.as_ptr()),
            vld1q_f32(b.as_ptr().add(4)),
        ]
    }
}

/// A 4-row dot product step: `acc[j] += sum_{i<4} w[4j + i] x[4 LANE + i]`.
trait Dot {
    /// # Safety
    /// The CPU must have the instructions the implementation uses.
    unsafe fn dot<const LANE: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
}

struct Sdot;
impl Dot for Sdot {
    #[inline(always)]
    unsafe fn dot<const LANE: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let mut a = acc;
        // SAFETY: the caller runs this only where `dotprod` was detected.
        unsafe {
            asm!(
                "sdot {a:v}.4s, {w:v}.16b, {x:v}.4b[{l}]",
                a = inout(vreg) a,
                w = in(vreg) w,
                x = in(vreg) x,
                l = const LANE,
                options(pure, nomem, nostack),
            );
        }
        a
    }
}

struct Smull;
impl Dot for Smull {
    #[inline(always)]
    unsafe fn dot<const LANE: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        // SAFETY: NEON is baseline.
        unsafe {
            let xb = vreinterpretq_s8_s32(vdupq_laneq_s32::<LANE>(vreinterpretq_s32_s8(x)));
            let lo = vmull_s8(vget_low_s8(w), vget_low_s8(xb));
            let hi = vmull_high_s8(w, xb);
            vpadalq_s16(acc, vpaddq_s16(lo, hi))
        }
    }
}

/// [`Dot::dot`] with a run-time lane (constant after unrolling).
#[inline(always)]
unsafe fn dot_lane<D: Dot>(acc: int32x4_t, w: int8x16_t, x: int8x16_t, lane: usize) -> int32x4_t {
    // SAFETY: forwarded from the caller.
    unsafe {
        match lane {
            0 => D::dot::<0>(acc, w, x),
            1 => D::dot::<1>(acc, w, x),
            2 => D::dot::<2>(acc, w, x),
            _ => D::dot::<3>(acc, w, x),
        }
    }
}

struct Neon<D>(PhantomData<D>);

// SAFETY (every `unsafe` block below): NEON is baseline and `D`'s instructions were
// detected by `run`; loads read slices whose lengths the slicing on the line checked.
impl<D: Dot> Neon<D> {
    /// Up to two activation rows (registers: 8 + 8 accumulators).
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
        let (zf, zi) = unsafe { (vdupq_n_f32(0.0), vdupq_n_s32(0)) };
        // SAFETY: see above the impl; Q4_LEVELS holds 16 i8.
        let (table, low4) = unsafe { (vld1q_s8(Q4_LEVELS.as_ptr()), vdupq_n_u8(15)) };
        let mut acc = [[zf; 4]; R];
        for (p, tile) in tiles.chunks_exact(tile_bytes(f)).take(pairs).enumerate() {
            for b in 0..2 {
                let k = 2 * p + b;
                let q = &tile[HEAD + b * block_bytes(f)..HEAD + (b + 1) * block_bytes(f)];
                let mut x = [(zi, zi); R];
                for (r, xr) in x.iter_mut().enumerate() {
                    let v = xq.block(t0 + r, k);
                    // SAFETY: see above the impl; `v` holds 32 i8.
                    *xr = unsafe {
                        (
                            vreinterpretq_s32_s8(vld1q_s8(v[..16].as_ptr())),
                            vreinterpretq_s32_s8(vld1q_s8(v[16..32].as_ptr())),
                        )
                    };
                }
                let mut s = [[zi; 4]; R];
                // SAFETY: see above the impl.
                unsafe {
                    if Q4 {
                        for c in 0..4 {
                            for j in 0..4 {
                                let v = vld1q_u8(q[64 * c + 16 * j..64 * c + 16 * j + 16].as_ptr());
                                let lo = vqtbl1q_s8(table, vandq_u8(v, low4));
                                let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(v));
                                for r in 0..R {
                                    let (xl, xh) = (
                                        vreinterpretq_s8_s32(x[r].0),
                                        vreinterpretq_s8_s32(x[r].1),
                                    );
                                    s[r][j] = dot_lane::<D>(s[r][j], lo, xl, c);
                                    s[r][j] = dot_lane::<D>(s[r][j], hi, xh, c);
                                }
                            }
                        }
                    } else {
                        for c in 0..8 {
                            for j in 0..4 {
                                let w = vld1q_s8(
                                    q[64 * c + 16 * j..64 * c + 16 * j + 16].as_ptr().cast(),
                                );
                                for r in 0..R {
                                    let xv = if c < 4 { x[r].0 } else { x[r].1 };
                                    s[r][j] =
                                        dot_lane::<D>(s[r][j], w, vreinterpretq_s8_s32(xv), c % 4);
                                }
                            }
                        }
                    }
                }
                let sw = scales(&tile[32 * b..32 * b + 32]);
                for r in 0..R {
                    let dx = xq.d[(t0 + r) * xq.blocks + k];
                    for j in 0..4 {
                        // SAFETY: see above the impl.
                        acc[r][j] = unsafe {
                            vfmaq_f32(acc[r][j], vcvtq_f32_s32(s[r][j]), vmulq_n_f32(sw[j], dx))
                        };
                    }
                }
            }
        }
        let mut out = [[0.0f32; GROUP]; R];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (j, v) in a.iter().enumerate() {
                // SAFETY: see above the impl; `o[4j..]` holds 4 f32.
                unsafe { vst1q_f32(o[4 * j..4 * j + 4].as_mut_ptr(), *v) };
            }
        }
        out
    }

    /// Any `R`, two rows at a time.
    #[inline(always)]
    fn rows<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        let mut out = [[0.0f32; GROUP]; R];
        let mut r = 0;
        while r < R {
            if r + 2 <= R {
                let v = Self::group::<2, Q4>(tiles, pairs, xq, t0 + r);
                (out[r], out[r + 1]) = (v[0], v[1]);
                r += 2;
            } else {
                out[r] = Self::group::<1, Q4>(tiles, pairs, xq, t0 + r)[0];
                r += 1;
            }
        }
        out
    }
}

impl<D: Dot> GroupKernel for Neon<D> {
    #[inline(always)]
    fn kernel<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R] {
        Self::rows::<R, Q4>(tiles, pairs, xq, t0)
    }
}

#[target_feature(enable = "neon,dotprod")]
fn run_sdot(p: &PackedView<'_>, xq: &QuantRows, range: core::ops::Range<usize>, y: &mut Out<'_>) {
    drive::<Neon<Sdot>>(p, xq, range, y);
}

#[target_feature(enable = "neon")]
fn run_smull(p: &PackedView<'_>, xq: &QuantRows, range: core::ops::Range<usize>, y: &mut Out<'_>) {
    drive::<Neon<Smull>>(p, xq, range, y);
}

/// [`drive`] with `sdot` where the CPU has it (and `sdot` is allowed), else `smull`.
pub(super) fn run_with(
    sdot: bool,
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    if sdot && std::arch::is_aarch64_feature_detected!("dotprod") {
        // SAFETY: `dotprod` was detected just above (NEON is baseline).
        unsafe { run_sdot(p, xq, range, y) }
    } else {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { run_smull(p, xq, range, y) }
    }
}

/// [`run_with`] preferring `sdot`.
pub(super) fn run(
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    run_with(true, p, xq, range, y);
}

/// The NEON block quantizer: `fcvtns` rounds to nearest even, `sqxtn` narrows.
pub(super) struct Quant;

impl QuantBlock for Quant {
    #[inline(always)]
    fn block(x: &[f32; 32], q: &mut [i8; 32]) -> (f32, i32) {
        // SAFETY: NEON is baseline; the loads read 8 x 4 f32 of `x`, the stores write
        // 2 x 16 bytes of `q`.
        unsafe {
            let mut v = [vdupq_n_f32(0.0); 8];
            let mut m = vdupq_n_f32(0.0);
            for (j, vj) in v.iter_mut().enumerate() {
                *vj = vld1q_f32(x.as_ptr().add(4 * j));
                // fmax propagates NaN, so a NaN anywhere makes `amax` NaN.
                m = vmaxq_f32(m, vabsq_f32(*vj));
            }
            let amax = vmaxvq_f32(m);
            if !amax.is_finite() {
                q.fill(0);
                return (f32::NAN, 0);
            }
            let id = inverse(amax);
            let mut i = [vdupq_n_s32(0); 8];
            for (ij, vj) in i.iter_mut().zip(v) {
                *ij = vcvtnq_s32_f32(vmulq_n_f32(vj, id));
            }
            let h: [int16x8_t; 4] = core::array::from_fn(|j| {
                vcombine_s16(vqmovn_s32(i[2 * j]), vqmovn_s32(i[2 * j + 1]))
            });
            vst1q_s8(
                q.as_mut_ptr(),
                vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])),
            );
            vst1q_s8(
                q.as_mut_ptr().add(16),
                vcombine_s8(vqmovn_s16(h[2]), vqmovn_s16(h[3])),
            );
            let s = vaddq_s32(
                vaddq_s32(vaddq_s32(i[0], i[1]), vaddq_s32(i[2], i[3])),
                vaddq_s32(vaddq_s32(i[4], i[5]), vaddq_s32(i[6], i[7])),
            );
            (amax / 127.0, -128 * vaddvq_s32(s))
        }
    }
}
