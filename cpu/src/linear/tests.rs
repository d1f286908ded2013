use super::act::{QuantRows, quantize_row};
use super::*;
use foxedge_core::quant::{BLOCK, encode_row};
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.r#gen::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

/// `W` in `format`, encoded row by row.
fn encode(format: WeightFormat, w: &[f32], out: usize, inp: usize) -> Vec<u8> {
    let rb = format.row_bytes(inp).unwrap();
    let mut bytes = vec![0u8; out * rb];
    for (r, dst) in w.chunks_exact(inp).zip(bytes.chunks_exact_mut(rb)) {
        encode_row(format, r, dst).unwrap();
    }
    bytes
}

/// Equal, NaN equal to NaN.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

/// Each float format on every instruction set and thread count, against the plain
/// reference (within f32 summation-order error: `2 n 2^-24 sum |w x|`, twice the
/// worst-case bound of either order) and the reference against f64 (`n 2^-24 sum |w x|`).
fn check_float(out: usize, inp: usize, rows: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = randn(&mut rng, out * inp, 1.0);
    let x = randn(&mut rng, rows * inp, 1.0);
    let y0 = randn(&mut rng, rows * out, 1.0);
    let w16: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
    let wb16: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let cases = [
        (Weights::f32(&w, out, inp).unwrap(), w.clone()),
        (
            Weights::f16(&w16, out, inp).unwrap(),
            w16.iter().map(|v| v.to_f32()).collect(),
        ),
        (
            Weights::bf16(&wb16, out, inp).unwrap(),
            wb16.iter().map(|v| v.to_f32()).collect(),
        ),
    ];
    for (wts, deq) in cases {
        let f = wts.format();
        let mut want = y0.clone();
        let mut y_ref = Out {
            y: &mut want,
            ld: out,
            accumulate: true,
        };
        match wts.data {
            Data::F32(d) => float::reference(d, inp, &x, rows, &mut y_ref),
            Data::F16(d) => float::reference(d, inp, &x, rows, &mut y_ref),
            Data::Bf16(d) => float::reference(d, inp, &x, rows, &mut y_ref),
            Data::Blocks(..) => unreachable!("float cases only"),
        }
        for t in 0..rows {
            for o in 0..out {
                let (mut e, mut a) = (0.0f64, 0.0f64);
                for i in 0..inp {
                    let p = f64::from(deq[o * inp + i]) * f64::from(x[t * inp + i]);
                    (e, a) = (e + p, a + p.abs());
                }
                let got = f64::from(want[t * out + o] - y0[t * out + o]);
                let tol = inp as f64 * 2f64.powi(-24) * a
                    + 1e-6 * (1.0 + f64::from(y0[t * out + o]).abs());
                assert!(
                    (got - e).abs() <= tol,
                    "{f} reference vs f64 at ({t}, {o}): {got} vs {e}"
                );
            }
        }
        for isa in Isa::available() {
            let mut first: Option<Vec<f32>> = None;
            for threads in [1, 3] {
                let mut y = y0.clone();
                linear_with_isa(isa, wts, &x, rows, &mut y, true, threads).unwrap();
                // The same bits whatever the thread count.
                assert!(first.get_or_insert_with(|| y.clone()) == &y, "{f} {isa:?}");
                for t in 0..rows {
                    for o in 0..out {
                        let a: f32 = (0..inp)
                            .map(|i| (deq[o * inp + i] * x[t * inp + i]).abs())
                            .sum();
                        let tol = 2.0 * inp as f32 * 2f32.powi(-24) * a
                            + 1e-6 * (1.0 + y0[t * out + o].abs());
                        let (g, r) = (y[t * out + o], want[t * out + o]);
                        assert!(
                            (g - r).abs() <= tol,
                            "{f} {isa:?} t{threads} {out}x{inp} rows {rows} ({t}, {o}): {g} vs {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn float_formats_match_reference() {
    for (i, &(out, inp, rows)) in [
        (1, 1, 1),
        (5, 17, 1),
        (37, 259, 1),
        (64, 768, 1),
        (33, 100, 3),
        (19, 64, 9),
        (37, 300, 8),
        (35, 97, 12),
        (70, 130, 70),
    ]
    .iter()
    .enumerate()
    {
        check_float(out, inp, rows, i as u64);
    }
}

/// Packed Q8 / Q4 on every instruction set equal the scalar reference over the canonical
/// blocks bit for bit, for any thread count; the reference is within f32 rounding of the
/// exact f64 product of the quantized operands, and within the activation-quantization
/// bound of the dequantized weights times `x`.
fn check_blocks(
    f: WeightFormat,
    w_bytes: &[u8],
    out: usize,
    inp: usize,
    x: &[f32],
    rows: usize,
    exact_check: bool,
) {
    let w = Weights::from_bytes(f, w_bytes, out, inp).unwrap();
    let mut want = vec![0.0f32; rows * out];
    linear_with_isa(Isa::Scalar, w, x, rows, &mut want, false, 1).unwrap();
    let packed = PackedWeights::pack(&w, 2).unwrap();
    assert_eq!(packed.format(), f);
    for isa in Isa::available() {
        for threads in [1, 2, 5] {
            let mut y = vec![f32::NAN; rows * out];
            linear_with_isa(isa, &packed, x, rows, &mut y, false, threads).unwrap();
            assert!(
                same(&y, &want),
                "{f} {isa:?} threads {threads} {out}x{inp} rows {rows}"
            );
        }
    }
    #[cfg(target_arch = "aarch64")]
    for sdot in [true, false] {
        let xq = QuantRows::new(Isa::Portable, x, rows, inp, packed.view().padded_blocks());
        let mut y = vec![f32::NAN; rows * out];
        neon::run_with(
            sdot,
            &packed.view(),
            &xq,
            0..out,
            &mut Out {
                y: &mut y,
                ld: out,
                accumulate: false,
            },
        );
        assert!(same(&y, &want), "{f} neon sdot={sdot}");
    }
    if !exact_check {
        return;
    }
    let mut deq = vec![0.0f32; out * inp];
    let rb = f.row_bytes(inp).unwrap();
    for (r, d) in w_bytes.chunks_exact(rb).zip(deq.chunks_exact_mut(inp)) {
        foxedge_core::quant::decode_row(f, r, d).unwrap();
    }
    let xq = QuantRows::new(Isa::Scalar, x, rows, inp, inp.div_ceil(BLOCK));
    for t in 0..rows {
        for o in 0..out {
            let (mut exact, mut mag, mut qbound, mut true_y) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
            for k in 0..inp.div_ceil(BLOCK) {
                let dx = f64::from(xq.d[t * xq.blocks + k]);
                let (mut s, mut wabs) = (0.0f64, 0.0f64);
                for i in k * BLOCK..inp.min((k + 1) * BLOCK) {
                    let wd = f64::from(deq[o * inp + i]);
                    s += wd * f64::from(xq.block(t, k)[i - k * BLOCK]);
                    wabs += wd.abs();
                    true_y += wd * f64::from(x[t * inp + i]);
                }
                exact += s * dx;
                mag += (s * dx).abs();
                qbound += dx / 2.0 * wabs;
            }
            let blocks = inp.div_ceil(BLOCK) as f64;
            let got = f64::from(want[t * out + o]);
            let tol = (blocks + 2.0) * 2f64.powi(-24) * mag + 1e-30;
            assert!(
                (got - exact).abs() <= tol,
                "{f} ({t}, {o}): {got} vs exact {exact}"
            );
            assert!(
                (got - true_y).abs() <= qbound * 1.0001 + tol,
                "{f} ({t}, {o}) vs x Wᵀ"
            );
        }
    }
}

#[test]
fn block_formats_match_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    for &(out, inp, rows) in &[
        (1, 32, 1),
        (16, 64, 1),
        (17, 96, 2),
        (40, 33, 5),
        (100, 768, 1),
        (35, 256, 13),
        (48, 200, 70),
    ] {
        let w = randn(&mut rng, out * inp, 0.05);
        let x = randn(&mut rng, rows * inp, 2.0);
        for f in [WeightFormat::Q8, WeightFormat::Q4] {
            check_blocks(f, &encode(f, &w, out, inp), out, inp, &x, rows, true);
        }
    }
}

#[test]
fn any_block_bytes_give_reference_bits() {
    // Random bytes: scales of every kind (NaN, inf, subnormal), Q8 values of -128.
    let mut rng = StdRng::seed_from_u64(4);
    for f in [WeightFormat::Q8, WeightFormat::Q4] {
        let (out, inp, rows) = (21, 160, 3);
        let mut bytes: Vec<u8> = (0..f.matrix_bytes(out, inp).unwrap())
            .map(|_| rng.r#gen())
            .collect();
        // Keep most scales finite so the comparison is not all NaN.
        for blk in bytes.chunks_exact_mut(f.unit_bytes()).skip(1).step_by(3) {
            blk[1] &= 0x3f;
        }
        let mut x = randn(&mut rng, rows * inp, 1.0);
        x[5] = f32::NAN;
        x[inp + 40] = f32::INFINITY;
        check_blocks(f, &bytes, out, inp, &x, rows, false);
    }
}

#[test]
fn activation_quantization() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut x = randn(&mut rng, 200, 3.0);
    x[70] = f32::NAN;
    x[150..160].fill(0.0);
    x[128..150].fill(0.0);
    x[160..192].fill(0.0);
    let blocks = 8;
    let (mut qs, mut d, mut bias) = (vec![0i8; 256], vec![0.0f32; blocks], vec![0i32; blocks]);
    quantize_row(&x, &mut qs, &mut d, &mut bias);
    for isa in Isa::available() {
        let q = QuantRows::new(isa, &x, 1, 200, blocks);
        assert_eq!(q.qs, qs, "{isa:?}");
        assert!(same(&q.d, &d) && q.bias == bias, "{isa:?}");
    }
    assert!(d[2].is_nan() && qs[64..96].iter().all(|&v| v == 0) && bias[2] == 0);
    // Blocks so small that 127 / max|x| overflows quantize to zero on every ISA (a fuzz
    // finding: the SIMD conversions of inf and NaN differ from Rust's saturating `as`).
    let tiny: Vec<f32> = [1e-38f32, -3e-39, 1e-45, 0.0, 2e-37, -1e-40, 3e-37, 1e-44]
        .iter()
        .cycle()
        .take(96)
        .enumerate()
        .map(|(i, &v)| if i < 64 { v } else { v * 1e4 })
        .collect();
    let (mut tq, mut td, mut tb) = (vec![0i8; 96], vec![0.0f32; 3], vec![0i32; 3]);
    quantize_row(&tiny, &mut tq, &mut td, &mut tb);
    for isa in Isa::available() {
        let q = QuantRows::new(isa, &tiny, 1, 96, 3);
        assert!(
            q.qs == tq && same(&q.d, &td) && q.bias == tb,
            "{isa:?} tiny blocks"
        );
    }
    assert!(tq[..32].iter().all(|&v| v == 0) && tq[64..].iter().any(|&v| v != 0));
    assert!(d[4] == 0.0 && d[5] == 0.0 && d[7] == 0.0);
    for k in [0, 1, 3, 6] {
        let blk = &x[k * 32..200.min((k + 1) * 32)];
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(d[k], amax / 127.0);
        let sum: i32 = qs[k * 32..(k + 1) * 32].iter().map(|&v| i32::from(v)).sum();
        assert_eq!(bias[k], -128 * sum);
        for (i, &v) in blk.iter().enumerate() {
            let q = qs[k * 32 + i];
            assert!(q.unsigned_abs() <= 127);
            assert!(
                (v - d[k] * f32::from(q)).abs() <= d[k] * 0.5 * (1.0 + 1e-5),
                "block {k}"
            );
        }
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let w = vec![0.5f32; 12];
    assert!(matches!(
        Weights::f32(&w, 3, 5),
        Err(Error::BadLength {
            expected: 60,
            got: 48,
            ..
        })
    ));
    assert!(matches!(Weights::f32(&[], 0, 5), Err(Error::BadShape(_))));
    let ok = Weights::f32(&w, 3, 4).unwrap();
    assert_eq!((ok.format(), ok.out(), ok.inp()), (WeightFormat::F32, 3, 4));
    let mut y = vec![0.0; 6];
    assert!(matches!(
        linear(ok, &[1.0; 7], 2, &mut y, false, 1),
        Err(Error::BadLength {
            what: "linear input x",
            ..
        })
    ));
    assert!(matches!(
        linear(ok, &[1.0; 8], 2, &mut y[..5], false, 1),
        Err(Error::BadLength {
            what: "linear output y",
            ..
        })
    ));
    linear(ok, &[1.0; 8], 2, &mut y, false, 1).unwrap();
    assert_eq!(y, [2.0; 6]);
    assert!(linear(ok, &[], 0, &mut [], false, 1).is_ok());
    // Misaligned float bytes are refused; block bytes need no alignment.
    let mut buf = [0u8; 64];
    let start = buf.as_ptr().align_offset(4);
    buf[start..start + 4].copy_from_slice(&2.0f32.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&(-3.0f32).to_le_bytes());
    let from_bytes = Weights::from_bytes(WeightFormat::F32, &buf[start..start + 8], 1, 2).unwrap();
    let mut y1 = [0.0f32];
    linear(from_bytes, &[1.0, 1.0], 1, &mut y1, false, 1).unwrap();
    assert_eq!(y1, [-1.0]);
    let mis = &buf[start + 1..start + 9];
    assert!(matches!(
        Weights::from_bytes(WeightFormat::F32, mis, 1, 2),
        Err(Error::BadArgument(_))
    ));
    let mis16 = &buf[start + 1..start + 5];
    assert!(matches!(
        Weights::from_bytes(WeightFormat::Bf16, mis16, 1, 2),
        Err(Error::BadArgument(_))
    ));
    assert!(Weights::from_bytes(WeightFormat::F16, &buf[start..start + 4], 1, 2).is_ok());
    assert!(Weights::from_bytes(WeightFormat::Q8, &buf[start + 1..start + 1 + 34], 1, 20).is_ok());
    assert!(matches!(
        Weights::from_bytes(WeightFormat::Q4, &buf[..17], 1, 20),
        Err(Error::BadLength { .. })
    ));
    assert!(matches!(
        PackedWeights::pack(&ok, 1),
        Err(Error::BadArgument(_))
    ));
}

/// Quantizing group by group gives the tiles of encode-then-pack; a view of stored tiles
/// (any alignment), and an owned copy of it, multiply as the packed original; each row
/// reads back as `decode_row` of the canonical row.
fn check_packed_forms(f: WeightFormat, out: usize, inp: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = randn(&mut rng, out * inp, 0.5);
    let canon = encode(f, &w, out, inp);
    let packed =
        PackedWeights::pack(&Weights::from_bytes(f, &canon, out, inp).unwrap(), 1).unwrap();
    for threads in [1, 3] {
        let q = PackedWeights::quantize(f, out, inp, threads, |r, buf: &mut [f32]| {
            buf.copy_from_slice(&w[r * inp..(r + 1) * inp]);
            Ok::<(), Error>(())
        })
        .unwrap();
        assert_eq!(q.view().tiles(), packed.view().tiles(), "{f} {out}x{inp}");
    }
    let bytes = packed.view().tiles();
    assert_eq!(
        bytes.len(),
        PackedWeights::packed_bytes(f, out, inp).unwrap()
    );
    // The tiles one byte past an aligned start, read in place and copied.
    let mut odd = vec![0u8; bytes.len() + 1];
    odd[1..].copy_from_slice(bytes);
    let view = PackedView::new(f, &odd[1..], out, inp).unwrap();
    let copy = PackedWeights::copy_of(&view).unwrap();
    assert!(copy.view().tiles().as_ptr().align_offset(64) == 0);
    let rows = 3;
    let x = randn(&mut rng, rows * inp, 1.0);
    let mut want = vec![0.0f32; rows * out];
    linear(&packed, &x, rows, &mut want, false, 1).unwrap();
    for m in [Matrix::from(view), Matrix::from(&copy)] {
        let mut y = vec![0.0f32; rows * out];
        linear(m, &x, rows, &mut y, false, 2).unwrap();
        assert!(same(&y, &want), "{f} {out}x{inp}");
    }
    let rb = f.row_bytes(inp).unwrap();
    let (mut got, mut exp) = (vec![0.0f32; inp], vec![0.0f32; inp]);
    for r in 0..out {
        view.row(r, &mut got).unwrap();
        foxedge_core::quant::decode_row(f, &canon[r * rb..(r + 1) * rb], &mut exp).unwrap();
        assert!(same(&got, &exp), "{f} row {r}");
    }
    assert!(view.first_bad_scale().is_none());
}

#[test]
fn packed_forms_agree() {
    for (i, &(out, inp)) in [(1, 1), (16, 64), (17, 65), (40, 300), (5, 32)]
        .iter()
        .enumerate()
    {
        for f in [WeightFormat::Q8, WeightFormat::Q4] {
            check_packed_forms(f, out, inp, i as u64);
        }
    }
}

#[test]
fn packed_views_reject_bad_input() {
    let n = PackedWeights::packed_bytes(WeightFormat::Q8, 20, 40).unwrap();
    assert_eq!(n, 2 * 1088, "two groups of one tile");
    let buf = vec![0u8; n + 1];
    assert!(matches!(
        PackedView::new(WeightFormat::Q8, &buf, 20, 40),
        Err(Error::BadLength { .. })
    ));
    assert!(matches!(
        PackedView::new(WeightFormat::F16, &buf[..n], 20, 40),
        Err(Error::BadArgument(_))
    ));
    assert!(matches!(
        PackedView::new(WeightFormat::Q4, &buf[..0], 0, 40),
        Err(Error::BadShape(_))
    ));
    assert!(PackedWeights::packed_bytes(WeightFormat::Q4, usize::MAX, usize::MAX).is_err());
    let v = PackedView::new(WeightFormat::Q8, &buf[..n], 20, 40).unwrap();
    let mut row = vec![0.0f32; 40];
    assert!(v.row(20, &mut row).is_err());
    assert!(v.row(0, &mut row[..39]).is_err());
    // A NaN scale in a padding row (row 31 of group 1, block 1) is found.
    let mut bad = buf[..n].to_vec();
    let at = 1088 + 32 + 2 * 15;
    bad[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
    let v = PackedView::new(WeightFormat::Q8, &bad, 20, 40).unwrap();
    assert_eq!(v.first_bad_scale(), Some((31, 1)));
    // A row that fails to quantize is the quantizer's error.
    let e = PackedWeights::quantize(WeightFormat::Q4, 3, 8, 1, |r, buf: &mut [f32]| {
        buf.fill(if r == 2 { f32::NAN } else { 1.0 });
        Ok::<(), Error>(())
    });
    assert!(matches!(e, Err(Error::BadArgument(_))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any shape: packed block kernels give the reference's bits, float kernels stay
    /// within the summation-order bound.
    #[test]
    fn any_shape(out in 1usize..40, inp in 1usize..300, rows in 1usize..12, seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let w = randn(&mut rng, out * inp, 0.1);
        let x = randn(&mut rng, rows * inp, 1.0);
        for f in [WeightFormat::Q8, WeightFormat::Q4] {
            check_blocks(f, &encode(f, &w, out, inp), out, inp, &x, rows, false);
        }
        check_float(out, inp, rows.min(5), seed);
    }
}

/// Up to 64 activation rows, each row's outputs are the same bits whether the row is
/// alone (a decode step's matrix-vector product) or among others (sessions decoding in one
/// batch), for every format on every instruction set.
#[test]
fn a_row_alone_equals_the_row_among_others() {
    let (out, inp) = (37, 259);
    let mut rng = StdRng::seed_from_u64(41);
    let wf = randn(&mut rng, out * inp, 1.0);
    let w16: Vec<half::f16> = wf.iter().map(|&v| half::f16::from_f32(v)).collect();
    let wb16: Vec<half::bf16> = wf.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let q8 = encode(WeightFormat::Q8, &wf, out, inp);
    let q4 = encode(WeightFormat::Q4, &wf, out, inp);
    let p8 = PackedWeights::pack(
        &Weights::from_bytes(WeightFormat::Q8, &q8, out, inp).unwrap(),
        1,
    )
    .unwrap();
    let p4 = PackedWeights::pack(
        &Weights::from_bytes(WeightFormat::Q4, &q4, out, inp).unwrap(),
        1,
    )
    .unwrap();
    let mats: [Matrix<'_>; 5] = [
        Weights::f32(&wf, out, inp).unwrap().into(),
        Weights::f16(&w16, out, inp).unwrap().into(),
        Weights::bf16(&wb16, out, inp).unwrap().into(),
        (&p8).into(),
        (&p4).into(),
    ];
    for rows in [2, 3, 5, 8, 12, 17, ROW_EXACT_ROWS] {
        let x = randn(&mut rng, rows * inp, 1.0);
        let y0 = randn(&mut rng, rows * out, 1.0);
        for (name, &m) in ["f32", "f16", "bf16", "q8", "q4"].iter().zip(&mats) {
            for isa in Isa::available() {
                let mut all = y0.clone();
                linear_with_isa(isa, m, &x, rows, &mut all, true, 2).unwrap();
                for t in 0..rows {
                    let mut one = y0[t * out..(t + 1) * out].to_vec();
                    let xr = &x[t * inp..(t + 1) * inp];
                    linear_with_isa(isa, m, xr, 1, &mut one, true, 1).unwrap();
                    assert!(
                        same(&one, &all[t * out..(t + 1) * out]),
                        "{name} {isa:?}: row {t} of {rows}"
                    );
                }
            }
        }
    }
}
