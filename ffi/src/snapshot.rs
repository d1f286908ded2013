//! Saving, restoring and forking sessions: `fx_session_save*`, `fx_session_restore*`,
//! `fx_session_load`, `fx_session_fork`. The file format is the facade's (`foxedge::session`
//! module docs): versioned, little-endian, checksummed, tied to the model it came from.

use std::ffi::{CStr, c_char};

use facade::Session;

use crate::abi::check_buf;
use crate::session::{fx_model, fx_session, live, mutate};
use crate::status::{FxResult, fail, fx_status, fx_status::*, guard, invalid, map_facade};

/// A C path argument as UTF-8.
///
/// # Safety
/// `path` is NULL or NUL-terminated.
unsafe fn path_arg<'a>(path: *const c_char) -> FxResult<&'a str> {
    if path.is_null() {
        return Err(fail(FX_ERR_NULL_POINTER, "path is NULL"));
    }
    // SAFETY: non-null, and the C contract says it is NUL-terminated.
    let p = unsafe { CStr::from_ptr(path) }
        .to_str()
        .map_err(|_| invalid("path is not valid UTF-8"))?;
    if p.is_empty() {
        return Err(invalid("path is empty"));
    }
    Ok(p)
}

fn new_handle(session: Session, out: *mut *mut fx_session) {
    let handle = Box::new(fx_session {
        session,
        poisoned: false,
    });
    // SAFETY: the callers checked `out` (non-null, aligned) first.
    unsafe { out.write(Box::into_raw(handle)) };
}

/// Writes the session's whole state (cache, gates, retention policy, positions, statistics,
/// options and the model's identity) to the file `path`, through a temporary file renamed
/// over it, so a failed save leaves an earlier file whole.
///
/// # Safety
/// `s` must be NULL or a live handle not being fed concurrently; `path` NULL or
/// NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_save(s: *const fx_session, path: *const c_char) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle.
        let s =
            unsafe { s.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        // SAFETY: forwarded C contract.
        let p = unsafe { path_arg(path) }?;
        s.session.save(p).map_err(map_facade)
    })
}

/// The session's state as bytes (the file format of `fx_session_save`). `*out_len` receives
/// the size the state needs; with `buf` NULL nothing else happens (a size query). Otherwise
/// `cap` must be at least that size (else `FX_ERR_INVALID_ARGUMENT`, nothing written).
///
/// # Safety
/// `s` must be NULL or a live handle not being fed concurrently; `buf` NULL or `cap`
/// writable bytes; `out_len` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_save_buffer(
    s: *const fx_session,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle.
        let s =
            unsafe { s.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        check_buf(out_len, "out_len")?;
        let bytes = s.session.save_bytes().map_err(map_facade)?;
        // SAFETY: non-null and aligned (checked).
        unsafe { out_len.write(bytes.len()) };
        if buf.is_null() {
            return Ok(());
        }
        if cap < bytes.len() {
            return Err(invalid(format!(
                "cap is {cap} bytes; the session state needs {}",
                bytes.len()
            )));
        }
        // SAFETY: C contract: buf holds cap >= bytes.len() writable bytes, distinct from
        // the freshly allocated `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
        Ok(())
    })
}

/// Replaces the session's state with that saved in the file `path` (by a session of the same
/// model): its options too, except the backend, which stays this session's. A file that is
/// not a session file, of another version, truncated, damaged, from another model or corrupt
/// is `FX_ERR_BAD_SESSION_FILE`; a missing file `FX_ERR_IO`; either way the session is
/// unchanged.
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `path` NULL
/// or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_restore(s: *mut fx_session, path: *const c_char) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle used by this thread only.
        let s =
            unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        // SAFETY: forwarded C contract.
        let p = unsafe { path_arg(path) }?;
        mutate(s, |session| session.restore(p))?;
        s.poisoned = false;
        Ok(())
    })
}

/// `fx_session_restore` from `len` bytes at `data` (as `fx_session_save_buffer` wrote them).
///
/// # Safety
/// `s` must be NULL or a live handle used by no other thread during the call; `data` NULL
/// or `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_restore_buffer(
    s: *mut fx_session,
    data: *const u8,
    len: usize,
) -> fx_status {
    guard(|| {
        // SAFETY: C contract: s is NULL or a live handle used by this thread only.
        let s =
            unsafe { s.as_mut() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        if data.is_null() {
            return Err(fail(FX_ERR_NULL_POINTER, "data is NULL"));
        }
        if len > isize::MAX as usize {
            return Err(invalid(format!("len = {len} bytes cannot be addressed")));
        }
        // SAFETY: non-null; C contract: len readable bytes (u8 needs no alignment).
        let bytes = unsafe { std::slice::from_raw_parts(data, len) };
        mutate(s, |session| session.restore_bytes(bytes))?;
        s.poisoned = false;
        Ok(())
    })
}

/// A new session over `m` in the state saved in the file `path`, with the options it was
/// saved with (its backend opened anew). On failure `*out` is set to NULL.
///
/// # Safety
/// `m` must be NULL or a live handle; `path` NULL or NUL-terminated; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_load(
    m: *const fx_model,
    path: *const c_char,
    out: *mut *mut fx_session,
) -> fx_status {
    guard(|| {
        check_buf(out, "out")?;
        // SAFETY: non-null and aligned (checked).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: C contract: m is NULL or a live handle.
        let m = unsafe { m.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "model is NULL"))?;
        // SAFETY: forwarded C contract.
        let p = unsafe { path_arg(path) }?;
        let session = Session::load(m.model.clone(), p).map_err(map_facade)?;
        new_handle(session, out);
        Ok(())
    })
}

/// A copy of the session that continues on its own (a branch of the conversation). On
/// failure `*out` is set to NULL.
///
/// # Safety
/// `s` must be NULL or a live handle not being fed concurrently; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fx_session_fork(
    s: *const fx_session,
    out: *mut *mut fx_session,
) -> fx_status {
    guard(|| {
        check_buf(out, "out")?;
        // SAFETY: non-null and aligned (checked).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: C contract: s is NULL or a live handle.
        let s =
            unsafe { s.as_ref() }.ok_or_else(|| fail(FX_ERR_NULL_POINTER, "session is NULL"))?;
        live(s)?;
        let session = s.session.fork().map_err(map_facade)?;
        new_handle(session, out);
        Ok(())
    })
}
