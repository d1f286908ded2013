//! The gemm crate's f32 product, the reference the linear benches time matmul against.

/// `y = x wᵀ` with the gemm crate (`dst = alpha dst + beta lhs rhs`).
pub fn gemm_f32(
    w: &[f32],
    out: usize,
    inp: usize,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    threads: usize,
) {
    assert!(w.len() >= out * inp && x.len() >= rows * inp && y.len() >= rows * out);
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the assert keeps every index in bounds: dst `rows x out` (row stride out),
    // lhs `rows x inp` (row stride inp), rhs[k][n] = w[n inp + k]; no aliasing.
    unsafe {
        gemm::gemm(
            rows,
            out,
            inp,
            y.as_mut_ptr(),
            1,
            out as isize,
            false,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            inp as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}
