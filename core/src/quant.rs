//! Weight storage formats: the byte layout of a row of `W [out, in]` in each
//! [`WeightFormat`], and the scalar quantize / dequantize references.
//!
//! A matrix is `out` rows stored one after another; a row of `in` weights takes
//! [`WeightFormat::row_bytes`] bytes. All multi-byte fields are little-endian.
//!
//! - `F32`, `F16`, `Bf16`: one IEEE value per weight (bf16 = the top 16 bits of an f32).
//! - `Q8` ([`BlockQ8`], 34 bytes per 32 weights, 8.5 bits/weight): an f16 scale `d`, then
//!   32 `i8` values `q`; `w = d * q`, `|q| <= 127`.
//! - `Q4` ([`BlockQ4`], 18 bytes per 32 weights, 4.5 bits/weight): an f16 scale `d`, then
//!   16 bytes of 4-bit indices (byte `j`: weight `j` in the low nibble, weight `j + 16` in
//!   the high nibble); `w = d * Q4_LEVELS[index]`.
//!
//! Block formats store `ceil(in / 32)` blocks per row; the weights of the last block past
//! `in` are encoded as zero and never read by a product (activations there are zero).
//!
//! Q4 uses 16 non-uniform levels ([`Q4_LEVELS`]) instead of the uniform `q - 8`: at the
//! same 4.5 bits/weight, the levels and the scale search of [`BlockQ4::quantize`] give a
//! 13% lower relative RMS error on the bundled model's weights (0.0762 against 0.0872
//! for `q - 8` with the largest-magnitude weight on `-8`: a quarter less squared error;
//! 4-bit with a scale and an offset, 5 bits/weight: 0.0789). The kernels pay one byte
//! shuffle per 16 weights for the table.

use crate::error::{Error, Result};
use core::fmt;
use core::str::FromStr;
use half::{bf16, f16};

/// Weights per block of the block formats.
pub const BLOCK: usize = 32;
/// Bytes of one [`BlockQ8`].
pub const Q8_BYTES: usize = 34;
/// Bytes of one [`BlockQ4`].
pub const Q4_BYTES: usize = 18;

/// The 16 levels of [`BlockQ4`], in units of the block scale: `w = d * Q4_LEVELS[i]`.
///
/// Fitted once (Lloyd's algorithm) to Gaussian blocks of 32 divided by their
/// largest-magnitude element, so that element sits on the top level; as `i8` values so
/// that the integer kernels multiply them directly. Consecutive gaps are at most 28, and
/// the bottom level is 17 short of `-127`.
pub const Q4_LEVELS: [i8; 16] = [
    -110, -86, -67, -51, -37, -25, -13, -2, 8, 19, 31, 44, 59, 77, 99, 127,
];

/// How a weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    Q8,
    Q4,
}

impl WeightFormat {
    /// Every format, widest first.
    pub const ALL: [WeightFormat; 5] = [Self::F32, Self::F16, Self::Bf16, Self::Q8, Self::Q4];

    /// The lower-case name used on the command line and in file metadata.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8 => "q8",
            Self::Q4 => "q4",
        }
    }

    /// Whether weights come in blocks of [`BLOCK`] sharing a scale.
    pub const fn is_block(self) -> bool {
        matches!(self, Self::Q8 | Self::Q4)
    }

    /// Weights per storage unit: [`BLOCK`] for block formats, 1 otherwise.
    pub const fn unit_len(self) -> usize {
        if self.is_block() { BLOCK } else { 1 }
    }

    /// Bytes per storage unit (one value, or one block).
    pub const fn unit_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q8 => Q8_BYTES,
            Self::Q4 => Q4_BYTES,
        }
    }

    /// Storage bits per weight (block formats include the scale): 32, 16, 16, 8.5, 4.5.
    pub fn bits_per_weight(self) -> f32 {
        (self.unit_bytes() * 8) as f32 / self.unit_len() as f32
    }

    /// Bytes of a row of `inp` weights, `None` on overflow.
    pub const fn row_bytes(self, inp: usize) -> Option<usize> {
        inp.div_ceil(self.unit_len()).checked_mul(self.unit_bytes())
    }

    /// Bytes of an `out x inp` matrix. Errors: [`Error::BadShape`] on overflow.
    pub fn matrix_bytes(self, out: usize, inp: usize) -> Result<usize> {
        self.row_bytes(inp)
            .and_then(|r| r.checked_mul(out))
            .ok_or(Error::BadShape("weight matrix byte size overflows usize"))
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightFormat {
    type Err = Error;
    /// Parses a [`WeightFormat::name`] (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or(Error::BadArgument(
                "unknown weight format (expected f32, f16, bf16, q8 or q4)",
            ))
    }
}

/// 32 weights as `w = d * q`: an f16 scale and 32 `i8` with `|q| <= 127`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8 {
    /// The scale `d` as f16 bits.
    pub d: u16,
    pub qs: [i8; BLOCK],
}

impl BlockQ8 {
    /// Round-to-nearest with `d` = the smallest f16 `>= max|w| / 127`, so no weight is
    /// clipped and every weight is within half a step: `|w - d q| <= d / 2`.
    ///
    /// Errors: [`Error::BadArgument`] for a NaN or infinite weight, or `max|w| / 127`
    /// above the largest f16 (65504).
    pub fn quantize(w: &[f32; BLOCK]) -> Result<Self> {
        let amax = abs_max(w)?;
        let d = f16_at_least(amax / 127.0)?;
        let df = f64::from(d.to_f32());
        let mut qs = [0i8; BLOCK];
        if df > 0.0 {
            for (q, &x) in qs.iter_mut().zip(w) {
                *q = libm::round(f64::from(x) / df).clamp(-127.0, 127.0) as i8;
            }
        }
        Ok(Self { d: d.to_bits(), qs })
    }

    /// The scale as f32.
    pub fn scale(&self) -> f32 {
        f16::from_bits(self.d).to_f32()
    }

    /// `out[i] = d * q[i]`.
    pub fn dequantize(&self, out: &mut [f32; BLOCK]) {
        let d = self.scale();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }

    /// The 34-byte layout: `d` (little-endian), then `qs`.
    pub fn to_bytes(&self) -> [u8; Q8_BYTES] {
        let mut b = [0u8; Q8_BYTES];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        for (o, &q) in b[2..].iter_mut().zip(&self.qs) {
            *o = q as u8;
        }
        b
    }

    /// Inverse of [`BlockQ8::to_bytes`]. Every byte pattern is a block (a `-128` byte
    /// is read as is; the quantizer never writes it).
    pub fn from_bytes(b: &[u8; Q8_BYTES]) -> Self {
        let mut qs = [0i8; BLOCK];
        for (q, &x) in qs.iter_mut().zip(&b[2..]) {
            *q = x as i8;
        }
        Self {
            d: u16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }
}

/// 32 weights as `w = d * Q4_LEVELS[i]`: an f16 scale (of either sign) and 32 4-bit
/// indices, packed as in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4 {
    /// The scale `d` as f16 bits.
    pub d: u16,
    /// Byte `j`: index of weight `j` in bits 0..4, of weight `j + 16` in bits 4..8.
    pub qs: [u8; BLOCK / 2],
}

/// Factors of `m / 127` tried as scales (`m` = the block's largest-magnitude weight).
const Q4_SEARCH: [f32; 4] = [1.0, 0.95, 0.9, 0.85];

impl BlockQ4 {
    /// The scale minimising the block's squared error `sum (w - d L[i])^2` over a small
    /// candidate set, each weight taking its nearest level. Candidates: `d = f m / 127`
    /// for `f` in 1, 0.95, 0.9, 0.85 (`m` the signed largest-magnitude weight, so it
    /// lands near the top level 127), each followed by its least-squares refit
    /// `d = sum w L / sum L^2` for the chosen levels; f16-rounded before scoring.
    ///
    /// Bound: the first candidate `d0` (`|m| / 127` rounded up to f16, sign of `m`) puts
    /// every weight within `[-127, 127] |d0|`, so its error per weight is at most
    /// `17 |d0|` (below the bottom level) and elsewhere half the largest gap, `14 |d0|`;
    /// the result's squared error is never above that candidate's.
    ///
    /// Errors: as [`BlockQ8::quantize`].
    pub fn quantize(w: &[f32; BLOCK]) -> Result<Self> {
        let m = signed_abs_max(w)?;
        let mut best = Self::from_indices(0, &[7; BLOCK]);
        if m == 0.0 {
            return Ok(best);
        }
        let d0 = f16_at_least(libm::fabsf(m) / 127.0)?;
        let d0 = if m < 0.0 { -d0 } else { d0 };
        let mut best_err = f32::INFINITY;
        for (k, f) in Q4_SEARCH.into_iter().enumerate() {
            let d = if k == 0 {
                d0
            } else {
                f16::from_f32(f * m / 127.0)
            };
            let mut idx = [0u8; BLOCK];
            let err = q4_assign(w, d.to_f32(), &mut idx);
            if err < best_err {
                (best, best_err) = (Self::from_indices(d.to_bits(), &idx), err);
            }
            let refit = q4_refit(w, &idx);
            let err = q4_assign(w, refit.to_f32(), &mut idx);
            if err < best_err {
                (best, best_err) = (Self::from_indices(refit.to_bits(), &idx), err);
            }
        }
        Ok(best)
    }

    /// A block from its scale bits and 32 indices (each `< 16`; higher bits are dropped).
    pub fn from_indices(d: u16, idx: &[u8; BLOCK]) -> Self {
        let mut qs = [0u8; BLOCK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (idx[j] & 15) | (idx[j + BLOCK / 2] << 4);
        }
        Self { d, qs }
    }

    /// The level index of weight `j < 32`.
    pub fn index(&self, j: usize) -> u8 {
        let b = self.qs[j % (BLOCK / 2)];
        if j < BLOCK / 2 { b & 15 } else { b >> 4 }
    }

    /// The scale as f32.
    pub fn scale(&self) -> f32 {
        f16::from_bits(self.d).to_f32()
    }

    /// `out[j] = d * Q4_LEVELS[index(j)]`.
    pub fn dequantize(&self, out: &mut [f32; BLOCK]) {
        let d = self.scale();
        for (j, o) in out.iter_mut().enumerate() {
            *o = d * f32::from(Q4_LEVELS[usize::from(self.index(j))]);
        }
    }

    /// The 18-byte layout: `d` (little-endian), then `qs`.
    pub fn to_bytes(&self) -> [u8; Q4_BYTES] {
        let mut b = [0u8; Q4_BYTES];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..].copy_from_slice(&self.qs);
        b
    }

    /// Inverse of [`BlockQ4::to_bytes`]; every byte pattern is a block.
    pub fn from_bytes(b: &[u8; Q4_BYTES]) -> Self {
        let mut qs = [0u8; BLOCK / 2];
        qs.copy_from_slice(&b[2..]);
        Self {
            d: u16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }
}

/// Offset of `floor(2 v)` in [`Q4_NEAREST`]: the table covers `v` in `[-160, 160)`.
const HALF_OFF: i32 = 320;

/// `Q4_NEAREST[floor(2 v) + 320]` = the index of the level nearest to `v` (in units of
/// `d`). Midpoints of integer levels are multiples of 1/2, so the nearest level is
/// constant on each half-unit cell; a tie on a cell's left edge goes up. Values outside
/// the table clamp to its ends, whose nearest levels are the extreme ones.
const Q4_NEAREST: [u8; 640] = {
    let mut t = [0u8; 640];
    let mut k = 0;
    while k < 640 {
        // The cell [c/2, (c+1)/2) with c = k - 320; compare distances from its centre
        // (2c + 1)/4 in quarter units (odd against multiples of 4: never equal).
        let centre = 2 * (k as i32 - HALF_OFF) + 1;
        let (mut best, mut dist) = (0, i32::MAX);
        let mut i = 0;
        while i < 16 {
            let e = (4 * Q4_LEVELS[i] as i32 - centre).abs();
            if e < dist {
                (best, dist) = (i, e);
            }
            i += 1;
        }
        t[k] = best as u8;
        k += 1;
    }
    t
};

/// The nearest level index of each `w / d` into `idx`, and the squared error.
fn q4_assign(w: &[f32; BLOCK], d: f32, idx: &mut [u8; BLOCK]) -> f32 {
    if d == 0.0 || !d.is_finite() {
        return f32::INFINITY;
    }
    let inv2 = 2.0 / d;
    for (i, &x) in idx.iter_mut().zip(w) {
        // floor(2 v) + 320 for 2 v >= -320 (truncation of a non-negative value); below
        // that `as` (which saturates) gives at most 0, and the clamp keeps the table end.
        let cell = ((x * inv2 + HALF_OFF as f32) as i32).clamp(0, 639);
        *i = Q4_NEAREST[cell as usize];
    }
    // Four partial sums: independent additions instead of one chain of 32.
    let mut err = [0.0f32; 4];
    for (k, (&x, &i)) in w.iter().zip(idx.iter()).enumerate() {
        let e = x - d * f32::from(Q4_LEVELS[usize::from(i)]);
        err[k % 4] += e * e;
    }
    (err[0] + err[1]) + (err[2] + err[3])
}

/// The least-squares scale for fixed levels, `sum w L / sum L^2`, rounded to f16.
fn q4_refit(w: &[f32; BLOCK], idx: &[u8; BLOCK]) -> f16 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &i) in w.iter().zip(idx) {
        let l = f64::from(Q4_LEVELS[usize::from(i)]);
        num += f64::from(x) * l;
        den += l * l;
    }
    f16::from_f64(num / den)
}

/// `max |w|`; errors on a NaN or infinite weight.
fn abs_max(w: &[f32]) -> Result<f32> {
    Ok(libm::fabsf(signed_abs_max(w)?))
}

/// The element of largest magnitude (the first of ties), with its sign.
fn signed_abs_max(w: &[f32]) -> Result<f32> {
    let mut m = 0.0f32;
    for &x in w {
        if !x.is_finite() {
            return Err(Error::BadArgument("a weight is NaN or infinite"));
        }
        if libm::fabsf(x) > libm::fabsf(m) {
            m = x;
        }
    }
    Ok(m)
}

/// The smallest f16 `>= x` for finite `x >= 0`. Errors when that is infinite.
fn f16_at_least(x: f32) -> Result<f16> {
    let mut h = f16::from_f32(x);
    if h.to_f32() < x {
        h = f16::from_bits(h.to_bits() + 1);
    }
    if h.is_infinite() {
        return Err(Error::BadArgument(
            "a weight is too large for an f16 block scale (|w| > 127 * 65504)",
        ));
    }
    Ok(h)
}

/// Encodes one row of `w.len()` weights into `out`, which must hold exactly
/// `format.row_bytes(w.len())` bytes. f16 and bf16 round to nearest even; block formats
/// use [`BlockQ8::quantize`] / [`BlockQ4::quantize`] with a zero-padded last block.
///
/// Errors: [`Error::BadLength`] for a wrong `out` length; [`Error::BadArgument`] for a
/// NaN or infinite weight, or one out of the format's range (f16: |w| > 65504).
pub fn encode_row(format: WeightFormat, w: &[f32], out: &mut [u8]) -> Result<()> {
    check_len("encoded row", format.row_bytes(w.len()), out.len())?;
    let unit = format.unit_bytes();
    match format {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            for (&x, o) in w.iter().zip(out.chunks_exact_mut(unit)) {
                if !x.is_finite() {
                    return Err(Error::BadArgument("a weight is NaN or infinite"));
                }
                match format {
                    WeightFormat::F32 => o.copy_from_slice(&x.to_le_bytes()),
                    WeightFormat::F16 => {
                        let h = f16::from_f32(x);
                        if h.is_infinite() {
                            return Err(Error::BadArgument("a weight is outside the f16 range"));
                        }
                        o.copy_from_slice(&h.to_le_bytes());
                    }
                    _ => o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                }
            }
        }
        WeightFormat::Q8 | WeightFormat::Q4 => {
            for (k, o) in out.chunks_exact_mut(unit).enumerate() {
                let mut blk = [0.0f32; BLOCK];
                let src = &w[k * BLOCK..w.len().min((k + 1) * BLOCK)];
                blk[..src.len()].copy_from_slice(src);
                if format == WeightFormat::Q8 {
                    o.copy_from_slice(&BlockQ8::quantize(&blk)?.to_bytes());
                } else {
                    o.copy_from_slice(&BlockQ4::quantize(&blk)?.to_bytes());
                }
            }
        }
    }
    Ok(())
}

/// Decodes one row of `out.len()` weights from `bytes` (exactly
/// `format.row_bytes(out.len())` bytes). Every byte pattern decodes (NaN included for the
/// float formats); errors: [`Error::BadLength`] for a wrong `bytes` length.
pub fn decode_row(format: WeightFormat, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_len("encoded row", format.row_bytes(out.len()), bytes.len())?;
    match format {
        WeightFormat::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Q8 => {
            for (o, b) in out.chunks_mut(BLOCK).zip(bytes.chunks_exact(Q8_BYTES)) {
                let mut blk = [0.0f32; BLOCK];
                if let Some(b) = b.first_chunk() {
                    BlockQ8::from_bytes(b).dequantize(&mut blk);
                }
                o.copy_from_slice(&blk[..o.len()]);
            }
        }
        WeightFormat::Q4 => {
            for (o, b) in out.chunks_mut(BLOCK).zip(bytes.chunks_exact(Q4_BYTES)) {
                let mut blk = [0.0f32; BLOCK];
                if let Some(b) = b.first_chunk() {
                    BlockQ4::from_bytes(b).dequantize(&mut blk);
                }
                o.copy_from_slice(&blk[..o.len()]);
            }
        }
    }
    Ok(())
}

fn check_len(what: &'static str, expected: Option<usize>, got: usize) -> Result<()> {
    match expected {
        Some(e) if e == got => Ok(()),
        Some(e) => Err(Error::BadLength {
            what,
            expected: e,
            got,
        }),
        None => Err(Error::BadShape("row byte size overflows usize")),
    }
}

#[cfg(test)]
mod tests;
