//! f32 / f16 / bf16 weights: widened to f32 in registers (F16C `vcvtph2ps` and 16-bit
//! shifts on x86-64, NEON `fcvtl` and shifts on aarch64), f32 multiply-adds.
//!
//! - One activation row: blocks of 4 weight rows against `x` (`1 x 4` tiles: four
//!   independent vector accumulators hide the FMA latency), so `W` is read as one
//!   sequential stream.
//! - Several rows: tiles of `R` activation rows x `C` weight rows with `R x C` vector
//!   accumulators along `in`, reduced at the end; each weight vector loaded feeds `R`
//!   multiply-adds and each activation vector `C`. f16 / bf16 rows are widened to an f32
//!   panel once per chunk of 64 activation rows.
//! - More than 64 rows: the `gemm` crate on f32 panels (faster there, measured).
//!
//! Up to 64 rows every output `y[t, o]` is summed in one order, whatever the tile shape
//! and however many rows share the product: one vector accumulator along `in` in steps of
//! `LANES`, its lanes reduced, then the scalar tail. So a row's outputs are the same bits
//! alone (a decode step) as among other rows (sessions decoding in one batch).

use super::Out;
use crate::simd::{Isa, Vf32, WithSimd, dispatch};
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
        tiles::<V, T, 4>(x, wb, inp, cols, 0..1, o - range.start, y);
        o += cols;
    }
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

/// Several activation rows: chunks of rows, then blocks of `C` weight rows (f16 / bf16
/// widened once per chunk into an f32 panel), then tiles of 4 activation rows (`R = 1`
/// and `C = 1` for the rest).
#[inline(always)]
fn matmul<V: Vf32, T: Elem, const C: usize>(
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
        let mut o = range.start;
        while o < range.end {
            let cols = if o + C <= range.end { C } else { 1 };
            let wb = &w[o * inp..(o + cols) * inp];
            let at = o - range.start;
            if T::WIDEN {
                panel.resize(wb.len(), 0.0);
                widen::<V, T>(wb, &mut panel);
                tiles::<V, f32, C>(x, &panel, inp, cols, c0..c1, at, y);
            } else {
                tiles::<V, T, C>(x, wb, inp, cols, c0..c1, at, y);
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
/// start at column `at`.
#[inline(always)]
fn tiles<V: Vf32, T: Elem, const C: usize>(
    x: &[f32],
    wb: &[T],
    inp: usize,
    cols: usize,
    ts: core::ops::Range<usize>,
    at: usize,
    y: &mut Out<'_>,
) {
    let mut t = ts.start;
    while t < ts.end {
        let r = if t + 4 <= ts.end { 4 } else { 1 };
        match (r == 4, cols == C) {
            (true, true) => put(y, t, at, tile::<V, T, 4, C>(x, wb, inp, t, 0)),
            (true, false) => put(y, t, at, tile::<V, T, 4, 1>(x, wb, inp, t, 0)),
            (false, true) => put(y, t, at, tile::<V, T, 1, C>(x, wb, inp, t, 0)),
            (false, false) => put(y, t, at, tile::<V, T, 1, 1>(x, wb, inp, t, 0)),
        }
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

/// `out[r][c] = x[t + r] · w[o + c]` for `r < R`, `c < C`.
#[inline(always)]
fn tile<V: Vf32, T: Elem, const R: usize, const C: usize>(
    x: &[f32],
    w: &[T],
    inp: usize,
    t: usize,
    o: usize,
) -> [[f32; C]; R] {
    let xr: [&[f32]; R] = core::array::from_fn(|r| &x[(t + r) * inp..(t + r + 1) * inp]);
    let wr: [&[T]; C] = core::array::from_fn(|c| &w[(o + c) * inp..(o + c + 1) * inp]);
    let l = V::LANES;
    let body = inp - inp % l;
    let mut acc = [[V::splat(0.0); C]; R];
    let mut i = 0;
    while i < body {
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
