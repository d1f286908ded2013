extern crate std;

use super::*;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

/// Deterministic standard normals (LCG + Box-Muller).
fn normals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    let mut uni = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (a, b) = (uni(), uni());
            (libm::sqrt(-2.0 * libm::log(a)) * libm::cos(core::f64::consts::TAU * b)) as f32
        })
        .collect()
}

fn block(v: &[f32]) -> [f32; BLOCK] {
    let mut b = [0.0; BLOCK];
    b.copy_from_slice(v);
    b
}

/// A block of 32 weights: a magnitude scale over many decades times values in [-1, 1],
/// with some exact zeros and some blocks that are all zero.
fn weights() -> impl Strategy<Value = [f32; BLOCK]> {
    (
        -30i32..8,
        proptest::collection::vec(prop_oneof![6 => -1.0f32..=1.0, 1 => Just(0.0)], BLOCK),
        0u8..20,
    )
        .prop_map(|(e, v, zero)| {
            let s = libm::powf(2.0, e as f32);
            block(
                &v.iter()
                    .map(|x| if zero == 0 { 0.0 } else { x * s })
                    .collect::<Vec<_>>(),
            )
        })
}

fn sse(w: &[f32; BLOCK], r: &[f32; BLOCK]) -> f64 {
    w.iter()
        .zip(r)
        .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Q8: `d` is the smallest f16 >= max|w| / 127 and every weight is within d/2 (the
    /// f64 rounding of w / d can move a tie by 2^-46 d at most, hence the 1e-9 slack).
    #[test]
    fn q8_error_within_half_step(w in weights()) {
        let b = BlockQ8::quantize(&w).unwrap();
        let d = b.scale();
        let amax = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        prop_assert!(d >= amax / 127.0);
        if d > 0.0 {
            prop_assert!(f16::from_bits(b.d - 1).to_f32() < amax / 127.0);
        }
        let mut r = [0.0; BLOCK];
        b.dequantize(&mut r);
        for (&x, &y) in w.iter().zip(&r) {
            // d (11 significant bits) times q (8 bits) is exact in f32.
            let err = (f64::from(x) - f64::from(y)).abs();
            prop_assert!(err <= f64::from(d) / 2.0 * (1.0 + 1e-9), "w {x} -> {y}, d {d}");
        }
        prop_assert!(b.qs.iter().all(|&q| q != i8::MIN));
    }

    /// Q4: the result's squared error is at most that of the first candidate `d0`, whose
    /// per-weight error is at most 17 |d0| (below the bottom level) or 14 |d0| (half the
    /// largest gap): sse <= 32 (17 d0)^2.
    #[test]
    fn q4_error_within_bound(w in weights()) {
        let b = BlockQ4::quantize(&w).unwrap();
        let mut r = [0.0; BLOCK];
        b.dequantize(&mut r);
        let m = w.iter().fold(0.0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        if m == 0.0 {
            prop_assert!(r.iter().all(|&y| y == 0.0));
            return Ok(());
        }
        let d0 = f16_at_least(m.abs() / 127.0).unwrap().to_f32();
        let d0 = if m < 0.0 { -d0 } else { d0 };
        let mut idx = [0u8; BLOCK];
        q4_assign(&w, d0, &mut idx);
        let mut r0 = [0.0; BLOCK];
        BlockQ4::from_indices(f16::from_f32(d0).to_bits(), &idx).dequantize(&mut r0);
        for (&x, &y) in w.iter().zip(&r0) {
            prop_assert!((x - y).abs() <= 17.0 * d0.abs() * (1.0 + 1e-6), "{x} -> {y} (d0 {d0})");
        }
        let (s, s0) = (sse(&w, &r), sse(&w, &r0));
        prop_assert!(s <= s0 * (1.0 + 1e-5) + 1e-30, "searched {s} > first candidate {s0}");
        prop_assert!(s0 <= 32.0 * f64::from(17.0 * d0).powi(2));
    }

    /// Byte layouts round-trip both ways for any block and any bytes.
    #[test]
    fn block_bytes_round_trip(d in any::<u16>(), q in proptest::collection::vec(any::<u8>(), BLOCK)) {
        let qs: [i8; BLOCK] = core::array::from_fn(|i| q[i] as i8);
        let b8 = BlockQ8 { d, qs };
        prop_assert_eq!(BlockQ8::from_bytes(&b8.to_bytes()), b8);
        let mut raw = [0u8; Q8_BYTES];
        raw[0] = q[0];
        raw[1] = (d >> 3) as u8;
        raw[2..].copy_from_slice(&q);
        prop_assert_eq!(BlockQ8::from_bytes(&raw).to_bytes(), raw);
        prop_assert_eq!(BlockQ8::from_bytes(&raw).d, u16::from_le_bytes([raw[0], raw[1]]));

        let idx: [u8; BLOCK] = core::array::from_fn(|i| q[i] & 15);
        let b4 = BlockQ4::from_indices(d, &idx);
        for (j, &i) in idx.iter().enumerate() {
            prop_assert_eq!(b4.index(j), i);
        }
        prop_assert_eq!(BlockQ4::from_bytes(&b4.to_bytes()), b4);
        let mut raw4 = [0u8; Q4_BYTES];
        raw4[..2].copy_from_slice(&d.to_le_bytes());
        raw4[2..].copy_from_slice(&q[..16]);
        prop_assert_eq!(BlockQ4::from_bytes(&raw4).to_bytes(), raw4);
    }

    /// encode_row then decode_row for every format and ragged lengths: floats exactly
    /// (f32) or within their rounding (f16: 2^-11 relative, bf16: 2^-8); blocks within
    /// their bounds from the f16 scale (Q8 half a step, or the clamped top code's miss);
    /// the padded part of the last block decodes nothing.
    #[test]
    fn rows_round_trip(n in 1usize..200, seed in any::<u64>()) {
        let w: Vec<f32> = normals(seed, n).iter().map(|x| x * 0.05).collect();
        for f in WeightFormat::ALL {
            let mut bytes = vec![0u8; f.row_bytes(n).unwrap()];
            encode_row(f, &w, &mut bytes).unwrap();
            let mut r = vec![f32::NAN; n];
            decode_row(f, &bytes, &mut r).unwrap();
            for (k, chunk) in w.chunks(BLOCK).enumerate() {
                let amax = chunk.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                // The first scale either block format tries: |m| / 127 rounded up to f16.
                // Code 127 then misses |m| by 127 d0 - |m|, which exceeds d0 / 2 only
                // when d0 is subnormal (spacing 2^-24).
                let d0 = f64::from(f16_at_least(amax / 127.0).unwrap().to_f32());
                let q8_tol = (d0 * 0.5).max(127.0 * d0 - f64::from(amax));
                let mut sse = 0.0f64;
                for (j, &x) in chunk.iter().enumerate() {
                    let y = r[k * BLOCK + j];
                    sse += (f64::from(x) - f64::from(y)).powi(2);
                    let tol = match f {
                        WeightFormat::F32 => 0.0,
                        WeightFormat::F16 => x.abs() * 4.9e-4 + 6e-8,
                        WeightFormat::Bf16 => x.abs() / 256.0,
                        WeightFormat::Q8 => q8_tol as f32,
                        WeightFormat::Q4 => f32::INFINITY,
                    };
                    prop_assert!((x - y).abs() <= tol, "{f} n {n}: {x} -> {y}");
                }
                if f == WeightFormat::Q4 {
                    prop_assert!(sse <= 32.0 * (17.0 * d0).powi(2), "q4 block {k}: sse {sse}");
                }
            }
        }
    }
}

#[test]
fn nearest_table_matches_brute_force() {
    for k in -400..400 {
        let v = k as f32 * 0.37 + 0.011;
        let mut idx = [0u8; BLOCK];
        let w = [v; BLOCK];
        q4_assign(&w, 1.0, &mut idx);
        let got = Q4_LEVELS[usize::from(idx[0])];
        let best = Q4_LEVELS
            .iter()
            .map(|&l| (f32::from(l) - v).abs())
            .fold(f32::INFINITY, f32::min);
        assert_eq!((f32::from(got) - v).abs(), best, "v {v} -> {got}");
    }
    // Levels are increasing, with the gaps the bound of BlockQ4::quantize uses.
    let gaps = Q4_LEVELS
        .windows(2)
        .map(|p| i32::from(p[1]) - i32::from(p[0]));
    assert!(gaps.clone().all(|g| g > 0) && gaps.max() == Some(28));
    assert_eq!(127 + i32::from(Q4_LEVELS[0]), 17);
}

/// Relative RMS error on Gaussian weights (the figure in the module docs is measured on
/// the bundled model's weights): Q8 0.0053; Q4 0.0755, against 0.0860 for uniform
/// levels `-8..=7` with the largest-magnitude weight on `-8`.
#[test]
fn gaussian_relative_rms_error() {
    let w = normals(42, 32 * 4096);
    let rel = |f: WeightFormat| {
        let mut bytes = vec![0u8; f.row_bytes(w.len()).unwrap()];
        encode_row(f, &w, &mut bytes).unwrap();
        let mut r = vec![0.0; w.len()];
        decode_row(f, &bytes, &mut r).unwrap();
        let e: f64 = w
            .iter()
            .zip(&r)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        let s: f64 = w.iter().map(|&a| f64::from(a).powi(2)).sum();
        libm::sqrt(e / s)
    };
    let (q8, q4) = (rel(WeightFormat::Q8), rel(WeightFormat::Q4));
    assert!(q8 < 0.0056, "q8 {q8}");
    assert!(q4 < 0.078, "q4 {q4}");
    // Uniform 4-bit levels -8..=7, d = m / -8 (m the signed largest-magnitude weight).
    let mut e = 0.0f64;
    for b in w.chunks_exact(BLOCK) {
        let m = b
            .iter()
            .fold(0.0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = m / -8.0;
        for &x in b {
            let q = libm::roundf(x / d).clamp(-8.0, 7.0);
            e += f64::from(x - d * q).powi(2);
        }
    }
    let s: f64 = w.iter().map(|&a| f64::from(a).powi(2)).sum();
    let uniform = libm::sqrt(e / s);
    assert!(q4 < 0.9 * uniform, "q4 {q4} vs uniform {uniform}");
}

#[test]
fn formats_sizes_names_and_errors() {
    use WeightFormat::*;
    let sizes: Vec<_> = WeightFormat::ALL
        .iter()
        .map(|f| f.row_bytes(768).unwrap())
        .collect();
    assert_eq!(sizes, [3072, 1536, 1536, 24 * 34, 24 * 18]);
    assert_eq!(Q8.row_bytes(33), Some(68));
    assert_eq!(Q4.row_bytes(1), Some(18));
    assert_eq!(Q8.bits_per_weight(), 8.5);
    assert_eq!(Q4.bits_per_weight(), 4.5);
    assert_eq!(F16.matrix_bytes(3, 5), Ok(30));
    assert!(F32.matrix_bytes(usize::MAX / 2, 3).is_err());
    assert_eq!(F32.row_bytes(usize::MAX), None);
    for f in WeightFormat::ALL {
        assert_eq!(f.name().parse::<WeightFormat>(), Ok(f));
        assert_eq!(
            std::format!("{f}").to_uppercase().parse::<WeightFormat>(),
            Ok(f)
        );
    }
    assert!("q5".parse::<WeightFormat>().is_err());

    let mut out = vec![0u8; 34];
    assert!(matches!(
        encode_row(Q8, &[0.0; 32], &mut out[..33]),
        Err(Error::BadLength {
            expected: 34,
            got: 33,
            ..
        })
    ));
    let mut bad = [0.5f32; 32];
    bad[7] = f32::NAN;
    for f in WeightFormat::ALL {
        let mut o = vec![0u8; f.row_bytes(32).unwrap()];
        assert!(
            matches!(encode_row(f, &bad, &mut o), Err(Error::BadArgument(_))),
            "{f}"
        );
    }
    assert!(encode_row(F16, &[1e6], &mut [0u8; 2]).is_err());
    assert!(encode_row(Q8, &[1e10; 32], &mut out).is_err());
    assert!(encode_row(Q8, &[8e6; 32], &mut out).is_ok());
    assert!(decode_row(Q4, &[0u8; 17], &mut [0.0; 32]).is_err());
    // Any bytes decode without panicking.
    let junk: Vec<u8> = (0..34u8).map(|i| i.wrapping_mul(97)).collect();
    let mut r = [0.0f32; 17];
    decode_row(Q8, &junk, &mut r).unwrap();
    decode_row(Q4, &junk[..18], &mut r).unwrap();
}
