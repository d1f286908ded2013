//! Model and session handles: `fx_model_*` and `fx_session_*`.

use std::ffi::{CStr, c_char};
use std::mem::size_of;
use std::ptr;
use std::sync::Arc;

use facade::{Budget, CacheDtype, Model, ModelOptions, Session, SessionOptions, WeightFormat};

use crate::abi::{Versioned, check_buf, check_out, read_opt, write_out};
use crate::attention::{backend_of, fx_backend, fx_backend_raw};
use crate::status::{FxResult, fail, fx_status, fx_status::*, guard, invalid, map_facade};

/// A loaded model (opaque). Immutable: share it freely across threads.
#[derive(Debug)]
pub struct fx_model {
    pub(crate) model: Arc<Model>,
}

/// A decoding stream over a model (opaque). One thread at a time.
#[derive(Debug)]
pub struct fx_session {
    pub(crate) session: Session,
    /// Set when a call panicked mid-way: the state may be half-updated, so every call but
    /// `fx_session_reset` and `fx_session_free` fails until a reset.
    pub(crate) poisoned: bool,
}

// The header's thread-safety promises, checked by the compiler: a model is shared by
// reference across threads (Sync) and freed from any thread (Send); a session moves between
// threads (Send) but is never used by two at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    const fn movable<T: Send>() {}
    shareable::<Model>();
    movable::<Session>();
};

/// A weight storage format (`fx_model_options.weights`, `.vocab_weights`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_weight_format {
    /// As stored in the file (`weights`), or the same as `weights` (`vocab_weights`).
    FX_WEIGHTS_DEFAULT = 0,
    FX_WEIGHTS_F32 = 1,
    FX_WEIGHTS_F16 = 2,
    FX_WEIGHTS_BF16 = 3,
    /// 8-bit blocks: 32 weights and an f16 scale (8.5 bits per weight).
    FX_WEIGHTS_Q8 = 4,
    /// 4-bit blocks of 16 levels: 32 weights and an f16 scale (4.5 bits per weight).
    FX_WEIGHTS_Q4 = 5,
}

/// The `int32_t` C passes where the header says `fx_weight_format`.
pub type fx_weight_format_raw = i32;

/// Options of `fx_model_open`. Create with `fx_model_options_default()`.
///
/// Version 1 held `struct_size` and `flags` only; a caller built against it passes its
/// smaller `struct_size` and gets the defaults for the later fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_model_options {
    /// `sizeof(fx_model_options)`.
    pub struct_size: usize,
    /// Must be 0 (room for future flags).
    pub flags: u64,
    /// An `fx_weight_format` for the dense layers (q/k/v/o, output gate, MLP), converted
    /// once at load; FX_WEIGHTS_DEFAULT keeps the file's formats (a quantized file then
    /// loads without a copy). Default FX_WEIGHTS_DEFAULT.
    pub weights: fx_weight_format_raw,
    /// An `fx_weight_format` for the embeddings and the LM head; FX_WEIGHTS_DEFAULT
    /// follows `weights`. Default FX_WEIGHTS_DEFAULT.
    pub vocab_weights: fx_weight_format_raw,
    /// Tasks the dense products (and the conversions at load) are split into on the
    /// library's thread pool; 0 = one per thread of the pool. Default 0.
    pub threads: usize,
}

/// Sizes of a loaded model.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_model_info {
    /// `sizeof(fx_model_info)`: set by the caller before `fx_model_info`.
    pub struct_size: usize,
    /// Token ids are `0 .. vocab_size-1`; logits have `vocab_size` floats.
    pub vocab_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Channels per head: `hidden_size / n_heads`.
    pub head_dim: usize,
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Total parameters.
    pub n_params: u64,
}

/// The kind of hard limit on a session's retained (KV) cache.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_budget_kind {
    /// No hard limit (only certified eviction shrinks the cache).
    FX_BUDGET_NONE = 0,
    /// At most `budget` entries per head, in every layer.
    FX_BUDGET_ENTRIES_PER_HEAD = 1,
    /// At most `budget` entries per layer (all heads of the layer together).
    FX_BUDGET_ENTRIES_PER_LAYER = 2,
    /// At most `budget` bytes of cache in the whole session.
    FX_BUDGET_BYTES = 3,
}

/// The `int32_t` C passes where the header says `fx_budget_kind`.
pub type fx_budget_kind_raw = i32;

/// Options of `fx_session_new`. Create with `fx_session_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_session_options {
    /// `sizeof(fx_session_options)`.
    pub struct_size: usize,
    /// Where attention runs (default FX_BACKEND_CPU).
    pub backend: fx_backend_raw,
    /// 1: ACP pruning and certified eviction with `log_eps`; 0: dense, no certificate.
    pub acp: i32,
    /// ln eps (nats, finite, < 0) of ACP and of the eviction certificate. Default -10.
    pub log_eps: f64,
    /// 1: evict entries whose certified bound allows it (needs `acp`). Default 1.
    pub certified_eviction: i32,
    /// An `fx_budget_kind` value; `budget` is its limit (> 0 unless FX_BUDGET_NONE).
    pub budget_kind: fx_budget_kind_raw,
    pub budget: u64,
    /// The most recent `window` tokens of every head are never evicted.
    pub window: usize,
    /// The first `sinks` tokens of the stream are never evicted.
    pub sinks: usize,
    /// Tokens per prefill chunk (> 0). Default 512.
    pub prefill_chunk: usize,
    /// Cache slots per head when `budget_kind` is FX_BUDGET_NONE: beyond it the oldest
    /// entries are force-evicted (and the bound reports it). Default 32768.
    pub max_entries_per_head: usize,
    /// 1: forced evictions drop the lowest caller scores first (`fx_session_feed_scored`);
    /// 0: the smallest weight bound first. Default 0.
    pub scored: i32,
    /// Threads of the session's own pool, which runs its attention kernels and dense layers
    /// (at most 1024); 0 (default): the library's shared pool, one thread per core.
    pub n_threads: usize,
    /// An `fx_cache_dtype` value: how the cache stores K and V rows. Added after
    /// `n_threads`: a caller's older, shorter struct gets the default.
    pub cache_dtype: fx_cache_dtype_raw,
}

/// How a session's cache stores K and V rows (compute is f32 either way).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_cache_dtype {
    /// 4 bytes per value.
    FX_CACHE_F32 = 0,
    /// 2 bytes per value (IEEE half): half the cache memory.
    FX_CACHE_F16 = 1,
}

/// The `int32_t` C passes where the header says `fx_cache_dtype`.
pub type fx_cache_dtype_raw = i32;

/// Counters of a session since creation or the last reset.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_session_stats {
    /// `sizeof(fx_session_stats)`: set by the caller before `fx_session_stats`.
    pub struct_size: usize,
    /// Tokens fed in total (the next token's position).
    pub tokens: u64,
    /// Tokens fed in calls of more than one token, and their wall time (seconds).
    pub prefill_tokens: u64,
    pub prefill_seconds: f64,
    /// Tokens fed one per call, and their wall time (seconds).
    pub decode_tokens: u64,
    pub decode_seconds: f64,
    /// Cache entries alive now, summed over layers and heads.
    pub live_entries: u64,
    /// Entries evicted under the certificate (bound <= eps), and beyond it by the budget.
    pub evicted_certified: u64,
    pub evicted_forced: u64,
    /// Bytes of retained cache now, and the most ever held.
    pub cache_bytes: u64,
    pub peak_cache_bytes: u64,
    /// Query-key pairs attended, and attendable (causal), over all attention calls.
    pub kept_pairs: u64,
    pub total_pairs: u64,
    /// The largest certified bound B_t over (layer, head): the attention mass that evicted
    /// entries can take from any query now or later (0 when nothing was evicted). Valid
    /// only when `bound_holds` is 1; otherwise it is 1, the trivial bound.
    pub max_bound: f64,
    /// 1: `max_bound` is a certified bound below 1. 0: no guarantee: entries were evicted
    /// and the model has no logit bound valid for every token (no QK-norm), or forced
    /// evictions pushed the bound to 1 or beyond.
    pub bound_holds: i32,
}

// SAFETY: repr(C), first field usize, only integer fields.
unsafe impl Versioned for fx_model_options {
    const NAME: &'static str = "fx_model_options";
    /// Version 1: `struct_size` and `flags`.
    const MIN_SIZE: usize = 16;
    fn default_value() -> Self {
        fx_model_options_default()
    }
}

// SAFETY: repr(C), first field usize, only integer fields.
unsafe impl Versioned for fx_model_info {
    const NAME: &'static str = "fx_model_info";
    fn default_value() -> Self {
        fx_model_info {
            struct_size: size_of::<Self>(),
            vocab_size: 0,
            n_layers: 0,
            n_heads: 0,
            head_dim: 0,
            hidden_size: 0,
            intermediate_size: 0,
            n_params: 0,
        }
    }
}

// SAFETY: repr(C), first field usize, only integer and float fields.
unsafe impl Versioned for fx_session_options {
    const NAME: &'static str = "fx_session_options";
    /// The first version ended before `n_threads`.
    const MIN_SIZE: usize = std::mem::offset_of!(fx_session_options, n_threads);
    fn default_value() -> Self {
        fx_session_options_default()
    }
}

// SAFETY: repr(C), first field usize, only integer and float fields.
unsafe impl Versioned for fx_session_stats {
    const NAME: &'static str = "fx_session_stats";
    /// The first version ended before `bound_holds`.
    const MIN_SIZE: usize = std::mem::offset_of!(fx_session_stats, bound_holds);
    fn default_value() -> Self {
        fx_session_stats {
            struct_size: size_of::<Self>(),
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
            max_bound: 0.0,
            bound_holds: 1,
        }
    }
}

/// Returns the default model options (`struct_size` set, no flags, weights as stored,
/// threads from the pool).
#[unsafe(no_mangle)]
pub extern "C" fn fx_model_options_default() -> fx_model_options {
    fx_model_options {
        struct_size: size_of::<fx_model_options>(),
        flags: 0,
        weights: fx_weight_format::FX_WEIGHTS_DEFAULT as i32,
        vocab_weights: fx_weight_format::FX_WEIGHTS_DEFAULT as i32,
        threads: 0,
    }
}

/// An `fx_weight_format` value as a format (None: the default).
fn weight_format(v: i32, field: &str) -> FxResult<Option<WeightFormat>> {
    Ok(Some(match v {
        0 => return Ok(None),
        1 => WeightFormat::F32,
        2 => WeightFormat::F16,
        3 => WeightFormat::Bf16,
        4 => WeightFormat::Q8,
        5 => WeightFormat::Q4,
        _ => {
            return Err(invalid(format!(
                "fx_model_options.{field} is {v}; expected an fx_weight_format (0 to 5)"
            )));
        }
    }))
}

/// Translates the C model options to the facade's.
fn model_options(o: &fx_model_options) -> FxResult<ModelOptions> {
    if o.flags != 0 {
        return Err(invalid(format!(
            "fx_model_options.flags is {}; must be 0",
            o.flags
        )));
    }
    Ok(ModelOptions {
        weights: weight_format(o.weights, "weights")?,
        vocab_weights: weight_format(o.vocab_weights, "vocab_weights")?,
        threads: o.threads,
    })
}

/// Returns the default session options: CPU backend, ACP and certified eviction on with
/// ln eps = -10, no budget, no window, no sinks, prefill chunks of 512 tokens, an f32 cache.
#[unsafe(no_mangle)]
pub extern "C" fn fx_session_options_default() -> fx_session_options {
    let d = SessionOptions::default();
    fx_session_options {
        struct_size: size_of::<fx_session_options>(),
        backend: fx_backend::FX_BACKEND_CPU as i32,
        acp: i32::from(d.ln_eps.is_some()),
        log_eps: d.ln_eps.unwrap_or(foxedge_core::threshold::DEFAULT_LN_EPS),
        certified_eviction: i32::from(d.certified_eviction),
        budget_kind: fx_budget_kind::FX_BUDGET_NONE as i32,
        budget: 0,
        window: d.window,
        sinks: d.sinks,
        prefill_chunk: d.prefill_chunk,
        max_entries_per_head: d.max_entries_per_head,
        scored: i32::from(d.scored),
        n_threads: d.threads,
        cache_dtype: match d.cache_dtype {
            CacheDtype::F32 => fx_cache_dtype::FX_CACHE_F32,
            CacheDtype::F16 => fx_cache_dtype::FX_CACHE_F16,
        } as i32,
    }
}

fn flag(v: i32, field: &str) -> FxResult<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(invalid(format!(
            "fx_session_options.{field} is {v}; expected 0 or 1"
        ))),
    }
}

/// Translates the C options to the facade's, checking enum values and ranges.
fn session_options(o: &fx_session_options) -> FxResult<SessionOptions> {
    let backend = backend_of(o.backend)?;
    let acp = flag(o.acp, "acp")?;
    let certified_eviction = flag(o.certified_eviction, "certified_eviction")?;
    let scored = flag(o.scored, "scored")?;
    let to_usize = |v: u64| {
        usize::try_from(v).map_err(|_| invalid(format!("budget {v} does not fit in size_t")))
    };
    let budget = match o.budget_kind {
        0 => None,
        1..=3 if o.budget == 0 => {
            return Err(invalid(
                "fx_session_options.budget is 0: a budget must allow at least one entry \
                 (use FX_BUDGET_NONE for no limit)",
            ));
        }
        1 => Some(Budget::EntriesPerHead(to_usize(o.budget)?)),
        2 => Some(Budget::EntriesPerLayer(to_usize(o.budget)?)),
        3 => Some(Budget::Bytes(to_usize(o.budget)?)),
        k => {
            return Err(invalid(format!(
                "fx_session_options.budget_kind {k} is not an fx_budget_kind"
            )));
        }
    };
    let cache_dtype = match o.cache_dtype {
        0 => CacheDtype::F32,
        1 => CacheDtype::F16,
        k => {
            return Err(invalid(format!(
                "fx_session_options.cache_dtype {k} is not an fx_cache_dtype"
            )));
        }
    };
    // Facade options the C ABI does not expose keep their defaults.
    #[allow(clippy::needless_update)]
    Ok(SessionOptions {
        cache_dtype,
        backend,
        ln_eps: acp.then_some(o.log_eps),
        certified_eviction,
        budget,
        window: o.window,
        sinks: o.sinks,
        prefill_chunk: o.prefill_chunk,
        max_entries_per_head: o.max_entries_per_head,
        scored,
        threads: o.n_threads,
        ..SessionOptions::default()
    })
}

/// Opens a model: a directory holding `config.json` and `model.safetensors` (or that
/// `model.safetensors` file), its weights held as `opts` says (converted or quantized once
/// at load where that differs from the file). `opts` may be NULL (defaults). On success `*out` receives a
/// handle to free with `fx_model_free`; on failure `*out` is set to NULL.
///
/// # Safety
/// `path` must be NULL or NUL-terminated; `opts` NULL or a readable `struct_size` prefix; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_model_open(
    path: *const c_char,
    opts: *const fx_model_options,
    out: *mut *mut fx_model,
) -> fx_status {
    guard(|| {
        check_buf(out, "out")?;
        // SAFETY: out is non-null and aligned (checked); clear it so a failure leaves NULL.
        unsafe { out.write(std::ptr::null_mut()) };
        if path.is_null() {
            return Err(fail(FX_ERR_NULL_POINTER, "path is NULL"));
        }
        // SAFETY: C contract: opts is NULL or a readable fx_model_options prefix.
        let o = unsafe { read_opt(opts) }?.unwrap_or_else(|| fx_model_options_default());
        let mo = model_options(&o)?;
        // SAFETY: non-null, and the C contract says path is NUL-terminated.
        let path = unsafe { CStr::from_ptr(path) };
        let path = path
            .to_str()
            .map_err(|_| invalid("path is not valid UTF-8"))?;
        if path.is_empty() {
            return Err(invalid("path is empty"));
        }
        let model = Model::open_with(path, &mo).map_err(map_facade)?;
        let handle = Box::new(fx_model {
            model: Arc::new(model),
        });
        // SAFETY: checked above.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Frees a model (NULL is a no-op). Sessions made from it stay valid.
///
/// # Safety
/// `m` must be NULL or a handle from `fx_model_open` not yet freed, and no other call may use it concurrently.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_model_free(m: *mut fx_model) {
    let _ = guard(|| {
        if !m.is_null() {
            // SAFETY: C contract: m came from fx_model_open and is freed once.
            drop(unsafe { Box::from_raw(m) });
        }
        Ok(())
    });
}

/// Fills `*out` (set `out->struct_size` first) with the model's sizes.
///
/// # Safety
/// `m` must be NULL or a live handle; `out` NULL or a writable struct of its `struct_size`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_model_info(m: *const fx_model, out: *mut fx_model_info) -> fx_status {
    guard(|| {
        // SAFETY: C contract: m is NULL or a live handle.
        let m = unsafe { m.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "model is NULL"))?;
        // SAFETY: C contract: out is NULL or a writable fx_model_info.
        let size = unsafe { check_out(out, "out") }?;
        let i = m.model.info();
        let info = fx_model_info {
            struct_size: size,
            vocab_size: i.vocab,
            n_layers: i.layers,
            n_heads: i.heads,
            head_dim: i.head_dim,
            hidden_size: i.hidden,
            intermediate_size: i.intermediate,
            n_params: i.params as u64,
        };
        // SAFETY: size came from check_out on out.
        unsafe { write_out(out, size, info) };
        Ok(())
    })
}

/// Creates a session over `m` (which it keeps alive). `opts` may be NULL (defaults). On
/// failure `*out` is set to NULL.
///
/// # Safety
/// `m` must be NULL or a live handle; `opts` NULL or a readable `struct_size` prefix; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_new(
    m: *const fx_model,
    opts: *const fx_session_options,
    out: *mut *mut fx_session,
) -> fx_status {
    guard(|| {
        check_buf(out, "out")?;
        // SAFETY: non-null and aligned (checked).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: C contract: m is NULL or a live handle.
        let m = unsafe { m.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "model is NULL"))?;
        // SAFETY: C contract: opts is NULL or a readable fx_session_options prefix.
        let o = unsafe { read_opt(opts) }?.unwrap_or_else(|| fx_session_options_default());
        let so = session_options(&o)?;
        let session = Session::new(m.model.clone(), so).map_err(map_facade)?;
        let handle = Box::new(fx_session {
            session,
            poisoned: false,
        });
        // SAFETY: checked above.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

pub(crate) fn live(s: &fx_session) -> FxResult<()> {
    if s.poisoned {
        return Err(fail(
            FX_ERR_INTERNAL,
            "session is unusable after an internal error; call fx_session_reset",
        ));
    }
    Ok(())
}

/// Runs a state-changing facade call. A panic inside it may leave the session half-updated,
/// so it marks the handle poisoned before the panic continues to the guard.
pub(crate) fn mutate(
    s: &mut fx_session,
    f: impl FnOnce(&mut Session) -> facade::Result<()>,
) -> FxResult<()> {
    let session = &mut s.session;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(session))) {
        Ok(r) => r.map_err(map_facade),
        Err(payload) => {
            s.poisoned = true;
            std::panic::resume_unwind(payload)
        }
    }
}

/// Feeds `n` tokens (ids in `0 .. vocab_size-1`) and, when `logits_out` is not NULL, writes
/// the last token's next-token logits (`vocab_size` floats). A failed call changes nothing.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `tokens` must hold `n` values and `logits_out` (if not NULL) `vocab_size` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_feed(
    s: *mut fx_session,
    tokens: *const i32,
    n: usize,
    logits_out: *mut f32,
) -> fx_status {
    // SAFETY: forwarded C contract (no scores).
    unsafe { feed(s, tokens, ptr::null(), n, logits_out) }
}

/// Shared body of `fx_session_feed` and `fx_session_feed_scored` (`scores` NULL: unscored).
///
/// # Safety
/// As for `fx_session_feed_scored`.
unsafe fn feed(
    s: *mut fx_session,
    tokens: *const i32,
    scores: *const f32,
    n: usize,
    logits_out: *mut f32,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle used by this thread only.
        let s =
            unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        check_buf(tokens, "tokens")?;
        if n == 0 {
            return Err(invalid("n is 0: feed at least one token"));
        }
        if n > isize::MAX as usize / size_of::<i32>() {
            return Err(invalid(format!("n = {n} tokens cannot be addressed")));
        }
        // SAFETY: non-null and aligned (checked); C contract: n readable int32 values.
        let toks = unsafe { std::slice::from_raw_parts(tokens, n) };
        let mut ids = Vec::new();
        ids.try_reserve_exact(n)
            .map_err(|_| fail(FX_ERR_OUT_OF_MEMORY, format!("{n} token ids")))?;
        for (i, &t) in toks.iter().enumerate() {
            let id = u32::try_from(t)
                .map_err(|_| invalid(format!("token {t} at index {i} is negative")))?;
            ids.push(id);
        }
        let score_copy = if scores.is_null() {
            None
        } else {
            check_buf(scores, "scores")?;
            // SAFETY: non-null, aligned (checked); C contract: n readable floats.
            Some(unsafe { std::slice::from_raw_parts(scores, n) }.to_vec())
        };
        let vocab = s.session.model().info().vocab;
        let logits = if logits_out.is_null() {
            None
        } else {
            check_buf(logits_out, "logits_out")?;
            // SAFETY: non-null, aligned (checked); C contract: vocab_size writable floats.
            // Tokens and scores were copied out, so aliasing them cannot be observed.
            Some(unsafe { std::slice::from_raw_parts_mut(logits_out, vocab) })
        };
        match score_copy {
            None => mutate(s, |session| session.feed(&ids, logits)),
            Some(sc) => mutate(s, |session| session.feed_scored(&ids, &sc, logits)),
        }
    })
}

/// Like `fx_session_feed`, with one retention score per token (`scores`, `n` floats,
/// higher = keep longer) for a session created with `scored = 1`: when the budget forces an
/// eviction, the lowest score outside the protected window and sinks goes first.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `tokens` and
/// `scores` must hold `n` values and `logits_out` (if not NULL) `vocab_size` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_feed_scored(
    s: *mut fx_session,
    tokens: *const i32,
    scores: *const f32,
    n: usize,
    logits_out: *mut f32,
) -> fx_status {
    if scores.is_null() {
        return guard(|| Err(fail(FX_ERR_NULL_POINTER, "scores is NULL")));
    }
    // SAFETY: forwarded C contract.
    unsafe { feed(s, tokens, scores, n, logits_out) }
}

/// Fills `*out` (set `out->struct_size` first) with the session's counters.
///
/// # Safety
/// `s` must be NULL or a live handle not being fed concurrently; `out` NULL or a writable struct of its `struct_size`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_stats(
    s: *const fx_session,
    out: *mut fx_session_stats,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle.
        let s =
            unsafe { s.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        // SAFETY: C contract: out is NULL or a writable fx_session_stats.
        let size = unsafe { check_out(out, "out") }?;
        let st = s.session.stats();
        let v = fx_session_stats {
            struct_size: size,
            tokens: st.tokens,
            prefill_tokens: st.prefill_tokens,
            prefill_seconds: st.prefill_seconds,
            decode_tokens: st.decode_tokens,
            decode_seconds: st.decode_seconds,
            live_entries: st.live_entries,
            evicted_certified: st.evicted_certified,
            evicted_forced: st.evicted_forced,
            cache_bytes: st.cache_bytes,
            peak_cache_bytes: st.peak_cache_bytes,
            kept_pairs: st.kept_pairs,
            total_pairs: st.total_pairs,
            max_bound: st.max_bound.unwrap_or(1.0),
            bound_holds: i32::from(st.max_bound.is_some()),
        };
        // SAFETY: size came from check_out on out.
        unsafe { write_out(out, size, v) };
        Ok(())
    })
}

/// Copies the certified eviction bound B_t of every (layer, head) into `out`
/// (`n = n_layers * n_heads` doubles, index `layer * n_heads + head`). A certified bound is
/// below 1; a head without a guarantee (see `bound_holds` of `fx_session_stats`) reports 1,
/// the trivial bound.
///
/// # Safety
/// `s` must be NULL or a live handle not being fed concurrently; `out` must hold `n` doubles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_head_bounds(
    s: *const fx_session,
    out: *mut f64,
    n: usize,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle.
        let s =
            unsafe { s.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        check_buf(out, "out")?;
        let b = s.session.stats().bound_per_head;
        if n != b.len() {
            return Err(invalid(format!(
                "n is {n}; expected n_layers * n_heads = {}",
                b.len()
            )));
        }
        // SAFETY: non-null, aligned (checked); C contract: n writable doubles.
        let dst = unsafe { std::slice::from_raw_parts_mut(out, n) };
        for (d, b) in dst.iter_mut().zip(&b) {
            *d = b.unwrap_or(1.0);
        }
        Ok(())
    })
}

/// Forgets every token (empty cache, zero counters); also clears an internal-error state.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_reset(s: *mut fx_session) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle used by this thread only.
        let s =
            unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        mutate(s, Session::reset)?;
        s.poisoned = false;
        Ok(())
    })
}

/// Frees a session (NULL is a no-op).
///
/// # Safety
/// `s` must be NULL or a handle from `fx_session_new` not yet freed, used by no other thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_free(s: *mut fx_session) {
    let _ = guard(|| {
        if !s.is_null() {
            // SAFETY: C contract: s came from fx_session_new and is freed once.
            drop(unsafe { Box::from_raw(s) });
        }
        Ok(())
    });
}
