//! Dense linear layers per weight format at the FoX-125M / 760M layer shapes
//! (`W [out, in]`: q/k/v/o/ogate D x D, MLP gate+up 2I x D, down D x I, LM head 50257 x D
//! with D = 768, I = 1792 and D = 1536, I = 3584), against the DRAM read bandwidth measured
//! in the same run. Run: `cargo bench -p foxedge-cpu --bench linear` (a name filter such
//! as `matvec/768x768` picks a part).
//!
//! - `dram_read/{t}t`: a sum over a 512 MiB buffer split over `t` threads (bytes/s).
//! - `matvec/{out}x{in}/{fmt}/{t}t`: one activation row; weight bytes/s, with a pool of
//!   copies of the matrix (256 MiB in all) cycled so that every call reads from DRAM, as a
//!   decode step does. `q8-canonical` streams the canonical 34-byte blocks row by row
//!   (AVX-512 VNNI, written here only to measure the packed layout against).
//! - `matmul/{out}x{in}/rows{r}/{fmt}/{t}t`: `r` activation rows; FLOP/s (`2 r out in`)
//!   for f32 / f16 / bf16, int8 OP/s for Q8 / Q4; `f32-gemm` is the gemm crate.
//! - `quantize/768x768/{encode,pack}/{fmt}`: load-time conversion, weights/s.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use foxedge_core::quant::{WeightFormat, encode_row};
use foxedge_cpu::limits;
use foxedge_cpu::linear::{Matrix, PackedWeights, Weights, linear};
use half::{bf16, f16};
use std::hint::black_box;
use std::time::Duration;

const POOL_BYTES: usize = 256 << 20;

/// Deterministic values in [-scale, scale).
fn values(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// One weight matrix in a benchmarked form.
#[derive(Clone)]
enum Stored {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    Packed(PackedWeights),
    Canonical(Vec<u8>),
}

impl Stored {
    fn new(name: &str, w: &[f32], out: usize, inp: usize) -> Stored {
        let blocks = |f: WeightFormat| {
            let rb = f.row_bytes(inp).unwrap_or(0);
            let mut b = vec![0u8; out * rb];
            for (r, d) in w.chunks_exact(inp).zip(b.chunks_exact_mut(rb)) {
                encode_row(f, r, d).expect("finite weights");
            }
            b
        };
        match name {
            "f32" => Stored::F32(w.to_vec()),
            "f16" => Stored::F16(w.iter().map(|&v| f16::from_f32(v)).collect()),
            "bf16" => Stored::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
            "q8-canonical" => Stored::Canonical(blocks(WeightFormat::Q8)),
            f => {
                let f: WeightFormat = f.parse().expect("format name");
                let b = blocks(f);
                let ws = Weights::from_bytes(f, &b, out, inp).expect("shape");
                Stored::Packed(PackedWeights::pack(&ws, 2).expect("block format"))
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Stored::F32(v) => v.len() * 4,
            Stored::F16(v) => v.len() * 2,
            Stored::Bf16(v) => v.len() * 2,
            Stored::Packed(p) => p.format().matrix_bytes(p.out(), p.inp()).unwrap_or(0),
            Stored::Canonical(b) => b.len(),
        }
    }

    fn matrix(&self, out: usize, inp: usize) -> Option<Matrix<'_>> {
        Some(match self {
            Stored::F32(v) => Weights::f32(v, out, inp).ok()?.into(),
            Stored::F16(v) => Weights::f16(v, out, inp).ok()?.into(),
            Stored::Bf16(v) => Weights::bf16(v, out, inp).ok()?.into(),
            Stored::Packed(p) => p.into(),
            Stored::Canonical(_) => return None,
        })
    }

    fn run(&self, out: usize, inp: usize, x: &[f32], rows: usize, y: &mut [f32], threads: usize) {
        match (self, self.matrix(out, inp)) {
            (_, Some(m)) => linear(m, x, rows, y, false, threads).expect("shapes"),
            (Stored::Canonical(b), None) => canonical::matvec(b, inp, x, y, threads),
            _ => unreachable!("every form runs"),
        }
    }
}

const FORMATS: [&str; 5] = ["f32", "f16", "bf16", "q8", "q4"];

const MATVEC_SHAPES: [(usize, usize); 7] = [
    (768, 768),
    (3584, 768),
    (768, 1792),
    (50257, 768),
    (1536, 1536),
    (7168, 1536),
    (1536, 3584),
];

fn bench_dram(c: &mut Criterion) {
    let mut g = c.benchmark_group("dram_read");
    g.sample_size(10);
    let n = 1usize << 27;
    let buf: Vec<f32> = (0..n).map(|i| i as f32).collect();
    g.throughput(Throughput::Bytes((n * 4) as u64));
    for threads in [1, 2] {
        let parts: Vec<&[f32]> = buf.chunks(n.div_ceil(threads)).collect();
        g.bench_function(format!("{threads}t"), |b| {
            b.iter(|| {
                rayon::broadcast(|ctx| {
                    parts
                        .get(ctx.index())
                        .map(|p| black_box(limits::read_pass(p)))
                })
            })
        });
    }
    g.finish();
}

fn bench_matvec(c: &mut Criterion) {
    let canon: &[&str] = if canonical::available() {
        &["q8-canonical"]
    } else {
        &[]
    };
    for (out, inp) in MATVEC_SHAPES {
        let mut g = c.benchmark_group(format!("matvec/{out}x{inp}"));
        g.sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        let w = values(out * inp, 0.05, 1);
        let x = values(inp, 1.0, 2);
        let mut y = vec![0.0f32; out];
        for &name in FORMATS.iter().chain(canon) {
            let one = Stored::new(name, &w, out, inp);
            let pool: Vec<Stored> = (0..POOL_BYTES.div_ceil(one.bytes()).max(2))
                .map(|_| one.clone())
                .collect();
            g.throughput(Throughput::Bytes(one.bytes() as u64));
            for threads in [1, 2] {
                let mut i = 0;
                g.bench_function(BenchmarkId::new(name, format!("{threads}t")), |b| {
                    b.iter(|| {
                        i = (i + 1) % pool.len();
                        pool[i].run(out, inp, black_box(&x), 1, &mut y, threads);
                    })
                });
            }
        }
        g.finish();
    }
}

fn bench_matmul(c: &mut Criterion) {
    for (out, inp) in [(768, 768), (3584, 768)] {
        for rows in [64, 512] {
            let mut g = c.benchmark_group(format!("matmul/{out}x{inp}/rows{rows}"));
            g.sample_size(10)
                .warm_up_time(Duration::from_secs(1))
                .measurement_time(Duration::from_secs(2));
            g.throughput(Throughput::Elements((2 * rows * out * inp) as u64));
            let w = values(out * inp, 0.05, 3);
            let x = values(rows * inp, 1.0, 4);
            let mut y = vec![0.0f32; rows * out];
            for name in FORMATS {
                let one = Stored::new(name, &w, out, inp);
                for threads in [1, 2] {
                    g.bench_function(BenchmarkId::new(name, format!("{threads}t")), |b| {
                        b.iter(|| one.run(out, inp, black_box(&x), rows, &mut y, threads))
                    });
                }
            }
            for threads in [1, 2] {
                g.bench_function(BenchmarkId::new("f32-gemm", format!("{threads}t")), |b| {
                    b.iter(|| gemm_f32(&w, out, inp, black_box(&x), rows, &mut y, threads))
                });
            }
            g.finish();
        }
    }
}

#[path = "common/canonical.rs"]
mod canonical;
#[path = "common/gemm_ref.rs"]
mod gemm_ref;
use gemm_ref::gemm_f32;

/// Load-time cost of the scalar quantizers (`foxedge_core::quant::encode_row`) and of
/// repacking, per 768 x 768 matrix on one thread (weights/s).
fn bench_quantize(c: &mut Criterion) {
    let (out, inp) = (768, 768);
    let w = values(out * inp, 0.05, 5);
    let mut g = c.benchmark_group("quantize/768x768");
    g.sample_size(10)
        .throughput(Throughput::Elements((out * inp) as u64));
    for f in [WeightFormat::F16, WeightFormat::Q8, WeightFormat::Q4] {
        let rb = f.row_bytes(inp).unwrap_or(0);
        let mut b = vec![0u8; out * rb];
        g.bench_function(BenchmarkId::new("encode", f.name()), |bch| {
            bch.iter(|| {
                for (r, d) in w.chunks_exact(inp).zip(b.chunks_exact_mut(rb)) {
                    encode_row(f, black_box(r), d).expect("finite weights");
                }
            })
        });
        if f.is_block() {
            let ws = Weights::from_bytes(f, &b, out, inp).expect("shape");
            g.bench_function(BenchmarkId::new("pack", f.name()), |bch| {
                bch.iter(|| PackedWeights::pack(black_box(&ws), 1).expect("block format"))
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_dram,
    bench_matvec,
    bench_matmul,
    bench_quantize
);
criterion_main!(benches);
