//! Loading: synthetic checkpoints of both variants (FoX Pro and plain FoX) against the f64
//! reference, f16/bf16 weights, and malformed files that must give clear errors, no panic.

mod common;

use common::synth::*;
use common::*;
use foxedge::{ErrorKind, Model, SessionOptions, WeightFormat};
use std::sync::Arc;

fn logits_of(dir: &std::path::Path, ids: &[u32], opts: SessionOptions) -> Vec<f32> {
    let model = Arc::new(Model::open(dir).unwrap());
    let v = model.info().vocab;
    let mut s = session(&model, opts);
    let mut out = vec![0.0f32; ids.len() * v];
    s.feed(ids, Some(&mut out)).unwrap();
    out
}

fn ids(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + i / 3) % vocab).collect()
}

/// Both variants, prefill and streaming, vs the f64 reference on fresh random weights.
/// f32 vs f64 over a 2-layer model of width 32: rel L2 <= 1e-5 (f32 epsilon 6e-8 times
/// the depth of the sums, with margin).
#[test]
fn both_variants_match_f64_reference() {
    for pro in [true, false] {
        let syn = Synth {
            pro,
            seed: 11 + pro as u64,
            ..Synth::default()
        };
        let dir = write_model(&syn, "variant");
        let r = reference::RefModel::load(&dir);
        let x = ids(150, 32);
        let (_, want) = r.forward(&x);
        let want: Vec<f32> = want.concat().iter().map(|&v| v as f32).collect();
        let got = logits_of(&dir, &x, dense_opts());
        let (max, rel) = errors(&got, &want);
        eprintln!("pro={pro}: prefill max {max:.3e} rel {rel:.3e}");
        assert!(rel <= 1e-5, "pro={pro}: prefill rel {rel:.3e}");
        // ACP on (QK-norm bound, or observed norms for plain FoX) with certified eviction.
        let got = logits_of(&dir, &x, SessionOptions::default());
        let (_, rel) = errors(&got, &want);
        assert!(rel <= 1e-5, "pro={pro}: ACP prefill rel {rel:.3e}");
        // Streaming one token at a time.
        let model = Arc::new(Model::open(&dir).unwrap());
        let mut s = session(&model, SessionOptions::default());
        let mut st = vec![0.0f32; x.len() * 32];
        for (t, &id) in x.iter().enumerate() {
            s.feed(&[id], Some(&mut st[t * 32..(t + 1) * 32])).unwrap();
        }
        let (_, rel) = errors(&st, &want);
        assert!(rel <= 1e-5, "pro={pro}: streaming rel {rel:.3e}");
        std::fs::remove_dir_all(dir).ok();
    }
}

/// f16 and bf16 checkpoints load with their matrices used as stored (read in place from
/// the map, widened in the kernels' registers) and match the f64 reference run on the same
/// rounded weights.
#[test]
fn half_precision_weights() {
    for dtype in ["F16", "BF16"] {
        let syn = Synth {
            seed: 3,
            ..Synth::default()
        };
        let dir = write_model_dtype(&syn, "half", dtype);
        let model = Model::open(&dir).unwrap();
        assert_eq!(model.converted_weight_bytes(), 0, "{dtype}: read in place");
        let f = if dtype == "F16" {
            WeightFormat::F16
        } else {
            WeightFormat::Bf16
        };
        assert_eq!(model.weight_formats(), (f, f));
        let r = reference::RefModel::load(&dir);
        let x = ids(60, 32);
        let want: Vec<f32> = r.forward(&x).1.concat().iter().map(|&v| v as f32).collect();
        let (_, rel) = errors(&logits_of(&dir, &x, dense_opts()), &want);
        assert!(rel <= 1e-5, "{dtype}: rel {rel:.3e}");
        std::fs::remove_dir_all(dir).ok();
    }
    // The f32 fixture is used in place from the map.
    assert_eq!(tiny().converted_weight_bytes(), 0);
    assert_eq!(tiny().info().params, 3_818_768);
}

fn open_err(dir: &std::path::Path) -> foxedge::Error {
    match Model::open(dir) {
        Ok(_) => panic!("{} should fail to load", dir.display()),
        Err(e) => e,
    }
}

fn expect(dir: &std::path::Path, kind: ErrorKind, needle: &str) {
    let e = open_err(dir);
    let msg = e.to_string();
    eprintln!("{msg}");
    assert_eq!(e.kind(), kind, "{msg}");
    assert!(msg.contains(needle), "`{msg}` should mention `{needle}`");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn malformed_weight_files_are_clear_errors() {
    let syn = Synth::default();
    let cfg = config_json(&syn);
    let ts = tensors(&syn);
    let good = safetensors_bytes(&ts, "F32");

    // Truncated: in the data, in the header, before the header length.
    expect(
        &with_weights(&cfg, &good[..good.len() - 10], "trunc"),
        ErrorKind::BadModel,
        "truncated",
    );
    expect(
        &with_weights(&cfg, &good[..40], "trunc-h"),
        ErrorKind::BadModel,
        "header length",
    );
    expect(
        &with_weights(&cfg, &good[..5], "trunc-8"),
        ErrorKind::BadModel,
        "truncated",
    );
    // Corrupt header: not JSON; huge header length.
    let mut bad = good.clone();
    bad[9] = b'#';
    expect(
        &with_weights(&cfg, &bad, "json"),
        ErrorKind::BadModel,
        "JSON",
    );
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    expect(
        &with_weights(&cfg, &bad, "hlen"),
        ErrorKind::BadModel,
        "header length",
    );
    // Missing tensor.
    let missing: Vec<_> = ts
        .iter()
        .filter(|t| t.0 != "model.layers.1.attn.o_proj.weight")
        .cloned()
        .collect();
    expect(
        &with_weights(&cfg, &safetensors_bytes(&missing, "F32"), "missing"),
        ErrorKind::BadModel,
        "model.layers.1.attn.o_proj.weight",
    );
    // Extra tensor.
    let mut extra = ts.clone();
    extra.push((
        "model.layers.0.attn.mystery".into(),
        vec![2],
        vec![0.0, 1.0],
    ));
    expect(
        &with_weights(&cfg, &safetensors_bytes(&extra, "F32"), "extra"),
        ErrorKind::BadModel,
        "model.layers.0.attn.mystery",
    );
    // Wrong shape (same element count, transposed).
    let mut shp = ts.clone();
    let k = shp
        .iter()
        .position(|t| t.0 == "model.layers.0.attn.fgate_proj.weight")
        .unwrap();
    shp[k].1 = vec![32, 2];
    expect(
        &with_weights(&cfg, &safetensors_bytes(&shp, "F32"), "shape"),
        ErrorKind::BadModel,
        "fgate_proj.weight",
    );
    // Shape that overflows.
    let txt = String::from_utf8_lossy(
        &good[8..8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize],
    )
    .to_string();
    let over = txt.replacen("[32, 32]", "[18446744073709551615, 2]", 1);
    let mut b = (over.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(over.as_bytes());
    b.extend_from_slice(&good[8 + txt.len()..]);
    expect(
        &with_weights(&cfg, &b, "overflow"),
        ErrorKind::BadModel,
        "overflow",
    );
    // Non-finite weight.
    let mut nan = ts.clone();
    nan[3].2[5] = f32::NAN;
    let name = nan[3].0.clone();
    expect(
        &with_weights(&cfg, &safetensors_bytes(&nan, "F32"), "nan"),
        ErrorKind::BadModel,
        &name,
    );
    // Unsupported dtype.
    let i64hdr = txt.replacen("\"F32\"", "\"I64\"", 1);
    let mut b = (i64hdr.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(i64hdr.as_bytes());
    b.extend_from_slice(&good[8 + txt.len()..]);
    expect(
        &with_weights(&cfg, &b, "dtype"),
        ErrorKind::Unsupported,
        "I64",
    );
    // Missing files.
    let empty = temp_dir("empty");
    assert_eq!(open_err(&empty).kind(), ErrorKind::Io);
}

#[test]
fn malformed_configs_are_clear_errors() {
    let syn = Synth::default();
    let good = safetensors_bytes(&tensors(&syn), "F32");
    let cfg = config_json(&syn);
    let cases: Vec<(String, ErrorKind, &str)> = vec![
        ("{not json".into(), ErrorKind::BadModel, "JSON"),
        ("[1, 2]".into(), ErrorKind::BadModel, "object"),
        (
            cfg.replace("\"vocab_size\": 32,", ""),
            ErrorKind::BadModel,
            "vocab_size",
        ),
        (
            cfg.replace("\"hidden_size\": 32", "\"hidden_size\": -4"),
            ErrorKind::BadModel,
            "hidden_size",
        ),
        (
            cfg.replace("\"num_heads\": 2", "\"num_heads\": 3"),
            ErrorKind::BadModel,
            "num_heads",
        ),
        (
            cfg.replace("\"swish\"", "\"gelu\""),
            ErrorKind::Unsupported,
            "hidden_act",
        ),
        (
            cfg.replace("\"full\"", "\"bias_only\""),
            ErrorKind::Unsupported,
            "fgate_type",
        ),
        (
            cfg.replace("\"use_rope\": false", "\"use_rope\": true"),
            ErrorKind::Unsupported,
            "use_rope",
        ),
        (
            cfg.replace("\"num_kv_heads\": null", "\"num_kv_heads\": 1"),
            ErrorKind::Unsupported,
            "num_kv_heads",
        ),
        (
            cfg.replace(
                "\"log_pruning_tolerance\": null",
                "\"log_pruning_tolerance\": 3",
            ),
            ErrorKind::BadModel,
            "log_pruning_tolerance",
        ),
        (
            cfg.replace("\"qk_norm\": true", "\"qk_norm\": \"yes\""),
            ErrorKind::BadModel,
            "qk_norm",
        ),
        // A valid config that does not match the weights: shapes named.
        (
            cfg.replace("\"intermediate_size\": null", "\"intermediate_size\": 512"),
            ErrorKind::BadModel,
            "mlp.gate_proj.weight",
        ),
    ];
    for (text, kind, needle) in cases {
        expect(&with_weights(&text, &good, "cfg"), kind, needle);
    }
}
