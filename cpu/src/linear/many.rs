//! Several products on the same activations in one parallel region:
//! `y_k (+)= x W_kᵀ` for `k < n`, all `W_k` `[out_k, inp]`.
//!
//! A transformer block applies several matrices to one normed row (q, k, v, the gates):
//! each alone is too small to split over threads at a profit when decoding (a 768 x 768
//! Q8 matrix is 0.6 MB, ~30 µs of DRAM time, the same order as a fork-join). Here the
//! outputs of all products form one index space `0..sum out_k`, split into `threads`
//! contiguous parts (cut at each matrix's kernel granule), so one fork-join serves them
//! all, and `x` is quantized once per block layout instead of once per matrix.
//!
//! Every output is computed by the same kernel, over `inp` in the same order, as
//! [`linear`](super::linear) computes it: the results are bit-identical to separate calls.

use super::act::QuantRows;
use super::float::{self, GRANULE};
use super::int8;
use super::pack::GROUP;
use super::{Data, Matrix, Out};
use crate::simd::Isa;
use core::ops::Range;
use foxedge_core::{Error, Result};

/// One product of [`linear_many`]: `y (+)= x wᵀ`, `y` `[rows, out]` row-major.
#[derive(Debug)]
pub struct Product<'a, 'y> {
    pub w: Matrix<'a>,
    pub y: &'y mut [f32],
    pub accumulate: bool,
}

/// `y_k (+)= x W_kᵀ` for every product, with the widest instruction set of this CPU;
/// `x` is `[rows, inp]` for the common `inp`; `threads` as in [`linear`](super::linear).
///
/// Errors: [`Error::BadLength`] when `x` or a `y` does not match the shapes,
/// [`Error::BadShape`] when the matrices' `inp` differ.
pub fn linear_many(
    products: &mut [Product<'_, '_>],
    x: &[f32],
    rows: usize,
    threads: usize,
) -> Result<()> {
    linear_many_with_isa(Isa::detect(), products, x, rows, threads)
}

/// [`linear_many`] with a chosen instruction set, as [`linear_with_isa`](super::linear_with_isa).
pub fn linear_many_with_isa(
    isa: Isa,
    products: &mut [Product<'_, '_>],
    x: &[f32],
    rows: usize,
    threads: usize,
) -> Result<()> {
    let Some(first) = products.first() else {
        return Ok(());
    };
    let inp = first.w.shape().1;
    for p in products.iter() {
        let (out, i) = p.w.shape();
        if i != inp {
            return Err(Error::BadShape("linear_many: the matrices' inputs differ"));
        }
        super::check_len("linear input x", rows.checked_mul(inp), x.len())?;
        super::check_len("linear output y", rows.checked_mul(out), p.y.len())?;
    }
    if rows == 0 {
        return Ok(());
    }
    // x quantized once per block count (packed matrices pad `inp` to their tiles).
    let mut quant: Vec<(usize, QuantRows)> = Vec::new();
    for p in products.iter() {
        if let Some(b) = blocks_of(&p.w)
            && !quant.iter().any(|(n, _)| *n == b)
        {
            quant.push((b, QuantRows::new(isa, x, rows, inp, b)));
        }
    }
    let xq_of = |w: &Matrix<'_>| -> Option<&QuantRows> {
        let b = blocks_of(w)?;
        quant.iter().find(|(n, _)| *n == b).map(|(_, q)| q)
    };
    let ws: Vec<Matrix<'_>> = products.iter().map(|p| p.w).collect();
    let parts = partition(&ws, threads.max(1));
    let run = |k: usize, r: Range<usize>, y: &mut Out<'_>| {
        range_of(isa, &ws[k], xq_of(&ws[k]), x, rows, r, y)
    };
    if parts.len() <= 1 {
        for (k, p) in products.iter_mut().enumerate() {
            let out = p.w.shape().0;
            let mut y = Out {
                y: &mut *p.y,
                ld: out,
                accumulate: p.accumulate,
            };
            run(k, 0..out, &mut y);
        }
        return Ok(());
    }
    use rayon::prelude::*;
    let done: Vec<Vec<Segment>> = parts
        .into_par_iter()
        .map(|segments| {
            segments
                .into_iter()
                .map(|(k, r)| {
                    let mut buf = vec![0.0f32; rows * r.len()];
                    let ld = r.len();
                    run(
                        k,
                        r.clone(),
                        &mut Out {
                            y: &mut buf,
                            ld,
                            accumulate: false,
                        },
                    );
                    (k, r, buf)
                })
                .collect()
        })
        .collect();
    for (k, r, buf) in done.into_iter().flatten() {
        let p = &mut products[k];
        let mut y = Out {
            ld: p.w.shape().0,
            y: &mut *p.y,
            accumulate: p.accumulate,
        };
        for (t, row) in buf.chunks_exact(r.len()).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                y.put(t, r.start + j, v);
            }
        }
    }
    Ok(())
}

/// A computed part of product `.0`: outputs `.1`, values `[rows, .1.len()]`.
type Segment = (usize, Range<usize>, Vec<f32>);

/// Blocks per quantized activation row for `w`, or None for float weights.
fn blocks_of(w: &Matrix<'_>) -> Option<usize> {
    match w {
        Matrix::Stored(s) => match s.data {
            Data::Blocks(..) => Some(s.inp.div_ceil(32)),
            _ => None,
        },
        Matrix::Packed(p) => Some(p.padded_blocks()),
    }
}

/// Outputs `r` of `x wᵀ` into `y` (columns relative to `r.start`).
fn range_of(
    isa: Isa,
    w: &Matrix<'_>,
    xq: Option<&QuantRows>,
    x: &[f32],
    rows: usize,
    r: Range<usize>,
    y: &mut Out<'_>,
) {
    match (w, xq) {
        (Matrix::Stored(s), _) => match s.data {
            Data::F32(d) => float::range_of(isa, d, s.inp, x, rows, r, y),
            Data::F16(d) => float::range_of(isa, d, s.inp, x, rows, r, y),
            Data::Bf16(d) => float::range_of(isa, d, s.inp, x, rows, r, y),
            Data::Blocks(f, b) => {
                // Canonical blocks run the whole-matrix reference (one segment, see
                // `granule`).
                if let Some(xq) = xq {
                    let y = Out {
                        y: &mut *y.y,
                        ld: y.ld,
                        accumulate: y.accumulate,
                    };
                    int8::reference(f, b, s.out, xq, y);
                }
            }
        },
        (Matrix::Packed(p), Some(xq)) => int8::packed_range(isa, p, xq, r, y),
        (Matrix::Packed(_), None) => {}
    }
}

/// The step at which a matrix's outputs may be cut between tasks.
fn granule(w: &Matrix<'_>) -> usize {
    match w {
        Matrix::Stored(s) => match s.data {
            Data::Blocks(..) => s.out,
            _ => GRANULE,
        },
        Matrix::Packed(_) => GROUP,
    }
}

/// Segments `(matrix, outputs)` of the joint index space in at most `threads` parts of
/// about `sum out / threads` outputs each, every cut at a multiple of the matrix's
/// granule.
fn partition(ws: &[Matrix<'_>], threads: usize) -> Vec<Vec<(usize, Range<usize>)>> {
    let total: usize = ws.iter().map(|w| w.shape().0).sum();
    let per = total.div_ceil(threads).max(1);
    let mut parts = vec![Vec::new()];
    let mut room = per;
    for (k, w) in ws.iter().enumerate() {
        let (out, g) = (w.shape().0, granule(w));
        let mut o = 0;
        while o < out {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let take = room.next_multiple_of(g).min(out - o);
            if let Some(last) = parts.last_mut() {
                last.push((k, o..o + take));
            }
            o += take;
            room = room.saturating_sub(take);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::super::{PackedWeights, Weights, linear_with_isa};
    use super::*;
    use foxedge_core::quant::WeightFormat;
    use proptest::prelude::*;

    fn weights(fmt: WeightFormat, out: usize, inp: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let vals: Vec<f32> = (0..out * inp)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        match fmt {
            WeightFormat::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            WeightFormat::F16 => vals
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            WeightFormat::Bf16 => vals
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            WeightFormat::Q8 | WeightFormat::Q4 => {
                let mut b = vec![0u8; fmt.matrix_bytes(out, inp).unwrap()];
                let rb = b.len() / out;
                for (row, dst) in vals.chunks_exact(inp).zip(b.chunks_exact_mut(rb)) {
                    foxedge_core::quant::encode_row(fmt, row, dst).unwrap();
                }
                b
            }
        }
    }

    /// f32-aligned copy of little-endian bytes.
    fn aligned(b: &[u8]) -> Vec<u32> {
        b.chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect()
    }

    const FORMATS: [WeightFormat; 5] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Bit-identical to one `linear` call per matrix, for any thread count, mixed
        /// formats and sizes, packed or canonical blocks, accumulating or not.
        #[test]
        fn equals_separate_calls(
            outs in proptest::collection::vec((1usize..70, 0usize..5, any::<bool>(), any::<bool>()), 1..5),
            inp in 1usize..100,
            rows in 1usize..6,
            threads in 1usize..5,
            seed in any::<u64>(),
        ) {
            let bytes: Vec<(WeightFormat, usize, Vec<u32>, usize)> = outs
                .iter()
                .enumerate()
                .map(|(i, &(out, f, _, _))| {
                    let fmt = FORMATS[f];
                    let b = weights(fmt, out, inp, seed ^ i as u64);
                    (fmt, out, aligned(&b), b.len())
                })
                .collect();
            let stored: Vec<Weights<'_>> = bytes
                .iter()
                .map(|(fmt, out, w, len)| {
                    let b: &[u8] = &bytemuck_bytes(w)[..*len];
                    Weights::from_bytes(*fmt, b, *out, inp).unwrap()
                })
                .collect();
            let packed: Vec<Option<PackedWeights>> = stored
                .iter()
                .zip(&outs)
                .map(|(w, &(_, f, pack, _))| {
                    (f >= 3 && pack).then(|| PackedWeights::pack(w, 1).unwrap())
                })
                .collect();
            let mats: Vec<Matrix<'_>> = stored
                .iter()
                .zip(&packed)
                .map(|(w, p)| match p {
                    Some(p) => Matrix::from(p),
                    None => Matrix::from(*w),
                })
                .collect();
            let x: Vec<f32> = (0..rows * inp).map(|i| ((i * 7919 + seed as usize) % 97) as f32 / 48.0 - 1.0).collect();
            let init = |out: usize| -> Vec<f32> { (0..rows * out).map(|i| i as f32 * 0.25).collect() };
            for isa in [Isa::detect(), Isa::Scalar] {
                let mut want: Vec<Vec<f32>> = outs.iter().map(|&(o, ..)| init(o)).collect();
                for ((m, y), &(_, _, _, acc)) in mats.iter().zip(&mut want).zip(&outs) {
                    linear_with_isa(isa, *m, &x, rows, y, acc, 1).unwrap();
                }
                let mut got: Vec<Vec<f32>> = outs.iter().map(|&(o, ..)| init(o)).collect();
                let mut products: Vec<Product<'_, '_>> = mats
                    .iter()
                    .zip(got.iter_mut())
                    .zip(&outs)
                    .map(|((m, y), &(_, _, _, acc))| Product { w: *m, y, accumulate: acc })
                    .collect();
                linear_many_with_isa(isa, &mut products, &x, rows, threads).unwrap();
                for (g, w) in got.iter().zip(&want) {
                    let gb: Vec<u32> = g.iter().map(|v| v.to_bits()).collect();
                    let wb: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
                    prop_assert_eq!(gb, wb);
                }
            }
        }

        /// Every output lands in exactly one segment, cut at granules, in at most
        /// `threads` parts.
        #[test]
        fn partition_covers_each_output_once(
            outs in proptest::collection::vec(1usize..300, 1..6),
            threads in 1usize..9,
        ) {
            let data = vec![0.0f32; 300 * 4];
            let mats: Vec<Matrix<'_>> = outs
                .iter()
                .map(|&o| Matrix::from(Weights::f32(&data[..o * 4], o, 4).unwrap()))
                .collect();
            let parts = partition(&mats, threads);
            prop_assert!(parts.len() <= threads);
            let mut seen: Vec<Vec<bool>> = outs.iter().map(|&o| vec![false; o]).collect();
            for (k, r) in parts.iter().flatten() {
                prop_assert_eq!(r.start % GRANULE, 0);
                for o in r.clone() {
                    prop_assert!(!seen[*k][o]);
                    seen[*k][o] = true;
                }
            }
            prop_assert!(seen.iter().flatten().all(|&b| b));
        }
    }

    fn bytemuck_bytes(w: &[u32]) -> &[u8] {
        // SAFETY: u32 has no padding and u8 has alignment 1; the length is in bytes.
        unsafe { core::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) }
    }

    #[test]
    fn mismatched_inputs_are_errors() {
        let a = vec![0.0f32; 8];
        let b = vec![0.0f32; 6];
        let (mut ya, mut yb) = (vec![0.0f32; 2], vec![0.0f32; 2]);
        let mut p = [
            Product {
                w: Weights::f32(&a, 2, 4).unwrap().into(),
                y: &mut ya,
                accumulate: false,
            },
            Product {
                w: Weights::f32(&b, 2, 3).unwrap().into(),
                y: &mut yb,
                accumulate: false,
            },
        ];
        assert!(linear_many(&mut p, &[0.0; 4], 1, 2).is_err());
        let mut yc = vec![0.0f32; 3];
        let mut q = [Product {
            w: Weights::f32(&a, 2, 4).unwrap().into(),
            y: &mut yc,
            accumulate: false,
        }];
        assert!(linear_many(&mut q, &[0.0; 4], 1, 2).is_err());
    }
}
