//! Checked reading and writing of the C structs (`struct_size` versioning) and pointers.

use std::mem::size_of;
use std::ptr;

use crate::status::{FxResult, fail, fx_status::FX_ERR_NULL_POINTER, invalid};

/// A `#[repr(C)]` struct whose first field is `size_t struct_size`.
///
/// # Safety
/// Implementors must be `#[repr(C)]`, start with a `usize` field, and every bit pattern
/// of every field must be valid (integers, floats and raw pointers only: no `bool`, no Rust
/// enums), so that bytes written by C are always a valid value.
pub(crate) unsafe trait Versioned: Copy {
    /// Type name for messages.
    const NAME: &'static str;
    /// The smallest `struct_size` accepted: the size of the first published version.
    const MIN_SIZE: usize = size_of::<Self>();
    /// The value with every field at its default and `struct_size = size_of::<Self>()`.
    fn default_value() -> Self;
}

fn check_size<T: Versioned>(struct_size: usize) -> FxResult<()> {
    if struct_size < T::MIN_SIZE || struct_size > size_of::<T>() {
        return Err(invalid(format!(
            "{}.struct_size is {struct_size}; this library accepts {} (set it to sizeof({}))",
            T::NAME,
            size_of::<T>(),
            T::NAME
        )));
    }
    Ok(())
}

/// Reads a caller's struct: NULL gives `None`; otherwise `struct_size` must be a size this
/// library knows, and the bytes beyond an older, shorter version keep their defaults.
///
/// # Safety
/// `p` is NULL or points to at least `struct_size` readable bytes (the C contract).
pub(crate) unsafe fn read_opt<T: Versioned>(p: *const T) -> FxResult<Option<T>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: p is non-null and, by the C contract, starts with a readable size_t;
    // read_unaligned makes no alignment assumption.
    let struct_size = unsafe { ptr::read_unaligned(p.cast::<usize>()) };
    check_size::<T>(struct_size)?;
    let mut value = T::default_value();
    // SAFETY: `struct_size <= size_of::<T>()` was checked, the caller promised that many
    // readable bytes at p, and `value` is a distinct local of size_of::<T>() bytes; every bit
    // pattern is a valid T (trait contract).
    unsafe {
        ptr::copy_nonoverlapping(
            p.cast::<u8>(),
            (&mut value as *mut T).cast::<u8>(),
            struct_size,
        );
    }
    Ok(Some(value))
}

/// Like [`read_opt`], but NULL is an `FX_ERR_NULL_POINTER` failure.
///
/// # Safety
/// As for [`read_opt`].
pub(crate) unsafe fn read_req<T: Versioned>(p: *const T, what: &str) -> FxResult<T> {
    // SAFETY: forwarded contract.
    unsafe { read_opt(p) }?.ok_or_else(|| fail(FX_ERR_NULL_POINTER, format!("{what} is NULL")))
}

/// Checks an output struct's `struct_size` before anything is computed.
///
/// # Safety
/// `p` is NULL or points to a writable struct whose first field is a readable size_t.
pub(crate) unsafe fn check_out<T: Versioned>(p: *mut T, what: &str) -> FxResult<usize> {
    if p.is_null() {
        return Err(fail(FX_ERR_NULL_POINTER, format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the C contract says it starts with a size_t.
    let struct_size = unsafe { ptr::read_unaligned(p.cast::<usize>()) };
    check_size::<T>(struct_size)?;
    Ok(struct_size)
}

/// Writes `value` to a caller's struct whose size was validated by [`check_out`]; only the
/// first `struct_size` bytes are written and the caller's `struct_size` is kept.
///
/// # Safety
/// `p` points to at least `struct_size` writable bytes and `struct_size` came from
/// [`check_out`] on the same pointer.
pub(crate) unsafe fn write_out<T: Versioned>(p: *mut T, struct_size: usize, value: T) {
    let mut value = value;
    // SAFETY: T starts with a usize field (trait contract); writing our own local.
    unsafe { ptr::write_unaligned((&mut value as *mut T).cast::<usize>(), struct_size) };
    // SAFETY: struct_size <= size_of::<T>() (checked by check_out); p has that many writable
    // bytes (caller contract); the local and the caller's memory do not overlap.
    unsafe {
        ptr::copy_nonoverlapping(
            (&value as *const T).cast::<u8>(),
            p.cast::<u8>(),
            struct_size,
        );
    }
}

/// Checks a typed buffer pointer: non-NULL and aligned for `T`.
pub(crate) fn check_buf<T>(p: *const T, what: &str) -> FxResult<()> {
    if p.is_null() {
        return Err(fail(FX_ERR_NULL_POINTER, format!("{what} is NULL")));
    }
    if !p
        .cast::<u8>()
        .align_offset(std::mem::align_of::<T>())
        .eq(&0)
    {
        return Err(invalid(format!(
            "{what} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

/// Multiplies sizes, failing with a message instead of overflowing.
pub(crate) fn checked_product(what: &str, factors: &[usize]) -> FxResult<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| invalid(format!("{what}: size overflows size_t")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::fx_status::*;

    #[repr(C)]
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct V2 {
        struct_size: usize,
        a: u32,
        b: f64,
    }

    // SAFETY: repr(C), usize first, integer and float fields.
    unsafe impl Versioned for V2 {
        const NAME: &'static str = "V2";
        const MIN_SIZE: usize = 16; // a v1 that ended after `a` (with padding)
        fn default_value() -> Self {
            V2 {
                struct_size: size_of::<V2>(),
                a: 1,
                b: 2.5,
            }
        }
    }

    #[test]
    fn reads_known_sizes_and_keeps_defaults_beyond_an_older_prefix() {
        let mut v = V2 {
            struct_size: 16,
            a: 9,
            b: -1.0,
        };
        // SAFETY: v is a valid V2.
        let got = unsafe { read_opt(&v) }.unwrap().unwrap();
        assert_eq!((got.a, got.b), (9, 2.5), "v1 prefix: b keeps its default");
        v.struct_size = size_of::<V2>();
        // SAFETY: as above.
        let got = unsafe { read_opt(&v) }.unwrap().unwrap();
        assert_eq!((got.a, got.b), (9, -1.0));
        for bad in [0, 8, 15, size_of::<V2>() + 1, usize::MAX] {
            v.struct_size = bad;
            // SAFETY: as above.
            let e = unsafe { read_opt(&v) }.unwrap_err();
            assert_eq!(e.status, FX_ERR_INVALID_ARGUMENT);
            assert!(e.message.contains("struct_size"), "{}", e.message);
        }
        // SAFETY: NULL is allowed.
        let none = unsafe { read_opt::<V2>(std::ptr::null()) };
        assert!(none.unwrap().is_none());
        // SAFETY: NULL is allowed.
        let e = unsafe { read_req::<V2>(std::ptr::null(), "opts") }.unwrap_err();
        assert_eq!(e.status, FX_ERR_NULL_POINTER);
    }

    #[test]
    fn writes_only_the_callers_prefix() {
        let mut out = V2 {
            struct_size: 16,
            a: 0,
            b: 7.0,
        };
        // SAFETY: out is a valid, writable V2.
        let size = unsafe { check_out(&mut out, "out") }.unwrap();
        let value = V2 {
            struct_size: 999,
            a: 5,
            b: 1.0,
        };
        // SAFETY: size from check_out on the same pointer.
        unsafe { write_out(&mut out, size, value) };
        assert_eq!(
            out,
            V2 {
                struct_size: 16,
                a: 5,
                b: 7.0
            }
        );
    }

    #[test]
    fn buffers_must_be_non_null_and_aligned() {
        let x = [0.0f32; 4];
        assert!(check_buf(x.as_ptr(), "x").is_ok());
        let e = check_buf(std::ptr::null::<f32>(), "x").unwrap_err();
        assert_eq!(e.status, FX_ERR_NULL_POINTER);
        let odd = x.as_ptr().cast::<u8>().wrapping_add(1).cast::<f32>();
        assert_eq!(
            check_buf(odd, "x").unwrap_err().status,
            FX_ERR_INVALID_ARGUMENT
        );
        assert!(checked_product("n", &[usize::MAX, 2]).is_err());
        assert_eq!(checked_product("n", &[3, 4]).unwrap(), 12);
    }
}
