//! The logit bound `U` and the ACP threshold `delta` (ACP paper, section 3 and appendix A).
//!
//! With `U >= max_{i,j} |s q_i.k_j|` (s the softmax scale) and
//! `delta = -2U - ln L + ln eps`, every attention weight with `D_ij < delta` is below
//! `eps / L`, so the pruned weights of any row sum below `eps` (appendix A, eqs. 4-6):
//! `A_ij <= exp(s_ij - s_ii + D_ij) <= exp(2U + D_ij) < exp(2U + delta) = eps / L`.
//! Units: `U`, `delta` and `ln eps` are in nats (natural-log units of attention logits).

use crate::error::{Error, Result};

/// Default `ln eps` = -10 (eps ~ 4.5e-5), the paper's setting.
pub const DEFAULT_LN_EPS: f64 = -10.0;

/// Relative slack allowed by [`LogitBound::check`] for [`LogitBound::QkNorm`]: that bound
/// holds mathematically, so an excess can only come from rounding of the observed norms.
pub const QK_NORM_CHECK_REL_TOL: f64 = 1e-5;

fn max_abs(what: &'static str, v: &[f32]) -> Result<f64> {
    if v.is_empty() {
        return Err(Error::BadArgument(what));
    }
    let mut m = 0.0f64;
    for &x in v {
        if !x.is_finite() {
            return Err(Error::BadArgument("QK-norm scale (gamma) must be finite"));
        }
        m = m.max(f64::from(x).abs());
    }
    Ok(m)
}

/// `U = max|gamma_q| * max|gamma_k| * sqrt(head_dim)`: the logit bound for the softmax
/// scale `1/sqrt(head_dim)` when q and k pass through RMSNorm with these per-channel scales
/// (pass one head's slices). An RMS-normalised vector has L2 norm `<= sqrt(d)` before the
/// scale, so `|q.k|/sqrt(d) <= max|gq| sqrt(d) * max|gk| sqrt(d) / sqrt(d)`. Holds for every
/// future token.
///
/// Errors ([`Error::BadArgument`]): an empty slice, a non-finite gamma, `head_dim == 0`.
pub fn bound_from_qk_norm(gamma_q: &[f32], gamma_k: &[f32], head_dim: usize) -> Result<f64> {
    if head_dim == 0 {
        return Err(Error::BadArgument(
            "bound_from_qk_norm: head_dim must be > 0",
        ));
    }
    let gq = max_abs("bound_from_qk_norm: gamma_q is empty", gamma_q)?;
    let gk = max_abs("bound_from_qk_norm: gamma_k is empty", gamma_k)?;
    Ok(gq * gk * libm::sqrt(head_dim as f64))
}

/// `U = scale * max_i ||q_i|| * max_j ||k_j||` from observed L2 norms (Cauchy-Schwarz).
/// Valid only for the q and k it was measured on: a streaming caller must check every new
/// q and k against it ([`LogitBound::check`]).
///
/// Errors ([`Error::BadArgument`]): a NaN, infinite or negative argument.
pub fn bound_from_norms(max_q_norm: f64, max_k_norm: f64, scale: f64) -> Result<f64> {
    for x in [max_q_norm, max_k_norm, scale] {
        if !x.is_finite() || x < 0.0 {
            return Err(Error::BadArgument(
                "bound_from_norms: norms and scale must be finite and >= 0",
            ));
        }
    }
    Ok(scale * max_q_norm * max_k_norm)
}

/// The ACP threshold `delta = -2U - ln(n_keys) + ln_eps` (nats). Blocks or entries with
/// `D < delta` may be pruned; each pruned weight is then `< eps / n_keys` and a row's pruned
/// weights sum to `< eps`. `n_keys` is the number of keys the query rows attend over (for
/// decoding: the cache length including the new token; over a retained cache, its live
/// entries). `ln_eps = -inf` (eps = 0) gives
/// `delta = -inf`: nothing is pruned.
///
/// Errors ([`Error::BadArgument`]): `u` NaN, infinite or negative; `n_keys == 0`;
/// `ln_eps` NaN or `> 0`.
pub fn threshold(u: f64, n_keys: usize, ln_eps: f64) -> Result<f64> {
    check_u(u)?;
    if n_keys == 0 {
        return Err(Error::BadArgument("threshold: n_keys must be > 0"));
    }
    threshold_ln(u, ln_keys(n_keys), ln_eps)
}

/// `ln n_keys` as [`threshold`] takes it, for callers that tabulate it.
pub fn ln_keys(n_keys: usize) -> f64 {
    libm::log(n_keys as f64)
}

/// [`threshold`] from `ln_n = ln_keys(n_keys)`: the same value, bit for bit.
///
/// Errors ([`Error::BadArgument`]): `u` NaN, infinite or negative; `ln_eps` NaN or `> 0`.
pub fn threshold_ln(u: f64, ln_n: f64, ln_eps: f64) -> Result<f64> {
    check_u(u)?;
    check_ln_eps(ln_eps)?;
    Ok(-2.0 * u - ln_n + ln_eps)
}

/// [`threshold`] for every head: `out[h] = threshold(u[h], n_keys, ln_eps)`.
///
/// Errors: `out.len() != u.len()` ([`Error::BadLength`]) and those of [`threshold`].
pub fn thresholds_per_head(u: &[f64], n_keys: usize, ln_eps: f64, out: &mut [f64]) -> Result<()> {
    if out.len() != u.len() {
        return Err(Error::BadLength {
            what: "thresholds_per_head out",
            expected: u.len(),
            got: out.len(),
        });
    }
    for (o, &uh) in out.iter_mut().zip(u) {
        *o = threshold(uh, n_keys, ln_eps)?;
    }
    Ok(())
}

pub(crate) fn check_u(u: f64) -> Result<()> {
    if !u.is_finite() || u < 0.0 {
        return Err(Error::BadArgument("logit bound U must be finite and >= 0"));
    }
    Ok(())
}

pub(crate) fn check_ln_eps(ln_eps: f64) -> Result<()> {
    if ln_eps.is_nan() || ln_eps > 0.0 {
        return Err(Error::BadArgument("ln eps must be <= 0 and not NaN"));
    }
    Ok(())
}

/// Where a logit bound came from, and so for how long it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogitBound {
    /// From QK-norm scales ([`bound_from_qk_norm`]): holds for every future token.
    QkNorm(f64),
    /// Declared by the caller: must be checked against every new q and k.
    Declared(f64),
    /// From observed norms ([`bound_from_norms`]): holds for the observed q and k only;
    /// new ones must be checked.
    Observed(f64),
}

impl LogitBound {
    /// The bound `U` (nats).
    #[inline]
    pub fn value(&self) -> f64 {
        match *self {
            LogitBound::QkNorm(u) | LogitBound::Declared(u) | LogitBound::Observed(u) => u,
        }
    }

    /// True when the bound holds for every future token without checks (QK-norm).
    #[inline]
    pub fn holds_forever(&self) -> bool {
        matches!(self, LogitBound::QkNorm(_))
    }

    /// Checks a new query or key against the bound a threshold (or an eviction certificate)
    /// was derived from: every logit it can form is at most
    /// `scale * observed_q_norm * observed_k_norm`, which must not exceed `U`. Pass the
    /// new vector's norm and the largest norm on the other side (for example the new q's
    /// norm with the largest cached k norm).
    ///
    /// `Declared` and `Observed` bounds are checked strictly; `QkNorm` allows a relative
    /// slack of [`QK_NORM_CHECK_REL_TOL`] for the rounding of the norms (the bound itself is
    /// exact math).
    ///
    /// Errors: [`Error::BoundViolated`] (observed logit bound and `U`, as f32);
    /// [`Error::BadArgument`] for NaN, infinite or negative arguments, or a stored `U` that
    /// is not finite and `>= 0`.
    pub fn check(&self, observed_q_norm: f64, observed_k_norm: f64, scale: f64) -> Result<()> {
        let u = self.value();
        check_u(u)?;
        let observed = bound_from_norms(observed_q_norm, observed_k_norm, scale)?;
        let limit = match self {
            LogitBound::QkNorm(_) => u * (1.0 + QK_NORM_CHECK_REL_TOL),
            LogitBound::Declared(_) | LogitBound::Observed(_) => u,
        };
        if observed > limit {
            return Err(Error::BoundViolated {
                observed: observed as f32,
                bound: u as f32,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_threshold_values() {
        let u = bound_from_qk_norm(&[0.5, -2.0, 1.0], &[1.5, 0.25], 64).unwrap();
        assert_eq!(u, 2.0 * 1.5 * 8.0);
        assert_eq!(bound_from_norms(3.0, 4.0, 0.125).unwrap(), 1.5);
        let d = threshold(1.5, 1024, DEFAULT_LN_EPS).unwrap();
        assert!((d - (-3.0 - libm::log(1024.0) - 10.0)).abs() < 1e-12);
        assert_eq!(threshold(0.0, 1, 0.0).unwrap(), 0.0);
        assert_eq!(
            threshold(1.0, 4, f64::NEG_INFINITY).unwrap(),
            f64::NEG_INFINITY
        );
        let mut out = [0.0; 2];
        thresholds_per_head(&[0.0, 1.0], 1, -1.0, &mut out).unwrap();
        assert_eq!(out, [-1.0, -3.0]);
    }

    #[test]
    fn error_paths() {
        assert!(bound_from_qk_norm(&[], &[1.0], 8).is_err());
        assert!(bound_from_qk_norm(&[1.0], &[], 8).is_err());
        assert!(bound_from_qk_norm(&[1.0], &[1.0], 0).is_err());
        assert!(bound_from_qk_norm(&[f32::NAN], &[1.0], 8).is_err());
        assert!(bound_from_qk_norm(&[1.0], &[f32::INFINITY], 8).is_err());
        assert!(bound_from_norms(-1.0, 1.0, 1.0).is_err());
        assert!(bound_from_norms(1.0, f64::NAN, 1.0).is_err());
        assert!(bound_from_norms(1.0, 1.0, f64::INFINITY).is_err());
        assert!(threshold(f64::NAN, 4, -1.0).is_err());
        assert!(threshold(-0.5, 4, -1.0).is_err());
        assert!(threshold(f64::INFINITY, 4, -1.0).is_err());
        assert!(threshold(1.0, 0, -1.0).is_err());
        assert!(threshold(1.0, 4, 0.5).is_err());
        assert!(threshold(1.0, 4, f64::NAN).is_err());
        let mut out = [0.0; 1];
        assert!(matches!(
            thresholds_per_head(&[1.0, 2.0], 4, -1.0, &mut out),
            Err(Error::BadLength { .. })
        ));
        assert!(thresholds_per_head(&[-1.0], 4, -1.0, &mut out).is_err());
    }

    #[test]
    fn logit_bound_check() {
        let d = LogitBound::Declared(2.0);
        assert_eq!(d.value(), 2.0);
        assert!(!d.holds_forever());
        assert!(d.check(4.0, 4.0, 0.125).is_ok());
        assert_eq!(
            d.check(4.0, 4.0001, 0.125),
            Err(Error::BoundViolated {
                observed: (0.125f64 * 4.0 * 4.0001) as f32,
                bound: 2.0
            })
        );
        assert!(LogitBound::Observed(2.0).check(4.0, 4.0001, 0.125).is_err());
        let q = LogitBound::QkNorm(2.0);
        assert!(q.holds_forever());
        assert!(q.check(4.0, 4.00001, 0.125).is_ok());
        assert!(q.check(4.0, 4.001, 0.125).is_err());
        assert!(matches!(
            d.check(f64::NAN, 1.0, 1.0),
            Err(Error::BadArgument(_))
        ));
        assert!(matches!(
            LogitBound::Declared(f64::NAN).check(1.0, 1.0, 1.0),
            Err(Error::BadArgument(_))
        ));
    }

    proptest::proptest! {
        /// The tabulated form is [`threshold`] bit for bit, errors included.
        #[test]
        fn threshold_ln_is_threshold(
            u in proptest::prop_oneof![0.0f64..1e3, proptest::num::f64::ANY],
            n in 1usize..1 << 40,
            ln_eps in proptest::prop_oneof![-1e3f64..=0.0, proptest::num::f64::ANY],
        ) {
            let a = threshold(u, n, ln_eps);
            let b = threshold_ln(u, ln_keys(n), ln_eps);
            proptest::prop_assert_eq!(a.is_ok(), b.is_ok());
            if let (Ok(a), Ok(b)) = (a, b) {
                proptest::prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }
    }
}
