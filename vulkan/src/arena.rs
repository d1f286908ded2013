//! Grow-only buffers that prefill calls reuse: staging (host-visible, written by the host),
//! device-local (bound to the kernels) and readback (host-visible, read by the host).
//!
//! Ownership is exclusive: the [`crate::device::Context`] keeps one pooled arena; a prefill
//! call takes it for as long as its [`crate::PreparedPrefill`] lives (a [`Lease`]) and gives
//! it back on drop. A call that finds it taken (another `PreparedPrefill` alive, or a
//! concurrent call) gets a fresh, unpooled arena that allocates exact sizes, as before the
//! arena existed, and is freed with its call. No two live calls ever share a buffer.
//!
//! Slots are addressed by (kind, index); the caller assigns indices (prefill: one index per
//! (chunk, tensor), so the chunks of one call never alias). A slot grows to the next power of
//! two of the words asked for (within `maxMemoryAllocationSize`), so slowly growing calls do
//! not reallocate each time; callers receive an exact-size `slice` of it, so descriptor
//! ranges and copies are what they were with exact-size buffers.

use crate::device::Context;
use crate::error::Result;
use std::sync::{Arc, PoisonError};
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

/// Buffers by (kind, slot index).
#[derive(Debug)]
pub(crate) struct Arena {
    slots: [Vec<Option<Subbuffer<[u32]>>>; 3],
    /// Pooled arenas grow with headroom; fresh ones allocate exact sizes.
    headroom: bool,
}

impl Arena {
    pub fn new(headroom: bool) -> Self {
        Self {
            slots: Default::default(),
            headroom,
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
        let v = &mut self.slots[kind as usize];
        if v.len() <= i {
            v.resize(i + 1, None);
        }
        let buf = match v[i].take() {
            Some(b) if b.len() >= words as u64 => b,
            old => {
                // Free the old buffer before allocating its replacement.
                drop(old);
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
        v[i] = Some(buf.clone());
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
            .flatten()
            .map(|b| b.size())
            .sum()
    }

    /// Whether this is the context's pooled arena.
    pub fn pooled(&self) -> bool {
        self.headroom
    }
}

/// Exclusive use of an arena for one prefill call: the context's pooled one when it was
/// free (given back on drop), else a fresh one.
#[derive(Debug)]
pub(crate) struct Lease {
    ctx: Arc<Context>,
    pub arena: Arena,
}

impl Lease {
    pub fn take(ctx: &Arc<Context>) -> Self {
        let pooled = ctx
            .prefill_arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Self {
            ctx: ctx.clone(),
            arena: pooled.unwrap_or_else(|| Arena::new(false)),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.arena.pooled() {
            let a = std::mem::replace(&mut self.arena, Arena::new(false));
            *self
                .ctx
                .prefill_arena
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(a);
        }
    }
}
