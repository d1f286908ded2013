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

const NONE: u32 = u32::MAX;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Zone {
    Free,
    Sink,
    Evictable,
    Protected,
}

/// One row of the slot storage: a cache entry (when live) and one element of the head's
/// score heap. Read it through the accessors; only the policy writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    position: u64,
    c: f64,
    score: f32,
    prev: u32,
    next: u32,
    heap_pos: u32,
    zone: Zone,
    /// Element `i` of the head's heap array lives in row `i`; it is not part of the entry
    /// and does not move with it.
    heap_item: u32,
}

impl Slot {
    /// An unused row (initial contents of caller storage).
    pub const EMPTY: Slot = Slot {
        position: 0,
        c: 0.0,
        score: 0.0,
        prev: NONE,
        next: NONE,
        heap_pos: NONE,
        zone: Zone::Free,
        heap_item: NONE,
    };

    /// Stream position (token index) of the entry.
    #[inline]
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Cumulative log gate `c_j` of the entry, relative to the head's gate origin.
    #[inline]
    pub fn c(&self) -> f64 {
        self.c
    }

    /// Caller score (0 when the order is [`ForcedOrder::WeightBound`]).
    #[inline]
    pub fn score(&self) -> f32 {
        self.score
    }

    /// True for a sink (never evicted).
    #[inline]
    pub fn is_sink(&self) -> bool {
        self.zone == Zone::Sink
    }

    /// True inside the protected window (not evictable now).
    #[inline]
    pub fn is_protected(&self) -> bool {
        self.zone == Zone::Protected
    }
}

impl Default for Slot {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// Per-head state of a [`RetentionPolicy`] (caller storage, one per head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadState {
    cert: Certificate,
    live: u32,
    sinks_live: u32,
    /// Age list of non-sink entries: evictable ones, then protected ones.
    oldest: u32,
    newest: u32,
    first_protected: u32,
    protected: u32,
    heap_len: u32,
    pushed: u64,
    c_t: f64,
    evicted_certified: u64,
    evicted_forced: u64,
}

impl HeadState {
    /// Initial contents of caller storage ([`RetentionPolicy::new`] resets it anyway).
    pub const EMPTY: HeadState = HeadState {
        cert: Certificate::empty(),
        live: 0,
        sinks_live: 0,
        oldest: NONE,
        newest: NONE,
        first_protected: NONE,
        protected: 0,
        heap_len: 0,
        pushed: 0,
        c_t: 0.0,
        evicted_certified: 0,
        evicted_forced: 0,
    };
}

impl Default for HeadState {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// Why an entry left the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionKind {
    /// Allowed by the certificate (`B_t <= eps` afterwards).
    Certified,
    /// Required by a budget.
    Forced,
}

/// One eviction, reported in order by [`RetentionPolicy::append`]. Apply them in the order
/// received: the entry of `head` at `slot` is gone; if `moved_from` is `Some(m)`, copy the
/// tensor row of slot `m` into `slot` (`m` was the last live slot; it is now free).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Eviction {
    /// Head index.
    pub head: usize,
    /// Stream position of the evicted token.
    pub position: u64,
    /// Slot that was freed (and refilled by the move, if any).
    pub slot: u32,
    /// Last live slot moved into `slot` (swap-delete); `None` when `slot` was the last.
    pub moved_from: Option<u32>,
    /// Certified or forced.
    pub kind: EvictionKind,
}

impl Eviction {
    /// The row copy to perform, as `(from_slot, to_slot)`.
    #[inline]
    pub fn moved(&self) -> Option<(u32, u32)> {
        self.moved_from.map(|from| (from, self.slot))
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
#[derive(Debug)]
pub struct RetentionPolicy<S, H> {
    cfg: PolicyConfig,
    limit: usize,
    slots: S,
    heads: H,
    live_total: usize,
    last_position: Option<u64>,
}

// ---- per-head primitives over one head's rows `r` -------------------------------------

fn list_push_back(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    r[s as usize].prev = hs.newest;
    r[s as usize].next = NONE;
    if hs.newest == NONE {
        hs.oldest = s;
    } else {
        r[hs.newest as usize].next = s;
    }
    hs.newest = s;
}

fn list_unlink(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    let (p, n) = (r[s as usize].prev, r[s as usize].next);
    if p == NONE {
        hs.oldest = n;
    } else {
        r[p as usize].next = n;
    }
    if n == NONE {
        hs.newest = p;
    } else {
        r[n as usize].prev = p;
    }
    if hs.first_protected == s {
        hs.first_protected = n;
    }
    r[s as usize].prev = NONE;
    r[s as usize].next = NONE;
}

/// Heap order: lower score first, then older position.
#[inline]
fn heap_less(r: &[Slot], a: u32, b: u32) -> bool {
    let (x, y) = (&r[a as usize], &r[b as usize]);
    x.score < y.score || (x.score == y.score && x.position < y.position)
}

fn heap_set(r: &mut [Slot], i: u32, s: u32) {
    r[i as usize].heap_item = s;
    r[s as usize].heap_pos = i;
}

fn heap_sift_up(r: &mut [Slot], mut i: u32) {
    let s = r[i as usize].heap_item;
    while i > 0 {
        let p = (i - 1) / 2;
        let ps = r[p as usize].heap_item;
        if !heap_less(r, s, ps) {
            break;
        }
        heap_set(r, i, ps);
        i = p;
    }
    heap_set(r, i, s);
}

fn heap_sift_down(r: &mut [Slot], len: u32, mut i: u32) {
    let s = r[i as usize].heap_item;
    loop {
        let l = 2 * i as u64 + 1;
        if l >= len as u64 {
            break;
        }
        let l = l as u32;
        let mut m = l;
        if l + 1 < len && heap_less(r, r[(l + 1) as usize].heap_item, r[l as usize].heap_item) {
            m = l + 1;
        }
        let ms = r[m as usize].heap_item;
        if !heap_less(r, ms, s) {
            break;
        }
        heap_set(r, i, ms);
        i = m;
    }
    heap_set(r, i, s);
}

fn heap_push(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    let i = hs.heap_len;
    hs.heap_len += 1;
    heap_set(r, i, s);
    heap_sift_up(r, i);
}

fn heap_remove(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    let i = r[s as usize].heap_pos;
    if i == NONE {
        return;
    }
    hs.heap_len -= 1;
    let last = hs.heap_len;
    r[s as usize].heap_pos = NONE;
    if i != last {
        let moved = r[last as usize].heap_item;
        heap_set(r, i, moved);
        heap_sift_down(r, hs.heap_len, i);
        heap_sift_up(r, r[moved as usize].heap_pos);
    }
    r[last as usize].heap_item = NONE;
}

/// Oldest evictable entry of the head.
#[inline]
fn oldest_evictable(r: &[Slot], hs: &HeadState) -> Option<u32> {
    (hs.oldest != NONE && r[hs.oldest as usize].zone == Zone::Evictable).then_some(hs.oldest)
}

/// The entry a forced eviction takes from this head.
#[inline]
fn forced_candidate(r: &[Slot], hs: &HeadState, order: ForcedOrder) -> Option<u32> {
    match order {
        ForcedOrder::WeightBound => oldest_evictable(r, hs),
        ForcedOrder::Scores => (hs.heap_len > 0).then(|| r[0].heap_item),
    }
}

/// Removes the evictable entry `s` (swap-delete) and records it in the certificate.
fn evict(r: &mut [Slot], hs: &mut HeadState, head: usize, s: u32, kind: EvictionKind) -> Eviction {
    let e = r[s as usize];
    // `c` is finite (checked on append and rebase), so recording cannot fail.
    let _ = hs.cert.record(e.c);
    match kind {
        EvictionKind::Certified => hs.evicted_certified += 1,
        EvictionKind::Forced => hs.evicted_forced += 1,
    }
    list_unlink(r, hs, s);
    heap_remove(r, hs, s);
    let last = hs.live - 1;
    let mut moved_from = None;
    if s != last {
        let m = r[last as usize];
        let keep_heap_item = r[s as usize].heap_item;
        r[s as usize] = Slot {
            heap_item: keep_heap_item,
            ..m
        };
        if m.prev == NONE {
            if hs.oldest == last {
                hs.oldest = s;
            }
        } else {
            r[m.prev as usize].next = s;
        }
        if m.next == NONE {
            if hs.newest == last {
                hs.newest = s;
            }
        } else {
            r[m.next as usize].prev = s;
        }
        if hs.first_protected == last {
            hs.first_protected = s;
        }
        if m.heap_pos != NONE {
            r[m.heap_pos as usize].heap_item = s;
        }
        moved_from = Some(last);
    }
    let keep_heap_item = r[last as usize].heap_item;
    r[last as usize] = Slot {
        heap_item: keep_heap_item,
        ..Slot::EMPTY
    };
    hs.live -= 1;
    Eviction {
        head,
        position: e.position,
        slot: s,
        moved_from,
        kind,
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

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;
    use std::vec;
    use std::vec::Vec;

    type VecPolicy = RetentionPolicy<Vec<Slot>, Vec<HeadState>>;

    fn policy(cfg: PolicyConfig, u: &[f64]) -> VecPolicy {
        let n = cfg.slots_needed().unwrap();
        RetentionPolicy::new(
            cfg,
            u,
            vec![Slot::EMPTY; n],
            vec![HeadState::EMPTY; cfg.heads],
        )
        .unwrap()
    }

    /// Every structural invariant of the policy.
    fn check_invariants(p: &VecPolicy) {
        let cfg = p.cfg;
        let mut total = 0;
        for h in 0..cfg.heads {
            let (r, hs) = p.head_ref(h);
            let live = hs.live as usize;
            total += live;
            assert!(live <= p.limit);
            for (i, s) in r.iter().enumerate() {
                assert_eq!(s.zone == Zone::Free, i >= live, "head {h} slot {i}");
            }
            for s in &r[..hs.sinks_live as usize] {
                assert!(s.is_sink());
            }
            // age list: all non-sinks once, positions increasing, evictable then protected
            let mut seen = 0;
            let mut node = hs.oldest;
            let mut prev = NONE;
            let mut last_pos = None;
            let mut protected = 0;
            let mut in_protected = false;
            let mut evictable = BTreeSet::new();
            while node != NONE {
                let s = &r[node as usize];
                assert_eq!(s.prev, prev);
                assert!(last_pos.is_none_or(|lp| s.position > lp));
                last_pos = Some(s.position);
                match s.zone {
                    Zone::Evictable => {
                        assert!(!in_protected);
                        evictable.insert(node);
                    }
                    Zone::Protected => {
                        if !in_protected {
                            assert_eq!(hs.first_protected, node);
                        }
                        in_protected = true;
                        protected += 1;
                    }
                    z => panic!("zone {z:?} in the age list"),
                }
                seen += 1;
                prev = node;
                node = s.next;
            }
            assert_eq!(hs.newest, prev);
            assert_eq!(seen + hs.sinks_live as usize, live);
            assert_eq!(protected, hs.protected);
            if protected == 0 {
                assert_eq!(hs.first_protected, NONE);
            }
            // heap: exactly the evictable entries (Scores order), heap-ordered
            let hl = hs.heap_len as usize;
            if cfg.order == ForcedOrder::Scores {
                let items: BTreeSet<u32> = r[..hl].iter().map(|s| s.heap_item).collect();
                assert_eq!(items, evictable);
                for i in 0..hl {
                    assert_eq!(r[r[i].heap_item as usize].heap_pos as usize, i);
                    if i > 0 {
                        assert!(!heap_less(r, r[i].heap_item, r[(i - 1) / 2].heap_item));
                    }
                }
            } else {
                assert_eq!(hl, 0);
            }
        }
        assert_eq!(total, p.live_total);
        if let Some(lb) = cfg.layer_budget {
            assert!(total <= lb);
        }
    }

    #[test]
    fn config_and_constructor_errors() {
        let ok = PolicyConfig::new(2, 4);
        assert!(ok.validate().is_ok());
        let bad = [
            PolicyConfig { heads: 0, ..ok },
            PolicyConfig {
                head_capacity: 0,
                ..ok
            },
            PolicyConfig {
                head_capacity: u32::MAX as usize,
                ..ok
            },
            PolicyConfig {
                head_budget: Some(0),
                ..ok
            },
            PolicyConfig {
                head_budget: Some(5),
                ..ok
            },
            PolicyConfig { window: 0, ..ok },
            PolicyConfig {
                window: 3,
                sinks: 2,
                ..ok
            },
            PolicyConfig {
                window: 3,
                head_budget: Some(2),
                ..ok
            },
            PolicyConfig {
                window: 2,
                layer_budget: Some(3),
                ..ok
            },
            PolicyConfig {
                sinks: usize::MAX,
                ..ok
            },
            PolicyConfig {
                ln_eps: Some(1.0),
                ..ok
            },
            PolicyConfig {
                ln_eps: Some(f64::NAN),
                ..ok
            },
            PolicyConfig {
                heads: usize::MAX,
                head_capacity: 3,
                ..ok
            },
        ];
        for cfg in bad {
            assert!(cfg.validate().is_err(), "{cfg:?}");
            assert!(
                RetentionPolicy::new(
                    cfg,
                    &[1.0, 1.0],
                    vec![Slot::EMPTY; 8],
                    vec![HeadState::EMPTY; 2]
                )
                .is_err()
            );
        }
        let mk = |u: &[f64], ns: usize, nh: usize| {
            RetentionPolicy::new(ok, u, vec![Slot::EMPTY; ns], vec![HeadState::EMPTY; nh]).err()
        };
        assert!(matches!(mk(&[1.0], 8, 2), Some(Error::BadLength { .. })));
        assert!(matches!(
            mk(&[1.0, 1.0], 7, 2),
            Some(Error::BadLength { .. })
        ));
        assert!(matches!(
            mk(&[1.0, 1.0], 8, 1),
            Some(Error::BadLength { .. })
        ));
        assert!(matches!(
            mk(&[1.0, -1.0], 8, 2),
            Some(Error::BadArgument(_))
        ));
        assert!(matches!(
            mk(&[f64::NAN, 1.0], 8, 2),
            Some(Error::BadArgument(_))
        ));
        assert!(mk(&[1.0, 1.0], 8, 2).is_none());
    }

    #[test]
    fn append_and_query_errors_change_nothing() {
        let mut p = policy(PolicyConfig::new(2, 4), &[1.0, 1.0]);
        let no = |_: Eviction| {};
        p.append(5, &[-1.0, -1.0], None, no).unwrap();
        let before = (p.slots(0).unwrap().to_vec(), p.heads.clone(), p.live_total);
        assert!(p.append(5, &[-2.0, -2.0], None, no).is_err()); // no re-entry / repeat
        assert!(p.append(4, &[-2.0, -2.0], None, no).is_err());
        assert!(matches!(
            p.append(6, &[-2.0], None, no),
            Err(Error::BadLength { .. })
        ));
        assert!(p.append(6, &[-2.0, f64::NAN], None, no).is_err());
        assert!(p.append(6, &[-2.0, f64::NEG_INFINITY], None, no).is_err());
        assert!(p.append(6, &[-2.0, -0.5], None, no).is_err()); // c increased
        assert!(p.append(6, &[-2.0, -2.0], Some(&[0.0, 0.0]), no).is_err()); // scores in WB mode
        assert_eq!(
            before,
            (p.slots(0).unwrap().to_vec(), p.heads.clone(), p.live_total)
        );
        assert!(p.slots(2).is_err());
        assert!(p.age_order(2).is_err());
        assert!(p.head_stats(2).is_err());
        assert!(p.rebase(2, 1.0).is_err());
        assert!(p.rebase(0, f64::NAN).is_err());
        assert!(p.certified_evictable(2, -1.0).is_err());
        assert!(p.certified_evictable(0, 1.0).is_err());

        let cfg = PolicyConfig {
            order: ForcedOrder::Scores,
            ..PolicyConfig::new(2, 4)
        };
        let mut q = policy(cfg, &[1.0, 1.0]);
        assert!(q.append(0, &[0.0, 0.0], None, no).is_err());
        assert!(matches!(
            q.append(0, &[0.0, 0.0], Some(&[1.0]), no),
            Err(Error::BadLength { .. })
        ));
        assert!(
            q.append(0, &[0.0, 0.0], Some(&[1.0, f32::NAN]), no)
                .is_err()
        );
        assert_eq!(q.live_total(), 0);
        q.append(0, &[0.0, 0.0], Some(&[1.0, f32::INFINITY]), no)
            .unwrap();
        assert_eq!(q.appended(), 1);
    }

    #[test]
    fn certified_eviction_rebase_and_age_order() {
        // one head, U = 0.5, window 2, one sink, huge capacity: only certified evictions
        let cfg = PolicyConfig {
            window: 2,
            sinks: 1,
            ln_eps: Some(-5.0),
            ..PolicyConfig::new(1, 64)
        };
        let mut p = policy(cfg, &[0.5]);
        let mut evs = Vec::new();
        let mut c = 0.0;
        for t in 0..6u64 {
            c -= 2.0;
            p.append(t, &[c], None, |e| evs.push(e)).unwrap();
            check_invariants(&p);
        }
        // c_t - c_j <= -6 is needed (1 + c_t - c_j <= -5): 3 steps of -2 apart.
        assert!(!evs.is_empty() && evs.iter().all(|e| e.kind == EvictionKind::Certified));
        let st = p.head_stats(0).unwrap();
        assert!(st.ln_bound <= -5.0 && st.evicted_forced == 0);
        let ages: Vec<u64> = p
            .age_order(0)
            .unwrap()
            .map(|s| p.slots(0).unwrap()[s as usize].position())
            .collect();
        assert_eq!(ages[0], 0); // the sink
        assert!(ages.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(ages[ages.len() - 2..], [4, 5]); // the window
        // rebase leaves differences and the bound unchanged
        let lnb = st.ln_bound;
        let d: Vec<f64> = p.slots(0).unwrap().iter().map(|s| c - s.c()).collect();
        p.rebase(0, c).unwrap();
        assert!((p.head_stats(0).unwrap().ln_bound - lnb).abs() < 1e-12);
        let d2: Vec<f64> = p.slots(0).unwrap().iter().map(|s| 0.0 - s.c()).collect();
        assert_eq!(d, d2);
        assert_eq!(p.certified_evictable(0, -5.0).unwrap(), 0);
        assert!(p.certified_evictable(0, 0.0).unwrap() <= ages.len() - 3);
        let ls = p.layer_stats();
        assert_eq!(
            (ls.live, ls.evicted_certified),
            (ages.len(), st.evicted_certified)
        );
    }

    #[test]
    fn forced_order_across_heads() {
        let base = PolicyConfig {
            ln_eps: None,
            layer_budget: Some(4),
            ..PolicyConfig::new(2, 8)
        };
        // weight bound: head 1 has the larger U, so head 0 pays
        let mut p = policy(base, &[0.0, 3.0]);
        let mut evs = Vec::new();
        for t in 0..3u64 {
            let c = -(t as f64) - 1.0;
            p.append(t, &[c, c], None, |e| evs.push(e)).unwrap();
        }
        let got: Vec<(usize, u64)> = evs.iter().map(|e| (e.head, e.position)).collect();
        assert_eq!(got, [(0, 0), (0, 1)]);
        assert!(evs.iter().all(|e| e.kind == EvictionKind::Forced));
        assert_eq!(evs[0].moved(), Some((1, 0))); // slot 0 refilled from the last slot
        assert_eq!(p.head_stats(1).unwrap().live, 3);
        assert_eq!(p.layer_stats().evicted_forced, 2);
        // scores: the lowest score goes first, whichever head holds it
        let cfg = PolicyConfig {
            order: ForcedOrder::Scores,
            ..base
        };
        let mut q = policy(cfg, &[0.0, 3.0]);
        let mut evs = Vec::new();
        for (t, sc) in [[5.0f32, 1.0], [4.0, 2.0], [0.0, 0.0]].iter().enumerate() {
            q.append(t as u64, &[0.0, 0.0], Some(sc), |e| evs.push(e))
                .unwrap();
        }
        let got: Vec<(usize, u64)> = evs.iter().map(|e| (e.head, e.position)).collect();
        assert_eq!(got, [(1, 0), (1, 1)]);
    }

    #[test]
    fn fixed_heapless_storage_and_copy_c() {
        let cfg = PolicyConfig {
            window: 2,
            ..PolicyConfig::new(2, 3)
        };
        assert!(matches!(
            FixedPolicy::<5, 2>::new_fixed(cfg, &[1.0, 1.0]),
            Err(Error::Capacity { capacity: 5, .. })
        ));
        assert!(matches!(
            FixedPolicy::<6, 1>::new_fixed(cfg, &[1.0, 1.0]),
            Err(Error::Capacity { capacity: 1, .. })
        ));
        let mut p = FixedPolicy::<6, 2>::new_fixed(cfg, &[0.0, 0.0]).unwrap();
        for t in 0..5u64 {
            let c = -(t as f64);
            p.append(t, &[c, 2.0 * c], None, |_| {}).unwrap();
        }
        assert_eq!(p.latest_c(1).unwrap(), -8.0);
        let mut out = [0.0; 3];
        assert!(matches!(
            p.copy_c(0, &mut out[..2]),
            Err(Error::BadLength { .. })
        ));
        assert!(p.copy_c(2, &mut out).is_err());
        assert!(p.latest_c(2).is_err());
        let n = p.copy_c(1, &mut out).unwrap();
        let want: Vec<f64> = p.slots(1).unwrap().iter().map(|s| s.c()).collect();
        assert_eq!(&out[..n], &want[..]);
        let (slots, heads) = p.into_storage();
        assert_eq!((slots.len(), heads.len()), (6, 2));
    }

    #[derive(Debug, Clone)]
    struct Case {
        cfg: PolicyConfig,
        u: Vec<f64>,
        gates: Vec<Vec<f32>>,  // [step][head]
        scores: Vec<Vec<f32>>, // [step][head]
        qk: Vec<f64>,          // random q, k components
        rebase_every: usize,
    }

    const D: usize = 3;

    fn case() -> impl Strategy<Value = Case> {
        (
            1usize..=3,
            1usize..=4,
            0usize..=2,
            1usize..=10,
            any::<bool>(),
            any::<bool>(),
            0u8..=2,
        )
            .prop_flat_map(
                |(heads, window, sinks, extra, scores_mode, certified, budget_kind)| {
                    let head_cap = window + sinks + extra;
                    let steps = 40usize;
                    (
                        Just((
                            heads,
                            window,
                            sinks,
                            head_cap,
                            scores_mode,
                            certified,
                            budget_kind,
                        )),
                        0usize..=extra,
                        0usize..=heads * extra,
                        proptest::collection::vec(0.0f64..=2.0, heads),
                        -8.0f64..=-1.0,
                        proptest::collection::vec(
                            proptest::collection::vec(
                                prop_oneof![-0.01f32..=0.0, -2.0f32..=0.0, -30.0f32..=0.0],
                                heads,
                            ),
                            steps,
                        ),
                        proptest::collection::vec(
                            proptest::collection::vec(-3.0f32..=3.0, heads),
                            steps,
                        ),
                        proptest::collection::vec(-1.0f64..=1.0, 2 * steps * heads * D),
                        0usize..=9,
                    )
                },
            )
            .prop_map(
                |(
                    (heads, window, sinks, cap, scores_mode, certified, bk),
                    hb,
                    lb,
                    u,
                    ln_eps,
                    gates,
                    scores,
                    qk,
                    rebase_every,
                )| {
                    let mut cfg = PolicyConfig::new(heads, cap);
                    cfg.window = window;
                    cfg.sinks = sinks;
                    cfg.ln_eps = certified.then_some(ln_eps);
                    cfg.order = if scores_mode {
                        ForcedOrder::Scores
                    } else {
                        ForcedOrder::WeightBound
                    };
                    if bk == 1 {
                        cfg.head_budget = Some(window + sinks + hb);
                    }
                    if bk == 2 {
                        cfg.layer_budget = Some(heads * (window + sinks) + lb);
                    }
                    Case {
                        cfg,
                        u,
                        gates,
                        scores,
                        qk,
                        rebase_every,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Budgets, protection, dense slots with correct move reports, no re-entry, the
        /// eviction orders, and the certificate against the brute-force evicted mass.
        #[test]
        fn policy_invariants(case in case()) {
            let cfg = case.cfg;
            let nh = cfg.heads;
            let steps = case.gates.len();
            let mut p = policy(cfg, &case.u);
            // mirror of the caller's tensor rows: positions by slot
            let mut rows: Vec<Vec<u64>> = vec![Vec::new(); nh];
            let mut evicted: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); nh];
            let mut c_abs: Vec<Vec<f64>> = vec![Vec::new(); nh]; // [head][t]
            let mut origin = vec![0.0f64; nh];
            let mut any_forced = false;
            // q, k per head and token, |s q.k| <= U_h with s = 1/sqrt(D)
            let scale = 1.0 / libm::sqrt(D as f64);
            let vecs: Vec<Vec<f64>> = case.qk.chunks_exact(D).map(|v| v.to_vec()).collect();
            let qk = |h: usize, t: usize, key: bool| -> Vec<f64> {
                let v = &vecs[(2 * (t * nh + h)) + usize::from(key)];
                let n = libm::sqrt(v.iter().map(|x| x * x).sum::<f64>()).max(1e-12);
                let r = libm::sqrt(case.u[h] / scale);
                v.iter().map(|x| x / n * r).collect()
            };
            for t in 0..steps {
                let pos = 3 * t as u64 + 1; // gaps are allowed
                if case.rebase_every > 0 && t % case.rebase_every == case.rebase_every - 1 {
                    for (h, o) in origin.iter_mut().enumerate() {
                        let shift = p.heads[h].c_t; // new origin at the latest c
                        p.rebase(h, shift).unwrap();
                        *o += shift;
                    }
                }
                let c: Vec<f64> = (0..nh)
                    .map(|h| {
                        let prev = c_abs[h].last().copied().unwrap_or(0.0);
                        let a = prev + f64::from(case.gates[t][h]);
                        c_abs[h].push(a);
                        a - origin[h]
                    })
                    .collect();
                let sc = (cfg.order == ForcedOrder::Scores).then_some(&case.scores[t][..]);
                let live_before: Vec<Vec<u64>> = rows.clone();
                let protected: Vec<u64> = (t.saturating_sub(cfg.window - 1)..t)
                    .chain(0..cfg.sinks.min(t))
                    .map(|i| 3 * i as u64 + 1)
                    .collect();
                let mut events = Vec::new();
                let rep = p.append(pos, &c, sc, |e| events.push(e)).unwrap();
                prop_assert_eq!(rep.certified + rep.forced, events.len());
                for e in &events {
                    let r = &mut rows[e.head];
                    prop_assert_eq!(r[e.slot as usize], e.position);
                    prop_assert!(!protected.contains(&e.position), "evicted a protected token");
                    // order: within the head, the chosen entry is the oldest evictable
                    // (certified, weight bound) or has the lowest score
                    let cand: Vec<u64> = r.iter().copied().filter(|x| !protected.contains(x)).collect();
                    if e.kind == EvictionKind::Certified || cfg.order == ForcedOrder::WeightBound {
                        prop_assert_eq!(Some(&e.position), cand.iter().min());
                    } else {
                        let score_of = |x: u64| case.scores[((x - 1) / 3) as usize][e.head];
                        let m = cand.iter().map(|&x| score_of(x)).fold(f32::INFINITY, f32::min);
                        prop_assert_eq!(score_of(e.position), m);
                    }
                    if e.kind == EvictionKind::Forced { any_forced = true; }
                    match e.moved_from {
                        Some(f) => {
                            prop_assert_eq!(f as usize, r.len() - 1);
                            prop_assert!(e.slot < f);
                            r[e.slot as usize] = r[f as usize];
                            r.pop();
                        }
                        None => {
                            prop_assert_eq!(e.slot as usize, r.len() - 1);
                            r.pop();
                        }
                    }
                    evicted[e.head].insert(e.position);
                }
                for h in 0..nh {
                    rows[h].push(pos);
                    let got: Vec<u64> = p.slots(h).unwrap().iter().map(|s| s.position()).collect();
                    prop_assert_eq!(&got, &rows[h], "slots must match the mirror after moves");
                    // no re-entry, protected all live, and nothing vanished without a report
                    for x in &got { prop_assert!(!evicted[h].contains(x)); }
                    for x in &protected { prop_assert!(got.contains(x)); }
                    for x in &live_before[h] { prop_assert!(got.contains(x) || evicted[h].contains(x)); }
                    // stored c is the token's c relative to the head origin
                    for s in p.slots(h).unwrap() {
                        let i = ((s.position() - 1) / 3) as usize;
                        prop_assert!((s.c() - (c_abs[h][i] - origin[h])).abs() < 1e-9);
                    }
                    prop_assert!(got.len() <= cfg.head_limit());
                }
                if let Some(lb) = cfg.layer_budget { prop_assert!(p.live_total() <= lb); }
                check_invariants(&p);

                // certificate vs the brute-force evicted attention mass of query t
                for h in 0..nh {
                    let q = qk(h, t, false);
                    let logits: Vec<f64> = (0..=t).map(|j| {
                        let k = qk(h, j, true);
                        scale * q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() + c_abs[h][t] - c_abs[h][j]
                    }).collect();
                    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = logits.iter().map(|x| libm::exp(x - m)).sum();
                    let mass: f64 = evicted[h].iter().map(|&x| libm::exp(logits[((x - 1) / 3) as usize] - m) / z).sum();
                    let st = p.head_stats(h).unwrap();
                    prop_assert!(mass <= st.bound * (1.0 + 1e-9) + 1e-300, "mass {} > B {}", mass, st.bound);
                    if let (Some(l), false) = (cfg.ln_eps, any_forced) {
                        prop_assert!(st.ln_bound <= l + 1e-9);
                    }
                }
                let ls = p.layer_stats();
                let mx = (0..nh).map(|h| p.head_stats(h).unwrap().ln_bound).fold(f64::NEG_INFINITY, f64::max);
                prop_assert_eq!(ls.max_ln_bound, mx);
            }
        }
    }
}
