//! Shared test helpers: device or skip, random inputs, a plain f64 reference, .npy reading.
#![allow(dead_code)]

use foxedge_vulkan::{AttentionShape, Layout, Vulkan};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The Vulkan device, or `None` when there is none: the test then prints why it skips and
/// passes, unless `CI` is set (to anything but "", "0" or "false"), where a missing device
/// fails it, so a CI machine that should have one (lavapipe) never skips in silence.
pub fn device() -> Option<Vulkan> {
    match Vulkan::new() {
        Ok(v) => {
            eprintln!("vulkan device: {}", v.info());
            Some(v)
        }
        Err(e) => {
            let test = test_name();
            if ci() {
                panic!("{test}: CI is set, so a Vulkan device is required: {e}");
            }
            eprintln!("SKIPPED {test}: no Vulkan device ({e}); with CI set this fails");
            None
        }
    }
}

/// Whether `CI` is set, and not to "", "0" or "false".
fn ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| {
        let v = v.to_string_lossy();
        !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false")
    })
}

/// The running test's name: the test harness names each test's thread after it.
pub fn test_name() -> String {
    std::thread::current().name().unwrap_or("test").to_owned()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ 0x5eed_f0e5)
}

pub fn randn(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Sum of uniforms: cheap, bounded, roughly normal.
            let s: f32 = (0..4).map(|_| r.r#gen::<f32>() - 0.5).sum();
            s * scale * 1.7
        })
        .collect()
}

/// Log forget gates: logsigmoid of logits around `bias` (more negative = faster decay).
pub fn log_gates(r: &mut StdRng, n: usize, bias: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x = bias + 2.0 * (r.r#gen::<f32>() - 0.5);
            x.min(0.0) - (-x.abs()).exp().ln_1p()
        })
        .collect()
}

/// Plain f64 forgetting attention over the caller's layout (inputs as f64).
/// Returns (out [q layout], lse [b, h, t]).
pub fn reference_prefill(
    sh: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f32],
    seq_start: Option<&[usize]>,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let d = sh.head_dim;
    let mut out = vec![0.0; sh.q_len()];
    let mut lse = vec![f64::NEG_INFINITY; sh.batch * sh.heads_q * sh.seq_q];
    for b in 0..sh.batch {
        let ks = seq_start.map_or(0, |s| s[b]);
        for h in 0..sh.heads_q {
            let hk = h / sh.group();
            let mut c = vec![0.0f64; sh.seq_k];
            let mut acc = 0.0;
            for (j, cj) in c.iter_mut().enumerate() {
                acc += f64::from(g[sh.gate_at(b, j, h)]);
                *cj = acc;
            }
            for t in 0..sh.seq_q {
                let i = sh.q_offset() + t;
                if i < ks {
                    continue;
                }
                let qo = sh.q_at(b, t, h);
                let logits: Vec<f64> = (ks..=i)
                    .map(|j| {
                        let ko = sh.kv_at(b, j, hk);
                        let dot: f64 = (0..d).map(|x| q[qo + x] * k[ko + x]).sum();
                        scale * dot + c[i] - c[j]
                    })
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = w.iter().sum();
                for (n, j) in (ks..=i).enumerate() {
                    let vo = sh.kv_at(b, j, hk);
                    for x in 0..d {
                        out[qo + x] += w[n] / l * v[vo + x];
                    }
                }
                lse[(b * sh.heads_q + h) * sh.seq_q + t] = m + l.ln();
            }
        }
    }
    (out, lse)
}

pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Largest |a - b| (NaN counts as infinite) and the relative L2 error ‖a-b‖/‖b‖.
pub fn errors(a: &[f32], b: &[f64]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let mut max = 0.0f64;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let e = (f64::from(x) - y).abs();
        max = max.max(if e.is_nan() { f64::INFINITY } else { e });
        num += e * e;
        den += y * y;
    }
    (max, (num / den.max(1e-300)).sqrt())
}

pub fn shape(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    layout: Layout,
) -> AttentionShape {
    AttentionShape {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        head_dim,
        layout,
    }
}

/// Minimal .npy reader for little-endian f32 / i32 arrays (C order, or 2-D Fortran order).
/// Files come from the repository's fixture directory; `FOXEDGE_FIXTURE_DIR` overrides it
/// for a binary that runs from another checkout (the GPU machine's copy of the tree).
pub fn npy_f32(name: &str) -> (Vec<usize>, Vec<f32>) {
    let dir = std::env::var("FOXEDGE_FIXTURE_DIR").unwrap_or_else(|_| {
        format!(
            "{}/../tests/fixtures/fox-tiny-pro",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let path = format!("{dir}/{name}");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{path}: not an npy file");
    let (hlen, h0) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = std::str::from_utf8(&bytes[h0..h0 + hlen]).expect("npy header is ASCII");
    let fortran = header.contains("'fortran_order': True");
    let is_f32 = header.contains("'<f4'");
    assert!(
        is_f32 || header.contains("'<i4'"),
        "{path}: f32 or i32 expected: {header}"
    );
    let shp = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("npy shape");
    let dims: Vec<usize> = shp
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    let data: Vec<f32> = bytes[h0 + hlen..]
        .chunks_exact(4)
        .map(|c| {
            let w = [c[0], c[1], c[2], c[3]];
            if is_f32 {
                f32::from_le_bytes(w)
            } else {
                i32::from_le_bytes(w) as f32
            }
        })
        .collect();
    if fortran && dims.len() == 2 {
        // Column-major [r, c]: element (i, j) at j * r + i; return row-major.
        let (r, c) = (dims[0], dims[1]);
        let t = (0..r * c).map(|x| data[(x % c) * r + x / c]).collect();
        return (dims, t);
    }
    assert!(
        !fortran || dims.len() < 2,
        "{path}: Fortran order only for 2-D arrays"
    );
    (dims, data)
}

/// Random q, k, v ~ N(0, 1) and log gates (`log_gates` with `gate_bias`) for `sh`.
pub fn random_inputs(
    sh: &AttentionShape,
    seed: u64,
    gate_bias: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = rng(seed);
    let q = randn(&mut r, sh.q_len(), 1.0);
    let k = randn(&mut r, sh.kv_len(), 1.0);
    let v = randn(&mut r, sh.kv_len(), 1.0);
    let g = log_gates(&mut r, sh.gate_len(), gate_bias);
    (q, k, v, g)
}
