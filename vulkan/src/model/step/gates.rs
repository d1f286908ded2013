//! Where a layer's gates live on the device and in a readback: [`GateLayout`].

use super::{Gates, bytemuck_f32, view};
use vulkano::buffer::Subbuffer;

/// Word offsets of one layer's gates for up to `n` tokens: `log f [n][H] | norms
/// [n][H][2] | k [H][n][HD] | v [H][n][HD]`, each section starting on a storage-buffer
/// view boundary (`align` words) so that `attn_pre.comp` writes them through views of one
/// buffer, which one copy reads back; `words` in all, a multiple of `align`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct GateLayout {
    n: usize,
    d: usize,
    nh: usize,
    pub lf: usize,
    pub nrm: usize,
    pub k: usize,
    pub v: usize,
    pub words: usize,
}

impl GateLayout {
    pub fn new(n: usize, d: usize, nh: usize, align: usize) -> Self {
        let up = |x: usize| x.max(1).div_ceil(align) * align;
        let nrm = up(n * nh);
        let k = nrm + up(2 * n * nh);
        let v = k + up(n * d);
        Self {
            n,
            d,
            nh,
            lf: 0,
            nrm,
            k,
            v,
            words: v + up(n * d),
        }
    }

    /// Views of the layout's sections in `buf` from word `at` (aligned): `[k, v, log f,
    /// norms]`, the order of `attn_pre.comp`'s outputs 5..8.
    pub fn views(&self, buf: &Subbuffer<[u32]>, at: usize) -> [Subbuffer<[u32]>; 4] {
        let (n, d, nh) = (self.n, self.d, self.nh);
        [
            view(buf, (at + self.k, n * d)),
            view(buf, (at + self.v, n * d)),
            view(buf, (at + self.lf, n * nh)),
            view(buf, (at + self.nrm, 2 * n * nh)),
        ]
    }

    /// The [`Gates`] of layer `l`, `n` tokens (at most the layout's), in `w`: the sections
    /// from word `at`, the shift state `[2 D]` at `shift_at`.
    pub fn read<'w>(
        &self,
        w: &'w [u32],
        l: usize,
        n: usize,
        at: usize,
        shift_at: usize,
    ) -> Gates<'w> {
        let (d, nh) = (self.d, self.nh);
        let f = |a: usize, len: usize| bytemuck_f32(&w[a..a + len]);
        Gates {
            layer: l,
            tokens: n,
            log_f: f(at + self.lf, n * nh),
            norms: f(at + self.nrm, 2 * n * nh),
            k: f(at + self.k, n * d),
            v: f(at + self.v, n * d),
            shift: f(shift_at, 2 * d),
        }
    }
}
