// The tried module src/hybrid/reuse.rs (not kept; its wiring is tried_bounds_reuse.diff).
// It never engaged on the H100 host: see BENCHMARKS.md, "H100 runs 310-326".

use super::{Calibration, ClassRecord, Costing, PlanKind, SPLIT_PRIOR, SizeClass, Work};
use super::split_side_factors;
use crate::error::Result;
use foxedge_core::boundary::{self, BlockGrid};

/// The least ratio of the other plans' corrected lower bounds to the all-GPU plan's
/// corrected upper bound at which a plan is reused.
pub(super) const MARGIN: f64 = 1.5;

/// Calls of a shape per count: one counted, then up to `CALLS - 1` reusing its plan.
pub(super) const CALLS: u32 = 8;

/// Shapes kept at most.
pub(super) const SHAPES: usize = 64;

/// A prefill's shape: (tokens, heads, head_dim).
pub(super) type Shape = (usize, usize, usize);

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Kept {
    pub class: SizeClass,
    pub raw: f64,
    pub bounds: (Work, Work),
    pub left: u32,
}

/// Per head of an ACP prefill of `t` tokens in `block`-token tiles: (the least, the most)
/// work the boundary can leave (diagonal blocks only; every causal pair).
pub(super) fn head_bounds(t: usize, block: usize) -> Result<(Work, Work)> {
    let grid = BlockGrid::new(block, block, t, t).map_err(super::core_err)?;
    let diagonal: Vec<u32> = (0..grid.q_blocks())
        .map(|i| u32::try_from(grid.diag_block(i)).unwrap_or(u32::MAX))
        .collect();
    let pc = boundary::count_pairs(&grid, &diagonal, 0);
    let rows = t as u64;
    let work = |pairs| Work { pairs, rows, gpu_rows: rows };
    Ok((work(pc.kept_pairs), work(pc.total_pairs)))
}

/// min(all-CPU at `lo`, best split at `lo`) over all-GPU at `hi`, each corrected by
/// `rec`'s factor for its kind.
pub(super) fn gpu_margin(heads: usize, (lo, hi): (Work, Work), cal: &Calibration, rec: &ClassRecord) -> f64 {
    let split_cost = (cal.split_fixed, cal.split_row_prefill);
    let side = |k: usize| split_side_factors(rec, k);
    let (cc, gc) = (cal.cpu_prefill, cal.gpu_prefill);
    let low = vec![lo; heads];
    let high = vec![hi; heads];
    let at_lo = Costing::new(&low, cc, gc, side, cal.concurrent, split_cost).search();
    let at_hi = Costing::new(&high, cc, gc, side, cal.concurrent, split_cost);
    let gpu = at_hi.cost(at_hi.total, heads).0;
    let f = |k: PlanKind, prior: f64| rec.factor(k).unwrap_or(prior);
    let others = (at_lo.cpu * f(PlanKind::Cpu, 1.0)).min(
        at_lo.split.map_or(f64::INFINITY, |(t, _)| t * f(PlanKind::Split, SPLIT_PRIOR)),
    );
    others / (gpu * f(PlanKind::Gpu, 1.0))
}
