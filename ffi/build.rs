//! Generates `include/foxedge.h` from this crate's source with cbindgen.
//!
//! The header is written to `$OUT_DIR/foxedge.h` and copied to `include/foxedge.h` only when
//! its content changed, so builds do not touch the committed file needlessly. CI rebuilds and
//! fails when `git diff` shows the committed header is stale (`ffi/scripts/ci.sh`).

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    // Also when the committed header is edited or restored, so a stale copy is rewritten.
    println!("cargo:rerun-if-changed=include/foxedge.h");
    // The shared library is installed as libfoxedge.so.0 (ABI major 0), whatever cargo names it.
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libfoxedge.so.0");
    }

    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("ffi/cbindgen.toml must parse");
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate foxedge.h");
    let generated = out_dir.join("foxedge.h");
    bindings.write_to_file(&generated);

    let text = fs::read(&generated).expect("read generated header");
    let committed = crate_dir.join("include").join("foxedge.h");
    if fs::read(&committed).ok().as_deref() != Some(text.as_slice()) {
        fs::create_dir_all(crate_dir.join("include")).expect("create include/");
        fs::write(&committed, &text).expect("write include/foxedge.h");
    }
}
