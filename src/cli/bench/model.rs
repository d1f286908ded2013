//! `foxedge bench --model DIR`: the whole model, like llama-bench. At each depth `d`, a
//! fresh session is filled with `d` tokens (untimed), then timed: `--prompt` tokens fed in
//! one call (a prefill at depth 0, a continuation at depth > 0), then `--gen` tokens
//! decoded one at a time (greedy), so decode runs at context `d + prompt` and up.
//! With `--batch N` (> 1), `--gen` tokens are also decoded in `N` forks of the session
//! after the prompt, advanced together ([`Session::feed_batch`]): aggregate tokens/s
//! (`N * gen` per second). With `--restore`, the session after the prompt is saved to
//! bytes and loaded back: the tokens it holds per second of loading, to set against
//! feeding them.
//! Repeated `--reps` times: median, min and max tokens/s, after one untimed warm-up
//! ([`crate::cli::warm_up`]). Also: load time, weight bytes,
//! resident memory before and after load and at the end (`VmRSS`, `VmHWM` of
//! `/proc/self/status`) and the cache's peak bytes.

use super::BenchArgs;
use crate::cli::progress;
use foxedge::{Error, Result, Session, SessionOptions};
use std::sync::Arc;
use std::time::Instant;

/// tokens/s of one timed part over the repetitions.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    /// `prefill`, `continuation`, `decode`, `batch decode` or `restore`.
    test: &'static str,
    /// Tokens in the cache when the part starts.
    depth: usize,
    /// Tokens timed per repetition.
    tokens: usize,
    median_tps: f64,
    min_tps: f64,
    max_tps: f64,
    /// tokens/s of each repetition, in order.
    samples: Vec<f64>,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    model: String,
    params: usize,
    /// Formats of the dense layers and of the embeddings / LM head.
    dense_weights: String,
    vocab_weights: String,
    /// Bytes of the weights in those formats (matrices, plus f32 vectors).
    weight_bytes: usize,
    /// Of those, bytes held in memory of their own rather than read from the file's map.
    converted_bytes: usize,
    threads: usize,
    backend: String,
    acp: bool,
    /// Tokens per prefill chunk and the cache's row storage.
    chunk: usize,
    cache: String,
    load_seconds: f64,
    /// Resident memory (bytes) before opening the model, right after, and at most.
    rss_before_load: Option<u64>,
    rss_after_load: Option<u64>,
    peak_rss: Option<u64>,
    /// The most cache bytes a session held.
    peak_cache_bytes: u64,
    reps: usize,
    rows: Vec<Row>,
}

/// `VmRSS` and `VmHWM` of this process in bytes (Linux), or None.
fn rss() -> (Option<u64>, Option<u64>) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |key: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Median, min, max of `v` (not empty).
fn summary(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (super::quantile(&s, 0.5), s[0], s[s.len() - 1])
}

/// Index of the largest logit.
fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub(super) fn run(a: &BenchArgs) -> Result<()> {
    let dir = a.model.dir()?;
    let reps = a.reps.unwrap_or(5);
    if reps == 0 || a.prompt == 0 || a.batch == 0 {
        return Err(Error::InvalidArgument(
            "--reps, --prompt and --batch must be > 0".into(),
        ));
    }
    let backend = match a.backend.as_slice() {
        [Some(b)] => *b,
        [None] => foxedge::BackendKind::Cpu,
        _ => {
            return Err(Error::InvalidArgument(
                "bench --model runs one backend: give --backend once".into(),
            ));
        }
    };
    let depths = if a.depth.is_empty() {
        vec![0]
    } else {
        a.depth.clone()
    };
    let quiet = a.quiet || a.json;
    let (rss_before_load, _) = rss();
    let t0 = Instant::now();
    let model = Arc::new(a.model.open(quiet)?);
    let load_seconds = t0.elapsed().as_secs_f64();
    let (rss_after_load, _) = rss();
    let info = model.info();
    let max_depth = depths.iter().copied().max().unwrap_or(0);
    let n = max_depth + a.prompt + a.gen_tokens;
    // Token ids from a fixed LCG over the vocabulary (like llama-bench's random prompt).
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let ids: Vec<u32> = (0..n)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % info.vocab as u64) as u32
        })
        .collect();
    let opts = SessionOptions {
        backend,
        ln_eps: (!a.dense).then_some(a.log_eps),
        prefill_chunk: a.chunk.unwrap_or(SessionOptions::default().prefill_chunk),
        max_entries_per_head: n.max(1),
        cache_dtype: a.cache_dtype,
        ..SessionOptions::default()
    };
    crate::cli::warm_up(&model, &opts)?;
    let mut rows = Vec::new();
    let mut peak_cache = 0u64;
    let bar = progress::bar((depths.len() * reps) as u64, "runs", quiet);
    let mut logits = vec![0.0f32; info.vocab];
    for &d in &depths {
        let (mut pp, mut tg, mut bg, mut rs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            bar.set_message(format!("depth {d}"));
            let mut s = Session::new(model.clone(), opts.clone())?;
            if d > 0 {
                s.feed(&ids[..d], None)?;
            }
            let t = Instant::now();
            s.feed(&ids[d..d + a.prompt], Some(&mut logits))?;
            pp.push(a.prompt as f64 / t.elapsed().as_secs_f64());
            if a.restore {
                let bytes = s.save_bytes()?;
                let t = Instant::now();
                let r = Session::load_bytes(model.clone(), &bytes)?;
                rs.push((d + a.prompt) as f64 / t.elapsed().as_secs_f64());
                drop(r);
            }
            if a.batch > 1 && a.gen_tokens > 0 {
                let mut forks = (0..a.batch).map(|_| s.fork()).collect::<Result<Vec<_>>>()?;
                let mut out = vec![0.0f32; a.batch * info.vocab];
                let mut next = vec![argmax(&logits); a.batch];
                let t = Instant::now();
                for _ in 0..a.gen_tokens {
                    let lists: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
                    let mut refs: Vec<&mut Session> = forks.iter_mut().collect();
                    Session::feed_batch(&mut refs, &lists, Some(&mut out))?;
                    for (n, l) in next.iter_mut().zip(out.chunks_exact(info.vocab)) {
                        *n = argmax(l);
                    }
                }
                bg.push((a.batch * a.gen_tokens) as f64 / t.elapsed().as_secs_f64());
            }
            if a.gen_tokens > 0 {
                let t = Instant::now();
                for _ in 0..a.gen_tokens {
                    let next = argmax(&logits);
                    s.feed(&[next], Some(&mut logits))?;
                }
                tg.push(a.gen_tokens as f64 / t.elapsed().as_secs_f64());
            }
            peak_cache = peak_cache.max(s.stats().peak_cache_bytes);
            bar.inc(1);
        }
        let row = |test, depth, tokens, v: Vec<f64>| {
            let (median_tps, min_tps, max_tps) = summary(&v);
            Row {
                test,
                depth,
                tokens,
                median_tps,
                min_tps,
                max_tps,
                samples: v,
            }
        };
        let test = if d == 0 { "prefill" } else { "continuation" };
        rows.push(row(test, d, a.prompt, pp));
        if a.gen_tokens > 0 {
            rows.push(row("decode", d + a.prompt, a.gen_tokens, tg));
        }
        if !bg.is_empty() {
            let test = "batch decode";
            rows.push(row(test, d + a.prompt, a.batch * a.gen_tokens, bg));
        }
        if !rs.is_empty() {
            rows.push(row("restore", 0, d + a.prompt, rs));
        }
    }
    bar.finish_and_clear();
    let (_, peak_rss) = rss();
    let (dense, vocab) = model.weight_formats();
    let report = Report {
        model: dir.display().to_string(),
        params: info.params,
        chunk: opts.prefill_chunk,
        cache: opts.cache_dtype.to_string(),
        dense_weights: dense.to_string(),
        vocab_weights: vocab.to_string(),
        weight_bytes: model.weight_bytes(),
        converted_bytes: model.converted_weight_bytes(),
        threads: model.threads(),
        backend: backend.name().to_string(),
        acp: !a.dense,
        load_seconds,
        rss_before_load,
        rss_after_load,
        peak_rss,
        peak_cache_bytes: peak_cache,
        reps,
        rows,
    };
    if a.json {
        let js = serde_json::to_string_pretty(&report)
            .map_err(|e| Error::Internal(format!("JSON: {e}")))?;
        println!("{js}");
    } else {
        print(&report);
    }
    Ok(())
}

fn mb(b: Option<u64>) -> String {
    b.map_or("?".into(), |b| format!("{:.1} MB", b as f64 / 1e6))
}

fn print(r: &Report) {
    println!(
        "{}: {:.1} M params, dense {} / vocab {}, weights {:.1} MB ({:.1} MB converted), {} \
         threads, {} backend, ACP {}",
        r.model,
        r.params as f64 / 1e6,
        r.dense_weights,
        r.vocab_weights,
        r.weight_bytes as f64 / 1e6,
        r.converted_bytes as f64 / 1e6,
        r.threads,
        r.backend,
        if r.acp { "on" } else { "off" },
    );
    println!(
        "load {:.2} s; RSS before load {}, after load {}, peak {}; peak cache {:.1} MB",
        r.load_seconds,
        mb(r.rss_before_load),
        mb(r.rss_after_load),
        mb(r.peak_rss),
        r.peak_cache_bytes as f64 / 1e6,
    );
    println!(
        "| test | tokens | depth | tokens/s (median of {}) | min | max |",
        r.reps
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for row in &r.rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} |",
            row.test, row.tokens, row.depth, row.median_tps, row.min_tps, row.max_tps
        );
    }
}
