//! The bench's workload: the bundled model's real attention inputs over held-out text.

use foxedge::attention::{PrefillInputs, capture_prefill};
use foxedge::{Error, Model, Result};
use std::path::Path;
use std::sync::Arc;

/// Token rows of an int32 `.npy` of shape `[B, T]` (or `[T]`), e.g. the fixture
/// `long_input_ids.npy` (8 x 16384 held-out bytes).
pub fn read_token_rows(path: &Path) -> Result<Vec<Vec<u32>>> {
    let t = super::super::npy::read_token_ids(path)?;
    Ok(t.ids.chunks(t.row_len()).map(<[u32]>::to_vec).collect())
}

/// The attention of every layer of `model` on real text, as one call of `layers * heads`
/// heads (heads are independent, so the layers' calls stack side by side) and `len`
/// tokens. Up to one row's length it is the model run over the start of row 0; beyond,
/// the model runs over whole rows 0, 1, ... and their inputs are joined in time (real
/// gates of consecutive documents; `c` keeps falling across the joins).
pub fn real_gate_inputs(
    model: &Arc<Model>,
    rows: &[Vec<u32>],
    len: usize,
) -> Result<PrefillInputs> {
    let row_len = rows.first().map_or(0, Vec::len);
    if len == 0 || row_len < 2 {
        return Err(Error::InvalidArgument(
            "real gate inputs: need len > 0 and rows of >= 2 tokens".into(),
        ));
    }
    if len <= row_len {
        let layers = capture_prefill(model, &rows[0][..len.max(2)])?;
        return PrefillInputs::concat_heads(&layers)?.prefix(len);
    }
    let need = len.div_ceil(row_len);
    if need > rows.len() {
        return Err(Error::InvalidArgument(format!(
            "real gate inputs: {len} tokens need {need} rows of {row_len}, have {}",
            rows.len()
        )));
    }
    let parts = rows[..need]
        .iter()
        .map(|r| PrefillInputs::concat_heads(&capture_prefill(model, r)?))
        .collect::<Result<Vec<_>>>()?;
    PrefillInputs::concat_time(&parts)?.prefix(len)
}
