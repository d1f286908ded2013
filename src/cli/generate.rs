//! `foxedge generate`: stream text from a FoX model through its directory's tokenizer.

use super::{AcpArgs, ModelArg, progress};
use clap::Args;
use foxedge::generate::{GenerateOptions, TextGenerator, feed_prompt};
use foxedge::{
    BackendKind, Budget, CacheDtype, Error, Result, Sampler, SamplerConfig, Session,
    SessionOptions, SessionStats,
};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const DEFAULT_PROMPT: &str = "import os\nimport sys\n\n\ndef main():\n";

/// Stream text from a FoX model
///
/// Encodes the prompt with the model directory's tokenizer (tokenizer.json, or vocab.json +
/// merges.txt with tokenizer_config.json; a vocabulary of 256 without files: one token per
/// byte), with BOS when the tokenizer's configuration adds it, prints the prompt, then
/// samples up to --max-tokens tokens and prints their text as it decodes. Stops at the end
/// of text (EOS) or at a --stop string (not printed). Ends with a statistics line (--json:
/// one JSON object): prefill and decode tokens/s, cache entries live and evicted (certified
/// / forced), peak cache bytes, the fraction of attention pairs ACP pruned, and the largest
/// eviction certificate B_t ("no guarantee" where none holds). With --backend vulkan, a
/// throwaway session first feeds 5 tokens untimed (the device's one-time pipeline compiles).
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Prompt text [default: the start of a Python file]
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a file (UTF-8 text)
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Tokens to generate at most
    #[arg(long, value_name = "N", default_value_t = 200)]
    max_tokens: usize,
    /// Stop when the generated text contains TEXT (not printed); may be repeated
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    /// Hard cache budget: N entries per head, Nl entries per layer, or a byte size for the
    /// whole cache (N with a B, KiB, MiB or GiB suffix, e.g. 4MiB) [default: none]
    #[arg(long, value_name = "B", value_parser = parse_budget)]
    budget: Option<Budget>,
    /// The most recent N tokens of every head are never evicted
    #[arg(long, value_name = "N", default_value_t = SessionOptions::default().window)]
    window: usize,
    /// The first N tokens of the stream are never evicted
    #[arg(long, value_name = "N", default_value_t = SessionOptions::default().sinks)]
    sinks: usize,
    #[command(flatten)]
    acp: AcpArgs,
    /// Compute backend: cpu, vulkan, auto or hybrid
    #[arg(long, value_name = "KIND", default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// Threads of the session's own pool [default: one per core, shared]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    #[command(flatten)]
    sampler: SamplerArgs,
    /// Storage of the cached K and V rows: f16 (half the memory) or f32
    #[arg(long = "cache", value_name = "DTYPE", default_value_t = SessionOptions::default().cache_dtype)]
    cache_dtype: CacheDtype,
    /// A session file: when it exists, the session is restored from it (with the options
    /// it was saved with, but this run's backend and threads; BOS is not added again) and
    /// continues with the prompt; at the end the session is saved back to it
    #[arg(long, value_name = "FILE")]
    session: Option<std::path::PathBuf>,
    /// Print the statistics as one JSON object instead of a line
    #[arg(long)]
    json: bool,
    /// Progress on stderr: a spinner during the prompt's prefill and a line every 2 s of
    /// decoding (without it, those lines only when --max-tokens >= 2000)
    #[arg(short, long)]
    verbose: bool,
}

/// The sampler chain's flags (applied in this order: repetition penalty, temperature,
/// top-k, top-p, min-p).
#[derive(Debug, Clone, Args)]
pub struct SamplerArgs {
    /// Sampling temperature; 0 is greedy (the most probable token)
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most probable tokens; 0 = off
    #[arg(long, value_name = "K", default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of most probable tokens whose probability reaches P, in (0, 1];
    /// 1 = off
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    top_p: f32,
    /// Keep tokens at least P times as probable as the most probable one, in [0, 1]; 0 = off
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    min_p: f32,
    /// Divide the logits of recent tokens by X > 0 (multiply when negative); 1 = off
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    repeat_penalty: f32,
    /// How many recent tokens (prompt included) the penalty looks at
    #[arg(long, value_name = "N", default_value_t = SamplerConfig::default().repetition_window)]
    repeat_window: usize,
    /// Sampling seed
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
}

impl SamplerArgs {
    /// The sampler's configuration (checked when the sampler is made).
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            repetition_window: self.repeat_window,
            seed: self.seed,
        }
    }
}

/// Parses a budget: `N` entries per head, `Nl` entries per layer, or bytes with a
/// `B`, `KiB`, `MiB` or `GiB` suffix (whole session).
fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
    let bad = || format!("`{s}`: expected N, Nl, or N{{B,KiB,MiB,GiB}}");
    let t = s.trim();
    for (suf, mul) in [
        ("GiB", 1usize << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ] {
        if let Some(n) = t.strip_suffix(suf) {
            let n: usize = n.trim().parse().map_err(|_| bad())?;
            return n.checked_mul(mul).map(Budget::Bytes).ok_or_else(bad);
        }
    }
    if let Some(n) = t.strip_suffix('l') {
        return n.parse().map(Budget::EntriesPerLayer).map_err(|_| bad());
    }
    t.parse().map(Budget::EntriesPerHead).map_err(|_| bad())
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let model = Arc::new(a.model.open(!a.verbose || a.json)?);
    let tokenizer = model.tokenizer()?.clone();
    let vocab = model.info().vocab;
    let mut sampler = Sampler::new(a.sampler.config())?;
    let gen_opts = GenerateOptions {
        stop: a.stop.clone(),
        ..GenerateOptions::new(a.max_tokens)
    };
    gen_opts.validate()?;
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_text(f)?,
        (None, None) => DEFAULT_PROMPT.to_string(),
    };
    // A resumed session continues its stream: BOS only starts a new one.
    let resumed = a.session.as_deref().filter(|p| p.exists());
    let ids = tokenizer.encode(&prompt, resumed.is_none())?;
    let opts = SessionOptions {
        backend: a.backend,
        ln_eps: a.acp.ln_eps(),
        budget: a.budget,
        window: a.window,
        sinks: a.sinks,
        threads: a.threads.unwrap_or(0),
        cache_dtype: a.cache_dtype,
        ..SessionOptions::default()
    };
    super::warm_up(&model, &opts)?;
    let mut session = Session::new(model, opts)?;
    if let Some(p) = resumed {
        session.restore(p)?;
    }
    let mut logits = vec![0.0f32; vocab];
    let mut generator = TextGenerator::new(&tokenizer, &gen_opts)?;

    // The spinner goes before the prompt is printed: clearing it must not erase text.
    let spinner = progress::spinner(
        format!("prefilling {} tokens", ids.len()),
        !a.verbose || a.json,
    );
    feed_prompt(&mut session, &mut sampler, &ids, &mut logits)?;
    spinner.finish_and_clear();
    let mut out = std::io::stdout().lock();
    out.write_all(prompt.as_bytes()).ok();
    out.flush().ok();
    let started = Instant::now();
    let mut last_report = Instant::now();
    let report = a.verbose || a.max_tokens >= 2000;
    loop {
        let step = generator.step(&mut session, &mut sampler, &mut logits)?;
        if !step.text.is_empty()
            && out
                .write_all(step.text.as_bytes())
                .and_then(|_| out.flush())
                .is_err()
        {
            // stdout closed (e.g. piped into `head`): stop quietly, keeping the session.
            return save_session(&session, a.session.as_deref());
        }
        if step.stop.is_some() {
            break;
        }
        if report && last_report.elapsed().as_secs_f64() >= 2.0 {
            last_report = Instant::now();
            let st = session.stats();
            let n = generator.tokens().len();
            eprintln!(
                "\n[foxedge] {n}/{} tokens, {:.0} tok/s, cache {} entries, max B_t {}",
                a.max_tokens,
                n as f64 / started.elapsed().as_secs_f64(),
                st.live_entries,
                bound_text(st.max_bound)
            );
        }
    }
    writeln!(out).ok();
    save_session(&session, a.session.as_deref())?;
    let st = session.stats();
    if a.json {
        writeln!(out, "{}", stats_json(&st, session.backend())).ok();
    } else {
        writeln!(out, "{}", stats_line(&st)).ok();
    }
    Ok(())
}

/// A UTF-8 text file's contents, errors naming the file.
pub fn read_text(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        Error::InvalidArgument(format!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The eviction certificate in words: a number, or "no guarantee".
pub fn bound_text(b: Option<f64>) -> String {
    match b {
        Some(b) => format!("{b:.3e}"),
        None => "no guarantee".to_string(),
    }
}

/// Saves the session to `path` when one was given (`--session`).
fn save_session(session: &Session, path: Option<&std::path::Path>) -> Result<()> {
    match path {
        Some(p) => session.save(p),
        None => Ok(()),
    }
}

/// One human-readable line of statistics.
pub fn stats_line(st: &SessionStats) -> String {
    format!(
        "[stats] prefill {} tok @ {:.1} tok/s | decode {} tok @ {:.1} tok/s | cache live {} \
         entries, evicted {} certified / {} forced, peak {:.1} KiB | ACP pruned {:.1}% of \
         attention pairs | max B_t {}",
        st.prefill_tokens,
        st.prefill_tokens_per_second(),
        st.decode_tokens,
        st.decode_tokens_per_second(),
        st.live_entries,
        st.evicted_certified,
        st.evicted_forced,
        st.peak_cache_bytes as f64 / 1024.0,
        100.0 * st.pruned_fraction(),
        bound_text(st.max_bound)
    )
}

/// The statistics as one JSON object; `max_bound` and `bound_per_head` entries are null
/// where there is no guarantee.
pub fn stats_json(st: &SessionStats, backend: BackendKind) -> String {
    let num = |x: f64| {
        if x.is_finite() {
            serde_json::json!(x)
        } else {
            serde_json::json!(x.to_string())
        }
    };
    serde_json::json!({
        "backend": backend.name(),
        "tokens": st.tokens,
        "prefill_tokens": st.prefill_tokens,
        "prefill_tokens_per_s": num(st.prefill_tokens_per_second()),
        "decode_tokens": st.decode_tokens,
        "decode_tokens_per_s": num(st.decode_tokens_per_second()),
        "live_entries": st.live_entries,
        "evicted_certified": st.evicted_certified,
        "evicted_forced": st.evicted_forced,
        "cache_bytes": st.cache_bytes,
        "peak_cache_bytes": st.peak_cache_bytes,
        "pruned_fraction": num(st.pruned_fraction()),
        "max_bound": st.max_bound.map(num),
        "bound_per_head": st.bound_per_head.iter().map(|b| b.map(num)).collect::<Vec<_>>(),
        "device_layers": st.device_layers,
        "device_bytes_uploaded": st.device_bytes_uploaded,
        "device_runs": st.device_runs,
        "device_submissions": st.device_submissions,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::parse_budget;
    use foxedge::Budget;

    #[test]
    fn budgets() {
        assert_eq!(parse_budget("512"), Ok(Budget::EntriesPerHead(512)));
        assert_eq!(parse_budget("64l"), Ok(Budget::EntriesPerLayer(64)));
        assert_eq!(parse_budget("4MiB"), Ok(Budget::Bytes(4 << 20)));
        assert_eq!(parse_budget("3 KiB"), Ok(Budget::Bytes(3 << 10)));
        assert_eq!(parse_budget("100B"), Ok(Budget::Bytes(100)));
        for bad in ["", "x", "-1", "4TiB", "1.5MiB", "99999999999999999999GiB"] {
            assert!(parse_budget(bad).is_err(), "{bad}");
        }
    }
}
