//! Errors of the Vulkan backend: bad input (from foxedge-core's checks) and the ways a
//! Vulkan system can be missing or fail. Nothing in this crate panics on either.

use std::fmt;
use vulkano::buffer::AllocateBufferError;
use vulkano::memory::allocator::MemoryAllocatorError;
use vulkano::{LoadingError, Validated, ValidationError, VulkanError};

/// What went wrong.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The caller's input is invalid (shape, lengths, gates, ACP parameters).
    Input(foxedge_core::Error),
    /// No Vulkan loader (libvulkan) could be loaded.
    NoLoader(String),
    /// The loader is there but no instance could be created (no driver, typically).
    NoInstance(String),
    /// No physical device with a compute queue.
    NoDevice,
    /// `FOXEDGE_VULKAN_DEVICE` (or the selection given) matched no device.
    DeviceNotFound {
        wanted: String,
        available: Vec<String>,
    },
    /// The device (or host) ran out of memory for this call's buffers.
    OutOfDeviceMemory,
    /// A model's weights need more device memory than its budget allows.
    DoesNotFit { needed: u64, budget: u64 },
    /// The device was lost (driver reset, hang, removal); create a new [`crate::Vulkan`].
    DeviceLost,
    /// The device cannot run this call (limits, missing features), with the reason.
    Unsupported(String),
    /// Any other Vulkan or validation failure, with its message.
    Vulkan(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Input(e) => write!(f, "invalid input: {e}"),
            Error::NoLoader(m) => write!(f, "no Vulkan loader: {m}"),
            Error::NoInstance(m) => write!(f, "no Vulkan instance (no driver?): {m}"),
            Error::NoDevice => write!(f, "no Vulkan device with a compute queue"),
            Error::DeviceNotFound { wanted, available } => write!(
                f,
                "no Vulkan device matches {wanted:?}; available: {}",
                available.join(", ")
            ),
            Error::OutOfDeviceMemory => write!(f, "out of device memory"),
            Error::DoesNotFit { needed, budget } => write!(
                f,
                "the model needs {needed} bytes of device memory, over the budget of {budget}"
            ),
            Error::DeviceLost => write!(f, "Vulkan device lost"),
            Error::Unsupported(m) => write!(f, "unsupported on this device: {m}"),
            Error::Vulkan(m) => write!(f, "Vulkan error: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl From<foxedge_core::Error> for Error {
    fn from(e: foxedge_core::Error) -> Self {
        Error::Input(e)
    }
}

impl From<VulkanError> for Error {
    fn from(e: VulkanError) -> Self {
        match e {
            VulkanError::OutOfDeviceMemory | VulkanError::OutOfHostMemory => {
                Error::OutOfDeviceMemory
            }
            VulkanError::DeviceLost => Error::DeviceLost,
            other => Error::Vulkan(other.to_string()),
        }
    }
}

impl From<Box<ValidationError>> for Error {
    fn from(e: Box<ValidationError>) -> Self {
        Error::Vulkan(e.to_string())
    }
}

impl<E: Into<Error>> From<Validated<E>> for Error {
    fn from(e: Validated<E>) -> Self {
        match e {
            Validated::Error(e) => e.into(),
            Validated::ValidationError(v) => Error::Vulkan(v.to_string()),
        }
    }
}

impl From<AllocateBufferError> for Error {
    fn from(e: AllocateBufferError) -> Self {
        match e {
            AllocateBufferError::AllocateMemory(MemoryAllocatorError::AllocateDeviceMemory(v)) => {
                v.into()
            }
            AllocateBufferError::AllocateMemory(MemoryAllocatorError::OutOfPoolMemory) => {
                Error::OutOfDeviceMemory
            }
            AllocateBufferError::CreateBuffer(v) | AllocateBufferError::BindMemory(v) => v.into(),
            other => Error::Vulkan(other.to_string()),
        }
    }
}

impl From<LoadingError> for Error {
    fn from(e: LoadingError) -> Self {
        Error::NoLoader(e.to_string())
    }
}
