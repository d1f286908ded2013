//! `foxedge inspect`: runs the model over a text and draws, for chosen heads, the decay
//! matrix `D_ij = c_i - c_j` with the ACP pruning boundary over it (the ACP paper's
//! Figures 1 and 6), and prints each head's threshold and kept fraction.

use super::args::Args;
use foxedge::attention::{AcpMode, PrefillInputs, capture_prefill};
use foxedge::plot::{DecayPanel, decay_heatmaps};
use foxedge::{Error, Model, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn run(rest: Vec<String>) -> Result<()> {
    let mut a = Args::new(rest);
    let model_dir = a.value("--model")?;
    let text = a
        .value("--text")?
        .ok_or_else(|| Error::InvalidArgument("--text FILE is required".into()))?;
    let plot = a
        .value("--plot")?
        .map(PathBuf::from)
        .ok_or_else(|| Error::InvalidArgument("--plot out.png is required".into()))?;
    let heads_arg = a.value("--heads")?;
    let max_tokens: usize = a.parsed("--max-tokens")?.unwrap_or(4096);
    let ln_eps: f64 = a.parsed("--log-eps")?.unwrap_or(-10.0);
    let clip: Option<f64> = a.parsed("--clip")?;
    a.finish()?;
    if max_tokens < 2 {
        return Err(Error::InvalidArgument("--max-tokens must be >= 2".into()));
    }
    if !(ln_eps.is_finite() && ln_eps < 0.0) {
        return Err(Error::InvalidArgument(
            "--log-eps must be finite and < 0".into(),
        ));
    }
    if let Some(c) = clip
        && !(c.is_finite() && c < 0.0)
    {
        return Err(Error::InvalidArgument(
            "--clip must be finite and < 0".into(),
        ));
    }
    let dir = match model_dir {
        Some(m) => PathBuf::from(m),
        None => super::default_model_dir()?,
    };
    let model = Arc::new(Model::open(&dir)?);
    let info = model.info();
    let bytes = std::fs::read(&text).map_err(|e| Error::Io {
        path: PathBuf::from(&text),
        source: e,
    })?;
    // BOS (byte 0) then the text's bytes (the bundled model is byte-level).
    let mut ids: Vec<u32> = vec![0];
    ids.extend(bytes.iter().take(max_tokens - 1).map(|&b| u32::from(b)));
    if ids.len() < 2 {
        return Err(Error::InvalidArgument(format!("{text}: empty text")));
    }
    if ids.iter().any(|&t| t as usize >= info.vocab) {
        return Err(Error::InvalidArgument(format!(
            "{text}: a byte is outside the model's vocabulary of {}",
            info.vocab
        )));
    }
    let heads: Vec<(usize, usize)> = match heads_arg.as_deref() {
        None | Some("all") => (0..info.layers)
            .flat_map(|l| (0..info.heads).map(move |h| (l, h)))
            .collect(),
        Some(s) => s
            .split(',')
            .map(|p| parse_head(p.trim(), info.layers, info.heads))
            .collect::<Result<_>>()?,
    };
    if let Some(parent) = plot.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::Io {
            path: parent.to_path_buf(),
            source: e,
        })?;
    }
    let layers = capture_prefill(&model, &ids)?;
    let p = PrefillInputs::concat_heads(&layers)?;
    draw_decay(&plot, &p, ln_eps, &heads, info.heads, clip)?;
    eprintln!("wrote {}", plot.display());
    Ok(())
}

/// `L.H` (layer, head), e.g. `0.3`.
fn parse_head(s: &str, layers: usize, heads: usize) -> Result<(usize, usize)> {
    let bad = || {
        Error::InvalidArgument(format!(
            "--heads: `{s}` is not LAYER.HEAD with layer < {layers} and head < {heads}"
        ))
    };
    let (l, h) = s.split_once('.').ok_or_else(bad)?;
    let l: usize = l.parse().map_err(|_| bad())?;
    let h: usize = h.parse().map_err(|_| bad())?;
    if l >= layers || h >= heads {
        return Err(bad());
    }
    Ok((l, h))
}

/// Draws the decay matrices of `heads` ((layer, head) pairs of a problem whose heads are
/// the layers' heads side by side, `per_layer` each) with the ACP boundary for `ln_eps`,
/// and prints each head's threshold and kept fraction. `clip`: the darkest `D`
/// (default: twice the most negative threshold drawn, so the boundary sits mid-scale).
pub fn draw_decay(
    path: &Path,
    p: &PrefillInputs,
    ln_eps: f64,
    heads: &[(usize, usize)],
    per_layer: usize,
    clip: Option<f64>,
) -> Result<()> {
    let b = p.boundary(AcpMode::Bound { ln_eps })?;
    let mut panels = Vec::with_capacity(heads.len());
    let mut lowest_delta = -1.0f64;
    println!("layer head  delta      kept");
    for &(l, h) in heads {
        let i = l * per_layer + h;
        if i >= p.heads {
            return Err(Error::InvalidArgument(format!(
                "head {l}.{h} is outside the {} heads",
                p.heads
            )));
        }
        let kept = b.kept_pairs[i] as f64 / b.total_pairs[i].max(1) as f64;
        let delta = b.delta[i].unwrap_or(f64::NEG_INFINITY);
        lowest_delta = lowest_delta.min(delta);
        println!("{l:>5} {h:>4} {delta:>7.1} {:>8.1}%", kept * 100.0);
        panels.push(DecayPanel {
            title: format!("L{l} H{h} kept {:.0}%", kept * 100.0),
            c: b.c[i * p.t..(i + 1) * p.t].to_vec(),
            start_blocks: b.start_blocks[i * b.q_blocks..(i + 1) * b.q_blocks].to_vec(),
            block: b.block,
        });
    }
    let clip = clip.unwrap_or(if lowest_delta.is_finite() {
        2.0 * lowest_delta
    } else {
        -50.0
    });
    decay_heatmaps(
        path,
        &format!(
            "D = c_i - c_j ({} tokens; red: ACP boundary, ln eps {ln_eps})",
            p.t
        ),
        &panels,
        clip,
        4.min(panels.len()),
        220,
    )
}
