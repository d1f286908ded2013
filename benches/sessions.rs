//! Session benchmarks (wall time, one run each, ratios within one run):
//!
//! - `continue`: a 512-token prompt fed after 4,096 tokens of context (one tiled
//!   continuation call) against a fresh 512-token prompt; ACP off and on.
//! - `batch`: 8 sessions decoding together ([`Session::feed_batch`]) against one session
//!   decoding alone, aggregate tokens/s.
//! - `restore`: restoring a session that holds N tokens (default 16,384) from its bytes
//!   against re-feeding the N tokens.
//!
//!     FOXEDGE_MODEL=/tmp/fox125m RAYON_NUM_THREADS=2 \
//!       cargo bench --bench sessions -- continue batch restore
//!
//! `FOXEDGE_MODEL` defaults to the bundled fox-tiny-pro; `FOXEDGE_DEPTH`, `FOXEDGE_CHUNK`,
//! `FOXEDGE_RESTORE_TOKENS` override 4096, 512 and 16384. Token ids are a fixed
//! pseudo-random sequence below the vocabulary.

use foxedge::{CacheDtype, Model, Session, SessionOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn model() -> Arc<Model> {
    let dir = std::env::var_os("FOXEDGE_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/fox-tiny-pro"));
    Arc::new(Model::open(&dir).expect("model"))
}

fn ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn modes() -> [(&'static str, SessionOptions); 2] {
    [
        (
            "acp off",
            SessionOptions {
                ln_eps: None,
                certified_eviction: false,
                ..Default::default()
            },
        ),
        ("acp on", SessionOptions::default()),
    ]
}

fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

fn continuation(m: &Arc<Model>) {
    let depth = env_usize("FOXEDGE_DEPTH", 4096);
    let n = env_usize("FOXEDGE_CHUNK", 512);
    let v = m.info().vocab;
    let context = ids(depth, v, 1);
    let prompt = ids(n, v, 2);
    println!("continue: {n} tokens after {depth} vs a fresh {n}-token prompt");
    for (name, opts) in modes() {
        let mut logits = vec![0.0f32; v];
        let mut fresh = Session::new(m.clone(), opts.clone()).expect("session");
        let t_fresh = timed(|| fresh.feed(&prompt, Some(&mut logits)).expect("feed"));
        let mut s = Session::new(m.clone(), opts).expect("session");
        s.feed(&context, None).expect("context");
        let t_cont = timed(|| s.feed(&prompt, Some(&mut logits)).expect("feed"));
        println!(
            "  {name}: fresh {:.1} tok/s, continuation {:.1} tok/s, ratio {:.2}",
            n as f64 / t_fresh,
            n as f64 / t_cont,
            t_fresh / t_cont
        );
    }
}

fn batch(m: &Arc<Model>) {
    let b = 8;
    let steps = env_usize("FOXEDGE_BATCH_STEPS", 32);
    let v = m.info().vocab;
    let opts = SessionOptions::default();
    let mut sessions: Vec<Session> = (0..b)
        .map(|i| {
            let mut s = Session::new(m.clone(), opts.clone()).expect("session");
            s.feed(&ids(256, v, 10 + i as u64), None).expect("context");
            s
        })
        .collect();
    let mut one = Session::new(m.clone(), opts).expect("session");
    one.feed(&ids(256, v, 10), None).expect("context");
    let toks = ids(steps * b, v, 3);
    let mut logits = vec![0.0f32; b * v];
    let t_one = timed(|| {
        for t in &toks[..steps] {
            one.feed(&[*t], Some(&mut logits[..v])).expect("feed");
        }
    });
    let t_batch = timed(|| {
        for s in 0..steps {
            let lists: Vec<&[u32]> = (0..b).map(|i| &toks[s * b + i..s * b + i + 1]).collect();
            let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
            Session::feed_batch(&mut refs, &lists, Some(&mut logits)).expect("batch");
        }
    });
    let (r1, rb) = (steps as f64 / t_one, (steps * b) as f64 / t_batch);
    println!(
        "batch: {b} sessions decoding together {rb:.1} tok/s aggregate, one alone {r1:.1} tok/s, ratio {:.2}",
        rb / r1
    );
}

fn restore(m: &Arc<Model>) {
    let n = env_usize("FOXEDGE_RESTORE_TOKENS", 16384);
    let v = m.info().vocab;
    let text = ids(n, v, 4);
    for dtype in [CacheDtype::F16, CacheDtype::F32] {
        let opts = SessionOptions {
            cache_dtype: dtype,
            ..Default::default()
        };
        let mut s = Session::new(m.clone(), opts.clone()).expect("session");
        let t_feed = timed(|| s.feed(&text, None).expect("feed"));
        let bytes = s.save_bytes().expect("save");
        let mut r = None;
        let t_restore = timed(|| r = Some(Session::load_bytes(m.clone(), &bytes).expect("load")));
        let path = std::env::temp_dir().join(format!("foxedge-bench-{}.fxs", std::process::id()));
        s.save(&path).expect("save file");
        let t_file = timed(|| r = Some(Session::load(m.clone(), &path).expect("load file")));
        let _ = std::fs::remove_file(&path);
        println!(
            "restore ({dtype} cache): {n} tokens, {:.1} MiB; re-feed {t_feed:.3} s, restore from bytes \
             {t_restore:.4} s ({:.0}x), from a file {t_file:.4} s ({:.0}x)",
            bytes.len() as f64 / (1 << 20) as f64,
            t_feed / t_restore,
            t_feed / t_file
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let want = |n: &str| args.is_empty() || args.iter().any(|a| a == n);
    let m = model();
    if want("continue") {
        continuation(&m);
    }
    if want("batch") {
        batch(&m);
    }
    if want("restore") {
        restore(&m);
    }
}
