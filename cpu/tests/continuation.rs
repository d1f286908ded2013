//! Continuation prefill against the f64 reference (every ISA, f32/f16/bf16 storage, with
//! and without ends), against decode fed one query at a time, with ACP, and bad inputs.
mod common;

use common::*;
use foxedge_cpu::reference::{decode_f64, prefill_continue_f64};
use foxedge_cpu::{
    Acp, CacheHead, ContinueArgs, ContinueOptions, DecodeArgs, Error, Isa, Storage,
    prefill_continue, prefill_continue_with_isa,
};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// A chunk of `t` new tokens after caches of `n[h]` entries (shuffled, as swap-delete
/// leaves them), `c` of one decaying stream per head from an origin far from 0.
struct Chunk {
    d: usize,
    nh: usize,
    t: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q_c: Vec<f64>,
    key_end: Option<Vec<u32>>,
    ck: Vec<Vec<f32>>,
    cv: Vec<Vec<f32>>,
    cc: Vec<Vec<f64>>,
    cache_end: Option<Vec<Vec<u32>>>,
}

fn chunk(seed: u64, nh: usize, d: usize, t: usize, n: usize, gate_mu: f32, ends: bool) -> Chunk {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cc = Vec::new();
    let mut q_c = vec![0.0; t * nh];
    for h in 0..nh {
        let nh_ = n + h; // heads of different lengths
        let mut acc = -1.0e5;
        let mut c_pos = Vec::with_capacity(nh_);
        for _ in 0..nh_ {
            acc += f64::from(logsigmoid(gate_mu + 2.0 * normal(&mut rng)));
            c_pos.push(acc);
        }
        for r in 0..t {
            acc += f64::from(logsigmoid(gate_mu + 2.0 * normal(&mut rng)));
            q_c[r * nh + h] = acc;
        }
        c_pos.shuffle(&mut rng);
        cc.push(c_pos);
    }
    let rows = t * nh * d;
    let mut vecs = |len: usize| -> Vec<f32> { (0..len).map(|_| normal(&mut rng)).collect() };
    let (q, k, v) = (vecs(rows), vecs(rows), vecs(rows));
    let ck: Vec<Vec<f32>> = cc.iter().map(|c| vecs(c.len() * d)).collect();
    let cv: Vec<Vec<f32>> = cc.iter().map(|c| vecs(c.len() * d)).collect();
    let (key_end, cache_end) = if ends {
        let ke = (0..t * nh)
            .map(|x| rng.gen_range(x / nh + 1..=t) as u32)
            .collect();
        let ce = cc
            .iter()
            .map(|c| c.iter().map(|_| rng.gen_range(0..=t) as u32).collect())
            .collect();
        (Some(ke), Some(ce))
    } else {
        (None, None)
    };
    Chunk {
        d,
        nh,
        t,
        q,
        k,
        v,
        q_c,
        key_end,
        ck,
        cv,
        cc,
        cache_end,
    }
}

/// The chunk's rows in storage `T`.
struct Stored<T> {
    k: Vec<T>,
    v: Vec<T>,
    ck: Vec<Vec<T>>,
    cv: Vec<Vec<T>>,
}

impl Chunk {
    fn stored<T: Storage>(&self) -> Stored<T> {
        Stored {
            k: convert(&self.k),
            v: convert(&self.v),
            ck: self.ck.iter().map(|x| convert(x)).collect(),
            cv: self.cv.iter().map(|x| convert(x)).collect(),
        }
    }

    fn heads<'a, T: Storage>(&'a self, s: &'a Stored<T>) -> Vec<CacheHead<'a, T>> {
        (0..self.nh)
            .map(|h| CacheHead {
                k: &s.ck[h],
                v: &s.cv[h],
                c: &self.cc[h],
                pos: None,
            })
            .collect()
    }

    fn ends(&self) -> Option<Vec<&[u32]>> {
        self.cache_end
            .as_ref()
            .map(|e| e.iter().map(Vec::as_slice).collect())
    }

    fn args<'a, T: Storage>(
        &'a self,
        s: &'a Stored<T>,
        heads: &'a [CacheHead<'a, T>],
        ends: Option<&'a [&'a [u32]]>,
    ) -> ContinueArgs<'a, T> {
        ContinueArgs {
            head_dim: self.d,
            n_queries: self.t,
            q: &self.q,
            k: &s.k,
            v: &s.v,
            q_c: &self.q_c,
            key_end: self.key_end.as_deref(),
            cache: heads,
            cache_end: ends,
        }
    }
}

fn check_storage<T: Storage>(ch: &Chunk, what: &str) {
    let s = ch.stored::<T>();
    let heads = ch.heads(&s);
    let ends = ch.ends();
    let args = ch.args(&s, &heads, ends.as_deref());
    let (want, _) = prefill_continue_f64(&args, None);
    for block in [(64, 64), (16, 32), (7, 5)] {
        let opts = ContinueOptions {
            block_q: block.0,
            block_k: block.1,
            ..Default::default()
        };
        for isa in Isa::available() {
            let mut out = vec![0.0f32; want.len()];
            let st = prefill_continue_with_isa(isa, &args, &opts, &mut out).unwrap();
            // f32 compute over f32 (or widened) rows: ~1e-6 relative per output, with
            // the decay's hi/lo pair exact to ~1e-12.
            let e = rel_l2(&to_f64(&out), &want);
            assert!(e <= 2e-5, "{what} {isa:?} blocks {block:?}: rel err {e}");
            assert_eq!(st.kept_pairs(), st.total_pairs());
            assert_eq!(st.total_pairs(), pairs(ch), "{what}");
        }
    }
}

/// Attendable pairs by brute force.
fn pairs(ch: &Chunk) -> u64 {
    let mut n = 0;
    for h in 0..ch.nh {
        for r in 0..ch.t {
            for j in 0..ch.cc[h].len() {
                if ch.cache_end.as_ref().is_none_or(|e| r < e[h][j] as usize) {
                    n += 1;
                }
            }
            for i in 0..=r {
                if ch
                    .key_end
                    .as_ref()
                    .is_none_or(|e| r < e[i * ch.nh + h] as usize)
                {
                    n += 1;
                }
            }
        }
    }
    n
}

#[test]
fn matches_f64_reference_on_every_isa_and_storage() {
    for (seed, (d, t, n, ends)) in (1..).zip([
        (8, 1, 0, false),
        (8, 5, 3, true),
        (64, 70, 130, false),
        (64, 70, 130, true),
        (40, 33, 64, true),
        (64, 130, 0, true),
    ]) {
        let ch = chunk(seed, 3, d, t, n, 3.0, ends);
        let what = format!("d={d} t={t} n={n} ends={ends}");
        check_storage::<f32>(&ch, &format!("f32 {what}"));
        check_storage::<f16>(&ch, &format!("f16 {what}"));
        check_storage::<bf16>(&ch, &format!("bf16 {what}"));
    }
}

/// Without ends, query `r` of a continuation sees exactly what a decode step sees after
/// the tokens before it and itself were appended: the cache plus new keys `0..=r`.
#[test]
fn equals_decode_fed_one_query_at_a_time() {
    let ch = chunk(42, 4, 64, 50, 300, 2.0, false);
    let s = ch.stored::<f32>();
    let heads = ch.heads(&s);
    let args = ch.args(&s, &heads, None);
    let mut out = vec![0.0f32; ch.t * ch.nh * ch.d];
    prefill_continue(&args, &ContinueOptions::default(), &mut out).unwrap();
    let (d, nh) = (ch.d, ch.nh);
    for r in 0..ch.t {
        // Each head's cache with new keys 0..=r appended.
        let grown: Vec<(Vec<f32>, Vec<f32>, Vec<f64>)> = (0..nh)
            .map(|h| {
                let (mut k, mut v, mut c) = (ch.ck[h].clone(), ch.cv[h].clone(), ch.cc[h].clone());
                for i in 0..=r {
                    k.extend_from_slice(&ch.k[(i * nh + h) * d..][..d]);
                    v.extend_from_slice(&ch.v[(i * nh + h) * d..][..d]);
                    c.push(ch.q_c[i * nh + h]);
                }
                (k, v, c)
            })
            .collect();
        let hs: Vec<CacheHead<'_, f32>> = grown
            .iter()
            .map(|(k, v, c)| CacheHead { k, v, c, pos: None })
            .collect();
        let q = &ch.q[r * nh * d..(r + 1) * nh * d];
        let q_c = &ch.q_c[r * nh..(r + 1) * nh];
        let mut one = vec![0.0f32; nh * d];
        let dargs = DecodeArgs::one_query(d, q, q_c, &hs);
        foxedge_cpu::decode(&dargs, &Default::default(), &mut one, None).unwrap();
        let (want, _) = decode_f64(&dargs, None);
        let got = &out[r * nh * d..(r + 1) * nh * d];
        // Both within f32 rounding of the same f64 value.
        let e = rel_l2(&to_f64(got), &to_f64(&one));
        assert!(e <= 2e-5, "row {r}: continuation vs decode {e}");
        assert!(rel_l2(&to_f64(got), &want) <= 2e-5, "row {r} vs f64");
    }
}

/// ACP skips tiles whose largest decay is below delta: each row's skipped weights sum
/// below eps, so `|o - o_dense| <= 2 eps max|v|` (the normaliser loses at most eps too),
/// plus f32 rounding; fast-decaying gates skip most cache tiles.
#[test]
fn acp_prunes_within_eps() {
    for (seed, ends) in [(7, false), (8, true)] {
        let ch = chunk(seed, 3, 64, 90, 700, -1.0, ends);
        let s = ch.stored::<f32>();
        let heads = ch.heads(&s);
        let ends = ch.ends();
        let args = ch.args(&s, &heads, ends.as_deref());
        let (want, _) = prefill_continue_f64(&args, None);
        let vmax =
            ch.v.iter()
                .chain(ch.cv.iter().flatten())
                .fold(0.0f32, |m, x| m.max(x.abs()));
        // U = s max|q| max|k| bounds every logit (Cauchy-Schwarz), s = 1/8 at d = 64.
        let norm = |x: &[f32]| x.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
        let qmax = ch.q.chunks(64).map(norm).fold(0.0, f64::max);
        let kmax =
            ch.k.chunks(64)
                .chain(ch.ck.iter().flat_map(|x| x.chunks(64)))
                .map(norm)
                .fold(0.0, f64::max);
        let u = vec![qmax * kmax / 8.0; 3];
        let ln_eps = -6.0;
        let opts = ContinueOptions {
            acp: Acp::Bound { u: &u, ln_eps },
            ..Default::default()
        };
        for isa in Isa::available() {
            let mut out = vec![0.0f32; want.len()];
            let st = prefill_continue_with_isa(isa, &args, &opts, &mut out).unwrap();
            assert!(st.kept_pairs() < st.total_pairs(), "{st:?}");
            assert_eq!(st.total_pairs(), pairs(&ch));
            let tol = 2.0 * ln_eps.exp() * f64::from(vmax) + 1e-4;
            let worst = max_abs(&to_f64(&out), &want);
            assert!(worst <= tol, "{isa:?}: {worst} > {tol}");
        }
    }
}

#[test]
fn bad_calls_are_errors() {
    let ch = chunk(3, 2, 8, 4, 5, 1.0, true);
    let s = ch.stored::<f32>();
    let heads = ch.heads(&s);
    let ends = ch.ends();
    let args = ch.args(&s, &heads, ends.as_deref());
    let opts = ContinueOptions::default();
    let mut out = vec![0.0f32; 4 * 2 * 8];
    prefill_continue(&args, &opts, &mut out).unwrap();
    let mut short = vec![0.0f32; 4 * 2 * 8 - 1];
    assert!(matches!(
        prefill_continue(&args, &opts, &mut short),
        Err(Error::BadLength { .. })
    ));
    macro_rules! err {
        ($a:expr) => {
            prefill_continue(&$a, &opts, &mut out.clone()).expect_err(stringify!($a))
        };
    }
    assert!(matches!(
        err!(ContinueArgs {
            head_dim: 12,
            ..args
        }),
        Error::BadShape(_)
    ));
    assert!(matches!(
        err!(ContinueArgs {
            n_queries: 0,
            ..args
        }),
        Error::BadShape(_)
    ));
    assert!(matches!(
        err!(ContinueArgs {
            q: &ch.q[1..],
            ..args
        }),
        Error::BadLength { .. }
    ));
    assert!(matches!(
        err!(ContinueArgs {
            k: &s.k[1..],
            ..args
        }),
        Error::BadLength { .. }
    ));
    let mut rising = ch.q_c.clone();
    rising[2] = rising[0] + 1.0;
    assert!(matches!(
        err!(ContinueArgs {
            q_c: &rising,
            ..args
        }),
        Error::BadArgument(_)
    ));
    let mut nan = ch.q_c.clone();
    nan[5] = f64::NAN;
    assert!(matches!(
        err!(ContinueArgs { q_c: &nan, ..args }),
        Error::BadArgument(_)
    ));
    let mut early = ch.key_end.clone().unwrap();
    early[2 * 2 + 1] = 2; // token 2 of head 1 unseen by its own query
    assert!(matches!(
        err!(ContinueArgs {
            key_end: Some(&early),
            ..args
        }),
        Error::BadArgument(_)
    ));
    let one_head: Vec<&[u32]> = ends.as_ref().unwrap()[..1].to_vec();
    assert!(matches!(
        err!(ContinueArgs {
            cache_end: Some(&one_head),
            ..args
        }),
        Error::BadLength { .. }
    ));
    // A query whose logits are NaN, inf or overflow f32 (as in prefill's test).
    for bad in [f32::NAN, f32::INFINITY, 1.0e20] {
        let (mut bad_q, mut bad_k) = (ch.q.clone(), s.k.clone());
        bad_q[3] = bad;
        bad_k[3] = bad;
        let e = err!(ContinueArgs {
            q: &bad_q,
            k: &bad_k,
            ..args
        });
        assert_eq!(
            e.to_string(),
            Error::BadArgument(
                "attention logits are not finite: q, k or v holds NaN/inf, or s*q.k overflows f32",
            )
            .to_string(),
            "{bad}"
        );
    }
    let u = [1.0];
    let o = ContinueOptions {
        acp: Acp::Bound {
            u: &u,
            ln_eps: -1.0,
        },
        ..opts
    };
    assert!(matches!(
        prefill_continue(&args, &o, &mut out),
        Err(Error::BadLength { .. })
    ));
    let o = ContinueOptions { block_k: 0, ..opts };
    assert!(matches!(
        prefill_continue(&args, &o, &mut out),
        Err(Error::BadArgument(_))
    ));
}
