//! The facade adapter over foxedge-vulkan: [`AttentionBackend`] on a Vulkan device, and
//! the `vulkan` backend kind: that device with the CPU kernels behind it ([`CpuFallback`]).
//!
//! Same calls, same math and the same per-head statistics as the CPU backend (both take
//! their ACP thresholds from foxedge-core). Device failures become facade errors:
//! no loader / no driver / no device → [`Error::BackendUnavailable`] at open time; a lost
//! device → [`Error::BackendUnavailable`] on that call and every later one (the adapter
//! remembers it); device memory exhausted → [`Error::OutOfMemory`]. [`CpuFallback`] turns
//! either into a rerun on the CPU.
//!
//! Decode keeps each cache head that comes with a [`HeadSync`] resident on the device
//! (`foxedge_vulkan::ResidentCache`, keyed by the sync id): a step uploads only
//! the rows whose version is newer than the mirror's, so a session's step moves O(1) rows
//! (the new token, swap-delete moves) instead of the whole cache. Heads without sync are
//! uploaded whole for the call. Mirrors are freed when their session releases them, and the
//! least recently used ones are dropped when device memory runs short.

use crate::backend::{
    AttentionBackend, BackendKind, CpuBackend, DecodeCall, PrefillCall, PrefillRun,
    is_device_failure,
};
use crate::error::{Error, Result};
use foxedge_core::contract::{AttentionStats, HeadSync, Storage};
use half::f16;
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

/// A Vulkan prefill whose output waits in readback memory.
struct Ran<'b> {
    backend: &'b VulkanBackend,
    run: foxedge_vulkan::PrefillRun,
}

impl PrefillRun for Ran<'_> {
    fn finish(self: Box<Self>, out: &mut [f32]) -> Result<AttentionStats> {
        self.run.finish(out).map_err(|e| self.backend.map_err(e))
    }
}

impl AttentionBackend for VulkanBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check_alive()?;
        let (args, opts) = (call.args(), call.options());
        if self.f16_prefill {
            self.vk.prefill_f16_storage(args, opts, out, None)
        } else {
            self.vk.prefill(args, opts, out, None)
        }
        .map_err(|e| self.map_err(e))
    }

    fn prefill_run(
        &self,
        call: &PrefillCall<'_>,
        on_packed: &mut dyn FnMut(),
    ) -> Result<Box<dyn PrefillRun + '_>> {
        self.check_alive()?;
        let (args, opts) = (call.args(), call.options());
        let run = self
            .vk
            .prefill_run(args, opts, self.f16_prefill, on_packed)
            .map_err(|e| self.map_err(e))?;
        Ok(Box::new(Ran { backend: self, run }))
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.decode_any(call, out)
    }

    /// f16 cache rows stay f16 on the device (the decode kernels read them as packed words).
    fn decode_f16(&self, call: &DecodeCall<'_, f16>, out: &mut [f32]) -> Result<AttentionStats> {
        self.decode_any(call, out)
    }

    fn release_cache(&self, ids: &[u64]) {
        if let Ok(mut r) = self.resident.lock() {
            r.forget(ids);
        }
    }
}

impl VulkanBackend {
    /// A decode step over `T` rows, through the resident mirrors when the heads carry
    /// change tracking.
    fn decode_any<T: Storage>(
        &self,
        call: &DecodeCall<'_, T>,
        out: &mut [f32],
    ) -> Result<AttentionStats> {
        self.check_alive()?;
        let args = &call.args;
        let entries: usize = args.heads.iter().map(|h| h.c.len()).sum();
        let opts = foxedge_vulkan::DecodeOptions {
            acp: call.acp,
            split: foxedge_vulkan::auto_split(entries * args.n_queries),
            ..Default::default()
        };
        if call.sync.is_empty() {
            return self
                .vk
                .decode(args, &opts, out, None)
                .map_err(|e| self.map_err(e));
        }
        let sync: Vec<Option<HeadSync<'_>>> = call.sync.iter().copied().map(Some).collect();
        let mut r = self
            .resident
            .lock()
            .map_err(|_| Error::Internal("vulkan resident cache lock poisoned".into()))?;
        r.decode(args, &sync, &opts, out, None)
            .map_err(|e| self.map_err(e))
    }
}

/// The `vulkan` backend kind: every call on the GPU backend `gpu`; a call the device
/// fails (lost, out of device memory) reruns on the CPU, and so does every later call,
/// said once on stderr. Backends hold no stream state (the session owns the cache), so
/// the stream goes on intact; [`AttentionBackend::kind`] then reports `cpu`.
#[derive(Debug)]
pub(crate) struct CpuFallback {
    gpu: Box<dyn AttentionBackend>,
    fell_back: AtomicBool,
}

impl CpuFallback {
    pub(crate) fn new(gpu: Box<dyn AttentionBackend>) -> Self {
        CpuFallback {
            gpu,
            fell_back: AtomicBool::new(false),
        }
    }

    /// Whether the GPU failed and the CPU took over.
    pub(crate) fn fell_back(&self) -> bool {
        self.fell_back.load(Ordering::Acquire)
    }

    /// `r` from the GPU, or `cpu()`'s rerun when the GPU failed as a device.
    fn or_cpu<R>(&self, r: Result<R>, cpu: impl FnOnce() -> Result<R>) -> Result<R> {
        match r {
            Err(e) if is_device_failure(&e) => {
                if !self.fell_back.swap(true, Ordering::AcqRel) {
                    eprintln!("foxedge: vulkan backend: {e}; attention continues on the CPU");
                }
                cpu()
            }
            r => r,
        }
    }
}

impl AttentionBackend for CpuFallback {
    fn kind(&self) -> BackendKind {
        if self.fell_back() {
            BackendKind::Cpu
        } else {
            BackendKind::Vulkan
        }
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        if self.fell_back() {
            return CpuBackend.prefill(call, out);
        }
        let r = self.gpu.prefill(call, out);
        self.or_cpu(r, || CpuBackend.prefill(call, out))
    }

    fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        if self.fell_back() {
            return CpuBackend.decode(call, out);
        }
        let r = self.gpu.decode(call, out);
        self.or_cpu(r, || CpuBackend.decode(call, out))
    }

    fn decode_f16(&self, call: &DecodeCall<'_, f16>, out: &mut [f32]) -> Result<AttentionStats> {
        if self.fell_back() {
            return CpuBackend.decode_f16(call, out);
        }
        let r = self.gpu.decode_f16(call, out);
        self.or_cpu(r, || CpuBackend.decode_f16(call, out))
    }

    fn release_cache(&self, ids: &[u64]) {
        self.gpu.release_cache(ids);
    }
}

#[cfg(test)]
mod tests {
    //! The f16 prefill storage against the CPU (f16 rounding tolerance), and the `vulkan`
    //! kind's CPU fallback on a device that fails mid-stream (a stand-in device: a real
    //! one cannot be lost on demand). Sessions on a shared Vulkan backend are tested with
    //! the session.
    use super::*;
    use foxedge_core::contract::{Acp, CacheHead, DecodeArgs};

    /// The device this process would open, or None (saying why) when there is none and
    /// `CI` is unset.
    fn backend_or_skip(test: &str) -> Option<VulkanBackend> {
        crate::test_device::or_skip(open(None), test, "Vulkan")
    }

    /// The CPU kernels standing in for a device, failing as a lost device on demand.
    #[derive(Debug)]
    struct Flaky(std::sync::Arc<AtomicBool>);

    impl AttentionBackend for Flaky {
        fn kind(&self) -> BackendKind {
            BackendKind::Vulkan
        }
        fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            if self.0.load(Ordering::Acquire) {
                return Err(Error::BackendUnavailable("vulkan: device lost".into()));
            }
            CpuBackend.prefill(call, out)
        }
        fn decode(&self, call: &DecodeCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
            if self.0.load(Ordering::Acquire) {
                return Err(Error::BackendUnavailable("vulkan: device lost".into()));
            }
            CpuBackend.decode(call, out)
        }
    }

    #[test]
    fn device_loss_mid_decode_falls_back_to_the_cpu() {
        let (n, d) = (300usize, 16usize);
        let k: Vec<f32> = (0..n * d)
            .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let v: Vec<f32> = (0..n * d)
            .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
            .collect();
        let c: Vec<f64> = (0..n).map(|j| -0.01 * (n - 1 - j) as f64).collect();
        let q = vec![0.25f32; 2 * d];
        let heads = [CacheHead {
            k: &k,
            v: &v,
            c: &c,
            pos: None,
        }; 2];
        let call = DecodeCall {
            args: DecodeArgs::one_query(d, &q, &[0.0, 0.0], &heads),
            sync: &[],
            acp: Acp::Off,
        };
        let fail = std::sync::Arc::new(AtomicBool::new(false));
        let b = CpuFallback::new(Box::new(Flaky(fail.clone())));
        let (mut a, mut x) = (vec![0.0f32; 2 * d], vec![0.0f32; 2 * d]);
        b.decode(&call, &mut a).unwrap();
        assert_eq!(b.kind(), BackendKind::Vulkan);
        fail.store(true, Ordering::Release);
        let st = b.decode(&call, &mut x).unwrap();
        assert_eq!(a, x, "the step reran on the CPU");
        assert_eq!(st.kept_pairs(), 2 * n as u64);
        assert!(b.fell_back());
        assert_eq!(b.kind(), BackendKind::Cpu);
        // Every later call runs on the CPU without asking the device.
        fail.store(false, Ordering::Release);
        b.decode(&call, &mut x).unwrap();
        assert_eq!(b.kind(), BackendKind::Cpu);
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
        let call = PrefillCall::new(t, nh, d, &q, &k, &v, &log_f).with_acp(Acp::Bound {
            u: &u,
            ln_eps: -10.0,
        });
        let mut want = vec![0.0f32; q.len()];
        let st_want = CpuBackend.prefill(&call, &mut want).unwrap();
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
}
