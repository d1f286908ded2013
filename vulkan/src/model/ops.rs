//! Recording the model's compute shaders into a command buffer: one method per op, each
//! binding its buffers and push constants and dispatching. Buffers are u32 words (the
//! shaders reinterpret them as f32 where they hold floats).

use super::Act;
use super::profile::Prof;
use super::weights::Mat;
use crate::device::Context;
use crate::error::{Error, Result};
use std::sync::Arc;
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::{AutoCommandBufferBuilder, PrimaryAutoCommandBuffer};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};

static MV: [&[u8]; 3] = [
    include_bytes!("../../shaders/mv_f32.spv"),
    include_bytes!("../../shaders/mv_f16.spv"),
    include_bytes!("../../shaders/mv_bf16.spv"),
];
static MV_NAMES: [&str; 3] = ["mv_f32", "mv_f16", "mv_bf16"];
/// The block formats' kernels (`mvq.glsl`), Q8 then Q4 (formats 3, 4).
static MVQ: [(&str, &[u8]); 2] = [
    ("mv_q8", include_bytes!("../../shaders/mv_q8.spv")),
    ("mv_q4", include_bytes!("../../shaders/mv_q4.spv")),
];
static EMBED: &[u8] = include_bytes!("../../shaders/embed.spv");
static RMSNORM: &[u8] = include_bytes!("../../shaders/rmsnorm.spv");
static ATTN_PRE: &[u8] = include_bytes!("../../shaders/attn_pre.spv");
static ATTN_POST: &[u8] = include_bytes!("../../shaders/attn_post.spv");
static SWIGLU: &[u8] = include_bytes!("../../shaders/swiglu.spv");
static CACHE_OPS: &[u8] = include_bytes!("../../shaders/cache_ops.spv");
static ARGMAX: &[u8] = include_bytes!("../../shaders/argmax.spv");

/// Columns of a head's rows per `cache_ops.comp` workgroup (`COLS`).
const CACHE_OPS_COLS: usize = 8;
/// Threads per row of the matrix-vector kernel.
pub(super) const MV_TPR: u32 = 32;
/// Threads per workgroup of `mv.glsl` for a dispatch of `rows` rows: `MV_TPR` a row, 2 to
/// 8 rows (about one row team per 512 rows, so that narrow layers still spread over many
/// workgroups; each workgroup stages the whole input once); 8 on a CPU device (`cpu`:
/// lavapipe), where workgroups do not run in parallel beyond its cores and each one's
/// staging costs. `FOXEDGE_VK_MV_TEAMS` (1..=8, a power of two) fixes the rows per
/// workgroup.
pub(super) fn mv_wgs(rows: usize, cpu: bool) -> u32 {
    static FIXED: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let fixed = *FIXED.get_or_init(|| {
        std::env::var("FOXEDGE_VK_MV_TEAMS")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|t| (1..=8).contains(t) && t.is_power_of_two())
    });
    let teams = fixed.unwrap_or_else(|| {
        if cpu {
            8
        } else {
            1 << (rows / 512).clamp(2, 8).ilog2()
        }
    });
    MV_TPR * teams
}

/// How a matrix-vector product reads its input (`xin.glsl`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum XIn<'a> {
    /// As stored.
    Plain,
    /// RMSNorm of the `K` inputs with this weight `[K]` and eps.
    Norm(&'a Subbuffer<[u32]>, f64),
    /// `act(g) * u` of the `2K` inputs `[g | u]`.
    Glu(Act),
    /// The attention output before o_proj (`attn_post.comp` of one token): the `K` inputs
    /// (heads of `head_dim`) GroupRMSNorm-ed with this weight and eps when `norm` is given,
    /// times `act(g)` of the gate logits in the projections row `p` when `gate` is.
    Post {
        norm: Option<(&'a Subbuffer<[u32]>, f64)>,
        gate: Option<Act>,
        p: &'a Subbuffer<[u32]>,
        head_dim: usize,
    },
}

impl XIn<'_> {
    /// Specialization constants 8 (`XIN`), 9 (eps, f32 bits), 11 and 12 (XIN 4's head dim
    /// and mode; otherwise the head dim is the row length `cols`, so that the per-head
    /// array holds one float).
    pub(super) fn spec(&self, cols: usize) -> [(u32, u32); 4] {
        let eps = |e: f64| (e as f32).to_bits();
        let k = cols as u32;
        let [code, e, hd, mode] = match *self {
            XIn::Plain => [0, 0, k, 0],
            XIn::Norm(_, e) => [1, eps(e), k, 0],
            XIn::Glu(Act::Silu) => [2, 0, k, 0],
            XIn::Glu(Act::Sigmoid) => [3, 0, k, 0],
            XIn::Post {
                norm,
                gate,
                head_dim,
                ..
            } => {
                let g = match gate {
                    None => 0,
                    Some(Act::Sigmoid) => 2,
                    Some(Act::Silu) => 4,
                };
                let (n, e) = norm.map_or((0, 0), |(_, e)| (1, eps(e)));
                [4, e, head_dim as u32, n | g]
            }
        };
        [(8, code), (9, e), (11, hd), (12, mode)]
    }

    /// The norm weight (binding 3).
    pub(super) fn weight(&self) -> Option<&Subbuffer<[u32]>> {
        match self {
            XIn::Norm(w, _) => Some(w),
            XIn::Post {
                norm: Some((w, _)), ..
            } => Some(w),
            _ => None,
        }
    }

    /// The projections row (binding 4).
    pub(super) fn gates(&self) -> Option<&Subbuffer<[u32]>> {
        match self {
            XIn::Post { p, .. } => Some(p),
            _ => None,
        }
    }

    /// Whether the whole input must be staged at once (XIN 4).
    pub(super) fn whole(&self) -> bool {
        matches!(self, XIn::Post { .. })
    }

    /// Floats of `xin.glsl`'s per-head array (`xhr`) for rows of `cols`.
    pub(super) fn heads(&self, cols: usize) -> usize {
        match *self {
            XIn::Post { head_dim, .. } => cols / head_dim.max(1),
            _ => 1,
        }
    }
}

/// A command buffer being recorded, with the context its pipelines come from.
pub(crate) struct Rec<'c> {
    pub ctx: &'c Arc<Context>,
    pub b: AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    /// Dispatches recorded.
    pub dispatches: u32,
    /// When recording began.
    pub started: std::time::Instant,
    /// Kind of the commands [`Rec::run`] records next, for the profile.
    pub tag: &'static str,
    /// Timestamps after every command (`FOXEDGE_VK_PROFILE`).
    pub prof: Option<Prof>,
    /// Flops of the next command [`Rec::run`] records, for the profile.
    pub(super) flops: f64,
}

impl<'c> Rec<'c> {
    pub fn new(ctx: &'c Arc<Context>) -> Result<Self> {
        Ok(Self {
            ctx,
            b: ctx.builder()?,
            dispatches: 0,
            started: std::time::Instant::now(),
            tag: "other",
            prof: None,
            flops: 0.0,
        })
    }

    /// A recording to be submitted many times ([`Context::builder_reusable`]).
    pub fn reusable(ctx: &'c Arc<Context>) -> Result<Self> {
        Ok(Self {
            ctx,
            b: ctx.builder_reusable()?,
            dispatches: 0,
            started: std::time::Instant::now(),
            tag: "other",
            prof: None,
            flops: 0.0,
        })
    }

    /// Starts timing every command from here (`cap` timestamps at most); nothing where the
    /// queue has no timestamps.
    pub fn profile(&mut self, cap: u32) -> Result<()> {
        self.prof = Prof::start(self.ctx, cap, &mut self.b)?;
        Ok(())
    }

    /// Stamps the end of a command of `kind` when profiling.
    pub fn mark(&mut self, kind: &'static str) -> Result<()> {
        let flops = std::mem::take(&mut self.flops);
        match &mut self.prof {
            Some(p) => p.mark(&mut self.b, kind, flops),
            None => Ok(()),
        }
    }

    /// Binds `pipe` with `bufs` at bindings 0.. (buffer arrays: several at one binding), pushes
    /// `push`, dispatches `groups`.
    pub fn run<P: BufferContents + Copy>(
        &mut self,
        pipe: &Arc<ComputePipeline>,
        writes: Vec<WriteDescriptorSet>,
        push: P,
        groups: [u32; 3],
    ) -> Result<()> {
        if groups.contains(&0) {
            self.flops = 0.0;
            return Ok(());
        }
        let layout = pipe
            .layout()
            .set_layouts()
            .first()
            .cloned()
            .ok_or_else(|| Error::Vulkan("model pipeline has no descriptor set".into()))?;
        let set = DescriptorSet::new(self.ctx.desc.clone(), layout, writes, [])?;
        self.b.bind_pipeline_compute(pipe.clone())?;
        self.b
            .bind_descriptor_sets(PipelineBindPoint::Compute, pipe.layout().clone(), 0, set)?;
        self.b.push_constants(pipe.layout().clone(), 0, push)?;
        // SAFETY: pipeline, descriptor set and push constants are bound above. Every shader
        // of the model bounds its indices by what the host passes: token and row counts in
        // push constants that match the bound buffers' sizes (the stream sizes its scratch
        // for the chunk, and a weight chunk's rows for its binding), head slots < the bound
        // array, cache rows < the head's capacity (checked by the stream before recording).
        unsafe { self.b.dispatch(groups) }?;
        self.dispatches += 1;
        self.mark(self.tag)
    }

    /// `y[y_off + r] (+)= W x'` for one token, `x'` the input at float `x_off` (a multiple
    /// of 4) read through `xin` (`xin.glsl`: as stored, RMS-normed, or the gated
    /// activation of `[gate | up]`). Float formats run `mv.glsl` (teams of `MV_TPR` threads
    /// a row); Q8 / Q4 run `mvq.glsl`: a workgroup per group of 16 rows, 16 x LANES
    /// threads, LANES a power of two, at most one per block of a row, 64, and the device's
    /// workgroup limit.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &mut self,
        m: &Mat,
        xin: XIn<'_>,
        x: &Subbuffer<[u32]>,
        x_off: usize,
        y: &Subbuffer<[u32]>,
        y_off: usize,
        acc: bool,
    ) -> Result<()> {
        let wgs = self.mv_threads(m);
        let tile = self.xin_tile(m.cols, wgs, xin.heads(m.cols))?;
        if xin.whole() && tile as usize != m.cols / 4 {
            return Err(Error::Unsupported(
                "the attention output's transform needs the whole row in shared memory".into(),
            ));
        }
        let mut spec = vec![(0, wgs), (1, m.cols as u32), (10, tile)];
        spec.extend(xin.spec(m.cols));
        let (pipe, rows_per_group) = if m.format >= 3 {
            let (name, spv) = MVQ[usize::from(m.format == 4)];
            spec.push((2, u32::from(acc)));
            (self.ctx.pipeline(name, spv, &spec)?, 16)
        } else {
            let f = m.format as usize;
            spec.extend([(2, MV_TPR), (3, u32::from(acc))]);
            let pipe = self.ctx.pipeline(MV_NAMES[f], MV[f], &spec)?;
            (pipe, (wgs / MV_TPR) as usize)
        };
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            rows: u32,
            y_off: u32,
            x_off4: u32,
        }
        let nw = xin.weight().unwrap_or(x).clone();
        let pg = xin.gates().unwrap_or(x).clone();
        for (w, r0, rows) in &m.chunks {
            self.run(
                &pipe,
                vec![
                    WriteDescriptorSet::buffer(0, w.clone()),
                    WriteDescriptorSet::buffer(1, x.clone()),
                    WriteDescriptorSet::buffer(2, y.clone()),
                    WriteDescriptorSet::buffer(3, nw.clone()),
                    WriteDescriptorSet::buffer(4, pg.clone()),
                ],
                P {
                    rows: *rows as u32,
                    y_off: (y_off + r0) as u32,
                    x_off4: (x_off / 4) as u32,
                },
                [rows.div_ceil(rows_per_group) as u32, 1, 1],
            )?;
        }
        Ok(())
    }

    /// Threads per workgroup of [`Rec::matvec`] on `m`.
    fn mv_threads(&self, m: &Mat) -> u32 {
        if m.format >= 3 {
            16 * self.block_lanes(m.cols)
        } else {
            mv_wgs(m.chunks.iter().map(|c| c.2).sum(), self.on_cpu())
        }
    }

    /// Whether the device is a CPU (lavapipe).
    pub(super) fn on_cpu(&self) -> bool {
        self.ctx.info.device_type == "Cpu"
    }

    /// Whether [`Rec::matvec`] on `m` stages its whole input at once with heads of
    /// `head_dim` (as [`XIn::Post`] needs).
    pub(super) fn stages_whole(&self, m: &Mat, head_dim: usize) -> bool {
        self.xin_tile(m.cols, self.mv_threads(m), m.cols / head_dim.max(1))
            .is_ok_and(|t| t as usize == m.cols / 4)
    }

    /// Input vec4 per tile of `xin.glsl` for rows of `cols` weights and `wgs` threads: all
    /// of them when they fit in shared memory beside the kernel's reductions (`red`, `xss`:
    /// `wgs` floats each; `lv`: 16) and the per-head array (`heads` floats), else the most
    /// that fit, a multiple of 8 (whole Q8 / Q4 blocks and float row words).
    pub(super) fn xin_tile(&self, cols: usize, wgs: u32, heads: usize) -> Result<u32> {
        let fixed = 8 * wgs as usize + 64 + 4 * heads;
        let room = (self.ctx.info.max_shared_memory as usize).saturating_sub(fixed) / 16 / 8 * 8;
        if room == 0 {
            return Err(Error::Unsupported(
                "too little shared memory for the decode products".into(),
            ));
        }
        Ok((cols / 4).min(room) as u32)
    }

    /// Threads per row of `mvq.glsl` for rows of `cols` weights: a power of two, at most
    /// one per block of 32, 64, and the device's workgroup limit over 16 rows.
    pub(super) fn block_lanes(&self, cols: usize) -> u32 {
        let most = (self.ctx.info.max_workgroup_invocations as usize / 16).clamp(1, 64);
        1u32 << (cols / 32).clamp(1, most).ilog2()
    }

    /// One token or many: the matrix-vector kernel for one, the tiled product for more.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &mut self,
        m: &Mat,
        n: usize,
        x: &Subbuffer<[u32]>,
        y: &Subbuffer<[u32]>,
        y_off: usize,
        ldy: usize,
        acc: bool,
    ) -> Result<()> {
        if n == 1 {
            self.matvec(m, XIn::Plain, x, 0, y, y_off, acc)
        } else {
            self.matmul(m, n, x, y, y_off, ldy, acc)
        }
    }

    /// `h[t] = E[ids[t]]`.
    pub fn embed(
        &mut self,
        e: &Mat,
        ids: &Subbuffer<[u32]>,
        n: usize,
        h: &Subbuffer<[u32]>,
    ) -> Result<()> {
        self.tag = "embed";
        let pipe = self
            .ctx
            .pipeline("embed", EMBED, &[(0, e.cols as u32), (1, e.format)])?;
        for (w, r0, rows) in &e.chunks {
            self.run(
                &pipe,
                vec![
                    WriteDescriptorSet::buffer(0, w.clone()),
                    WriteDescriptorSet::buffer(1, ids.clone()),
                    WriteDescriptorSet::buffer(2, h.clone()),
                ],
                [*r0 as u32, *rows as u32],
                [n as u32, 1, 1],
            )?;
        }
        Ok(())
    }

    /// RMSNorm of `n` rows of `d` floats.
    pub fn rmsnorm(
        &mut self,
        d: usize,
        n: usize,
        x: &Subbuffer<[u32]>,
        w: &Subbuffer<[u32]>,
        eps: f64,
        y: &Subbuffer<[u32]>,
    ) -> Result<()> {
        self.tag = "rmsnorm";
        let pipe = self.ctx.pipeline("rmsnorm", RMSNORM, &[(0, d as u32)])?;
        self.run(
            &pipe,
            vec![
                WriteDescriptorSet::buffer(0, x.clone()),
                WriteDescriptorSet::buffer(1, w.clone()),
                WriteDescriptorSet::buffer(2, y.clone()),
            ],
            eps as f32,
            [n as u32, 1, 1],
        )
    }

    /// `attn_pre.comp` over `n` tokens: bindings in its order, spec (H, HD, kshift, vshift, qkn).
    pub fn attn_pre(
        &mut self,
        spec: [u32; 5],
        n: usize,
        bufs: [&Subbuffer<[u32]>; 9],
        qk_eps: f64,
    ) -> Result<()> {
        self.tag = "attn_pre";
        let pipe = self.ctx.pipeline(
            "attn_pre",
            ATTN_PRE,
            &[
                (0, spec[0]),
                (1, spec[1]),
                (2, spec[2]),
                (3, spec[3]),
                (4, spec[4]),
            ],
        )?;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            n: u32,
            qk_eps: f32,
        }
        let writes = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| WriteDescriptorSet::buffer(i as u32, (*b).clone()))
            .collect();
        self.run(
            &pipe,
            writes,
            P {
                n: n as u32,
                qk_eps: qk_eps as f32,
            },
            [n as u32, spec[0], 1],
        )
    }

    /// `attn_post.comp` over `n` tokens: (o, projections, output norm weight, out), spec
    /// (H, HD, norm, gate).
    pub fn attn_post(
        &mut self,
        spec: [u32; 4],
        n: usize,
        bufs: [&Subbuffer<[u32]>; 4],
        eps: f64,
    ) -> Result<()> {
        self.tag = "attn_post";
        let pipe = self.ctx.pipeline(
            "attn_post",
            ATTN_POST,
            &[(0, spec[0]), (1, spec[1]), (2, spec[2]), (3, spec[3])],
        )?;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            n: u32,
            eps: f32,
        }
        let writes = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| WriteDescriptorSet::buffer(i as u32, (*b).clone()))
            .collect();
        self.run(
            &pipe,
            writes,
            P {
                n: n as u32,
                eps: eps as f32,
            },
            [n as u32, spec[0], 1],
        )
    }

    /// `a = act(g) * u` over `n` rows of `gu = [g | u]` (`i` each).
    pub fn swiglu(
        &mut self,
        i: usize,
        act: u32,
        n: usize,
        gu: &Subbuffer<[u32]>,
        a: &Subbuffer<[u32]>,
    ) -> Result<()> {
        self.tag = "swiglu";
        let pipe = self
            .ctx
            .pipeline("swiglu", SWIGLU, &[(0, i as u32), (1, act)])?;
        self.run(
            &pipe,
            vec![
                WriteDescriptorSet::buffer(0, gu.clone()),
                WriteDescriptorSet::buffer(1, a.clone()),
            ],
            n as u32,
            [(n * i).div_ceil(256) as u32, 1, 1],
        )
    }

    /// `cache_ops.comp` on up to 8 head buffers: (heads, k, v, ops, ranges), one workgroup
    /// per head and [`CACHE_OPS_COLS`] columns.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_ops(
        &mut self,
        hd: usize,
        n: usize,
        heads: Vec<Subbuffer<[u32]>>,
        k: &Subbuffer<[u32]>,
        v: &Subbuffer<[u32]>,
        ops: &Subbuffer<[u32]>,
        ranges: &Subbuffer<[u32]>,
    ) -> Result<()> {
        self.tag = "cache_ops";
        let pipe = self
            .ctx
            .pipeline("cache_ops", CACHE_OPS, &[(0, hd as u32)])?;
        let slots = heads.len() as u32;
        let mut arr = heads;
        while arr.len() < 8 {
            arr.push(arr[0].clone());
        }
        self.run(
            &pipe,
            vec![
                WriteDescriptorSet::buffer_array(0, 0, arr),
                WriteDescriptorSet::buffer(1, k.clone()),
                WriteDescriptorSet::buffer(2, v.clone()),
                WriteDescriptorSet::buffer(3, ops.clone()),
                WriteDescriptorSet::buffer(4, ranges.clone()),
            ],
            n as u32,
            [slots, hd.max(4).div_ceil(CACHE_OPS_COLS) as u32, 1],
        )
    }

    /// `out = (argmax, max)` of `n` logits.
    pub fn argmax(
        &mut self,
        logits: &Subbuffer<[u32]>,
        n: usize,
        out: &Subbuffer<[u32]>,
    ) -> Result<()> {
        self.tag = "argmax";
        let pipe = self.ctx.pipeline("argmax", ARGMAX, &[])?;
        self.run(
            &pipe,
            vec![
                WriteDescriptorSet::buffer(0, logits.clone()),
                WriteDescriptorSet::buffer(1, out.clone()),
            ],
            n as u32,
            [1, 1, 1],
        )
    }
}

#[cfg(test)]
pub(super) mod tests;
