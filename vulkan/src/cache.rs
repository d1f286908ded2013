//! A device-resident decode cache: mirrors of cache heads kept on the device between steps,
//! so a decode step uploads only the rows written since the mirror last synced (an append,
//! the swap-delete moves of eviction, every row after a re-basing of c) instead of the whole
//! cache.
//!
//! A mirror is one buffer per head in the decode kernel's layout (`decode.rs`: `cap` rows
//! of K, `cap` rows of V, `cap` meta words with c and the position), `cap` a power of two
//! grown by doubling (old rows copied on the device). Heads are identified by the caller's
//! [`HeadSync::id`], unique for the life of the process, with a version per row: the mirror
//! uploads row `j` when `row_version[j] > synced`, the newest version it has seen. That is
//! exact when the caller keeps the invariant of `HeadSync`. Finding those rows reads every
//! row's version (O(n) per head and step: 170-185 us for 16 heads of 64k entries on the
//! H100 host) unless the head comes with a [`Journal`] of its latest writes that reaches
//! back to `synced`: then it reads only the rows written since (O(rows sent)).
//!
//! Rows reach a mirror through the scatter kernel (`scatter.comp`), which binds the whole
//! buffer. Copy commands into row ranges would split vulkano's per-buffer map of access
//! ranges at every row, and each submit walks that map: with copies, a 16-head 16k-entry
//! step on the H100 host slowed from 0.5 to 6 ms over 5000 steps. With the scatter kernel
//! vulkano's command-buffer build took 101-109 us per step over 10,000 steps.
//!
//! Device memory of mirrors is accounted and bounded by a budget: beyond it (or when an
//! allocation fails) the least-recently-used mirrors not needed by the current step are
//! dropped (their next step uploads them whole); a step that cannot fit even then is
//! [`Error::OutOfDeviceMemory`], not a crash. A step's small buffers (inputs, partials,
//! results: O(heads x chunks x head_dim) words, outside the budget) and its staging and
//! readback buffers are kept from step to step and grow only (`arena.rs`), so a steady
//! step allocates nothing.

use crate::arena::{Arena, Kind};
use crate::decode::{self, HeadRef, Uploads};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pack::pack_rows;
use foxedge_core::contract::{
    AttentionStats, DecodeArgs, DecodeOptions, HeadSync, Journal, Storage,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use vulkano::buffer::Subbuffer;
use vulkano::command_buffer::{BufferCopy, CopyBufferInfo};
use vulkano::memory::MemoryHeapFlags;

/// Counters of a [`ResidentCache`] since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Decode steps run against the cache.
    pub steps: u64,
    /// Cache rows uploaded (K, V and meta of one entry each), and their bytes.
    pub rows_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Heads uploaded whole: a new mirror, a re-created one, or a head without sync.
    pub full_uploads: u64,
    /// Heads whose changed rows were found by reading every row's version (no
    /// [`Journal`], or one that did not reach back to the mirror's version).
    pub scans: u64,
    /// Mirrors whose capacity doubled, and mirrors dropped to stay under the budget.
    pub grows: u64,
    pub evictions: u64,
    /// Device bytes held by mirrors now, and how many mirrors.
    pub resident_bytes: u64,
    pub mirrors: u64,
}

/// Settings of a [`ResidentCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResidentOptions {
    /// Keep K and V as f16 on the device (half the bytes; rounds f32 input), else f32.
    pub f16: bool,
    /// Most device bytes the mirrors may hold; `None`: half the largest device-local heap.
    pub budget_bytes: Option<u64>,
}

/// A doubled mirror's old rows: (old buffer, new buffer, K / V / meta regions).
type GrowCopy = (Subbuffer<[u32]>, Subbuffer<[u32]>, Vec<BufferCopy>);

struct Mirror {
    buf: Subbuffer<[u32]>,
    cap: usize,
    n: usize,
    synced: u64,
    d: usize,
    last_use: u64,
    /// `[ceil(n / bk)]` the least c of each `bk`-entry block (`decode::block_minima`), kept
    /// up to date from the rows written, so the ACP decisions do not read every c.
    bk: usize,
    bmin: Vec<f64>,
}

impl Mirror {
    fn bytes(&self) -> u64 {
        self.buf.size()
    }
}

/// Mirrors of cache heads on one device; see the module documentation.
pub struct ResidentCache {
    ctx: Arc<Context>,
    tuning: crate::DecodeTuning,
    f16: bool,
    budget: u64,
    mirrors: HashMap<u64, Mirror>,
    clock: u64,
    counters: CacheCounters,
    /// The steps' small buffers (inputs, partials, results, staging, readback), reused.
    arena: Arena,
}

impl std::fmt::Debug for ResidentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentCache")
            .field("f16", &self.f16)
            .field("budget", &self.budget)
            .field("counters", &self.counters)
            .finish()
    }
}

/// Row ranges `[a, b)`.
type Runs = Vec<(usize, usize)>;

/// Rows `j < n` with `row_version[j] > synced`, as runs `[a, b)`; `None` when a row is
/// newer than `version` (the caller broke the [`HeadSync`] invariant).
fn dirty_runs(row_version: &[u64], synced: u64, version: u64) -> Option<Runs> {
    let mut runs = Runs::new();
    for (j, &v) in row_version.iter().enumerate() {
        if v > synced {
            if v > version {
                return None;
            }
            add_row(&mut runs, j);
        }
    }
    Some(runs)
}

/// Adds row `j` (at or after every row added before) to `runs`.
fn add_row(runs: &mut Runs, j: usize) {
    match runs.last_mut() {
        Some(r) if r.1 == j => r.1 = j + 1,
        _ => runs.push((j, j + 1)),
    }
}

/// [`dirty_runs`] from a journal, for a mirror synced at `synced >= j.since`: the rows
/// written after `synced` (deduplicated, rows `>= n` skipped), as runs `[a, b)`; `None`
/// when the journal does not end at `version` or reach back to `synced` (the caller then
/// scans the row versions).
fn journal_runs(j: &Journal<'_>, n: usize, synced: u64, version: u64) -> Option<Runs> {
    if synced < j.since || j.since.checked_add(j.rows.len() as u64) != Some(version) {
        return None;
    }
    let from = usize::try_from(synced - j.since).ok()?;
    let mut rows: Vec<usize> = j.rows.get(from..)?.iter().map(|&r| r as usize).collect();
    rows.retain(|&r| r < n);
    rows.sort_unstable();
    rows.dedup();
    let mut runs = Runs::new();
    for r in rows {
        add_row(&mut runs, r);
    }
    Some(runs)
}

impl ResidentCache {
    pub(crate) fn new(
        ctx: Arc<Context>,
        tuning: crate::DecodeTuning,
        opts: ResidentOptions,
    ) -> Self {
        let heap = ctx
            .device
            .physical_device()
            .memory_properties()
            .memory_heaps
            .iter()
            .filter(|h| h.flags.intersects(MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .unwrap_or(1 << 30);
        Self {
            ctx,
            tuning,
            f16: opts.f16,
            budget: opts.budget_bytes.unwrap_or(heap / 2),
            mirrors: HashMap::new(),
            clock: 0,
            counters: CacheCounters::default(),
            arena: Arena::new(true),
        }
    }

    /// Counters so far (resident bytes and mirrors as of now).
    pub fn counters(&self) -> CacheCounters {
        CacheCounters {
            resident_bytes: self.mirrors.values().map(Mirror::bytes).sum(),
            mirrors: self.mirrors.len() as u64,
            ..self.counters
        }
    }

    /// The budget in force (bytes).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Changes the budget; mirrors over it are dropped at the next step.
    pub fn set_budget(&mut self, bytes: u64) {
        self.budget = bytes;
    }

    /// Decode-kernel launch shape for later steps.
    pub fn set_tuning(&mut self, t: crate::DecodeTuning) {
        self.tuning = t;
    }

    /// Drops the mirrors of these heads (their owner reset or went away).
    pub fn forget(&mut self, ids: &[u64]) {
        for id in ids {
            self.mirrors.remove(id);
        }
    }

    /// Drops every mirror.
    pub fn clear(&mut self) {
        self.mirrors.clear();
    }

    fn resident(&self) -> u64 {
        self.mirrors.values().map(Mirror::bytes).sum()
    }

    /// Drops the least recently used mirror not in `keep`; false when there is none.
    fn evict_one(&mut self, keep: &HashSet<u64>) -> bool {
        let victim = self
            .mirrors
            .iter()
            .filter(|(id, _)| !keep.contains(id))
            .min_by_key(|(_, m)| m.last_use)
            .map(|(&id, _)| id);
        match victim {
            Some(id) => {
                self.mirrors.remove(&id);
                self.counters.evictions += 1;
                true
            }
            None => false,
        }
    }

    /// A device buffer of `words` for a mirror, within the budget (`extra`: bytes this step
    /// already allocated and not yet counted in a mirror).
    fn alloc(&mut self, words: usize, keep: &HashSet<u64>, extra: u64) -> Result<Subbuffer<[u32]>> {
        let bytes = words as u64 * 4;
        while self.resident() + extra + bytes > self.budget {
            if !self.evict_one(keep) {
                return Err(Error::OutOfDeviceMemory);
            }
        }
        loop {
            match self.ctx.device_buffer(words) {
                Ok(b) => return Ok(b),
                Err(Error::OutOfDeviceMemory) => {
                    if !self.evict_one(keep) {
                        return Err(Error::OutOfDeviceMemory);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One decode step against the mirrors: heads with `Some` sync are brought up to date
    /// (only their changed rows uploaded) and read in place; heads with `None` are uploaded
    /// whole for this step. Same results and statistics as [`crate::Vulkan::decode`].
    ///
    /// Errors: bad input or a broken sync invariant ([`Error::Input`]), device memory
    /// exhausted even after dropping every other mirror ([`Error::OutOfDeviceMemory`]),
    /// device failures. A failed step leaves every mirror as it was.
    pub fn decode<Q: Storage, T: Storage, O: Storage>(
        &mut self,
        args: &DecodeArgs<'_, Q, T>,
        sync: &[Option<HeadSync<'_>>],
        opts: &DecodeOptions<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<AttentionStats> {
        let t0 = std::time::Instant::now();
        decode::validate_except_c(args, opts, |h| sync.get(h).is_some_and(Option::is_some))?;
        let (d, nh) = (args.head_dim, args.heads.len());
        decode::check_out_len(nh * args.n_queries, d, out, lse.as_deref())?;
        if sync.len() != nh {
            return Err(foxedge_core::Error::BadLength {
                what: "decode sync (one per head)",
                expected: nh,
                got: sync.len(),
            }
            .into());
        }
        for (s, hc) in sync.iter().zip(args.heads) {
            if let Some(s) = s {
                if s.row_version.len() != hc.c.len() {
                    return Err(foxedge_core::Error::BadLength {
                        what: "row_version (one per cache entry)",
                        expected: hc.c.len(),
                        got: s.row_version.len(),
                    }
                    .into());
                }
            }
        }
        let f16 = self.f16;
        let t_val = t0.elapsed();
        let kernel = decode::kernel(&self.ctx, &self.tuning, d, f16)?;
        // The pipeline, compiled on its first use in this context (~130-190 ms on the H100).
        let t_kernel = t0.elapsed();
        let limit = self
            .ctx
            .binding_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        self.clock += 1;
        let keep: HashSet<u64> = sync.iter().flatten().map(|s| s.id).collect();
        let rw = decode::row_words(d, f16);
        let row_bytes = (2 * rw + 4) as u64 * 4;

        // New mirror states, applied only once the step has run.
        let mut pending: Vec<(u64, Mirror)> = Vec::new();
        let mut grow_copies: Vec<GrowCopy> = Vec::new();
        let mut up = Uploads::default();
        let mut heads = Vec::with_capacity(nh);
        let mut rows = 0u64;
        let mut full = 0u64;
        let mut grows = 0u64;
        let mut extra = 0u64;
        // Rows written since each mirror's version: from the head's journal when it
        // reaches back that far, else an O(n) scan of the row versions (heads in parallel
        // when any head scans); None where no usable mirror exists (the same test as `old`
        // below: this step's mirrors are in `keep`, so none is dropped before its head is
        // reached).
        let usable = |s: &HeadSync<'_>| {
            self.mirrors
                .get(&s.id)
                .filter(|m| m.d == d && m.synced <= s.version)
        };
        let mut dirty: Vec<Option<Option<Runs>>> = sync
            .iter()
            .map(|s| {
                let s = s.as_ref()?;
                let m = usable(s)?;
                Some(
                    s.journal
                        .and_then(|j| journal_runs(&j, s.row_version.len(), m.synced, s.version)),
                )
            })
            .collect();
        let scan: Vec<usize> = (0..nh)
            .filter(|&h| matches!(dirty[h], Some(None)))
            .collect();
        let scans = scan.len() as u64;
        if !scan.is_empty() {
            use rayon::prelude::*;
            let found: Vec<Option<Runs>> = scan
                .par_iter()
                .map(|&h| {
                    let s = sync[h].as_ref()?;
                    dirty_runs(s.row_version, usable(s)?.synced, s.version)
                })
                .collect();
            for (&h, r) in scan.iter().zip(found) {
                dirty[h] = Some(r);
            }
        }
        let t_dirty = t0.elapsed();
        // Block minima of c for the decisions: a mirror's, updated for the rows written
        // since (O(blocks + rows written)); whole (O(n), heads in parallel) for a synced
        // head without them.
        let bk = opts.block_k;
        let mut minima: Vec<Option<Vec<f64>>> = (0..nh)
            .map(|h| {
                let s = sync[h].as_ref()?;
                let m = usable(s).filter(|m| m.bk == bk && m.bmin.len() == m.n.div_ceil(bk))?;
                let Some(Some(runs)) = dirty[h].as_ref() else {
                    return None;
                };
                let c = args.heads[h].c;
                Some(decode::update_block_minima(
                    m.bmin.clone(),
                    m.n,
                    c,
                    bk,
                    runs,
                ))
            })
            .collect();
        let whole: Vec<usize> = (0..nh)
            .filter(|&h| minima[h].is_none() && sync[h].is_some())
            .collect();
        if !whole.is_empty() {
            use rayon::prelude::*;
            let found: Vec<Vec<f64>> = whole
                .par_iter()
                .map(|&h| decode::block_minima(args.heads[h].c, bk))
                .collect();
            for (&h, m) in whole.iter().zip(found) {
                minima[h] = Some(m);
            }
        }
        let (plans, stats) = decode::plan(args, opts, &minima)?;
        let t_plan = t0.elapsed();
        for (h, hc) in args.heads.iter().enumerate() {
            let n = hc.c.len();
            let Some(s) = sync[h] else {
                let bytes = decode::head_words(n.max(1), d, f16) as u64 * 4;
                if bytes > limit {
                    return Err(Error::Unsupported(format!(
                        "one head's cache needs {bytes} bytes, over the binding limit {limit}"
                    )));
                }
                heads.push(decode::upload_head(&self.ctx, &mut up, hc, d, f16)?);
                rows += n as u64;
                full += 1;
                continue;
            };
            if let Some((_, m)) = pending.iter().find(|(id, _)| *id == s.id) {
                // The same head twice in one step: already brought up to date above.
                heads.push(HeadRef {
                    buf: m.buf.clone(),
                    cap: m.cap,
                });
                continue;
            }
            let broken = || {
                Error::Input(foxedge_core::Error::BadArgument(
                    "a row version is newer than its head's version",
                ))
            };
            let want_cap = n.max(64).next_power_of_two();
            let old = self
                .mirrors
                .get(&s.id)
                .filter(|m| m.d == d && m.synced <= s.version);
            let (buf, cap) = match old {
                Some(m) if m.cap >= n => (m.buf.clone(), m.cap),
                Some(m) => {
                    // Grown: doubled, the kept rows copied on the device.
                    let (old_buf, old_cap, keep_rows) = (m.buf.clone(), m.cap, m.n.min(n));
                    grows += 1;
                    let cap = want_cap.max(2 * old_cap);
                    let words = decode::head_words(cap, d, f16);
                    self.check_limit(words, limit)?;
                    let buf = self.alloc(words, &keep, extra)?;
                    extra += words as u64 * 4;
                    let region = |src: usize, dst: usize, len: usize| BufferCopy {
                        src_offset: src as u64 * 4,
                        dst_offset: dst as u64 * 4,
                        size: len as u64 * 4,
                        ..Default::default()
                    };
                    let mut regions = Vec::new();
                    if keep_rows > 0 {
                        regions.push(region(0, 0, keep_rows * rw));
                        regions.push(region(
                            decode::v_off(old_cap, d, f16),
                            decode::v_off(cap, d, f16),
                            keep_rows * rw,
                        ));
                        regions.push(region(
                            decode::meta_off(old_cap, d, f16),
                            decode::meta_off(cap, d, f16),
                            keep_rows * 4,
                        ));
                        grow_copies.push((old_buf, buf.clone(), regions));
                    }
                    (buf, cap)
                }
                None => {
                    if s.row_version.iter().any(|&v| v > s.version) {
                        return Err(broken());
                    }
                    let words = decode::head_words(want_cap, d, f16);
                    self.check_limit(words, limit)?;
                    let buf = self.alloc(words, &keep, extra)?;
                    extra += words as u64 * 4;
                    full += 1;
                    (buf, want_cap)
                }
            };
            let runs = match dirty[h].take() {
                Some(r) => r.ok_or_else(broken)?,
                // Nothing on the device yet: every row is uploaded.
                None => vec![(0, n)],
            };
            let mut meta = Vec::new();
            for &(a, b) in &runs {
                decode::check_c(&hc.c[a..b])?;
                let k = pack_rows(hc.k, f16, b - a, d, |r| (a + r) * d).words;
                let v = pack_rows(hc.v, f16, b - a, d, |r| (a + r) * d).words;
                up.push(&buf, a * rw, &k);
                up.push(&buf, decode::v_off(cap, d, f16) + a * rw, &v);
                meta.clear();
                decode::meta_words(&hc.c[a..b], hc.pos.map(|p| &p[a..b]), &mut meta);
                up.push(&buf, decode::meta_off(cap, d, f16) + a * 4, &meta);
                rows += (b - a) as u64;
            }
            heads.push(HeadRef {
                buf: buf.clone(),
                cap,
            });
            pending.push((
                s.id,
                Mirror {
                    buf,
                    cap,
                    n,
                    synced: s.version,
                    d,
                    last_use: self.clock,
                    bk,
                    bmin: minima[h].take().unwrap_or_default(),
                },
            ));
        }

        let t_prep = t0.elapsed();
        let step = decode::build_step(
            &self.ctx,
            &kernel,
            args,
            opts,
            &plans,
            &heads,
            &mut up,
            &mut self.arena,
        )?;
        let mut b = self.ctx.builder()?;
        let stamps = crate::profile()
            .then(|| crate::device::Stamps::new(&self.ctx, 4))
            .flatten();
        if let Some(s) = &stamps {
            s.reset(&mut b)?;
            s.stamp(&mut b, 0)?;
        }
        for (src, dst, regions) in grow_copies {
            let mut info = CopyBufferInfo::buffers(src, dst);
            info.regions.clear();
            info.regions.extend(regions);
            b.copy_buffer(info)?;
        }
        up.record(&self.ctx, &mut self.arena, &mut b)?;
        if let Some(s) = &stamps {
            s.stamp(&mut b, 1)?;
        }
        step.record(&mut b, 1)?;
        if let Some(s) = &stamps {
            s.stamp(&mut b, 2)?;
        }
        // Results back in the same submission: one copy of the step's results buffer.
        let host = self
            .arena
            .get(&self.ctx, Kind::Download, 0, step.results.len() as usize)?;
        b.copy_buffer(CopyBufferInfo::buffers(step.results.clone(), host.clone()))?;
        let base = step.results.offset() / 4;
        let span = |v: &Subbuffer<[u32]>| ((v.offset() / 4 - base) as usize, v.len() as usize);
        let spans: Vec<_> = step
            .groups
            .iter()
            .map(|g| (span(&g.out), span(&g.lse)))
            .collect();
        if let Some(s) = &stamps {
            s.stamp(&mut b, 3)?;
        }
        let t_build = t0.elapsed();
        let phases = self.ctx.submit_timed(b)?;
        let t_run = t0.elapsed();
        let words = host.read().map_err(|e| Error::Vulkan(e.to_string()))?;
        let slice = |(a, n): (usize, usize)| words[a..a + n].to_vec();
        let outs: Vec<(Vec<u32>, Vec<u32>)> =
            spans.iter().map(|&(o, l)| (slice(o), slice(l))).collect();
        let flag = step
            .groups
            .iter()
            .fold(0, |f, g| f | words[span(&g.flag).0]);
        drop(words);

        // The step ran: the mirrors now hold what was uploaded.
        for (id, m) in pending {
            self.mirrors.insert(id, m);
        }
        self.counters.steps += 1;
        self.counters.rows_uploaded += rows;
        self.counters.bytes_uploaded += rows * row_bytes;
        self.counters.full_uploads += full;
        self.counters.scans += scans;
        self.counters.grows += grows;
        step.scatter(&outs, flag, out, lse)?;
        let t_read = t0.elapsed();
        if crate::profile() {
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            // The round trip of a one-command submission, for comparison.
            let mut e = self.ctx.builder()?;
            e.fill_buffer(step.ctl.clone(), 0)?;
            let te = std::time::Instant::now();
            self.ctx.submit(e)?;
            let empty = te.elapsed();
            eprintln!(
                "foxedge-vulkan decode {nh} heads, {rows} rows sent: prep {:.0} us (checks {:.0}, \
                 kernel {:.0}, dirty rows {:.0}, plan {:.0}, packing {:.0}), build {:.0} \
                 us, submit+wait {:.0} us (barriers {:.0}, submit {:.0}, wait {:.0}), read {:.0} us; \
                 gpu upload/kernel/readback {:.0?} us; one-command round trip {:.0} us",
                us(t_prep),
                us(t_val),
                us(t_kernel - t_val),
                us(t_dirty - t_kernel),
                us(t_plan - t_dirty),
                us(t_prep - t_plan),
                us(t_build - t_prep),
                us(t_run - t_build),
                us(phases[0]),
                us(phases[1]),
                us(phases[2]),
                us(t_read - t_run),
                stamps.map(|s| s.gaps_us()).unwrap_or_default(),
                us(empty)
            );
        }
        Ok(stats)
    }

    fn check_limit(&self, words: usize, limit: u64) -> Result<()> {
        let bytes = words as u64 * 4;
        if bytes > limit {
            return Err(Error::Unsupported(format!(
                "one head's mirror needs {bytes} bytes, over the binding limit {limit}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Journal, dirty_runs, journal_runs};
    use proptest::prelude::*;

    /// A head's change tracking as an owner keeps it: row versions and a journal of at
    /// most `cap` writes (the oldest half dropped when full).
    struct Tracked {
        version: u64,
        rv: Vec<u64>,
        since: u64,
        rows: Vec<u32>,
        cap: usize,
    }

    impl Tracked {
        fn write(&mut self, row: usize) {
            self.version += 1;
            if row == self.rv.len() {
                self.rv.push(self.version);
            } else {
                self.rv[row] = self.version;
            }
            self.rows.push(row as u32);
            if self.rows.len() > self.cap {
                let drop = self.rows.len() - self.cap / 2;
                self.since += drop as u64;
                self.rows.drain(..drop);
            }
        }

        fn edit(&mut self, op: u8, x: usize) {
            let n = self.rv.len();
            match op {
                // Append.
                0 | 1 => self.write(n),
                // Swap-delete: the last row moves into row x, then the head shrinks.
                2 if n > 1 => {
                    self.write(x % (n - 1));
                    self.rv.truncate(n - 1);
                }
                3 if n > 0 => self.rv.truncate(n - 1),
                // Rewrite row x.
                4 if n > 0 => self.write(x % n),
                // Re-basing: every row at once.
                5 => {
                    self.version += 1;
                    self.rv.fill(self.version);
                    self.rows.clear();
                    self.since = self.version;
                }
                _ => {}
            }
        }

        fn journal(&self) -> Journal<'_> {
            Journal {
                since: self.since,
                rows: &self.rows,
            }
        }
    }

    proptest! {
        #[test]
        fn journal_runs_equal_the_scan(
            ops in proptest::collection::vec((0u8..6, 0usize..1000), 0..300),
            cap in 1usize..40,
            seen in proptest::collection::vec(0usize..300, 1..8),
        ) {
            let mut t = Tracked { version: 0, rv: vec![], since: 0, rows: vec![], cap };
            let mut synced = vec![0u64];
            for (i, &(op, x)) in ops.iter().enumerate() {
                t.edit(op, x);
                if seen.contains(&i) {
                    synced.push(t.version);
                }
                // Every version a mirror may hold, from the journal when it reaches back.
                for &s in &synced {
                    let want = dirty_runs(&t.rv, s, t.version);
                    prop_assert!(want.is_some());
                    match journal_runs(&t.journal(), t.rv.len(), s, t.version) {
                        Some(got) => prop_assert_eq!(Some(got), want),
                        None => prop_assert!(s < t.since, "synced {} since {}", s, t.since),
                    }
                }
            }
        }
    }

    #[test]
    fn a_journal_that_does_not_end_at_the_version_is_not_used() {
        let j = Journal {
            since: 4,
            rows: &[0, 2],
        };
        assert_eq!(journal_runs(&j, 3, 4, 6), Some(vec![(0, 1), (2, 3)]));
        assert_eq!(journal_runs(&j, 3, 5, 6), Some(vec![(2, 3)]));
        assert_eq!(journal_runs(&j, 3, 6, 6), Some(vec![]));
        assert_eq!(journal_runs(&j, 2, 4, 6), Some(vec![(0, 1)]));
        assert_eq!(journal_runs(&j, 3, 3, 6), None);
        assert_eq!(journal_runs(&j, 3, 4, 7), None);
        assert_eq!(journal_runs(&j, 3, 4, 5), None);
    }

    /// The definition: maximal runs of rows newer than `synced`; None if one is newer than
    /// `version`.
    fn dirty_runs_ref(rv: &[u64], synced: u64, version: u64) -> Option<Vec<(usize, usize)>> {
        if rv.iter().any(|&v| v > version) {
            return None;
        }
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (j, &v) in rv.iter().enumerate() {
            if v > synced {
                match runs.last_mut() {
                    Some(r) if r.1 == j => r.1 = j + 1,
                    _ => runs.push((j, j + 1)),
                }
            }
        }
        Some(runs)
    }

    proptest! {
        #[test]
        fn dirty_runs_match_the_definition(
            rv in proptest::collection::vec(0u64..12, 0..300),
            synced in 0u64..12,
            ahead in 0u64..3,
        ) {
            // (The caller's invariant: a mirror's version is never ahead of its head's.)
            let version = synced + ahead;
            prop_assert_eq!(dirty_runs(&rv, synced, version), dirty_runs_ref(&rv, synced, version));
        }
    }

    #[test]
    fn dirty_rows_come_as_runs() {
        assert_eq!(
            dirty_runs(&[1, 5, 6, 2, 7, 7], 4, 7),
            Some(vec![(1, 3), (4, 6)])
        );
        assert_eq!(dirty_runs(&[1, 2, 3], 3, 3), Some(vec![]));
        assert_eq!(dirty_runs(&[9], 0, 9), Some(vec![(0, 1)]));
        assert_eq!(dirty_runs(&[9, 10], 0, 9), None);
    }
}
