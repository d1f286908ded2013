//! A call's ACP decisions before any kernel runs: which key blocks each head of a prefill
//! visits, and how many query-key pairs each head of a call keeps.
//!
//! The decisions are the kernel contract's (`foxedge_core::contract::acp`: the threshold
//! from the bound, paper section 3, then the start blocks and pair counts over
//! [`BLOCK`]-token blocks), made exactly as the kernels make them: a placement that splits
//! heads by their kept pairs hands these decisions to both sides (`Acp::Decided`), so no
//! kernel decides again.

use crate::backend::{DecodeCall, PrefillCall};
use crate::error::{Error, Result};
use foxedge_core::boundary::BlockGrid;
use foxedge_core::contract::{Acp, Decisions, acp};
use foxedge_core::gate;

/// ACP block size (tokens) of both backends' kernels (their default options).
pub(crate) const BLOCK: usize = 64;

/// The ACP boundary of one prefill call (what every backend skips), per head: the
/// decisions of [`prefill_decisions`].
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// Tokens per block (query and key): [`BLOCK`].
    pub block: usize,
    /// Query blocks per head.
    pub q_blocks: usize,
    /// `[heads, q_blocks]`: key blocks `< start` are pruned for that query block.
    pub start_blocks: Vec<u32>,
    pub kept_pairs: Vec<u64>,
    pub total_pairs: Vec<u64>,
    /// The threshold of each head (None: dense).
    pub delta: Vec<Option<f64>>,
    /// `[heads, t]`: cumulative log gates `c_i = sum_{l <= i} log f_l` (f64).
    pub c: Vec<f64>,
}

impl Boundary {
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
/// `Threshold`): per head [`acp::decide_slab`] on `c` from 0. Small calls are decided on
/// this thread, every head's `c` in one pass over the gate rows; large ones head by head
/// on the rayon pool ([`acp::SERIAL_DECISIONS`]).
pub(crate) fn prefill_decisions(call: &PrefillCall<'_>) -> Result<Boundary> {
    use rayon::prelude::*;
    let (t, nh) = (call.t(), call.heads());
    let (args, mode) = (call.args(), call.acp());
    if matches!(mode, Acp::Decided(_)) {
        return Err(Error::Internal(
            "prefill decisions asked of a decided call".into(),
        ));
    }
    let log_f = args.log_fgate;
    if log_f.len() != t * nh {
        return Err(Error::invalid("prefill: log_f holds [t, heads] values"));
    }
    let grid = BlockGrid::new(BLOCK, BLOCK, t, t).map_err(core_err)?;
    let nqb = grid.q_blocks();
    let mut pd = Boundary {
        block: BLOCK,
        q_blocks: nqb,
        start_blocks: vec![0; nh * nqb],
        kept_pairs: vec![0; nh],
        total_pairs: vec![0; nh],
        delta: vec![None; nh],
        c: vec![0.0; nh * t],
    };
    let heavy = matches!(mode, Acp::ObservedNorms { .. });
    let serial = !heavy && t * nh <= acp::SERIAL_DECISIONS;
    if serial {
        gate::cumsum_rows(log_f, nh, 0.0, &mut pd.c).map_err(core_err)?;
    } else {
        gate::validate_log_gates(log_f).map_err(core_err)?;
    }
    let scale = 1.0 / (call.head_dim() as f32).sqrt();
    let one = |(h, (c, st)): (usize, (&mut [f64], &mut [u32]))| {
        if !serial {
            gate::cumsum_strided(&log_f[h..], nh, 0.0, c).map_err(core_err)?;
        }
        acp::decide_slab(args, &mode, scale, &grid, h, 0, c, st).map_err(core_err)
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
        let hs = r?;
        (pd.delta[h], pd.kept_pairs[h], pd.total_pairs[h]) =
            (hs.delta, hs.kept_pairs, hs.total_pairs);
    }
    Ok(pd)
}

/// Kept (query, entry) pairs of head `h` of a decode call: the head's entries that
/// [`acp::decode_kept_entries`] keeps in [`BLOCK`]-entry blocks under the threshold
/// [`acp::decode_delta`], times the queries.
pub(crate) fn decode_kept<T: foxedge_core::contract::Storage>(
    call: &DecodeCall<'_, T>,
    h: usize,
) -> Result<u64> {
    let nq = call.args.n_queries;
    let heads = call.args.heads;
    let head = heads
        .get(h)
        .ok_or_else(|| Error::Internal("decode_kept: no such head".into()))?;
    let qc = call
        .args
        .q_c
        .get(h * nq..(h + 1) * nq)
        .ok_or_else(|| Error::invalid("decode: q_c holds [heads, n_queries] values"))?;
    acp::check_decode_acp(&call.acp, heads.len()).map_err(core_err)?;
    let delta = acp::decode_delta(&call.acp, h, head.c.len()).map_err(core_err)?;
    let kept = acp::decode_kept_entries(head.c, qc, delta, BLOCK).map_err(core_err)?;
    Ok(kept as u64 * nq as u64)
}

#[cfg(test)]
pub(crate) mod tests {
    //! The decisions against foxedge-core head by head and against the CPU kernels' own
    //! statistics (exact: the same integer counts), and random inputs the placement's
    //! tests share.
    use super::*;
    use crate::backend::{AttentionBackend, CpuBackend};
    use foxedge_core::contract::{CacheHead, DecodeArgs, DecodeOptions, PrefillOptions};

    /// Prefill inputs: q, k, v uniform in [-1, 1) from a seed; head `h`'s log gates
    /// `-0.001 (1 + 50 h)` (from nearly global to local heads); `U = sqrt(d)`.
    #[derive(Debug, Clone)]
    pub(crate) struct Inputs {
        pub t: usize,
        pub heads: usize,
        pub d: usize,
        pub q: Vec<f32>,
        pub k: Vec<f32>,
        pub v: Vec<f32>,
        pub log_f: Vec<f32>,
        pub u: Vec<f64>,
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// A decode step at entry `n - 1` of [`Inputs`]: per head the first `n` tokens' keys,
    /// values and `c`, and token `n - 1`'s query.
    #[derive(Debug, Clone)]
    pub(crate) struct Step {
        pub d: usize,
        pub k: Vec<Vec<f32>>,
        pub v: Vec<Vec<f32>>,
        pub c: Vec<Vec<f64>>,
        pub q: Vec<f32>,
        pub q_c: Vec<f64>,
        pub u: Vec<f64>,
    }

    impl Inputs {
        pub(crate) fn new(t: usize, heads: usize, d: usize, seed: u64) -> Inputs {
            let n = t * heads * d;
            Inputs {
                t,
                heads,
                d,
                q: random(n, seed),
                k: random(n, seed + 1),
                v: random(n, seed + 2),
                log_f: (0..t * heads)
                    .map(|i| -0.001 * (1 + 50 * (i % heads)) as f32)
                    .collect(),
                u: vec![(d as f64).sqrt(); heads],
            }
        }

        /// ACP with the inputs' bounds and `ln eps = -10`.
        pub(crate) fn bound(&self) -> Acp<'_> {
            Acp::Bound {
                u: &self.u,
                ln_eps: -10.0,
            }
        }

        pub(crate) fn call<'a>(&'a self, acp: Acp<'a>) -> PrefillCall<'a> {
            PrefillCall::new(
                self.t,
                self.heads,
                self.d,
                &self.q,
                &self.k,
                &self.v,
                &self.log_f,
            )
            .with_acp(acp)
        }

        pub(crate) fn step(&self, n: usize) -> Step {
            let (nh, d) = (self.heads, self.d);
            let rows = |x: &[f32], h: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|r| x[(r * nh + h) * d..][..d].to_vec())
                    .collect()
            };
            let c: Vec<Vec<f64>> = (0..nh)
                .map(|h| {
                    let mut c = vec![0.0; n];
                    gate::cumsum_strided(&self.log_f[h..], nh, 0.0, &mut c).unwrap();
                    c
                })
                .collect();
            Step {
                d,
                k: (0..nh).map(|h| rows(&self.k, h)).collect(),
                v: (0..nh).map(|h| rows(&self.v, h)).collect(),
                q_c: c.iter().map(|c| c[n - 1]).collect(),
                c,
                q: (0..nh)
                    .flat_map(|h| self.q[((n - 1) * nh + h) * d..][..d].to_vec())
                    .collect(),
                u: self.u.clone(),
            }
        }
    }

    impl Step {
        pub(crate) fn heads(&self) -> Vec<CacheHead<'_, f32>> {
            (0..self.c.len())
                .map(|h| CacheHead {
                    k: &self.k[h],
                    v: &self.v[h],
                    c: &self.c[h],
                    pos: None,
                })
                .collect()
        }

        pub(crate) fn call<'a>(
            &'a self,
            heads: &'a [CacheHead<'a, f32>],
            acp: Acp<'a>,
        ) -> DecodeCall<'a> {
            DecodeCall {
                args: DecodeArgs::one_query(self.d, &self.q, &self.q_c, heads),
                sync: &[],
                acp,
            }
        }

        pub(crate) fn bound(&self) -> Acp<'_> {
            Acp::Bound {
                u: &self.u,
                ln_eps: -10.0,
            }
        }
    }

    #[test]
    fn block_is_both_kernels_default_tile() {
        assert_eq!(BLOCK, PrefillOptions::default().block_q);
        assert_eq!(BLOCK, PrefillOptions::default().block_k);
        assert_eq!(BLOCK, DecodeOptions::default().block_k);
    }

    #[test]
    fn decisions_equal_each_heads_own_serially_and_on_the_pool() {
        // 700 x 5 gate entries are decided on this thread; 4200 x 16 on the pool. Each
        // head against its own decision by foxedge-core (itself tested against the
        // paper's definitions there).
        for (t, nh) in [(700, 5), (4200, 16)] {
            let p = Inputs::new(t, nh, 8, 3);
            let call = p.call(p.bound());
            let b = prefill_decisions(&call).unwrap();
            let grid = BlockGrid::new(BLOCK, BLOCK, t, t).unwrap();
            let nqb = grid.q_blocks();
            let (mut c, mut st) = (vec![0.0; t], vec![0u32; nqb]);
            let scale = 1.0 / (p.d as f32).sqrt();
            for h in 0..nh {
                gate::cumsum_strided(&p.log_f[h..], nh, 0.0, &mut c).unwrap();
                let hs = acp::decide_slab(call.args(), &p.bound(), scale, &grid, h, 0, &c, &mut st)
                    .unwrap();
                let delta = acp::prefill_delta(call.args(), &p.bound(), scale, h, 0).unwrap();
                assert_eq!(&b.c[h * t..][..t], &c[..]);
                assert_eq!(&b.start_blocks[h * nqb..][..nqb], &st[..]);
                assert_eq!(b.delta[h], delta);
                assert!(delta.is_some());
                assert_eq!(
                    (b.kept_pairs[h], b.total_pairs[h]),
                    (hs.kept_pairs, hs.total_pairs)
                );
            }
            assert!(b.kept_pairs.iter().zip(&b.total_pairs).any(|(k, n)| k < n));
        }
    }

    #[test]
    fn decision_counts_equal_the_cpu_kernels() {
        let p = Inputs::new(700, 5, 16, 5);
        let norms = Acp::ObservedNorms { ln_eps: -10.0 };
        for acp in [Acp::Off, p.bound(), norms] {
            let b = prefill_decisions(&p.call(acp)).unwrap();
            let mut out = vec![0.0; p.q.len()];
            let st = CpuBackend.prefill(&p.call(acp), &mut out).unwrap();
            let kept: Vec<u64> = st.heads.iter().map(|h| h.kept_pairs).collect();
            let total: Vec<u64> = st.heads.iter().map(|h| h.total_pairs).collect();
            assert_eq!(b.kept_pairs, kept, "{acp:?}");
            assert_eq!(b.total_pairs, total, "{acp:?}");
            // The kernels on these decisions: bit-identical output and statistics.
            let mut got = vec![0.0; p.q.len()];
            assert_eq!(CpuBackend.prefill(&p.call(b.acp()), &mut got).unwrap(), st);
            assert_eq!(got, out);
        }
        let b = prefill_decisions(&p.call(norms)).unwrap();
        assert!(b.kept_pairs.iter().zip(&b.total_pairs).any(|(k, t)| k < t));
        assert!(
            prefill_decisions(&p.call(b.acp())).is_err(),
            "decided twice"
        );
    }

    #[test]
    fn decode_kept_equals_the_cpu_kernels() {
        let p = Inputs::new(3000, 4, 16, 7);
        let s = p.step(3000);
        let heads = s.heads();
        for acp in [Acp::Off, s.bound()] {
            let call = s.call(&heads, acp);
            let w: Vec<u64> = (0..4).map(|h| decode_kept(&call, h).unwrap()).collect();
            let mut out = vec![0.0; 4 * 16];
            let st = CpuBackend.decode(&call, &mut out).unwrap();
            let kept: Vec<u64> = st.heads.iter().map(|h| h.kept_pairs).collect();
            assert_eq!(w, kept, "{acp:?}");
        }
        let call = s.call(&heads, s.bound());
        let w: Vec<u64> = (0..4).map(|h| decode_kept(&call, h).unwrap()).collect();
        assert!(w.iter().any(|&x| x < 3000), "something pruned");
        assert!(decode_kept(&call, 4).is_err());
    }
}
