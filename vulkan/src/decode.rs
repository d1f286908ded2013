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

use crate::api::{Acp, AttentionStats, DecodeArgs, DecodeOptions, HeadStats, Storage};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::{pack_rows, split_f64};
use foxedge_core::threshold;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, BufferCopy, CopyBufferInfo, PrimaryAutoCommandBuffer,
    PrimaryCommandBufferAbstract,
};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};
use vulkano::sync::GpuFuture;

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
    pipe: Arc<ComputePipeline>,
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
    if props.max_per_stage_descriptor_storage_buffers < BINDINGS
        || props.max_descriptor_set_storage_buffers < BINDINGS
    {
        return Err(Error::Unsupported(format!(
            "decode binds {BINDINGS} storage buffers; the device allows {}",
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
        &[(0, wgs), (1, d as u32), (2, tpe), (3, tuning.unroll)],
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

/// The checks foxedge-cpu's decode makes, with the same errors.
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
    let (d, nq, nh) = (args.head_dim, args.n_queries, args.heads.len());
    let bad = |m| Err(Error::Input(foxedge_core::Error::BadShape(m)));
    if d == 0 || d % 8 != 0 {
        return bad("head_dim must be a positive multiple of 8");
    }
    if nq == 0 || nh == 0 {
        return bad("decode needs at least one head and one query");
    }
    let rows = nh
        .checked_mul(nq)
        .filter(|r| r.checked_mul(d).is_some())
        .ok_or(Error::Input(foxedge_core::Error::BadShape(
            "element count overflows usize",
        )))?;
    bad_len("decode q", rows * d, args.q.len())?;
    bad_len("decode q_c", rows, args.q_c.len())?;
    if args.q_c.iter().any(|x| !x.is_finite()) {
        return Err(foxedge_core::Error::BadArgument("query c_t must be finite").into());
    }
    if let Some(p) = args.q_pos {
        bad_len("decode q_pos", rows, p.len())?;
    }
    for (h, hc) in args.heads.iter().enumerate() {
        let n = hc.c.len();
        let nd = n
            .checked_mul(d)
            .ok_or(Error::Input(foxedge_core::Error::BadShape(
                "cache size overflows usize",
            )))?;
        bad_len("cache k (entries * head_dim)", nd, hc.k.len())?;
        bad_len("cache v (entries * head_dim)", nd, hc.v.len())?;
        if !synced(h) {
            check_c(hc.c)?;
        }
        if let Some(p) = hc.pos {
            bad_len("cache pos", n, p.len())?;
            if args.q_pos.is_none() {
                return Err(foxedge_core::Error::BadArgument(
                    "cache has positions but q_pos is None",
                )
                .into());
            }
        }
    }
    if opts.block_k == 0 || opts.split == 0 {
        return Err(foxedge_core::Error::BadArgument("block_k and split must be > 0").into());
    }
    if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
        return Err(foxedge_core::Error::BadArgument("sm_scale must be finite").into());
    }
    match opts.acp {
        Acp::Off => {}
        Acp::Threshold(t) => {
            bad_len("decode ACP thresholds (one per head)", nh, t.len())?;
            if t.iter().any(|x| x.is_nan()) {
                return Err(foxedge_core::Error::BadArgument("ACP threshold is NaN").into());
            }
        }
        Acp::Bound { u, .. } => bad_len("decode ACP bounds (one per head)", nh, u.len())?,
        Acp::ObservedNorms { .. } => {
            return Err(foxedge_core::Error::BadArgument(
                "ObservedNorms needs every key: pass Bound or Threshold to decode",
            )
            .into());
        }
        Acp::Decided(_) => {
            return Err(foxedge_core::Error::BadArgument(
                "Decided holds prefill decisions: pass Bound or Threshold to decode",
            )
            .into());
        }
    }
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
    let mut kept = Vec::with_capacity(n.div_ceil(bk));
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
        let pruned = delta.is_some_and(|dl| {
            let cmin = block_min(&hc.c[b0..b1]);
            qc.iter().all(|&ct| ct - cmin < dl)
        });
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

/// The least of `c` (+inf when empty), as `fold(inf, f64::min)` (a NaN never wins either
/// way), in 4 independent lanes that the compiler keeps in vector registers: the ACP
/// decisions scan every cached entry of every head each step.
fn block_min(c: &[f64]) -> f64 {
    let mut m = [f64::INFINITY; 4];
    let mut chunks = c.chunks_exact(4);
    for x in &mut chunks {
        for i in 0..4 {
            m[i] = if x[i] < m[i] { x[i] } else { m[i] };
        }
    }
    let mut r = f64::min(f64::min(m[0], m[1]), f64::min(m[2], m[3]));
    for &x in chunks.remainder() {
        r = r.min(x);
    }
    r
}

/// Host decisions of every head and the call's statistics. Heads in parallel: each scans
/// its whole cache (O(n) per head and step), 16 x 64k entries per step in the benchmarks.
pub(crate) fn plan<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
) -> Result<(Vec<HeadPlan>, AttentionStats)> {
    use rayon::prelude::*;
    let plans = args
        .heads
        .par_iter()
        .enumerate()
        .map(|(h, hc)| {
            let n = hc.c.len();
            let delta = match opts.acp {
                Acp::Threshold(t) => Some(t[h]),
                Acp::Bound { u, ln_eps } if n > 0 => Some(threshold::threshold(u[h], n, ln_eps)?),
                _ => None,
            };
            Ok(plan_head(args, h, delta, opts.block_k))
        })
        .collect::<Result<Vec<HeadPlan>>>()?;
    let stats = AttentionStats {
        heads: plans.iter().map(|p| p.stats).collect(),
    };
    Ok((plans, stats))
}

/// Host-to-device copies gathered into one staging buffer and recorded as few commands.
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

    /// Records the copies (one command per run of regions with the same destination).
    pub fn record(
        self,
        ctx: &Context,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<()> {
        if self.regions.is_empty() {
            return Ok(());
        }
        let staging = ctx.host_buffer(self.words.len(), true)?;
        staging
            .write()
            .map_err(|e| Error::Vulkan(e.to_string()))?
            .copy_from_slice(&self.words);
        let mut i = 0;
        while i < self.regions.len() {
            let dst = self.regions[i].0.clone();
            let mut info = CopyBufferInfo::buffers(staging.clone(), dst.clone());
            info.regions.clear();
            while i < self.regions.len() && same(&self.regions[i].0, &dst) {
                let (_, s, d, n) = self.regions[i];
                info.regions.push(BufferCopy {
                    src_offset: s as u64 * 4,
                    dst_offset: d as u64 * 4,
                    size: n as u64 * 4,
                    ..Default::default()
                });
                i += 1;
            }
            b.copy_buffer(info)?;
        }
        Ok(())
    }
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
    hc: &crate::api::CacheHead<'_, T>,
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

/// One dispatch: up to [`HPD`] heads, its inputs, scratch and outputs.
pub(crate) struct Group {
    set: Arc<DescriptorSet>,
    groups: [u32; 3],
    counters: Subbuffer<[u32]>,
    pub out: Subbuffer<[u32]>,
    pub lse: Subbuffer<[u32]>,
    pub head0: usize,
    pub heads: usize,
}

/// A call's dispatches and the values they share.
pub(crate) struct Step {
    kernel: Kernel,
    push: Push,
    pub groups: Vec<Group>,
    pub flag: Subbuffer<[u32]>,
    pub nq: usize,
}

/// Builds the dispatches of a call over `heads` (one [`HeadRef`] per head of `args`),
/// queuing its small inputs into `up`.
pub(crate) fn build_step<Q: Storage, T: Storage>(
    ctx: &Arc<Context>,
    kernel: &Kernel,
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    plans: &[HeadPlan],
    heads: &[HeadRef],
    up: &mut Uploads,
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
    let layout = kernel
        .pipe
        .layout()
        .set_layouts()
        .first()
        .cloned()
        .ok_or_else(|| Error::Vulkan("decode pipeline has no descriptor set".into()))?;
    let flag = ctx.device_buffer(1)?;
    let mut groups = Vec::new();
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
        let bq = ctx.device_buffer(q.len())?;
        let bi = ctx.device_buffer(qinfo.len())?;
        let bc = ctx.device_buffer(qc.len())?;
        let bk_ = ctx.device_buffer(kept.len().max(1))?;
        up.push(&bq, 0, &q);
        up.push(&bi, 0, &qinfo);
        up.push(&bc, 0, &qc);
        up.push(&bk_, 0, &kept);
        let part_ml = ctx.device_buffer(parts.max(1) * 2)?;
        let part_o = ctx.device_buffer(parts.max(1) * d)?;
        let out = ctx.device_buffer(queries * d)?;
        let lse = ctx.device_buffer(queries)?;
        let counters = ctx.device_buffer(queries)?;
        let slots: Vec<Subbuffer<[u32]>> = (0..HPD)
            .map(|s| heads[(h0 + s).min(h1 - 1)].buf.clone())
            .collect();
        let set = DescriptorSet::new(
            ctx.desc.clone(),
            layout.clone(),
            [
                WriteDescriptorSet::buffer(0, bq),
                WriteDescriptorSet::buffer_array(1, 0, slots),
                WriteDescriptorSet::buffer(2, bi),
                WriteDescriptorSet::buffer(3, bc),
                WriteDescriptorSet::buffer(4, bk_),
                WriteDescriptorSet::buffer(5, part_ml),
                WriteDescriptorSet::buffer(6, part_o),
                WriteDescriptorSet::buffer(7, out.clone()),
                WriteDescriptorSet::buffer(8, lse.clone()),
                WriteDescriptorSet::buffer(9, counters.clone()),
                WriteDescriptorSet::buffer(10, flag.clone()),
            ],
            [],
        )?;
        groups.push(Group {
            set,
            groups: [max_chunks as u32, queries as u32, 1],
            counters,
            out,
            lse,
            head0: h0,
            heads: h1 - h0,
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
        flag,
        nq,
    })
}

impl Step {
    /// Records: zeroed counters and flag, then `reps` times every dispatch.
    pub fn record(
        &self,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
        reps: usize,
    ) -> Result<()> {
        b.fill_buffer(self.flag.clone(), 0)?;
        for g in &self.groups {
            b.fill_buffer(g.counters.clone(), 0)?;
        }
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
    /// each group's (out, lse) and the flag word; a set flag is the non-finite error.
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

/// Builds and submits `b`, waits; returns the time from submit to completion.
pub(crate) fn submit_timed(
    ctx: &Context,
    b: AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
) -> Result<Duration> {
    let cb = b.build()?;
    let t0 = Instant::now();
    cb.execute(ctx.queue.clone())
        .map_err(|e| Error::Vulkan(e.to_string()))?
        .then_signal_fence_and_flush()?
        .wait(None)?;
    Ok(t0.elapsed())
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
    let f16 = T::DTYPE == crate::api::DType::F16;
    let kernel = kernel(ctx, tuning, d, f16)?;
    let (plans, stats) = plan(args, opts)?;
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
    let step = build_step(ctx, &kernel, args, opts, &plans, &heads, &mut up)?;
    let mut b = ctx.builder()?;
    up.record(ctx, &mut b)?;
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
        submit_timed(&self.ctx, b)
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
        let mut bufs = vec![&self.step.flag];
        for g in &self.step.groups {
            bufs.push(&g.out);
            bufs.push(&g.lse);
        }
        let got = self.ctx.download(&bufs)?;
        let flag = got[0].first().copied().unwrap_or(0);
        let outs: Vec<(Vec<u32>, Vec<u32>)> = got[1..]
            .chunks_exact(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect();
        self.step.scatter(&outs, flag, out, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::block_min;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn block_min_is_the_fold(
            c in proptest::collection::vec(
                prop_oneof![
                    8 => -1e6f64..1e3,
                    1 => Just(f64::NAN),
                    1 => Just(f64::NEG_INFINITY),
                ],
                0..70,
            ),
        ) {
            let want = c.iter().copied().fold(f64::INFINITY, f64::min);
            prop_assert_eq!(block_min(&c).to_bits(), want.to_bits());
        }
    }

    /// Not a check: prints the time of one step's block minima (16 heads x 64k entries, 64
    /// per block) with `block_min` and with the plain fold it replaced. Run with
    /// `cargo test --release -p foxedge-vulkan --lib block_min_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn block_min_timing() {
        let c: Vec<f64> = (0..16 * 65536).map(|j| -(j as f64) * 1e-3).collect();
        let time = |f: &dyn Fn(&[f64]) -> f64| {
            let t = std::time::Instant::now();
            for _ in 0..50 {
                std::hint::black_box(c.chunks(64).map(f).sum::<f64>());
            }
            t.elapsed().as_secs_f64() / 50.0 * 1e3
        };
        for _ in 0..3 {
            let fold = time(&|b| b.iter().copied().fold(f64::INFINITY, f64::min));
            let lanes = time(&block_min);
            println!("one step's block minima: fold {fold:.3} ms, block_min {lanes:.3} ms");
        }
    }
}
