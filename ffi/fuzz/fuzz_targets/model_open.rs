//! Fuzzes model loading through the C ABI: bytes -> a model directory -> `fx_model_open`.
//!
//! Input: byte 0 selects what the rest is. Even: `model.safetensors`, with a valid tiny
//! `config.json` (vocab 16, hidden 16, 1 layer, 2 heads of 8). Odd: bytes 1-2 (LE) give the
//! length of a fuzzed `config.json` that follows; the rest is `model.safetensors`.
//! A model that opens is then run: info, a session, a short feed with logits.
//! Failures must be reported as statuses; `FX_ERR_INTERNAL` (a caught panic or a broken
//! invariant) is a finding.
#![no_main]

use std::ffi::CString;
use std::path::PathBuf;
use std::ptr;
use std::sync::OnceLock;

use foxedge_ffi::*;
use libfuzzer_sys::fuzz_target;

const TINY_CONFIG: &str = r#"{"vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1,
 "num_heads": 2, "hidden_ratio": 4, "intermediate_size": null, "hidden_act": "swish",
 "norm_eps": 1e-6, "qk_norm": true, "qk_norm_share_param_across_head": false,
 "use_k_shift": true, "use_v_shift": true, "use_output_gate": true, "ogate_act": "sigmoid",
 "use_output_norm": true, "fgate_type": "full", "use_rope": false,
 "log_pruning_tolerance": null, "num_kv_heads": null, "window_size": null,
 "tie_word_embeddings": false}"#;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("foxedge-fuzz-model-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (config, weights): (&[u8], &[u8]) = if mode & 1 == 0 {
        (TINY_CONFIG.as_bytes(), rest)
    } else {
        if rest.len() < 2 {
            return;
        }
        let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        (&rest[2..2 + n], &rest[2 + n..])
    };
    let d = dir();
    std::fs::write(d.join("config.json"), config).expect("write config");
    std::fs::write(d.join("model.safetensors"), weights).expect("write weights");
    let path = CString::new(d.to_str().expect("utf-8 temp dir")).expect("no NUL");

    let mut m: *mut fx_model = ptr::null_mut();
    // SAFETY: valid C string, NULL options, valid out pointer.
    let st = unsafe { fx_model_open(path.as_ptr(), ptr::null(), &mut m) };
    assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on open");
    if st != fx_status::FX_OK {
        assert!(m.is_null());
        return;
    }
    let mut info = fx_model_info {
        struct_size: std::mem::size_of::<fx_model_info>(),
        vocab_size: 0,
        n_layers: 0,
        n_heads: 0,
        head_dim: 0,
        hidden_size: 0,
        intermediate_size: 0,
        n_params: 0,
    };
    // SAFETY: m is a live handle; info is a valid struct with struct_size set.
    assert_eq!(unsafe { fx_model_info(m, &mut info) }, fx_status::FX_OK);
    let mut s: *mut fx_session = ptr::null_mut();
    let opts = fx_session_options_default();
    // SAFETY: live model, valid options and out pointer.
    let st = unsafe { fx_session_new(m, &opts, &mut s) };
    assert_ne!(
        st,
        fx_status::FX_ERR_INTERNAL,
        "internal error on session_new"
    );
    if st == fx_status::FX_OK && info.vocab_size > 0 && info.vocab_size <= 1 << 16 {
        let tokens: Vec<i32> = (0..3).map(|i| (i % info.vocab_size) as i32).collect();
        let mut logits = vec![0.0f32; info.vocab_size];
        // SAFETY: live session; tokens and logits sized as documented.
        let st = unsafe { fx_session_feed(s, tokens.as_ptr(), tokens.len(), logits.as_mut_ptr()) };
        assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on feed");
    }
    // SAFETY: handles from the calls above (NULL-safe), freed once.
    unsafe {
        fx_session_free(s);
        fx_model_free(m);
    }
});
