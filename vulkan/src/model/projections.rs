//! Decode's projections of one normed row in one dispatch (`mv.glsl` and `mvq.glsl` with
//! MULTI): the matrices that read the same input (q, k, v, the k/v shift
//! projections, the forget and output gates) write their slices of one output row, each
//! output the sum the single-matrix kernel (`mv.glsl`, `mvq.glsl`) makes, in the same
//! order.

use super::ops::{MV_TPR, Rec, XIn, mv_wgs};
use super::weights::Mat;
use crate::error::{Error, Result};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::descriptor_set::WriteDescriptorSet;

static MVN: [&[u8]; 3] = [
    include_bytes!("../../shaders/mvn_f32.spv"),
    include_bytes!("../../shaders/mvn_f16.spv"),
    include_bytes!("../../shaders/mvn_bf16.spv"),
];
static MVN_NAMES: [&str; 3] = ["mvn_f32", "mvn_f16", "mvn_bf16"];
/// The block formats' kernels, Q8 then Q4 (formats 3, 4).
static MVNQ: [(&str, &[u8]); 2] = [
    ("mvn_q8", include_bytes!("../../shaders/mvn_q8.spv")),
    ("mvn_q4", include_bytes!("../../shaders/mvn_q4.spv")),
];
/// Weight bindings per dispatch (`SLOTS` in `mv.glsl` and `mvq.glsl`).
const SLOTS: usize = 8;

impl Rec<'_> {
    /// `y[off + r] = (W x')[r]` for every `(W, off)` of `mats` (one token, `x` at float 0,
    /// `x'` it read through `xin`):
    /// one dispatch per [`SLOTS`] weight chunks when the matrices share a format and a row
    /// length, else one per matrix ([`Rec::matvec`]).
    pub fn matvec_many(
        &mut self,
        mats: &[(Mat, usize)],
        xin: XIn<'_>,
        x: &Subbuffer<[u32]>,
        y: &Subbuffer<[u32]>,
    ) -> Result<()> {
        let Some((m0, _)) = mats.first() else {
            return Ok(());
        };
        if mats
            .iter()
            .any(|(m, _)| m.format != m0.format || m.cols != m0.cols)
        {
            for (m, off) in mats {
                self.matvec(m, xin, x, 0, y, *off, false)?;
            }
            return Ok(());
        }
        let rows: usize = mats
            .iter()
            .flat_map(|(m, _)| m.chunks.iter().map(|c| c.2))
            .sum();
        let wgs = if m0.format >= 3 {
            16 * self.block_lanes(m0.cols)
        } else {
            mv_wgs(rows, self.on_cpu())
        };
        let tile = self.xin_tile(m0.cols, wgs, xin.heads(m0.cols))?;
        if xin.whole() && tile as usize != m0.cols / 4 {
            return Err(Error::Unsupported(
                "the attention output's transform needs the whole row in shared memory".into(),
            ));
        }
        let mut spec = vec![(0, wgs), (1, m0.cols as u32), (10, tile)];
        spec.extend(xin.spec(m0.cols));
        let (pipe, teams) = if m0.format >= 3 {
            let (name, spv) = MVNQ[usize::from(m0.format == 4)];
            (self.ctx.pipeline(name, spv, &spec)?, 16)
        } else {
            let f = m0.format as usize;
            spec.push((2, MV_TPR));
            let pipe = self.ctx.pipeline(MVN_NAMES[f], MVN[f], &spec)?;
            (pipe, (wgs / MV_TPR) as usize)
        };
        let nw = xin.weight().unwrap_or(x);
        let pg = xin.gates().unwrap_or(x);
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            rows: [u32; SLOTS],
            y_off: [u32; SLOTS],
            first: [u32; SLOTS],
        }
        let chunks: Vec<(&Subbuffer<[u32]>, usize, usize)> = mats
            .iter()
            .flat_map(|(m, off)| {
                m.chunks
                    .iter()
                    .map(move |(w, r0, rows)| (w, off + r0, *rows))
            })
            .collect();
        for group in chunks.chunks(SLOTS) {
            let mut p = P {
                rows: [0; SLOTS],
                y_off: [0; SLOTS],
                first: [u32::MAX; SLOTS],
            };
            let mut groups = 0usize;
            let mut bufs = Vec::with_capacity(SLOTS);
            for (i, &(w, off, rows)) in group.iter().enumerate() {
                p.rows[i] = rows as u32;
                p.y_off[i] = off as u32;
                p.first[i] = groups as u32;
                groups += rows.div_ceil(teams);
                bufs.push(w.clone());
            }
            while bufs.len() < SLOTS {
                bufs.push(bufs[0].clone());
            }
            self.run(
                &pipe,
                vec![
                    WriteDescriptorSet::buffer_array(0, 0, bufs),
                    WriteDescriptorSet::buffer(1, x.clone()),
                    WriteDescriptorSet::buffer(2, y.clone()),
                    WriteDescriptorSet::buffer(3, nw.clone()),
                    WriteDescriptorSet::buffer(4, pg.clone()),
                ],
                p,
                [groups as u32, 1, 1],
            )?;
        }
        Ok(())
    }
}
