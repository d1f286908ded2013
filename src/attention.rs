//! Forgetting attention on its own: run prefill or a decode step over your own q, k, v and
//! gates on any [`BackendKind`], and get a model's per-layer attention inputs for a token
//! sequence ([`capture_prefill`]).
//!
//! ```no_run
//! use foxedge::attention::{AcpMode, Engine, capture_prefill};
//! use foxedge::{BackendKind, Model};
//! use std::sync::Arc;
//! let model = Arc::new(Model::open("models/fox-tiny-pro")?);
//! let layers = capture_prefill(&model, &[0, b'd' as u32, b'e' as u32, b'f' as u32])?;
//! let engine = Engine::new(BackendKind::Auto)?;
//! let mut out = vec![0.0f32; layers[0].q.len()];
//! let stats = engine.prefill(&layers[0], AcpMode::Bound { ln_eps: -10.0 }, &mut out)?;
//! println!("kept {:.0}% of the pairs", 100.0 * stats.kept_fraction());
//! # Ok::<(), foxedge::Error>(())
//! ```
//!
//! Math (per head, scale `s = 1 / sqrt(head_dim)`): `o_i = sum_j w_ij v_j / sum_j w_ij`,
//! `w_ij = exp(s q_i k_j + c_i - c_j)`, `c_i = sum_{l <= i} log f_l`, over `j <= i` (prefill)
//! or the cache (decode); ACP skips key blocks whose weights are below `eps / N`.

use crate::aligned::AlignedF32;
use crate::backend::{
    AttentionBackend, BackendKind, CpuBackend, DecodeCall, PrefillCall, WriteJournal,
    fresh_cache_ids,
};
use crate::decisions::prefill_decisions;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::select::Opened;
use crate::session::{Session, SessionOptions};
use foxedge_core::contract::{Acp, CacheHead, DecodeArgs, HeadSync, acp};
use foxedge_core::gate;
use std::sync::{Arc, Mutex};

pub use crate::calibration::{Calibration, Line};
pub use crate::decisions::Boundary;
pub use crate::placement::{PlanCounts, Split};
pub use foxedge_core::contract::{AttentionStats, HeadStats};

/// How a call is pruned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AcpMode {
    /// Dense.
    Off,
    /// ACP with the inputs' logit bounds `u` and this `ln eps` (< 0):
    /// `delta_h = -2 U_h - ln N + ln eps` (ACP paper, section 3).
    Bound { ln_eps: f64 },
}

impl AcpMode {
    fn acp(self, u: &[f64]) -> Acp<'_> {
        match self {
            AcpMode::Off => Acp::Off,
            AcpMode::Bound { ln_eps } => Acp::Bound { u, ln_eps },
        }
    }
}

fn core_err(e: foxedge_core::Error) -> Error {
    Error::invalid(format!("attention input: {e}"))
}

/// One causal prefill from an empty cache: `t` tokens, `heads` heads of `head_dim`.
///
/// `q`, `k`, `v`: `[t, heads, head_dim]`; `log_f`: `[t, heads]` log forget gates (finite,
/// `<= 0`); `u`: `[heads]` logit bounds `U_h >= max |s q k|` used by [`AcpMode::Bound`].
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillInputs {
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub log_f: Vec<f32>,
    pub u: Vec<f64>,
}

impl PrefillInputs {
    /// Checks sizes, gates (finite, `<= 0`) and bounds (finite, `>= 0`).
    pub fn validate(&self) -> Result<()> {
        let (t, h, d) = (self.t, self.heads, self.head_dim);
        if t == 0 || h == 0 || d == 0 {
            return Err(Error::invalid("inputs: t, heads and head_dim must be > 0"));
        }
        let n = t
            .checked_mul(h)
            .and_then(|x| x.checked_mul(d))
            .ok_or_else(|| Error::invalid("inputs: t * heads * head_dim overflows"))?;
        for (name, len, want) in [
            ("q", self.q.len(), n),
            ("k", self.k.len(), n),
            ("v", self.v.len(), n),
            ("log_f", self.log_f.len(), t * h),
            ("u", self.u.len(), h),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "inputs: {name} has {len} values, expected {want}"
                )));
            }
        }
        gate::validate_log_gates(&self.log_f).map_err(core_err)?;
        if self.u.iter().any(|u| !(u.is_finite() && *u >= 0.0)) {
            return Err(Error::invalid(
                "inputs: logit bounds must be finite and >= 0",
            ));
        }
        Ok(())
    }

    fn call(&self, acp: AcpMode) -> PrefillCall<'_> {
        let (q, k, v) = (&self.q, &self.k, &self.v);
        PrefillCall::new(self.t, self.heads, self.head_dim, q, k, v, &self.log_f)
            .with_acp(acp.acp(&self.u))
    }

    /// The pruning boundary every backend uses for these inputs under `acp`.
    pub fn boundary(&self, acp: AcpMode) -> Result<Boundary> {
        self.validate()?;
        prefill_decisions(&self.call(acp))
    }

    /// The first `t` tokens.
    pub fn prefix(&self, t: usize) -> Result<PrefillInputs> {
        if t == 0 || t > self.t {
            return Err(Error::invalid(format!(
                "prefix of {t} tokens of {}-token inputs",
                self.t
            )));
        }
        let (h, d) = (self.heads, self.head_dim);
        Ok(PrefillInputs {
            t,
            heads: h,
            head_dim: d,
            q: self.q[..t * h * d].to_vec(),
            k: self.k[..t * h * d].to_vec(),
            v: self.v[..t * h * d].to_vec(),
            log_f: self.log_f[..t * h].to_vec(),
            u: self.u.clone(),
        })
    }

    /// The heads of every part side by side (same `t` and `head_dim`): heads are
    /// independent in attention, so layers' calls can run as one wider call.
    pub fn concat_heads(parts: &[PrefillInputs]) -> Result<PrefillInputs> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat_heads: no inputs"))?;
        let (t, d) = (first.t, first.head_dim);
        if parts.iter().any(|p| p.t != t || p.head_dim != d) {
            return Err(Error::invalid(
                "concat_heads: parts differ in t or head_dim",
            ));
        }
        let heads: usize = parts.iter().map(|p| p.heads).sum();
        let mut o = PrefillInputs {
            t,
            heads,
            head_dim: d,
            q: Vec::with_capacity(t * heads * d),
            k: Vec::with_capacity(t * heads * d),
            v: Vec::with_capacity(t * heads * d),
            log_f: Vec::with_capacity(t * heads),
            u: parts.iter().flat_map(|p| p.u.iter().copied()).collect(),
        };
        for r in 0..t {
            for p in parts {
                let row = r * p.heads * d..(r + 1) * p.heads * d;
                o.q.extend_from_slice(&p.q[row.clone()]);
                o.k.extend_from_slice(&p.k[row.clone()]);
                o.v.extend_from_slice(&p.v[row]);
                o.log_f
                    .extend_from_slice(&p.log_f[r * p.heads..(r + 1) * p.heads]);
            }
        }
        Ok(o)
    }

    /// The parts one after another in time (same heads and `head_dim`; `u` = the largest
    /// bound of each head, so it bounds every part).
    pub fn concat_time(parts: &[PrefillInputs]) -> Result<PrefillInputs> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat_time: no inputs"))?;
        let (h, d) = (first.heads, first.head_dim);
        if parts.iter().any(|p| p.heads != h || p.head_dim != d) {
            return Err(Error::invalid(
                "concat_time: parts differ in heads or head_dim",
            ));
        }
        let mut o = PrefillInputs {
            t: parts.iter().map(|p| p.t).sum(),
            heads: h,
            head_dim: d,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            log_f: Vec::new(),
            u: vec![0.0; h],
        };
        for p in parts {
            o.q.extend_from_slice(&p.q);
            o.k.extend_from_slice(&p.k);
            o.v.extend_from_slice(&p.v);
            o.log_f.extend_from_slice(&p.log_f);
            for (a, b) in o.u.iter_mut().zip(&p.u) {
                *a = a.max(*b);
            }
        }
        Ok(o)
    }

    /// A decode step at position `n - 1`: the cache holds tokens `0..n` of every head (the
    /// query's own key included), the query is token `n - 1`'s q.
    pub fn decode_at(&self, n: usize) -> Result<DecodeInputs> {
        self.validate()?;
        if n == 0 || n > self.t {
            return Err(Error::invalid(format!(
                "decode at {n} entries of {}-token inputs",
                self.t
            )));
        }
        let (h, d) = (self.heads, self.head_dim);
        let mut p = DecodeInputs {
            heads: h,
            head_dim: d,
            n,
            k: AlignedF32::with_capacity(h * n * d),
            v: AlignedF32::with_capacity(h * n * d),
            c: vec![0.0; h * n],
            q: Vec::with_capacity(h * d),
            q_c: Vec::with_capacity(h),
            u: self.u.clone(),
            steps: Steps::new(h, n),
        };
        for head in 0..h {
            for r in 0..n {
                p.k.extend_from_slice(&self.k[(r * h + head) * d..][..d]);
                p.v.extend_from_slice(&self.v[(r * h + head) * d..][..d]);
            }
            let c = &mut p.c[head * n..(head + 1) * n];
            gate::cumsum_strided(&self.log_f[head..], h, 0.0, c).map_err(core_err)?;
            p.q.extend_from_slice(&self.q[((n - 1) * h + head) * d..][..d]);
            p.q_c.push(c[n - 1]);
        }
        Ok(p)
    }
}

/// One decode step of one query per head against `n` cached entries per head.
///
/// Each [`Engine::decode`] of it is one step of a stream whose newest row was just
/// written, so a backend that keeps the cache resident on a device sends one
/// row per head per step after the first. After changing `k`, `v` or `c` in place, call
/// [`Engine::release`] or decode a clone (a clone is a new cache).
///
/// `k`, `v`: `[heads, n, head_dim]`; `c`: `[heads, n]` (f64); `q`: `[heads, head_dim]`;
/// `q_c`: `[heads]`; `u`: `[heads]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeInputs {
    pub heads: usize,
    pub head_dim: usize,
    pub n: usize,
    /// 64-byte aligned, as a session's cache is ([`AlignedF32`]).
    pub k: AlignedF32,
    pub v: AlignedF32,
    pub c: Vec<f64>,
    pub q: Vec<f32>,
    pub q_c: Vec<f64>,
    pub u: Vec<f64>,
    steps: Steps,
}

/// Version bookkeeping of a cache that stands still between decode steps except that each
/// step rewrites one row, as a session's step writes its token's key. Row `j` was written
/// at version `j + 1`; step `s` (1, 2, ...) rewrites row `n - 1 - (s - 1) mod n` at version
/// `n + s`: a different row each step (newest first, cycling), so the rows written since
/// any version are as many as the steps since (up to `n`). Every head shares the rows'
/// versions; ids are `base + head`.
#[derive(Debug)]
struct StepSync {
    heads: usize,
    base: u64,
    version: u64,
    row_version: Vec<u64>,
    /// The steps' writes, as a session journals its heads'.
    journal: WriteJournal,
}

impl StepSync {
    fn new(heads: usize, n: usize) -> StepSync {
        let mut journal = WriteJournal::default();
        journal.rewrote_all(n as u64);
        StepSync {
            heads,
            base: fresh_cache_ids(heads),
            version: n as u64,
            row_version: (1..=n as u64).collect(),
            journal,
        }
    }

    /// The next step: the next row (see the type docs) gets a fresh version.
    fn step(&mut self) {
        let n = self.row_version.len() as u64;
        if n == 0 {
            return;
        }
        let s = self.version - n;
        self.version += 1;
        let row = (n - 1 - s % n) as usize;
        self.row_version[row] = self.version;
        self.journal.wrote(row, self.version, n as usize);
    }

    fn sync(&self, head: usize) -> HeadSync<'_> {
        HeadSync {
            id: self.base + head as u64,
            version: self.version,
            row_version: &self.row_version,
            journal: Some(self.journal.view()),
        }
    }
}

/// [`StepSync`] behind a lock, so that steps run through `&DecodeInputs`. A clone is a new
/// cache (fresh ids); equality ignores it.
#[derive(Debug)]
struct Steps(Mutex<StepSync>);

impl Steps {
    fn new(heads: usize, n: usize) -> Steps {
        Steps(Mutex::new(StepSync::new(heads, n)))
    }
}

impl Clone for Steps {
    fn clone(&self) -> Steps {
        let (h, n) = self
            .0
            .lock()
            .map(|s| (s.heads, s.row_version.len()))
            .unwrap_or((0, 0));
        Steps::new(h, n)
    }
}

impl PartialEq for Steps {
    fn eq(&self, _: &Steps) -> bool {
        true
    }
}

impl DecodeInputs {
    /// The cache ids of this step's heads (what [`Engine::release`] frees).
    fn cache_ids(&self) -> Vec<u64> {
        let base = self.steps.0.lock().map_or(0, |s| s.base);
        (0..self.heads as u64).map(|h| base + h).collect()
    }

    /// Checks sizes and finiteness.
    pub fn validate(&self) -> Result<()> {
        self.check_sizes()?;
        if self.c.iter().chain(&self.q_c).any(|c| !c.is_finite()) {
            return Err(Error::invalid("decode inputs: c must be finite"));
        }
        Ok(())
    }

    /// Checks sizes and the bounds (finite, `>= 0`); O(heads), not O(cache).
    pub fn check_sizes(&self) -> Result<()> {
        let (h, n, d) = (self.heads, self.n, self.head_dim);
        if h == 0 || n == 0 || d == 0 {
            return Err(Error::invalid(
                "decode inputs: heads, n, head_dim must be > 0",
            ));
        }
        for (name, len, want) in [
            ("k", self.k.len(), h * n * d),
            ("v", self.v.len(), h * n * d),
            ("c", self.c.len(), h * n),
            ("q", self.q.len(), h * d),
            ("q_c", self.q_c.len(), h),
            ("u", self.u.len(), h),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "decode inputs: {name} has {len} values, expected {want}"
                )));
            }
        }
        if self.u.iter().any(|u| !(u.is_finite() && *u >= 0.0)) {
            return Err(Error::invalid(
                "decode inputs: bounds must be finite and >= 0",
            ));
        }
        Ok(())
    }
}

/// Attention on one [`BackendKind`], with a session's selection and fallback rules: `auto`
/// without a Vulkan device runs on the CPU, and a GPU that fails mid-stream hands over to
/// the CPU.
#[derive(Debug)]
pub struct Engine {
    opened: Opened,
}

impl Engine {
    /// The backend `kind` on the device `FOXEDGE_VULKAN_DEVICE` names (or the best one).
    pub fn new(kind: BackendKind) -> Result<Engine> {
        Engine::with_device(kind, None)
    }

    /// The backend `kind` on `device` (an index or a name substring; None = the
    /// environment variable, else the best device). `auto` without a device is the CPU.
    pub fn with_device(kind: BackendKind, device: Option<&str>) -> Result<Engine> {
        Ok(Engine {
            opened: crate::select::open(kind, device)?,
        })
    }

    fn backend(&self) -> &dyn AttentionBackend {
        self.opened.backend()
    }

    /// The backend in effect (`cpu` after a fallback).
    pub fn kind(&self) -> BackendKind {
        self.backend().kind()
    }

    /// The Vulkan device's name, if one is open.
    pub fn device(&self) -> Option<String> {
        match &self.opened {
            Opened::Cpu(_) => None,
            Opened::Vulkan(_, name) => Some(name.clone()),
            Opened::Placed(p) => Some(p.gpu_name().to_string()),
        }
    }

    /// Whether the GPU failed and the CPU took over.
    pub fn fell_back(&self) -> bool {
        !matches!(self.opened, Opened::Cpu(_)) && self.kind() == BackendKind::Cpu
    }

    /// `hybrid` and `auto`: the costs of calls of `heads` x `head_dim`, measured now if
    /// not yet (else at the first call). None for the other kinds.
    pub fn calibrate(&self, heads: usize, head_dim: usize) -> Result<Option<Calibration>> {
        match &self.opened {
            Opened::Placed(p) => p.calibration(heads, head_dim).map(Some),
            _ => Ok(None),
        }
    }

    /// `hybrid` and `auto`: where the heads of the last call ran.
    pub fn last_split(&self) -> Option<Split> {
        match &self.opened {
            Opened::Placed(p) => p.last_split(),
            _ => None,
        }
    }

    /// `hybrid` and `auto`: calls so far by plan (zero for the other kinds).
    pub fn plan_counts(&self) -> PlanCounts {
        match &self.opened {
            Opened::Placed(p) => p.plan_counts(),
            _ => PlanCounts::default(),
        }
    }

    /// Frees what the backend keeps of `p`'s cache (a device mirror); a later decode of
    /// `p` sends its whole cache again.
    pub fn release(&self, p: &DecodeInputs) {
        self.backend().release_cache(&p.cache_ids());
    }

    /// Prefill of `p` into `out` (`[t, heads, head_dim]`).
    pub fn prefill(
        &self,
        p: &PrefillInputs,
        acp: AcpMode,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        p.validate()?;
        if out.len() != p.q.len() {
            return Err(Error::invalid(format!(
                "prefill out has {} values, expected {}",
                out.len(),
                p.q.len()
            )));
        }
        self.backend().prefill(&p.call(acp), out)
    }

    /// One decode step of `p` into `out` (`[heads, head_dim]`).
    ///
    /// Checks sizes and bounds only, as a session's step does: every backend's kernel
    /// rejects a non-finite `c` itself (a scan of `heads n` values here would be a serial
    /// pass over the cache at every step).
    pub fn decode(
        &self,
        p: &DecodeInputs,
        acp: AcpMode,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        p.check_sizes()?;
        if out.len() != p.q.len() {
            return Err(Error::invalid(format!(
                "decode out has {} values, expected {}",
                out.len(),
                p.q.len()
            )));
        }
        let mut steps = p
            .steps
            .0
            .lock()
            .map_err(|_| Error::Internal("decode inputs lock poisoned".into()))?;
        if steps.row_version.len() != p.n || steps.heads != p.heads {
            // The sizes were changed through the public fields: a new cache.
            *steps = StepSync::new(p.heads, p.n);
        }
        steps.step();
        let (n, d) = (p.n, p.head_dim);
        let heads: Vec<CacheHead<'_, f32>> = (0..p.heads)
            .map(|h| CacheHead {
                k: &p.k[h * n * d..(h + 1) * n * d],
                v: &p.v[h * n * d..(h + 1) * n * d],
                c: &p.c[h * n..(h + 1) * n],
                pos: None,
            })
            .collect();
        let sync: Vec<HeadSync<'_>> = (0..p.heads).map(|h| steps.sync(h)).collect();
        let call = DecodeCall {
            args: DecodeArgs::one_query(d, &p.q, &p.q_c, &heads),
            sync: &sync,
            acp: acp.acp(&p.u),
        };
        self.backend().decode(&call, out)
    }
}

/// Records each prefill call's inputs, then runs it on the CPU.
#[derive(Debug)]
struct Recorder {
    calls: Arc<Mutex<Vec<PrefillInputs>>>,
}

impl AttentionBackend for Recorder {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        let (nh, d, a) = (call.heads(), call.head_dim(), call.args());
        let u = match call.acp() {
            Acp::Bound { u, .. } => u.to_vec(),
            // Observed norms: each head's U from this call's q and k, as the kernels take it.
            _ => {
                let scale = 1.0 / (d as f32).sqrt();
                (0..nh)
                    .map(|h| acp::observed_bound(a, scale, h, 0).map_err(core_err))
                    .collect::<Result<_>>()?
            }
        };
        let inputs = PrefillInputs {
            t: call.t(),
            heads: nh,
            head_dim: d,
            q: a.q.to_vec(),
            k: a.k.to_vec(),
            v: a.v.to_vec(),
            log_f: a.log_fgate.to_vec(),
            u,
        };
        self.calls
            .lock()
            .map_err(|_| Error::Internal("capture lock poisoned".into()))?
            .push(inputs);
        CpuBackend.prefill(call, out)
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        CpuBackend.decode(call, out)
    }
}

/// The attention of every layer of `model` on real text, as one call of `layers * heads`
/// heads (heads are independent, so the layers' calls stack side by side) and `len`
/// tokens. Up to one row's length it is the model run over the start of row 0; beyond,
/// the model runs over whole rows 0, 1, ... and their inputs are joined in time (real
/// gates of consecutive documents; `c` keeps falling across the joins).
///
/// Errors: `len == 0`, rows shorter than 2 tokens or too few rows for `len`
/// ([`Error::InvalidArgument`]); those of [`capture_prefill`].
pub fn capture_text(model: &Arc<Model>, rows: &[Vec<u32>], len: usize) -> Result<PrefillInputs> {
    let row_len = rows.first().map_or(0, Vec::len);
    if len == 0 || row_len < 2 {
        return Err(Error::InvalidArgument(
            "real gate inputs: need len > 0 and rows of >= 2 tokens".into(),
        ));
    }
    if len <= row_len {
        let layers = capture_prefill(model, &rows[0][..len.max(2)])?;
        return PrefillInputs::concat_heads(&layers)?.prefix(len);
    }
    let need = len.div_ceil(row_len);
    if need > rows.len() {
        return Err(Error::InvalidArgument(format!(
            "real gate inputs: {len} tokens need {need} rows of {row_len}, have {}",
            rows.len()
        )));
    }
    let parts = rows[..need]
        .iter()
        .map(|r| PrefillInputs::concat_heads(&capture_prefill(model, r)?))
        .collect::<Result<Vec<_>>>()?;
    PrefillInputs::concat_time(&parts)?.prefix(len)
}

/// Runs `model` over `tokens` (one prefill chunk, a fresh session) and returns the
/// attention inputs of every layer: q and k after QK-norm, the log gates as the kernels get
/// them, and the layer's logit bounds (for a model without QK-norm, each head's bound from
/// this call's largest q and k norms).
pub fn capture_prefill(model: &Arc<Model>, tokens: &[u32]) -> Result<Vec<PrefillInputs>> {
    if tokens.len() < 2 {
        return Err(Error::invalid("capture_prefill needs at least 2 tokens"));
    }
    let opts = SessionOptions {
        prefill_chunk: tokens.len(),
        max_entries_per_head: tokens
            .len()
            .max(SessionOptions::default().max_entries_per_head),
        certified_eviction: false,
        ..SessionOptions::default()
    };
    let mut s = Session::new(model.clone(), opts)?;
    let calls = Arc::new(Mutex::new(Vec::new()));
    s.set_backend(Box::new(Recorder {
        calls: calls.clone(),
    }));
    s.feed(tokens, None)?;
    let mut v = calls
        .lock()
        .map_err(|_| Error::Internal("capture lock poisoned".into()))?;
    let layers = model.info().layers;
    if v.len() != layers {
        return Err(Error::Internal(format!(
            "capture_prefill: {} attention calls for {layers} layers",
            v.len()
        )));
    }
    Ok(std::mem::take(&mut *v))
}

#[cfg(test)]
mod tests;
