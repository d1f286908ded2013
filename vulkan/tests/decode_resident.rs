//! The fused decode kernel's merge, launch shapes and non-finite detection, and the
//! device-resident cache (`ResidentCache`): a cache head edited as a session edits it
//! (appends, swap-delete moves, re-based c) decodes like a fresh upload and like the CPU,
//! uploads only the changed rows, grows, and stays within
//! its device-memory budget.
//!
//! Tolerance vs the CPU backend: 4e-5 max |err| for f32 storage (both f32 accumulations in
//! different orders over up to ~10^4 entries with |v| <~ 3.4); f16 mirrors vs the CPU on
//! the same f16-rounded rows, also 4e-5.
mod common;

use common::*;
use foxedge_vulkan::{
    CacheHead, DecodeArgs, DecodeOptions, DecodeTuning, Error, HeadSync, Journal, ResidentOptions,
};
use half::f16;
use rand::Rng;

/// One cache head owned the way a session owns it: rows, c, versions, and (when
/// `journal_cap > 0`) a journal of at most that many latest writes.
#[derive(Clone)]
struct Head {
    k: Vec<f32>,
    v: Vec<f32>,
    c: Vec<f64>,
    id: u64,
    version: u64,
    row_version: Vec<u64>,
    since: u64,
    journal: Vec<u32>,
    journal_cap: usize,
}

impl Head {
    fn new(id: u64) -> Head {
        Head {
            k: vec![],
            v: vec![],
            c: vec![],
            id,
            version: 0,
            row_version: vec![],
            since: 0,
            journal: vec![],
            journal_cap: 0,
        }
    }

    /// A fresh version for a write of row `j`, journaled.
    fn bump(&mut self, j: usize) -> u64 {
        self.version += 1;
        self.journal.push(j as u32);
        if self.journal.len() > self.journal_cap {
            let drop = self.journal.len() - self.journal_cap / 2;
            self.since += drop as u64;
            self.journal.drain(..drop);
        }
        self.version
    }

    fn push(&mut self, k: &[f32], v: &[f32], c: f64) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.c.push(c);
        let ver = self.bump(self.row_version.len());
        self.row_version.push(ver);
    }

    /// Swap-delete of row `j`: the last row moves into it.
    fn remove(&mut self, j: usize, d: usize) {
        let last = self.c.len() - 1;
        if j != last {
            self.k.copy_within(last * d..(last + 1) * d, j * d);
            self.v.copy_within(last * d..(last + 1) * d, j * d);
            self.c[j] = self.c[last];
            self.row_version[j] = self.bump(j);
        }
        self.k.truncate(last * d);
        self.v.truncate(last * d);
        self.c.truncate(last);
        self.row_version.truncate(last);
    }

    fn rebase(&mut self, by: f64) {
        for c in &mut self.c {
            *c -= by;
        }
        self.version += 1;
        self.row_version.fill(self.version);
        self.journal.clear();
        self.since = self.version;
    }

    fn view(&self) -> CacheHead<'_, f32> {
        CacheHead {
            k: &self.k,
            v: &self.v,
            c: &self.c,
            pos: None,
        }
    }

    fn sync(&self) -> Option<HeadSync<'_>> {
        Some(HeadSync {
            id: self.id,
            version: self.version,
            row_version: &self.row_version,
            journal: (self.journal_cap > 0).then_some(Journal {
                since: self.since,
                rows: &self.journal,
            }),
        })
    }
}

fn cpu_decode(heads: &[Head], d: usize, q: &[f32], q_c: &[f64]) -> Vec<f32> {
    let hs: Vec<foxedge_cpu::CacheHead<'_, f32>> = heads
        .iter()
        .map(|h| foxedge_cpu::CacheHead {
            k: &h.k,
            v: &h.v,
            c: &h.c,
            pos: None,
        })
        .collect();
    let args = foxedge_cpu::DecodeArgs::one_query(d, q, q_c, &hs);
    let mut out = vec![0.0f32; heads.len() * d];
    foxedge_cpu::decode(&args, &Default::default(), &mut out, None).expect("cpu decode");
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        )
}

/// A head of `n` random rows with c from random gates.
fn filled(r: &mut rand::rngs::StdRng, id: u64, n: usize, d: usize) -> Head {
    let mut h = Head::new(id);
    let g = log_gates(r, n, 1.0);
    let mut acc = 0.0f64;
    for x in g {
        acc += f64::from(x);
        let k = randn(r, d, 1.0);
        let v = randn(r, d, 1.0);
        h.push(&k, &v, acc);
    }
    h
}

#[test]
fn many_chunks_and_launch_shapes_match_cpu() {
    let Some(vk) = device() else { return };
    let d = 64;
    let mut r = rng(31);
    // 10000 entries in chunks of 64: 157 partials per query, more than a workgroup's
    // threads, so the merging workgroup loops; a short head takes a single chunk.
    let heads = vec![filled(&mut r, 1, 10_000, d), filled(&mut r, 2, 50, d)];
    let q = randn(&mut r, 2 * d, 1.0);
    let q_c: Vec<f64> = heads.iter().map(|h| h.c[h.c.len() - 1]).collect();
    let want = cpu_decode(&heads, d, &q, &q_c);
    let views: Vec<_> = heads.iter().map(Head::view).collect();
    let args = DecodeArgs::one_query(d, &q, &q_c, &views);
    for (tuning, split) in [
        (DecodeTuning::default(), 64),
        (DecodeTuning::default(), 2048),
        (
            DecodeTuning {
                workgroup: 64,
                unroll: 4,
                lanes_per_entry: 4,
            },
            128,
        ),
        (
            DecodeTuning {
                workgroup: 256,
                unroll: 1,
                lanes_per_entry: 8,
            },
            512,
        ),
    ] {
        vk.set_decode_tuning(tuning);
        let opts = DecodeOptions {
            split,
            ..Default::default()
        };
        let mut out = vec![f32::NAN; 2 * d];
        let mut lse = vec![0.0f32; 2];
        vk.decode(&args, &opts, &mut out, Some(&mut lse))
            .expect("vulkan decode");
        let e = max_diff(&out, &want);
        eprintln!("{tuning:?} split {split}: max vs cpu {e:.2e}, lse {lse:?}");
        assert!(e <= 4e-5, "{tuning:?} split {split}: {e}");
        assert!(lse.iter().all(|x| x.is_finite()));
    }
    vk.set_decode_tuning(DecodeTuning::default());
}

#[test]
fn non_finite_logits_are_an_error() {
    let Some(vk) = device() else { return };
    let d = 32;
    let mut r = rng(32);
    let mut heads = [filled(&mut r, 1, 300, d), filled(&mut r, 2, 40, d)];
    let q_c: Vec<f64> = heads.iter().map(|h| h.c[h.c.len() - 1]).collect();
    // s q.k overflows f32 in one key of head 0 (1e30 * 1e30 / sqrt(32)), in a later chunk.
    heads[0].k[200 * d] = 1.0e30;
    let mut q = randn(&mut r, 2 * d, 1.0);
    q[0] = 1.0e30;
    let views: Vec<_> = heads.iter().map(Head::view).collect();
    let args = DecodeArgs::one_query(d, &q, &q_c, &views);
    let opts = DecodeOptions {
        split: 64,
        ..Default::default()
    };
    let mut out = vec![0.0f32; 2 * d];
    for nosg in [false, true] {
        vk.set_decode_without_subgroups(nosg);
        let e = vk.decode(&args, &opts, &mut out, None);
        assert!(
            matches!(
                e,
                Err(Error::Input(foxedge_core::Error::BadArgument(m))) if m.contains("not finite")
            ),
            "{e:?}"
        );
        let mut cache = vk.resident_cache(ResidentOptions::default());
        let sync: Vec<_> = heads.iter().map(Head::sync).collect();
        let e = cache.decode(&args, &sync, &opts, &mut out, None);
        assert!(matches!(e, Err(Error::Input(_))), "{e:?}");
    }
    vk.set_decode_without_subgroups(false);
    // The CPU kernels say the same.
    let hs: Vec<_> = heads
        .iter()
        .map(|h| foxedge_cpu::CacheHead {
            k: &h.k,
            v: &h.v,
            c: &h.c,
            pos: None,
        })
        .collect();
    let cargs = foxedge_cpu::DecodeArgs::one_query(d, &q, &q_c, &hs);
    assert!(foxedge_cpu::decode(&cargs, &Default::default(), &mut out, None).is_err());
}

/// A stream against a resident cache: appends, evictions (swap-delete), a re-basing, and a
/// head that appears mid-stream; every step equals the CPU, and the rows uploaded per step
/// are the rows written since the last step, not the cache.
#[test]
fn resident_cache_follows_edits_with_few_uploads() {
    let Some(vk) = device() else { return };
    let d = 64;
    let mut r = rng(33);
    // Journals of 4 writes: a mirror one step behind finds its rows there; one that skipped
    // a step (every 7th) may be further behind than the journal reaches, and scans.
    for (f16_mirror, journal_cap) in [(false, 0), (true, 0), (false, 4), (true, 4)] {
        let mut cache = vk.resident_cache(ResidentOptions {
            f16: f16_mirror,
            budget_bytes: None,
        });
        let base = 100 * u64::from(f16_mirror) + 1000 * journal_cap as u64;
        let mut heads = [
            filled(&mut r, base + 1, 700, d),
            filled(&mut r, base + 2, 60, d),
            filled(&mut r, base + 3, 0, d),
        ];
        for h in &mut heads {
            h.journal_cap = journal_cap;
        }
        let mut last_c = vec![-3.0f64; 3];
        let mut prev = cache.counters();
        let mut behind = 0u64;
        let mut decoded = 0u64;
        for step in 0..40 {
            // Edits: one append per head, an eviction every other step, a re-basing once.
            for (h, head) in heads.iter_mut().enumerate() {
                last_c[h] += f64::from(log_gates(&mut r, 1, 1.0)[0]);
                let (k, v) = (randn(&mut r, d, 1.0), randn(&mut r, d, 1.0));
                head.push(&k, &v, last_c[h]);
                if step % 2 == 1 && head.c.len() > 5 {
                    let j = r.gen_range(0..head.c.len() - 1);
                    head.remove(j, d);
                }
            }
            if step == 20 {
                heads[1].rebase(last_c[1]);
                last_c[1] = 0.0;
            }
            behind += 1;
            if journal_cap > 0 && step % 7 == 5 {
                continue;
            }
            let q = randn(&mut r, 3 * d, 1.0);
            let q_c = last_c.clone();
            // The CPU sees what the mirror holds: f16-rounded rows for an f16 mirror.
            let shown: Vec<Head> = heads
                .iter()
                .map(|h| {
                    let mut s = h.clone();
                    if f16_mirror {
                        for x in s.k.iter_mut().chain(s.v.iter_mut()) {
                            *x = f16::from_f32(*x).to_f32();
                        }
                    }
                    s
                })
                .collect();
            let want = cpu_decode(&shown, d, &q, &q_c);
            let views: Vec<_> = heads.iter().map(Head::view).collect();
            let sync: Vec<_> = heads.iter().map(Head::sync).collect();
            let args = DecodeArgs::one_query(d, &q, &q_c, &views);
            let opts = DecodeOptions {
                split: 128,
                ..Default::default()
            };
            let mut out = vec![f32::NAN; 3 * d];
            cache
                .decode(&args, &sync, &opts, &mut out, None)
                .expect("resident decode");
            let e = max_diff(&out, &want);
            assert!(e <= 4e-5, "f16 {f16_mirror} step {step}: {e}");
            let now = cache.counters();
            let rows = now.rows_uploaded - prev.rows_uploaded;
            let expect = match step {
                0 => heads.iter().map(|h| h.c.len() as u64).sum(),
                20 => heads[1].c.len() as u64 + 4,
                _ => 3 * behind,
            };
            assert!(
                rows <= expect,
                "step {step}: {rows} rows uploaded, expected <= {expect}"
            );
            // Without a journal every resident head scans; with one, only a head whose
            // mirror is further behind than its journal reaches (after a skipped step or
            // the re-basing).
            let scans = now.scans - prev.scans;
            if journal_cap == 0 && step > 0 {
                assert_eq!(scans, 3, "step {step}");
            } else if journal_cap > 0 && behind == 1 && step != 20 {
                assert_eq!(scans, 0, "step {step}");
            }
            prev = now;
            behind = 0;
            decoded += 1;
        }
        let c = cache.counters();
        eprintln!("f16 {f16_mirror} journal {journal_cap}: {c:?}");
        assert_eq!(c.mirrors, 3);
        assert!(c.grows >= 1, "the 60-row head outgrew its 64-row mirror");
        assert_eq!(c.steps, decoded);
        if journal_cap > 0 {
            assert!(
                c.scans >= 1,
                "a skipped step leaves a mirror beyond its journal"
            );
        }
    }
}

/// Uploads go through the scatter kernel in several dispatches: 20 heads (more than one
/// dispatch's 16 destination slots and the decode's 8 heads per dispatch), heads of up to
/// 1500 rows (regions cut into many pieces), and a binding limit that holds one head but
/// not the step's staging data (source windows split). Fresh uploads and resident steps
/// with appends match the CPU.
#[test]
fn uploads_in_many_scatter_dispatches_match_cpu() {
    let Some(vk) = device() else { return };
    let d = 64;
    let mut r = rng(35);
    // The largest head: 2048-row mirror capacity x (64 + 64 + 4) words.
    let limit = vk.set_binding_limit(2048 * 132 * 4);
    let mut heads: Vec<Head> = (0..20)
        .map(|i| filled(&mut r, 40 + i, [1, 1500, 37, 700][i as usize % 4], d))
        .collect();
    let mut cache = vk.resident_cache(ResidentOptions {
        f16: false,
        budget_bytes: None,
    });
    let mut last_c: Vec<f64> = heads
        .iter()
        .map(|h| h.c.last().copied().unwrap_or(0.0))
        .collect();
    for step in 0..4 {
        let q = randn(&mut r, 20 * d, 1.0);
        let want = cpu_decode(&heads, d, &q, &last_c);
        let views: Vec<_> = heads.iter().map(Head::view).collect();
        let sync: Vec<_> = heads.iter().map(Head::sync).collect();
        let args = DecodeArgs::one_query(d, &q, &last_c, &views);
        let opts = DecodeOptions::default();
        let mut out = vec![f32::NAN; 20 * d];
        cache
            .decode(&args, &sync, &opts, &mut out, None)
            .expect("resident decode");
        let e = max_diff(&out, &want);
        assert!(e <= 4e-5, "resident step {step} (limit {limit}): {e}");
        let mut fresh = vec![f32::NAN; 20 * d];
        vk.decode(&args, &opts, &mut fresh, None)
            .expect("one-off decode");
        let e = max_diff(&fresh, &want);
        assert!(e <= 4e-5, "one-off step {step}: {e}");
        for (h, head) in heads.iter_mut().enumerate() {
            last_c[h] += f64::from(log_gates(&mut r, 1, 1.0)[0]);
            let (k, v) = (randn(&mut r, d, 1.0), randn(&mut r, d, 1.0));
            head.push(&k, &v, last_c[h]);
        }
    }
    // A non-finite row in the second decode dispatch (heads 8..16) is the error.
    heads[13].k[5 * d] = f32::INFINITY;
    heads[13].row_version[5] = heads[13].bump(5);
    let q = randn(&mut r, 20 * d, 1.0);
    let views: Vec<_> = heads.iter().map(Head::view).collect();
    let sync: Vec<_> = heads.iter().map(Head::sync).collect();
    let args = DecodeArgs::one_query(d, &q, &last_c, &views);
    let mut out = vec![f32::NAN; 20 * d];
    let got = cache.decode(&args, &sync, &DecodeOptions::default(), &mut out, None);
    assert!(matches!(got, Err(Error::Input(_))), "{got:?}");
    let got = vk.decode(&args, &DecodeOptions::default(), &mut out, None);
    assert!(matches!(got, Err(Error::Input(_))), "{got:?}");
}

/// A budget smaller than all mirrors: least-recently-used mirrors are dropped and
/// re-uploaded whole when needed, results stay exact; a budget below one head's mirror is
/// an out-of-memory error, and the cache works again once the budget allows.
#[test]
fn resident_cache_budget_evicts_and_reports_oom() {
    let Some(vk) = device() else { return };
    let d = 32;
    let mut r = rng(34);
    let heads: Vec<Head> = (0..4).map(|i| filled(&mut r, 10 + i, 200, d)).collect();
    // One mirror: 256 rows * (2 * 32 + 4) words * 4 bytes = 69632 bytes.
    let mirror = 256 * (2 * 32 + 4) * 4;
    let mut cache = vk.resident_cache(ResidentOptions {
        f16: false,
        budget_bytes: Some(2 * mirror + 100),
    });
    for round in 0..3 {
        for pair in [[0usize, 1], [2, 3], [1, 2]] {
            let sel: Vec<Head> = pair.iter().map(|&i| heads[i].clone()).collect();
            let q = randn(&mut r, 2 * d, 1.0);
            let q_c: Vec<f64> = sel.iter().map(|h| h.c[199]).collect();
            let views: Vec<_> = sel.iter().map(Head::view).collect();
            let sync: Vec<_> = sel.iter().map(Head::sync).collect();
            let args = DecodeArgs::one_query(d, &q, &q_c, &views);
            let mut out = vec![0.0f32; 2 * d];
            cache
                .decode(&args, &sync, &DecodeOptions::default(), &mut out, None)
                .expect("decode under budget");
            assert!(max_diff(&out, &cpu_decode(&sel, d, &q, &q_c)) <= 4e-5);
            assert!(
                cache.counters().resident_bytes <= cache.budget(),
                "round {round}"
            );
        }
    }
    let c = cache.counters();
    eprintln!("{c:?}");
    assert!(c.evictions > 0 && c.full_uploads > 4);

    cache.set_budget(mirror - 1);
    let q = randn(&mut r, d, 1.0);
    let views = [heads[3].view()];
    let sync = [heads[3].sync()];
    let q_c = [heads[3].c[199]];
    let args = DecodeArgs::one_query(d, &q, &q_c, &views);
    let mut out = vec![0.0f32; d];
    cache.forget(&[13]);
    let e = cache.decode(&args, &sync, &DecodeOptions::default(), &mut out, None);
    assert_eq!(e.err(), Some(Error::OutOfDeviceMemory));
    cache.set_budget(mirror);
    cache
        .decode(&args, &sync, &DecodeOptions::default(), &mut out, None)
        .expect("decode once the budget allows");
    // A broken sync invariant is refused.
    let bad = [Some(HeadSync {
        id: 13,
        version: 0,
        row_version: &heads[3].row_version,
        journal: None,
    })];
    let e = cache.decode(&args, &bad, &DecodeOptions::default(), &mut out, None);
    assert!(matches!(e, Err(Error::Input(_))), "{e:?}");
}

/// Several queries per step with positions (the causal mask inside a step): the mirror
/// carries each row's u64 position, and a step whose positions cross 2^32 masks exactly.
#[test]
fn resident_cache_with_positions_matches_cpu() {
    let Some(vk) = device() else { return };
    let d = 16;
    let nq = 3;
    let mut r = rng(35);
    let mut cache = vk.resident_cache(ResidentOptions::default());
    let mut head = filled(&mut r, 77, 90, d);
    let base = (1u64 << 32) - 50;
    let mut pos: Vec<u64> = (0..90).map(|j| base + j as u64).collect();
    for step in 0..4 {
        // Three new tokens per step; the queries sit at the newest three positions.
        for _ in 0..nq {
            let c = head.c[head.c.len() - 1] + f64::from(log_gates(&mut r, 1, 1.0)[0]);
            let (k, v) = (randn(&mut r, d, 1.0), randn(&mut r, d, 1.0));
            head.push(&k, &v, c);
            pos.push(pos[pos.len() - 1] + 1);
        }
        if step == 2 {
            head.remove(5, d);
            let last = pos.len() - 1;
            pos[5] = pos[last];
            pos.truncate(last);
        }
        let n = head.c.len();
        let newest = *pos.iter().max().unwrap();
        let q_pos: Vec<u64> = (0..nq as u64).map(|t| newest - 2 + t).collect();
        let q_c: Vec<f64> = q_pos
            .iter()
            .map(|p| head.c[pos.iter().position(|x| x == p).unwrap()])
            .collect();
        let q = randn(&mut r, nq * d, 1.0);
        let views = [CacheHead {
            k: &head.k[..],
            v: &head.v[..],
            c: &head.c[..],
            pos: Some(&pos[..]),
        }];
        let args = DecodeArgs {
            head_dim: d,
            n_queries: nq,
            q: &q,
            q_c: &q_c,
            q_pos: Some(&q_pos),
            heads: &views,
        };
        let opts = DecodeOptions {
            split: 64,
            ..Default::default()
        };
        let mut out = vec![f32::NAN; nq * d];
        let st = cache
            .decode(&args, &[head.sync()], &opts, &mut out, None)
            .expect("resident decode with positions");
        let ch = [foxedge_cpu::CacheHead {
            k: &head.k[..],
            v: &head.v[..],
            c: &head.c[..],
            pos: Some(&pos[..]),
        }];
        let cargs = foxedge_cpu::DecodeArgs {
            head_dim: d,
            n_queries: nq,
            q: &q,
            q_c: &q_c,
            q_pos: Some(&q_pos),
            heads: &ch,
        };
        let mut want = vec![0.0f32; nq * d];
        let cst =
            foxedge_cpu::decode(&cargs, &Default::default(), &mut want, None).expect("cpu decode");
        assert!(max_diff(&out, &want) <= 4e-5, "step {step}");
        assert_eq!(st.heads[0].total_pairs, cst.heads[0].total_pairs);
        assert_eq!(
            st.heads[0].total_pairs,
            3 * n as u64 - 3,
            "causal mask in the step"
        );
    }
}

/// ACP through the resident cache: decisions and statistics equal the CPU backend's, and
/// outputs match, through appends, swap-delete moves, a re-basing, a change of block size,
/// and queries behind the newest position (masking).
#[test]
fn resident_plans_match_cpu_decisions_under_edits() {
    let Some(vk) = device() else { return };
    let (d, nh) = (16, 3);
    let mut r = rng(36);
    let mut cache = vk.resident_cache(ResidentOptions::default());
    let mut heads: Vec<Head> = (0..nh)
        .map(|i| filled(&mut r, 300 + i as u64, 150, d))
        .collect();
    let mut pos: Vec<Vec<u64>> = (0..nh).map(|_| (0..150).collect()).collect();
    let mut next = 150u64;
    let mut pruning_steps = 0;
    for step in 0..30 {
        for (h, head) in heads.iter_mut().enumerate() {
            for _ in 0..r.gen_range(0..3) {
                let c =
                    head.c.last().copied().unwrap_or(0.0) + f64::from(log_gates(&mut r, 1, 1.0)[0]);
                let (k, v) = (randn(&mut r, d, 1.0), randn(&mut r, d, 1.0));
                head.push(&k, &v, c);
                pos[h].push(next);
                next += 1;
            }
            if r.gen_bool(0.4) && head.c.len() > 2 {
                let j = r.gen_range(0..head.c.len());
                head.remove(j, d);
                let last = pos[h].len() - 1;
                pos[h][j] = pos[h][last];
                pos[h].truncate(last);
            }
        }
        if step == 12 {
            let by = heads[1].c[0];
            heads[1].rebase(by);
        }
        // Every third step the queries sit behind the newest position, so some entries
        // are masked and the position bound cannot be used.
        let q_pos: Vec<u64> = (0..nh)
            .map(|_| if step % 3 == 2 { next - 3 } else { next })
            .collect();
        let q_c: Vec<f64> = heads
            .iter()
            .map(|h| h.c.iter().copied().fold(f64::NEG_INFINITY, f64::max) + 0.5)
            .collect();
        let q = randn(&mut r, nh * d, 1.0);
        let thresholds: Vec<f64> = (0..nh).map(|h| [0.5, 3.0, 20.0][h]).collect();
        let opts = DecodeOptions {
            split: 64,
            block_k: if step < 20 { 8 } else { 16 },
            acp: foxedge_vulkan::Acp::Threshold(&thresholds),
            ..Default::default()
        };
        let views: Vec<CacheHead<'_, f32>> = heads
            .iter()
            .zip(&pos)
            .map(|(h, p)| CacheHead {
                k: &h.k,
                v: &h.v,
                c: &h.c,
                pos: Some(p),
            })
            .collect();
        let args = DecodeArgs {
            head_dim: d,
            n_queries: 1,
            q: &q,
            q_c: &q_c,
            q_pos: Some(&q_pos),
            heads: &views,
        };
        let sync: Vec<_> = heads.iter().map(Head::sync).collect();
        let mut out = vec![f32::NAN; nh * d];
        let st = cache
            .decode(&args, &sync, &opts, &mut out, None)
            .expect("resident decode");
        let mut want = vec![0.0f32; nh * d];
        let cst = foxedge_cpu::decode(&args, &opts, &mut want, None).expect("cpu decode");
        assert_eq!(st, cst, "step {step}: statistics differ from the CPU's");
        let e = max_diff(&out, &want);
        assert!(e <= 4e-5, "step {step}: {e}");
        let kept: u64 = st.heads.iter().map(|s| s.kept_blocks).sum();
        let total: u64 = st.heads.iter().map(|s| s.total_blocks).sum();
        pruning_steps += usize::from(kept < total);
    }
    eprintln!("ACP pruned blocks in {pruning_steps} of 30 steps");
    assert!(
        pruning_steps >= 20,
        "ACP pruned in only {pruning_steps} of 30 steps"
    );
}

/// The bandwidth probes run and give positive, finite rates (their values are measured by
/// `examples/vk_bandwidth`, not asserted).
#[test]
fn bandwidth_probes_return_finite_rates() {
    let Some(vk) = common::device() else { return };
    for rate in [vk.read_bandwidth(1 << 20, 2), vk.copy_bandwidth(1 << 20, 2)] {
        let r = rate.expect("probe runs");
        assert!(r.is_finite() && r > 0.0, "rate {r}");
    }
}
