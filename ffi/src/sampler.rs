//! The sampler object: `fx_sampler_*`, next-token choice from logits.

use std::mem::size_of;

use facade::{Sampler, SamplerConfig};

use crate::abi::{Versioned, check_buf, read_opt};
use crate::status::{FxResult, fail, fx_status, fx_status::*, guard, invalid, map_facade};

/// A sampler chain with its generator and its window of recent tokens (opaque). One thread
/// at a time.
#[derive(Debug)]
pub struct fx_sampler {
    pub(crate) sampler: Sampler,
}

/// Parameters of `fx_sampler_new`. Create with `fx_sampler_params_default()`. The chain
/// applies, in order: the repetition penalty over the last `repetition_window` tokens,
/// temperature (0 = greedy: the most probable token, lowest id on ties), top-k, top-p
/// (nucleus), min-p, then draws with a generator seeded by `seed`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_sampler_params {
    /// `sizeof(fx_sampler_params)`.
    pub struct_size: usize,
    /// `T >= 0` (finite): probabilities `∝ exp(logit / T)`; 0 = greedy. Default 1.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]: keep the most probable tokens until their mass reaches it;
    /// 1 = off (default).
    pub top_p: f32,
    /// In [0, 1]: keep tokens at least `min_p` times as probable as the most probable one;
    /// 0 = off (default).
    pub min_p: f32,
    /// `θ > 0` (finite): a recent token's logit is divided by θ (multiplied when negative);
    /// 1 = off (default).
    pub repetition_penalty: f32,
    /// Keep the `top_k` most probable tokens; 0 = off (default).
    pub top_k: usize,
    /// How many of the most recent tokens the penalty looks at. Default 64.
    pub repetition_window: usize,
    /// Seed of the generator: equal seeds and inputs give equal choices. Default 0.
    pub seed: u64,
}

// SAFETY: repr(C), first field usize, only integer and float fields.
unsafe impl Versioned for fx_sampler_params {
    const NAME: &'static str = "fx_sampler_params";
    fn default_value() -> Self {
        fx_sampler_params_default()
    }
}

/// Returns the default sampler parameters: temperature 1, no top-k, top-p, min-p or
/// repetition penalty (window 64), seed 0: a draw from `softmax(logits)`.
#[unsafe(no_mangle)]
pub extern "C" fn fx_sampler_params_default() -> fx_sampler_params {
    let d = SamplerConfig::default();
    fx_sampler_params {
        struct_size: size_of::<fx_sampler_params>(),
        temperature: d.temperature,
        top_p: d.top_p,
        min_p: d.min_p,
        repetition_penalty: d.repetition_penalty,
        top_k: d.top_k,
        repetition_window: d.repetition_window,
        seed: d.seed,
    }
}

/// Creates a sampler from `params` (NULL: the defaults). On failure `*out` is set to NULL
/// and the message names the parameter out of range.
///
/// # Safety
/// `params` must be NULL or a readable `struct_size` prefix; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_sampler_new(
    params: *const fx_sampler_params,
    out: *mut *mut fx_sampler,
) -> fx_status {
    guard(|| {
        check_buf(out, "out")?;
        // SAFETY: non-null and aligned (checked); cleared so a failure leaves NULL.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: C contract: params is NULL or a readable fx_sampler_params prefix.
        let p = unsafe { read_opt(params) }?.unwrap_or_else(|| fx_sampler_params_default());
        let config = SamplerConfig {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            repetition_window: p.repetition_window,
            seed: p.seed,
        };
        let sampler = Sampler::new(config).map_err(map_facade)?;
        // SAFETY: checked above.
        unsafe { out.write(Box::into_raw(Box::new(fx_sampler { sampler }))) };
        Ok(())
    })
}

/// The sampler behind a handle, or a NULL-pointer failure.
///
/// # Safety
/// `s` is NULL or a live handle used by this thread only.
pub(crate) unsafe fn sampler_mut<'a>(s: *mut fx_sampler) -> FxResult<&'a mut fx_sampler> {
    // SAFETY: forwarded C contract.
    unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "sampler is NULL"))
}

/// Token ids from C, each checked to be non-negative.
///
/// # Safety
/// `tokens` is NULL or holds `n` readable values.
pub(crate) unsafe fn token_ids(tokens: *const i32, n: usize, what: &str) -> FxResult<Vec<u32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    check_buf(tokens, what)?;
    if n > isize::MAX as usize / size_of::<i32>() {
        return Err(invalid(format!("{n} {what} cannot be addressed")));
    }
    // SAFETY: non-null and aligned (checked); C contract: n readable int32 values.
    let raw = unsafe { std::slice::from_raw_parts(tokens, n) };
    let mut ids = Vec::new();
    ids.try_reserve_exact(n)
        .map_err(|_| fail(FX_ERR_OUT_OF_MEMORY, format!("{n} {what}")))?;
    for (i, &t) in raw.iter().enumerate() {
        let id = u32::try_from(t)
            .map_err(|_| invalid(format!("{what}[{i}] is {t}: token ids are >= 0")))?;
        ids.push(id);
    }
    Ok(ids)
}

/// Chooses the next token from `logits` (`n` floats, one per token id: a model's
/// `vocab_size`) and records it in the repetition window. A failed call changes nothing.
///
/// Errors: FX_ERR_INVALID_ARGUMENT for n = 0, a NaN or infinite logit, or a recent token
/// (from `fx_sampler_accept` or an earlier call) that is not below `n`.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `logits` must
/// hold `n` floats; `token_out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_sampler_sample(
    s: *mut fx_sampler,
    logits: *const f32,
    n: usize,
    token_out: *mut i32,
) -> fx_status {
    guard(|| {
        // SAFETY: forwarded C contract.
        let s = unsafe { sampler_mut(s) }?;
        check_buf(logits, "logits")?;
        check_buf(token_out, "token_out")?;
        if n == 0 {
            return Err(invalid("n is 0: logits need at least one token"));
        }
        if n > i32::MAX as usize {
            return Err(invalid(format!(
                "n = {n} logits: token ids must fit in int32_t"
            )));
        }
        // SAFETY: non-null and aligned (checked); C contract: n readable floats.
        let x = unsafe { std::slice::from_raw_parts(logits, n) };
        let id = s.sampler.sample(x).map_err(map_facade)?;
        let id = i32::try_from(id).map_err(|_| fail(FX_ERR_INTERNAL, "token id overflow"))?;
        // SAFETY: non-null and aligned (checked); C contract: writable.
        unsafe { token_out.write(id) };
        Ok(())
    })
}

/// Records `n` tokens of context (a prompt, or tokens chosen elsewhere) in the sampler's
/// repetition window; `tokens` may be NULL when n = 0. A failed call changes nothing.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `tokens` must
/// hold `n` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_sampler_accept(
    s: *mut fx_sampler,
    tokens: *const i32,
    n: usize,
) -> fx_status {
    guard(|| {
        // SAFETY: forwarded C contract.
        let s = unsafe { sampler_mut(s) }?;
        // SAFETY: forwarded C contract.
        let ids = unsafe { token_ids(tokens, n, "tokens") }?;
        s.sampler.accept(&ids);
        Ok(())
    })
}

/// Forgets the recent tokens and reseeds the generator with the parameters' seed.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_sampler_reset(s: *mut fx_sampler) -> fx_status {
    guard(|| {
        // SAFETY: forwarded C contract.
        unsafe { sampler_mut(s) }?.sampler.reset();
        Ok(())
    })
}

/// Frees a sampler (NULL is a no-op).
///
/// # Safety
/// `s` must be NULL or a handle from `fx_sampler_new` not yet freed, used by no other thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_sampler_free(s: *mut fx_sampler) {
    let _ = guard(|| {
        if !s.is_null() {
            // SAFETY: C contract: s came from fx_sampler_new and is freed once.
            drop(unsafe { Box::from_raw(s) });
        }
        Ok(())
    });
}
