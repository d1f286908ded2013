//! Retention (KV-cache) policy for the heads of one layer: which cache slots are live and
//! which entry to evict next. Bookkeeping only: the caller owns the tensors and copies one
//! row per reported move.
//!
//! # Model
//!
//! Every call to [`RetentionPolicy::append`] adds one token (a stream position) to every
//! head. Per head the policy keeps:
//! - **slots**: live entries are dense in `0..live`; the new token goes to slot `live - 1`.
//!   Evicting slot `e` moves the last live slot into `e` (swap-delete), reported as
//!   [`Eviction::moved_from`], so the tensor storage copies one row.
//! - **sinks**: the first `sinks` tokens appended are never evicted; they stay in slots
//!   `0..sinks`.
//! - **protected window**: the `window` most recent tokens (the new one included) are never
//!   evicted.
//! - **age order**: the other (evictable) entries, oldest first ([`RetentionPolicy::age_order`]).
//! - **certificate** ([`Certificate`]): `B_t = exp(2U_h + c_t + logsumexp_{j evicted}(-c_j))`
//!   bounds the attention mass that everything evicted from the head can take from the
//!   current and every later query.
//!
//! Eviction at each step, after the token leaving the window becomes evictable and before
//! the new token is stored:
//! 1. **certified** (when `ln_eps` is set): per head, evict the oldest evictable entry while
//!    `B_t` stays `<= eps`. Free: the output changes by at most `B_t` of attention mass.
//! 2. **forced** by the head budget (`live_h + 1 > head limit`), then by the layer budget
//!    (`sum_h live_h + heads > layer_budget`): [`ForcedOrder::WeightBound`] evicts, across
//!    heads, the oldest evictable entry with the smallest weight bound `2U_h + c_t - c_j`;
//!    [`ForcedOrder::Scores`] evicts the lowest caller score (ties: older first, then lower
//!    head), kept per head in an indexed min-heap. `B_t` keeps counting forced evictions,
//!    so it may exceed `eps`; it is reported, never hidden.
//!
//! Positions must strictly increase across calls, so an evicted token never re-enters.
//! Nothing is allocated: the caller provides the slot storage (`heads * head_capacity`
//! [`Slot`]s) and the per-head state (`heads` [`HeadState`]s) as anything that is
//! `AsRef<[T]> + AsMut<[T]>`: `&mut [T]`, arrays, `heapless::Vec`, or `Vec` on std, so the
//! capacity and budgets are runtime values.
//!
//! A "head" is a cache head. With grouped-query attention one kv head serves several
//! query heads, each with its own gates and `U`: pass for that kv head the cumulative sum of
//! the group's element-wise largest log gate (`max_h log f^h_l`) and `U = max_h U_h`. Then
//! `2U + c_t - c_j` bounds every query head of the group, since a sum of maxima is at least
//! the maximum of the sums.
//!
//! `c` values are cumulative log gates relative to each head's gate origin
//! ([`crate::gate::GateStream`]). When the facade re-bases a head's stream by `shift`, it
//! calls [`RetentionPolicy::rebase`] with the same `shift`.
//!
//! # Example
//!
//! ```
//! use foxedge_core::retention::{EvictionKind, HeadState, PolicyConfig, RetentionPolicy, Slot};
//!
//! // 2 heads, at most 4 entries per head, the last 2 tokens protected, 1 sink, ln eps = -10.
//! let mut cfg = PolicyConfig::new(2, 4);
//! cfg.window = 2;
//! cfg.sinks = 1;
//! let mut slots = [Slot::EMPTY; 2 * 4]; // or vec![Slot::EMPTY; cfg.slots_needed()?]
//! let mut heads = [HeadState::EMPTY; 2];
//! let u = [1.0, 1.0]; // logit bound per head (from QK-norm scales)
//! let mut policy = RetentionPolicy::new(cfg, &u, &mut slots[..], &mut heads[..])?;
//!
//! // K/V rows of head h, slot s (one number per row to keep the example short).
//! let mut rows = [[0u64; 4]; 2];
//! let mut c = [0.0f64; 2];
//! for t in 0..10u64 {
//!     // head 0 forgets fast (local), head 1 barely (global)
//!     c[0] -= 8.0;
//!     c[1] -= 0.01;
//!     policy.append(t, &c, None, |ev| {
//!         if let Some(from) = ev.moved_from {
//!             rows[ev.head][ev.slot as usize] = rows[ev.head][from as usize];
//!         }
//!     })?;
//!     for h in 0..2 {
//!         let s = policy.head_stats(h)?.live - 1; // the new token's slot
//!         rows[h][s] = t;
//!     }
//! }
//! let s0 = policy.head_stats(0)?;
//! assert!(s0.evicted_certified > 0 && s0.bound <= (-10f64).exp()); // local head: certified
//! let s1 = policy.head_stats(1)?;
//! assert!(s1.evicted_forced > 0); // global head: its budget forced evictions
//! for h in 0..2 {
//!     let live = policy.slots(h)?;
//!     assert!(live.iter().zip(&rows[h]).all(|(s, &r)| s.position() == r));
//! }
//! # Ok::<(), foxedge_core::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::eviction::Certificate;
use crate::threshold::{DEFAULT_LN_EPS, check_ln_eps, check_u};

mod slots;
mod snapshot;
#[cfg(test)]
mod tests;

pub use slots::{Eviction, EvictionKind, HeadState, Slot};
use slots::{NONE, Zone, evict, heap_push, list_push_back, oldest_evictable};
pub use snapshot::{EntryRecord, EntryZone, HeadRecord};

/// How a budget chooses what to evict once the certificate allows nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForcedOrder {
    /// Smallest weight bound `2U_h + c_t - c_j` first (the oldest evictable entry of the
    /// head where that is smallest).
    #[default]
    WeightBound,
    /// Lowest caller score first (scores given to [`RetentionPolicy::append`]).
    Scores,
}

/// Sizes and rules of a [`RetentionPolicy`]. Units: entries (= tokens per head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    /// Heads in the layer (`>= 1`).
    pub heads: usize,
    /// Slots per head in the caller's storage (`1..u32::MAX`).
    pub head_capacity: usize,
    /// Live entries allowed per head (`<= head_capacity`); `None` = `head_capacity`.
    pub head_budget: Option<usize>,
    /// Live entries allowed over all heads of the layer; `None` = no layer budget.
    pub layer_budget: Option<usize>,
    /// Most recent tokens never evicted, the new token included (`>= 1`).
    pub window: usize,
    /// First tokens never evicted (attention sinks).
    pub sinks: usize,
    /// `ln eps` of certified eviction; `None` turns certified eviction off.
    pub ln_eps: Option<f64>,
    /// Order of forced evictions.
    pub order: ForcedOrder,
}

impl PolicyConfig {
    /// `heads` heads of `head_capacity` slots; no extra budgets, window 1 (only the new
    /// token), no sinks, certified eviction at [`DEFAULT_LN_EPS`], weight-bound order.
    pub fn new(heads: usize, head_capacity: usize) -> Self {
        Self {
            heads,
            head_capacity,
            head_budget: None,
            layer_budget: None,
            window: 1,
            sinks: 0,
            ln_eps: Some(DEFAULT_LN_EPS),
            order: ForcedOrder::WeightBound,
        }
    }

    /// Live entries allowed per head: `min(head_budget, head_capacity)`.
    pub fn head_limit(&self) -> usize {
        self.head_budget
            .map_or(self.head_capacity, |b| b.min(self.head_capacity))
    }

    /// Slot storage the policy needs: `heads * head_capacity`.
    ///
    /// Errors: the product overflows ([`Error::BadShape`]).
    pub fn slots_needed(&self) -> Result<usize> {
        self.heads
            .checked_mul(self.head_capacity)
            .ok_or(Error::BadShape(
                "retention: heads * head_capacity overflows",
            ))
    }

    /// Checks that every budget can hold the protected tokens, so a forced eviction always
    /// finds a candidate: `heads >= 1`, `1 <= head_capacity < u32::MAX`,
    /// `1 <= head_budget <= head_capacity`, `window >= 1`,
    /// `sinks + window <= head limit`, `heads * (sinks + window) <= layer_budget`,
    /// `ln_eps` not NaN and `<= 0`.
    ///
    /// Errors: [`Error::BadShape`] or [`Error::BadArgument`] naming the rule.
    pub fn validate(&self) -> Result<()> {
        if self.heads == 0 {
            return Err(Error::BadShape("retention: heads must be >= 1"));
        }
        if self.head_capacity == 0 || self.head_capacity >= NONE as usize {
            return Err(Error::BadShape(
                "retention: head_capacity must be in 1..u32::MAX",
            ));
        }
        if let Some(b) = self.head_budget {
            if b == 0 || b > self.head_capacity {
                return Err(Error::BadArgument(
                    "retention: head_budget must be in 1..=head_capacity",
                ));
            }
        }
        if self.window == 0 {
            return Err(Error::BadArgument(
                "retention: window must be >= 1 (the new token is always kept)",
            ));
        }
        let protected = self
            .sinks
            .checked_add(self.window)
            .ok_or(Error::BadArgument("retention: sinks + window overflows"))?;
        if protected > self.head_limit() {
            return Err(Error::BadArgument(
                "retention: sinks + window must be <= the head budget",
            ));
        }
        if let Some(lb) = self.layer_budget {
            let need = protected.checked_mul(self.heads).ok_or(Error::BadArgument(
                "retention: heads * (sinks + window) overflows",
            ))?;
            if need > lb {
                return Err(Error::BadArgument(
                    "retention: layer_budget must be >= heads * (sinks + window)",
                ));
            }
        }
        if let Some(l) = self.ln_eps {
            check_ln_eps(l)?;
        }
        self.slots_needed()?;
        Ok(())
    }
}

/// Evictions made by one [`RetentionPolicy::append`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepReport {
    /// Certified evictions over all heads.
    pub certified: usize,
    /// Forced evictions over all heads.
    pub forced: usize,
}

/// Statistics of one head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadStats {
    /// Live entries (slots `0..live`).
    pub live: usize,
    /// Entries evicted under the certificate.
    pub evicted_certified: u64,
    /// Entries evicted by a budget.
    pub evicted_forced: u64,
    /// `ln B_t` at the head's latest `c_t` (`-inf` when nothing was evicted).
    pub ln_bound: f64,
    /// `B_t`: bound on the attention mass taken by all evicted entries from the latest and
    /// every later query.
    pub bound: f64,
}

/// Statistics of the layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerStats {
    /// Live entries over all heads.
    pub live: usize,
    /// Certified evictions over all heads.
    pub evicted_certified: u64,
    /// Forced evictions over all heads.
    pub evicted_forced: u64,
    /// Largest `ln B_t` over heads.
    pub max_ln_bound: f64,
    /// Largest `B_t` over heads.
    pub max_bound: f64,
}

/// The retention policy of one layer over caller storage `S` (slots) and `H` (head states).
/// See the module documentation.
#[derive(Debug, Clone)]
pub struct RetentionPolicy<S, H> {
    cfg: PolicyConfig,
    limit: usize,
    slots: S,
    heads: H,
    live_total: usize,
    last_position: Option<u64>,
}

/// The entry a forced eviction takes from this head.
#[inline]
fn forced_candidate(r: &[Slot], hs: &HeadState, order: ForcedOrder) -> Option<u32> {
    match order {
        ForcedOrder::WeightBound => oldest_evictable(r, hs),
        ForcedOrder::Scores => (hs.heap_len > 0).then(|| r[0].heap_item),
    }
}

impl<S, H> RetentionPolicy<S, H>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    H: AsRef<[HeadState]> + AsMut<[HeadState]>,
{
    /// A policy with empty caches. `u[h]` is head `h`'s logit bound `U_h` (nats), which
    /// must hold for every future q and k (QK-norm, or declared and checked). `slots` must
    /// hold at least [`PolicyConfig::slots_needed`] rows and `heads` at least `cfg.heads`;
    /// both are reset.
    ///
    /// Errors: those of [`PolicyConfig::validate`]; `u.len() != heads` or storage too small
    /// ([`Error::BadLength`]); a `U` not finite and `>= 0` ([`Error::BadArgument`]).
    pub fn new(cfg: PolicyConfig, u: &[f64], mut slots: S, mut heads: H) -> Result<Self> {
        cfg.validate()?;
        let need = cfg.slots_needed()?;
        if u.len() != cfg.heads {
            return Err(Error::BadLength {
                what: "retention logit bounds u",
                expected: cfg.heads,
                got: u.len(),
            });
        }
        if slots.as_ref().len() < need {
            return Err(Error::BadLength {
                what: "retention slot storage (minimum)",
                expected: need,
                got: slots.as_ref().len(),
            });
        }
        if heads.as_ref().len() < cfg.heads {
            return Err(Error::BadLength {
                what: "retention head storage (minimum)",
                expected: cfg.heads,
                got: heads.as_ref().len(),
            });
        }
        for &uh in u {
            check_u(uh)?;
        }
        for x in &mut slots.as_mut()[..need] {
            *x = Slot::EMPTY;
        }
        for (hs, &uh) in heads.as_mut()[..cfg.heads].iter_mut().zip(u) {
            *hs = HeadState {
                cert: Certificate::new(uh)?,
                ..HeadState::EMPTY
            };
        }
        Ok(Self {
            limit: cfg.head_limit(),
            cfg,
            slots,
            heads,
            live_total: 0,
            last_position: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Gives the storage back.
    pub fn into_storage(self) -> (S, H) {
        (self.slots, self.heads)
    }

    fn check_head(&self, h: usize) -> Result<()> {
        if h >= self.cfg.heads {
            return Err(Error::BadArgument("retention: head index out of range"));
        }
        Ok(())
    }

    /// Head `h`'s rows and state.
    fn head_mut(&mut self, h: usize) -> (&mut [Slot], &mut HeadState) {
        let cap = self.cfg.head_capacity;
        (
            &mut self.slots.as_mut()[h * cap..(h + 1) * cap],
            &mut self.heads.as_mut()[h],
        )
    }

    fn head_ref(&self, h: usize) -> (&[Slot], &HeadState) {
        let cap = self.cfg.head_capacity;
        (
            &self.slots.as_ref()[h * cap..(h + 1) * cap],
            &self.heads.as_ref()[h],
        )
    }

    /// Appends token `position` to every head, after evicting what the certificate allows
    /// and what the budgets require (module docs, steps 1-2). `c[h]` is the token's
    /// cumulative log gate in head `h` (relative to that head's origin, `<=` the previous
    /// token's). `scores[h]` is its retention score, required with [`ForcedOrder::Scores`]
    /// and refused otherwise. Each eviction is passed to `on_evict` in order (apply moves
    /// in that order); afterwards the new token of head `h` is at slot `live_h - 1`.
    ///
    /// Errors (nothing changes): `position` not above the previous one, `c` or `scores`
    /// of the wrong length ([`Error::BadLength`]), `c[h]` not finite or above the head's
    /// previous `c`, a NaN score, scores given or missing against the order
    /// ([`Error::BadArgument`]).
    pub fn append<F: FnMut(Eviction)>(
        &mut self,
        position: u64,
        c: &[f64],
        scores: Option<&[f32]>,
        mut on_evict: F,
    ) -> Result<StepReport> {
        let nh = self.cfg.heads;
        if self.last_position.is_some_and(|p| position <= p) {
            return Err(Error::BadArgument(
                "retention: positions must strictly increase (no re-entry)",
            ));
        }
        if c.len() != nh {
            return Err(Error::BadLength {
                what: "retention append c",
                expected: nh,
                got: c.len(),
            });
        }
        match (self.cfg.order, scores) {
            (ForcedOrder::Scores, None) => {
                return Err(Error::BadArgument(
                    "retention: scores are required with ForcedOrder::Scores",
                ));
            }
            (ForcedOrder::WeightBound, Some(_)) => {
                return Err(Error::BadArgument(
                    "retention: scores given but the order is WeightBound",
                ));
            }
            (_, Some(sc)) => {
                if sc.len() != nh {
                    return Err(Error::BadLength {
                        what: "retention append scores",
                        expected: nh,
                        got: sc.len(),
                    });
                }
                if sc.iter().any(|x| x.is_nan()) {
                    return Err(Error::BadArgument("retention: a score is NaN"));
                }
            }
            (_, None) => {}
        }
        for (h, &ch) in c.iter().enumerate() {
            let hs = &self.heads.as_ref()[h];
            if !ch.is_finite() {
                return Err(Error::BadArgument("retention: c must be finite"));
            }
            if hs.pushed > 0 && ch > hs.c_t {
                return Err(Error::BadArgument(
                    "retention: c must be non-increasing along the stream",
                ));
            }
        }

        let mut report = StepReport::default();
        let (window, sinks, order) = (
            self.cfg.window as u64,
            self.cfg.sinks as u64,
            self.cfg.order,
        );

        // The token appended `window` steps ago leaves the window; then certified and
        // head-budget evictions.
        for (h, &c_t) in c.iter().enumerate() {
            let limit = self.limit;
            let ln_eps = self.cfg.ln_eps;
            let (r, hs) = self.head_mut(h);
            if hs.pushed >= window && hs.pushed - window >= sinks {
                let s = hs.first_protected;
                if s == NONE {
                    return Err(Error::BadArgument("retention: internal window state lost"));
                }
                r[s as usize].zone = Zone::Evictable;
                hs.first_protected = r[s as usize].next;
                hs.protected -= 1;
                if order == ForcedOrder::Scores {
                    heap_push(r, hs, s);
                }
            }
            if let Some(ln_eps) = ln_eps {
                while let Some(s) = oldest_evictable(r, hs) {
                    if !hs.cert.allows(c_t, r[s as usize].c, ln_eps) {
                        break;
                    }
                    on_evict(evict(r, hs, h, s, EvictionKind::Certified));
                    report.certified += 1;
                }
            }
            while hs.live as usize + 1 > limit {
                let Some(s) = forced_candidate(r, hs, order) else {
                    return Err(Error::Capacity {
                        what: "retention head budget (all entries protected)",
                        capacity: limit,
                    });
                };
                on_evict(evict(r, hs, h, s, EvictionKind::Forced));
                report.forced += 1;
            }
        }
        self.live_total -= report.certified + report.forced;

        // Layer budget: forced evictions across heads.
        if let Some(lb) = self.cfg.layer_budget {
            while self.live_total + nh > lb {
                let mut best: Option<(usize, u32, f64, u64)> = None;
                for (h, &c_t) in c.iter().enumerate() {
                    let (r, hs) = self.head_ref(h);
                    if let Some(s) = forced_candidate(r, hs, order) {
                        let e = &r[s as usize];
                        let key = match order {
                            ForcedOrder::WeightBound => 2.0 * hs.cert.u() + c_t - e.c,
                            ForcedOrder::Scores => f64::from(e.score),
                        };
                        let better = match best {
                            None => true,
                            Some((_, _, k, p)) => key < k || (key == k && e.position < p),
                        };
                        if better {
                            best = Some((h, s, key, e.position));
                        }
                    }
                }
                let Some((h, s, _, _)) = best else {
                    return Err(Error::Capacity {
                        what: "retention layer budget (all entries protected)",
                        capacity: lb,
                    });
                };
                let (r, hs) = self.head_mut(h);
                on_evict(evict(r, hs, h, s, EvictionKind::Forced));
                report.forced += 1;
                self.live_total -= 1;
            }
        }

        // Store the new token in every head.
        for (h, &c_t) in c.iter().enumerate() {
            let score = scores.map_or(0.0, |sc| sc[h]);
            let (r, hs) = self.head_mut(h);
            let s = hs.live;
            let sink = hs.pushed < sinks;
            r[s as usize] = Slot {
                position,
                c: c_t,
                score,
                prev: NONE,
                next: NONE,
                heap_pos: NONE,
                zone: if sink { Zone::Sink } else { Zone::Protected },
                heap_item: r[s as usize].heap_item,
            };
            if sink {
                hs.sinks_live += 1;
            } else {
                list_push_back(r, hs, s);
                hs.protected += 1;
                if hs.first_protected == NONE {
                    hs.first_protected = s;
                }
            }
            hs.live += 1;
            hs.pushed += 1;
            hs.c_t = c_t;
        }
        self.live_total += nh;
        self.last_position = Some(position);
        Ok(report)
    }

    /// Live entries of head `h`, by slot (`0..live`). The kernels read `position()` and
    /// `c()` of each slot.
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn slots(&self, h: usize) -> Result<&[Slot]> {
        self.check_head(h)?;
        let (r, hs) = self.head_ref(h);
        Ok(&r[..hs.live as usize])
    }

    /// Copies `c_j` of head `h`'s live slots into `out[..live]` (slot order), for a decode
    /// kernel that adds `D = c_t - c_j`. Returns `live`.
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]); `out.len() < live`
    /// ([`Error::BadLength`]).
    pub fn copy_c(&self, h: usize, out: &mut [f64]) -> Result<usize> {
        let live = self.slots(h)?;
        if out.len() < live.len() {
            return Err(Error::BadLength {
                what: "retention copy_c out (minimum)",
                expected: live.len(),
                got: out.len(),
            });
        }
        for (o, s) in out.iter_mut().zip(live) {
            *o = s.c;
        }
        Ok(live.len())
    }

    /// Head `h`'s latest `c_t` (relative to its origin; 0 before the first append).
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn latest_c(&self, h: usize) -> Result<f64> {
        self.check_head(h)?;
        Ok(self.heads.as_ref()[h].c_t)
    }

    /// Slots of head `h` in age order, oldest first (sinks, then the others).
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn age_order(&self, h: usize) -> Result<AgeOrder<'_>> {
        self.check_head(h)?;
        let (r, hs) = self.head_ref(h);
        Ok(AgeOrder {
            rows: r,
            sink_next: 0,
            sinks: hs.sinks_live,
            node: hs.oldest,
        })
    }

    /// How many of head `h`'s oldest evictable entries the certificate would still allow
    /// evicting at the head's latest `c_t` with this `ln_eps` (protected entries and sinks
    /// excluded).
    ///
    /// Errors: `h >= heads`, `ln_eps` NaN or `> 0` ([`Error::BadArgument`]).
    pub fn certified_evictable(&self, h: usize, ln_eps: f64) -> Result<usize> {
        self.check_head(h)?;
        let (r, hs) = self.head_ref(h);
        let it = AgeOrder {
            rows: r,
            sink_next: 0,
            sinks: 0,
            node: hs.oldest,
        }
        .take_while(|&s| r[s as usize].zone == Zone::Evictable)
        .map(|s| r[s as usize].c);
        hs.cert.allowed_evictions(hs.c_t, it, ln_eps)
    }

    /// The entries that the next [`Self::append`] evicts from head `h`, in eviction order,
    /// decided before the new token's `c_t` is known (a device can then apply the
    /// evictions in the same pass that computes `c_t`). `out[i]` gets the `i`-th candidate's
    /// slot now and the largest `c_t` at which it goes: `+inf` where the head budget forces
    /// it, else the certificate's `ln_eps - 2U - logsumexp(-c_j over it and every entry
    /// evicted before it)` (`-inf` without certified eviction). The thresholds do not
    /// increase, so the step evicts exactly the candidates with `c_t <= threshold`: a
    /// prefix, when it evicts no more than `out.len()` (the comparison may differ from
    /// `append`'s in the last bit of f64 rounding: callers check `append`'s evictions).
    ///
    /// Returns how many candidates were written (the oldest evictable entries, with the one
    /// leaving the window at this step), or `None` where the step's evictions are not such a
    /// prefix: a forced eviction under [`ForcedOrder::Scores`] or by the layer budget, or
    /// more forced evictions than evictable entries (`append` then fails).
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn next_evictions(&self, h: usize, out: &mut [Candidate]) -> Result<Option<usize>> {
        self.check_head(h)?;
        let (r, hs) = self.head_ref(h);
        let nh = self.cfg.heads;
        if self
            .cfg
            .layer_budget
            .is_some_and(|lb| self.live_total + nh > lb)
        {
            return Ok(None);
        }
        let forced = (hs.live as usize + 1).saturating_sub(self.limit);
        if forced > 0 && self.cfg.order == ForcedOrder::Scores {
            return Ok(None);
        }
        let window = self.cfg.window as u64;
        let slides = hs.pushed >= window && hs.pushed - window >= self.cfg.sinks as u64;
        let mut lse = hs.cert.log_sum_exp_neg_c();
        let mut node = hs.oldest;
        let mut n = 0;
        while node != NONE && n < out.len() {
            let e = &r[node as usize];
            let evictable = e.zone == Zone::Evictable || (slides && node == hs.first_protected);
            if !evictable {
                break;
            }
            lse = crate::eviction::log_add_exp(lse, -e.c);
            let at = if n < forced {
                f64::INFINITY
            } else {
                match self.cfg.ln_eps {
                    Some(ln_eps) => ln_eps - (2.0 * hs.cert.u() + lse),
                    None => f64::NEG_INFINITY,
                }
            };
            if at == f64::NEG_INFINITY {
                break;
            }
            out[n] = Candidate {
                slot: node,
                evict_at_or_below: at,
            };
            n += 1;
            node = e.next;
        }
        if n < forced {
            return Ok(None);
        }
        Ok(Some(n))
    }

    /// Moves head `h`'s gate origin by `shift`: every stored `c_j` and the latest `c_t`
    /// become `c - shift`, and the certificate follows, so every `D` and `B_t` is
    /// unchanged. Call it with the same `shift` as [`crate::gate::GateStream::rebase`].
    ///
    /// Errors: `h >= heads`, `shift` not finite ([`Error::BadArgument`]).
    pub fn rebase(&mut self, h: usize, shift: f64) -> Result<()> {
        self.check_head(h)?;
        if !shift.is_finite() {
            return Err(Error::BadArgument("retention rebase: shift must be finite"));
        }
        let (r, hs) = self.head_mut(h);
        for s in &mut r[..hs.live as usize] {
            s.c -= shift;
        }
        hs.c_t -= shift;
        hs.cert.rebase(shift);
        Ok(())
    }

    /// Statistics of head `h`.
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn head_stats(&self, h: usize) -> Result<HeadStats> {
        self.check_head(h)?;
        let hs = &self.heads.as_ref()[h];
        let ln_bound = hs.cert.ln_bound(hs.c_t);
        Ok(HeadStats {
            live: hs.live as usize,
            evicted_certified: hs.evicted_certified,
            evicted_forced: hs.evicted_forced,
            ln_bound,
            bound: libm::exp(ln_bound),
        })
    }

    /// Statistics of the layer (sums, and the maximum bound over heads).
    pub fn layer_stats(&self) -> LayerStats {
        let mut st = LayerStats {
            live: self.live_total,
            evicted_certified: 0,
            evicted_forced: 0,
            max_ln_bound: f64::NEG_INFINITY,
            max_bound: 0.0,
        };
        for hs in &self.heads.as_ref()[..self.cfg.heads] {
            st.evicted_certified += hs.evicted_certified;
            st.evicted_forced += hs.evicted_forced;
            st.max_ln_bound = st.max_ln_bound.max(hs.cert.ln_bound(hs.c_t));
        }
        st.max_bound = libm::exp(st.max_ln_bound);
        st
    }

    /// Live entries over all heads.
    pub fn live_total(&self) -> usize {
        self.live_total
    }

    /// Tokens appended so far (the same for every head).
    pub fn appended(&self) -> u64 {
        self.heads.as_ref()[0].pushed
    }
}

/// A policy owning fixed-capacity `heapless` storage (`SLOTS` slot rows, `HEADS` heads):
/// for no_std users whose sizes are known at compile time. The storage lives inline.
pub type FixedPolicy<const SLOTS: usize, const HEADS: usize> =
    RetentionPolicy<heapless::Vec<Slot, SLOTS>, heapless::Vec<HeadState, HEADS>>;

impl<const SLOTS: usize, const HEADS: usize> FixedPolicy<SLOTS, HEADS> {
    /// [`RetentionPolicy::new`] with owned `heapless` storage sized from `cfg`.
    ///
    /// Errors: those of [`RetentionPolicy::new`]; [`Error::Capacity`] when `cfg` needs
    /// more than `SLOTS` slots or `HEADS` heads.
    pub fn new_fixed(cfg: PolicyConfig, u: &[f64]) -> Result<Self> {
        cfg.validate()?;
        let mut slots = heapless::Vec::new();
        slots
            .resize(cfg.slots_needed()?, Slot::EMPTY)
            .map_err(|_| Error::Capacity {
                what: "FixedPolicy slot storage",
                capacity: SLOTS,
            })?;
        let mut heads = heapless::Vec::new();
        heads
            .resize(cfg.heads, HeadState::EMPTY)
            .map_err(|_| Error::Capacity {
                what: "FixedPolicy head storage",
                capacity: HEADS,
            })?;
        Self::new(cfg, u, slots, heads)
    }
}

/// One entry that the next append may evict ([`RetentionPolicy::next_evictions`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Candidate {
    /// Its slot now.
    pub slot: u32,
    /// The largest new-token `c_t` at which it is evicted (`+inf`: forced by the budget).
    pub evict_at_or_below: f64,
}

/// Iterator over one head's slots, oldest first ([`RetentionPolicy::age_order`]).
#[derive(Debug, Clone)]
pub struct AgeOrder<'a> {
    rows: &'a [Slot],
    sink_next: u32,
    sinks: u32,
    node: u32,
}

impl Iterator for AgeOrder<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.sink_next < self.sinks {
            self.sink_next += 1;
            return Some(self.sink_next - 1);
        }
        if self.node == NONE {
            return None;
        }
        let s = self.node;
        self.node = self.rows.get(s as usize).map_or(NONE, |x| x.next);
        Some(s)
    }
}
