//! Fuzzes loading quantized model files (`foxedge quantize` / `Model::save` output) through
//! the C ABI: packed Q8 / Q4 tensors described in the safetensors `__metadata__`.
//!
//! A valid tiny model (vocab 16, hidden 16, 1 layer, 2 heads of 8, random weights) is
//! quantized to Q8 and to Q4 once and saved; each input then damages one of them:
//! byte 0 picks the base (bit 0: Q8 / Q4) and the damage (bits 1-2):
//! 0: a list of 5-byte edits (u32 offset, u8 xor) and a final truncation (u32);
//! 1: the rest replaces the header JSON (the data section kept);
//! 2: the rest replaces the metadata entry of one packed tensor (index in byte 1);
//! 3: the rest is the whole `model.safetensors`.
//! The model is opened as stored or converted (byte 1 picks `fx_model_options.weights`);
//! a model that opens runs a session over 3 tokens. Failures must be statuses;
//! `FX_ERR_INTERNAL` (a caught panic or a broken invariant) is a finding.
#![no_main]

use std::collections::HashMap;
use std::ffi::CString;
use std::path::PathBuf;
use std::ptr;
use std::sync::OnceLock;

use foxedge::{Model, ModelOptions, WeightFormat};
use foxedge_ffi::*;
use libfuzzer_sys::fuzz_target;

const TINY_CONFIG: &str = r#"{"vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 1,
 "num_heads": 2, "hidden_ratio": 4, "intermediate_size": null, "hidden_act": "swish",
 "norm_eps": 1e-6, "qk_norm": true, "qk_norm_share_param_across_head": false,
 "use_k_shift": true, "use_v_shift": true, "use_output_gate": true, "ogate_act": "sigmoid",
 "use_output_norm": true, "fgate_type": "full", "use_rope": false,
 "log_pruning_tolerance": null, "num_kv_heads": null, "window_size": null,
 "tie_word_embeddings": false}"#;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("foxedge-fuzz-q-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// The tiny model's tensors (name, shape) in the reference layout.
fn shapes() -> Vec<(String, Vec<usize>)> {
    let (v, d, h, i) = (16, 16, 2, 256);
    let p = "model.layers.0.";
    let mut s: Vec<(String, Vec<usize>)> = vec![
        ("model.embeddings.weight".into(), vec![v, d]),
        ("model.norm.weight".into(), vec![d]),
        ("lm_head.weight".into(), vec![v, d]),
    ];
    for (n, shape) in [
        ("attn_norm.weight", vec![d]),
        ("attn.q_proj.weight", vec![d, d]),
        ("attn.k_proj.linear.weight", vec![d, d]),
        ("attn.k_proj.shift_proj.weight", vec![h, d]),
        ("attn.v_proj.linear.weight", vec![d, d]),
        ("attn.v_proj.shift_proj.weight", vec![h, d]),
        ("attn.o_proj.weight", vec![d, d]),
        ("attn.fgate_proj.weight", vec![h, d]),
        ("attn.fgate_proj.bias", vec![h]),
        ("attn.ogate_proj.weight", vec![d, d]),
        ("attn.output_norm.weight", vec![d]),
        ("attn.q_norm.weight", vec![d]),
        ("attn.k_norm.weight", vec![d]),
        ("mlp_norm.weight", vec![d]),
        ("mlp.gate_proj.weight", vec![2 * i, d]),
        ("mlp.down_proj.weight", vec![d, i]),
    ] {
        s.push((format!("{p}{n}"), shape));
    }
    s
}

/// The valid Q8 and Q4 files.
fn bases() -> &'static [Vec<u8>; 2] {
    static B: OnceLock<[Vec<u8>; 2]> = OnceLock::new();
    B.get_or_init(|| {
        let src = dir("src");
        let mut seed = 1u64;
        let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, shape) in shapes() {
            let n: usize = shape.iter().product();
            let mut b = Vec::with_capacity(4 * n);
            for _ in 0..n {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let x = if shape.len() == 1 {
                    1.0
                } else {
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
                };
                b.extend_from_slice(&f32::to_le_bytes(x));
            }
            data.push((name, shape, b));
        }
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .expect("tensor view");
                (n.clone(), v)
            })
            .collect();
        let file = safetensors::serialize(views, &None::<HashMap<String, String>>).expect("f32");
        std::fs::write(src.join("config.json"), TINY_CONFIG).expect("config");
        std::fs::write(src.join("model.safetensors"), file).expect("weights");
        [WeightFormat::Q8, WeightFormat::Q4].map(|f| {
            let opts = ModelOptions {
                weights: Some(f),
                ..ModelOptions::default()
            };
            let m = Model::open_with(&src, &opts).expect("tiny model quantizes");
            let out = dir(f.name());
            m.save(&out, &|_, _| {}).expect("save");
            std::fs::read(out.join("model.safetensors")).expect("read back")
        })
    })
}

/// The header length field, header JSON and data of a safetensors file.
fn split(b: &[u8]) -> (usize, &[u8]) {
    let n = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
    (n, &b[8 + n..])
}

fn with_header(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(data);
    b
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let base = &bases()[usize::from(mode & 1)];
    let pick = rest.first().copied().unwrap_or(0);
    let file: Vec<u8> = match (mode >> 1) & 3 {
        0 => {
            let mut b = base.clone();
            let mut edits = rest.chunks_exact(5);
            for e in &mut edits {
                let at = u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as usize % b.len();
                b[at] ^= e[4];
            }
            if let [a, c, d, f] = *edits.remainder() {
                let cut = u32::from_le_bytes([a, c, d, f]) as usize % (b.len() + 1);
                b.truncate(cut);
            }
            b
        }
        1 => with_header(rest, split(base).1),
        2 => {
            let (n, data) = split(base);
            let Ok(mut h) = serde_json::from_slice::<serde_json::Value>(&base[8..8 + n]) else {
                return;
            };
            let text = String::from_utf8_lossy(rest.get(1..).unwrap_or(&[])).into_owned();
            if let Some(meta) = h.get_mut("__metadata__").and_then(|m| m.as_object_mut()) {
                let keys: Vec<String> = meta.keys().cloned().collect();
                if !keys.is_empty() {
                    let k = &keys[usize::from(pick) % keys.len()];
                    meta.insert(k.clone(), serde_json::Value::String(text));
                }
            }
            with_header(&serde_json::to_vec(&h).expect("json"), data)
        }
        _ => rest.to_vec(),
    };
    let d = dir("case");
    std::fs::write(d.join("config.json"), TINY_CONFIG).expect("write config");
    std::fs::write(d.join("model.safetensors"), &file).expect("write weights");
    let path = CString::new(d.to_str().expect("utf-8 temp dir")).expect("no NUL");

    let mut opts = fx_model_options_default();
    opts.weights = i32::from(pick % 7);
    opts.threads = usize::from(pick % 3);
    let mut m: *mut fx_model = ptr::null_mut();
    // SAFETY: valid C string, valid options and out pointer.
    let st = unsafe { fx_model_open(path.as_ptr(), &opts, &mut m) };
    assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on open");
    if st != fx_status::FX_OK {
        assert!(m.is_null());
        return;
    }
    let mut s: *mut fx_session = ptr::null_mut();
    let so = fx_session_options_default();
    // SAFETY: live model, valid options and out pointer.
    let st = unsafe { fx_session_new(m, &so, &mut s) };
    assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on session_new");
    if st == fx_status::FX_OK {
        let tokens = [0i32, 5, 15];
        let mut logits = [0.0f32; 16];
        // SAFETY: live session; 3 tokens; logits of vocab 16.
        let st = unsafe { fx_session_feed(s, tokens.as_ptr(), tokens.len(), logits.as_mut_ptr()) };
        assert_ne!(st, fx_status::FX_ERR_INTERNAL, "internal error on feed");
    }
    // SAFETY: handles from the calls above (NULL-safe), freed once.
    unsafe {
        fx_session_free(s);
        fx_model_free(m);
    }
});
