//! The C library: every `fx_*` function of `foxedge-ffi`, exported from `libfoxedge.so`
//! and `libfoxedge.a` (declared in `ffi/include/foxedge.h`).

pub use foxedge_ffi::*;
