//! f32 / f16 / bf16 weights: widened to f32 in registers (F16C `vcvtph2ps` and 16-bit
//! shifts on x86-64, NEON `fcvtl` and shifts on aarch64), f32 multiply-adds.
//!
//! - One activation row: blocks of 4 weight rows against `x` (`1 x 4` tiles: four
//!   independent vector accumulators hide the FMA latency), so `W` is read as one
//!   sequential stream.
//! - Several rows: tiles of `R` activation rows x `C` weight rows with `R x C` vector
//!   accumulators along `in`, reduced at the end; each weight vector loaded feeds `R`
//!   multiply-adds and each activation vector `C`. With 32 vector registers (AVX-512) the
//!   rows go in tiles of 8 against 2 weight rows (16 accumulators), so a batch of up to 8
//!   decode rows streams each weight once, at the rate of one row. f16 / bf16 rows are
//!   widened in registers when one tile of rows covers the chunk, else to an f32 panel
//!   once per chunk of 64 activation rows.
//! - Every tile asks for the next block of weight rows, a slice at a time, while it runs
//!   (`prefetcht1` into L2: +30-40% weight GB/s from DRAM on one Zen 4 thread), so the
//!   next block's DRAM reads overlap this block's arithmetic.
//! - More than 64 rows: the `gemm` crate on f32 panels (faster there, measured).
//!
//! Up to 64 rows every output `y[t, o]` is summed in one order, whatever the tile shape
//! and however many rows share the product: one vector accumulator along `in` in steps of
//! `LANES`, its lanes reduced, then the scalar tail. So a row's outputs are the same bits
//! alone (a decode step) as among other rows (sessions decoding in one batch).

use super::Out;
use crate::simd::{Isa, Vf32, WithSimd, dispatch, prefetch_l2};
use half::{bf16, f16};

/// A weight element read by the float kernels.
pub(super) trait Elem: Copy + Send + Sync + 'static {
    /// Whether the matmul widens blocks of weight rows to an f32 panel first (16-bit
    /// types: the conversion is then paid once per row chunk, not once per row tile).
    const WIDEN: bool = true;
    /// `V::LANES` weights from `s[..V::LANES]`, widened.
    fn load<V: Vf32>(s: &[Self]) -> V;
    /// The slice itself when the elements are f32.
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const WIDEN: bool = false;
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn load<V: Vf32>(s: &[Self]) -> V {
        V::load(s)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn load<V: Vf32>(s: &[Self]) -> V {
        let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(s);
        #[cfg(target_arch = "aarch64")]
        if V::LANES == 8 {
            return V::load(&super::neon::widen_f16x8(bits));
        }
        V::load_f16(bits)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn load<V: Vf32>(s: &[Self]) -> V {
        V::load_bf16(half::slice::HalfFloatSliceExt::reinterpret_cast(s))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// The plain reference: `y[t, o] (+)= sum_i x[t, i] w[o, i]`, summed in order in f32.
#[cfg(test)]
pub(super) fn reference<T: Elem>(w: &[T], inp: usize, x: &[f32], rows: usize, y: &mut Out<'_>) {
    for t in 0..rows {
        for (o, wr) in w.chunks_exact(inp).enumerate() {
            let xr = &x[t * inp..(t + 1) * inp];
            let s = wr
                .iter()
                .zip(xr)
                .fold(0.0f32, |s, (&a, &b)| s + a.to_f32() * b);
            y.put(t, o, s);
        }
    }
}

/// Outputs per task boundary of the float kernels (a multiple of every tile width).
pub(super) const GRANULE: usize = 16;

/// Outputs `range` (starting at a multiple of [`GRANULE`]) of `x wᵀ`, stored at
/// `range.start`-relative columns of `y`.
pub(super) fn range_of<T: Elem>(
    isa: Isa,
    w: &[T],
    inp: usize,
    x: &[f32],
    rows: usize,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    dispatch(
        isa,
        Job {
            w,
            inp,
            x,
            rows,
            range,
            y,
        },
    );
}

struct Job<'a, 'b, 'y, T> {
    w: &'a [T],
    inp: usize,
    x: &'a [f32],
    rows: usize,
    range: core::ops::Range<usize>,
    y: &'b mut Out<'y>,
}

impl<T: Elem> WithSimd for Job<'_, '_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vf32>(self) {
        let Job {
            w,
            inp,
            x,
            rows,
            range,
            y,
        } = self;
        if rows == 1 {
            matvec::<V, T>(w, inp, x, range, y);
        } else if rows > GEMM_ROWS && V::LANES > 1 {
            gemm_panels::<V, T>(w, inp, x, rows, range, y);
        } else if V::MM_COLS == 4 {
            matmul::<V, T, 4>(w, inp, x, rows, range, y);
        } else {
            matmul::<V, T, 2>(w, inp, x, rows, range, y);
        }
    }
}

/// One activation row: `1 x 4` tiles over the range's weight rows (then `1 x 1` for the
/// rest), each output summed as every tile sums it (module docs).
#[inline(always)]
fn matvec<V: Vf32, T: Elem>(
    w: &[T],
    inp: usize,
    x: &[f32],
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    let mut o = range.start;
    while o < range.end {
        let cols = if o + 4 <= range.end { 4 } else { 1 };
        let wb = &w[o * inp..(o + cols) * inp];
        let ahead = next_block(w, inp, o + cols, range.end, 4);
        tiles::<V, T, 4>(x, wb, ahead, inp, cols, 0..1, o - range.start, y);
        o += cols;
    }
}

/// Weight rows `o..min(o + n, end)` (empty past `end`): the block a tile prefetches.
#[inline(always)]
fn next_block<T>(w: &[T], inp: usize, o: usize, end: usize, n: usize) -> &[T] {
    let o1 = end.min(o + n).max(o);
    &w[o * inp..o1 * inp]
}

/// Above this many activation rows the `gemm` crate (packed panels, outer-product
/// micro-kernels) runs the product: on Zen 4 it matched the tiles below at 64 rows and was
/// 15-25% faster at 512 (f32, one thread).
const GEMM_ROWS: usize = super::ROW_EXACT_ROWS;
/// f16 / bf16 weight rows widened to f32 per `gemm` call.
const PANEL: usize = 256;

/// Many activation rows: `gemm` over the range, f32 weights in place, f16 / bf16 widened
/// `PANEL` rows at a time.
#[inline(always)]
fn gemm_panels<V: Vf32, T: Elem>(
    w: &[T],
    inp: usize,
    x: &[f32],
    rows: usize,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    let mut panel = Vec::new();
    let step = if T::WIDEN { PANEL } else { range.len() };
    for o0 in range.clone().step_by(step) {
        let n = step.min(range.end - o0);
        let wb = &w[o0 * inp..(o0 + n) * inp];
        let wf = match T::as_f32(wb) {
            Some(f) => f,
            None => {
                panel.resize(wb.len(), 0.0);
                widen::<V, T>(wb, &mut panel);
                &panel[..]
            }
        };
        let at = o0 - range.start;
        assert!(x.len() >= rows * inp && wf.len() >= n * inp);
        assert!(y.y.len() >= (rows - 1) * y.ld + at + n && n <= y.ld);
        // SAFETY: the asserts keep every index gemm forms in bounds: dst `rows x n` at
        // `y[at]` with row stride `ld >= n`; lhs `rows x inp` (row stride inp); rhs[k][j] =
        // wf[j inp + k] for k < inp, j < n. dst is a distinct mutable borrow. gemm's
        // `dst = alpha dst + beta lhs rhs` reads dst only when accumulating.
        unsafe {
            gemm::gemm(
                rows,
                n,
                inp,
                y.y.as_mut_ptr().add(at),
                1,
                y.ld as isize,
                y.accumulate,
                x.as_ptr(),
                1,
                inp as isize,
                wf.as_ptr(),
                inp as isize,
                1,
                if y.accumulate { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// Activation rows per chunk: the chunk (`64 * inp` f32) stays in L2 while every weight
/// row of the range passes over it.
const ROW_CHUNK: usize = 64;

/// Activation rows per tile of the tall tiles (32 vector registers: `8 x 2` accumulators
/// plus the two weight vectors).
const TALL: usize = 8;

/// Several activation rows: chunks of rows, then blocks of weight rows (`C`, or 2 against
/// tall tiles of [`TALL`] rows where the vector type has 32 registers), then tiles of
/// rows. f16 / bf16 weights are widened once per chunk into an f32 panel when the chunk
/// takes more than one tile of rows, else in registers.
#[inline(always)]
fn matmul<V: Vf32, T: Elem, const C: usize>(
    w: &[T],
    inp: usize,
    x: &[f32],
    rows: usize,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    if V::MM_COLS == 4 && rows >= TALL {
        return blocks::<V, T, 2, TALL>(w, inp, x, rows, range, y);
    }
    blocks::<V, T, C, 4>(w, inp, x, rows, range, y);
}

/// [`matmul`] with weight blocks of `C` rows and row tiles of `R` (then 4, then 1).
#[inline(always)]
fn blocks<V: Vf32, T: Elem, const C: usize, const R: usize>(
    w: &[T],
    inp: usize,
    x: &[f32],
    rows: usize,
    range: core::ops::Range<usize>,
    y: &mut Out<'_>,
) {
    let mut panel = Vec::new();
    for c0 in (0..rows).step_by(ROW_CHUNK) {
        let c1 = rows.min(c0 + ROW_CHUNK);
        let widen_panel = T::WIDEN && c1 - c0 > R;
        let mut o = range.start;
        while o < range.end {
            let cols = if o + C <= range.end { C } else { 1 };
            let wb = &w[o * inp..(o + cols) * inp];
            let ahead = next_block(w, inp, o + cols, range.end, C);
            let at = o - range.start;
            if widen_panel {
                panel.resize(wb.len(), 0.0);
                widen::<V, T>(wb, &mut panel);
                tiles_r::<V, f32, T, C, R>(x, &panel, ahead, inp, cols, c0..c1, at, y);
            } else {
                tiles_r::<V, T, T, C, R>(x, wb, ahead, inp, cols, c0..c1, at, y);
            }
            o += cols;
        }
    }
}

/// `dst = f32(src)`, a vector at a time.
#[inline(always)]
fn widen<V: Vf32, T: Elem>(src: &[T], dst: &mut [f32]) {
    let l = V::LANES;
    let body = src.len() - src.len() % l;
    for i in (0..body).step_by(l) {
        T::load::<V>(&src[i..]).store(&mut dst[i..]);
    }
    for (d, s) in dst[body..].iter_mut().zip(&src[body..]) {
        *d = s.to_f32();
    }
}

/// The activation rows `ts` against the `cols` (`C` or 1) weight rows `wb`, whose outputs
/// start at column `at`, in tiles of 4 rows (then 1); `ahead` is prefetched meanwhile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tiles<V: Vf32, T: Elem, const C: usize>(
    x: &[f32],
    wb: &[T],
    ahead: &[T],
    inp: usize,
    cols: usize,
    ts: core::ops::Range<usize>,
    at: usize,
    y: &mut Out<'_>,
) {
    tiles_r::<V, T, T, C, 4>(x, wb, ahead, inp, cols, ts, at, y);
}

/// [`tiles`] with tiles of `R` rows first (then 4, then 1).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tiles_r<V: Vf32, T: Elem, P: Copy, const C: usize, const R: usize>(
    x: &[f32],
    wb: &[T],
    ahead: &[P],
    inp: usize,
    cols: usize,
    ts: core::ops::Range<usize>,
    at: usize,
    y: &mut Out<'_>,
) {
    let mut t = ts.start;
    // The next block is prefetched while the first tile of rows streams this one.
    let mut ahead = ahead;
    while t < ts.end {
        let left = ts.end - t;
        let r = if R > 4 && left >= R {
            R
        } else if left >= 4 {
            4
        } else {
            1
        };
        let full = cols == C;
        match (r, full) {
            (4, true) => put(y, t, at, tile::<V, T, P, 4, C>(x, wb, ahead, inp, t)),
            (4, false) => put(y, t, at, tile::<V, T, P, 4, 1>(x, wb, ahead, inp, t)),
            (1, true) => put(y, t, at, tile::<V, T, P, 1, C>(x, wb, ahead, inp, t)),
            (1, false) => put(y, t, at, tile::<V, T, P, 1, 1>(x, wb, ahead, inp, t)),
            (_, true) => put(y, t, at, tile::<V, T, P, R, C>(x, wb, ahead, inp, t)),
            (_, false) => put(y, t, at, tile::<V, T, P, R, 1>(x, wb, ahead, inp, t)),
        }
        ahead = &ahead[..0];
        t += r;
    }
}

#[inline(always)]
fn put<const R: usize, const C: usize>(y: &mut Out<'_>, t: usize, o: usize, v: [[f32; C]; R]) {
    for (r, vr) in v.iter().enumerate() {
        for (c, &s) in vr.iter().enumerate() {
            y.put(t + r, o + c, s);
        }
    }
}

/// `out[r][c] = x[t + r] · w[c]` for `r < R`, `c < C`; `ahead` (any length) is
/// prefetched in equal slices, one per step along `inp`.
#[inline(always)]
fn tile<V: Vf32, T: Elem, P: Copy, const R: usize, const C: usize>(
    x: &[f32],
    w: &[T],
    ahead: &[P],
    inp: usize,
    t: usize,
) -> [[f32; C]; R] {
    let xr: [&[f32]; R] = core::array::from_fn(|r| &x[(t + r) * inp..(t + r + 1) * inp]);
    let wr: [&[T]; C] = core::array::from_fn(|c| &w[c * inp..(c + 1) * inp]);
    let l = V::LANES;
    let body = inp - inp % l;
    // Elements of `ahead` per step, rounded up so that the steps cover it.
    let per = ahead.len().div_ceil((body / l).max(1));
    let mut acc = [[V::splat(0.0); C]; R];
    let mut i = 0;
    let mut a = 0;
    while i < body {
        if a < ahead.len() {
            prefetch_l2(&ahead[a..ahead.len().min(a + per)]);
            a += per;
        }
        let mut xv = [V::splat(0.0); R];
        for (v, xs) in xv.iter_mut().zip(&xr) {
            *v = V::load(&xs[i..]);
        }
        for (c, ws) in wr.iter().enumerate() {
            let wv = T::load::<V>(&ws[i..]);
            for r in 0..R {
                acc[r][c] = wv.fma(xv[r], acc[r][c]);
            }
        }
        i += l;
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let tail = wr[c][body..].iter().zip(&xr[r][body..]);
            out[r][c] = tail.fold(acc[r][c].reduce_sum(), |s, (&a, &b)| s + a.to_f32() * b);
        }
    }
    out
}
