//! `foxedge generate`: stream text from a byte-level FoX model.

use super::{AcpArgs, ModelArg, progress};
use clap::Args;
use foxedge::{BackendKind, Budget, Error, Result, Rng, Session, SessionOptions, SessionStats};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

const DEFAULT_PROMPT: &str = "import os\nimport sys\n\n\ndef main():\n";

/// Stream text from a byte-level FoX model
///
/// Feeds BOS (byte 0) and the prompt's bytes, then samples up to --max-tokens bytes. Ends
/// with a statistics line (--json: one JSON object): prefill and decode tokens/s, cache
/// entries live and evicted (certified / forced), peak cache bytes, the fraction of attention
/// pairs ACP pruned, and the largest eviction certificate B_t.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Prompt text, fed after BOS (byte 0) [default: the start of a Python file]
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// Tokens to generate at most (generation also stops at byte 0, the end of text)
    #[arg(long, value_name = "N", default_value_t = 200)]
    max_tokens: usize,
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
    /// Sampling seed
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Sampling temperature; 0 is greedy
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    temperature: f32,
    /// Print the statistics as one JSON object instead of a line
    #[arg(long)]
    json: bool,
    /// Progress on stderr: a spinner during the prompt's prefill and a line every 2 s of
    /// decoding (without it, those lines only when --max-tokens >= 2000)
    #[arg(short, long)]
    verbose: bool,
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
    let dir = a.model.dir()?;
    let model = Arc::new(a.model.open(!a.verbose || a.json)?);
    let info = model.info();
    if info.vocab != 256 {
        return Err(Error::Unsupported(format!(
            "generate streams bytes and needs a byte-level model (vocab 256), {} has {}",
            dir.display(),
            info.vocab
        )));
    }
    let opts = SessionOptions {
        backend: a.backend,
        ln_eps: a.acp.ln_eps(),
        budget: a.budget,
        window: a.window,
        sinks: a.sinks,
        ..SessionOptions::default()
    };
    let prompt = a.prompt.as_deref().unwrap_or(DEFAULT_PROMPT);
    let mut session = Session::new(model, opts)?;
    let mut rng = Rng::new(a.seed);
    let mut logits = vec![0.0f32; info.vocab];
    // BOS (byte 0) then the prompt's bytes (fixture convention, spec §7).
    let mut ids: Vec<u32> = vec![0];
    ids.extend(prompt.bytes().map(u32::from));

    // The spinner goes before the prompt is printed: clearing it must not erase text.
    let spinner = progress::spinner(
        format!("prefilling {} tokens", ids.len()),
        !a.verbose || a.json,
    );
    session.feed(&ids, Some(&mut logits))?;
    spinner.finish_and_clear();
    let mut out = std::io::stdout().lock();
    out.write_all(prompt.as_bytes()).ok();
    out.flush().ok();
    let started = Instant::now();
    let mut last_report = Instant::now();
    let report = a.verbose || a.max_tokens >= 2000;
    let mut generated = 0usize;
    while generated < a.max_tokens {
        let next = foxedge::sample(&logits, a.temperature, &mut rng)?;
        if next == 0 {
            break; // byte 0 is the end-of-text id
        }
        if out
            .write_all(&[next as u8])
            .and_then(|_| out.flush())
            .is_err()
        {
            return Ok(()); // stdout closed (e.g. piped into `head`): stop quietly
        }
        session.feed(&[next], Some(&mut logits))?;
        generated += 1;
        if report && last_report.elapsed().as_secs_f64() >= 2.0 {
            last_report = Instant::now();
            let st = session.stats();
            eprintln!(
                "\n[foxedge] {generated}/{} tokens, {:.0} tok/s, cache {} entries, max B_t {:.2e}",
                a.max_tokens,
                generated as f64 / started.elapsed().as_secs_f64(),
                st.live_entries,
                st.max_bound
            );
        }
    }
    writeln!(out).ok();
    let st = session.stats();
    if a.json {
        writeln!(out, "{}", stats_json(&st, session.backend())).ok();
    } else {
        writeln!(out, "{}", stats_line(&st)).ok();
    }
    Ok(())
}

/// One human-readable line of statistics.
pub fn stats_line(st: &SessionStats) -> String {
    format!(
        "[stats] prefill {} tok @ {:.1} tok/s | decode {} tok @ {:.1} tok/s | cache live {} \
         entries, evicted {} certified / {} forced, peak {:.1} KiB | ACP pruned {:.1}% of \
         attention pairs | max B_t {:.3e}",
        st.prefill_tokens,
        st.prefill_tokens_per_second(),
        st.decode_tokens,
        st.decode_tokens_per_second(),
        st.live_entries,
        st.evicted_certified,
        st.evicted_forced,
        st.peak_cache_bytes as f64 / 1024.0,
        100.0 * st.pruned_fraction(),
        st.max_bound
    )
}

/// The statistics as one JSON object.
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
        "max_bound": num(st.max_bound),
        "bound_per_head": st.bound_per_head.iter().map(|&b| num(b)).collect::<Vec<_>>(),
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
