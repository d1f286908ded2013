//! Continuation prefill: a chunk of new tokens attends the retained cache (unordered
//! entries carrying their `c_j`) and, causally, its own keys, in tiles.
//!
//! Tile loop for one (head h, query tile I), rows `t0..t1` of the chunk:
//!
//! ```text
//! c_ref = c[t0]                                   the tile's largest c (non-increasing)
//! for key tile J of the cache (block_k entries in slot order), then of the new keys
//! (0 ..= the diagonal tile):
//!     skip if no query of I sees a key of J       (ends, causality)
//!     skip if c_ref - min_J c_j < delta           foxedge-core's continue_tile_pruned
//!     S   = (s Q) K^T + (c_i - c_ref) - (c_j - c_ref)
//!           masked: new key after the query; query at or past the key's end
//!     online softmax: m_i, l_i, acc_i <- rescale by exp(m_old - m_new), add P V
//! o_i = acc_i / l_i
//! ```
//!
//! The tile arithmetic (transposed register tiles, online softmax, `c` as f32 hi/lo
//! pairs) is prefill's ([`crate::prefill`]), run in one [`Vf32`] instantiation chosen by
//! [`dispatch`]; the one-lane scalar instantiation is the reference the vector paths are
//! tested against, and [`crate::reference::prefill_continue_f64`] the f64 definition.

use crate::prefill::{
    KeyCut, M_FLOOR, NON_FINITE, SCRATCH, Scratch, SharedMut, SoftmaxArgs, normalized_rows,
    scale_row, sized, softmax_block, split_f64, tile_mm, transpose,
};
use crate::simd::{Isa, Vf32, WithSimd, dispatch, prefetch, widen};
use foxedge_core::contract::{
    AttentionStats, ContinueArgs, ContinueOptions, HeadStats, Storage, acp,
};
use foxedge_core::{Error, Result};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

/// A key position before every query: no causal mask (cache entries precede the chunk).
const BEFORE_ALL: isize = isize::MIN / 4;

/// Continuation prefill with the widest instruction set of this CPU.
///
/// `out`: `[n_queries, heads, head_dim]`. Every query sees at least its own key, so every
/// row is a softmax over one key or more.
///
/// Errors: those of [`ContinueArgs::check`], an `out` of the wrong length, and a
/// non-finite softmax (q, k or v holding NaN/inf, or `s q·k` overflowing f32).
pub fn prefill_continue<T: Storage, O: Storage>(
    args: &ContinueArgs<'_, T>,
    opts: &ContinueOptions<'_>,
    out: &mut [O],
) -> Result<AttentionStats> {
    prefill_continue_with_isa(Isa::detect(), args, opts, out)
}

/// [`prefill_continue`] with a chosen instruction set (tests and benches compare them).
pub fn prefill_continue_with_isa<T: Storage, O: Storage>(
    isa: Isa,
    args: &ContinueArgs<'_, T>,
    opts: &ContinueOptions<'_>,
    out: &mut [O],
) -> Result<AttentionStats> {
    args.check(opts)?;
    let (d, t, nh) = (args.head_dim, args.n_queries, args.heads());
    if out.len() != t * nh * d {
        return Err(Error::BadLength {
            what: "continue out",
            expected: t * nh * d,
            got: out.len(),
        });
    }
    let scale = opts.sm_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let (bq, bk) = (opts.block_q, opts.block_k);

    // Decisions, per head: delta over N = cache entries + new tokens, and the least c of
    // every cache key tile (read by each query tile of the head).
    let mut deltas = Vec::with_capacity(nh);
    let mut cache_min: Vec<Vec<f64>> = Vec::with_capacity(nh);
    for (h, hc) in args.cache.iter().enumerate() {
        let delta = acp::decode_delta(&opts.acp, h, hc.c.len() + t)?;
        deltas.push(delta);
        cache_min.push(match delta {
            Some(_) => hc.c.chunks(bk).map(acp::block_min).collect(),
            None => Vec::new(),
        });
    }

    // Tasks (head, query tile), grouped by head and heaviest first within each (later
    // tiles see more new keys): a thread walks one head's query tiles while that head's
    // cache rows stay in its caches, as prefill's tasks do.
    let nqb = t.div_ceil(bq);
    let tasks: Vec<(usize, usize)> = (0..nh)
        .flat_map(|h| (0..nqb).rev().map(move |qb| (h, qb)))
        .collect();

    let ctx = Ctx {
        args,
        isa,
        scale,
        bq,
        bk,
        deltas: &deltas,
        cache_min: &cache_min,
        out: SharedMut::new(out),
        non_finite: AtomicBool::new(false),
    };
    let parts: Vec<(usize, HeadStats)> = tasks
        .par_iter()
        .with_max_len(1)
        .map(|&(h, qb)| {
            let st = SCRATCH.with(|s| ctx.run_tile(h, qb, &mut s.borrow_mut()));
            (h, st)
        })
        .collect();
    if ctx.non_finite.load(Ordering::Relaxed) {
        return Err(NON_FINITE);
    }
    let mut stats = AttentionStats {
        heads: deltas
            .iter()
            .map(|&delta| HeadStats {
                delta,
                ..HeadStats::default()
            })
            .collect(),
    };
    for (h, p) in parts {
        let s = &mut stats.heads[h];
        s.kept_pairs += p.kept_pairs;
        s.total_pairs += p.total_pairs;
        s.kept_blocks += p.kept_blocks;
        s.total_blocks += p.total_blocks;
    }
    Ok(stats)
}

struct Ctx<'a, 'b, T: Storage, O: Storage> {
    args: &'a ContinueArgs<'b, T>,
    isa: Isa,
    scale: f32,
    bq: usize,
    bk: usize,
    deltas: &'a [Option<f64>],
    cache_min: &'a [Vec<f64>],
    out: SharedMut<O>,
    /// Set by a task whose softmax is not finite.
    non_finite: AtomicBool,
}

impl<T: Storage, O: Storage> Ctx<'_, '_, T, O> {
    fn run_tile(&self, h: usize, qb: usize, scr: &mut Scratch) -> HeadStats {
        dispatch(
            self.isa,
            Tile {
                ctx: self,
                h,
                qb,
                scr,
            },
        )
    }
}

/// `n` rows of `src` from element `base`, row stride `rs`, `d` values each, as f32: in
/// place when the storage is f32, otherwise widened into `buf` (stride `d`).
#[inline(always)]
fn rows_f32<'t, V: Vf32, T: Storage>(
    src: &'t [T],
    buf: &'t mut Vec<f32>,
    base: usize,
    n: usize,
    rs: usize,
    d: usize,
) -> (&'t [f32], usize) {
    if let Some(f) = T::as_f32(src) {
        return (&f[base..base + (n - 1) * rs + d], rs);
    }
    let dst = sized(buf, n * d);
    for j in 0..n {
        widen::<V, T>(&src[base + j * rs..][..d], &mut dst[j * d..(j + 1) * d]);
    }
    (dst, d)
}

/// One (head, query tile) task, run inside [`dispatch`]; returns its pair counts.
struct Tile<'s, 'a, 'b, T: Storage, O: Storage> {
    ctx: &'s Ctx<'a, 'b, T, O>,
    h: usize,
    qb: usize,
    scr: &'s mut Scratch,
}

impl<T: Storage, O: Storage> WithSimd for Tile<'_, '_, '_, T, O> {
    type Output = HeadStats;
    #[inline(always)]
    fn run<V: Vf32>(self) -> HeadStats {
        let Tile { ctx, h, qb, scr } = self;
        let a = ctx.args;
        let (d, t, nh) = (a.head_dim, a.n_queries, a.heads());
        let rs = nh * d;
        let (bq, bk) = (ctx.bq, ctx.bk);
        let t0 = qb * bq;
        let nq = (t - t0).min(bq);
        let w = V::MM_COLS * V::LANES;
        let nqp = nq.div_ceil(w) * w;
        let qc = |i: usize| a.q_c[i * nh + h];
        let c_ref = qc(t0);
        let delta = ctx.deltas[h];
        let mut st_out = HeadStats::default();

        // qt[p][i] = s q_i[p]; padded columns 0.
        let qrows = sized(&mut scr.row, nq * d);
        for (i, r) in qrows.chunks_exact_mut(d).enumerate() {
            r.copy_from_slice(&a.q[(t0 + i) * rs + h * d..][..d]);
        }
        let qt = sized(&mut scr.qt, d * nqp);
        transpose::<V>(qrows, d, qt, nqp, nq, d);
        for r in qt.chunks_exact_mut(nqp) {
            scale_row::<V>(&mut r[..nq], ctx.scale);
            r[nq..].fill(0.0);
        }
        let cq = sized(&mut scr.cq, nqp);
        let cq_lo = sized(&mut scr.cq_lo, nqp);
        for (i, (hi, lo)) in cq.iter_mut().zip(cq_lo.iter_mut()).enumerate() {
            (*hi, *lo) = split_f64(qc(t0 + i.min(nq - 1)) - c_ref);
        }
        let acc = sized(&mut scr.acc, d * nqp);
        acc.fill(0.0);
        let m = sized(&mut scr.m, nqp);
        m.fill(M_FLOOR);
        let l = sized(&mut scr.l, nqp);
        l.fill(0.0);
        let mx = sized(&mut scr.mx, nqp);
        let alpha = sized(&mut scr.alpha, nqp);

        // Cache tiles: every entry precedes every query; entry j is seen by the queries
        // before its end.
        let hc = &a.cache[h];
        let n = hc.c.len();
        let cache_end = a.cache_end.map(|e| e[h]);
        let pruned = |kb: usize| {
            delta.is_some_and(|dl| acp::continue_tile_pruned(c_ref, ctx.cache_min[h][kb], dl))
        };
        for (kb, j0) in (0..n).step_by(bk).enumerate() {
            let nk = (n - j0).min(bk);
            // The next kept tile's K and V rows start loading while this one runs.
            if let Some(nb) = (kb + 1..n.div_ceil(bk)).find(|&b| !pruned(b)) {
                let (a0, a1) = (nb * bk * d, ((nb + 1) * bk).min(n) * d);
                prefetch(&hc.k[a0..a1]);
                prefetch(&hc.v[a0..a1]);
            }
            let hi = sized(&mut scr.hi, nk);
            let mut pairs = 0u64;
            for (j, x) in hi.iter_mut().enumerate() {
                let end = cache_end.map_or(t, |e| e[j0 + j] as usize);
                *x = end.saturating_sub(t0).min(nq) as u32;
                pairs += u64::from(*x);
            }
            if pairs == 0 {
                continue;
            }
            st_out.total_pairs += pairs;
            st_out.total_blocks += 1;
            if pruned(kb) {
                continue;
            }
            st_out.kept_pairs += pairs;
            st_out.kept_blocks += 1;
            let st = sized(&mut scr.st, nk * nqp);
            let (kt, krs) = rows_f32::<V, T>(hc.k, &mut scr.k, j0 * d, nk, d, d);
            let all = KeyCut::Rows(BEFORE_ALL);
            tile_mm::<V>(st, nqp, kt, krs, 1, qt, nqp, nk, d, nqp, false, all);
            softmax_block::<V>(SoftmaxArgs {
                st,
                nqp,
                nk,
                lo: 0,
                causal0: BEFORE_ALL,
                hi: cache_end.map(|_| &scr.hi[..nk]),
                ck: &hc.c[j0..j0 + nk],
                c_ref,
                cq,
                cq_lo,
                m,
                l,
                mx,
                alpha,
                acc,
                d,
            });
            let (vt, vrs) = rows_f32::<V, T>(hc.v, &mut scr.v, j0 * d, nk, d, d);
            let all = KeyCut::Depth(BEFORE_ALL);
            tile_mm::<V>(acc, nqp, vt, 1, vrs, st, nqp, d, nk, nqp, true, all);
        }

        // New-key tiles up to the diagonal: key i is seen by queries i..end_i.
        let p_last = t0 + nq - 1;
        for j0 in (0..=p_last).step_by(bk) {
            let nk = (p_last + 1 - j0).min(bk);
            let causal0 = j0 as isize - t0 as isize;
            let hi = sized(&mut scr.hi, nk);
            let ck = sized(&mut scr.ck, nk);
            let mut pairs = 0u64;
            for j in 0..nk {
                let i = j0 + j;
                let end = a.key_end.map_or(t, |e| e[i * nh + h] as usize);
                hi[j] = end.saturating_sub(t0).min(nq) as u32;
                let first = i.saturating_sub(t0);
                pairs += u64::from(hi[j]).saturating_sub(first as u64);
                ck[j] = qc(i);
            }
            if pairs == 0 {
                continue;
            }
            st_out.total_pairs += pairs;
            st_out.total_blocks += 1;
            if delta.is_some_and(|dl| acp::continue_tile_pruned(c_ref, acp::block_min(ck), dl)) {
                continue;
            }
            st_out.kept_pairs += pairs;
            st_out.kept_blocks += 1;
            let st = sized(&mut scr.st, nk * nqp);
            let (kt, krs) = rows_f32::<V, T>(a.k, &mut scr.k, j0 * rs + h * d, nk, rs, d);
            let rows = KeyCut::Rows(causal0);
            tile_mm::<V>(st, nqp, kt, krs, 1, qt, nqp, nk, d, nqp, false, rows);
            softmax_block::<V>(SoftmaxArgs {
                st,
                nqp,
                nk,
                lo: 0,
                causal0,
                hi: a.key_end.map(|_| &scr.hi[..nk]),
                ck: &scr.ck[..nk],
                c_ref,
                cq,
                cq_lo,
                m,
                l,
                mx,
                alpha,
                acc,
                d,
            });
            let (vt, vrs) = rows_f32::<V, T>(a.v, &mut scr.v, j0 * rs + h * d, nk, rs, d);
            let depth = KeyCut::Depth(causal0);
            tile_mm::<V>(acc, nqp, vt, 1, vrs, st, nqp, d, nk, nqp, true, depth);
        }

        // o_i = acc_i / l_i, scaled across queries, then transposed into row order.
        let rows = normalized_rows::<V>(acc, nqp, l, nq, d, &mut scr.alpha, &mut scr.row);
        for (i, row) in rows.chunks_exact(d).enumerate() {
            if !(l[i] > 0.0 && l[i].is_finite() && m[i].is_finite()) {
                ctx.non_finite.store(true, Ordering::Relaxed);
            }
            // SAFETY: row (t0 + i, h) of `out` belongs to this task alone (tasks are
            // distinct (head, query tile) pairs and the rows of a tile are disjoint).
            let o = unsafe { ctx.out.slice((t0 + i) * rs + h * d, d) };
            O::from_f32_slice(row, o);
        }
        st_out
    }
}
