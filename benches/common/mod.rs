//! What the benches share.

use foxedge::attention::{AcpMode, PrefillInputs};
use foxedge::{Model, Result};
use std::sync::Arc;

#[path = "../../tests/common/workload.rs"]
mod workload;

/// `FOXEDGE_BENCH_LENGTHS` (else `default`): comma-separated token counts, `k` = 1024
/// (e.g. `1k,4k,16k`); counts below 2 are dropped.
pub fn lengths(default: &str) -> Vec<usize> {
    let s = std::env::var("FOXEDGE_BENCH_LENGTHS").unwrap_or_else(|_| default.into());
    s.split(',')
        .filter_map(|x| {
            let x = x.trim();
            match x.strip_suffix(['k', 'K']) {
                Some(n) => n.parse::<usize>().ok().map(|n| n * 1024),
                None => x.parse().ok(),
            }
        })
        .filter(|&n| n >= 2)
        .collect()
}

/// `name` parsed from the environment, else `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// The repository root (its `models/`), or the working directory when the binary runs
/// from another checkout (a copy carried to another machine).
pub fn root() -> std::path::PathBuf {
    Some(std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .filter(|r| r.join("models").is_dir())
        .unwrap_or_else(|| std::path::PathBuf::from("."))
}

/// Dense attention, and ACP at ln eps = -10, with their names in the benches' tables.
pub const MODES: [(&str, AcpMode); 2] = [
    ("dense", AcpMode::Off),
    ("acp", AcpMode::Bound { ln_eps: -10.0 }),
];

/// The bundled fox-tiny-pro run over the long fixture for real gates, `max_len` tokens:
/// 16 heads (4 layers x 4).
pub fn workload(max_len: usize) -> Result<PrefillInputs> {
    let root = root();
    let model = Arc::new(Model::open(root.join("models/fox-tiny-pro"))?);
    let rows =
        workload::read_token_rows(&root.join("tests/fixtures/fox-tiny-pro/long_input_ids.npy"));
    foxedge::attention::capture_text(&model, &rows, max_len)
}
