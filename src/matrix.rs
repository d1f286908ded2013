//! A linear layer's weight matrix `W [out, inp]` (PyTorch's `Linear.weight`, row-major) in
//! the format its products run in, and those products (`foxedge_cpu::linear`).
//!
//! Storage: a region of the memory-mapped model file used in place (f32 / f16 / bf16
//! little-endian elements aligned to their size, or Q8 / Q4 tiles in the packed layout of
//! `foxedge_cpu::linear::PackedView`), or owned memory when the file's bytes are not
//! usable in place (misaligned, a big-endian host) or the matrix was converted at load to
//! another format. Conversions decode each row to f32 and encode it again
//! (`foxedge_core::quant`): f16 / bf16 round to nearest even, Q8 / Q4 quantize per block of
//! 32 weights.

use crate::error::{Error, Result};
use foxedge_cpu::linear::{Matrix, PackedView, PackedWeights, WeightFormat, Weights, linear};
use half::{bf16, f16};
use memmap2::Mmap;
use std::io::Write;
use std::sync::Arc;

/// Where a matrix's weights are.
enum Store {
    /// `len` bytes at `start` of the model file's map, in the matrix's format, aligned for
    /// its kernels (f32: 4 bytes, f16 / bf16: 2, packed tiles: 64).
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    F32(Vec<f32>),
    /// f16 or bf16 bits, as the matrix's format says.
    Half(Vec<u16>),
    Packed(PackedWeights),
}

/// A weight matrix in its run format. Immutable after load.
pub(crate) struct WeightMatrix {
    name: String,
    out: usize,
    inp: usize,
    format: WeightFormat,
    store: Store,
}

/// A matrix's weights borrowed for reading rows, whatever holds them.
#[derive(Debug, Clone, Copy)]
enum Rows<'a> {
    /// Little-endian f32 / f16 / bf16 elements, any alignment.
    Bytes(WeightFormat, &'a [u8]),
    F32(&'a [f32]),
    /// f16 or bf16 bits.
    Half(WeightFormat, &'a [u16]),
    Packed(PackedView<'a>),
}

impl Rows<'_> {
    /// Row `r` (of `inp` weights) as f32 into `out`.
    fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let n = out.len();
        match *self {
            Rows::Bytes(f, b) => {
                let rb = f.unit_bytes() * n;
                foxedge_core::quant::decode_row(f, &b[r * rb..(r + 1) * rb], out)?;
            }
            Rows::F32(v) => out.copy_from_slice(&v[r * n..(r + 1) * n]),
            Rows::Half(f, v) => {
                for (o, &h) in out.iter_mut().zip(&v[r * n..(r + 1) * n]) {
                    *o = match f {
                        WeightFormat::F16 => f16::from_bits(h).to_f32(),
                        _ => bf16::from_bits(h).to_f32(),
                    };
                }
            }
            Rows::Packed(p) => p.row(r, out)?,
        }
        Ok(())
    }
}

/// Index of the first NaN or infinite element of little-endian `bytes` in float `format`.
fn first_non_finite(format: WeightFormat, bytes: &[u8]) -> Option<usize> {
    match format {
        WeightFormat::F32 => bytes
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        // All-ones exponent: f16 bits 10..15, bf16 bits 7..15.
        WeightFormat::F16 => bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00),
        _ => bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
    }
}

/// An allocation failure of the kernels' crate as the facade's error for `what`.
fn oom_or(
    e: foxedge_core::Error,
    what: &str,
    other: impl FnOnce(foxedge_core::Error) -> Error,
) -> Error {
    match e {
        foxedge_core::Error::Capacity { capacity, .. } => Error::OutOfMemory {
            what: what.to_string(),
            bytes: capacity,
        },
        e => other(e),
    }
}

impl std::fmt::Debug for WeightMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightMatrix")
            .field("name", &self.name)
            .field("shape", &[self.out, self.inp])
            .field("format", &self.format)
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

impl WeightMatrix {
    /// Builds matrix `name` of `out x inp` from `len` bytes at `start` of `map`, which hold
    /// it in `stored` format (float elements, or Q8 / Q4 packed tiles), to run in `target`.
    /// Used in place when `target == stored` and the bytes are aligned for the kernels;
    /// copied or converted (rows split over `threads` tasks) otherwise.
    ///
    /// Errors: [`Error::BadModel`] naming the tensor for a wrong byte count, a NaN or
    /// infinite weight or block scale, or a weight out of the target format's range;
    /// [`Error::OutOfMemory`] when an owned copy cannot be allocated.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        name: &str,
        map: &Arc<Mmap>,
        start: usize,
        len: usize,
        stored: WeightFormat,
        (out, inp): (usize, usize),
        target: WeightFormat,
        threads: usize,
    ) -> Result<WeightMatrix> {
        let item = format!("tensor `{name}`");
        let bytes = map
            .get(start..start.saturating_add(len))
            .ok_or_else(|| Error::bad_model(&item, "data lies outside the file"))?;
        let source = if stored.is_block() {
            let v = PackedView::new(stored, bytes, out, inp).map_err(|e| {
                Error::bad_model(&item, format!("{stored} [{out}, {inp}] packed: {e}"))
            })?;
            if let Some((r, k)) = v.first_bad_scale() {
                return Err(Error::bad_model(
                    &item,
                    format!("the scale of row {r}, block {k} is not finite"),
                ));
            }
            Rows::Packed(v)
        } else {
            let want = stored.matrix_bytes(out, inp)?;
            if len != want {
                return Err(Error::bad_model(
                    &item,
                    format!("{len} bytes, expected {want} for {stored} [{out}, {inp}]"),
                ));
            }
            if let Some(i) = first_non_finite(stored, bytes) {
                return Err(Error::bad_model(
                    &item,
                    format!("element {i} is not finite"),
                ));
            }
            Rows::Bytes(stored, bytes)
        };
        let align = match stored {
            WeightFormat::Q8 | WeightFormat::Q4 => 64,
            f => f.unit_bytes(),
        };
        let store = if target == stored {
            if bytes.as_ptr().align_offset(align) == 0 && cfg!(target_endian = "little") {
                Store::Mapped {
                    map: Arc::clone(map),
                    start,
                    len,
                }
            } else {
                Self::copy(source, out * inp, &item)?
            }
        } else {
            Self::convert(source, (out, inp), target, threads, &item)?
        };
        Ok(WeightMatrix {
            name: name.to_string(),
            out,
            inp,
            format: target,
            store,
        })
    }

    /// An owned copy of `source`, in its own format.
    fn copy(source: Rows<'_>, n: usize, item: &str) -> Result<Store> {
        Ok(match source {
            Rows::Packed(v) => {
                Store::Packed(PackedWeights::copy_of(&v).map_err(|e| oom_or(e, item, Error::from))?)
            }
            Rows::Bytes(WeightFormat::F32, b) => {
                let mut v = crate::error::try_zeroed::<f32>(n, item)?;
                for (o, c) in v.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
                Store::F32(v)
            }
            Rows::Bytes(_, b) => {
                let mut v = crate::error::try_zeroed::<u16>(n, item)?;
                for (o, c) in v.iter_mut().zip(b.chunks_exact(2)) {
                    *o = u16::from_le_bytes([c[0], c[1]]);
                }
                Store::Half(v)
            }
            Rows::F32(_) | Rows::Half(..) => {
                return Err(Error::Internal(format!("{item}: copy of an owned matrix")));
            }
        })
    }

    /// `source` decoded row by row and encoded in `target`, rows split over `threads`.
    fn convert(
        source: Rows<'_>,
        (out, inp): (usize, usize),
        target: WeightFormat,
        threads: usize,
        item: &str,
    ) -> Result<Store> {
        use rayon::prelude::*;
        if target.is_block() {
            let range_err = |e: foxedge_core::Error| {
                oom_or(e, item, |e| {
                    Error::bad_model(item, format!("cannot be stored as {target}: {e}"))
                })
            };
            let p = PackedWeights::quantize(target, out, inp, threads, |r, buf: &mut [f32]| {
                source
                    .row(r, buf)
                    .map_err(|_| foxedge_core::Error::BadArgument("a source row does not decode"))
            })
            .map_err(range_err)?;
            return Ok(Store::Packed(p));
        }
        // Rows per task: the matrix split into `threads` parts.
        let per = out.div_ceil(threads.max(1)).max(1) * inp;
        if target == WeightFormat::F32 {
            let mut v = crate::error::try_zeroed::<f32>(out * inp, item)?;
            v.par_chunks_mut(per)
                .enumerate()
                .try_for_each(|(c, part)| -> Result<()> {
                    let r0 = c * per / inp;
                    for (i, row) in part.chunks_exact_mut(inp).enumerate() {
                        source.row(r0 + i, row)?;
                    }
                    Ok(())
                })?;
            return Ok(Store::F32(v));
        }
        let mut v = crate::error::try_zeroed::<u16>(out * inp, item)?;
        v.par_chunks_mut(per)
            .enumerate()
            .try_for_each(|(c, part)| -> Result<()> {
                let r0 = c * per / inp;
                let mut w = vec![0.0f32; inp];
                for (i, row) in part.chunks_exact_mut(inp).enumerate() {
                    source.row(r0 + i, &mut w)?;
                    for (j, (o, &x)) in row.iter_mut().zip(&w).enumerate() {
                        let (bits, finite) = match target {
                            WeightFormat::F16 => {
                                let h = f16::from_f32(x);
                                (h.to_bits(), h.is_finite())
                            }
                            _ => {
                                let h = bf16::from_f32(x);
                                (h.to_bits(), h.is_finite())
                            }
                        };
                        if !finite {
                            return Err(Error::bad_model(
                                item,
                                format!(
                                    "element {} ({x}) is outside the {target} range",
                                    (r0 + i) * inp + j
                                ),
                            ));
                        }
                        *o = bits;
                    }
                }
                Ok(())
            })?;
        Ok(Store::Half(v))
    }

    /// The tensor name in the model file.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `(out, inp)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    /// The format products run in.
    pub(crate) fn format(&self) -> WeightFormat {
        self.format
    }

    /// Whether the weights are read in place from the model file's map.
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.store, Store::Mapped { .. })
    }

    /// The weights as the device takes them: f32 / f16 / bf16 elements row-major
    /// `[out, inp]`, Q8 / Q4 as their packed tiles (the layout the device reads too).
    #[cfg(feature = "vulkan")]
    pub(crate) fn device_weights(&self) -> Option<foxedge_vulkan::model::Weights<'_>> {
        use foxedge_vulkan::model::Weights as W;
        use half::slice::HalfBitsSliceExt;
        match &self.store {
            Store::Mapped { map, start, len } => {
                let b = &map[*start..*start + *len];
                match self.format {
                    // SAFETY: every bit pattern is a valid f32 / f16 / bf16, and only the
                    // aligned middle of `align_to` is used, checked to be all of `b`.
                    WeightFormat::F32 => match unsafe { b.align_to::<f32>() } {
                        ([], m, []) => Some(W::F32(m)),
                        _ => None,
                    },
                    // SAFETY: as above.
                    WeightFormat::F16 => match unsafe { b.align_to::<f16>() } {
                        ([], m, []) => Some(W::F16(m)),
                        _ => None,
                    },
                    // SAFETY: as above.
                    WeightFormat::Bf16 => match unsafe { b.align_to::<bf16>() } {
                        ([], m, []) => Some(W::Bf16(m)),
                        _ => None,
                    },
                    WeightFormat::Q8 => Some(W::Q8(b)),
                    WeightFormat::Q4 => Some(W::Q4(b)),
                }
            }
            Store::F32(v) => Some(W::F32(v)),
            Store::Half(v) if self.format == WeightFormat::F16 => {
                Some(W::F16(v[..].reinterpret_cast()))
            }
            Store::Half(v) => Some(W::Bf16(v[..].reinterpret_cast())),
            Store::Packed(p) => match self.format {
                WeightFormat::Q4 => Some(W::Q4(p.view().tiles())),
                _ => Some(W::Q8(p.view().tiles())),
            },
        }
    }

    /// Bytes of the weights in their format (packed: with the padding to 16 rows and
    /// whole tile pairs).
    pub(crate) fn bytes(&self) -> usize {
        match &self.store {
            Store::Mapped { len, .. } => *len,
            Store::F32(v) => v.len() * 4,
            Store::Half(v) => v.len() * 2,
            Store::Packed(p) => p.view().tiles().len(),
        }
    }

    /// The kernels' view of the weights.
    fn matrix(&self) -> Result<Matrix<'_>> {
        let (out, inp, f) = (self.out, self.inp, self.format);
        let m = match &self.store {
            Store::Mapped { map, start, len } => {
                let b = &map[*start..*start + *len];
                if f.is_block() {
                    PackedView::new(f, b, out, inp)?.into()
                } else {
                    Weights::from_bytes(f, b, out, inp)?.into()
                }
            }
            Store::F32(v) => Weights::f32(v, out, inp)?.into(),
            Store::Half(v) if f == WeightFormat::F16 => Weights::f16(
                half::slice::HalfBitsSliceExt::reinterpret_cast(&v[..]),
                out,
                inp,
            )?
            .into(),
            Store::Half(v) => Weights::bf16(
                half::slice::HalfBitsSliceExt::reinterpret_cast(&v[..]),
                out,
                inp,
            )?
            .into(),
            Store::Packed(p) => p.into(),
        };
        Ok(m)
    }

    /// The weights for reading rows.
    fn rows(&self) -> Rows<'_> {
        match &self.store {
            Store::Mapped { map, start, len } => {
                let b = &map[*start..*start + *len];
                match PackedView::new(self.format, b, self.out, self.inp) {
                    Ok(v) if self.format.is_block() => Rows::Packed(v),
                    _ => Rows::Bytes(self.format, b),
                }
            }
            Store::F32(v) => Rows::F32(v),
            Store::Half(v) => Rows::Half(self.format, v),
            Store::Packed(p) => Rows::Packed(p.view()),
        }
    }

    /// `y[t, o] (+)= sum_i x[t, i] W[o, i]` for `t < rows` (`x` `[rows, inp]`, `y`
    /// `[rows, out]`), outputs split over `threads` tasks; block formats quantize `x` per
    /// block of 32 (see `foxedge_cpu::linear::linear`).
    ///
    /// Errors: [`Error::Internal`] for buffers that do not match the shape (a caller bug).
    pub(crate) fn apply(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        accumulate: bool,
        threads: usize,
    ) -> Result<()> {
        let m = self.matrix().map_err(|e| self.internal(e))?;
        linear(m, x, rows, y, accumulate, threads).map_err(|e| self.internal(e.into()))
    }

    /// [`WeightMatrix::apply`] for several matrices on the same `x` in one parallel
    /// region (`foxedge_cpu::linear::linear_many`: bit-identical to one call each).
    ///
    /// Errors: [`Error::Internal`] for buffers that do not match the shapes (a caller bug).
    pub(crate) fn apply_many(
        products: &mut [(&WeightMatrix, &mut [f32], bool)],
        x: &[f32],
        rows: usize,
        threads: usize,
    ) -> Result<()> {
        let mut ps = Vec::with_capacity(products.len());
        for (m, y, accumulate) in products.iter_mut() {
            ps.push(foxedge_cpu::linear::Product {
                w: m.matrix().map_err(|e| m.internal(e))?,
                y,
                accumulate: *accumulate,
            });
        }
        foxedge_cpu::linear::linear_many(&mut ps, x, rows, threads)
            .map_err(|e| Error::Internal(format!("linear_many: {e}")))
    }

    /// Row `r` of `W` as f32 (an embedding lookup): `out.len()` must be `inp`.
    ///
    /// Errors: [`Error::Internal`] for `r >= out` or a wrong `out` length (caller bugs).
    pub(crate) fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        if r >= self.out || out.len() != self.inp {
            return Err(Error::Internal(format!(
                "{}: row {r} into {} floats",
                self.name,
                out.len()
            )));
        }
        self.rows().row(r, out)
    }

    fn internal(&self, e: Error) -> Error {
        Error::Internal(format!("{}: {e}", self.name))
    }

    /// Writes the weights as stored: little-endian elements, or the packed tiles.
    pub(crate) fn write_to(&self, w: &mut dyn Write) -> std::io::Result<()> {
        const CHUNK: usize = 1 << 14;
        match &self.store {
            Store::Mapped { map, start, len } => w.write_all(&map[*start..*start + *len]),
            Store::Packed(p) => w.write_all(p.view().tiles()),
            Store::F32(v) => {
                let mut buf = Vec::with_capacity(4 * CHUNK);
                for c in v.chunks(CHUNK) {
                    buf.clear();
                    c.iter()
                        .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    w.write_all(&buf)?;
                }
                Ok(())
            }
            Store::Half(v) => {
                let mut buf = Vec::with_capacity(2 * CHUNK);
                for c in v.chunks(CHUNK) {
                    buf.clear();
                    c.iter()
                        .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    w.write_all(&buf)?;
                }
                Ok(())
            }
        }
    }
}
