//! Text in and out: `fx_model_tokenizer_info`, `fx_tokenize`, `fx_detokenize` and
//! `fx_generate`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::mem::size_of;
use std::ops::ControlFlow;

use facade::generate::{GenerateOptions, StopReason};
use facade::{Session, Tokenizer};

use crate::abi::{Versioned, check_buf, check_out, read_opt, write_out};
use crate::sampler::{fx_sampler, sampler_mut, token_ids};
use crate::session::{fx_model, fx_session, live, mutate};
use crate::status::{FxResult, fail, fx_status, fx_status::*, guard, invalid, map_facade};

/// What the tokenizer of a model's directory says.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_tokenizer_info {
    /// `sizeof(fx_tokenizer_info)`: set by the caller before `fx_model_tokenizer_info`.
    pub struct_size: usize,
    /// Token ids with text are `0 .. n_tokens-1` (at most the model's `vocab_size`).
    pub n_tokens: usize,
    /// The BOS (beginning of text) id, or -1 when the tokenizer names none.
    pub bos: i32,
    /// The EOS (end of text) id, or -1 when the tokenizer names none; `fx_generate` stops
    /// there.
    pub eos: i32,
    /// 1 when `fx_tokenize` with `add_bos = 1` prepends `bos` (the configuration's
    /// `add_bos_token`), else 0.
    pub adds_bos: i32,
    /// 1 when text is JSON-escaped before BPE (LongCrawl64's `JSONGPT2Tokenizer`), else 0.
    pub json_escaped: i32,
}

// SAFETY: repr(C), first field usize, only integer fields.
unsafe impl Versioned for fx_tokenizer_info {
    const NAME: &'static str = "fx_tokenizer_info";
    fn default_value() -> Self {
        fx_tokenizer_info {
            struct_size: size_of::<Self>(),
            n_tokens: 0,
            bos: -1,
            eos: -1,
            adds_bos: 0,
            json_escaped: 0,
        }
    }
}

/// Receives one piece of generated text: `len` bytes of UTF-8 at `piece`, followed by a NUL
/// (not counted in `len`), valid only during the call. Return 0 to continue, anything else
/// to stop the generation. It must not call functions on the session or sampler that
/// `fx_generate` is using.
pub type fx_piece_fn =
    Option<unsafe extern "C" fn(piece: *const c_char, len: usize, user: *mut c_void) -> c_int>;

/// Options of `fx_generate`. Create with `fx_generate_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_generate_options {
    /// `sizeof(fx_generate_options)`.
    pub struct_size: usize,
    /// Tokens to draw at most (EOS included). Default 256.
    pub max_tokens: usize,
    /// 1: stop when the tokenizer's EOS is drawn (default); 0: only at a stop string or
    /// `max_tokens`.
    pub stop_at_eos: i32,
    /// `n_stop` NUL-terminated, non-empty UTF-8 strings: generation stops when the text
    /// contains one, and the text from it on is not passed to the callback. May be NULL when
    /// `n_stop` is 0. Read during the call only.
    pub stop: *const *const c_char,
    pub n_stop: usize,
}

// SAFETY: repr(C), first field usize, integer and raw-pointer fields (any bits are a value).
unsafe impl Versioned for fx_generate_options {
    const NAME: &'static str = "fx_generate_options";
    fn default_value() -> Self {
        fx_generate_options_default()
    }
}

/// Why `fx_generate` stopped.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_stop_reason {
    /// The tokenizer's EOS was drawn (not fed, not printed).
    FX_STOP_EOS = 0,
    /// The text reached the stop string `stop_index`.
    FX_STOP_STRING = 1,
    /// `max_tokens` tokens were drawn.
    FX_STOP_MAX_TOKENS = 2,
    /// The callback returned non-zero.
    FX_STOP_CALLBACK = 3,
}

/// The `int32_t` C reads where the header says `fx_stop_reason`.
pub type fx_stop_reason_raw = i32;

/// What `fx_generate` did.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fx_generate_result {
    /// `sizeof(fx_generate_result)`: set by the caller before `fx_generate`.
    pub struct_size: usize,
    /// Tokens of the prompt fed (BOS included).
    pub n_prompt_tokens: usize,
    /// Tokens generated and fed after the prompt (EOS is never fed).
    pub n_tokens: usize,
    /// An `fx_stop_reason`.
    pub stop_reason: fx_stop_reason_raw,
    /// With FX_STOP_STRING, the index of the stop string reached; otherwise -1.
    pub stop_index: i32,
}

// SAFETY: repr(C), first field usize, only integer fields.
unsafe impl Versioned for fx_generate_result {
    const NAME: &'static str = "fx_generate_result";
    fn default_value() -> Self {
        fx_generate_result {
            struct_size: size_of::<Self>(),
            n_prompt_tokens: 0,
            n_tokens: 0,
            stop_reason: fx_stop_reason::FX_STOP_MAX_TOKENS as i32,
            stop_index: -1,
        }
    }
}

/// Returns the default generation options: at most 256 tokens, stop at EOS, no stop strings.
#[unsafe(no_mangle)]
pub extern "C" fn fx_generate_options_default() -> fx_generate_options {
    fx_generate_options {
        struct_size: size_of::<fx_generate_options>(),
        max_tokens: 256,
        stop_at_eos: 1,
        stop: std::ptr::null(),
        n_stop: 0,
    }
}

fn model_ref<'a>(m: *const fx_model) -> FxResult<&'a fx_model> {
    // SAFETY: C contract of every caller: m is NULL or a live handle.
    unsafe { m.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "model is NULL"))
}

fn id_i32(id: Option<u32>) -> i32 {
    id.and_then(|i| i32::try_from(i).ok()).unwrap_or(-1)
}

fn flag(v: i32, what: &str) -> FxResult<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(invalid(format!("{what} is {v}; expected 0 or 1"))),
    }
}

/// `len` bytes of UTF-8 at `p` (NULL allowed when `len` is 0).
///
/// # Safety
/// `p` is NULL or points to `len` readable bytes.
unsafe fn utf8_arg<'a>(p: *const c_char, len: usize, what: &str) -> FxResult<&'a str> {
    if len == 0 {
        return Ok("");
    }
    if p.is_null() {
        return Err(fail(FX_ERR_NULL_POINTER, format!("{what} is NULL")));
    }
    if len > isize::MAX as usize {
        return Err(invalid(format!("{what}_len = {len} cannot be addressed")));
    }
    // SAFETY: non-null; C contract: len readable bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    std::str::from_utf8(bytes).map_err(|e| {
        invalid(format!(
            "{what} is not UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })
}

/// Fills `*out` (set `out->struct_size` first) with the BOS and EOS ids and the other facts
/// of the model directory's tokenizer. The tokenizer files are read on the first call that
/// needs them (this one, `fx_tokenize`, `fx_detokenize` or `fx_generate`).
///
/// Errors: FX_ERR_UNSUPPORTED when the directory has no tokenizer files and the vocabulary
/// is not the 256 bytes (the model still runs on token ids), FX_ERR_BAD_MODEL naming a
/// corrupt tokenizer file, FX_ERR_IO when one cannot be read.
///
/// # Safety
/// `m` must be NULL or a live handle; `out` NULL or a writable struct of its `struct_size`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_model_tokenizer_info(
    m: *const fx_model,
    out: *mut fx_tokenizer_info,
) -> fx_status {
    guard(|| {
        let m = model_ref(m)?;
        // SAFETY: C contract: out is NULL or a writable fx_tokenizer_info.
        let size = unsafe { check_out(out, "out") }?;
        let t = m.model.tokenizer().map_err(map_facade)?;
        let info = fx_tokenizer_info {
            struct_size: size,
            n_tokens: t.size(),
            bos: id_i32(t.bos()),
            eos: id_i32(t.eos()),
            adds_bos: i32::from(t.adds_bos()),
            json_escaped: i32::from(t.json_escaped()),
        };
        // SAFETY: size came from check_out on out.
        unsafe { write_out(out, size, info) };
        Ok(())
    })
}

/// Encodes `text_len` bytes of UTF-8 `text` (NULL allowed when `text_len` is 0; no NUL
/// needed) into token ids. `add_bos` = 1 marks the start of a text: BOS is prepended when
/// the tokenizer's configuration adds it (`adds_bos` of `fx_tokenizer_info`); 0 never
/// prepends it (a continuation).
///
/// `*n_ids` receives the number of ids. When it exceeds `capacity`, the call returns
/// FX_ERR_BUFFER_TOO_SMALL and writes nothing else: call again with a buffer that large
/// (`ids` may be NULL when `capacity` is 0, to ask for the size).
///
/// # Safety
/// `m` must be NULL or a live handle; `text` must hold `text_len` bytes; `ids` must hold
/// `capacity` int32 values; `n_ids` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_tokenize(
    m: *const fx_model,
    text: *const c_char,
    text_len: usize,
    add_bos: i32,
    ids: *mut i32,
    capacity: usize,
    n_ids: *mut usize,
) -> fx_status {
    guard(|| {
        let m = model_ref(m)?;
        check_buf(n_ids, "n_ids")?;
        if capacity > 0 {
            check_buf(ids, "ids")?;
        }
        let add_bos = flag(add_bos, "add_bos")?;
        // SAFETY: C contract: text holds text_len bytes.
        let text = unsafe { utf8_arg(text, text_len, "text") }?;
        let tok = m.model.tokenizer().map_err(map_facade)?;
        let out = tok.encode(text, add_bos).map_err(map_facade)?;
        // SAFETY: non-null and aligned (checked); C contract: writable.
        unsafe { n_ids.write(out.len()) };
        if out.len() > capacity {
            return Err(fail(
                FX_ERR_BUFFER_TOO_SMALL,
                format!(
                    "ids holds {capacity} values; the text has {} tokens (written to *n_ids)",
                    out.len()
                ),
            ));
        }
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: ids is non-null and aligned (checked, capacity > 0 here); C contract:
        // capacity >= out.len() writable int32 values.
        let dst = unsafe { std::slice::from_raw_parts_mut(ids, out.len()) };
        for (d, &id) in dst.iter_mut().zip(&out) {
            *d = i32::try_from(id).map_err(|_| fail(FX_ERR_INTERNAL, "token id overflow"))?;
        }
        Ok(())
    })
}

/// Decodes `n_ids` token ids (`ids` may be NULL when `n_ids` is 0) into UTF-8 text;
/// `skip_special` = 1 leaves out special tokens (BOS, EOS, ...), 0 writes their text. Bytes
/// that are not UTF-8 become U+FFFD.
///
/// `*text_len` receives the text's length in bytes. The buffer needs `*text_len + 1`
/// bytes: the text, then a NUL. When `capacity` is smaller, the call returns
/// FX_ERR_BUFFER_TOO_SMALL and writes nothing else (`text` may be NULL when `capacity` is 0,
/// to ask for the size).
///
/// Errors: FX_ERR_INVALID_ARGUMENT naming the first id that is negative or has no token.
///
/// # Safety
/// `m` must be NULL or a live handle; `ids` must hold `n_ids` values; `text` must hold
/// `capacity` writable bytes; `text_len` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_detokenize(
    m: *const fx_model,
    ids: *const i32,
    n_ids: usize,
    skip_special: i32,
    text: *mut c_char,
    capacity: usize,
    text_len: *mut usize,
) -> fx_status {
    guard(|| {
        let m = model_ref(m)?;
        check_buf(text_len, "text_len")?;
        if capacity > 0 && text.is_null() {
            return Err(fail(FX_ERR_NULL_POINTER, "text is NULL"));
        }
        let skip = flag(skip_special, "skip_special")?;
        // SAFETY: C contract: ids holds n_ids values.
        let ids = unsafe { token_ids(ids, n_ids, "ids") }?;
        let tok = m.model.tokenizer().map_err(map_facade)?;
        let out = tok.decode(&ids, skip).map_err(map_facade)?;
        // SAFETY: non-null and aligned (checked); C contract: writable.
        unsafe { text_len.write(out.len()) };
        if out.len() >= capacity {
            return Err(fail(
                FX_ERR_BUFFER_TOO_SMALL,
                format!(
                    "text holds {capacity} bytes; the text and its NUL need {} (its length was \
                     written to *text_len)",
                    out.len() + 1
                ),
            ));
        }
        // SAFETY: text is non-null (capacity > out.len() >= 0, checked above); C contract:
        // capacity >= out.len() + 1 writable bytes; our String does not alias it.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), text.cast::<u8>(), out.len());
            text.add(out.len()).write(0);
        }
        Ok(())
    })
}

/// The stop strings of C options.
///
/// # Safety
/// `o.stop` is NULL or holds `o.n_stop` pointers, each NULL or NUL-terminated.
unsafe fn stop_strings(o: &fx_generate_options) -> FxResult<Vec<String>> {
    if o.n_stop == 0 {
        return Ok(Vec::new());
    }
    check_buf(o.stop, "fx_generate_options.stop")?;
    if o.n_stop > isize::MAX as usize / size_of::<*const c_char>() {
        return Err(invalid(format!(
            "n_stop = {} cannot be addressed",
            o.n_stop
        )));
    }
    // SAFETY: non-null and aligned (checked); C contract: n_stop readable pointers.
    let ptrs = unsafe { std::slice::from_raw_parts(o.stop, o.n_stop) };
    let mut out = Vec::with_capacity(ptrs.len());
    for (i, &p) in ptrs.iter().enumerate() {
        if p.is_null() {
            return Err(fail(
                FX_ERR_NULL_POINTER,
                format!("fx_generate_options.stop[{i}] is NULL"),
            ));
        }
        // SAFETY: non-null; C contract: NUL-terminated.
        let s = unsafe { CStr::from_ptr(p) }
            .to_str()
            .map_err(|_| invalid(format!("fx_generate_options.stop[{i}] is not UTF-8")))?;
        if s.is_empty() {
            return Err(invalid(format!("fx_generate_options.stop[{i}] is empty")));
        }
        out.push(s.to_owned());
    }
    Ok(out)
}

/// Calls the C callback with one piece (and a NUL after it).
///
/// # Safety
/// `f` is a valid function pointer (C contract of `fx_generate`).
unsafe fn call_piece(
    f: unsafe extern "C" fn(*const c_char, usize, *mut c_void) -> c_int,
    buf: &mut Vec<u8>,
    piece: &str,
    user: *mut c_void,
) -> ControlFlow<()> {
    buf.clear();
    buf.extend_from_slice(piece.as_bytes());
    buf.push(0);
    // SAFETY: buf holds piece.len() bytes and a NUL, alive for the call; C contract: f is
    // a valid callback.
    let r = unsafe { f(buf.as_ptr().cast(), piece.len(), user) };
    if r == 0 {
        ControlFlow::Continue(())
    } else {
        ControlFlow::Break(())
    }
}

/// Generates text: encodes `prompt` (`prompt_len` bytes of UTF-8; BOS prepended when the
/// session has no tokens yet and the tokenizer's configuration adds it), feeds it to the
/// session, then draws tokens with `sampler`, feeds each (except EOS) to the session and
/// passes the decoded text to `on_piece` as it becomes final (never splitting a UTF-8
/// character). Stops at EOS, at a stop string, after `max_tokens` tokens, or when
/// `on_piece` returns non-zero (the token whose text it received has then been fed).
/// Afterwards the session holds the prompt and the generated tokens, so a later call
/// continues the text. `opts` may be NULL (defaults); `result` may be NULL.
///
/// Every argument is checked before the session changes: a failed check changes nothing.
/// An error after generation began (a non-finite logit, an internal fault) leaves the
/// session holding what was fed so far and writes no result.
///
/// # Safety
/// `s` and `sampler` must be NULL or live handles used by no other thread during the call;
/// `prompt` must hold `prompt_len` bytes; `opts` NULL or a readable `struct_size` prefix
/// whose `stop` holds `n_stop` NUL-terminated strings; `result` NULL or a writable struct of
/// its `struct_size`; `on_piece` a function callable with `user`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fx_generate(
    s: *mut fx_session,
    sampler: *mut fx_sampler,
    prompt: *const c_char,
    prompt_len: usize,
    opts: *const fx_generate_options,
    on_piece: fx_piece_fn,
    user: *mut c_void,
    result: *mut fx_generate_result,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle used by this thread only.
        let s =
            unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        // SAFETY: C contract: sampler is NULL or a live handle used by this thread only.
        let sampler = unsafe { sampler_mut(sampler) }?;
        let f = on_piece.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "on_piece is NULL"))?;
        let result_size = if result.is_null() {
            None
        } else {
            // SAFETY: C contract: result is a writable fx_generate_result.
            Some(unsafe { check_out(result, "result") }?)
        };
        // SAFETY: C contract: opts is NULL or a readable fx_generate_options prefix.
        let o = unsafe { read_opt(opts) }?.unwrap_or_else(|| fx_generate_options_default());
        let gen_opts = GenerateOptions {
            max_tokens: o.max_tokens,
            stop_at_eos: flag(o.stop_at_eos, "fx_generate_options.stop_at_eos")?,
            // SAFETY: C contract on opts.stop.
            stop: unsafe { stop_strings(&o) }?,
        };
        // SAFETY: C contract: prompt holds prompt_len bytes.
        let text = unsafe { utf8_arg(prompt, prompt_len, "prompt") }?;
        let tok: Tokenizer = s.session.model().tokenizer().map_err(map_facade)?.clone();
        let start = s.session.position() == 0;
        let ids = tok.encode(text, start).map_err(map_facade)?;
        if ids.is_empty() {
            return Err(invalid(
                "the prompt has no tokens (empty text and no BOS to add): generation needs \
                 at least one",
            ));
        }
        let mut buf = Vec::new();
        let mut generated = None;
        mutate(s, |session: &mut Session| {
            let g = facade::generate::generate(
                session,
                &tok,
                &mut sampler.sampler,
                &ids,
                &gen_opts,
                // SAFETY: C contract: on_piece is callable with user.
                |piece| unsafe { call_piece(f, &mut buf, piece, user) },
            )?;
            generated = Some(g);
            Ok(())
        })?;
        let g = generated.ok_or_else(|| fail(FX_ERR_INTERNAL, "generation left no result"))?;
        if let (Some(size), false) = (result_size, result.is_null()) {
            let (reason, index) = match g.reason {
                StopReason::Eos => (fx_stop_reason::FX_STOP_EOS, -1),
                StopReason::StopString(i) => (
                    fx_stop_reason::FX_STOP_STRING,
                    i32::try_from(i).unwrap_or(i32::MAX),
                ),
                StopReason::MaxTokens => (fx_stop_reason::FX_STOP_MAX_TOKENS, -1),
                StopReason::Caller => (fx_stop_reason::FX_STOP_CALLBACK, -1),
            };
            let r = fx_generate_result {
                struct_size: size,
                n_prompt_tokens: ids.len(),
                n_tokens: g.tokens.len(),
                stop_reason: reason as i32,
                stop_index: index,
            };
            // SAFETY: size came from check_out on result.
            unsafe { write_out(result, size, r) };
        }
        Ok(())
    })
}
