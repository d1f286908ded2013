//! Device memory bandwidth: buffer-to-buffer copies timed with GPU timestamps (host wall
//! time where the queue has none). A copy of `b` bytes reads `b` and writes `b`, so the
//! figure is `2 b reps / seconds`, the rate a memory-bound kernel (decode's weight reads)
//! can at best reach.

use crate::device::{Context, Stamps};
use crate::error::Result;
use vulkano::command_buffer::CopyBufferInfo;

/// Bytes per second moved (read + written) by `reps` copies of a `bytes`-byte buffer,
/// after one untimed warm-up copy.
pub(crate) fn copy_bandwidth(ctx: &Context, bytes: u64, reps: u32) -> Result<f64> {
    let words = (bytes / 4).max(1) as usize;
    let src = ctx.device_buffer(words)?;
    let dst = ctx.device_buffer(words)?;
    let mut b = ctx.builder()?;
    b.fill_buffer(src.clone(), 0x3f80_0000)?;
    b.copy_buffer(CopyBufferInfo::buffers(src.clone(), dst.clone()))?;
    ctx.submit(b)?;
    let reps = reps.max(1);
    let stamps = Stamps::new(ctx, 2);
    let mut b = ctx.builder()?;
    if let Some(s) = &stamps {
        s.reset(&mut b)?;
        s.stamp(&mut b, 0)?;
    }
    for _ in 0..reps {
        b.copy_buffer(CopyBufferInfo::buffers(src.clone(), dst.clone()))?;
    }
    if let Some(s) = &stamps {
        s.stamp(&mut b, 1)?;
    }
    let t0 = std::time::Instant::now();
    ctx.submit(b)?;
    let wall = t0.elapsed().as_secs_f64();
    let secs = stamps
        .and_then(|s| s.gaps_us().first().map(|us| us / 1e6))
        .filter(|&s| s > 0.0)
        .unwrap_or(wall);
    Ok(2.0 * (words as f64 * 4.0) * f64::from(reps) / secs)
}
