//! The `foxedge` command line (clap): one module per subcommand, plus the `.npy` files, PNG
//! plots and progress bars they use.

pub mod bench;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod npy;
pub mod plot;
pub mod pool;
pub mod progress;
pub mod quantize;
pub mod tokenize;

use clap::{Args, Parser, Subcommand};
use foxedge::{
    BackendKind, Error, Model, ModelOptions, Result, Session, SessionOptions, WeightFormat,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Forgetting Attention (FoX) inference with ACP and a certified retention cache
///
/// Runs FoX models on SIMD CPU kernels and Vulkan, with Adaptive Computation Pruning (ACP)
/// and a retention (KV) cache whose evictions carry a certified bound B_t.
#[derive(Debug, Parser)]
#[command(name = "foxedge", version, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Generate(generate::GenerateArgs),
    Tokenize(tokenize::TokenizeArgs),
    Detokenize(tokenize::DetokenizeArgs),
    Logits(logits::LogitsArgs),
    Bench(bench::BenchArgs),
    Inspect(inspect::InspectArgs),
    Quantize(quantize::QuantizeArgs),
}

/// `--model DIR`, `--weights FMT` and `--vocab-weights FMT`, shared by the subcommands
/// that load a model.
#[derive(Debug, Clone, Args)]
pub struct ModelArg {
    /// Model directory (config.json + model.safetensors) [default: the bundled
    /// models/fox-tiny-pro, searched from the current directory and the executable]
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Format of the dense layers' weights: f32, f16, bf16, q8 (8.5 bits/weight) or q4
    /// (4.5 bits/weight), converted once at load [default: as stored]
    #[arg(long, value_name = "FMT")]
    pub weights: Option<WeightFormat>,
    /// Format of the embeddings and the LM head [default: that of --weights]
    #[arg(long, value_name = "FMT")]
    pub vocab_weights: Option<WeightFormat>,
}

impl ModelArg {
    /// The directory given, or the bundled model's ([`default_model_dir`]).
    pub fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(m) => Ok(m.clone()),
            None => default_model_dir(),
        }
    }

    /// The model options these flags ask for.
    pub fn options(&self) -> ModelOptions {
        ModelOptions {
            weights: self.weights,
            vocab_weights: self.vocab_weights,
            ..ModelOptions::default()
        }
    }

    /// Opens the model, with a progress bar over the weights when they are converted
    /// (hidden with `quiet` or when stderr is not a terminal).
    pub fn open(&self, quiet: bool) -> Result<Model> {
        let dir = self.dir()?;
        let opts = self.options();
        if opts.weights.is_none() && opts.vocab_weights.is_none() {
            return Model::open_with(&dir, &opts);
        }
        let bar = progress::bar(0, "weights", quiet);
        bar.set_message(format!("converting {}", dir.display()));
        let model = Model::open_with_progress(&dir, &opts, &|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
        model
    }
}

/// ACP and certified eviction: `--log-eps X` or `--no-acp`.
#[derive(Debug, Clone, Args)]
pub struct AcpArgs {
    /// ln eps of ACP and of certified eviction, < 0 (the bound on the attention mass pruned
    /// or evicted) [default: -10]
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub log_eps: Option<f64>,
    /// Turn ACP and certified eviction off (dense attention, full cache)
    #[arg(long, conflicts_with = "log_eps")]
    pub no_acp: bool,
}

impl AcpArgs {
    /// ln eps, or None with `--no-acp`.
    pub fn ln_eps(&self) -> Option<f64> {
        if self.no_acp {
            None
        } else {
            Some(
                self.log_eps
                    .unwrap_or(foxedge_core::threshold::DEFAULT_LN_EPS),
            )
        }
    }
}

/// Finds the bundled model when `--model` is not given: `models/fox-tiny-pro` under the
/// current directory or one of its ancestors, then beside the executable or its ancestors
/// (a `target/release` binary), then under the source tree the binary was built from.
pub fn default_model_dir() -> Result<PathBuf> {
    let rel = Path::new(foxedge::BUNDLED_MODEL);
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for r in &roots {
        let d = r.join(rel);
        if d.join("config.json").is_file() {
            return Ok(d);
        }
    }
    Err(Error::InvalidArgument(format!(
        "no --model given and {} was not found from the current directory, the executable \
         or {}",
        rel.display(),
        env!("CARGO_MANIFEST_DIR")
    )))
}

/// One untimed pass of a throwaway session through each device path a session takes (a
/// first chunk, a continuation chunk, a one-token step), so one-time costs of the process
/// (the device's pipeline compiles, first allocations) stay out of the timed figures, as
/// llama.cpp's warm-up decode does. Only where the whole model runs on a device (`vulkan`,
/// `auto` on a GPU); `auto` that keeps the layers on the CPU stops after one 2-token chunk.
pub fn warm_up(model: &Arc<Model>, opts: &SessionOptions) -> Result<()> {
    if !matches!(opts.backend, BackendKind::Vulkan | BackendKind::Auto) {
        return Ok(());
    }
    let vocab = model.info().vocab;
    let mut s = Session::new(model.clone(), opts.clone())?;
    let mut logits = vec![0.0f32; vocab];
    for ids in [&[1u32, 2][..], &[3, 4], &[5]] {
        let ids: Vec<u32> = ids.iter().map(|&i| i % vocab as u32).collect();
        s.feed(&ids, Some(&mut logits))?;
        if s.stats().device_layers == 0 {
            // `auto` kept the layers on the CPU: nothing to compile.
            break;
        }
    }
    Ok(())
}

/// Runs `foxedge <args>`; returns the process exit code: 0 on success (and for `--help`,
/// `--version`), 2 for a usage error, 1 for an error while running.
pub fn run(argv: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => return usage_error(&e),
    };
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Tokenize(a) => tokenize::run_tokenize(a),
        Command::Detokenize(a) => tokenize::run_detokenize(a),
        Command::Logits(a) => logits::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Quantize(a) => quantize::run(a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("foxedge: {e}");
            1
        }
    }
}

/// Prints what clap returned instead of arguments: help and version on stdout (exit 0), help
/// for a bare `foxedge` on stderr (exit 2), a usage error as `foxedge: <message>` (exit 2).
fn usage_error(e: &clap::Error) -> i32 {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // Nothing to do when stdout or stderr is closed.
            e.print().ok();
        }
        _ => {
            let text = e.render().to_string();
            eprint!("foxedge: {}", text.strip_prefix("error: ").unwrap_or(&text));
        }
    }
    // Usage errors exit 1 like every other error; a bare `foxedge` prints its usage and
    // exits 2; help and version exit 0.
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn acp_flags() {
        use clap::Parser;
        let parse = |args: &[&str]| {
            let mut v = vec!["foxedge", "logits", "--input", "a", "--output", "b"];
            v.extend_from_slice(args);
            match Cli::try_parse_from(v).map(|c| c.command) {
                Ok(super::Command::Logits(a)) => Ok(a.acp.ln_eps()),
                Ok(_) => unreachable!("parsed as logits"),
                Err(e) => Err(e.kind()),
            }
        };
        assert_eq!(parse(&[]), Ok(Some(-10.0)));
        assert_eq!(parse(&["--log-eps", "-7.5"]), Ok(Some(-7.5)));
        assert_eq!(parse(&["--log-eps=-3"]), Ok(Some(-3.0)));
        assert_eq!(parse(&["--no-acp"]), Ok(None));
        assert_eq!(
            parse(&["--no-acp", "--log-eps", "-5"]),
            Err(clap::error::ErrorKind::ArgumentConflict)
        );
    }
}
