//! `foxedge logits`: token ids (.npy) in, float32 logits (.npy) out.

use super::{AcpArgs, ModelArg, npy, progress};
use clap::Args;
use foxedge::{BackendKind, Error, Result, Session, SessionOptions};
use std::path::PathBuf;
use std::sync::Arc;

/// Token ids (.npy) in, float32 logits of every position (.npy) out
///
/// Ids: int32, int64 or uint8, shape [T] or [B, T]. Logits: float32, [T, V] or [B, T, V].
/// Each row is one prefill over a full cache (no eviction).
#[derive(Debug, Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Token ids (.npy, C order)
    #[arg(long, value_name = "IDS.npy")]
    input: PathBuf,
    /// Where to write the logits (.npy, float32)
    #[arg(long, value_name = "LOGITS.npy")]
    output: PathBuf,
    #[command(flatten)]
    pub(super) acp: AcpArgs,
    /// Compute backend: cpu, vulkan, auto or hybrid
    #[arg(long, value_name = "KIND", default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// No progress bar on stderr (it is also hidden when stderr is not a terminal)
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(a: LogitsArgs) -> Result<()> {
    let model = Arc::new(a.model.open(a.quiet)?);
    let vocab = model.info().vocab;
    let ids = npy::read_token_ids(&a.input)?;
    let (batch, t) = (ids.rows(), ids.row_len());
    // Full cache (no eviction), one prefill chunk per row: logits of the whole sequence.
    let opts = SessionOptions {
        backend: a.backend,
        ln_eps: a.acp.ln_eps(),
        certified_eviction: false,
        prefill_chunk: t,
        max_entries_per_head: t,
        ..SessionOptions::default()
    };
    let n = batch
        .checked_mul(t)
        .and_then(|n| n.checked_mul(vocab))
        .ok_or_else(|| Error::InvalidArgument(format!("{}: too many tokens", a.input.display())))?;
    let mut out: Vec<f32> = Vec::new();
    out.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        what: "logits".into(),
        bytes: n.saturating_mul(4),
    })?;
    out.resize(n, 0.0);
    let mut session = Session::new(model, opts)?;
    let bar = progress::bar((batch * t) as u64, "tokens", a.quiet);
    for (b, (row, logits)) in ids.ids.chunks(t).zip(out.chunks_mut(t * vocab)).enumerate() {
        if b > 0 {
            session.reset()?;
        }
        session.feed(row, Some(logits))?;
        bar.inc(t as u64);
    }
    bar.finish_and_clear();
    let mut shape = ids.shape.clone();
    shape.push(vocab);
    npy::write_f32(&a.output, &shape, &out)?;
    eprintln!(
        "foxedge: wrote {} ({batch} x {t} x {vocab} float32)",
        a.output.display()
    );
    Ok(())
}
