//! The attention backend each [`BackendKind`] names: `cpu` the CPU kernels, `vulkan` the
//! Vulkan device with the CPU behind it, `hybrid` and `auto` a [`Placement`] over both.

use crate::backend::{AttentionBackend, BackendKind, CpuBackend};
use crate::error::Result;
use crate::placement::{Gpu, Placement};
use std::sync::atomic::{AtomicBool, Ordering};

/// Opens the Vulkan device `device` (an index or a name substring; None:
/// `FOXEDGE_VULKAN_DEVICE`, else the best device).
#[cfg(feature = "vulkan")]
fn open_gpu(device: Option<&str>) -> Result<Gpu> {
    let vb = crate::vulkan_backend::open(device)?;
    Ok(Gpu {
        name: vb.device_name(),
        concurrent: !vb.is_cpu_device(),
        backend: Box::new(vb),
    })
}

#[cfg(not(feature = "vulkan"))]
fn open_gpu(_device: Option<&str>) -> Result<Gpu> {
    Err(crate::error::Error::BackendUnavailable(
        "vulkan: this build has no Vulkan backend (cargo feature `vulkan`)".into(),
    ))
}

/// A backend of some [`BackendKind`], as [`open`] made it.
#[derive(Debug)]
pub(crate) enum Opened {
    /// `cpu`, or `auto` without a device.
    Cpu(CpuBackend),
    /// `vulkan` (with its CPU fallback) on the named device.
    #[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
    Vulkan(Box<dyn AttentionBackend>, String),
    /// `hybrid` or `auto`.
    Placed(Box<Placement>),
}

impl Opened {
    pub(crate) fn backend(&self) -> &dyn AttentionBackend {
        match self {
            Opened::Cpu(c) => c,
            Opened::Vulkan(b, _) => b.as_ref(),
            Opened::Placed(p) => p.as_ref(),
        }
    }
}

/// The backend of `kind` on `device` (as [`open_gpu`] takes it). `cpu` always opens;
/// `vulkan` and `hybrid` need a Vulkan device ([`Error::BackendUnavailable`] otherwise);
/// `auto` uses the CPU when there is none, and says so once per process.
pub(crate) fn open(kind: BackendKind, device: Option<&str>) -> Result<Opened> {
    let auto = match kind {
        BackendKind::Cpu => return Ok(Opened::Cpu(CpuBackend)),
        BackendKind::Vulkan => return open_vulkan(device),
        BackendKind::Hybrid => false,
        BackendKind::Auto => true,
    };
    match open_gpu(device) {
        Ok(gpu) => Ok(Opened::Placed(Box::new(Placement::new(auto, gpu)))),
        Err(e) if auto => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::AcqRel) {
                eprintln!("foxedge: auto backend: {e}; attention runs on the CPU");
            }
            Ok(Opened::Cpu(CpuBackend))
        }
        Err(e) => Err(e),
    }
}

#[cfg(feature = "vulkan")]
fn open_vulkan(device: Option<&str>) -> Result<Opened> {
    let gpu = open_gpu(device)?;
    let b = crate::vulkan_backend::CpuFallback::new(gpu.backend);
    Ok(Opened::Vulkan(Box::new(b), gpu.name))
}

#[cfg(not(feature = "vulkan"))]
fn open_vulkan(device: Option<&str>) -> Result<Opened> {
    open_gpu(device).map(|_| Opened::Cpu(CpuBackend))
}

/// A session's backend for `kind` (see [`open`]).
pub(crate) fn resolve(
    kind: BackendKind,
    device: Option<&str>,
) -> Result<Box<dyn AttentionBackend>> {
    Ok(match open(kind, device)? {
        Opened::Cpu(c) => Box::new(c),
        Opened::Vulkan(b, _) => b,
        Opened::Placed(p) => p,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_opens_or_says_why() {
        assert_eq!(
            resolve(BackendKind::Cpu, None).unwrap().kind(),
            BackendKind::Cpu
        );
        let none = Some("no-such-vulkan-device-xyz");
        assert_eq!(
            resolve(BackendKind::Auto, none).unwrap().kind(),
            BackendKind::Cpu
        );
        for k in [BackendKind::Vulkan, BackendKind::Hybrid] {
            let e = resolve(k, none).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::BackendUnavailable, "{k}: {e}");
        }
    }
}
