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
//! `S = QK^T` and `acc += PV` go through `gemm` (its own AVX2/AVX-512/NEON dispatch); the
//! softmax update is a [`Vf32`] micro-kernel. With [`Isa::Scalar`] every step, matrix
//! products included, is plain scalar Rust: the reference the fast paths are tested against.

use crate::api::{Acp, AttentionStats, HeadStats, PrefillArgs, PrefillOptions, Storage};
use crate::simd::{Isa, Vf32, WithSimd, dispatch};
use foxedge_core::boundary::{self, BlockGrid};
use foxedge_core::{Error, Layout, Result, gate, threshold};
use rayon::prelude::*;
use std::cell::RefCell;

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

    // Decisions, per (batch, query head): c (f64), delta, start blocks, pair counts.
    gate::validate_log_gates(args.log_fgate)?;
    let mut c = vec![0.0f64; heads * sh.seq_k];
    let mut starts = vec![0u32; heads * nqb];
    let mut stats = AttentionStats {
        heads: Vec::with_capacity(heads),
    };
    let key_start: Vec<usize> = match args.seq_start {
        Some(s) => s.to_vec(),
        None => vec![0; sh.batch],
    };
    for bh in 0..heads {
        let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
        let cb = &mut c[bh * sh.seq_k..(bh + 1) * sh.seq_k];
        gate::cumsum_strided(
            &args.log_fgate[sh.gate_at(b, 0, h)..],
            sh.gate_stride(),
            0.0,
            cb,
        )?;
        let delta = head_delta(args, opts, scale, b, h, key_start[b])?;
        let st = &mut starts[bh * nqb..(bh + 1) * nqb];
        boundary::start_blocks(&grid, cb, delta, key_start[b], st)?;
        let pc = boundary::count_pairs(&grid, st, key_start[b]);
        stats.heads.push(HeadStats {
            kept_pairs: pc.kept_pairs,
            total_pairs: pc.total_pairs,
            kept_blocks: pc.kept_blocks,
            total_blocks: pc.total_blocks,
            delta,
        });
    }

    // Tasks (batch, head, query block), heaviest first so that the uneven rows that ACP
    // leaves do not end on one thread.
    let mut tasks: Vec<(usize, usize, usize)> = Vec::with_capacity(heads * nqb);
    for bh in 0..heads {
        for qb in 0..nqb {
            let diag = grid.diag_block(qb);
            let start = starts[bh * nqb + qb] as usize;
            let rows = (sh.seq_q - qb * opts.block_q).min(opts.block_q);
            let work = (diag + 1).saturating_sub(start) * rows + 1;
            tasks.push((work, bh, qb));
        }
    }
    tasks.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));

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
    };
    debug_assert!(ctx.lse.as_ref().is_none_or(|l| l.len == lse_len));
    tasks.par_iter().with_max_len(1).for_each(|&(_, bh, qb)| {
        SCRATCH.with(|s| ctx.run_tile(bh, qb, &mut s.borrow_mut()));
    });
    Ok(stats)
}

fn validate<T: Storage>(
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    out_len: usize,
    lse_len: Option<usize>,
) -> Result<()> {
    let sh = &args.shape;
    sh.validate()?;
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
    len("q", sh.q_len(), args.q.len())?;
    len("k", sh.kv_len(), args.k.len())?;
    len("v", sh.kv_len(), args.v.len())?;
    len("log_fgate", sh.gate_len(), args.log_fgate.len())?;
    len("out", sh.q_len(), out_len)?;
    if let Some(l) = lse_len {
        len("lse", sh.batch * sh.heads_q * sh.seq_q, l)?;
    }
    if let Some(s) = args.seq_start {
        len("seq_start", sh.batch, s.len())?;
        if s.iter().any(|&x| x >= sh.seq_k) {
            return Err(Error::BadArgument("seq_start values must be < seq_k"));
        }
    }
    if opts.block_q == 0 || opts.block_k == 0 {
        return Err(Error::BadArgument("block sizes must be > 0"));
    }
    if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
        return Err(Error::BadArgument("sm_scale must be finite"));
    }
    Ok(())
}

/// The ACP threshold of (b, h), from core; `None` when ACP is off.
fn head_delta<T: Storage>(
    args: &PrefillArgs<'_, T>,
    opts: &PrefillOptions<'_>,
    scale: f32,
    b: usize,
    h: usize,
    key_start: usize,
) -> Result<Option<f64>> {
    let sh = &args.shape;
    let bh = b * sh.heads_q + h;
    let n_keys = sh.seq_k - key_start;
    match opts.acp {
        Acp::Off => Ok(None),
        Acp::Threshold(d) => {
            if d.len() != sh.batch * sh.heads_q {
                return Err(Error::BadLength {
                    what: "ACP thresholds (batch * heads_q)",
                    expected: sh.batch * sh.heads_q,
                    got: d.len(),
                });
            }
            if d[bh].is_nan() {
                return Err(Error::BadArgument("ACP threshold is NaN"));
            }
            Ok(Some(d[bh]))
        }
        Acp::Bound { u, ln_eps } => {
            let uh = if u.len() == sh.heads_q {
                u[h]
            } else if u.len() == sh.batch * sh.heads_q {
                u[bh]
            } else {
                return Err(Error::BadLength {
                    what: "ACP bounds (heads_q or batch * heads_q)",
                    expected: sh.heads_q,
                    got: u.len(),
                });
            };
            threshold::threshold(uh, n_keys, ln_eps).map(Some)
        }
        Acp::ObservedNorms { ln_eps } => {
            let d = sh.head_dim;
            let first_t = key_start.saturating_sub(sh.q_offset());
            let mut qn = 0.0f64;
            for t in first_t..sh.seq_q {
                qn = qn.max(norm(&args.q[sh.q_at(b, t, h)..][..d]));
            }
            let hk = h / sh.group();
            let mut kn = 0.0f64;
            for j in key_start..sh.seq_k {
                kn = kn.max(norm(&args.k[sh.kv_at(b, j, hk)..][..d]));
            }
            let u = threshold::bound_from_norms(qn, kn, f64::from(scale.abs()))?;
            threshold::threshold(u, n_keys, ln_eps).map(Some)
        }
    }
}

fn norm<T: Storage>(x: &[T]) -> f64 {
    x.iter()
        .map(|v| f64::from(v.to_f32()).powi(2))
        .sum::<f64>()
        .sqrt()
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

/// Per-thread tile buffers (f32), reused across tasks.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    cq: Vec<f32>,
    ck: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Columns of a score row are padded to a multiple of this (the widest vector).
const PAD: usize = 16;

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
}

/// A block of `rows` vectors of `head_dim` f32 with row stride `rs`, starting at `data[0]`.
#[derive(Clone, Copy)]
struct TileRef<'t> {
    data: &'t [f32],
    rs: usize,
}

impl<T: Storage, O: Storage> Ctx<'_, '_, T, O> {
    /// K or V rows `j0..j0+n` of (b, hk) as f32: in place when the storage is f32,
    /// otherwise converted into `buf`.
    fn kv_tile<'t>(
        &self,
        src: &'t [T],
        buf: &'t mut Vec<f32>,
        b: usize,
        hk: usize,
        j0: usize,
        n: usize,
    ) -> TileRef<'t> {
        let sh = &self.args.shape;
        let d = sh.head_dim;
        let rs = sh.kv_row_stride();
        let base = sh.kv_at(b, j0, hk);
        let span = (n - 1) * rs + d;
        if let Some(f) = T::as_f32(src) {
            return TileRef {
                data: &f[base..base + span],
                rs,
            };
        }
        let dst = sized(buf, n * d);
        if sh.layout == Layout::HeadFirst {
            T::to_f32_slice(&src[base..base + n * d], dst);
        } else {
            for j in 0..n {
                T::to_f32_slice(&src[base + j * rs..][..d], &mut dst[j * d..(j + 1) * d]);
            }
        }
        TileRef { data: dst, rs: d }
    }

    fn run_tile(&self, bh: usize, qb: usize, scr: &mut Scratch) {
        let sh = &self.args.shape;
        let (d, bq, bk) = (sh.head_dim, self.grid.block_q, self.grid.block_k);
        let (b, h) = (bh / sh.heads_q, bh % sh.heads_q);
        let hk = h / sh.group();
        let t0 = qb * bq;
        let nq = (sh.seq_q - t0).min(bq);
        let off = sh.q_offset();
        let p0 = off + t0;
        let ks = self.key_start[b];
        let c = &self.c[bh * sh.seq_k..(bh + 1) * sh.seq_k];
        let c_ref = c[p0];

        let acc = sized(&mut scr.acc, nq * d);
        acc.fill(0.0);
        let m = sized(&mut scr.m, nq);
        m.fill(f32::NEG_INFINITY);
        let l = sized(&mut scr.l, nq);
        l.fill(0.0);

        if p0 + nq > ks {
            let qt = sized(&mut scr.q, nq * d);
            for i in 0..nq {
                let row = &mut qt[i * d..(i + 1) * d];
                T::to_f32_slice(&self.args.q[sh.q_at(b, t0 + i, h)..][..d], row);
                for x in row.iter_mut() {
                    *x *= self.scale;
                }
            }
            let cq = sized(&mut scr.cq, nq);
            for (i, x) in cq.iter_mut().enumerate() {
                *x = (c[p0 + i] - c_ref) as f32;
            }
            let start = self.starts[bh * self.grid.q_blocks() + qb] as usize;
            let diag = self.grid.diag_block(qb);
            let p_last = p0 + nq - 1;
            for kb in start..=diag {
                let j0 = kb * bk;
                let nk = ((kb + 1) * bk).min(p_last + 1) - j0;
                let ncp = nk.div_ceil(PAD) * PAD;
                let kt = self.kv_tile(self.args.k, &mut scr.k, b, hk, j0, nk);
                let vt = self.kv_tile(self.args.v, &mut scr.v, b, hk, j0, nk);
                let ck = sized(&mut scr.ck, ncp);
                for (j, x) in ck.iter_mut().enumerate() {
                    *x = if j < nk {
                        (c[j0 + j] - c_ref) as f32
                    } else {
                        0.0
                    };
                }
                let s = sized(&mut scr.s, nq * ncp);
                qk_tile(self.isa, qt, kt, s, nq, nk, ncp, d);
                dispatch(
                    self.isa,
                    BlockSoftmax {
                        s,
                        ncp,
                        nk,
                        acc,
                        d,
                        m,
                        l,
                        cq,
                        ck,
                        lo: ks.saturating_sub(j0).min(nk),
                        row_end0: (p0 + 1) as isize - j0 as isize,
                    },
                );
                pv_tile(self.isa, s, vt, acc, nq, nk, ncp, d);
            }
        }

        // o_i = acc_i / l_i; rows that attended nothing (padding) get 0 and lse -inf.
        for i in 0..nq {
            let row = &mut acc[i * d..(i + 1) * d];
            let (inv, lse) = if l[i] > 0.0 {
                (1.0 / l[i], m[i] + l[i].ln())
            } else {
                (0.0, f32::NEG_INFINITY)
            };
            for x in row.iter_mut() {
                *x *= inv;
            }
            // SAFETY: row (b, t0 + i, h) of `out` belongs to this task alone (tasks are
            // distinct (b, h, query block) triples and rows of a block are disjoint).
            let o = unsafe { self.out.slice(sh.q_at(b, t0 + i, h), d) };
            O::from_f32_slice(row, o);
            if let Some(ls) = &self.lse {
                // SAFETY: lse element (b, h, t0 + i) belongs to this task alone (as above).
                unsafe { ls.slice(bh * sh.seq_q + t0 + i, 1)[0] = lse };
            }
        }
    }
}

/// `S[i][j] = Q[i]·K[j]` for `i < nq`, `j < nk` (row stride `ncp` in `s`).
#[allow(clippy::too_many_arguments)]
fn qk_tile(
    isa: Isa,
    q: &[f32],
    k: TileRef<'_>,
    s: &mut [f32],
    nq: usize,
    nk: usize,
    ncp: usize,
    d: usize,
) {
    assert!(q.len() >= nq * d && s.len() >= nq * ncp && ncp >= nk);
    assert!(k.data.len() >= (nk - 1) * k.rs + d);
    if isa == Isa::Scalar {
        for i in 0..nq {
            for j in 0..nk {
                let kj = &k.data[j * k.rs..][..d];
                s[i * ncp + j] = q[i * d..(i + 1) * d]
                    .iter()
                    .zip(kj)
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
        return;
    }
    // SAFETY: dst spans `nq` rows of stride `ncp` >= nk columns inside `s`; lhs spans `nq`
    // rows of `d` inside `q`; rhs element (p, j) = k.data[j * rs + p] with j < nk, p < d
    // is inside `k.data` (asserted above). `s` is a distinct buffer from `q` and `k`.
    unsafe {
        gemm::gemm(
            nq,
            nk,
            d,
            s.as_mut_ptr(),
            1,
            ncp as isize,
            false,
            q.as_ptr(),
            1,
            d as isize,
            k.data.as_ptr(),
            k.rs as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `acc[i] += Σ_j P[i][j] V[j]` for `i < nq`, `j < nk`.
#[allow(clippy::too_many_arguments)]
fn pv_tile(
    isa: Isa,
    p: &[f32],
    v: TileRef<'_>,
    acc: &mut [f32],
    nq: usize,
    nk: usize,
    ncp: usize,
    d: usize,
) {
    assert!(p.len() >= nq * ncp && acc.len() >= nq * d && ncp >= nk);
    assert!(v.data.len() >= (nk - 1) * v.rs + d);
    if isa == Isa::Scalar {
        for i in 0..nq {
            let a = &mut acc[i * d..(i + 1) * d];
            for j in 0..nk {
                let w = p[i * ncp + j];
                for (x, y) in a.iter_mut().zip(&v.data[j * v.rs..][..d]) {
                    *x += w * y;
                }
            }
        }
        return;
    }
    // SAFETY: dst spans `nq` rows of `d` inside `acc`; lhs spans `nq` rows of stride `ncp`
    // (first `nk` columns) inside `p`; rhs element (j, c) = v.data[j * rs + c], j < nk,
    // c < d, is inside `v.data` (asserted above). `acc` is distinct from `p` and `v`.
    unsafe {
        gemm::gemm(
            nq,
            d,
            nk,
            acc.as_mut_ptr(),
            1,
            d as isize,
            true,
            p.as_ptr(),
            1,
            ncp as isize,
            v.data.as_ptr(),
            1,
            v.rs as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Online-softmax update of one tile (FlashAttention-2 style), in place.
///
/// In: `s[i][j] = s q_i·k_j` for `j < nk`. Row `i` attends columns `lo..hi_i`,
/// `hi_i = clamp(row_end0 + i, 0, nk)` (causal: key `j0 + j <= p0 + i`). Out: `s[i][j] =
/// exp(x_ij - m_i')` with `x_ij = s_ij + cq_i - ck_j` and 0 on masked columns; `m`, `l`
/// and the rows of `acc` rescaled by `exp(m_i - m_i')`.
struct BlockSoftmax<'a> {
    s: &'a mut [f32],
    ncp: usize,
    nk: usize,
    acc: &'a mut [f32],
    d: usize,
    m: &'a mut [f32],
    l: &'a mut [f32],
    cq: &'a [f32],
    ck: &'a [f32],
    lo: usize,
    row_end0: isize,
}

impl WithSimd for BlockSoftmax<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vf32>(self) {
        let (ncp, d) = (self.ncp, self.d);
        for (i, row) in self.s.chunks_exact_mut(ncp).enumerate() {
            let hi = (self.row_end0 + i as isize).clamp(0, self.nk as isize) as usize;
            if hi <= self.lo {
                row.fill(0.0);
                continue;
            }
            row[..self.lo].fill(f32::NEG_INFINITY);
            row[hi..].fill(f32::NEG_INFINITY);
            let cq = V::splat(self.cq[i]);
            let mut mx = V::splat(f32::NEG_INFINITY);
            for (x, ck) in row
                .chunks_exact_mut(V::LANES)
                .zip(self.ck.chunks_exact(V::LANES))
            {
                let y = V::load(x).add(cq).sub(V::load(ck));
                y.store(x);
                mx = mx.max(y);
            }
            let m_old = self.m[i];
            let m_new = m_old.max(mx.reduce_max());
            let alpha = (m_old - m_new).exp();
            let mn = V::splat(m_new);
            let mut sum = V::splat(0.0);
            for x in row.chunks_exact_mut(V::LANES) {
                let p = V::load(x).sub(mn).exp();
                p.store(x);
                sum = sum.add(p);
            }
            self.m[i] = m_new;
            self.l[i] = self.l[i] * alpha + sum.reduce_sum();
            if alpha != 1.0 {
                scale_row::<V>(&mut self.acc[i * d..(i + 1) * d], alpha);
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
