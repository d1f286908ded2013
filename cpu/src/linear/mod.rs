//! Dense linear layers `y = x Wᵀ + (y if accumulating)` with `W [out, in]` row-major
//! (PyTorch's `Linear.weight`) in any [`WeightFormat`], for one activation row (decode:
//! a matrix-vector product that streams `W` once) or several (prefill: tiles of rows x
//! outputs so that each weight is read once per tile of rows).
//!
//! - f32 / f16 / bf16 ([`Weights`] borrowed as stored): widened to f32 in registers,
//!   f32 multiply-adds ([`float`]).
//! - Q8 / Q4 ([`PackedWeights`] owned, repacked from the canonical blocks of
//!   [`foxedge_core::quant`] or quantized group by group; [`PackedView`] the same tiles
//!   borrowed, e.g. from a model file that stores them): activations quantized per block
//!   of 32 to `i8` with an f32 scale ([`act`]), integer dot products per block (AVX-512 VNNI, AVX2, NEON `sdot` or
//!   `smull`, or plain Rust), and `y += d_w d_x sum(q_w q_x)` in f32, block by block.
//!   All integer kernels give the same bits as the scalar reference ([`int8`]).
//!
//! Threads: `threads` splits the outputs into that many contiguous ranges run on the
//! current rayon pool (1 or 0: the calling thread only). Each output is computed by one
//! task in a fixed order, so results do not depend on `threads`.

mod act;
mod float;
mod int8;
mod many;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pack;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;

pub use foxedge_core::quant::WeightFormat;
pub use many::{Product, linear_many, linear_many_with_isa};
pub use pack::{PACKED_LAYOUT, PackedView, PackedWeights};

/// Up to this many activation rows, each row's outputs are the bits that row gives alone
/// (a matrix-vector product), in every format and on every instruction set: float
/// products sum every output in one order up to here (beyond it `gemm` runs them), Q8 / Q4
/// quantize and sum each row on its own. Sessions decoding in one batch rely on it.
pub const ROW_EXACT_ROWS: usize = 64;

use crate::simd::Isa;
use foxedge_core::{Error, Result};
use half::{bf16, f16};

/// A weight matrix `W [out, inp]` borrowed in its stored format (e.g. from a memory map).
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    out: usize,
    inp: usize,
    data: Data<'a>,
}

#[derive(Debug, Clone, Copy)]
enum Data<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    /// Canonical blocks, `out` rows of `row_bytes(inp)` bytes.
    Blocks(WeightFormat, &'a [u8]),
}

impl<'a> Weights<'a> {
    /// f32 weights, `out * inp` values. Errors: [`Error::BadShape`] for a zero size,
    /// [`Error::BadLength`] for a wrong slice length.
    pub fn f32(w: &'a [f32], out: usize, inp: usize) -> Result<Self> {
        check(WeightFormat::F32, w.len() * 4, out, inp)?;
        Ok(Self {
            out,
            inp,
            data: Data::F32(w),
        })
    }

    /// f16 weights, `out * inp` values. Errors as [`Weights::f32`].
    pub fn f16(w: &'a [f16], out: usize, inp: usize) -> Result<Self> {
        check(WeightFormat::F16, w.len() * 2, out, inp)?;
        Ok(Self {
            out,
            inp,
            data: Data::F16(w),
        })
    }

    /// bf16 weights, `out * inp` values. Errors as [`Weights::f32`].
    pub fn bf16(w: &'a [bf16], out: usize, inp: usize) -> Result<Self> {
        check(WeightFormat::Bf16, w.len() * 2, out, inp)?;
        Ok(Self {
            out,
            inp,
            data: Data::Bf16(w),
        })
    }

    /// Weights of any format from their stored bytes (little-endian; block formats as
    /// laid out by `foxedge_core::quant`), exactly `format.matrix_bytes(out, inp)` bytes.
    ///
    /// Errors: [`Error::BadShape`], [`Error::BadLength`] as [`Weights::f32`];
    /// [`Error::BadArgument`] when f32 / f16 / bf16 bytes are not aligned to their element
    /// (copy them to an aligned buffer first). Every byte pattern is accepted otherwise.
    pub fn from_bytes(
        format: WeightFormat,
        bytes: &'a [u8],
        out: usize,
        inp: usize,
    ) -> Result<Self> {
        check(format, bytes.len(), out, inp)?;
        let misaligned = Error::BadArgument("float weight bytes are not aligned to their element");
        let data = match format {
            WeightFormat::F32 => Data::F32(cast(bytes).ok_or(misaligned)?),
            WeightFormat::F16 => {
                let b: &[u16] = cast(bytes).ok_or(misaligned)?;
                Data::F16(half::slice::HalfBitsSliceExt::reinterpret_cast(b))
            }
            WeightFormat::Bf16 => {
                let b: &[u16] = cast(bytes).ok_or(misaligned)?;
                Data::Bf16(half::slice::HalfBitsSliceExt::reinterpret_cast(b))
            }
            WeightFormat::Q8 | WeightFormat::Q4 => Data::Blocks(format, bytes),
        };
        Ok(Self { out, inp, data })
    }

    /// The storage format.
    pub fn format(&self) -> WeightFormat {
        match self.data {
            Data::F32(_) => WeightFormat::F32,
            Data::F16(_) => WeightFormat::F16,
            Data::Bf16(_) => WeightFormat::Bf16,
            Data::Blocks(f, _) => f,
        }
    }

    /// Output features (rows of `W`).
    pub fn out(&self) -> usize {
        self.out
    }

    /// Input features (columns of `W`).
    pub fn inp(&self) -> usize {
        self.inp
    }
}

/// `bytes` as a slice of `T` (a plain number type) if it is aligned for `T`.
fn cast<T: bytes::Plain>(bytes: &[u8]) -> Option<&[T]> {
    // SAFETY: `T` is a plain number type (sealed: f32, u16) for which every bit pattern is
    // a value; `align_to` only yields a middle part that is aligned and in bounds.
    let (head, mid, tail) = unsafe { bytes.align_to::<T>() };
    (head.is_empty() && tail.is_empty()).then_some(mid)
}

mod bytes {
    /// Number types valid for every bit pattern.
    pub trait Plain: Copy {}
    impl Plain for f32 {}
    impl Plain for u16 {}
}

/// Checks sizes: `out, inp > 0` and `len` = the matrix's byte size.
fn check(format: WeightFormat, len: usize, out: usize, inp: usize) -> Result<()> {
    if out == 0 || inp == 0 {
        return Err(Error::BadShape("weight matrix sizes must be > 0"));
    }
    let expected = format.matrix_bytes(out, inp)?;
    if len != expected {
        return Err(Error::BadLength {
            what: "weight matrix bytes",
            expected,
            got: len,
        });
    }
    Ok(())
}

/// The right-hand side of [`linear`]: weights as stored, or repacked.
#[derive(Debug, Clone, Copy)]
pub enum Matrix<'a> {
    /// Any format as stored. Q8 / Q4 as stored run the scalar reference: pack them.
    Stored(Weights<'a>),
    /// Q8 / Q4 repacked for the integer kernels (owned or borrowed from a file).
    Packed(PackedView<'a>),
}

impl<'a> From<Weights<'a>> for Matrix<'a> {
    fn from(w: Weights<'a>) -> Self {
        Matrix::Stored(w)
    }
}

impl<'a> From<&'a PackedWeights> for Matrix<'a> {
    fn from(w: &'a PackedWeights) -> Self {
        Matrix::Packed(w.view())
    }
}

impl<'a> From<PackedView<'a>> for Matrix<'a> {
    fn from(w: PackedView<'a>) -> Self {
        Matrix::Packed(w)
    }
}

impl Matrix<'_> {
    /// `(out, inp)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Matrix::Stored(w) => (w.out, w.inp),
            Matrix::Packed(p) => (p.out(), p.inp()),
        }
    }
}

/// `y[t, o] = sum_i x[t, i] W[o, i]` for `t < rows`, `o < out` (plus the old `y[t, o]`
/// when `accumulate`), with the widest instruction set of this CPU. `x` is `[rows, inp]`
/// and `y` `[rows, out]`, row-major; `threads` as in the module docs.
///
/// Block formats quantize each 32-block of `x` to `i8` first (scale `max|x| / 127`, round
/// to nearest even): the result is the exact product of the quantized operands up to f32
/// rounding, and differs from `x Wᵀ` by at most `sum_blocks d_x / 2 * sum |W|` per output.
/// A block of `x` holding a NaN or an infinity gives NaN outputs.
///
/// Errors: [`Error::BadLength`] when `x` or `y` does not match the shapes.
pub fn linear<'a>(
    w: impl Into<Matrix<'a>>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    linear_with_isa(Isa::detect(), w, x, rows, y, accumulate, threads)
}

/// [`linear`] with a chosen instruction set (one this CPU lacks falls back to the widest
/// it has). `Isa::Scalar` runs the plain reference kernels.
pub fn linear_with_isa<'a>(
    isa: Isa,
    w: impl Into<Matrix<'a>>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    linear_many_with_isa(
        isa,
        &mut [Product {
            w: w.into(),
            y,
            accumulate,
        }],
        x,
        rows,
        threads,
    )
}

/// `Ok` when a buffer of `got` elements has the `expected` length (None: the shape's
/// product overflowed).
fn check_len(what: &'static str, expected: Option<usize>, got: usize) -> Result<()> {
    match expected {
        Some(e) if e == got => Ok(()),
        Some(expected) => Err(Error::BadLength {
            what,
            expected,
            got,
        }),
        None => Err(Error::BadShape("rows times features overflows usize")),
    }
}

/// Where a kernel writes: `y[t * ld + o]`, added to the old value when `accumulate`.
#[derive(Debug)]
struct Out<'y> {
    y: &'y mut [f32],
    ld: usize,
    accumulate: bool,
}

impl Out<'_> {
    /// Stores output `o` of row `t`.
    #[inline(always)]
    fn put(&mut self, t: usize, o: usize, v: f32) {
        let slot = &mut self.y[t * self.ld + o];
        *slot = if self.accumulate { *slot + v } else { v };
    }
}
