//! A decoding session: per-layer state (retained K/V/c cache, k/v shift state, gate stream)
//! over a shared [`Model`], fed token ids in chunks (prefill) or one at a time (decode).

use crate::backend::{AttentionBackend, BackendKind};
use crate::error::{Error, Result};
use crate::model::Model;
use cache::HeadCache;
use forward::{Member, forward};
use foxedge_core::gate::GateStream;
use foxedge_core::retention::{ForcedOrder, HeadState, PolicyConfig, RetentionPolicy, Slot};
use std::sync::Arc;
use std::time::Instant;

/// Most tokens of one chunk on a device running the whole model, with the default
/// [`SessionOptions::prefill_chunk`].
pub const DEVICE_PREFILL_CHUNK: usize = 2048;

mod cache;
#[cfg(all(test, feature = "vulkan"))]
mod device_continue_tests;
#[cfg(feature = "vulkan")]
#[path = "device_model.rs"]
mod device_model;
#[cfg(feature = "vulkan")]
mod device_replay;
mod file;
mod forward;
#[cfg(all(test, feature = "vulkan"))]
mod vulkan_tests;

pub use cache::entry_bytes;

/// Re-base a head's gate origin once `|c_t|` exceeds this (nats): keeps stored `c` small so
/// their f64 spacing stays below 1e-12.
const REBASE_AT: f64 = 1e4;

/// A hard limit on the retained cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// At most this many entries per head (in every layer).
    EntriesPerHead(usize),
    /// At most this many entries per layer (all heads of the layer together).
    EntriesPerLayer(usize),
    /// At most this many bytes of K, V, c and position storage in the whole session.
    Bytes(usize),
}

/// How the retained cache stores K and V rows (compute is always f32; `c` stays f64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheDtype {
    /// 4 bytes per value: the default (the golden logits' f32 tolerances need it).
    #[default]
    F32,
    /// 2 bytes per value (IEEE half, rounded to nearest even): half the cache memory and
    /// bytes read per decode step.
    F16,
}

impl CacheDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::F16 => 2,
        }
    }

    /// The lowercase name accepted by [`std::str::FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::F16 => "f16",
        }
    }
}

impl std::fmt::Display for CacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(CacheDtype::F32),
            "f16" => Ok(CacheDtype::F16),
            _ => Err(Error::invalid(format!(
                "cache dtype `{s}`: expected f16 or f32"
            ))),
        }
    }
}

/// Options of a [`Session`].
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOptions {
    /// Where attention runs.
    pub backend: BackendKind,
    /// ln eps of ACP and of the eviction certificate; `None` = ACP off, no certified eviction.
    /// Default `Some(-10.0)`.
    pub ln_eps: Option<f64>,
    /// Evict entries whose certified bound allows it (needs `ln_eps` and a model whose logit
    /// bound holds for every future token, i.e. QK-norm). Default true.
    pub certified_eviction: bool,
    /// Hard cache limit (None = unbounded apart from certified eviction).
    pub budget: Option<Budget>,
    /// The most recent `window` tokens of every head are never evicted.
    pub window: usize,
    /// The first `sinks` tokens of the stream are never evicted.
    pub sinks: usize,
    /// Tokens per prefill chunk (> 0). Default 512 (on a device running the whole model,
    /// the default lets a chunk grow to [`DEVICE_PREFILL_CHUNK`] tokens where the device
    /// has room for them). A feed of several tokens runs in
    /// chunks of at most this many: each chunk's dense layers are one matrix product over
    /// its rows and its attention one tiled kernel call over the retained cache and the
    /// chunk itself, each token seeing exactly the keys it would see fed alone (evictions
    /// and the certificate advance token by token). Transient memory grows with the chunk
    /// (about 46 KiB a token for the 125M shape); 512 costs ~6% of the speed of one
    /// 4096-token chunk and a fifth of its memory.
    pub prefill_chunk: usize,
    /// Slots per head when no budget is given: the cache never holds more entries per head
    /// (beyond it the oldest are force-evicted and `B_t` reports it). Default 32768.
    pub max_entries_per_head: usize,
    /// Rank forced evictions by caller scores ([`Session::feed_scored`]) instead of the
    /// weight bound `2U_h + c_t - c_j`.
    pub scored: bool,
    /// Storage of the retained K and V rows.
    pub cache_dtype: CacheDtype,
    /// Threads of the session's own rayon pool, which runs its kernels and dense layers;
    /// 0 (default) = rayon's global pool (one thread per core, shared by every session).
    pub threads: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            backend: BackendKind::Cpu,
            ln_eps: Some(foxedge_core::threshold::DEFAULT_LN_EPS),
            certified_eviction: true,
            budget: None,
            window: 0,
            sinks: 0,
            prefill_chunk: 512,
            max_entries_per_head: 32768,
            scored: false,
            cache_dtype: CacheDtype::default(),
            threads: 0,
        }
    }
}

/// Counters of a session since creation or the last [`Session::reset`].
#[derive(Debug, Clone, PartialEq)]
pub struct SessionStats {
    /// Tokens fed in total.
    pub tokens: u64,
    /// Tokens fed in calls of more than one token, and the wall time of those calls.
    pub prefill_tokens: u64,
    pub prefill_seconds: f64,
    /// Tokens fed one per call, and the wall time of those calls.
    pub decode_tokens: u64,
    pub decode_seconds: f64,
    /// Cache entries alive now, summed over layers and heads.
    pub live_entries: u64,
    /// Entries evicted under the certificate (`B_t <= eps`), summed over layers and heads.
    pub evicted_certified: u64,
    /// Entries evicted by the budget beyond what the certificate allowed.
    pub evicted_forced: u64,
    /// Bytes of retained K, V, c and positions now, and the most ever held.
    pub cache_bytes: u64,
    pub peak_cache_bytes: u64,
    /// Query-key pairs attended and attendable (causal) in all attention calls.
    pub kept_pairs: u64,
    pub total_pairs: u64,
    /// The certificate `B_t` of each (layer, head), index `layer * heads + head`: a bound in
    /// `[0, 1)` on the attention mass that the head's evicted entries can take from any query
    /// now or later (0 when nothing was evicted). `None`: no guarantee, because entries were
    /// evicted and either the model has no logit bound valid for every token (no QK-norm) or
    /// forced evictions pushed `B_t` to 1 or beyond, which says nothing (attention weights sum
    /// to 1).
    pub bound_per_head: Vec<Option<f64>>,
    /// The largest of `bound_per_head`; `None` (no guarantee) when any head has none.
    pub max_bound: Option<f64>,
    /// Layers the latest feed ran entirely on the Vulkan device (every op, weights and
    /// cache resident): all of them, or 0 when the model runs on the CPU.
    pub device_layers: u64,
    /// Bytes the host wrote for the device (token ids, cache row operations, per-query
    /// metadata; never cache rows or weights) and device runs (one per chunk or token), so
    /// far.
    pub device_bytes_uploaded: u64,
    pub device_runs: u64,
    /// Device submissions the host waited for (a decode token: one; a chunk: one per layer
    /// and one more).
    pub device_submissions: u64,
}

impl Default for SessionStats {
    fn default() -> Self {
        SessionStats {
            tokens: 0,
            prefill_tokens: 0,
            prefill_seconds: 0.0,
            decode_tokens: 0,
            decode_seconds: 0.0,
            live_entries: 0,
            evicted_certified: 0,
            evicted_forced: 0,
            cache_bytes: 0,
            peak_cache_bytes: 0,
            kept_pairs: 0,
            total_pairs: 0,
            bound_per_head: Vec::new(),
            max_bound: Some(0.0),
            device_layers: 0,
            device_bytes_uploaded: 0,
            device_runs: 0,
            device_submissions: 0,
        }
    }
}

impl SessionStats {
    /// Fraction of attendable query-key pairs that ACP skipped.
    pub fn pruned_fraction(&self) -> f64 {
        if self.total_pairs == 0 {
            0.0
        } else {
            1.0 - self.kept_pairs as f64 / self.total_pairs as f64
        }
    }

    /// Prefill throughput in tokens per second (0 when none).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill_seconds)
    }

    /// Decode throughput in tokens per second (0 when none).
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.decode_tokens, self.decode_seconds)
    }
}

fn rate(n: u64, s: f64) -> f64 {
    if n == 0 || s <= 0.0 {
        0.0
    } else {
        n as f64 / s
    }
}

/// The most threads [`SessionOptions::threads`] may ask for.
pub const MAX_THREADS: usize = 1024;

/// A budget in words, for messages.
fn budget_text(b: Option<Budget>) -> String {
    match b {
        None => "none".into(),
        Some(Budget::EntriesPerHead(n)) => format!("{n} entries per head"),
        Some(Budget::EntriesPerLayer(n)) => format!("{n} entries per layer"),
        Some(Budget::Bytes(n)) => format!("{n} bytes"),
    }
}

type Policy = RetentionPolicy<Vec<Slot>, Vec<HeadState>>;

/// Decode state of one layer.
#[derive(Debug)]
struct LayerState {
    /// Raw (pre-shift, pre-norm) k/v projection of the last token, `[D]` (spec §6).
    k_shift: Vec<f32>,
    v_shift: Vec<f32>,
    /// Cumulative log gate per head.
    gates: Vec<GateStream>,
    heads: Vec<HeadCache>,
    policy: Policy,
    /// Largest key norm ever cached per head (ACP bound of models without QK-norm).
    k_norm_max: Vec<f64>,
    /// Most entries the layer held at once.
    peak_live: usize,
}

/// Runs `f` on a worker thread of `pool`, or of rayon's global pool when None. The forward's
/// parallel regions (~5 a block) then fork from a worker, whose deque the other workers
/// steal from, instead of each one being injected from outside the pool while the caller
/// sleeps until it ends (two thread wake-ups a region).
fn on_pool<R: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> R + Send) -> R {
    match pool {
        Some(p) => p.install(f),
        None => rayon::scope(|_| f()),
    }
}

/// A stream of tokens through a model. `Send`, fed by one caller at a time.
#[derive(Debug)]
pub struct Session {
    model: Arc<Model>,
    opts: SessionOptions,
    policy_cfg: PolicyConfig,
    /// Logit bound per (layer, head) given to the policy; `certified[l]` says whether it is
    /// a bound for every future token (QK-norm) so that `B_t` is a certificate.
    u: Vec<Vec<f64>>,
    certified: Vec<bool>,
    backend: Arc<dyn AttentionBackend>,
    /// The session's own thread pool (`opts.threads > 0`); None: the global pool.
    pool: Option<Arc<rayon::ThreadPool>>,
    layers: Vec<LayerState>,
    stats: SessionStats,
    /// Set when an internal error interrupted a feed half-way; cleared by `reset`.
    poisoned: bool,
    /// The whole model on a Vulkan device (`device_model.rs`), while it is in use.
    #[cfg(feature = "vulkan")]
    device: Option<device_model::Device>,
}

/// The retention policy of `opts` for `model`, the logit bound per (layer, head) and
/// whether each layer's bound holds for every future token (QK-norm).
///
/// Errors: [`Error::InvalidArgument`] for inconsistent options.
#[allow(clippy::type_complexity)]
fn policy_config(
    model: &Model,
    opts: &SessionOptions,
) -> Result<(PolicyConfig, Vec<Vec<f64>>, Vec<bool>)> {
    if opts.prefill_chunk == 0 {
        return Err(Error::invalid("prefill_chunk must be > 0"));
    }
    if opts.threads > MAX_THREADS {
        return Err(Error::invalid(format!(
            "threads = {} is more than {MAX_THREADS}",
            opts.threads
        )));
    }
    if let Some(e) = opts.ln_eps
        && !(e.is_finite() && e < 0.0)
    {
        return Err(Error::invalid(format!("ln eps {e} must be finite and < 0")));
    }
    let info = model.info();
    let window = opts.window.max(1);
    let mut cfg = PolicyConfig::new(info.heads, opts.max_entries_per_head);
    match opts.budget {
        None => {}
        Some(Budget::EntriesPerHead(n)) => {
            cfg.head_capacity = n;
            cfg.head_budget = Some(n);
        }
        Some(Budget::EntriesPerLayer(n)) => {
            cfg.head_capacity = n;
            cfg.layer_budget = Some(n);
        }
        Some(Budget::Bytes(b)) => {
            let per_layer = b / (info.layers * entry_bytes(info.head_dim, opts.cache_dtype));
            cfg.head_capacity = per_layer.max(1);
            cfg.layer_budget = Some(per_layer);
        }
    }
    cfg.window = window;
    cfg.sinks = opts.sinks;
    cfg.order = if opts.scored {
        ForcedOrder::Scores
    } else {
        ForcedOrder::WeightBound
    };
    let mut u = Vec::with_capacity(info.layers);
    let mut certified = Vec::with_capacity(info.layers);
    for l in 0..info.layers {
        match model.logit_bounds(l) {
            Some(b) => {
                u.push(b.to_vec());
                certified.push(true);
            }
            None => {
                u.push(vec![0.0; info.heads]);
                certified.push(false);
            }
        }
    }
    cfg.ln_eps = if opts.certified_eviction && certified.iter().all(|&c| c) {
        opts.ln_eps
    } else {
        None
    };
    cfg.validate().map_err(|e| {
        Error::invalid(format!(
            "cache options (budget {}, window {}, sinks {}): {e}",
            budget_text(opts.budget),
            opts.window,
            opts.sinks
        ))
    })?;
    Ok((cfg, u, certified))
}

impl Session {
    /// A fresh session over `model`.
    ///
    /// Errors: [`Error::InvalidArgument`] for inconsistent options (zero chunk, ln eps not
    /// negative, a budget that cannot hold `sinks + window` per head, more than
    /// [`MAX_THREADS`] threads), [`Error::BackendUnavailable`] when the backend cannot be
    /// used, [`Error::OutOfMemory`] when the threads cannot be started.
    pub fn new(model: Arc<Model>, opts: SessionOptions) -> Result<Session> {
        policy_config(&model, &opts)?;
        let backend: Arc<dyn AttentionBackend> = crate::select::resolve(opts.backend, None)?.into();
        Session::with_backend(model, opts, backend)
    }

    /// [`Session::new`] on a backend already open (shared with other sessions).
    pub(crate) fn with_backend(
        model: Arc<Model>,
        opts: SessionOptions,
        backend: Arc<dyn AttentionBackend>,
    ) -> Result<Session> {
        let (cfg, u, certified) = policy_config(&model, &opts)?;
        let pool = match opts.threads {
            0 => None,
            n => Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("foxedge-session-{i}"))
                    .build()
                    .map_err(|e| Error::OutOfMemory {
                        what: format!("a pool of {n} threads ({e})"),
                        bytes: 0,
                    })?,
            )),
        };
        #[cfg(feature = "vulkan")]
        let device = device_model::open(&model, opts.backend);
        let mut s = Session {
            #[cfg(feature = "vulkan")]
            device,
            model,
            opts,
            policy_cfg: cfg,
            u,
            certified,
            backend,
            pool,
            layers: Vec::new(),
            stats: SessionStats::default(),
            poisoned: false,
        };
        s.reset()?;
        Ok(s)
    }

    /// Forgets every token: empty caches, zero shift states, zeroed statistics.
    ///
    /// Errors: [`Error::OutOfMemory`] when the policy's slot storage cannot be allocated.
    pub fn reset(&mut self) -> Result<()> {
        let info = self.model.info();
        let slots = self.policy_cfg.slots_needed()?;
        self.release_cache();
        let mut layers = Vec::with_capacity(info.layers);
        for l in 0..info.layers {
            let mut store = Vec::new();
            store
                .try_reserve_exact(slots)
                .map_err(|_| Error::OutOfMemory {
                    what: "retention policy slots".into(),
                    bytes: slots.saturating_mul(std::mem::size_of::<Slot>()),
                })?;
            store.resize(slots, Slot::EMPTY);
            let policy = RetentionPolicy::new(
                self.policy_cfg,
                &self.u[l],
                store,
                vec![HeadState::EMPTY; info.heads],
            )?;
            layers.push(LayerState {
                k_shift: vec![0.0; info.hidden],
                v_shift: vec![0.0; info.hidden],
                gates: vec![GateStream::new(); info.heads],
                heads: (0..info.heads)
                    .map(|_| HeadCache::new(self.opts.cache_dtype))
                    .collect(),
                policy,
                k_norm_max: vec![0.0; info.heads],
                peak_live: 0,
            });
        }
        self.layers = layers;
        #[cfg(feature = "vulkan")]
        if let Some(d) = &mut self.device
            && d.reset().is_err()
        {
            self.device = None;
        }
        self.stats = SessionStats {
            bound_per_head: vec![Some(0.0); info.layers * info.heads],
            ..SessionStats::default()
        };
        self.poisoned = false;
        Ok(())
    }

    /// Tells the backend that the cache heads of this session's current state are gone.
    fn release_cache(&self) {
        let ids: Vec<u64> = self
            .layers
            .iter()
            .flat_map(|l| l.heads.iter().map(|h| h.id))
            .collect();
        if !ids.is_empty() {
            self.backend.release_cache(&ids);
        }
    }

    /// The model this session runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The options the session was created with.
    pub fn options(&self) -> &SessionOptions {
        &self.opts
    }

    /// Which backend runs attention.
    pub fn backend(&self) -> BackendKind {
        self.backend.kind()
    }

    /// Replaces the attention backend (crate-internal: input capture in `attention`, tests).
    pub(crate) fn set_backend(&mut self, backend: Box<dyn AttentionBackend>) {
        self.release_cache();
        self.backend = backend.into();
    }

    /// Counters so far.
    pub fn stats(&self) -> SessionStats {
        self.stats.clone()
    }

    /// Number of tokens fed since creation or reset (the next token's position).
    pub fn position(&self) -> u64 {
        self.stats.tokens
    }

    /// Stream positions of the entries retained by (layer, head), in slot order.
    pub fn cache_positions(&self, layer: usize, head: usize) -> Option<Vec<u64>> {
        Some(self.layers.get(layer)?.heads.get(head)?.pos.clone())
    }

    /// Live entries of (layer, head), for inspection and tests.
    pub fn cache_len(&self, layer: usize, head: usize) -> Option<usize> {
        Some(self.layers.get(layer)?.heads.get(head)?.len())
    }

    /// Feeds `tokens` (ids `< vocab`) and optionally writes logits: `logits_out.len()` must be
    /// `vocab` (the last token's next-token logits) or `tokens.len() * vocab` (every token's,
    /// row-major `[T, vocab]`).
    ///
    /// Errors from validation ([`Error::InvalidArgument`]) and allocation
    /// ([`Error::OutOfMemory`]) leave the session unchanged: they are checked before any
    /// state is touched. An internal error after that (a bug, or a checkpoint whose
    /// activations overflow) leaves the session poisoned: later feeds fail until `reset`.
    pub fn feed(&mut self, tokens: &[u32], logits_out: Option<&mut [f32]>) -> Result<()> {
        if self.opts.scored {
            return Err(Error::invalid(
                "this session ranks evictions by caller scores: use feed_scored",
            ));
        }
        self.feed_inner(tokens, None, logits_out, None)
    }

    /// [`Session::feed`] that also writes the residual stream, `[layers + 1, T, D]`: row
    /// block 0 = the embeddings, block `l + 1` = after layer `l` (before the final norm).
    pub fn feed_with_hidden(&mut self, tokens: &[u32], hidden_out: &mut [f32]) -> Result<()> {
        let info = self.model.info();
        let want = (info.layers + 1)
            .checked_mul(tokens.len())
            .and_then(|x| x.checked_mul(info.hidden));
        if want != Some(hidden_out.len()) {
            return Err(Error::invalid(format!(
                "hidden buffer has {} floats: expected (layers + 1) * tokens * hidden",
                hidden_out.len()
            )));
        }
        if self.opts.scored {
            return Err(Error::invalid("scored session: use feed_scored"));
        }
        self.feed_inner(tokens, None, None, Some(hidden_out))
    }

    /// [`Session::feed`] with one retention score per token (higher = keep longer), for a
    /// session created with `scored: true`; the budget evicts the lowest scores first.
    pub fn feed_scored(
        &mut self,
        tokens: &[u32],
        scores: &[f32],
        logits_out: Option<&mut [f32]>,
    ) -> Result<()> {
        if !self.opts.scored {
            return Err(Error::invalid(
                "scores given but the session was created with scored = false",
            ));
        }
        if scores.len() != tokens.len() {
            return Err(Error::invalid(format!(
                "{} scores for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        if let Some(i) = scores.iter().position(|x| x.is_nan()) {
            return Err(Error::invalid(format!("score {i} is NaN")));
        }
        self.feed_inner(tokens, Some(scores), logits_out, None)
    }

    /// Checks a feed before anything changes: a session not poisoned, at least one token,
    /// every id in the vocabulary.
    fn check_feed(&self, tokens: &[u32]) -> Result<()> {
        if self.poisoned {
            return Err(Error::Internal(
                "session poisoned by an earlier internal error: reset it".into(),
            ));
        }
        let vocab = self.model.info().vocab;
        if tokens.is_empty() {
            return Err(Error::invalid("no tokens to feed"));
        }
        if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(Error::invalid(format!(
                "token {} at index {i} is out of the vocabulary 0..{vocab}",
                tokens[i]
            )));
        }
        Ok(())
    }

    /// Counts a feed of `n` tokens that took `secs` (one token: decode; more: prefill).
    fn count_feed(&mut self, n: usize, secs: f64) {
        if n == 1 {
            self.stats.decode_tokens += 1;
            self.stats.decode_seconds += secs;
        } else {
            self.stats.prefill_tokens += n as u64;
            self.stats.prefill_seconds += secs;
        }
        self.update_cache_stats();
    }

    /// [`Session::feed_checked`] on the session's pool, if it has one.
    fn feed_inner(
        &mut self,
        tokens: &[u32],
        scores: Option<&[f32]>,
        logits_out: Option<&mut [f32]>,
        hidden: Option<&mut [f32]>,
    ) -> Result<()> {
        let pool = self.pool.clone();
        on_pool(pool.as_deref(), || {
            self.feed_checked(tokens, scores, logits_out, hidden)
        })
    }

    fn feed_checked(
        &mut self,
        tokens: &[u32],
        scores: Option<&[f32]>,
        logits_out: Option<&mut [f32]>,
        mut hidden: Option<&mut [f32]>,
    ) -> Result<()> {
        self.check_feed(tokens)?;
        let info = self.model.info();
        let all_rows = match &logits_out {
            None => false,
            Some(l) if l.len() == info.vocab => false,
            Some(l) if Some(l.len()) == tokens.len().checked_mul(info.vocab) => true,
            Some(l) => {
                return Err(Error::invalid(format!(
                    "logits buffer has {} floats: expected vocab = {} or tokens * vocab = {}",
                    l.len(),
                    info.vocab,
                    tokens.len().saturating_mul(info.vocab)
                )));
            }
        };
        self.reserve(tokens.len())?;

        let start = Instant::now();
        let mut logits_out = logits_out;
        let chunk = self.chunk_len(tokens.len(), hidden.is_some());
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, ids) in tokens.chunks(chunk).enumerate() {
            let logits = match logits_out.as_deref_mut() {
                Some(l) if all_rows => {
                    Some(&mut l[ci * chunk * info.vocab..][..ids.len() * info.vocab])
                }
                Some(l) if ci + 1 == n_chunks => Some(l),
                _ => None,
            };
            let sc = scores.map(|s| &s[ci * chunk..ci * chunk + ids.len()]);
            let hid = hidden.as_deref_mut().map(|h| (h, tokens.len(), ci * chunk));
            if let Err(e) = self.forward_chunk(ids, sc, logits, all_rows, hid) {
                self.poisoned = true;
                return Err(e);
            }
        }
        self.count_feed(tokens.len(), start.elapsed().as_secs_f64());
        Ok(())
    }

    /// Tokens per chunk of a feed of `n`: `prefill_chunk`, except on the device with the
    /// default `prefill_chunk`, where a chunk takes up to [`DEVICE_PREFILL_CHUNK`] tokens
    /// as far as the device holds their activations (fewer runs, wider matrix products).
    fn chunk_len(&self, n: usize, hidden: bool) -> usize {
        let chunk = self.opts.prefill_chunk;
        #[cfg(feature = "vulkan")]
        if let Some(d) = &self.device
            && !hidden
            && chunk == SessionOptions::default().prefill_chunk
        {
            return d.chunk_room(n.min(DEVICE_PREFILL_CHUNK)).max(chunk);
        }
        let _ = (n, hidden);
        chunk
    }

    /// Runs one chunk through every layer (on the device while the session has one and no
    /// hidden states are asked for) and writes the requested logits: the last row's, or
    /// every row's when `all_rows`.
    fn forward_chunk(
        &mut self,
        ids: &[u32],
        scores: Option<&[f32]>,
        logits: Option<&mut [f32]>,
        all_rows: bool,
        hidden: Option<(&mut [f32], usize, usize)>,
    ) -> Result<()> {
        #[cfg(feature = "vulkan")]
        if self.device.is_some() {
            if hidden.is_none() {
                return self.device_chunk(ids, scores, logits, all_rows);
            }
            // The CPU feeds this chunk: the device's copy of the stream falls behind.
            self.device = None;
        }
        // The forward reads "every row" from the buffer's length.
        let v = self.model.info().vocab;
        debug_assert!(!all_rows || logits.as_ref().is_some_and(|l| l.len() == ids.len() * v));
        let model = Arc::clone(&self.model);
        let member = Member {
            s: self,
            ids,
            scores,
            logits,
            hidden,
        };
        forward(&model, &mut [member])
    }

    /// Leaves the device (the session continues on the CPU from its host state): before a
    /// feed the device does not take part in, or a state the device does not hold.
    fn leave_device(&mut self) {
        #[cfg(feature = "vulkan")]
        {
            self.device = None;
        }
    }

    /// Advances several sessions of one model in one step: `tokens[i]` (one or more ids)
    /// is fed to `sessions[i]`. The dense layers run as one matrix product over every
    /// session's rows, so the weights are read once per step for all of them; attention
    /// runs per session over its own cache, with its own options, budget and statistics.
    /// A session may prefill a chunk while others decode one token. `logits`, when given,
    /// has `sessions.len() * vocab` floats: row `i` receives the next-token logits after
    /// session `i`'s last token.
    ///
    /// Each session ends in the state its own [`Session::feed`] of the same tokens gives,
    /// and its logits agree with that feed's within the summation-order difference of a
    /// matrix product over more rows (a decode step alone is a matrix-vector product).
    /// A feed longer than a session's `prefill_chunk` runs in rounds of one chunk each.
    ///
    /// Errors (checked before any session changes, naming the session): sessions of
    /// different models, a scored session (use [`Session::feed_scored`]), a poisoned one,
    /// no tokens, an id out of the vocabulary, `tokens` or `logits` of the wrong length
    /// ([`Error::InvalidArgument`]); [`Error::OutOfMemory`]. An internal error after that
    /// poisons every session of the batch.
    pub fn feed_batch(
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        if sessions.len() != tokens.len() {
            return Err(Error::invalid(format!(
                "{} sessions but {} token lists",
                sessions.len(),
                tokens.len()
            )));
        }
        let Some(first) = sessions.first() else {
            return Err(Error::invalid("no sessions to feed"));
        };
        let model = Arc::clone(&first.model);
        let vocab = model.info().vocab;
        for (i, (s, ids)) in sessions.iter().zip(tokens).enumerate() {
            if !Arc::ptr_eq(&s.model, &model) {
                return Err(Error::invalid(format!(
                    "session {i} runs another model than session 0"
                )));
            }
            if s.opts.scored {
                return Err(Error::invalid(format!(
                    "session {i} ranks evictions by caller scores: use feed_scored"
                )));
            }
            s.check_feed(ids)
                .map_err(|e| Error::invalid(format!("session {i}: {e}")))?;
        }
        if let Some(l) = &logits
            && Some(l.len()) != sessions.len().checked_mul(vocab)
        {
            return Err(Error::invalid(format!(
                "logits buffer has {} floats: expected sessions * vocab = {}",
                l.len(),
                sessions.len().saturating_mul(vocab)
            )));
        }
        for (s, ids) in sessions.iter_mut().zip(tokens) {
            s.reserve(ids.len())?;
        }
        for s in sessions.iter_mut() {
            s.leave_device();
        }
        let pool = sessions[0].pool.clone();
        on_pool(pool.as_deref(), || {
            Session::batch_rounds(&model, sessions, tokens, logits)
        })
    }

    /// The rounds of a checked [`Session::feed_batch`]: one chunk of every session with
    /// tokens left per round.
    fn batch_rounds(
        model: &Arc<Model>,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        let vocab = model.info().vocab;
        let start = Instant::now();
        let mut slots: Vec<Option<&mut [f32]>> = match logits {
            Some(l) => l.chunks_exact_mut(vocab).map(Some).collect(),
            None => (0..sessions.len()).map(|_| None).collect(),
        };
        for round in 0.. {
            let mut members = Vec::with_capacity(sessions.len());
            for ((s, ids), slot) in sessions.iter_mut().zip(tokens).zip(&mut slots) {
                let chunk = s.opts.prefill_chunk;
                let at = round * chunk;
                if at >= ids.len() {
                    continue;
                }
                let end = ids.len().min(at + chunk);
                members.push(Member {
                    s,
                    ids: &ids[at..end],
                    scores: None,
                    logits: if end == ids.len() { slot.take() } else { None },
                    hidden: None,
                });
            }
            if members.is_empty() {
                break;
            }
            let r = forward(model, &mut members);
            drop(members);
            if let Err(e) = r {
                for s in sessions.iter_mut() {
                    s.poisoned = true;
                }
                return Err(e);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        for (s, ids) in sessions.iter_mut().zip(tokens) {
            s.count_feed(ids.len(), secs);
        }
        Ok(())
    }

    /// Reserves cache rows for what `t` more tokens can add to every head, so that the
    /// forward cannot fail half-way on allocation.
    fn reserve(&mut self, t: usize) -> Result<()> {
        let hd = self.model.info().head_dim;
        let limit = self.policy_cfg.head_limit();
        let dtype = self.opts.cache_dtype;
        for l in &mut self.layers {
            for h in &mut l.heads {
                let want = (h.len() + t).min(limit).saturating_sub(h.len());
                h.reserve(want, hd, dtype)?;
            }
        }
        Ok(())
    }

    /// Refreshes the cache counters and certificates from the policies.
    fn update_cache_stats(&mut self) {
        let info = self.model.info();
        let eb = entry_bytes(info.head_dim, self.opts.cache_dtype) as u64;
        let (mut live, mut cert, mut forced, mut peak) = (0u64, 0u64, 0u64, 0u64);
        let mut max_bound = Some(0.0f64);
        for (l, ls) in self.layers.iter().enumerate() {
            let st = ls.policy.layer_stats();
            live += st.live as u64;
            cert += st.evicted_certified;
            forced += st.evicted_forced;
            peak += ls.peak_live as u64;
            for h in 0..info.heads {
                let b = match ls.policy.head_stats(h) {
                    Ok(hs) if hs.evicted_certified + hs.evicted_forced == 0 => Some(0.0),
                    // Without a bound valid for every token there is no certificate.
                    Ok(_) if !self.certified[l] => None,
                    Ok(hs) if hs.bound < 1.0 => Some(hs.bound),
                    // NaN, or a bound of 1 or more: no information.
                    _ => None,
                };
                self.stats.bound_per_head[l * info.heads + h] = b;
                max_bound = max_bound.zip(b).map(|(m, b)| m.max(b));
            }
        }
        self.stats.live_entries = live;
        self.stats.evicted_certified = cert;
        self.stats.evicted_forced = forced;
        self.stats.cache_bytes = live.saturating_mul(eb);
        let peak_bytes = peak.saturating_mul(eb);
        self.stats.peak_cache_bytes = self.stats.peak_cache_bytes.max(peak_bytes);
        self.stats.max_bound = max_bound;
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.release_cache();
    }
}
