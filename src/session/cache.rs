//! The retained K/V rows of one cache head, in the retention policy's slot order and in
//! the session's cache dtype, with the change tracking that device mirrors read.

use super::CacheDtype;
use crate::aligned::{Aligned, Elem};
use crate::backend::{WriteJournal, fresh_cache_ids};
use crate::error::{Error, Result, SessionFileError};
use foxedge_core::contract::{CacheHead, HeadSync, Storage};
use foxedge_core::retention::{EntryRecord, Eviction};
use half::f16;

/// Bytes held per cache entry: K and V (`head_dim` values each in `dtype`) plus c (f64),
/// position (u64), the row's version (u64, for device mirrors) and a byte of write journal
/// (`WriteJournal`: at most one u32 per 8 entries, or 33 per head). The budget in bytes
/// and the statistics count this.
pub fn entry_bytes(head_dim: usize, dtype: CacheDtype) -> usize {
    2 * head_dim * dtype.bytes() + 25
}

/// K and V rows of one head, `[n, hd]` each, from a 64-byte boundary.
#[derive(Debug, Clone)]
pub(super) enum Rows {
    F32 { k: Aligned<f32>, v: Aligned<f32> },
    F16 { k: Aligned<f16>, v: Aligned<f16> },
}

/// An element type the cache stores (f32 or f16): how to find its rows.
pub(crate) trait RowsOf: Storage + Elem {
    /// `(k, v)` when `r` holds this type.
    fn of(r: &Rows) -> Option<(&[Self], &[Self])>;
    /// f32 rows as this type stores them (f32: as they are; f16: rounded, [`to_f16`]).
    fn stored(x: &[f32]) -> Result<std::borrow::Cow<'_, [Self]>>;
}

impl RowsOf for f32 {
    fn of(r: &Rows) -> Option<(&[f32], &[f32])> {
        match r {
            Rows::F32 { k, v } => Some((k, v)),
            Rows::F16 { .. } => None,
        }
    }
    fn stored(x: &[f32]) -> Result<std::borrow::Cow<'_, [f32]>> {
        Ok(std::borrow::Cow::Borrowed(x))
    }
}

impl RowsOf for f16 {
    fn of(r: &Rows) -> Option<(&[f16], &[f16])> {
        match r {
            Rows::F16 { k, v } => Some((k, v)),
            Rows::F32 { .. } => None,
        }
    }
    fn stored(x: &[f32]) -> Result<std::borrow::Cow<'_, [f16]>> {
        let mut out = vec![f16::ZERO; x.len()];
        to_f16(x, &mut out)?;
        Ok(std::borrow::Cow::Owned(out))
    }
}

/// Rounds `src` into f16 storage; a value past f16's range (|x| > 65504) is an error, not
/// an infinity that would poison every later softmax.
pub(super) fn to_f16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(x);
        if d.is_infinite() && x.is_finite() {
            return Err(Error::Unsupported(format!(
                "a cached K or V value ({x:e}) is beyond the f16 cache's range: use cache dtype f32"
            )));
        }
    }
    Ok(())
}

/// One head's retained entries, dense in slot order (the policy's slot `i` is row `i`).
///
/// Change tracking for device mirrors ([`HeadSync`]): `version` counts writes;
/// every write of a row (append, swap-delete move, re-basing of every `c`) sets its
/// `row_version` to a fresh `version`, so `row_version[j] <= version` always holds and a
/// changed row is newer than anything a mirror synced before. The journal lists the latest
/// writes, so a mirror a few steps behind finds its rows without reading every version.
#[derive(Debug)]
pub(super) struct HeadCache {
    rows: Rows,
    /// `c_j` relative to the head's gate origin.
    pub(super) c: Vec<f64>,
    /// Token position of each entry.
    pub(super) pos: Vec<u64>,
    /// Process-unique identity of this head's cache (a reset makes a new one).
    pub(super) id: u64,
    /// The newest write's version, and each row's.
    version: u64,
    row_version: Vec<u64>,
    journal: WriteJournal,
}

impl HeadCache {
    pub(super) fn new(dtype: CacheDtype) -> HeadCache {
        let rows = match dtype {
            CacheDtype::F32 => Rows::F32 {
                k: Aligned::new(),
                v: Aligned::new(),
            },
            CacheDtype::F16 => Rows::F16 {
                k: Aligned::new(),
                v: Aligned::new(),
            },
        };
        HeadCache {
            rows,
            c: Vec::new(),
            pos: Vec::new(),
            id: fresh_cache_ids(1),
            version: 0,
            row_version: Vec::new(),
            journal: WriteJournal::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.c.len()
    }

    /// A fresh version for a write.
    fn bump(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    /// The kernels' view of this head in storage `T` (the session's cache dtype).
    ///
    /// Errors: [`Error::Internal`] when the head stores another type.
    pub(super) fn view<T: RowsOf>(&self) -> Result<CacheHead<'_, T>> {
        let (k, v) = T::of(&self.rows)
            .ok_or_else(|| Error::Internal("cache head read in another dtype".into()))?;
        Ok(CacheHead {
            k,
            v,
            c: &self.c,
            pos: None,
        })
    }

    /// Makes room for `want` more entries of `hd` values, so that appends cannot fail on
    /// allocation half-way through a feed.
    pub(super) fn reserve(&mut self, want: usize, hd: usize, dtype: CacheDtype) -> Result<()> {
        let oom = |_| Error::OutOfMemory {
            what: "KV cache".into(),
            bytes: want.saturating_mul(entry_bytes(hd, dtype)),
        };
        match &mut self.rows {
            Rows::F32 { k, v } => {
                k.try_reserve(want * hd).map_err(oom)?;
                v.try_reserve(want * hd).map_err(oom)?;
            }
            Rows::F16 { k, v } => {
                k.try_reserve(want * hd).map_err(oom)?;
                v.try_reserve(want * hd).map_err(oom)?;
            }
        }
        self.c.try_reserve(want).map_err(oom)?;
        self.pos.try_reserve(want).map_err(oom)?;
        self.row_version.try_reserve(want).map_err(oom)?;
        self.journal.try_reserve(self.len() + want).map_err(oom)?;
        Ok(())
    }

    /// Appends one row (K and V rounded to the cache dtype).
    ///
    /// Errors: an f16 cache and a value beyond its range ([`to_f16`]); nothing changes.
    pub(super) fn push(&mut self, k: &[f32], v: &[f32], c: f64, pos: u64) -> Result<()> {
        match &mut self.rows {
            Rows::F32 { k: ks, v: vs } => {
                ks.extend_from_slice(k);
                vs.extend_from_slice(v);
            }
            Rows::F16 { k: ks, v: vs } => {
                let n = ks.len();
                let r = to_f16(k, ks.extend_zeroed(k.len()))
                    .and_then(|()| to_f16(v, vs.extend_zeroed(v.len())));
                if let Err(e) = r {
                    ks.truncate(n);
                    vs.truncate(n);
                    return Err(e);
                }
            }
        }
        self.c.push(c);
        self.pos.push(pos);
        let ver = self.bump();
        self.journal
            .wrote(self.row_version.len(), ver, self.c.len());
        self.row_version.push(ver);
        Ok(())
    }

    /// Subtracts `by` from every `c` (gate-origin re-basing): every row changes.
    pub(super) fn rebase(&mut self, by: f64) {
        for c in &mut self.c {
            *c -= by;
        }
        let ver = self.bump();
        self.row_version.fill(ver);
        self.journal.rewrote_all(ver);
    }

    /// Change tracking for a backend's device mirror.
    pub(super) fn sync(&self) -> HeadSync<'_> {
        HeadSync {
            id: self.id,
            version: self.version,
            row_version: &self.row_version,
            journal: Some(self.journal.view()),
        }
    }

    /// A head with these rows (`[n, hd]` each) and the `c` and positions of `entries`
    /// (slot order), every row new to device mirrors (a fresh identity).
    fn with_rows(rows: Rows, entries: impl Iterator<Item = (f64, u64)>) -> HeadCache {
        let (c, pos): (Vec<f64>, Vec<u64>) = entries.unzip();
        let n = c.len();
        let mut journal = WriteJournal::default();
        journal.rewrote_all(1);
        HeadCache {
            rows,
            c,
            pos,
            id: fresh_cache_ids(1),
            version: 1,
            row_version: vec![1; n],
            journal,
        }
    }

    /// A copy with a new identity (a forked session's head: its device mirror is its own).
    pub(super) fn fork(&self) -> HeadCache {
        let e = self.c.iter().copied().zip(self.pos.iter().copied());
        HeadCache::with_rows(self.rows.clone(), e)
    }

    /// A head holding the rows of `entries` (slot order) as a session file stores them:
    /// `k`, then `v`, `[n, hd]` values each of `dtype`, little-endian.
    ///
    /// Errors: [`Error::SessionFile`] for a non-finite value or a length that is not
    /// `2 * n * hd` values.
    pub(super) fn from_file(
        dtype: CacheDtype,
        bytes: &[u8],
        entries: &[EntryRecord],
        hd: usize,
    ) -> Result<HeadCache> {
        let n = entries.len() * hd;
        let bad = |m: &str| Error::SessionFile {
            reason: SessionFileError::Corrupt,
            message: m.into(),
        };
        if bytes.len() != 2 * n * dtype.bytes() {
            return Err(bad("cache rows of the wrong size"));
        }
        fn read<T: Elem>(b: &[u8], w: usize, f: impl Fn(&[u8]) -> T) -> Aligned<T> {
            let mut a = Aligned::with_capacity(b.len() / w);
            for (d, s) in a
                .extend_zeroed(b.len() / w)
                .iter_mut()
                .zip(b.chunks_exact(w))
            {
                *d = f(s);
            }
            a
        }
        let (kb, vb) = bytes.split_at(bytes.len() / 2);
        let rows = match dtype {
            CacheDtype::F32 => {
                let f = |s: &[u8]| f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                let (k, v) = (read(kb, 4, f), read(vb, 4, f));
                if !k.iter().chain(v.iter()).all(|x| x.is_finite()) {
                    return Err(bad("a cached K or V value is not finite"));
                }
                Rows::F32 { k, v }
            }
            CacheDtype::F16 => {
                let f = |s: &[u8]| f16::from_le_bytes([s[0], s[1]]);
                let (k, v) = (read(kb, 2, f), read(vb, 2, f));
                if !k.iter().chain(v.iter()).all(|x| x.is_finite()) {
                    return Err(bad("a cached K or V value is not finite"));
                }
                Rows::F16 { k, v }
            }
        };
        Ok(HeadCache::with_rows(
            rows,
            entries.iter().map(|e| (e.c, e.position)),
        ))
    }

    /// Appends the K rows, then the V rows, as stored (little-endian).
    pub(super) fn write_rows(&self, out: &mut Vec<u8>) {
        match &self.rows {
            Rows::F32 { k, v } => {
                out.reserve(4 * (k.len() + v.len()));
                for x in k.iter().chain(v.iter()) {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            Rows::F16 { k, v } => {
                out.reserve(2 * (k.len() + v.len()));
                for x in k.iter().chain(v.iter()) {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    }

    /// Applies one swap-delete reported by the policy: row `slot` is gone and, when
    /// `moved_from` is given, the last row moves into it.
    pub(super) fn apply(&mut self, ev: &Eviction, hd: usize) -> Result<()> {
        let n = self.len();
        let slot = ev.slot as usize;
        let last = n
            .checked_sub(1)
            .ok_or_else(|| Error::Internal("eviction from an empty cache head".into()))?;
        match ev.moved() {
            Some((from, to)) => {
                let (from, to) = (from as usize, to as usize);
                if from != last || to >= last {
                    return Err(Error::Internal(format!(
                        "policy moved slot {from} to {to} with {n} live rows"
                    )));
                }
                let rows = from * hd..(from + 1) * hd;
                match &mut self.rows {
                    Rows::F32 { k, v } => {
                        k.copy_within(rows.clone(), to * hd);
                        v.copy_within(rows, to * hd);
                    }
                    Rows::F16 { k, v } => {
                        k.copy_within(rows.clone(), to * hd);
                        v.copy_within(rows, to * hd);
                    }
                }
                self.c[to] = self.c[from];
                self.pos[to] = self.pos[from];
                let ver = self.bump();
                self.row_version[to] = ver;
                self.journal.wrote(to, ver, n);
            }
            None if slot != last => {
                return Err(Error::Internal(format!(
                    "policy freed slot {slot} without a move, {n} live rows"
                )));
            }
            None => {}
        }
        match &mut self.rows {
            Rows::F32 { k, v } => {
                k.truncate(last * hd);
                v.truncate(last * hd);
            }
            Rows::F16 { k, v } => {
                k.truncate(last * hd);
                v.truncate(last * hd);
            }
        }
        self.c.truncate(last);
        self.pos.truncate(last);
        self.row_version.truncate(last);
        Ok(())
    }
}
