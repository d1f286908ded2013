//! foxedge-vulkan: forgetting attention with ACP on a Vulkan device (vulkano 0.35,
//! precompiled SPIR-V), computing what `foxedge-cpu` computes from the same call: both
//! take the kernel contract of `foxedge_core::contract`, re-exported here.
//!
//! - [`Vulkan::prefill`]: `o_i = Σ_j w_ij v_j / Σ_j w_ij`, `w_ij = exp(s q_i·k_j + c_i − c_j)`
//!   over causal keys `seq_start[b] <= j <= i`; under ACP each query block starts at the key
//!   block that `foxedge_core::contract::acp` decided (ACP paper, Algorithm 1).
//!   Shared-memory tiles and an online softmax (`shaders/prefill.glsl`).
//! - [`Vulkan::decode`]: new queries against an unordered cache whose entries carry `c_j`;
//!   split over the cache (flash-decoding) with an exact merge in the same dispatch (the
//!   last workgroup of a query merges, `shaders/decode.glsl`), subgroup reductions where the
//!   device has them. A row whose softmax is not finite is an error, as on the CPU.
//! - [`ResidentCache`]: cache heads kept on the device between decode steps; a step uploads
//!   only the rows written since the last one.
//!
//! Storage: f16 stays f16 on the device when it has 16-bit storage buffers; f32 and bf16
//! (and f16 without 16-bit storage) go up as f32; decode reads f16 K/V as packed 32-bit
//! words and keeps them f16 on any device. Compute and accumulation are f32. `c` is f64 on
//! the host and reaches the device as a double-float pair (see `prefill.rs`).
//!
//! Statistics ([`AttentionStats`]) come from foxedge-core's pair counts, as on the CPU.
//! Every failure is an [`Error`]: no loader, no driver, no device, out of device memory,
//! device lost, limits the call exceeds, bad input.

mod arena;
mod cache;
mod decode;
mod device;
mod error;
pub mod model;
mod pack;
mod prefill;
mod probe;

pub use cache::{CacheCounters, ResidentCache, ResidentOptions};
pub use decode::{DecodeTuning, PreparedDecode, auto_split};
pub use device::{DEVICE_ENV, DeviceInfo, DeviceSelection, list_devices};
pub use error::{Error, Result};
/// The kernel contract (`foxedge_core::contract`), the same types `foxedge-cpu` takes. On
/// the GPU, bf16 storage is widened to f32 on upload (GLSL has no bf16 type).
pub use foxedge_core::contract::{
    Acp, AttentionStats, CacheHead, DType, Decisions, DecodeArgs, DecodeOptions, HeadStats,
    HeadSync, Journal, PrefillArgs, PrefillOptions, Storage,
};
pub use foxedge_core::{AttentionShape, Layout};
pub use prefill::{FlashConfig, PrefillKernel, PrefillTile, PreparedPrefill};

use std::sync::{Arc, OnceLock};

/// Environment variable: `1` makes [`Vulkan::prefill`] print one line per call on stderr
/// with the milliseconds of each phase (decisions, setup, pack, upload, kernel, download,
/// unpack) and the kernel that ran. Read once.
pub const PROFILE_ENV: &str = "FOXEDGE_VULKAN_PROFILE";

fn profile() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(PROFILE_ENV).is_some_and(|v| v == "1"))
}

/// The profile line of one prefill call (with [`PROFILE_ENV`] set), `input` -> `O`.
fn profile_line<O: Storage>(
    p: &PreparedPrefill,
    input: DType,
    kernel: std::time::Duration,
    download: std::time::Duration,
    unpack: std::time::Duration,
) {
    if !profile() {
        return;
    }
    let sh = p.shape();
    let ph = p.phases();
    let (pooled, bytes) = p.arena_use();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    eprintln!(
        "foxedge-vulkan prefill {}x{}x{}x{} ({:?} -> {:?}) {}: decisions {:.2} setup {:.2} \
         pack {:.2} upload {:.2} kernel {:.2} download {:.2} unpack {:.2} ms; {} buffers {} MiB",
        sh.batch,
        p.stats().heads.len() / sh.batch.max(1),
        sh.seq_q,
        sh.head_dim,
        input,
        O::DTYPE,
        p.kernel_name(),
        ms(ph.decisions),
        ms(ph.setup),
        ms(ph.pack),
        ms(ph.upload),
        ms(kernel),
        ms(download),
        ms(unpack),
        if pooled { "pooled" } else { "fresh" },
        bytes >> 20,
    );
}

/// A prefill whose kernels ran and whose output waits in readback memory
/// ([`Vulkan::prefill_run`]). It holds the device's pooled prefill buffers until it is
/// finished or dropped.
#[derive(Debug)]
pub struct PrefillRun {
    p: PreparedPrefill,
    kernel: std::time::Duration,
    download: std::time::Duration,
    input: DType,
}

impl PrefillRun {
    /// The call's statistics (one entry per computed (batch, head)).
    pub fn stats(&self) -> &AttentionStats {
        self.p.stats()
    }

    /// Writes the output rows of the computed heads into `out` (`shape.q_len()` elements
    /// in `shape.layout`), leaving the others as they are; returns the statistics.
    pub fn finish<O: Storage>(self, out: &mut [O]) -> Result<AttentionStats> {
        let unpack = self.p.unpack_checked(out)?;
        profile_line::<O>(&self.p, self.input, self.kernel, self.download, unpack);
        Ok(self.p.stats().clone())
    }
}

/// A Vulkan compute device with this crate's pipelines. Cheap to share (`Arc` inside);
/// calls on one `Vulkan` run one after another on its queue.
#[derive(Debug, Clone)]
pub struct Vulkan {
    ctx: Arc<device::Context>,
    /// Prefill's reusable buffers (`arena.rs`).
    prefill_pool: arena::Pool,
    decode_tuning: Arc<std::sync::Mutex<DecodeTuning>>,
}

impl Vulkan {
    /// Opens the device chosen by `FOXEDGE_VULKAN_DEVICE`, else the best one.
    pub fn new() -> Result<Self> {
        Self::with_selection(&DeviceSelection::FromEnv)
    }

    /// Opens the device chosen by `sel`.
    pub fn with_selection(sel: &DeviceSelection) -> Result<Self> {
        Ok(Self {
            ctx: Arc::new(device::Context::new(sel)?),
            prefill_pool: arena::Pool::new(),
            decode_tuning: Arc::default(),
        })
    }

    /// Name, API version, subgroup size and the optional features in use.
    pub fn info(&self) -> &DeviceInfo {
        &self.ctx.info
    }

    /// Chooses the prefill kernel for later calls ([`PrefillKernel::Auto`] by default:
    /// the tensor-core kernel where it applies, else the scalar one).
    pub fn set_prefill_kernel(&self, k: PrefillKernel) {
        self.ctx
            .prefill_kernel
            .store(k as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether prefill binds its host-visible staging and readback buffers to the kernels
    /// (no upload or download copies). Default: [`DeviceInfo::unified_memory`], where the
    /// device works in the host's memory. On a discrete GPU the kernels would then read
    /// their inputs across the bus, so there it is for tests and measurements.
    pub fn set_prefill_direct(&self, direct: bool) {
        self.ctx
            .prefill_direct
            .store(direct, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this device can run kernel `k` at all (CoopMat: also needs f16 storage and
    /// head_dim 64 in the call).
    pub fn supports(&self, k: PrefillKernel) -> bool {
        match k {
            PrefillKernel::Auto | PrefillKernel::Scalar => true,
            PrefillKernel::CoopMat => self.ctx.info.coopmat_prefill,
            PrefillKernel::Flash => prefill::flash_layout_of(&self.ctx).is_ok_and(|l| l.is_some()),
        }
    }

    /// Where this device's 16 x 16 f32 cooperative-matrix accumulators keep their elements:
    /// `(row, column)` of element `e` of lane `L` at index `8 L + e` (measured once on the
    /// device); `None` without NV cooperative matrices, 32-lane subgroups or 8 elements a
    /// lane. [`PrefillKernel::Flash`] runs when this layout suits it.
    pub fn coopmat_layout(&self) -> Result<Option<Vec<(u32, u32)>>> {
        prefill::coopmat_layout(&self.ctx)
    }

    /// Settings of the [`PrefillKernel::Flash`] kernel for later calls.
    pub fn set_prefill_flash(&self, cfg: FlashConfig) {
        self.ctx
            .flash_cfg
            .store(cfg.pack(), std::sync::atomic::Ordering::Relaxed);
    }

    /// `true` makes decode use its shared-memory reduction variant (what devices without
    /// subgroup shuffles run) even where lane teams are available; tests cover both.
    pub fn set_decode_without_subgroups(&self, on: bool) {
        self.ctx
            .decode_no_subgroups
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long each submit polls its fence before it blocks (default: `FOXEDGE_VULKAN_SPIN_US`,
    /// else 1 ms on a GPU and none on a CPU device). Polling keeps the calling thread running
    /// through a short wait; on the H100 host a resident decode step took 15-19% less time
    /// with 1 ms than with none. Returns the previous setting.
    pub fn set_spin_wait(&self, d: std::time::Duration) -> std::time::Duration {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        std::time::Duration::from_nanos(
            self.ctx
                .spin_wait_ns
                .swap(ns, std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Caps the bytes one buffer binding may hold (never above the device's
    /// `maxStorageBufferRange` / `maxMemoryAllocationSize`): larger tensors are split into
    /// more dispatches. Returns the cap in force.
    pub fn set_binding_limit(&self, bytes: u64) -> u64 {
        let dev = self
            .ctx
            .info
            .max_storage_buffer_range
            .min(self.ctx.info.max_allocation);
        let v = bytes.clamp(1, dev);
        self.ctx
            .binding_limit
            .store(v, std::sync::atomic::Ordering::Relaxed);
        v
    }

    /// Forgetting-attention prefill: same arguments, results (within the storage dtype's
    /// tolerance) and statistics as `foxedge_cpu::prefill`.
    ///
    /// `out`: `shape.q_len()` elements in `shape.layout`; `lse`: `[batch, heads_q, seq_q]`
    /// natural-log normalisers (`-inf` for padded rows, whose output is 0).
    pub fn prefill<T: Storage, O: Storage>(
        &self,
        args: &PrefillArgs<'_, T>,
        opts: &PrefillOptions<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<AttentionStats> {
        self.prefill_stored(args, opts, out, lse, false)
    }

    /// [`Vulkan::prefill`] with q, k, v stored on the device as f16 whatever `T` is (where
    /// the device has 16-bit storage; else as `prefill`), rounded to nearest even while
    /// they are packed: f32 callers reach the tensor-core kernels without converting their
    /// tensors first. Error: about 2^-11 relative per input element.
    pub fn prefill_f16_storage<T: Storage, O: Storage>(
        &self,
        args: &PrefillArgs<'_, T>,
        opts: &PrefillOptions<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<AttentionStats> {
        self.prefill_stored(args, opts, out, lse, true)
    }

    fn prefill_stored<T: Storage, O: Storage>(
        &self,
        args: &PrefillArgs<'_, T>,
        opts: &PrefillOptions<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
        half: bool,
    ) -> Result<AttentionStats> {
        let sh = &args.shape;
        sh.validate()?;
        if out.len() != sh.q_len() {
            return Err(foxedge_core::Error::BadLength {
                what: "out",
                expected: sh.q_len(),
                got: out.len(),
            }
            .into());
        }
        let p = prefill::prepare(&self.ctx, &self.prefill_pool, args, opts, half, &mut || {})?;
        let kernel = p.run(1)?;
        let (download, unpack) = p.read_timed(out, lse)?;
        profile_line::<O>(&p, T::DTYPE, kernel, download, unpack);
        Ok(p.stats().clone())
    }

    /// A prefill run up to its output, which [`PrefillRun::finish`] writes: decisions,
    /// packing, upload, kernels and download happen here, the unpacking there. With
    /// [`PrefillOptions::heads`], `finish` writes only those heads' rows, so another
    /// backend may compute the other heads into the same output meanwhile. `on_packed`
    /// runs once the inputs are packed into staging memory, when the call stops needing
    /// the host's cores until `finish` (it then waits on the device): the moment for a
    /// caller to start CPU work of its own (it does not run if the call fails before).
    /// `f16_storage`: as [`Vulkan::prefill_f16_storage`].
    pub fn prefill_run<T: Storage>(
        &self,
        args: &PrefillArgs<'_, T>,
        opts: &PrefillOptions<'_>,
        f16_storage: bool,
        on_packed: &mut dyn FnMut(),
    ) -> Result<PrefillRun> {
        let p = prefill::prepare(
            &self.ctx,
            &self.prefill_pool,
            args,
            opts,
            f16_storage,
            on_packed,
        )?;
        let kernel = p.run(1)?;
        let download = p.download(false)?;
        Ok(PrefillRun {
            p,
            kernel,
            download,
            input: T::DTYPE,
        })
    }

    /// Frees the device and staging buffers that prefill calls keep for reuse (they grow
    /// to fit each call, and shrink back only after many smaller calls: see
    /// [`Vulkan::prefill_buffer_bytes`]); later calls allocate them again.
    /// A prefill call alive at the time keeps its buffers until it is dropped.
    pub fn release_prefill_buffers(&self) {
        self.prefill_pool.release();
    }

    /// Bytes of the buffers prefill calls keep for reuse (0 while a call holds them). They
    /// grow to fit each call; a buffer more than 4x what 64 calls in a row needed is
    /// allocated again at their size, and one no call used for 64 calls is freed.
    pub fn prefill_buffer_bytes(&self) -> u64 {
        self.prefill_pool.bytes()
    }

    /// Uploads a prefill call and decides its blocks, without running it (benchmarks run
    /// it many times on device-resident inputs). While it lives it holds this device's
    /// reusable prefill buffers; prefill calls made meanwhile allocate their own.
    pub fn prepare_prefill<T: Storage>(
        &self,
        args: &PrefillArgs<'_, T>,
        opts: &PrefillOptions<'_>,
    ) -> Result<PreparedPrefill> {
        prefill::prepare(&self.ctx, &self.prefill_pool, args, opts, false, &mut || {})
    }

    /// One decode step: same arguments, results and statistics as `foxedge_cpu::decode`.
    /// `out`: `[heads, n_queries, head_dim]`; `lse`: `[heads, n_queries]`.
    pub fn decode<Q: Storage, T: Storage, O: Storage>(
        &self,
        args: &DecodeArgs<'_, Q, T>,
        opts: &DecodeOptions<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<AttentionStats> {
        let p = self.prepare_decode(args, opts)?;
        p.run(1)?;
        p.read(out, lse)?;
        Ok(p.stats().clone())
    }

    /// Uploads a decode step without running it.
    pub fn prepare_decode<Q: Storage, T: Storage>(
        &self,
        args: &DecodeArgs<'_, Q, T>,
        opts: &DecodeOptions<'_>,
    ) -> Result<PreparedDecode> {
        decode::prepare(&self.ctx, &self.decode_tuning(), args, opts)
    }

    /// Sets the decode kernel's launch shape for later calls (and caches made after).
    pub fn set_decode_tuning(&self, t: DecodeTuning) {
        if let Ok(mut g) = self.decode_tuning.lock() {
            *g = t;
        }
    }

    /// The decode kernel's launch shape in force.
    pub fn decode_tuning(&self) -> DecodeTuning {
        self.decode_tuning.lock().map(|g| *g).unwrap_or_default()
    }

    /// Uploads a model's weights to this device (see [`model`]).
    ///
    /// Errors: tensors that do not match `shape` ([`Error::Input`]), a model over the
    /// budget ([`Error::DoesNotFit`]), a device without what the model's kernels need
    /// ([`Error::Unsupported`]), device failures.
    pub fn load_model(
        &self,
        shape: model::ModelShape,
        weights: &model::ModelWeights<'_>,
        opts: model::ModelOptions,
    ) -> Result<model::DeviceModel> {
        model::DeviceModel::upload(&self.ctx, shape, weights, opts)
    }

    /// Device memory bandwidth in bytes per second: `reps` copies of a `bytes`-byte buffer
    /// (each reads and writes `bytes`), timed with GPU timestamps where the queue has them.
    pub fn copy_bandwidth(&self, bytes: u64, reps: u32) -> Result<f64> {
        probe::copy_bandwidth(&self.ctx, bytes, reps)
    }

    /// Bytes per second a compute shader reads streaming a buffer of about `bytes` bytes
    /// (capped at the storage binding range), `reps` timed passes: the denominator of
    /// decode's bandwidth bound.
    pub fn read_bandwidth(&self, bytes: u64, reps: u32) -> Result<f64> {
        probe::read_bandwidth(&self.ctx, bytes, reps)
    }

    /// A device-resident decode cache on this device (see [`ResidentCache`]).
    pub fn resident_cache(&self, opts: ResidentOptions) -> ResidentCache {
        ResidentCache::new(self.ctx.clone(), self.decode_tuning(), opts)
    }
}
