//! Decode: a few new queries per head against the retained cache (flash-decoding).
//!
//! Each head's `n` entries are cut into splits of `opts.split` entries (a multiple of
//! `block_k`); every (head, split) is one parallel task that returns, per query `t`, the
//! partial softmax state over its entries `J`:
//!
//! ```text
//! m_t = max_{j in J} x_tj,  l_t = Σ_J exp(x_tj - m_t),  a_t = Σ_J exp(x_tj - m_t) v_j
//! x_tj = s q_t·k_j + f32(c_t - c_j)      (the difference is taken in f64)
//! ```
//!
//! Partials merge exactly: `m = max(m1, m2)`, `l = l1 e^{m1-m} + l2 e^{m2-m}`,
//! `a = a1 e^{m1-m} + a2 e^{m2-m}`; finally `o_t = a_t / l_t`.
//!
//! ACP: a block of `block_k` entries is skipped (its K and V rows are never read) when
//! `c_t - min_j c_j < delta` for every query, i.e. the block's largest decay is below the
//! threshold core derived.

use crate::api::{Acp, AttentionStats, DecodeArgs, DecodeOptions, HeadStats, Storage};
use crate::prefill::scale_row;
use crate::simd::{Isa, Vf32, WithSimd, dispatch, prefetch, widen};
use foxedge_core::{Error, Result, threshold};
use rayon::prelude::*;
use std::cell::RefCell;

/// One decode step with the widest instruction set of this CPU.
///
/// `out`: `[heads, n_queries, head_dim]`; `lse` (optional): `[heads, n_queries]`, natural
/// log of `Σ_j exp(x_tj)`. A query that attends no entry (empty cache, or every entry
/// after it by position) outputs 0 with lse `-inf`.
///
/// Errors: lengths that disagree with `head_dim`, `n_queries` and the cache, a non-finite
/// `c` or query `c_t`, `pos` on a head without `q_pos`, zero `block_k`/`split`,
/// `head_dim` not a positive multiple of 8, a non-finite `sm_scale`, bad ACP parameters
/// (`ObservedNorms` is refused: it would read every key).
pub fn decode<Q: Storage, T: Storage, O: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> Result<AttentionStats> {
    decode_with_isa(Isa::detect(), args, opts, out, lse)
}

fn bad_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::BadLength {
            what,
            expected,
            got,
        })
    }
}

fn validate<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    out_len: usize,
    lse_len: Option<usize>,
) -> Result<()> {
    let (d, nq, nh) = (args.head_dim, args.n_queries, args.heads.len());
    if d == 0 || d % 8 != 0 {
        return Err(Error::BadShape("head_dim must be a positive multiple of 8"));
    }
    if nq == 0 || nh == 0 {
        return Err(Error::BadShape(
            "decode needs at least one head and one query",
        ));
    }
    let rows = nh
        .checked_mul(nq)
        .filter(|r| r.checked_mul(d).is_some())
        .ok_or(Error::BadShape("element count overflows usize"))?;
    bad_len("decode q", rows * d, args.q.len())?;
    bad_len("decode q_c", rows, args.q_c.len())?;
    bad_len("decode out", rows * d, out_len)?;
    if let Some(l) = lse_len {
        bad_len("decode lse", rows, l)?;
    }
    if args.q_c.iter().any(|x| !x.is_finite()) {
        return Err(Error::BadArgument("query c_t must be finite"));
    }
    if let Some(p) = args.q_pos {
        bad_len("decode q_pos", rows, p.len())?;
    }
    for hc in args.heads {
        let n = hc.c.len();
        let nd = n
            .checked_mul(d)
            .ok_or(Error::BadShape("cache size overflows usize"))?;
        bad_len("cache k (entries * head_dim)", nd, hc.k.len())?;
        bad_len("cache v (entries * head_dim)", nd, hc.v.len())?;
        if hc.c.iter().any(|x| !x.is_finite()) {
            return Err(Error::BadArgument("cache c_j must be finite"));
        }
        if let Some(p) = hc.pos {
            bad_len("cache pos", n, p.len())?;
            if args.q_pos.is_none() {
                return Err(Error::BadArgument("cache has positions but q_pos is None"));
            }
        }
    }
    if opts.block_k == 0 || opts.split == 0 {
        return Err(Error::BadArgument("block_k and split must be > 0"));
    }
    if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
        return Err(Error::BadArgument("sm_scale must be finite"));
    }
    match opts.acp {
        Acp::Off => {}
        Acp::Threshold(t) => {
            bad_len("decode ACP thresholds (one per head)", nh, t.len())?;
            if t.iter().any(|x| x.is_nan()) {
                return Err(Error::BadArgument("ACP threshold is NaN"));
            }
        }
        Acp::Bound { u, .. } => bad_len("decode ACP bounds (one per head)", nh, u.len())?,
        Acp::ObservedNorms { .. } => {
            return Err(Error::BadArgument(
                "ObservedNorms needs every key: pass Bound or Threshold to decode",
            ));
        }
    }
    Ok(())
}

/// Partial softmax of one (head, split): per query `m`, `l`, then `acc` (`d` values).
struct Partial {
    head: usize,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    kept_pairs: u64,
    total_pairs: u64,
    kept_blocks: u64,
    total_blocks: u64,
}

/// [`decode`] with a chosen instruction set.
pub fn decode_with_isa<Q: Storage, T: Storage, O: Storage>(
    isa: Isa,
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    out: &mut [O],
    mut lse: Option<&mut [f32]>,
) -> Result<AttentionStats> {
    validate(args, opts, out.len(), lse.as_deref().map(<[f32]>::len))?;
    let (d, nq, nh) = (args.head_dim, args.n_queries, args.heads.len());
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());

    // Decisions: one delta per head, from core.
    let mut deltas = Vec::with_capacity(nh);
    for (h, hc) in args.heads.iter().enumerate() {
        let n = hc.c.len();
        deltas.push(match opts.acp {
            Acp::Threshold(t) => Some(t[h]),
            Acp::Bound { u, ln_eps } if n > 0 => Some(threshold::threshold(u[h], n, ln_eps)?),
            _ => None,
        });
    }

    // Queries widened and pre-scaled once.
    let mut qs = vec![0.0f32; nh * nq * d];
    Q::to_f32_slice(args.q, &mut qs);
    for x in &mut qs {
        *x *= scale;
    }

    let split = opts.split.div_ceil(opts.block_k) * opts.block_k;
    let mut tasks = Vec::new();
    for (h, hc) in args.heads.iter().enumerate() {
        let n = hc.c.len();
        let mut e0 = 0;
        while e0 < n {
            tasks.push((h, e0, (e0 + split).min(n)));
            e0 += split;
        }
    }
    let parts: Vec<Partial> = tasks
        .par_iter()
        .with_max_len(1)
        .map(|&(h, e0, e1)| {
            DSCRATCH.with(|s| {
                dispatch(
                    isa,
                    Split {
                        args,
                        q: &qs[h * nq * d..(h + 1) * nq * d],
                        delta: deltas[h],
                        bk: opts.block_k,
                        h,
                        e0,
                        e1,
                        scr: &mut s.borrow_mut(),
                    },
                )
            })
        })
        .collect();

    // Exact merge of the partials of each head (tasks are in head order).
    let mut stats = AttentionStats {
        heads: deltas
            .iter()
            .map(|&delta| HeadStats {
                delta,
                ..HeadStats::default()
            })
            .collect(),
    };
    let mut m = vec![f32::NEG_INFINITY; nh * nq];
    let mut l = vec![0.0f32; nh * nq];
    let mut acc = vec![0.0f32; nh * nq * d];
    for p in &parts {
        let st = &mut stats.heads[p.head];
        st.kept_pairs += p.kept_pairs;
        st.total_pairs += p.total_pairs;
        st.kept_blocks += p.kept_blocks;
        st.total_blocks += p.total_blocks;
        for t in 0..nq {
            let r = p.head * nq + t;
            if p.m[t].is_nan() || p.m[t] == f32::INFINITY || !p.l[t].is_finite() {
                return Err(crate::prefill::NON_FINITE);
            }
            let m_new = m[r].max(p.m[t]);
            if m_new == f32::NEG_INFINITY {
                continue;
            }
            let (a1, a2) = ((m[r] - m_new).exp(), (p.m[t] - m_new).exp());
            l[r] = l[r] * a1 + p.l[t] * a2;
            m[r] = m_new;
            for (x, y) in acc[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&p.acc[t * d..(t + 1) * d])
            {
                *x = *x * a1 + y * a2;
            }
        }
    }
    for r in 0..nh * nq {
        if m[r] != f32::NEG_INFINITY && !(l[r] > 0.0 && l[r].is_finite() && m[r].is_finite()) {
            return Err(crate::prefill::NON_FINITE);
        }
    }
    for r in 0..nh * nq {
        let row = &mut acc[r * d..(r + 1) * d];
        let (inv, ls) = if l[r] > 0.0 {
            (1.0 / l[r], m[r] + l[r].ln())
        } else {
            (0.0, f32::NEG_INFINITY)
        };
        for x in row.iter_mut() {
            *x *= inv;
        }
        O::from_f32_slice(row, &mut out[r * d..(r + 1) * d]);
        if let Some(ls_out) = lse.as_deref_mut() {
            ls_out[r] = ls;
        }
    }
    Ok(stats)
}

#[derive(Default)]
struct DScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
}

thread_local! {
    static DSCRATCH: RefCell<DScratch> = RefCell::new(DScratch::default());
}

/// Entries of a score row are padded to a multiple of this (the widest vector).
const PAD: usize = 16;

/// `src` as f32: in place for f32 storage, else widened into `buf`.
#[inline(always)]
fn widened<'t, V: Vf32, T: Storage>(src: &'t [T], buf: &'t mut Vec<f32>) -> &'t [f32] {
    if let Some(f) = T::as_f32(src) {
        return f;
    }
    if buf.len() < src.len() {
        buf.resize(src.len(), 0.0);
    }
    widen::<V, T>(src, &mut buf[..src.len()]);
    &buf[..src.len()]
}

/// One (head, split) task, run inside [`dispatch`]: entries `e0..e1` of head `h`.
struct Split<'s, 'a, Q: Storage, T: Storage> {
    args: &'s DecodeArgs<'a, Q, T>,
    /// The head's queries, widened and scaled: `[n_queries, d]`.
    q: &'s [f32],
    delta: Option<f64>,
    bk: usize,
    h: usize,
    e0: usize,
    e1: usize,
    scr: &'s mut DScratch,
}

impl<Q: Storage, T: Storage> WithSimd for Split<'_, '_, Q, T> {
    type Output = Partial;
    #[inline(always)]
    fn run<V: Vf32>(self) -> Partial {
        let Split {
            args,
            q,
            delta,
            bk,
            h,
            e0,
            e1,
            scr,
        } = self;
        let (d, nq) = (args.head_dim, args.n_queries);
        let hc = &args.heads[h];
        let qc = &args.q_c[h * nq..(h + 1) * nq];
        let qpos = args.q_pos.map(|p| &p[h * nq..(h + 1) * nq]);
        let mut part = Partial {
            head: h,
            m: vec![f32::NEG_INFINITY; nq],
            l: vec![0.0; nq],
            acc: vec![0.0; nq * d],
            kept_pairs: 0,
            total_pairs: 0,
            kept_blocks: 0,
            total_blocks: 0,
        };
        let mut b0 = e0;
        while b0 < e1 {
            let b1 = (b0 + bk).min(e1);
            let nb = b1 - b0;
            let c = &hc.c[b0..b1];
            // Pairs this block can hold (causal by position when positions are given).
            let eligible = |t: usize| -> u64 {
                match (hc.pos, qpos) {
                    (Some(p), Some(qp)) => p[b0..b1].iter().filter(|&&x| x <= qp[t]).count() as u64,
                    _ => nb as u64,
                }
            };
            let pairs: u64 = (0..nq).map(eligible).sum();
            part.total_pairs += pairs;
            if pairs > 0 {
                part.total_blocks += 1;
            }
            let cmin = c.iter().copied().fold(f64::INFINITY, f64::min);
            let pruned = delta.is_some_and(|dl| qc.iter().all(|&ct| ct - cmin < dl));
            if pruned || pairs == 0 {
                b0 = b1;
                continue;
            }
            part.kept_pairs += pairs;
            part.kept_blocks += 1;
            let nbp = nb.div_ceil(PAD) * PAD;
            // s[t][j] starts as the decay term (or -inf when masked by position).
            if scr.s.len() < nq * nbp {
                scr.s.resize(nq * nbp, 0.0);
            }
            let s = &mut scr.s[..nq * nbp];
            for t in 0..nq {
                let row = &mut s[t * nbp..(t + 1) * nbp];
                for (j, x) in row.iter_mut().enumerate() {
                    let after = matches!((hc.pos, qpos), (Some(p), Some(qp)) if j < nb && p[b0 + j] > qp[t]);
                    *x = if j >= nb || after {
                        f32::NEG_INFINITY
                    } else {
                        (qc[t] - c[j]) as f32
                    };
                }
            }
            // The next block's rows start moving while this one computes.
            let n1 = (b1 + bk).min(e1);
            prefetch(&hc.k[b1 * d..n1 * d]);
            prefetch(&hc.v[b1 * d..n1 * d]);
            let kb = widened::<V, T>(&hc.k[b0 * d..b1 * d], &mut scr.k);
            let vb = widened::<V, T>(&hc.v[b0 * d..b1 * d], &mut scr.v);
            decode_block::<V>(DecodeBlock {
                q,
                k: kb,
                v: vb,
                s,
                nb,
                nbp,
                d,
                m: &mut part.m,
                l: &mut part.l,
                acc: &mut part.acc,
            });
            b0 = b1;
        }
        part
    }
}

/// One block of `nb` cache entries for every query: `s[t][j] += q_t·k_j`, then the
/// online-softmax update of `m`, `l`, `acc` (rows of `k`, `v`: `d` contiguous f32).
struct DecodeBlock<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    s: &'a mut [f32],
    nb: usize,
    nbp: usize,
    d: usize,
    m: &'a mut [f32],
    l: &'a mut [f32],
    acc: &'a mut [f32],
}

#[inline(always)]
fn dot<V: Vf32>(a: &[f32], b: &[f32]) -> f32 {
    let mut s0 = V::splat(0.0);
    let mut ca = a.chunks_exact(V::LANES);
    let mut cb = b.chunks_exact(V::LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        s0 = V::load(x).fma(V::load(y), s0);
    }
    let mut s = s0.reduce_sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn decode_block<V: Vf32>(blk: DecodeBlock<'_>) {
    let DecodeBlock {
        q,
        k,
        v,
        s,
        nb,
        nbp,
        d,
        m,
        l,
        acc,
    } = blk;
    {
        for (t, row) in s.chunks_exact_mut(nbp).enumerate() {
            let qt = &q[t * d..(t + 1) * d];
            for (j, x) in row[..nb].iter_mut().enumerate() {
                if *x != f32::NEG_INFINITY {
                    *x += dot::<V>(qt, &k[j * d..(j + 1) * d]);
                }
            }
            // NaN/inf scores poison l (NaN sticks through every later update), so the
            // merge reports them instead of writing a meaningless row.
            if row[..nb].iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
                l[t] = f32::NAN;
                continue;
            }
            let mut mx = V::splat(f32::NEG_INFINITY);
            for x in row.chunks_exact(V::LANES) {
                mx = mx.max(V::load(x));
            }
            let m_old = m[t];
            let m_new = m_old.max(mx.reduce_max());
            if m_new == f32::NEG_INFINITY {
                continue;
            }
            let alpha = (m_old - m_new).exp();
            let mn = V::splat(m_new);
            let mut sum = V::splat(0.0);
            for x in row.chunks_exact_mut(V::LANES) {
                let p = V::load(x).sub(mn).exp();
                p.store(x);
                sum = sum.add(p);
            }
            m[t] = m_new;
            l[t] = l[t] * alpha + sum.reduce_sum();
            let acc = &mut acc[t * d..(t + 1) * d];
            if alpha != 1.0 {
                scale_row::<V>(acc, alpha);
            }
            // acc += Σ_j p_j v_j, one vector of acc at a time (it stays in a register).
            let mut ca = acc.chunks_exact_mut(V::LANES);
            let mut c0 = 0;
            for a in &mut ca {
                let mut av = V::load(a);
                for (j, &p) in row[..nb].iter().enumerate() {
                    av = V::splat(p).fma(V::load(&v[j * d + c0..]), av);
                }
                av.store(a);
                c0 += V::LANES;
            }
            for (i, a) in ca.into_remainder().iter_mut().enumerate() {
                for (j, &p) in row[..nb].iter().enumerate() {
                    *a += p * v[j * d + c0 + i];
                }
            }
        }
    }
}
