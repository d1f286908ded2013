//! Q8 matvec straight over the canonical 34-byte blocks (AVX-512 VNNI, 256-bit), one row
//! after another: the alternative the packed layout is measured against.
//! Shared by `benches/linear.rs` and `examples/linear_bw.rs`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `y = W x` with `x` quantized per block as the library does (scale `max|x| / 127`).
pub fn matvec(w: &[u8], inp: usize, x: &[f32], y: &mut [f32], threads: usize) {
    let nb = inp / 32;
    let mut qs = vec![0i8; nb * 32];
    let (mut d, mut bias) = (vec![0.0f32; nb], vec![0i32; nb]);
    for k in 0..nb {
        let b = &x[32 * k..32 * k + 32];
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut s = 0;
        for (q, &v) in qs[32 * k..32 * k + 32].iter_mut().zip(b) {
            *q = (v * id).round_ties_even() as i8;
            s += i32::from(*q);
        }
        (d[k], bias[k]) = (amax / 127.0, -128 * s);
    }
    let rb = nb * 34;
    let per = y.len().div_ceil(threads.max(1));
    use rayon::prelude::*;
    y.par_chunks_mut(per).enumerate().for_each(|(c, yc)| {
        let rows = &w[c * per * rb..(c * per + yc.len()) * rb];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` checked the features before any call.
        unsafe {
            rows_vnni(rows, rb, &qs, &d, &bias, yc)
        };
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn rows_vnni(w: &[u8], rb: usize, qs: &[i8], d: &[f32], bias: &[i32], y: &mut [f32]) {
    for (row, yo) in w.chunks_exact(rb).zip(y.iter_mut()) {
        // SAFETY: the features are enabled on this function; each load
        // reads 32 bytes inside `row` (offset 2 of a 34-byte block) or `qs`.
        unsafe {
            let flip = _mm256_set1_epi8(-128);
            let mut acc = _mm256_setzero_ps();
            for (k, blk) in row.chunks_exact(34).enumerate() {
                let wq = _mm256_xor_si256(_mm256_loadu_si256(blk[2..34].as_ptr().cast()), flip);
                let xq = _mm256_loadu_si256(qs[32 * k..32 * k + 32].as_ptr().cast());
                let s = _mm256_dpbusd_epi32(_mm256_set1_epi32(bias[k] / 8), wq, xq);
                let h = i32::from(u16::from_le_bytes([blk[0], blk[1]]));
                let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * d[k]), acc);
            }
            let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            *yo = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)));
        }
    }
}
