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
use foxedge_core::quant::{BLOCK, Q4_BYTES, Q8_BYTES, WeightFormat, encode_row};
use foxedge_core::{Error, Result};
use half::f16;

/// The name of this layout where it is stored (a model file's metadata): a file that names
/// another layout must not be read as this one.
pub const PACKED_LAYOUT: &str = "packed16";

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

/// Packed Q8 or Q4 tiles borrowed from anywhere (an owned [`PackedWeights`], or a
/// memory-mapped file that stores this layout): what the kernels read.
#[derive(Debug, Clone, Copy)]
pub struct PackedView<'a> {
    format: WeightFormat,
    out: usize,
    inp: usize,
    pairs: usize,
    tiles: &'a [u8],
}

/// Row groups and tile pairs of an `out x inp` matrix in `format` (a block format).
fn dims(format: WeightFormat, out: usize, inp: usize) -> Result<(usize, usize, usize)> {
    if !format.is_block() {
        return Err(Error::BadArgument("only Q8 and Q4 weights are packed"));
    }
    if out == 0 || inp == 0 {
        return Err(Error::BadShape("weight matrix sizes must be > 0"));
    }
    let (groups, pairs) = (out.div_ceil(GROUP), inp.div_ceil(2 * BLOCK));
    let bytes = groups
        .checked_mul(pairs)
        .and_then(|n| n.checked_mul(tile_bytes(format)))
        .ok_or(Error::BadShape("packed matrix byte size overflows usize"))?;
    Ok((groups, pairs, bytes))
}

/// A zeroed buffer of `bytes` bytes starting at a 64-byte boundary: `(buf, start)`.
///
/// Errors: [`Error::Capacity`] (capacity = the bytes asked for) when it cannot be
/// allocated.
fn aligned_zeroed(bytes: usize) -> Result<(Vec<u8>, usize)> {
    let n = bytes.saturating_add(63);
    let mut buf = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| Error::Capacity {
        what: "packed weight bytes",
        capacity: n,
    })?;
    buf.resize(n, 0u8);
    let start = buf.as_ptr().align_offset(64).min(63);
    Ok((buf, start))
}

impl PackedWeights {
    /// Bytes of the packed tiles of an `out x inp` matrix in `format`: the canonical size
    /// (34 or 18 bytes per 32 weights) with rows padded to 16 and blocks to pairs.
    ///
    /// Errors: [`Error::BadArgument`] for a float format, [`Error::BadShape`] for a zero
    /// size or an overflow.
    pub fn packed_bytes(format: WeightFormat, out: usize, inp: usize) -> Result<usize> {
        Ok(dims(format, out, inp)?.2)
    }

    /// Repacks Q8 or Q4 weights, splitting the row groups over `threads` tasks.
    ///
    /// Errors: [`Error::BadArgument`] for a float format (those are used as stored),
    /// [`Error::Capacity`] when the tiles cannot be allocated.
    pub fn pack(w: &Weights<'_>, threads: usize) -> Result<Self> {
        let Data::Blocks(format, src) = w.data else {
            return Err(Error::BadArgument("only Q8 and Q4 weights are packed"));
        };
        let row_bytes = format.row_bytes(w.inp).unwrap_or(0);
        Self::build(
            format,
            w.out,
            w.inp,
            threads,
            |r0, rows, canon: &mut [u8]| {
                canon[..rows * row_bytes]
                    .copy_from_slice(&src[r0 * row_bytes..(r0 + rows) * row_bytes]);
                Ok::<(), Error>(())
            },
        )
    }

    /// Quantizes an `out x inp` matrix to Q8 or Q4 and packs it, one group of 16 rows at a
    /// time (no canonical copy of the whole matrix): `row(r, buf)` writes row `r`'s `inp`
    /// weights into `buf`; each row is encoded by `foxedge_core::quant::encode_row`. The
    /// groups are split over `threads` tasks on the current rayon pool.
    ///
    /// Errors: the first error of `row`; converted into `E`: [`Error::BadArgument`] for a
    /// float format or a weight that does not encode (NaN, infinite, too large),
    /// [`Error::Capacity`] when the tiles cannot be allocated.
    pub fn quantize<E, F>(
        format: WeightFormat,
        out: usize,
        inp: usize,
        threads: usize,
        row: F,
    ) -> core::result::Result<Self, E>
    where
        E: From<Error> + Send,
        F: Fn(usize, &mut [f32]) -> core::result::Result<(), E> + Sync,
    {
        let row_bytes = format
            .row_bytes(inp)
            .ok_or(Error::BadShape("row byte size overflows usize"))?;
        Self::build(format, out, inp, threads, |r0, rows, canon: &mut [u8]| {
            let mut w = vec![0.0f32; inp];
            for (i, dst) in canon.chunks_exact_mut(row_bytes).take(rows).enumerate() {
                row(r0 + i, &mut w)?;
                encode_row(format, &w, dst)?;
            }
            Ok(())
        })
    }

    /// Fills every group from `fill(r0, rows, canonical)`, which writes the canonical
    /// blocks of rows `r0..r0 + rows` (at most 16) into `canonical`.
    fn build<E, F>(
        format: WeightFormat,
        out: usize,
        inp: usize,
        threads: usize,
        fill: F,
    ) -> core::result::Result<Self, E>
    where
        E: From<Error> + Send,
        F: Fn(usize, usize, &mut [u8]) -> core::result::Result<(), E> + Sync,
    {
        let (groups, pairs, bytes) = dims(format, out, inp)?;
        let row_bytes = format.row_bytes(inp).unwrap_or(0);
        let group_bytes = pairs * tile_bytes(format);
        let (mut buf, start) = aligned_zeroed(bytes)?;
        let per = groups.div_ceil(threads.max(1)).max(1);
        let body = &mut buf[start..start + bytes];
        let task = |(c, dst): (usize, &mut [u8])| -> core::result::Result<(), E> {
            let mut canon = vec![0u8; GROUP * row_bytes];
            for (gi, g) in dst.chunks_exact_mut(group_bytes).enumerate() {
                let r0 = (c * per + gi) * GROUP;
                let rows = out.saturating_sub(r0).min(GROUP);
                fill(r0, rows, &mut canon)?;
                pack_group(format, &canon[..rows * row_bytes], row_bytes, g);
            }
            Ok(())
        };
        if threads > 1 {
            use rayon::prelude::*;
            body.par_chunks_mut(per * group_bytes)
                .enumerate()
                .try_for_each(task)?;
        } else {
            body.chunks_mut(per * group_bytes)
                .enumerate()
                .try_for_each(task)?;
        }
        Ok(Self {
            format,
            out,
            inp,
            pairs,
            buf,
            start,
        })
    }

    /// An owned, 64-byte aligned copy of `view`'s tiles.
    ///
    /// Errors: [`Error::Capacity`] when the copy cannot be allocated.
    pub fn copy_of(view: &PackedView<'_>) -> Result<Self> {
        let (mut buf, start) = aligned_zeroed(view.tiles.len())?;
        buf[start..start + view.tiles.len()].copy_from_slice(view.tiles);
        Ok(Self {
            format: view.format,
            out: view.out,
            inp: view.inp,
            pairs: view.pairs,
            buf,
            start,
        })
    }

    /// The tiles, borrowed.
    pub fn view(&self) -> PackedView<'_> {
        PackedView {
            format: self.format,
            out: self.out,
            inp: self.inp,
            pairs: self.pairs,
            tiles: &self.buf[self.start..],
        }
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
}

impl<'a> PackedView<'a> {
    /// Tiles of an `out x inp` matrix in `format` stored in this layout (e.g. in a file),
    /// exactly [`PackedWeights::packed_bytes`] bytes. Any alignment is read correctly; a
    /// 64-byte aligned start reads fastest. Every byte pattern is a matrix (a non-finite
    /// scale gives non-finite outputs: see [`PackedView::first_bad_scale`]).
    ///
    /// Errors: [`Error::BadArgument`] for a float format, [`Error::BadShape`] for a zero
    /// size, [`Error::BadLength`] for a wrong byte count.
    pub fn new(format: WeightFormat, tiles: &'a [u8], out: usize, inp: usize) -> Result<Self> {
        let (_, pairs, bytes) = dims(format, out, inp)?;
        if tiles.len() != bytes {
            return Err(Error::BadLength {
                what: "packed weight bytes",
                expected: bytes,
                got: tiles.len(),
            });
        }
        Ok(Self {
            format,
            out,
            inp,
            pairs,
            tiles,
        })
    }

    /// The stored bytes (what [`PackedView::new`] takes back).
    pub fn tiles(&self) -> &'a [u8] {
        &self.tiles[..self.out.div_ceil(GROUP) * self.pairs * tile_bytes(self.format)]
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
    pub(crate) fn group(&self, g: usize) -> &'a [u8] {
        let n = self.pairs * tile_bytes(self.format);
        &self.tiles[g * n..(g + 1) * n]
    }

    /// `(row, block)` of the first scale (padding included) that is NaN or infinite, if
    /// any: such a scale makes every product with its row, or with every row of its group
    /// when it pads, non-finite.
    pub fn first_bad_scale(&self) -> Option<(usize, usize)> {
        let tb = tile_bytes(self.format);
        for (g, group) in self.tiles().chunks_exact(self.pairs * tb).enumerate() {
            for (p, tile) in group.chunks_exact(tb).enumerate() {
                for (i, s) in tile[..HEAD].chunks_exact(2).enumerate() {
                    if !f16::from_le_bytes([s[0], s[1]]).is_finite() {
                        return Some((g * GROUP + i % GROUP, 2 * p + i / GROUP));
                    }
                }
            }
        }
        None
    }

    /// Dequantizes row `r` into `out` (`inp` values): `w = d q` (Q8) or
    /// `d Q4_LEVELS[index]` (Q4), as `foxedge_core::quant::decode_row` of the canonical row.
    ///
    /// Errors: [`Error::BadArgument`] for `r >= out`, [`Error::BadLength`] for a wrong
    /// `out` length.
    pub fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        if r >= self.out {
            return Err(Error::BadArgument("packed row index out of range"));
        }
        if out.len() != self.inp {
            return Err(Error::BadLength {
                what: "decoded packed row",
                expected: self.inp,
                got: out.len(),
            });
        }
        let (g, j) = (r / GROUP, r % GROUP);
        let (tiles, f) = (self.group(g), self.format);
        for (k, o) in out.chunks_mut(BLOCK).enumerate() {
            let (p, b) = (k / 2, k % 2);
            let tile = &tiles[p * tile_bytes(f)..(p + 1) * tile_bytes(f)];
            let d = f16::from_le_bytes([tile[32 * b + 2 * j], tile[32 * b + 2 * j + 1]]).to_f32();
            let q = &tile[HEAD + b * block_bytes(f)..HEAD + (b + 1) * block_bytes(f)];
            for (i, v) in o.iter_mut().enumerate() {
                let level = match f {
                    WeightFormat::Q8 => q[64 * (i / 4) + 4 * j + i % 4] as i8,
                    _ => {
                        let (c, t) = ((i % 16) / 4, i % 4);
                        let byte = q[64 * c + 4 * j + t];
                        let idx = if i < 16 { byte & 15 } else { byte >> 4 };
                        foxedge_core::quant::Q4_LEVELS[usize::from(idx)]
                    }
                };
                *v = d * f32::from(level);
            }
        }
        Ok(())
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
