//! Prefill on the device: host-side decisions (c in f64, delta and start blocks from
//! foxedge-core), packing into the device layout, and the tiled kernel `prefill.glsl`.
//!
//! Device layout: every tensor head-first, one contiguous slab per (batch, head):
//! q/out `[slab][seq_q][d]`, k/v `[kv slab][seq_k][d]`, c `[slab][seq_k]` as (hi, lo) f32
//! pairs, first keys `[slab][acp query block]` (tokens). Slabs are grouped into chunks whose
//! every binding fits `maxStorageBufferRange`, one dispatch per chunk.
//!
//! Why c is a double-float pair: the kernel needs `D_ij = c_i - c_j` in f32, but `|c|`
//! grows without bound with the position (at |c| = 1e6 the f32 spacing is 0.06). With
//! `hi = f32(c)`, `lo = f32(c - hi)` the kernel forms `(hi_i - hi_j) + (lo_i - lo_j)`: when
//! `D` matters (|D| small next to |c|) `hi_i - hi_j` is exact (Sterbenz), so the error of D
//! is a rounding of D itself, on any sequence length, without per-tile re-uploads.

use crate::api::{Acp, AttentionStats, HeadStats, PrefillArgs, PrefillOptions, Storage};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::{pack_rows, split_f64, unpack_rows};
use foxedge_core::boundary::{self, BlockGrid};
use foxedge_core::{AttentionShape, gate, threshold};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};

static PREFILL_F32: &[u8] = include_bytes!("../shaders/prefill_f32.spv");
static PREFILL_F16: &[u8] = include_bytes!("../shaders/prefill_f16.spv");
static PREFILL_CM: &[u8] = include_bytes!("../shaders/prefill_cm.spv");

/// Which prefill kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum PrefillKernel {
    /// The tensor-core kernel when the device and the call allow it, else the scalar one.
    #[default]
    Auto = 0,
    /// `prefill.glsl`: shared-memory tiles, f32 FMA (any device, any head_dim).
    Scalar = 1,
    /// `prefill_cm.comp`: NV cooperative matrix (tensor cores), f16 storage, head_dim 64.
    CoopMat = 2,
}

/// Push constants of `prefill.glsl` (same order and types).
#[derive(BufferContents, Clone, Copy, Debug)]
#[repr(C)]
struct Push {
    seq_q: u32,
    seq_k: u32,
    q_off: u32,
    group: u32,
    n_qb: u32,
    scale_log2: f32,
    acp_bq: u32,
    acp_nqb: u32,
}

/// Kernel tile: `bm` query rows x `bn` keys, `tpr` threads per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTile {
    pub bm: u32,
    pub bn: u32,
    pub tpr: u32,
}

impl PrefillTile {
    /// Shared memory of `prefill.glsl` for this tile and head size (bytes).
    pub fn shared_bytes(&self, d: usize) -> usize {
        let (bm, bn, tpr) = (self.bm as usize, self.bn as usize, self.tpr as usize);
        2 * bn * (d / 4 + 1) * 16 + bm * (bn + 1) * 4 + bn * 8 + bm * tpr * 4
    }

    /// The largest tile the device holds: 64 rows, keys from 64 down to 8.
    pub(crate) fn choose(ctx: &Context, d: usize) -> Result<Self> {
        let d4 = d / 4;
        let tpr = [4u32, 2, 1]
            .into_iter()
            .find(|&t| d4 % t as usize == 0)
            .unwrap_or(1);
        for bm in [64u32, 32, 16] {
            if bm * tpr > ctx.info.max_workgroup_invocations {
                continue;
            }
            for bn in [64u32, 32, 16, 8] {
                let t = PrefillTile { bm, bn, tpr };
                if t.shared_bytes(d) <= ctx.info.max_shared_memory as usize {
                    return Ok(t);
                }
            }
        }
        Err(Error::Unsupported(format!(
            "head_dim {d} needs more shared memory than the device's {} bytes",
            ctx.info.max_shared_memory
        )))
    }
}

/// One dispatch: a run of consecutive kv slabs and their query slabs.
struct Chunk {
    set: Arc<DescriptorSet>,
    groups: [u32; 3],
    out: Subbuffer<[u32]>,
    lse: Subbuffer<[u32]>,
    slab0: usize,
    slabs: usize,
}

/// A prefill call whose inputs are on the device: run it (repeatedly, for timing) and read
/// the result. Built by [`crate::Vulkan::prepare_prefill`].
pub struct PreparedPrefill {
    ctx: Arc<Context>,
    pipe: Arc<ComputePipeline>,
    push: Push,
    chunks: Vec<Chunk>,
    shape: AttentionShape,
    stats: AttentionStats,
    tile: PrefillTile,
    f16: bool,
    coopmat: bool,
}

impl std::fmt::Debug for PreparedPrefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedPrefill")
            .field("shape", &self.shape)
            .field("tile", &self.tile)
            .field("f16_storage", &self.f16)
            .field("coopmat", &self.coopmat)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

/// `delta` of one (batch, query head), exactly as foxedge-cpu derives it (through core).
fn head_delta<T: Storage>(
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    scale: f32,
    b: usize,
    h: usize,
    key_start: usize,
) -> Result<Option<f64>> {
    let sh = &args.shape;
    let bh = b * sh.heads_q + h;
    let n_keys = sh.seq_k - key_start;
    Ok(match opts.acp {
        Acp::Off => None,
        Acp::Threshold(d) => {
            if d.len() != sh.batch * sh.heads_q {
                return Err(foxedge_core::Error::BadLength {
                    what: "ACP thresholds (batch * heads_q)",
                    expected: sh.batch * sh.heads_q,
                    got: d.len(),
                }
                .into());
            }
            if d[bh].is_nan() {
                return Err(foxedge_core::Error::BadArgument("ACP threshold is NaN").into());
            }
            Some(d[bh])
        }
        Acp::Bound { u, ln_eps } => {
            let uh = if u.len() == sh.heads_q {
                u[h]
            } else if u.len() == sh.batch * sh.heads_q {
                u[bh]
            } else {
                return Err(foxedge_core::Error::BadLength {
                    what: "ACP bounds (heads_q or batch * heads_q)",
                    expected: sh.heads_q,
                    got: u.len(),
                }
                .into());
            };
            Some(threshold::threshold(uh, n_keys, ln_eps)?)
        }
        Acp::ObservedNorms { ln_eps } => {
            let d = sh.head_dim;
            let norm = |x: &[T]| {
                x.iter()
                    .map(|v| f64::from(v.to_f32()).powi(2))
                    .sum::<f64>()
                    .sqrt()
            };
            let first_t = key_start.saturating_sub(sh.q_offset());
            let mut qn = 0.0f64;
            for t in first_t..sh.seq_q {
                qn = qn.max(norm(&args.q[sh.q_at(b, t, h)..][..d]));
            }
            let hk = h / sh.group();
            let mut kn = 0.0f64;
            for j in key_start..sh.seq_k {
                kn = kn.max(norm(&args.k[sh.kv_at(b, j, hk)..][..d]));
            }
            let u = threshold::bound_from_norms(qn, kn, f64::from(scale.abs()))?;
            Some(threshold::threshold(u, n_keys, ln_eps)?)
        }
    })
}

fn validate<T: Storage>(args: &PrefillArgs<'_, T>, opts: &PrefillOptions<'_>) -> Result<()> {
    let sh = &args.shape;
    sh.validate()?;
    let len = |what, expected: usize, got: usize| -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(foxedge_core::Error::BadLength {
                what,
                expected,
                got,
            }
            .into())
        }
    };
    len("q", sh.q_len(), args.q.len())?;
    len("k", sh.kv_len(), args.k.len())?;
    len("v", sh.kv_len(), args.v.len())?;
    len("log_fgate", sh.gate_len(), args.log_fgate.len())?;
    if let Some(s) = args.seq_start {
        len("seq_start", sh.batch, s.len())?;
        if s.iter().any(|&x| x >= sh.seq_k) {
            return Err(foxedge_core::Error::BadArgument("seq_start must be < seq_k").into());
        }
    }
    if opts.block_q == 0 || opts.block_k == 0 {
        return Err(foxedge_core::Error::BadArgument("block sizes must be > 0").into());
    }
    if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
        return Err(foxedge_core::Error::BadArgument("sm_scale must be finite").into());
    }
    let max = u32::MAX as usize;
    if sh.seq_k > max / 2 || sh.batch * sh.heads_q > 65_535 * 64 {
        return Err(Error::Unsupported(
            "sequence or head count too large for u32 indexing".into(),
        ));
    }
    Ok(())
}

pub(crate) fn prepare<T: Storage>(
    ctx: &Arc<Context>,
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
) -> Result<PreparedPrefill> {
    validate(args, opts)?;
    let sh = args.shape;
    let d = sh.head_dim;
    let g = sh.group();
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let grid = BlockGrid::new(opts.block_q, opts.block_k, sh.seq_q, sh.seq_k)?;
    let nqb = grid.q_blocks();
    let slabs = sh.batch * sh.heads_q;

    // Decisions (foxedge-core): c per (b, h) in f64, delta, start blocks, pair counts.
    gate::validate_log_gates(args.log_fgate)?;
    let key_start: Vec<usize> = args
        .seq_start
        .map_or_else(|| vec![0; sh.batch], <[usize]>::to_vec);
    let mut c = vec![0.0f64; sh.seq_k];
    let mut starts = vec![0u32; nqb];
    let mut c_pairs = vec![0u32; slabs * sh.seq_k * 2];
    let mut first_key = vec![0u32; slabs * nqb];
    let mut stats = AttentionStats {
        heads: Vec::with_capacity(slabs),
    };
    for bh in 0..slabs {
        let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
        gate::cumsum_strided(
            &args.log_fgate[sh.gate_at(b, 0, h)..],
            sh.gate_stride(),
            0.0,
            &mut c,
        )?;
        let delta = head_delta(args, opts, scale, b, h, key_start[b])?;
        boundary::start_blocks(&grid, &c, delta, key_start[b], &mut starts)?;
        let pc = boundary::count_pairs(&grid, &starts, key_start[b]);
        stats.heads.push(HeadStats {
            kept_pairs: pc.kept_pairs,
            total_pairs: pc.total_pairs,
            kept_blocks: pc.kept_blocks,
            total_blocks: pc.total_blocks,
            delta,
        });
        for (qb, &s) in starts.iter().enumerate() {
            let tok = (s as usize * opts.block_k).max(key_start[b]);
            first_key[bh * nqb + qb] = u32::try_from(tok).unwrap_or(u32::MAX);
        }
        split_f64(&c, &mut c_pairs[bh * sh.seq_k * 2..(bh + 1) * sh.seq_k * 2]);
    }

    let f16 = T::DTYPE == crate::api::DType::F16 && ctx.info.storage_16bit;
    let esize = if f16 { 2 } else { 4 };
    let cm_ok = ctx.info.coopmat_prefill && f16 && d == 64;
    let want = ctx
        .prefill_kernel
        .load(std::sync::atomic::Ordering::Relaxed);
    let coopmat = match want {
        x if x == PrefillKernel::CoopMat as u8 => {
            if !cm_ok {
                return Err(Error::Unsupported(format!(
                    "tensor-core prefill needs NV cooperative matrix (device: {}), f16 storage                      (call: {:?}) and head_dim 64 (call: {d})",
                    ctx.info.coopmat_prefill,
                    T::DTYPE
                )));
            }
            true
        }
        x if x == PrefillKernel::Scalar as u8 => false,
        _ => cm_ok,
    };
    let (tile, pipe) = if coopmat {
        let sg = ctx.info.subgroup_size.unwrap_or(32);
        let tile = PrefillTile {
            bm: 64,
            bn: 64,
            tpr: 0,
        };
        (
            tile,
            ctx.pipeline("prefill_cm", PREFILL_CM, &[(0, 4 * sg), (2, sg)])?,
        )
    } else {
        let tile = PrefillTile::choose(ctx, d)?;
        let spv = if f16 { PREFILL_F16 } else { PREFILL_F32 };
        let name = if f16 { "prefill_f16" } else { "prefill_f32" };
        let pipe = ctx.pipeline(
            name,
            spv,
            &[
                (0, tile.bm * tile.tpr),
                (1, d as u32),
                (2, tile.bm),
                (3, tile.bn),
                (4, tile.tpr),
            ],
        )?;
        (tile, pipe)
    };
    // The tensor-core kernel loads whole 16-row / 64-key fragments: one tile of slack at
    // the end of q, k and v keeps those loads inside the buffers.
    let slack = if coopmat { 64 * d / 2 } else { 0 };
    let n_tiles = sh.seq_q.div_ceil(tile.bm as usize);

    // Chunking under the binding range: bytes per kv slab of every binding.
    let per_kv = [
        g * sh.seq_q * d * esize,
        sh.seq_k * d * esize,
        g * sh.seq_k * 8,
        g * sh.seq_q * d * 4,
        g * nqb * 4,
        g * sh.seq_q * 4,
    ];
    let limit = ctx.binding_limit.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let worst = per_kv.iter().copied().max().unwrap_or(1).max(1);
    if worst > limit {
        return Err(Error::Unsupported(format!(
            "one head needs a {worst}-byte buffer, over the device's limit of {limit} bytes"
        )));
    }
    let kv_slabs = sh.batch * sh.heads_kv;
    let per_chunk = (limit / worst).clamp(1, 65_535 / g.max(1)).min(kv_slabs);

    let mut chunks = Vec::new();
    let mut kv0 = 0;
    while kv0 < kv_slabs {
        let nkv = per_chunk.min(kv_slabs - kv0);
        let s0 = kv0 * g;
        let ns = nkv * g;
        // Device slabs in (b, kv head, group member) order = (b, q head) order.
        let mut q = pack_rows(args.q, f16, ns * sh.seq_q, d, |r| {
            let (s, t) = (s0 + r / sh.seq_q, r % sh.seq_q);
            sh.q_at(s / sh.heads_q, t, s % sh.heads_q)
        });
        let kv_row = |r: usize| {
            let (s, t) = (kv0 + r / sh.seq_k, r % sh.seq_k);
            sh.kv_at(s / sh.heads_kv, t, s % sh.heads_kv)
        };
        let mut k = pack_rows(args.k, f16, nkv * sh.seq_k, d, kv_row);
        let mut v = pack_rows(args.v, f16, nkv * sh.seq_k, d, kv_row);
        for p in [&mut q, &mut k, &mut v] {
            p.words.resize(p.words.len() + slack, 0);
        }
        let cw = &c_pairs[s0 * sh.seq_k * 2..(s0 + ns) * sh.seq_k * 2];
        let fk = &first_key[s0 * nqb..(s0 + ns) * nqb];
        let bufs = ctx.upload(&[&q.words, &k.words, &v.words, cw, fk])?;
        let out = ctx.device_buffer(ns * sh.seq_q * d)?;
        let lse = ctx.device_buffer(ns * sh.seq_q)?;
        let layout = pipe
            .layout()
            .set_layouts()
            .first()
            .cloned()
            .ok_or_else(|| Error::Vulkan("prefill pipeline has no descriptor set".into()))?;
        let set = DescriptorSet::new(
            ctx.desc.clone(),
            layout,
            [
                WriteDescriptorSet::buffer(0, bufs[0].clone()),
                WriteDescriptorSet::buffer(1, bufs[1].clone()),
                WriteDescriptorSet::buffer(2, bufs[2].clone()),
                WriteDescriptorSet::buffer(3, bufs[3].clone()),
                WriteDescriptorSet::buffer(4, bufs[4].clone()),
                WriteDescriptorSet::buffer(5, out.clone()),
                WriteDescriptorSet::buffer(6, lse.clone()),
            ],
            [],
        )?;
        chunks.push(Chunk {
            set,
            groups: [n_tiles as u32, ns as u32, 1],
            out,
            lse,
            slab0: s0,
            slabs: ns,
        });
        kv0 += nkv;
    }
    let push = Push {
        seq_q: sh.seq_q as u32,
        seq_k: sh.seq_k as u32,
        q_off: sh.q_offset() as u32,
        group: g as u32,
        n_qb: n_tiles as u32,
        scale_log2: scale * std::f32::consts::LOG2_E,
        acp_bq: opts.block_q.min(u32::MAX as usize) as u32,
        acp_nqb: nqb as u32,
    };
    Ok(PreparedPrefill {
        ctx: ctx.clone(),
        pipe,
        push,
        chunks,
        shape: sh,
        stats,
        tile,
        f16,
        coopmat,
    })
}

impl PreparedPrefill {
    /// Runs the kernel `reps` times in one command buffer and returns the wall time of
    /// submit-to-completion (divide by `reps` for one call's device time, amortised).
    pub fn run(&self, reps: usize) -> Result<Duration> {
        let mut b = self.ctx.builder()?;
        b.bind_pipeline_compute(self.pipe.clone())?;
        for _ in 0..reps.max(1) {
            for ch in &self.chunks {
                b.bind_descriptor_sets(
                    PipelineBindPoint::Compute,
                    self.pipe.layout().clone(),
                    0,
                    ch.set.clone(),
                )?;
                b.push_constants(self.pipe.layout().clone(), 0, self.push)?;
                // SAFETY: the pipeline, its descriptor set and push constants are bound above;
                // the buffers hold exactly the slabs the grid indexes (sizes from `prepare`),
                // and the shader bounds every access by seq_q / seq_k.
                unsafe { b.dispatch(ch.groups) }?;
            }
        }
        let t0 = Instant::now();
        self.ctx.submit(b)?;
        Ok(t0.elapsed())
    }

    /// Statistics of this call (from foxedge-core, as the CPU backend reports them).
    pub fn stats(&self) -> &AttentionStats {
        &self.stats
    }

    /// The kernel tile in use.
    pub fn tile(&self) -> PrefillTile {
        self.tile
    }

    /// Whether the tensor-core kernel runs.
    pub fn coopmat(&self) -> bool {
        self.coopmat
    }

    /// Whether q/k/v are f16 on the device.
    pub fn f16_storage(&self) -> bool {
        self.f16
    }

    /// Copies the output into `out` (`shape.q_len()` elements in `shape.layout`) and,
    /// when given, the natural-log normalisers into `lse` (`[batch, heads_q, seq_q]`).
    pub fn read<O: Storage>(&self, out: &mut [O], lse: Option<&mut [f32]>) -> Result<()> {
        let sh = &self.shape;
        let d = sh.head_dim;
        if out.len() != sh.q_len() {
            return Err(foxedge_core::Error::BadLength {
                what: "out",
                expected: sh.q_len(),
                got: out.len(),
            }
            .into());
        }
        let rows = sh.batch * sh.heads_q * sh.seq_q;
        if let Some(l) = lse.as_deref() {
            if l.len() != rows {
                return Err(foxedge_core::Error::BadLength {
                    what: "lse",
                    expected: rows,
                    got: l.len(),
                }
                .into());
            }
        }
        let mut lse = lse;
        for ch in &self.chunks {
            let got = self.ctx.download(&[&ch.out, &ch.lse])?;
            unpack_rows(&got[0], out, ch.slabs * sh.seq_q, d, |r| {
                let (s, t) = (ch.slab0 + r / sh.seq_q, r % sh.seq_q);
                sh.q_at(s / sh.heads_q, t, s % sh.heads_q)
            });
            if let Some(l) = lse.as_deref_mut() {
                let dst = &mut l[ch.slab0 * sh.seq_q..(ch.slab0 + ch.slabs) * sh.seq_q];
                for (x, &w) in dst.iter_mut().zip(&got[1]) {
                    *x = f32::from_bits(w);
                }
            }
        }
        Ok(())
    }
}
