//! Prefill's reusable buffers (the context's arena): calls of growing and shrinking sizes,
//! f32 and f16, one and several chunks, equal the CPU backend; a `PreparedPrefill` kept
//! alive while other calls run keeps its own buffers (the others get fresh ones) and reads
//! back the same bits afterwards; concurrent calls from two threads stay correct.
//!
//! Tolerance vs `foxedge_cpu::prefill` on the same inputs (both compute in f32 from the same
//! stored values, so f16 inputs are no coarser here): |err| <= 4e-5, twice the f32 bound of
//! `tests/prefill.rs` (each backend within 2e-5 of the f64 reference); lse within 1e-4.
mod common;

use common::*;
use foxedge_vulkan::{
    AttentionShape, Layout, PrefillArgs, PrefillOptions, PreparedPrefill, Storage, Vulkan,
};
use half::f16;

/// Random inputs of one call.
struct Case<T> {
    sh: AttentionShape,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    g: Vec<f32>,
}

impl<T: Storage> Case<T> {
    fn new(sh: AttentionShape, seed: u64) -> Self {
        let mut r = rng(seed);
        let mut t =
            |n: usize| -> Vec<T> { randn(&mut r, n, 1.0).into_iter().map(T::from_f32).collect() };
        let (q, k, v) = (t(sh.q_len()), t(sh.kv_len()), t(sh.kv_len()));
        let g = log_gates(&mut r, sh.gate_len(), 1.0);
        Self { sh, q, k, v, g }
    }

    fn args(&self) -> PrefillArgs<'_, T> {
        PrefillArgs {
            shape: self.sh,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            log_fgate: &self.g,
            seq_start: None,
        }
    }

    fn rows(&self) -> usize {
        self.sh.batch * self.sh.heads_q * self.sh.seq_q
    }

    /// The CPU backend's output and lse.
    fn cpu(&self) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![0.0f32; self.sh.q_len()];
        let mut lse = vec![0.0f32; self.rows()];
        foxedge_cpu::prefill(
            &self.args(),
            &PrefillOptions::default(),
            &mut out,
            Some(&mut lse),
        )
        .expect("cpu prefill");
        (out, lse)
    }

    /// Asserts that `out` / `lse` match the CPU backend.
    fn check(&self, out: &[f32], lse: &[f32], what: &str) {
        let (co, cl) = self.cpu();
        let worst = out
            .iter()
            .zip(&co)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
            );
        let lworst = lse
            .iter()
            .zip(&cl)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
            );
        eprintln!(
            "{what}: {:?} {:?}: max |vulkan - cpu| {worst:.2e}, lse {lworst:.2e}",
            T::DTYPE,
            self.sh
        );
        assert!(worst <= 4e-5, "{what}: {worst}");
        assert!(lworst <= 1e-4, "{what}: lse {lworst}");
    }

    /// One `Vulkan::prefill` call, checked against the CPU.
    fn run(&self, vk: &Vulkan, what: &str) {
        let mut out = vec![f32::NAN; self.sh.q_len()];
        let mut lse = vec![f32::NAN; self.rows()];
        vk.prefill(
            &self.args(),
            &PrefillOptions::default(),
            &mut out,
            Some(&mut lse),
        )
        .expect("vulkan prefill");
        self.check(&out, &lse, what);
    }

    /// Output and lse of a prepared call.
    fn read(&self, p: &PreparedPrefill) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; self.sh.q_len()];
        let mut lse = vec![f32::NAN; self.rows()];
        p.read(&mut out, Some(&mut lse)).expect("read");
        (out, lse)
    }
}

fn pooled(p: &PreparedPrefill) -> bool {
    format!("{p:?}").contains("pooled_buffers: true")
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn prefill_buffer_reuse_growing_shrinking_f16_f32_and_kept_calls() {
    let Some(vk) = device() else { return };
    vk.release_prefill_buffers();
    // Growing, shrinking, f32 and f16, both layouts, GQA: each call reuses (and grows) the
    // pooled buffers of the previous one.
    let sizes = [
        (1, 2, 2, 40, 64, Layout::HeadFirst),
        (1, 4, 2, 130, 64, Layout::SeqFirst),
        (2, 4, 4, 300, 64, Layout::HeadFirst),
        (1, 2, 1, 64, 32, Layout::SeqFirst),
        (1, 4, 4, 200, 64, Layout::SeqFirst),
        (1, 1, 1, 17, 64, Layout::HeadFirst),
        (2, 4, 2, 310, 64, Layout::SeqFirst),
    ];
    for (i, &(b, hq, hk, l, d, lay)) in sizes.iter().enumerate() {
        let sh = shape(b, hq, hk, l, l, d, lay);
        let what = format!("sequence call {i}");
        Case::<f32>::new(sh, 100 + i as u64).run(&vk, &what);
        Case::<f16>::new(sh, 200 + i as u64).run(&vk, &what);
    }
    // Several chunks per call (binding limit lowered) in the same arena, then one again.
    vk.set_binding_limit(80_000); // 2 heads of q (38,400 bytes each) per chunk: 4 chunks
    let sh = shape(2, 4, 4, 150, 150, 64, Layout::SeqFirst);
    Case::<f32>::new(sh, 300).run(&vk, "chunked f32");
    Case::<f16>::new(sh, 301).run(&vk, "chunked f16");
    vk.set_binding_limit(u64::MAX);
    Case::<f32>::new(sh, 302).run(&vk, "unchunked after chunked");

    // A prepared call kept alive holds the pooled buffers; calls meanwhile get fresh ones
    // and must not disturb it.
    let kept = Case::<f32>::new(shape(1, 4, 2, 180, 180, 64, Layout::SeqFirst), 400);
    let p = vk
        .prepare_prefill(&kept.args(), &PrefillOptions::default())
        .expect("prepare");
    assert!(pooled(&p), "first live call takes the pooled buffers");
    p.run(1).expect("run");
    let (o1, l1) = kept.read(&p);
    kept.check(&o1, &l1, "kept call");
    for (i, l) in [(0u64, 250usize), (1, 60), (2, 180)] {
        let sh = shape(1, 4, 2, l, l, 64, Layout::SeqFirst);
        let other = Case::<f32>::new(sh, 500 + i);
        let q = vk
            .prepare_prefill(&other.args(), &PrefillOptions::default())
            .expect("prepare other");
        assert!(!pooled(&q), "a second live call allocates its own buffers");
        q.run(1).expect("run other");
        let (o, l) = other.read(&q);
        other.check(&o, &l, "call beside the kept one");
        drop(q);
        Case::<f16>::new(sh, 600 + i).run(&vk, "prefill beside the kept one");
        // The kept call still reads its own result, bit for bit, and runs again the same.
        let (o2, l2) = kept.read(&p);
        assert_eq!(bits(&o1), bits(&o2), "kept output changed");
        assert_eq!(bits(&l1), bits(&l2), "kept lse changed");
    }
    p.run(1).expect("rerun");
    let (o3, _) = kept.read(&p);
    assert_eq!(bits(&o1), bits(&o3), "kept output after a rerun");
    drop(p);
    // Given back: the next call uses the pooled buffers again.
    let next = Case::<f32>::new(shape(1, 2, 2, 90, 90, 64, Layout::HeadFirst), 700);
    let p = vk
        .prepare_prefill(&next.args(), &PrefillOptions::default())
        .expect("prepare");
    assert!(pooled(&p), "buffers given back on drop");
    p.run(1).expect("run");
    let (o, l) = next.read(&p);
    next.check(&o, &l, "after give-back");
    drop(p);
    vk.release_prefill_buffers();
    next.run(&vk, "after release");
}

/// The pooled buffers follow the calls down as well as up: after a large call split in
/// chunks, `SHRINK_CALLS` (64) small calls leave them as the small calls alone did (the
/// oversized slots allocated again at size, the other chunks' slots freed), and every
/// output stays right.
#[test]
fn pooled_buffers_shrink_back_after_a_large_call() {
    let Some(vk) = device() else { return };
    vk.release_prefill_buffers();
    let small = shape(1, 2, 2, 64, 64, 64, Layout::SeqFirst);
    let big = shape(1, 4, 4, 1024, 1024, 64, Layout::SeqFirst);
    Case::<f32>::new(small, 800).run(&vk, "small");
    let small_bytes = vk.prefill_buffer_bytes();
    vk.set_binding_limit(600_000);
    Case::<f32>::new(big, 801).run(&vk, "big, chunked");
    vk.set_binding_limit(u64::MAX);
    let big_bytes = vk.prefill_buffer_bytes();
    assert!(
        big_bytes > 16 * small_bytes,
        "{big_bytes} against {small_bytes}"
    );
    for i in 0..64 {
        assert!(
            vk.prefill_buffer_bytes() > 16 * small_bytes,
            "kept for 64 calls"
        );
        Case::<f32>::new(small, 802 + i).run(&vk, "small after big");
    }
    assert_eq!(vk.prefill_buffer_bytes(), small_bytes);
    Case::<f16>::new(big, 900).run(&vk, "big again");
}

#[test]
fn prefill_concurrent_calls_share_no_buffers() {
    let Some(vk) = device() else { return };
    let cases: Vec<Case<f32>> = (0..2)
        .map(|i| {
            Case::new(
                shape(1, 4, 4, 120 + 50 * i, 120 + 50 * i, 64, Layout::SeqFirst),
                800 + i as u64,
            )
        })
        .collect();
    std::thread::scope(|s| {
        for (i, c) in cases.iter().enumerate() {
            let vk = vk.clone();
            s.spawn(move || {
                for rep in 0..3 {
                    c.run(&vk, &format!("thread {i} call {rep}"));
                }
            });
        }
    });
}

#[test]
fn f32_inputs_stored_as_f16_equal_f16_inputs_bit_for_bit() {
    let Some(vk) = device() else { return };
    if !vk.info().storage_16bit {
        eprintln!("SKIPPED {}: the device has no 16-bit storage", test_name());
        return;
    }
    // `prefill_f16_storage` rounds f32 q, k, v to f16 (nearest even) while packing: the
    // result is the one of the same call given f16 inputs, on every kernel the device runs.
    for (i, &(b, hq, hk, l, lay)) in [
        (1, 4, 2, 130, Layout::SeqFirst),
        (2, 2, 2, 200, Layout::HeadFirst),
    ]
    .iter()
    .enumerate()
    {
        let sh = shape(b, hq, hk, l, l, 64, lay);
        let c32 = Case::<f32>::new(sh, 800 + i as u64);
        let c16 = Case::<f16> {
            sh,
            q: c32.q.iter().map(|&x| f16::from_f32(x)).collect(),
            k: c32.k.iter().map(|&x| f16::from_f32(x)).collect(),
            v: c32.v.iter().map(|&x| f16::from_f32(x)).collect(),
            g: c32.g.clone(),
        };
        let run = |f: &dyn Fn(&mut [f32], &mut [f32])| {
            let mut out = vec![f32::NAN; sh.q_len()];
            let mut lse = vec![f32::NAN; c32.rows()];
            f(&mut out, &mut lse);
            (out, lse)
        };
        let opts = PrefillOptions::default();
        let (o32, l32) = run(&|o, l| {
            vk.prefill_f16_storage(&c32.args(), &opts, o, Some(l))
                .map(drop)
                .expect("f32 stored as f16")
        });
        let (o16, l16) = run(&|o, l| {
            vk.prefill(&c16.args(), &opts, o, Some(l))
                .map(drop)
                .expect("f16 inputs")
        });
        assert_eq!(bits(&o32), bits(&o16), "call {i}: output");
        assert_eq!(bits(&l32), bits(&l16), "call {i}: lse");
        c16.check(&o16, &l16, "f16 inputs");
    }
}

#[test]
fn decided_prefill_equals_the_threshold_call_bit_for_bit() {
    use foxedge_core::boundary::{BlockGrid, start_blocks};
    use foxedge_vulkan::{Acp, Decisions};
    let Some(vk) = device() else { return };
    // Decisions formed by the caller with foxedge-core (c, start blocks, delta per head)
    // give the call made from the thresholds, bit for bit; bad decisions are refused.
    let sh = shape(1, 4, 4, 300, 300, 64, Layout::SeqFirst);
    let case = Case::<f32>::new(sh, 900);
    let delta: Vec<f64> = vec![-4.0, -8.0, -1.0e9, -2.0];
    let grid = BlockGrid::new(64, 64, 300, 300).expect("grid");
    let nqb = grid.q_blocks();
    let mut c = vec![0.0f64; 4 * 300];
    let mut st = vec![0u32; 4 * nqb];
    for h in 0..4 {
        let ch = &mut c[h * 300..(h + 1) * 300];
        foxedge_core::gate::cumsum_strided(&case.g[h..], 4, 0.0, ch).expect("cumsum");
        start_blocks(
            &grid,
            ch,
            Some(delta[h]),
            0,
            &mut st[h * nqb..(h + 1) * nqb],
        )
        .expect("start blocks");
    }
    let opt_delta: Vec<Option<f64>> = delta.iter().copied().map(Some).collect();
    let call = |acp: Acp<'_>| {
        let mut out = vec![f32::NAN; sh.q_len()];
        let opts = PrefillOptions {
            acp,
            ..Default::default()
        };
        vk.prefill(&case.args(), &opts, &mut out, None)
            .map(|s| (out, s))
    };
    let (o1, s1) = call(Acp::Threshold(&delta)).expect("threshold call");
    let dec = Decisions {
        c: &c,
        start_blocks: &st,
        delta: &opt_delta,
    };
    let (o2, s2) = call(Acp::Decided(dec)).expect("decided call");
    assert_eq!(bits(&o1), bits(&o2));
    assert_eq!(s1, s2);
    assert!(s1.kept_fraction() < 1.0, "some blocks pruned");
    let short = Decisions { c: &c[1..], ..dec };
    assert!(call(Acp::Decided(short)).is_err());
    let mut late = st.clone();
    late[0] = 3;
    let late = Decisions {
        start_blocks: &late,
        ..dec
    };
    assert!(call(Acp::Decided(late)).is_err());
}

#[test]
fn decisions_above_the_serial_limit_equal_the_cpus() {
    use foxedge_vulkan::Acp;
    let Some(vk) = device() else { return };
    // 17 heads x 4096 tokens: past `SERIAL_DECISIONS`, so the slabs are decided on the pool
    // (each forming its own `c`), in both layouts; the CPU decides serially in one pass.
    let t = 4096;
    assert!(17 * t > foxedge_cpu::SERIAL_DECISIONS);
    for layout in [Layout::SeqFirst, Layout::HeadFirst] {
        let case = Case::<f32>::new(shape(1, 17, 1, t, t, 8, layout), 77);
        let delta: Vec<f64> = (0..17).map(|h| -6.0 - h as f64).collect();
        let opts = PrefillOptions {
            acp: Acp::Threshold(&delta),
            ..Default::default()
        };
        let run = |cpu: bool| {
            let mut out = vec![f32::NAN; case.sh.q_len()];
            let stats = if cpu {
                foxedge_cpu::prefill(&case.args(), &opts, &mut out, None).map_err(|e| e.to_string())
            } else {
                vk.prefill(&case.args(), &opts, &mut out, None)
                    .map_err(|e| e.to_string())
            }
            .expect("prefill");
            (out, stats)
        };
        let ((co, cs), (vo, vs)) = (run(true), run(false));
        assert_eq!(cs, vs, "{layout:?}: the same decisions");
        assert!(
            vs.kept_fraction() < 0.1,
            "{layout:?}: kept {}",
            vs.kept_fraction()
        );
        let (worst, _) = errors(&vo, &to_f64(&co));
        assert!(worst <= 4e-5, "{layout:?}: max |vulkan - cpu| {worst}");
    }
}
