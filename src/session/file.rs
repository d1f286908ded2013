//! Session files: a session's whole state written to bytes and read back, so that the
//! restored session continues bit-identically; and [`Session::fork`].
//!
//! # Format (version 1)
//!
//! Little-endian throughout; `f32`/`f64` as their IEEE-754 bits. A 32-byte header, a
//! payload, and a checksum:
//!
//! ```text
//! offset  size  field
//! 0       8     magic "FOXSESS\0"
//! 8       4     u32 format version (1)
//! 12      4     u32 flags (0)
//! 16      8     u64 model identity (Model::identity: config, safetensors header, size)
//! 24      8     u64 payload length P
//! 32      P     payload
//! 32+P    8     u64 checksum: XXH3-64 of bytes 0 .. 32+P
//! ```
//!
//! The payload, in order (`[n] T` = n values of T; `bool` = one byte 0 or 1):
//!
//! ```text
//! shape    u32 layers, u32 heads, u32 head_dim, u32 hidden       (must match the model)
//! options  u8 backend (0 cpu, 1 vulkan, 2 auto, 3 hybrid), bool has ln_eps, f64 ln_eps,
//!          bool certified_eviction, u8 budget kind (0 none, 1 entries per head,
//!          2 entries per layer, 3 bytes), u64 budget, u64 window, u64 sinks,
//!          u64 prefill_chunk, u64 max_entries_per_head, bool scored,
//!          u8 cache dtype (0 f32, 1 f16)
//! stats    u64 tokens, u64 prefill_tokens, f64 prefill_seconds, u64 decode_tokens,
//!          f64 decode_seconds, u64 kept_pairs, u64 total_pairs, u64 peak_cache_bytes
//! layers   per layer:
//!          [hidden] f32 k shift state, [hidden] f32 v shift state,
//!          [heads] f64 largest key norm, u64 peak live entries,
//!          bool has last position, u64 last position,
//!          per head: f64 gate origin, f64 gate c, u64 gates pushed,
//!                    u64 live, u64 appended, f64 c_t, u64 evicted certified,
//!                    u64 evicted forced, f64 certificate lse,
//!                    per live entry (slot order): u64 position, f64 c, f32 score,
//!                      u8 zone (0 sink, 1 evictable, 2 protected),
//!                    [live * head_dim] K rows, then V rows, in the cache dtype
//! ```
//!
//! Reading checks the magic, version, length and checksum before anything else, then the
//! model identity and shape, then every value as the kernels and the retention policy
//! need it ([`RetentionPolicy::restore`] refuses states no stream can reach). Any failure
//! is [`Error::SessionFile`] and leaves the caller's session as it was.

use super::{
    Budget, CacheDtype, HeadCache, LayerState, Policy, Session, SessionOptions, SessionStats,
};
use crate::backend::BackendKind;
use crate::error::{Error, Result, SessionFileError};
use crate::model::Model;
use foxedge_core::gate::GateStream;
use foxedge_core::retention::{
    EntryRecord, EntryZone, HeadRecord, HeadState, RetentionPolicy, Slot,
};
use std::path::Path;
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"FOXSESS\0";
const VERSION: u32 = 1;
const HEADER: usize = 32;

fn err(reason: SessionFileError, message: impl Into<String>) -> Error {
    Error::SessionFile {
        reason,
        message: message.into(),
    }
}

fn corrupt(message: impl Into<String>) -> Error {
    err(SessionFileError::Corrupt, message)
}

/// Little-endian writer.
struct W(Vec<u8>);

impl W {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn f64(&mut self, x: f64) {
        self.u64(x.to_bits());
    }
    fn f32s(&mut self, x: &[f32]) {
        self.0.reserve(4 * x.len());
        for v in x {
            self.0.extend_from_slice(&v.to_bits().to_le_bytes());
        }
    }
}

/// Little-endian reader of the payload; running out is [`SessionFileError::Truncated`]
/// (the declared length disagrees with the contents).
struct R<'a> {
    b: &'a [u8],
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.b.len() {
            return Err(err(
                SessionFileError::Truncated,
                format!("payload ends {} bytes early", n - self.b.len()),
            ));
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn flag(&mut self, what: &str) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            x => Err(corrupt(format!("{what}: {x} is not a boolean"))),
        }
    }
    fn u32(&mut self) -> Result<u32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn usize(&mut self, what: &str) -> Result<usize> {
        let x = self.u64()?;
        usize::try_from(x).map_err(|_| corrupt(format!("{what} {x} does not fit this machine")))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }
    /// `n` f32 values, after checking that the payload holds them (no allocation first).
    fn f32s(&mut self, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let bytes = self.take(
            n.checked_mul(4)
                .ok_or_else(|| corrupt("row count overflows"))?,
        )?;
        out.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
            what: "session file rows".into(),
            bytes: 4 * n,
        })?;
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        );
        Ok(())
    }
}

fn backend_code(k: BackendKind) -> u8 {
    match k {
        BackendKind::Cpu => 0,
        BackendKind::Vulkan => 1,
        BackendKind::Auto => 2,
        BackendKind::Hybrid => 3,
    }
}

fn zone_code(z: EntryZone) -> u8 {
    match z {
        EntryZone::Sink => 0,
        EntryZone::Evictable => 1,
        EntryZone::Protected => 2,
    }
}

impl Session {
    /// The session's whole state in the session file format (module docs).
    ///
    /// Errors: [`Error::Internal`] for a session poisoned by an earlier internal error.
    pub fn save_bytes(&self) -> Result<Vec<u8>> {
        if self.poisoned {
            return Err(Error::Internal(
                "session poisoned by an earlier internal error: nothing to save".into(),
            ));
        }
        let info = self.model.info();
        let mut w = W(Vec::new());
        w.0.extend_from_slice(MAGIC);
        w.u32(VERSION);
        w.u32(0);
        w.u64(self.model.identity());
        w.u64(0); // payload length, filled in below
        for x in [info.layers, info.heads, info.head_dim, info.hidden] {
            w.u32(x as u32);
        }
        let o = &self.opts;
        w.u8(backend_code(o.backend));
        w.u8(u8::from(o.ln_eps.is_some()));
        w.f64(o.ln_eps.unwrap_or(0.0));
        w.u8(u8::from(o.certified_eviction));
        let (kind, n) = match o.budget {
            None => (0, 0),
            Some(Budget::EntriesPerHead(n)) => (1, n),
            Some(Budget::EntriesPerLayer(n)) => (2, n),
            Some(Budget::Bytes(n)) => (3, n),
        };
        w.u8(kind);
        w.u64(n as u64);
        for x in [o.window, o.sinks, o.prefill_chunk, o.max_entries_per_head] {
            w.u64(x as u64);
        }
        w.u8(u8::from(o.scored));
        w.u8(match o.cache_dtype {
            CacheDtype::F32 => 0,
            CacheDtype::F16 => 1,
        });
        let st = &self.stats;
        w.u64(st.tokens);
        w.u64(st.prefill_tokens);
        w.f64(st.prefill_seconds);
        w.u64(st.decode_tokens);
        w.f64(st.decode_seconds);
        w.u64(st.kept_pairs);
        w.u64(st.total_pairs);
        w.u64(st.peak_cache_bytes);
        for ls in &self.layers {
            w.f32s(&ls.k_shift);
            w.f32s(&ls.v_shift);
            for &x in &ls.k_norm_max {
                w.f64(x);
            }
            w.u64(ls.peak_live as u64);
            let last = ls.policy.last_position();
            w.u8(u8::from(last.is_some()));
            w.u64(last.unwrap_or(0));
            for (h, hc) in ls.heads.iter().enumerate() {
                let g = &ls.gates[h];
                w.f64(g.origin());
                w.f64(g.current());
                w.u64(g.len());
                let rec = ls.policy.head_record(h)?;
                w.u64(rec.live as u64);
                w.u64(rec.pushed);
                w.f64(rec.c_t);
                w.u64(rec.evicted_certified);
                w.u64(rec.evicted_forced);
                w.f64(rec.lse);
                for s in 0..rec.live {
                    let e = ls.policy.entry(h, s)?;
                    w.u64(e.position);
                    w.f64(e.c);
                    w.u32(e.score.to_bits());
                    w.u8(zone_code(e.zone));
                }
                hc.write_rows(&mut w.0);
            }
        }
        let payload = (w.0.len() - HEADER) as u64;
        w.0[24..32].copy_from_slice(&payload.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&w.0);
        w.u64(sum);
        Ok(w.0)
    }

    /// Writes [`Session::save_bytes`] to `path`, through a temporary file beside it that
    /// is renamed over `path`, so a failed save leaves an earlier file whole.
    ///
    /// Errors: those of [`Session::save_bytes`]; [`Error::Io`].
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.save_bytes()?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        std::fs::write(&tmp, &bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(path, e)
        })
    }

    /// A new session over `model` in the state of a session file's bytes, with the
    /// options it was saved with (its backend kind opened anew).
    ///
    /// Errors: [`Error::SessionFile`] naming why the bytes were refused (not a session
    /// file, another version, truncated, checksum mismatch, another model, corrupt
    /// contents); those of [`Session::new`] for the saved options.
    pub fn load_bytes(model: Arc<Model>, bytes: &[u8]) -> Result<Session> {
        let (opts, parts) = parse(&model, bytes)?;
        let mut s = Session::new(model, opts)?;
        s.install(parts)?;
        Ok(s)
    }

    /// [`Session::load_bytes`] of the file at `path`.
    pub fn load(model: Arc<Model>, path: impl AsRef<Path>) -> Result<Session> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Session::load_bytes(model, &bytes)
    }

    /// Replaces this session's state with a session file's: its options (all but the
    /// backend and the thread pool, which stay this session's), cache, gates, policy,
    /// positions and statistics. On any error the session is unchanged. A session that ran
    /// on a Vulkan device continues on the CPU (the device does not hold the restored
    /// state).
    ///
    /// Errors: as [`Session::load_bytes`].
    pub fn restore_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let (mut opts, parts) = parse(&self.model, bytes)?;
        opts.backend = self.opts.backend;
        opts.threads = 0;
        let mut s = Session::with_backend(self.model.clone(), opts, self.backend.clone())?;
        s.install(parts)?;
        s.opts.threads = self.opts.threads;
        s.pool = self.pool.clone();
        *self = s;
        Ok(())
    }

    /// [`Session::restore_bytes`] of the file at `path`.
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        self.restore_bytes(&bytes)
    }

    /// A copy of this session that continues on its own (a branch of the conversation):
    /// the same model, options, backend, thread pool, cache, gates, policy and statistics.
    /// The copy runs on the CPU (a Vulkan device holds only the original's stream).
    ///
    /// Errors: [`Error::Internal`] for a poisoned session; [`Error::OutOfMemory`].
    pub fn fork(&self) -> Result<Session> {
        if self.poisoned {
            return Err(Error::Internal(
                "session poisoned by an earlier internal error: nothing to fork".into(),
            ));
        }
        let mut layers = Vec::new();
        layers
            .try_reserve_exact(self.layers.len())
            .map_err(|_| Error::OutOfMemory {
                what: "forked session".into(),
                bytes: self.stats.cache_bytes as usize,
            })?;
        for ls in &self.layers {
            layers.push(LayerState {
                k_shift: ls.k_shift.clone(),
                v_shift: ls.v_shift.clone(),
                gates: ls.gates.clone(),
                heads: ls.heads.iter().map(HeadCache::fork).collect(),
                policy: ls.policy.clone(),
                k_norm_max: ls.k_norm_max.clone(),
                peak_live: ls.peak_live,
            });
        }
        Ok(Session {
            model: self.model.clone(),
            opts: self.opts.clone(),
            policy_cfg: self.policy_cfg,
            u: self.u.clone(),
            certified: self.certified.clone(),
            backend: self.backend.clone(),
            pool: self.pool.clone(),
            layers,
            stats: SessionStats {
                device_layers: 0,
                ..self.stats.clone()
            },
            poisoned: false,
            #[cfg(feature = "vulkan")]
            device: None,
        })
    }

    /// Puts parsed state into this fresh session (same model and options).
    fn install(&mut self, parts: Parts) -> Result<()> {
        let info = self.model.info();
        let dtype = self.opts.cache_dtype;
        let slots = self.policy_cfg.slots_needed()?;
        let mut layers = Vec::with_capacity(info.layers);
        for (l, pl) in parts.layers.into_iter().enumerate() {
            let mut store = Vec::new();
            store
                .try_reserve_exact(slots)
                .map_err(|_| Error::OutOfMemory {
                    what: "retention policy slots".into(),
                    bytes: slots.saturating_mul(std::mem::size_of::<Slot>()),
                })?;
            store.resize(slots, Slot::EMPTY);
            let records: Vec<HeadRecord> = pl.heads.iter().map(|h| h.record).collect();
            let ages: Vec<Vec<usize>> = pl
                .heads
                .iter()
                .map(|h| {
                    let mut order: Vec<usize> = (0..h.entries.len())
                        .filter(|&s| h.entries[s].zone != EntryZone::Sink)
                        .collect();
                    order.sort_by_key(|&s| h.entries[s].position);
                    order
                })
                .collect();
            let policy: Policy = RetentionPolicy::restore(
                self.policy_cfg,
                &self.u[l],
                store,
                vec![HeadState::EMPTY; info.heads],
                pl.last_position,
                &records,
                |h, s| pl.heads[h].entries[s],
                |h, i| ages[h].get(i).copied().unwrap_or(usize::MAX),
            )
            .map_err(|e| corrupt(format!("layer {l} retention state: {e}")))?;
            if pl.peak_live < policy.live_total() || pl.peak_live > slots {
                return Err(corrupt(format!(
                    "layer {l}: peak of {} live entries, {} live now, {slots} slots",
                    pl.peak_live,
                    policy.live_total()
                )));
            }
            let mut gates = Vec::with_capacity(info.heads);
            let mut heads = Vec::with_capacity(info.heads);
            for (h, ph) in pl.heads.into_iter().enumerate() {
                if ph.gate.2 != ph.record.pushed {
                    return Err(corrupt(format!(
                        "layer {l} head {h}: {} gates for {} tokens",
                        ph.gate.2, ph.record.pushed
                    )));
                }
                if ph.gate.1 != ph.record.c_t {
                    return Err(corrupt(format!(
                        "layer {l} head {h}: gate c is not the policy's c_t"
                    )));
                }
                gates.push(
                    GateStream::from_parts(ph.gate.0, ph.gate.1, ph.gate.2)
                        .map_err(|e| corrupt(format!("layer {l} head {h}: {e}")))?,
                );
                heads.push(HeadCache::from_file(
                    dtype,
                    &ph.rows,
                    &ph.entries,
                    info.head_dim,
                )?);
            }
            layers.push(LayerState {
                k_shift: pl.k_shift,
                v_shift: pl.v_shift,
                gates,
                heads,
                policy,
                k_norm_max: pl.k_norm_max,
                peak_live: pl.peak_live,
            });
        }
        self.release_cache();
        self.leave_device();
        self.layers = layers;
        self.stats = SessionStats {
            bound_per_head: vec![Some(0.0); info.layers * info.heads],
            ..parts.stats
        };
        self.poisoned = false;
        self.update_cache_stats();
        Ok(())
    }
}

/// One head of a parsed file.
struct PartHead {
    /// (origin, c, count) of the gate stream.
    gate: (f64, f64, u64),
    record: HeadRecord,
    entries: Vec<EntryRecord>,
    /// K rows then V rows as stored ([`HeadCache::from_file`]).
    rows: Vec<u8>,
}

struct PartLayer {
    k_shift: Vec<f32>,
    v_shift: Vec<f32>,
    k_norm_max: Vec<f64>,
    peak_live: usize,
    last_position: Option<u64>,
    heads: Vec<PartHead>,
}

/// A parsed file's state (before the policy checks of `install`).
struct Parts {
    stats: SessionStats,
    layers: Vec<PartLayer>,
}

/// Checks a file's frame (magic, version, length, checksum, model) and parses its payload.
fn parse(model: &Model, bytes: &[u8]) -> Result<(SessionOptions, Parts)> {
    use SessionFileError::*;
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(err(NotASessionFile, "no FOXSESS magic at the start"));
    }
    if bytes.len() < HEADER {
        return Err(err(
            Truncated,
            format!("{} bytes: shorter than the header", bytes.len()),
        ));
    }
    let mut h = R {
        b: &bytes[8..HEADER],
    };
    let version = h.u32()?;
    if version != VERSION {
        return Err(err(
            Version,
            format!("format version {version}; this build reads version {VERSION}"),
        ));
    }
    let flags = h.u32()?;
    let identity = h.u64()?;
    let payload = h.u64()?;
    let total = usize::try_from(payload)
        .ok()
        .and_then(|p| p.checked_add(HEADER + 8))
        .ok_or_else(|| err(Corrupt, format!("payload length {payload} is impossible")))?;
    if bytes.len() < total {
        return Err(err(Truncated, format!("{} bytes of {total}", bytes.len())));
    }
    if bytes.len() > total {
        return Err(err(
            Corrupt,
            format!("{} bytes after the checksum", bytes.len() - total),
        ));
    }
    let body = &bytes[..total - 8];
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&bytes[total - 8..]);
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum) {
        return Err(err(Checksum, "checksum mismatch: the file is damaged"));
    }
    if flags != 0 {
        return Err(err(Version, format!("unknown flags {flags:#x}")));
    }
    if identity != model.identity() {
        return Err(err(
            OtherModel,
            format!(
                "saved from model {identity:016x}, this is {:016x} ({})",
                model.identity(),
                model.dir().display()
            ),
        ));
    }
    let mut r = R { b: &body[HEADER..] };
    let info = model.info();
    let shape = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
    let want = [info.layers, info.heads, info.head_dim, info.hidden];
    if shape.iter().zip(want).any(|(&a, b)| a as usize != b) {
        return Err(err(
            OtherModel,
            format!("shape {shape:?}, the model's is {want:?}"),
        ));
    }
    let backend = match r.u8()? {
        0 => BackendKind::Cpu,
        1 => BackendKind::Vulkan,
        2 => BackendKind::Auto,
        3 => BackendKind::Hybrid,
        x => return Err(corrupt(format!("backend code {x}"))),
    };
    let has_eps = r.flag("has ln_eps")?;
    let eps = r.f64()?;
    let certified_eviction = r.flag("certified_eviction")?;
    let kind = r.u8()?;
    let n = r.usize("budget")?;
    let budget = match kind {
        0 => None,
        1 => Some(Budget::EntriesPerHead(n)),
        2 => Some(Budget::EntriesPerLayer(n)),
        3 => Some(Budget::Bytes(n)),
        x => return Err(corrupt(format!("budget kind {x}"))),
    };
    let window = r.usize("window")?;
    let sinks = r.usize("sinks")?;
    let prefill_chunk = r.usize("prefill_chunk")?;
    let max_entries_per_head = r.usize("max_entries_per_head")?;
    let scored = r.flag("scored")?;
    let cache_dtype = match r.u8()? {
        0 => CacheDtype::F32,
        1 => CacheDtype::F16,
        x => return Err(corrupt(format!("cache dtype {x}"))),
    };
    let opts = SessionOptions {
        backend,
        ln_eps: has_eps.then_some(eps),
        certified_eviction,
        budget,
        window,
        sinks,
        prefill_chunk,
        max_entries_per_head,
        scored,
        cache_dtype,
        threads: 0,
    };
    // The options must make a session (the same checks as `Session::new`, without a
    // backend); a file that passed the checksum but not these is corrupt.
    super::policy_config(model, &opts).map_err(|e| corrupt(format!("saved options: {e}")))?;
    let stats = SessionStats {
        tokens: r.u64()?,
        prefill_tokens: r.u64()?,
        prefill_seconds: r.f64()?,
        decode_tokens: r.u64()?,
        decode_seconds: r.f64()?,
        kept_pairs: r.u64()?,
        total_pairs: r.u64()?,
        peak_cache_bytes: r.u64()?,
        ..SessionStats::default()
    };
    let (d, nh, hd) = (info.hidden, info.heads, info.head_dim);
    let mut layers = Vec::with_capacity(info.layers);
    for l in 0..info.layers {
        let (mut k_shift, mut v_shift) = (Vec::new(), Vec::new());
        r.f32s(d, &mut k_shift)?;
        r.f32s(d, &mut v_shift)?;
        let mut k_norm_max = Vec::with_capacity(nh);
        for _ in 0..nh {
            let x = r.f64()?;
            if !(x.is_finite() && x >= 0.0) {
                return Err(corrupt(format!("layer {l}: key norm {x}")));
            }
            k_norm_max.push(x);
        }
        let peak_live = r.usize("peak live")?;
        let has_last = r.flag("has last position")?;
        let last = r.u64()?;
        if has_last && last.checked_add(1) != Some(stats.tokens) {
            return Err(corrupt(format!(
                "layer {l}: last position {last} with {} tokens fed",
                stats.tokens
            )));
        }
        let mut heads = Vec::with_capacity(nh);
        for h in 0..nh {
            let gate = (r.f64()?, r.f64()?, r.u64()?);
            let live = r.usize("live entries")?;
            let record = HeadRecord {
                live,
                pushed: r.u64()?,
                c_t: r.f64()?,
                evicted_certified: r.u64()?,
                evicted_forced: r.u64()?,
                lse: r.f64()?,
            };
            // 21 bytes per entry and two rows of at least 2 bytes per value must be
            // present before anything is allocated for them.
            let per = 21 + 2 * hd * cache_dtype.bytes();
            if live.checked_mul(per).is_none_or(|b| b > r.b.len()) {
                return Err(err(
                    Truncated,
                    format!("layer {l} head {h}: {live} entries do not fit the payload"),
                ));
            }
            let mut entries = Vec::with_capacity(live);
            for _ in 0..live {
                let position = r.u64()?;
                let c = r.f64()?;
                let score = f32::from_bits(r.u32()?);
                let zone = match r.u8()? {
                    0 => EntryZone::Sink,
                    1 => EntryZone::Evictable,
                    2 => EntryZone::Protected,
                    x => return Err(corrupt(format!("layer {l} head {h}: zone {x}"))),
                };
                entries.push(EntryRecord {
                    position,
                    c,
                    score,
                    zone,
                });
            }
            let n = 2 * live * hd * cache_dtype.bytes();
            let rows = r.take(n)?.to_vec();
            heads.push(PartHead {
                gate,
                record,
                entries,
                rows,
            });
        }
        layers.push(PartLayer {
            k_shift,
            v_shift,
            k_norm_max,
            peak_live,
            last_position: has_last.then_some(last),
            heads,
        });
    }
    if !r.b.is_empty() {
        return Err(corrupt(format!("{} bytes after the last layer", r.b.len())));
    }
    Ok((opts, Parts { stats, layers }))
}
