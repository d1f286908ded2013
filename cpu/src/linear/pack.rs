//! Q8 / Q4 weights repacked for the integer kernels: 16 rows interleaved so that one
//! 64-byte load holds 4 consecutive weights of each of 16 rows (one `i32` lane per row
//! of an AVX-512 dot product), with the 16 rows' scales of two blocks in front.
//!
//! Layout: row groups `g` of [`GROUP`] rows, each `pairs` tiles of two blocks (`k = 2p`,
//! `2p + 1`); tiles are contiguous, group after group, from a 64-byte boundary. A tile:
//!
//! ```text
//! [0, 64)              f16 scales: block b's rows j = 0..16 at 32 b + 2 j
//! [64 + b QB, ...)     block b's weights, QB = 512 (Q8) or 256 (Q4) bytes:
//!   Q8: chunk c = 0..8 at 64 c: row j at 4 j, its weights 4c..4c+4 (i8)
//!   Q4: chunk c = 0..4 at 64 c: row j at 4 j, byte t = 0..4 holds the level index of
//!       weight 4c+t (low nibble) and of weight 16+4c+t (high nibble)
//! ```
//!
//! Rows past `out` and blocks past `ceil(inp / 32)` are zero (scale 0). The packed size
//! equals the canonical one (34 or 18 bytes per 32 weights) up to that padding.
//!
//! Why repack: a Q8 matrix-vector product streaming the canonical 34-byte blocks row by
//! row (AVX-512 VNNI, one block per 256-bit dot product, scale per block) reads at most
//! ~28 GB/s on one Zen 4 thread even from cache, about the DRAM rate of one thread; this
//! layout reaches 75-80 GB/s in cache (a scale vector per 16 rows, 64-byte aligned loads,
//! one `i32` lane per row), so decode stays memory-bound (`examples/linear_bw.rs cache`).

use super::{Data, Weights};
use foxedge_core::quant::{BLOCK, Q4_BYTES, Q8_BYTES, WeightFormat};
use foxedge_core::{Error, Result};

/// Rows interleaved in one group.
pub(crate) const GROUP: usize = 16;
/// Bytes of the scale header of a tile.
pub(crate) const HEAD: usize = 64;

/// Weight bytes of one block of a group (16 rows): Q8 512, Q4 256.
pub(crate) const fn block_bytes(f: WeightFormat) -> usize {
    if matches!(f, WeightFormat::Q8) {
        512
    } else {
        256
    }
}

/// Bytes of one tile (two blocks of 16 rows with their scales).
pub(crate) const fn tile_bytes(f: WeightFormat) -> usize {
    HEAD + 2 * block_bytes(f)
}

/// Q8 or Q4 weights in the interleaved layout of the module docs, owned, 64-byte aligned.
#[derive(Debug, Clone)]
pub struct PackedWeights {
    format: WeightFormat,
    out: usize,
    inp: usize,
    pairs: usize,
    /// The tiles start at `buf[start]`, a 64-byte boundary.
    buf: Vec<u8>,
    start: usize,
}

impl PackedWeights {
    /// Repacks Q8 or Q4 weights, splitting the row groups over `threads` tasks.
    ///
    /// Errors: [`Error::BadArgument`] for a float format (those are used as stored).
    pub fn pack(w: &Weights<'_>, threads: usize) -> Result<Self> {
        let Data::Blocks(format, src) = w.data else {
            return Err(Error::BadArgument("only Q8 and Q4 weights are packed"));
        };
        let pairs = w.inp.div_ceil(2 * BLOCK);
        let groups = w.out.div_ceil(GROUP);
        let group_bytes = pairs * tile_bytes(format);
        let mut buf = vec![0u8; groups * group_bytes + 63];
        let start = buf.as_ptr().align_offset(64).min(63);
        let row_bytes = format.row_bytes(w.inp).unwrap_or(0);
        let per = groups.div_ceil(threads.max(1)).max(1);
        let body = &mut buf[start..start + groups * group_bytes];
        let fill = |(c, dst): (usize, &mut [u8])| {
            for (gi, g) in dst.chunks_exact_mut(group_bytes).enumerate() {
                let r0 = (c * per + gi) * GROUP;
                let rows = w.out.saturating_sub(r0).min(GROUP);
                pack_group(
                    format,
                    &src[r0 * row_bytes..(r0 + rows) * row_bytes],
                    row_bytes,
                    g,
                );
            }
        };
        if threads > 1 {
            use rayon::prelude::*;
            body.par_chunks_mut(per * group_bytes)
                .enumerate()
                .for_each(fill);
        } else {
            body.chunks_mut(per * group_bytes)
                .enumerate()
                .for_each(fill);
        }
        Ok(Self {
            format,
            out: w.out,
            inp: w.inp,
            pairs,
            buf,
            start,
        })
    }

    /// Q8 or Q4.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Output features (rows of `W`).
    pub fn out(&self) -> usize {
        self.out
    }

    /// Input features (columns of `W`).
    pub fn inp(&self) -> usize {
        self.inp
    }

    /// Bytes held (tiles and alignment slack).
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// Blocks per row including the padding to whole tiles.
    pub(crate) fn padded_blocks(&self) -> usize {
        2 * self.pairs
    }

    /// Tiles per group.
    pub(crate) fn pairs(&self) -> usize {
        self.pairs
    }

    /// The tiles of row group `g`.
    #[inline(always)]
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let n = self.pairs * tile_bytes(self.format);
        &self.buf[self.start + g * n..self.start + (g + 1) * n]
    }
}

/// Packs up to 16 rows (`src`: `rows` canonical rows of `row_bytes`) into one group `dst`.
fn pack_group(format: WeightFormat, src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    let (unit, qb) = match format {
        WeightFormat::Q8 => (Q8_BYTES, 512),
        _ => (Q4_BYTES, 256),
    };
    for (j, row) in src.chunks_exact(row_bytes).enumerate() {
        for (k, blk) in row.chunks_exact(unit).enumerate() {
            let (p, b) = (k / 2, k % 2);
            let tile = &mut dst[p * tile_bytes(format)..(p + 1) * tile_bytes(format)];
            tile[32 * b + 2 * j..32 * b + 2 * j + 2].copy_from_slice(&blk[..2]);
            let q = &blk[2..];
            let base = HEAD + b * qb + 4 * j;
            // Q8: chunk c holds weights 4c..4c+4. Q4: chunk c holds canonical bytes
            // 4c..4c+4, which carry weights 4c+t (low) and 16+4c+t (high).
            for (c, four) in q.chunks_exact(4).enumerate() {
                tile[base + 64 * c..base + 64 * c + 4].copy_from_slice(four);
            }
        }
    }
}
