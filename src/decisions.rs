//! A call's ACP decisions before any kernel runs: which key blocks each head of a prefill
//! visits, and how many query-key pairs each head of a call keeps.
//!
//! The decisions are foxedge-core's (threshold from the bound, paper section 3, then
//! `start_blocks` and `count_pairs` over [`BLOCK`]-token blocks), exactly as the kernels
//! make them: a placement that splits heads by their kept pairs hands these decisions to
//! both sides (`Acp::Decided`), so no kernel decides again.

use crate::backend::{DecodeCall, PrefillCall};
use crate::error::{Error, Result};
use foxedge_core::boundary::{self, BlockGrid};
use foxedge_core::{gate, threshold};
use foxedge_cpu::{Acp, Decisions};

/// ACP block size (tokens) of both backends' kernels (their default options).
pub(crate) const BLOCK: usize = 64;

/// The ACP decisions of one prefill call, per head.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PrefillDecisions {
    /// Query blocks per head (of [`BLOCK`] tokens).
    pub q_blocks: usize,
    /// `[heads, q_blocks]`: first visited key block of each query block.
    pub start_blocks: Vec<u32>,
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
    /// The threshold of each head (None: dense).
    pub delta: Vec<Option<f64>>,
    /// `[heads, t]`: cumulative log gates `c_i = sum_{l <= i} log f_l` (f64).
    pub c: Vec<f64>,
}

impl PrefillDecisions {
    /// These decisions as the kernels' pruning mode.
    pub(crate) fn acp(&self) -> Acp<'_> {
        Acp::Decided(Decisions {
            c: &self.c,
            start_blocks: &self.start_blocks,
            delta: &self.delta,
        })
    }
}

fn core_err(e: foxedge_core::Error) -> Error {
    Error::invalid(format!("attention input: {e}"))
}

/// The decisions of `call` under its `acp` (`Off`, `Bound`, `ObservedNorms` or
/// `Threshold`). Small calls are decided on this thread, every head's `c` in one pass
/// over the gate rows; large ones head by head on the rayon pool
/// (`foxedge_cpu::SERIAL_DECISIONS`).
pub(crate) fn prefill_decisions(call: &PrefillCall<'_>) -> Result<PrefillDecisions> {
    use rayon::prelude::*;
    let (t, nh) = (call.t, call.heads);
    if call.log_f.len() != t * nh {
        return Err(Error::invalid("prefill: log_f holds [t, heads] values"));
    }
    let grid = BlockGrid::new(BLOCK, BLOCK, t, t).map_err(core_err)?;
    let nqb = grid.q_blocks();
    let mut pd = PrefillDecisions {
        q_blocks: nqb,
        start_blocks: vec![0; nh * nqb],
        kept_pairs: vec![0; nh],
        total_pairs: vec![0; nh],
        delta: vec![None; nh],
        c: vec![0.0; nh * t],
    };
    let heavy = matches!(call.acp, Acp::ObservedNorms { .. });
    let serial = !heavy && t * nh <= foxedge_cpu::SERIAL_DECISIONS;
    if serial {
        gate::cumsum_rows(call.log_f, nh, 0.0, &mut pd.c).map_err(core_err)?;
    } else {
        gate::validate_log_gates(call.log_f).map_err(core_err)?;
    }
    let one = |(h, (c, st)): (usize, (&mut [f64], &mut [u32]))| {
        if !serial {
            gate::cumsum_strided(&call.log_f[h..], nh, 0.0, c).map_err(core_err)?;
        }
        let delta = head_threshold(call, h)?;
        boundary::start_blocks(&grid, c, delta, 0, st).map_err(core_err)?;
        Ok::<_, Error>((delta, boundary::count_pairs(&grid, st, 0)))
    };
    let heads: Vec<_> = if serial {
        let parts =
            pd.c.chunks_mut(t.max(1))
                .zip(pd.start_blocks.chunks_mut(nqb.max(1)));
        parts.enumerate().map(one).collect()
    } else {
        let parts = (pd.c.par_chunks_mut(t.max(1))).zip(pd.start_blocks.par_chunks_mut(nqb.max(1)));
        parts.enumerate().map(one).collect()
    };
    for (h, r) in heads.into_iter().enumerate() {
        let (delta, pc) = r?;
        (pd.delta[h], pd.kept_pairs[h], pd.total_pairs[h]) = (delta, pc.kept_pairs, pc.total_pairs);
    }
    Ok(pd)
}

/// Head `h`'s threshold `delta = -2 U_h - ln t + ln eps` (None: dense).
fn head_threshold(call: &PrefillCall<'_>, h: usize) -> Result<Option<f64>> {
    let (t, nh, d) = (call.t, call.heads, call.head_dim);
    let one_per_head = |x: &[f64]| {
        x.get(h)
            .copied()
            .ok_or_else(|| Error::invalid("ACP: one bound or threshold per head"))
    };
    Ok(match call.acp {
        Acp::Off => None,
        Acp::Threshold(delta) => Some(one_per_head(delta)?),
        Acp::Bound { u, ln_eps } => {
            Some(threshold::threshold(one_per_head(u)?, t, ln_eps).map_err(core_err)?)
        }
        Acp::ObservedNorms { ln_eps } => {
            // U from this call's largest q and k norms of the head (Cauchy-Schwarz).
            let max_norm = |x: &[f32]| {
                (0..t)
                    .map(|r| {
                        let row = &x[(r * nh + h) * d..][..d];
                        row.iter()
                            .map(|v| f64::from(*v) * f64::from(*v))
                            .sum::<f64>()
                            .sqrt()
                    })
                    .fold(0.0f64, f64::max)
            };
            let scale = 1.0 / (d as f64).sqrt();
            let u = threshold::bound_from_norms(max_norm(call.q), max_norm(call.k), scale)
                .map_err(core_err)?;
            Some(threshold::threshold(u, t, ln_eps).map_err(core_err)?)
        }
        Acp::Decided(_) => {
            return Err(Error::Internal(
                "prefill decisions asked of a decided call".into(),
            ));
        }
    })
}

/// Kept (query, entry) pairs of head `h` of a decode call: entries in [`BLOCK`]-entry
/// blocks (slot order, as the kernels split them) where some query has
/// `c_t - c_j >= delta`, times the queries.
pub(crate) fn decode_kept(call: &DecodeCall<'_>, h: usize) -> Result<u64> {
    let nq = call.args.n_queries;
    let head = call
        .args
        .heads
        .get(h)
        .ok_or_else(|| Error::Internal("decode_kept: no such head".into()))?;
    let n = head.c.len();
    let qc = call
        .args
        .q_c
        .get(h * nq..(h + 1) * nq)
        .ok_or_else(|| Error::invalid("decode: q_c holds [heads, n_queries] values"))?;
    let one = |x: &[f64]| {
        x.get(h)
            .copied()
            .ok_or_else(|| Error::invalid("ACP: one bound or threshold per head"))
    };
    let delta = match call.acp {
        _ if n == 0 => None,
        Acp::Off => None,
        Acp::Bound { u, ln_eps } => {
            Some(threshold::threshold(one(u)?, n, ln_eps).map_err(core_err)?)
        }
        Acp::Threshold(d) => Some(one(d)?),
        Acp::ObservedNorms { .. } | Acp::Decided(_) => {
            return Err(Error::invalid("decode: ACP is off, a bound or a threshold"));
        }
    };
    let kept = match delta {
        None => n,
        Some(delta) => {
            let cmax = qc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            head.c
                .chunks(BLOCK)
                .filter(|blk| {
                    let cmin = blk.iter().copied().fold(f64::INFINITY, f64::min);
                    cmax - cmin >= delta
                })
                .map(<[f64]>::len)
                .sum()
        }
    };
    Ok(kept as u64 * nq as u64)
}
