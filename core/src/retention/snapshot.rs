//! A policy's state as plain data, to save a stream and restore it.
//!
//! Per head: its live entries in slot order ([`EntryRecord`]: position, `c`, score, zone)
//! and its counters ([`HeadRecord`]); per layer: the last appended position. The age list
//! and the score heap are not part of it: the age list is the non-sink entries in position
//! order (the caller passes that order, and [`RetentionPolicy::restore`] checks it), and
//! the heap is rebuilt from the evictable entries. The heap's order (score, then position)
//! is total, so the rebuilt heap pops the entries the saved one would have popped: a
//! restored policy makes exactly the decisions of the saved one.

use super::slots::HeadState;
use super::slots::{NONE, Zone, heap_push};
use super::{ForcedOrder, PolicyConfig, RetentionPolicy, Slot};
use crate::error::{Error, Result};
use crate::eviction::Certificate;

/// Where a live entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryZone {
    /// One of the first `sinks` tokens: never evicted.
    Sink,
    /// Outside the protected window: may be evicted.
    Evictable,
    /// Inside the protected window.
    Protected,
}

/// One live entry of a head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntryRecord {
    /// Stream position of the token.
    pub position: u64,
    /// Cumulative log gate, relative to the head's origin.
    pub c: f64,
    /// Caller score (0 under [`ForcedOrder::WeightBound`]).
    pub score: f32,
    pub zone: EntryZone,
}

/// The counters of one head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadRecord {
    /// Live entries (slots `0..live`).
    pub live: usize,
    /// Tokens appended.
    pub pushed: u64,
    /// The latest `c_t` (relative to the head's origin).
    pub c_t: f64,
    pub evicted_certified: u64,
    pub evicted_forced: u64,
    /// The certificate's `logsumexp_{j evicted}(-c_j)` (`-inf` when nothing was evicted).
    pub lse: f64,
}

fn bad(what: &'static str) -> Error {
    Error::BadArgument(what)
}

impl<S, H> RetentionPolicy<S, H>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    H: AsRef<[HeadState]> + AsMut<[HeadState]>,
{
    /// The counters of head `h`.
    ///
    /// Errors: `h >= heads` ([`Error::BadArgument`]).
    pub fn head_record(&self, h: usize) -> Result<HeadRecord> {
        self.check_head(h)?;
        let hs = &self.heads.as_ref()[h];
        Ok(HeadRecord {
            live: hs.live as usize,
            pushed: hs.pushed,
            c_t: hs.c_t,
            evicted_certified: hs.evicted_certified,
            evicted_forced: hs.evicted_forced,
            lse: hs.cert.log_sum_exp_neg_c(),
        })
    }

    /// The live entry of head `h` in `slot`.
    ///
    /// Errors: `h >= heads` or `slot >= live` ([`Error::BadArgument`]).
    pub fn entry(&self, h: usize, slot: usize) -> Result<EntryRecord> {
        let s = self
            .slots(h)?
            .get(slot)
            .ok_or(bad("retention entry: slot not live"))?;
        let zone = match s.zone {
            Zone::Sink => EntryZone::Sink,
            Zone::Evictable => EntryZone::Evictable,
            Zone::Protected => EntryZone::Protected,
            Zone::Free => return Err(bad("retention entry: slot not live")),
        };
        Ok(EntryRecord {
            position: s.position,
            c: s.c,
            score: s.score,
            zone,
        })
    }

    /// The last appended position (`None` before the first append).
    pub fn last_position(&self) -> Option<u64> {
        self.last_position
    }

    /// A policy in the saved state: `records[h]` holds head `h`'s counters, `entry(h, s)`
    /// its entry in slot `s < live`, and `age(h, i)` the slot of its `i`-th oldest non-sink
    /// entry (`i < live - sinks`, `sinks = min(pushed, cfg.sinks)`). Storage and `u` as in
    /// [`RetentionPolicy::new`].
    ///
    /// Checked, so that the result is a state the policy can reach: every head appended
    /// the same `pushed = live + evicted` tokens and `last_position` is given iff
    /// `pushed > 0`; `live` within the head limit and the layer budget; sinks in slots
    /// `0..sinks`, the other slots each once in `age`, positions increasing along it and
    /// at most `last_position`, evictable entries before protected ones, `min(window,
    /// pushed - sinks)` of them protected; every `c` finite and `>= c_t`; scores not NaN;
    /// the certificate's `lse` consistent with the evicted count.
    ///
    /// Errors: those of [`RetentionPolicy::new`]; `records.len() != heads`
    /// ([`Error::BadLength`]); any broken rule above ([`Error::BadArgument`]).
    #[allow(clippy::too_many_arguments)]
    pub fn restore(
        cfg: PolicyConfig,
        u: &[f64],
        slots: S,
        heads: H,
        last_position: Option<u64>,
        records: &[HeadRecord],
        entry: impl Fn(usize, usize) -> EntryRecord,
        age: impl Fn(usize, usize) -> usize,
    ) -> Result<Self> {
        let mut p = Self::new(cfg, u, slots, heads)?;
        if records.len() != cfg.heads {
            return Err(Error::BadLength {
                what: "retention restore records (one per head)",
                expected: cfg.heads,
                got: records.len(),
            });
        }
        let pushed = records[0].pushed;
        if last_position.is_some() != (pushed > 0) {
            return Err(bad(
                "retention restore: last position given iff tokens were appended",
            ));
        }
        let last = last_position.unwrap_or(0);
        let mut live_total = 0usize;
        for (h, rec) in records.iter().enumerate() {
            if rec.pushed != pushed {
                return Err(bad(
                    "retention restore: heads appended different token counts",
                ));
            }
            let evicted = rec
                .evicted_certified
                .checked_add(rec.evicted_forced)
                .ok_or(bad("retention restore: evicted count overflows"))?;
            if (rec.live as u64).checked_add(evicted) != Some(pushed) {
                return Err(bad("retention restore: live + evicted != appended"));
            }
            if rec.live > p.limit {
                return Err(bad(
                    "retention restore: more live entries than the head limit",
                ));
            }
            if !rec.c_t.is_finite() {
                return Err(bad("retention restore: c_t must be finite"));
            }
            let cert = Certificate::from_parts(u[h], rec.lse, evicted)?;
            live_total += rec.live;
            let sinks = pushed.min(cfg.sinks as u64) as usize;
            let protected = (pushed - sinks as u64).min(cfg.window as u64) as u32;
            let order = cfg.order;
            let (r, hs) = p.head_mut(h);
            let slot_of = |e: EntryRecord, zone: Zone| -> Result<Slot> {
                if !(e.c.is_finite() && e.c >= rec.c_t) {
                    return Err(bad("retention restore: entry c must be finite and >= c_t"));
                }
                if e.score.is_nan() {
                    return Err(bad("retention restore: entry score is NaN"));
                }
                if e.position > last {
                    return Err(bad("retention restore: entry after the last position"));
                }
                Ok(Slot {
                    position: e.position,
                    c: e.c,
                    score: e.score,
                    zone,
                    ..Slot::EMPTY
                })
            };
            if rec.live < sinks {
                return Err(bad("retention restore: fewer live entries than sinks"));
            }
            for (s, row) in r.iter_mut().enumerate().take(sinks) {
                let e = entry(h, s);
                if e.zone != EntryZone::Sink {
                    return Err(bad("retention restore: sinks must fill the first slots"));
                }
                *row = slot_of(e, Zone::Sink)?;
            }
            *hs = HeadState {
                cert,
                live: rec.live as u32,
                sinks_live: sinks as u32,
                pushed,
                c_t: rec.c_t,
                evicted_certified: rec.evicted_certified,
                evicted_forced: rec.evicted_forced,
                ..HeadState::EMPTY
            };
            // The age list: every other slot once, positions increasing, evictable first.
            let mut prev = NONE;
            let mut prev_pos = None;
            let mut seen_protected = 0u32;
            for i in 0..rec.live - sinks {
                let s = age(h, i);
                if !(sinks..rec.live).contains(&s) || r[s].zone != Zone::Free {
                    return Err(bad(
                        "retention restore: age order is not the non-sink slots",
                    ));
                }
                let e = entry(h, s);
                let zone = match e.zone {
                    EntryZone::Evictable if seen_protected == 0 => Zone::Evictable,
                    EntryZone::Protected => Zone::Protected,
                    EntryZone::Evictable => {
                        return Err(bad(
                            "retention restore: evictable entry after a protected one",
                        ));
                    }
                    EntryZone::Sink => {
                        return Err(bad("retention restore: sink outside the first slots"));
                    }
                };
                if prev_pos.is_some_and(|pp| e.position <= pp) {
                    return Err(bad("retention restore: positions must increase with age"));
                }
                prev_pos = Some(e.position);
                r[s] = Slot {
                    prev,
                    ..slot_of(e, zone)?
                };
                let s = s as u32;
                if prev == NONE {
                    hs.oldest = s;
                } else {
                    r[prev as usize].next = s;
                }
                if zone == Zone::Protected {
                    if seen_protected == 0 {
                        hs.first_protected = s;
                    }
                    seen_protected += 1;
                }
                prev = s;
            }
            hs.newest = prev;
            hs.protected = seen_protected;
            if seen_protected != protected {
                return Err(bad(
                    "retention restore: protected entries are not the window",
                ));
            }
            if order == ForcedOrder::Scores {
                let mut node = hs.oldest;
                while node != NONE && r[node as usize].zone == Zone::Evictable {
                    heap_push(r, hs, node);
                    node = r[node as usize].next;
                }
            }
        }
        if cfg.layer_budget.is_some_and(|lb| live_total > lb) {
            return Err(bad(
                "retention restore: more live entries than the layer budget",
            ));
        }
        p.live_total = live_total;
        p.last_position = last_position;
        Ok(p)
    }
}
