//! A decoding session: per-layer state (retained K/V/c cache, k/v shift state, gate stream)
//! over a shared [`Model`], fed token ids in chunks (prefill) or one at a time (decode).

use crate::backend::{
    self, Acp, AttentionBackend, BackendKind, CacheHead, DecodeCall, PrefillCall,
};
use crate::config::{HiddenAct, OgateAct};
use crate::error::{Error, Result};
use crate::model::{LayerWeights, Model, QK_EPS};
use crate::ops;
use foxedge_core::gate::GateStream;
use std::sync::Arc;
use std::time::Instant;

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
    /// Tokens per prefill chunk (> 0). Default 16384.
    pub prefill_chunk: usize,
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
            prefill_chunk: 16384,
        }
    }
}

/// Counters of a session since creation or the last [`Session::reset`].
#[derive(Debug, Clone, Default, PartialEq)]
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
    /// The certificate `B_t` of each (layer, head), index `layer * heads + head`: a bound on
    /// the attention mass that the evicted entries can take from any query now or later.
    pub bound_per_head: Vec<f64>,
    /// The largest of `bound_per_head` (0 when nothing was evicted).
    pub max_bound: f64,
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

/// One head's retained entries, dense in slot order.
#[derive(Debug, Default, Clone)]
struct HeadCache {
    /// `[n, hd]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// `c_j` relative to the head's gate origin.
    c: Vec<f64>,
    /// Token position of each entry.
    pos: Vec<u64>,
}

impl HeadCache {
    fn len(&self) -> usize {
        self.c.len()
    }
}

/// Decode state of one layer.
#[derive(Debug, Clone)]
struct LayerState {
    /// Raw (pre-shift, pre-norm) k/v projection of the last token, `[D]` (spec §6).
    k_shift: Vec<f32>,
    v_shift: Vec<f32>,
    /// Cumulative log gate per head.
    gates: Vec<GateStream>,
    heads: Vec<HeadCache>,
}

/// Bytes held per cache entry: K and V (f32) plus c (f64) and position (u64).
fn entry_bytes(hd: usize) -> usize {
    2 * hd * 4 + 16
}

/// A stream of tokens through a model. Not `Sync` (one caller feeds it at a time) but `Send`.
#[derive(Debug)]
pub struct Session {
    model: Arc<Model>,
    opts: SessionOptions,
    backend: Box<dyn AttentionBackend>,
    layers: Vec<LayerState>,
    stats: SessionStats,
}

/// Scratch of one chunk forward, `t` rows.
struct Scratch {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    kv_raw_last: (Vec<f32>, Vec<f32>),
    alpha: Vec<f32>,
    log_f: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
}

impl Session {
    /// A fresh session over `model`.
    ///
    /// Errors: [`Error::InvalidArgument`] for inconsistent options,
    /// [`Error::BackendUnavailable`] when the backend cannot be used.
    pub fn new(model: Arc<Model>, opts: SessionOptions) -> Result<Session> {
        if opts.prefill_chunk == 0 {
            return Err(Error::invalid("prefill_chunk must be > 0"));
        }
        if let Some(e) = opts.ln_eps
            && !(e.is_finite() && e < 0.0)
        {
            return Err(Error::invalid(format!("ln eps {e} must be finite and < 0")));
        }
        let backend = backend::resolve(opts.backend)?;
        let mut s = Session {
            model,
            opts,
            backend,
            layers: Vec::new(),
            stats: SessionStats::default(),
        };
        s.reset();
        Ok(s)
    }

    /// Forgets every token: empty caches, zero shift states, zeroed statistics.
    pub fn reset(&mut self) {
        let info = self.model.info();
        self.layers = (0..info.layers)
            .map(|_| LayerState {
                k_shift: vec![0.0; info.hidden],
                v_shift: vec![0.0; info.hidden],
                gates: vec![GateStream::new(); info.heads],
                heads: vec![HeadCache::default(); info.heads],
            })
            .collect();
        self.stats = SessionStats {
            bound_per_head: vec![0.0; info.layers * info.heads],
            ..SessionStats::default()
        };
    }

    /// The model this session runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The options the session was created with.
    pub fn options(&self) -> &SessionOptions {
        &self.opts
    }

    /// Counters so far (cheap: a copy of a few numbers and the per-head bounds).
    pub fn stats(&self) -> SessionStats {
        self.stats.clone()
    }

    /// Number of tokens fed since creation or reset (the next token's position).
    pub fn position(&self) -> u64 {
        self.stats.tokens
    }

    /// Feeds `tokens` (ids `< vocab`) and optionally writes logits: `logits_out.len()` must be
    /// `vocab` (the last token's next-token logits) or `tokens.len() * vocab` (every token's,
    /// row-major `[T, vocab]`).
    ///
    /// Errors leave the session unchanged: arguments are validated and cache memory is
    /// reserved before any state is touched.
    pub fn feed(&mut self, tokens: &[u32], logits_out: Option<&mut [f32]>) -> Result<()> {
        let info = self.model.info();
        if tokens.is_empty() {
            return Err(Error::invalid("no tokens to feed"));
        }
        if let Some(i) = tokens.iter().position(|&t| t as usize >= info.vocab) {
            return Err(Error::invalid(format!(
                "token {} at index {i} is out of the vocabulary 0..{}",
                tokens[i], info.vocab
            )));
        }
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
        let chunk = self.opts.prefill_chunk;
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, ids) in tokens.chunks(chunk).enumerate() {
            let rows_out = match logits_out.as_deref_mut() {
                Some(l) if all_rows => {
                    Some(&mut l[ci * chunk * info.vocab..][..ids.len() * info.vocab])
                }
                Some(l) if ci + 1 == n_chunks => Some(l),
                _ => None,
            };
            self.forward_chunk(ids, rows_out, all_rows)?;
        }
        let secs = start.elapsed().as_secs_f64();
        let n = tokens.len() as u64;
        self.stats.tokens += n;
        if tokens.len() == 1 {
            self.stats.decode_tokens += 1;
            self.stats.decode_seconds += secs;
        } else {
            self.stats.prefill_tokens += n;
            self.stats.prefill_seconds += secs;
        }
        Ok(())
    }

    /// Reserves cache capacity for `t` more tokens in every head, so that the forward
    /// cannot fail half-way on allocation.
    fn reserve(&mut self, t: usize) -> Result<()> {
        let hd = self.model.info().head_dim;
        for l in &mut self.layers {
            for h in &mut l.heads {
                let want = t.min(self.opts.prefill_chunk.max(t));
                let oom = |_| Error::OutOfMemory {
                    what: "KV cache".into(),
                    bytes: want.saturating_mul(entry_bytes(hd)),
                };
                h.k.try_reserve(want.saturating_mul(hd)).map_err(oom)?;
                h.v.try_reserve(want.saturating_mul(hd)).map_err(oom)?;
                h.c.try_reserve(want).map_err(oom)?;
                h.pos.try_reserve(want).map_err(oom)?;
            }
        }
        Ok(())
    }

    /// Runs one chunk through every layer and writes the requested logits.
    fn forward_chunk(
        &mut self,
        ids: &[u32],
        logits: Option<&mut [f32]>,
        all_rows: bool,
    ) -> Result<()> {
        let model = Arc::clone(&self.model);
        let info = model.info();
        let (t, d) = (ids.len(), info.hidden);
        let mut h = vec![0.0f32; t * d];
        let emb = model.w(&model.embeddings);
        for (row, &id) in h.chunks_exact_mut(d).zip(ids) {
            row.copy_from_slice(&emb[id as usize * d..(id as usize + 1) * d]);
        }
        let mut s = Scratch::new(t, &info);
        let pos0 = self.stats.tokens;
        for l in 0..info.layers {
            self.layer_forward(&model, l, &mut h, t, pos0, &mut s)?;
        }
        if let Some(out) = logits {
            let (rows, hs) = if all_rows {
                (t, &h[..])
            } else {
                (1, &h[(t - 1) * d..])
            };
            let mut x = vec![0.0f32; rows * d];
            ops::rmsnorm(hs, model.w(&model.norm), model.config.norm_eps, &mut x);
            ops::linear(&x, rows, model.lm_head(), info.vocab, d, out, false);
        }
        Ok(())
    }

    /// One block on `t` rows of the residual stream `h` (spec §3, §6).
    fn layer_forward(
        &mut self,
        model: &Model,
        l: usize,
        h: &mut [f32],
        t: usize,
        pos0: u64,
        s: &mut Scratch,
    ) -> Result<()> {
        let cfg = &model.config;
        let info = model.info();
        let (d, nh, hd) = (info.hidden, info.heads, info.head_dim);
        let lw: &LayerWeights = &model.layers[l];
        let w = |x| model.w(x);

        ops::rmsnorm(h, w(&lw.attn_norm), cfg.norm_eps, &mut s.x);
        ops::linear(&s.x, t, w(&lw.q_proj), d, d, &mut s.q, false);
        let state = &mut self.layers[l];
        for (proj, out, st, last) in [
            (
                &lw.k_proj,
                &mut s.k,
                &mut state.k_shift,
                &mut s.kv_raw_last.0,
            ),
            (
                &lw.v_proj,
                &mut s.v,
                &mut state.v_shift,
                &mut s.kv_raw_last.1,
            ),
        ] {
            ops::linear(&s.x, t, w(proj.linear()), d, d, out, false);
            if let Some(ws) = proj.shift() {
                // α = sigmoid(x·Wsᵀ) weights the previous token's raw projection.
                ops::linear(&s.x, t, w(ws), nh, d, &mut s.alpha, false);
                last.copy_from_slice(&out[(t - 1) * d..t * d]);
                for r in (0..t).rev() {
                    for hh in 0..nh {
                        let a = ops::sigmoid(s.alpha[r * nh + hh]);
                        for c in hh * hd..(hh + 1) * hd {
                            let prev = if r == 0 { st[c] } else { out[(r - 1) * d + c] };
                            out[r * d + c] = a * prev + (1.0 - a) * out[r * d + c];
                        }
                    }
                }
                st.copy_from_slice(last);
            }
        }
        if let Some((qn, kn)) = &lw.qk_norm {
            ops::group_rmsnorm_inplace(&mut s.q, w(qn), hd, QK_EPS);
            ops::group_rmsnorm_inplace(&mut s.k, w(kn), hd, QK_EPS);
        }
        ops::linear(&s.x, t, w(&lw.fgate_w), nh, d, &mut s.log_f, false);
        let bias = w(&lw.fgate_b);
        for (i, z) in s.log_f.iter_mut().enumerate() {
            *z = foxedge_core::gate::logsigmoid(*z + bias[i % nh]);
        }

        self.attention(model, l, t, pos0, s)?;

        // Output norm / gate (spec §3.7), then o_proj into the residual.
        if let Some(on) = &lw.output_norm {
            ops::group_rmsnorm_inplace(&mut s.o, w(on), hd, cfg.norm_eps);
        }
        if let Some(og) = &lw.ogate {
            ops::linear(&s.x, t, w(og), d, d, &mut s.g, false);
            for (o, &g) in s.o.iter_mut().zip(&s.g) {
                let a = match cfg.ogate_act {
                    OgateAct::Sigmoid => ops::sigmoid(g),
                    OgateAct::Silu => ops::silu(g),
                };
                *o *= a;
            }
        }
        ops::linear(&s.o, t, w(&lw.o_proj), d, d, h, true);

        // MLP: h += (act(g) ⊙ u)·Wdᵀ with [g | u] = RMSNorm(h)·Wguᵀ.
        let i = info.intermediate;
        ops::rmsnorm(h, w(&lw.mlp_norm), cfg.norm_eps, &mut s.x);
        ops::linear(&s.x, t, w(&lw.gate_up), 2 * i, d, &mut s.gu, false);
        for r in 0..t {
            let (g, u) = s.gu[r * 2 * i..(r + 1) * 2 * i].split_at(i);
            for ((a, &g), &u) in s.act[r * i..(r + 1) * i].iter_mut().zip(g).zip(u) {
                *a = match cfg.hidden_act {
                    HiddenAct::Swish => ops::silu(g),
                    HiddenAct::Sigmoid => ops::sigmoid(g),
                } * u;
            }
        }
        ops::linear(&s.act, t, w(&lw.down), d, i, h, true);
        Ok(())
    }

    /// Forgetting attention of the chunk in `s.q/k/v/log_f` into `s.o`, appending the chunk's
    /// keys, values and `c` to the cache.
    fn attention(
        &mut self,
        model: &Model,
        l: usize,
        t: usize,
        pos0: u64,
        s: &mut Scratch,
    ) -> Result<()> {
        let info = model.info();
        let (nh, hd) = (info.heads, info.head_dim);
        let u = model.layers[l].u_bound.as_deref();
        let state = &mut self.layers[l];
        let empty = state.heads.iter().all(|h| h.len() == 0) && state.gates[0].is_empty();
        let acp = match (self.opts.ln_eps, u) {
            (None, _) => Acp::Off,
            (Some(ln_eps), Some(u)) => Acp::Bound { u, ln_eps },
            (Some(ln_eps), None) => Acp::ObservedNorms { ln_eps },
        };

        // c of the chunk per head; validated by the gate stream (finite, <= 0).
        let mut q_c = vec![0.0f64; nh * t];
        for hh in 0..nh {
            for r in 0..t {
                q_c[hh * t + r] = state.gates[hh].push(s.log_f[r * nh + hh])?;
            }
        }
        // Append the chunk's entries (the cache must hold a step's own keys).
        for (hh, hc) in state.heads.iter_mut().enumerate() {
            for r in 0..t {
                let at = r * nh * hd + hh * hd;
                hc.k.extend_from_slice(&s.k[at..at + hd]);
                hc.v.extend_from_slice(&s.v[at..at + hd]);
                hc.c.push(q_c[hh * t + r]);
                hc.pos.push(pos0 + r as u64);
            }
        }

        let stats = if empty && t > 1 {
            let call = PrefillCall {
                t,
                heads: nh,
                head_dim: hd,
                q: &s.q,
                k: &s.k,
                v: &s.v,
                log_f: &s.log_f,
                acp,
            };
            self.backend.prefill(&call, &mut s.o)?
        } else {
            // Queries head-first: [H, t, hd].
            let mut qh = vec![0.0f32; nh * t * hd];
            for r in 0..t {
                for hh in 0..nh {
                    qh[(hh * t + r) * hd..][..hd].copy_from_slice(&s.q[(r * nh + hh) * hd..][..hd]);
                }
            }
            let q_pos: Vec<u64> = (0..nh)
                .flat_map(|_| (0..t as u64).map(|r| pos0 + r))
                .collect();
            let heads: Vec<CacheHead<'_>> = state
                .heads
                .iter()
                .map(|hc| CacheHead {
                    k: &hc.k,
                    v: &hc.v,
                    c: &hc.c,
                    pos: if t > 1 { Some(&hc.pos) } else { None },
                })
                .collect();
            let dacp = match acp {
                Acp::ObservedNorms { .. } => Acp::Off,
                a => a,
            };
            let call = DecodeCall {
                head_dim: hd,
                n_queries: t,
                q: &qh,
                q_c: &q_c,
                q_pos: if t > 1 { Some(&q_pos) } else { None },
                heads: &heads,
                acp: dacp,
            };
            let mut oh = vec![0.0f32; nh * t * hd];
            let st = self.backend.decode(&call, &mut oh)?;
            for r in 0..t {
                for hh in 0..nh {
                    s.o[(r * nh + hh) * hd..][..hd].copy_from_slice(&oh[(hh * t + r) * hd..][..hd]);
                }
            }
            st
        };
        self.stats.kept_pairs += stats.kept_pairs.iter().sum::<u64>();
        self.stats.total_pairs += stats.total_pairs.iter().sum::<u64>();
        self.update_cache_stats();
        Ok(())
    }

    fn update_cache_stats(&mut self) {
        let hd = self.model.info().head_dim;
        let live: usize = self
            .layers
            .iter()
            .flat_map(|l| l.heads.iter().map(HeadCache::len))
            .sum();
        self.stats.live_entries = live as u64;
        self.stats.cache_bytes = (live * entry_bytes(hd)) as u64;
        self.stats.peak_cache_bytes = self.stats.peak_cache_bytes.max(self.stats.cache_bytes);
    }
}

impl Scratch {
    fn new(t: usize, info: &crate::model::ModelInfo) -> Scratch {
        let (d, nh, i) = (info.hidden, info.heads, info.intermediate);
        Scratch {
            x: vec![0.0; t * d],
            q: vec![0.0; t * d],
            k: vec![0.0; t * d],
            v: vec![0.0; t * d],
            kv_raw_last: (vec![0.0; d], vec![0.0; d]),
            alpha: vec![0.0; t * nh],
            log_f: vec![0.0; t * nh],
            o: vec![0.0; t * d],
            g: vec![0.0; t * d],
            gu: vec![0.0; t * 2 * i],
            act: vec![0.0; t * i],
        }
    }
}
