//! The fixture model's real log forget gates, for benches and examples that need the
//! decay statistics of a trained model (shared by `cpu/examples/speed.rs` and
//! `benches/attention.rs` through `#[path]`).
//!
//! Heads: layers 1 and 2 of `tests/fixtures/fox-tiny-pro/log_fgate.npy` (4 heads each, 1024
//! positions), repeated periodically to length L. The logit bound U per head is recovered
//! from the model's own thresholds (`acp_threshold.npy`, delta = -(2U + ln 1024) - 10), so
//! core derives delta at length L with ln eps = -10.

use std::path::PathBuf;

/// Heads taken from the fixture (layers 1 and 2, 4 heads each).
pub const HEADS: usize = 8;

/// A little-endian `<f4` C-order `.npy` of the fixture directory: (shape, data).
fn npy_f32(name: &str) -> (Vec<usize>, Vec<f32>) {
    // The run-time CARGO_MANIFEST_DIR (set by cargo run/bench) wins, so that a copied
    // binary finds the repository it runs in; the fixture lives at the workspace root.
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    let path = [".", ".."]
        .iter()
        .map(|up| {
            PathBuf::from(&dir)
                .join(up)
                .join("tests/fixtures/fox-tiny-pro")
                .join(name)
        })
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} not found from {dir}"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).expect("npy header");
    assert!(
        header.contains("'<f4'") && header.contains("'fortran_order': False"),
        "{name}: {header}"
    );
    let shape = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("npy shape")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("npy dim"))
        .collect();
    let data = bytes[10 + hlen..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (shape, data)
}

/// The fixture's gates for [`HEADS`] heads repeated to `l` positions, in `[1, l, HEADS]`
/// (seq-first) order, and the logit bound U per head.
pub fn real_gates(l: usize) -> (Vec<f32>, Vec<f64>) {
    let (gs, g) = npy_f32("log_fgate.npy");
    assert_eq!(gs, [4, 4, 1024]);
    let (_, thr) = npy_f32("acp_threshold.npy");
    let heads: Vec<(usize, usize)> = (1..3).flat_map(|ly| (0..4).map(move |h| (ly, h))).collect();
    let mut out = vec![0.0f32; l * HEADS];
    for t in 0..l {
        for (h, &(ly, hh)) in heads.iter().enumerate() {
            out[t * HEADS + h] = g[(ly * 4 + hh) * 1024 + t % 1024];
        }
    }
    let u = heads
        .iter()
        .map(|&(ly, hh)| (-f64::from(thr[ly * 4 + hh]) - (1024f64).ln() - 10.0) / 2.0)
        .collect();
    (out, u)
}
