//! Status codes, the thread-local last-error message and the panic guard that every exported
//! function runs its body in.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Result of every fallible call: `FX_OK` (0) or a negative error code.
///
/// In C this is `int32_t` with named constants, so any value can be passed back to
/// `fx_status_string` safely.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fx_status {
    /// Success.
    FX_OK = 0,
    /// A required pointer argument (handle, buffer, output) was NULL.
    FX_ERR_NULL_POINTER = -1,
    /// An argument is out of its domain: wrong `struct_size`, zero or inconsistent sizes,
    /// NaN or positive log gates, an unknown enum value, a misaligned buffer.
    FX_ERR_INVALID_ARGUMENT = -2,
    /// The model directory or file is missing, truncated, corrupt or inconsistent.
    FX_ERR_BAD_MODEL = -3,
    /// Valid request that this build or this model does not support.
    FX_ERR_UNSUPPORTED = -4,
    /// An allocation failed or a size does not fit in memory.
    FX_ERR_OUT_OF_MEMORY = -5,
    /// The requested backend is not compiled in or has no usable device.
    FX_ERR_BACKEND_UNAVAILABLE = -6,
    /// A bug inside foxedge (a caught panic or a broken invariant). Please report it.
    FX_ERR_INTERNAL = -7,
    /// Reading a file failed (not found, permission denied, I/O error).
    FX_ERR_IO = -8,
    /// A streaming logit bound was exceeded by a new query or key (the certificate that
    /// ACP pruning and eviction rely on would no longer hold).
    FX_ERR_BOUND_VIOLATED = -9,
    /// A caller's output buffer is too small; the call wrote the size it needs (and nothing
    /// else) so the caller can retry with a larger one.
    FX_ERR_BUFFER_TOO_SMALL = -10,
    /// A session file (or buffer) cannot be restored: not a session file, another format
    /// version, truncated, damaged (checksum), saved from another model, or corrupt. The
    /// session it was restored into is unchanged.
    FX_ERR_BAD_SESSION_FILE = -11,
}

/// The `int32_t` that C passes where the header says `fx_status` (any value is defined).
pub type fx_status_raw = i32;

use fx_status::*;

/// Every code, for tests and for `fx_status_string`.
pub(crate) const ALL_STATUS: [fx_status; 12] = [
    FX_OK,
    FX_ERR_NULL_POINTER,
    FX_ERR_INVALID_ARGUMENT,
    FX_ERR_BAD_MODEL,
    FX_ERR_UNSUPPORTED,
    FX_ERR_OUT_OF_MEMORY,
    FX_ERR_BACKEND_UNAVAILABLE,
    FX_ERR_INTERNAL,
    FX_ERR_IO,
    FX_ERR_BOUND_VIOLATED,
    FX_ERR_BUFFER_TOO_SMALL,
    FX_ERR_BAD_SESSION_FILE,
];

impl fx_status {
    fn text(self) -> &'static std::ffi::CStr {
        match self {
            FX_OK => c"ok",
            FX_ERR_NULL_POINTER => c"null pointer",
            FX_ERR_INVALID_ARGUMENT => c"invalid argument",
            FX_ERR_BAD_MODEL => c"bad model file",
            FX_ERR_UNSUPPORTED => c"unsupported",
            FX_ERR_OUT_OF_MEMORY => c"out of memory",
            FX_ERR_BACKEND_UNAVAILABLE => c"backend unavailable",
            FX_ERR_INTERNAL => c"internal error",
            FX_ERR_IO => c"i/o error",
            FX_ERR_BOUND_VIOLATED => c"logit bound violated",
            FX_ERR_BUFFER_TOO_SMALL => c"buffer too small",
            FX_ERR_BAD_SESSION_FILE => c"bad session file",
        }
    }
}

/// A failed call: the status to return and the message for `fx_last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub status: fx_status,
    pub message: String,
}

pub(crate) type FxResult<T> = Result<T, Failure>;

/// Builds a [`Failure`].
pub(crate) fn fail(status: fx_status, message: impl Into<String>) -> Failure {
    Failure {
        status,
        message: message.into(),
    }
}

/// Shorthand for an `FX_ERR_INVALID_ARGUMENT` failure.
pub(crate) fn invalid(message: impl Into<String>) -> Failure {
    fail(FX_ERR_INVALID_ARGUMENT, message)
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores `message` as this thread's last error (interior NULs become spaces).
pub(crate) fn set_last_error(message: &str) {
    let bytes: Vec<u8> = message
        .bytes()
        .map(|b| if b == 0 { b' ' } else { b })
        .collect();
    let text = CString::new(bytes).unwrap_or_default();
    // `try_with` fails only during thread teardown; then there is no one to read it.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = text;
        }
    });
}

/// Runs `body` with panics caught; records the message of a failure and returns its status.
pub(crate) fn guard(body: impl FnOnce() -> FxResult<()>) -> fx_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => FX_OK,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            set_last_error(&format!("internal error (caught panic): {what}"));
            FX_ERR_INTERNAL
        }
    }
}

/// Like [`guard`] for functions that return a value instead of a status: `on_error` is
/// returned when the body fails or panics.
pub(crate) fn guard_value<T>(on_error: T, body: impl FnOnce() -> FxResult<T>) -> T {
    let mut out = None;
    let status = guard(|| {
        out = Some(body()?);
        Ok(())
    });
    match (status, out) {
        (FX_OK, Some(v)) => v,
        _ => on_error,
    }
}

/// Returns a static, NUL-terminated description of a status code (never NULL).
/// Unknown codes give "unknown status".
#[unsafe(no_mangle)]
pub extern "C" fn fx_status_string(s: fx_status_raw) -> *const c_char {
    ALL_STATUS
        .iter()
        .find(|c| **c as i32 == s)
        .map_or(c"unknown status", |c| c.text())
        .as_ptr()
}

/// Returns the message of the last failed call on this thread, or "" if none failed yet.
/// The pointer stays valid until the next failing call on the same thread. Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn fx_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| match slot.try_borrow() {
            Ok(s) => s.as_ptr(),
            Err(_) => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// Maps an error of the decision layer or the kernels to a status and message (the
/// message does not repeat the status's words).
pub(crate) fn map_core(e: foxedge_core::Error) -> Failure {
    use foxedge_core::Error as E;
    let status = match e {
        E::BadLogGate { .. } | E::BadShape(_) | E::BadLength { .. } | E::BadArgument(_) => {
            FX_ERR_INVALID_ARGUMENT
        }
        E::Capacity { .. } => FX_ERR_UNSUPPORTED,
        E::BoundViolated { .. } => FX_ERR_BOUND_VIOLATED,
    };
    let message = match e {
        E::BadArgument(why) => why.to_string(),
        E::BoundViolated { observed, bound } => {
            format!("observed {observed} > bound {bound} used for the threshold")
        }
        _ => e.to_string(),
    };
    fail(status, message)
}

/// Maps a facade error to a status and message (without the class words of its
/// `Display`, which the status already says).
pub(crate) fn map_facade(e: facade::Error) -> Failure {
    use facade::ErrorKind as K;
    let status = match e.kind() {
        K::InvalidArgument => FX_ERR_INVALID_ARGUMENT,
        K::BadModel => FX_ERR_BAD_MODEL,
        K::Io => FX_ERR_IO,
        K::Unsupported => FX_ERR_UNSUPPORTED,
        K::OutOfMemory => FX_ERR_OUT_OF_MEMORY,
        K::BackendUnavailable => FX_ERR_BACKEND_UNAVAILABLE,
        K::Internal => FX_ERR_INTERNAL,
        K::BadSessionFile => FX_ERR_BAD_SESSION_FILE,
    };
    fail(status, e.message())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: fx_last_error never returns NULL and the string is NUL-terminated.
        unsafe { CStr::from_ptr(fx_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn guard_turns_a_panic_into_internal_with_a_message() {
        let st = guard(|| panic!("boom {}", 7));
        assert_eq!(st, FX_ERR_INTERNAL);
        assert!(last().contains("boom 7"), "{}", last());
        let st = guard(|| Err(fail(FX_ERR_BAD_MODEL, "bad\0file")));
        assert_eq!(st, FX_ERR_BAD_MODEL);
        assert_eq!(last(), "bad file");
        assert_eq!(guard(|| Ok(())), FX_OK);
        assert_eq!(guard_value(-1.0, || Err(invalid("x"))), -1.0);
        assert_eq!(guard_value(-1.0, || Ok(2.0)), 2.0);
    }

    #[test]
    fn last_error_is_per_thread() {
        set_last_error("main thread");
        std::thread::spawn(|| {
            assert_eq!(last(), "");
            set_last_error("other thread");
            assert_eq!(last(), "other thread");
        })
        .join()
        .unwrap();
        assert_eq!(last(), "main thread");
    }

    #[test]
    fn status_strings_are_distinct_and_total() {
        let mut seen = std::collections::HashSet::new();
        for s in ALL_STATUS {
            // SAFETY: static NUL-terminated strings.
            let t = unsafe { CStr::from_ptr(fx_status_string(s as i32)) };
            assert!(seen.insert(t.to_owned()), "{t:?}");
            assert!(s == FX_OK || (s as i32) < 0);
        }
        for raw in [1, -12, i32::MIN, i32::MAX] {
            // SAFETY: as above.
            let t = unsafe { CStr::from_ptr(fx_status_string(raw)) };
            assert_eq!(t.to_str().unwrap(), "unknown status");
        }
    }
}
