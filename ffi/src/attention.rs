//! `fx_attention_forward`: one forgetting-attention prefill call on caller memory, and
//! `fx_acp_threshold`.

use std::ffi::c_void;
use std::mem::size_of;

use foxedge_core::{AttentionShape, Layout};
use half::{bf16, f16};

use crate::abi::{Versioned, check_buf, check_out, checked_product, read_req, write_out};
use crate::status::{
    FxResult, fail, fx_status, fx_status::*, guard, guard_value, invalid, map_core,
};

/// Memory layout of q, k, v, out and the log gates (see `fx_attention_desc`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_layout {
    /// q/out `[batch, seq_q, heads_q, head_dim]`, k/v `[batch, seq_k, heads_kv, head_dim]`,
    /// log gates `[batch, seq_k, heads_q]` (the reference default).
    FX_LAYOUT_SEQ_FIRST = 0,
    /// q/out `[batch, heads_q, seq_q, head_dim]`, k/v `[batch, heads_kv, seq_k, head_dim]`,
    /// log gates `[batch, heads_q, seq_k]`.
    FX_LAYOUT_HEAD_FIRST = 1,
}
/// The `int32_t` C passes where the header says `fx_layout`.
pub type fx_layout_raw = i32;

/// Storage type of q, k, v and out. Compute and accumulation are always f32.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_dtype {
    /// IEEE binary32 (`float`).
    FX_DTYPE_F32 = 0,
    /// IEEE binary16, stored as `uint16_t` bits.
    FX_DTYPE_F16 = 1,
    /// bfloat16 (the top 16 bits of a binary32), stored as `uint16_t` bits.
    FX_DTYPE_BF16 = 2,
}
/// The `int32_t` C passes where the header says `fx_dtype`.
pub type fx_dtype_raw = i32;

/// Where attention runs.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_backend {
    /// The SIMD CPU kernels (always available).
    FX_BACKEND_CPU = 0,
    /// Vulkan compute.
    FX_BACKEND_VULKAN = 1,
    /// Picked by the library (falls back to the CPU).
    FX_BACKEND_AUTO = 2,
    /// Heavy heads on the GPU, light heads on the CPU.
    FX_BACKEND_HYBRID = 3,
}
/// The `int32_t` C passes where the header says `fx_backend`.
pub type fx_backend_raw = i32;

/// How `fx_attention_forward` prunes with ACP (ACP paper, section 3).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_acp_mode {
    /// Dense: every causal key is attended.
    FX_ACP_OFF = 0,
    /// `acp_values` holds a ready threshold delta (nats, <= 0) per (batch, query head),
    /// index `b * heads_q + h`; `-INFINITY` disables pruning for that head.
    FX_ACP_THRESHOLD = 1,
    /// `acp_values` holds a logit bound `U >= max |s q.k|` per query head (`heads_q` values)
    /// or per (batch, query head) (`batch * heads_q`); with `log_eps` the library derives
    /// `delta = -2U - ln N + log_eps`.
    FX_ACP_BOUND = 2,
    /// U from the max norms of this call's q and k (valid for this call only) and `log_eps`.
    FX_ACP_OBSERVED_NORMS = 3,
}
/// The `int32_t` C passes where the header says `fx_acp_mode`.
pub type fx_acp_mode_raw = i32;

/// Describes one prefill call. Create with `fx_attention_desc_default()`, then set the sizes.
///
/// The queries are the last `seq_q` of `seq_k` positions (causal). Buffer sizes in
/// elements: q and out `batch*heads_q*seq_q*head_dim`, k and v
/// `batch*heads_kv*seq_k*head_dim`, log_fgate `batch*heads_q*seq_k` (f32, finite, <= 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_attention_desc {
    /// `sizeof(fx_attention_desc)`.
    pub struct_size: usize,
    pub batch: usize,
    /// Query heads; a multiple of `heads_kv` (grouped-query attention).
    pub heads_q: usize,
    pub heads_kv: usize,
    /// Query positions (tokens), `<= seq_k`.
    pub seq_q: usize,
    /// Key positions (tokens).
    pub seq_k: usize,
    /// Channels per head, a multiple of 8.
    pub head_dim: usize,
    pub layout: fx_layout_raw,
    /// Storage type of q, k and v.
    pub dtype: fx_dtype_raw,
    /// Storage type of out.
    pub out_dtype: fx_dtype_raw,
    /// FX_BACKEND_CPU or FX_BACKEND_AUTO: the SIMD CPU kernels. FX_BACKEND_VULKAN: the Vulkan
    /// kernels (FX_ERR_BACKEND_UNAVAILABLE in a build without them or with no device).
    /// FX_BACKEND_HYBRID schedules whole sessions only: FX_ERR_BACKEND_UNAVAILABLE here.
    pub backend: fx_backend_raw,
    /// Logit scale s; 0 means `1/sqrt(head_dim)`.
    pub sm_scale: f32,
    /// `ln eps` (nats, < 0) for `FX_ACP_BOUND` and `FX_ACP_OBSERVED_NORMS`; default -10.
    pub log_eps: f32,
    pub acp_mode: fx_acp_mode_raw,
    /// Values for `FX_ACP_THRESHOLD` / `FX_ACP_BOUND` (see `fx_acp_mode`), else NULL.
    pub acp_values: *const f64,
    pub acp_values_len: usize,
    /// Left padding: NULL, or `batch` values; row b never attends keys `< seq_start[b]`,
    /// and query rows before it output zeros.
    pub seq_start: *const usize,
    /// Optional output (NULL = not wanted): `ln sum_j exp(s q_i.k_j + D_ij)` per row,
    /// `[batch, heads_q, seq_q]` floats.
    pub lse_out: *mut f32,
    /// Query and key tile sizes (tokens, > 0); also the ACP granularity. Default 64.
    pub block_q: usize,
    pub block_k: usize,
}

/// Work done by one query head of one batch row.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct fx_head_stats {
    /// Query-key pairs computed, and attendable (causal, after left padding).
    pub kept_pairs: u64,
    pub total_pairs: u64,
    /// Tiles computed, and tiles that hold an attendable pair.
    pub kept_blocks: u64,
    pub total_blocks: u64,
    /// The ACP threshold applied (nats); NaN when ACP was off.
    pub delta: f64,
}

/// Statistics of one `fx_attention_forward` call. Set `struct_size`; set `heads` to an
/// array of `batch * heads_q` entries to get per-head figures (index `b * heads_q + h`), or
/// NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_attention_stats {
    /// `sizeof(fx_attention_stats)`.
    pub struct_size: usize,
    /// Sums over all heads.
    pub kept_pairs: u64,
    pub total_pairs: u64,
    pub kept_blocks: u64,
    pub total_blocks: u64,
    /// FLOPs done: `4 * head_dim * kept_pairs` (QK^T and PV, multiply-add = 2).
    pub flops: f64,
    /// Input: NULL or an array of `heads_len` entries to fill.
    pub heads: *mut fx_head_stats,
    /// Input: `batch * heads_q` when `heads` is set.
    pub heads_len: usize,
}

// SAFETY: repr(C), first field usize, fields are integers, floats and raw pointers only.
unsafe impl Versioned for fx_attention_desc {
    const NAME: &'static str = "fx_attention_desc";
    fn default_value() -> Self {
        fx_attention_desc_default()
    }
}

// SAFETY: repr(C), first field usize, fields are integers, floats and raw pointers only.
unsafe impl Versioned for fx_attention_stats {
    const NAME: &'static str = "fx_attention_stats";
    fn default_value() -> Self {
        fx_attention_stats_default()
    }
}

/// Returns a descriptor with `struct_size` set, every size 0 (to be filled in), seq-first
/// f32 layout, the CPU backend, the default scale, ACP off with `log_eps = -10`, no left
/// padding and 64x64 tiles.
#[unsafe(no_mangle)]
pub extern "C" fn fx_attention_desc_default() -> fx_attention_desc {
    fx_attention_desc {
        struct_size: size_of::<fx_attention_desc>(),
        batch: 0,
        heads_q: 0,
        heads_kv: 0,
        seq_q: 0,
        seq_k: 0,
        head_dim: 0,
        layout: fx_layout::FX_LAYOUT_SEQ_FIRST as i32,
        dtype: fx_dtype::FX_DTYPE_F32 as i32,
        out_dtype: fx_dtype::FX_DTYPE_F32 as i32,
        backend: fx_backend::FX_BACKEND_CPU as i32,
        sm_scale: 0.0,
        log_eps: foxedge_core::threshold::DEFAULT_LN_EPS as f32,
        acp_mode: fx_acp_mode::FX_ACP_OFF as i32,
        acp_values: std::ptr::null(),
        acp_values_len: 0,
        seq_start: std::ptr::null(),
        lse_out: std::ptr::null_mut(),
        block_q: 64,
        block_k: 64,
    }
}

/// Returns an `fx_attention_stats` with `struct_size` set, zero counters and no per-head
/// array.
#[unsafe(no_mangle)]
pub extern "C" fn fx_attention_stats_default() -> fx_attention_stats {
    fx_attention_stats {
        struct_size: size_of::<fx_attention_stats>(),
        kept_pairs: 0,
        total_pairs: 0,
        kept_blocks: 0,
        total_blocks: 0,
        flops: 0.0,
        heads: std::ptr::null_mut(),
        heads_len: 0,
    }
}

/// The ACP threshold `delta = -2U - ln(seq_len) + log_eps` in nats (ACP paper, appendix A):
/// with `U >= max |s q.k|`, every pruned weight is below `eps / seq_len` and the pruned
/// weights of a row sum below eps. Returns NaN and sets `fx_last_error` when
/// `logit_bound` is NaN, infinite or negative, `seq_len` is 0, or `log_eps` is NaN or > 0.
#[unsafe(no_mangle)]
pub extern "C" fn fx_acp_threshold(logit_bound: f32, seq_len: u64, log_eps: f32) -> f32 {
    guard_value(f32::NAN, || {
        let n = usize::try_from(seq_len)
            .map_err(|_| invalid(format!("seq_len {seq_len} does not fit in size_t")))?;
        let delta =
            foxedge_core::threshold::threshold(f64::from(logit_bound), n, f64::from(log_eps))
                .map_err(map_core)?;
        Ok(delta as f32)
    })
}

fn layout_of(raw: i32) -> FxResult<Layout> {
    match raw {
        0 => Ok(Layout::SeqFirst),
        1 => Ok(Layout::HeadFirst),
        _ => Err(invalid(format!(
            "fx_attention_desc.layout {raw} is not an fx_layout"
        ))),
    }
}

fn dtype_of(raw: i32, field: &str) -> FxResult<fx_dtype> {
    match raw {
        0 => Ok(fx_dtype::FX_DTYPE_F32),
        1 => Ok(fx_dtype::FX_DTYPE_F16),
        2 => Ok(fx_dtype::FX_DTYPE_BF16),
        _ => Err(invalid(format!(
            "fx_attention_desc.{field} {raw} is not an fx_dtype"
        ))),
    }
}

/// Checks the backend enum; only the CPU kernels can run a standalone attention call here.
pub(crate) fn backend_of(raw: i32) -> FxResult<facade::BackendKind> {
    match raw {
        0 => Ok(facade::BackendKind::Cpu),
        1 => Ok(facade::BackendKind::Vulkan),
        2 => Ok(facade::BackendKind::Auto),
        3 => Ok(facade::BackendKind::Hybrid),
        _ => Err(invalid(format!("backend {raw} is not an fx_backend"))),
    }
}

/// A caller byte range `[start, start + len)`, for the aliasing check.
#[derive(Clone, Copy)]
struct Span {
    what: &'static str,
    start: usize,
    len: usize,
}

impl Span {
    fn of<T>(what: &'static str, p: *const T, elems: usize) -> Span {
        Span {
            what,
            start: p as usize,
            len: elems * size_of::<T>(),
        }
    }
    fn overlaps(&self, o: &Span) -> bool {
        self.len > 0 && o.len > 0 && self.start < o.start + o.len && o.start < self.start + self.len
    }
}

/// Validates a raw buffer and its byte length; returns the element count.
fn buffer<T>(what: &str, p: *const T, elems: usize) -> FxResult<usize> {
    check_buf(p, what)?;
    let bytes = checked_product(what, &[elems, size_of::<T>()])?;
    if bytes > isize::MAX as usize || (p as usize).checked_add(bytes).is_none() {
        return Err(invalid(format!(
            "{what}: {bytes} bytes cannot be addressed"
        )));
    }
    Ok(elems)
}

/// The kernels a standalone attention call runs on (`FX_BACKEND_AUTO` means the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Cpu,
    #[cfg(feature = "vulkan")]
    Vulkan,
}

/// Everything `fx_attention_forward` checked, ready for the kernel.
struct Call {
    shape: AttentionShape,
    backend: Target,
    dtype: fx_dtype,
    out_dtype: fx_dtype,
    sm_scale: Option<f32>,
    acp_mode: fx_acp_mode,
    log_eps: f64,
    block_q: usize,
    block_k: usize,
}

fn check_desc(d: &fx_attention_desc) -> FxResult<Call> {
    let shape = AttentionShape {
        batch: d.batch,
        heads_q: d.heads_q,
        heads_kv: d.heads_kv,
        seq_q: d.seq_q,
        seq_k: d.seq_k,
        head_dim: d.head_dim,
        layout: layout_of(d.layout)?,
    };
    shape.validate().map_err(map_core)?;
    let dtype = dtype_of(d.dtype, "dtype")?;
    let out_dtype = dtype_of(d.out_dtype, "out_dtype")?;
    let backend = match backend_of(d.backend)? {
        facade::BackendKind::Cpu | facade::BackendKind::Auto => Target::Cpu,
        #[cfg(feature = "vulkan")]
        facade::BackendKind::Vulkan => Target::Vulkan,
        #[cfg(not(feature = "vulkan"))]
        facade::BackendKind::Vulkan => {
            return Err(fail(
                FX_ERR_BACKEND_UNAVAILABLE,
                "vulkan: this build of foxedge has no Vulkan backend (cargo feature `vulkan`)",
            ));
        }
        facade::BackendKind::Hybrid => {
            return Err(fail(
                FX_ERR_BACKEND_UNAVAILABLE,
                "hybrid: runs inside sessions (fx_session_options.backend), not for a single \
                 fx_attention_forward call",
            ));
        }
    };
    if !d.sm_scale.is_finite() || d.sm_scale < 0.0 {
        return Err(invalid(format!(
            "fx_attention_desc.sm_scale {} must be finite and >= 0 (0 = 1/sqrt(head_dim))",
            d.sm_scale
        )));
    }
    let acp_mode = match d.acp_mode {
        0 => fx_acp_mode::FX_ACP_OFF,
        1 => fx_acp_mode::FX_ACP_THRESHOLD,
        2 => fx_acp_mode::FX_ACP_BOUND,
        3 => fx_acp_mode::FX_ACP_OBSERVED_NORMS,
        raw => {
            return Err(invalid(format!(
                "fx_attention_desc.acp_mode {raw} is not an fx_acp_mode"
            )));
        }
    };
    Ok(Call {
        shape,
        backend,
        dtype,
        out_dtype,
        sm_scale: (d.sm_scale > 0.0).then_some(d.sm_scale),
        acp_mode,
        log_eps: f64::from(d.log_eps),
        block_q: d.block_q,
        block_k: d.block_k,
    })
}

/// Reinterprets caller memory as a slice of `len` elements.
///
/// # Safety
/// `p` was checked by [`buffer`] (non-null, aligned, addressable) and the caller promised
/// `len` initialised elements there that nothing writes during the call.
unsafe fn slice<'a, T>(p: *const T, len: usize) -> &'a [T] {
    // SAFETY: see the function contract.
    unsafe { std::slice::from_raw_parts(p, len) }
}

/// Generates `$name::<T, O>(call, desc, q, k, v, log_fgate, out)`: one prefill with storage
/// `T` and output `O` on the kernels of crate `$krate` (foxedge-cpu and foxedge-vulkan share
/// the argument types' shape), returning per-head figures in `fx_head_stats` form.
///
/// Safety of the generated function: the pointers were checked by [`buffer`] with the
/// lengths in `call.shape`, no output overlaps another buffer (checked), and the C caller
/// owns that memory for the duration of the call.
macro_rules! prefill_on {
    ($name:ident, $krate:ident, $run:ident) => {
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<T: $krate::Storage, O: $krate::Storage>(
            call: &Call,
            d: &fx_attention_desc,
            q: *const c_void,
            k: *const c_void,
            v: *const c_void,
            log_fgate: *const f32,
            out: *mut c_void,
        ) -> FxResult<Vec<fx_head_stats>> {
            let sh = call.shape;
            // SAFETY: checked by the caller (see the macro's safety note), per buffer.
            let (q, k, v, g) = unsafe {
                (
                    slice(q.cast::<T>(), sh.q_len()),
                    slice(k.cast::<T>(), sh.kv_len()),
                    slice(v.cast::<T>(), sh.kv_len()),
                    slice(log_fgate, sh.gate_len()),
                )
            };
            let seq_start = if d.seq_start.is_null() {
                None
            } else {
                // SAFETY: checked by `buffer` with `batch` elements.
                Some(unsafe { slice(d.seq_start, sh.batch) })
            };
            let values = if d.acp_values.is_null() {
                &[][..]
            } else {
                // SAFETY: checked by `buffer` with `acp_values_len` elements.
                unsafe { slice(d.acp_values, d.acp_values_len) }
            };
            let acp = match call.acp_mode {
                fx_acp_mode::FX_ACP_OFF => $krate::Acp::Off,
                fx_acp_mode::FX_ACP_THRESHOLD => $krate::Acp::Threshold(values),
                fx_acp_mode::FX_ACP_BOUND => $krate::Acp::Bound {
                    u: values,
                    ln_eps: call.log_eps,
                },
                fx_acp_mode::FX_ACP_OBSERVED_NORMS => $krate::Acp::ObservedNorms {
                    ln_eps: call.log_eps,
                },
            };
            // SAFETY: `out` was checked by `buffer` for q_len elements of O and overlaps no
            // other buffer; no other reference to it exists during the call.
            let out = unsafe { std::slice::from_raw_parts_mut(out.cast::<O>(), sh.q_len()) };
            let lse = if d.lse_out.is_null() {
                None
            } else {
                let n = sh.batch * sh.heads_q * sh.seq_q;
                // SAFETY: checked by `buffer` for n floats, no overlap.
                Some(unsafe { std::slice::from_raw_parts_mut(d.lse_out, n) })
            };
            let args = $krate::PrefillArgs {
                shape: sh,
                q,
                k,
                v,
                log_fgate: g,
                seq_start,
            };
            let opts = $krate::PrefillOptions {
                sm_scale: call.sm_scale,
                acp,
                block_q: call.block_q,
                block_k: call.block_k,
                heads: None,
            };
            let stats = $run(&args, &opts, out, lse)?;
            Ok(stats
                .heads
                .iter()
                .map(|h| fx_head_stats {
                    kept_pairs: h.kept_pairs,
                    total_pairs: h.total_pairs,
                    kept_blocks: h.kept_blocks,
                    total_blocks: h.total_blocks,
                    delta: h.delta.unwrap_or(f64::NAN),
                })
                .collect())
        }
    };
}

/// foxedge-cpu's prefill with its errors mapped.
fn cpu_prefill<T: foxedge_cpu::Storage, O: foxedge_cpu::Storage>(
    args: &foxedge_cpu::PrefillArgs<'_, T>,
    opts: &foxedge_cpu::PrefillOptions<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> FxResult<foxedge_cpu::AttentionStats> {
    foxedge_cpu::prefill(args, opts, out, lse).map_err(map_core)
}

/// foxedge-vulkan's prefill on the process-wide device, with its errors mapped.
#[cfg(feature = "vulkan")]
fn vulkan_prefill<T: foxedge_vulkan::Storage, O: foxedge_vulkan::Storage>(
    args: &foxedge_vulkan::PrefillArgs<'_, T>,
    opts: &foxedge_vulkan::PrefillOptions<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) -> FxResult<foxedge_vulkan::AttentionStats> {
    vulkan_device()?
        .prefill(args, opts, out, lse)
        .map_err(map_vulkan)
}

prefill_on!(run_cpu, foxedge_cpu, cpu_prefill);
#[cfg(feature = "vulkan")]
prefill_on!(run_vulkan, foxedge_vulkan, vulkan_prefill);

/// The process-wide Vulkan device for `fx_attention_forward`, opened on first use
/// (`FOXEDGE_VULKAN_DEVICE` picks one). A failure to open is remembered.
#[cfg(feature = "vulkan")]
fn vulkan_device() -> FxResult<&'static foxedge_vulkan::Vulkan> {
    static DEVICE: std::sync::OnceLock<Result<foxedge_vulkan::Vulkan, crate::status::Failure>> =
        std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| foxedge_vulkan::Vulkan::new().map_err(map_vulkan))
        .as_ref()
        .map_err(Clone::clone)
}

/// Maps a Vulkan backend error to a status and message.
#[cfg(feature = "vulkan")]
fn map_vulkan(e: foxedge_vulkan::Error) -> crate::status::Failure {
    use foxedge_vulkan::Error as E;
    match e {
        E::Input(c) => map_core(c),
        E::NoLoader(_)
        | E::NoInstance(_)
        | E::NoDevice
        | E::DeviceNotFound { .. }
        | E::DeviceLost
        | E::Vulkan(_) => fail(FX_ERR_BACKEND_UNAVAILABLE, format!("vulkan: {e}")),
        E::OutOfDeviceMemory | E::DoesNotFit { .. } => {
            fail(FX_ERR_OUT_OF_MEMORY, format!("vulkan: {e}"))
        }
        E::Unsupported(_) => fail(FX_ERR_UNSUPPORTED, format!("vulkan: {e}")),
    }
}

/// Calls `$f::<T, O>(args...)` for the storage and output types of `call`.
macro_rules! by_dtype {
    ($f:ident, $call:expr, $($arg:expr),*) => {{
        use fx_dtype::*;
        match ($call.dtype, $call.out_dtype) {
            (FX_DTYPE_F32, FX_DTYPE_F32) => $f::<f32, f32>($call, $($arg),*),
            (FX_DTYPE_F32, FX_DTYPE_F16) => $f::<f32, f16>($call, $($arg),*),
            (FX_DTYPE_F32, FX_DTYPE_BF16) => $f::<f32, bf16>($call, $($arg),*),
            (FX_DTYPE_F16, FX_DTYPE_F32) => $f::<f16, f32>($call, $($arg),*),
            (FX_DTYPE_F16, FX_DTYPE_F16) => $f::<f16, f16>($call, $($arg),*),
            (FX_DTYPE_F16, FX_DTYPE_BF16) => $f::<f16, bf16>($call, $($arg),*),
            (FX_DTYPE_BF16, FX_DTYPE_F32) => $f::<bf16, f32>($call, $($arg),*),
            (FX_DTYPE_BF16, FX_DTYPE_F16) => $f::<bf16, f16>($call, $($arg),*),
            (FX_DTYPE_BF16, FX_DTYPE_BF16) => $f::<bf16, bf16>($call, $($arg),*),
        }
    }};
}

/// Forgetting-attention prefill on caller memory (the kernel of the chosen backend):
/// `o_i = sum_j exp(s q_i.k_j + c_i - c_j) v_j / sum_j exp(s q_i.k_j + c_i - c_j)` over
/// causal keys `j <= i` (`c` = prefix sums of `log_fgate`), skipping ACP-pruned tiles.
///
/// `q`, `k`, `v` and `out` hold `desc->dtype` / `desc->out_dtype` elements (see
/// `fx_attention_desc` for sizes); `out` must not overlap an input. `stats` may be NULL.
/// On failure nothing is written to `stats`; `out` may have been partly written only when
/// the failure is FX_ERR_INTERNAL.
///
/// # Safety
/// Every non-NULL pointer must point to memory of the size stated above, valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_attention_forward(
    desc: *const fx_attention_desc,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    log_fgate: *const f32,
    out: *mut c_void,
    stats: *mut fx_attention_stats,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: desc is NULL or a readable fx_attention_desc prefix.
        let d = unsafe { read_req(desc, "desc") }?;
        let call = check_desc(&d)?;
        let stats_size = if stats.is_null() {
            None
        } else {
            // SAFETY: C contract: stats is a writable fx_attention_stats.
            Some(unsafe { check_out(stats, "stats") }?)
        };
        let stats_in = match stats_size {
            // SAFETY: check_out validated its struct_size; readable per the C contract.
            Some(_) => unsafe { crate::abi::read_opt(stats as *const fx_attention_stats) }?,
            None => None,
        };
        let sh = call.shape;
        let mut spans = Vec::with_capacity(8);
        macro_rules! typed {
            ($dt:expr, $p:expr, $what:literal, $n:expr) => {
                match $dt {
                    fx_dtype::FX_DTYPE_F32 => {
                        let p = $p.cast::<f32>();
                        spans.push(Span::of($what, p, buffer($what, p, $n)?));
                    }
                    _ => {
                        let p = $p.cast::<u16>();
                        spans.push(Span::of($what, p, buffer($what, p, $n)?));
                    }
                }
            };
        }
        typed!(call.dtype, q, "q", sh.q_len());
        typed!(call.dtype, k, "k", sh.kv_len());
        typed!(call.dtype, v, "v", sh.kv_len());
        spans.push(Span::of(
            "log_fgate",
            log_fgate,
            buffer("log_fgate", log_fgate, sh.gate_len())?,
        ));
        if !d.seq_start.is_null() {
            spans.push(Span::of(
                "seq_start",
                d.seq_start,
                buffer("seq_start", d.seq_start, sh.batch)?,
            ));
        }
        match call.acp_mode {
            fx_acp_mode::FX_ACP_THRESHOLD | fx_acp_mode::FX_ACP_BOUND => {
                if d.acp_values.is_null() {
                    return Err(fail(
                        FX_ERR_NULL_POINTER,
                        "acp_values is NULL but acp_mode needs values",
                    ));
                }
                spans.push(Span::of(
                    "acp_values",
                    d.acp_values,
                    buffer("acp_values", d.acp_values, d.acp_values_len)?,
                ));
            }
            _ => {}
        }
        let heads_out = match stats_in {
            Some(s) if !s.heads.is_null() => {
                let n = checked_product("stats heads", &[sh.batch, sh.heads_q])?;
                if s.heads_len != n {
                    return Err(invalid(format!(
                        "stats->heads_len is {}; expected batch * heads_q = {n}",
                        s.heads_len
                    )));
                }
                buffer("stats->heads", s.heads, n)?;
                Some((s.heads, n))
            }
            _ => None,
        };
        let mut outs = Vec::with_capacity(2);
        match call.out_dtype {
            fx_dtype::FX_DTYPE_F32 => {
                let p = out.cast::<f32>();
                outs.push(Span::of(
                    "out",
                    p.cast_const(),
                    buffer("out", p, sh.q_len())?,
                ));
            }
            _ => {
                let p = out.cast::<u16>();
                outs.push(Span::of(
                    "out",
                    p.cast_const(),
                    buffer("out", p, sh.q_len())?,
                ));
            }
        }
        if !d.lse_out.is_null() {
            let n = sh.batch * sh.heads_q * sh.seq_q;
            outs.push(Span::of(
                "lse_out",
                d.lse_out.cast_const(),
                buffer("lse_out", d.lse_out, n)?,
            ));
        }
        if let Some((p, n)) = heads_out {
            outs.push(Span::of("stats->heads", p.cast_const(), n));
        }
        if !stats.is_null() {
            outs.push(Span::of("stats", stats.cast_const(), 1));
        }
        for (i, o) in outs.iter().enumerate() {
            for x in spans.iter().chain(&outs[i + 1..]) {
                if o.overlaps(x) {
                    return Err(invalid(format!("{} overlaps {}", o.what, x.what)));
                }
            }
        }
        // SAFETY: every pointer was validated above against its element count and type, and
        // no output overlaps another buffer.
        let heads = unsafe {
            match call.backend {
                Target::Cpu => by_dtype!(run_cpu, &call, &d, q, k, v, log_fgate, out),
                #[cfg(feature = "vulkan")]
                Target::Vulkan => by_dtype!(run_vulkan, &call, &d, q, k, v, log_fgate, out),
            }
        }?;
        if let (Some(size), Some(s_in)) = (stats_size, stats_in) {
            let mut s = s_in;
            s.kept_pairs = heads.iter().map(|h| h.kept_pairs).sum();
            s.total_pairs = heads.iter().map(|h| h.total_pairs).sum();
            s.kept_blocks = heads.iter().map(|h| h.kept_blocks).sum();
            s.total_blocks = heads.iter().map(|h| h.total_blocks).sum();
            s.flops = 4.0 * sh.head_dim as f64 * s.kept_pairs as f64;
            if let Some((p, n)) = heads_out {
                if heads.len() != n {
                    return Err(fail(
                        FX_ERR_INTERNAL,
                        format!("kernel returned {} head stats, expected {n}", heads.len()),
                    ));
                }
                // SAFETY: p was validated for n writable entries, disjoint from the rest.
                unsafe { std::slice::from_raw_parts_mut(p, n) }.copy_from_slice(&heads);
            }
            // SAFETY: size came from check_out on this pointer.
            unsafe { write_out(stats, size, s) };
        }
        Ok(())
    })
}
