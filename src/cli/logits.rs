//! `foxedge logits`: token ids (.npy) in, float32 logits (.npy) out.

use super::args::Args;
use foxedge::npy::{NpyArray, NpyData};
use foxedge::{BackendKind, Error, Model, Result, Session, SessionOptions};
use std::sync::Arc;

pub fn run(rest: Vec<String>) -> Result<()> {
    let mut a = Args::new(rest);
    let no_acp = a.flag("--no-acp");
    let log_eps: Option<f64> = a.parsed("--log-eps")?;
    let backend = a.parsed::<BackendKind>("--backend")?.unwrap_or_default();
    let model_dir = a.value("--model")?;
    let input = a
        .value("--input")?
        .ok_or_else(|| Error::InvalidArgument("--input ids.npy is required".into()))?;
    let output = a
        .value("--output")?
        .ok_or_else(|| Error::InvalidArgument("--output logits.npy is required".into()))?;
    a.finish()?;
    if no_acp && log_eps.is_some() {
        return Err(Error::InvalidArgument(
            "--no-acp and --log-eps exclude each other".into(),
        ));
    }
    let dir = match model_dir {
        Some(m) => m.into(),
        None => super::default_model_dir()?,
    };
    let model = Arc::new(Model::open(&dir)?);
    let vocab = model.info().vocab;
    let arr = NpyArray::read(&input)?;
    let ids = arr.to_i32()?;
    let (batch, t) = match arr.shape.as_slice() {
        [t] => (1, *t),
        [b, t] => (*b, *t),
        s => {
            return Err(Error::InvalidArgument(format!(
                "{input}: token ids must be [T] or [B, T], got shape {s:?}"
            )));
        }
    };
    if t == 0 {
        return Err(Error::InvalidArgument(format!("{input}: no tokens")));
    }
    let ids: Vec<u32> = ids
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            u32::try_from(x).map_err(|_| {
                Error::InvalidArgument(format!("{input}: token {x} at {i} is negative"))
            })
        })
        .collect::<Result<_>>()?;
    // Full cache (no eviction), one prefill chunk per row: logits of the whole sequence.
    let opts = SessionOptions {
        backend,
        ln_eps: if no_acp {
            None
        } else {
            Some(log_eps.unwrap_or(-10.0))
        },
        certified_eviction: false,
        prefill_chunk: t,
        max_entries_per_head: t,
        ..SessionOptions::default()
    };
    let mut out = vec![0.0f32; batch * t * vocab];
    let mut session = Session::new(model, opts)?;
    for b in 0..batch {
        if b > 0 {
            session.reset()?;
        }
        session.feed(
            &ids[b * t..(b + 1) * t],
            Some(&mut out[b * t * vocab..(b + 1) * t * vocab]),
        )?;
    }
    let mut shape = arr.shape.clone();
    shape.push(vocab);
    NpyArray {
        shape,
        data: NpyData::F32(out),
    }
    .write(&output)?;
    eprintln!("foxedge: wrote {output} ({batch} x {t} x {vocab} float32)");
    Ok(())
}
