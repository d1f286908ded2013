//! Shared test helpers: deterministic random problems, error norms, a minimal .npy reader.
#![allow(dead_code)]

use foxedge_cpu::{AttentionShape, Layout, Storage};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

/// `||a - b|| / ||b||` (L2 over all elements).
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

pub fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

pub fn to_f64<T: Storage>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| f64::from(v.to_f32())).collect()
}

pub fn convert<T: Storage>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

/// A random problem: q, k, v ~ N(0, 1) scaled by `qk_scale` for q and k, log gates
/// `logsigmoid(z)`, `z ~ N(gate_mu, 2)`.
pub struct Problem {
    pub shape: AttentionShape,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
}

pub fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller: enough for tests.
    let u1: f64 = rng.gen_range(1e-12..1.0);
    let u2: f64 = rng.r#gen();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

pub fn logsigmoid(z: f32) -> f32 {
    let z = z as f64;
    (z.min(0.0) - (-z.abs()).exp().ln_1p()) as f32
}

#[allow(clippy::too_many_arguments)]
pub fn problem(
    seed: u64,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    layout: Layout,
    gate_mu: f32,
) -> Problem {
    let shape = AttentionShape {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        layout,
    };
    shape.validate().unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let q = (0..shape.q_len()).map(|_| normal(&mut rng)).collect();
    let k = (0..shape.kv_len()).map(|_| normal(&mut rng)).collect();
    let v = (0..shape.kv_len()).map(|_| normal(&mut rng)).collect();
    let g = (0..shape.gate_len())
        .map(|_| logsigmoid(gate_mu + 2.0 * normal(&mut rng)))
        .collect();
    Problem { shape, q, k, v, g }
}

/// The fixture file `name`; `CARGO_MANIFEST_DIR` at run time wins over the build-time
/// one, so a test binary copied to another machine finds the repository it runs in.
pub fn fixture_path(name: &str) -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    PathBuf::from(dir)
        .join("../tests/fixtures/fox-tiny-pro")
        .join(name)
}

/// Reads a little-endian .npy file of `<f4` or `<i4` (C or Fortran order):
/// `(shape, values as f64 in C order)`.
pub fn npy(name: &str) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(fixture_path(name)).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let (hlen, hstart) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = std::str::from_utf8(&bytes[hstart..hstart + hlen]).unwrap();
    let fortran = header.contains("'fortran_order': True");
    let shape_str = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_str
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data = &bytes[hstart + hlen..];
    let vals: Vec<f64> = if header.contains("'<f4'") {
        data.chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect()
    } else if header.contains("'<i4'") {
        data.chunks_exact(4)
            .map(|b| f64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect()
    } else {
        panic!("unsupported dtype in {name}: {header}");
    };
    assert_eq!(vals.len(), shape.iter().product::<usize>());
    if !fortran {
        return (shape, vals);
    }
    // Column-major: element (i0, i1, ..) sits at i0 + n0 * (i1 + n1 * (..)).
    let mut strides = vec![1usize; shape.len()];
    for a in 1..shape.len() {
        strides[a] = strides[a - 1] * shape[a - 1];
    }
    let mut c_order = Vec::with_capacity(vals.len());
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..vals.len() {
        c_order.push(vals[idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>()]);
        for a in (0..shape.len()).rev() {
            idx[a] += 1;
            if idx[a] < shape[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    (shape, c_order)
}
