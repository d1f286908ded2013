//! The model's forward pass over the rows of one or more sessions: the dense layers as
//! matrix products over every session's rows at once (spec §3), attention per session over
//! its own retained cache (spec §6), and the logits.
//!
//! One session's feed is a batch of one; [`Session::feed_batch`] advances several sessions
//! of one model in one step, so a decode step of `B` sessions reads every weight once
//! instead of `B` times.

use super::cache::{HeadCache, RowsOf};
use super::{CacheDtype, LayerState, REBASE_AT, Session};
use crate::backend::{AttentionBackend, ContinueCall, DecodeCall, KvElem, PrefillCall};
use crate::config::{HiddenAct, OgateAct};
use crate::error::{Error, Result};
use crate::matrix::WeightMatrix;
use crate::model::{LayerWeights, Model, ModelInfo, QK_EPS};
use crate::ops;
use foxedge_core::contract::{Acp, AttentionStats, ContinueArgs, DecodeArgs, HeadSync};
use foxedge_core::retention::{Eviction, EvictionKind};
use foxedge_cpu::linear::ROW_EXACT_ROWS;
use half::f16;
use std::ops::Range;

/// One session's part of a forward step: the chunk of token ids it feeds, their scores (a
/// scored session), and where its outputs go.
pub(super) struct Member<'a> {
    pub s: &'a mut Session,
    pub ids: &'a [u32],
    pub scores: Option<&'a [f32]>,
    /// Logits of the last row (`vocab` values) or of every row (`ids.len() * vocab`).
    pub logits: Option<&'a mut [f32]>,
    /// The residual stream before each layer and after the last, `(buffer, rows of the
    /// whole feed, first row of this chunk)`: see [`Session::feed_with_hidden`].
    pub hidden: Option<(&'a mut [f32], usize, usize)>,
}

/// Scratch of one forward step, `t` rows (every member's).
pub(super) struct Scratch {
    pub(super) x: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) kv_raw_last: (Vec<f32>, Vec<f32>),
    pub(super) alpha: Vec<f32>,
    pub(super) alpha_v: Vec<f32>,
    pub(super) log_f: Vec<f32>,
    pub(super) o: Vec<f32>,
    pub(super) g: Vec<f32>,
    pub(super) gu: Vec<f32>,
    pub(super) act: Vec<f32>,
}

/// One member's rows of the attention inputs and output (`t` rows).
struct Io<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    log_f: &'a [f32],
    o: &'a mut [f32],
}

/// Where each member's rows lie in the stacked matrices of a step, and the row groups the
/// dense products run in.
///
/// Members of one row (decode steps) come first and share products of up to
/// [`ROW_EXACT_ROWS`] rows, so every weight is read once for all of them; each longer
/// member's rows are a product of their own. Each row's outputs are then the bits of that
/// member fed alone: a decode step alone is a one-row product, which gives a row the bits
/// it has among up to `ROW_EXACT_ROWS` rows, and a chunk is the same product alone or in
/// a batch.
pub(super) struct Layout {
    /// First row of each member.
    rows: Vec<usize>,
    /// The dense products' row ranges, covering `0..t` in order.
    groups: Vec<Range<usize>>,
    /// Rows in all.
    t: usize,
}

impl Layout {
    pub(super) fn new(members: &[Member<'_>]) -> Layout {
        let mut rows = vec![0; members.len()];
        let mut t = 0;
        for (r, m) in rows.iter_mut().zip(members) {
            if m.ids.len() == 1 {
                *r = t;
                t += 1;
            }
        }
        let mut groups = shared_groups(0..t);
        for (r, m) in rows.iter_mut().zip(members) {
            if m.ids.len() != 1 {
                *r = t;
                groups.push(t..t + m.ids.len());
                t += m.ids.len();
            }
        }
        Layout { rows, groups, t }
    }

    /// Members in the order of their rows.
    fn order(&self) -> Vec<usize> {
        let mut o: Vec<usize> = (0..self.rows.len()).collect();
        o.sort_by_key(|&i| self.rows[i]);
        o
    }
}

/// `rows` in pieces of at most [`ROW_EXACT_ROWS`].
fn shared_groups(rows: Range<usize>) -> Vec<Range<usize>> {
    rows.clone()
        .step_by(ROW_EXACT_ROWS)
        .map(|a| a..rows.end.min(a + ROW_EXACT_ROWS))
        .collect()
}

/// `y (+)= x mᵀ` over the stacked rows, one product per group.
fn dense(
    model: &Model,
    groups: &[Range<usize>],
    m: &WeightMatrix,
    x: &[f32],
    y: &mut [f32],
    accumulate: bool,
) -> Result<()> {
    let (out, inp) = m.shape();
    for g in groups {
        let (xs, ys) = (
            &x[g.start * inp..g.end * inp],
            &mut y[g.start * out..g.end * out],
        );
        model.linear(m, xs, g.len(), ys, accumulate)?;
    }
    Ok(())
}

/// `y_k (+)= x m_kᵀ` over the stacked rows for several matrices reading the same `x`, one
/// parallel region per group; bit-identical to one [`dense`] call each.
fn dense_many(
    model: &Model,
    groups: &[Range<usize>],
    x: &[f32],
    products: &mut [(&WeightMatrix, &mut [f32], bool)],
) -> Result<()> {
    let inp = products.first().map_or(0, |p| p.0.shape().1);
    for g in groups {
        let mut part: Vec<(&WeightMatrix, &mut [f32], bool)> = products
            .iter_mut()
            .map(|(m, y, acc)| {
                let out = m.shape().0;
                (*m, &mut y[g.start * out..g.end * out], *acc)
            })
            .collect();
        model.linear_many(&x[g.start * inp..g.end * inp], g.len(), &mut part)?;
    }
    Ok(())
}

/// Runs each member's chunk through every layer and writes the logits they ask for. All
/// members run `model`; each member's stream position advances by its rows.
///
/// Errors: from the attention of a member (bad gates, a broken invariant). The members'
/// states may then be half-updated: the caller poisons them.
pub(super) fn forward(model: &Model, members: &mut [Member<'_>]) -> Result<()> {
    let info = model.info();
    let d = info.hidden;
    let lay = Layout::new(members);
    let mut ids = vec![0u32; lay.t];
    for (m, &r0) in members.iter().zip(&lay.rows) {
        ids[r0..r0 + m.ids.len()].copy_from_slice(m.ids);
    }
    let mut h = vec![0.0f32; lay.t * d];
    model.embed(&ids, &mut h)?;
    let mut s = Scratch::new(lay.t, &info);
    let pos0: Vec<u64> = members.iter().map(|m| m.s.stats.tokens).collect();
    for l in 0..info.layers {
        save_hidden(members, &lay.rows, &h, l, d);
        layer_forward(model, l, &mut h, members, &lay, &pos0, &mut s)?;
    }
    save_hidden(members, &lay.rows, &h, info.layers, d);
    for m in members.iter_mut() {
        m.s.stats.tokens += m.ids.len() as u64;
    }

    // Logits: the asked-for rows through the final norm and the LM head, last rows
    // together and each member's every-row logits on their own (as `Layout` groups).
    let v = info.vocab;
    let all = |m: &Member<'_>| m.ids.len() > 1 && m.logits.as_ref().is_some_and(|l| l.len() > v);
    let mut pick = Vec::new();
    let mut at = vec![0usize; members.len()];
    for (i, m) in members.iter().enumerate() {
        if m.logits.is_some() && !all(m) {
            at[i] = pick.len();
            pick.push(lay.rows[i] + m.ids.len() - 1);
        }
    }
    let mut groups = shared_groups(0..pick.len());
    for (i, m) in members.iter().enumerate() {
        if all(m) {
            at[i] = pick.len();
            groups.push(pick.len()..pick.len() + m.ids.len());
            pick.extend(lay.rows[i]..lay.rows[i] + m.ids.len());
        }
    }
    if pick.is_empty() {
        return Ok(());
    }
    let mut x = vec![0.0f32; pick.len() * d];
    for (xr, &r) in x.chunks_exact_mut(d).zip(&pick) {
        ops::rmsnorm(
            &h[r * d..(r + 1) * d],
            &model.norm,
            model.config.norm_eps,
            xr,
        );
    }
    let mut out = vec![0.0f32; pick.len() * v];
    dense(model, &groups, model.lm_head(), &x, &mut out, false)?;
    for (m, &a) in members.iter_mut().zip(&at) {
        if let Some(l) = m.logits.as_deref_mut() {
            l.copy_from_slice(&out[a * v..a * v + l.len()]);
        }
    }
    Ok(())
}

/// Rows with at least this many in a step run their element-wise ops (gates, activations)
/// split over the threads; fewer (decode steps) run on the calling thread.
const PAR_ELEMENTWISE_ROWS: usize = 32;

/// `f(out row, in row)` for the `t` rows of `out` (`ow` values a row) and `inp` (`iw`),
/// split over rayon's threads from [`PAR_ELEMENTWISE_ROWS`] rows on. Each row is computed
/// alone, so the result does not depend on the split.
fn by_rows<F>(t: usize, ow: usize, out: &mut [f32], iw: usize, inp: &[f32], f: F)
where
    F: Fn((&mut [f32], &[f32])) + Sync + Send,
{
    let (out, inp) = (&mut out[..t * ow], &inp[..t * iw]);
    if t < PAR_ELEMENTWISE_ROWS {
        out.chunks_exact_mut(ow)
            .zip(inp.chunks_exact(iw))
            .for_each(f);
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(ow)
            .zip(inp.par_chunks(iw))
            .with_min_len(8)
            .for_each(f);
    }
}

/// Copies each member's rows of the residual stream `h` into its hidden buffer, block `l`.
fn save_hidden(members: &mut [Member<'_>], rows: &[usize], h: &[f32], l: usize, d: usize) {
    for (m, &r0) in members.iter_mut().zip(rows) {
        let t = m.ids.len();
        if let Some((buf, total, row0)) = m.hidden.as_mut() {
            buf[(l * *total + *row0) * d..][..t * d].copy_from_slice(&h[r0 * d..(r0 + t) * d]);
        }
    }
}

/// One block on the stacked rows `h` of every member (spec §3, §6); member `i` owns rows
/// `rows[i]..` (`ids.len()` of them) and its stream starts at `pos0[i]`.
pub(super) fn layer_forward(
    model: &Model,
    l: usize,
    h: &mut [f32],
    members: &mut [Member<'_>],
    lay: &Layout,
    pos0: &[u64],
    s: &mut Scratch,
) -> Result<()> {
    let cfg = &model.config;
    let info = model.info();
    let (d, nh, hd) = (info.hidden, info.heads, info.head_dim);
    let lw: &LayerWeights = &model.layers[l];
    let (rows, g) = (&lay.rows, &lay.groups[..]);

    ops::rmsnorm(h, &lw.attn_norm, cfg.norm_eps, &mut s.x);
    // Every matrix that reads the normed rows, in one parallel region per row group.
    let mut pre: Vec<(&WeightMatrix, &mut [f32], bool)> = vec![
        (&lw.q_proj, &mut s.q, false),
        (lw.k_proj.linear(), &mut s.k, false),
        (lw.v_proj.linear(), &mut s.v, false),
        (&lw.fgate_w, &mut s.log_f, false),
    ];
    if let Some(ws) = lw.k_proj.shift() {
        pre.push((ws, &mut s.alpha, false));
    }
    if let Some(ws) = lw.v_proj.shift() {
        pre.push((ws, &mut s.alpha_v, false));
    }
    if let Some(og) = &lw.ogate {
        pre.push((og, &mut s.g, false));
    }
    dense_many(model, g, &s.x, &mut pre)?;
    drop(pre);
    for (which, proj, out, alpha, last) in [
        (0, &lw.k_proj, &mut s.k, &s.alpha, &mut s.kv_raw_last.0),
        (1, &lw.v_proj, &mut s.v, &s.alpha_v, &mut s.kv_raw_last.1),
    ] {
        if proj.shift().is_some() {
            // α = sigmoid(x·Wsᵀ) weights the previous token's raw projection; each
            // member's first row takes its own stream's last raw projection.
            for (m, &r0) in members.iter_mut().zip(rows) {
                let n = m.ids.len();
                let state = &mut m.s.layers[l];
                let st = if which == 0 {
                    &mut state.k_shift
                } else {
                    &mut state.v_shift
                };
                last.copy_from_slice(&out[(r0 + n - 1) * d..(r0 + n) * d]);
                for r in (r0..r0 + n).rev() {
                    for hh in 0..nh {
                        let a = ops::sigmoid(alpha[r * nh + hh]);
                        for c in hh * hd..(hh + 1) * hd {
                            let prev = if r == r0 { st[c] } else { out[(r - 1) * d + c] };
                            out[r * d + c] = a * prev + (1.0 - a) * out[r * d + c];
                        }
                    }
                }
                st.copy_from_slice(last);
            }
        }
    }
    if let Some((qn, kn)) = &lw.qk_norm {
        ops::group_rmsnorm_inplace(&mut s.q, qn, hd, QK_EPS);
        ops::group_rmsnorm_inplace(&mut s.k, kn, hd, QK_EPS);
    }
    let bias = &lw.fgate_b;
    for (i, z) in s.log_f.iter_mut().enumerate() {
        *z = foxedge_core::gate::logsigmoid(*z + bias[i % nh]);
    }

    // Attention: each member over its own cache, members in parallel (one parallel region
    // for the whole batch; each member's kernel splits further over its heads).
    let mut ios: Vec<Option<Io<'_>>> = (0..members.len()).map(|_| None).collect();
    let mut o_rest = &mut s.o[..];
    for i in lay.order() {
        let (r0, n) = (rows[i], members[i].ids.len());
        let (o, rest) = o_rest.split_at_mut(n * d);
        o_rest = rest;
        ios[i] = Some(Io {
            q: &s.q[r0 * d..(r0 + n) * d],
            k: &s.k[r0 * d..(r0 + n) * d],
            v: &s.v[r0 * d..(r0 + n) * d],
            log_f: &s.log_f[r0 * nh..(r0 + n) * nh],
            o,
        });
    }
    let attend = |(i, (m, io)): (usize, (&mut Member<'_>, Option<Io<'_>>))| match io {
        Some(io) => m.s.attention(model, l, pos0[i], m.scores, io),
        None => Err(Error::Internal(format!("member {i} has no rows"))),
    };
    if members.len() == 1 {
        members
            .iter_mut()
            .zip(ios)
            .enumerate()
            .try_for_each(attend)?;
    } else {
        use rayon::prelude::*;
        // Every member runs (as fed alone); the first error in member order is returned.
        let done: Vec<Result<()>> = members
            .par_iter_mut()
            .zip(ios)
            .enumerate()
            .map(attend)
            .collect();
        done.into_iter().collect::<Result<()>>()?;
    }

    // Output norm / gate (spec §3.7), then o_proj into the residual.
    if let Some(on) = &lw.output_norm {
        ops::group_rmsnorm_inplace(&mut s.o, on, hd, cfg.norm_eps);
    }
    if lw.ogate.is_some() {
        let gate = |(o, g): (&mut [f32], &[f32])| {
            for (o, &g) in o.iter_mut().zip(g) {
                *o *= match cfg.ogate_act {
                    OgateAct::Sigmoid => ops::sigmoid(g),
                    OgateAct::Silu => ops::silu(g),
                };
            }
        };
        by_rows(lay.t, d, &mut s.o, d, &s.g, gate);
    }
    dense(model, g, &lw.o_proj, &s.o, h, true)?;

    // MLP: h += (act(g) ⊙ u)·Wdᵀ with [g | u] = RMSNorm(h)·Wguᵀ.
    let i = info.intermediate;
    ops::rmsnorm(h, &lw.mlp_norm, cfg.norm_eps, &mut s.x);
    dense(model, g, &lw.gate_up, &s.x, &mut s.gu, false)?;
    let act = |(a, gu): (&mut [f32], &[f32])| {
        let (g, u) = gu.split_at(i);
        for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
            *a = match cfg.hidden_act {
                HiddenAct::Swish => ops::silu(g),
                HiddenAct::Sigmoid => ops::sigmoid(g),
            } * u;
        }
    };
    by_rows(lay.t, i, &mut s.act, 2 * i, &s.gu, act);
    dense(model, g, &lw.down, &s.act, h, true)?;
    Ok(())
}

impl Session {
    /// Forgetting attention of a chunk's `t` rows in `s.q/k/v/log_f` into `s.o`, storing its
    /// keys, values and `c` through the retention policy.
    ///
    /// The chunk's tokens are appended to the policy one by one first (evicting what the
    /// certificate allows and the budgets require, as between decode steps), which says
    /// where each key stops being seen. Then one token attends the cache (decode), a fresh
    /// stream's chunk that forced no eviction runs the prefill kernel over itself (its
    /// queries also see the keys certified-evicted inside the chunk, each weighing < eps of
    /// any query's mass, as the Vulkan whole-model chunk does), and any other chunk runs
    /// the continuation kernel over the cache as it was before the chunk plus the chunk's
    /// own keys, each query seeing exactly the keys it would see fed token by token. The evictions and the new rows then reach the cache rows in order.
    /// ACP uses the QK-norm bound, or without QK-norm the observed norms of this call's
    /// queries and of every key cached so far.
    fn attention(
        &mut self,
        model: &Model,
        l: usize,
        pos0: u64,
        scores: Option<&[f32]>,
        s: Io<'_>,
    ) -> Result<()> {
        let t = s.log_f.len() / model.info().heads;
        let info = model.info();
        let (nh, hd) = (info.heads, info.head_dim);
        let d = info.hidden;
        let scale = 1.0 / (hd as f64).sqrt();
        let ln_eps = self.opts.ln_eps;
        let certified = self.certified[l];
        let u = &self.u[l];
        let state = &mut self.layers[l];
        let fresh = state.gates[0].is_empty();

        // Move the gate origin forward before |c| grows large (exact: D uses differences).
        for h in 0..nh {
            let cur = state.gates[h].current();
            if cur.abs() > REBASE_AT {
                state.gates[h].rebase(cur);
                state.policy.rebase(h, cur)?;
                state.heads[h].rebase(cur);
            }
        }
        // c of every chunk row per head, validated by the gate stream (finite, <= 0).
        let mut c_rows = vec![0.0f64; t * nh];
        for r in 0..t {
            for h in 0..nh {
                c_rows[r * nh + h] = state.gates[h].push(s.log_f[r * nh + h])?;
            }
        }
        if !certified {
            for r in 0..t {
                for h in 0..nh {
                    let k = &s.k[r * d + h * hd..][..hd];
                    let n = f64::from(ops::dot(k, k)).sqrt();
                    state.k_norm_max[h] = state.k_norm_max[h].max(n);
                }
            }
        }
        let mut u_obs = vec![0.0f64; nh];
        if !certified && ln_eps.is_some() {
            for (h, uh) in u_obs.iter_mut().enumerate() {
                let qn = (0..t)
                    .map(|r| {
                        let qh = &s.q[r * d + h * hd..][..hd];
                        f64::from(ops::dot(qh, qh)).sqrt()
                    })
                    .fold(0.0, f64::max);
                *uh = foxedge_core::threshold::bound_from_norms(qn, state.k_norm_max[h], scale)?;
            }
        }
        let acp = match (ln_eps, certified) {
            (None, _) => Acp::Off,
            (Some(ln_eps), true) => Acp::Bound { u, ln_eps },
            (Some(ln_eps), false) => Acp::Bound { u: &u_obs, ln_eps },
        };

        // The chunk's tokens enter the policy in order; its evictions are logged.
        let n0: Vec<usize> = state.heads.iter().map(HeadCache::len).collect();
        let mut log: Vec<(usize, Eviction)> = Vec::new();
        let mut score_row = vec![0.0f32; nh];
        for r in 0..t {
            let sc = scores.map(|sc| {
                score_row.fill(sc[r]);
                &score_row[..]
            });
            let c = &c_rows[r * nh..(r + 1) * nh];
            state
                .policy
                .append(pos0 + r as u64, c, sc, |ev| log.push((r, ev)))?;
            state.peak_live = state.peak_live.max(state.policy.live_total());
        }

        let dtype = self.opts.cache_dtype;
        let backend = self.backend.as_ref();
        let st = if t == 1 {
            store_chunk(state, &log, s.k, s.v, &c_rows, pos0, t, hd)?;
            let (q, heads) = (s.q, &state.heads[..]);
            match dtype {
                CacheDtype::F32 => decode_step::<f32>(backend, heads, hd, q, &c_rows, acp, s.o)?,
                CacheDtype::F16 => decode_step::<f16>(backend, heads, hd, q, &c_rows, acp, s.o)?,
            }
        } else if fresh && log.iter().all(|(_, ev)| ev.kind == EvictionKind::Certified) {
            let acp = match (ln_eps, certified) {
                (Some(ln_eps), false) => Acp::ObservedNorms { ln_eps },
                _ => acp,
            };
            let call = PrefillCall::new(t, nh, hd, s.q, s.k, s.v, s.log_f).with_acp(acp);
            let st = backend.prefill(&call, s.o)?;
            store_chunk(state, &log, s.k, s.v, &c_rows, pos0, t, hd)?;
            st
        } else {
            let ends = if log.is_empty() {
                None
            } else {
                Some(chunk_ends(&n0, &log, t)?)
            };
            let chunk = Chunk {
                hd,
                q: s.q,
                k: s.k,
                v: s.v,
                q_c: &c_rows,
                ends: ends.as_ref(),
                acp,
            };
            let st = match dtype {
                CacheDtype::F32 => continue_chunk::<f32>(backend, &state.heads, &chunk, s.o)?,
                CacheDtype::F16 => continue_chunk::<f16>(backend, &state.heads, &chunk, s.o)?,
            };
            store_chunk(state, &log, s.k, s.v, &c_rows, pos0, t, hd)?;
            st
        };
        self.stats.kept_pairs += st.kept_pairs();
        self.stats.total_pairs += st.total_pairs();
        Ok(())
    }
}

/// One decode step of the query `q` (`[heads, hd]`, `c` = `q_c`) over the heads' rows
/// stored as `T`.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_step<T: KvElem + RowsOf>(
    backend: &dyn AttentionBackend,
    heads: &[HeadCache],
    hd: usize,
    q: &[f32],
    q_c: &[f64],
    acp: Acp<'_>,
    out: &mut [f32],
) -> Result<AttentionStats> {
    let views = heads
        .iter()
        .map(HeadCache::view::<T>)
        .collect::<Result<Vec<_>>>()?;
    let sync: Vec<HeadSync<'_>> = heads.iter().map(HeadCache::sync).collect();
    let call = DecodeCall {
        args: DecodeArgs::one_query(hd, q, q_c, &views),
        sync: &sync,
        acp,
    };
    T::decode(backend, &call, out)
}

/// A chunk's continuation inputs: its rows (`[t, heads, hd]`), `c` (`[t, heads]`), where
/// each key stops being seen ([`chunk_ends`]; `None`: no eviction in the chunk) and ACP.
struct Chunk<'a> {
    hd: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    q_c: &'a [f64],
    ends: Option<&'a (Vec<Vec<u32>>, Vec<u32>)>,
    acp: Acp<'a>,
}

/// The continuation of `chunk` over the heads' rows (as they were before the chunk) stored
/// as `T`; the chunk's own K and V are rounded to `T` first, as the cache will hold them.
fn continue_chunk<T: KvElem + RowsOf>(
    backend: &dyn AttentionBackend,
    heads: &[HeadCache],
    chunk: &Chunk<'_>,
    out: &mut [f32],
) -> Result<AttentionStats> {
    let views = heads
        .iter()
        .map(HeadCache::view::<T>)
        .collect::<Result<Vec<_>>>()?;
    let (k, v) = (T::stored(chunk.k)?, T::stored(chunk.v)?);
    let cache_end: Option<Vec<&[u32]>> = chunk
        .ends
        .map(|(c, _)| c.iter().map(Vec::as_slice).collect());
    let call = ContinueCall {
        args: ContinueArgs {
            head_dim: chunk.hd,
            n_queries: chunk.q_c.len() / heads.len().max(1),
            q: chunk.q,
            k: &k,
            v: &v,
            q_c: chunk.q_c,
            key_end: chunk.ends.map(|(_, k)| &k[..]),
            cache: &views,
            cache_end: cache_end.as_deref(),
        },
        acp: chunk.acp,
    };
    T::prefill_continue(backend, &call, out)
}

/// Stores a chunk's rows in the cache heads as the policy placed them: for each token in
/// order, the logged evictions (`(token, eviction)`, in the order reported) and then the
/// token's K, V and `c` in every head.
#[allow(clippy::too_many_arguments)]
fn store_chunk(
    state: &mut LayerState,
    log: &[(usize, Eviction)],
    k: &[f32],
    v: &[f32],
    c_rows: &[f64],
    pos0: u64,
    t: usize,
    hd: usize,
) -> Result<()> {
    let nh = state.heads.len();
    let d = nh * hd;
    let mut next = log.iter().peekable();
    for r in 0..t {
        while let Some((_, ev)) = next.next_if(|(er, _)| *er == r) {
            state
                .heads
                .get_mut(ev.head)
                .ok_or_else(|| Error::Internal(format!("eviction from head {}", ev.head)))?
                .apply(ev, hd)?;
        }
        for (h, hc) in state.heads.iter_mut().enumerate() {
            let at = r * d + h * hd;
            hc.push(
                &k[at..at + hd],
                &v[at..at + hd],
                c_rows[r * nh + h],
                pos0 + r as u64,
            )?;
        }
    }
    Ok(())
}

/// Where each key stops being seen by a chunk of `t` tokens whose appends evicted `log`
/// (`(token, eviction)` in order) from heads of `n0[h]` entries: `(cache_end[h][j],
/// key_end[r * heads + h])`, the first query that no longer sees cache entry `j` or new key
/// `r` (`t` when all do). A key evicted while token `r` was appended is not seen by query
/// `r`: token by token, a query attends the cache after its own append.
pub(super) fn chunk_ends(
    n0: &[usize],
    log: &[(usize, Eviction)],
    t: usize,
) -> Result<(Vec<Vec<u32>>, Vec<u32>)> {
    let nh = n0.len();
    let end = u32::try_from(t).map_err(|_| Error::invalid("chunk of 2^32 tokens or more"))?;
    let mut cache_end: Vec<Vec<u32>> = n0.iter().map(|&n| vec![end; n]).collect();
    let mut key_end = vec![end; t * nh];
    // The key in each live slot: `j < n0[h]` cache entry j, `n0[h] + r` new token r.
    let mut slot_key: Vec<Vec<usize>> = n0.iter().map(|&n| (0..n).collect()).collect();
    let mut next = log.iter().peekable();
    let broken = |ev: &Eviction| Error::Internal(format!("policy evicted {ev:?} off its slots"));
    for r in 0..t {
        while let Some((_, ev)) = next.next_if(|(er, _)| *er == r) {
            let h = ev.head;
            let keys = slot_key.get_mut(h).ok_or_else(|| broken(ev))?;
            let key = *keys.get(ev.slot as usize).ok_or_else(|| broken(ev))?;
            if key < n0[h] {
                cache_end[h][key] = r as u32;
            } else {
                key_end[(key - n0[h]) * nh + h] = r as u32;
            }
            let last = keys.len() - 1;
            match ev.moved() {
                Some((from, to)) if from as usize == last && (to as usize) < last => {
                    keys[to as usize] = keys[last];
                }
                None if ev.slot as usize == last => {}
                _ => return Err(broken(ev)),
            }
            keys.pop();
        }
        for (h, keys) in slot_key.iter_mut().enumerate() {
            keys.push(n0[h] + r);
        }
    }
    Ok((cache_end, key_end))
}

impl Scratch {
    pub(super) fn new(t: usize, info: &ModelInfo) -> Scratch {
        let (d, nh, i) = (info.hidden, info.heads, info.intermediate);
        Scratch {
            x: vec![0.0; t * d],
            q: vec![0.0; t * d],
            k: vec![0.0; t * d],
            v: vec![0.0; t * d],
            kv_raw_last: (vec![0.0; d], vec![0.0; d]),
            alpha: vec![0.0; t * nh],
            alpha_v: vec![0.0; t * nh],
            log_f: vec![0.0; t * nh],
            o: vec![0.0; t * d],
            g: vec![0.0; t * d],
            gu: vec![0.0; t * 2 * i],
            act: vec![0.0; t * i],
        }
    }
}
