//! One decode token through every layer in one submission ([`DeviceStream::step`]).
//!
//! What the per-layer path asks the host between layers is decided before the step or on
//! the device:
//! - the host's row operations that do not depend on the token (re-based metas);
//! - `c_t = c_{t-1} + log f_t` per head (double-float, from the host's f64 `c_{t-1}`),
//!   written into the query's `c` and the new row's meta;
//! - the retention policy's evictions at this token: the host lists them in eviction order
//!   with the largest `c_t` that evicts each (foxedge-core's `next_evictions`), with each
//!   one's swap-delete move; the device evicts those at or above its `c_t`, stores the
//!   token's row after the survivors and attends them (the CPU's order: evictions, then
//!   the token's row, then its attention);
//! - ACP's block decisions by foxedge-core's rule from the rows' `c`, with the host's
//!   `delta` or one from the step's own q/k norms.
//!
//! The three run in one dispatch per group of heads (`head_step.comp`), before the group's
//! attention (one dispatch too): all the layer's heads where the device binds that many
//! buffers ([`DeviceStream::step_slots`]).
//!
//! The host waits once, then reads every layer's gates, new K/V rows and shift state (its
//! bookkeeping and shadow cache), the device's ACP counts, and the token or logits.
//! Buffers (readback, host inputs, logits, ACP flags, decode partials) live in [`Bufs`],
//! grown when a step needs more and reused otherwise.

use super::{
    BLOCK, DeviceStream, GateLayout, Gates, HPD, HostData, HostTimes, MAXC, Output, RowOp,
    RunStats, copy, copy_region, internal, logits_words, op_words, out_rows, read_head, view,
};
use crate::decode::{auto_split, storage_align};
use crate::error::{Error, Result};
use crate::pack::split_f64;
use foxedge_core::contract::{AttentionStats, HeadStats};
use std::sync::Arc;
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::PrimaryAutoCommandBuffer;
use vulkano::descriptor_set::WriteDescriptorSet;

static HEAD_STEP: &[u8] = include_bytes!("../../../shaders/head_step.spv");

/// ACP's threshold of one head in a step (`head_step.comp`'s modes).
#[derive(Debug, Clone, PartialEq)]
pub enum StepAcp {
    /// Every block attended (ACP off).
    Dense,
    /// `delta` from the host, one per number `k` of evictions the step may make (`0..=`
    /// the candidates): `threshold(U, live - k + 1, ln eps)` with the certified `U`.
    Delta(Vec<f64>),
    /// `delta = base - 2 scale |q| max(k_norm_max, |k|)` with the step's own norms:
    /// `base = ln eps - ln(live + 1)`, `k_norm_max` the head's largest earlier `|k|`.
    Norms {
        base: f64,
        k_norm_max: f64,
        scale: f64,
    },
}

impl StepAcp {
    fn mode(&self) -> u32 {
        match self {
            StepAcp::Dense => 0,
            StepAcp::Delta(_) => 1,
            StepAcp::Norms { .. } => 2,
        }
    }

    /// `par` of `head_step.comp` (f32 bits; [`StepAcp::Delta`]: its first, for no
    /// eviction).
    fn par(&self) -> Result<[u32; 4]> {
        let bad = || {
            Error::Input(foxedge_core::Error::BadArgument(
                "ACP threshold parameters must be finite",
            ))
        };
        Ok(match *self {
            StepAcp::Dense => [0; 4],
            StepAcp::Delta(ref d) => {
                let d = *d.first().ok_or_else(bad)?;
                if !d.is_finite() {
                    return Err(bad());
                }
                let mut w = [0u32; 2];
                split_f64(&[d], &mut w);
                [w[0], w[1], 0, 0]
            }
            StepAcp::Norms {
                base,
                k_norm_max,
                scale,
            } => {
                if !(base.is_finite() && k_norm_max.is_finite() && scale.is_finite()) {
                    return Err(bad());
                }
                [
                    (base as f32).to_bits(),
                    (k_norm_max as f32).to_bits(),
                    (scale as f32).to_bits(),
                    0,
                ]
            }
        })
    }
}

/// One eviction a step may make: its swap-delete move (none when the evicted row was the
/// last live one) and the largest `c_t` at which it is made (`+inf`: always).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepEvict {
    pub moved: Option<(u32, u32)>,
    pub at_or_below: f64,
}

/// One head of one layer of a step, as the host decided it before the step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepHead {
    /// Row operations applied first, in order ([`RowOp::Move`] / [`RowOp::Meta`]: the
    /// token's own row is stored by the step).
    pub ops: Vec<RowOp>,
    /// Live rows after `ops`.
    pub live: usize,
    /// The evictions the step may make, in order (thresholds non-increasing): it makes the
    /// first `k`, those with `c_t <= at_or_below`; the token's row then goes to slot
    /// `live - k` and its query attends rows `0..live - k + 1`.
    pub evict: Vec<StepEvict>,
    /// `c_{t-1}` of the head, same origin as its rows.
    pub c_prev: f64,
    /// The token's stream position (its row's meta).
    pub pos: u64,
    pub acp: StepAcp,
}

/// Word offsets of a step's readback (`words` in all): every layer's gates (one token's
/// [`GateLayout`], layer `l` at `l * gl.words`), the ACP counts `[layers][H][4]` (kept
/// blocks, kept rows, evictions) at `acp` and `c_t` `[layers][H]` (hi, lo) at `ct`, the
/// shaders writing all of these straight into one device buffer of `dev` words (read back
/// with one copy); then the layers' shift states at `dev`, one every `stride` words (one
/// more copy).
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepLayout {
    gl: GateLayout,
    acp: usize,
    ct: usize,
    dev: usize,
    stride: usize,
    words: usize,
}

impl StepLayout {
    fn new(d: usize, nh: usize, nl: usize, align: usize, stride: usize) -> Self {
        let up = |x: usize| x.div_ceil(align) * align;
        let gl = GateLayout::new(1, d, nh, align);
        let acp = nl * gl.words;
        let ct = acp + up(4 * nl * nh);
        let dev = ct + up(2 * nl * nh);
        Self {
            gl,
            acp,
            ct,
            dev,
            stride,
            words: dev + nl * stride,
        }
    }
}

/// What a step read back: every layer's [`Gates`], the device's ACP decisions, evictions
/// and `c_t`.
#[derive(Debug)]
pub struct StepOutput {
    words: Vec<u32>,
    at: StepLayout,
    heads: usize,
}

impl StepOutput {
    /// Layer `l`'s gates (one token).
    pub fn gates(&self, l: usize) -> Gates<'_> {
        let at = &self.at;
        at.gl
            .read(&self.words, l, 1, l * at.gl.words, at.dev + l * at.stride)
    }

    /// (kept blocks, kept rows) of head `h` of layer `l`, as the device decided.
    pub fn kept(&self, l: usize, h: usize) -> (u64, u64) {
        let at = self.at.acp + 4 * (l * self.heads + h);
        (u64::from(self.words[at]), u64::from(self.words[at + 1]))
    }

    /// Evictions the device made in head `h` of layer `l` (the first of its plan's).
    pub fn evicted(&self, l: usize, h: usize) -> usize {
        self.words[self.at.acp + 4 * (l * self.heads + h) + 2] as usize
    }

    /// The device's `c_t` of head `h` of layer `l` (its double-float pair summed in f64).
    pub fn c_t(&self, l: usize, h: usize) -> f64 {
        let at = self.at.ct + 2 * (l * self.heads + h);
        f64::from(f32::from_bits(self.words[at])) + f64::from(f32::from_bits(self.words[at + 1]))
    }
}

/// Buffers of [`DeviceStream::step`], grown when a step needs more.
pub(super) struct Bufs {
    /// Host inputs (token, c, operations, per-head metadata).
    up: Subbuffer<[u32]>,
    /// Its device-local copy, which the step's shaders read and write (a discrete GPU reads
    /// host memory across the bus: a round trip per dependent read).
    upd: Subbuffer<[u32]>,
    /// The readback ([`StepLayout`]) and its device-written part.
    rb: Subbuffer<[u32]>,
    dev: Subbuffer<[u32]>,
    /// Logits or the token, and the non-finite flag.
    out: Subbuffer<[u32]>,
    logits: Subbuffer<[u32]>,
    am: Subbuffer<[u32]>,
    /// `c_t` per head, group-padded (`head_step.comp`).
    qc: Subbuffer<[u32]>,
    /// ACP flags `[layers][H][blocks]`.
    kept: Subbuffer<[u32]>,
    /// Decode partials and merge counters.
    ml: Subbuffer<[u32]>,
    po: Subbuffer<[u32]>,
    counters: Subbuffer<[u32]>,
}

/// Sizes (words) a step needs of each [`Bufs`] member.
#[derive(Clone, Copy)]
struct Need {
    up: usize,
    rb: usize,
    kept: usize,
    parts: usize,
}

impl Bufs {
    fn fits(&self, n: &Need) -> bool {
        self.up.len() as usize >= n.up
            && self.rb.len() as usize >= n.rb
            && self.kept.len() as usize >= n.kept
            && self.ml.len() as usize >= 2 * n.parts
    }
}

/// Per group of [`DeviceStream::step_slots`] heads of a layer: host-data ranges and the
/// decode split.
struct Group {
    h0: usize,
    h1: usize,
    ranges: (usize, usize),
    info: (usize, usize),
    par: (usize, usize),
    qinfo: (usize, usize),
    /// Decode workgroups per head: chunks of the largest capacity among the group's heads.
    grid: u32,
}

/// Per layer: host-data ranges (of the step's fixed-size inputs).
struct LayerAt {
    cprev: (usize, usize),
    rc: (usize, usize),
    mode: u32,
    chunk: usize,
    groups: Vec<Group>,
}

/// `FOXEDGE_VK_REPLAY=0` records every step afresh (for measuring what replay saves).
fn replay_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FOXEDGE_VK_REPLAY")
            .map(|v| v.trim() != "0")
            .unwrap_or(true)
    })
}

/// `FOXEDGE_VK_UNTRACKED=0` submits a replayed step through vulkano's futures (resource
/// tracking per submission) instead of a plain queue submission.
fn untracked_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FOXEDGE_VK_UNTRACKED")
            .map(|v| v.trim() != "0")
            .unwrap_or(true)
    })
}

/// Words of one row operation (`cache_ops.comp`: two uvec4).
const OP_WORDS: usize = 8;

/// What a recorded step depends on besides the buffers it binds (a re-allocated buffer
/// drops the recording): the output, the offset of the variable host inputs, the decode
/// pipeline, and per layer the decode chunk, the ACP mode and each head group's grid.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    out: u8,
    var_at: usize,
    decode: usize,
    layers: Vec<(usize, u32, Vec<u32>)>,
}

/// A step's command buffer, recorded once and submitted for every token with the same
/// [`Key`]: everything that changes per token (the token id, `c_{t-1}`, row operations,
/// eviction thresholds, live rows, ACP thresholds) is in the host inputs it reads.
pub(super) struct Replay {
    key: Key,
    cb: Arc<PrimaryAutoCommandBuffer>,
    dispatches: u32,
    /// Bytes it reads back besides the gates (logits or the token, and the flag).
    head_bytes: u64,
    /// Its timestamps (`FOXEDGE_VK_PROFILE`).
    prof: Option<crate::model::profile::Prof>,
}

impl DeviceStream {
    /// Feeds `token` (at the stream positions the plan names) through every layer in one
    /// submission. `plan[l][h]` says what the host decided for head `h` of layer `l` before
    /// the step; the step itself evicts nothing (the caller's policy must not, at this
    /// token). Returns the run's counters (attention statistics from the device's ACP
    /// decisions) and the readback of every layer's gates for the caller's bookkeeping.
    ///
    /// Errors: a bad token or plan ([`Error::Input`]), non-finite activations, device
    /// failures. After an error the stream's cache may hold part of the step: reset it.
    pub fn step(
        &mut self,
        token: u32,
        plan: &[Vec<StepHead>],
        out: Output<'_>,
    ) -> Result<(RunStats, StepOutput)> {
        let model = self.model.clone();
        let sh = model.shape;
        let ctx = model.ctx.clone();
        let (nh, v, nl) = (sh.heads, sh.vocab, sh.layers);
        if token as usize >= v {
            return Err(Error::Input(foxedge_core::Error::BadArgument(
                "a token id is out of the vocabulary",
            )));
        }
        if plan.len() != nl || plan.iter().any(|p| p.len() != nh) {
            return Err(foxedge_core::Error::BadLength {
                what: "step plan (one head step per head of every layer)",
                expected: nl * nh,
                got: plan.iter().map(Vec::len).sum(),
            }
            .into());
        }
        if nl * nh > 0xffff {
            return Err(Error::Unsupported(
                "a fused step handles at most 65535 heads in all layers".into(),
            ));
        }
        if let Output::Last(l) | Output::All(l) = &out
            && l.len() != v
        {
            return Err(foxedge_core::Error::BadLength {
                what: "logits (vocab)",
                expected: v,
                got: l.len(),
            }
            .into());
        }
        self.scratch(1)?;
        let align = storage_align(&ctx);
        let mut stats = RunStats {
            attention: Vec::with_capacity(nl),
            ..RunStats::default()
        };

        // Cache heads large enough for the token's row, grown in a submission of their own:
        // the recorded step binds the heads' buffers, so each growth re-records the step.
        // Where one head must grow, every head within an eighth of its capacity grows with
        // it (heads fill at similar rates: one re-recording instead of one per head).
        let mut needs = Vec::with_capacity(nl * nh);
        let mut any = false;
        for (l, heads) in plan.iter().enumerate() {
            for (h, st) in heads.iter().enumerate() {
                let mut need = st.live + 1;
                for op in &st.ops {
                    match *op {
                        RowOp::Move { from, to } => need = need.max(from.max(to) as usize + 1),
                        RowOp::Meta { slot, .. } => need = need.max(slot as usize + 1),
                        RowOp::Put { .. } => {
                            return Err(Error::Input(foxedge_core::Error::BadArgument(
                                "a step stores the token's row itself (no Put in its plan)",
                            )));
                        }
                    }
                }
                if need > u32::MAX as usize / 4 {
                    return Err(Error::Unsupported("cache head too large".into()));
                }
                any |= self.heads[l][h].as_ref().is_none_or(|b| b.cap < need);
                needs.push(need);
            }
        }
        let mut grow: Option<super::Rec<'_>> = None;
        if any {
            for (i, &need) in needs.iter().enumerate() {
                let (l, h) = (i / nh, i % nh);
                let cap = self.heads[l][h].as_ref().map_or(0, |b| b.cap);
                if cap >= need && need + cap / 8 <= cap {
                    continue;
                }
                let rec = match &mut grow {
                    Some(r) => r,
                    None => grow.insert(super::Rec::new(&ctx)?),
                };
                self.ensure_head(rec, l, h, need.max(cap + 1))?;
            }
        }
        if let Some(grow) = grow {
            let [build, submit, wait] = ctx.submit_timed(grow.b)?;
            let t = HostTimes {
                build,
                submit,
                wait,
                ..HostTimes::default()
            };
            stats.host.add(&t);
            self.times.add(&t);
        }
        let t0 = std::time::Instant::now();

        // Host inputs, one buffer for the step: first those whose offsets depend on the
        // model's shape only (bound at fixed views by the recorded step), then the row
        // operations, eviction thresholds and ACP tables (one view; the fixed part holds
        // indices into it).
        let slots = self.step_slots();
        let qstride = (2 * slots).div_ceil(align) * align / 2;
        // ACP flags and decode partials are laid out by the heads' capacities (at least
        // their live rows and the token's), so their buffers change only when a head grows.
        let max_blocks = self
            .heads
            .iter()
            .flatten()
            .flatten()
            .map(|b| b.cap.div_ceil(BLOCK))
            .max()
            .unwrap_or(1);
        let mut fx = HostData::new(align);
        let mut var = HostData::new(OP_WORDS);
        let ids_at = fx.push(&[token]);
        let mut layers_at = Vec::with_capacity(nl);
        let mut parts_max = 1usize;
        for (l, heads) in plan.iter().enumerate() {
            let mut cw = vec![0u32; 2 * nh];
            let mut words = Vec::new();
            let mut ranges = Vec::new();
            let mut thr = Vec::new();
            let mut tables = Vec::new();
            // Per head: (put op, first candidate op, thresholds, ACP table) offsets.
            let mut offs = Vec::with_capacity(nh);
            let mode = heads[0].acp.mode();
            for (h, st) in heads.iter().enumerate() {
                if !st.c_prev.is_finite() {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "c_{t-1} must be finite",
                    )));
                }
                if st.acp.mode() != mode {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "the heads of a layer take one kind of ACP threshold",
                    )));
                }
                if st.evict.len() > st.live {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "a step cannot evict more rows than are live",
                    )));
                }
                split_f64(&[st.c_prev], &mut cw[2 * h..2 * h + 2]);
                let first = words.len() / OP_WORDS;
                for op in &st.ops {
                    op_words(op, &mut words)?;
                }
                let cand = words.len();
                let thr0 = thr.len();
                let mut prev = f64::INFINITY;
                for e in &st.evict {
                    if e.at_or_below.is_nan() || e.at_or_below > prev {
                        return Err(Error::Input(foxedge_core::Error::BadArgument(
                            "eviction thresholds must not increase",
                        )));
                    }
                    prev = e.at_or_below;
                    match e.moved {
                        Some((from, to)) => {
                            if from.max(to) as usize >= st.live {
                                return Err(Error::Input(foxedge_core::Error::BadArgument(
                                    "an eviction moves a row that is not live",
                                )));
                            }
                            op_words(&RowOp::Move { from, to }, &mut words)?;
                        }
                        None => words.extend([3, 0, 0, 0, 0, 0, 0, 0]),
                    }
                    let mut t = [0u32; 2];
                    if e.at_or_below == f64::INFINITY {
                        t = [f32::INFINITY.to_bits(), 0];
                    } else if e.at_or_below.is_finite() {
                        split_f64(&[e.at_or_below], &mut t);
                    } else {
                        t = [f32::NEG_INFINITY.to_bits(), 0];
                    }
                    thr.extend(t);
                }
                let table = match &st.acp {
                    StepAcp::Delta(d) => {
                        if d.len() != st.evict.len() + 1 || d.iter().any(|x| !x.is_finite()) {
                            return Err(Error::Input(foxedge_core::Error::BadArgument(
                                "one finite ACP threshold per possible number of evictions",
                            )));
                        }
                        let t0 = tables.len();
                        let mut w = vec![0u32; 2 * d.len()];
                        split_f64(d, &mut w);
                        tables.extend(w);
                        Some(t0)
                    }
                    _ => None,
                };
                // The token's row; head_step.comp sets its slot and c.
                let put = words.len();
                op_words(
                    &RowOp::Put {
                        token: 0,
                        slot: st.live as u32,
                        c: 0.0,
                        pos: st.pos,
                    },
                    &mut words,
                )?;
                offs.push((put, cand, thr0, table));
                let cap = self.heads[l][h].as_ref().map_or(0, |b| b.cap);
                let n_ops = st.ops.len() + st.evict.len() + 1;
                ranges.extend([first as u32, n_ops as u32, h as u32, cap as u32]);
            }
            let ops_at = var.push(&words);
            let thr_at = var.push(&thr);
            let tab_at = var.push(&tables);
            // First operations relative to the operations' view (which starts at `var`).
            for r in ranges.chunks_mut(4) {
                r[0] += (ops_at.0 / OP_WORDS) as u32;
            }
            let entries: usize = heads.iter().map(|s| s.live + 1).sum();
            let n_max = heads.iter().map(|s| s.live + 1).max().unwrap_or(1);
            let chunk = auto_split(entries)
                .max(n_max.div_ceil(MAXC))
                .div_ceil(BLOCK)
                * BLOCK;
            let mut groups = Vec::new();
            let mut rc = vec![0u32; 12 * nh];
            for h0 in (0..nh).step_by(slots) {
                let h1 = (h0 + slots).min(nh);
                let mut info = Vec::new();
                let mut par = Vec::new();
                let mut qinfo = Vec::new();
                let mut parts = 0usize;
                let mut parts_cap = 0usize;
                let mut grid = 1usize;
                for (h, st) in heads.iter().enumerate().take(h1).skip(h0) {
                    let live = st.live + 1;
                    let cap = self.heads[l][h].as_ref().map_or(0, |b| b.cap);
                    let kept0 = (l * nh + h) * max_blocks;
                    info.extend([
                        live as u32,
                        cap as u32,
                        kept0 as u32,
                        ((l * nh + h) | (h << 16)) as u32,
                    ]);
                    par.extend(st.acp.par()?);
                    qinfo.extend([
                        live as u32,
                        cap as u32,
                        parts as u32,
                        kept0 as u32,
                        (h - h0) as u32,
                        0,
                        0,
                        0,
                    ]);
                    parts += live.div_ceil(chunk);
                    // Chunks of the head's capacity: the decode kernel's workgroups past
                    // its live rows' chunks return at once.
                    grid = grid.max(cap.div_ceil(chunk));
                    parts_cap += cap.div_ceil(chunk);
                }
                parts_max = parts_max.max(parts).max(parts_cap);
                let g = Group {
                    h0,
                    h1,
                    ranges: fx.push(&ranges[4 * h0..4 * h1]),
                    info: fx.push(&info),
                    par: fx.push(&par),
                    qinfo: fx.push(&qinfo),
                    grid: grid as u32,
                };
                for h in h0..h1 {
                    let (put, cand, thr0, table) = offs[h];
                    let i = h - h0;
                    // Words 0, 2, 3 and 7 index `var`; made absolute below.
                    rc[12 * h..12 * h + 12].copy_from_slice(&[
                        (ops_at.0 + put) as u32,
                        heads[h].evict.len() as u32,
                        (ops_at.0 + cand) as u32,
                        (thr_at.0 + thr0) as u32,
                        heads[h].live as u32,
                        (g.info.0 + 4 * i) as u32,
                        (g.qinfo.0 + 8 * i) as u32,
                        table.map_or(u32::MAX, |t| (tab_at.0 + t) as u32),
                        (g.par.0 + 4 * i) as u32,
                        (l * nh + h) as u32,
                        (g.ranges.0 + 4 * i) as u32,
                        0,
                    ]);
                }
                groups.push(g);
            }
            layers_at.push(LayerAt {
                cprev: fx.push(&cw),
                rc: fx.push(&rc),
                mode,
                chunk,
                groups,
            });
        }
        let var_at = fx.words.len().div_ceil(align) * align;
        for la in &layers_at {
            for r in fx.words[la.rc.0..la.rc.0 + 12 * nh].chunks_mut(12) {
                for i in [0, 2, 3] {
                    r[i] += var_at as u32;
                }
                if r[7] != u32::MAX {
                    r[7] += var_at as u32;
                }
            }
        }
        let at = self.step_layout();
        let need = Need {
            up: var_at + var.words.len(),
            rb: at.words,
            kept: nl * nh * max_blocks,
            parts: parts_max,
        };
        self.fused_bufs(need, qstride * nh.div_ceil(slots) * 2, slots)?;
        let kernel = self.step_kernel(slots)?;
        let key = Key {
            out: match &out {
                Output::Nothing => 0,
                Output::Last(_) | Output::All(_) => 1,
                Output::Greedy => 2,
            },
            var_at,
            decode: Arc::as_ptr(&kernel.pipe) as usize,
            layers: layers_at
                .iter()
                .map(|la| {
                    (
                        la.chunk,
                        la.mode,
                        la.groups.iter().map(|g| g.grid).collect(),
                    )
                })
                .collect(),
        };
        {
            let b = self
                .fused
                .as_ref()
                .ok_or_else(|| internal("no step buffers"))?;
            let mut w = b.up.write().map_err(|e| Error::Vulkan(e.to_string()))?;
            w[..fx.words.len()].copy_from_slice(&fx.words);
            w[var_at..var_at + var.words.len()].copy_from_slice(&var.words);
        }
        stats.bytes_uploaded += (fx.words.len() + var.words.len()) as u64 * 4;

        let mut t = HostTimes::default();
        if !replay_enabled() || self.replay.as_ref().is_none_or(|r| r.key != key) {
            self.replay = None;
            let (r, build) = self.record_step(&kernel, &layers_at, ids_at, key, &out)?;
            self.replay = Some(r);
            t.build = build;
            t.recorded = 1;
        }
        t.record = t0.elapsed().saturating_sub(t.build);
        let r = self
            .replay
            .as_ref()
            .ok_or_else(|| internal("no recorded step"))?;
        let (cb, dispatches) = (r.cb.clone(), r.dispatches);
        stats.bytes_downloaded += at.words as u64 * 4 + r.head_bytes;
        let (rb, hout) = {
            let b = self
                .fused
                .as_ref()
                .ok_or_else(|| internal("no step buffers"))?;
            (b.rb.clone(), b.out.clone())
        };
        self.submit_built(cb, dispatches, t, &mut stats, untracked_enabled())?;
        self.step_times.add(&stats.host);
        if let Some(p) = self.replay.as_ref().and_then(|r| r.prof.as_ref()) {
            p.collect(&mut self.profile);
        }
        let mut words = std::mem::take(&mut self.spare);
        {
            let w = rb.read().map_err(|e| Error::Vulkan(e.to_string()))?;
            words.clear();
            words.extend_from_slice(&w[..at.words]);
        }
        {
            let w = hout.read().map_err(|e| Error::Vulkan(e.to_string()))?;
            read_head(&w, out_rows(&out, 1) * v, out, &mut stats)?;
        }
        let res = StepOutput {
            words,
            at,
            heads: nh,
        };
        for (l, heads) in plan.iter().enumerate() {
            let mut st = AttentionStats {
                heads: Vec::with_capacity(nh),
            };
            for (h, sp) in heads.iter().enumerate() {
                let k = res.evicted(l, h);
                if k > sp.evict.len() {
                    return Err(internal("a step evicted more than its plan"));
                }
                let live = (sp.live - k + 1) as u64;
                let (kb, kr) = res.kept(l, h);
                st.heads.push(HeadStats {
                    delta: match &sp.acp {
                        StepAcp::Delta(x) => x.get(k).copied(),
                        _ => None,
                    },
                    total_pairs: live,
                    total_blocks: live.div_ceil(BLOCK as u64),
                    kept_pairs: kr,
                    kept_blocks: kb,
                });
            }
            stats.attention.push(st);
        }
        Ok((stats, res))
    }

    /// Records the step's command buffer for `key` (submitted many times): every layer
    /// with the host inputs at the offsets `layers` names, the final norm and LM head for
    /// `out`. Returns it with the time its build took.
    fn record_step(
        &self,
        kernel: &crate::decode::Kernel,
        layers_at: &[LayerAt],
        ids_at: (usize, usize),
        key: Key,
        out: &Output<'_>,
    ) -> Result<(Replay, std::time::Duration)> {
        let model = &self.model;
        let ctx = &model.ctx;
        let sh = model.shape;
        let (nh, hd, nl) = (sh.heads, sh.head_dim, sh.layers);
        let at = self.step_layout();
        let align = storage_align(ctx);
        let slots = self.step_slots();
        let qstride = (2 * slots).div_ceil(align) * align / 2;
        let b = self
            .fused
            .as_ref()
            .ok_or_else(|| internal("no step buffers"))?;
        let up = b.upd.clone();
        let mut rec = super::Rec::reusable(ctx)?;
        if self.profiling {
            let groups = nh.div_ceil(slots) as u32;
            rec.profile(256 + nl as u32 * (64 + 8 * groups))?;
        }
        rec.b.fill_buffer(self.flag.clone(), 0)?;
        // Zero once: each decode dispatch leaves its merge counters at zero (the merging
        // workgroup resets its query's; single-chunk queries never count).
        rec.b.fill_buffer(b.counters.clone(), 0)?;
        rec.mark("fill")?;
        copy(
            &mut rec,
            &b.up,
            &up,
            vec![copy_region(0, 0, b.up.len() as usize)],
        )?;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        rec.embed(&model.embeddings, &view(&up, ids_at), 1, &s.h)?;
        let spec = self.attn_spec();
        let mut spec: Vec<(u32, u32)> = (0u32..).zip(spec).collect();
        spec.push((5, slots as u32));
        let head_pipe = ctx.pipeline("head_step", HEAD_STEP, &spec)?;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            chunk: u32,
            block: u32,
            scale_log2: f32,
            pad: u32,
        }
        // The layers' gates, ACP counts and c_t go straight into `b.dev` (`StepLayout`).
        let acp = view(&b.dev, (at.acp, 4 * nl * nh));
        let ct = view(&b.dev, (at.ct, 2 * nl * nh));
        for (l, la) in layers_at.iter().enumerate() {
            self.record_proj(&mut rec, l, 1)?;
            let [k, v, lf, nrm] = at.gl.views(&b.dev, l * at.gl.words);
            #[derive(BufferContents, Clone, Copy)]
            #[repr(C)]
            struct H {
                h0: u32,
                qstride: u32,
                var_at: u32,
                cprev_at: u32,
                rc_at: u32,
                block: u32,
                mode: u32,
                qk_eps: f32,
            }
            let lw = &model.layers[l];
            for (gi, g) in la.groups.iter().enumerate() {
                let bound = self.head_slots(l, g.h0, g.h1, slots)?;
                let qc = view(&b.qc, (gi * qstride * 2, 2 * slots));
                rec.tag = "head_step";
                rec.run(
                    &head_pipe,
                    vec![
                        WriteDescriptorSet::buffer_array(0, 0, bound.clone()),
                        WriteDescriptorSet::buffer(1, s.p.clone()),
                        WriteDescriptorSet::buffer(2, self.shift[l].clone()),
                        WriteDescriptorSet::buffer(3, lw.qk_norm.clone()),
                        WriteDescriptorSet::buffer(4, lw.fgate_bias.clone()),
                        WriteDescriptorSet::buffer(5, s.q.clone()),
                        WriteDescriptorSet::buffer(6, k.clone()),
                        WriteDescriptorSet::buffer(7, v.clone()),
                        WriteDescriptorSet::buffer(8, lf.clone()),
                        WriteDescriptorSet::buffer(9, nrm.clone()),
                        WriteDescriptorSet::buffer(10, b.qc.clone()),
                        WriteDescriptorSet::buffer(11, up.clone()),
                        WriteDescriptorSet::buffer(12, b.kept.clone()),
                        WriteDescriptorSet::buffer(13, acp.clone()),
                        WriteDescriptorSet::buffer(14, self.flag.clone()),
                        WriteDescriptorSet::buffer(15, ct.clone()),
                    ],
                    H {
                        h0: g.h0 as u32,
                        qstride: qstride as u32,
                        var_at: key.var_at as u32,
                        cprev_at: la.cprev.0 as u32,
                        rc_at: la.rc.0 as u32,
                        block: BLOCK as u32,
                        mode: la.mode,
                        qk_eps: sh.qk_eps as f32,
                    },
                    [(g.h1 - g.h0) as u32, 1, 1],
                )?;
                let q_views = (g.h1 - g.h0) * hd;
                rec.tag = "decode";
                rec.run(
                    &kernel.pipe,
                    vec![
                        WriteDescriptorSet::buffer(0, view(&s.q, (g.h0 * hd, q_views))),
                        WriteDescriptorSet::buffer_array(1, 0, bound),
                        WriteDescriptorSet::buffer(2, view(&up, g.qinfo)),
                        WriteDescriptorSet::buffer(3, qc),
                        WriteDescriptorSet::buffer(4, b.kept.clone()),
                        WriteDescriptorSet::buffer(5, b.ml.clone()),
                        WriteDescriptorSet::buffer(6, b.po.clone()),
                        WriteDescriptorSet::buffer(7, view(&s.o, (g.h0 * hd, q_views))),
                        WriteDescriptorSet::buffer(8, view(&s.lse, (0, g.h1 - g.h0))),
                        WriteDescriptorSet::buffer(9, b.counters.clone()),
                        WriteDescriptorSet::buffer(10, self.flag.clone()),
                    ],
                    P {
                        chunk: la.chunk as u32,
                        block: BLOCK as u32,
                        scale_log2: (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E,
                        pad: 0,
                    },
                    [g.grid, (g.h1 - g.h0) as u32, 1],
                )?;
            }
            self.record_post(&mut rec, l, 1)?;
        }
        copy(&mut rec, &b.dev, &b.rb, vec![copy_region(0, 0, at.dev)])?;
        copy(
            &mut rec,
            &self.shift_all,
            &b.rb,
            vec![copy_region(0, at.dev, nl * at.stride)],
        )?;
        let head_bytes = self.record_head(&mut rec, 1, out, &b.logits, &b.am, &b.out)?;
        let dispatches = rec.dispatches;
        let prof = rec.prof.take();
        let t = std::time::Instant::now();
        let cb = rec.b.build()?;
        let build = t.elapsed();
        Ok((
            Replay {
                key,
                cb,
                dispatches,
                head_bytes,
                prof,
            },
            build,
        ))
    }

    /// Takes back a step's readback buffer for the next step (saves its allocation).
    pub fn recycle(&mut self, out: StepOutput) {
        self.spare = out.words;
    }

    /// Where a step's readback holds what.
    fn step_layout(&self) -> StepLayout {
        let sh = &self.model.shape;
        let align = storage_align(&self.model.ctx);
        StepLayout::new(sh.hidden, sh.heads, sh.layers, align, self.shift_stride)
    }

    /// Heads per `head_step.comp` / decode dispatch of a step: all of a layer's where the
    /// device binds that many storage buffers in one set (each kernel binds at most 15
    /// besides the heads), at least [`HPD`] (what the decode kernel always binds);
    /// `FOXEDGE_VK_STEP_SLOTS` caps it (at least 1).
    pub(super) fn step_slots(&self) -> usize {
        static CAP: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        let cap = *CAP.get_or_init(|| {
            std::env::var("FOXEDGE_VK_STEP_SLOTS")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&c| c > 0)
        });
        let props = self.model.ctx.device.physical_device().properties();
        let most = props
            .max_per_stage_descriptor_storage_buffers
            .min(props.max_descriptor_set_storage_buffers) as usize;
        let fit = most.saturating_sub(15).max(HPD);
        self.model
            .shape
            .heads
            .min(fit)
            .min(cap.unwrap_or(usize::MAX))
            .max(1)
    }

    /// The cache buffers of heads `h0..h1` of layer `l`, padded to `slots` with the last.
    fn head_slots(
        &self,
        l: usize,
        h0: usize,
        h1: usize,
        slots: usize,
    ) -> Result<Vec<Subbuffer<[u32]>>> {
        (0..slots)
            .map(|i| {
                let h = (h0 + i).min(h1 - 1);
                self.heads[l][h].as_ref().map(|b| b.buf.clone())
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| internal("cache head missing"))
    }

    /// Makes [`Self::fused`] hold at least `need` (grown by half again when it grows).
    fn fused_bufs(&mut self, need: Need, qc_words: usize, slots: usize) -> Result<()> {
        if self.fused.as_ref().is_some_and(|b| b.fits(&need)) {
            return Ok(());
        }
        let ctx = self.model.ctx.clone();
        let sh = self.model.shape;
        let grow = |x: usize| x + x / 2;
        let parts = grow(need.parts);
        self.invalidate();
        self.fused = Some(Bufs {
            up: ctx.host_buffer(grow(need.up), true)?,
            upd: ctx.device_buffer(grow(need.up))?,
            rb: ctx.host_buffer(grow(need.rb), false)?,
            out: ctx.host_buffer(logits_words(1, sh.vocab), false)?,
            logits: ctx.device_buffer(sh.vocab)?,
            am: ctx.device_buffer(2)?,
            qc: ctx.device_buffer(qc_words)?,
            kept: ctx.device_buffer(grow(need.kept))?,
            dev: ctx.device_buffer(self.step_layout().dev)?,
            ml: ctx.device_buffer(2 * parts)?,
            po: ctx.device_buffer(sh.head_dim * parts)?,
            counters: ctx.device_buffer(slots)?,
        });
        Ok(())
    }
}
