//! The session's books of a device run ([`super::Device`]): per layer, the gates read back
//! advance the gate streams, the retention policy and the host rows, and give the layer's
//! plan (a fresh chunk's `c` and ACP thresholds, a continuation's tile flags, a token's row
//! operations); before a one-token step, each layer's list of the evictions its policy may
//! make. Layers are independent, so a token's books run in parallel over layers.

use super::*;

/// Re-bases every head of `state` whose gate stream's `|c|` passed [`REBASE_AT`] (gates,
/// policy and cache rows by the same shift, as `Session::attention` does before a chunk's
/// gates); returns which heads moved.
pub(super) fn rebase_heads(state: &mut LayerState) -> Result<Vec<bool>> {
    let mut rebased = vec![false; state.gates.len()];
    for (h, r) in rebased.iter_mut().enumerate() {
        let cur = state.gates[h].current();
        if cur.abs() > REBASE_AT {
            state.gates[h].rebase(cur);
            state.policy.rebase(h, cur)?;
            state.heads[h].rebase(cur);
            *r = true;
        }
    }
    Ok(rebased)
}

/// Operations that give every row of `hc` its (re-based) `c` and position.
pub(super) fn meta_ops(hc: &HeadCache) -> Vec<RowOp> {
    (0..hc.len())
        .map(|s| RowOp::Meta {
            slot: s as u32,
            c: hc.c[s],
            pos: hc.pos[s],
        })
        .collect()
}

/// Largest difference, relative to `1 + |c_t|`, between the device's and the host's `c_t`
/// of a one-token step: the device sums a double-float pair (48 significant bits) with an
/// exact two-sum, so it is the host's f64 sum to about `2^-47`; `2^-40` leaves room.
pub(super) const C_T_TOLERANCE: f64 = 1.0 / (1u64 << 40) as f64;

/// Evictions listed per head in a one-token step beyond those the budget forces.
pub(super) const STEP_EVICTIONS: usize = 16;

/// Whether the retention policy's operations `ops` for a one-token step are the `k`
/// evictions the device made from the plan `sp`, then the token's row.
pub(super) fn same_ops(ops: &[RowOp], sp: &StepHead, k: usize) -> bool {
    let moves = sp.evict[..k.min(sp.evict.len())]
        .iter()
        .filter_map(|e| e.moved.map(|(from, to)| RowOp::Move { from, to }));
    let n_moves = moves.clone().count();
    k <= sp.evict.len()
        && ops.len() == n_moves + 1
        && ops[..n_moves].iter().copied().eq(moves)
        && matches!(ops[n_moves], RowOp::Put { token: 0, slot, .. } if slot as usize == sp.live - k)
}

/// One layer's bookkeeping of a device run, as `Session::attention` keeps it.
pub(super) struct Keeper<'s> {
    pub(super) sess: &'s mut Session,
    pub(super) pos0: u64,
    pub(super) fresh: bool,
    pub(super) scores: Option<&'s [f32]>,
    /// The device decided ACP itself (a one-token step): the plan's decisions are left
    /// empty.
    pub(super) acp_on_device: bool,
    /// Per layer planned as a continuation: what its bookkeeping removed, for the CPU to
    /// finish the chunk exactly if the device fails.
    pub(super) replays: Vec<Option<Replay>>,
    /// `[layer][head]` re-based before this run without the device's rows ([`Device`]'s
    /// `unsent_metas`): planned as if re-based now.
    pub(super) unsent_metas: Vec<Vec<bool>>,
}

impl Keeper<'_> {
    /// Layer `g.layer`'s gates in, its plan out (and the session's state advanced).
    pub(super) fn plan(&mut self, g: &Gates<'_>) -> Result<LayerPlan> {
        let l = g.layer;
        let s = &mut *self.sess;
        let info = s.model.info();
        let cx = LayerCx {
            fresh: self.fresh,
            acp_on_device: self.acp_on_device,
            unsent: self.unsent_metas.get(l).map(Vec::as_slice),
            ..LayerCx::new(
                &info,
                s.opts.ln_eps,
                (&s.u, &s.certified),
                l,
                self.pos0,
                self.scores,
            )
        };
        let (plan, replay) = plan_layer(&cx, &mut s.layers[l], g)?;
        if let Some(r) = replay {
            if self.replays.len() <= l {
                self.replays.resize_with(l + 1, || None);
            }
            self.replays[l] = Some(r);
        }
        Ok(plan)
    }
}

/// What a layer's bookkeeping reads besides the layer's own state.
pub(super) struct LayerCx<'a> {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) hidden: usize,
    pub(super) ln_eps: Option<f64>,
    pub(super) certified: bool,
    /// The layer's logit bound per head.
    pub(super) u: &'a [f64],
    pub(super) pos0: u64,
    pub(super) fresh: bool,
    pub(super) scores: Option<&'a [f32]>,
    pub(super) acp_on_device: bool,
    /// Heads re-based before this run without the device's rows.
    pub(super) unsent: Option<&'a [bool]>,
}

impl<'a> LayerCx<'a> {
    /// Layer `l`'s context in a run from `pos0` of a session with these bounds `u`,
    /// certificates and `ln ε`: a chunk of a stream with a cache whose ACP the host decides
    /// (set `fresh`, `acp_on_device`, `unsent` where they differ).
    pub(super) fn new(
        info: &crate::model::ModelInfo,
        ln_eps: Option<f64>,
        (u, certified): (&'a [Vec<f64>], &[bool]),
        l: usize,
        pos0: u64,
        scores: Option<&'a [f32]>,
    ) -> Self {
        LayerCx {
            heads: info.heads,
            head_dim: info.head_dim,
            hidden: info.hidden,
            ln_eps,
            certified: certified[l],
            u: &u[l],
            pos0,
            fresh: false,
            scores,
            acp_on_device: false,
            unsent: None,
        }
    }
}

/// One layer's bookkeeping of a device run ([`Keeper::plan`]): the layer's gates in, its
/// plan out, the layer's state advanced; a continuation's [`Replay`] too. Touches no other
/// layer, so a one-token step keeps the books of its layers in parallel.
pub(super) fn plan_layer(
    cx: &LayerCx<'_>,
    state: &mut LayerState,
    g: &Gates<'_>,
) -> Result<(LayerPlan, Option<Replay>)> {
    let (nh, hd) = (cx.heads, cx.head_dim);
    let n = g.tokens;
    let scale = 1.0 / (hd as f64).sqrt();
    let ln_eps = cx.ln_eps;
    let certified = cx.certified;
    let u = cx.u;
    let (rebased, c_rows) = take_gates(cx, state, g)?;
    let qn = |h: usize, r: usize| f64::from(g.norms[2 * (r * nh + h)]);
    let (gk, gv) = (g.k, g.v);
    let row = |h: usize, r: usize| {
        let at = (h * n + r) * hd;
        (&gk[at..at + hd], &gv[at..at + hd])
    };
    let mut score_row = vec![0.0f32; nh];
    let pos0 = cx.pos0;
    let scores = cx.scores;
    // The CPU's `append`: evictions (their moves into `moves[h]`), then the new row.
    let mut log: Vec<(usize, Eviction)> = Vec::new();
    let continuation = !cx.fresh && n > 1 && !cx.acp_on_device;
    let mut evicted: Vec<Vec<Evicted>> = (0..nh).map(|_| Vec::new()).collect();
    let mut append = |state: &mut LayerState,
                      r: usize,
                      moves: &mut Vec<Vec<RowOp>>|
     -> Result<()> {
        let sc = scores.map(|sc| {
            score_row.fill(sc[r]);
            &score_row[..]
        });
        let heads = &mut state.heads;
        let mut failed = None;
        state
            .policy
            .append(pos0 + r as u64, &c_rows[r * nh..(r + 1) * nh], sc, |ev| {
                log.push((r, ev));
                if continuation && ev.position < pos0 && failed.is_none() {
                    let hc = &heads[ev.head];
                    let slot = ev.slot as usize;
                    match (row_f32(hc, slot, hd), hc.c.get(slot)) {
                        (Ok((k, v)), Some(&c)) => evicted[ev.head].push(Evicted {
                            k,
                            v,
                            c,
                            end: r as u32,
                        }),
                        (Err(e), _) => failed = Some(e),
                        (_, None) => failed = Some(Error::Internal("evicted an empty slot".into())),
                    }
                }
                if let Some((from, to)) = ev.moved() {
                    moves[ev.head].push(RowOp::Move { from, to });
                }
                if failed.is_none()
                    && let Err(e) = heads[ev.head].apply(&ev, hd)
                {
                    failed = Some(e);
                }
            })?;
        if let Some(e) = failed {
            return Err(e);
        }
        for (h, hc) in heads.iter_mut().enumerate() {
            let c = c_rows[r * nh + h];
            let pos = pos0 + r as u64;
            let (k, v) = row(h, r);
            hc.push(k, v, c, pos)?;
            moves[h].push(RowOp::Put {
                token: r as u32,
                slot: (hc.len() - 1) as u32,
                c,
                pos,
            });
        }
        state.peak_live = state.peak_live.max(state.policy.live_total());
        Ok(())
    };
    if cx.fresh && n > 1 {
        // A stream's first chunk keeps its books beside the device (`fresh_plan`).
        return Err(Error::Internal(
            "a fresh chunk's books go through fresh_plan".into(),
        ));
    }
    if continuation {
        // A continuation: the chunk attends the cache as it is now, then its rows (and
        // the evictions made while appending them) join the cache.
        let live: Vec<usize> = state.heads.iter().map(HeadCache::len).collect();
        let cache_c: Vec<Vec<f64>> = state.heads.iter().map(|hc| hc.c.clone()).collect();
        let pre: Vec<Vec<RowOp>> = (0..nh)
            .map(|h| {
                if rebased[h] {
                    meta_ops(&state.heads[h])
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut delta = Vec::with_capacity(nh);
        for h in 0..nh {
            let big_n = live[h] + n;
            delta.push(match (ln_eps, certified) {
                (None, _) => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(u[h], big_n, e)?),
                (Some(e), false) => {
                    let qm = (0..n).map(|r| qn(h, r)).fold(0.0, f64::max);
                    let uu =
                        foxedge_core::threshold::bound_from_norms(qm, state.k_norm_max[h], scale)?;
                    Some(foxedge_core::threshold::threshold(uu, big_n, e)?)
                }
            });
        }
        let mut ops = vec![Vec::new(); nh];
        for r in 0..n {
            append(state, r, &mut ops)?;
        }
        let (ends, key_end) = if log.is_empty() {
            (vec![Vec::new(); nh], vec![n as u32; n * nh])
        } else {
            let (cache_end, key_end) = super::forward::chunk_ends(&live, &log, n)?;
            let ends = cache_end
                .into_iter()
                .enumerate()
                .map(|(h, mut e)| {
                    e.extend((0..n).map(|r| key_end[r * nh + h]));
                    e
                })
                .collect();
            (ends, key_end)
        };
        let replay = Replay {
            evicted,
            q_c: c_rows.clone(),
            key_end,
        };
        let mut c = vec![0.0f64; nh * n];
        let (mut kept, mut stats) = (Vec::with_capacity(nh), Vec::with_capacity(nh));
        for h in 0..nh {
            for r in 0..n {
                c[h * n + r] = c_rows[r * nh + h];
            }
            let e = (!ends[h].is_empty()).then_some(&ends[h][..]);
            let (k, st) = vm::continue_blocks(&cache_c[h], &c[h * n..(h + 1) * n], delta[h], e);
            kept.push(k);
            stats.push(st);
        }
        let plan = LayerPlan::Continue(ContinuePlan {
            c,
            pre,
            live,
            kept,
            stats,
            ends,
            ops,
        });
        return Ok((plan, Some(replay)));
    }
    let mut steps = Vec::with_capacity(n);
    for r in 0..n {
        let mut ops: Vec<Vec<RowOp>> = (0..nh)
            .map(|h| {
                if r == 0 && rebased[h] {
                    meta_ops(&state.heads[h])
                } else {
                    Vec::new()
                }
            })
            .collect();
        append(state, r, &mut ops)?;
        let mut heads = Vec::with_capacity(nh);
        for (h, ops) in ops.into_iter().enumerate() {
            let hc = &state.heads[h];
            let live = hc.len();
            let delta = match (ln_eps, certified) {
                (None, _) => None,
                // The step decided ACP on the device from its plan's thresholds.
                (Some(_), true) if cx.acp_on_device => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(u[h], live, e)?),
                (Some(e), false) => {
                    let uu = foxedge_core::threshold::bound_from_norms(
                        qn(h, r),
                        state.k_norm_max[h],
                        scale,
                    )?;
                    Some(foxedge_core::threshold::threshold(uu, live, e)?)
                }
            };
            let c_t = c_rows[r * nh + h];
            let (kept, stats) = if cx.acp_on_device {
                (Vec::new(), Default::default())
            } else {
                vm::decode_blocks(&hc.c, c_t, delta, BLOCK)
            };
            heads.push(HeadStep {
                ops,
                live,
                c_t,
                kept,
                stats,
            });
        }
        steps.push(TokenPlan { heads });
    }
    Ok((LayerPlan::Tokens(steps), None))
}

/// A layer's part of a one-token step's plan: which heads it re-based, and its heads'
/// plans (None: the per-layer path runs the token).
pub(super) type LayerStepPlan = (Vec<bool>, Option<Vec<StepHead>>);

/// The layer's gates into its state: re-bases (with the heads `cx.unsent` names), each
/// head's cumulative gates (`[n][H]` `c` in f64, returned), the key-norm maxima of a layer
/// without a certificate and the token-shift state.
fn take_gates(
    cx: &LayerCx<'_>,
    state: &mut LayerState,
    g: &Gates<'_>,
) -> Result<(Vec<bool>, Vec<f64>)> {
    let (nh, d, n) = (cx.heads, cx.hidden, g.tokens);
    let mut rebased = rebase_heads(state)?;
    if let Some(u) = cx.unsent {
        for (r, &x) in rebased.iter_mut().zip(u) {
            *r |= x;
        }
    }
    let mut c_rows = vec![0.0f64; n * nh];
    for r in 0..n {
        for h in 0..nh {
            c_rows[r * nh + h] = state.gates[h].push(g.log_f[r * nh + h])?;
        }
    }
    if !cx.certified {
        for h in 0..nh {
            for r in 0..n {
                let kn = f64::from(g.norms[2 * (r * nh + h) + 1]);
                state.k_norm_max[h] = state.k_norm_max[h].max(kn);
            }
        }
    }
    state.k_shift.copy_from_slice(&g.shift[..d]);
    state.v_shift.copy_from_slice(&g.shift[d..2 * d]);
    Ok((rebased, c_rows))
}

/// ACP thresholds of a fresh chunk's heads (`None`: dense): from the layer's bound where
/// it is a certificate, else from the chunk's largest query and key norms.
fn fresh_delta(cx: &LayerCx<'_>, g: &Gates<'_>) -> Result<Vec<Option<f64>>> {
    let (nh, n) = (cx.heads, g.tokens);
    let scale = 1.0 / (cx.head_dim as f64).sqrt();
    let norm = |h: usize, r: usize, i: usize| f64::from(g.norms[2 * (r * nh + h) + i]);
    (0..nh)
        .map(|h| {
            Ok(match (cx.ln_eps, cx.certified) {
                (None, _) => None,
                (Some(e), true) => Some(foxedge_core::threshold::threshold(cx.u[h], n, e)?),
                (Some(e), false) => {
                    let qm = (0..n).map(|r| norm(h, r, 0)).fold(0.0, f64::max);
                    let km = (0..n).map(|r| norm(h, r, 1)).fold(0.0, f64::max);
                    let uu = foxedge_core::threshold::bound_from_norms(qm, km, scale)?;
                    Some(foxedge_core::threshold::threshold(uu, n, e)?)
                }
            })
        })
        .collect()
}

/// `[n][H]` values as `[H][n]`.
fn head_major(c_rows: &[f64], nh: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0f64; nh * n];
    for h in 0..nh {
        for r in 0..n {
            c[h * n + r] = c_rows[r * nh + h];
        }
    }
    c
}

/// The part of a fresh chunk's books its attention needs, for [`Session::device_chunk`]'s
/// deferred books: the gates taken, and a plan that stores every row of the chunk in the
/// slot of its token (the policy's evictions are not known yet). Returns the `[n][H]` `c`
/// for [`fresh_rows`].
pub(super) fn fresh_plan(
    cx: &LayerCx<'_>,
    state: &mut LayerState,
    g: &Gates<'_>,
) -> Result<(LayerPlan, Vec<f64>)> {
    let (nh, n) = (cx.heads, g.tokens);
    let (_, c_rows) = take_gates(cx, state, g)?;
    let delta = fresh_delta(cx, g)?;
    let c = head_major(&c_rows, nh, n);
    let ops = (0..nh)
        .map(|h| {
            (0..n)
                .map(|r| RowOp::Put {
                    token: r as u32,
                    slot: r as u32,
                    c: c_rows[r * nh + h],
                    pos: cx.pos0 + r as u64,
                })
                .collect()
        })
        .collect();
    Ok((LayerPlan::Chunk { c, delta, ops }, c_rows))
}

/// The rest of a fresh chunk's books after [`fresh_plan`] (while the device runs on): the
/// policy over the chunk and the host rows ([`keep_fresh_chunk`]); returns per head the
/// moves that compact the device's rows (stored in their tokens' slots) into the policy's
/// slots. Each survivor's token is at or after its slot, so moves in order of slot never
/// read a row an earlier move wrote.
pub(super) fn fresh_rows(
    state: &mut LayerState,
    g: &Gates<'_>,
    c_rows: &[f64],
    pos0: u64,
    scores: Option<&[f32]>,
    hd: usize,
) -> Result<Vec<Vec<RowOp>>> {
    keep_fresh_chunk(state, g, c_rows, pos0, scores, hd)?;
    state
        .heads
        .iter()
        .map(|hc| {
            let mut ops = Vec::new();
            for (s, &p) in hc.pos.iter().enumerate() {
                let t = p
                    .checked_sub(pos0)
                    .filter(|&t| t >= s as u64 && t < g.tokens as u64)
                    .ok_or_else(|| Error::Internal("a fresh chunk's row out of place".into()))?;
                if t != s as u64 {
                    ops.push(RowOp::Move {
                        from: t as u32,
                        to: s as u32,
                    });
                }
            }
            Ok(ops)
        })
        .collect()
}

/// The CPU's `append` of a fresh chunk's `n` rows (a stream's first): the retention policy
/// over the tokens in order, noting each head's evictions, then each head's host rows
/// (its evictions at a token, then the token's row), head by head. The same rows as
/// appending token by token: a fresh chunk reads no evicted row, and heads do not share
/// rows.
pub(super) fn keep_fresh_chunk(
    state: &mut LayerState,
    g: &Gates<'_>,
    c_rows: &[f64],
    pos0: u64,
    scores: Option<&[f32]>,
    hd: usize,
) -> Result<()> {
    let (n, nh) = (g.tokens, state.heads.len());
    let mut evs: Vec<Vec<(usize, Eviction)>> = vec![Vec::new(); nh];
    let mut score_row = vec![0.0f32; nh];
    let mut bad_head = false;
    for r in 0..n {
        let sc = scores.map(|sc| {
            score_row.fill(sc[r]);
            &score_row[..]
        });
        state.policy.append(
            pos0 + r as u64,
            &c_rows[r * nh..(r + 1) * nh],
            sc,
            |ev| match evs.get_mut(ev.head) {
                Some(e) => e.push((r, ev)),
                None => bad_head = true,
            },
        )?;
        state.peak_live = state.peak_live.max(state.policy.live_total());
    }
    if bad_head {
        return Err(Error::Internal(
            "an eviction of a head the layer lacks".into(),
        ));
    }
    let (gk, gv) = (g.k, g.v);
    for (h, (hc, evs)) in state.heads.iter_mut().zip(&evs).enumerate() {
        let mut evs = evs.iter().peekable();
        for r in 0..n {
            while let Some((_, ev)) = evs.next_if(|(at, _)| *at == r) {
                hc.apply(ev, hd)?;
            }
            let at = (h * n + r) * hd;
            let c = c_rows[r * nh + h];
            hc.push(&gk[at..at + hd], &gv[at..at + hd], c, pos0 + r as u64)?;
        }
    }
    Ok(())
}

/// What a one-token step's plan of a layer reads besides the layer's state.
pub(super) struct StepCx<'a> {
    pub(super) certified: bool,
    /// The layer's logit bound per head.
    pub(super) u: &'a [f64],
    pub(super) ln: &'a LnTable,
    pub(super) ln_eps: Option<f64>,
    /// Most live rows a head keeps (the budget).
    pub(super) limit: usize,
    pub(super) scale: f64,
    /// The token's position.
    pub(super) pos: u64,
}

/// Layer plan of a one-token step ([`Session::step_plan`]): per head the evictions its
/// policy may make, their swap-delete moves and the ACP threshold for each count; None
/// where the policy cannot list them (the per-layer path runs the token).
pub(super) fn step_plan_layer(
    cx: &StepCx<'_>,
    state: &LayerState,
    rebased: &[bool],
) -> Result<Option<Vec<StepHead>>> {
    let mut cand = Vec::new();
    let mut slots: Vec<u32> = Vec::new();
    let mut heads = Vec::with_capacity(state.heads.len());
    for (h, hc) in state.heads.iter().enumerate() {
        let live = hc.len();
        let k_max = (live + 1).saturating_sub(cx.limit) + STEP_EVICTIONS;
        if cand.len() < k_max {
            cand.resize(k_max, foxedge_core::retention::Candidate::default());
        }
        let Some(n) = state.policy.next_evictions(h, &mut cand[..k_max])? else {
            return Ok(None);
        };
        // The swap-deletes of evicting the candidates in order.
        slots.clear();
        slots.extend(cand[..n].iter().map(|c| c.slot));
        let mut evict = Vec::with_capacity(n);
        let mut last = live;
        for i in 0..n {
            last -= 1;
            let at = slots[i];
            let moved = (at as usize != last).then_some((last as u32, at));
            for s in &mut slots[i + 1..] {
                if *s as usize == last {
                    *s = at;
                }
            }
            evict.push(StepEvict {
                moved,
                at_or_below: cand[i].evict_at_or_below,
            });
        }
        let acp = match (cx.ln_eps, cx.certified) {
            (None, _) => StepAcp::Dense,
            (Some(e), true) => StepAcp::Delta(
                (0..=n)
                    .map(|k| {
                        let ln_n = cx.ln.at(live - k + 1);
                        foxedge_core::threshold::threshold_ln(cx.u[h], ln_n, e)
                    })
                    .collect::<std::result::Result<_, _>>()?,
            ),
            (Some(e), false) => {
                // Without a certificate only the budget evicts: all n, always.
                if evict.iter().any(|x| x.at_or_below != f64::INFINITY) {
                    return Ok(None);
                }
                StepAcp::Norms {
                    base: e - ((live - n + 1) as f64).ln(),
                    k_norm_max: state.k_norm_max[h],
                    scale: cx.scale,
                }
            }
        };
        heads.push(StepHead {
            ops: if rebased[h] { meta_ops(hc) } else { Vec::new() },
            live,
            evict,
            c_prev: state.gates[h].current(),
            pos: cx.pos,
            acp,
        });
    }
    Ok(Some(heads))
}
