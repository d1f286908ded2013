//! Quantized model files (written by `Model::save` / `foxedge quantize`): they load as
//! written, and damaged ones (truncated, a bad metadata entry, a wrong byte count, a
//! non-finite block scale) fail with named errors, never a panic.

mod common;

use common::synth::*;
use foxedge::{ErrorKind, Model, ModelOptions, WeightFormat};
use std::path::Path;

/// A synthetic model saved with its dense layers in `f`: (directory, file bytes).
fn quantized(f: WeightFormat, tag: &str) -> (TestDir, Vec<u8>) {
    let src = write_model(&Synth::default(), &format!("{tag}-src"));
    let opts = ModelOptions {
        weights: Some(f),
        ..ModelOptions::default()
    };
    let model = Model::open_with(&src, &opts).expect("synthetic model quantizes");
    let dir = temp_dir(tag);
    model.save(&dir, &|_, _| {}).expect("save");
    drop(src);
    let bytes = read(&dir.join("model.safetensors"));
    (dir, bytes)
}

/// The header JSON of a safetensors file and the data after it.
fn split(bytes: &[u8]) -> (serde_json::Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let h = serde_json::from_slice(&bytes[8..8 + n]).expect("header JSON");
    (h, &bytes[8 + n..])
}

/// A file with header `h` and `data`.
fn join(h: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let text = serde_json::to_vec(h).unwrap();
    let mut b = (text.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&text);
    b.extend_from_slice(data);
    b
}

fn expect(dir: &Path, bytes: &[u8], kind: ErrorKind, needles: &[&str]) {
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let e = match Model::open(dir) {
        Ok(_) => panic!("should fail: {needles:?}"),
        Err(e) => e,
    };
    let msg = e.to_string();
    eprintln!("{msg}");
    assert_eq!(e.kind(), kind, "{msg}");
    for n in needles {
        assert!(msg.contains(n), "`{msg}` should mention `{n}`");
    }
}

const Q: &str = "model.layers.0.attn.q_proj.weight";

#[test]
fn saved_files_are_aligned_and_described() {
    for f in [WeightFormat::Q8, WeightFormat::Q4] {
        let (dir, bytes) = quantized(f, &format!("layout-{f}"));
        let (h, _) = split(&bytes);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + n) % 64, 0, "data starts on a 64-byte boundary");
        let meta: serde_json::Value =
            serde_json::from_str(h["__metadata__"][Q].as_str().unwrap()).unwrap();
        assert_eq!(meta["format"], f.name());
        assert_eq!(meta["layout"], "packed16");
        assert_eq!(meta["shape"], serde_json::json!([32, 32]));
        assert_eq!(h[Q]["dtype"], "U8");
        let start = h[Q]["data_offsets"][0].as_u64().unwrap();
        assert_eq!(start % 64, 0, "packed tensors start on 64-byte boundaries");
        // Small projections and vectors keep their dtype.
        assert_eq!(h["model.layers.0.attn.fgate_proj.weight"]["dtype"], "F32");
        assert_eq!(h["model.norm.weight"]["dtype"], "F32");
        let m = Model::open(&dir).expect("opens");
        assert_eq!(m.weight_formats(), (f, f));
        assert_eq!(m.converted_weight_bytes(), 0);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn damaged_quantized_files_are_named_errors() {
    let (dir, good) = quantized(WeightFormat::Q8, "damaged");
    let (h, data) = split(&good);
    assert!(Model::open(&dir).is_ok());

    expect(
        &dir,
        &good[..good.len() / 2],
        ErrorKind::BadModel,
        &["truncated"],
    );
    expect(
        &dir,
        &good[..good.len() - 1],
        ErrorKind::BadModel,
        &["truncated"],
    );

    let entry = |e: &str| {
        let mut h = h.clone();
        h["__metadata__"][Q] = serde_json::Value::String(e.into());
        join(&h, data)
    };
    expect(
        &dir,
        &entry(r#"{"format":"q9","layout":"packed16","shape":[32,32]}"#),
        ErrorKind::Unsupported,
        &[Q, "q9"],
    );
    expect(
        &dir,
        &entry(r#"{"format":"q8","layout":"rowmajor","shape":[32,32]}"#),
        ErrorKind::Unsupported,
        &[Q, "layout `rowmajor`"],
    );
    expect(
        &dir,
        &entry(r#"{"format":"q8","layout":"packed16"}"#),
        ErrorKind::BadModel,
        &[Q, "not valid"],
    );
    expect(
        &dir,
        &entry("not json"),
        ErrorKind::BadModel,
        &[Q, "not valid"],
    );
    // Another logical shape of the same packed size, and one of another size.
    expect(
        &dir,
        &entry(r#"{"format":"q8","layout":"packed16","shape":[32,31]}"#),
        ErrorKind::BadModel,
        &[Q, "shape [32, 31], expected [32, 32]"],
    );
    expect(
        &dir,
        &entry(r#"{"format":"q8","layout":"packed16","shape":[64,32]}"#),
        ErrorKind::BadModel,
        &[Q, "U8 shape [2176], expected [4352]"],
    );
    // The entry removed: a U8 tensor nothing describes.
    let mut bare = h.clone();
    bare["__metadata__"].as_object_mut().unwrap().remove(Q);
    expect(
        &dir,
        &join(&bare, data),
        ErrorKind::Unsupported,
        &[Q, "U8 without"],
    );
    // A NaN block scale (row 3, block 0 of the first tile).
    let start = h[Q]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut nan = data.to_vec();
    nan[start + 6..start + 8].copy_from_slice(&half::f16::NAN.to_le_bytes());
    expect(
        &dir,
        &join(&h, &nan),
        ErrorKind::BadModel,
        &[Q, "scale of row 3, block 0 is not finite"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Any one-byte change or truncation of a quantized file opens (and runs) or fails with a
/// named error, never a panic.
#[test]
fn byte_flips_never_panic() {
    let (dir, good) = quantized(WeightFormat::Q4, "flips");
    let mut seed = 7u64;
    for i in 0..60 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut b = good.clone();
        if i % 4 == 0 {
            b.truncate((seed >> 20) as usize % good.len());
        } else {
            let at = (seed >> 20) as usize % good.len();
            b[at] ^= 1 << (seed % 8);
        }
        std::fs::write(dir.join("model.safetensors"), &b).unwrap();
        match Model::open(&dir) {
            Ok(m) => {
                let m = std::sync::Arc::new(m);
                let mut s = foxedge::Session::new(m.clone(), Default::default()).unwrap();
                let mut l = vec![0.0f32; m.info().vocab];
                let _ = s.feed(&[1, 2, 3], Some(&mut l));
            }
            Err(e) => assert_ne!(e.kind(), ErrorKind::Internal, "{e}"),
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
