//! Cache-line-aligned f32 storage for K and V rows.
//!
//! The CPU kernels load a row of `head_dim` f32 as whole vectors (16 lanes with AVX-512, 8
//! with AVX2). An f32 buffer from the global allocator is only sure to start on a 16-byte
//! boundary (glibc), so with AVX-512 every such load of a row can straddle two 64-byte
//! cache lines. [`AlignedF32`]
//! starts on a 64-byte boundary: with `head_dim` a multiple of 16, every row of a
//! `[rows, head_dim]` buffer (and every head of a `[heads, n, head_dim]` one) starts a
//! cache line.
//!
//! Measured on the dev VM (AVX-512, decode of 16 heads x 1K entries with ACP, the kept
//! tail resident in L2, 2026-11-28): K and V at a 64-byte boundary ran 0-5% faster than at
//! 16-48 bytes past one in a harness, and the bench's decode ACP steps 16-19% faster than
//! with the allocator's placement; on the H200 host the CPU's decode steps ran 12-34%
//! faster (BENCHMARKS.md, "H200 host CPU").

use std::collections::TryReserveError;
use std::fmt;
use std::ops::{Deref, DerefMut};

/// f32 per cache line.
const LANES: usize = 16;

/// One 64-byte cache line of f32.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; LANES]);

const ZERO: Line = Line([0.0; LANES]);

/// A growable f32 buffer whose first value is on a 64-byte boundary; derefs to `[f32]`.
///
/// Invariant: `len <= LANES * lines.len()`, and `lines.len()` is the fewest lines that hold
/// `len` values (values past `len` in the last line are unobservable).
#[derive(Clone, Default)]
pub struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// An empty buffer (no allocation).
    pub fn new() -> AlignedF32 {
        AlignedF32::default()
    }

    /// An empty buffer with room for `n` values.
    pub fn with_capacity(n: usize) -> AlignedF32 {
        AlignedF32 {
            lines: Vec::with_capacity(n.div_ceil(LANES)),
            len: 0,
        }
    }

    /// Values it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.lines.capacity() * LANES
    }

    /// Makes room for `additional` more values; on success, appends of that many values
    /// do not allocate.
    pub fn try_reserve(&mut self, additional: usize) -> Result<(), TryReserveError> {
        let want = self.len.saturating_add(additional).div_ceil(LANES);
        self.lines
            .try_reserve(want.saturating_sub(self.lines.len()))
    }

    /// Appends `src`.
    pub fn extend_from_slice(&mut self, src: &[f32]) {
        let (at, len) = (self.len, self.len + src.len());
        self.lines.resize(len.div_ceil(LANES), ZERO);
        self.len = len;
        self[at..].copy_from_slice(src);
    }

    /// Keeps the first `n` values (no-op when it holds `n` or fewer); keeps the capacity.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.len = n;
            self.lines.truncate(n.div_ceil(LANES));
        }
    }
}

impl Deref for AlignedF32 {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` over `[f32; 16]` (64 bytes, no padding), so `lines`
        // is `16 * lines.len()` initialized, contiguous f32 starting at its (non-null,
        // 64-byte-aligned) pointer, and `len <= 16 * lines.len()` (the invariant).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`; the slice borrows `self` mutably, so it is the only view.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

impl From<&[f32]> for AlignedF32 {
    fn from(src: &[f32]) -> AlignedF32 {
        let mut a = AlignedF32::with_capacity(src.len());
        a.extend_from_slice(src);
        a
    }
}

impl From<Vec<f32>> for AlignedF32 {
    fn from(src: Vec<f32>) -> AlignedF32 {
        AlignedF32::from(&src[..])
    }
}

impl PartialEq for AlignedF32 {
    fn eq(&self, other: &AlignedF32) -> bool {
        self[..] == other[..]
    }
}

impl fmt::Debug for AlignedF32 {
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
