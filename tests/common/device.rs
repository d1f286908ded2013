//! Tests that need a Vulkan device: without one they print why they skip and pass, unless
//! `CI` is set (to anything but "", "0" or "false"), where a missing device fails them, so
//! a CI machine that should have one (lavapipe) never skips in silence.
//!
//! One helper for the whole crate: the integration tests use it as `common::device`, the
//! library's unit tests as `crate::test_device` (included by path from `src/lib.rs`).
#![allow(dead_code)]

use std::fmt::Display;

/// Whether a missing Vulkan device fails the test: `CI` is set, and not to "", "0" or
/// "false".
pub fn required() -> bool {
    std::env::var_os("CI").is_some_and(|v| {
        let v = v.to_string_lossy();
        !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false")
    })
}

/// Test `test` has no Vulkan device (`why`): prints that it skips, or panics where
/// [`required`].
pub fn missing(test: &str, why: &dyn Display) {
    if required() {
        panic!("{test}: CI is set, so a Vulkan device is required: {why}");
    }
    eprintln!("SKIPPED {test}: no Vulkan device ({why}); with CI set this fails");
}

/// `r`'s value; or, when the Vulkan-backed `what` could not be opened, `None` after
/// [`missing`] (which panics where [`required`]).
pub fn or_skip<T, E: Display>(r: Result<T, E>, test: &str, what: &str) -> Option<T> {
    match r {
        Ok(x) => Some(x),
        Err(e) => {
            missing(test, &format_args!("{what}: {e}"));
            None
        }
    }
}
