//! What a valid call is: the checks every backend runs before it computes, so that a bad
//! call fails the same way on each. Output buffers and backend limits (u32 indexing on a
//! device) are the backend's to check.

use super::acp::check_decode_acp;
use super::types::{
    ContinueArgs, ContinueOptions, DecodeArgs, DecodeOptions, PrefillArgs, PrefillOptions, Storage,
};
use crate::error::{Error, Result};

fn len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::BadLength {
            what,
            expected,
            got,
        })
    }
}

impl<T: Storage> PrefillArgs<'_, T> {
    /// Checks a prefill call: a valid shape ([`crate::AttentionShape::validate`]); q, k, v
    /// and the log gates of the shape's lengths; `seq_start` with `batch` values, each
    /// `< seq_k`; block sizes `> 0`; a finite `sm_scale`. The ACP parameters are checked
    /// per head when the decisions are made ([`super::acp::prefill_delta`]), the log gates'
    /// values when `c` is formed ([`crate::gate`]).
    ///
    /// Errors: [`Error::BadShape`], [`Error::BadLength`], [`Error::BadArgument`].
    pub fn check(&self, opts: &PrefillOptions<'_>) -> Result<()> {
        let sh = &self.shape;
        sh.validate()?;
        len("q", sh.q_len(), self.q.len())?;
        len("k", sh.kv_len(), self.k.len())?;
        len("v", sh.kv_len(), self.v.len())?;
        len("log_fgate", sh.gate_len(), self.log_fgate.len())?;
        if let Some(s) = self.seq_start {
            len("seq_start", sh.batch, s.len())?;
            if s.iter().any(|&x| x >= sh.seq_k) {
                return Err(Error::BadArgument("seq_start values must be < seq_k"));
            }
        }
        if opts.block_q == 0 || opts.block_k == 0 {
            return Err(Error::BadArgument("block sizes must be > 0"));
        }
        if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
            return Err(Error::BadArgument("sm_scale must be finite"));
        }
        Ok(())
    }
}

impl<Q: Storage, T: Storage> DecodeArgs<'_, Q, T> {
    /// Checks a decode step: `head_dim` a positive multiple of 8; at least one head and one
    /// query; q, `q_c` (finite) and `q_pos` of `heads * n_queries` rows; every cache head's
    /// k and v of `n * head_dim` values, its `c` finite, its `pos` (if any) of `n` values
    /// and then `q_pos` given; `block_k` and `split` `> 0`; a finite `sm_scale`; the ACP
    /// ([`check_decode_acp`]).
    ///
    /// Errors: [`Error::BadShape`], [`Error::BadLength`], [`Error::BadArgument`].
    pub fn check(&self, opts: &DecodeOptions<'_>) -> Result<()> {
        self.check_except_c(opts, |_| false)
    }

    /// [`DecodeArgs::check`] without the finiteness scan of `c` for the heads where
    /// `checked(h)`: a backend that keeps a head resident checks only the rows it uploads
    /// (the others were checked when they were).
    pub fn check_except_c(
        &self,
        opts: &DecodeOptions<'_>,
        checked: impl Fn(usize) -> bool,
    ) -> Result<()> {
        let (d, nq, nh) = (self.head_dim, self.n_queries, self.heads.len());
        if d == 0 || d % 8 != 0 {
            return Err(Error::BadShape("head_dim must be a positive multiple of 8"));
        }
        if nq == 0 || nh == 0 {
            return Err(Error::BadShape(
                "decode needs at least one head and one query",
            ));
        }
        let rows = nh
            .checked_mul(nq)
            .filter(|r| r.checked_mul(d).is_some())
            .ok_or(Error::BadShape("element count overflows usize"))?;
        len("decode q", rows * d, self.q.len())?;
        len("decode q_c", rows, self.q_c.len())?;
        if self.q_c.iter().any(|x| !x.is_finite()) {
            return Err(Error::BadArgument("query c_t must be finite"));
        }
        if let Some(p) = self.q_pos {
            len("decode q_pos", rows, p.len())?;
        }
        for (h, hc) in self.heads.iter().enumerate() {
            let n = hc.c.len();
            let nd = n
                .checked_mul(d)
                .ok_or(Error::BadShape("cache size overflows usize"))?;
            len("cache k (entries * head_dim)", nd, hc.k.len())?;
            len("cache v (entries * head_dim)", nd, hc.v.len())?;
            if !checked(h) && hc.c.iter().any(|x| !x.is_finite()) {
                return Err(Error::BadArgument("cache c_j must be finite"));
            }
            if let Some(p) = hc.pos {
                len("cache pos", n, p.len())?;
                if self.q_pos.is_none() {
                    return Err(Error::BadArgument("cache has positions but q_pos is None"));
                }
            }
        }
        if opts.block_k == 0 || opts.split == 0 {
            return Err(Error::BadArgument("block_k and split must be > 0"));
        }
        if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
            return Err(Error::BadArgument("sm_scale must be finite"));
        }
        check_decode_acp(&opts.acp, nh)
    }
}

impl<T: Storage> ContinueArgs<'_, T> {
    /// Checks a continuation prefill: `head_dim` a positive multiple of 8; at least one
    /// head and one query, `n_queries < u32::MAX`; q, k, v of `n_queries * heads *
    /// head_dim` values; `q_c` (finite and non-increasing along the queries of each head)
    /// and `key_end` of `n_queries * heads` (each new token's end after the token); every cache head's k and v of `n * head_dim`
    /// values and its `c` finite; `cache_end` of one slice per head, each of its head's
    /// length; block sizes `> 0`; a finite `sm_scale`; the ACP ([`check_decode_acp`]).
    ///
    /// Errors: [`Error::BadShape`], [`Error::BadLength`], [`Error::BadArgument`].
    pub fn check(&self, opts: &ContinueOptions<'_>) -> Result<()> {
        let (d, nq, nh) = (self.head_dim, self.n_queries, self.cache.len());
        if d == 0 || d % 8 != 0 {
            return Err(Error::BadShape("head_dim must be a positive multiple of 8"));
        }
        if nq == 0 || nh == 0 {
            return Err(Error::BadShape(
                "continuation needs at least one head and one query",
            ));
        }
        if u32::try_from(nq).is_err() {
            return Err(Error::BadShape("continuation n_queries must be < 2^32"));
        }
        let rows = nh
            .checked_mul(nq)
            .filter(|r| r.checked_mul(d).is_some())
            .ok_or(Error::BadShape("element count overflows usize"))?;
        len("continue q", rows * d, self.q.len())?;
        len("continue k", rows * d, self.k.len())?;
        len("continue v", rows * d, self.v.len())?;
        len("continue q_c", rows, self.q_c.len())?;
        if self.q_c.iter().any(|x| !x.is_finite()) {
            return Err(Error::BadArgument("query c_t must be finite"));
        }
        if self
            .q_c
            .windows(2 * nh)
            .step_by(nh)
            .any(|w| (0..nh).any(|h| w[nh + h] > w[h]))
        {
            return Err(Error::BadArgument(
                "query c_t must be non-increasing along the new tokens",
            ));
        }
        if let Some(e) = self.key_end {
            len("continue key_end", rows, e.len())?;
            if (0..rows).any(|x| (e[x] as usize) <= x / nh) {
                return Err(Error::BadArgument(
                    "key_end of a new token must be after it (its own query sees it)",
                ));
            }
        }
        if let Some(e) = self.cache_end {
            len("continue cache_end (one per head)", nh, e.len())?;
        }
        for (h, hc) in self.cache.iter().enumerate() {
            let n = hc.c.len();
            let nd = n
                .checked_mul(d)
                .ok_or(Error::BadShape("cache size overflows usize"))?;
            len("cache k (entries * head_dim)", nd, hc.k.len())?;
            len("cache v (entries * head_dim)", nd, hc.v.len())?;
            if hc.c.iter().any(|x| !x.is_finite()) {
                return Err(Error::BadArgument("cache c_j must be finite"));
            }
            if let Some(e) = self.cache_end {
                len("continue cache_end (entries of the head)", n, e[h].len())?;
            }
        }
        if opts.block_q == 0 || opts.block_k == 0 {
            return Err(Error::BadArgument("block sizes must be > 0"));
        }
        if opts.sm_scale.is_some_and(|s| !s.is_finite()) {
            return Err(Error::BadArgument("sm_scale must be finite"));
        }
        check_decode_acp(&opts.acp, nh)
    }
}

#[cfg(test)]
mod tests {
    use super::super::types::{Acp, CacheHead};
    use super::*;
    use crate::shape::{AttentionShape, Layout};

    #[test]
    fn prefill_check() {
        let sh = AttentionShape {
            batch: 2,
            heads_q: 2,
            heads_kv: 1,
            seq_q: 3,
            seq_k: 4,
            head_dim: 8,
            layout: Layout::HeadFirst,
        };
        let z = [0.0f32; 128];
        let g = [0.0f32; 16];
        let args = PrefillArgs {
            shape: sh,
            q: &z[..96],
            k: &z[..64],
            v: &z[..64],
            log_fgate: &g,
            seq_start: Some(&[0, 3]),
        };
        let opts = PrefillOptions::default();
        args.check(&opts).unwrap();
        let bad_len = |a: PrefillArgs<'_, f32>, what: &str| {
            assert!(matches!(a.check(&opts), Err(Error::BadLength { what: w, .. }) if w == what));
        };
        bad_len(
            PrefillArgs {
                q: &z[..95],
                ..args
            },
            "q",
        );
        bad_len(
            PrefillArgs {
                k: &z[..65],
                ..args
            },
            "k",
        );
        bad_len(PrefillArgs { v: &z[..0], ..args }, "v");
        bad_len(
            PrefillArgs {
                log_fgate: &g[..15],
                ..args
            },
            "log_fgate",
        );
        bad_len(
            PrefillArgs {
                seq_start: Some(&[0]),
                ..args
            },
            "seq_start",
        );
        let late = PrefillArgs {
            seq_start: Some(&[0, 4]),
            ..args
        };
        assert!(matches!(late.check(&opts), Err(Error::BadArgument(_))));
        let shape = AttentionShape { seq_q: 5, ..sh };
        assert!(matches!(
            PrefillArgs { shape, ..args }.check(&opts),
            Err(Error::BadShape(_))
        ));
        for o in [
            PrefillOptions { block_q: 0, ..opts },
            PrefillOptions { block_k: 0, ..opts },
            PrefillOptions {
                sm_scale: Some(f32::NAN),
                ..opts
            },
        ] {
            assert!(matches!(args.check(&o), Err(Error::BadArgument(_))));
        }
    }

    #[test]
    fn decode_check() {
        let kv = [0.0f32; 24];
        let c = [0.0, -1.0, -2.0];
        let cn = [0.0, f64::NAN, -2.0];
        let pos = [0u64, 1, 2];
        let heads = [
            CacheHead {
                k: &kv[..],
                v: &kv[..],
                c: &c[..],
                pos: None,
            },
            CacheHead {
                k: &kv[..16],
                v: &kv[..16],
                c: &c[..2],
                pos: None,
            },
        ];
        let q = [0.0f32; 16];
        let q_c = [0.0; 2];
        let args = DecodeArgs::one_query(8, &q, &q_c, &heads);
        let opts = DecodeOptions::default();
        args.check(&opts).unwrap();
        let shape = |a: DecodeArgs<'_, f32, f32>| matches!(a.check(&opts), Err(Error::BadShape(_)));
        assert!(shape(DecodeArgs {
            head_dim: 4,
            ..args
        }));
        assert!(shape(DecodeArgs {
            n_queries: 0,
            ..args
        }));
        assert!(shape(DecodeArgs { heads: &[], ..args }));
        let length =
            |a: DecodeArgs<'_, f32, f32>| matches!(a.check(&opts), Err(Error::BadLength { .. }));
        assert!(length(DecodeArgs { q: &q[..8], ..args }));
        assert!(length(DecodeArgs {
            q_c: &q_c[..1],
            ..args
        }));
        assert!(length(DecodeArgs {
            q_pos: Some(&pos),
            ..args
        }));
        let short = [
            heads[0],
            CacheHead {
                k: &kv[..8],
                ..heads[1]
            },
        ];
        assert!(length(DecodeArgs {
            heads: &short,
            ..args
        }));
        let argument = |a: DecodeArgs<'_, f32, f32>, o: &DecodeOptions<'_>| {
            matches!(a.check(o), Err(Error::BadArgument(_)))
        };
        assert!(argument(
            DecodeArgs {
                q_c: &[0.0, f64::INFINITY],
                ..args
            },
            &opts
        ));
        let nan = [CacheHead { c: &cn, ..heads[0] }, heads[1]];
        let with_nan = DecodeArgs {
            heads: &nan,
            ..args
        };
        assert!(argument(with_nan, &opts));
        with_nan.check_except_c(&opts, |h| h == 0).unwrap();
        let positioned = [
            CacheHead {
                pos: Some(&pos),
                ..heads[0]
            },
            heads[1],
        ];
        assert!(argument(
            DecodeArgs {
                heads: &positioned,
                ..args
            },
            &opts
        ));
        for o in [
            DecodeOptions { block_k: 0, ..opts },
            DecodeOptions { split: 0, ..opts },
            DecodeOptions {
                sm_scale: Some(f32::INFINITY),
                ..opts
            },
            DecodeOptions {
                acp: Acp::ObservedNorms { ln_eps: -1.0 },
                ..opts
            },
        ] {
            assert!(argument(args, &o));
        }
    }
}
