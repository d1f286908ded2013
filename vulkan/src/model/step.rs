//! A stream on a [`DeviceModel`]: its cache heads, token-shift states and activations on the
//! device, and [`DeviceStream::run`], which feeds a chunk of tokens through every layer.
//!
//! One run is `layers + 1` submissions: the first ends after layer 0's gates, each next one
//! runs a layer's attention and MLP and the next layer up to its gates, the last the final
//! norm and LM head. Between them the caller's plan callback sees the layer's `log f` and new
//! K/V rows and decides (its retention policy, its ACP decisions); the host waits only for
//! those few values. The cache stays on the device: a step uploads the caller's row
//! operations (a few words per row) and per-query metadata, never cache rows.

mod cont;
mod fused;
mod gates;
mod heads;
mod levels;

pub use cont::ContinuePlan;
pub use fused::{StepAcp, StepEvict, StepHead, StepOutput};

use super::ops::{Rec, XIn};
use super::profile;
use super::weights::DeviceModel;
use super::{Act, QkNorm};
use crate::decode::{auto_split, head_words, meta_off, storage_align, v_off};
use crate::error::{Error, Result};
use crate::pack::split_f64;
use foxedge_core::boundary::{self, BlockGrid};
use foxedge_core::contract::{AttentionStats, HeadStats, acp};
use gates::GateLayout;
use heads::op_words;
use std::sync::Arc;
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::command_buffer::{BufferCopy, CopyBufferInfo, PrimaryAutoCommandBuffer};
use vulkano::descriptor_set::WriteDescriptorSet;

static PREFILL_F32: &[u8] = include_bytes!("../../shaders/prefill_f32.spv");

/// Entries per ACP block of the device's decisions (the kernels' default tile).
const BLOCK: usize = 64;
/// Head buffers bound per attention or cache dispatch (`HPD` / `SLOTS` in the shaders).
const HPD: usize = crate::decode::HPD;
/// Chunks per query at most (`MAXC` in decode.glsl).
const MAXC: usize = 1024;

/// One row operation on a cache head (slot indices of that head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowOp {
    /// Row `from` moves to row `to` (a swap-delete).
    Move { from: u32, to: u32 },
    /// Token `token` of the run (its K and V) is stored in row `slot`, with `c` (relative to
    /// the head's gate origin) and its stream position.
    Put {
        token: u32,
        slot: u32,
        c: f64,
        pos: u64,
    },
    /// Row `slot` keeps its K and V and takes this `c` and position (a re-based origin).
    Meta { slot: u32, c: f64, pos: u64 },
}

/// One head of one token's step: row operations, then its query attends rows `0..live`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HeadStep {
    pub ops: Vec<RowOp>,
    pub live: usize,
    /// The query's cumulative gate `c_t` (same origin as the rows').
    pub c_t: f64,
    /// ACP flags per [`BLOCK`]-entry block of rows (1 = attend), empty = every block
    /// ([`super::decode_blocks`]), and the statistics they give.
    pub kept: Vec<u32>,
    pub stats: HeadStats,
}

/// One token's step, one [`HeadStep`] per head.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenPlan {
    pub heads: Vec<HeadStep>,
}

/// The caller's decisions for one layer of a run.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerPlan {
    /// A fresh stream's chunk: causal attention over the chunk's own tokens with ACP
    /// threshold `delta[h]` (`None`: dense) on cumulative gates `c` (`[H][n]`, from 0),
    /// then `ops[h]` store rows into the cache heads.
    Chunk {
        c: Vec<f64>,
        delta: Vec<Option<f64>>,
        ops: Vec<Vec<RowOp>>,
    },
    /// Each token in turn (`n` plans): its row operations, then its query attends the
    /// cache.
    Tokens(Vec<TokenPlan>),
    /// A chunk of a stream that has a cache: its queries attend the cache rows and,
    /// causally, their own keys in one tiled pass; then its rows join the cache.
    Continue(ContinuePlan),
}

/// Row operations per layer and head that [`DeviceStream::run_deferred`] applies after the
/// last layer.
pub type OpsAfter = Vec<Vec<Vec<RowOp>>>;

/// A layer's readback of a [`DeviceStream::run_deferred`]: its own host buffer, which the
/// run never writes again, so a caller may read its [`Gates`] after the run has moved on
/// (from another thread too).
#[derive(Clone, Debug)]
pub struct LayerGates {
    buf: Subbuffer<[u32]>,
    gl: GateLayout,
    layer: usize,
    n: usize,
}

impl LayerGates {
    /// `f` on the layer's gates.
    pub fn with<R>(&self, f: impl FnOnce(&Gates<'_>) -> R) -> Result<R> {
        let w = self.buf.read().map_err(|e| Error::Vulkan(e.to_string()))?;
        Ok(f(&self.gl.read(&w, self.layer, self.n, 0, self.gl.words)))
    }
}

/// What a layer's gates gave, for the plan callback.
#[derive(Debug, Clone, Copy)]
pub struct Gates<'a> {
    pub layer: usize,
    pub tokens: usize,
    /// `[n][H]` log forget gates.
    pub log_f: &'a [f32],
    /// `[n][H]` (|q|, |k|) after the QK-norm, interleaved.
    pub norms: &'a [f32],
    /// `[H][n][head_dim]` the run's keys and values (after shift and QK-norm).
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// `[k_raw D | v_raw D]`: the raw projections of the run's last token (the layer's
    /// token-shift state from now on).
    pub shift: &'a [f32],
}

/// What a run returns.
#[derive(Debug)]
pub enum Output<'a> {
    /// Nothing (the tokens only fill the cache).
    Nothing,
    /// The last token's logits (`vocab` floats).
    Last(&'a mut [f32]),
    /// Every token's logits (`n * vocab`).
    All(&'a mut [f32]),
    /// The id of the last token's largest logit.
    Greedy,
}

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunStats {
    /// With [`Output::Greedy`]: the chosen token.
    pub token: Option<u32>,
    /// Per layer, the attention statistics of every head (token steps summed).
    pub attention: Vec<AttentionStats>,
    /// Bytes the host wrote for the device (token ids, row operations, query metadata).
    pub bytes_uploaded: u64,
    /// Bytes read back (gates, new rows, logits).
    pub bytes_downloaded: u64,
    pub submissions: u32,
    pub dispatches: u32,
    /// Host time of the run's submissions: recording commands, building the command
    /// buffers (vulkano's barrier pass), submitting, and waiting for the device.
    pub host: HostTimes,
}

/// Host time split of submissions (see [`RunStats::host`]); `FOXEDGE_VK_TIMING=1` prints
/// a stream's totals per submission to stderr when it is dropped. A one-token step that
/// replays its recorded command buffer spends `record` on its host inputs only, and no
/// `build`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostTimes {
    pub record: std::time::Duration,
    pub build: std::time::Duration,
    pub submit: std::time::Duration,
    pub wait: std::time::Duration,
    /// Between a chunk run's submissions: reading a layer's gates back and the caller's
    /// plan callback ([`DeviceStream::run`]; not counted for one-token steps).
    pub plan: std::time::Duration,
    pub submissions: u64,
    /// Command buffers recorded for one-token steps (each replayed until a buffer it binds
    /// is re-allocated or its shape changes).
    pub recorded: u64,
}

impl HostTimes {
    pub(crate) fn add(&mut self, o: &HostTimes) {
        self.record += o.record;
        self.build += o.build;
        self.submit += o.submit;
        self.wait += o.wait;
        self.plan += o.plan;
        self.submissions += o.submissions;
        self.recorded += o.recorded;
    }
}

/// A cache head on the device in the decode kernel's layout.
#[derive(Clone)]
struct HeadBuf {
    buf: Subbuffer<[u32]>,
    cap: usize,
}

/// Activations of a run of `n` tokens.
struct Scratch {
    n: usize,
    h: Subbuffer<[u32]>,
    x: Subbuffer<[u32]>,
    p: Subbuffer<[u32]>,
    q: Subbuffer<[u32]>,
    /// The gates of a layer ([`GateLayout`] `gl`), and views of its sections.
    g: Subbuffer<[u32]>,
    gl: GateLayout,
    k: Subbuffer<[u32]>,
    v: Subbuffer<[u32]>,
    lf: Subbuffer<[u32]>,
    nrm: Subbuffer<[u32]>,
    o: Subbuffer<[u32]>,
    op: Subbuffer<[u32]>,
    gu: Subbuffer<[u32]>,
    a: Subbuffer<[u32]>,
    lse: Subbuffer<[u32]>,
    /// One token's queries and outputs `[H][HD]` (token steps of a multi-token run).
    q1: Subbuffer<[u32]>,
    o1: Subbuffer<[u32]>,
}

impl Drop for DeviceStream {
    fn drop(&mut self) {
        if !self.profile.is_empty() {
            eprint!("{}", self.profile.table("one-token steps"));
        }
        if !self.run_profile.is_empty() {
            eprint!("{}", self.run_profile.table("multi-row runs"));
        }
        if std::env::var_os("FOXEDGE_VK_TIMING").is_none() {
            return;
        }
        for (what, t) in [("all", self.times), ("one-token steps", self.step_times)] {
            if t.submissions == 0 {
                continue;
            }
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6 / t.submissions as f64;
            eprintln!(
                "foxedge-vulkan: {what}: {} submissions, host µs each: record {:.0}, build \
                 {:.0}, submit {:.0}, wait {:.0}, plan {:.0} ({} step command buffers \
                 recorded)",
                t.submissions,
                us(t.record),
                us(t.build),
                us(t.submit),
                us(t.wait),
                us(t.plan),
                t.recorded
            );
        }
        let (n, t) = self.model.ctx.compiled();
        eprintln!(
            "foxedge-vulkan: {n} pipelines compiled by this context so far, {:.0} ms of host \
             time (within the first submissions' record)",
            t.as_secs_f64() * 1e3
        );
    }
}

/// A stream's device state on one model.
pub struct DeviceStream {
    model: Arc<DeviceModel>,
    /// `[layer][head]`, created at the first row stored.
    heads: Vec<Vec<Option<HeadBuf>>>,
    /// `[layer]` `[k_raw D | v_raw D]` of the last token fed: views of `shift_all`, one
    /// every `shift_stride` words.
    shift: Vec<Subbuffer<[u32]>>,
    shift_all: Subbuffer<[u32]>,
    shift_stride: usize,
    scratch: Option<Scratch>,
    /// Buffers of [`DeviceStream::step`], kept between steps.
    fused: Option<fused::Bufs>,
    /// The step's recorded command buffer; dropped whenever a buffer it binds is
    /// re-allocated ([`Self::invalidate`]).
    replay: Option<fused::Replay>,
    flag: Subbuffer<[u32]>,
    /// The fence of replayed steps' submissions, reset and reused.
    fence: Option<Arc<vulkano::sync::fence::Fence>>,
    /// How long the last replayed step's wait took (the next one's expected wait).
    step_wait: std::time::Duration,
    /// The decode pipeline of one-token steps, for the context's subgroup setting and the
    /// head buffers per dispatch it was made with.
    kernel: Option<(bool, usize, crate::decode::Kernel)>,
    /// A step readback's words, kept for the next step ([`Self::recycle`]).
    spare: Vec<u32>,
    /// Test hook: the submission (counted over runs) that reports a lost device.
    fail_at: Option<u64>,
    submitted: u64,
    /// Host times of every submission of this stream, and of its one-token steps.
    times: HostTimes,
    step_times: HostTimes,
    /// Whether a recorded step or run times its commands (`FOXEDGE_VK_PROFILE`), and their
    /// GPU time per kind over the one-token steps and over the runs ([`Self::run`]).
    profiling: bool,
    profile: profile::Profile,
    run_profile: profile::Profile,
}

impl std::fmt::Debug for DeviceStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStream")
            .field("shape", &self.model.shape)
            .finish()
    }
}

/// Small host-written inputs of a submission, gathered into one host-visible buffer.
struct HostData {
    words: Vec<u32>,
    align: usize,
}

impl HostData {
    fn new(align: usize) -> Self {
        Self {
            words: Vec::new(),
            align,
        }
    }

    /// Appends `w` at an aligned offset; returns (offset, length).
    fn push(&mut self, w: &[u32]) -> (usize, usize) {
        let at = self.words.len().div_ceil(self.align) * self.align;
        self.words.resize(at, 0);
        self.words.extend_from_slice(w);
        if w.is_empty() {
            self.words.push(0);
        }
        (at, w.len().max(1))
    }

    fn upload(self, rec: &Rec<'_>) -> Result<(Subbuffer<[u32]>, u64)> {
        let buf = rec.ctx.host_buffer(self.words.len().max(1), true)?;
        buf.write()
            .map_err(|e| Error::Vulkan(e.to_string()))?
            .get_mut(..self.words.len())
            .ok_or_else(|| Error::Vulkan("host buffer too small".into()))?
            .copy_from_slice(&self.words);
        Ok((buf, self.words.len() as u64 * 4))
    }
}

fn view(b: &Subbuffer<[u32]>, (at, len): (usize, usize)) -> Subbuffer<[u32]> {
    b.clone().slice(at as u64..(at + len) as u64)
}

fn copy_region(src: usize, dst: usize, words: usize) -> BufferCopy {
    BufferCopy {
        src_offset: src as u64 * 4,
        dst_offset: dst as u64 * 4,
        size: words as u64 * 4,
        ..Default::default()
    }
}

fn copy(
    rec: &mut Rec<'_>,
    src: &Subbuffer<[u32]>,
    dst: &Subbuffer<[u32]>,
    regions: Vec<BufferCopy>,
) -> Result<()> {
    if regions.is_empty() {
        return Ok(());
    }
    let mut info = CopyBufferInfo::buffers(src.clone(), dst.clone());
    info.regions.clear();
    info.regions.extend(regions);
    rec.b.copy_buffer(info)?;
    rec.mark("copy")
}

fn non_finite() -> Error {
    Error::Input(foxedge_core::Error::BadArgument(
        "attention logits are not finite: q, k or v holds NaN/inf, or s*q.k overflows f32",
    ))
}

fn internal(m: &str) -> Error {
    Error::Vulkan(format!("device model: {m}"))
}

/// A merged head statistic (pairs and blocks added).
fn add_stats(a: &mut HeadStats, b: &HeadStats) {
    a.kept_pairs += b.kept_pairs;
    a.total_pairs += b.total_pairs;
    a.kept_blocks += b.kept_blocks;
    a.total_blocks += b.total_blocks;
    a.delta = b.delta.or(a.delta);
}

impl DeviceStream {
    /// An empty stream (zero shift states, no cache rows).
    pub fn new(model: Arc<DeviceModel>) -> Result<Self> {
        let ctx = model.ctx.clone();
        let d = model.shape.hidden;
        let align = storage_align(&ctx);
        let shift_stride = (2 * d).div_ceil(align) * align;
        let shift_all = ctx.device_buffer(model.shape.layers * shift_stride)?;
        let shift = (0..model.shape.layers)
            .map(|l| view(&shift_all, (l * shift_stride, 2 * d)))
            .collect();
        let flag = ctx.device_buffer(1)?;
        let mut s = Self {
            heads: vec![vec![None; model.shape.heads]; model.shape.layers],
            model,
            shift,
            shift_all,
            shift_stride,
            scratch: None,
            fused: None,
            replay: None,
            flag,
            fence: None,
            step_wait: std::time::Duration::ZERO,
            kernel: None,
            spare: Vec::new(),
            fail_at: None,
            submitted: 0,
            times: HostTimes::default(),
            step_times: HostTimes::default(),
            profiling: profile::enabled(),
            profile: profile::Profile::default(),
            run_profile: profile::Profile::default(),
        };
        s.reset()?;
        Ok(s)
    }

    /// Forgets every token: zero shift states, no cache rows.
    pub fn reset(&mut self) -> Result<()> {
        let ctx = self.model.ctx.clone();
        let mut rec = Rec::new(&ctx)?;
        rec.b.fill_buffer(self.shift_all.clone(), 0)?;
        ctx.submit(rec.b)?;
        for l in &mut self.heads {
            l.iter_mut().for_each(|h| *h = None);
        }
        self.invalidate();
        Ok(())
    }

    /// Forgets the recorded step: a buffer it binds is being replaced.
    fn invalidate(&mut self) {
        self.replay = None;
    }

    /// Turns the per-command GPU profile of one-token steps on or off (default: as
    /// `FOXEDGE_VK_PROFILE` says).
    #[cfg(test)]
    pub(crate) fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
        self.invalidate();
    }

    /// GPU time per command kind of the profiled one-token steps.
    #[cfg(test)]
    pub(crate) fn gpu_profile(&self) -> &profile::Profile {
        &self.profile
    }

    /// GPU time per command kind of the profiled runs ([`Self::run`]).
    #[cfg(test)]
    pub(crate) fn run_gpu_profile(&self) -> &profile::Profile {
        &self.run_profile
    }

    /// A recording of [`Self::run`], timing its commands when profiling.
    fn run_rec<'c>(&self, ctx: &'c Arc<crate::device::Context>) -> Result<Rec<'c>> {
        let mut rec = Rec::new(ctx)?;
        if self.profiling {
            // A layer's submission: norms, projection chunks, attention (one command per
            // head group or token), cache operations and copies.
            let sh = &self.model.shape;
            rec.profile(1024 + 16 * sh.heads as u32)?;
        }
        Ok(rec)
    }

    /// Host times of every submission of this stream so far.
    pub fn host_times(&self) -> HostTimes {
        self.times
    }

    /// Makes the `k`-th submission from now (0: the next) fail as a lost device would,
    /// without submitting it: tests of a caller's fallback use it.
    #[doc(hidden)]
    pub fn fail_after(&mut self, k: u64) {
        self.fail_at = Some(self.submitted + k);
    }

    /// Submits `rec`, or reports the device lost where [`Self::fail_after`] says so.
    /// A profiled recording's timestamps join the runs' profile.
    fn submit(&mut self, mut rec: Rec<'_>, stats: &mut RunStats) -> Result<()> {
        let record = rec.started.elapsed();
        let t0 = std::time::Instant::now();
        let dispatches = rec.dispatches;
        let prof = rec.prof.take();
        let cb = rec.b.build()?;
        let t = HostTimes {
            record,
            build: t0.elapsed(),
            ..HostTimes::default()
        };
        self.submit_built(cb, dispatches, t, stats, false)?;
        if let Some(p) = prof {
            p.collect(&mut self.run_profile);
        }
        Ok(())
    }

    /// Submits a built command buffer of `dispatches` dispatches whose recording took
    /// `t` (record, build, recorded), or reports the device lost where
    /// [`Self::fail_after`] says so. `untracked`: without vulkano's resource tracking
    /// ([`crate::device::Context::submit_untracked`]; a replayed step).
    fn submit_built(
        &mut self,
        cb: Arc<PrimaryAutoCommandBuffer>,
        dispatches: u32,
        mut t: HostTimes,
        stats: &mut RunStats,
        untracked: bool,
    ) -> Result<()> {
        let at = self.submitted;
        self.submitted += 1;
        stats.dispatches += dispatches;
        if self.fail_at == Some(at) {
            self.fail_at = None;
            return Err(Error::DeviceLost);
        }
        let [submit, wait] = if untracked {
            // SAFETY: a stream submits from one thread and waits for each submission; the
            // host touches the buffers of a replayed step only between its submissions.
            let r = unsafe {
                self.model
                    .ctx
                    .submit_untracked(cb, &mut self.fence, self.step_wait)
            }?;
            self.step_wait = r[1];
            r
        } else {
            self.model.ctx.submit_built(cb)?
        };
        t.submit = submit;
        t.wait = wait;
        t.submissions = 1;
        stats.host.add(&t);
        self.times.add(&t);
        stats.submissions += 1;
        Ok(())
    }

    /// The decode pipeline of one-token steps binding `slots` head buffers, made once per
    /// subgroup setting of the context and slot count.
    fn step_kernel(&mut self, slots: usize) -> Result<crate::decode::Kernel> {
        let ctx = &self.model.ctx;
        let nosg = ctx
            .decode_no_subgroups
            .load(std::sync::atomic::Ordering::Relaxed);
        if let Some((f, n, k)) = &self.kernel
            && *f == nosg
            && *n == slots
        {
            return Ok(k.clone());
        }
        let hd = self.model.shape.head_dim;
        let tuning = crate::DecodeTuning::default();
        let k = crate::decode::kernel_slots(ctx, &tuning, hd, false, slots)?;
        self.kernel = Some((nosg, slots, k.clone()));
        Ok(k)
    }

    /// The model this stream runs.
    pub fn model(&self) -> &Arc<DeviceModel> {
        &self.model
    }

    /// Device bytes of the cache heads and activations.
    pub fn bytes(&self) -> u64 {
        let heads: u64 = self
            .heads
            .iter()
            .flatten()
            .flatten()
            .map(|h| h.buf.size())
            .sum();
        heads
    }

    fn scratch(&mut self, n: usize) -> Result<()> {
        if self.scratch.as_ref().is_some_and(|s| s.n >= n) {
            return Ok(());
        }
        let sh = &self.model.shape;
        let ctx = &self.model.ctx;
        let (d, h, i, hd) = (sh.hidden, sh.heads, sh.intermediate, sh.head_dim);
        let b = |w: usize| ctx.device_buffer(w);
        self.replay = None;
        let gl = GateLayout::new(n, d, h, storage_align(ctx));
        let g = b(gl.words)?;
        let [k, v, lf, nrm] = gl.views(&g, 0);
        self.scratch = Some(Scratch {
            n,
            h: b(n * d)?,
            x: b(n * d)?,
            p: b(n * sh.proj_width())?,
            q: b(n * d)?,
            g,
            gl,
            k,
            v,
            lf,
            nrm,
            o: b(n * d)?,
            op: b(n * d)?,
            gu: b(2 * n * i)?,
            a: b(n * i)?,
            lse: b(n * h)?,
            q1: b(h * hd)?,
            o1: b(h * hd)?,
        });
        Ok(())
    }

    /// Feeds `tokens` (ids `< vocab`, the stream's next positions) through every layer.
    /// After each layer's gates, `plan` gets them and returns the layer's decisions; the
    /// device then applies its row operations and runs the rest of the layer.
    ///
    /// Errors: a bad token id or plan ([`Error::Input`]), a non-finite softmax (as the CPU
    /// kernels report it), the plan callback's own error, device failures. After an error
    /// the stream's cache may hold part of the run: reset it.
    pub fn run(
        &mut self,
        tokens: &[u32],
        plan: &mut dyn FnMut(&Gates<'_>) -> Result<LayerPlan>,
        out: Output<'_>,
    ) -> Result<RunStats> {
        self.run_with(tokens, &mut |g, _| plan(g), None, out)
    }

    /// [`Self::run`] for a caller that finishes a layer's books while the device runs on:
    /// `plan` also gets the layer's readback ([`LayerGates`], a buffer of its own that
    /// nothing overwrites), and after the last layer `finish` returns, per layer and head,
    /// row operations that the device applies before the final norm (a fresh chunk's
    /// compaction: its plan stored every row, the caller's policy later said which stay
    /// where).
    pub fn run_deferred(
        &mut self,
        tokens: &[u32],
        plan: &mut dyn FnMut(&Gates<'_>, &LayerGates) -> Result<LayerPlan>,
        finish: &mut dyn FnMut() -> Result<OpsAfter>,
        out: Output<'_>,
    ) -> Result<RunStats> {
        self.run_with(tokens, plan, Some(finish), out)
    }

    fn run_with(
        &mut self,
        tokens: &[u32],
        plan: &mut dyn FnMut(&Gates<'_>, &LayerGates) -> Result<LayerPlan>,
        finish: Option<&mut dyn FnMut() -> Result<OpsAfter>>,
        out: Output<'_>,
    ) -> Result<RunStats> {
        let model = self.model.clone();
        let sh = model.shape;
        let ctx = model.ctx.clone();
        let n = tokens.len();
        let v = sh.vocab;
        if n == 0 {
            return Err(Error::Input(foxedge_core::Error::BadArgument("no tokens")));
        }
        if tokens.iter().any(|&t| t as usize >= v) {
            return Err(Error::Input(foxedge_core::Error::BadArgument(
                "a token id is out of the vocabulary",
            )));
        }
        match &out {
            Output::Last(l) if l.len() != v => {
                return Err(foxedge_core::Error::BadLength {
                    what: "logits (vocab)",
                    expected: v,
                    got: l.len(),
                }
                .into());
            }
            Output::All(l) if l.len() != n * v => {
                return Err(foxedge_core::Error::BadLength {
                    what: "logits (tokens * vocab)",
                    expected: n * v,
                    got: l.len(),
                }
                .into());
            }
            _ => {}
        }
        self.scratch(n)?;
        let align = storage_align(&ctx);
        let mut stats = RunStats {
            attention: Vec::with_capacity(sh.layers),
            ..RunStats::default()
        };
        // Readback of a layer's gates ([`GateLayout`]), then its shift state [2 D].
        let gl = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?
            .gl;
        let rb_words = gl.words + 2 * sh.hidden;
        let deferred = finish.is_some();
        let mut rb = ctx.host_buffer(rb_words, false)?;

        let mut rec = self.run_rec(&ctx)?;
        rec.b.fill_buffer(self.flag.clone(), 0)?;
        rec.mark("fill")?;
        let mut hdata = HostData::new(align);
        let ids_at = hdata.push(tokens);
        let (hbuf, up) = hdata.upload(&rec)?;
        stats.bytes_uploaded += up;
        {
            let s = self
                .scratch
                .as_ref()
                .ok_or_else(|| internal("no scratch"))?;
            rec.embed(&model.embeddings, &view(&hbuf, ids_at), n, &s.h)?;
        }
        for l in 0..sh.layers {
            let gv = {
                let s = self
                    .scratch
                    .as_ref()
                    .ok_or_else(|| internal("no scratch"))?;
                [s.k.clone(), s.v.clone(), s.lf.clone(), s.nrm.clone()]
            };
            if deferred && l > 0 {
                rb = ctx.host_buffer(rb_words, false)?;
            }
            self.record_pre(&mut rec, l, n, &gv)?;
            self.record_gates_out(&mut rec, l, &rb)?;
            self.submit(rec, &mut stats)?;
            stats.bytes_downloaded += rb_words as u64 * 4;

            let planning = std::time::Instant::now();
            let layer_plan = {
                let lg = LayerGates {
                    buf: rb.clone(),
                    gl,
                    layer: l,
                    n,
                };
                let w = rb.read().map_err(|e| Error::Vulkan(e.to_string()))?;
                plan(&gl.read(&w, l, n, 0, gl.words), &lg)?
            };
            let t = HostTimes {
                plan: planning.elapsed(),
                ..HostTimes::default()
            };
            stats.host.add(&t);
            self.times.add(&t);

            rec = self.run_rec(&ctx)?;
            let st = self.attend(&mut rec, l, n, &layer_plan, &mut stats)?;
            stats.attention.push(st);
            self.record_post(&mut rec, l, n)?;
        }
        if let Some(finish) = finish {
            let planning = std::time::Instant::now();
            let extra = finish()?;
            let t = HostTimes {
                plan: planning.elapsed(),
                ..HostTimes::default()
            };
            stats.host.add(&t);
            self.times.add(&t);
            if extra.len() > sh.layers || extra.iter().any(|x| x.len() > sh.heads) {
                return Err(foxedge_core::Error::BadLength {
                    what: "row operations after a run (per layer, per head)",
                    expected: sh.layers * sh.heads,
                    got: extra.iter().map(Vec::len).sum(),
                }
                .into());
            }
            for (l, heads) in extra.into_iter().enumerate() {
                if heads.iter().all(Vec::is_empty) {
                    continue;
                }
                if heads
                    .iter()
                    .flatten()
                    .any(|op| matches!(op, RowOp::Put { .. }))
                {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "rows applied after a run only move or re-stamp rows (no Put)",
                    )));
                }
                let steps: Vec<HeadStep> = heads
                    .into_iter()
                    .map(|ops| HeadStep {
                        ops,
                        ..HeadStep::default()
                    })
                    .collect();
                self.apply_ops(&mut rec, l, n, &steps, &mut stats)?;
            }
        }
        let rows = out_rows(&out, n);
        let logits = ctx.device_buffer((rows * v).max(1))?;
        let am = ctx.device_buffer(2)?;
        let host = ctx.host_buffer(logits_words(rows, v), false)?;
        stats.bytes_downloaded += self.record_head(&mut rec, n, &out, &logits, &am, &host)?;
        self.submit(rec, &mut stats)?;
        if self.profiling {
            self.run_profile.add_run(n);
        }
        let w = host.read().map_err(|e| Error::Vulkan(e.to_string()))?;
        read_head(&w, rows * v, out, &mut stats)?;
        Ok(stats)
    }

    /// Records the final norm and LM head on the rows `out` asks for, and copies to `host`
    /// (at least [`logits_words`] words) the logits or, with [`Output::Greedy`], the argmax
    /// (through `am`, 2 words), then the non-finite flag. Returns the bytes it reads back.
    fn record_head(
        &self,
        rec: &mut Rec<'_>,
        n: usize,
        out: &Output<'_>,
        logits: &Subbuffer<[u32]>,
        am: &Subbuffer<[u32]>,
        host: &Subbuffer<[u32]>,
    ) -> Result<u64> {
        let model = &self.model;
        let sh = model.shape;
        let (d, v) = (sh.hidden, sh.vocab);
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        let rows = out_rows(out, n);
        let mut bytes = 4;
        if rows == 1 {
            // The last row, normed as the LM head reads it.
            rec.tag = "lm_head";
            let xin = XIn::Norm(&model.norm, sh.norm_eps);
            rec.matvec(&model.lm_head, xin, &s.h, (n - 1) * d, logits, 0, false)?;
        } else if rows > 0 {
            rec.rmsnorm(d, rows, &s.h, &model.norm, sh.norm_eps, &s.x)?;
            rec.tag = "mm_lm_head";
            rec.linear(&model.lm_head, rows, &s.x, logits, 0, v, false)?;
        }
        if rows > 0 {
            if matches!(out, Output::Greedy) {
                rec.argmax(logits, v, am)?;
                copy(rec, am, host, vec![copy_region(0, 0, 2)])?;
                bytes += 8;
            } else {
                copy(rec, logits, host, vec![copy_region(0, 0, rows * v)])?;
                bytes += (rows * v) as u64 * 4;
            }
        }
        copy(
            rec,
            &self.flag,
            host,
            vec![copy_region(0, (rows * v).max(2), 1)],
        )?;
        Ok(bytes)
    }

    /// Specialization constants of `attn_pre.glsl`: (H, HD, kshift, vshift, QK-norm).
    fn attn_spec(&self) -> [u32; 5] {
        let sh = &self.model.shape;
        let qkn = match sh.qk_norm {
            QkNorm::Off => 0,
            QkNorm::PerHead => 1,
            QkNorm::Shared => 2,
        };
        [
            sh.heads as u32,
            sh.head_dim as u32,
            u32::from(sh.k_shift),
            u32::from(sh.v_shift),
            qkn,
        ]
    }

    /// Records layer `l`'s attention norm and projections of `n` tokens into `s.p`.
    fn record_proj(&self, rec: &mut Rec<'_>, l: usize, n: usize) -> Result<()> {
        let sh = self.model.shape;
        let lw = &self.model.layers[l];
        let (d, pw) = (sh.hidden, sh.proj_width());
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        if n == 1 {
            rec.tag = "mv_pre";
            let xin = XIn::Norm(&lw.attn_norm, sh.norm_eps);
            return rec.matvec_many(&lw.pre, xin, &s.h, &s.p);
        }
        rec.rmsnorm(d, n, &s.h, &lw.attn_norm, sh.norm_eps, &s.x)?;
        rec.tag = "mm_pre";
        for (m, col) in &lw.pre {
            rec.linear(m, n, &s.x, &s.p, *col, pw, false)?;
        }
        Ok(())
    }

    /// Records layer `l` up to its gates for `n` tokens: [`Self::record_proj`],
    /// `attn_pre.comp` (q head-major into scratch; k, v head-major, `log f` and norms into
    /// `gates` = `[k, v, log f, norms]`, [`GateLayout::views`]), and the layer's new
    /// token-shift state (the raw k/v projections of the last token).
    fn record_pre(
        &self,
        rec: &mut Rec<'_>,
        l: usize,
        n: usize,
        gates: &[Subbuffer<[u32]>; 4],
    ) -> Result<()> {
        let sh = self.model.shape;
        let lw = &self.model.layers[l];
        let (d, pw) = (sh.hidden, sh.proj_width());
        self.record_proj(rec, l, n)?;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        rec.attn_pre(
            self.attn_spec(),
            n,
            [
                &s.p,
                &self.shift[l],
                &lw.qk_norm,
                &lw.fgate_bias,
                &s.q,
                &gates[0],
                &gates[1],
                &gates[2],
                &gates[3],
            ],
            sh.qk_eps,
        )?;
        copy(
            rec,
            &s.p,
            &self.shift[l],
            vec![copy_region((n - 1) * pw + d, 0, 2 * d)],
        )
    }

    /// Copies layer `l`'s gates (after [`Self::record_pre`] into scratch) and its shift
    /// state to `rb`: the [`GateLayout`] at word 0, the shift state after it.
    fn record_gates_out(&self, rec: &mut Rec<'_>, l: usize, rb: &Subbuffer<[u32]>) -> Result<()> {
        let d = self.model.shape.hidden;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        copy(rec, &s.g, rb, vec![copy_region(0, 0, s.gl.words)])?;
        copy(
            rec,
            &self.shift[l],
            rb,
            vec![copy_region(0, s.gl.words, 2 * d)],
        )
    }

    /// Records the rest of layer `l` after its attention (in `s.o`, head-major): output norm
    /// and gate, output projection into the residual, the MLP into the residual (one token:
    /// the norm and gate fused into the projection's input reads where it stages its whole
    /// input, `XIn::Post`).
    fn record_post(&self, rec: &mut Rec<'_>, l: usize, n: usize) -> Result<()> {
        let sh = self.model.shape;
        let lw = &self.model.layers[l];
        let d = sh.hidden;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        if n == 1 && rec.stages_whole(&lw.o, sh.head_dim) {
            // The output norm and gate fused into o_proj's input reads.
            rec.tag = "mv_o";
            let xin = XIn::Post {
                norm: sh.output_norm.then_some((&lw.output_norm, sh.norm_eps)),
                gate: sh.output_gate,
                p: &s.p,
                head_dim: sh.head_dim,
            };
            rec.matvec(&lw.o, xin, &s.o, 0, &s.h, 0, true)?;
        } else {
            let spec = [
                sh.heads as u32,
                sh.head_dim as u32,
                u32::from(sh.output_norm),
                match sh.output_gate {
                    None => 0,
                    Some(Act::Sigmoid) => 1,
                    Some(Act::Silu) => 2,
                },
            ];
            rec.attn_post(spec, n, [&s.o, &s.p, &lw.output_norm, &s.op], sh.norm_eps)?;
            rec.tag = if n == 1 { "mv_o" } else { "mm_o" };
            rec.linear(&lw.o, n, &s.op, &s.h, 0, d, true)?;
        }
        if n == 1 {
            // The MLP norm and the gated activation fused into the products' input reads.
            rec.tag = "mv_gate_up";
            let xin = XIn::Norm(&lw.mlp_norm, sh.norm_eps);
            rec.matvec(&lw.gate_up, xin, &s.h, 0, &s.gu, 0, false)?;
            rec.tag = "mv_down";
            return rec.matvec(&lw.down, XIn::Glu(sh.mlp_act), &s.gu, 0, &s.h, 0, true);
        }
        rec.rmsnorm(d, n, &s.h, &lw.mlp_norm, sh.norm_eps, &s.x)?;
        rec.tag = "mm_gate_up";
        rec.linear(&lw.gate_up, n, &s.x, &s.gu, 0, 2 * sh.intermediate, false)?;
        let act = match sh.mlp_act {
            Act::Silu => 0,
            Act::Sigmoid => 1,
        };
        rec.swiglu(sh.intermediate, act, n, &s.gu, &s.a)?;
        rec.tag = "mm_down";
        rec.linear(&lw.down, n, &s.a, &s.h, 0, d, true)
    }

    /// Records layer `l`'s attention (and its cache row operations) into `s.o` (head-major).
    fn attend(
        &mut self,
        rec: &mut Rec<'_>,
        l: usize,
        n: usize,
        plan: &LayerPlan,
        stats: &mut RunStats,
    ) -> Result<AttentionStats> {
        let sh = self.model.shape;
        let nh = sh.heads;
        match plan {
            LayerPlan::Chunk { c, delta, ops } => {
                if c.len() != nh * n || delta.len() != nh || ops.len() != nh {
                    return Err(foxedge_core::Error::BadLength {
                        what: "chunk plan (c [H][n], one delta and op list per head)",
                        expected: nh * n,
                        got: c.len(),
                    }
                    .into());
                }
                let st = self.prefill(rec, n, c, delta, stats)?;
                let no_q: Vec<HeadStep> = ops
                    .iter()
                    .map(|o| HeadStep {
                        ops: o.clone(),
                        ..HeadStep::default()
                    })
                    .collect();
                self.apply_ops(rec, l, n, &no_q, stats)?;
                Ok(st)
            }
            LayerPlan::Continue(cp) => self.attend_continue(rec, l, n, cp, stats),
            LayerPlan::Tokens(steps) => {
                if steps.len() != n || steps.iter().any(|s| s.heads.len() != nh) {
                    return Err(foxedge_core::Error::BadLength {
                        what: "token plans (one per token, one head step per head)",
                        expected: n,
                        got: steps.len(),
                    }
                    .into());
                }
                let mut st = AttentionStats {
                    heads: vec![HeadStats::default(); nh],
                };
                for (r, step) in steps.iter().enumerate() {
                    self.apply_ops(rec, l, n, &step.heads, stats)?;
                    self.decode(rec, l, n, r, step, stats)?;
                    for (a, hs) in st.heads.iter_mut().zip(&step.heads) {
                        add_stats(a, &hs.stats);
                    }
                }
                Ok(st)
            }
        }
    }

    /// Fresh-chunk attention with `prefill.glsl` over q, k, v head-major in scratch.
    fn prefill(
        &mut self,
        rec: &mut Rec<'_>,
        n: usize,
        c: &[f64],
        delta: &[Option<f64>],
        stats: &mut RunStats,
    ) -> Result<AttentionStats> {
        let sh = self.model.shape;
        let (nh, hd) = (sh.heads, sh.head_dim);
        let ctx = self.model.ctx.clone();
        let grid = BlockGrid::new(BLOCK, BLOCK, n, n)?;
        let nqb = grid.q_blocks();
        let mut first = vec![0u32; nh * nqb];
        let mut cw = vec![0u32; 2 * nh * n];
        let mut heads = Vec::with_capacity(nh);
        let mut starts = vec![0u32; nqb];
        for h in 0..nh {
            let ch = &c[h * n..(h + 1) * n];
            if ch.iter().any(|x| !x.is_finite()) {
                return Err(Error::Input(foxedge_core::Error::BadArgument(
                    "chunk c must be finite",
                )));
            }
            boundary::start_blocks(&grid, ch, delta[h], 0, &mut starts)?;
            heads.push(acp::head_stats(&grid, &starts, 0, delta[h]));
            for (f, &s) in first[h * nqb..(h + 1) * nqb].iter_mut().zip(&starts) {
                *f = (s as usize * BLOCK) as u32;
            }
            split_f64(ch, &mut cw[2 * h * n..2 * (h + 1) * n]);
        }
        let mut hdata = HostData::new(storage_align(&ctx));
        let c_at = hdata.push(&cw);
        let f_at = hdata.push(&first);
        let (hbuf, up) = hdata.upload(rec)?;
        stats.bytes_uploaded += up;
        let tile = crate::prefill::PrefillTile::choose(&ctx, hd)?;
        let pipe = ctx.pipeline("prefill_f32", PREFILL_F32, &tile.constants(hd))?;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            seq_q: u32,
            seq_k: u32,
            q_off: u32,
            group: u32,
            n_qb: u32,
            scale_log2: f32,
            acp_bq: u32,
            acp_nqb: u32,
        }
        let n_tiles = n.div_ceil(tile.bm as usize);
        rec.tag = "prefill";
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        rec.run(
            &pipe,
            vec![
                WriteDescriptorSet::buffer(0, s.q.clone()),
                WriteDescriptorSet::buffer(1, s.k.clone()),
                WriteDescriptorSet::buffer(2, s.v.clone()),
                WriteDescriptorSet::buffer(3, view(&hbuf, c_at)),
                WriteDescriptorSet::buffer(4, view(&hbuf, f_at)),
                WriteDescriptorSet::buffer(5, s.o.clone()),
                WriteDescriptorSet::buffer(6, s.lse.clone()),
                WriteDescriptorSet::buffer(7, self.flag.clone()),
            ],
            P {
                seq_q: n as u32,
                seq_k: n as u32,
                q_off: 0,
                group: 1,
                n_qb: n_tiles as u32,
                scale_log2: (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E,
                acp_bq: BLOCK as u32,
                acp_nqb: nqb as u32,
            },
            [n_tiles as u32, nh as u32, 1],
        )?;
        Ok(AttentionStats { heads })
    }

    /// Token `r`'s query of every head against its cache rows `0..live` (`decode.glsl`).
    fn decode(
        &mut self,
        rec: &mut Rec<'_>,
        l: usize,
        n: usize,
        r: usize,
        step: &TokenPlan,
        stats: &mut RunStats,
    ) -> Result<()> {
        let sh = self.model.shape;
        let (nh, hd) = (sh.heads, sh.head_dim);
        let ctx = self.model.ctx.clone();
        let kernel = crate::decode::kernel(&ctx, &crate::DecodeTuning::default(), hd, false)?;
        let entries: usize = step.heads.iter().map(|h| h.live).sum();
        let n_max = step.heads.iter().map(|h| h.live).max().unwrap_or(0);
        let chunk = auto_split(entries)
            .max(n_max.div_ceil(MAXC))
            .div_ceil(BLOCK)
            * BLOCK;
        // Heads with no rows still need a buffer bound (their queries write zeros).
        for h in 0..nh {
            if self.heads[l][h].is_none() {
                self.ensure_head(rec, l, h, 1)?;
            }
        }
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        let (q, o) = if n == 1 {
            (s.q.clone(), s.o.clone())
        } else {
            let regions = (0..nh)
                .map(|h| copy_region((h * n + r) * hd, h * hd, hd))
                .collect();
            copy(rec, &s.q, &s.q1, regions)?;
            (s.q1.clone(), s.o1.clone())
        };
        let mut hdata = HostData::new(storage_align(&ctx));
        struct G {
            h0: usize,
            h1: usize,
            qinfo: (usize, usize),
            qc: (usize, usize),
            kept: (usize, usize),
            parts: usize,
            chunks: usize,
        }
        let mut groups = Vec::new();
        for h0 in (0..nh).step_by(HPD) {
            let h1 = (h0 + HPD).min(nh);
            let mut qinfo = Vec::new();
            let mut qc = vec![0u32; 2 * (h1 - h0)];
            let mut kept = Vec::new();
            let mut parts = 0usize;
            let mut chunks = 1usize;
            for h in h0..h1 {
                let hs = &step.heads[h];
                let cap = self.heads[l][h].as_ref().map_or(1, |b| b.cap);
                if hs.live > cap {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "a head attends more rows than its operations stored",
                    )));
                }
                if !hs.kept.is_empty() && hs.kept.len() != hs.live.div_ceil(BLOCK) {
                    return Err(foxedge_core::Error::BadLength {
                        what: "ACP block flags (one per 64 rows)",
                        expected: hs.live.div_ceil(BLOCK),
                        got: hs.kept.len(),
                    }
                    .into());
                }
                let kept0 = if hs.kept.is_empty() {
                    u32::MAX
                } else {
                    let k0 = kept.len() as u32;
                    kept.extend(&hs.kept);
                    k0
                };
                let nch = hs.live.div_ceil(chunk);
                chunks = chunks.max(nch);
                qinfo.extend([
                    hs.live as u32,
                    cap as u32,
                    parts as u32,
                    kept0,
                    (h - h0) as u32,
                    0,
                    0,
                    0,
                ]);
                parts += nch;
                if !hs.c_t.is_finite() {
                    return Err(Error::Input(foxedge_core::Error::BadArgument(
                        "query c_t must be finite",
                    )));
                }
                split_f64(&[hs.c_t], &mut qc[2 * (h - h0)..2 * (h - h0) + 2]);
            }
            groups.push(G {
                h0,
                h1,
                qinfo: hdata.push(&qinfo),
                qc: hdata.push(&qc),
                kept: hdata.push(&kept),
                parts,
                chunks,
            });
        }
        let (hbuf, up) = hdata.upload(rec)?;
        stats.bytes_uploaded += up;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            chunk: u32,
            block: u32,
            scale_log2: f32,
            pad: u32,
        }
        let push = P {
            chunk: chunk as u32,
            block: BLOCK as u32,
            scale_log2: (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E,
            pad: 0,
        };
        for g in &groups {
            let q_views = (g.h1 - g.h0) * hd;
            let ml = ctx.device_buffer(2 * g.parts.max(1))?;
            let po = ctx.device_buffer(hd * g.parts.max(1))?;
            let counters = ctx.device_buffer(g.h1 - g.h0)?;
            rec.b.fill_buffer(counters.clone(), 0)?;
            rec.mark("fill")?;
            rec.tag = "decode";
            let slots: Vec<Subbuffer<[u32]>> = (0..HPD)
                .map(|i| {
                    let h = (g.h0 + i).min(g.h1 - 1);
                    self.heads[l][h].as_ref().map(|b| b.buf.clone())
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| internal("cache head missing"))?;
            rec.run(
                &kernel.pipe,
                vec![
                    WriteDescriptorSet::buffer(0, view(&q, (g.h0 * hd, q_views))),
                    WriteDescriptorSet::buffer_array(1, 0, slots),
                    WriteDescriptorSet::buffer(2, view(&hbuf, g.qinfo)),
                    WriteDescriptorSet::buffer(3, view(&hbuf, g.qc)),
                    WriteDescriptorSet::buffer(4, view(&hbuf, g.kept)),
                    WriteDescriptorSet::buffer(5, ml),
                    WriteDescriptorSet::buffer(6, po),
                    WriteDescriptorSet::buffer(7, view(&o, (g.h0 * hd, q_views))),
                    WriteDescriptorSet::buffer(8, view(&s.lse, (0, g.h1 - g.h0))),
                    WriteDescriptorSet::buffer(9, counters),
                    WriteDescriptorSet::buffer(10, self.flag.clone()),
                ],
                push,
                [g.chunks as u32, (g.h1 - g.h0) as u32, 1],
            )?;
        }
        if n > 1 {
            let regions = (0..nh)
                .map(|h| copy_region(h * hd, (h * n + r) * hd, hd))
                .collect();
            copy(rec, &s.o1, &s.o, regions)?;
        }
        Ok(())
    }
}

/// u32 words as f32 values (same size and alignment; every bit pattern is an f32).
fn bytemuck_f32(w: &[u32]) -> &[f32] {
    // SAFETY: u32 and f32 have the same size and alignment and every u32 bit pattern is a
    // valid f32, so the slice reinterprets in place with the same length and lifetime.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<f32>(), w.len()) }
}

/// Rows of logits `out` asks for from a run of `n` tokens.
fn out_rows(out: &Output<'_>, n: usize) -> usize {
    match out {
        Output::Nothing => 0,
        Output::All(_) => n,
        Output::Last(_) | Output::Greedy => 1,
    }
}

/// Words of [`DeviceStream::record_head`]'s host buffer for `rows` rows of `vocab` logits.
fn logits_words(rows: usize, vocab: usize) -> usize {
    (rows * vocab).max(2) + 2
}

/// Reads what [`DeviceStream::record_head`] copied (`logit_words` = rows * vocab) into `out`.
fn read_head(w: &[u32], logit_words: usize, out: Output<'_>, stats: &mut RunStats) -> Result<()> {
    if w[logit_words.max(2)] != 0 {
        return Err(non_finite());
    }
    match out {
        Output::Nothing => {}
        Output::Greedy => stats.token = Some(w[0]),
        Output::Last(o) | Output::All(o) => {
            for (x, &b) in o.iter_mut().zip(w.iter()) {
                *x = f32::from_bits(b);
            }
        }
    }
    Ok(())
}
