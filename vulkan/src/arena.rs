//! Grow-only buffers that prefill calls reuse: staging (host-visible, written by the host),
//! device-local (bound to the kernels) and readback (host-visible, read by the host).
//!
//! Ownership is exclusive: a [`crate::Vulkan`] handle (and its clones) keeps one pooled
//! arena (a [`Pool`]); a prefill call takes it for as long as its [`crate::PreparedPrefill`]
//! lives (a [`Lease`]) and gives it back on drop. A call that finds it taken (another `PreparedPrefill` alive, or a
//! concurrent call) gets a fresh, unpooled arena that allocates exact sizes, as before the
//! arena existed, and is freed with its call. No two live calls ever share a buffer.
//!
//! Slots are addressed by (kind, index); the caller assigns indices (prefill: one index per
//! (chunk, tensor), so the chunks of one call never alias). A slot grows to the next power of
//! two of the words asked for (within `maxMemoryAllocationSize`), so slowly growing calls do
//! not reallocate each time; callers receive an exact-size `slice` of it, so descriptor
//! ranges and copies are what they were with exact-size buffers.
//!
//! A pooled arena also shrinks: a slot more than [`SHRINK`] times what [`SHRINK_CALLS`]
//! calls in a row asked of it is allocated again at their size, and a slot no call used for
//! [`SHRINK_CALLS`] calls is freed. Otherwise one long prompt holds its buffers for the
//! process's life: on the H100 host 518 MiB after 16k-token calls of 16 heads, where 1k
//! calls need 32 MiB (BENCHMARKS.md, "Vulkan attention kernels"), and on a board whose GPU
//! shares the host's memory the application loses that memory. [`SHRINK_CALLS`] spans a
//! few chunks of a model's layers, so a prompt's short last chunk does not make the next
//! prompt allocate again.

use crate::device::Context;
use crate::error::Result;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use vulkano::buffer::Subbuffer;

/// What a slot's buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Device-local storage buffer (transfer source and destination too).
    Device,
    /// Host-visible, written sequentially by the host, copied to the device.
    Upload,
    /// Host-visible, copied into by the device, read by the host.
    Download,
}

/// A pooled slot more than this many times the size a call would give it is oversized.
pub(crate) const SHRINK: u64 = 4;

/// Calls in a row after which an oversized pooled slot is allocated again at size, and an
/// unused one freed (a prefill call per layer: four chunks of a 16-layer model).
pub(crate) const SHRINK_CALLS: u64 = 64;

/// One slot: its buffer, the oversized calls in a row it served, the call that last used it.
#[derive(Debug, Clone, Default)]
struct Slot {
    buf: Option<Subbuffer<[u32]>>,
    oversized: u64,
    used_at: u64,
}

/// Buffers by (kind, slot index).
#[derive(Debug)]
pub(crate) struct Arena {
    slots: [Vec<Slot>; 3],
    /// Pooled arenas grow with headroom (and shrink); fresh ones allocate exact sizes.
    headroom: bool,
    /// Calls begun ([`Arena::begin_call`]).
    calls: u64,
}

impl Arena {
    pub fn new(headroom: bool) -> Self {
        Self {
            slots: Default::default(),
            headroom,
            calls: 0,
        }
    }

    /// Starts a call: slots it does not use age by one call.
    pub fn begin_call(&mut self) {
        self.calls += 1;
    }

    /// Ends a call of a pooled arena: frees the slots no call used for [`SHRINK_CALLS`]
    /// calls.
    pub fn end_call(&mut self) {
        if !self.headroom {
            return;
        }
        let now = self.calls;
        for s in self.slots.iter_mut().flatten() {
            if s.buf.is_some() && s.used_at + SHRINK_CALLS <= now {
                *s = Slot::default();
            }
        }
    }

    /// An exact `words`-word (at least 1) view of slot `i` of `kind`, replacing the slot's
    /// buffer with a larger one when it is too small (its old contents are not kept).
    pub fn get(
        &mut self,
        ctx: &Context,
        kind: Kind,
        i: usize,
        words: usize,
    ) -> Result<Subbuffer<[u32]>> {
        let words = words.max(1);
        let max_words = (ctx.info.max_allocation / 4) as usize;
        let cap = if self.headroom {
            words
                .checked_next_power_of_two()
                .unwrap_or(words)
                .min(max_words)
                .max(words)
        } else {
            words
        };
        let v = &mut self.slots[kind as usize];
        if v.len() <= i {
            v.resize(i + 1, Slot::default());
        }
        let slot = &mut v[i];
        slot.used_at = self.calls;
        let oversized = |b: &Subbuffer<[u32]>| self.headroom && b.len() > SHRINK * cap as u64;
        slot.oversized = match &slot.buf {
            Some(b) if oversized(b) => slot.oversized + 1,
            _ => 0,
        };
        let buf = match slot.buf.take() {
            Some(b) if b.len() >= words as u64 && slot.oversized < SHRINK_CALLS => b,
            old => {
                // Free the old buffer before allocating its replacement.
                drop(old);
                slot.oversized = 0;
                let alloc = |n: usize| match kind {
                    Kind::Device => ctx.device_buffer(n),
                    Kind::Upload => ctx.host_buffer(n, true),
                    Kind::Download => ctx.host_buffer(n, false),
                };
                // Headroom is a wish: fall back to the exact size when it does not fit.
                match alloc(cap) {
                    Ok(b) => b,
                    Err(_) if cap > words => alloc(words)?,
                    Err(e) => return Err(e),
                }
            }
        };
        slot.buf = Some(buf.clone());
        Ok(buf.slice(0..words as u64))
    }

    /// Frees the staging buffers (a fresh arena after its upload: nothing will reuse them).
    pub fn free_uploads(&mut self) {
        self.slots[Kind::Upload as usize].clear();
    }

    /// Bytes held, over all slots.
    pub fn bytes(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .filter_map(|s| s.buf.as_ref())
            .map(|b| b.size())
            .sum()
    }

    /// Whether this is the context's pooled arena.
    pub fn pooled(&self) -> bool {
        self.headroom
    }
}

/// The pooled prefill arena of a [`crate::Vulkan`] handle, shared by its clones: `None`
/// while a prefill call holds it.
#[derive(Debug, Clone)]
pub(crate) struct Pool(Arc<Mutex<Option<Arena>>>);

impl Pool {
    pub fn new() -> Self {
        Self(Arc::new(Mutex::new(Some(Arena::new(true)))))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arena>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Frees the pooled buffers (when no call holds them; a call that does keeps its own).
    pub fn release(&self) {
        let mut g = self.lock();
        if g.is_some() {
            *g = Some(Arena::new(true));
        }
    }

    /// Bytes the pooled arena holds (0 while a call holds it).
    pub fn bytes(&self) -> u64 {
        self.lock().as_ref().map_or(0, Arena::bytes)
    }
}

/// Exclusive use of an arena for one prefill call: the pool's arena when it was free
/// (given back on drop), else a fresh one.
#[derive(Debug)]
pub(crate) struct Lease {
    pool: Pool,
    pub arena: Arena,
}

impl Lease {
    pub fn take(pool: &Pool) -> Self {
        let pooled = pool.lock().take();
        let mut arena = pooled.unwrap_or_else(|| Arena::new(false));
        arena.begin_call();
        Self {
            pool: pool.clone(),
            arena,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.arena.pooled() {
            self.arena.end_call();
            let a = std::mem::replace(&mut self.arena, Arena::new(false));
            *self.pool.lock() = Some(a);
        }
    }
}
