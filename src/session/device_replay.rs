//! The CPU's attention of a continuation chunk whose bookkeeping a failed device run had
//! already made: the layer's cache holds the chunk's surviving rows and has lost the rows
//! its retention policy evicted while appending the chunk. [`Replay`] keeps what was
//! removed, so the CPU continuation kernel sees exactly the keys each query saw: the rows
//! of before the chunk (survivors and evicted ones, each evicted row up to the query at
//! whose append it left) and the chunk's own keys up to their ends.

use super::cache::HeadCache;
use super::*;
use crate::backend::ContinueCall;
use foxedge_core::contract::{Acp, AttentionStats, CacheHead, ContinueArgs};
use half::f16;

/// A row of before the chunk, evicted while the chunk was appended.
#[derive(Debug)]
pub(super) struct Evicted {
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) c: f64,
    /// The first query of the chunk that no longer sees it.
    pub(super) end: u32,
}

/// One layer's removed keys of a continuation chunk of `t` tokens.
#[derive(Debug, Default)]
pub(super) struct Replay {
    /// Per head.
    pub(super) evicted: Vec<Vec<Evicted>>,
    /// `[t][H]`: the chunk rows' `c` and the first query that no longer sees each chunk
    /// key (`t`: every later query sees it).
    pub(super) q_c: Vec<f64>,
    pub(super) key_end: Vec<u32>,
}

/// One head's keys of before the chunk, as the continuation kernel takes them.
#[derive(Default)]
struct Rows {
    k: Vec<f32>,
    v: Vec<f32>,
    c: Vec<f64>,
    /// The first query that no longer sees each row.
    end: Vec<u32>,
}

/// Row `slot` of `hc` (`hd` values of K and of V) in f32.
pub(super) fn row_f32(hc: &HeadCache, slot: usize, hd: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let at = slot * hd..(slot + 1) * hd;
    let missing = || Error::Internal(format!("cache row {slot} is not stored"));
    if let Ok(r) = hc.view::<f32>() {
        let (k, v) = (r.k.get(at.clone()), r.v.get(at));
        return Ok((
            k.ok_or_else(missing)?.to_vec(),
            v.ok_or_else(missing)?.to_vec(),
        ));
    }
    let r = hc.view::<f16>()?;
    let (k, v) = (r.k.get(at.clone()), r.v.get(at));
    let widen = |x: &[f16]| x.iter().map(|y| y.to_f32()).collect::<Vec<f32>>();
    Ok((widen(k.ok_or_else(missing)?), widen(v.ok_or_else(missing)?)))
}

/// The continuation attention of the chunk (`q`, `k`, `v`, `out`: `[t][H][hd]`) over the
/// keys of before it: the rows of `heads` older than `pos0` and the evicted ones.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    backend: &dyn AttentionBackend,
    heads: &[HeadCache],
    pos0: u64,
    hd: usize,
    replay: &Replay,
    (q, k, v): (&[f32], &[f32], &[f32]),
    acp: Acp<'_>,
    out: &mut [f32],
) -> Result<AttentionStats> {
    let t = replay.key_end.len() / heads.len().max(1);
    let end = u32::try_from(t).map_err(|_| Error::invalid("chunk of 2^32 tokens or more"))?;
    let mut rows: Vec<Rows> = Vec::with_capacity(heads.len());
    for (hc, ev) in heads.iter().zip(&replay.evicted) {
        let mut r = Rows::default();
        for s in (0..hc.len()).filter(|&s| hc.pos[s] < pos0) {
            let (a, b) = row_f32(hc, s, hd)?;
            r.k.extend(a);
            r.v.extend(b);
            r.c.push(hc.c[s]);
            r.end.push(end);
        }
        for e in ev {
            r.k.extend_from_slice(&e.k);
            r.v.extend_from_slice(&e.v);
            r.c.push(e.c);
            r.end.push(e.end);
        }
        rows.push(r);
    }
    let views: Vec<CacheHead<'_, f32>> = rows
        .iter()
        .map(|r| CacheHead {
            k: &r.k,
            v: &r.v,
            c: &r.c,
            pos: None,
        })
        .collect();
    let cache_end: Vec<&[u32]> = rows.iter().map(|r| &r.end[..]).collect();
    let call = ContinueCall {
        args: ContinueArgs {
            head_dim: hd,
            n_queries: t,
            q,
            k,
            v,
            q_c: &replay.q_c,
            key_end: Some(&replay.key_end),
            cache: &views,
            cache_end: Some(&cache_end),
        },
        acp,
    };
    backend.prefill_continue(&call, out)
}
