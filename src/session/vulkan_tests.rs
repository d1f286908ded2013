//! Sessions on one shared Vulkan backend: logits equal the CPU session's (|diff| <=
//! 2e-3 on O(10) logits: the kernels differ by ~1e-6 relative per attention output,
//! carried through 4 layers), the resident cache uploads O(1) rows per step, and a
//! reset or dropped session frees its mirrors without disturbing another session's.
use super::*;
use crate::Model;
use crate::backend::{DecodeCall, PrefillCall};
use crate::vulkan_backend::{VulkanBackend, open};
use foxedge_core::contract::AttentionStats;

/// Lets several sessions share one backend (and its mirrors) in a test.
#[derive(Debug)]
struct Shared(Arc<VulkanBackend>);

impl AttentionBackend for Shared {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }
    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.0.prefill(call, out)
    }
    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.0.decode(call, out)
    }
    fn release_cache(&self, ids: &[u64]) {
        self.0.release_cache(ids);
    }
}

fn backend_or_skip(test: &str) -> Option<Arc<VulkanBackend>> {
    crate::test_device::or_skip(open(None), test, "Vulkan").map(Arc::new)
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        )
}

#[test]
fn resident_session_uploads_o1_rows_and_releases_mirrors() {
    let Some(vb) = backend_or_skip("resident_session_uploads_o1_rows_and_releases_mirrors") else {
        return;
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = Arc::new(Model::open(root.join("models/fox-tiny-pro")).unwrap());
    let ids: Vec<u32> = {
        let f =
            std::fs::File::open(root.join("tests/fixtures/fox-tiny-pro/input_ids.npy")).unwrap();
        let npy = npyz::NpyFile::new(std::io::BufReader::new(f)).unwrap();
        let v: Vec<i32> = npy.into_vec().unwrap();
        v.into_iter().map(|x| x as u32).collect()
    };
    let v = model.info().vocab;
    let opts = SessionOptions {
        budget: Some(Budget::EntriesPerHead(64)),
        window: 8,
        sinks: 2,
        ..Default::default()
    };
    let pair = || {
        let cpu = Session::new(model.clone(), opts.clone()).unwrap();
        let mut gpu = Session::new(model.clone(), opts.clone()).unwrap();
        gpu.set_backend(Box::new(Shared(vb.clone())));
        (cpu, gpu)
    };
    let (mut ca, mut ga) = pair();
    let (mut x, mut y) = (vec![0.0f32; v], vec![0.0f32; v]);
    ca.feed(&ids[..48], Some(&mut x)).unwrap();
    ga.feed(&ids[..48], Some(&mut y)).unwrap();
    assert!(worst(&x, &y) <= 2e-3);
    // The first decode step uploads each head's cache once.
    ca.feed(&ids[48..49], Some(&mut x)).unwrap();
    ga.feed(&ids[48..49], Some(&mut y)).unwrap();
    let c0 = vb.cache_counters();
    assert_eq!(c0.mirrors, 16, "4 layers x 4 heads");
    let steps = 120;
    let mut live_sum = 0u64;
    for &t in &ids[49..49 + steps] {
        ca.feed(&[t], Some(&mut x)).unwrap();
        ga.feed(&[t], Some(&mut y)).unwrap();
        assert!(worst(&x, &y) <= 2e-3, "logits differ by {}", worst(&x, &y));
        live_sum += ga.stats().live_entries;
    }
    let c1 = vb.cache_counters();
    let rows = c1.rows_uploaded - c0.rows_uploaded;
    eprintln!(
        "{steps} steps: {rows} rows uploaded ({:.1}/step), {:.0} live entries/step; {c1:?}",
        rows as f64 / steps as f64,
        live_sum as f64 / steps as f64
    );
    assert!(ga.stats().evicted_forced > 0, "the budget must move rows");
    // Per step and head: the appended row, plus the row a swap-delete moved into a
    // freed slot (at most 2 rows per eviction), nothing else.
    assert!(rows <= steps as u64 * 16 * 3, "{rows} rows");
    assert!(
        rows * 10 < live_sum,
        "uploads must not scale with the cache"
    );
    assert_eq!(c1.full_uploads, c0.full_uploads);
    // The sessions' write journals name every steady step's rows: no head reads all of
    // its row versions.
    assert_eq!(c1.scans, c0.scans, "steady steps scanned row versions");

    // A second session on the same backend, interleaved; then the first is reset.
    let (mut cb, mut gb) = pair();
    cb.feed(&ids[..30], Some(&mut x)).unwrap();
    gb.feed(&ids[..30], Some(&mut y)).unwrap();
    ga.reset().unwrap();
    ca.reset().unwrap();
    assert_eq!(vb.cache_counters().mirrors, 0, "reset releases the mirrors");
    let (mut xa, mut ya) = (vec![0.0f32; v], vec![0.0f32; v]);
    for i in 0..40 {
        ca.feed(&ids[200 + i..201 + i], Some(&mut xa)).unwrap();
        ga.feed(&ids[200 + i..201 + i], Some(&mut ya)).unwrap();
        cb.feed(&ids[30 + i..31 + i], Some(&mut x)).unwrap();
        gb.feed(&ids[30 + i..31 + i], Some(&mut y)).unwrap();
        assert!(worst(&xa, &ya) <= 2e-3 && worst(&x, &y) <= 2e-3, "step {i}");
    }
    assert_eq!(vb.cache_counters().mirrors, 32);
    drop(ga);
    assert_eq!(
        vb.cache_counters().mirrors,
        16,
        "a dropped session frees its mirrors"
    );
    for i in 40..50 {
        cb.feed(&ids[30 + i..31 + i], Some(&mut x)).unwrap();
        gb.feed(&ids[30 + i..31 + i], Some(&mut y)).unwrap();
        assert!(worst(&x, &y) <= 2e-3, "step {i}");
    }
}
