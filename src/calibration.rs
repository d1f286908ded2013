//! What a call costs on each side: `secs = a + b P` per side (the CPU kernels, a GPU
//! backend) and kind of call (prefill, decode), fitted through two synthetic dense calls
//! each, `P` the call's query-key pairs (work is proportional to them: ACP paper, section
//! 3). [`crate::placement`] plans calls from these lines; they are measured once per
//! process, device and (heads, head_dim) ([`for_device`]).

use crate::backend::{AttentionBackend, CpuBackend, DecodeCall, PrefillCall, fresh_cache_ids};
use crate::error::{Error, Result};
use foxedge_core::contract::{CacheHead, DecodeArgs, HeadSync};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// `secs = a + b pairs` of one side and kind of call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// Seconds of a call's fixed work.
    pub a: f64,
    /// Seconds per query-key pair.
    pub b: f64,
}

impl Line {
    /// Seconds of a call of `pairs` pairs.
    pub fn secs(&self, pairs: u64) -> f64 {
        self.a + self.b * pairs as f64
    }

    /// The line through two measurements `(pairs, secs)`, both terms clamped to `>= 0`
    /// (timer noise); a flat pair charges the larger call's time per pair.
    fn through((p1, s1): (u64, f64), (p2, s2): (u64, f64)) -> Line {
        let dp = p2.saturating_sub(p1) as f64;
        let b = if dp > 0.0 { (s2 - s1) / dp } else { 0.0 };
        let b = if b > 0.0 { b } else { s2 / p2.max(1) as f64 };
        Line {
            a: (s1 - b * p1 as f64).max(0.0),
            b,
        }
    }
}

/// Both sides' costs for one (heads, head_dim): index 0 prefill, 1 decode (a step of one
/// query per head over a cache the device keeps resident).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    pub cpu: [Line; 2],
    pub gpu: [Line; 2],
    /// Wall time the calibration took.
    pub seconds: f64,
}

impl fmt::Display for Calibration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = |x: &Line| format!("{:.0} us + {:.3} ns/pair", x.a * 1e6, x.b * 1e9);
        write!(
            f,
            "prefill cpu {} | gpu {}; decode cpu {} | gpu {} ({:.2} s)",
            l(&self.cpu[0]),
            l(&self.gpu[0]),
            l(&self.cpu[1]),
            l(&self.gpu[1]),
            self.seconds
        )
    }
}

/// Minimum seconds of the runs of `f` after one untimed warm-up: at least one run, more
/// while they total under 50 ms, at most 5.
fn time_min(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let (mut best, mut total) = (f64::INFINITY, 0.0);
    for _ in 0..5 {
        let t0 = Instant::now();
        f()?;
        let secs = t0.elapsed().as_secs_f64();
        (best, total) = (best.min(secs), total + secs);
        if total > 0.05 {
            break;
        }
    }
    Ok(best)
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift64*).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Seconds of a dense prefill of `t` synthetic tokens on `b` ([`time_min`]).
fn prefill_secs(b: &dyn AttentionBackend, heads: usize, d: usize, t: usize) -> Result<f64> {
    let n = t * heads * d;
    let (q, k, v) = (random(n, 1), random(n, 2), random(n, 3));
    let log_f = vec![-0.01f32; t * heads];
    let call = PrefillCall::new(t, heads, d, &q, &k, &v, &log_f);
    let mut out = vec![0.0f32; n];
    time_min(|| b.prefill(&call, &mut out).map(|_| ()))
}

/// Seconds of a dense decode step over `n` synthetic entries per head on `b`, with change
/// tracking that never changes: a backend that mirrors caches sends them on the untimed
/// first step, then nothing, as a session's step sends one row a head.
fn decode_secs(b: &dyn AttentionBackend, heads: usize, d: usize, n: usize) -> Result<f64> {
    let (k, v, q) = (random(n * d, 4), random(n * d, 5), random(heads * d, 6));
    let c: Vec<f64> = (0..n).map(|j| -0.01 * (n - 1 - j) as f64).collect();
    let (q_c, rows) = (vec![0.0f64; heads], vec![1u64; n]);
    let id = fresh_cache_ids(heads);
    let sync: Vec<HeadSync<'_>> = (0..heads as u64)
        .map(|h| HeadSync {
            id: id + h,
            version: 1,
            row_version: &rows,
            journal: None,
        })
        .collect();
    let cache = vec![
        CacheHead {
            k: &k,
            v: &v,
            c: &c,
            pos: None
        };
        heads
    ];
    let call = DecodeCall {
        args: DecodeArgs::one_query(d, &q, &q_c, &cache),
        sync: &sync,
        acp: foxedge_core::contract::Acp::Off,
    };
    let mut out = vec![0.0f32; heads * d];
    let secs = time_min(|| b.decode(&call, &mut out).map(|_| ()));
    b.release_cache(&(id..id + heads as u64).collect::<Vec<_>>());
    secs
}

/// Both sides' costs for calls of `heads` x `d`: prefill lines through the last two of
/// 64, 256, 1024, 4096 tokens (stopping once one takes over 20 ms), decode lines through
/// steps over 1024 and 8192 entries per head.
fn calibrate(gpu: &dyn AttentionBackend, heads: usize, d: usize) -> Result<Calibration> {
    let t0 = Instant::now();
    let prefill = |b: &dyn AttentionBackend| -> Result<Line> {
        let mut pts: Vec<(u64, f64)> = Vec::new();
        for t in [64usize, 256, 1024, 4096] {
            let secs = prefill_secs(b, heads, d, t)?;
            pts.push(((t * (t + 1) / 2 * heads) as u64, secs));
            if pts.len() >= 2 && secs > 0.02 {
                break;
            }
        }
        Ok(Line::through(pts[pts.len() - 2], pts[pts.len() - 1]))
    };
    let decode = |b: &dyn AttentionBackend| -> Result<Line> {
        let at = |n: usize| Ok::<_, Error>(((n * heads) as u64, decode_secs(b, heads, d, n)?));
        Ok(Line::through(at(1024)?, at(8192)?))
    };
    let cpu = CpuBackend;
    Ok(Calibration {
        cpu: [prefill(&cpu)?, decode(&cpu)?],
        gpu: [prefill(gpu)?, decode(gpu)?],
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The costs of calls of `heads` x `d` on `gpu` (the device `name`) and the CPU: the
/// process's, when some earlier placement measured them for this device (then `gpu` runs
/// each kind of call once, so that its pipelines are built now, not in the middle of a
/// stream), else measured now ([`calibrate`]) and kept for the process.
pub(crate) fn for_device(
    gpu: &dyn AttentionBackend,
    name: &str,
    heads: usize,
    d: usize,
) -> Result<Calibration> {
    type Shared = Mutex<HashMap<(String, usize, usize), Calibration>>;
    static SHARED: OnceLock<Shared> = OnceLock::new();
    let shared = SHARED.get_or_init(Shared::default);
    let key = (name.to_string(), heads, d);
    if let Some(c) = shared.lock().ok().and_then(|m| m.get(&key).copied()) {
        prefill_secs(gpu, heads, d, 64)?;
        decode_secs(gpu, heads, d, 64)?;
        return Ok(c);
    }
    let c = calibrate(gpu, heads, d)?;
    if let Ok(mut m) = shared.lock() {
        m.insert(key, c);
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A fitted line never charges negative time, whatever the timer read.
        #[test]
        fn a_fitted_line_is_finite_and_not_negative(
            p1 in 1u64..1_000_000, dp in 0u64..1_000_000_000, s1 in 0.0f64..1.0, s2 in 0.0f64..1.0,
        ) {
            let l = Line::through((p1, s1), (p1 + dp, s2));
            prop_assert!(l.a.is_finite() && l.a >= 0.0 && l.b.is_finite() && l.b >= 0.0);
        }
    }
}
