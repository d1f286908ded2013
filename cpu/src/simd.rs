//! Vectors of f32 lanes and runtime selection of the widest instruction set.
//!
//! Micro-kernels are written once, generic over [`Vf32`], and run through [`dispatch`],
//! which instantiates them inside a `#[target_feature]` function for the instruction set
//! found at run time (multiversioning by hand). Instances:
//! - `f32`: one lane, the plain scalar reference (exact `f32::exp`);
//! - `wide::f32x8`: the portable vector (NEON on aarch64, SSE or AVX on x86-64 as
//!   compiled);
//! - `V256` (AVX2 + FMA) and `V512` (AVX-512F) on x86-64, chosen at run time.

/// A vector of `LANES` f32 values. All methods are `#[inline(always)]` so that a kernel
/// instantiated inside a `#[target_feature]` function is compiled for that feature set.
pub(crate) trait Vf32: Copy {
    const LANES: usize;
    fn splat(x: f32) -> Self;
    /// Loads `s[..LANES]` (panics if `s` is shorter: a kernel bug, not an input error).
    fn load(s: &[f32]) -> Self;
    /// Stores into `s[..LANES]`.
    fn store(self, s: &mut [f32]);
    fn add(self, b: Self) -> Self;
    fn sub(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    /// `self * b + c`, fused where the hardware has FMA.
    fn fma(self, b: Self, c: Self) -> Self;
    fn max(self, b: Self) -> Self;
    fn reduce_sum(self) -> f32;
    fn reduce_max(self) -> f32;
    /// `e^x`; exact 0 for `x = -inf` (masked scores) and for `x < -87.9`.
    fn exp(self) -> Self;
    /// Widens `LANES` IEEE half-precision bit patterns from `s[..LANES]`.
    fn load_f16(s: &[u16]) -> Self;
    /// Widens `LANES` bfloat16 bit patterns from `s[..LANES]` (a 16-bit shift).
    fn load_bf16(s: &[u16]) -> Self;
    /// Vectors per row of the prefill register tile (4 where there are 32 registers).
    const MM_COLS: usize = 2;
    /// `-inf` in the lanes where `self` is `-inf` (masked), `v` elsewhere.
    fn keep_neg_inf(self, v: Self) -> Self;
    /// Whether some lane is not below `b` (a NaN lane counts).
    fn any_not_below(self, b: f32) -> bool;
    /// The horizontal sums of 8 vectors, `[a[0].reduce_sum(), .., a[7].reduce_sum()]` up
    /// to the order of the additions.
    #[inline(always)]
    fn reduce_sum8(a: [Self; 8]) -> [f32; 8] {
        a.map(Self::reduce_sum)
    }
    /// Transposes one 8 x 8 block: `dst[c * ldd + r] = src[r * lds + c]` for `r, c < 8`
    /// (panics if a row of either side is out of bounds). The scalar body is the reference;
    /// AVX2 transposes in registers.
    #[inline(always)]
    fn transpose8(src: &[f32], lds: usize, dst: &mut [f32], ldd: usize) {
        let rows: [[f32; 8]; 8] = core::array::from_fn(|r| array8(&src[r * lds..]));
        for (c, d) in dst.chunks_mut(ldd).take(8).enumerate() {
            let d = &mut d[..8];
            for (r, x) in d.iter_mut().enumerate() {
                *x = rows[r][c];
            }
        }
    }
}

/// Asks the CPU to start fetching the cache lines of `s` into L1 (x86-64: `prefetcht0`;
/// elsewhere a no-op). Used one tile ahead of the K/V rows a kernel will read.
#[inline(always)]
pub(crate) fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = s.as_ptr().cast::<i8>();
        let bytes = core::mem::size_of_val(s);
        let mut off = 0;
        while off < bytes {
            // SAFETY: `p + off` lies inside `s`; a prefetch reads nothing
            // architecturally and never faults; SSE is part of the x86-64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// [`prefetch`] into L2 (x86-64: `prefetcht1`; elsewhere a no-op): for streams read from
/// DRAM well ahead of use, where fills into L1 would be capped by its few miss buffers.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let p = s.as_ptr().cast::<i8>();
        let bytes = core::mem::size_of_val(s);
        let mut off = 0;
        while off < bytes {
            // SAFETY: as in `prefetch`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// `dst[..src.len()] = f32(src)`, vectorised for f16 and bf16.
#[inline(always)]
pub(crate) fn widen<V: Vf32, T: Storage>(src: &[T], dst: &mut [f32]) {
    let dst = &mut dst[..src.len()];
    let l = V::LANES;
    match (T::DTYPE, T::bits16(src)) {
        (DType::F16, Some(b)) => {
            let mut o = dst.chunks_exact_mut(l);
            let mut i = b.chunks_exact(l);
            for (x, y) in (&mut i).zip(&mut o) {
                V::load_f16(x).store(y);
            }
            for (x, y) in i.remainder().iter().zip(o.into_remainder()) {
                *y = half::f16::from_bits(*x).to_f32();
            }
        }
        (DType::Bf16, Some(b)) => {
            let mut o = dst.chunks_exact_mut(l);
            let mut i = b.chunks_exact(l);
            for (x, y) in (&mut i).zip(&mut o) {
                V::load_bf16(x).store(y);
            }
            for (x, y) in i.remainder().iter().zip(o.into_remainder()) {
                *y = f32::from_bits(u32::from(*x) << 16);
            }
        }
        _ => T::to_f32_slice(src, dst),
    }
}

impl Vf32 for f32 {
    const LANES: usize = 1;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn load(s: &[f32]) -> Self {
        s[0]
    }
    #[inline(always)]
    fn store(self, s: &mut [f32]) {
        s[0] = self;
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        self + b
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        self - b
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        self * b
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        self * b + c
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        f32::max(self, b)
    }
    #[inline(always)]
    fn reduce_sum(self) -> f32 {
        self
    }
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        self
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f32::exp(self)
    }
    #[inline(always)]
    fn load_f16(s: &[u16]) -> Self {
        half::f16::from_bits(s[0]).to_f32()
    }
    #[inline(always)]
    fn load_bf16(s: &[u16]) -> Self {
        f32::from_bits(u32::from(s[0]) << 16)
    }
    #[inline(always)]
    fn keep_neg_inf(self, v: Self) -> Self {
        if self == f32::NEG_INFINITY { self } else { v }
    }
    #[inline(always)]
    fn any_not_below(self, b: f32) -> bool {
        // NaN compares unordered: not below.
        self.partial_cmp(&b) != Some(core::cmp::Ordering::Less)
    }
}

#[inline(always)]
fn array8(s: &[f32]) -> [f32; 8] {
    match s.first_chunk::<8>() {
        Some(a) => *a,
        None => panic!("kernel slice shorter than a vector"),
    }
}

impl Vf32 for wide::f32x8 {
    const LANES: usize = 8;
    #[inline(always)]
    fn splat(x: f32) -> Self {
        wide::f32x8::splat(x)
    }
    #[inline(always)]
    fn load(s: &[f32]) -> Self {
        wide::f32x8::new(array8(s))
    }
    #[inline(always)]
    fn store(self, s: &mut [f32]) {
        s[..8].copy_from_slice(self.as_array_ref());
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        self + b
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        self - b
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        self * b
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        self.fast_max(b)
    }
    #[inline(always)]
    fn reduce_sum(self) -> f32 {
        self.reduce_add()
    }
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        let a = self.to_array();
        let m01 = a[0].max(a[1]).max(a[2].max(a[3]));
        let m23 = a[4].max(a[5]).max(a[6].max(a[7]));
        m01.max(m23)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        // wide's exp returns 0 for non-finite and |x| >= 87.3 inputs; our arguments are
        // <= 0, so that is the underflow we want.
        wide::f32x8::exp(self)
    }
    #[inline(always)]
    fn load_f16(s: &[u16]) -> Self {
        let s = &s[..8];
        wide::f32x8::new(core::array::from_fn(|i| {
            half::f16::from_bits(s[i]).to_f32()
        }))
    }
    #[inline(always)]
    fn load_bf16(s: &[u16]) -> Self {
        let s = &s[..8];
        wide::f32x8::new(core::array::from_fn(|i| {
            f32::from_bits(u32::from(s[i]) << 16)
        }))
    }
    #[inline(always)]
    fn keep_neg_inf(self, v: Self) -> Self {
        use wide::CmpEq;
        self.cmp_eq(wide::f32x8::splat(f32::NEG_INFINITY))
            .blend(self, v)
    }
    #[inline(always)]
    fn any_not_below(self, b: f32) -> bool {
        use wide::CmpLt;
        self.cmp_lt(wide::f32x8::splat(b)).move_mask() != 0xff
    }
}

/// Coefficients of `e^r` on `|r| <= ln2/2` (Taylor to degree 7: error < 5e-9 relative)
/// and the Cody-Waite split of ln 2.
#[cfg(target_arch = "x86_64")]
mod expc {
    pub const LOG2E: f32 = core::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const LO: f32 = -87.9;
    pub const C: [f32; 8] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{V256, V512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Vf32, expc};
    use core::arch::x86_64::*;

    /// 8 lanes of AVX2 + FMA. Invariant: values exist only inside kernels run by
    /// [`super::dispatch`] after it detected `avx2`, `fma` and `f16c`.
    #[derive(Clone, Copy)]
    pub(crate) struct V256(__m256);

    /// 16 lanes of AVX-512F. Invariant: values exist only inside kernels run by
    /// [`super::dispatch`] after it detected `avx512f` (and the AVX2 set).
    #[derive(Clone, Copy)]
    pub(crate) struct V512(__m512);

    /// [`Vf32::transpose8`] in registers: unpack pairs, shuffle quads, swap 128-bit
    /// halves. Only reached from V256 / V512 kernels (AVX is part of both invariants).
    #[inline(always)]
    fn transpose8_avx(src: &[f32], lds: usize, dst: &mut [f32], ldd: usize) {
        // No closures here: a closure is not compiled with the caller's target features,
        // so the intrinsics inside it would not inline.
        // SAFETY: register-only; AVX is available (see above).
        let mut r = [unsafe { _mm256_setzero_ps() }; 8];
        for (i, x) in r.iter_mut().enumerate() {
            let row = &src[i * lds..][..8];
            // SAFETY: `row` has 8 f32; AVX is available (see above).
            *x = unsafe { _mm256_loadu_ps(row.as_ptr()) };
        }
        // SAFETY: register-only shuffles; AVX is available (see above).
        let t = unsafe {
            let u = [
                _mm256_unpacklo_ps(r[0], r[1]),
                _mm256_unpackhi_ps(r[0], r[1]),
                _mm256_unpacklo_ps(r[2], r[3]),
                _mm256_unpackhi_ps(r[2], r[3]),
                _mm256_unpacklo_ps(r[4], r[5]),
                _mm256_unpackhi_ps(r[4], r[5]),
                _mm256_unpacklo_ps(r[6], r[7]),
                _mm256_unpackhi_ps(r[6], r[7]),
            ];
            let q = [
                _mm256_shuffle_ps::<0x44>(u[0], u[2]),
                _mm256_shuffle_ps::<0xEE>(u[0], u[2]),
                _mm256_shuffle_ps::<0x44>(u[1], u[3]),
                _mm256_shuffle_ps::<0xEE>(u[1], u[3]),
                _mm256_shuffle_ps::<0x44>(u[4], u[6]),
                _mm256_shuffle_ps::<0xEE>(u[4], u[6]),
                _mm256_shuffle_ps::<0x44>(u[5], u[7]),
                _mm256_shuffle_ps::<0xEE>(u[5], u[7]),
            ];
            [
                _mm256_permute2f128_ps::<0x20>(q[0], q[4]),
                _mm256_permute2f128_ps::<0x20>(q[1], q[5]),
                _mm256_permute2f128_ps::<0x20>(q[2], q[6]),
                _mm256_permute2f128_ps::<0x20>(q[3], q[7]),
                _mm256_permute2f128_ps::<0x31>(q[0], q[4]),
                _mm256_permute2f128_ps::<0x31>(q[1], q[5]),
                _mm256_permute2f128_ps::<0x31>(q[2], q[6]),
                _mm256_permute2f128_ps::<0x31>(q[3], q[7]),
            ]
        };
        for (c, v) in t.iter().enumerate() {
            let row = &mut dst[c * ldd..][..8];
            // SAFETY: `row` has 8 f32; AVX is available (see above).
            unsafe { _mm256_storeu_ps(row.as_mut_ptr(), *v) };
        }
    }

    // SAFETY (for every `unsafe` block in the two impls below): the intrinsics need the
    // CPU features named in each type's invariant, which `dispatch` checked before
    // running any kernel instantiated with the type; loads and stores go through slices
    // whose length was checked (`s[..LANES]` panics otherwise).
    impl Vf32 for V256 {
        const LANES: usize = 8;
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(s: &[f32]) -> Self {
            let s = &s[..8];
            // SAFETY: see the comment above the impl; `s` has 8 elements.
            unsafe { V256(_mm256_loadu_ps(s.as_ptr())) }
        }
        #[inline(always)]
        fn store(self, s: &mut [f32]) {
            let s = &mut s[..8];
            // SAFETY: see the comment above the impl; `s` has 8 elements.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn add(self, b: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_add_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn sub(self, b: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_sub_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn mul(self, b: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_mul_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn fma(self, b: Self, c: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_fmadd_ps(self.0, b.0, c.0)) }
        }
        #[inline(always)]
        fn max(self, b: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe { V256(_mm256_max_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn reduce_sum(self) -> f32 {
            // SAFETY: see the comment above the impl.
            unsafe {
                let h = _mm_add_ps(
                    _mm256_castps256_ps128(self.0),
                    _mm256_extractf128_ps(self.0, 1),
                );
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
                _mm_cvtss_f32(h)
            }
        }
        #[inline(always)]
        fn reduce_max(self) -> f32 {
            // SAFETY: see the comment above the impl.
            unsafe {
                let h = _mm_max_ps(
                    _mm256_castps256_ps128(self.0),
                    _mm256_extractf128_ps(self.0, 1),
                );
                let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                let h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
                _mm_cvtss_f32(h)
            }
        }
        #[inline(always)]
        fn exp(self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe {
                // x = max(x, LO) (max returns the second operand for NaN/-inf first).
                let x = _mm256_max_ps(self.0, _mm256_set1_ps(expc::LO));
                let n = _mm256_round_ps(
                    _mm256_mul_ps(x, _mm256_set1_ps(expc::LOG2E)),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                );
                let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(expc::LN2_HI), x);
                let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(expc::LN2_LO), r);
                let mut p = _mm256_set1_ps(expc::C[7]);
                for c in expc::C[..7].iter().rev() {
                    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
                }
                // 2^n with n in [-127, 127]: n = -127 gives the bit pattern 0, i.e. 0.0.
                let e = _mm256_slli_epi32(
                    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                    23,
                );
                V256(_mm256_mul_ps(p, _mm256_castsi256_ps(e)))
            }
        }
        #[inline(always)]
        fn load_f16(s: &[u16]) -> Self {
            let s = &s[..8];
            // SAFETY: see the comment above the impl (`f16c` is part of the invariant);
            // `s` has 8 u16 = 16 bytes.
            unsafe { V256(_mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast()))) }
        }
        #[inline(always)]
        fn load_bf16(s: &[u16]) -> Self {
            let s = &s[..8];
            // SAFETY: see the comment above the impl; `s` has 8 u16 = 16 bytes.
            unsafe {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.as_ptr().cast()));
                V256(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)))
            }
        }
        #[inline(always)]
        fn keep_neg_inf(self, v: Self) -> Self {
            // SAFETY: see the comment above the impl.
            unsafe {
                let m = _mm256_cmp_ps::<_CMP_EQ_OQ>(self.0, _mm256_set1_ps(f32::NEG_INFINITY));
                V256(_mm256_blendv_ps(v.0, self.0, m))
            }
        }
        #[inline(always)]
        fn any_not_below(self, b: f32) -> bool {
            // SAFETY: see the comment above the impl.
            unsafe {
                let m = _mm256_cmp_ps::<_CMP_NLT_UQ>(self.0, _mm256_set1_ps(b));
                _mm256_movemask_ps(m) != 0
            }
        }
        #[inline(always)]
        fn reduce_sum8(a: [Self; 8]) -> [f32; 8] {
            let mut out = [0.0f32; 8];
            // SAFETY: see the comment above the impl; `out` holds 8 f32.
            unsafe {
                // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]:
                // two rounds leave [A0..3, B0..3, C0..3, D0..3 | A4..7, .., D4..7].
                let h01 = _mm256_hadd_ps(a[0].0, a[1].0);
                let h23 = _mm256_hadd_ps(a[2].0, a[3].0);
                let h45 = _mm256_hadd_ps(a[4].0, a[5].0);
                let h67 = _mm256_hadd_ps(a[6].0, a[7].0);
                let q0 = _mm256_hadd_ps(h01, h23);
                let q1 = _mm256_hadd_ps(h45, h67);
                let lo = _mm256_permute2f128_ps::<0x20>(q0, q1);
                let hi = _mm256_permute2f128_ps::<0x31>(q0, q1);
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
            }
            out
        }
        #[inline(always)]
        fn transpose8(src: &[f32], lds: usize, dst: &mut [f32], ldd: usize) {
            transpose8_avx(src, lds, dst, ldd);
        }
    }

    impl Vf32 for V512 {
        const LANES: usize = 16;
        #[inline(always)]
        fn transpose8(src: &[f32], lds: usize, dst: &mut [f32], ldd: usize) {
            transpose8_avx(src, lds, dst, ldd);
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(s: &[f32]) -> Self {
            let s = &s[..16];
            // SAFETY: see the comment above the V256 impl; `s` has 16 elements.
            unsafe { V512(_mm512_loadu_ps(s.as_ptr())) }
        }
        #[inline(always)]
        fn store(self, s: &mut [f32]) {
            let s = &mut s[..16];
            // SAFETY: see the comment above the V256 impl; `s` has 16 elements.
            unsafe { _mm512_storeu_ps(s.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn add(self, b: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_add_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn sub(self, b: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_sub_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn mul(self, b: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_mul_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn fma(self, b: Self, c: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_fmadd_ps(self.0, b.0, c.0)) }
        }
        #[inline(always)]
        fn max(self, b: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe { V512(_mm512_max_ps(self.0, b.0)) }
        }
        #[inline(always)]
        fn reduce_sum(self) -> f32 {
            // SAFETY: see the comment above the V256 impl.
            unsafe { _mm512_reduce_add_ps(self.0) }
        }
        #[inline(always)]
        fn reduce_max(self) -> f32 {
            // SAFETY: see the comment above the V256 impl.
            unsafe { _mm512_reduce_max_ps(self.0) }
        }
        #[inline(always)]
        fn exp(self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe {
                let x = _mm512_max_ps(self.0, _mm512_set1_ps(expc::LO));
                let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_mul_ps(x, _mm512_set1_ps(expc::LOG2E)),
                );
                let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(expc::LN2_HI), x);
                let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(expc::LN2_LO), r);
                let mut p = _mm512_set1_ps(expc::C[7]);
                for c in expc::C[..7].iter().rev() {
                    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
                }
                let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                    _mm512_cvtps_epi32(n),
                    _mm512_set1_epi32(127),
                ));
                V512(_mm512_mul_ps(p, _mm512_castsi512_ps(e)))
            }
        }
        #[inline(always)]
        fn load_f16(s: &[u16]) -> Self {
            let s = &s[..16];
            // SAFETY: see the comment above the V256 impl; `s` has 16 u16 = 32 bytes.
            unsafe { V512(_mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().cast()))) }
        }
        #[inline(always)]
        fn load_bf16(s: &[u16]) -> Self {
            let s = &s[..16];
            // SAFETY: see the comment above the V256 impl; `s` has 16 u16 = 32 bytes.
            unsafe {
                let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.as_ptr().cast()));
                V512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)))
            }
        }
        #[inline(always)]
        fn keep_neg_inf(self, v: Self) -> Self {
            // SAFETY: see the comment above the V256 impl.
            unsafe {
                let m = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self.0, _mm512_set1_ps(f32::NEG_INFINITY));
                V512(_mm512_mask_blend_ps(m, v.0, self.0))
            }
        }
        #[inline(always)]
        fn any_not_below(self, b: f32) -> bool {
            // SAFETY: see the comment above the V256 impl.
            unsafe { _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(self.0, _mm512_set1_ps(b)) != 0 }
        }
        const MM_COLS: usize = 4;
    }
}

use foxedge_core::contract::{DType, Storage};

/// Instruction set a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// One lane, plain Rust: the reference the vector kernels are tested against.
    Scalar,
    /// `wide::f32x8` as compiled (NEON on aarch64).
    Portable,
    /// AVX2 + FMA + F16C, detected at run time.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F, detected at run time.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    has_avx2() && std::arch::is_x86_feature_detected!("avx512f")
}

impl Isa {
    /// The widest instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                return Isa::Avx512;
            }
            if has_avx2() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every instruction set this CPU can run (scalar first), for tests and benches.
    pub fn available() -> Vec<Isa> {
        let v = vec![Isa::Scalar, Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        let v = {
            let mut v = v;
            if has_avx2() {
                v.push(Isa::Avx2);
            }
            if has_avx512() {
                v.push(Isa::Avx512);
            }
            v
        };
        v
    }
}

/// A kernel generic over the vector type; [`dispatch`] picks the instance.
pub(crate) trait WithSimd {
    type Output;
    /// Must be `#[inline(always)]` so that it is compiled inside the feature wrapper.
    fn run<V: Vf32>(self) -> Self::Output;
}

/// Runs `k` with the vector type of `isa`. An `isa` this CPU lacks falls back to the
/// detected one (so a wrong request cannot execute an illegal instruction).
pub(crate) fn dispatch<K: WithSimd>(isa: Isa, k: K) -> K::Output {
    match isa {
        Isa::Scalar => k.run::<f32>(),
        Isa::Portable => k.run::<wide::f32x8>(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn go<K: WithSimd>(k: K) -> K::Output {
                k.run::<V256>()
            }
            if has_avx2() {
                // SAFETY: the features `go` is compiled for were detected just above.
                unsafe { go(k) }
            } else {
                k.run::<wide::f32x8>()
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            fn go<K: WithSimd>(k: K) -> K::Output {
                k.run::<V512>()
            }
            if has_avx512() {
                // SAFETY: the features `go` is compiled for were detected just above.
                unsafe { go(k) }
            } else {
                dispatch(Isa::detect(), k)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct ExpAll<'a>(&'a [f32], &'a mut [f32]);
    impl WithSimd for ExpAll<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vf32>(self) {
            for (x, y) in self
                .0
                .chunks_exact(V::LANES)
                .zip(self.1.chunks_exact_mut(V::LANES))
            {
                V::load(x).exp().store(y);
            }
        }
    }

    struct Reduce<'a>(&'a [f32]);
    impl WithSimd for Reduce<'_> {
        type Output = (f32, f32);
        #[inline(always)]
        fn run<V: Vf32>(self) -> (f32, f32) {
            let (mut s, mut m) = (V::splat(0.0), V::splat(f32::NEG_INFINITY));
            for x in self.0.chunks_exact(V::LANES) {
                s = s.add(V::load(x));
                m = m.max(V::load(x));
            }
            (s.reduce_sum(), m.reduce_max())
        }
    }

    #[test]
    fn exp_matches_std_and_underflows_to_zero() {
        let mut xs: Vec<f32> = (0..1600).map(|i| -90.0 + i as f32 * 0.0575).collect();
        xs.extend([f32::NEG_INFINITY; 16]);
        xs.extend([0.0, -1e-8, -0.3465, 0.3466, -1.0, -2.0, -10.0, -20.0]);
        xs.extend([-40.0, -60.0, -80.0, -87.0, -88.0, -100.0, -1e30, -0.5]);
        for isa in Isa::available() {
            let mut ys = vec![0.0; xs.len()];
            dispatch(isa, ExpAll(&xs, &mut ys));
            for (&x, &y) in xs.iter().zip(&ys) {
                let want = (x as f64).exp();
                if x == f32::NEG_INFINITY {
                    assert_eq!(y, 0.0, "{isa:?} exp({x})");
                } else if x > -87.0 {
                    let rel = ((y as f64 - want) / want).abs();
                    assert!(rel < 4e-7, "{isa:?} exp({x}) = {y}, want {want}, rel {rel}");
                } else {
                    // Underflow region: zero or a subnormal, never more than 1e-37 off.
                    assert!((y as f64 - want).abs() < 1e-37, "{isa:?} exp({x})");
                }
            }
        }
    }

    /// `reduce_sum8`, `keep_neg_inf(x + 1)` and `any_not_below(inf)` over 8 rows of 16
    /// values; outputs in (column vector, row, lane) order, and the lane count.
    struct Lanes<'a>(&'a [f32]);
    impl WithSimd for Lanes<'_> {
        type Output = (Vec<f32>, Vec<f32>, Vec<bool>, usize);
        #[inline(always)]
        fn run<V: Vf32>(self) -> Self::Output {
            let rows: Vec<&[f32]> = self.0.chunks_exact(16).collect();
            let (mut sums, mut kept, mut flags) = (vec![0.0f32; 8], vec![], vec![]);
            for c0 in (0..16).step_by(V::LANES) {
                let a: [V; 8] = core::array::from_fn(|i| V::load(&rows[i][c0..]));
                for (s, y) in sums.iter_mut().zip(V::reduce_sum8(a)) {
                    *s += y;
                }
                for r in &rows {
                    let v = V::load(&r[c0..]);
                    let mut out = [0.0f32; 16];
                    v.keep_neg_inf(v.add(V::splat(1.0))).store(&mut out);
                    kept.extend_from_slice(&out[..V::LANES]);
                    flags.push(v.any_not_below(f32::INFINITY));
                }
            }
            (sums, kept, flags, V::LANES)
        }
    }

    #[test]
    fn lane_helpers_match_scalar() {
        let mut xs: Vec<f32> = (0..128)
            .map(|i| ((i * 29) % 31) as f32 * 0.25 - 3.0)
            .collect();
        xs[5] = f32::NEG_INFINITY;
        xs[40] = f32::NAN;
        xs[77] = f32::INFINITY;
        xs[100] = f32::NEG_INFINITY;
        for isa in Isa::available() {
            let (sums, kept, flags, w) = dispatch(isa, Lanes(&xs));
            let (mut k, mut f) = (0, 0);
            for c0 in (0..16).step_by(w) {
                for r in 0..8 {
                    let lanes = &xs[r * 16 + c0..r * 16 + c0 + w];
                    let want = lanes.iter().any(|x| x.is_nan() || *x == f32::INFINITY);
                    assert_eq!(flags[f], want, "{isa:?} row {r} col {c0}");
                    f += 1;
                    for &x in lanes {
                        let y = kept[k];
                        k += 1;
                        if x == f32::NEG_INFINITY {
                            assert_eq!(y, f32::NEG_INFINITY, "{isa:?}");
                        } else if x.is_nan() {
                            assert!(y.is_nan(), "{isa:?}");
                        } else {
                            assert_eq!(y, x + 1.0, "{isa:?}");
                        }
                    }
                }
            }
            for (r, g) in sums.iter().enumerate() {
                let row = &xs[r * 16..(r + 1) * 16];
                let w: f32 = row.iter().sum();
                if w.is_nan() {
                    assert!(g.is_nan(), "{isa:?} row {r}");
                } else if w.is_infinite() {
                    assert_eq!(*g, w, "{isa:?} row {r}");
                } else {
                    assert!((g - w).abs() < 1e-4, "{isa:?} row {r}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn reductions_match_scalar() {
        let xs: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 - 11.5).collect();
        let want = dispatch(Isa::Scalar, Reduce(&xs));
        for isa in Isa::available() {
            let got = dispatch(isa, Reduce(&xs));
            assert!((got.0 - want.0).abs() < 1e-4 && got.1 == want.1, "{isa:?}");
        }
    }

    /// `transpose8` of an 8 x 8 block at an offset inside strided buffers.
    struct Transpose<'a>(&'a [f32]);
    impl WithSimd for Transpose<'_> {
        type Output = Vec<f32>;
        #[inline(always)]
        fn run<V: Vf32>(self) -> Vec<f32> {
            let mut dst = vec![-1.0f32; 12 * 10];
            V::transpose8(&self.0[3 * 11 + 2..], 11, &mut dst[10 + 1..], 10);
            dst
        }
    }

    #[test]
    fn transpose8_matches_definition() {
        let src: Vec<f32> = (0..11 * 11).map(|i| i as f32).collect();
        for isa in Isa::available() {
            let dst = dispatch(isa, Transpose(&src));
            for (i, &y) in dst.iter().enumerate() {
                let (row, col) = (i / 10, i % 10);
                let want = if (1..9).contains(&row) && (1..9).contains(&col) {
                    // dst[c][r] = src[r][c] with the block at src (3, 2) and dst (1, 1).
                    src[(3 + col - 1) * 11 + 2 + row - 1]
                } else {
                    -1.0
                };
                assert_eq!(y, want, "{isa:?} dst row {row} col {col}");
            }
        }
    }
}
