//! Weights on the device, uploaded once in their storage format: f32 as is, f16 and bf16
//! two per u32 word (lower half first; the shaders widen them), Q8 / Q4 as the bytes of
//! their packed tiles (`shaders/qblk.glsl`; 1.0625 / 0.5625 bytes per weight, the shaders
//! dequantize). A matrix larger than one storage-buffer binding is split into chunks of
//! whole rows (whole groups of 16 rows for Q8 / Q4), each its own buffer; a product runs
//! one dispatch per chunk. The total is checked against a budget before anything is
//! allocated, so a model that does not fit is [`Error::DoesNotFit`], not a failed
//! allocation half-way.

use super::{ModelOptions, ModelShape, ModelWeights, Weights};
use crate::device::Context;
use crate::error::{Error, Result};
use std::sync::Arc;
use vulkano::buffer::Subbuffer;
use vulkano::memory::MemoryHeapFlags;

/// A matrix `[rows, cols]` on the device, in row chunks.
#[derive(Debug, Clone)]
pub(crate) struct Mat {
    /// 0 f32, 1 f16, 2 bf16 (`wfmt.glsl`), 3 Q8, 4 Q4 (`qblk.glsl`).
    pub format: u32,
    pub cols: usize,
    /// (buffer, first row, rows).
    pub chunks: Vec<(Subbuffer<[u32]>, usize, usize)>,
}

/// One block's tensors on the device.
#[derive(Debug)]
pub(crate) struct DevLayer {
    pub attn_norm: Subbuffer<[u32]>,
    /// `[q | k | v | k shift | v shift | gate | output gate]` projections: (matrix, column of
    /// the projection row it writes).
    pub pre: Vec<(Mat, usize)>,
    /// `[q_norm | k_norm]` (zeros without QK-norm).
    pub qk_norm: Subbuffer<[u32]>,
    pub fgate_bias: Subbuffer<[u32]>,
    pub output_norm: Subbuffer<[u32]>,
    pub o: Mat,
    pub mlp_norm: Subbuffer<[u32]>,
    pub gate_up: Mat,
    pub down: Mat,
}

/// A model's weights on one device; share it between streams with `Arc`.
pub struct DeviceModel {
    pub(crate) ctx: Arc<Context>,
    pub(crate) shape: ModelShape,
    pub(crate) embeddings: Mat,
    pub(crate) layers: Vec<DevLayer>,
    pub(crate) norm: Subbuffer<[u32]>,
    pub(crate) lm_head: Mat,
    bytes: u64,
}

impl std::fmt::Debug for DeviceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceModel")
            .field("shape", &self.shape)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// u32 words of a weight tensor.
fn words(w: &Weights<'_>) -> Vec<u32> {
    match w {
        Weights::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        Weights::F16(v) => v
            .chunks(2)
            .map(|p| {
                u32::from(p[0].to_bits()) | (u32::from(p.get(1).map_or(0, |x| x.to_bits())) << 16)
            })
            .collect(),
        Weights::Bf16(v) => v
            .chunks(2)
            .map(|p| {
                u32::from(p[0].to_bits()) | (u32::from(p.get(1).map_or(0, |x| x.to_bits())) << 16)
            })
            .collect(),
        Weights::Q8(b) | Weights::Q4(b) => b
            .chunks(4)
            .map(|p| {
                let mut w = [0u8; 4];
                w[..p.len()].copy_from_slice(p);
                u32::from_le_bytes(w)
            })
            .collect(),
    }
}

fn bad_len(what: &'static str, expected: usize, got: usize) -> Error {
    Error::Input(foxedge_core::Error::BadLength {
        what,
        expected,
        got,
    })
}

/// Checks that `w` holds `rows x cols` weights (block formats: their packed bytes, and
/// `cols` a multiple of 32, which the block kernels take whole).
fn check(w: &Weights<'_>, what: &'static str, rows: usize, cols: usize) -> Result<()> {
    let (want, got) = match w {
        Weights::F32(v) => (rows * cols, v.len()),
        Weights::F16(v) => (rows * cols, v.len()),
        Weights::Bf16(v) => (rows * cols, v.len()),
        Weights::Q8(b) | Weights::Q4(b) => {
            let want = super::packed_bytes(matches!(w, Weights::Q4(_)), rows, cols).ok_or(
                Error::Input(foxedge_core::Error::BadShape(
                    "packed weight byte size overflows usize",
                )),
            )?;
            (want, b.len())
        }
    };
    if want != got {
        return Err(bad_len(what, want, got));
    }
    if w.is_block() && cols % 32 != 0 {
        return Err(Error::Unsupported(format!(
            "{what}: the device's Q8 / Q4 kernels need rows of a multiple of 32 weights, not {cols}"
        )));
    }
    Ok(())
}

fn check_vec(v: &[f32], what: &'static str, n: usize) -> Result<()> {
    if v.len() != n {
        return Err(bad_len(what, n, v.len()));
    }
    if v.iter().any(|x| !x.is_finite()) {
        return Err(Error::Input(foxedge_core::Error::BadArgument(
            "a model weight is not finite",
        )));
    }
    Ok(())
}

/// Uploads collected tensors in batches of about 64 MiB of staging memory per submit.
pub(super) struct Uploader<'c> {
    pub(super) ctx: &'c Context,
    pub(super) limit_words: usize,
    pub(super) bytes: u64,
}

impl Uploader<'_> {
    fn vec(&mut self, v: &[f32]) -> Result<Subbuffer<[u32]>> {
        let w: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        self.bytes += w.len() as u64 * 4;
        Ok(self.ctx.upload(&[&w])?.remove(0))
    }

    /// `w` (checked to be `rows x cols`) in chunks of whole rows, or of whole groups of 16
    /// rows for block formats.
    pub(super) fn mat(&mut self, w: &Weights<'_>, rows: usize, cols: usize) -> Result<Mat> {
        let all = words(w);
        // Rows per unit of the layout and the unit's words.
        let unit = if w.is_block() { 16 } else { 1 };
        let unit_words = all.len() / rows.div_ceil(unit).max(1);
        let per = (self.limit_words / unit_words.max(1)).max(1) * unit;
        let mut chunks = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let n = per.min(rows - r0);
            let part = &all[r0 / unit * unit_words..(r0 + n).div_ceil(unit) * unit_words];
            chunks.push((self.ctx.upload(&[part])?.remove(0), r0, n));
            r0 += n;
        }
        self.bytes += all.len() as u64 * 4;
        Ok(Mat {
            format: w.format(),
            cols,
            chunks,
        })
    }
}

/// Device bytes of every tensor of `w` (what the budget is checked against).
fn total_bytes(w: &ModelWeights<'_>) -> u64 {
    let v = |x: &[f32]| x.len() as u64 * 4;
    let mut b = w.embeddings.bytes() + w.lm_head.bytes() + v(w.norm);
    for l in &w.layers {
        b += v(l.attn_norm) + l.q.bytes() + l.k.bytes() + l.v.bytes() + l.fgate.bytes();
        b += v(l.fgate_bias) + l.o.bytes() + v(l.mlp_norm) + l.gate_up.bytes() + l.down.bytes();
        for m in [l.k_shift, l.v_shift, l.ogate].into_iter().flatten() {
            b += m.bytes();
        }
        for x in [l.output_norm, l.q_norm, l.k_norm].into_iter().flatten() {
            b += v(x);
        }
    }
    b
}

impl DeviceModel {
    pub(crate) fn upload(
        ctx: &Arc<Context>,
        shape: ModelShape,
        w: &ModelWeights<'_>,
        opts: ModelOptions,
    ) -> Result<Self> {
        let s = &shape;
        let (d, h, hd, i, v) = (s.hidden, s.heads, s.head_dim, s.intermediate, s.vocab);
        if h * hd != d || d == 0 || v == 0 || s.layers == 0 {
            return Err(Error::Input(foxedge_core::Error::BadShape(
                "model shape: hidden must be heads * head_dim, every size > 0",
            )));
        }
        if d % 8 != 0 || i % 8 != 0 || hd % 4 != 0 {
            return Err(Error::Unsupported(format!(
                "the device model needs hidden and intermediate sizes that are multiples of 8 \
                 and a head_dim multiple of 4 (hidden {d}, intermediate {i}, head_dim {hd})"
            )));
        }
        if !ctx.info.subgroup_arithmetic
            || !ctx
                .device
                .enabled_features()
                .shader_storage_buffer_array_dynamic_indexing
        {
            return Err(Error::Unsupported(
                "the device model needs subgroup arithmetic and dynamic indexing of storage buffer arrays".into(),
            ));
        }
        if w.layers.len() != s.layers {
            return Err(bad_len("model layers", s.layers, w.layers.len()));
        }
        let needed = total_bytes(w);
        let budget = opts
            .budget_bytes
            .unwrap_or_else(|| device_heap(ctx) / 10 * 9);
        if needed > budget {
            return Err(Error::DoesNotFit { needed, budget });
        }
        check(&w.embeddings, "embeddings [V, D]", v, d)?;
        check(&w.lm_head, "lm_head [V, D]", v, d)?;
        check_vec(w.norm, "final norm [D]", d)?;
        let limit = ctx
            .binding_limit
            .load(std::sync::atomic::Ordering::Relaxed)
            .min(64 << 20);
        let mut up = Uploader {
            ctx,
            limit_words: (limit / 4) as usize,
            bytes: 0,
        };
        let embeddings = up.mat(&w.embeddings, v, d)?;
        let lm_head = up.mat(&w.lm_head, v, d)?;
        let norm = up.vec(w.norm)?;
        let mut layers = Vec::with_capacity(s.layers);
        for l in &w.layers {
            check_vec(l.attn_norm, "attn_norm [D]", d)?;
            check_vec(l.mlp_norm, "mlp_norm [D]", d)?;
            check_vec(l.fgate_bias, "fgate bias [H]", h)?;
            let mut pre = Vec::new();
            for (m, col, rows, what) in [
                (Some(l.q), 0, d, "q_proj [D, D]"),
                (Some(l.k), d, d, "k_proj [D, D]"),
                (Some(l.v), 2 * d, d, "v_proj [D, D]"),
                (l.k_shift, 3 * d, h, "k shift_proj [H, D]"),
                (l.v_shift, 3 * d + h, h, "v shift_proj [H, D]"),
                (Some(l.fgate), 3 * d + 2 * h, h, "fgate_proj [H, D]"),
                (l.ogate, 3 * d + 3 * h, d, "ogate_proj [D, D]"),
            ] {
                if let Some(m) = m {
                    check(&m, what, rows, d)?;
                    pre.push((up.mat(&m, rows, d)?, col));
                }
            }
            if s.k_shift != l.k_shift.is_some()
                || s.v_shift != l.v_shift.is_some()
                || s.output_gate.is_some() != l.ogate.is_some()
                || s.output_norm != l.output_norm.is_some()
                || (s.qk_norm != super::QkNorm::Off) != (l.q_norm.is_some() && l.k_norm.is_some())
            {
                return Err(Error::Input(foxedge_core::Error::BadArgument(
                    "model weights do not match the shape's switches (shift, gate, norms)",
                )));
            }
            let qk_len = if s.qk_norm == super::QkNorm::Shared {
                hd
            } else {
                d
            };
            let mut qk = vec![0.0f32; 2 * qk_len];
            if let (Some(qn), Some(kn)) = (l.q_norm, l.k_norm) {
                check_vec(qn, "q_norm", qk_len)?;
                check_vec(kn, "k_norm", qk_len)?;
                qk[..qk_len].copy_from_slice(qn);
                qk[qk_len..].copy_from_slice(kn);
            }
            let on = match l.output_norm {
                Some(x) => {
                    check_vec(x, "output_norm [D]", d)?;
                    x.to_vec()
                }
                None => vec![1.0; d],
            };
            check(&l.o, "o_proj [D, D]", d, d)?;
            check(&l.gate_up, "gate_proj [2I, D]", 2 * i, d)?;
            check(&l.down, "down_proj [D, I]", d, i)?;
            layers.push(DevLayer {
                attn_norm: up.vec(l.attn_norm)?,
                pre,
                qk_norm: up.vec(&qk)?,
                fgate_bias: up.vec(l.fgate_bias)?,
                output_norm: up.vec(&on)?,
                o: up.mat(&l.o, d, d)?,
                mlp_norm: up.vec(l.mlp_norm)?,
                gate_up: up.mat(&l.gate_up, 2 * i, d)?,
                down: up.mat(&l.down, d, i)?,
            });
        }
        let model = Self {
            ctx: ctx.clone(),
            shape,
            embeddings,
            layers,
            norm,
            lm_head,
            bytes: up.bytes,
        };
        // Every product pipeline a prompt's chunks take, built now rather than in a run.
        let mut mats: Vec<(&Mat, bool)> = vec![(&model.lm_head, false)];
        for l in &model.layers {
            mats.extend(l.pre.iter().map(|(m, _)| (m, false)));
            mats.extend([(&l.o, true), (&l.gate_up, false), (&l.down, true)]);
        }
        super::matmul::warm(ctx, &mats)?;
        Ok(model)
    }

    /// The model's sizes.
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// Device bytes the weights take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The largest device-local heap (bytes).
pub(crate) fn device_heap(ctx: &Context) -> u64 {
    ctx.device
        .physical_device()
        .memory_properties()
        .memory_heaps
        .iter()
        .filter(|h| h.flags.intersects(MemoryHeapFlags::DEVICE_LOCAL))
        .map(|h| h.size)
        .max()
        .unwrap_or(1 << 30)
}

#[cfg(test)]
pub(super) mod tests;
