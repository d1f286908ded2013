//! `foxedge generate`: stream text from a byte-level FoX model.

use super::args::{Args, parse_budget};
use foxedge::{BackendKind, Model, Result, Rng, Session, SessionOptions, SessionStats};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

const DEFAULT_PROMPT: &str = "import os\nimport sys\n\n\ndef main():\n";

/// Parsed options of `generate`.
#[derive(Debug)]
struct Opts {
    model: Option<String>,
    prompt: String,
    max_tokens: usize,
    session: SessionOptions,
    seed: u64,
    temperature: f32,
    json: bool,
}

fn parse(rest: Vec<String>) -> Result<Opts> {
    let mut a = Args::new(rest);
    let mut session = SessionOptions::default();
    let no_acp = a.flag("--no-acp");
    let log_eps: Option<f64> = a.parsed("--log-eps")?;
    if no_acp && log_eps.is_some() {
        return Err(foxedge::Error::InvalidArgument(
            "--no-acp and --log-eps exclude each other".into(),
        ));
    }
    if no_acp {
        session.ln_eps = None;
    } else if let Some(e) = log_eps {
        session.ln_eps = Some(e);
    }
    if let Some(b) = a.value("--budget")? {
        session.budget = Some(parse_budget(&b)?);
    }
    session.window = a.parsed("--window")?.unwrap_or(session.window);
    session.sinks = a.parsed("--sinks")?.unwrap_or(session.sinks);
    session.backend = a.parsed::<BackendKind>("--backend")?.unwrap_or_default();
    let o = Opts {
        model: a.value("--model")?,
        prompt: a
            .value("--prompt")?
            .unwrap_or_else(|| DEFAULT_PROMPT.to_string()),
        max_tokens: a.parsed("--max-tokens")?.unwrap_or(200),
        seed: a.parsed("--seed")?.unwrap_or(0),
        temperature: a.parsed("--temperature")?.unwrap_or(0.8),
        json: a.flag("--json"),
        session,
    };
    a.finish()?;
    Ok(o)
}

pub fn run(rest: Vec<String>) -> Result<()> {
    let o = parse(rest)?;
    let dir = match &o.model {
        Some(m) => m.into(),
        None => super::default_model_dir()?,
    };
    let model = Arc::new(Model::open(&dir)?);
    let info = model.info();
    if info.vocab != 256 {
        return Err(foxedge::Error::Unsupported(format!(
            "generate streams bytes and needs a byte-level model (vocab 256), {} has {}",
            dir.display(),
            info.vocab
        )));
    }
    let mut session = Session::new(model, o.session.clone())?;
    let mut rng = Rng::new(o.seed);
    let mut logits = vec![0.0f32; info.vocab];
    // BOS (byte 0) then the prompt's bytes (fixture convention, spec §7).
    let mut ids: Vec<u32> = vec![0];
    ids.extend(o.prompt.bytes().map(u32::from));

    let mut out = std::io::stdout().lock();
    out.write_all(o.prompt.as_bytes()).ok();
    out.flush().ok();
    session.feed(&ids, Some(&mut logits))?;
    let started = Instant::now();
    let mut last_report = Instant::now();
    let long = o.max_tokens >= 2000;
    let mut generated = 0usize;
    while generated < o.max_tokens {
        let next = foxedge::sample(&logits, o.temperature, &mut rng)?;
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
        if long && last_report.elapsed().as_secs_f64() >= 2.0 {
            last_report = Instant::now();
            let st = session.stats();
            eprintln!(
                "\n[foxedge] {generated}/{} tokens, {:.0} tok/s, cache {} entries, max B_t {:.2e}",
                o.max_tokens,
                generated as f64 / started.elapsed().as_secs_f64(),
                st.live_entries,
                st.max_bound
            );
        }
    }
    writeln!(out).ok();
    let st = session.stats();
    if o.json {
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
