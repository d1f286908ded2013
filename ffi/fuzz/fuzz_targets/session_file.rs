//! Fuzzes session files through the C ABI: bytes -> `fx_session_restore_buffer` into a
//! live session of the bundled tiny model.
//!
//! Input: byte 0 selects what the rest is. Even: the file as given (the frame checks see
//! it: magic, version, length, checksum). Odd: the harness writes the payload length
//! (bytes 24..32) and a valid XXH3-64 checksum, so the payload's own checks are reached.
//! A refused file must be `FX_ERR_BAD_SESSION_FILE` (or `FX_ERR_INVALID_ARGUMENT` /
//! `FX_ERR_OUT_OF_MEMORY`) and leave the session's saved bytes unchanged; an accepted one
//! must continue (a feed) and save again. `FX_ERR_INTERNAL` is a finding.
#![no_main]

use std::ffi::CString;
use std::ptr;

use foxedge_ffi::*;
use libfuzzer_sys::fuzz_target;

/// The session's state as a file.
fn saved(s: *const fx_session) -> Vec<u8> {
    let mut len = 0usize;
    // SAFETY: live session; NULL buffer with capacity 0 asks for the length.
    let st = unsafe { fx_session_save_buffer(s, ptr::null_mut(), 0, &mut len) };
    assert!(st == fx_status::FX_OK || st == fx_status::FX_ERR_INVALID_ARGUMENT);
    let mut buf = vec![0u8; len];
    // SAFETY: live session; buf holds len bytes.
    let st = unsafe { fx_session_save_buffer(s, buf.as_mut_ptr(), len, &mut len) };
    assert_eq!(st, fx_status::FX_OK, "save");
    buf.truncate(len);
    buf
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut file = rest.to_vec();
    if mode & 1 == 1 && file.len() >= 40 {
        let p = (file.len() - 40) as u64;
        file[24..32].copy_from_slice(&p.to_le_bytes());
        let n = file.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&file[..n]);
        file[n..].copy_from_slice(&sum.to_le_bytes());
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/fox-tiny-pro");
    let path = CString::new(dir).expect("no NUL");
    let mut m: *mut fx_model = ptr::null_mut();
    // SAFETY: valid C string, NULL options, valid out pointer.
    assert_eq!(unsafe { fx_model_open(path.as_ptr(), ptr::null(), &mut m) }, fx_status::FX_OK);
    let mut s: *mut fx_session = ptr::null_mut();
    let opts = fx_session_options_default();
    // SAFETY: live model, valid options and out pointer.
    assert_eq!(unsafe { fx_session_new(m, &opts, &mut s) }, fx_status::FX_OK);
    let tokens = [0i32, 105, 109];
    // SAFETY: live session; 3 tokens, no logits.
    let st = unsafe { fx_session_feed(s, tokens.as_ptr(), tokens.len(), ptr::null_mut()) };
    assert_eq!(st, fx_status::FX_OK);
    let before = saved(s);
    // SAFETY: live session; file holds file.len() bytes.
    let st = unsafe { fx_session_restore_buffer(s, file.as_ptr(), file.len()) };
    assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on restore");
    if st == fx_status::FX_OK {
        // SAFETY: live session; one token, no logits.
        let st = unsafe { fx_session_feed(s, tokens.as_ptr(), 1, ptr::null_mut()) };
        assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on feed after restore");
        saved(s);
    } else {
        assert_eq!(saved(s), before, "a refused file changed the session");
    }
    // SAFETY: handles from the calls above, freed once.
    unsafe {
        fx_session_free(s);
        fx_model_free(m);
    }
});
