//! The whole model on a Vulkan device for a [`Session`]: `--backend vulkan` runs every layer
//! there (foxedge-vulkan's `model`); `auto` does so on a GPU and keeps the layers on the CPU
//! with a CPU implementation of Vulkan (see [`open`]).
//!
//! The session keeps its bookkeeping exactly as on the CPU: the gate streams (c in f64), the
//! retention policy and its evictions, the ACP decisions, and a host shadow of every cache
//! row. The device sends back, per layer, the layer's `log f`, its new K/V rows and its
//! shift state (a few KiB per token); the session applies them to its own state and answers
//! with the row operations the policy made (swap-delete moves, the new rows' slots), which
//! the device applies to its resident cache. So the host shadow is always the stream's
//! whole state: when the device fails (lost, out of memory) the session drops it and
//! continues on the CPU. A run that fails part-way has advanced the bookkeeping of the
//! layers whose gates came back; the CPU then recomputes those layers without bookkeeping
//! (their cache already holds the run's rows; a continuation chunk's layers also kept the
//! rows their policy evicted during the chunk, [`super::device_replay`]) and runs the
//! others as usual, so the stream continues as if the device had finished.
//!
//! A chunk of a stream that already has a cache (a prompt past the first chunk, a later
//! feed) is one run as well: per layer the session plans a continuation (the chunk's `c`,
//! the ACP tile flags and pair counts of the CPU continuation kernel, where each key stops
//! being seen when the policy evicts it inside the chunk, and the chunk's row operations),
//! and the device attends the resident cache and the chunk's own keys in one tiled pass.
//!
//! A decode token (after the first chunk) is one submission instead: before it the session
//! lists, per head, the evictions its policy may make at the token with the largest `c_t`
//! that makes each (`RetentionPolicy::next_evictions`), their swap-delete moves and the ACP
//! threshold for each count; the device computes `c_t`, evicts what it makes, stores and
//! attends (evictions before the token's attention, as on the CPU). Afterwards the session
//! runs its policy on the gates read back and checks it made the device's operations; a
//! head where it made others (evictions past the listed candidates) is loaded from the
//! host's rows. Layers keep their books independently, so a token's plan and books run
//! in parallel over layers on the session's pool; a fresh chunk's host rows are kept per
//! head in parallel after its policy has run over the chunk's tokens.
//!
//! A model whose weights exceed the device budget, or a device without what the kernels
//! need, leaves the session on the CPU from the start.

use super::device_replay::{Evicted, Replay, attend as replay_attend, row_f32};
use super::forward::{Layout, Member, Scratch, decode_step, layer_forward};
use super::*;
use crate::backend::PrefillCall;
use crate::config::{HiddenAct, OgateAct};
use crate::model::{LayerWeights, QK_EPS};
use crate::ops;
use foxedge_core::contract::Acp;
use foxedge_core::retention::Eviction;
use foxedge_vulkan::model::{
    self as vm, Act, ContinuePlan, DeviceModel, DeviceStream, Gates, HeadStep, LayerPlan,
    ModelOptions, ModelShape, ModelWeights, Output, QkNorm, RowOp, StepAcp, StepEvict, StepHead,
    TokenPlan,
};
use half::f16;
use std::sync::{Mutex, OnceLock, Weak};

/// ACP block of the device's decode decisions (foxedge-cpu's default `block_k`).
const BLOCK: usize = 64;

/// A session's device state.
pub(super) struct Device {
    stream: DeviceStream,
    vk: foxedge_vulkan::Vulkan,
    /// Bytes the host wrote for the device and runs made, since the session was created.
    pub(super) bytes_uploaded: u64,
    pub(super) runs: u64,
    /// `ln n` of a step's key counts.
    ln: LnTable,
    /// `[layer][head]`: heads a step plan re-based that then went the per-layer way
    /// (`step_plan` gave `None`): the device's rows still hold the old `c`, so the next
    /// run's plan sends their metas.
    unsent_metas: Vec<Vec<bool>>,
}

/// `ln n` for key counts `n` ([`foxedge_core::threshold::ln_keys`], the same bits),
/// tabulated as the cache grows: a one-token step lists an ACP threshold per possible
/// number of evictions of every head, each with the logarithm of its key count.
#[derive(Debug, Default)]
struct LnTable(Vec<f64>);

impl LnTable {
    /// Tabulates `ln n` up to `n` at least (doubling).
    fn grow(&mut self, n: usize) {
        if n >= self.0.len() {
            let from = self.0.len();
            let to = n.max(2 * from);
            self.0
                .extend((from..=to).map(foxedge_core::threshold::ln_keys));
        }
    }

    /// `ln n`: from the table where grown that far, else computed (the same bits).
    fn at(&self, n: usize) -> f64 {
        match self.0.get(n) {
            Some(&x) => x,
            None => foxedge_core::threshold::ln_keys(n),
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("device", &self.vk.info().name)
            .field("bytes_uploaded", &self.bytes_uploaded)
            .finish()
    }
}

impl Device {
    /// The most tokens, at most `want`, that one device run takes (its activations fit).
    pub(super) fn chunk_room(&self, want: usize) -> usize {
        self.stream.chunk_room(want)
    }

    /// Forgets the stream's tokens on the device.
    pub(super) fn reset(&mut self) -> Result<()> {
        self.bytes_uploaded = 0;
        self.runs = 0;
        self.unsent_metas.clear();
        self.stream.reset().map_err(device_error)
    }
}

/// The process's Vulkan device for whole models (opened once).
fn vulkan() -> std::result::Result<foxedge_vulkan::Vulkan, String> {
    static VK: OnceLock<std::result::Result<foxedge_vulkan::Vulkan, String>> = OnceLock::new();
    VK.get_or_init(|| foxedge_vulkan::Vulkan::new().map_err(|e| e.to_string()))
        .clone()
}

/// Whether `auto` runs the whole model on a device of this type (vulkano's
/// `PhysicalDeviceType` name): a discrete or integrated GPU.
fn auto_runs_on(device_type: &str) -> bool {
    matches!(device_type, "DiscreteGpu" | "IntegratedGpu")
}

/// Device copies of models, one per model alive (uploaded at the first session).
type Uploaded = Vec<(Weak<Model>, Arc<DeviceModel>)>;

fn device_model(model: &Arc<Model>, vk: &foxedge_vulkan::Vulkan) -> Result<Arc<DeviceModel>> {
    static MODELS: OnceLock<Mutex<Uploaded>> = OnceLock::new();
    let mut g = MODELS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    g.retain(|(w, _)| w.strong_count() > 0);
    if let Some((_, m)) = g
        .iter()
        .find(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(model)))
    {
        return Ok(m.clone());
    }
    let weights = weights_of(model).ok_or_else(|| {
        Error::Unsupported("a weight matrix is not held in a layout the device reads".into())
    })?;
    let dm = vk
        .load_model(shape_of(model), &weights, budget_from_env()?)
        .map_err(device_error)?;
    let dm = Arc::new(dm);
    g.push((Arc::downgrade(model), dm.clone()));
    Ok(dm)
}

/// `FOXEDGE_DEVICE_MODEL_BUDGET`: most device bytes for a model's weights (default: 90% of
/// the device's largest heap).
fn budget_from_env() -> Result<ModelOptions> {
    match std::env::var("FOXEDGE_DEVICE_MODEL_BUDGET") {
        Err(_) => Ok(ModelOptions::default()),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(|b| ModelOptions {
                budget_bytes: Some(b),
            })
            .map_err(|_| {
                Error::invalid(format!(
                    "FOXEDGE_DEVICE_MODEL_BUDGET: `{v}` is not a number of bytes"
                ))
            }),
    }
}

/// A device failure as a facade error: [`Error::OutOfMemory`] or
/// [`Error::BackendUnavailable`] (both make the session fall back to the CPU).
fn device_error(e: foxedge_vulkan::Error) -> Error {
    use foxedge_vulkan::Error as V;
    match e {
        V::Input(e) => Error::Internal(format!("device model refused its input: {e}")),
        V::OutOfDeviceMemory => Error::OutOfMemory {
            what: "Vulkan device memory (whole model)".into(),
            bytes: 0,
        },
        V::DoesNotFit { needed, budget } => Error::OutOfMemory {
            what: format!("device model weights (budget {budget} bytes)"),
            bytes: usize::try_from(needed).unwrap_or(usize::MAX),
        },
        other => Error::BackendUnavailable(format!("vulkan (whole model): {other}")),
    }
}

/// The device state for a session of `kind` on `model`, or `None` (said once per process)
/// where the model stays on the CPU: `cpu` and `hybrid` kinds, no device, a model over the
/// budget, a device without the kernels' features, and `auto` on a device that is not a GPU.
///
/// `auto` takes a discrete or integrated GPU ([`auto_runs_on`]): on the H200 the whole model
/// there prefills 2.9-7.2x and decodes 1.04-4.2x as fast as the 16-thread CPU backend (125M
/// and 760M shapes, f32 / Q8 / Q4 weights, BENCHMARKS.md). A CPU implementation (lavapipe) shares the cores the CPU
/// kernels use and loses to them, and a virtual GPU is unmeasured.
pub(super) fn open(model: &Arc<Model>, kind: BackendKind) -> Option<Device> {
    if !matches!(kind, BackendKind::Vulkan | BackendKind::Auto) {
        return None;
    }
    let said = |m: String| {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::AcqRel) {
            eprintln!("foxedge: {m}; the model's layers run on the CPU");
        }
    };
    let vk = match vulkan() {
        Ok(v) => v,
        Err(e) => {
            if kind == BackendKind::Vulkan {
                said(format!("no Vulkan device for the whole model ({e})"));
            }
            return None;
        }
    };
    if kind == BackendKind::Auto && !auto_runs_on(&vk.info().device_type) {
        return None;
    }
    let dm = match device_model(model, &vk) {
        Ok(m) => m,
        Err(e) => {
            said(format!(
                "the whole model does not run on {}: {e}",
                vk.info().name
            ));
            return None;
        }
    };
    match DeviceStream::new(dm) {
        Ok(stream) => Some(Device {
            stream,
            vk,
            bytes_uploaded: 0,
            runs: 0,
            ln: LnTable::default(),
            unsent_metas: Vec::new(),
        }),
        Err(e) => {
            said(format!("no device stream: {e}"));
            None
        }
    }
}

fn act(a: crate::config::OgateAct) -> Act {
    match a {
        OgateAct::Sigmoid => Act::Sigmoid,
        OgateAct::Silu => Act::Silu,
    }
}

fn shape_of(model: &Model) -> ModelShape {
    let c = &model.config;
    let info = model.info();
    ModelShape {
        vocab: info.vocab,
        hidden: info.hidden,
        layers: info.layers,
        heads: info.heads,
        head_dim: info.head_dim,
        intermediate: info.intermediate,
        norm_eps: c.norm_eps,
        qk_eps: QK_EPS,
        qk_norm: match (c.qk_norm, c.qk_norm_share_param_across_head) {
            (false, _) => QkNorm::Off,
            (true, false) => QkNorm::PerHead,
            (true, true) => QkNorm::Shared,
        },
        k_shift: c.use_k_shift,
        v_shift: c.use_v_shift,
        output_gate: c.use_output_gate.then(|| act(c.ogate_act)),
        output_norm: c.use_output_norm,
        mlp_act: match c.hidden_act {
            HiddenAct::Swish => Act::Silu,
            HiddenAct::Sigmoid => Act::Sigmoid,
        },
    }
}

/// The model's tensors as the device takes them: its matrices as held (f32 / f16 / bf16
/// elements, Q8 / Q4 packed tiles); None when one is in no layout the device reads.
fn weights_of(model: &Model) -> Option<ModelWeights<'_>> {
    let w = crate::matrix::WeightMatrix::device_weights;
    let mut layers = Vec::with_capacity(model.layers.len());
    for l in &model.layers {
        layers.push(vm::LayerWeights {
            attn_norm: &l.attn_norm,
            q: w(&l.q_proj)?,
            k: w(l.k_proj.linear())?,
            v: w(l.v_proj.linear())?,
            k_shift: match l.k_proj.shift() {
                Some(m) => Some(w(m)?),
                None => None,
            },
            v_shift: match l.v_proj.shift() {
                Some(m) => Some(w(m)?),
                None => None,
            },
            fgate: w(&l.fgate_w)?,
            fgate_bias: &l.fgate_b,
            ogate: match &l.ogate {
                Some(m) => Some(w(m)?),
                None => None,
            },
            output_norm: l.output_norm.as_deref(),
            q_norm: l.qk_norm.as_ref().map(|(q, _)| &q[..]),
            k_norm: l.qk_norm.as_ref().map(|(_, k)| &k[..]),
            o: w(&l.o_proj)?,
            mlp_norm: &l.mlp_norm,
            gate_up: w(&l.gate_up)?,
            down: w(&l.down)?,
        });
    }
    Some(ModelWeights {
        embeddings: w(&model.embeddings)?,
        layers,
        norm: &model.norm,
        lm_head: w(model.lm_head())?,
    })
}

/// Re-bases every head of `state` whose gate stream's `|c|` passed [`REBASE_AT`] (gates,
/// policy and cache rows by the same shift, as `Session::attention` does before a chunk's
/// gates); returns which heads moved.
fn rebase_heads(state: &mut LayerState) -> Result<Vec<bool>> {
    let mut rebased = vec![false; state.gates.len()];
    for (h, r) in rebased.iter_mut().enumerate() {
        let cur = state.gates[h].current();
        if cur.abs() > REBASE_AT {
            state.gates[h].rebase(cur);
            state.policy.rebase(h, cur)?;
            state.heads[h].rebase(cur);
            *r = true;
        }
    }
    Ok(rebased)
}

/// Operations that give every row of `hc` its (re-based) `c` and position.
fn meta_ops(hc: &HeadCache) -> Vec<RowOp> {
    (0..hc.len())
        .map(|s| RowOp::Meta {
            slot: s as u32,
            c: hc.c[s],
            pos: hc.pos[s],
        })
        .collect()
}

/// Largest difference, relative to `1 + |c_t|`, between the device's and the host's `c_t`
/// of a one-token step: the device sums a double-float pair (48 significant bits) with an
/// exact two-sum, so it is the host's f64 sum to about `2^-47`; `2^-40` leaves room.
const C_T_TOLERANCE: f64 = 1.0 / (1u64 << 40) as f64;

/// Evictions listed per head in a one-token step beyond those the budget forces.
const STEP_EVICTIONS: usize = 16;

/// Whether the retention policy's operations `ops` for a one-token step are the `k`
/// evictions the device made from the plan `sp`, then the token's row.
fn same_ops(ops: &[RowOp], sp: &StepHead, k: usize) -> bool {
    let moves = sp.evict[..k.min(sp.evict.len())]
        .iter()
        .filter_map(|e| e.moved.map(|(from, to)| RowOp::Move { from, to }));
    let n_moves = moves.clone().count();
    k <= sp.evict.len()
        && ops.len() == n_moves + 1
        && ops[..n_moves].iter().copied().eq(moves)
        && matches!(ops[n_moves], RowOp::Put { token: 0, slot, .. } if slot as usize == sp.live - k)
}

/// One layer's bookkeeping of a device run, as `Session::attention` keeps it.
struct Keeper<'s> {
    sess: &'s mut Session,
    pos0: u64,
    fresh: bool,
    scores: Option<&'s [f32]>,
    /// The device decided ACP itself (a one-token step): the plan's decisions are left
    /// empty.
    acp_on_device: bool,
    /// Per layer planned as a continuation: what its bookkeeping removed, for the CPU to
    /// finish the chunk exactly if the device fails.
    replays: Vec<Option<Replay>>,
    /// `[layer][head]` re-based before this run without the device's rows ([`Device`]'s
    /// `unsent_metas`): planned as if re-based now.
    unsent_metas: Vec<Vec<bool>>,
}

impl Keeper<'_> {
    /// Layer `g.layer`'s gates in, its plan out (and the session's state advanced).
    fn plan(&mut self, g: &Gates<'_>) -> Result<LayerPlan> {
        let l = g.layer;
        let s = &mut *self.sess;
        let info = s.model.info();
        let cx = LayerCx {
            heads: info.heads,
            head_dim: info.head_dim,
            hidden: info.hidden,
            ln_eps: s.opts.ln_eps,
            certified: s.certified[l],
            u: &s.u[l],
            pos0: self.pos0,
            fresh: self.fresh,
            scores: self.scores,
            acp_on_device: self.acp_on_device,
            unsent: self.unsent_metas.get(l).map(Vec::as_slice),
        };
        let (plan, replay) = plan_layer(&cx, &mut s.layers[l], g)?;
        if let Some(r) = replay {
            if self.replays.len() <= l {
                self.replays.resize_with(l + 1, || None);
            }
            self.replays[l] = Some(r);
        }
        Ok(plan)
    }
}

/// What a layer's bookkeeping reads besides the layer's own state.
struct LayerCx<'a> {
    heads: usize,
    head_dim: usize,
    hidden: usize,
    ln_eps: Option<f64>,
    certified: bool,
    /// The layer's logit bound per head.
    u: &'a [f64],
    pos0: u64,
    fresh: bool,
    scores: Option<&'a [f32]>,
    acp_on_device: bool,
    /// Heads re-based before this run without the device's rows.
    unsent: Option<&'a [bool]>,
}

/// One layer's bookkeeping of a device run ([`Keeper::plan`]): the layer's gates in, its
/// plan out, the layer's state advanced; a continuation's [`Replay`] too. Touches no other
/// layer, so a one-token step keeps the books of its layers in parallel.
fn plan_layer(
    cx: &LayerCx<'_>,
    state: &mut LayerState,
    g: &Gates<'_>,
) -> Result<(LayerPlan, Option<Replay>)> {
    let (nh, hd, d) = (cx.heads, cx.head_dim, cx.hidden);
    let n = g.tokens;
    let scale = 1.0 / (hd as f64).sqrt();
    let ln_eps = cx.ln_eps;
    let certified = cx.certified;
    let u = cx.u;
    let mut rebased = rebase_heads(state)?;
    if let Some(u) = cx.unsent {
        for (r, &x) in rebased.iter_mut().zip(u) {
            *r |= x;
        }
    }
    let mut c_rows = vec![0.0f64; n * nh];
    for r in 0..n {
        for h in 0..nh {
            c_rows[r * nh + h] = state.gates[h].push(g.log_f[r * nh + h])?;
        }
    }
    let kn = |h: usize, r: usize| f64::from(g.norms[2 * (r * nh + h) + 1]);
    let qn = |h: usize, r: usize| f64::from(g.norms[2 * (r * nh + h)]);
    if !certified {
        for h in 0..nh {
            for r in 0..n {
                state.k_norm_max[h] = state.k_norm_max[h].max(kn(h, r));
            }
        }
    }
    state.k_shift.copy_from_slice(&g.shift[..d]);
    state.v_shift.copy_from_slice(&g.shift[d..2 * d]);
    let (gk, gv) = (g.k, g.v);
    let row = |h: usize, r: usize| {
        let at = (h * n + r) * hd;
        (&gk[at..at + hd], &gv[at..at + hd])
    };
    let mut score_row = vec![0.0f32; nh];
    let pos0 = cx.pos0;
    let scores = cx.scores;
    // The CPU's `append`: evictions (their moves into `moves[h]`), then the new row.
    let mut log: Vec<(usize, Eviction)> = Vec::new();
    let continuation = !cx.fresh && n > 1 && !cx.acp_on_device;
    let mut evicted: Vec<Vec<Evicted>> = (0..nh).map(|_| Vec::new()).collect();
    let mut append = |state: &mut LayerState,
                      r: usize,
                      moves: &mut Vec<Vec<RowOp>>|
     -> Result<()> {
        let sc = scores.map(|sc| {
            score_row.fill(sc[r]);
            &score_row[..]
        });
        let heads = &mut state.heads;
        let mut failed = None;
        state
            .policy
            .append(pos0 + r as u64, &c_rows[r * nh..(r + 1) * nh], sc, |ev| {
                log.push((r, ev));
                if continuation && ev.position < pos0 && failed.is_none() {
                    let hc = &heads[ev.head];
                    let slot = ev.slot as usize;
                    match (row_f32(hc, slot, hd), hc.c.get(slot)) {
                        (Ok((k, v)), Some(&c)) => evicted[ev.head].push(Evicted {
                            k,
                            v,
                            c,
                            end: r as u32,
                        }),
                        (Err(e), _) => failed = Some(e),
                        (_, None) => failed = Some(Error::Internal("evicted an empty slot".into())),
                    }
                }
                if let Some((from, to)) = ev.moved() {
                    moves[ev.head].push(RowOp::Move { from, to });
                }
                if failed.is_none()
                    && let Err(e) = heads[ev.head].apply(&ev, hd)
                {
                    failed = Some(e);
                }
            })?;
        if let Some(e) = failed {
            return Err(e);
        }
        for (h, hc) in heads.iter_mut().enumerate() {
            let c = c_rows[r * nh + h];
            let pos = pos0 + r as u64;
            let (k, v) = row(h, r);
            hc.push(k, v, c, pos)?;
            moves[h].push(RowOp::Put {
                token: r as u32,
                slot: (hc.len() - 1) as u32,
                c,
                pos,
            });
        }
        state.peak_live = state.peak_live.max(state.policy.live_total());
        Ok(())
    };
    if cx.fresh && n > 1 {
        let mut delta = Vec::with_capacity(nh);
        for (h, &uh) in u.iter().enumerate().take(nh) {
            delta.push(match (ln_eps, certified) {
                (None, _) => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(uh, n, e)?),
                (Some(e), false) => {
                    let qm = (0..n).map(|r| qn(h, r)).fold(0.0, f64::max);
                    let km = (0..n).map(|r| kn(h, r)).fold(0.0, f64::max);
                    let uu = foxedge_core::threshold::bound_from_norms(qm, km, scale)?;
                    Some(foxedge_core::threshold::threshold(uu, n, e)?)
                }
            });
        }
        keep_fresh_chunk(state, g, &c_rows, pos0, scores, hd)?;
        // The surviving rows, each from its token of the chunk.
        let ops = state
            .heads
            .iter()
            .map(|hc| {
                (0..hc.len())
                    .map(|s| RowOp::Put {
                        token: (hc.pos[s] - pos0) as u32,
                        slot: s as u32,
                        c: hc.c[s],
                        pos: hc.pos[s],
                    })
                    .collect()
            })
            .collect();
        let mut c = vec![0.0f64; nh * n];
        for h in 0..nh {
            for r in 0..n {
                c[h * n + r] = c_rows[r * nh + h];
            }
        }
        return Ok((LayerPlan::Chunk { c, delta, ops }, None));
    }
    if continuation {
        // A continuation: the chunk attends the cache as it is now, then its rows (and
        // the evictions made while appending them) join the cache.
        let live: Vec<usize> = state.heads.iter().map(HeadCache::len).collect();
        let cache_c: Vec<Vec<f64>> = state.heads.iter().map(|hc| hc.c.clone()).collect();
        let pre: Vec<Vec<RowOp>> = (0..nh)
            .map(|h| {
                if rebased[h] {
                    meta_ops(&state.heads[h])
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut delta = Vec::with_capacity(nh);
        for h in 0..nh {
            let big_n = live[h] + n;
            delta.push(match (ln_eps, certified) {
                (None, _) => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(u[h], big_n, e)?),
                (Some(e), false) => {
                    let qm = (0..n).map(|r| qn(h, r)).fold(0.0, f64::max);
                    let uu =
                        foxedge_core::threshold::bound_from_norms(qm, state.k_norm_max[h], scale)?;
                    Some(foxedge_core::threshold::threshold(uu, big_n, e)?)
                }
            });
        }
        let mut ops = vec![Vec::new(); nh];
        for r in 0..n {
            append(state, r, &mut ops)?;
        }
        let (ends, key_end) = if log.is_empty() {
            (vec![Vec::new(); nh], vec![n as u32; n * nh])
        } else {
            let (cache_end, key_end) = super::forward::chunk_ends(&live, &log, n)?;
            let ends = cache_end
                .into_iter()
                .enumerate()
                .map(|(h, mut e)| {
                    e.extend((0..n).map(|r| key_end[r * nh + h]));
                    e
                })
                .collect();
            (ends, key_end)
        };
        let replay = Replay {
            evicted,
            q_c: c_rows.clone(),
            key_end,
        };
        let mut c = vec![0.0f64; nh * n];
        let (mut kept, mut stats) = (Vec::with_capacity(nh), Vec::with_capacity(nh));
        for h in 0..nh {
            for r in 0..n {
                c[h * n + r] = c_rows[r * nh + h];
            }
            let e = (!ends[h].is_empty()).then_some(&ends[h][..]);
            let (k, st) = vm::continue_blocks(&cache_c[h], &c[h * n..(h + 1) * n], delta[h], e);
            kept.push(k);
            stats.push(st);
        }
        let plan = LayerPlan::Continue(ContinuePlan {
            c,
            pre,
            live,
            kept,
            stats,
            ends,
            ops,
        });
        return Ok((plan, Some(replay)));
    }
    let mut steps = Vec::with_capacity(n);
    for r in 0..n {
        let mut ops: Vec<Vec<RowOp>> = (0..nh)
            .map(|h| {
                if r == 0 && rebased[h] {
                    meta_ops(&state.heads[h])
                } else {
                    Vec::new()
                }
            })
            .collect();
        append(state, r, &mut ops)?;
        let mut heads = Vec::with_capacity(nh);
        for (h, ops) in ops.into_iter().enumerate() {
            let hc = &state.heads[h];
            let live = hc.len();
            let delta = match (ln_eps, certified) {
                (None, _) => None,
                // The step decided ACP on the device from its plan's thresholds.
                (Some(_), true) if cx.acp_on_device => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(u[h], live, e)?),
                (Some(e), false) => {
                    let uu = foxedge_core::threshold::bound_from_norms(
                        qn(h, r),
                        state.k_norm_max[h],
                        scale,
                    )?;
                    Some(foxedge_core::threshold::threshold(uu, live, e)?)
                }
            };
            let c_t = c_rows[r * nh + h];
            let (kept, stats) = if cx.acp_on_device {
                (Vec::new(), Default::default())
            } else {
                vm::decode_blocks(&hc.c, c_t, delta, BLOCK)
            };
            heads.push(HeadStep {
                ops,
                live,
                c_t,
                kept,
                stats,
            });
        }
        steps.push(TokenPlan { heads });
    }
    Ok((LayerPlan::Tokens(steps), None))
}

/// A layer's part of a one-token step's plan: which heads it re-based, and its heads'
/// plans (None: the per-layer path runs the token).
type LayerStepPlan = (Vec<bool>, Option<Vec<StepHead>>);

/// The CPU's `append` of a fresh chunk's `n` rows (a stream's first): the retention policy
/// over the tokens in order, noting each head's evictions, then each head's host rows
/// (its evictions at a token, then the token's row), heads in parallel. The same rows as
/// appending token by token: a fresh chunk reads no evicted row, and heads do not share
/// rows.
fn keep_fresh_chunk(
    state: &mut LayerState,
    g: &Gates<'_>,
    c_rows: &[f64],
    pos0: u64,
    scores: Option<&[f32]>,
    hd: usize,
) -> Result<()> {
    use rayon::prelude::*;
    let (n, nh) = (g.tokens, state.heads.len());
    let mut evs: Vec<Vec<(usize, Eviction)>> = vec![Vec::new(); nh];
    let mut score_row = vec![0.0f32; nh];
    let mut bad_head = false;
    for r in 0..n {
        let sc = scores.map(|sc| {
            score_row.fill(sc[r]);
            &score_row[..]
        });
        state.policy.append(
            pos0 + r as u64,
            &c_rows[r * nh..(r + 1) * nh],
            sc,
            |ev| match evs.get_mut(ev.head) {
                Some(e) => e.push((r, ev)),
                None => bad_head = true,
            },
        )?;
        state.peak_live = state.peak_live.max(state.policy.live_total());
    }
    if bad_head {
        return Err(Error::Internal(
            "an eviction of a head the layer lacks".into(),
        ));
    }
    let (gk, gv) = (g.k, g.v);
    state
        .heads
        .par_iter_mut()
        .zip(&evs)
        .enumerate()
        .try_for_each(|(h, (hc, evs))| -> Result<()> {
            let mut evs = evs.iter().peekable();
            for r in 0..n {
                while let Some((_, ev)) = evs.next_if(|(at, _)| *at == r) {
                    hc.apply(ev, hd)?;
                }
                let at = (h * n + r) * hd;
                let c = c_rows[r * nh + h];
                hc.push(&gk[at..at + hd], &gv[at..at + hd], c, pos0 + r as u64)?;
            }
            Ok(())
        })
}

/// What a one-token step's plan of a layer reads besides the layer's state.
struct StepCx<'a> {
    certified: bool,
    /// The layer's logit bound per head.
    u: &'a [f64],
    ln: &'a LnTable,
    ln_eps: Option<f64>,
    /// Most live rows a head keeps (the budget).
    limit: usize,
    scale: f64,
    /// The token's position.
    pos: u64,
}

/// Layer plan of a one-token step ([`Session::step_plan`]): per head the evictions its
/// policy may make, their swap-delete moves and the ACP threshold for each count; None
/// where the policy cannot list them (the per-layer path runs the token).
fn step_plan_layer(
    cx: &StepCx<'_>,
    state: &LayerState,
    rebased: &[bool],
) -> Result<Option<Vec<StepHead>>> {
    let mut cand = Vec::new();
    let mut slots: Vec<u32> = Vec::new();
    let mut heads = Vec::with_capacity(state.heads.len());
    for (h, hc) in state.heads.iter().enumerate() {
        let live = hc.len();
        let k_max = (live + 1).saturating_sub(cx.limit) + STEP_EVICTIONS;
        if cand.len() < k_max {
            cand.resize(k_max, foxedge_core::retention::Candidate::default());
        }
        let Some(n) = state.policy.next_evictions(h, &mut cand[..k_max])? else {
            return Ok(None);
        };
        // The swap-deletes of evicting the candidates in order.
        slots.clear();
        slots.extend(cand[..n].iter().map(|c| c.slot));
        let mut evict = Vec::with_capacity(n);
        let mut last = live;
        for i in 0..n {
            last -= 1;
            let at = slots[i];
            let moved = (at as usize != last).then_some((last as u32, at));
            for s in &mut slots[i + 1..] {
                if *s as usize == last {
                    *s = at;
                }
            }
            evict.push(StepEvict {
                moved,
                at_or_below: cand[i].evict_at_or_below,
            });
        }
        let acp = match (cx.ln_eps, cx.certified) {
            (None, _) => StepAcp::Dense,
            (Some(e), true) => StepAcp::Delta(
                (0..=n)
                    .map(|k| {
                        let ln_n = cx.ln.at(live - k + 1);
                        foxedge_core::threshold::threshold_ln(cx.u[h], ln_n, e)
                    })
                    .collect::<std::result::Result<_, _>>()?,
            ),
            (Some(e), false) => {
                // Without a certificate only the budget evicts: all n, always.
                if evict.iter().any(|x| x.at_or_below != f64::INFINITY) {
                    return Ok(None);
                }
                StepAcp::Norms {
                    base: e - ((live - n + 1) as f64).ln(),
                    k_norm_max: state.k_norm_max[h],
                    scale: cx.scale,
                }
            }
        };
        heads.push(StepHead {
            ops: if rebased[h] { meta_ops(hc) } else { Vec::new() },
            live,
            evict,
            c_prev: state.gates[h].current(),
            pos: cx.pos,
            acp,
        });
    }
    Ok(Some(heads))
}

impl Session {
    /// Feeds one chunk through the device, falling back to the CPU (for good) when the
    /// device fails; logits as `forward_chunk` writes them.
    pub(super) fn device_chunk(
        &mut self,
        ids: &[u32],
        scores: Option<&[f32]>,
        mut logits: Option<&mut [f32]>,
        all_rows: bool,
    ) -> Result<()> {
        let fresh = self.layers[0].gates[0].is_empty();
        let v = self.model.info().vocab;
        // The device's prefill of a fresh chunk attends all of the chunk's keys: past what
        // the budget holds, the rest continues token by token, as the CPU's queries see.
        let room = self.room_without_forced_eviction();
        if fresh && ids.len() > room {
            let (a, b) = ids.split_at(room);
            let (sa, sb) = (scores.map(|s| &s[..room]), scores.map(|s| &s[room..]));
            let (la, lb) = match logits {
                Some(l) if all_rows => {
                    let (x, y) = l.split_at_mut(room * v);
                    (Some(x), Some(y))
                }
                l => (None, l),
            };
            self.device_chunk(a, sa, la, all_rows)?;
            return self.forward_chunk(b, sb, lb, all_rows, None);
        }
        if !fresh && ids.len() == 1 {
            match self.step_plan() {
                Ok(Some(plan)) => return self.device_step(ids[0], plan, scores, logits),
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        let Some(mut dev) = self.device.take() else {
            return Err(Error::Internal("device chunk without a device".into()));
        };
        let unsent_metas = std::mem::take(&mut dev.unsent_metas);
        let n = ids.len();
        let shift_before: Vec<(Vec<f32>, Vec<f32>)> = self
            .layers
            .iter()
            .map(|l| (l.k_shift.clone(), l.v_shift.clone()))
            .collect();
        let pos0 = self.stats.tokens;
        let mut keeper = Keeper {
            sess: self,
            pos0,
            fresh,
            scores,
            acp_on_device: false,
            replays: Vec::new(),
            unsent_metas,
        };
        let mut layers_done = 0usize;
        let mut own_err: Option<Error> = None;
        let out = match logits.as_deref_mut() {
            None => Output::Nothing,
            Some(l) if all_rows => Output::All(l),
            Some(l) => Output::Last(l),
        };
        let res = dev.stream.run(
            ids,
            &mut |g: &Gates<'_>| match keeper.plan(g) {
                Ok(p) => {
                    layers_done = g.layer + 1;
                    Ok(p)
                }
                Err(e) => {
                    own_err = Some(e);
                    Err(foxedge_vulkan::Error::Input(
                        foxedge_core::Error::BadArgument("the session's bookkeeping failed"),
                    ))
                }
            },
            out,
        );
        let replays = std::mem::take(&mut keeper.replays);
        if let Some(e) = own_err {
            self.device = Some(dev);
            return Err(e);
        }
        match res {
            Ok(rs) => {
                for st in &rs.attention {
                    self.stats.kept_pairs += st.kept_pairs();
                    self.stats.total_pairs += st.total_pairs();
                }
                self.stats.tokens += n as u64;
                dev.bytes_uploaded += rs.bytes_uploaded;
                dev.runs += 1;
                self.stats.device_layers = self.model.info().layers as u64;
                self.stats.device_bytes_uploaded = dev.bytes_uploaded;
                self.stats.device_runs = dev.runs;
                self.stats.device_submissions += u64::from(rs.submissions);
                self.device = Some(dev);
                Ok(())
            }
            Err(e) => {
                let err = device_error(e);
                if !crate::backend::is_device_failure(&err) {
                    self.device = Some(dev);
                    return Err(err);
                }
                eprintln!("foxedge: {err}; the session continues on the CPU");
                self.stats.device_layers = 0;
                let done = (layers_done, &replays[..]);
                self.cpu_finish(ids, scores, logits, all_rows, done, &shift_before)
            }
        }
    }

    /// What the host decides for a one-token step before its gates: re-bases (their metas),
    /// each head's live rows, `c_{t-1}`, the evictions its retention policy may make at the
    /// token (in order, with the largest `c_t` that makes each, and each one's swap-delete
    /// move) and the ACP threshold for each number of them. `None` where the policy's
    /// evictions at this token are not known that way (`next_evictions`): the per-layer
    /// path runs it.
    fn step_plan(&mut self) -> Result<Option<Vec<Vec<StepHead>>>> {
        use rayon::prelude::*;
        let scale = 1.0 / (self.model.info().head_dim as f64).sqrt();
        let pos = self.stats.tokens;
        let ln_eps = self.opts.ln_eps;
        let limit = self.policy_cfg.head_limit();
        let Some(dev) = self.device.as_mut() else {
            return Err(Error::Internal("a step plan without a device".into()));
        };
        let most = self
            .layers
            .iter()
            .flat_map(|s| &s.heads)
            .map(HeadCache::len)
            .max();
        dev.ln.grow(most.unwrap_or(0) + 1);
        let ln = &dev.ln;
        let (u, certified) = (&self.u, &self.certified);
        // Layers are independent: planned in parallel.
        let per_layer: Vec<Result<LayerStepPlan>> = self
            .layers
            .par_iter_mut()
            .enumerate()
            .map(|(l, state)| {
                let rebased = rebase_heads(state)?;
                let cx = StepCx {
                    certified: certified[l],
                    u: &u[l],
                    ln,
                    ln_eps,
                    limit,
                    scale,
                    pos,
                };
                let heads = step_plan_layer(&cx, state, &rebased)?;
                Ok((rebased, heads))
            })
            .collect();
        let mut plan = Vec::with_capacity(per_layer.len());
        let mut rebased_all = Vec::with_capacity(per_layer.len());
        let mut whole = true;
        for r in per_layer {
            let (rebased, heads) = r?;
            rebased_all.push(rebased);
            match heads {
                Some(h) => plan.push(h),
                None => whole = false,
            }
        }
        if !whole {
            // Heads re-based here: their metas go with the run that replaces the step.
            dev.unsent_metas = rebased_all;
            return Ok(None);
        }
        Ok(Some(plan))
    }

    /// One token in one device submission ([`DeviceStream::step`]): the host decides what
    /// does not depend on the token before it, the device the rest; afterwards the host
    /// keeps its books from the step's gates (as after each layer of a run) and checks that
    /// its policy made exactly the operations the step applied.
    fn device_step(
        &mut self,
        id: u32,
        plan: Vec<Vec<StepHead>>,
        scores: Option<&[f32]>,
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        let Some(mut dev) = self.device.take() else {
            return Err(Error::Internal("device step without a device".into()));
        };
        let mut logits = logits;
        let out = match logits.as_deref_mut() {
            None => Output::Nothing,
            Some(l) => Output::Last(l),
        };
        let (rs, got) = match dev.stream.step(id, &plan, out) {
            Ok(r) => r,
            Err(e) => {
                let err = device_error(e);
                if !crate::backend::is_device_failure(&err) {
                    self.device = Some(dev);
                    return Err(err);
                }
                eprintln!("foxedge: {err}; the session continues on the CPU");
                self.stats.device_layers = 0;
                // The step changed nothing of the session's: the shift states are as before.
                let shift_before: Vec<(Vec<f32>, Vec<f32>)> = self
                    .layers
                    .iter()
                    .map(|l| (l.k_shift.clone(), l.v_shift.clone()))
                    .collect();
                return self.cpu_finish(&[id], scores, logits, false, (0, &[]), &shift_before);
            }
        };
        if plan.len() != self.layers.len() {
            return Err(Error::Internal("a step plan without every layer".into()));
        }
        // The books of each layer from its gates, layers in parallel; per layer the heads
        // whose operations the device made differently from the policy.
        let per_layer: Vec<Result<Vec<usize>>> = {
            use rayon::prelude::*;
            let info = self.model.info();
            let (u, certified, ln_eps) = (&self.u, &self.certified, self.opts.ln_eps);
            let pos0 = self.stats.tokens;
            let got = &got;
            self.layers
                .par_iter_mut()
                .zip(plan.par_iter())
                .enumerate()
                .map(|(l, (state, heads))| {
                    let cx = LayerCx {
                        heads: info.heads,
                        head_dim: info.head_dim,
                        hidden: info.hidden,
                        ln_eps,
                        certified: certified[l],
                        u: &u[l],
                        pos0,
                        fresh: false,
                        scores,
                        acp_on_device: true,
                        unsent: None,
                    };
                    let (made, _) = plan_layer(&cx, state, &got.gates(l))?;
                    let LayerPlan::Tokens(steps) = made else {
                        return Err(Error::Internal("a one-token step planned a chunk".into()));
                    };
                    let [step] = &steps[..] else {
                        return Err(Error::Internal("a one-token step planned several".into()));
                    };
                    let differ = (step.heads.iter().zip(heads).enumerate())
                        .filter(|(h, (hs, sp))| !same_ops(&hs.ops, sp, got.evicted(l, *h)))
                        .map(|(h, _)| h)
                        .collect();
                    // The device's c_t is the f64 sum to its double-float precision.
                    for (h, g) in state.gates.iter().enumerate() {
                        let (dev_c, host_c) = (got.c_t(l, h), g.current());
                        if (dev_c - host_c).abs() > C_T_TOLERANCE * (1.0 + host_c.abs()) {
                            return Err(Error::Internal(format!(
                                "layer {l} head {h}: the device's c_t {dev_c} is not the \
                                 host's {host_c}"
                            )));
                        }
                    }
                    Ok(differ)
                })
                .collect()
        };
        let mut differ = Vec::new();
        for (l, heads) in per_layer.into_iter().enumerate() {
            differ.extend(heads?.into_iter().map(|h| (l, h)));
        }
        dev.stream.recycle(got);
        for st in &rs.attention {
            self.stats.kept_pairs += st.kept_pairs();
            self.stats.total_pairs += st.total_pairs();
        }
        self.stats.tokens += 1;
        dev.bytes_uploaded += rs.bytes_uploaded;
        dev.runs += 1;
        self.stats.device_layers = self.model.info().layers as u64;
        self.stats.device_bytes_uploaded = dev.bytes_uploaded;
        self.stats.device_runs = dev.runs;
        self.stats.device_submissions += u64::from(rs.submissions);
        // The device decided an eviction threshold on the other side of the host's (f64
        // rounding), or the policy evicted past the candidates the plan listed (a large
        // gate drop): this token's attention differs by less than the certificate's eps,
        // and those heads of the device's cache are not the host's. They are loaded from
        // the host's rows; where that fails the session continues on the CPU.
        match differ
            .iter()
            .try_for_each(|&(l, h)| self.reload_head(&mut dev, l, h))
        {
            Ok(()) => self.device = Some(dev),
            Err(e) => {
                eprintln!(
                    "foxedge: the device's evictions differ from the retention policy's \
                     ({e}); the session continues on the CPU"
                );
                self.stats.device_layers = 0;
            }
        }
        Ok(())
    }

    /// Loads head `h` of layer `l` of the device's cache from the session's rows.
    fn reload_head(&self, dev: &mut Device, l: usize, h: usize) -> Result<()> {
        let hc = &self.layers[l].heads[h];
        let n = hc.len() * self.model.info().head_dim;
        let (k, v): (Vec<f32>, Vec<f32>) = match self.opts.cache_dtype {
            CacheDtype::F32 => {
                let r = hc.view::<f32>()?;
                (r.k.to_vec(), r.v.to_vec())
            }
            CacheDtype::F16 => {
                let r = hc.view::<f16>()?;
                (
                    r.k.iter().map(|x| x.to_f32()).collect(),
                    r.v.iter().map(|x| x.to_f32()).collect(),
                )
            }
        };
        let (Some(k), Some(v)) = (k.get(..n), v.get(..n)) else {
            return Err(Error::Internal(
                "a cache head holds fewer rows than its c".into(),
            ));
        };
        dev.stream
            .load_head(l, h, k, v, &hc.c, &hc.pos)
            .map_err(device_error)
    }

    /// The CPU's forward of a chunk whose first `done.0` layers' bookkeeping the device run
    /// already made: those layers are recomputed without it (a continuation's with what
    /// `done.1` kept of its keys), the others run as usual.
    fn cpu_finish(
        &mut self,
        ids: &[u32],
        scores: Option<&[f32]>,
        logits: Option<&mut [f32]>,
        all_rows: bool,
        (done, replays): (usize, &[Option<Replay>]),
        shift_before: &[(Vec<f32>, Vec<f32>)],
    ) -> Result<()> {
        let model = Arc::clone(&self.model);
        let info = model.info();
        let (t, d) = (ids.len(), info.hidden);
        let mut h = vec![0.0f32; t * d];
        model.embed(ids, &mut h)?;
        let mut s = Scratch::new(t, &info);
        let pos0 = self.stats.tokens;
        for (l, shift) in shift_before.iter().enumerate().take(info.layers) {
            if l < done {
                let rp = replays.get(l).and_then(Option::as_ref);
                self.replay_layer(&model, l, &mut h, (t, rp), shift, &mut s)?;
            } else {
                let mut me = [Member {
                    s: self,
                    ids,
                    scores,
                    logits: None,
                    hidden: None,
                }];
                let lay = Layout::new(&me);
                layer_forward(&model, l, &mut h, &mut me, &lay, &[pos0], &mut s)?;
            }
        }
        self.stats.tokens += t as u64;
        if let Some(out) = logits {
            let (rows, hs) = if all_rows {
                (t, &h[..])
            } else {
                (1, &h[(t - 1) * d..])
            };
            let mut x = vec![0.0f32; rows * d];
            ops::rmsnorm(hs, &model.norm, model.config.norm_eps, &mut x);
            model.linear(model.lm_head(), &x, rows, out, false)?;
        }
        Ok(())
    }

    /// Layer `l` on `t` rows of `h` whose bookkeeping is done (its cache holds the rows of
    /// these tokens, its gate streams and shift state are past them): the dense math of
    /// `layer_forward` with the shift state of before the run, and attention over the chunk
    /// itself (a fresh stream's chunk), over the keys of before it and itself (a
    /// continuation, `replay`) or over the cache (one token).
    fn replay_layer(
        &mut self,
        model: &Model,
        l: usize,
        h: &mut [f32],
        (t, replay): (usize, Option<&Replay>),
        shift: &(Vec<f32>, Vec<f32>),
        s: &mut Scratch,
    ) -> Result<()> {
        let cfg = &model.config;
        let info = model.info();
        let (d, nh, hd) = (info.hidden, info.heads, info.head_dim);
        let lw: &LayerWeights = &model.layers[l];
        ops::rmsnorm(h, &lw.attn_norm, cfg.norm_eps, &mut s.x);
        model.linear(&lw.q_proj, &s.x, t, &mut s.q, false)?;
        for (proj, out, st) in [
            (&lw.k_proj, &mut s.k, &shift.0),
            (&lw.v_proj, &mut s.v, &shift.1),
        ] {
            model.linear(proj.linear(), &s.x, t, out, false)?;
            if let Some(ws) = proj.shift() {
                model.linear(ws, &s.x, t, &mut s.alpha, false)?;
                for r in (0..t).rev() {
                    for hh in 0..nh {
                        let a = ops::sigmoid(s.alpha[r * nh + hh]);
                        for c in hh * hd..(hh + 1) * hd {
                            let prev = if r == 0 { st[c] } else { out[(r - 1) * d + c] };
                            out[r * d + c] = a * prev + (1.0 - a) * out[r * d + c];
                        }
                    }
                }
            }
        }
        if let Some((qn, kn)) = &lw.qk_norm {
            ops::group_rmsnorm_inplace(&mut s.q, qn, hd, QK_EPS);
            ops::group_rmsnorm_inplace(&mut s.k, kn, hd, QK_EPS);
        }
        model.linear(&lw.fgate_w, &s.x, t, &mut s.log_f, false)?;
        let bias = &lw.fgate_b;
        for (i, z) in s.log_f.iter_mut().enumerate() {
            *z = foxedge_core::gate::logsigmoid(*z + bias[i % nh]);
        }
        let ln_eps = self.opts.ln_eps;
        let certified = self.certified[l];
        let u = &self.u[l];
        let state = &self.layers[l];
        if let Some(rp) = replay {
            let scale = 1.0 / (hd as f64).sqrt();
            let mut u_obs = vec![0.0f64; nh];
            if !certified {
                for (hh, uh) in u_obs.iter_mut().enumerate() {
                    let qn = (0..t)
                        .map(|r| {
                            let qh = &s.q[r * d + hh * hd..][..hd];
                            f64::from(ops::dot(qh, qh)).sqrt()
                        })
                        .fold(0.0, f64::max);
                    *uh =
                        foxedge_core::threshold::bound_from_norms(qn, state.k_norm_max[hh], scale)?;
                }
            }
            let acp = match (ln_eps, certified) {
                (None, _) => Acp::Off,
                (Some(ln_eps), true) => Acp::Bound { u, ln_eps },
                (Some(ln_eps), false) => Acp::Bound { u: &u_obs, ln_eps },
            };
            let (b, pos0) = (self.backend.as_ref(), self.stats.tokens);
            let qkv = (&s.q[..], &s.k[..], &s.v[..]);
            let st = replay_attend(b, &state.heads, pos0, hd, rp, qkv, acp, &mut s.o)?;
            self.stats.kept_pairs += st.kept_pairs();
            self.stats.total_pairs += st.total_pairs();
        } else if t > 1 {
            let acp = match (ln_eps, certified) {
                (None, _) => Acp::Off,
                (Some(ln_eps), true) => Acp::Bound { u, ln_eps },
                (Some(ln_eps), false) => Acp::ObservedNorms { ln_eps },
            };
            let call = PrefillCall::new(t, nh, hd, &s.q, &s.k, &s.v, &s.log_f).with_acp(acp);
            let st = self.backend.prefill(&call, &mut s.o)?;
            self.stats.kept_pairs += st.kept_pairs();
            self.stats.total_pairs += st.total_pairs();
        } else {
            let c_t: Vec<f64> = state.gates.iter().map(|g| g.current()).collect();
            let mut u_step = vec![0.0f64; nh];
            let acp = match (ln_eps, certified) {
                (None, _) => Acp::Off,
                (Some(ln_eps), true) => Acp::Bound { u, ln_eps },
                (Some(ln_eps), false) => {
                    for (hh, uh) in u_step.iter_mut().enumerate() {
                        let qh = &s.q[hh * hd..(hh + 1) * hd];
                        let qn = f64::from(ops::dot(qh, qh)).sqrt();
                        *uh = foxedge_core::threshold::bound_from_norms(
                            qn,
                            state.k_norm_max[hh],
                            1.0 / (hd as f64).sqrt(),
                        )?;
                    }
                    Acp::Bound { u: &u_step, ln_eps }
                }
            };
            let (b, heads, q, o) = (
                self.backend.as_ref(),
                &state.heads,
                &s.q[..d],
                &mut s.o[..d],
            );
            let st = match self.opts.cache_dtype {
                CacheDtype::F32 => decode_step::<f32>(b, heads, hd, q, &c_t, acp, o)?,
                CacheDtype::F16 => decode_step::<f16>(b, heads, hd, q, &c_t, acp, o)?,
            };
            self.stats.kept_pairs += st.kept_pairs();
            self.stats.total_pairs += st.total_pairs();
        }
        if let Some(on) = &lw.output_norm {
            ops::group_rmsnorm_inplace(&mut s.o, on, hd, cfg.norm_eps);
        }
        if let Some(og) = &lw.ogate {
            model.linear(og, &s.x, t, &mut s.g, false)?;
            for (o, &g) in s.o.iter_mut().zip(&s.g) {
                *o *= match cfg.ogate_act {
                    OgateAct::Sigmoid => ops::sigmoid(g),
                    OgateAct::Silu => ops::silu(g),
                };
            }
        }
        model.linear(&lw.o_proj, &s.o, t, h, true)?;
        let i = info.intermediate;
        ops::rmsnorm(h, &lw.mlp_norm, cfg.norm_eps, &mut s.x);
        model.linear(&lw.gate_up, &s.x, t, &mut s.gu, false)?;
        for r in 0..t {
            let (g, u) = s.gu[r * 2 * i..(r + 1) * 2 * i].split_at(i);
            for ((a, &g), &u) in s.act[r * i..(r + 1) * i].iter_mut().zip(g).zip(u) {
                *a = match cfg.hidden_act {
                    HiddenAct::Swish => ops::silu(g),
                    HiddenAct::Sigmoid => ops::sigmoid(g),
                } * u;
            }
        }
        model.linear(&lw.down, &s.act, t, h, true)?;
        Ok(())
    }

    /// Tokens a fresh stream can take before the budget forces an eviction (at least 1).
    fn room_without_forced_eviction(&self) -> usize {
        let cfg = &self.policy_cfg;
        let per_layer = cfg
            .layer_budget
            .map_or(usize::MAX, |b| b / cfg.heads.max(1));
        cfg.head_limit().min(per_layer).max(1)
    }

    /// Makes the `k`-th device submission from now fail as a lost device would (tests of
    /// the fallback); false without a device.
    #[cfg(test)]
    pub(crate) fn inject_device_loss(&mut self, k: u64) -> bool {
        match &mut self.device {
            Some(d) => {
                d.stream.fail_after(k);
                true
            }
            None => false,
        }
    }

    /// Whether the session's layers run on the device now.
    pub fn on_device(&self) -> bool {
        self.device.is_some()
    }
}

#[cfg(test)]
#[path = "device_model/tests.rs"]
pub(super) mod tests;
