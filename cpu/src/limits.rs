//! The machine limits that speed figures are reported against: the fp32 FMA peak and the
//! DRAM read bandwidth, measured on the machine at hand (datasheet rates are only leads).
//!
//! FMA peak: every thread runs [`CHAINS`] independent chains of fused multiply-adds on the
//! widest vectors it has (AVX-512, AVX2+FMA, NEON; scalar `mul_add` otherwise), enough
//! independent work to hide the FMA latency on two pipes. FLOPs = 2 per lane per FMA.
//! DRAM read: threads sum disjoint parts of a buffer far larger than the caches, 16
//! accumulators each (a simple reader: a lower bound of what the memory system can do).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Independent FMA chains per thread.
pub const CHAINS: usize = 12;
/// FMA rounds per chain in one [`fma_block`].
pub const BLOCK_ITERS: usize = 1 << 16;

/// One block of `CHAINS x BLOCK_ITERS` vector FMAs on the best instruction set:
/// (FLOPs done, a value that depends on every chain, to keep the work alive).
pub fn fma_block() -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return ((BLOCK_ITERS * CHAINS * 16 * 2) as f64, unsafe {
                x86::avx512()
            });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return ((BLOCK_ITERS * CHAINS * 8 * 2) as f64, unsafe {
                x86::avx2()
            });
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        return ((BLOCK_ITERS * CHAINS * 4 * 2) as f64, unsafe {
            arm::neon()
        });
    }
    #[allow(unreachable_code)]
    ((BLOCK_ITERS * CHAINS * 2) as f64, scalar())
}

/// fp32 FMA peak in GFLOP/s of `threads` threads, each repeating [`fma_block`] for about
/// `seconds`.
pub fn fma_peak_gflops(threads: usize, seconds: f64) -> f64 {
    let dur = Duration::from_secs_f64(seconds.max(0.0));
    let total: f64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(move || {
                    let t0 = Instant::now();
                    let (mut flops, mut sink) = (0.0f64, 0.0f32);
                    while t0.elapsed() < dur || flops == 0.0 {
                        let (f, x) = fma_block();
                        flops += f;
                        sink += x;
                    }
                    black_box(sink);
                    flops / t0.elapsed().as_secs_f64()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    total / 1e9
}

/// Sums `part` once with 16 accumulators: the reader of [`dram_read_gbps`].
pub fn read_pass(part: &[f32]) -> [f32; 16] {
    let mut acc = [0.0f32; 16];
    for ch in part.chunks_exact(16) {
        for (a, x) in acc.iter_mut().zip(ch) {
            *a += x;
        }
    }
    acc
}

/// DRAM read bandwidth in GB/s: `threads` threads each read a disjoint part of `buf` once;
/// the best of `reps` passes. `buf` should be far larger than the last-level cache.
pub fn dram_read_gbps(buf: &[f32], threads: usize, reps: usize) -> f64 {
    let parts: Vec<&[f32]> = buf
        .chunks(buf.len().div_ceil(threads.max(1)).max(1))
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for p in &parts {
                s.spawn(move || black_box(read_pass(p)));
            }
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::mem::size_of_val(buf) as f64 / best / 1e9
}

/// Portable fallback: scalar `mul_add` chains.
fn scalar() -> f32 {
    let mut acc = [0.0f32; CHAINS];
    let (a, b) = (black_box(0.999_f32), black_box(1e-3_f32));
    for _ in 0..BLOCK_ITERS {
        for x in &mut acc {
            *x = x.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK_ITERS, CHAINS};
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512() -> f32 {
        let a = _mm512_set1_ps(black_box(0.999));
        let b = _mm512_set1_ps(black_box(1e-3));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..BLOCK_ITERS {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for x in acc {
            s = _mm512_add_ps(s, x);
        }
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2() -> f32 {
        let a = _mm256_set1_ps(black_box(0.999));
        let b = _mm256_set1_ps(black_box(1e-3));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..BLOCK_ITERS {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut s = _mm256_setzero_ps();
        for x in acc {
            s = _mm256_add_ps(s, x);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32, what an unaligned 256-bit store writes.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
        lanes.iter().sum()
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::{BLOCK_ITERS, CHAINS};
    use std::arch::aarch64::*;
    use std::hint::black_box;

    /// # Safety
    /// The CPU must support NEON (every aarch64 CPU does: it is part of the baseline).
    #[target_feature(enable = "neon")]
    pub unsafe fn neon() -> f32 {
        let a = vdupq_n_f32(black_box(0.999));
        let b = vdupq_n_f32(black_box(1e-3));
        let mut acc = [vdupq_n_f32(0.0); CHAINS];
        for _ in 0..BLOCK_ITERS {
            for x in &mut acc {
                *x = vfmaq_f32(b, *x, a);
            }
        }
        acc.iter().map(|x| vaddvq_f32(*x)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_positive_and_finite() {
        let (flops, x) = fma_block();
        assert!(flops > 0.0 && x.is_finite());
        let g = fma_peak_gflops(1, 0.01);
        assert!(g.is_finite() && g > 0.0);
        let buf = vec![1.0f32; 1 << 16];
        assert_eq!(read_pass(&buf).iter().sum::<f32>(), (1 << 16) as f32);
        let bw = dram_read_gbps(&buf, 2, 2);
        assert!(bw.is_finite() && bw > 0.0);
    }
}
