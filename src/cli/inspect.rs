//! `foxedge inspect`: runs the model over a text and draws, for chosen heads, the decay
//! matrix `D_ij = c_i - c_j` with the ACP pruning boundary over it (the ACP paper's
//! Figures 1 and 6), and prints each head's threshold and kept fraction.

use super::plot::{DecayPanel, decay_heatmaps};
use super::{ModelArg, progress};
use clap::Args;
use foxedge::attention::{AcpMode, PrefillInputs, capture_prefill};
use foxedge::{Error, Model, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Draw the decay matrix D with the ACP pruning boundary (PNG)
///
/// Runs the model over a text and draws, for the chosen heads, D_ij = c_i - c_j (the log
/// decay from key j to query i) with the ACP boundary over it; prints each head's threshold
/// delta and kept fraction.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Text to run the model over (its bytes, after BOS)
    #[arg(long, value_name = "FILE")]
    text: PathBuf,
    /// Where to write the picture (PNG)
    #[arg(long, value_name = "OUT.png")]
    plot: PathBuf,
    /// Heads to draw, LAYER.HEAD comma-separated (e.g. 0.1,3.2), or all
    #[arg(long, value_name = "LIST", default_value = "all")]
    heads: String,
    /// Tokens of the text to use at most, BOS included (>= 2)
    #[arg(long, value_name = "N", default_value_t = 4096)]
    max_tokens: usize,
    /// ln eps of the ACP boundary drawn (< 0)
    #[arg(long, value_name = "X", default_value_t = -10.0, allow_negative_numbers = true)]
    log_eps: f64,
    /// The darkest D of the colour scale (< 0) [default: twice the lowest threshold drawn]
    #[arg(long, value_name = "D", allow_negative_numbers = true)]
    clip: Option<f64>,
    /// No progress spinner on stderr
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(a: InspectArgs) -> Result<()> {
    if a.max_tokens < 2 {
        return Err(Error::InvalidArgument("--max-tokens must be >= 2".into()));
    }
    if !(a.log_eps.is_finite() && a.log_eps < 0.0) {
        return Err(Error::InvalidArgument(
            "--log-eps must be finite and < 0".into(),
        ));
    }
    if let Some(c) = a.clip
        && !(c.is_finite() && c < 0.0)
    {
        return Err(Error::InvalidArgument(
            "--clip must be finite and < 0".into(),
        ));
    }
    let model = Arc::new(a.model.open(a.quiet)?);
    let info = model.info();
    let text = &a.text;
    let bytes = std::fs::read(text).map_err(|e| Error::Io {
        path: text.clone(),
        source: e,
    })?;
    // BOS (byte 0) then the text's bytes (the bundled model is byte-level).
    let mut ids: Vec<u32> = vec![0];
    ids.extend(bytes.iter().take(a.max_tokens - 1).map(|&b| u32::from(b)));
    if ids.len() < 2 {
        return Err(Error::InvalidArgument(format!(
            "{}: empty text",
            text.display()
        )));
    }
    if ids.iter().any(|&t| t as usize >= info.vocab) {
        return Err(Error::InvalidArgument(format!(
            "{}: a byte is outside the model's vocabulary of {}",
            text.display(),
            info.vocab
        )));
    }
    let heads: Vec<(usize, usize)> = match a.heads.trim() {
        "all" => (0..info.layers)
            .flat_map(|l| (0..info.heads).map(move |h| (l, h)))
            .collect(),
        s => s
            .split(',')
            .map(|p| parse_head(p.trim(), info.layers, info.heads))
            .collect::<Result<_>>()?,
    };
    let plot = &a.plot;
    if let Some(parent) = plot.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::Io {
            path: parent.to_path_buf(),
            source: e,
        })?;
    }
    let spinner = progress::spinner(
        format!("running the model over {} tokens", ids.len()),
        a.quiet,
    );
    let p = attention_inputs(&model, &ids);
    spinner.finish_and_clear();
    draw_decay(plot, &p?, a.log_eps, &heads, info.heads, a.clip)?;
    eprintln!("wrote {}", plot.display());
    Ok(())
}

/// Every layer's attention inputs over `ids`, as one problem whose heads are the layers'
/// heads side by side.
fn attention_inputs(model: &Arc<Model>, ids: &[u32]) -> Result<PrefillInputs> {
    let layers = capture_prefill(model, ids)?;
    PrefillInputs::concat_heads(&layers)
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
            "Decay D = c_i - c_j over {} tokens; red: the ACP boundary at ln eps = {ln_eps}",
            p.t
        ),
        &panels,
        clip,
        4.min(panels.len()),
        220,
    )
}
