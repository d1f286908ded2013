//! A continuation chunk's attention on the device (`continue.comp`): the chunk's queries
//! attend the resident cache rows as they were before the chunk and, causally, the chunk's
//! own keys, in one online softmax per query tile; then the caller's row operations store
//! the chunk's rows (and apply the evictions its retention policy made while appending
//! them).

use super::{DeviceStream, HPD, HeadStep, HostData, RowOp, RunStats, internal, view};
use crate::decode::storage_align;
use crate::error::{Error, Result};
use crate::pack::split_f64;
use crate::prefill::PrefillTile;
use foxedge_core::contract::{AttentionStats, HeadStats};
use vulkano::buffer::{BufferContents, Subbuffer};
use vulkano::descriptor_set::WriteDescriptorSet;

static CONTINUE: &[u8] = include_bytes!("../../../shaders/continue.spv");

/// "No such array" in `continue.comp`'s head info.
const NONE: u32 = u32::MAX;

/// One layer's decisions for a continuation chunk of `n` tokens ([`super::LayerPlan::Continue`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ContinuePlan {
    /// `[H][n]` cumulative gates of the chunk's rows, on the cache rows' origin.
    pub c: Vec<f64>,
    /// Per head: row operations before the attention (re-based metas).
    pub pre: Vec<Vec<RowOp>>,
    /// Per head: the cache rows `0..live[h]` the chunk attends.
    pub live: Vec<usize>,
    /// Per head: ACP flags `[query block][cache blocks + chunk blocks]` of
    /// [`super::super::continue_blocks`] (empty: every block), and its statistics.
    pub kept: Vec<Vec<u32>>,
    pub stats: Vec<HeadStats>,
    /// Per head: `[live]` then `[n]`, the first query that no longer sees each cache row and
    /// each chunk key (the retention policy evicted it while the chunk was appended); empty:
    /// every query sees every key it follows.
    pub ends: Vec<Vec<u32>>,
    /// Per head: row operations after the attention (evictions' moves, the chunk's rows).
    pub ops: Vec<Vec<RowOp>>,
}

fn bad(what: &'static str) -> Error {
    Error::Input(foxedge_core::Error::BadArgument(what))
}

impl ContinuePlan {
    /// Checks the plan's shape for `nh` heads and `n` tokens.
    fn check(&self, nh: usize, n: usize) -> Result<()> {
        if self.c.len() != nh * n {
            return Err(foxedge_core::Error::BadLength {
                what: "continuation plan c ([H][n])",
                expected: nh * n,
                got: self.c.len(),
            }
            .into());
        }
        let per_head = [
            self.pre.len(),
            self.live.len(),
            self.kept.len(),
            self.stats.len(),
            self.ends.len(),
            self.ops.len(),
        ];
        if per_head.iter().any(|&x| x != nh) {
            return Err(bad("continuation plan: one entry per head in every list"));
        }
        if self.c.iter().any(|x| !x.is_finite()) {
            return Err(bad("chunk c must be finite"));
        }
        for h in 0..nh {
            let (live, b) = (self.live[h], super::super::CONTINUE_BLOCK);
            let blocks = n.div_ceil(b) * (live.div_ceil(b) + n.div_ceil(b));
            if !self.kept[h].is_empty() && self.kept[h].len() != blocks {
                return Err(bad("continuation plan: ACP flags of another shape"));
            }
            if !self.ends[h].is_empty() && self.ends[h].len() != live + n {
                return Err(bad("continuation plan: ends of another length"));
            }
        }
        Ok(())
    }
}

impl DeviceStream {
    /// Records layer `l`'s continuation attention into `s.o` (head-major), with the plan's
    /// row operations before and after it.
    pub(super) fn attend_continue(
        &mut self,
        rec: &mut super::Rec<'_>,
        l: usize,
        n: usize,
        plan: &ContinuePlan,
        stats: &mut RunStats,
    ) -> Result<AttentionStats> {
        let sh = self.model.shape;
        let (nh, hd) = (sh.heads, sh.head_dim);
        plan.check(nh, n)?;
        let steps = |ops: &[Vec<RowOp>]| -> Vec<HeadStep> {
            ops.iter()
                .zip(&plan.live)
                .map(|(o, &live)| HeadStep {
                    ops: o.clone(),
                    live,
                    ..HeadStep::default()
                })
                .collect()
        };
        self.apply_ops(rec, l, n, &steps(&plan.pre), stats)?;
        for h in 0..nh {
            let hb = self.ensure_head(rec, l, h, plan.live[h].max(1))?;
            if plan.live[h] > hb.cap {
                return Err(bad("a head attends more rows than its cache holds"));
            }
        }

        let ctx = self.model.ctx.clone();
        let tile = PrefillTile::choose(&ctx, hd)?;
        let shared = tile.shared_bytes(hd) + 4 * tile.bn as usize;
        if shared > ctx.info.max_shared_memory as usize || 64 % tile.bm != 0 {
            return Err(Error::Unsupported(format!(
                "continuation tile needs {shared} bytes of shared memory"
            )));
        }
        let mut hdata = HostData::new(storage_align(&ctx));
        let mut cw = vec![0u32; 2 * nh * n];
        split_f64(&plan.c, &mut cw);
        let c_at = hdata.push(&cw);
        let mut words: Vec<u32> = Vec::new();
        let mut info: Vec<u32> = Vec::with_capacity(4 * nh);
        for h in 0..nh {
            let cap = self.heads[l][h].as_ref().map_or(1, |b| b.cap);
            let mut at = |w: &[u32]| {
                if w.is_empty() {
                    return Ok(NONE);
                }
                let a = u32::try_from(words.len()).map_err(|_| bad("plan too large"))?;
                words.extend_from_slice(w);
                Ok::<u32, Error>(a)
            };
            let kept = at(&plan.kept[h])?;
            let ends = at(&plan.ends[h])?;
            info.extend([plan.live[h] as u32, cap as u32, kept, ends]);
        }
        let w_at = hdata.push(&words);
        let info_at: Vec<(usize, usize)> = info.chunks(4 * HPD).map(|g| hdata.push(g)).collect();
        let (hbuf, up) = hdata.upload(rec)?;
        stats.bytes_uploaded += up;

        let pipe = ctx.pipeline("continue", CONTINUE, &tile.constants(hd))?;
        #[derive(BufferContents, Clone, Copy)]
        #[repr(C)]
        struct P {
            n: u32,
            h0: u32,
            n_qt: u32,
            scale_log2: f32,
        }
        let n_qt = n.div_ceil(tile.bm as usize);
        rec.tag = "continue";
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        for (g, ia) in (0..nh).step_by(HPD).zip(info_at) {
            let h1 = (g + HPD).min(nh);
            let slots: Vec<Subbuffer<[u32]>> = (0..HPD)
                .map(|i| {
                    let h = (g + i).min(h1 - 1);
                    self.heads[l][h].as_ref().map(|b| b.buf.clone())
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| internal("cache head missing"))?;
            rec.run(
                &pipe,
                vec![
                    WriteDescriptorSet::buffer(0, s.q.clone()),
                    WriteDescriptorSet::buffer(1, s.k.clone()),
                    WriteDescriptorSet::buffer(2, s.v.clone()),
                    WriteDescriptorSet::buffer_array(3, 0, slots),
                    WriteDescriptorSet::buffer(4, view(&hbuf, c_at)),
                    WriteDescriptorSet::buffer(5, view(&hbuf, ia)),
                    WriteDescriptorSet::buffer(6, view(&hbuf, w_at)),
                    WriteDescriptorSet::buffer(7, s.o.clone()),
                    WriteDescriptorSet::buffer(8, self.flag.clone()),
                ],
                P {
                    n: n as u32,
                    h0: g as u32,
                    n_qt: n_qt as u32,
                    scale_log2: (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E,
                },
                [n_qt as u32, (h1 - g) as u32, 1],
            )?;
        }
        self.apply_ops(rec, l, n, &steps(&plan.ops), stats)?;
        Ok(AttentionStats {
            heads: plan.stats.clone(),
        })
    }
}

impl DeviceStream {
    /// The most tokens, at most `want` and at least 1, that one run takes with its
    /// activations in at most half of the device memory the weights and cache heads leave
    /// free, and each activation binding (the widest: a projection row, the MLP's gate and
    /// up rows, or a row of logits) within the device's storage-buffer range.
    pub fn chunk_room(&self, want: usize) -> usize {
        let sh = self.model.shape;
        let (d, h, i, v) = (sh.hidden, sh.heads, sh.intermediate, sh.vocab);
        let pw = sh.proj_width();
        // h, x, q, k, v, o, op [D]; p [pw]; log f, norms, lse [4 H]; gu, a [3 I]; logits
        // [V]; the gates' readback [3 H + 2 D] (f32 words).
        let per_token = 4 * (9 * d + pw + 7 * h + 3 * i + v) as u64;
        let widest = 4 * pw.max(2 * i).max(v) as u64;
        let heap = super::super::weights::device_heap(&self.model.ctx);
        let free = heap.saturating_sub(self.model.bytes() + self.bytes()) / 2;
        let by_memory = free / per_token.max(1);
        let by_range = self.model.ctx.info.max_storage_buffer_range / widest.max(1);
        let fits = usize::try_from(by_memory.min(by_range)).unwrap_or(usize::MAX);
        want.min(fits).max(1)
    }
}
