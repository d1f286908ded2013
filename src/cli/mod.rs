//! The `foxedge` command line: one module per subcommand.

pub mod args;
pub mod bench;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod pool;

use foxedge::{Error, Result};
use std::path::{Path, PathBuf};

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

/// Runs `foxedge <args>`; returns the process exit code.
pub fn run(argv: Vec<String>) -> i32 {
    let mut it = argv.into_iter().skip(1);
    let sub = it.next();
    let rest: Vec<String> = it.collect();
    let result = match sub.as_deref() {
        Some("generate") => generate::run(rest),
        Some("logits") => logits::run(rest),
        Some("bench") => bench::run(rest),
        Some("inspect") => inspect::run(rest),
        Some("-h") | Some("--help") | Some("help") | None => {
            print!("{}", USAGE);
            return if sub.is_none() { 2 } else { 0 };
        }
        Some("-V") | Some("--version") => {
            println!("foxedge {}", env!("CARGO_PKG_VERSION"));
            return 0;
        }
        Some(other) => Err(Error::InvalidArgument(format!(
            "unknown command `{other}` (expected generate, logits, bench or inspect; see --help)"
        ))),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("foxedge: {e}");
            1
        }
    }
}

pub const USAGE: &str = "\
foxedge: Forgetting Attention (FoX) inference with ACP and a certified retention cache

USAGE:
  foxedge generate [--model DIR] [--prompt TEXT] [--max-tokens N] [--budget B]
                   [--window N] [--sinks N] [--log-eps X | --no-acp]
                   [--backend cpu|vulkan|auto|hybrid] [--seed N] [--temperature T] [--json]
  foxedge logits --model DIR --input ids.npy --output logits.npy
                   [--no-acp | --log-eps X] [--backend ...]
  foxedge bench [--backend cpu,vulkan,hybrid,auto] [--json] [--plot DIR] [--full]
                   [--lengths 1k,4k] [--ops prefill,decode] [--reps N] [--warm N]
                   [--batch-ms MS] [--budget-s S] [--control] [--device SEL]
                   [--log-eps X] [--out report.json]
  foxedge bench --pool run1.json,run2.json,... [--json]
  foxedge inspect [--model DIR] --text FILE --plot out.png [--heads L.H,...]
                   [--max-tokens N] [--log-eps X] [--clip D]

generate streams bytes from a byte-level model (default: models/fox-tiny-pro) and ends with a
statistics line (--json: one JSON object). --budget: N entries per head, Nl entries per
layer, or a byte size (e.g. 4MiB) for the whole cache. --log-eps: ln eps of ACP and
certified eviction (default -10); --no-acp turns both off. --temperature 0 is greedy.
bench: attention prefill/decode per backend, dense and ACP, on the model's real gates
(quick: 1k and 4k tokens; --full: 1k-64k); table of time, GFLOP/s, % of the measured
FMA peak, kept fraction and speedups; each cell: --warm untimed calls per backend, then up
to --reps rounds (default 15, --full 80) with the backends interleaved (random order), samples
of >= --batch-ms, at most --budget-s (default 3, --full 8) of timed calls per backend; medians,
min, IQR and auto/best ratios (by median, and by total time); --control adds a second CPU
engine and, with a Vulkan device, a second Vulkan engine (the noise floor);
FOXEDGE_BENCH_SLOW_MS=X reports timed calls over X ms. --pool: auto/best per cell over
repeated --out reports, by median and by total time (geometric mean, one-sided 95% lower
bound over the runs, the control pairs' noise). inspect: decay matrix D with the ACP
boundary.
logits: int32 (or uint8) token ids [T] or [B, T] in, float32 logits [T, V] / [B, T, V] out.
";
