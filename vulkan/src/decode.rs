//! Decode on the device in one dispatch (`shaders/decode.glsl`): one workgroup per (query,
//! chunk of cache entries) computes a partial softmax; the last workgroup of a query to
//! finish (an atomic counter per query) merges the partials exactly. ACP decisions are made
//! on the host in f64 exactly as foxedge-cpu makes them (a block of `block_k` entries is
//! skipped when `c_t - min_j c_j < delta` for every query of the head) and uploaded as one
//! flag per block (nothing when a head keeps every block).
//!
//! Device layout: one buffer per cache head, `cap` rows of K, then `cap` rows of V (f16
//! pairs or f32 words), then `cap` meta words `(c_hi, c_lo, pos_lo, pos_hi)`: c as a
//! double-float pair (see `pack.rs`), positions as u64. A dispatch binds up to [`HPD`]
//! head buffers; more heads take more dispatches in the same command buffer. The same layout
//! serves a call's one-off upload ([`prepare`]) and the resident cache (`cache.rs`).

use crate::arena::{Arena, Kind};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::{pack_rows, split_f64};
use foxedge_core::contract::{AttentionStats, DecodeArgs, DecodeOptions, HeadStats, Storage, acp};
use std::sync::Arc;
use std::time::Duration;
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::{AutoCommandBufferBuilder, PrimaryAutoCommandBuffer};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};

static DECODE_F32: &[u8] = include_bytes!("../shaders/decode_f32.spv");
static DECODE_F16: &[u8] = include_bytes!("../shaders/decode_f16.spv");
static DECODE_F32_NOSG: &[u8] = include_bytes!("../shaders/decode_f32_nosg.spv");
static DECODE_F16_NOSG: &[u8] = include_bytes!("../shaders/decode_f16_nosg.spv");

/// Head buffers bound per dispatch (`HPD` in the shader).
pub(crate) const HPD: usize = 8;
/// Chunks per query at most (`MAXC` in the shader): longer caches get larger chunks.
const MAXC: usize = 1024;
/// Storage-buffer bindings the kernel uses per stage.
const BINDINGS: u32 = HPD as u32 + 10;

/// The error of a row whose softmax is not finite, as foxedge-cpu reports it.
pub(crate) fn non_finite() -> Error {
    Error::Input(foxedge_core::Error::BadArgument(
        "attention logits are not finite: q, k or v holds NaN/inf, or s*q.k overflows f32",
    ))
}

/// Launch shape of the decode kernel (benchmarks sweep it; defaults suit most GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTuning {
    /// Threads per workgroup (a power of two; the variant without subgroups picks its own).
    pub workgroup: u32,
    /// Entries each team of lanes loads per iteration (loads in flight), 1..=8.
    pub unroll: u32,
    /// Lanes sharing one entry (a power of two dividing the row's 16-byte words); 0 = auto.
    pub lanes_per_entry: u32,
}

impl Default for DecodeTuning {
    fn default() -> Self {
        Self {
            workgroup: 128,
            unroll: 4,
            lanes_per_entry: 0,
        }
    }
}

/// Entries per chunk for a step over `entries` cached entries in all (every head and
/// query): powers of two in 128..=2048 giving about 512 workgroups, enough to fill a large
/// GPU without many partials per query. On the H100 (8 heads, d = 64) this picks the fastest
/// split of the sweep in BENCHMARKS.md: 128 at 4096 entries per head, 512 at 32768.
pub fn auto_split(entries: usize) -> usize {
    (entries / 512).next_power_of_two().clamp(128, 2048)
}

#[derive(BufferContents, Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct Push {
    chunk: u32,
    block: u32,
    scale_log2: f32,
    pad: u32,
}

/// The decode pipeline for one (head_dim, storage) pair.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub pipe: Arc<ComputePipeline>,
    pub f16: bool,
    pub subgroups: bool,
    pub d: usize,
}

/// u32 words of one K (or V) row.
pub(crate) fn row_words(d: usize, f16: bool) -> usize {
    if f16 { d / 2 } else { d }
}

/// u32 words of a head buffer of `cap` rows: K, V and 4 meta words per row.
pub(crate) fn head_words(cap: usize, d: usize, f16: bool) -> usize {
    cap * (2 * row_words(d, f16) + 4)
}

/// Word offsets of V and meta in a head buffer of `cap` rows.
pub(crate) fn v_off(cap: usize, d: usize, f16: bool) -> usize {
    cap * row_words(d, f16)
}

pub(crate) fn meta_off(cap: usize, d: usize, f16: bool) -> usize {
    2 * cap * row_words(d, f16)
}

/// Meta words of entries `c` / `pos`: (c_hi, c_lo, pos_lo, pos_hi) each.
pub(crate) fn meta_words(c: &[f64], pos: Option<&[u64]>, out: &mut Vec<u32>) {
    let mut cw = [0u32; 2];
    for (j, &x) in c.iter().enumerate() {
        split_f64(&[x], &mut cw);
        let p = pos.map_or(0, |p| p[j]);
        out.extend([cw[0], cw[1], p as u32, (p >> 32) as u32]);
    }
}

pub(crate) fn kernel(
    ctx: &Arc<Context>,
    tuning: &DecodeTuning,
    d: usize,
    f16: bool,
) -> Result<Kernel> {
    kernel_slots(ctx, tuning, d, f16, HPD)
}

/// [`kernel`] binding `slots` head buffers per dispatch (`HPD` in the shader) instead of
/// [`HPD`].
pub(crate) fn kernel_slots(
    ctx: &Arc<Context>,
    tuning: &DecodeTuning,
    d: usize,
    f16: bool,
    slots: usize,
) -> Result<Kernel> {
    let bindings = slots as u32 + BINDINGS - HPD as u32;
    if !ctx
        .device
        .enabled_features()
        .shader_storage_buffer_array_dynamic_indexing
    {
        return Err(Error::Unsupported(
            "decode needs shaderStorageBufferArrayDynamicIndexing".into(),
        ));
    }
    let props = ctx.device.physical_device().properties();
    if slots == 0
        || props.max_per_stage_descriptor_storage_buffers < bindings
        || props.max_descriptor_set_storage_buffers < bindings
    {
        return Err(Error::Unsupported(format!(
            "decode binds {bindings} storage buffers; the device allows {}",
            props.max_per_stage_descriptor_storage_buffers
        )));
    }
    let rv = d / if f16 { 8 } else { 4 };
    let pow2_divisor = |cap: u32| {
        let mut t = 1u32;
        while t * 2 <= cap && rv % (t as usize * 2) == 0 {
            t *= 2;
        }
        t
    };
    let sg_size = ctx.info.subgroup_size.unwrap_or(0);
    let want_tpe = if tuning.lanes_per_entry == 0 {
        pow2_divisor(8)
    } else {
        tuning.lanes_per_entry
    };
    let sg = !ctx
        .decode_no_subgroups
        .load(std::sync::atomic::Ordering::Relaxed)
        && ctx.info.subgroup_shuffle
        && want_tpe.is_power_of_two()
        && rv % want_tpe as usize == 0
        && sg_size % want_tpe == 0;
    let d4 = (d / 4) as u32;
    let (wgs, tpe) = if sg {
        let w = tuning.workgroup;
        if !w.is_power_of_two() || w < want_tpe || w > ctx.info.max_workgroup_invocations {
            return Err(Error::Unsupported(format!(
                "decode workgroup {w}: a power of two in {want_tpe}..={}",
                ctx.info.max_workgroup_invocations
            )));
        }
        (w, want_tpe)
    } else {
        // One thread per entry: the team merge holds WGS * D/4 vec4 in shared memory.
        let w = (1024 / d4.max(1)).clamp(8, 64);
        (1u32 << (31 - w.leading_zeros()), 1)
    };
    let shared = (wgs / tpe) as usize * d4 as usize * 16 + MAXC * 4 + wgs as usize * 4 + 256;
    if shared > ctx.info.max_shared_memory as usize {
        return Err(Error::Unsupported(format!(
            "decode needs {shared} bytes of shared memory, the device has {}",
            ctx.info.max_shared_memory
        )));
    }
    if !(1..=8).contains(&tuning.unroll) {
        return Err(foxedge_core::Error::BadArgument("decode unroll must be 1..=8").into());
    }
    let (name, spv) = match (f16, sg) {
        (true, true) => ("decode_f16", DECODE_F16),
        (false, true) => ("decode_f32", DECODE_F32),
        (true, false) => ("decode_f16_nosg", DECODE_F16_NOSG),
        (false, false) => ("decode_f32_nosg", DECODE_F32_NOSG),
    };
    let pipe = ctx.pipeline(
        name,
        spv,
        &[
            (0, wgs),
            (1, d as u32),
            (2, tpe),
            (3, tuning.unroll),
            (4, slots as u32),
        ],
    )?;
    Ok(Kernel {
        pipe,
        f16,
        subgroups: sg,
        d,
    })
}

fn bad_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
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
}

/// The contract's checks ([`DecodeArgs::check`]), then the device's index limits.
pub(crate) fn validate<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
) -> Result<()> {
    validate_except_c(args, opts, |_| false)
}

/// [`validate`] without the finiteness scan of `c` for the heads where `synced(h)`: the
/// resident cache checks only the rows it uploads (the others were checked when they were).
pub(crate) fn validate_except_c<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    synced: impl Fn(usize) -> bool,
) -> Result<()> {
    args.check_except_c(opts, synced)?;
    if args.heads.iter().any(|h| h.c.len() > u32::MAX as usize / 4) {
        return Err(Error::Unsupported(
            "cache too large for u32 indexing".into(),
        ));
    }
    Ok(())
}

/// Every `c_j` finite, as foxedge-cpu requires.
pub(crate) fn check_c(c: &[f64]) -> Result<()> {
    if c.iter().all(|x| x.is_finite()) {
        Ok(())
    } else {
        Err(foxedge_core::Error::BadArgument("cache c_j must be finite").into())
    }
}

/// Per-head host decisions: block flags (1 = attend) and statistics.
pub(crate) struct HeadPlan {
    /// `ceil(n / block)` flags, or empty when every block is attended.
    pub kept: Vec<u32>,
    pub stats: HeadStats,
}

fn plan_head<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    h: usize,
    delta: Option<f64>,
    bk: usize,
    minima: Option<&[f64]>,
) -> HeadPlan {
    let nq = args.n_queries;
    let hc = &args.heads[h];
    let n = hc.c.len();
    let qc = &args.q_c[h * nq..(h + 1) * nq];
    let qpos = args.q_pos.map(|p| &p[h * nq..(h + 1) * nq]);
    let mut st = HeadStats {
        delta,
        ..HeadStats::default()
    };
    let blocks = n.div_ceil(bk);
    let min_of = |b: usize| match minima {
        Some(m) => m[b],
        None => acp::block_min(&hc.c[b * bk..((b + 1) * bk).min(n)]),
    };
    if (hc.pos.is_none() || qpos.is_none()) && nq > 0 {
        // Every entry is attendable by every query: only the gates decide.
        st.total_pairs = n as u64 * nq as u64;
        st.total_blocks = blocks as u64;
        let Some(dl) = delta else {
            st.kept_pairs = st.total_pairs;
            st.kept_blocks = st.total_blocks;
            return HeadPlan {
                kept: Vec::new(),
                stats: st,
            };
        };
        // Branch-free: a block is kept when some query has `c_t - cmin >= delta`.
        let mut kept: Vec<u32> = (0..blocks)
            .map(|b| u32::from(!acp::decode_block_pruned(qc, min_of(b), dl)))
            .collect();
        st.kept_blocks = kept.iter().map(|&k| u64::from(k)).sum();
        // Every kept block holds `bk` entries but the last, which holds `n - (blocks-1) bk`.
        let short = (blocks * bk - n) as u64 * u64::from(kept.last().copied().unwrap_or(0));
        st.kept_pairs = (st.kept_blocks * bk as u64 - short) * nq as u64;
        if st.kept_blocks == st.total_blocks {
            kept.clear();
        }
        return HeadPlan { kept, stats: st };
    }
    let mut kept = Vec::with_capacity(blocks);
    let mut all = true;
    let mut b0 = 0;
    while b0 < n {
        let b1 = (b0 + bk).min(n);
        let nb = (b1 - b0) as u64;
        let pairs: u64 = match (hc.pos, qpos) {
            (Some(p), Some(qp)) => (0..nq)
                .map(|t| p[b0..b1].iter().filter(|&&x| x <= qp[t]).count() as u64)
                .sum(),
            _ => nb * nq as u64,
        };
        st.total_pairs += pairs;
        if pairs > 0 {
            st.total_blocks += 1;
        }
        let pruned = delta.is_some_and(|dl| acp::decode_block_pruned(qc, min_of(b0 / bk), dl));
        let keep = !pruned && pairs > 0;
        if keep {
            st.kept_pairs += pairs;
            st.kept_blocks += 1;
        }
        all &= keep || pairs == 0;
        kept.push(u32::from(keep));
        b0 = b1;
    }
    if all {
        kept.clear();
    }
    HeadPlan { kept, stats: st }
}

/// `[ceil(n / bk)]` the least `c` of each `bk`-entry block of `c` (the ACP decisions'
/// `min_j c_j` per block), O(n).
pub(crate) fn block_minima(c: &[f64], bk: usize) -> Vec<f64> {
    c.chunks(bk).map(acp::block_min).collect()
}

/// [`block_minima`] of `c` from those of an earlier state of it, `old` over `old_n`
/// entries: blocks holding a row of `runs` (the rows written since, `[a, b)`) or past
/// `min(old_n, n)` are recomputed, the rest kept. O(blocks + rows written); equal to
/// `block_minima(c, bk)` when every row that changed is in `runs`.
pub(crate) fn update_block_minima(
    mut old: Vec<f64>,
    old_n: usize,
    c: &[f64],
    bk: usize,
    runs: &[(usize, usize)],
) -> Vec<f64> {
    let n = c.len();
    let blocks = n.div_ceil(bk);
    let min_of = |b: usize| acp::block_min(&c[b * bk..((b + 1) * bk).min(n)]);
    // Blocks from the first whose extent or rows past `old_n` changed.
    let tail = old_n.min(n) / bk;
    old.truncate(tail.min(blocks));
    for b in old.len()..blocks {
        old.push(min_of(b));
    }
    for &(a, e) in runs {
        let e = e.min(n);
        if a >= e {
            continue;
        }
        let (b0, b1) = (a / bk, ((e - 1) / bk + 1).min(tail));
        for (b, m) in old.iter_mut().enumerate().take(b1).skip(b0) {
            *m = min_of(b);
        }
    }
    old
}

/// Host decisions of every head and the call's statistics. Heads in parallel: each scans
/// its whole cache (O(n) per head and step), 16 x 64k entries per step in the benchmarks,
/// unless `minima` gives a head's [`block_minima`] (for `opts.block_k`): then that head
/// costs O(blocks), and the heads are planned in turn (no thread wake-ups).
pub(crate) fn plan<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    minima: &[Option<Vec<f64>>],
) -> Result<(Vec<HeadPlan>, AttentionStats)> {
    use rayon::prelude::*;
    let one = |h: usize| {
        let hc = &args.heads[h];
        let n = hc.c.len();
        let delta = acp::decode_delta(&opts.acp, h, n)?;
        let m = minima
            .get(h)
            .and_then(Option::as_deref)
            .filter(|m| m.len() == n.div_ceil(opts.block_k));
        Ok(plan_head(args, h, delta, opts.block_k, m))
    };
    let nh = args.heads.len();
    let cached = (0..nh).all(|h| minima.get(h).is_some_and(Option::is_some));
    let plans = if cached {
        (0..nh).map(one).collect::<Result<Vec<HeadPlan>>>()?
    } else {
        (0..nh)
            .into_par_iter()
            .map(one)
            .collect::<Result<Vec<HeadPlan>>>()?
    };
    let stats = AttentionStats {
        heads: plans.iter().map(|p| p.stats).collect(),
    };
    Ok((plans, stats))
}

/// Host-to-device uploads gathered into one staging buffer and recorded as few dispatches.
#[derive(Default)]
pub(crate) struct Uploads {
    words: Vec<u32>,
    /// (destination, source word, destination word, words).
    regions: Vec<(Subbuffer<[u32]>, usize, usize, usize)>,
}

impl Uploads {
    /// Queues `data` for `dst[at..]`.
    pub fn push(&mut self, dst: &Subbuffer<[u32]>, at: usize, data: &[u32]) {
        if data.is_empty() {
            return;
        }
        let src = self.words.len();
        self.words.extend_from_slice(data);
        if let Some(last) = self.regions.last_mut()
            && same(&last.0, dst)
            && last.1 + last.3 == src
            && last.2 + last.3 == at
        {
            last.3 += data.len();
            return;
        }
        self.regions.push((dst.clone(), src, at, data.len()));
    }

    /// Records the uploads: the data and the region tables go into one staging buffer
    /// (`arena`'s upload slot 0), and `scatter.comp` copies them on the device, one
    /// dispatch per [`SCATTER_SLOTS`] destination buffers (a steady decode step: 16 heads'
    /// new rows and the step's inputs in 2 dispatches instead of 17 copy commands).
    pub fn record(
        self,
        ctx: &Context,
        arena: &mut Arena,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<()> {
        if self.regions.is_empty() {
            return Ok(());
        }
        let limit_words = (ctx.binding_limit.load(std::sync::atomic::Ordering::Relaxed) / 4)
            .min(u32::MAX as u64) as usize;
        let max_groups = ctx
            .device
            .physical_device()
            .properties()
            .max_compute_work_group_count[0] as usize;
        // Dispatches: destinations (at most SCATTER_SLOTS), pieces (slot, src, dst, words)
        // with src relative to the dispatch's source window [src0, src1).
        struct Dispatch {
            dsts: Vec<Subbuffer<[u32]>>,
            pieces: Vec<[u32; 4]>,
            src0: usize,
            src1: usize,
        }
        let mut ds: Vec<Dispatch> = Vec::new();
        for (dst, src, at, n) in &self.regions {
            let mut o = 0;
            while o < *n {
                let len = (n - o).min(PIECE);
                let (s0, s1) = (src + o, src + o + len);
                let fits = |d: &Dispatch| {
                    let new_slot = !d.dsts.iter().any(|x| same(x, dst));
                    (!new_slot || d.dsts.len() < SCATTER_SLOTS)
                        && s1 - d.src0 <= limit_words
                        && d.pieces.len() < max_groups
                };
                if !ds.last().is_some_and(fits) {
                    ds.push(Dispatch {
                        dsts: Vec::new(),
                        pieces: Vec::new(),
                        src0: s0,
                        src1: s0,
                    });
                }
                let d = ds
                    .last_mut()
                    .ok_or_else(|| Error::Vulkan("no dispatch".into()))?;
                let slot = match d.dsts.iter().position(|x| same(x, dst)) {
                    Some(k) => k,
                    None => {
                        d.dsts.push(dst.clone());
                        d.dsts.len() - 1
                    }
                };
                d.pieces.push([
                    slot as u32,
                    (s0 - d.src0) as u32,
                    (at + o) as u32,
                    len as u32,
                ]);
                d.src1 = s1;
                o += len;
            }
        }
        // Staging: the data, then each dispatch's table at an aligned offset.
        let align = storage_align(ctx);
        let mut words = self.words.len();
        let mut tables = Vec::with_capacity(ds.len());
        for d in &ds {
            let at = words.div_ceil(align) * align;
            tables.push(at);
            words = at + 4 * d.pieces.len();
        }
        let staging = arena.get(ctx, Kind::Upload, 0, words)?;
        {
            let mut w = staging.write().map_err(|e| Error::Vulkan(e.to_string()))?;
            w[..self.words.len()].copy_from_slice(&self.words);
            for (d, &at) in ds.iter().zip(&tables) {
                for (k, p) in d.pieces.iter().enumerate() {
                    w[at + 4 * k..at + 4 * k + 4].copy_from_slice(p);
                }
            }
        }
        let pipe = ctx.pipeline("scatter", SCATTER, &[(0, SCATTER_WGS)])?;
        let layout = set_layout(&pipe, "scatter")?;
        b.bind_pipeline_compute(pipe.clone())?;
        for (d, &at) in ds.iter().zip(&tables) {
            let slots: Vec<Subbuffer<[u32]>> = (0..SCATTER_SLOTS)
                .map(|k| d.dsts[k.min(d.dsts.len() - 1)].clone())
                .collect();
            let set = DescriptorSet::new(
                ctx.desc.clone(),
                layout.clone(),
                [
                    WriteDescriptorSet::buffer(0, view(&staging, (d.src0, d.src1 - d.src0))),
                    WriteDescriptorSet::buffer_array(1, 0, slots),
                    WriteDescriptorSet::buffer(2, view(&staging, (at, 4 * d.pieces.len()))),
                ],
                [],
            )?;
            b.bind_descriptor_sets(PipelineBindPoint::Compute, pipe.layout().clone(), 0, set)?;
            b.push_constants(pipe.layout().clone(), 0, 0u32)?;
            // SAFETY: pipeline, set and push constant bound above. Workgroup i reads piece
            // i of the table (the dispatch has one workgroup per piece); a piece's source
            // lies in the bound source window (src1 - src0 words) and its destination range
            // was given by the caller within its buffer (`push`).
            unsafe { b.dispatch([d.pieces.len() as u32, 1, 1]) }?;
        }
        Ok(())
    }
}

/// Largest region piece one scatter workgroup copies (u32 words).
const PIECE: usize = 4096;
/// Destination buffers per scatter dispatch (`SLOTS` in the shader).
pub(crate) const SCATTER_SLOTS: usize = 16;
const SCATTER_WGS: u32 = 256;
static SCATTER: &[u8] = include_bytes!("../shaders/scatter.spv");

/// The layout of `pipe`'s descriptor set 0 (the only set these kernels use).
fn set_layout(
    pipe: &ComputePipeline,
    what: &str,
) -> Result<Arc<vulkano::descriptor_set::layout::DescriptorSetLayout>> {
    pipe.layout()
        .set_layouts()
        .first()
        .cloned()
        .ok_or_else(|| Error::Vulkan(format!("{what} pipeline has no descriptor set")))
}

/// The device's storage-buffer offset alignment, in u32 words.
pub(crate) fn storage_align(ctx: &Context) -> usize {
    (ctx.device
        .physical_device()
        .properties()
        .min_storage_buffer_offset_alignment
        .as_devicesize() as usize)
        .div_ceil(4)
        .max(1)
}

fn same(a: &Subbuffer<[u32]>, b: &Subbuffer<[u32]>) -> bool {
    Arc::ptr_eq(a.buffer(), b.buffer()) && a.offset() == b.offset() && a.size() == b.size()
}

/// A head as the kernel sees it: its buffer, capacity and live rows.
#[derive(Clone)]
pub(crate) struct HeadRef {
    pub buf: Subbuffer<[u32]>,
    pub cap: usize,
}

/// Queues a whole head (rows `0..n`) into a new buffer of `cap = max(n, 1)` rows.
pub(crate) fn upload_head<T: Storage>(
    ctx: &Context,
    up: &mut Uploads,
    hc: &foxedge_core::contract::CacheHead<'_, T>,
    d: usize,
    f16: bool,
) -> Result<HeadRef> {
    let n = hc.c.len();
    let cap = n.max(1);
    let buf = ctx.device_buffer(head_words(cap, d, f16))?;
    up.push(&buf, 0, &pack_rows(hc.k, f16, n, d, |r| r * d).words);
    up.push(
        &buf,
        v_off(cap, d, f16),
        &pack_rows(hc.v, f16, n, d, |r| r * d).words,
    );
    let mut meta = Vec::with_capacity(4 * n);
    meta_words(hc.c, hc.pos, &mut meta);
    up.push(&buf, meta_off(cap, d, f16), &meta);
    Ok(HeadRef { buf, cap })
}

/// One dispatch: up to [`HPD`] heads; its outputs are views of the step's results buffer.
pub(crate) struct Group {
    set: Arc<DescriptorSet>,
    groups: [u32; 3],
    /// Set to 1 by a row whose softmax was not finite.
    pub flag: Subbuffer<[u32]>,
    pub out: Subbuffer<[u32]>,
    pub lse: Subbuffer<[u32]>,
    pub head0: usize,
    pub heads: usize,
}

/// A call's dispatches and the values they share.
///
/// Buffers (slots of the caller's [`Arena`], reused from step to step by the resident
/// cache): `inputs` holds every group's q, query info, c_t and block flags (one upload
/// copy); `scratch` every group's partials; `results` = `[flag, counters of each group |
/// out, lse of each group]`, of which `ctl` (flags and counters) is zeroed by one fill and
/// the whole is read back by one copy. No buffer range is written by two groups, so their
/// dispatches need no barrier between them. Views start at multiples of the device's
/// storage-offset alignment.
pub(crate) struct Step {
    kernel: Kernel,
    push: Push,
    pub groups: Vec<Group>,
    pub ctl: Subbuffer<[u32]>,
    pub results: Subbuffer<[u32]>,
    pub nq: usize,
}

/// Word offsets of consecutive views, each starting at a multiple of `align` words.
struct Layout {
    align: usize,
    words: usize,
}

impl Layout {
    fn take(&mut self, len: usize) -> (usize, usize) {
        let at = self.words.div_ceil(self.align) * self.align;
        self.words = at + len.max(1);
        (at, len.max(1))
    }
}

fn view(buf: &Subbuffer<[u32]>, (at, len): (usize, usize)) -> Subbuffer<[u32]> {
    buf.clone().slice(at as u64..(at + len) as u64)
}

/// Builds the dispatches of a call over `heads` (one [`HeadRef`] per head of `args`),
/// queuing its small inputs into `up`; per-step buffers come from `arena`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_step<Q: Storage, T: Storage>(
    ctx: &Arc<Context>,
    kernel: &Kernel,
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    plans: &[HeadPlan],
    heads: &[HeadRef],
    up: &mut Uploads,
    arena: &mut Arena,
) -> Result<Step> {
    let (d, nq, nh) = (args.head_dim, args.n_queries, args.heads.len());
    let bk = opts.block_k;
    let n_max = args.heads.iter().map(|h| h.c.len()).max().unwrap_or(0);
    let chunk = opts
        .split
        .max(n_max.div_ceil(MAXC))
        .div_ceil(bk)
        .checked_mul(bk)
        .filter(|&c| c <= u32::MAX as usize)
        .ok_or_else(|| Error::Unsupported("split too large for u32 indexing".into()))?;
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let layout = set_layout(&kernel.pipe, "decode")?;
    let align = storage_align(ctx);
    let new_layout = || Layout { align, words: 0 };
    let (mut li, mut ls, mut lr) = (new_layout(), new_layout(), new_layout());

    // Host side of each group: its data and where its views go.
    struct G {
        h0: usize,
        h1: usize,
        data: [Vec<u32>; 4],
        inputs: [(usize, usize); 4],
        part_ml: (usize, usize),
        part_o: (usize, usize),
        flag: (usize, usize),
        counters: (usize, usize),
        out: (usize, usize),
        lse: (usize, usize),
        groups: [u32; 3],
    }
    let mut gs = Vec::new();
    for h0 in (0..nh).step_by(HPD) {
        let h1 = (h0 + HPD).min(nh);
        let queries = (h1 - h0) * nq;
        let mut qinfo = Vec::with_capacity(queries * 8);
        let mut qc = vec![0u32; queries * 2];
        let mut kept = Vec::new();
        let mut parts = 0usize;
        let mut max_chunks = 1usize;
        for h in h0..h1 {
            let n = args.heads[h].c.len();
            let nch = n.div_ceil(chunk);
            max_chunks = max_chunks.max(nch);
            let kept0 = if plans[h].kept.is_empty() {
                u32::MAX
            } else {
                let k0 = kept.len() as u32;
                kept.extend(&plans[h].kept);
                k0
            };
            let use_pos = u32::from(args.heads[h].pos.is_some());
            for t in 0..nq {
                let qp = args.q_pos.map_or(0, |p| p[h * nq + t]);
                qinfo.extend([
                    n as u32,
                    heads[h].cap as u32,
                    parts as u32,
                    kept0,
                    (h - h0) as u32,
                    use_pos,
                    qp as u32,
                    (qp >> 32) as u32,
                ]);
                parts += nch;
            }
            split_f64(
                &args.q_c[h * nq..(h + 1) * nq],
                &mut qc[(h - h0) * nq * 2..(h - h0 + 1) * nq * 2],
            );
        }
        let q = pack_rows(args.q, false, queries, d, |r| (h0 * nq + r) * d).words;
        let data = [q, qinfo, qc, kept];
        let inputs = [
            li.take(data[0].len()),
            li.take(data[1].len()),
            li.take(data[2].len()),
            li.take(data[3].len()),
        ];
        gs.push(G {
            h0,
            h1,
            data,
            inputs,
            part_ml: ls.take(parts * 2),
            part_o: ls.take(parts * d),
            flag: (0, 0),
            counters: (0, 0),
            out: (0, 0),
            lse: (0, 0),
            groups: [max_chunks as u32, queries as u32, 1],
        });
    }
    for g in &mut gs {
        g.flag = lr.take(1);
        g.counters = lr.take(g.groups[1] as usize);
    }
    let ctl_words = lr.words;
    for g in &mut gs {
        g.out = lr.take(g.groups[1] as usize * d);
        g.lse = lr.take(g.groups[1] as usize);
    }
    let inputs = arena.get(ctx, Kind::Device, 0, li.words)?;
    let scratch = arena.get(ctx, Kind::Device, 1, ls.words)?;
    let results = arena.get(ctx, Kind::Device, 2, lr.words)?;
    let mut groups = Vec::with_capacity(gs.len());
    for g in gs {
        for (data, &(at, _)) in g.data.iter().zip(&g.inputs) {
            up.push(&inputs, at, data);
        }
        let slots: Vec<Subbuffer<[u32]>> = (0..HPD)
            .map(|s| heads[(g.h0 + s).min(g.h1 - 1)].buf.clone())
            .collect();
        let out = view(&results, g.out);
        let lse = view(&results, g.lse);
        let flag = view(&results, g.flag);
        let set = DescriptorSet::new(
            ctx.desc.clone(),
            layout.clone(),
            [
                WriteDescriptorSet::buffer(0, view(&inputs, g.inputs[0])),
                WriteDescriptorSet::buffer_array(1, 0, slots),
                WriteDescriptorSet::buffer(2, view(&inputs, g.inputs[1])),
                WriteDescriptorSet::buffer(3, view(&inputs, g.inputs[2])),
                WriteDescriptorSet::buffer(4, view(&inputs, g.inputs[3])),
                WriteDescriptorSet::buffer(5, view(&scratch, g.part_ml)),
                WriteDescriptorSet::buffer(6, view(&scratch, g.part_o)),
                WriteDescriptorSet::buffer(7, out.clone()),
                WriteDescriptorSet::buffer(8, lse.clone()),
                WriteDescriptorSet::buffer(9, view(&results, g.counters)),
                WriteDescriptorSet::buffer(10, flag.clone()),
            ],
            [],
        )?;
        groups.push(Group {
            set,
            groups: g.groups,
            flag,
            out,
            lse,
            head0: g.h0,
            heads: g.h1 - g.h0,
        });
    }
    Ok(Step {
        kernel: kernel.clone(),
        push: Push {
            chunk: chunk as u32,
            block: bk as u32,
            scale_log2: scale * std::f32::consts::LOG2_E,
            pad: 0,
        },
        groups,
        ctl: results.clone().slice(0..ctl_words as u64),
        results,
        nq,
    })
}

impl Step {
    /// Records: zeroed flag and counters (one fill), then `reps` times every dispatch.
    pub fn record(
        &self,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
        reps: usize,
    ) -> Result<()> {
        b.fill_buffer(self.ctl.clone(), 0)?;
        let pipe = &self.kernel.pipe;
        for _ in 0..reps.max(1) {
            for g in &self.groups {
                b.bind_pipeline_compute(pipe.clone())?;
                b.bind_descriptor_sets(
                    PipelineBindPoint::Compute,
                    pipe.layout().clone(),
                    0,
                    g.set.clone(),
                )?;
                b.push_constants(pipe.layout().clone(), 0, self.push)?;
                // SAFETY: pipeline, set and push constants bound above. Every index the
                // kernel forms is bounded by what the host wrote: rows < n <= cap of the
                // bound head buffer, parts < the part buffers' length, queries < the
                // dispatch's y size; workgroups past a query's chunk count return at once.
                // Counters start at 0 (filled above) and the merging workgroup resets them.
                unsafe { b.dispatch(g.groups) }?;
            }
        }
        Ok(())
    }

    /// Output `[heads, n_queries, head_dim]` and lse `[heads, n_queries]` from the words of
    /// each group's (out, lse) and the groups' flags or-ed; a set flag is the non-finite
    /// error.
    pub fn scatter<O: Storage>(
        &self,
        outs: &[(Vec<u32>, Vec<u32>)],
        flag: u32,
        out: &mut [O],
        mut lse: Option<&mut [f32]>,
    ) -> Result<()> {
        if flag != 0 {
            return Err(non_finite());
        }
        let d = self.kernel.d;
        for (g, (o, l)) in self.groups.iter().zip(outs) {
            let r0 = g.head0 * self.nq;
            let nr = g.heads * self.nq;
            for (x, &w) in out[r0 * d..(r0 + nr) * d].iter_mut().zip(o) {
                *x = O::from_f32(f32::from_bits(w));
            }
            if let Some(ls) = lse.as_deref_mut() {
                for (x, &w) in ls[r0..r0 + nr].iter_mut().zip(l) {
                    *x = f32::from_bits(w);
                }
            }
        }
        Ok(())
    }
}

/// Checks `out` / `lse` lengths for `rows` query rows of `d` values.
pub(crate) fn check_out_len<O: Storage>(
    rows: usize,
    d: usize,
    out: &[O],
    lse: Option<&[f32]>,
) -> Result<()> {
    bad_len("decode out", rows * d, out.len())?;
    if let Some(l) = lse {
        bad_len("decode lse", rows, l.len())?;
    }
    Ok(())
}

/// A decode step whose inputs are on the device. Built by [`crate::Vulkan::prepare_decode`].
pub struct PreparedDecode {
    ctx: Arc<Context>,
    step: Step,
    nh: usize,
    stats: AttentionStats,
}

impl std::fmt::Debug for PreparedDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDecode")
            .field("heads", &self.nh)
            .field("n_queries", &self.step.nq)
            .field("head_dim", &self.step.kernel.d)
            .field("f16_storage", &self.step.kernel.f16)
            .field("subgroups", &self.step.kernel.subgroups)
            .field("dispatches", &self.step.groups.len())
            .finish()
    }
}

pub(crate) fn prepare<Q: Storage, T: Storage>(
    ctx: &Arc<Context>,
    tuning: &DecodeTuning,
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
) -> Result<PreparedDecode> {
    validate(args, opts)?;
    let d = args.head_dim;
    let f16 = T::DTYPE == foxedge_core::contract::DType::F16;
    let kernel = kernel(ctx, tuning, d, f16)?;
    let (plans, stats) = plan(args, opts, &[])?;
    let limit = ctx.binding_limit.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let mut up = Uploads::default();
    let mut heads = Vec::with_capacity(args.heads.len());
    for hc in args.heads {
        let bytes = head_words(hc.c.len().max(1), d, f16) * 4;
        if bytes > limit {
            return Err(Error::Unsupported(format!(
                "one head's cache needs {bytes} bytes, over the device's binding limit {limit}"
            )));
        }
        heads.push(upload_head(ctx, &mut up, hc, d, f16)?);
    }
    let mut arena = Arena::new(false);
    let step = build_step(
        ctx, &kernel, args, opts, &plans, &heads, &mut up, &mut arena,
    )?;
    let mut b = ctx.builder()?;
    up.record(ctx, &mut arena, &mut b)?;
    ctx.submit(b)?;
    Ok(PreparedDecode {
        ctx: ctx.clone(),
        step,
        nh: args.heads.len(),
        stats,
    })
}

impl PreparedDecode {
    /// Runs the step `reps` times in one command buffer (built before the clock starts);
    /// wall time of submit-to-completion.
    pub fn run(&self, reps: usize) -> Result<Duration> {
        let mut b = self.ctx.builder()?;
        self.step.record(&mut b, reps)?;
        // Submit to completion; the command buffer's build is not counted.
        let [_, submit, wait] = self.ctx.submit_timed(b)?;
        Ok(submit + wait)
    }

    pub fn stats(&self) -> &AttentionStats {
        &self.stats
    }

    /// Whether K and V are f16 on the device (f16 input; read as packed halves).
    pub fn f16_storage(&self) -> bool {
        self.step.kernel.f16
    }

    /// Whether the lane-team variant (subgroup shuffles) runs.
    pub fn subgroups(&self) -> bool {
        self.step.kernel.subgroups
    }

    /// Output `[heads, n_queries, head_dim]` and optional lse `[heads, n_queries]` of the
    /// last run. A row whose softmax was not finite is an error, as on the CPU.
    pub fn read<O: Storage>(&self, out: &mut [O], lse: Option<&mut [f32]>) -> Result<()> {
        check_out_len(
            self.nh * self.step.nq,
            self.step.kernel.d,
            out,
            lse.as_deref(),
        )?;
        let mut bufs = Vec::new();
        for g in &self.step.groups {
            bufs.extend([&g.flag, &g.out, &g.lse]);
        }
        let got = self.ctx.download(&bufs)?;
        let mut flag = 0;
        let mut outs = Vec::with_capacity(self.step.groups.len());
        for p in got.chunks_exact(3) {
            flag |= p[0].first().copied().unwrap_or(0);
            outs.push((p[1].clone(), p[2].clone()));
        }
        self.step.scatter(&outs, flag, out, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::{block_minima, update_block_minima};
    use proptest::prelude::*;

    proptest! {
        /// Minima updated from the rows written (appends, rewrites, swap-deletes that
        /// shrink the head) equal minima computed whole, bit for bit.
        #[test]
        fn updated_block_minima_equal_whole_ones(
            n0 in 0usize..300,
            bk in 1usize..70,
            edits in proptest::collection::vec((0u8..3, 0usize..1000, -1e3f64..1e3), 0..60),
        ) {
            let mut c: Vec<f64> = (0..n0).map(|j| -(j as f64) * 0.37).collect();
            let old = block_minima(&c, bk);
            let mut written: Vec<usize> = Vec::new();
            for (op, at, x) in edits {
                let n = c.len();
                match op {
                    0 => {
                        written.push(n);
                        c.push(x);
                    }
                    1 if n > 0 => {
                        c[at % n] = x;
                        written.push(at % n);
                    }
                    2 if n > 0 => {
                        let j = at % n;
                        c[j] = c[n - 1];
                        c.pop();
                        written.push(j);
                    }
                    _ => {}
                }
            }
            let runs: Vec<(usize, usize)> = written.iter().map(|&r| (r, r + 1)).collect();
            let got = update_block_minima(old, n0, &c, bk, &runs);
            let want = block_minima(&c, bk);
            prop_assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
