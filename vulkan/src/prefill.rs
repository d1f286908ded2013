//! Prefill on the device: host-side decisions (c in f64, delta and start blocks from
//! `foxedge_core::contract::acp`), packing into the device layout, and one of three kernels: the scalar
//! tiled `prefill.glsl` (any device), the tensor-core `prefill_cm.comp` (S and P through
//! shared memory) and the tensor-core `prefill_fa.glsl` (softmax in registers, K/V tiles
//! staged once per workgroup, work list of (slab, query tile) items, heaviest first).
//!
//! Every kernel sets a flag word when a row that attended keys ends with a non-finite
//! softmax (NaN/inf in q or k, or `s q.k` overflowing f32); reading the result then fails
//! with the CPU backend's error instead of returning that row.
//!
//! Device layout: every tensor head-first, one contiguous slab per (batch, head):
//! q/out `[slab][seq_q][d]`, k/v `[kv slab][seq_k][d]`, c `[slab][seq_k]` as (hi, lo) f32
//! pairs, first keys `[slab][acp query block]` (tokens). Slabs are grouped into chunks whose
//! every binding fits `maxStorageBufferRange`, one dispatch per chunk.
//!
//! Host path: decisions per slab in parallel; q, k and v packed in parallel straight into
//! mapped staging buffers; one submit for every upload; one for every readback, unpacked in
//! parallel straight from mapped memory. Every buffer comes from the context's arena
//! (`arena.rs`): reused from call to call, exclusively owned by one live call.
//! `FOXEDGE_VULKAN_PROFILE=1` prints the time of each phase per `Vulkan::prefill` call.
//!
//! Why c is a double-float pair: the kernel needs `D_ij = c_i - c_j` in f32, but `|c|`
//! grows without bound with the position (at |c| = 1e6 the f32 spacing is 0.06). With
//! `hi = f32(c)`, `lo = f32(c - hi)` the kernel forms `(hi_i - hi_j) + (lo_i - lo_j)`: when
//! `D` matters (|D| small next to |c|) `hi_i - hi_j` is exact (Sterbenz), so the error of D
//! is a rounding of D itself, on any sequence length, without per-tile re-uploads.

use crate::arena::{Kind, Lease, Pool};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::{pack_f16_into, pack_f32_into, split_f64, unpack_rows};
use foxedge_core::boundary::BlockGrid;
use foxedge_core::contract::{
    Acp, AttentionStats, HeadStats, PrefillArgs, PrefillOptions, SERIAL_DECISIONS, Storage, acp,
    selected_slabs,
};
use foxedge_core::{AttentionShape, Layout, gate};
use half::slice::HalfBitsSliceExt;
use rayon::prelude::*;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::CopyBufferInfo;
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};
use vulkano::sync::HostAccessError;

static PREFILL_F32: &[u8] = include_bytes!("../shaders/prefill_f32.spv");
static PREFILL_F16: &[u8] = include_bytes!("../shaders/prefill_f16.spv");
static PREFILL_CM: &[u8] = include_bytes!("../shaders/prefill_cm.spv");
static PREFILL_CM_KHR: &[u8] = include_bytes!("../shaders/prefill_cm_khr.spv");
static PREFILL_FA: &[u8] = include_bytes!("../shaders/prefill_fa.spv");
static PREFILL_FA_NB: &[u8] = include_bytes!("../shaders/prefill_fa_nb.spv");
static PREFILL_CM_PROBE: &[u8] = include_bytes!("../shaders/prefill_cm_probe.spv");

/// What the CPU backend reports for a row whose softmax is not finite.
const NON_FINITE: foxedge_core::Error = foxedge_core::Error::BadArgument(
    "attention logits are not finite: q, k or v holds NaN/inf, or s*q.k overflows f32",
);

/// Which prefill kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum PrefillKernel {
    /// The tensor-core kernel when the device and the call allow it, else the scalar one.
    #[default]
    Auto = 0,
    /// `prefill.glsl`: shared-memory tiles, f32 FMA (any device, any head_dim).
    Scalar = 1,
    /// `prefill_cm.glsl`: KHR or NV cooperative matrix (tensor cores), f16 storage,
    /// head_dim 64; S and P pass through shared memory (any cooperative-matrix layout).
    CoopMat = 2,
    /// `prefill_fa.glsl`: NV cooperative matrix, f16 storage, head_dim 64, softmax on the
    /// accumulators in registers; needs the accumulator layout it assumes (probed on the
    /// device, see [`crate::Vulkan::supports`]) and 32-lane subgroups.
    Flash = 3,
}

/// Settings of the [`PrefillKernel::Flash`] kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashConfig {
    /// Subgroups per workgroup (16 query rows each): 2, 4, 8 or 16; 0 chooses per call
    /// ([`FlashConfig::auto_subgroups`]).
    pub subgroups: u32,
    /// Stage tiles with 16-byte shared stores (aliased shared blocks) where the device has
    /// VK_KHR_workgroup_memory_explicit_layout; `false` stores 2-byte halves.
    pub shared_blocks: bool,
}

impl Default for FlashConfig {
    fn default() -> Self {
        Self {
            subgroups: 0,
            shared_blocks: true,
        }
    }
}

impl FlashConfig {
    /// Subgroups per workgroup for `slabs` (batch x query heads) of `seq_q` rows: 8 (128-row
    /// tiles, half the K/V traffic of 64-row tiles) when that still gives at least 256
    /// workgroups (two per multiprocessor on a 132-SM H100), else 4. Measured on the H100
    /// (2026-11-22; BENCHMARKS.md, "Vulkan attention kernels"): 8 wins at L = 8192 x 8
    /// heads and L = 16384 x 32 heads by 1.5x, 4 wins at L = 2048 x 8 heads and L = 4096 x
    /// 4 heads by 1.1-1.2x.
    pub fn auto_subgroups(slabs: usize, seq_q: usize) -> u32 {
        if slabs * seq_q.div_ceil(128) >= 256 {
            8
        } else {
            4
        }
    }

    pub(crate) fn pack(self) -> u32 {
        self.subgroups | (u32::from(self.shared_blocks) << 8) | (1 << 16)
    }

    pub(crate) fn unpack(w: u32) -> Self {
        if w & (1 << 16) == 0 {
            return Self::default();
        }
        Self {
            subgroups: w & 0xff,
            shared_blocks: (w >> 8) & 1 == 1,
        }
    }
}

/// The accumulator layout `prefill_fa.glsl` runs with: its `LAYOUT` constant and the
/// per-lane table `(row of slot 0, row of slot 1, slot bits, 4-bit columns)` it reads
/// when `LAYOUT` is 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FlashLayout {
    pub id: u32,
    pub table: Vec<u32>,
}

/// The (row, column) of each element of each lane of a 16 x 16 f32 cooperative matrix
/// (lane-major, 8 elements a lane), measured with `prefill_cm_probe.comp` once per device;
/// `None` when the device has no cooperative matrices, 32-lane subgroups, or 8 elements
/// per lane.
pub(crate) fn coopmat_layout(ctx: &Context) -> Result<Option<Vec<(u32, u32)>>> {
    let words = match ctx.fa_layout.get() {
        Some(w) => w.clone(),
        None => {
            // The probe and the register-softmax kernel are NV cooperative-matrix shaders.
            let nv = ctx.info.coopmat_prefill && ctx.info.cooperative_matrix_nv;
            let w = if nv && ctx.info.subgroup_size == Some(32) {
                // A failed probe counts as "no layout" from then on; the error is returned once.
                run_probe(ctx).inspect_err(|_| {
                    let _ = ctx.fa_layout.set(Vec::new());
                })?
            } else {
                Vec::new()
            };
            ctx.fa_layout.get_or_init(|| w).clone()
        }
    };
    if words.len() != 1 + 8 * 32 || f32::from_bits(words[0]) != 8.0 {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(256);
    for &w in &words[1..] {
        let x = f32::from_bits(w);
        if !(0.0..256.0).contains(&x) || x.fract() != 0.0 {
            return Ok(None);
        }
        out.push((x as u32 / 16, x as u32 % 16));
    }
    Ok(Some(out))
}

fn run_probe(ctx: &Context) -> Result<Vec<u32>> {
    let pipe = ctx.pipeline("prefill_cm_probe", PREFILL_CM_PROBE, &[(0, 32)])?;
    let idx: Vec<u32> = (0..256u32).map(|x| (x as f32).to_bits()).collect();
    let bufs = ctx.upload(&[&idx])?;
    let out = ctx.device_buffer(1 + 8 * 32)?;
    let layout = pipe
        .layout()
        .set_layouts()
        .first()
        .cloned()
        .ok_or_else(|| Error::Vulkan("probe pipeline has no descriptor set".into()))?;
    let set = DescriptorSet::new(
        ctx.desc.clone(),
        layout,
        [
            WriteDescriptorSet::buffer(0, bufs[0].clone()),
            WriteDescriptorSet::buffer(1, out.clone()),
        ],
        [],
    )?;
    let mut b = ctx.builder()?;
    b.bind_pipeline_compute(pipe.clone())?;
    b.bind_descriptor_sets(PipelineBindPoint::Compute, pipe.layout().clone(), 0, set)?;
    // SAFETY: pipeline and descriptor set bound above; the shader writes at most
    // 1 + 8 * 32 words into `out`, which holds exactly that many, and reads 256 words.
    unsafe { b.dispatch([1, 1, 1]) }?;
    ctx.submit(b)?;
    Ok(ctx.download(&[&out])?.remove(0))
}

/// Whether `prefill_fa.glsl` can compute its softmax in this accumulator layout
/// (`(row, col)` per lane-major element): every lane holds 4 elements of each of two rows,
/// the 4 lanes of an aligned quad hold the same two rows, and the 256 elements are
/// covered once. Returns the kernel's `LAYOUT` constant and lane table.
pub(crate) fn flash_layout(map: &[(u32, u32)]) -> Option<FlashLayout> {
    if map.len() != 256 {
        return None;
    }
    let mut seen = [false; 256];
    let mut table = Vec::with_capacity(32 * 4);
    let mut rows_of = Vec::with_capacity(32);
    for lane in 0..32usize {
        let el = &map[lane * 8..lane * 8 + 8];
        let r0 = el.iter().map(|x| x.0).min()?;
        let r1 = el.iter().map(|x| x.0).max()?;
        if r0 == r1
            || el.iter().any(|x| x.0 != r0 && x.0 != r1)
            || el.iter().filter(|x| x.0 == r0).count() != 4
        {
            return None;
        }
        let (mut slots, mut cols) = (0u32, 0u32);
        for (e, &(r, c)) in el.iter().enumerate() {
            let i = (r * 16 + c) as usize;
            if r >= 16 || c >= 16 || seen[i] {
                return None;
            }
            seen[i] = true;
            slots |= u32::from(r == r1) << e;
            cols |= c << (4 * e);
        }
        rows_of.push((r0, r1));
        table.extend([r0, r1, slots, cols]);
    }
    // Quads share their rows; a row lives in one quad only (with full coverage above).
    if (0..32).any(|l| rows_of[l] != rows_of[l & !3]) {
        return None;
    }
    let rule = |slot: fn(u32) -> u32, col: fn(u32, u32) -> u32| {
        (0..32u32).all(|lane| {
            (0..8u32).all(|e| {
                map[(lane * 8 + e) as usize] == ((lane >> 2) + 8 * slot(e), col(lane & 3, e))
            })
        })
    };
    let id = if rule(|e| (e >> 1) & 1, |q, e| 2 * q + (e & 1) + 8 * (e >> 2)) {
        1
    } else if rule(|e| e >> 2, |q, e| 2 * q + (e & 1) + 8 * ((e >> 1) & 1)) {
        2
    } else {
        0
    };
    Some(FlashLayout { id, table })
}

/// The layout the flash kernel runs with on this device, `None` where it cannot run.
pub(crate) fn flash_layout_of(ctx: &Context) -> Result<Option<FlashLayout>> {
    Ok(coopmat_layout(ctx)?.and_then(|m| flash_layout(&m)))
}

/// Push constants of `prefill.glsl` and `prefill_cm.comp` (same order and types).
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

/// Push constants of `prefill_fa.glsl` (same order and types).
#[derive(BufferContents, Clone, Copy, Debug)]
#[repr(C)]
struct PushFa {
    seq_q: u32,
    seq_k: u32,
    q_off: u32,
    group: u32,
    n_items: u32,
    scale_log2: f32,
    acp_bq: u32,
    acp_nqb: u32,
    gx: u32,
}

/// Kernel tile: `bm` query rows x `bn` keys, `tpr` threads per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTile {
    pub bm: u32,
    pub bn: u32,
    pub tpr: u32,
}

impl PrefillTile {
    /// The specialization constants of a shader built on `prefill.glsl`'s tile (workgroup
    /// size, head size `d`, rows, keys, threads per row), as `Context::pipeline` takes them.
    pub fn constants(&self, d: usize) -> [(u32, u32); 5] {
        [
            (0, self.bm * self.tpr),
            (1, d as u32),
            (2, self.bm),
            (3, self.bn),
            (4, self.tpr),
        ]
    }

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
    /// Work items of this chunk (flash kernel; 0 otherwise).
    items: u32,
    out: Subbuffer<[u32]>,
    lse: Subbuffer<[u32]>,
    /// Readback staging of `out` and `lse`.
    out_host: Subbuffer<[u32]>,
    lse_host: Subbuffer<[u32]>,
    slab0: usize,
    slabs: usize,
}

/// Host-side time of one prefill call by phase (`FOXEDGE_VULKAN_PROFILE`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Phases {
    /// c, thresholds, start blocks and pair counts (foxedge-core), all slabs.
    pub decisions: Duration,
    /// Kernel choice, buffers from the arena, work lists, descriptor sets.
    pub setup: Duration,
    /// q, k, v (and the small inputs) into the mapped staging buffers.
    pub pack: Duration,
    /// Staging-to-device copies, submit and wait.
    pub upload: Duration,
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
    /// The kernel that runs (never `Auto`).
    kernel: PrefillKernel,
    flash: Option<FlashConfig>,
    /// One word, set by the kernel when a softmax row is not finite.
    flag: Subbuffer<[u32]>,
    flag_host: Subbuffer<[u32]>,
    phases: Phases,
    /// Serialises `read`s of this call (they share the readback staging).
    read_lock: Mutex<()>,
    /// The (b * heads_q + h) slab of each device slab: every slab in order, or the heads
    /// the call selected ([`PrefillOptions::heads`]).
    selected: Vec<usize>,
    /// The kernels read and write host-visible buffers (unified memory): nothing to copy.
    direct: bool,
    /// The buffers above belong to this arena; the context's pooled arena goes back to
    /// the context when this call is dropped.
    lease: Lease,
}

impl std::fmt::Debug for PreparedPrefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedPrefill")
            .field("shape", &self.shape)
            .field("tile", &self.tile)
            .field("f16_storage", &self.f16)
            .field("kernel", &self.kernel)
            .field("pooled_buffers", &self.lease.arena.pooled())
            .field("flash", &self.flash)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

/// The contract's checks ([`PrefillArgs::check`]), then the device's index limits.
fn validate<T: Storage>(args: &PrefillArgs<'_, T>, opts: &PrefillOptions<'_>) -> Result<()> {
    args.check(opts)?;
    let sh = &args.shape;
    let max = u32::MAX as usize;
    if sh.seq_k > max / 2 || sh.batch * sh.heads_q > 65_535 * 64 {
        return Err(Error::Unsupported(
            "sequence or head count too large for u32 indexing".into(),
        ));
    }
    Ok(())
}

/// `half`: q, k, v go to the device as f16 whatever `T` is (where the device has 16-bit
/// storage), rounded to nearest even while they are packed. `on_packed` runs after the
/// packing, before the upload.
pub(crate) fn prepare<T: Storage>(
    ctx: &Arc<Context>,
    pool: &Pool,
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    half: bool,
    on_packed: &mut dyn FnMut(),
) -> Result<PreparedPrefill> {
    validate(args, opts)?;
    let sh = args.shape;
    let d = sh.head_dim;
    let g = sh.group();
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let grid = BlockGrid::new(opts.block_q, opts.block_k, sh.seq_q, sh.seq_k)?;
    let nqb = grid.q_blocks();
    // The computed slabs' (b * heads_q + h): device slab `i` is `sel[i]`.
    let sel: Vec<usize> = selected_slabs(&sh, opts.heads)?.collect();
    if opts.heads.is_some() && g != 1 {
        return Err(Error::Unsupported(
            "a prefill of selected heads needs heads_kv = heads_q".into(),
        ));
    }
    let slabs = sel.len();

    // Decisions (foxedge-core): c per (b, h) in f64, delta, start blocks, pair counts. A
    // small call is decided on this thread, every slab's `c` in one pass over the gates; a
    // large one slab by slab on the pool (`SERIAL_DECISIONS`), each writing its own parts of
    // c_pairs and first_key. Statistics stay in slab order and the first failing slab's
    // error is returned, as serially.
    let t_dec = Instant::now();
    let heavy = matches!(opts.acp, Acp::ObservedNorms { .. });
    let serial = !heavy && slabs * sh.seq_k <= SERIAL_DECISIONS;
    // Every slab's `c` in one pass over the gates (a selection forms its slabs' own).
    let whole = serial && opts.heads.is_none();
    let mut formed = Vec::new();
    let decided = match opts.acp {
        Acp::Decided(dec) => {
            acp::check_decisions(&dec, &grid, sh.batch * sh.heads_q, sh.seq_k)?;
            Some(dec)
        }
        _ if whole => {
            formed = vec![0.0f64; slabs * sh.seq_k];
            gate::cumsum_heads(&sh, args.log_fgate, &mut formed)?;
            None
        }
        _ => {
            gate::validate_log_gates(args.log_fgate)?;
            None
        }
    };
    let key_start: Vec<usize> = args
        .seq_start
        .map_or_else(|| vec![0; sh.batch], <[usize]>::to_vec);
    let mut c_pairs = vec![0u32; slabs * sh.seq_k * 2];
    let mut first_key = vec![0u32; slabs * nqb];
    // Each slab's start blocks when it forms them (the caller's are read in place).
    let mut own_starts = vec![0u32; slabs * nqb];
    // `c_buf`: a slab's `c` when it is formed here slab by slab (parallel calls, selections).
    let one = |i: usize, cw: &mut [u32], fk: &mut [u32], st_buf: &mut [u32], c_buf: &mut [f64]| {
        let bh = sel[i];
        let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
        let ks = key_start[b];
        let (c, starts, stats): (&[f64], &[u32], HeadStats) = match decided {
            Some(dec) => {
                let st = &dec.start_blocks[bh * nqb..][..nqb];
                let stats = acp::head_stats(&grid, st, ks, dec.delta[bh]);
                (&dec.c[bh * sh.seq_k..][..sh.seq_k], st, stats)
            }
            None => {
                let c: &[f64] = if whole {
                    &formed[bh * sh.seq_k..][..sh.seq_k]
                } else {
                    let gates = &args.log_fgate[sh.gate_at(b, 0, h)..];
                    gate::cumsum_strided(gates, sh.gate_stride(), 0.0, c_buf)?;
                    c_buf
                };
                let stats = acp::decide_slab(args, &opts.acp, scale, &grid, bh, ks, c, st_buf)?;
                (c, st_buf, stats)
            }
        };
        for (f, &s) in fk.iter_mut().zip(starts.iter()) {
            let tok = (s as usize * opts.block_k).max(ks);
            *f = u32::try_from(tok).unwrap_or(u32::MAX);
        }
        split_f64(c, cw);
        Ok::<_, Error>(stats)
    };
    let c_need = if decided.is_some() || whole {
        0
    } else {
        sh.seq_k
    };
    let heads: Vec<Result<HeadStats>> = if serial {
        let mut c_buf = vec![0.0f64; c_need];
        c_pairs
            .chunks_mut(sh.seq_k * 2)
            .zip(first_key.chunks_mut(nqb))
            .zip(own_starts.chunks_mut(nqb))
            .enumerate()
            .map(|(i, ((cw, fk), st))| one(i, cw, fk, st, &mut c_buf))
            .collect()
    } else {
        c_pairs
            .par_chunks_mut(sh.seq_k * 2)
            .zip(first_key.par_chunks_mut(nqb))
            .zip(own_starts.par_chunks_mut(nqb))
            .enumerate()
            .map_init(
                || vec![0.0f64; c_need],
                |c_buf, (i, ((cw, fk), st))| one(i, cw, fk, st, c_buf),
            )
            .collect()
    };
    let stats = AttentionStats {
        heads: heads.into_iter().collect::<Result<Vec<_>>>()?,
    };
    let mut phases = Phases {
        decisions: t_dec.elapsed(),
        ..Phases::default()
    };
    let t_setup = Instant::now();

    let f16 = (half || T::DTYPE == foxedge_core::contract::DType::F16) && ctx.info.storage_16bit;
    let esize = if f16 { 2 } else { 4 };
    let cm_ok = ctx.info.coopmat_prefill && f16 && d == 64;
    let want = ctx
        .prefill_kernel
        .load(std::sync::atomic::Ordering::Relaxed);
    let fa_layout = if !cm_ok {
        None
    } else if want == PrefillKernel::Flash as u8 {
        flash_layout_of(ctx)?
    } else if want == PrefillKernel::Auto as u8 {
        // Auto falls back to the other kernels when the probe cannot run.
        flash_layout_of(ctx).unwrap_or(None)
    } else {
        None
    };
    let fa_ok = || -> Result<bool> { Ok(fa_layout.is_some()) };
    let unsupported = |what: &str| {
        let dtype = match T::DTYPE {
            foxedge_core::contract::DType::F32 => "f32",
            foxedge_core::contract::DType::F16 => "f16",
            foxedge_core::contract::DType::Bf16 => "bf16",
        };
        Error::Unsupported(format!(
            "{what} needs KHR or NV cooperative matrix (device: {}), f16 storage (call: {dtype}) and \
             head_dim 64 (call: {d})",
            ctx.info.coopmat_prefill,
        ))
    };
    let kernel = match want {
        x if x == PrefillKernel::Scalar as u8 => PrefillKernel::Scalar,
        x if x == PrefillKernel::CoopMat as u8 => {
            if !cm_ok {
                return Err(unsupported("tensor-core prefill"));
            }
            PrefillKernel::CoopMat
        }
        x if x == PrefillKernel::Flash as u8 => {
            if !fa_ok()? {
                return Err(unsupported(
                    "register-softmax prefill (and the probed accumulator layout)",
                ));
            }
            PrefillKernel::Flash
        }
        _ if fa_ok()? => PrefillKernel::Flash,
        _ if cm_ok => PrefillKernel::CoopMat,
        _ => PrefillKernel::Scalar,
    };
    let coopmat = kernel != PrefillKernel::Scalar;
    let sg = ctx.info.subgroup_size.unwrap_or(32);
    let mut flash = None;
    let mut lay_table = vec![0u32; 4];
    let (tile, pipe) = match kernel {
        PrefillKernel::CoopMat => (
            PrefillTile {
                bm: 64,
                bn: 64,
                tpr: 0,
            },
            if ctx.info.coopmat_khr {
                ctx.pipeline("prefill_cm_khr", PREFILL_CM_KHR, &[(0, 4 * sg), (2, sg)])?
            } else {
                ctx.pipeline("prefill_cm", PREFILL_CM, &[(0, 4 * sg), (2, sg)])?
            },
        ),
        PrefillKernel::Flash => {
            let mut cfg =
                FlashConfig::unpack(ctx.flash_cfg.load(std::sync::atomic::Ordering::Relaxed));
            cfg.shared_blocks &= ctx.info.shared_memory_blocks;
            if cfg.subgroups == 0 {
                cfg.subgroups = FlashConfig::auto_subgroups(slabs, sh.seq_q);
            }
            if ![2, 4, 8, 16].contains(&cfg.subgroups)
                || 32 * cfg.subgroups > ctx.info.max_workgroup_invocations
            {
                return Err(Error::Unsupported(format!(
                    "flash prefill: {} subgroups per workgroup (2, 4, 8 or 16, within the device's workgroup size)",
                    cfg.subgroups
                )));
            }
            flash = Some(cfg);
            let fl = fa_layout
                .clone()
                .ok_or_else(|| unsupported("flash prefill"))?;
            lay_table = fl.table;
            let (name, spv) = if cfg.shared_blocks {
                ("prefill_fa", PREFILL_FA)
            } else {
                ("prefill_fa_nb", PREFILL_FA_NB)
            };
            (
                PrefillTile {
                    bm: 16 * cfg.subgroups,
                    bn: 64,
                    tpr: 0,
                },
                ctx.pipeline(
                    name,
                    spv,
                    &[(0, 32 * cfg.subgroups), (1, cfg.subgroups), (2, fl.id)],
                )?,
            )
        }
        _ => {
            let tile = PrefillTile::choose(ctx, d)?;
            let spv = if f16 { PREFILL_F16 } else { PREFILL_F32 };
            let name = if f16 { "prefill_f16" } else { "prefill_f32" };
            let pipe = ctx.pipeline(name, spv, &tile.constants(d))?;
            (tile, pipe)
        }
    };
    // The tensor-core kernels load whole 16-row / 64-key fragments: one tile of slack at
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
        g * n_tiles * 8,
    ];
    let limit = ctx.binding_limit.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let worst = per_kv.iter().copied().max().unwrap_or(1).max(1);
    if worst > limit {
        return Err(Error::Unsupported(format!(
            "one head needs a {worst}-byte buffer, over the device's limit of {limit} bytes"
        )));
    }
    let kv_slabs = if opts.heads.is_some() {
        slabs
    } else {
        sh.batch * sh.heads_kv
    };
    let per_chunk = (limit / worst).clamp(1, 65_535 / g.max(1)).min(kv_slabs);
    let mut lease = Lease::take(pool);
    let ar = &mut lease.arena;
    // Unified memory: the kernels read the staging buffers and write the readback ones.
    let direct = ctx
        .prefill_direct
        .load(std::sync::atomic::Ordering::Relaxed);
    let flag_host = ar.get(ctx, Kind::Download, 0, 1)?;
    let flag = if direct {
        flag_host.clone()
    } else {
        ar.get(ctx, Kind::Device, 0, 1)?
    };
    let layout = pipe
        .layout()
        .set_layouts()
        .first()
        .cloned()
        .ok_or_else(|| Error::Vulkan("prefill pipeline has no descriptor set".into()))?;

    // Buffers and descriptor sets of every chunk: arena slot 1 + SLOTS * chunk + tensor.
    const SLOTS: usize = 9;
    let mut chunks = Vec::new();
    // Per chunk: (first kv slab, kv slabs, work items, staging and device buffers of the
    // seven inputs q, k, v, c, first keys, work items, lane table).
    let mut staged = Vec::new();
    let mut kv0 = 0;
    while kv0 < kv_slabs {
        let ci = chunks.len();
        let slot = |t: usize| 1 + SLOTS * ci + t;
        let nkv = per_chunk.min(kv_slabs - kv0);
        let s0 = kv0 * g;
        let ns = nkv * g;
        let fk = &first_key[s0 * nqb..(s0 + ns) * nqb];
        let items = if flash.is_some() {
            work_items(
                fk,
                ns,
                n_tiles,
                tile.bm as usize,
                sh.seq_q,
                sh.q_offset(),
                opts.block_q,
                nqb,
            )
        } else {
            vec![0u32; 2]
        };
        let n_items = (items.len() / 2) as u32;
        let words = |elems: usize| if f16 { elems / 2 } else { elems } + slack;
        let sizes = [
            words(ns * sh.seq_q * d),
            words(nkv * sh.seq_k * d),
            words(nkv * sh.seq_k * d),
            ns * sh.seq_k * 2,
            ns * nqb,
            items.len(),
            lay_table.len(),
        ];
        let mut up = Vec::with_capacity(sizes.len());
        let mut dev = Vec::with_capacity(sizes.len());
        for (t, &n) in sizes.iter().enumerate() {
            let u = ar.get(ctx, Kind::Upload, slot(t), n)?;
            dev.push(if direct {
                u.clone()
            } else {
                ar.get(ctx, Kind::Device, slot(t), n)?
            });
            up.push(u);
        }
        let out_host = ar.get(ctx, Kind::Download, slot(7), ns * sh.seq_q * d)?;
        let lse_host = ar.get(ctx, Kind::Download, slot(8), ns * sh.seq_q)?;
        let (out, lse) = if direct {
            (out_host.clone(), lse_host.clone())
        } else {
            (
                ar.get(ctx, Kind::Device, slot(7), ns * sh.seq_q * d)?,
                ar.get(ctx, Kind::Device, slot(8), ns * sh.seq_q)?,
            )
        };
        let mut writes = vec![
            WriteDescriptorSet::buffer(0, dev[0].clone()),
            WriteDescriptorSet::buffer(1, dev[1].clone()),
            WriteDescriptorSet::buffer(2, dev[2].clone()),
            WriteDescriptorSet::buffer(3, dev[3].clone()),
            WriteDescriptorSet::buffer(4, dev[4].clone()),
            WriteDescriptorSet::buffer(5, out.clone()),
            WriteDescriptorSet::buffer(6, lse.clone()),
            WriteDescriptorSet::buffer(7, flag.clone()),
        ];
        if flash.is_some() {
            writes.push(WriteDescriptorSet::buffer(8, dev[5].clone()));
            writes.push(WriteDescriptorSet::buffer(9, dev[6].clone()));
        }
        let set = DescriptorSet::new(ctx.desc.clone(), layout.clone(), writes, [])?;
        let groups = if flash.is_some() {
            let gx = n_items.clamp(1, 65_535);
            [gx, n_items.div_ceil(gx).max(1), 1]
        } else {
            [n_tiles as u32, ns as u32, 1]
        };
        chunks.push(Chunk {
            set,
            groups,
            items: n_items,
            out,
            lse,
            out_host,
            lse_host,
            slab0: s0,
            slabs: ns,
        });
        staged.push((kv0, nkv, items, up, dev));
        kv0 += nkv;
    }
    phases.setup = t_setup.elapsed();

    // Packing straight into the mapped staging buffers, by tiles of tokens across slabs in
    // parallel (`pack::for_tiles`). Device slabs are in (b, kv head, group member) order =
    // (b, q head) order. The tensor-core kernels' slack after q, k and v is zeroed: stale
    // words there could be NaN, and 0 * NaN is NaN.
    let t_pack = Instant::now();
    for (kv0, nkv, items, up, _) in &staged {
        let (kv0, nkv) = (*kv0, *nkv);
        let (s0, ns) = (kv0 * g, nkv * g);
        // A selection's device slab `i` is query (and kv) slab `sel[i]` (heads_kv = heads_q).
        let q_row = |r: usize| {
            let (s, t) = (sel[s0 + r / sh.seq_q], r % sh.seq_q);
            sh.q_at(s / sh.heads_q, t, s % sh.heads_q)
        };
        let kv_row = |r: usize| {
            let (s, t) = (kv0 + r / sh.seq_k, r % sh.seq_k);
            let s = if opts.heads.is_some() { sel[s] } else { s };
            sh.kv_at(s / sh.heads_kv, t, s % sh.heads_kv)
        };
        let (q_slabs, kv_slabs) = ((d, sh.seq_q), (d, sh.seq_k));
        stage_rows(&up[0], args.q, f16, ns * sh.seq_q * d, q_slabs, q_row)?;
        stage_rows(&up[1], args.k, f16, nkv * sh.seq_k * d, kv_slabs, kv_row)?;
        stage_rows(&up[2], args.v, f16, nkv * sh.seq_k * d, kv_slabs, kv_row)?;
        let small: [&[u32]; 4] = [
            &c_pairs[s0 * sh.seq_k * 2..(s0 + ns) * sh.seq_k * 2],
            &first_key[s0 * nqb..(s0 + ns) * nqb],
            items,
            &lay_table,
        ];
        for (buf, src) in up[3..].iter().zip(small) {
            buf.write().map_err(host_err)?.copy_from_slice(src);
        }
    }
    phases.pack = t_pack.elapsed();
    on_packed();

    // One submit: clear the flag, copy every staged input to its device buffer (unified
    // memory: the flag is cleared from the host, and nothing is copied).
    let t_up = Instant::now();
    if direct {
        flag.write().map_err(host_err)?[0] = 0;
    } else {
        let mut b = ctx.builder()?;
        b.fill_buffer(flag.clone(), 0)?;
        for (_, _, _, up, dev) in &staged {
            for (src, dst) in up.iter().zip(dev) {
                b.copy_buffer(CopyBufferInfo::buffers(src.clone(), dst.clone()))?;
            }
        }
        ctx.submit(b)?;
        if !lease.arena.pooled() {
            lease.arena.free_uploads();
        }
    }
    drop(staged);
    phases.upload = t_up.elapsed();

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
        kernel,
        flash,
        flag,
        flag_host,
        phases,
        read_lock: Mutex::new(()),
        selected: sel,
        direct,
        lease,
    })
}

fn host_err(e: HostAccessError) -> Error {
    Error::Vulkan(e.to_string())
}

/// Packs `elems` elements (slabs of `seq` rows of `d`, row `r` at `src[at(r)..]`) into the
/// staging words `buf` as f16 or f32, and zeroes the words after them.
fn stage_rows<T: Storage>(
    buf: &Subbuffer<[u32]>,
    src: &[T],
    f16: bool,
    elems: usize,
    (d, seq): (usize, usize),
    at: impl Fn(usize) -> usize + Sync + Send,
) -> Result<()> {
    if f16 {
        let b = buf.clone().reinterpret::<[u16]>();
        let mut w = b.write().map_err(host_err)?;
        let (data, slack) = w.split_at_mut(elems);
        pack_f16_into(src, data.reinterpret_cast_mut::<half::f16>(), d, seq, at);
        slack.fill(0);
    } else {
        let b = buf.clone().reinterpret::<[f32]>();
        let mut w = b.write().map_err(host_err)?;
        let (data, slack) = w.split_at_mut(elems);
        pack_f32_into(src, data, d, seq, at);
        slack.fill(0.0);
    }
    Ok(())
}

/// The flash kernel's work list for one chunk: `(local slab, query tile)` pairs, flattened,
/// ordered by the number of 64-key tiles they visit (most first, so the heaviest start
/// first and the grid's tail is short). Tile `qt` covers rows `qt * bm ..`; its key tiles
/// run from the first key of its first row to the diagonal of its last row, as in the
/// kernel.
#[allow(clippy::too_many_arguments)]
fn work_items(
    first_key: &[u32],
    slabs: usize,
    n_tiles: usize,
    bm: usize,
    seq_q: usize,
    q_off: usize,
    acp_bq: usize,
    acp_nqb: usize,
) -> Vec<u32> {
    let mut it: Vec<(usize, u32, u32)> = Vec::with_capacity(slabs * n_tiles);
    for s in 0..slabs {
        for qt in 0..n_tiles {
            let row0 = qt * bm;
            let last = (row0 + bm).min(seq_q) - 1;
            let begin = first_key[s * acp_nqb + row0 / acp_bq] as usize / 64;
            let end = (q_off + last) / 64 + 1;
            it.push((end.saturating_sub(begin), s as u32, qt as u32));
        }
    }
    it.sort_by_key(|x| std::cmp::Reverse(x.0));
    it.iter().flat_map(|&(_, s, qt)| [s, qt]).collect()
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
                if self.flash.is_some() {
                    let p = &self.push;
                    let pf = PushFa {
                        seq_q: p.seq_q,
                        seq_k: p.seq_k,
                        q_off: p.q_off,
                        group: p.group,
                        n_items: ch.items,
                        scale_log2: p.scale_log2,
                        acp_bq: p.acp_bq,
                        acp_nqb: p.acp_nqb,
                        gx: ch.groups[0],
                    };
                    b.push_constants(self.pipe.layout().clone(), 0, pf)?;
                } else {
                    b.push_constants(self.pipe.layout().clone(), 0, self.push)?;
                }
                // SAFETY: the pipeline, its descriptor set and push constants are bound above;
                // the buffers hold exactly the slabs the grid indexes (sizes from `prepare`,
                // plus one tile of slack for the tensor-core kernels' fragment loads), the
                // shader bounds every access by seq_q / seq_k, and the flash kernel's
                // workgroups past its item count return at once.
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
        self.kernel != PrefillKernel::Scalar
    }

    /// The register-softmax kernel's settings, when that kernel runs.
    pub fn flash(&self) -> Option<FlashConfig> {
        self.flash
    }

    /// Whether q/k/v are f16 on the device.
    pub fn f16_storage(&self) -> bool {
        self.f16
    }

    /// Copies the output into `out` (`shape.q_len()` elements in `shape.layout`) and,
    /// when given, the natural-log normalisers into `lse` (`[batch, heads_q, seq_q]`).
    /// Fails with [`Error::Input`] (`BadArgument`) when a row that attended keys had a
    /// non-finite softmax in any run so far (the flag is sticky), as the CPU backend does.
    pub fn read<O: Storage>(&self, out: &mut [O], lse: Option<&mut [f32]>) -> Result<()> {
        self.read_timed(out, lse).map(|_| ())
    }

    /// [`Self::read`], returning the time of the download (copies, submit and wait) and of
    /// the unpacking.
    pub(crate) fn read_timed<O: Storage>(
        &self,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<(Duration, Duration)> {
        self.check_read(out.len(), lse.as_deref().map(<[f32]>::len))?;
        let _one_reader = self
            .read_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let download = self.download(lse.is_some())?;
        let unpack = self.unpack(out, lse)?;
        Ok((download, unpack))
    }

    fn check_read(&self, out: usize, lse: Option<usize>) -> Result<()> {
        let sh = &self.shape;
        let rows = sh.batch * sh.heads_q * sh.seq_q;
        for (what, expected, got) in [("out", sh.q_len(), Some(out)), ("lse", rows, lse)] {
            if let Some(got) = got
                && got != expected
            {
                return Err(foxedge_core::Error::BadLength {
                    what,
                    expected,
                    got,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Copies the output (and the normalisers, with `lse`) to the readback staging, and
    /// fails as [`Self::read`] does when a row's softmax was not finite. Its time.
    pub(crate) fn download(&self, lse: bool) -> Result<Duration> {
        let t0 = Instant::now();
        if self.direct {
            if self.flag_host.read().map_err(host_err)?[0] != 0 {
                return Err(NON_FINITE.into());
            }
            return Ok(t0.elapsed());
        }
        let mut b = self.ctx.builder()?;
        b.copy_buffer(CopyBufferInfo::buffers(
            self.flag.clone(),
            self.flag_host.clone(),
        ))?;
        for ch in &self.chunks {
            b.copy_buffer(CopyBufferInfo::buffers(ch.out.clone(), ch.out_host.clone()))?;
            if lse {
                b.copy_buffer(CopyBufferInfo::buffers(ch.lse.clone(), ch.lse_host.clone()))?;
            }
        }
        self.ctx.submit(b)?;
        if self.flag_host.read().map_err(host_err)?[0] != 0 {
            return Err(NON_FINITE.into());
        }
        Ok(t0.elapsed())
    }

    /// [`Self::unpack`] of `out` alone, after checking its length.
    pub(crate) fn unpack_checked<O: Storage>(&self, out: &mut [O]) -> Result<Duration> {
        self.check_read(out.len(), None)?;
        self.unpack(out, None)
    }

    /// The call's shape.
    pub(crate) fn shape(&self) -> &AttentionShape {
        &self.shape
    }

    /// From the readback staging (after [`Self::download`]) into the rows of `out` and
    /// `lse` of the computed slabs. Its time.
    fn unpack<O: Storage>(&self, out: &mut [O], lse: Option<&mut [f32]>) -> Result<Duration> {
        let sh = &self.shape;
        let d = sh.head_dim;
        let t1 = Instant::now();
        // Straight from the mapped readback buffers: destination rows in parallel, each
        // from its chunk's slab row.
        let outs = self
            .chunks
            .iter()
            .map(|ch| ch.out_host.clone().reinterpret::<[f32]>())
            .collect::<Vec<_>>();
        let guards = outs
            .iter()
            .map(|o| o.read().map_err(host_err))
            .collect::<Result<Vec<_>>>()?;
        let srcs: Vec<&[f32]> = guards.iter().map(|g| &**g).collect();
        let per_chunk = self.chunks[0].slabs;
        // The device slab of each (b * heads_q + h) slab, if computed.
        let mut device_of = vec![None; sh.batch * sh.heads_q];
        for (i, &bh) in self.selected.iter().enumerate() {
            device_of[bh] = Some(i);
        }
        unpack_rows(out, d, |i| {
            let (s, t) = q_row_of(sh, i);
            let s = device_of[s]?;
            let c = s / per_chunk;
            let r = (s - self.chunks[c].slab0) * sh.seq_q + t;
            Some(&srcs[c][r * d..(r + 1) * d])
        });
        if let Some(l) = lse {
            for ch in &self.chunks {
                let src = ch.lse_host.clone().reinterpret::<[f32]>();
                let src = src.read().map_err(host_err)?;
                let slabs = &self.selected[ch.slab0..ch.slab0 + ch.slabs];
                for (&s, row) in slabs.iter().zip(src.chunks_exact(sh.seq_q)) {
                    l[s * sh.seq_q..(s + 1) * sh.seq_q].copy_from_slice(row);
                }
            }
        }
        Ok(t1.elapsed())
    }

    /// Host-side phase times of `prepare` (for the profile line).
    pub(crate) fn phases(&self) -> Phases {
        self.phases
    }

    /// `scalar-f32`, `scalar-f16`, `coopmat-f16` or `flash-f16`.
    pub(crate) fn kernel_name(&self) -> &'static str {
        match (self.kernel, self.f16) {
            (PrefillKernel::Flash, _) => "flash-f16",
            (PrefillKernel::CoopMat, _) => "coopmat-f16",
            (_, true) => "scalar-f16",
            (_, false) => "scalar-f32",
        }
    }

    /// Whether this call uses the context's pooled buffers, and the bytes its arena holds.
    pub(crate) fn arena_use(&self) -> (bool, u64) {
        (self.lease.arena.pooled(), self.lease.arena.bytes())
    }
}

/// Slab (`b * heads_q + h`) and position of destination row `i` of q/out (the element
/// offset `i * head_dim`): the inverse of `AttentionShape::q_at`.
fn q_row_of(sh: &AttentionShape, i: usize) -> (usize, usize) {
    match sh.layout {
        Layout::SeqFirst => {
            let (bt, h) = (i / sh.heads_q, i % sh.heads_q);
            let (b, t) = (bt / sh.seq_q, bt % sh.seq_q);
            (b * sh.heads_q + h, t)
        }
        Layout::HeadFirst => (i / sh.seq_q, i % sh.seq_q),
    }
}

#[cfg(test)]
mod tests {
    use super::{flash_layout, q_row_of};
    use foxedge_core::{AttentionShape, Layout};

    /// The KHR tensor-core kernel runs on no CI device (lavapipe has no cooperative
    /// matrices): vulkano must at least parse it, and it must declare KHR matrices only
    /// (check.sh runs spirv-val on it).
    #[test]
    fn the_khr_tensor_core_kernel_is_khr_cooperative_matrix_spirv() {
        use vulkano::shader::spirv::{Capability, Instruction, Spirv};
        let words: Vec<u32> = super::PREFILL_CM_KHR
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let spirv = Spirv::new(&words).expect("vulkano parses prefill_cm_khr.spv");
        let caps: Vec<Capability> = spirv
            .capabilities()
            .iter()
            .filter_map(|i| match i {
                Instruction::Capability { capability } => Some(*capability),
                _ => None,
            })
            .collect();
        assert!(caps.contains(&Capability::CooperativeMatrixKHR), "{caps:?}");
        assert!(!caps.contains(&Capability::CooperativeMatrixNV), "{caps:?}");
    }

    #[test]
    fn q_row_of_inverts_q_at() {
        for layout in [Layout::SeqFirst, Layout::HeadFirst] {
            let sh = AttentionShape {
                batch: 3,
                heads_q: 4,
                heads_kv: 2,
                seq_q: 5,
                seq_k: 7,
                head_dim: 8,
                layout,
            };
            for s in 0..sh.batch * sh.heads_q {
                for t in 0..sh.seq_q {
                    let i = sh.q_at(s / sh.heads_q, t, s % sh.heads_q) / sh.head_dim;
                    assert_eq!(q_row_of(&sh, i), (s, t), "{layout:?}");
                }
            }
        }
    }

    fn map(slot: fn(u32) -> u32, col: fn(u32, u32) -> u32) -> Vec<(u32, u32)> {
        (0..32u32)
            .flat_map(|l| (0..8u32).map(move |e| ((l >> 2) + 8 * slot(e), col(l & 3, e))))
            .collect()
    }

    #[test]
    fn flash_layout_recognises_quad_layouts_and_rejects_others() {
        let a = map(|e| (e >> 1) & 1, |q, e| 2 * q + (e & 1) + 8 * (e >> 2));
        assert_eq!(flash_layout(&a).map(|l| l.id), Some(1));
        let b = map(|e| e >> 2, |q, e| 2 * q + (e & 1) + 8 * ((e >> 1) & 1));
        assert_eq!(flash_layout(&b).map(|l| l.id), Some(2));
        // Same family, other element order: runs from the table, which must describe it.
        let mut c = a.clone();
        for lane in c.chunks_mut(8) {
            lane.reverse();
        }
        let lc = flash_layout(&c).expect("quad layout");
        assert_eq!(lc.id, 0);
        for (lane, el) in c.chunks(8).enumerate() {
            let t = &lc.table[lane * 4..lane * 4 + 4];
            for (e, &(r, col)) in el.iter().enumerate() {
                let slot = (t[2] >> e) & 1;
                assert_eq!(r, t[slot as usize]);
                assert_eq!(col, (t[3] >> (4 * e)) & 15);
            }
        }
        // Transposed (a lane holds 4 rows): not a layout the kernel can reduce in.
        let t: Vec<(u32, u32)> = a.iter().map(|&(r, c)| (c, r)).collect();
        assert!(flash_layout(&t).is_none());
        // An element twice: rejected.
        let mut d = a.clone();
        d[1] = d[0];
        assert!(flash_layout(&d).is_none());
        assert!(flash_layout(&a[..128]).is_none());
    }
}
