//! Dependency levels of one head's row operations, so that `cache_ops.comp` applies the
//! operations of a level in parallel with a barrier only between levels.
//!
//! An operation reads the cache row a move copies (`from`) and writes its destination row
//! (puts read the chunk, not the cache). Its level is 1 + the highest level of any earlier
//! operation that wrote a row it reads or writes, or read a row it writes. So two
//! operations of one level touch no common row unless both only read it, and every
//! conflicting pair keeps its order across levels: applying the levels in turn, the
//! operations of each at once, gives exactly the serial result.

use super::{RowOp, op_words};
use crate::error::Result;

/// Words per operation (`op_words`); word 3 (unused by `rowops.glsl`) carries the level end.
const OP_WORDS: usize = 8;

/// The cache row `op` reads, if any, and the row it writes.
fn rows(op: &RowOp) -> (Option<u32>, u32) {
    match *op {
        RowOp::Move { from, to } => (Some(from), to),
        RowOp::Put { slot, .. } | RowOp::Meta { slot, .. } => (None, slot),
    }
}

/// The level (1..) of every operation of `ops`, in order.
pub(super) fn levels(ops: &[RowOp]) -> Vec<u32> {
    let top = ops
        .iter()
        .map(|op| {
            let (r, w) = rows(op);
            r.unwrap_or(0).max(w) as usize + 1
        })
        .max()
        .unwrap_or(0);
    // Highest level that wrote / read each row so far (0: none).
    let mut wrote = vec![0u32; top];
    let mut read = vec![0u32; top];
    ops.iter()
        .map(|op| {
            let (r, w) = rows(op);
            let w = w as usize;
            let mut lv = wrote[w].max(read[w]);
            if let Some(r) = r {
                lv = lv.max(wrote[r as usize]);
            }
            let lv = lv + 1;
            wrote[w] = lv;
            if let Some(r) = r {
                read[r as usize] = read[r as usize].max(lv);
            }
            lv
        })
        .collect()
}

/// The positions of `ops` sorted by level (stable) and, for each, the end (exclusive, in
/// that order) of its level.
pub(super) fn order(ops: &[RowOp]) -> (Vec<usize>, Vec<u32>) {
    let lv = levels(ops);
    let nl = lv.iter().copied().max().unwrap_or(0) as usize;
    let mut start = vec![0usize; nl + 1];
    for &l in &lv {
        start[l as usize] += 1;
    }
    // After the prefix sum, start[l] = the first position of level l (levels are 1..=nl).
    let mut acc = 0;
    for s in start.iter_mut() {
        let c = *s;
        *s = acc;
        acc += c;
    }
    let mut next = start.clone();
    let mut idx = vec![0usize; ops.len()];
    let mut end = vec![0u32; ops.len()];
    for (i, &l) in lv.iter().enumerate() {
        let l = l as usize;
        let at = next[l];
        next[l] += 1;
        idx[at] = i;
        end[at] = start.get(l + 1).copied().unwrap_or(ops.len()) as u32;
    }
    (idx, end)
}

/// Appends the words of `ops` for `cache_ops.comp` in level order, each op's word 3 the end
/// of its level (an op index relative to the first of `ops`).
pub(super) fn leveled_words(ops: &[RowOp], words: &mut Vec<u32>) -> Result<()> {
    let (idx, end) = order(ops);
    for (&i, &e) in idx.iter().zip(&end) {
        let at = words.len();
        op_words(&ops[i], words)?;
        debug_assert_eq!(words.len(), at + OP_WORDS);
        words[at + 3] = e;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
