//! Sets the shared library's soname: libfoxedge.so.0 (ABI major version 0).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libfoxedge.so.0");
    }
}
