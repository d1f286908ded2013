//! Bookkeeping of the retention policy over caller storage: the rows ([`Slot`]) and
//! per-head state ([`HeadState`]), the age list and the score heap over one head's rows,
//! and the swap-delete removal of an entry ([`evict`]). The policy
//! ([`super::RetentionPolicy`]) decides what to evict; this module keeps the structures
//! consistent.
//!
//! Invariants per head of `live` entries: rows `0..live` hold the entries, the others are
//! free; sinks occupy `0..sinks_live`; the age list links every other entry by increasing
//! position, evictable ones before protected ones (`first_protected` is the first protected
//! one); under the score order, heap element `i` lives in row `i`, and `heap_item` and
//! `heap_pos` are inverse of each other.

use crate::eviction::Certificate;

pub(super) const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Zone {
    Free,
    Sink,
    Evictable,
    Protected,
}

/// One row of the slot storage: a cache entry (when live) and one element of the head's
/// score heap. Read it through the accessors; only the policy writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    pub(super) position: u64,
    pub(super) c: f64,
    pub(super) score: f32,
    pub(super) prev: u32,
    pub(super) next: u32,
    pub(super) heap_pos: u32,
    pub(super) zone: Zone,
    /// Element `i` of the head's heap array lives in row `i`; it is not part of the entry
    /// and does not move with it.
    pub(super) heap_item: u32,
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

    /// Caller score (0 when the order is [`super::ForcedOrder::WeightBound`]).
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

/// Per-head state of a [`super::RetentionPolicy`] (caller storage, one per head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadState {
    pub(super) cert: Certificate,
    pub(super) live: u32,
    pub(super) sinks_live: u32,
    /// Age list of non-sink entries: evictable ones, then protected ones.
    pub(super) oldest: u32,
    pub(super) newest: u32,
    pub(super) first_protected: u32,
    pub(super) protected: u32,
    pub(super) heap_len: u32,
    pub(super) pushed: u64,
    pub(super) c_t: f64,
    pub(super) evicted_certified: u64,
    pub(super) evicted_forced: u64,
}

impl HeadState {
    /// Initial contents of caller storage ([`super::RetentionPolicy::new`] resets it anyway).
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

/// One eviction, reported in order by [`super::RetentionPolicy::append`]. Apply them in
/// the order received: the entry of `head` at `slot` is gone; if `moved_from` is `Some(m)`,
/// copy the tensor row of slot `m` into `slot` (`m` was the last live slot; it is now free).
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

pub(super) fn list_push_back(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    r[s as usize].prev = hs.newest;
    r[s as usize].next = NONE;
    if hs.newest == NONE {
        hs.oldest = s;
    } else {
        r[hs.newest as usize].next = s;
    }
    hs.newest = s;
}

pub(super) fn list_unlink(r: &mut [Slot], hs: &mut HeadState, s: u32) {
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
pub(super) fn heap_less(r: &[Slot], a: u32, b: u32) -> bool {
    let (x, y) = (&r[a as usize], &r[b as usize]);
    x.score < y.score || (x.score == y.score && x.position < y.position)
}

pub(super) fn heap_set(r: &mut [Slot], i: u32, s: u32) {
    r[i as usize].heap_item = s;
    r[s as usize].heap_pos = i;
}

pub(super) fn heap_sift_up(r: &mut [Slot], mut i: u32) {
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

pub(super) fn heap_sift_down(r: &mut [Slot], len: u32, mut i: u32) {
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

pub(super) fn heap_push(r: &mut [Slot], hs: &mut HeadState, s: u32) {
    let i = hs.heap_len;
    hs.heap_len += 1;
    heap_set(r, i, s);
    heap_sift_up(r, i);
}

pub(super) fn heap_remove(r: &mut [Slot], hs: &mut HeadState, s: u32) {
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
pub(super) fn oldest_evictable(r: &[Slot], hs: &HeadState) -> Option<u32> {
    (hs.oldest != NONE && r[hs.oldest as usize].zone == Zone::Evictable).then_some(hs.oldest)
}

/// Removes the evictable entry `s` (swap-delete) and records it in the certificate.
pub(super) fn evict(
    r: &mut [Slot],
    hs: &mut HeadState,
    head: usize,
    s: u32,
    kind: EvictionKind,
) -> Eviction {
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
