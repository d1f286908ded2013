//! Generates the C header from this crate's source with cbindgen into `$OUT_DIR/foxedge.h`.
//!
//! The build never writes the committed `include/foxedge.h`: `ffi/scripts/header.sh` copies
//! the generated header there, and `ffi/scripts/ci.sh` fails when the two differ.

use std::env;
use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("ffi/cbindgen.toml must parse");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate foxedge.h")
        .write_to_file(out_dir.join("foxedge.h"));
}
