//! Certified eviction for streaming decoding (DESIGN.md, "Certified eviction for streaming").
//!
//! With `U >= |s q_i.k_j|` for every query and key the head will ever see, a cache entry
//! `j` takes at most `A_ij <= exp(s_ij - s_ii + D_ij) <= exp(2U + c_i - c_j)` of the
//! attention of any later query `i` (the query keeps itself, as in the ACP paper's
//! appendix A). Summed over an evicted set `E`, the mass that eviction removes from query
//! `i` (measured in the dense softmax) is at most
//!
//! ```text
//! B_i = exp(2U + c_i + logsumexp_{j in E}(-c_j))
//! ```
//!
//! and `B_i` never increases with `i` because `c_i` never increases. One running
//! `logsumexp(-c_j)` per head therefore certifies forever that everything evicted so far
//! costs at most `B_t`. The certified rule evicts the oldest live entry (largest `c_j`, so
//! smallest bound) while the new `B_t` stays `<= eps`.
//!
//! `U` must hold for all future tokens: a QK-norm bound
//! ([`crate::threshold::LogitBound::QkNorm`]) or a declared bound that the caller checks on
//! every new q and k ([`crate::threshold::LogitBound::check`]). An observed bound does not
//! certify the future.
//!
//! Values of `c` are relative to the head's gate origin ([`crate::gate::GateStream`]);
//! [`Certificate::rebase`] follows an origin move.

use crate::error::{Error, Result};
use crate::threshold::{check_ln_eps, check_u};

/// `ln(exp(a) + exp(b))`, exact for `-inf` arguments.
#[inline]
pub(crate) fn log_add_exp(a: f64, b: f64) -> f64 {
    if a == f64::NEG_INFINITY {
        return b;
    }
    if b == f64::NEG_INFINITY {
        return a;
    }
    let (m, d) = if a >= b { (a, b - a) } else { (b, a - b) };
    m + libm::log1p(libm::exp(d))
}

/// The running eviction certificate of one head.
///
/// State: `U` (nats), `lse = logsumexp_{j in E}(-c_j)` over the evicted set `E` (`-inf`
/// when empty) and `|E|`. `ln B_t = 2U + c_t + lse`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Certificate {
    u: f64,
    lse: f64,
    evicted: u64,
}

impl Certificate {
    /// A certificate with nothing evicted, for logit bound `u`.
    ///
    /// Errors: `u` NaN, infinite or negative ([`Error::BadArgument`]).
    pub fn new(u: f64) -> Result<Self> {
        check_u(u)?;
        Ok(Self {
            u,
            lse: f64::NEG_INFINITY,
            evicted: 0,
        })
    }

    /// `U = 0`, nothing evicted (a placeholder for fixed-size storage).
    pub(crate) const fn empty() -> Self {
        Self {
            u: 0.0,
            lse: f64::NEG_INFINITY,
            evicted: 0,
        }
    }

    /// A certificate from its state (a saved stream's): bound `u`, `lse =
    /// logsumexp_{j in E}(-c_j)` and `|E| = evicted`.
    ///
    /// Errors ([`Error::BadArgument`]): `u` NaN, infinite or negative; `lse` NaN or
    /// `+inf`; `lse = -inf` with `evicted > 0`, or finite with `evicted = 0`.
    pub fn from_parts(u: f64, lse: f64, evicted: u64) -> Result<Self> {
        check_u(u)?;
        let empty = lse == f64::NEG_INFINITY;
        if lse.is_nan() || lse == f64::INFINITY || empty != (evicted == 0) {
            return Err(Error::BadArgument(
                "Certificate::from_parts: lse must be -inf exactly when nothing was evicted",
            ));
        }
        Ok(Self { u, lse, evicted })
    }

    /// The logit bound `U` (nats).
    #[inline]
    pub fn u(&self) -> f64 {
        self.u
    }

    /// Number of entries recorded as evicted.
    #[inline]
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// `logsumexp_{j in E}(-c_j)` (relative to the current origin), `-inf` when `E` is empty.
    #[inline]
    pub fn log_sum_exp_neg_c(&self) -> f64 {
        self.lse
    }

    /// `ln B_t = 2U + c_t + logsumexp_{j in E}(-c_j)`: the log of the attention mass that
    /// the evicted entries can take from a query with cumulative gate `c_t` (or any later
    /// one). `-inf` when nothing was evicted.
    #[inline]
    pub fn ln_bound(&self, c_t: f64) -> f64 {
        if self.lse == f64::NEG_INFINITY {
            return f64::NEG_INFINITY;
        }
        2.0 * self.u + c_t + self.lse
    }

    /// `B_t = exp(ln_bound(c_t))` (a fraction of attention mass, 0 when nothing evicted;
    /// may exceed 1, where it certifies nothing).
    #[inline]
    pub fn bound(&self, c_t: f64) -> f64 {
        libm::exp(self.ln_bound(c_t))
    }

    /// `ln B_t` as it would be after also evicting an entry with gate `c_j`.
    #[inline]
    pub fn ln_bound_with(&self, c_t: f64, c_j: f64) -> f64 {
        2.0 * self.u + c_t + log_add_exp(self.lse, -c_j)
    }

    /// True when evicting the entry `c_j` keeps `B_t <= eps`.
    #[inline]
    pub fn allows(&self, c_t: f64, c_j: f64, ln_eps: f64) -> bool {
        self.ln_bound_with(c_t, c_j) <= ln_eps
    }

    /// Adds an evicted entry (`c_j` relative to the current origin).
    ///
    /// Errors: `c_j` not finite ([`Error::BadArgument`]); nothing changes.
    pub fn record(&mut self, c_j: f64) -> Result<()> {
        if !c_j.is_finite() {
            return Err(Error::BadArgument(
                "Certificate::record: c_j must be finite",
            ));
        }
        self.lse = log_add_exp(self.lse, -c_j);
        self.evicted += 1;
        Ok(())
    }

    /// How many entries, taken in the given order (oldest first: non-increasing `c_j`),
    /// can be evicted one after the other while `B_t` stays `<= eps`. Stops at the first
    /// entry that would break the bound. Does not change the certificate.
    ///
    /// Errors: `ln_eps` NaN or `> 0`, a non-finite `c_t` or `c_j` ([`Error::BadArgument`]).
    pub fn allowed_evictions<I: IntoIterator<Item = f64>>(
        &self,
        c_t: f64,
        oldest_first: I,
        ln_eps: f64,
    ) -> Result<usize> {
        check_ln_eps(ln_eps)?;
        if !c_t.is_finite() {
            return Err(Error::BadArgument("allowed_evictions: c_t must be finite"));
        }
        let mut lse = self.lse;
        let mut n = 0;
        for c_j in oldest_first {
            if !c_j.is_finite() {
                return Err(Error::BadArgument("allowed_evictions: c_j must be finite"));
            }
            let next = log_add_exp(lse, -c_j);
            if 2.0 * self.u + c_t + next > ln_eps {
                break;
            }
            lse = next;
            n += 1;
        }
        Ok(n)
    }

    /// Follows a move of the head's gate origin by `shift` (every stored `c` becomes
    /// `c - shift`, so `-c_j` grows by `shift`): `lse += shift`. `ln B_t` is unchanged when
    /// `c_t` is shifted too. A non-finite `shift` is ignored (see
    /// [`crate::gate::GateStream::rebase`]).
    pub fn rebase(&mut self, shift: f64) {
        if shift.is_finite() && self.lse != f64::NEG_INFINITY {
            self.lse += shift;
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::vec;
    use std::vec::Vec;

    #[test]
    fn log_add_exp_is_exact_at_edges() {
        assert_eq!(log_add_exp(f64::NEG_INFINITY, 3.0), 3.0);
        assert_eq!(log_add_exp(3.0, f64::NEG_INFINITY), 3.0);
        assert!((log_add_exp(0.0, 0.0) - libm::log(2.0)).abs() < 1e-15);
        assert_eq!(log_add_exp(1000.0, 0.0), 1000.0);
    }

    #[test]
    fn certificate_values_and_errors() {
        assert!(Certificate::new(-1.0).is_err());
        assert!(Certificate::new(f64::NAN).is_err());
        assert!(Certificate::new(f64::INFINITY).is_err());
        let mut c = Certificate::new(1.0).unwrap();
        assert_eq!(c.ln_bound(-5.0), f64::NEG_INFINITY);
        assert_eq!(c.bound(-5.0), 0.0);
        assert!(c.record(f64::NAN).is_err());
        assert_eq!(c.evicted(), 0);
        c.record(-1.0).unwrap();
        c.record(-2.0).unwrap();
        let want = 2.0 + -10.0 + libm::log(libm::exp(1.0) + libm::exp(2.0));
        assert!((c.ln_bound(-10.0) - want).abs() < 1e-12);
        assert_eq!(c.evicted(), 2);
        assert!(c.allowed_evictions(0.0, [0.0], 0.5).is_err());
        assert!(c.allowed_evictions(f64::NAN, [0.0], -1.0).is_err());
        assert!(c.allowed_evictions(-10.0, [f64::INFINITY], -1.0).is_err());
        // rebase keeps ln B when c_t moves too
        let before = c.ln_bound(-10.0);
        c.rebase(-4.0);
        assert!((c.ln_bound(-10.0 + 4.0) - before).abs() < 1e-12);
        c.rebase(f64::NAN);
        assert!((c.ln_bound(-6.0) - before).abs() < 1e-12);
    }

    #[test]
    fn allowed_evictions_matches_sequential_records() {
        let mut c = Certificate::new(0.5).unwrap();
        let cs = [-1.0, -2.0, -3.0, -4.0, -5.0];
        let (c_t, ln_eps) = (-9.0, -4.0);
        let n = c.allowed_evictions(c_t, cs, ln_eps).unwrap();
        for &cj in &cs[..n] {
            assert!(c.allows(c_t, cj, ln_eps));
            c.record(cj).unwrap();
        }
        assert!(c.ln_bound(c_t) <= ln_eps);
        assert_eq!(n, 3);
        assert!(!c.allows(c_t, cs[n], ln_eps));
    }

    /// Dense softmax weights of query `i` over keys `0..=i` (f64).
    fn weights(i: usize, q: &[Vec<f64>], k: &[Vec<f64>], c: &[f64], scale: f64) -> Vec<f64> {
        let logits: Vec<f64> = (0..=i)
            .map(|j| scale * q[i].iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f64>() + c[i] - c[j])
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|x| libm::exp(x - m)).sum();
        logits.iter().map(|x| libm::exp(x - m) / z).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// For random streams with logits bounded by U, any evicted set (certified or not),
        /// and every later step, the certificate is >= the true evicted attention mass and
        /// never increases. With the certified rule alone it also stays <= eps.
        #[test]
        fn certificate_bounds_true_evicted_mass(
            n in 1usize..=48,
            d in 1usize..=6,
            u in 0.0f64..=3.0,
            ln_eps in -8.0f64..=-0.5,
            g in proptest::collection::vec(prop_oneof![-3.0f32..=0.0, -0.02f32..=0.0, -40.0f32..=0.0], 48),
            raw in proptest::collection::vec(-1.0f64..=1.0, 2 * 48 * 6),
            forced in proptest::collection::vec(0u8..=9, 48),
            rebase_every in 0usize..=7,
        ) {
            let scale = 1.0 / libm::sqrt(d as f64);
            let r = libm::sqrt(u / scale);
            let vecs: Vec<Vec<f64>> = (0..2 * n).map(|i| {
                let v = &raw[i * d..(i + 1) * d];
                let nv = libm::sqrt(v.iter().map(|x| x * x).sum::<f64>()).max(1e-12);
                v.iter().map(|x| x / nv * r).collect()
            }).collect();
            let (q, k) = vecs.split_at(n);
            // absolute c for the brute force; the certificate sees relative c (re-based)
            let mut c_abs = vec![0.0f64; n];
            let mut acc = 0.0;
            for t in 0..n { acc += f64::from(g[t]); c_abs[t] = acc; }

            let mut cert = Certificate::new(u).unwrap();
            let mut origin = 0.0;
            let mut live: Vec<usize> = Vec::new(); // age order
            let mut evicted: Vec<usize> = Vec::new();
            let mut any_forced = false;
            // snapshots (evicted set, certificate, c_t when taken) to re-check later
            let mut snaps: Vec<(Vec<usize>, Certificate, f64, f64)> = Vec::new();
            for t in 0..n {
                if rebase_every > 0 && t % rebase_every == 0 {
                    let shift = c_abs[t] - origin; // new origin at the current c
                    origin += shift;
                    cert.rebase(shift);
                    for s in &mut snaps { s.1.rebase(shift); s.2 -= shift; s.3 -= shift; }
                }
                let c_t = c_abs[t] - origin;
                // certified rule: oldest first while B_t <= eps (token t itself stays)
                while let Some(&j) = live.first() {
                    if !cert.allows(c_t, c_abs[j] - origin, ln_eps) { break; }
                    cert.record(c_abs[j] - origin).unwrap();
                    evicted.push(live.remove(0));
                }
                // sometimes a forced eviction of an arbitrary live entry
                if forced[t] == 0 && !live.is_empty() {
                    let j = live.remove(t % live.len());
                    cert.record(c_abs[j] - origin).unwrap();
                    evicted.push(j);
                    any_forced = true;
                }
                live.push(t);
                if !any_forced {
                    prop_assert!(cert.ln_bound(c_t) <= ln_eps + 1e-12);
                }
                snaps.push((evicted.clone(), cert, c_t, c_t));
                // check every snapshot at this step
                let w = weights(t, q, k, &c_abs, scale);
                for (set, sc, c_then, last_c) in &mut snaps {
                    let mass: f64 = set.iter().map(|&j| w[j]).sum();
                    let b = sc.bound(c_t);
                    prop_assert!(mass <= b * (1.0 + 1e-9) + 1e-300, "mass {} > B {}", mass, b);
                    prop_assert!(sc.ln_bound(c_t) <= sc.ln_bound(*last_c) + 1e-9);
                    prop_assert!(sc.ln_bound(c_t) <= sc.ln_bound(*c_then) + 1e-9);
                    *last_c = c_t;
                }
            }
        }
    }
}
