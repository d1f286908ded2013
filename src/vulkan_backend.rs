//! The facade adapter over foxedge-vulkan: [`AttentionBackend`] on a Vulkan device.
//!
//! Same calls, same math and the same per-head statistics as the CPU backend (both take
//! their ACP thresholds from foxedge-core). Device failures become facade errors:
//! no loader / no driver / no device → [`Error::BackendUnavailable`] at open time; a lost
//! device → [`Error::BackendUnavailable`] on that call and every later one (the adapter
//! remembers it; a caller that wants to go on must use another backend, see
//! `crate::hybrid`); device memory exhausted → [`Error::OutOfMemory`].

use crate::backend::{Acp, AttentionBackend, AttentionStats, BackendKind, DecodeCall, PrefillCall};
use crate::error::{Error, Result};
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
    Ok(VulkanBackend {
        vk,
        lost: AtomicBool::new(false),
    })
}

/// Attention on one Vulkan device.
#[derive(Debug)]
pub(crate) struct VulkanBackend {
    vk: foxedge_vulkan::Vulkan,
    /// Set once the device reported loss; every later call fails fast.
    lost: AtomicBool,
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
                what: "Vulkan device buffers of one attention call".into(),
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

fn vk_acp(a: Acp<'_>) -> foxedge_vulkan::Acp<'_> {
    match a {
        Acp::Off => foxedge_vulkan::Acp::Off,
        Acp::Bound { u, ln_eps } => foxedge_vulkan::Acp::Bound { u, ln_eps },
        Acp::ObservedNorms { ln_eps } => foxedge_vulkan::Acp::ObservedNorms { ln_eps },
    }
}

fn convert(st: &foxedge_vulkan::AttentionStats) -> AttentionStats {
    AttentionStats {
        kept_pairs: st.heads.iter().map(|h| h.kept_pairs).collect(),
        total_pairs: st.heads.iter().map(|h| h.total_pairs).collect(),
    }
}

impl AttentionBackend for VulkanBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn prefill(&self, call: &PrefillCall<'_>, out: &mut [f32]) -> Result<AttentionStats> {
        self.check_alive()?;
        let shape = foxedge_core::AttentionShape {
            batch: 1,
            heads_q: call.heads,
            heads_kv: call.heads,
            seq_q: call.t,
            seq_k: call.t,
            head_dim: call.head_dim,
            layout: foxedge_core::Layout::SeqFirst,
        };
        let args = foxedge_vulkan::PrefillArgs {
            shape,
            q: call.q,
            k: call.k,
            v: call.v,
            log_fgate: call.log_f,
            seq_start: None,
        };
        let opts = foxedge_vulkan::PrefillOptions {
            acp: vk_acp(call.acp),
            ..Default::default()
        };
        let st = self
            .vk
            .prefill(&args, &opts, out, None)
            .map_err(|e| self.map_err(e))?;
        Ok(convert(&st))
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
        let opts = foxedge_vulkan::DecodeOptions {
            acp: vk_acp(call.acp),
            ..Default::default()
        };
        let st = self
            .vk
            .decode(&args, &opts, out, None)
            .map_err(|e| self.map_err(e))?;
        Ok(convert(&st))
    }
}
