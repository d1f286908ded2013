//! The tests' and benches' workload: token rows of the held-out text (the bundled model's
//! attention inputs over them come from `foxedge::attention::capture_text`).

use std::path::Path;

/// Token rows of a uint8 `.npy` of shape `[B, T]`, e.g. the fixture `long_input_ids.npy`
/// (8 x 16384 held-out bytes).
pub fn read_token_rows(path: &Path) -> Vec<Vec<u32>> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let npy = npyz::NpyFile::new(std::io::BufReader::new(f)).expect(".npy header");
    let t = *npy.shape().last().expect("a [B, T] array") as usize;
    let ids: Vec<u8> = npy.into_vec().expect("uint8 token ids");
    ids.chunks(t)
        .map(|r| r.iter().map(|&x| u32::from(x)).collect())
        .collect()
}
