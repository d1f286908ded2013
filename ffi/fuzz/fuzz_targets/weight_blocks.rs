//! Fuzzes the weight formats of `foxedge_core::quant` and the kernels of
//! `foxedge_cpu::linear`: a format, a small shape, weight bytes (sometimes of the wrong
//! length, sometimes misaligned) and activation bits, all from the input.
//!
//! Every byte string must be accepted or refused with an error, never a panic: the row
//! decoder, `Weights::from_bytes`, `PackedWeights::pack` and `linear`. For the block
//! formats, every instruction set and thread count must return the scalar reference's
//! bits (NaN where the reference has NaN); re-encoding decoded finite rows must succeed.
#![no_main]

use foxedge_core::quant::{WeightFormat, decode_row, encode_row};
use foxedge_cpu::Isa;
use foxedge_cpu::linear::{PackedWeights, Weights, linear_with_isa};
use libfuzzer_sys::fuzz_target;

/// Reads the input front to back; zeros once exhausted.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

fuzz_target!(|data: &[u8]| {
    let mut r = Bytes(data);
    let format = WeightFormat::ALL[usize::from(r.u8() % 5)];
    let out = usize::from(r.u8() % 40);
    let inp = usize::from(r.u16() % 300);
    let rows = usize::from(r.u8() % 6);
    let flags = r.u8();
    let want = format.matrix_bytes(out, inp).unwrap_or(0);
    let len = match flags % 8 {
        0 => want.saturating_sub(1 + usize::from(r.u8())),
        1 => want + 1,
        _ => want,
    };
    // From an 8-byte boundary; `flags & 8` shifts the view by one byte.
    let shift = usize::from(flags & 8 != 0);
    let mut store = vec![0u8; len + 16];
    let at = store.as_ptr().align_offset(8).min(8) + shift;
    for v in &mut store[at..at + len] {
        *v = r.u8();
    }
    let view = &store[at..at + len];
    let x: Vec<f32> = (0..rows * inp)
        .map(|_| {
            let b = r.u8();
            if b < 224 { (f32::from(b) - 112.0) / 16.0 } else { f32::from_bits(u32::from(r.u16()) << 16 | u32::from(r.u16())) }
        })
        .collect();

    if out > 0 && inp > 0 && len == want {
        let rb = want / out;
        let mut row = vec![0.0f32; inp];
        for src in view.chunks_exact(rb) {
            decode_row(format, src, &mut row).expect("a row of the right length decodes");
            if row.iter().all(|v| v.abs() < 8e6) {
                let mut enc = vec![0u8; rb];
                let ok = encode_row(format, &row, &mut enc);
                assert!(ok.is_ok(), "{format}: {ok:?}");
            }
        }
    }

    let Ok(w) = Weights::from_bytes(format, view, out, inp) else {
        return;
    };
    let mut reference = vec![0.0f32; rows * out];
    linear_with_isa(Isa::Scalar, w, &x, rows, &mut reference, false, 1).expect("shapes match");
    if !format.is_block() {
        for isa in Isa::available() {
            let mut y = vec![0.0f32; rows * out];
            linear_with_isa(isa, w, &x, rows, &mut y, true, 3).expect("shapes match");
        }
        return;
    }
    let packed = PackedWeights::pack(&w, 2).expect("block formats pack");
    for isa in Isa::available() {
        for threads in [1, 3] {
            let mut y = vec![f32::NAN; rows * out];
            linear_with_isa(isa, &packed, &x, rows, &mut y, false, threads).expect("shapes match");
            assert!(same(&y, &reference), "{format} {isa:?} threads {threads}");
        }
    }
});
