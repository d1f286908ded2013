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
//! in parallel over layers on the session's pool. A stream's first chunk needs only its
//! gates before its attention: the device stores every row in its token's slot and runs
//! on while a thread per layer keeps the policy's books; after the last layer the device
//! moves the rows the policy kept into its slots.
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
    self as vm, Act, ContinuePlan, DeviceModel, DeviceStream, Gates, HeadStep, LayerGates,
    LayerPlan, ModelOptions, ModelShape, ModelWeights, Output, QkNorm, RowOp, StepAcp, StepEvict,
    StepHead, TokenPlan,
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

/// The device run's error for a plan callback whose books failed (the books' own error is
/// kept beside it).
fn books_failed() -> foxedge_vulkan::Error {
    foxedge_vulkan::Error::Input(foxedge_core::Error::BadArgument(
        "the session's bookkeeping failed",
    ))
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
/// there prefills 9-27x and decodes 1.9-10x as fast as the 16-thread CPU backend (125M and
/// 760M shapes, f32 / Q8 / Q4 weights, BENCHMARKS.md). A CPU implementation (lavapipe)
/// shares the cores the CPU kernels use and loses to them, and a virtual GPU is unmeasured.
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

#[path = "device_model/books.rs"]
mod books;
use books::*;

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
        let out = match logits.as_deref_mut() {
            None => Output::Nothing,
            Some(l) if all_rows => Output::All(l),
            Some(l) => Output::Last(l),
        };
        let (res, layers_done, own_err, replays) = if fresh && n > 1 {
            let (res, done, err) = self.run_fresh(&mut dev, ids, scores, out);
            (res, done, err, Vec::new())
        } else {
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
            let res = dev.stream.run(
                ids,
                &mut |g: &Gates<'_>| match keeper.plan(g) {
                    Ok(p) => {
                        layers_done = g.layer + 1;
                        Ok(p)
                    }
                    Err(e) => {
                        own_err = Some(e);
                        Err(books_failed())
                    }
                },
                out,
            );
            (
                res,
                layers_done,
                own_err,
                std::mem::take(&mut keeper.replays),
            )
        };
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

    /// A fresh chunk's run with its books deferred: per layer the session takes the gates
    /// and plans the attention at once ([`books::fresh_plan`]: every row stored in its
    /// token's slot), then keeps the rest of the layer's books on a thread of its own while
    /// the device runs on ([`books::fresh_rows`]); after the last layer the device moves the
    /// rows the policy kept into its slots. Returns the run's result, the layers whose
    /// books were kept (all joined before it returns) and the books' own error.
    fn run_fresh(
        &mut self,
        dev: &mut Device,
        ids: &[u32],
        scores: Option<&[f32]>,
        out: Output<'_>,
    ) -> (
        std::result::Result<foxedge_vulkan::model::RunStats, foxedge_vulkan::Error>,
        usize,
        Option<Error>,
    ) {
        use std::cell::{Cell, RefCell};
        let info = self.model.info();
        let (u, certified, ln_eps) = (&self.u, &self.certified, self.opts.ln_eps);
        let pos0 = self.stats.tokens;
        let hd = info.head_dim;
        let mut states: Vec<Option<&mut LayerState>> = self.layers.iter_mut().map(Some).collect();
        let done = Cell::new(0usize);
        let own_err: RefCell<Option<Error>> = RefCell::new(None);
        let res = std::thread::scope(|s| {
            type Job<'s> = std::thread::ScopedJoinHandle<'s, Result<Vec<Vec<RowOp>>>>;
            let jobs: RefCell<Vec<Job<'_>>> = RefCell::new(Vec::new());
            let fail = |e: Error| {
                own_err.borrow_mut().get_or_insert(e);
                books_failed()
            };
            let join = |j: Job<'_>| match j.join() {
                Ok(r) => r,
                Err(_) => Err(Error::Internal("a layer's books panicked".into())),
            };
            let mut plan = |g: &Gates<'_>, lg: &LayerGates| {
                let l = g.layer;
                let Some(state) = states.get_mut(l).and_then(Option::take) else {
                    return Err(fail(Error::Internal("a layer planned twice".into())));
                };
                let cx = LayerCx {
                    fresh: true,
                    ..LayerCx::new(&info, ln_eps, (u, certified), l, pos0, scores)
                };
                let (p, c_rows) = books::fresh_plan(&cx, state, g).map_err(fail)?;
                // Layers in parallel, each on a thread of its own and no pool: the caller's
                // thread (a pool worker) waits for them.
                let lg = lg.clone();
                jobs.borrow_mut().push(s.spawn(move || {
                    lg.with(|g| books::fresh_rows(state, g, &c_rows, pos0, scores, hd))
                        .map_err(device_error)?
                }));
                done.set(l + 1);
                Ok(p)
            };
            let mut finish = || {
                let mut all = Vec::new();
                for j in jobs.borrow_mut().drain(..) {
                    all.push(join(j).map_err(fail)?);
                }
                Ok(all)
            };
            let res = dev.stream.run_deferred(ids, &mut plan, &mut finish, out);
            // A run that failed part-way: the books it started end before the CPU takes over.
            for j in jobs.borrow_mut().drain(..) {
                if let Err(e) = join(j) {
                    own_err.borrow_mut().get_or_insert(e);
                }
            }
            res
        });
        (res, done.get(), own_err.into_inner())
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
                        acp_on_device: true,
                        ..LayerCx::new(&info, ln_eps, (u, certified), l, pos0, scores)
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
