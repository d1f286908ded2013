//! ACP prefills planned one call ahead: the GPU starts at once while the call's work is
//! counted beside it.
//!
//! `auto` plans a call from each head's kept pairs, which an ACP prefill must count first:
//! the boundary over every head, on the calling thread, before any backend starts (on the
//! H100 host 40-60 us at 16 heads x 1k tokens, 4-6% of the GPU's call). A count needs
//! every head's gates, so it cannot be bounded away: a head keeps between its diagonal
//! blocks' pairs and all of them, and at those bounds the CPU's and the GPU's predictions
//! of a 1k or 4k call cross on the H100 host.
//!
//! So when the last counted call of a [`Shape`] picked the all-GPU plan by the model (not
//! as a probe) and the all-CPU plan's corrected prediction was at least [`MARGIN`] times
//! its own (a split need only lose to it: a split runs the GPU too, and a near-tie one held
//! every ACP prefill of 16 heads x 16K and 64K tokens to its count first on the H100 host,
//! 0.76 and 2.1 ms of `auto`'s own time a call, run 431), the next call of that shape
//! starts on the GPU at once (the GPU decides its
//! blocks itself, as the `vulkan` backend does) while a pool thread counts its work. That
//! count is a counted call's in every other way: the call's size class learns its
//! measured time from it, and it plans the shape's next call. A count that picks another
//! plan, or by less than [`MARGIN`], ends the run: the next call counts first and runs
//! what its count picks. A call therefore runs the plan of its own count, or the GPU's
//! when its shape's previous call (usually the previous layer's) found the GPU
//! [`MARGIN`] ahead of everything else.
//!
//! Only with a concurrent GPU: where the Vulkan device is itself a CPU implementation, the
//! count would take the device's cores.
//!
//! The GPU's call runs on the calling thread, as the `vulkan` backend's does; the count is
//! spawned into the pool and ends long before the GPU does. (With both sides handed to
//! `rayon::join`, the GPU's call ran on a pool thread, and `auto` read 0.92-0.93 of the
//! `vulkan` backend at ACP 1k: runs 315-316.) On the H100 host `auto`'s own time per call fell from 62-76 to 17-29 us at
//! ACP 1k and from 221-268 to 18-25 us at ACP 4k (BENCHMARKS.md, runs 314-326). At 1k the
//! GPU then forms its own decisions again (about 40 us that a count handed to it saved), so
//! only 4k gained in `auto / best`.

/// The least ratio of the all-CPU plan's corrected prediction to the all-GPU plan's at
/// which the next call of a shape starts on the GPU before its count (`EXPLORE`: a
/// plan within it may be probed, and a probe needs the count first).
pub(super) const MARGIN: f64 = super::EXPLORE;

/// Shapes remembered at most (all are forgotten when a new one would pass this).
pub(super) const SHAPES: usize = 64;

/// A prefill's shape: (tokens, heads, head_dim).
pub(super) type Shape = (usize, usize, usize);
