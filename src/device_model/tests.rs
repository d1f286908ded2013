//! Device loss mid-stream: the session drops the device and continues on the CPU from
//! its host state, so the stream equals a CPU session's (logits within 2e-3 absolute:
//! the bundled model's logits are O(10), the device's f32 sums differ from the CPU's by
//! ~1e-6 relative per op over 4 layers).
use super::*;

proptest::proptest! {
    /// The table gives `ln_keys(n)` bit for bit, in any order of use, grown that far or
    /// not.
    #[test]
    fn ln_table_is_ln_keys(ns in proptest::collection::vec(0usize..5000, 1..40)) {
        let mut t = LnTable::default();
        for n in ns {
            let want = foxedge_core::threshold::ln_keys(n).to_bits();
            proptest::prop_assert_eq!(t.at(n).to_bits(), want);
            t.grow(n);
            proptest::prop_assert_eq!(t.at(n).to_bits(), want);
        }
    }
}

#[test]
fn auto_takes_gpus_only() {
    assert!(auto_runs_on("DiscreteGpu"));
    assert!(auto_runs_on("IntegratedGpu"));
    for t in ["Cpu", "VirtualGpu", "Other", ""] {
        assert!(!auto_runs_on(t), "{t}");
    }
}

pub(in crate::session) fn ids() -> Vec<u32> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let f = std::fs::File::open(root.join("tests/fixtures/fox-tiny-pro/input_ids.npy"))
        .expect("fixture");
    let npy = npyz::NpyFile::new(std::io::BufReader::new(f)).expect("npy");
    let v: Vec<i32> = npy.into_vec().expect("ids");
    v.into_iter().map(|x| x as u32).collect()
}

pub(in crate::session) fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        )
}

/// A CPU session and a whole-model device session, or `None` (skipped) without a device.
pub(in crate::session) fn pair(test: &str, opts: &SessionOptions) -> Option<(Session, Session)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = Arc::new(Model::open(root.join("models/fox-tiny-pro")).expect("model"));
    let cpu = Session::new(model.clone(), opts.clone()).expect("cpu session");
    let gpu = crate::test_device::or_skip(
        Session::new(
            model,
            SessionOptions {
                backend: BackendKind::Vulkan,
                ..opts.clone()
            },
        ),
        test,
        "Vulkan",
    )?;
    if !gpu.on_device() {
        crate::test_device::missing(test, &"the whole model did not load on the device");
        return None;
    }
    Some((cpu, gpu))
}

/// Loses the device at submission `k` of the run after `before` tokens (a prefill
/// chunk when `chunk`, else a decode step), then streams on: every logit stays within
/// the tolerance of the CPU session's and the caches hold the same positions.
fn loss_keeps_the_stream(test: &str, k: u64, chunk: bool, certified_eviction: bool) {
    let opts = SessionOptions {
        certified_eviction,
        budget: Some(Budget::EntriesPerHead(48)),
        window: 8,
        sinks: 2,
        ..SessionOptions::default()
    };
    let Some((mut cpu, mut gpu)) = pair(test, &opts) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    let first = if chunk { 40 } else { 30 };
    if chunk {
        assert!(gpu.inject_device_loss(k));
    }
    cpu.feed(&ids[..first], Some(&mut a)).unwrap();
    gpu.feed(&ids[..first], Some(&mut b)).unwrap();
    assert!(worst(&a, &b) <= 2e-3, "{}", worst(&a, &b));
    for (i, &t) in ids[first..first + 60].iter().enumerate() {
        if !chunk && i == 10 {
            assert!(gpu.inject_device_loss(k));
        }
        let subs = gpu.stats().device_submissions;
        cpu.feed(&[t], Some(&mut a)).unwrap();
        gpu.feed(&[t], Some(&mut b)).unwrap();
        assert!(worst(&a, &b) <= 2e-3, "token {i}: {}", worst(&a, &b));
        if !certified_eviction && i < 10 {
            assert_eq!(gpu.stats().device_submissions - subs, 1, "token {i}");
        }
    }
    assert!(!gpu.on_device(), "the device was lost");
    assert_eq!(gpu.stats().device_layers, 0);
    assert!(gpu.stats().evicted_forced > 0, "the budget must evict");
    assert_eq!(gpu.stats().tokens, cpu.stats().tokens);
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// 200 decode tokens after an 8-token prompt under a budget with certified eviction:
/// each token is one submission of the recorded step, re-recorded only when a buffer
/// it binds is re-allocated (the cache heads grow from 64 rows to 128), and the stream
/// (logits within 2e-3, evictions, cache positions) is the CPU's. On this stream a gate
/// drop at token 137 makes the policy evict more rows of one head than the step listed
/// (`STEP_EVICTIONS` past the forced ones): that head is loaded from the host's rows
/// and the session stays on the device.
#[test]
fn replayed_steps_across_cache_growth_keep_the_stream() {
    let test = "replayed_steps_across_cache_growth_keep_the_stream";
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(160)),
        window: 8,
        sinks: 2,
        ..SessionOptions::default()
    };
    assert!(opts.certified_eviction);
    let Some((mut cpu, mut gpu)) = pair(test, &opts) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..8], Some(&mut a)).unwrap();
    gpu.feed(&ids[..8], Some(&mut b)).unwrap();
    let recorded = |s: &Session| {
        s.device
            .as_ref()
            .map_or(0, |d| d.stream.host_times().recorded)
    };
    let heads_bytes = |s: &Session| s.device.as_ref().map_or(0, |d| d.stream.bytes());
    assert_eq!(recorded(&gpu), 0);
    let (mut bytes0, mut bytes1, mut r) = (0, 0, 0);
    for (i, &t) in ids[8..208].iter().enumerate() {
        let subs = gpu.stats().device_submissions;
        cpu.feed(&[t], Some(&mut a)).unwrap();
        gpu.feed(&[t], Some(&mut b)).unwrap();
        assert!(worst(&a, &b) <= 2e-3, "token {i}: {}", worst(&a, &b));
        assert!(gpu.on_device(), "token {i}");
        assert_eq!(gpu.stats().device_submissions - subs, 1, "token {i}");
        if i == 0 {
            bytes0 = heads_bytes(&gpu);
        }
        bytes1 = heads_bytes(&gpu);
        r = recorded(&gpu);
    }
    assert!(bytes1 > bytes0, "the cache heads must grow");
    // The first step, the heads' growths, a few growths of the step's inputs.
    assert!((2..=12).contains(&r), "{r} recordings for 200 steps");
    let (sc, sg) = (cpu.stats(), gpu.stats());
    assert!(
        sc.evicted_forced + sc.evicted_certified > 0,
        "the budget must evict"
    );
    assert_eq!(sg.evicted_forced, sc.evicted_forced);
    assert_eq!(sg.evicted_certified, sc.evicted_certified);
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// Under a layer budget the one-token plan gives way to the per-layer run at every
/// token once a layer is full, after re-basing layer 0's heads: their rows' new `c`
/// must still reach the device. Both sessions' gate origins are moved by -2e4 (the
/// device's heads loaded from the host's rows), so the next token re-bases every head;
/// the stream stays the CPU's (logits within 2e-3, cache positions equal).
#[test]
fn rebase_before_a_per_layer_token_reaches_the_device() {
    let test = "rebase_before_a_per_layer_token_reaches_the_device";
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerLayer(4 * 24)),
        window: 8,
        sinks: 2,
        ..SessionOptions::default()
    };
    let Some((mut cpu, mut gpu)) = pair(test, &opts) else {
        return;
    };
    let ids = ids();
    let v = cpu.model().info().vocab;
    let (mut a, mut b) = (vec![0.0f32; v], vec![0.0f32; v]);
    cpu.feed(&ids[..16], Some(&mut a)).unwrap();
    gpu.feed(&ids[..16], Some(&mut b)).unwrap();
    for (i, &t) in ids[16..56].iter().enumerate() {
        if i == 20 {
            for s in [&mut cpu, &mut gpu] {
                for st in &mut s.layers {
                    for h in 0..st.gates.len() {
                        st.gates[h].rebase(-2e4);
                        st.policy.rebase(h, -2e4).unwrap();
                        st.heads[h].rebase(-2e4);
                    }
                }
            }
            let mut dev = gpu.device.take().expect("on the device");
            for l in 0..gpu.layers.len() {
                for h in 0..gpu.layers[l].heads.len() {
                    gpu.reload_head(&mut dev, l, h).unwrap();
                }
            }
            gpu.device = Some(dev);
        }
        cpu.feed(&[t], Some(&mut a)).unwrap();
        gpu.feed(&[t], Some(&mut b)).unwrap();
        assert!(worst(&a, &b) <= 2e-3, "token {i}: {}", worst(&a, &b));
        assert!(gpu.on_device(), "token {i}");
    }
    assert!(cpu.stats().evicted_forced > 0, "the budget must evict");
    for l in 0..4 {
        for h in 0..4 {
            assert_eq!(gpu.cache_positions(l, h), cpu.cache_positions(l, h));
        }
    }
}

/// `same_ops` accepts exactly the device's first `k` planned evictions (their moves;
/// none for a last row) followed by the token's row at slot `live - k`.
#[test]
fn step_operations_are_checked_against_the_policy() {
    let sp = StepHead {
        ops: Vec::new(),
        live: 10,
        evict: vec![
            StepEvict {
                moved: Some((9, 3)),
                at_or_below: f64::INFINITY,
            },
            StepEvict {
                moved: None,
                at_or_below: -2.0,
            },
            StepEvict {
                moved: Some((7, 1)),
                at_or_below: -3.0,
            },
        ],
        c_prev: -1.0,
        pos: 10,
        acp: StepAcp::Dense,
    };
    let put = |slot| RowOp::Put {
        token: 0,
        slot,
        c: -1.5,
        pos: 10,
    };
    let mv = |from, to| RowOp::Move { from, to };
    assert!(same_ops(&[mv(9, 3), put(9)], &sp, 1));
    assert!(same_ops(&[mv(9, 3), put(8)], &sp, 2));
    assert!(same_ops(&[mv(9, 3), mv(7, 1), put(7)], &sp, 3));
    assert!(!same_ops(&[mv(9, 3), put(8)], &sp, 1));
    assert!(same_ops(&[put(10)], &sp, 0));
    assert!(!same_ops(&[mv(9, 3), mv(7, 1), put(7)], &sp, 2));
    assert!(!same_ops(&[mv(9, 3), mv(7, 1), put(6)], &sp, 4));
}

#[test]
fn device_loss_in_a_decode_step_keeps_the_stream() {
    loss_keeps_the_stream(
        "device_loss_in_a_decode_step_keeps_the_stream",
        2,
        false,
        true,
    );
}

#[test]
fn device_loss_in_a_prefill_chunk_keeps_the_stream() {
    loss_keeps_the_stream(
        "device_loss_in_a_prefill_chunk_keeps_the_stream",
        3,
        true,
        true,
    );
}

#[test]
fn device_loss_at_the_first_submission_keeps_the_stream() {
    loss_keeps_the_stream(
        "device_loss_at_the_first_submission_keeps_the_stream",
        0,
        false,
        true,
    );
}

/// A decode token at which nothing can be evicted is one submission (`device_step`):
/// losing it leaves the host's books untouched, and the CPU runs the token.
#[test]
fn device_loss_in_a_one_submission_step_keeps_the_stream() {
    loss_keeps_the_stream(
        "device_loss_in_a_one_submission_step_keeps_the_stream",
        0,
        false,
        false,
    );
}
