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
//! threshold (both decided by `foxedge_core::contract::acp`).

use crate::prefill::scale_row;
use crate::simd::{Isa, Vf32, WithSimd, dispatch, prefetch};
use foxedge_core::contract::{
    AttentionStats, DType, DecodeArgs, DecodeOptions, HeadStats, Storage, acp,
};
use foxedge_core::{Error, Result};
use rayon::prelude::*;

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

/// The contract's checks ([`DecodeArgs::check`]), then the output lengths.
fn validate<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    opts: &DecodeOptions<'_>,
    out_len: usize,
    lse_len: Option<usize>,
) -> Result<()> {
    args.check(opts)?;
    let rows = args.heads.len() * args.n_queries;
    bad_len("decode out", rows * args.head_dim, out_len)?;
    if let Some(l) = lse_len {
        bad_len("decode lse", rows, l)?;
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
        deltas.push(acp::decode_delta(&opts.acp, h, hc.c.len())?);
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
                },
            )
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

/// Entries scored together in one sub-block of the fused pass (a multiple of the widest
/// vector, so the score row splits into whole vectors).
const G: usize = 16;
/// Entries whose dot products run as independent FMA chains at once.
const DOTS: usize = 8;
/// Bytes of K (and of V) read ahead of the sub-block being scored: one 4 KiB page, so
/// each stream's next page is already in flight where the hardware prefetchers stop (at
/// page boundaries). Measured on the dev VM (f32, 32k x 8 heads): 70-75% of the DRAM read
/// limit without, 86-102% with; neutral within noise for f16.
const PREFETCH_BYTES: usize = 4096;

/// K or V rows of one head in their storage form (`entries x d`, row-major), widened to
/// f32 lane by lane as they are loaded: no conversion pass, no scratch copy.
trait KvRows: Copy {
    /// The element type as stored (f32, or the bits of f16 / bf16).
    type Elem;
    /// The rows as stored.
    fn raw(&self) -> &[Self::Elem];
    #[inline(always)]
    fn len(self) -> usize {
        self.raw().len()
    }
    /// Element `i` as f32.
    fn get(self, i: usize) -> f32;
    /// Elements `i..i + V::LANES` as f32 lanes.
    ///
    /// # Safety
    /// `i + V::LANES <= self.len()`.
    unsafe fn load<V: Vf32>(self, i: usize) -> V;
    /// Starts fetching the cache lines of elements `i..i + n` (clamped to the rows).
    #[inline(always)]
    fn prefetch(self, i: usize, n: usize) {
        let r = self.raw();
        prefetch(&r[i.min(r.len())..(i + n).min(r.len())]);
    }
}

#[derive(Clone, Copy)]
struct F32Rows<'a>(&'a [f32]);
#[derive(Clone, Copy)]
struct F16Rows<'a>(&'a [u16]);
#[derive(Clone, Copy)]
struct Bf16Rows<'a>(&'a [u16]);

impl KvRows for F32Rows<'_> {
    type Elem = f32;
    #[inline(always)]
    fn raw(&self) -> &[f32] {
        self.0
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    unsafe fn load<V: Vf32>(self, i: usize) -> V {
        // SAFETY: `i + LANES <= len` is the caller's contract.
        V::load(unsafe { self.0.get_unchecked(i..i + V::LANES) })
    }
}

impl KvRows for F16Rows<'_> {
    type Elem = u16;
    #[inline(always)]
    fn raw(&self) -> &[u16] {
        self.0
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        half::f16::from_bits(self.0[i]).to_f32()
    }
    #[inline(always)]
    unsafe fn load<V: Vf32>(self, i: usize) -> V {
        // SAFETY: `i + LANES <= len` is the caller's contract.
        V::load_f16(unsafe { self.0.get_unchecked(i..i + V::LANES) })
    }
}

impl KvRows for Bf16Rows<'_> {
    type Elem = u16;
    #[inline(always)]
    fn raw(&self) -> &[u16] {
        self.0
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        f32::from_bits(u32::from(self.0[i]) << 16)
    }
    #[inline(always)]
    unsafe fn load<V: Vf32>(self, i: usize) -> V {
        // SAFETY: `i + LANES <= len` is the caller's contract.
        V::load_bf16(unsafe { self.0.get_unchecked(i..i + V::LANES) })
    }
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
}

impl<Q: Storage, T: Storage> WithSimd for Split<'_, '_, Q, T> {
    type Output = Partial;
    #[inline(always)]
    fn run<V: Vf32>(self) -> Partial {
        let hc = &self.args.heads[self.h];
        if let Some(k) = T::as_f32(hc.k) {
            // `as_f32` is Some for both or neither (same T).
            let v = T::as_f32(hc.v).unwrap_or_default();
            return self.scan::<V, _>(F32Rows(k), F32Rows(v));
        }
        let (k, v) = (
            T::bits16(hc.k).unwrap_or_default(),
            T::bits16(hc.v).unwrap_or_default(),
        );
        if T::DTYPE == DType::Bf16 {
            self.scan::<V, _>(Bf16Rows(k), Bf16Rows(v))
        } else {
            self.scan::<V, _>(F16Rows(k), F16Rows(v))
        }
    }
}

impl<Q: Storage, T: Storage> Split<'_, '_, Q, T> {
    /// Block loop (ACP decisions and pair counts per `bk` entries), then the fused pass
    /// over each kept block, [`G`] entries at a time: for every query, scores, online
    /// softmax and `P V` while the sub-block's K and V rows are in L1.
    #[inline(always)]
    fn scan<V: Vf32, R: KvRows>(self, k: R, v: R) -> Partial {
        let Split {
            args,
            q,
            delta,
            bk,
            h,
            e0,
            e1,
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
        let masked =
            |t: usize, j: usize| matches!((hc.pos, qpos), (Some(p), Some(qp)) if p[j] > qp[t]);
        // Entries ahead that the prefetch covers (at least one sub-block).
        let ahead = (PREFETCH_BYTES / (d * std::mem::size_of::<T>())).max(G);
        let mut b0 = e0;
        while b0 < e1 {
            let b1 = (b0 + bk).min(e1);
            let nb = b1 - b0;
            // Pairs this block can hold (causal by position when positions are given).
            let pairs: u64 = match (hc.pos, qpos) {
                (Some(p), Some(qp)) => qp
                    .iter()
                    .map(|&x| p[b0..b1].iter().filter(|&&y| y <= x).count() as u64)
                    .sum(),
                _ => (nb * nq) as u64,
            };
            part.total_pairs += pairs;
            if pairs > 0 {
                part.total_blocks += 1;
            }
            let pruned = delta
                .is_some_and(|dl| acp::decode_block_pruned(qc, acp::block_min(&hc.c[b0..b1]), dl));
            if pruned || pairs == 0 {
                b0 = b1;
                continue;
            }
            part.kept_pairs += pairs;
            part.kept_blocks += 1;
            let mut s0 = b0;
            while s0 < b1 {
                let g = (b1 - s0).min(G);
                k.prefetch((s0 + ahead) * d, g * d);
                v.prefetch((s0 + ahead) * d, g * d);
                for t in 0..nq {
                    // x_j = f32(c_t - c_j) (f64 difference), -inf when masked or padding.
                    let mut x = [f32::NEG_INFINITY; G];
                    let cs = &hc.c[s0..s0 + g];
                    if hc.pos.is_some() {
                        for (j, (xj, &cj)) in x.iter_mut().zip(cs).enumerate() {
                            if !masked(t, s0 + j) {
                                *xj = (qc[t] - cj) as f32;
                            }
                        }
                    } else {
                        for (xj, &cj) in x.iter_mut().zip(cs) {
                            *xj = (qc[t] - cj) as f32;
                        }
                    }
                    let acc = &mut part.acc[t * d..(t + 1) * d];
                    let (m, l) = (&mut part.m[t], &mut part.l[t]);
                    fused_update::<V, R>(&q[t * d..(t + 1) * d], k, v, s0, g, d, &mut x, m, l, acc);
                }
                s0 += g;
            }
            b0 = b1;
        }
        part
    }
}

/// `s_n = q·k_{e+n}` for `n < N`: `N` independent FMA chains over `d`, one load of each
/// query vector shared by the `N` rows.
#[inline(always)]
fn dots<V: Vf32, R: KvRows, const N: usize>(q: &[f32], k: R, e: usize, d: usize) -> [f32; N] {
    let l = V::LANES;
    let dv = d - d % l;
    assert!(q.len() >= d && k.len() >= (e + N) * d);
    let mut a = [V::splat(0.0); N];
    let mut i = 0;
    while i < dv {
        let qv = V::load(&q[i..i + l]);
        for (n, an) in a.iter_mut().enumerate() {
            // SAFETY: (e + n) * d + i + LANES <= (e + N) * d <= k.len() (asserted above,
            // i + LANES <= dv <= d).
            *an = unsafe { k.load::<V>((e + n) * d + i) }.fma(qv, *an);
        }
        i += l;
    }
    let mut s = [0.0f32; N];
    if N == 8 {
        s.copy_from_slice(&V::reduce_sum8(core::array::from_fn(|n| a[n])));
    } else {
        for (sn, an) in s.iter_mut().zip(a) {
            *sn = an.reduce_sum();
        }
    }
    for (n, sn) in s.iter_mut().enumerate() {
        for (c, qc) in q.iter().enumerate().take(d).skip(dv) {
            *sn += qc * k.get((e + n) * d + c);
        }
    }
    s
}

/// `acc[c0..c0 + N*LANES] += Σ_j p_j v_{e+j}[c0..]`: `N` accumulator vectors held in
/// registers across the `p.len()` rows.
#[inline(always)]
fn add_pv<V: Vf32, R: KvRows, const N: usize>(
    acc: &mut [f32],
    c0: usize,
    v: R,
    e: usize,
    p: &[f32],
    d: usize,
) {
    let l = V::LANES;
    let acc = &mut acc[c0..c0 + N * l];
    assert!(c0 + N * l <= d && v.len() >= (e + p.len()) * d);
    let mut a = [V::splat(0.0); N];
    for (n, an) in a.iter_mut().enumerate() {
        *an = V::load(&acc[n * l..]);
    }
    for (j, &pj) in p.iter().enumerate() {
        let pv = V::splat(pj);
        for (n, an) in a.iter_mut().enumerate() {
            // SAFETY: (e + j) * d + c0 + (n + 1) * LANES <= (e + j + 1) * d <= v.len()
            // (asserted above).
            *an = unsafe { v.load::<V>((e + j) * d + c0 + n * l) }.fma(pv, *an);
        }
    }
    for (n, an) in a.iter().enumerate() {
        an.store(&mut acc[n * l..]);
    }
}

/// One query's online-softmax update with `g <= G` consecutive entries `e..e + g`:
///
/// ```text
/// x_j  = q·k_j + x_j        (x_j enters as the decay f32(c_t - c_j), or -inf: masked)
/// m'   = max(m, max_j x_j),  alpha = exp(m - m')
/// p_j  = exp(x_j - m'),      l' = alpha l + Σ_j p_j,   acc' = alpha acc + Σ_j p_j v_j
/// ```
///
/// `q` is pre-scaled; `x[g..]` must be `-inf`. A NaN or `+inf` logit sets `l = NaN`, which
/// sticks through later updates and is reported by the merge.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fused_update<V: Vf32, R: KvRows>(
    q: &[f32],
    k: R,
    v: R,
    e: usize,
    g: usize,
    d: usize,
    x: &mut [f32; G],
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    let lanes = V::LANES;
    // Scores q·k_j (0 beyond g), DOTS rows at a time.
    let mut sc = [0.0f32; G];
    let mut j = 0;
    while j + DOTS <= g {
        sc[j..j + DOTS].copy_from_slice(&dots::<V, R, DOTS>(q, k, e + j, d));
        j += DOTS;
    }
    while j < g {
        sc[j] = dots::<V, R, 1>(q, k, e + j, d)[0];
        j += 1;
    }
    // x_j += s_j except where masked (a masked -inf stays, whatever its score).
    let (mut mx, mut bad) = (V::splat(f32::NEG_INFINITY), false);
    for (xc, s) in x.chunks_exact_mut(lanes).zip(sc.chunks_exact(lanes)) {
        let xv = V::load(xc);
        let y = xv.keep_neg_inf(xv.add(V::load(s)));
        bad |= y.any_not_below(f32::INFINITY);
        mx = mx.max(y);
        y.store(xc);
    }
    if bad {
        *l = f32::NAN;
        return;
    }
    let m_new = m.max(mx.reduce_max());
    if m_new == f32::NEG_INFINITY {
        return;
    }
    if m_new > *m {
        let alpha = (*m - m_new).exp();
        *l *= alpha;
        scale_row::<V>(acc, alpha);
        *m = m_new;
    }
    let mn = V::splat(m_new);
    let mut sum = V::splat(0.0);
    for c in x.chunks_exact_mut(lanes) {
        let p = V::load(c).sub(mn).exp();
        p.store(c);
        sum = sum.add(p);
    }
    *l += sum.reduce_sum();
    // acc += Σ_j p_j v_j, up to 8 vectors of acc in registers per pass over the rows.
    let p = &x[..g];
    let nv = d / lanes;
    let mut c0 = 0;
    let mut left = nv;
    while left >= 8 {
        add_pv::<V, R, 8>(acc, c0, v, e, p, d);
        c0 += 8 * lanes;
        left -= 8;
    }
    if left >= 4 {
        add_pv::<V, R, 4>(acc, c0, v, e, p, d);
        c0 += 4 * lanes;
        left -= 4;
    }
    if left >= 2 {
        add_pv::<V, R, 2>(acc, c0, v, e, p, d);
        c0 += 2 * lanes;
        left -= 2;
    }
    if left == 1 {
        add_pv::<V, R, 1>(acc, c0, v, e, p, d);
        c0 += lanes;
    }
    for (c, a) in acc.iter_mut().enumerate().skip(c0) {
        for (jj, &pj) in p.iter().enumerate() {
            *a += pj * v.get((e + jj) * d + c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Plain scalar reference of [`fused_update`]: f64 dot products, `f32::exp`, rows
    /// given as f32.
    #[allow(clippy::too_many_arguments)]
    fn fused_update_ref(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        e: usize,
        g: usize,
        d: usize,
        x: &mut [f32; G],
        m: &mut f32,
        l: &mut f32,
        acc: &mut [f32],
    ) {
        for j in 0..g {
            if x[j] != f32::NEG_INFINITY {
                let s: f64 = (0..d)
                    .map(|c| f64::from(q[c]) * f64::from(k[(e + j) * d + c]))
                    .sum();
                x[j] += s as f32;
            }
        }
        if x.iter().any(|y| y.is_nan() || *y == f32::INFINITY) {
            *l = f32::NAN;
            return;
        }
        let m_new = x.iter().fold(*m, |a, &b| a.max(b));
        if m_new == f32::NEG_INFINITY {
            return;
        }
        let alpha = if m_new > *m { (*m - m_new).exp() } else { 1.0 };
        *l *= alpha;
        for a in acc.iter_mut() {
            *a *= alpha;
        }
        *m = m_new;
        for j in 0..g {
            let p = (x[j] - m_new).exp();
            *l += p;
            for c in 0..d {
                acc[c] += p * v[(e + j) * d + c];
            }
        }
    }

    struct Run<'a, R: KvRows> {
        q: &'a [f32],
        k: R,
        v: R,
        e: usize,
        g: usize,
        d: usize,
        x: [f32; G],
        m: f32,
        l: f32,
        acc: Vec<f32>,
    }

    impl<R: KvRows> WithSimd for Run<'_, R> {
        type Output = (f32, f32, Vec<f32>);
        #[inline(always)]
        fn run<V: Vf32>(mut self) -> Self::Output {
            fused_update::<V, R>(
                self.q,
                self.k,
                self.v,
                self.e,
                self.g,
                self.d,
                &mut self.x,
                &mut self.m,
                &mut self.l,
                &mut self.acc,
            );
            (self.m, self.l, self.acc)
        }
    }

    fn lcg(s: &mut u64) -> f32 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let n: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum();
        let r: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        (n / r.max(1e-300)).sqrt()
    }

    /// Every instruction set and storage type against the scalar reference: odd head
    /// dims (vector tails), partial sub-blocks, masked entries, a running state that
    /// rescales or not.
    #[test]
    fn fused_update_matches_scalar_reference() {
        let mut s = 11;
        for d in [8, 24, 64, 136] {
            for g in [G, 11, 8, 3, 1] {
                for (case, m0) in [(0, f32::NEG_INFINITY), (1, -3.0), (2, 40.0)] {
                    let n = 40;
                    let e = 5;
                    let q: Vec<f32> = (0..d).map(|_| lcg(&mut s)).collect();
                    let kf: Vec<f32> = (0..n * d).map(|_| lcg(&mut s) * 2.0).collect();
                    let vf: Vec<f32> = (0..n * d).map(|_| lcg(&mut s)).collect();
                    let mut x = [f32::NEG_INFINITY; G];
                    for (j, xj) in x.iter_mut().enumerate().take(g) {
                        if (j + case) % 5 != 3 {
                            *xj = -lcg(&mut s).abs() * 4.0;
                        }
                    }
                    let (l0, acc0): (f32, Vec<f32>) = if m0 == f32::NEG_INFINITY {
                        (0.0, vec![0.0; d])
                    } else {
                        (1.7, (0..d).map(|_| lcg(&mut s)).collect())
                    };
                    for dt in [DType::F32, DType::F16, DType::Bf16] {
                        let (k16, v16): (Vec<u16>, Vec<u16>) = match dt {
                            DType::F16 => (
                                kf.iter().map(|&y| f16::from_f32(y).to_bits()).collect(),
                                vf.iter().map(|&y| f16::from_f32(y).to_bits()).collect(),
                            ),
                            _ => (
                                kf.iter().map(|&y| bf16::from_f32(y).to_bits()).collect(),
                                vf.iter().map(|&y| bf16::from_f32(y).to_bits()).collect(),
                            ),
                        };
                        let widen = |b: &[u16]| -> Vec<f32> {
                            match dt {
                                DType::F16 => {
                                    b.iter().map(|&y| f16::from_bits(y).to_f32()).collect()
                                }
                                _ => b.iter().map(|&y| bf16::from_bits(y).to_f32()).collect(),
                            }
                        };
                        let (kr, vr) = match dt {
                            DType::F32 => (kf.clone(), vf.clone()),
                            _ => (widen(&k16), widen(&v16)),
                        };
                        let (mut xr, mut mr, mut lr, mut ar) = (x, m0, l0, acc0.clone());
                        fused_update_ref(&q, &kr, &vr, e, g, d, &mut xr, &mut mr, &mut lr, &mut ar);
                        for isa in Isa::available() {
                            // The same update over the rows in each storage form.
                            macro_rules! run {
                                ($rows:ident, $k:expr, $v:expr) => {
                                    dispatch(
                                        isa,
                                        Run {
                                            q: &q,
                                            k: $rows($k),
                                            v: $rows($v),
                                            e,
                                            g,
                                            d,
                                            x,
                                            m: m0,
                                            l: l0,
                                            acc: acc0.clone(),
                                        },
                                    )
                                };
                            }
                            let got = match dt {
                                DType::F32 => run!(F32Rows, &kf, &vf),
                                DType::F16 => run!(F16Rows, &k16, &v16),
                                DType::Bf16 => run!(Bf16Rows, &k16, &v16),
                            };
                            let what = format!("{isa:?} {dt:?} d={d} g={g} case {case}");
                            assert!((got.0 - mr).abs() <= 1e-5 * (1.0 + mr.abs()), "m {what}");
                            assert!(((got.1 - lr) / lr).abs() <= 1e-5, "l {what}");
                            assert!(rel(&got.2, &ar) <= 1e-5, "acc {what}");
                        }
                    }
                }
            }
        }
    }

    /// A NaN key on a masked entry is ignored; on a kept one it poisons `l`.
    #[test]
    fn fused_update_flags_non_finite_scores_only_where_kept() {
        let d = 16;
        let q = vec![0.5f32; d];
        let mut k = vec![0.25f32; 20 * d];
        k[3 * d + 2] = f32::NAN;
        let v = vec![1.0f32; 20 * d];
        for isa in Isa::available() {
            for (masked, want_nan) in [(true, false), (false, true)] {
                let mut x = [0.0f32; G];
                if masked {
                    x[3] = f32::NEG_INFINITY;
                }
                let r = dispatch(
                    isa,
                    Run {
                        q: &q,
                        k: F32Rows(&k),
                        v: F32Rows(&v),
                        e: 0,
                        g: G,
                        d,
                        x,
                        m: f32::NEG_INFINITY,
                        l: 0.0,
                        acc: vec![0.0; d],
                    },
                );
                assert_eq!(r.1.is_nan(), want_nan, "{isa:?} masked={masked}");
            }
        }
    }
}
