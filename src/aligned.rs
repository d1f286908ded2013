//! Cache-line-aligned storage for K and V rows (f32 or f16).
//!
//! The CPU kernels load a row of `head_dim` values as whole vectors (16 f32 lanes with
//! AVX-512, 8 with AVX2). A buffer from the global allocator is only sure to start on a
//! 16-byte boundary (glibc), so with AVX-512 every such load of a row can straddle two
//! 64-byte cache lines. [`Aligned`] starts on a 64-byte boundary: with `head_dim` a multiple
//! of 16 (f32) or 32 (f16), every row of a `[rows, head_dim]` buffer (and every head of a
//! `[heads, n, head_dim]` one) starts a cache line.
//!
//! Measured on the dev VM (AVX-512, decode of 16 heads x 1K entries with ACP, the kept
//! tail resident in L2, 2026-11-28): K and V at a 64-byte boundary ran 0-5% faster than at
//! 16-48 bytes past one in a harness, and the bench's decode ACP steps 16-19% faster than
//! with the allocator's placement; on the H200 host the CPU's decode steps ran 12-34%
//! faster (BENCHMARKS.md, "H200 host CPU").

use std::collections::TryReserveError;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// An element type of [`Aligned`]: `f32` or `half::f16`.
///
/// # Safety
/// Implementors are plain data: no padding, alignment at most 64, size dividing 64, and
/// every bit pattern (all-zero bytes in particular) a valid value.
pub unsafe trait Elem:
    Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static
{
}

// SAFETY: 4 bytes, alignment 4, every bit pattern is an f32.
unsafe impl Elem for f32 {}
// SAFETY: 2 bytes, alignment 2, every bit pattern is an f16.
unsafe impl Elem for half::f16 {}

/// One 64-byte cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

const ZERO: Line = Line([0; 64]);

/// A growable buffer of `T` whose first value is on a 64-byte boundary; derefs to `[T]`.
///
/// Invariant: `len <= per_line * lines.len()` (`per_line = 64 / size_of::<T>()`), and
/// `lines.len()` is the fewest lines that hold `len` values (values past `len` in the last
/// line are unobservable).
#[derive(Clone)]
pub struct Aligned<T: Elem> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

/// 64-byte-aligned f32 rows.
pub type AlignedF32 = Aligned<f32>;

impl<T: Elem> Default for Aligned<T> {
    fn default() -> Self {
        Aligned {
            lines: Vec::new(),
            len: 0,
            _t: PhantomData,
        }
    }
}

impl<T: Elem> Aligned<T> {
    /// Values per cache line.
    const PER_LINE: usize = 64 / std::mem::size_of::<T>();

    /// An empty buffer (no allocation).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty buffer with room for `n` values.
    pub fn with_capacity(n: usize) -> Self {
        Aligned {
            lines: Vec::with_capacity(n.div_ceil(Self::PER_LINE)),
            len: 0,
            _t: PhantomData,
        }
    }

    /// Values it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.lines.capacity() * Self::PER_LINE
    }

    /// Makes room for `additional` more values; on success, appends of that many values
    /// do not allocate.
    pub fn try_reserve(&mut self, additional: usize) -> Result<(), TryReserveError> {
        let want = self.len.saturating_add(additional).div_ceil(Self::PER_LINE);
        self.lines
            .try_reserve(want.saturating_sub(self.lines.len()))
    }

    /// Grows by `n` values (`T::default()`) and returns them.
    pub fn extend_zeroed(&mut self, n: usize) -> &mut [T] {
        let (at, len) = (self.len, self.len + n);
        self.lines.resize(len.div_ceil(Self::PER_LINE), ZERO);
        self.len = len;
        let new = &mut self[at..];
        new.fill(T::default());
        new
    }

    /// Appends `src`.
    pub fn extend_from_slice(&mut self, src: &[T]) {
        self.extend_zeroed(src.len()).copy_from_slice(src);
    }

    /// Keeps the first `n` values (no-op when it holds `n` or fewer); keeps the capacity.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.len = n;
            self.lines.truncate(n.div_ceil(Self::PER_LINE));
        }
    }
}

impl<T: Elem> Deref for Aligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `Line` is 64 plain bytes (`repr(C)`, no padding) and `T` is plain data
        // whose size divides 64 (`Elem`), so `lines` is `PER_LINE * lines.len()`
        // initialized, contiguous `T` starting at its (non-null, 64-byte-aligned) pointer,
        // and `len <= PER_LINE * lines.len()` (the invariant).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Elem> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; the slice borrows `self` mutably, so it is the only view.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Elem> From<&[T]> for Aligned<T> {
    fn from(src: &[T]) -> Self {
        let mut a = Self::with_capacity(src.len());
        a.extend_from_slice(src);
        a
    }
}

impl<T: Elem> From<Vec<T>> for Aligned<T> {
    fn from(src: Vec<T>) -> Self {
        Self::from(&src[..])
    }
}

impl<T: Elem> PartialEq for Aligned<T> {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl<T: Elem> fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn aligned(a: &AlignedF32) -> bool {
        (a.as_ptr() as usize).is_multiple_of(64)
    }

    #[test]
    fn starts_on_a_cache_line_and_reads_back_what_was_appended() {
        let mut a = AlignedF32::new();
        assert!(a.is_empty() && aligned(&a));
        let src: Vec<f32> = (0..100).map(|i| i as f32).collect();
        a.extend_from_slice(&src[..37]);
        a.extend_from_slice(&src[37..]);
        assert_eq!(&a[..], &src[..]);
        assert!(aligned(&a));
        a.truncate(20);
        assert_eq!(&a[..], &src[..20]);
        a.truncate(50);
        assert_eq!(a.len(), 20);
        assert_eq!(AlignedF32::from(src.clone()), AlignedF32::from(&src[..]));
    }

    #[test]
    fn a_reserve_covers_the_appends_it_was_made_for() {
        let mut a = AlignedF32::from(&[1.0f32; 5][..]);
        a.try_reserve(1000).expect("reserve");
        let (cap, ptr) = (a.capacity(), a.as_ptr());
        assert!(cap >= 1005);
        for _ in 0..100 {
            a.extend_from_slice(&[2.0; 10]);
        }
        assert_eq!((a.capacity(), a.as_ptr()), (cap, ptr));
        assert!(a.try_reserve(usize::MAX).is_err());
    }

    #[test]
    fn f16_rows_start_on_a_cache_line() {
        let mut a = Aligned::<half::f16>::new();
        let src: Vec<half::f16> = (0..70).map(|i| half::f16::from_f32(i as f32)).collect();
        a.extend_from_slice(&src[..33]);
        a.extend_from_slice(&src[33..]);
        assert_eq!(&a[..], &src[..]);
        assert!((a.as_ptr() as usize).is_multiple_of(64));
        a.try_reserve(100).unwrap();
        assert!(a.capacity() >= 170);
        a.truncate(5);
        assert_eq!(a.extend_zeroed(2), &[half::f16::ZERO; 2]);
        assert_eq!(a.len(), 7);
    }

    proptest! {
        /// Any sequence of appends, truncations and in-place moves reads back as a `Vec`
        /// given the same operations does, always from a 64-byte boundary.
        #[test]
        fn behaves_as_a_vec(ops in proptest::collection::vec((0u8..3, 0usize..70), 0..40)) {
            let (mut a, mut v) = (AlignedF32::new(), Vec::<f32>::new());
            for (i, &(op, n)) in ops.iter().enumerate() {
                match op {
                    0 => {
                        let src: Vec<f32> = (0..n).map(|j| (i * 100 + j) as f32).collect();
                        a.extend_from_slice(&src);
                        v.extend_from_slice(&src);
                    }
                    1 => {
                        a.truncate(n);
                        v.truncate(n);
                    }
                    _ if !v.is_empty() => {
                        let (len, to) = (v.len(), n % v.len());
                        a.copy_within(0..len - to, to);
                        v.copy_within(0..len - to, to);
                    }
                    _ => {}
                }
                prop_assert!(aligned(&a));
                prop_assert_eq!(&a[..], &v[..]);
            }
        }
    }
}
