//! Device setup: loader, instance, device choice, queue, allocators, buffers, pipelines.
//!
//! Choice: `FOXEDGE_VULKAN_DEVICE` (or [`DeviceSelection`]) is either a device index in
//! enumeration order or a case-insensitive substring of the device name; otherwise the
//! first device of the best type wins: discrete GPU, integrated GPU, virtual GPU, other,
//! CPU (lavapipe and similar software drivers last).

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use vulkano::buffer::{Buffer, BufferCreateInfo, BufferUsage, Subbuffer};
use vulkano::command_buffer::allocator::StandardCommandBufferAllocator;
use vulkano::command_buffer::{
    AutoCommandBufferBuilder, CommandBufferUsage, CopyBufferInfo, PrimaryAutoCommandBuffer,
    PrimaryCommandBufferAbstract,
};
use vulkano::command_buffer::{CommandBufferSubmitInfo, SubmitInfo};
use vulkano::descriptor_set::allocator::StandardDescriptorSetAllocator;
use vulkano::device::physical::{PhysicalDevice, PhysicalDeviceType, SubgroupFeatures};
use vulkano::device::{
    Device, DeviceCreateInfo, DeviceExtensions, DeviceFeatures, Queue, QueueCreateInfo, QueueFlags,
};
use vulkano::instance::{Instance, InstanceCreateFlags, InstanceCreateInfo};
use vulkano::memory::allocator::{AllocationCreateInfo, MemoryTypeFilter, StandardMemoryAllocator};
use vulkano::pipeline::compute::ComputePipelineCreateInfo;
use vulkano::pipeline::layout::PipelineDescriptorSetLayoutCreateInfo;
use vulkano::pipeline::{ComputePipeline, PipelineLayout, PipelineShaderStageCreateInfo};
use vulkano::shader::{ShaderModule, ShaderModuleCreateInfo, ShaderStages, SpecializationConstant};
use vulkano::sync::GpuFuture;
use vulkano::sync::fence::{Fence, FenceCreateInfo};
use vulkano::{Version, VulkanLibrary};

/// Environment variable that selects the device: an index or a name substring.
pub const DEVICE_ENV: &str = "FOXEDGE_VULKAN_DEVICE";

/// Microseconds a submit polls its fence before it blocks (`FOXEDGE_VULKAN_SPIN_US`;
/// default [`SPIN_US_DEFAULT`] on a GPU, 0 on a CPU device, whose own threads need the
/// cores a poll would take).
pub const SPIN_ENV: &str = "FOXEDGE_VULKAN_SPIN_US";

/// Environment variable: `0` keeps a replayed submission from sleeping before it polls its
/// fence ([`Context::submit_untracked`]).
pub const NAP_ENV: &str = "FOXEDGE_VULKAN_NAP";

/// Environment variable: `simultaneous` records command buffers that are submitted many
/// times (the decode step) with `SIMULTANEOUS_USE` instead of none of the usage flags.
pub const CB_USAGE_ENV: &str = "FOXEDGE_VK_CB_USAGE";

/// Environment variable: `new` gives each replayed submission a fence of its own instead
/// of resetting and reusing one ([`Context::submit_untracked`]).
pub const FENCE_ENV: &str = "FOXEDGE_VK_FENCE";

/// Environment variable: `nv` runs the tensor-core prefill through VK_NV_cooperative_matrix
/// even where VK_KHR_cooperative_matrix can run it (to compare the two on one device).
pub const COOPMAT_ENV: &str = "FOXEDGE_VULKAN_COOPMAT";

/// Default fence poll before blocking, in microseconds: a decode step's wait (0.2-1 ms on
/// the H100) ends with the thread running rather than waking from a blocked wait.
pub const SPIN_US_DEFAULT: u64 = 1000;

/// How to choose among the Vulkan devices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSelection {
    /// `FOXEDGE_VULKAN_DEVICE` if set, else [`DeviceSelection::Best`].
    #[default]
    FromEnv,
    /// Best device type first (discrete > integrated > virtual > other > CPU).
    Best,
    /// Index in the loader's enumeration order.
    Index(usize),
    /// First device whose name contains this (case-insensitive).
    Name(String),
}

/// What the chosen device is and which optional features this backend uses on it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub name: String,
    pub device_type: String,
    /// Vulkan API version of the device, `major.minor.patch`.
    pub api_version: String,
    pub driver_version: u32,
    /// Subgroup size reported by the device (`None` before Vulkan 1.1).
    pub subgroup_size: Option<u32>,
    /// Subgroup arithmetic in compute shaders.
    pub subgroup_arithmetic: bool,
    /// Subgroup shuffles in compute shaders: decode's lane teams reduce with them.
    pub subgroup_shuffle: bool,
    /// 16-bit storage buffers enabled: f16 tensors stay f16 on the device.
    pub storage_16bit: bool,
    /// VK_KHR_cooperative_matrix / VK_NV_cooperative_matrix advertised by the device.
    pub cooperative_matrix_khr: bool,
    pub cooperative_matrix_nv: bool,
    /// The tensor-core prefill kernel (`prefill_cm.glsl`) can run: KHR or NV cooperative
    /// matrix, f16 arithmetic and storage, subgroup size a multiple of 16 with shuffles.
    /// The register-softmax kernel and its layout probe need the NV extension too.
    pub coopmat_prefill: bool,
    /// It runs through VK_KHR_cooperative_matrix (`prefill_cm_khr.comp`): the device lists
    /// 16 x 16 x 16 subgroup products of f16 into f32. Otherwise NV (`prefill_cm.comp`).
    pub coopmat_khr: bool,
    /// VK_KHR_workgroup_memory_explicit_layout (16-bit) enabled: aliased shared-memory
    /// blocks, so `prefill_fa.comp` stages tiles with 16-byte stores.
    pub shared_memory_blocks: bool,
    /// Largest binding range of one storage buffer (bytes): tensors are split under it.
    pub max_storage_buffer_range: u64,
    /// Largest single allocation (bytes).
    pub max_allocation: u64,
    /// Shared memory per workgroup (bytes).
    pub max_shared_memory: u32,
    pub max_workgroup_invocations: u32,
    /// The device works in the host's memory (an integrated GPU, as on Jetson boards, or a
    /// CPU device such as lavapipe): prefill binds its host-visible staging and readback
    /// buffers to the kernels instead of copying them to and from device-local ones.
    pub unified_memory: bool,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}, Vulkan {}), subgroup size {}, subgroup arithmetic {} shuffle {}, 16-bit storage {}, \
             cooperative matrix KHR {} / NV {} (tensor-core prefill {}{}, shared blocks {}), max storage range {} MiB, shared {} KiB, \
             unified memory {}",
            self.name,
            self.device_type,
            self.api_version,
            self.subgroup_size
                .map_or("n/a".to_string(), |s| s.to_string()),
            self.subgroup_arithmetic,
            self.subgroup_shuffle,
            self.storage_16bit,
            self.cooperative_matrix_khr,
            self.cooperative_matrix_nv,
            self.coopmat_prefill,
            if self.coopmat_khr { " via KHR" } else { "" },
            self.shared_memory_blocks,
            self.max_storage_buffer_range >> 20,
            self.max_shared_memory >> 10,
            self.unified_memory,
        )
    }
}

/// Key of a compiled pipeline: shader name and its specialization constants.
type PipelineKey = (&'static str, Vec<(u32, u32)>);

/// A created device and everything needed to run compute work on it.
pub(crate) struct Context {
    pub device: Arc<Device>,
    pub queue: Arc<Queue>,
    pub mem: Arc<StandardMemoryAllocator>,
    pub cmd: Arc<StandardCommandBufferAllocator>,
    pub desc: Arc<StandardDescriptorSetAllocator>,
    pub info: DeviceInfo,
    /// Decode without subgroup operations even where the device has them.
    pub decode_no_subgroups: std::sync::atomic::AtomicBool,
    /// Prefill kernel choice, a [`crate::PrefillKernel`] as u8.
    pub prefill_kernel: std::sync::atomic::AtomicU8,
    /// Prefill binds host-visible buffers to its kernels (no upload or download copies):
    /// [`DeviceInfo::unified_memory`] unless set otherwise.
    pub prefill_direct: std::sync::atomic::AtomicBool,
    /// Largest binding (bytes) a chunk may use: the device limit, or lower when set.
    pub binding_limit: std::sync::atomic::AtomicU64,
    /// Register-softmax prefill settings (`prefill.rs`, `FlashConfig` packed; 0 = default).
    pub flash_cfg: std::sync::atomic::AtomicU32,
    /// Where a 16 x 16 f32 cooperative matrix keeps its elements (`prefill_cm_probe.comp`'s
    /// output, probed once; empty without cooperative matrices): `prefill.rs` decides from
    /// it whether and how `prefill_fa.glsl` runs.
    pub fa_layout: std::sync::OnceLock<Vec<u32>>,
    /// Nanoseconds a submit polls its fence before blocking ([`SPIN_ENV`]).
    pub spin_wait_ns: std::sync::atomic::AtomicU64,
    pipelines: Mutex<HashMap<PipelineKey, Arc<ComputePipeline>>>,
    /// Pipelines compiled so far, and the host nanoseconds their creation took.
    compiled: std::sync::atomic::AtomicU64,
    compile_ns: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("info", &self.info).finish()
    }
}

/// [`SPIN_ENV`] if set to a number, else [`SPIN_US_DEFAULT`] for a GPU and 0 for a CPU
/// device.
fn spin_us(t: PhysicalDeviceType) -> u64 {
    std::env::var(SPIN_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(if t == PhysicalDeviceType::Cpu {
            0
        } else {
            SPIN_US_DEFAULT
        })
}

fn type_rank(t: PhysicalDeviceType) -> u32 {
    match t {
        PhysicalDeviceType::DiscreteGpu => 0,
        PhysicalDeviceType::IntegratedGpu => 1,
        PhysicalDeviceType::VirtualGpu => 2,
        PhysicalDeviceType::Cpu => 4,
        _ => 3,
    }
}

fn compute_family(pd: &PhysicalDevice) -> Option<u32> {
    pd.queue_family_properties()
        .iter()
        .position(|q| q.queue_flags.intersects(QueueFlags::COMPUTE))
        .and_then(|i| u32::try_from(i).ok())
}

/// Names of every Vulkan device the loader reports (for messages and device lists).
pub fn list_devices() -> Result<Vec<String>> {
    let instance = instance()?;
    let devs = instance.enumerate_physical_devices()?;
    Ok(devs.map(|d| d.properties().device_name.clone()).collect())
}

fn instance() -> Result<Arc<Instance>> {
    let library = VulkanLibrary::new()?;
    Instance::new(
        library,
        InstanceCreateInfo {
            flags: InstanceCreateFlags::ENUMERATE_PORTABILITY,
            ..Default::default()
        },
    )
    .map_err(|e| {
        Error::NoInstance(match e {
            vulkano::Validated::Error(v) => v.to_string(),
            vulkano::Validated::ValidationError(v) => v.to_string(),
        })
    })
}

/// Whether `pd` (with VK_KHR_cooperative_matrix) lists the products of `prefill_cm_khr.comp`:
/// subgroup scope, M = N = K = 16, A and B f16, C and the result f32.
fn khr_f16_products(pd: &PhysicalDevice) -> bool {
    use ash::vk;
    use vulkano::VulkanObject;
    let f = pd
        .instance()
        .fns()
        .khr_cooperative_matrix
        .get_physical_device_cooperative_matrix_properties_khr;
    let mut n = 0u32;
    // SAFETY: a count query (null array) of a device whose extension list names
    // VK_KHR_cooperative_matrix, so the instance loaded this function.
    if unsafe { f(pd.handle(), &mut n, std::ptr::null_mut()) } != vk::Result::SUCCESS {
        return false;
    }
    let mut props = vec![vk::CooperativeMatrixPropertiesKHR::default(); n as usize];
    // SAFETY: `props` holds `n` default-initialised structures (sType set, pNext null).
    let r = unsafe { f(pd.handle(), &mut n, props.as_mut_ptr()) };
    if r != vk::Result::SUCCESS && r != vk::Result::INCOMPLETE {
        return false;
    }
    props.truncate(n as usize);
    props.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.a_type == vk::ComponentTypeKHR::FLOAT16
            && p.b_type == vk::ComponentTypeKHR::FLOAT16
            && p.c_type == vk::ComponentTypeKHR::FLOAT32
            && p.result_type == vk::ComponentTypeKHR::FLOAT32
            && p.scope == vk::ScopeKHR::SUBGROUP
    })
}

impl Context {
    pub fn new(sel: &DeviceSelection) -> Result<Self> {
        let instance = instance()?;
        let devices: Vec<Arc<PhysicalDevice>> = instance
            .enumerate_physical_devices()
            .map_err(|e| Error::NoInstance(e.to_string()))?
            .filter(|d| compute_family(d).is_some() && d.api_version() >= Version::V1_2)
            .collect();
        if devices.is_empty() {
            return Err(Error::NoDevice);
        }
        let sel = match sel {
            DeviceSelection::FromEnv => match std::env::var(DEVICE_ENV) {
                Ok(s) if !s.trim().is_empty() => match s.trim().parse::<usize>() {
                    Ok(i) => DeviceSelection::Index(i),
                    Err(_) => DeviceSelection::Name(s.trim().to_string()),
                },
                _ => DeviceSelection::Best,
            },
            other => other.clone(),
        };
        let names = || {
            devices
                .iter()
                .map(|d| d.properties().device_name.clone())
                .collect::<Vec<_>>()
        };
        let pd = match &sel {
            DeviceSelection::Index(i) => devices.get(*i).cloned().ok_or(Error::DeviceNotFound {
                wanted: i.to_string(),
                available: names(),
            })?,
            DeviceSelection::Name(n) => {
                let lower = n.to_lowercase();
                devices
                    .iter()
                    .find(|d| d.properties().device_name.to_lowercase().contains(&lower))
                    .cloned()
                    .ok_or(Error::DeviceNotFound {
                        wanted: n.clone(),
                        available: names(),
                    })?
            }
            _ => devices
                .iter()
                .min_by_key(|d| type_rank(d.properties().device_type))
                .cloned()
                .ok_or(Error::NoDevice)?,
        };
        let family = compute_family(&pd).ok_or(Error::NoDevice)?;
        let props = pd.properties();
        let sup = pd.supported_features();
        let ext = pd.supported_extensions();
        let storage_16bit = sup.storage_buffer16_bit_access;
        let sg_ops = props
            .subgroup_supported_operations
            .unwrap_or(SubgroupFeatures::empty());
        let sg_stages = props
            .subgroup_supported_stages
            .unwrap_or(ShaderStages::empty());
        let subgroup_arithmetic = sg_stages.intersects(ShaderStages::COMPUTE)
            && sg_ops.contains(SubgroupFeatures::BASIC | SubgroupFeatures::ARITHMETIC)
            && props.subgroup_size.is_some_and(|s| s >= 2);
        // Tensor-core path: VK_KHR_cooperative_matrix where the device lists the products
        // the kernel takes, else VK_NV_cooperative_matrix (both enabled where both are
        // there: the register-softmax kernel is NV only); with f16 arithmetic and storage,
        // subgroups of a multiple of 16 lanes with shuffles, 4 subgroups per workgroup.
        let sg = props.subgroup_size.unwrap_or(0);
        let coopmat_base = sup.cooperative_matrix
            && sup.shader_float16
            && storage_16bit
            && sg >= 16
            && sg % 16 == 0
            && 4 * sg <= props.max_compute_work_group_invocations
            && sg_stages.intersects(ShaderStages::COMPUTE)
            && sg_ops.contains(SubgroupFeatures::BASIC | SubgroupFeatures::SHUFFLE)
            && sup.vulkan_memory_model;
        let coopmat_nv = coopmat_base && ext.nv_cooperative_matrix;
        let nv_asked =
            std::env::var(COOPMAT_ENV).is_ok_and(|v| v.trim().eq_ignore_ascii_case("nv"));
        let coopmat_khr = coopmat_base
            && ext.khr_cooperative_matrix
            && !(nv_asked && coopmat_nv)
            && khr_f16_products(&pd);
        let coopmat = coopmat_nv || coopmat_khr;
        let subgroup_shuffle = sg_stages.intersects(ShaderStages::COMPUTE)
            && sg_ops.contains(SubgroupFeatures::BASIC | SubgroupFeatures::SHUFFLE)
            && props.subgroup_size.is_some_and(|s| s >= 2);
        let blocks = coopmat_nv
            && ext.khr_workgroup_memory_explicit_layout
            && sup.workgroup_memory_explicit_layout
            && sup.workgroup_memory_explicit_layout16_bit_access;
        let features = DeviceFeatures {
            storage_buffer16_bit_access: storage_16bit,
            cooperative_matrix: coopmat,
            shader_float16: coopmat,
            vulkan_memory_model: coopmat,
            // Decode's cross-workgroup merge (device-scope atomics and barriers) under the
            // memory model that the tensor-core prefill turns on.
            vulkan_memory_model_device_scope: coopmat && sup.vulkan_memory_model_device_scope,
            // Decode binds the cache heads as an array of storage buffers, indexed per workgroup.
            shader_storage_buffer_array_dynamic_indexing: sup
                .shader_storage_buffer_array_dynamic_indexing,
            workgroup_memory_explicit_layout: blocks,
            workgroup_memory_explicit_layout16_bit_access: blocks,
            ..DeviceFeatures::empty()
        };
        let extensions = DeviceExtensions {
            nv_cooperative_matrix: coopmat_nv,
            khr_cooperative_matrix: coopmat_khr,
            khr_workgroup_memory_explicit_layout: blocks,
            ..DeviceExtensions::empty()
        };
        let (device, mut queues) = Device::new(
            pd.clone(),
            DeviceCreateInfo {
                queue_create_infos: vec![QueueCreateInfo {
                    queue_family_index: family,
                    ..Default::default()
                }],
                enabled_features: features,
                enabled_extensions: extensions,
                ..Default::default()
            },
        )?;
        let queue = queues.next().ok_or(Error::NoDevice)?;
        let v = pd.api_version();
        let info = DeviceInfo {
            name: props.device_name.clone(),
            device_type: format!("{:?}", props.device_type),
            api_version: format!("{}.{}.{}", v.major, v.minor, v.patch),
            driver_version: props.driver_version,
            subgroup_size: props.subgroup_size,
            subgroup_arithmetic,
            subgroup_shuffle,
            storage_16bit,
            cooperative_matrix_khr: ext.khr_cooperative_matrix,
            cooperative_matrix_nv: ext.nv_cooperative_matrix,
            coopmat_prefill: coopmat,
            coopmat_khr,
            shared_memory_blocks: blocks,
            max_storage_buffer_range: u64::from(props.max_storage_buffer_range),
            max_allocation: props.max_memory_allocation_size.unwrap_or(1 << 30),
            max_shared_memory: props.max_compute_shared_memory_size,
            max_workgroup_invocations: props.max_compute_work_group_invocations,
            unified_memory: matches!(
                props.device_type,
                PhysicalDeviceType::IntegratedGpu | PhysicalDeviceType::Cpu
            ),
        };
        let direct = info.unified_memory;
        let mem = Arc::new(StandardMemoryAllocator::new_default(device.clone()));
        let cmd = Arc::new(StandardCommandBufferAllocator::new(
            device.clone(),
            Default::default(),
        ));
        let desc = Arc::new(StandardDescriptorSetAllocator::new(
            device.clone(),
            Default::default(),
        ));
        let binding_limit = info
            .max_storage_buffer_range
            .min(info.max_allocation)
            .into();
        Ok(Self {
            device,
            queue,
            mem,
            cmd,
            desc,
            info,
            binding_limit,
            prefill_kernel: 0.into(),
            prefill_direct: direct.into(),
            flash_cfg: 0.into(),
            fa_layout: std::sync::OnceLock::new(),
            decode_no_subgroups: false.into(),
            spin_wait_ns: spin_us(props.device_type).saturating_mul(1000).into(),
            pipelines: Mutex::new(HashMap::new()),
            compiled: 0.into(),
            compile_ns: 0.into(),
        })
    }

    /// The compute pipeline of shader `name` (SPIR-V `spv`) with these specialization
    /// constants, created once and cached.
    pub fn pipeline(
        &self,
        name: &'static str,
        spv: &[u8],
        spec: &[(u32, u32)],
    ) -> Result<Arc<ComputePipeline>> {
        let key = (name, spec.to_vec());
        if let Some(p) = self
            .pipelines
            .lock()
            .ok()
            .and_then(|m| m.get(&key).cloned())
        {
            return Ok(p);
        }
        if spv.len() % 4 != 0 {
            return Err(Error::Vulkan(format!(
                "{name}: SPIR-V length not a multiple of 4"
            )));
        }
        let t0 = std::time::Instant::now();
        let words: Vec<u32> = spv
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // SAFETY: the words are SPIR-V produced by glslc from this crate's shaders (CI checks
        // that they match their GLSL); vulkano parses and validates the module's interface.
        let module =
            unsafe { ShaderModule::new(self.device.clone(), ShaderModuleCreateInfo::new(&words)) }?;
        let spec_map = spec
            .iter()
            .map(|&(id, v)| (id, SpecializationConstant::U32(v)))
            .collect();
        let entry = module
            .specialize(spec_map)?
            .entry_point("main")
            .ok_or_else(|| Error::Vulkan(format!("{name}: no entry point main")))?;
        let stage = PipelineShaderStageCreateInfo::new(entry);
        let layout = PipelineLayout::new(
            self.device.clone(),
            PipelineDescriptorSetLayoutCreateInfo::from_stages([&stage])
                .into_pipeline_layout_create_info(self.device.clone())
                .map_err(|e| Error::Vulkan(format!("{name}: {e}")))?,
        )?;
        let pipe = ComputePipeline::new(
            self.device.clone(),
            None,
            ComputePipelineCreateInfo::stage_layout(stage, layout),
        )?;
        if let Ok(mut m) = self.pipelines.lock() {
            m.insert(key, pipe.clone());
        }
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.compile_ns.fetch_add(ns, Ordering::Relaxed);
        self.compiled.fetch_add(1, Ordering::Relaxed);
        Ok(pipe)
    }

    /// Pipelines this context has compiled, and the host time their creation took.
    pub fn compiled(&self) -> (u64, std::time::Duration) {
        (
            self.compiled.load(Ordering::Relaxed),
            std::time::Duration::from_nanos(self.compile_ns.load(Ordering::Relaxed)),
        )
    }

    /// A device-local buffer of `words` u32 words (storage and transfer).
    pub fn device_buffer(&self, words: usize) -> Result<Subbuffer<[u32]>> {
        let bytes = words as u64 * 4;
        if bytes > self.info.max_allocation {
            return Err(Error::Unsupported(format!(
                "buffer of {bytes} bytes exceeds maxMemoryAllocationSize {}",
                self.info.max_allocation
            )));
        }
        Ok(Buffer::new_slice::<u32>(
            self.mem.clone(),
            BufferCreateInfo {
                usage: BufferUsage::STORAGE_BUFFER
                    | BufferUsage::TRANSFER_DST
                    | BufferUsage::TRANSFER_SRC,
                ..Default::default()
            },
            AllocationCreateInfo {
                memory_type_filter: MemoryTypeFilter::PREFER_DEVICE,
                ..Default::default()
            },
            words.max(1) as u64,
        )?)
    }

    /// A host-visible buffer for uploads (`write`) or downloads (`!write`).
    pub(crate) fn host_buffer(&self, words: usize, write: bool) -> Result<Subbuffer<[u32]>> {
        let filter = if write {
            MemoryTypeFilter::PREFER_HOST | MemoryTypeFilter::HOST_SEQUENTIAL_WRITE
        } else {
            MemoryTypeFilter::PREFER_HOST | MemoryTypeFilter::HOST_RANDOM_ACCESS
        };
        Ok(Buffer::new_slice::<u32>(
            self.mem.clone(),
            BufferCreateInfo {
                // Storage: the decode's scatter kernel reads uploads straight from staging.
                usage: BufferUsage::TRANSFER_SRC
                    | BufferUsage::TRANSFER_DST
                    | BufferUsage::STORAGE_BUFFER,
                ..Default::default()
            },
            AllocationCreateInfo {
                memory_type_filter: filter,
                ..Default::default()
            },
            words.max(1) as u64,
        )?)
    }

    pub fn builder(&self) -> Result<AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>> {
        Ok(AutoCommandBufferBuilder::primary(
            self.cmd.clone(),
            self.queue.queue_family_index(),
            CommandBufferUsage::OneTimeSubmit,
        )?)
    }

    /// A builder of a command buffer that is submitted many times (one at a time), for
    /// [`Self::submit_built`]: `MultipleSubmit`, or `SimultaneousUse` where
    /// [`CB_USAGE_ENV`] is `simultaneous` (to compare the drivers' submission cost).
    pub fn builder_reusable(&self) -> Result<AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>> {
        static SIMULTANEOUS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let simultaneous = *SIMULTANEOUS
            .get_or_init(|| std::env::var(CB_USAGE_ENV).is_ok_and(|v| v.trim() == "simultaneous"));
        Ok(AutoCommandBufferBuilder::primary(
            self.cmd.clone(),
            self.queue.queue_family_index(),
            if simultaneous {
                CommandBufferUsage::SimultaneousUse
            } else {
                CommandBufferUsage::MultipleSubmit
            },
        )?)
    }

    /// Submits and waits.
    pub fn submit(&self, b: AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>) -> Result<()> {
        self.submit_timed(b).map(|_| ())
    }

    /// [`Self::submit`], returning the host time of its phases: building the command
    /// buffer (vulkano's barrier pass), submitting it (resource locking, fence, queue
    /// submit) and waiting for the fence.
    pub fn submit_timed(
        &self,
        b: AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<[std::time::Duration; 3]> {
        let t0 = std::time::Instant::now();
        let cb = b.build()?;
        let build = t0.elapsed();
        let [submit, wait] = self.submit_built(cb)?;
        Ok([build, submit, wait])
    }

    /// Submits a built command buffer and waits; returns the host time of submitting it
    /// (resource locking, fence, queue submit) and of waiting for the fence.
    pub fn submit_built(
        &self,
        cb: Arc<PrimaryAutoCommandBuffer>,
    ) -> Result<[std::time::Duration; 2]> {
        let t1 = std::time::Instant::now();
        let fence = cb
            .execute(self.queue.clone())
            .map_err(|e| Error::Vulkan(e.to_string()))?
            .then_signal_fence_and_flush()?;
        let t2 = std::time::Instant::now();
        let spin = self.spin_wait_ns.load(std::sync::atomic::Ordering::Relaxed);
        if spin > 0 {
            let until = t2 + std::time::Duration::from_nanos(spin);
            // A lost device reads as `Error::DeviceLost`, as from the blocking wait.
            while !fence.is_signaled()? && std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        fence.wait(None)?;
        drop(fence);
        let t3 = std::time::Instant::now();
        Ok([t2 - t1, t3 - t2])
    }

    /// [`Self::submit_built`] without a `GpuFuture`: one queue submission with a fence,
    /// skipping vulkano's per-submission check and lock of every buffer the command buffer
    /// uses (a cost that grows with its bindings: most of a replayed decode step's host
    /// time). `fence` is the caller's reused fence: taken (created when `None`), and put
    /// back unsignaled once the device has finished (left `None` after an error). Returns
    /// the host time of submitting and of waiting.
    ///
    /// # Safety
    /// While this runs, nothing else may use `cb` nor access the buffers it uses (from
    /// the host or in another submission): vulkano does not know they are in use. It
    /// returns once the device has finished, so a caller that submits from one thread and
    /// touches those buffers only between its calls meets this.
    ///
    /// `expect` is how long the device is expected to take (the last wait of the same
    /// command buffer; zero when unknown): where the context polls ([`SPIN_ENV`]), the
    /// thread first sleeps through three quarters of it, less 300 µs (at most 20 ms), then
    /// polls for the rest plus the spin time, so that it is running when the fence signals
    /// without spinning through a whole step (`FOXEDGE_VULKAN_NAP=0`: no sleep).
    pub unsafe fn submit_untracked(
        &self,
        cb: Arc<PrimaryAutoCommandBuffer>,
        fence: &mut Option<Arc<Fence>>,
        expect: std::time::Duration,
    ) -> Result<[std::time::Duration; 2]> {
        let t1 = std::time::Instant::now();
        let f = match fence.take() {
            Some(f) => f,
            None => Arc::new(Fence::new(self.device.clone(), FenceCreateInfo::default())?),
        };
        let info = SubmitInfo {
            command_buffers: vec![CommandBufferSubmitInfo::new(cb)],
            ..Default::default()
        };
        // SAFETY: the caller guarantees that nothing else uses the command buffer or its
        // resources until this returns; the command buffer (MultipleSubmit) is not pending
        // (the previous submission's fence was waited for); it and the fence are kept alive
        // (held here) until the fence is signaled below. The fence is unsignaled: new, or
        // reset after its last wait.
        unsafe { self.queue.with(|mut q| q.submit(&[info], Some(&f))) }?;
        let t2 = std::time::Instant::now();
        let spin = self.spin_wait_ns.load(std::sync::atomic::Ordering::Relaxed);
        if spin > 0 {
            static NAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let nap = if *NAP.get_or_init(|| std::env::var(NAP_ENV).is_ok_and(|v| v.trim() == "0"))
            {
                std::time::Duration::ZERO
            } else {
                (expect * 3 / 4)
                    .saturating_sub(std::time::Duration::from_micros(300))
                    .min(std::time::Duration::from_millis(20))
            };
            if !nap.is_zero() {
                std::thread::sleep(nap);
            }
            let until = t2 + nap + expect / 4 + std::time::Duration::from_nanos(spin);
            while !f.is_signaled()? && std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        f.wait(None)?;
        let waited = t2.elapsed();
        static NEW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !*NEW.get_or_init(|| std::env::var(FENCE_ENV).is_ok_and(|v| v.trim() == "new")) {
            // SAFETY: the fence is signaled (waited for above): no queue operation uses it.
            unsafe { f.reset() }?;
            *fence = Some(f);
        }
        Ok([t2 - t1, waited])
    }

    /// Uploads words into new device-local buffers, one copy command each, one submit.
    pub fn upload(&self, data: &[&[u32]]) -> Result<Vec<Subbuffer<[u32]>>> {
        let mut b = self.builder()?;
        let mut out = Vec::with_capacity(data.len());
        let mut staging = Vec::with_capacity(data.len());
        for d in data {
            let dst = self.device_buffer(d.len())?;
            let src = self.host_buffer(d.len(), true)?;
            {
                let mut w = src.write().map_err(|e| Error::Vulkan(e.to_string()))?;
                w[..d.len()].copy_from_slice(d);
            }
            b.copy_buffer(CopyBufferInfo::buffers(src.clone(), dst.clone()))?;
            staging.push(src);
            out.push(dst);
        }
        self.submit(b)?;
        drop(staging);
        Ok(out)
    }

    /// Copies device buffers back to host vectors.
    pub fn download(&self, bufs: &[&Subbuffer<[u32]>]) -> Result<Vec<Vec<u32>>> {
        let mut b = self.builder()?;
        let mut staging = Vec::with_capacity(bufs.len());
        for src in bufs {
            let dst = self.host_buffer(src.len() as usize, false)?;
            b.copy_buffer(CopyBufferInfo::buffers((*src).clone(), dst.clone()))?;
            staging.push(dst);
        }
        self.submit(b)?;
        staging
            .iter()
            .map(|s| {
                s.read()
                    .map(|r| r.to_vec())
                    .map_err(|e| Error::Vulkan(e.to_string()))
            })
            .collect()
    }
}

/// GPU timestamps for the phase profile (`FOXEDGE_VULKAN_PROFILE`): `n` stamps, each taken
/// when every command recorded before it has completed.
pub(crate) struct Stamps {
    pool: Arc<vulkano::query::QueryPool>,
    n: u32,
    period_ns: f64,
}

impl Stamps {
    /// None where the queue cannot time compute work.
    pub fn new(ctx: &Context, n: u32) -> Option<Self> {
        use vulkano::query::{QueryPool, QueryPoolCreateInfo, QueryType};
        let props = ctx.device.physical_device().properties();
        if !props.timestamp_compute_and_graphics {
            return None;
        }
        let pool = QueryPool::new(
            ctx.device.clone(),
            QueryPoolCreateInfo {
                query_count: n,
                ..QueryPoolCreateInfo::query_type(QueryType::Timestamp)
            },
        )
        .ok()?;
        Some(Self {
            pool,
            n,
            period_ns: f64::from(props.timestamp_period),
        })
    }

    /// Resets the pool (record first).
    pub fn reset(&self, b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>) -> Result<()> {
        // SAFETY: the pool is not in use by any other command buffer (one step at a time).
        unsafe { b.reset_query_pool(self.pool.clone(), 0..self.n) }?;
        Ok(())
    }

    pub fn stamp(
        &self,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
        i: u32,
    ) -> Result<()> {
        // SAFETY: query `i` < n was reset earlier in this command buffer.
        unsafe {
            b.write_timestamp(
                self.pool.clone(),
                i,
                vulkano::sync::PipelineStage::AllCommands,
            )
        }?;
        Ok(())
    }

    /// Microseconds between consecutive stamps (after the submission completed).
    pub fn gaps_us(&self) -> Vec<f64> {
        self.gaps_us_first(self.n)
    }

    /// Microseconds between consecutive stamps of the first `n` (each written by the
    /// completed submission; empty if `n` is past the pool).
    pub fn gaps_us_first(&self, n: u32) -> Vec<f64> {
        if n > self.n {
            return Vec::new();
        }
        let mut t = vec![0u64; n as usize];
        let ok = self
            .pool
            .get_results(0..n, &mut t, vulkano::query::QueryResultFlags::WAIT)
            .is_ok();
        if !ok {
            return Vec::new();
        }
        t.windows(2)
            .map(|w| w[1].wrapping_sub(w[0]) as f64 * self.period_ns / 1e3)
            .collect()
    }
}
