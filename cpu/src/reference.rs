//! Plain f64 forgetting attention, written straight from the definition, for tests of
//! every backend. Dense and slow (`O(seq_q * seq_k * d)` per head); its own prefix sum.
//!
//! ```text
//! o_i = Σ_j w_ij v_j / Σ_j w_ij,  w_ij = exp(s q_i·k_j + c_i - c_j),  lse_i = ln Σ_j w_ij
//! ```

use foxedge_core::contract::{ContinueArgs, DecodeArgs, PrefillArgs, Storage};

/// Reference prefill. Returns `(out, lse)`: `out` in `args.shape.layout`, `lse` in
/// `[batch, heads_q, seq_q]` order. Row `t` of (b, h) attends keys
/// `first_key(b, h, t) ..= q_offset + t` where `first_key` defaults to `seq_start[b]`
/// (pass a larger one to emulate pruning). Rows with no key give 0 and `-inf`.
///
/// Panics on inconsistent lengths (test helper; the kernels return errors instead).
pub fn prefill_f64<T: Storage>(
    args: &PrefillArgs<'_, T>,
    sm_scale: Option<f64>,
    first_key: Option<&dyn Fn(usize, usize, usize) -> usize>,
) -> (Vec<f64>, Vec<f64>) {
    let sh = &args.shape;
    let d = sh.head_dim;
    let s = sm_scale.unwrap_or(1.0 / (d as f64).sqrt());
    let f = |x: T| f64::from(x.to_f32());
    let mut out = vec![0.0; sh.q_len()];
    let mut lse = vec![f64::NEG_INFINITY; sh.batch * sh.heads_q * sh.seq_q];
    let mut c = vec![0.0f64; sh.seq_k];
    let mut w = vec![0.0f64; sh.seq_k];
    for b in 0..sh.batch {
        let ks = args.seq_start.map_or(0, |x| x[b]);
        for h in 0..sh.heads_q {
            let hk = h / sh.group();
            let mut acc = 0.0;
            for (j, cj) in c.iter_mut().enumerate() {
                // The floor is exact (a weight across a gate of -1e4 is exp(-1e4) = 0 in f64
                // too) and keeps a gate near f32::MIN from swallowing every later gate of c.
                let g = args.log_fgate[sh.gate_at(b, j, h)].max(foxedge_core::gate::LOG_GATE_FLOOR);
                acc += f64::from(g);
                *cj = acc;
            }
            for t in 0..sh.seq_q {
                let i = sh.q_offset() + t;
                let lo = first_key.map_or(ks, |fk| fk(b, h, t)).max(ks);
                if lo > i {
                    continue;
                }
                let q = &args.q[sh.q_at(b, t, h)..][..d];
                let mut mx = f64::NEG_INFINITY;
                for (j, wj) in w.iter_mut().enumerate().take(i + 1).skip(lo) {
                    let k = &args.k[sh.kv_at(b, j, hk)..][..d];
                    let dot: f64 = q.iter().zip(k).map(|(&x, &y)| f(x) * f(y)).sum();
                    *wj = s * dot + c[i] - c[j];
                    mx = mx.max(*wj);
                }
                let mut l = 0.0;
                let o = &mut out[sh.q_at(b, t, h)..][..d];
                for (j, wj) in w.iter().enumerate().take(i + 1).skip(lo) {
                    let p = (wj - mx).exp();
                    l += p;
                    let v = &args.v[sh.kv_at(b, j, hk)..][..d];
                    for (x, &y) in o.iter_mut().zip(v) {
                        *x += p * f(y);
                    }
                }
                for x in o.iter_mut() {
                    *x /= l;
                }
                lse[(b * sh.heads_q + h) * sh.seq_q + t] = mx + l.ln();
            }
        }
    }
    (out, lse)
}

/// Reference decode: `(out [heads, n_queries, d], lse [heads, n_queries])`; every entry
/// attended (subject to positions when given).
pub fn decode_f64<Q: Storage, T: Storage>(
    args: &DecodeArgs<'_, Q, T>,
    sm_scale: Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    let (d, nq) = (args.head_dim, args.n_queries);
    let s = sm_scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut out = vec![0.0; args.heads.len() * nq * d];
    let mut lse = vec![f64::NEG_INFINITY; args.heads.len() * nq];
    for (h, hc) in args.heads.iter().enumerate() {
        for t in 0..nq {
            let r = h * nq + t;
            let q = &args.q[r * d..(r + 1) * d];
            let ok = |j: usize| match (hc.pos, args.q_pos) {
                (Some(p), Some(qp)) => p[j] <= qp[r],
                _ => true,
            };
            let w: Vec<Option<f64>> = (0..hc.c.len())
                .map(|j| {
                    ok(j).then(|| {
                        let k = &hc.k[j * d..(j + 1) * d];
                        let dot: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(x, y)| f64::from(x.to_f32()) * f64::from(y.to_f32()))
                            .sum();
                        s * dot + args.q_c[r] - hc.c[j]
                    })
                })
                .collect();
            let mx = w
                .iter()
                .flatten()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let mut l = 0.0;
            let o = &mut out[r * d..(r + 1) * d];
            for (j, wj) in w.iter().enumerate() {
                if let Some(wj) = wj {
                    let p = (wj - mx).exp();
                    l += p;
                    for (x, y) in o.iter_mut().zip(&hc.v[j * d..(j + 1) * d]) {
                        *x += p * f64::from(y.to_f32());
                    }
                }
            }
            for x in o.iter_mut() {
                *x /= l;
            }
            lse[r] = mx + l.ln();
        }
    }
    (out, lse)
}

/// Reference continuation prefill: `out` `[n_queries, heads, d]`, `lse` `[n_queries,
/// heads]`. Query `r` of head `h` attends cache entry `j` iff `r < cache_end[h][j]` and
/// new key `i` iff `i <= r < key_end[i]` (see [`ContinueArgs`]), every one of them.
pub fn prefill_continue_f64<T: Storage>(
    args: &ContinueArgs<'_, T>,
    sm_scale: Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    let (d, t, nh) = (args.head_dim, args.n_queries, args.heads());
    let s = sm_scale.unwrap_or(1.0 / (d as f64).sqrt());
    let f = |x: T| f64::from(x.to_f32());
    let mut out = vec![0.0; t * nh * d];
    let mut lse = vec![f64::NEG_INFINITY; t * nh];
    for (h, hc) in args.cache.iter().enumerate() {
        for r in 0..t {
            let q = &args.q[(r * nh + h) * d..][..d];
            let cr = args.q_c[r * nh + h];
            // (logit, value row) of every key query r sees.
            let mut keys: Vec<(f64, Vec<f64>)> = Vec::new();
            let dot =
                |k: &[T]| -> f64 { q.iter().zip(k).map(|(&x, &y)| f64::from(x) * f(y)).sum() };
            for j in 0..hc.c.len() {
                if args.cache_end.is_some_and(|e| r >= e[h][j] as usize) {
                    continue;
                }
                let w = s * dot(&hc.k[j * d..(j + 1) * d]) + cr - hc.c[j];
                keys.push((w, hc.v[j * d..(j + 1) * d].iter().map(|&y| f(y)).collect()));
            }
            for i in 0..=r {
                if args.key_end.is_some_and(|e| r >= e[i * nh + h] as usize) {
                    continue;
                }
                let at = (i * nh + h) * d;
                let w = s * dot(&args.k[at..at + d]) + cr - args.q_c[i * nh + h];
                keys.push((w, args.v[at..at + d].iter().map(|&y| f(y)).collect()));
            }
            let mx = keys.iter().map(|k| k.0).fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let o = &mut out[(r * nh + h) * d..][..d];
            let mut l = 0.0;
            for (w, v) in &keys {
                let p = (w - mx).exp();
                l += p;
                for (x, y) in o.iter_mut().zip(v) {
                    *x += p * y;
                }
            }
            for x in o.iter_mut() {
                *x /= l;
            }
            lse[r * nh + h] = mx + l.ln();
        }
    }
    (out, lse)
}
