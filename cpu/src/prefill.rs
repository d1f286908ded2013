//! Prefill: tiled forgetting attention over `seq_q` queries and `seq_k` keys.
//!
//! Tile loop for one (batch b, query head h, query block I), rows `t0..t1`:
//!
//! ```text
//! r      = q_offset + t0                        first row's key position
//! cq_i   = f32(c[q_offset + t] - c[r])          decay of each row, relative to row r
//! for key block n in start[I] ..= diag(I):      start[I] from foxedge-core (Algorithm 1)
//!     ck_j = f32(c[j] - c[r])
//!     S    = (s Q) K^T + cq_i - ck_j            masked: j > row position, j < seq_start
//!     online softmax: m_i, l_i, acc_i <- rescale by exp(m_old - m_new), add P V
//! o_i = acc_i / l_i,   lse_i = m_i + ln l_i
//! ```
//!
//! Everything inside a task runs in one [`Vf32`] instantiation chosen by [`dispatch`]
//! (AVX-512, AVX2+FMA, `wide` / NEON, or one-lane scalar: the reference that the vector
//! paths are tested against). The `gemm` crate is not used: on 64 x 64 tiles its
//! per-call packing left the whole kernel 1.6-2.5x slower than this register tile
//! (measured 2026-11-22).

use crate::simd::{Isa, Vf32, WithSimd, dispatch, prefetch, widen};
use foxedge_core::boundary::BlockGrid;
use foxedge_core::contract::{
    Acp, AttentionStats, PrefillArgs, PrefillOptions, Storage, acp, selected_slabs,
};
use foxedge_core::{Error, Result, gate};
use rayon::prelude::*;
use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

/// A row that attended keys ended with a non-finite softmax: q, k or v holds NaN/inf, or
/// `s q.k` overflows f32. Reported instead of writing a meaningless row.
pub const NON_FINITE: Error = Error::BadArgument(
    "attention logits are not finite: q, k or v holds NaN/inf, or s*q.k overflows f32",
);

/// Forgetting-attention prefill with the widest instruction set of this CPU.
///
/// `out` has `shape.q_len()` elements in `shape.layout`; `lse`, when given, receives the
/// natural-log normaliser `ln Σ_j exp(s q_i·k_j + D_ij)` per row in `[batch, heads_q,
/// seq_q]` order (`-inf` for padded rows, whose output is 0).
///
/// Errors: a bad shape or buffer length, `seq_start` of the wrong length or with a value
/// `>= seq_k`, zero block sizes, a non-finite `sm_scale`, a NaN / infinite / positive log
/// gate ([`Error::BadLogGate`]), and bad ACP parameters (lengths, NaN, `ln_eps > 0`).
pub fn prefill<T: Storage, O: Storage>(
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> Result<AttentionStats> {
    prefill_with_isa(Isa::detect(), args, opts, out, lse)
}

/// [`prefill`] with a chosen instruction set (tests and benches compare them).
pub fn prefill_with_isa<T: Storage, O: Storage>(
    isa: Isa,
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> Result<AttentionStats> {
    let sh = &args.shape;
    validate(args, opts, out.len(), lse.as_deref().map(<[f32]>::len))?;
    let scale = opts.sm_scale.unwrap_or(1.0 / (sh.head_dim as f32).sqrt());
    let grid = BlockGrid::new(opts.block_q, opts.block_k, sh.seq_q, sh.seq_k)?;
    let heads = sh.batch * sh.heads_q;
    let nqb = grid.q_blocks();
    let slabs: Vec<usize> = selected_slabs(sh, opts.heads)?.collect();

    // Decisions, per (batch, query head): c (f64), delta, start blocks, pair counts.
    let key_start: Vec<usize> = match args.seq_start {
        Some(s) => s.to_vec(),
        None => vec![0; sh.batch],
    };
    let mut stats = AttentionStats {
        heads: Vec::with_capacity(slabs.len()),
    };
    let (c, starts): (Cow<'_, [f64]>, Cow<'_, [u32]>) = match opts.acp {
        Acp::Decided(dec) => {
            acp::check_decisions(&dec, &grid, heads, sh.seq_k)?;
            for &bh in &slabs {
                let ks = key_start[bh / sh.heads_q];
                let st = &dec.start_blocks[bh * nqb..(bh + 1) * nqb];
                stats
                    .heads
                    .push(acp::head_stats(&grid, st, ks, dec.delta[bh]));
            }
            (Cow::Borrowed(dec.c), Cow::Borrowed(dec.start_blocks))
        }
        _ => {
            // c and start blocks of the computed slabs (others stay 0, never read).
            let mut c = vec![0.0f64; heads * sh.seq_k];
            if opts.heads.is_none() {
                gate::cumsum_heads(sh, args.log_fgate, &mut c)?;
            }
            let mut starts = vec![0u32; heads * nqb];
            for &bh in &slabs {
                let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
                let cb = &mut c[bh * sh.seq_k..(bh + 1) * sh.seq_k];
                if opts.heads.is_some() {
                    let gates = &args.log_fgate[sh.gate_at(b, 0, h)..];
                    gate::cumsum_strided(gates, sh.gate_stride(), 0.0, cb)?;
                }
                let st = &mut starts[bh * nqb..(bh + 1) * nqb];
                let ks = key_start[b];
                stats.heads.push(acp::decide_slab(
                    args, &opts.acp, scale, &grid, bh, ks, cb, st,
                )?);
            }
            (Cow::Owned(c), Cow::Owned(starts))
        }
    };

    // Tasks (batch, head, query block), grouped by (batch, head) and heaviest first within
    // each: a thread walks one head's query blocks while that head's K/V (8 MiB at L =
    // 16384, d = 64) stays in the last-level cache, instead of cycling through every
    // head's K/V (measured at L = 16384, 8 heads: 5-10% more work per CPU-second). Work
    // stealing splits the list in halves, and each half ends on the light early blocks,
    // so the uneven rows that ACP leaves still balance.
    let mut tasks: Vec<(usize, usize, usize)> = Vec::with_capacity(slabs.len() * nqb);
    for &bh in &slabs {
        for qb in 0..nqb {
            let diag = grid.diag_block(qb);
            let start = starts[bh * nqb + qb] as usize;
            let rows = (sh.seq_q - qb * opts.block_q).min(opts.block_q);
            let work = (diag + 1).saturating_sub(start) * rows + 1;
            tasks.push((work, bh, qb));
        }
    }
    tasks.sort_unstable_by_key(|t| (t.1, std::cmp::Reverse(t.0)));

    let lse_len = heads * sh.seq_q;
    let ctx = Ctx {
        args,
        isa,
        scale,
        grid,
        c: &c,
        starts: &starts,
        key_start: &key_start,
        out: SharedMut::new(out),
        lse: lse.map(SharedMut::new),
        non_finite: AtomicBool::new(false),
    };
    debug_assert!(ctx.lse.as_ref().is_none_or(|l| l.len == lse_len));
    tasks.par_iter().with_max_len(1).for_each(|&(_, bh, qb)| {
        SCRATCH.with(|s| ctx.run_tile(bh, qb, &mut s.borrow_mut()));
    });
    if ctx.non_finite.load(Ordering::Relaxed) {
        return Err(NON_FINITE);
    }
    Ok(stats)
}

/// The contract's checks ([`PrefillArgs::check`]), then the output lengths.
fn validate<T: Storage>(
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    out_len: usize,
    lse_len: Option<usize>,
) -> Result<()> {
    args.check(opts)?;
    let sh = &args.shape;
    let len = |what, expected, got| {
        if expected == got {
            Ok(())
        } else {
            Err(Error::BadLength {
                what,
                expected,
                got,
            })
        }
    };
    len("out", sh.q_len(), out_len)?;
    if let Some(l) = lse_len {
        len("lse", sh.batch * sh.heads_q * sh.seq_q, l)?;
    }
    Ok(())
}

/// A mutable buffer written by several tasks, each to its own disjoint elements.
pub(crate) struct SharedMut<E> {
    ptr: *mut E,
    pub(crate) len: usize,
}

// SAFETY: `SharedMut` only hands out `&mut` to ranges that the caller of `slice`
// guarantees no other thread touches; `E: Send` makes moving those elements across
// threads sound.
unsafe impl<E: Send> Sync for SharedMut<E> {}
// SAFETY: as above.
unsafe impl<E: Send> Send for SharedMut<E> {}

impl<E> SharedMut<E> {
    pub(crate) fn new(s: &mut [E]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// `&mut buf[off..off + n]`.
    ///
    /// # Safety
    /// No other live reference (from this or another thread) may overlap that range,
    /// and the borrowed buffer must outlive the result.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, off: usize, n: usize) -> &mut [E] {
        assert!(off <= self.len && n <= self.len - off, "SharedMut range");
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }
}

/// Per-thread tile buffers, reused across tasks (prefill and continuation).
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) qt: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) st: Vec<f32>,
    pub(crate) acc: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    pub(crate) mx: Vec<f32>,
    pub(crate) alpha: Vec<f32>,
    pub(crate) cq: Vec<f32>,
    pub(crate) cq_lo: Vec<f32>,
    pub(crate) row: Vec<f32>,
    /// Per-key column bounds of a continuation tile.
    pub(crate) hi: Vec<u32>,
    /// `c` of a continuation tile's new keys.
    pub(crate) ck: Vec<f64>,
}

thread_local! {
    pub(crate) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

pub(crate) fn sized<E: Copy + Default>(v: &mut Vec<E>, n: usize) -> &mut [E] {
    if v.len() < n {
        v.resize(n, E::default());
    }
    &mut v[..n]
}

/// Stand-in for `-inf` as the initial running max: finite, so that `m_old - m_new` is
/// never `-inf - -inf`; far below any real logit.
pub(crate) const M_FLOOR: f32 = -1e30;

struct Ctx<'a, 'b, T: Storage, O: Storage> {
    args: &'a PrefillArgs<'b, T>,
    isa: Isa,
    scale: f32,
    grid: BlockGrid,
    c: &'a [f64],
    starts: &'a [u32],
    key_start: &'a [usize],
    out: SharedMut<O>,
    lse: Option<SharedMut<f32>>,
    /// Set by a task whose row attended keys but whose softmax is not finite.
    non_finite: AtomicBool,
}

impl<T: Storage, O: Storage> Ctx<'_, '_, T, O> {
    fn run_tile(&self, bh: usize, qb: usize, scr: &mut Scratch) {
        dispatch(
            self.isa,
            Tile {
                ctx: self,
                bh,
                qb,
                scr,
            },
        );
    }

    /// Prefetches K and V rows `j0..j0+n` of (b, hk).
    #[inline(always)]
    fn prefetch_kv(&self, b: usize, hk: usize, j0: usize, n: usize) {
        let sh = &self.args.shape;
        let (d, rs) = (sh.head_dim, sh.kv_row_stride());
        let base = sh.kv_at(b, j0, hk);
        for src in [self.args.k, self.args.v] {
            if rs == d {
                prefetch(&src[base..base + n * d]);
            } else {
                for j in 0..n {
                    prefetch(&src[base + j * rs..][..d]);
                }
            }
        }
    }

    /// K or V rows `j0..j0+n` of (b, hk) as f32 with their row stride: in place when the
    /// storage is f32, otherwise converted into `buf` (stride `d`).
    #[inline(always)]
    fn kv_tile<'t, V: Vf32>(
        &self,
        src: &'t [T],
        buf: &'t mut Vec<f32>,
        b: usize,
        hk: usize,
        j0: usize,
        n: usize,
    ) -> (&'t [f32], usize) {
        let sh = &self.args.shape;
        let d = sh.head_dim;
        let rs = sh.kv_row_stride();
        let base = sh.kv_at(b, j0, hk);
        let span = (n - 1) * rs + d;
        if let Some(f) = T::as_f32(src) {
            return (&f[base..base + span], rs);
        }
        let dst = sized(buf, n * d);
        if rs == d {
            widen::<V, T>(&src[base..base + n * d], dst);
        } else {
            for j in 0..n {
                widen::<V, T>(&src[base + j * rs..][..d], &mut dst[j * d..(j + 1) * d]);
            }
        }
        (dst, d)
    }
}

/// One (batch, head, query block) task, run inside [`dispatch`].
///
/// Tiles are kept transposed so that every vector runs across query rows: `qt[p][i]`,
/// `st[j][i]` (scores, then probabilities), `acc[c][i]`. The softmax then needs no
/// horizontal reduction (row max and sum are elementwise across keys), and both matrix
/// products are broadcast-times-vector micro-kernels ([`bcast_mm`]) with no packing.
/// K and V tiles in f16/bf16 are widened once per block ([`widen`]).
struct Tile<'s, 'a, 'b, T: Storage, O: Storage> {
    ctx: &'s Ctx<'a, 'b, T, O>,
    bh: usize,
    qb: usize,
    scr: &'s mut Scratch,
}

impl<T: Storage, O: Storage> WithSimd for Tile<'_, '_, '_, T, O> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vf32>(self) {
        let Tile { ctx, bh, qb, scr } = self;
        let sh = &ctx.args.shape;
        let (d, bq, bk) = (sh.head_dim, ctx.grid.block_q, ctx.grid.block_k);
        let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
        let hk = h / sh.group();
        let t0 = qb * bq;
        let nq = (sh.seq_q - t0).min(bq);
        // Query columns padded to the micro-kernel width.
        let w = V::MM_COLS * V::LANES;
        let nqp = nq.div_ceil(w) * w;
        let p0 = sh.q_offset() + t0;
        let ks = ctx.key_start[b];
        let c = &ctx.c[bh * sh.seq_k..(bh + 1) * sh.seq_k];
        let c_ref = c[p0];

        let acc = sized(&mut scr.acc, d * nqp);
        acc.fill(0.0);
        let m = sized(&mut scr.m, nqp);
        m.fill(M_FLOOR);
        let l = sized(&mut scr.l, nqp);
        l.fill(0.0);

        if p0 + nq > ks {
            // qt[p][i] = s q_i[p]; padded columns 0.
            // Rows of Q are widened first, then transposed in 8 x 8 register blocks
            // (measured at L = 2048, f32: transposing element by element took 40% of a
            // task's fixed cost, and the ACP prefill was 5% slower).
            let qrows = sized(&mut scr.row, nq * d);
            for (i, r) in qrows.chunks_exact_mut(d).enumerate() {
                widen::<V, T>(&ctx.args.q[sh.q_at(b, t0 + i, h)..][..d], r);
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
                (*hi, *lo) = split_f64(c[p0 + i.min(nq - 1)] - c_ref);
            }
            let mx = sized(&mut scr.mx, nqp);
            let alpha = sized(&mut scr.alpha, nqp);
            let start = ctx.starts[bh * ctx.grid.q_blocks() + qb] as usize;
            let diag = ctx.grid.diag_block(qb);
            let p_last = p0 + nq - 1;
            for kb in start..=diag {
                let j0 = kb * bk;
                let nk = ((kb + 1) * bk).min(p_last + 1) - j0;
                if kb < diag {
                    let nn = ((kb + 2) * bk).min(p_last + 1) - j0 - bk;
                    ctx.prefetch_kv(b, hk, j0 + bk, nn);
                }
                let (kt, krs) = ctx.kv_tile::<V>(ctx.args.k, &mut scr.k, b, hk, j0, nk);
                let st = sized(&mut scr.st, nk * nqp);
                // st[j][i] = s q_i·k_j
                // Keys are the rows; a diagonal tile skips those after all queries of a
                // column chunk (softmax masks them to -inf whatever st holds there).
                let causal0 = j0 as isize - p0 as isize;
                let keys_rows = KeyCut::Rows(causal0);
                tile_mm::<V>(st, nqp, kt, krs, 1, qt, nqp, nk, d, nqp, false, keys_rows);
                let lo = ks.saturating_sub(j0).min(nk);
                softmax_block::<V>(SoftmaxArgs {
                    st,
                    nqp,
                    nk,
                    lo,
                    // Row j masks query columns i < j0 + j - p0 (causal).
                    causal0,
                    hi: None,
                    ck: &c[j0..j0 + nk],
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
                let (vt, vrs) = ctx.kv_tile::<V>(ctx.args.v, &mut scr.v, b, hk, j0, nk);
                // acc[c][i] += Σ_j v_j[c] p_ij
                // Keys are the depth; the skipped keys have probability 0 there.
                let keys_depth = KeyCut::Depth(causal0);
                tile_mm::<V>(acc, nqp, vt, 1, vrs, st, nqp, d, nk, nqp, true, keys_depth);
            }
        }

        // o_i = acc_i / l_i; rows that attended nothing (padding) get 0 and lse -inf.
        // Scaled in place across queries, then transposed in blocks into row order.
        let rows = normalized_rows::<V>(acc, nqp, l, nq, d, &mut scr.alpha, &mut scr.row);
        for (i, row) in rows.chunks_exact(d).enumerate() {
            if p0 + i >= ks && !(l[i] > 0.0 && l[i].is_finite() && m[i].is_finite()) {
                ctx.non_finite.store(true, Ordering::Relaxed);
            }
            let lse = if l[i] > 0.0 {
                m[i] + l[i].ln()
            } else {
                f32::NEG_INFINITY
            };
            // SAFETY: row (b, t0 + i, h) of `out` belongs to this task alone (tasks are
            // distinct (b, h, query block) triples and rows of a block are disjoint).
            let o = unsafe { ctx.out.slice(sh.q_at(b, t0 + i, h), d) };
            O::from_f32_slice(row, o);
            if let Some(ls) = &ctx.lse {
                // SAFETY: lse element (b, h, t0 + i) belongs to this task alone (as above).
                unsafe { ls.slice(bh * sh.seq_q + t0 + i, 1)[0] = lse };
            }
        }
    }
}

/// `out[r][v] (+)= Σ_k a[r*ars + k*aks] · b[k*ldb + v]` for `r < rows`, `k < depth`,
/// `v < ncols` (`ncols` a multiple of `C * LANES`): an `R`-row x `C`-vector register tile
/// (`R * C` independent FMA chains), one broadcast of `a` per row and depth step.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn bcast_mm<V: Vf32, const R: usize, const C: usize>(
    out: &mut [f32],
    ldo: usize,
    a: &[f32],
    ars: usize,
    aks: usize,
    b: &[f32],
    ldb: usize,
    rows: usize,
    depth: usize,
    ncols: usize,
    accumulate: bool,
    cut: KeyCut,
) {
    let l = V::LANES;
    if rows == 0 || depth == 0 {
        return;
    }
    assert!(ncols.is_multiple_of(C * l) && ncols <= ldo && ncols <= ldb);
    assert!(out.len() >= (rows - 1) * ldo + ncols);
    assert!(b.len() >= (depth - 1) * ldb + ncols);
    assert!(a.len() > (rows - 1) * ars + (depth - 1) * aks);
    for c0 in (0..ncols).step_by(C * l) {
        let (rows, depth) = cut.limits(c0 + C * l, rows, depth);
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(R);
            let mut t = [[V::splat(0.0); C]; R];
            if accumulate {
                for (rr, tr) in t.iter_mut().enumerate().take(nr) {
                    let o = &out[(r + rr) * ldo + c0..];
                    for (cc, x) in tr.iter_mut().enumerate() {
                        *x = V::load(&o[cc * l..]);
                    }
                }
            }
            if nr == R {
                for k in 0..depth {
                    // SAFETY: k < depth and c0 + C*l <= ncols, so the range ends at most
                    // at (depth - 1) * ldb + ncols <= b.len(); a's indices are at most
                    // (rows - 1) * ars + (depth - 1) * aks < a.len() (asserted above).
                    unsafe {
                        let bk = b.get_unchecked(k * ldb + c0..k * ldb + c0 + C * l);
                        let mut bv = [V::splat(0.0); C];
                        for (cc, x) in bv.iter_mut().enumerate() {
                            *x = V::load(&bk[cc * l..]);
                        }
                        let ak = k * aks + r * ars;
                        for (rr, tr) in t.iter_mut().enumerate() {
                            let av = V::splat(*a.get_unchecked(ak + rr * ars));
                            for (x, bb) in tr.iter_mut().zip(bv) {
                                *x = av.fma(bb, *x);
                            }
                        }
                    }
                }
            } else {
                for k in 0..depth {
                    let bk = &b[k * ldb + c0..k * ldb + c0 + C * l];
                    for (rr, tr) in t.iter_mut().enumerate().take(nr) {
                        let av = V::splat(a[k * aks + (r + rr) * ars]);
                        for (cc, x) in tr.iter_mut().enumerate() {
                            *x = av.fma(V::load(&bk[cc * l..]), *x);
                        }
                    }
                }
            }
            for (rr, tr) in t.iter().enumerate().take(nr) {
                let o = &mut out[(r + rr) * ldo + c0..];
                for (cc, x) in tr.iter().enumerate() {
                    x.store(&mut o[cc * l..]);
                }
            }
            r += nr;
        }
    }
}

/// [`bcast_mm`] with the register tile of `V`: 4 x 4 vectors with 32 registers
/// (AVX-512), 4 x 2 otherwise.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn tile_mm<V: Vf32>(
    out: &mut [f32],
    ldo: usize,
    a: &[f32],
    ars: usize,
    aks: usize,
    b: &[f32],
    ldb: usize,
    rows: usize,
    depth: usize,
    ncols: usize,
    accumulate: bool,
    cut: KeyCut,
) {
    if V::MM_COLS == 4 {
        bcast_mm::<V, 4, 4>(
            out, ldo, a, ars, aks, b, ldb, rows, depth, ncols, accumulate, cut,
        );
    } else {
        bcast_mm::<V, 4, 2>(
            out, ldo, a, ars, aks, b, ldb, rows, depth, ncols, accumulate, cut,
        );
    }
}

/// Causal skipping inside a tile for [`bcast_mm`]. Key `j` of the tile is after every
/// query of the column chunk ending at `c1` when `causal0 + j >= c1` (`causal0` = first
/// key position minus first query position), so only keys `j < c1 - causal0` are needed;
/// the keys are the output rows (`Rows`, for S = Q K^T) or the depth (`Depth`, for P V).
#[derive(Clone, Copy)]
pub(crate) enum KeyCut {
    Rows(isize),
    Depth(isize),
}

impl KeyCut {
    /// `(rows, depth)` needed for the column chunk ending at `c1`.
    #[inline(always)]
    fn limits(self, c1: usize, rows: usize, depth: usize) -> (usize, usize) {
        let need = |causal0: isize, n: usize| (c1 as isize - causal0).clamp(0, n as isize) as usize;
        match self {
            KeyCut::Rows(c) => (need(c, rows), depth),
            KeyCut::Depth(c) => (rows, need(c, depth)),
        }
    }
}

/// Inputs of [`softmax_block`] (transposed tile: rows are keys, vectors run over queries).
pub(crate) struct SoftmaxArgs<'a> {
    pub(crate) st: &'a mut [f32],
    pub(crate) nqp: usize,
    pub(crate) nk: usize,
    /// Rows `j < lo` lie before `seq_start`: masked.
    pub(crate) lo: usize,
    /// Row `j` masks columns `i < causal0 + j` (key after the query).
    pub(crate) causal0: isize,
    /// Row `j` also masks columns `i >= hi[j]` (a key no longer seen by later queries);
    /// `None`: no such mask.
    pub(crate) hi: Option<&'a [u32]>,
    /// `c` of the block's keys (f64), and `c` of the tile's first row.
    pub(crate) ck: &'a [f64],
    pub(crate) c_ref: f64,
    /// `c_i - c_ref` of the tile's queries as an f32 pair `hi + lo` (see [`split_f64`]).
    pub(crate) cq: &'a [f32],
    pub(crate) cq_lo: &'a [f32],
    pub(crate) m: &'a mut [f32],
    pub(crate) l: &'a mut [f32],
    pub(crate) mx: &'a mut [f32],
    pub(crate) alpha: &'a mut [f32],
    pub(crate) acc: &'a mut [f32],
    pub(crate) d: usize,
}

/// `x` as `hi + lo` with `hi = x as f32` and `lo` the f32 rounding of the remainder, so
/// differences of two such pairs keep ~48 bits of `c` (f32 alone loses D = c_i - c_j once
/// |c - c_ref| is large: at |c| ~ 1e4 its spacing is 1e-3, a 1e-3 relative weight error).
#[inline(always)]
pub(crate) fn split_f64(x: f64) -> (f32, f32) {
    let hi = x as f32;
    (hi, (x - f64::from(hi)) as f32)
}

/// Online-softmax update of one tile (FlashAttention-2), vectorised across queries:
///
/// ```text
/// x_ji  = st_ji + (c_i - c_j)        (masked: -inf; c_i - c_j from f32 hi/lo pairs)
/// m_i'  = max(m_i, max_j x_ji),  alpha_i = exp(m_i - m_i')
/// st_ji = exp(x_ji - m_i'),      l_i = alpha_i l_i + Σ_j st_ji,   acc[c][i] *= alpha_i
/// ```
///
/// In a row `j` whose first `cut` columns are masked, the column chunks of [`tile_mm`]
/// (`MM_COLS * LANES` wide) that lie wholly before `cut` are skipped and left stale:
/// neither S = Q K^T nor P V of such a chunk reads key `j` ([`KeyCut`]).
#[inline(always)]
pub(crate) fn softmax_block<V: Vf32>(a: SoftmaxArgs<'_>) {
    let (nqp, l) = (a.nqp, V::LANES);
    let w = V::MM_COLS * l;
    let skip_to = |cut: usize| cut / w * w;
    a.mx.fill(f32::NEG_INFINITY);
    for (j, row) in a.st.chunks_exact_mut(nqp).enumerate().take(a.nk) {
        if j < a.lo {
            row.fill(0.0);
            continue;
        }
        let (ck_hi, ck_lo) = split_f64(a.ck[j] - a.c_ref);
        let (ck_hi, ck_lo) = (V::splat(ck_hi), V::splat(ck_lo));
        let cut = (a.causal0 + j as isize).clamp(0, nqp as isize) as usize;
        let c0 = skip_to(cut);
        let row = &mut row[c0..];
        let cut = cut - c0;
        // Columns from `hi` on (relative to c0) are masked too.
        let hi =
            a.hi.map_or(row.len(), |h| (h[j] as usize).saturating_sub(c0));
        let hi = hi.clamp(cut, row.len());
        let plain = cut == 0 && hi == row.len();
        for (((x, cq), cq_lo), mx) in row
            .chunks_exact_mut(l)
            .zip(a.cq[c0..].chunks_exact(l))
            .zip(a.cq_lo[c0..].chunks_exact(l))
            .zip(a.mx[c0..].chunks_exact_mut(l))
        {
            // D_ij = (hi_i - hi_j) + (lo_i - lo_j): the hi difference is exact whenever
            // c_i and c_j are close (Sterbenz), which is where weights are not negligible.
            let dij = V::load(cq).sub(ck_hi).add(V::load(cq_lo).sub(ck_lo));
            V::load(x).add(dij).store(x);
            if plain {
                V::load(mx).max(V::load(x)).store(mx);
            }
        }
        if !plain {
            row[..cut].fill(f32::NEG_INFINITY);
            row[hi..].fill(f32::NEG_INFINITY);
            for (x, mx) in row.chunks_exact(l).zip(a.mx[c0..].chunks_exact_mut(l)) {
                V::load(mx).max(V::load(x)).store(mx);
            }
        }
    }
    for ((m, mx), al) in
        a.m.chunks_exact_mut(l)
            .zip(a.mx.chunks_exact_mut(l))
            .zip(a.alpha.chunks_exact_mut(l))
    {
        let m_old = V::load(m);
        let m_new = m_old.max(V::load(mx));
        m_old.sub(m_new).exp().store(al);
        m_new.store(m);
        V::splat(0.0).store(mx);
    }
    // Probabilities; `mx` now accumulates the row sums.
    for (j, row) in a.st.chunks_exact_mut(nqp).enumerate().take(a.nk).skip(a.lo) {
        let c0 = skip_to((a.causal0 + j as isize).clamp(0, nqp as isize) as usize);
        for ((x, m), s) in row[c0..]
            .chunks_exact_mut(l)
            .zip(a.m[c0..].chunks_exact(l))
            .zip(a.mx[c0..].chunks_exact_mut(l))
        {
            let p = V::load(x).sub(V::load(m)).exp();
            p.store(x);
            V::load(s).add(p).store(s);
        }
    }
    for ((lv, s), al) in
        a.l.chunks_exact_mut(l)
            .zip(a.mx.chunks_exact(l))
            .zip(a.alpha.chunks_exact(l))
    {
        V::load(lv).fma(V::load(al), V::load(s)).store(lv);
    }
    for row in a.acc.chunks_exact_mut(nqp).take(a.d) {
        for (x, al) in row.chunks_exact_mut(l).zip(a.alpha.chunks_exact(l)) {
            V::load(x).mul(V::load(al)).store(x);
        }
    }
}

/// `o_i = acc_i / l_i` for the `nq` queries of a tile (`acc` `[d][nqp]`, queries across;
/// a row with `l_i = 0`, padding or nothing attended, gives 0), scaled in place, then
/// transposed into row order `[nq][d]` in `row`, which is returned. `inv` is scratch.
#[inline(always)]
pub(crate) fn normalized_rows<'r, V: Vf32>(
    acc: &mut [f32],
    nqp: usize,
    l: &[f32],
    nq: usize,
    d: usize,
    inv: &mut Vec<f32>,
    row: &'r mut Vec<f32>,
) -> &'r [f32] {
    let inv = sized(inv, nqp);
    for (i, (x, &li)) in inv.iter_mut().zip(l.iter()).enumerate() {
        *x = if i < nq && li > 0.0 { 1.0 / li } else { 0.0 };
    }
    for r in acc.chunks_exact_mut(nqp) {
        for (x, a) in r.chunks_exact_mut(V::LANES).zip(inv.chunks_exact(V::LANES)) {
            V::load(x).mul(V::load(a)).store(x);
        }
    }
    let rows = sized(row, nq * d);
    transpose::<V>(acc, nqp, rows, d, d, nq);
    rows
}

/// `dst[c * ldd + r] = src[r * lds + c]` for `r < rows`, `c < cols`, in 8 x 8 blocks
/// ([`Vf32::transpose8`]; partial edge blocks element by element).
#[inline(always)]
pub(crate) fn transpose<V: Vf32>(
    src: &[f32],
    lds: usize,
    dst: &mut [f32],
    ldd: usize,
    rows: usize,
    cols: usize,
) {
    const B: usize = 8;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            if r0 + B <= rows && c0 + B <= cols {
                V::transpose8(&src[r0 * lds + c0..], lds, &mut dst[c0 * ldd + r0..], ldd);
                continue;
            }
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    dst[c * ldd + r] = src[r * lds + c];
                }
            }
        }
    }
}

/// `x *= a` elementwise (vector body, scalar tail).
#[inline(always)]
pub(crate) fn scale_row<V: Vf32>(x: &mut [f32], a: f32) {
    let av = V::splat(a);
    let mut it = x.chunks_exact_mut(V::LANES);
    for c in &mut it {
        V::load(c).mul(av).store(c);
    }
    for y in it.into_remainder() {
        *y *= a;
    }
}
