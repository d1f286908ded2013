//! Decode on the device: flash-decoding over each query head's cache (`decode.glsl`, one
//! workgroup per (query, chunk of `split` entries)) and an exact merge
//! (`decode_merge.comp`). ACP decisions are made on the host in f64 exactly as foxedge-cpu
//! makes them (a block of `block_k` entries is skipped when `c_t - min_j c_j < delta` for
//! every query of the head) and uploaded as one flag per block.
//!
//! Device layout: heads' entries concatenated, each head starting on a multiple of
//! `block_k` so that a block's flag index is `entry / block_k`; c as (hi, lo) f32 pairs
//! (see `prefill.rs`); positions as i32 relative to the head's smallest query position.
//! Heads are grouped into chunks whose every binding fits `maxStorageBufferRange`.

use crate::api::{Acp, AttentionStats, DecodeArgs, DecodeOptions, HeadStats, Storage};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::{pack_rows, split_f64, unpack_rows};
use foxedge_core::threshold;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{ComputePipeline, Pipeline, PipelineBindPoint};

static DECODE_F32: &[u8] = include_bytes!("../shaders/decode_f32.spv");
static DECODE_F16: &[u8] = include_bytes!("../shaders/decode_f16.spv");
static DECODE_F32_NOSG: &[u8] = include_bytes!("../shaders/decode_f32_nosg.spv");
static DECODE_F16_NOSG: &[u8] = include_bytes!("../shaders/decode_f16_nosg.spv");
static DECODE_MERGE: &[u8] = include_bytes!("../shaders/decode_merge.spv");

/// Threads per decode workgroup (a power of two, as the reductions require).
const WG: u32 = 128;

#[derive(BufferContents, Clone, Copy, Debug)]
#[repr(C)]
struct Push {
    chunk: u32,
    block: u32,
    scale_log2: f32,
    chunks_per_query: u32,
}

struct Chunk {
    set: Arc<DescriptorSet>,
    merge_set: Arc<DescriptorSet>,
    groups: [u32; 3],
    queries: u32,
    out: Subbuffer<[u32]>,
    lse: Subbuffer<[u32]>,
    head0: usize,
    heads: usize,
}

/// A decode step whose inputs are on the device. Built by [`crate::Vulkan::prepare_decode`].
pub struct PreparedDecode {
    ctx: Arc<Context>,
    pipe: Arc<ComputePipeline>,
    merge: Arc<ComputePipeline>,
    push: Push,
    chunks: Vec<Chunk>,
    d: usize,
    nq: usize,
    nh: usize,
    stats: AttentionStats,
    f16: bool,
    subgroups: bool,
}

impl std::fmt::Debug for PreparedDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDecode")
            .field("heads", &self.nh)
            .field("n_queries", &self.nq)
            .field("head_dim", &self.d)
            .field("f16_storage", &self.f16)
            .field("subgroups", &self.subgroups)
            .field("chunks", &self.chunks.len())
            .finish()
    }
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

fn validate<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
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
    for hc in args.heads {
        let n = hc.c.len();
        let nd = n
            .checked_mul(d)
            .ok_or(Error::Input(foxedge_core::Error::BadShape(
                "cache size overflows usize",
            )))?;
        bad_len("cache k (entries * head_dim)", nd, hc.k.len())?;
        bad_len("cache v (entries * head_dim)", nd, hc.v.len())?;
        if hc.c.iter().any(|x| !x.is_finite()) {
            return Err(foxedge_core::Error::BadArgument("cache c_j must be finite").into());
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
    }
    Ok(())
}

/// Per-head host data in device layout.
struct HeadPlan {
    /// Block flags (1 = attend) of this head, `ceil(n / block)` values.
    kept: Vec<u32>,
    stats: HeadStats,
    /// Query positions relative to the head's base, and entries' positions likewise.
    qpos: Vec<u32>,
    epos: Vec<i32>,
}

fn plan_head<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    h: usize,
    delta: Option<f64>,
    bk: usize,
) -> Result<HeadPlan> {
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
        let cmin = hc.c[b0..b1].iter().copied().fold(f64::INFINITY, f64::min);
        let pruned = delta.is_some_and(|dl| qc.iter().all(|&ct| ct - cmin < dl));
        let keep = !pruned && pairs > 0;
        if keep {
            st.kept_pairs += pairs;
            st.kept_blocks += 1;
        }
        kept.push(u32::from(keep));
        b0 = b1;
    }
    let (qrel, erel) = match (hc.pos, qpos) {
        (Some(p), Some(qp)) => {
            let base = qp.iter().copied().min().unwrap_or(0);
            let mut qrel = Vec::with_capacity(nq);
            for &x in qp {
                let r = x - base;
                if r > i32::MAX as u64 {
                    return Err(Error::Unsupported(
                        "query positions of one step span more than 2^31".into(),
                    ));
                }
                qrel.push(r as u32);
            }
            let erel = p
                .iter()
                .map(|&x| {
                    let r = i128::from(x) - i128::from(base);
                    r.clamp(i128::from(i32::MIN), i128::from(i32::MAX)) as i32
                })
                .collect();
            (qrel, erel)
        }
        _ => (vec![0; nq], vec![0; n]),
    };
    Ok(HeadPlan {
        kept,
        stats: st,
        qpos: qrel,
        epos: erel,
    })
}

pub(crate) fn prepare<Q: Storage, T: Storage>(
    ctx: &Arc<Context>,
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
) -> Result<PreparedDecode> {
    validate(args, opts)?;
    let (d, nq, nh) = (args.head_dim, args.n_queries, args.heads.len());
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let bk = opts.block_k;
    let chunk = opts.split.div_ceil(bk) * bk;
    if chunk > u32::MAX as usize || args.heads.iter().any(|h| h.c.len() > i32::MAX as usize) {
        return Err(Error::Unsupported(
            "cache or split too large for u32 indexing".into(),
        ));
    }

    let mut plans = Vec::with_capacity(nh);
    for (h, hc) in args.heads.iter().enumerate() {
        let n = hc.c.len();
        let delta = match opts.acp {
            Acp::Threshold(t) => Some(t[h]),
            Acp::Bound { u, ln_eps } if n > 0 => Some(threshold::threshold(u[h], n, ln_eps)?),
            _ => None,
        };
        plans.push(plan_head(args, h, delta, bk)?);
    }
    let stats = AttentionStats {
        heads: plans.iter().map(|p| p.stats).collect(),
    };

    let f16 = T::DTYPE == crate::api::DType::F16 && ctx.info.storage_16bit;
    let esize = if f16 { 2 } else { 4 };
    // Lane teams: TPE lanes per entry, each D/(4 TPE) vec4 columns; needs shuffles within
    // a subgroup whose size is a multiple of TPE.
    let tpe = (d / 4).min(8) as u32;
    let sg = !ctx
        .decode_no_subgroups
        .load(std::sync::atomic::Ordering::Relaxed)
        && ctx.info.subgroup_shuffle
        && ctx.info.subgroup_size.is_some_and(|s| s % tpe == 0)
        && (d / 4) as u32 % tpe == 0;
    let (name, spv) = match (f16, sg) {
        (true, true) => ("decode_f16", DECODE_F16),
        (false, true) => ("decode_f32", DECODE_F32),
        (true, false) => ("decode_f16_nosg", DECODE_F16_NOSG),
        (false, false) => ("decode_f32_nosg", DECODE_F32_NOSG),
    };
    let pipe = ctx.pipeline(name, spv, &[(0, WG), (1, d as u32), (2, tpe)])?;
    let merge = ctx.pipeline("decode_merge", DECODE_MERGE, &[(0, 64), (1, d as u32)])?;

    // Head chunks under the binding range (the K/V entry buffers dominate).
    let limit = ctx.binding_limit.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let padded = |h: usize| args.heads[h].c.len().div_ceil(bk) * bk;
    let mut chunks = Vec::new();
    let mut h0 = 0;
    while h0 < nh {
        let mut h1 = h0;
        let mut entries = 0usize;
        while h1 < nh && (h1 == h0 || (entries + padded(h1)) * d * esize <= limit) {
            entries += padded(h1);
            h1 += 1;
        }
        if entries * d * esize > limit {
            return Err(Error::Unsupported(format!(
                "one head's cache needs {} bytes, over the device's binding limit {limit}",
                entries * d * esize
            )));
        }
        chunks.push(build_chunk(
            ctx, args, &plans, h0, h1, bk, chunk, f16, &pipe, &merge,
        )?);
        h0 = h1;
    }
    let max_chunks = chunks.iter().map(|c| c.groups[0]).max().unwrap_or(1);
    Ok(PreparedDecode {
        ctx: ctx.clone(),
        pipe,
        merge,
        push: Push {
            chunk: chunk as u32,
            block: bk as u32,
            scale_log2: scale * std::f32::consts::LOG2_E,
            chunks_per_query: max_chunks,
        },
        chunks,
        d,
        nq,
        nh,
        stats,
        f16,
        subgroups: sg,
    })
}

#[allow(clippy::too_many_arguments)]
fn build_chunk<Q: Storage, T: Storage>(
    ctx: &Arc<Context>,
    args: &DecodeArgs<'_, Q, T>,
    plans: &[HeadPlan],
    h0: usize,
    h1: usize,
    bk: usize,
    chunk: usize,
    f16: bool,
    pipe: &Arc<ComputePipeline>,
    merge: &Arc<ComputePipeline>,
) -> Result<Chunk> {
    let (d, nq) = (args.head_dim, args.n_queries);
    let dw = if f16 { d / 2 } else { d };
    let mut k = Vec::new();
    let mut v = Vec::new();
    let mut c = Vec::new();
    let mut epos = Vec::new();
    let mut kept = Vec::new();
    let mut qinfo = Vec::new();
    let mut qc = vec![0u32; (h1 - h0) * nq * 2];
    let mut chunk0 = 0u32;
    let mut max_chunks = 1u32;
    for h in h0..h1 {
        let hc = &args.heads[h];
        let n = hc.c.len();
        let e0 = k.len() / dw;
        k.extend(pack_rows(hc.k, f16, n, d, |r| r * d).words);
        v.extend(pack_rows(hc.v, f16, n, d, |r| r * d).words);
        let pad = n.div_ceil(bk) * bk - n;
        k.resize(k.len() + pad * dw, 0);
        v.resize(v.len() + pad * dw, 0);
        let mut cw = vec![0u32; n * 2];
        split_f64(hc.c, &mut cw);
        c.extend(cw);
        c.resize(c.len() + pad * 2, 0);
        epos.extend(plans[h].epos.iter().map(|&x| x as u32));
        epos.resize(epos.len() + pad, 0);
        kept.extend(&plans[h].kept);
        let nch = n.div_ceil(chunk) as u32;
        max_chunks = max_chunks.max(nch);
        for t in 0..nq {
            qinfo.extend([e0 as u32, n as u32, chunk0, plans[h].qpos[t]]);
            chunk0 += nch;
        }
        split_f64(
            &args.q_c[h * nq..(h + 1) * nq],
            &mut qc[(h - h0) * nq * 2..(h - h0 + 1) * nq * 2],
        );
    }
    let q = pack_rows(args.q, false, (h1 - h0) * nq, d, |r| (h0 * nq + r) * d);
    let bufs = ctx.upload(&[&q.words, &k, &v, &c, &epos, &qinfo, &qc, &kept])?;
    let part_ml = ctx.device_buffer(chunk0.max(1) as usize * 2)?;
    let part_o = ctx.device_buffer(chunk0.max(1) as usize * d)?;
    let queries = ((h1 - h0) * nq) as u32;
    let out = ctx.device_buffer(queries as usize * d)?;
    let lse = ctx.device_buffer(queries as usize)?;
    let layout = |p: &Arc<ComputePipeline>| {
        p.layout()
            .set_layouts()
            .first()
            .cloned()
            .ok_or_else(|| Error::Vulkan("decode pipeline has no descriptor set".into()))
    };
    let mut writes: Vec<WriteDescriptorSet> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| WriteDescriptorSet::buffer(i as u32, b.clone()))
        .collect();
    writes.push(WriteDescriptorSet::buffer(8, part_ml.clone()));
    writes.push(WriteDescriptorSet::buffer(9, part_o.clone()));
    let set = DescriptorSet::new(ctx.desc.clone(), layout(pipe)?, writes, [])?;
    let merge_set = DescriptorSet::new(
        ctx.desc.clone(),
        layout(merge)?,
        [
            WriteDescriptorSet::buffer(0, bufs[5].clone()),
            WriteDescriptorSet::buffer(1, part_ml),
            WriteDescriptorSet::buffer(2, part_o),
            WriteDescriptorSet::buffer(3, out.clone()),
            WriteDescriptorSet::buffer(4, lse.clone()),
        ],
        [],
    )?;
    Ok(Chunk {
        set,
        merge_set,
        groups: [max_chunks, queries, 1],
        queries,
        out,
        lse,
        head0: h0,
        heads: h1 - h0,
    })
}

impl PreparedDecode {
    /// Runs the step `reps` times in one command buffer; wall time of submit-to-completion.
    pub fn run(&self, reps: usize) -> Result<Duration> {
        let mut b = self.ctx.builder()?;
        for _ in 0..reps.max(1) {
            for ch in &self.chunks {
                b.bind_pipeline_compute(self.pipe.clone())?;
                b.bind_descriptor_sets(
                    PipelineBindPoint::Compute,
                    self.pipe.layout().clone(),
                    0,
                    ch.set.clone(),
                )?;
                b.push_constants(self.pipe.layout().clone(), 0, self.push)?;
                // SAFETY: pipeline, set and push constants bound above; workgroups past a
                // query's chunk count return at once; every index is bounded by the per-query
                // entry count the host wrote into qinfo.
                unsafe { b.dispatch(ch.groups) }?;
                b.bind_pipeline_compute(self.merge.clone())?;
                b.bind_descriptor_sets(
                    PipelineBindPoint::Compute,
                    self.merge.layout().clone(),
                    0,
                    ch.merge_set.clone(),
                )?;
                b.push_constants(self.merge.layout().clone(), 0, self.push)?;
                // SAFETY: as above; the merge reads exactly the partials pass 1 wrote (the
                // automatic barrier orders it after pass 1).
                unsafe { b.dispatch([ch.queries, 1, 1]) }?;
            }
        }
        let t0 = Instant::now();
        self.ctx.submit(b)?;
        Ok(t0.elapsed())
    }

    pub fn stats(&self) -> &AttentionStats {
        &self.stats
    }

    pub fn f16_storage(&self) -> bool {
        self.f16
    }

    /// Whether the subgroup-reduction variant runs.
    pub fn subgroups(&self) -> bool {
        self.subgroups
    }

    /// Output `[heads, n_queries, head_dim]` and optional lse `[heads, n_queries]`.
    pub fn read<O: Storage>(&self, out: &mut [O], lse: Option<&mut [f32]>) -> Result<()> {
        let rows = self.nh * self.nq;
        bad_len("decode out", rows * self.d, out.len())?;
        if let Some(l) = lse.as_deref() {
            bad_len("decode lse", rows, l.len())?;
        }
        let mut lse = lse;
        for ch in &self.chunks {
            let got = self.ctx.download(&[&ch.out, &ch.lse])?;
            let r0 = ch.head0 * self.nq;
            let nr = ch.heads * self.nq;
            unpack_rows(&got[0], out, nr, self.d, |r| (r0 + r) * self.d);
            if let Some(l) = lse.as_deref_mut() {
                for (x, &w) in l[r0..r0 + nr].iter_mut().zip(&got[1]) {
                    *x = f32::from_bits(w);
                }
            }
        }
        Ok(())
    }
}
