//! The block-format products: the scalar reference over canonical blocks, the driver of
//! the packed kernels, and the portable packed kernel (plain Rust).
//!
//! Every kernel computes, for output `o` and activation row `t`, over blocks `k` in order:
//!
//! ```text
//! acc = fma(f32(s_k), d_w[o,k] * d_x[t,k], acc),   s_k = sum_i q_w[o,k,i] q_x[t,k,i] (exact i32)
//! ```
//!
//! with `q_w` the block's `i8` values (Q8) or levels `Q4_LEVELS[index]` (Q4). The integer
//! sums are exact and the f32 operations the same, so every kernel returns the reference's
//! bits (padding blocks add `0 * 0`).

use super::Out;
use super::act::QuantRows;
use super::pack::{GROUP, HEAD, PackedView, block_bytes, tile_bytes};
use crate::simd::Isa;
use foxedge_core::quant::{BlockQ4, BlockQ8, Q4_BYTES, Q4_LEVELS, Q8_BYTES, WeightFormat};
use half::f16;

/// The scalar reference over canonical Q8 / Q4 rows (`bytes`: `out` rows), `xq` quantized
/// with `ceil(inp / 32)` blocks per row.
pub(super) fn reference(f: WeightFormat, bytes: &[u8], out: usize, xq: &QuantRows, mut y: Out<'_>) {
    let rows = xq.d.len() / xq.blocks;
    let row_bytes = bytes.len() / out;
    for t in 0..rows {
        for (o, wr) in bytes.chunks_exact(row_bytes).enumerate() {
            let mut acc = 0.0f32;
            for k in 0..xq.blocks {
                let x = xq.block(t, k);
                let (dw, s) = match f {
                    WeightFormat::Q8 => {
                        let mut raw = [0u8; Q8_BYTES];
                        raw.copy_from_slice(&wr[k * Q8_BYTES..(k + 1) * Q8_BYTES]);
                        let b = BlockQ8::from_bytes(&raw);
                        let s: i32 =
                            b.qs.iter()
                                .zip(x)
                                .map(|(&w, &v)| i32::from(w) * i32::from(v))
                                .sum();
                        (b.scale(), s)
                    }
                    _ => {
                        let mut raw = [0u8; Q4_BYTES];
                        raw.copy_from_slice(&wr[k * Q4_BYTES..(k + 1) * Q4_BYTES]);
                        let b = BlockQ4::from_bytes(&raw);
                        let s: i32 = (0..32)
                            .map(|i| {
                                i32::from(Q4_LEVELS[usize::from(b.index(i))]) * i32::from(x[i])
                            })
                            .sum();
                        (b.scale(), s)
                    }
                };
                acc = (s as f32).mul_add(dw * xq.d[t * xq.blocks + k], acc);
            }
            y.put(t, o, acc);
        }
    }
}

/// One instruction set's kernel for one row group of a [`PackedView`].
pub(super) trait GroupKernel {
    /// `out[r][j]` for activation rows `t0 + r` (`r < R`) and the 16 rows `j` of the
    /// group whose tiles are `tiles` (`pairs` tiles), Q4 blocks if `Q4`, else Q8.
    fn kernel<const R: usize, const Q4: bool>(
        tiles: &[u8],
        pairs: usize,
        xq: &QuantRows,
        t0: usize,
    ) -> [[f32; GROUP]; R];
}

/// Activation rows per chunk of the matmul loop: the chunk's quantized rows (`64 * inp`
/// bytes) stay in L2 while every row group of the range passes over them.
const ROW_CHUNK: usize = 64;

/// The packed product for outputs `range` (a multiple of 16 apart from the end): row
/// chunks, then groups, then tiles of 4 activation rows (1 for the rest).
#[inline(always)]
pub(super) fn drive<K: GroupKernel>(
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    let rows = xq.d.len() / xq.blocks;
    let (g0, g1) = (range.start / GROUP, range.end.div_ceil(GROUP));
    let mut store = |t0: usize, g: usize, v: &[[f32; GROUP]]| {
        for (r, vr) in v.iter().enumerate() {
            for (j, &x) in vr.iter().enumerate() {
                let o = g * GROUP + j;
                if o < range.end {
                    y.put(t0 + r, o - range.start, x);
                }
            }
        }
    };
    for c0 in (0..rows).step_by(ROW_CHUNK) {
        let c1 = rows.min(c0 + ROW_CHUNK);
        for g in g0..g1 {
            let tiles = p.group(g);
            let mut t = c0;
            while t + 4 <= c1 {
                let v = match p.format() {
                    WeightFormat::Q8 => K::kernel::<4, false>(tiles, p.pairs(), xq, t),
                    _ => K::kernel::<4, true>(tiles, p.pairs(), xq, t),
                };
                store(t, g, &v);
                t += 4;
            }
            while t < c1 {
                let v = match p.format() {
                    WeightFormat::Q8 => K::kernel::<1, false>(tiles, p.pairs(), xq, t),
                    _ => K::kernel::<1, true>(tiles, p.pairs(), xq, t),
                };
                store(t, g, &v);
                t += 1;
            }
        }
    }
}

/// Outputs `range` (starting at a multiple of [`GROUP`]) of the packed product, with the
/// widest kernel `isa` allows on this CPU.
pub(super) fn packed_range(
    isa: Isa,
    p: &PackedView<'_>,
    xq: &QuantRows,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512 if super::x86::has_vnni() => {
                // SAFETY: the features `vnni` is compiled for were detected just above.
                return unsafe { super::x86::vnni(p, xq, range, y) };
            }
            Isa::Avx512 | Isa::Avx2 if super::x86::has_avx2() => {
                // SAFETY: the features `avx2` is compiled for were detected just above.
                return unsafe { super::x86::avx2(p, xq, range, y) };
            }
            _ => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if isa == Isa::Portable {
            return super::neon::run(p, xq, range, y);
        }
    }
    let _ = isa;
    drive::<Portable>(p, xq, range, y)
}

/// The packed layout read in plain Rust (any CPU).
pub(super) struct Portable;

impl Portable {
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
        let mut acc = [[0.0f32; GROUP]; R];
        for (p, tile) in tiles.chunks_exact(tile_bytes(f)).take(pairs).enumerate() {
            for b in 0..2 {
                let k = 2 * p + b;
                let q = &tile[HEAD + b * block_bytes(f)..HEAD + (b + 1) * block_bytes(f)];
                for (r, ar) in acc.iter_mut().enumerate() {
                    let x = xq.block(t0 + r, k);
                    let dx = xq.d[(t0 + r) * xq.blocks + k];
                    for (j, a) in ar.iter_mut().enumerate() {
                        let mut s = 0i32;
                        for c in 0..8 {
                            for i in 0..4 {
                                let w = if Q4 {
                                    let byte = q[64 * (c % 4) + 4 * j + i];
                                    let idx = if c < 4 { byte & 15 } else { byte >> 4 };
                                    Q4_LEVELS[usize::from(idx)]
                                } else {
                                    q[64 * c + 4 * j + i] as i8
                                };
                                s += i32::from(w) * i32::from(x[4 * c + i]);
                            }
                        }
                        let dw =
                            f16::from_le_bytes([tile[32 * b + 2 * j], tile[32 * b + 2 * j + 1]])
                                .to_f32();
                        *a = (s as f32).mul_add(dw * dx, *a);
                    }
                }
            }
        }
        acc
    }
}

impl GroupKernel for Portable {
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
