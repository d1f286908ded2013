//! The attention-kernel interface a backend implements, and the CPU backend.
//!
//! The model runner does the dense layer math itself and calls a backend only for
//! forgetting attention (prefill and decode), through the `AttentionBackend` trait. Its
//! calls carry the kernel contract's own argument, option and statistics types
//! (`foxedge_core::contract`, which both kernel crates take), plus what only the facade
//! has: the one shape of prefill it makes ([`PrefillCall`]) and the change tracking of
//! each cache head it owns ([`HeadSync`], for a backend that mirrors the cache on a
//! device).

use crate::error::{Error, Result};
use foxedge_core::contract::{
    Acp, AttentionStats, CacheHead, ContinueArgs, ContinueOptions, DecodeArgs, HeadStats, HeadSync,
    Journal, PrefillArgs, PrefillOptions, Storage,
};
use half::f16;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

/// `count` consecutive cache ids never handed out before in this process: the first is
/// returned. Every owner of a cache head (a session, a benchmark's decode inputs, a
/// calibration) takes its [`HeadSync::id`]s here, so a device mirror keyed by id never
/// mixes two heads.
pub(crate) fn fresh_cache_ids(count: usize) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(count as u64, Ordering::Relaxed)
}

/// Fewest writes a [`WriteJournal`] keeps.
const JOURNAL_MIN: usize = 16;

/// The latest row writes of one cache head, kept by its owner for [`HeadSync::journal`]:
/// write `i` (oldest first) is of row `rows[i]` at version `since + 1 + i`, every version
/// after `since` being one row's write.
///
/// Invariant: `since + rows.len()` is the head's version, and for a head of `n` entries
/// the journal holds the latest `keep = max(16, n / 16)` writes at least (all of them
/// since the last [`WriteJournal::rewrote_all`]) and `2 keep` at most: past `2 keep` the
/// oldest are dropped down to `keep`, so a drop moves `keep` words per `keep` writes.
/// Its memory is at most about half a byte per entry (the session's `entry_bytes` counts
/// it).
#[derive(Debug, Default)]
pub(crate) struct WriteJournal {
    since: u64,
    rows: Vec<u32>,
}

impl WriteJournal {
    /// Writes always kept for a head of `live` entries.
    fn keep(live: usize) -> usize {
        JOURNAL_MIN.max(live / 16)
    }

    /// Notes that `version` (the head's next) wrote `row`, the head now holding `live`
    /// entries. A version out of sequence, or a row past `u32`, restarts the journal
    /// there (mirrors behind it then scan, which is always exact).
    pub fn wrote(&mut self, row: usize, version: u64, live: usize) {
        let next = self.since + self.rows.len() as u64 + 1;
        match u32::try_from(row) {
            Ok(r) if version == next => self.rows.push(r),
            _ => return self.rewrote_all(version),
        }
        let keep = Self::keep(live);
        if self.rows.len() > 2 * keep {
            let drop = self.rows.len() - keep;
            self.since += drop as u64;
            self.rows.drain(..drop);
        }
    }

    /// Notes that `version` wrote every row (a re-basing): nothing older is kept.
    pub fn rewrote_all(&mut self, version: u64) {
        self.rows.clear();
        self.since = version;
    }

    /// The writes kept, as a [`HeadSync`] carries them.
    pub fn view(&self) -> Journal<'_> {
        Journal {
            since: self.since,
            rows: &self.rows,
        }
    }

    /// Reserves room for the writes a head of up to `live` entries keeps, so that
    /// [`WriteJournal::wrote`] does not allocate.
    pub fn try_reserve(
        &mut self,
        live: usize,
    ) -> std::result::Result<(), std::collections::TryReserveError> {
        let want = 2 * Self::keep(live) + 1;
        self.rows
            .try_reserve_exact(want.saturating_sub(self.rows.len()))
    }
}

/// Which compute backend a session runs attention on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendKind {
    /// SIMD CPU kernels (foxedge-cpu). Always available.
    #[default]
    Cpu,
    /// Vulkan compute kernels (foxedge-vulkan).
    Vulkan,
    /// In a session: the whole model on a discrete or integrated GPU, else the layers on the
    /// CPU with each attention call on cpu, vulkan or hybrid by measured costs; the CPU when
    /// there is no device.
    Auto,
    /// Heavy heads on the GPU, light heads on the CPU (needs the Vulkan backend).
    Hybrid,
}

impl BackendKind {
    /// The lowercase name accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Vulkan => "vulkan",
            BackendKind::Auto => "auto",
            BackendKind::Hybrid => "hybrid",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendKind::Cpu),
            "vulkan" | "gpu" => Ok(BackendKind::Vulkan),
            "auto" => Ok(BackendKind::Auto),
            "hybrid" => Ok(BackendKind::Hybrid),
            _ => Err(Error::invalid(format!(
                "backend `{s}`: expected cpu, vulkan, auto or hybrid"
            ))),
        }
    }
}

/// A prefill as the facade makes it: one sequence of `t` tokens from an empty cache,
/// seq-first (`q`, `k`, `v`, `out`: `[t, heads, head_dim]`, `log_f`: `[t, heads]`), f32,
/// one kv head per query head, keys from position 0, the kernels' default scale and
/// tiles.
///
/// It holds the contract's arguments and options themselves; what it adds is that shape,
/// which its constructor fixes and which the ACP decisions of the facade (one head per
/// slab, [`crate::decisions::BLOCK`]-token tiles) and a split's sides rely on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillCall<'a> {
    args: PrefillArgs<'a, f32>,
    opts: PrefillOptions<'a>,
}

impl<'a> PrefillCall<'a> {
    /// A dense call over every head; sizes are checked by the kernels.
    pub(crate) fn new(
        t: usize,
        heads: usize,
        head_dim: usize,
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        log_f: &'a [f32],
    ) -> Self {
        PrefillCall {
            args: PrefillArgs {
                shape: foxedge_core::AttentionShape {
                    batch: 1,
                    heads_q: heads,
                    heads_kv: heads,
                    seq_q: t,
                    seq_k: t,
                    head_dim,
                    layout: foxedge_core::Layout::SeqFirst,
                },
                q,
                k,
                v,
                log_fgate: log_f,
                seq_start: None,
            },
            opts: PrefillOptions::default(),
        }
    }

    /// This call pruned by `acp`: `Off`, `Bound` (one `U` per head), `ObservedNorms`,
    /// `Threshold` (one `delta` per head) or `Decided` (this call's decisions, made with
    /// foxedge-core on the default tile grid by a caller that planned the call from them).
    pub(crate) fn with_acp(self, acp: Acp<'a>) -> Self {
        PrefillCall {
            opts: PrefillOptions { acp, ..self.opts },
            ..self
        }
    }

    /// This call computing only the heads `only` (strictly increasing, each `< heads`;
    /// `None`: all). The other heads' output rows are left as they are and the statistics
    /// cover these heads alone, in order (a split's two sides share one call's output this
    /// way); `acp`'s bounds and decisions stay indexed by the call's heads.
    pub(crate) fn with_heads(self, only: Option<&'a [usize]>) -> Self {
        PrefillCall {
            opts: PrefillOptions {
                heads: only,
                ..self.opts
            },
            ..self
        }
    }

    /// The kernels' arguments.
    pub(crate) fn args(&self) -> &PrefillArgs<'a, f32> {
        &self.args
    }

    /// The kernels' options.
    pub(crate) fn options(&self) -> &PrefillOptions<'a> {
        &self.opts
    }

    /// Tokens.
    pub(crate) fn t(&self) -> usize {
        self.args.shape.seq_q
    }

    pub(crate) fn heads(&self) -> usize {
        self.args.shape.heads_q
    }

    pub(crate) fn head_dim(&self) -> usize {
        self.args.shape.head_dim
    }

    pub(crate) fn acp(&self) -> Acp<'a> {
        self.opts.acp
    }
}

/// A chunk of new tokens against the retained cache and, causally, themselves (the
/// kernels' [`ContinueArgs`]: `q`, `k`, `v`, `out`: `[t, heads, head_dim]`). `acp` is
/// `Off`, `Bound` (one `U` per head) or `Threshold` (one `delta` per head).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ContinueCall<'a, T: Storage = f32> {
    pub args: ContinueArgs<'a, T>,
    pub acp: Acp<'a>,
}

/// Queries of one step against the retained cache (which already holds their own keys),
/// whose K and V rows are stored as `T` (f32 or f16).
///
/// `args` is the kernels' call: `q`, `out`: `[heads, n_queries, head_dim]`. `acp` is `Off`,
/// `Bound` (one `U` per head) or `Threshold` (one `delta` per head); the other decode
/// options (tiles, the flash-decoding split) are each backend's. What the contract's
/// arguments lack is `sync`: the owner's change tracking of each head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeCall<'a, T: Storage = f32> {
    pub args: DecodeArgs<'a, f32, T>,
    /// One per head of `args`, or empty: the heads carry no change tracking (a backend
    /// that mirrors caches must then treat every row as new).
    pub sync: &'a [HeadSync<'a>],
    pub acp: Acp<'a>,
}

/// The heads `idx` of a decode call, gathered ([`DecodeCall::part`]): queries and
/// per-head pruning values are copied, cache heads stay views.
pub(crate) struct DecodePart<'c, T: Storage = f32> {
    q: Vec<f32>,
    q_c: Vec<f64>,
    q_pos: Option<Vec<u64>>,
    heads: Vec<CacheHead<'c, T>>,
    sync: Vec<HeadSync<'c>>,
    /// The heads' bounds or thresholds, where the call's `acp` has them.
    per_head: Vec<f64>,
}

impl<'c, T: Storage> DecodeCall<'c, T> {
    /// Heads `idx` (each `< heads`) of this call, to run as a call of their own
    /// ([`DecodePart::call`]).
    pub(crate) fn part(&self, idx: &[usize]) -> DecodePart<'c, T> {
        let a = &self.args;
        let (nq, d) = (a.n_queries, a.head_dim);
        let rows = |x: &[f64], per: usize| -> Vec<f64> {
            idx.iter()
                .flat_map(|&h| x[h * per..(h + 1) * per].to_vec())
                .collect()
        };
        DecodePart {
            q: idx
                .iter()
                .flat_map(|&h| a.q[h * nq * d..(h + 1) * nq * d].to_vec())
                .collect(),
            q_c: rows(a.q_c, nq),
            q_pos: a.q_pos.map(|p| {
                idx.iter()
                    .flat_map(|&h| p[h * nq..(h + 1) * nq].to_vec())
                    .collect()
            }),
            heads: idx.iter().map(|&h| a.heads[h]).collect(),
            sync: idx
                .iter()
                .filter_map(|&h| self.sync.get(h).copied())
                .collect(),
            per_head: match self.acp {
                Acp::Bound { u, .. } => rows(u, 1),
                Acp::Threshold(t) => rows(t, 1),
                _ => Vec::new(),
            },
        }
    }
}

impl<T: Storage> DecodePart<'_, T> {
    /// The part as a call, pruned as `whole` was.
    pub(crate) fn call<'a>(&'a self, whole: &DecodeCall<'a, T>) -> DecodeCall<'a, T> {
        let acp = match whole.acp {
            Acp::Bound { ln_eps, .. } => Acp::Bound {
                u: &self.per_head,
                ln_eps,
            },
            Acp::Threshold(_) => Acp::Threshold(&self.per_head),
            other => other,
        };
        DecodeCall {
            args: DecodeArgs {
                head_dim: whole.args.head_dim,
                n_queries: whole.args.n_queries,
                q: &self.q,
                q_c: &self.q_c,
                q_pos: self.q_pos.as_deref(),
                heads: &self.heads,
            },
            sync: &self.sync,
            acp,
        }
    }
}

/// The statistics of an `n`-head call from its parts' (each part's heads `idx`, in order).
pub(crate) fn merge_stats<'i>(
    n: usize,
    parts: impl IntoIterator<Item = (&'i [usize], AttentionStats)>,
) -> AttentionStats {
    let mut st = AttentionStats {
        heads: vec![HeadStats::default(); n],
    };
    for (idx, part) in parts {
        for (&h, hs) in idx.iter().zip(part.heads) {
            st.heads[h] = hs;
        }
    }
    st
}

/// A prefill whose kernels ran ([`AttentionBackend::prefill_run`]): `finish` writes its
/// heads' output rows.
pub(crate) trait PrefillRun: Send {
    /// Writes the computed heads' rows of `out` (`[t, heads, head_dim]`), leaving the
    /// others as they are; returns the statistics.
    fn finish(self: Box<Self>, out: &mut [f32]) -> Result<AttentionStats>;
}

/// [`AttentionBackend::prefill_run`] of a backend with one phase: the output of its heads,
/// computed into a buffer of the whole call's size.
struct Computed {
    full: Vec<f32>,
    heads: usize,
    head_dim: usize,
    only: Option<Vec<usize>>,
    stats: AttentionStats,
}

impl PrefillRun for Computed {
    fn finish(self: Box<Self>, out: &mut [f32]) -> Result<AttentionStats> {
        if out.len() != self.full.len() {
            return Err(Error::invalid("prefill out: [t, heads, head_dim] values"));
        }
        let (nh, d) = (self.heads, self.head_dim);
        for (o, f) in out
            .chunks_exact_mut(nh * d)
            .zip(self.full.chunks_exact(nh * d))
        {
            match &self.only {
                Some(sel) => {
                    for &h in sel {
                        o[h * d..(h + 1) * d].copy_from_slice(&f[h * d..(h + 1) * d]);
                    }
                }
                None => o.copy_from_slice(f),
            }
        }
        Ok(self.stats)
    }
}

/// The attention kernels a backend provides. Implementations are stateless with respect to
/// a session (the session owns every buffer), so one backend may serve many sessions.
pub(crate) trait AttentionBackend: Send + Sync + fmt::Debug {
    fn kind(&self) -> BackendKind;
    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats>;
    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats>;
    /// Runs `call` up to its output, which the result's `finish` writes (a split runs its
    /// GPU side this way while its CPU side writes the other heads into the same output).
    /// `on_packed` runs once the call stops needing the host's cores until `finish` (not
    /// if it fails before): the Vulkan backend's packed inputs. Default: `on_packed`, then
    /// [`Self::prefill`] into a buffer of its own, copied out by `finish`.
    fn prefill_run(
        &self,
        call: &PrefillCall<'_>,
        on_packed: &mut dyn FnMut(),
    ) -> Result<Box<dyn PrefillRun + '_>> {
        on_packed();
        let mut full = vec![0.0f32; call.t() * call.heads() * call.head_dim()];
        let stats = self.prefill(call, &mut full)?;
        Ok(Box::new(Computed {
            full,
            heads: call.heads(),
            head_dim: call.head_dim(),
            only: call.options().heads.map(<[usize]>::to_vec),
            stats,
        }))
    }
    /// [`Self::decode`] over f16 cache rows. Default: the CPU kernel.
    fn decode_f16(&self, call: &DecodeCall<'_, f16>, out: &mut [f32]) -> Result<AttentionStats> {
        CpuBackend.decode_f16(call, out)
    }
    /// Continuation prefill ([`ContinueCall`]). Default: the CPU kernel (no device kernel
    /// exists yet; the cache rows it reads are the session's own).
    fn prefill_continue(&self, call: &ContinueCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        CpuBackend.prefill_continue(call, out)
    }
    /// [`Self::prefill_continue`] over f16 cache rows. Default: the CPU kernel.
    fn prefill_continue_f16(
        &self,
        call: &ContinueCall<'_, f16>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        CpuBackend.prefill_continue_f16(call, out)
    }
    /// The cache heads with these [`HeadSync::id`]s are gone (their session was reset or
    /// dropped): a backend that mirrors them may free the mirrors. Default: nothing kept.
    fn release_cache(&self, _ids: &[u64]) {}
}

/// The SIMD CPU kernels of foxedge-cpu.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CpuBackend;

impl AttentionBackend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        foxedge_cpu::prefill(call.args(), call.options(), out, None).map_err(kernel_error)
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        cpu_decode(call, out)
    }

    fn decode_f16(&self, call: &DecodeCall<'_, f16>, out: &mut [f32]) -> Result<AttentionStats> {
        cpu_decode(call, out)
    }

    fn prefill_continue(&self, call: &ContinueCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        cpu_continue(call, out)
    }

    fn prefill_continue_f16(
        &self,
        call: &ContinueCall<'_, f16>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        cpu_continue(call, out)
    }
}

fn cpu_decode<T: Storage>(call: &DecodeCall<'_, T>, out: &mut [f32]) -> Result<AttentionStats> {
    let opts = foxedge_core::contract::DecodeOptions {
        acp: call.acp,
        ..Default::default()
    };
    foxedge_cpu::decode(&call.args, &opts, out, None).map_err(kernel_error)
}

fn cpu_continue<T: Storage>(call: &ContinueCall<'_, T>, out: &mut [f32]) -> Result<AttentionStats> {
    let opts = ContinueOptions {
        acp: call.acp,
        ..Default::default()
    };
    foxedge_cpu::prefill_continue(&call.args, &opts, out).map_err(kernel_error)
}

/// A cache storage type (f32 or f16) and the backend methods that take calls over it.
pub(crate) trait KvElem: Storage {
    fn decode(
        b: &dyn AttentionBackend,
        call: &DecodeCall<'_, Self>,
        out: &mut [f32],
    ) -> Result<AttentionStats>;
    fn prefill_continue(
        b: &dyn AttentionBackend,
        call: &ContinueCall<'_, Self>,
        out: &mut [f32],
    ) -> Result<AttentionStats>;
}

impl KvElem for f32 {
    fn decode(
        b: &dyn AttentionBackend,
        call: &DecodeCall<'_>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        b.decode(call, out)
    }
    fn prefill_continue(
        b: &dyn AttentionBackend,
        call: &ContinueCall<'_>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        b.prefill_continue(call, out)
    }
}

impl KvElem for f16 {
    fn decode(
        b: &dyn AttentionBackend,
        call: &DecodeCall<'_, f16>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        b.decode_f16(call, out)
    }
    fn prefill_continue(
        b: &dyn AttentionBackend,
        call: &ContinueCall<'_, f16>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        b.prefill_continue_f16(call, out)
    }
}

/// The session validated every argument it passes, so a kernel error is a broken invariant,
/// except non-finite attention logits: q, k and v come from the model's weights, and a
/// model whose activations overflow f32 on this input is reported as a bad model.
fn kernel_error(e: foxedge_core::Error) -> Error {
    if e == foxedge_cpu::NON_FINITE {
        return Error::BadModel {
            item: "weights".into(),
            message: "the model's activations overflow f32 (attention q, k or v not finite)".into(),
        };
    }
    Error::Internal(format!("attention kernel refused its arguments: {e}"))
}

/// Whether a GPU backend's error means "stop using the GPU" (a lost device, device memory
/// exhausted) rather than bad input: the call then reruns on the CPU, and so does every
/// later one.
pub(crate) fn is_device_failure(e: &Error) -> bool {
    matches!(e, Error::BackendUnavailable(_) | Error::OutOfMemory { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The journal holds the latest writes in order, ends at the version, and keeps
        /// between `max(16, n / 16)` (or all since a re-basing) and twice that.
        #[test]
        fn journal_keeps_the_latest_writes_within_its_bound(
            start in 0usize..3000,
            ops in proptest::collection::vec((0u8..8, 0usize..100_000, 0u8..3), 0..400),
        ) {
            // A head's entries move by at most one per write (an append or an eviction).
            let mut live = start;
            let mut j = WriteJournal::default();
            let mut version = 0u64;
            let mut all: Vec<(u64, u32)> = Vec::new();
            let mut since_all = 0u64;
            for (op, row, step) in ops {
                version += 1;
                live = (live + usize::from(step)).saturating_sub(1);
                if op == 0 {
                    j.rewrote_all(version);
                    all.clear();
                    since_all = version;
                } else {
                    j.wrote(row, version, live);
                    all.push((version, row as u32));
                    let keep = JOURNAL_MIN.max(live / 16);
                    prop_assert!(j.rows.len() <= 2 * keep);
                    let written = (version - since_all) as usize;
                    prop_assert!(j.rows.len() >= keep.min(written));
                }
                let Journal { since, rows } = j.view();
                prop_assert_eq!(since + rows.len() as u64, version);
                let tail: Vec<u32> = all
                    .iter()
                    .filter(|&&(v, _)| v > since)
                    .map(|&(_, r)| r)
                    .collect();
                prop_assert_eq!(rows, &tail[..]);
            }
        }
    }

    #[test]
    fn journal_restarts_on_a_version_out_of_sequence() {
        let mut j = WriteJournal::default();
        j.wrote(3, 1, 10);
        j.wrote(4, 2, 10);
        let at = |j: &WriteJournal| (j.view().since, j.view().rows.to_vec());
        assert_eq!(at(&j), (0, vec![3u32, 4]));
        j.wrote(5, 7, 10);
        assert_eq!(at(&j), (7, vec![]));
        j.wrote(usize::MAX, 8, 10);
        assert_eq!(at(&j), (8, vec![]));
        j.try_reserve(4096).unwrap();
        assert!(j.rows.capacity() > 2 * 4096 / 16);
    }

    #[test]
    fn parse_backend_names() {
        for k in [
            BackendKind::Cpu,
            BackendKind::Vulkan,
            BackendKind::Auto,
            BackendKind::Hybrid,
        ] {
            assert_eq!(k.name().parse::<BackendKind>().unwrap(), k);
        }
        assert!("tpu".parse::<BackendKind>().is_err());
    }

    /// Non-finite logits come from the model's activations (a bad model, as the C ABI
    /// reports it); any other refusal is a broken invariant. A quantized_model fuzz finding.
    #[test]
    fn kernel_errors_are_classified() {
        use crate::error::ErrorKind;
        assert_eq!(
            kernel_error(foxedge_cpu::NON_FINITE).kind(),
            ErrorKind::BadModel
        );
        assert_eq!(
            kernel_error(foxedge_core::Error::BadShape("x")).kind(),
            ErrorKind::Internal
        );
    }
}
