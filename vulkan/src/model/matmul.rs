//! The n-row products of prefill and continuation chunks,
//! `Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k]` for `n` tokens, and the choice of their
//! kernel:
//! - `mm.glsl` / `mmq.glsl` ([`MmKernel::Tile64`]): 64 x 64 tiles, 4 x 4 outputs per
//!   thread, scalar loads; for a few rows (n <= [`SMALL_N`]).
//! - `mmt.glsl` ([`MmKernel::Simt`]): register-tiled f32, (16 TM) x (16 TN) tiles, TM x TN
//!   outputs per thread, vec4 / uvec4 loads; the largest tile that still gives
//!   [`WAVE`] workgroups. The portable path: the default on CPU devices (lavapipe: about
//!   2.5x Tile64's prefill), and with `FOXEDGE_VK_MM=simt` on GPUs without cooperative
//!   matrices, which keep Tile64 until it has been measured on one.
//! - `mmc.glsl` ([`MmKernel::Coop`]): KHR cooperative matrices, X and W rounded to f16 in
//!   shared memory, f32 accumulators; where the device lists 16x16x16 f16 x f16 -> f32
//!   subgroup products ([`crate::device::DeviceInfo::coopmat_khr`]), unless
//!   `FOXEDGE_VK_COOPMAT=0`. Each product then carries the f16 rounding of its two factors
//!   (relative <= 2^-11 each, for |x|, |w| in f16's normal range [2^-14, 65504]; smaller
//!   values keep an absolute error <= 2^-25, larger ones overflow to infinity).
//!
//! Tile64 and Simt sum each output's K products in f32 in the order of k. `FOXEDGE_VK_MM`
//! = `tile64` or `simt` forces one kernel (for comparisons).

use super::ops::Rec;
use super::weights::Mat;
use crate::device::Context;
use crate::error::Result;
use std::sync::Arc;
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::descriptor_set::WriteDescriptorSet;
use vulkano::pipeline::ComputePipeline;

/// `mm.glsl` / `mmq.glsl` by format (f32, f16, bf16, Q8, Q4).
static TILE64: [(&str, &[u8]); 5] = [
    ("mm_f32", include_bytes!("../../shaders/mm_f32.spv")),
    ("mm_f16", include_bytes!("../../shaders/mm_f16.spv")),
    ("mm_bf16", include_bytes!("../../shaders/mm_bf16.spv")),
    ("mm_q8", include_bytes!("../../shaders/mm_q8.spv")),
    ("mm_q4", include_bytes!("../../shaders/mm_q4.spv")),
];
/// `mmt.glsl` by format.
static SIMT: [(&str, &[u8]); 5] = [
    ("mmt_f32", include_bytes!("../../shaders/mmt_f32.spv")),
    ("mmt_f16", include_bytes!("../../shaders/mmt_f16.spv")),
    ("mmt_bf16", include_bytes!("../../shaders/mmt_bf16.spv")),
    ("mmt_q8", include_bytes!("../../shaders/mmt_q8.spv")),
    ("mmt_q4", include_bytes!("../../shaders/mmt_q4.spv")),
];

/// `mmc.glsl` by format (KHR cooperative matrices).
static COOP: [(&str, &[u8]); 5] = [
    (
        "mmc_f32_khr",
        include_bytes!("../../shaders/mmc_f32_khr.spv"),
    ),
    (
        "mmc_f16_khr",
        include_bytes!("../../shaders/mmc_f16_khr.spv"),
    ),
    (
        "mmc_bf16_khr",
        include_bytes!("../../shaders/mmc_bf16_khr.spv"),
    ),
    ("mmc_q8_khr", include_bytes!("../../shaders/mmc_q8_khr.spv")),
    ("mmc_q4_khr", include_bytes!("../../shaders/mmc_q4_khr.spv")),
];

/// Environment variable: `0` keeps the n-row products off cooperative matrices.
pub(crate) const COOPMAT_ENV: &str = "FOXEDGE_VK_COOPMAT";

/// Environment variable: `tile64` or `simt` runs every n-row product with that kernel.
pub(crate) const MM_ENV: &str = "FOXEDGE_VK_MM";

/// Token rows up to which a product runs [`MmKernel::Tile64`].
pub(crate) const SMALL_N: usize = 16;

/// Workgroups a product should have at least (about two per multiprocessor of a large
/// GPU) before a larger tile is taken.
pub(crate) const WAVE: usize = 256;

/// The kernel of an n-row product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MmKernel {
    /// `mm.glsl` / `mmq.glsl`.
    Tile64,
    /// `mmt.glsl` with TM, TN (4 or 8 each).
    Simt { tm: u32, tn: u32 },
    /// `mmc.glsl` with FN (2 or 4) 16-row fragments per subgroup.
    Coop { fnn: u32 },
}

/// Whether [`COOPMAT_ENV`] is `0`, read once.
fn coop_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var(COOPMAT_ENV).is_ok_and(|v| v.trim() == "0"))
}

/// Set when a [`MmKernel::Coop`] pipeline failed to build: the products take the SIMT
/// kernel from then on.
static COOP_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether `ctx` runs [`MmKernel::Coop`].
pub(crate) fn coop_available(ctx: &Context) -> bool {
    ctx.info.coopmat_khr
        && ctx.info.subgroup_size.is_some()
        && !COOP_FAILED.load(std::sync::atomic::Ordering::Relaxed)
}

/// What [`MM_ENV`] asks for, read once.
fn forced() -> Option<&'static str> {
    static F: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *F.get_or_init(|| match std::env::var(MM_ENV).ok()?.trim() {
        "tile64" => Some("tile64"),
        "simt" => Some("simt"),
        _ => None,
    })
}

impl MmKernel {
    /// The kernel for `n` tokens by `rows` weight rows.
    pub fn choose(ctx: &Context, n: usize, rows: usize) -> Self {
        match forced() {
            Some("tile64") => return Self::Tile64,
            Some(_) => {}
            None if n <= SMALL_N => return Self::Tile64,
            None if coop_available(ctx) && !coop_off() => {
                let wide = Self::Coop { fnn: 4 };
                return if wide.groups(n, rows) >= WAVE {
                    wide
                } else {
                    Self::Coop { fnn: 2 }
                };
            }
            // A GPU without cooperative matrices keeps the kernel measured on GPUs until
            // the SIMT kernel has been too.
            None if ctx.info.device_type != "Cpu" => return Self::Tile64,
            None => {}
        }
        let simt = [(8, 8), (8, 4), (4, 4)].map(|(tm, tn)| Self::Simt { tm, tn });
        simt.into_iter()
            .find(|k| k.groups(n, rows) >= WAVE)
            .unwrap_or(simt[2])
    }

    /// (tokens, rows) of a workgroup's output tile.
    pub fn tile(self) -> (usize, usize) {
        match self {
            Self::Tile64 => (64, 64),
            Self::Simt { tm, tn } => (16 * tm as usize, 16 * tn as usize),
            Self::Coop { fnn } => (64, 32 * fnn as usize),
        }
    }

    /// Workgroups of an `n` x `rows` product.
    pub fn groups(self, n: usize, rows: usize) -> usize {
        let (bm, bn) = self.tile();
        n.div_ceil(bm) * rows.div_ceil(bn)
    }
}

/// The pipeline of `kernel` for `m`'s format and row length.
fn pipeline(ctx: &Context, kernel: MmKernel, m: &Mat, acc: bool) -> Result<Arc<ComputePipeline>> {
    let f = m.format as usize;
    let (k, acc) = (m.cols as u32, u32::from(acc));
    match kernel {
        MmKernel::Tile64 => {
            let (name, spv) = TILE64[f];
            ctx.pipeline(name, spv, &[(0, k), (1, acc)])
        }
        MmKernel::Simt { tm, tn } => {
            let (name, spv) = SIMT[f];
            ctx.pipeline(name, spv, &[(0, k), (1, acc), (2, tm), (3, tn)])
        }
        MmKernel::Coop { fnn } => {
            let sg = ctx.info.subgroup_size.unwrap_or(32);
            let (name, spv) = COOP[f];
            ctx.pipeline(name, spv, &[(0, k), (1, acc), (2, fnn), (3, 4 * sg)])
        }
    }
}

/// The pipeline [`MmKernel::choose`] picks, or the SIMT kernel's where the
/// cooperative-matrix pipeline fails to build (said once on stderr; from then on the
/// products take the SIMT kernel).
fn chosen(
    ctx: &Context,
    n: usize,
    rows: usize,
    m: &Mat,
    acc: bool,
) -> Result<(MmKernel, Arc<ComputePipeline>)> {
    let kernel = MmKernel::choose(ctx, n, rows);
    match pipeline(ctx, kernel, m, acc) {
        Ok(p) => Ok((kernel, p)),
        Err(e) if matches!(kernel, MmKernel::Coop { .. }) => {
            COOP_FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
            eprintln!(
                "foxedge-vulkan: the cooperative-matrix product does not build on {} ({e}); \
                 using the SIMT kernel",
                ctx.info.name
            );
            let kernel = MmKernel::choose(ctx, n, rows);
            Ok((kernel, pipeline(ctx, kernel, m, acc)?))
        }
        Err(e) => Err(e),
    }
}

/// Builds the pipelines of the n-row products of `mats` (matrix, adds into Y) for every
/// kernel a chunk may take, so that no prompt's run compiles one (a pipeline is built once
/// per context: [`Context::pipeline`] keeps them).
pub(crate) fn warm(ctx: &Context, mats: &[(&Mat, bool)]) -> Result<()> {
    for &(m, acc) in mats {
        let rows = m.chunks.iter().map(|c| c.2).max().unwrap_or(0);
        // A few rows, and chunks of 64 and 2048 tokens (the products' tile choice of
        // every size in between is one of theirs or of the widths between).
        for n in [SMALL_N, 64, 256, 1024, 2048] {
            chosen(ctx, n, rows, m, acc)?;
        }
    }
    Ok(())
}

impl Rec<'_> {
    /// `Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k]` for `n` tokens, Y rows of `ldy` floats,
    /// with the kernel [`MmKernel::choose`] picks (the SIMT kernel where the
    /// cooperative-matrix pipeline fails to build).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &mut self,
        m: &Mat,
        n: usize,
        x: &Subbuffer<[u32]>,
        y: &Subbuffer<[u32]>,
        y_off: usize,
        ldy: usize,
        acc: bool,
    ) -> Result<()> {
        let rows = m.chunks.iter().map(|c| c.2).max().unwrap_or(0);
        let (kernel, pipe) = chosen(self.ctx, n, rows, m, acc)?;
        self.mm_record(kernel, &pipe, m, n, x, y, y_off, ldy)
    }

    /// [`Rec::matmul`] with `kernel` (the tests run every kernel).
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with(
        &mut self,
        kernel: MmKernel,
        m: &Mat,
        n: usize,
        x: &Subbuffer<[u32]>,
        y: &Subbuffer<[u32]>,
        y_off: usize,
        ldy: usize,
        acc: bool,
    ) -> Result<()> {
        let pipe = pipeline(self.ctx, kernel, m, acc)?;
        self.mm_record(kernel, &pipe, m, n, x, y, y_off, ldy)
    }

    /// Records `kernel`'s dispatches (one per chunk of `m`) with `pipe`.
    #[allow(clippy::too_many_arguments)]
    fn mm_record(
        &mut self,
        kernel: MmKernel,
        pipe: &Arc<ComputePipeline>,
        m: &Mat,
        n: usize,
        x: &Subbuffer<[u32]>,
        y: &Subbuffer<[u32]>,
        y_off: usize,
        ldy: usize,
    ) -> Result<()> {
        let (bm, bn) = kernel.tile();
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            n: u32,
            rows: u32,
            y_off: u32,
            ldy: u32,
        }
        for (w, r0, rows) in &m.chunks {
            self.flops = 2.0 * (n * rows * m.cols) as f64;
            self.run(
                pipe,
                vec![
                    WriteDescriptorSet::buffer(0, w.clone()),
                    WriteDescriptorSet::buffer(1, x.clone()),
                    WriteDescriptorSet::buffer(2, y.clone()),
                ],
                P {
                    n: n as u32,
                    rows: *rows as u32,
                    y_off: (y_off + r0) as u32,
                    ldy: ldy as u32,
                },
                [rows.div_ceil(bn) as u32, n.div_ceil(bm) as u32, 1],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
