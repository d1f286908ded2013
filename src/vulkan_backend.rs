//! The facade adapter over foxedge-vulkan: [`AttentionBackend`] on a Vulkan device.
//!
//! Same calls, same math and the same per-head statistics as the CPU backend (both take
//! their ACP thresholds from foxedge-core). Device failures become facade errors:
//! no loader / no driver / no device → [`Error::BackendUnavailable`] at open time; a lost
//! device → [`Error::BackendUnavailable`] on that call and every later one (the adapter
//! remembers it; a caller that wants to go on must use another backend, see
//! `crate::hybrid`); device memory exhausted → [`Error::OutOfMemory`].
//!
//! Decode keeps each cache head that comes with a [`crate::backend::CacheSync`] resident on
//! the device (`foxedge_vulkan::ResidentCache`, keyed by the sync id): a step uploads only
//! the rows whose version is newer than the mirror's, so a session's step moves O(1) rows
//! (the new token, swap-delete moves) instead of the whole cache. Heads without sync are
//! uploaded whole for the call. Mirrors are freed when their session releases them, and the
//! least recently used ones are dropped when device memory runs short.

use crate::backend::{
    AttentionBackend, AttentionStats, BackendKind, DecodeCall, PrefillCall, PrefillRun,
};
use crate::error::{Error, Result};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Which Vulkan device to open: `None` follows `FOXEDGE_VULKAN_DEVICE` (an index or a name
/// substring), else the best device; `Some(s)` uses `s` the same way.
pub(crate) fn open(selection: Option<&str>) -> Result<VulkanBackend> {
    let sel = match selection {
        None => foxedge_vulkan::DeviceSelection::FromEnv,
        Some(s) => match s.trim().parse::<usize>() {
            Ok(i) => foxedge_vulkan::DeviceSelection::Index(i),
            Err(_) => foxedge_vulkan::DeviceSelection::Name(s.to_string()),
        },
    };
    let vk = foxedge_vulkan::Vulkan::with_selection(&sel)
        .map_err(|e| Error::BackendUnavailable(format!("vulkan: {e}")))?;
    let resident = Mutex::new(vk.resident_cache(foxedge_vulkan::ResidentOptions::default()));
    let f16_prefill = vk.info().storage_16bit
        && f16_prefill_from_env()?
            .unwrap_or_else(|| vk.supports(foxedge_vulkan::PrefillKernel::Flash));
    Ok(VulkanBackend {
        vk,
        lost: AtomicBool::new(false),
        resident,
        f16_prefill,
    })
}

/// `FOXEDGE_VULKAN_F16_PREFILL`: `1` stores prefill q, k, v as f16 on the device (where it
/// has 16-bit storage), `0` as f32; unset: f16 exactly where the device runs the
/// tensor-core flash kernel (which needs f16 inputs), f32 elsewhere (lavapipe, devices
/// without NV cooperative matrices). Other values are an error.
fn f16_prefill_from_env() -> Result<Option<bool>> {
    f16_flag(std::env::var("FOXEDGE_VULKAN_F16_PREFILL").ok().as_deref())
}

fn f16_flag(v: Option<&str>) -> Result<Option<bool>> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some("0") => Ok(Some(false)),
        Some("1") => Ok(Some(true)),
        Some(other) => Err(Error::InvalidArgument(format!(
            "FOXEDGE_VULKAN_F16_PREFILL: `{other}` (expected 0 or 1)"
        ))),
    }
}

/// Attention on one Vulkan device.
#[derive(Debug)]
pub(crate) struct VulkanBackend {
    vk: foxedge_vulkan::Vulkan,
    /// Set once the device reported loss; every later call fails fast.
    lost: AtomicBool,
    /// Device mirrors of the cache heads decode calls carried sync for.
    resident: Mutex<foxedge_vulkan::ResidentCache>,
    /// Prefill q, k, v go to the device as f16 (see [`f16_prefill_from_env`]): relative
    /// error about 2^-11 per input element instead of 2^-24.
    f16_prefill: bool,
}

impl VulkanBackend {
    /// The device's name and type, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) (Cpu)`.
    pub(crate) fn device_name(&self) -> String {
        let i = self.vk.info();
        format!("{} ({})", i.name, i.device_type)
    }

    /// Whether the device is a CPU implementation (lavapipe): it then shares the cores with
    /// the CPU kernels, so CPU and GPU work do not overlap in time.
    pub(crate) fn is_cpu_device(&self) -> bool {
        self.vk
            .info()
            .device_type
            .to_ascii_lowercase()
            .contains("cpu")
    }

    /// Counters of the resident decode cache (rows and bytes uploaded, mirrors held).
    #[cfg(test)]
    pub(crate) fn cache_counters(&self) -> foxedge_vulkan::CacheCounters {
        self.resident
            .lock()
            .map(|r| r.counters())
            .unwrap_or_default()
    }

    fn check_alive(&self) -> Result<()> {
        if self.lost.load(Ordering::Acquire) {
            return Err(Error::BackendUnavailable(
                "vulkan: the device was lost earlier in this session".into(),
            ));
        }
        Ok(())
    }

    fn map_err(&self, e: foxedge_vulkan::Error) -> Error {
        use foxedge_vulkan::Error as V;
        match e {
            V::Input(e) => Error::Internal(format!("vulkan kernel refused its arguments: {e}")),
            V::OutOfDeviceMemory => Error::OutOfMemory {
                what: "Vulkan device buffers of one attention call (or the resident cache)".into(),
                bytes: 0,
            },
            V::DeviceLost => {
                self.lost.store(true, Ordering::Release);
                Error::BackendUnavailable("vulkan: device lost".into())
            }
            other => Error::BackendUnavailable(format!("vulkan: {other}")),
        }
    }
}

fn convert(st: &foxedge_vulkan::AttentionStats) -> AttentionStats {
    AttentionStats {
        kept_pairs: st.heads.iter().map(|h| h.kept_pairs).collect(),
        total_pairs: st.heads.iter().map(|h| h.total_pairs).collect(),
    }
}

/// The kernel options of `call`: its ACP and its heads.
fn prefill_options<'c>(call: &'c PrefillCall<'_>) -> foxedge_vulkan::PrefillOptions<'c> {
    foxedge_vulkan::PrefillOptions {
        acp: call.kernel_acp(),
        heads: call.only,
        ..Default::default()
    }
}

/// A Vulkan prefill whose output waits in readback memory.
struct Ran<'b> {
    backend: &'b VulkanBackend,
    run: foxedge_vulkan::PrefillRun,
}

impl PrefillRun for Ran<'_> {
    fn finish(self: Box<Self>, out: &mut [f32]) -> Result<AttentionStats> {
        let st = self.run.finish(out).map_err(|e| self.backend.map_err(e))?;
        Ok(convert(&st))
    }
}

impl AttentionBackend for VulkanBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check_alive()?;
        let opts = prefill_options(call);
        let args = call.kernel_args(call.q, call.k, call.v);
        let st = if self.f16_prefill {
            self.vk.prefill_f16_storage(&args, &opts, out, None)
        } else {
            self.vk.prefill(&args, &opts, out, None)
        }
        .map_err(|e| self.map_err(e))?;
        Ok(convert(&st))
    }

    fn prefill_run(
        &self,
        call: &PrefillCall<'_>,
        on_packed: &mut dyn FnMut(),
    ) -> Result<Box<dyn PrefillRun + '_>> {
        self.check_alive()?;
        let opts = prefill_options(call);
        let args = call.kernel_args(call.q, call.k, call.v);
        let run = self
            .vk
            .prefill_run(&args, &opts, self.f16_prefill, on_packed)
            .map_err(|e| self.map_err(e))?;
        Ok(Box::new(Ran { backend: self, run }))
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check_alive()?;
        let heads: Vec<foxedge_vulkan::CacheHead<'_, f32>> = call
            .heads
            .iter()
            .map(|h| foxedge_vulkan::CacheHead {
                k: h.k,
                v: h.v,
                c: h.c,
                pos: h.pos,
            })
            .collect();
        let args = foxedge_vulkan::DecodeArgs {
            head_dim: call.head_dim,
            n_queries: call.n_queries,
            q: call.q,
            q_c: call.q_c,
            q_pos: call.q_pos,
            heads: &heads,
        };
        let entries: usize = call.heads.iter().map(|h| h.c.len()).sum();
        let opts = foxedge_vulkan::DecodeOptions {
            acp: crate::backend::kernels_acp(call.acp),
            split: foxedge_vulkan::auto_split(entries * call.n_queries),
            ..Default::default()
        };
        let st = if call.heads.iter().any(|h| h.sync.is_some()) {
            let sync: Vec<Option<foxedge_vulkan::HeadSync<'_>>> = call
                .heads
                .iter()
                .map(|h| {
                    h.sync.map(|s| foxedge_vulkan::HeadSync {
                        id: s.id,
                        version: s.version,
                        row_version: s.row_version,
                        journal: s
                            .journal
                            .map(|(since, rows)| foxedge_vulkan::Journal { since, rows }),
                    })
                })
                .collect();
            let mut r = self
                .resident
                .lock()
                .map_err(|_| Error::Internal("vulkan resident cache lock poisoned".into()))?;
            r.decode(&args, &sync, &opts, out, None)
        } else {
            self.vk.decode(&args, &opts, out, None)
        }
        .map_err(|e| self.map_err(e))?;
        Ok(convert(&st))
    }

    fn release_cache(&self, ids: &[u64]) {
        if let Ok(mut r) = self.resident.lock() {
            r.forget(ids);
        }
    }
}

#[cfg(test)]
mod tests {
    //! A session on one shared Vulkan backend: logits equal the CPU session's (|diff| <=
    //! 2e-3 on O(10) logits: the kernels differ by ~1e-6 relative per attention output,
    //! carried through 4 layers), the resident cache uploads O(1) rows per step, and a
    //! reset or dropped session frees its mirrors without disturbing another session's.
    use super::*;
    use crate::backend::{Acp, AttentionBackend, DecodeCall, PrefillCall};
    use crate::session::{Budget, Session, SessionOptions};
    use crate::{Model, npy::NpyArray};
    use std::sync::Arc;

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
    fn f16_flag_values() {
        assert_eq!(f16_flag(None).unwrap(), None);
        assert_eq!(f16_flag(Some("")).unwrap(), None);
        assert_eq!(f16_flag(Some(" 0")).unwrap(), Some(false));
        assert_eq!(f16_flag(Some("1")).unwrap(), Some(true));
        assert!(f16_flag(Some("yes")).is_err());
    }

    #[test]
    fn f16_prefill_storage_matches_the_cpu_within_f16_rounding() {
        let test = "f16_prefill_storage_matches_the_cpu_within_f16_rounding";
        let Some(vb) = backend_or_skip(test) else {
            return;
        };
        if !vb.vk.info().storage_16bit {
            eprintln!("SKIPPED {test}: the device has no 16-bit storage");
            return;
        }
        let (t, nh, d) = (200usize, 3usize, 64usize);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
                })
                .collect()
        };
        let (q, k, v) = (
            rnd(t * nh * d, 2.0),
            rnd(t * nh * d, 2.0),
            rnd(t * nh * d, 2.0),
        );
        let log_f: Vec<f32> = rnd(t * nh, 1.0).iter().map(|x| -0.3 * x.abs()).collect();
        let u = vec![2.0f64; nh];
        let call = PrefillCall {
            t,
            heads: nh,
            head_dim: d,
            q: &q,
            k: &k,
            v: &v,
            log_f: &log_f,
            acp: Acp::Bound {
                u: &u,
                ln_eps: -10.0,
            },
            decided: None,
            only: None,
        };
        let mut want = vec![0.0f32; q.len()];
        let st_want = crate::backend::CpuBackend
            .prefill(&call, &mut want)
            .unwrap();
        let rel = |x: &[f32]| {
            let (mut e, mut n) = (0.0f64, 0.0f64);
            for (a, b) in x.iter().zip(&want) {
                e += f64::from(a - b).powi(2);
                n += f64::from(*b).powi(2);
            }
            (e / n).sqrt()
        };
        // Both storages explicitly (the opened backend's default is f16 where the flash
        // kernel runs).
        let with = |f16_prefill| VulkanBackend {
            vk: vb.vk.clone(),
            lost: AtomicBool::new(false),
            resident: Mutex::new(vb.vk.resident_cache(Default::default())),
            f16_prefill,
        };
        let (f32b, f16) = (with(false), with(true));
        let (mut a, mut b) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
        let st32 = f32b.prefill(&call, &mut a).unwrap();
        let st16 = f16.prefill(&call, &mut b).unwrap();
        // Decisions come from the gates (f32 either way): the same pairs are kept.
        assert_eq!(st32, st_want);
        assert_eq!(st16, st_want);
        // f16 inputs: 2^-11 relative rounding per element; 5e-3 in rel. L2 is the f16
        // tolerance of the Vulkan tests. The f32 path is far closer, so f16 really ran.
        let (e32, e16) = (rel(&a), rel(&b));
        assert!(e16 <= 5e-3, "f16 rel L2 {e16}");
        assert!(e32 < e16 && e32 <= 1e-4, "f32 rel L2 {e32}, f16 {e16}");
    }

    #[test]
    fn resident_session_uploads_o1_rows_and_releases_mirrors() {
        let test = "resident_session_uploads_o1_rows_and_releases_mirrors";
        let Some(vb) = backend_or_skip(test) else {
            return;
        };
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let model = Arc::new(Model::open(root.join("models/fox-tiny-pro")).unwrap());
        let ids: Vec<u32> = NpyArray::read(root.join("tests/fixtures/fox-tiny-pro/input_ids.npy"))
            .unwrap()
            .to_i32()
            .unwrap()
            .iter()
            .map(|&x| x as u32)
            .collect();
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
}
