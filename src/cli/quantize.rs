//! `foxedge quantize`: writes a model directory whose weights are stored in another format.

use super::progress;
use clap::Args;
use foxedge::{Model, ModelOptions, Result, WeightFormat};
use std::path::PathBuf;
use std::time::Instant;

/// Write a copy of a model with its weights quantized (or converted)
///
/// Loads --model with its dense layers in --to and its embeddings and LM head in
/// --vocab-weights, then writes --out: config.json, model.safetensors and the tokenizer
/// files found beside the model. Q8 / Q4 matrices are stored in the engine's packed
/// layout (U8 tensors described in the file's __metadata__), so the written model loads
/// without re-quantizing, read in place from the file.
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Model directory to read (config.json + model.safetensors)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Format of the dense layers' weights: q8, q4 (or f32, f16, bf16)
    #[arg(long, value_name = "FMT")]
    to: WeightFormat,
    /// Format of the embeddings and the LM head [default: that of --to]
    #[arg(long, value_name = "FMT")]
    vocab_weights: Option<WeightFormat>,
    /// Directory to write (created if needed; not the model's own)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// No progress bars on stderr
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let t0 = Instant::now();
    let opts = ModelOptions {
        weights: Some(a.to),
        vocab_weights: a.vocab_weights,
        ..ModelOptions::default()
    };
    let bar = progress::bar(0, "weights", a.quiet);
    bar.set_message(format!("quantizing to {}", a.to));
    let model = Model::open_with_progress(&a.model, &opts, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let model = model?;
    let t1 = Instant::now();
    let bar = progress::bar(0, "bytes", a.quiet);
    bar.set_message(format!("writing {}", a.out.display()));
    let report = model.save(&a.out, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report?;
    let (dense, vocab) = model.weight_formats();
    eprintln!(
        "wrote {}: model.safetensors {:.1} MB ({} tensors; dense layers {dense}, embeddings \
         and LM head {vocab}), copied {}; converted in {:.1} s, written in {:.1} s",
        report.dir.display(),
        report.file_bytes as f64 / 1e6,
        report.tensors,
        report.copied.join(", "),
        (t1 - t0).as_secs_f64(),
        t1.elapsed().as_secs_f64(),
    );
    Ok(())
}
