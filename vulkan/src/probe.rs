//! Device memory bandwidth, timed with GPU timestamps (host wall time where the queue has
//! none):
//! - [`copy_bandwidth`]: buffer-to-buffer copies (`vkCmdCopyBuffer`, which a driver may run
//!   on a copy engine); a copy of `b` bytes reads `b` and writes `b`: `2 b reps / seconds`.
//! - [`read_bandwidth`]: a compute shader streaming a buffer once per pass (`read_bw.comp`),
//!   `b reps / seconds`: the rate at which decode's kernels can at best read weights and
//!   cache rows, the denominator of its bandwidth bound.

use crate::device::{Context, Stamps};
use crate::error::{Error, Result};
use vulkano::command_buffer::CopyBufferInfo;
use vulkano::descriptor_set::{DescriptorSet, WriteDescriptorSet};
use vulkano::pipeline::{Pipeline, PipelineBindPoint};

static READ_BW: &[u8] = include_bytes!("../shaders/read_bw.spv");

/// Workgroups of the read probe (256 invocations each): enough to fill any GPU.
const READ_GROUPS: u32 = 2048;

/// Bytes per second read by `reps` passes of a compute shader over a buffer of about
/// `bytes` bytes (at most the device's storage binding range), after one untimed pass.
pub(crate) fn read_bandwidth(ctx: &Context, bytes: u64, reps: u32) -> Result<f64> {
    let limit = ctx.info.max_storage_buffer_range.min(u64::from(u32::MAX)) & !15;
    let words = (bytes.min(limit) / 16 * 4).max(4) as usize;
    let src = ctx.device_buffer(words)?;
    let dst = ctx.device_buffer((READ_GROUPS * 256) as usize)?;
    let pipe = ctx.pipeline("read_bw", READ_BW, &[])?;
    let layout = pipe
        .layout()
        .set_layouts()
        .first()
        .cloned()
        .ok_or_else(|| Error::Vulkan("read_bw pipeline has no descriptor set".into()))?;
    let set = DescriptorSet::new(
        ctx.desc.clone(),
        layout,
        [
            WriteDescriptorSet::buffer(0, src.clone()),
            WriteDescriptorSet::buffer(1, dst.clone()),
        ],
        [],
    )?;
    let n4 = (words / 4) as u32;
    let record = |b: &mut vulkano::command_buffer::AutoCommandBufferBuilder<
        vulkano::command_buffer::PrimaryAutoCommandBuffer,
    >,
                  passes: u32|
     -> Result<()> {
        b.bind_pipeline_compute(pipe.clone())?;
        b.bind_descriptor_sets(
            PipelineBindPoint::Compute,
            pipe.layout().clone(),
            0,
            set.clone(),
        )?;
        b.push_constants(pipe.layout().clone(), 0, n4)?;
        for _ in 0..passes {
            // SAFETY: pipeline, set and push constant are bound above; the shader reads
            // `src[i]` only for `i < n4` (the bound buffer's vec4 count) and writes
            // `outv[gid]` for `gid < READ_GROUPS * 256`, the size of `dst`.
            unsafe { b.dispatch([READ_GROUPS, 1, 1]) }?;
        }
        Ok(())
    };
    let mut b = ctx.builder()?;
    b.fill_buffer(src.clone(), 0x3f80_0000)?;
    record(&mut b, 1)?;
    ctx.submit(b)?;
    let reps = reps.max(1);
    let secs = timed(ctx, |b| record(b, reps))?;
    Ok(words as f64 * 4.0 * f64::from(reps) / secs)
}

/// Seconds the device takes to run what `record` records, between two GPU timestamps
/// (host wall time around the submission where the queue has none).
fn timed(
    ctx: &Context,
    record: impl FnOnce(
        &mut vulkano::command_buffer::AutoCommandBufferBuilder<
            vulkano::command_buffer::PrimaryAutoCommandBuffer,
        >,
    ) -> Result<()>,
) -> Result<f64> {
    let stamps = Stamps::new(ctx, 2);
    let mut b = ctx.builder()?;
    if let Some(s) = &stamps {
        s.reset(&mut b)?;
        s.stamp(&mut b, 0)?;
    }
    record(&mut b)?;
    if let Some(s) = &stamps {
        s.stamp(&mut b, 1)?;
    }
    let t0 = std::time::Instant::now();
    ctx.submit(b)?;
    let wall = t0.elapsed().as_secs_f64();
    Ok(stamps
        .and_then(|s| s.gaps_us().first().map(|us| us / 1e6))
        .filter(|&s| s > 0.0)
        .unwrap_or(wall))
}

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
    let secs = timed(ctx, |b| {
        for _ in 0..reps {
            b.copy_buffer(CopyBufferInfo::buffers(src.clone(), dst.clone()))?;
        }
        Ok(())
    })?;
    Ok(2.0 * (words as f64 * 4.0) * f64::from(reps) / secs)
}
