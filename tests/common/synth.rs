//! Synthetic FoX checkpoints for tests: a config and a safetensors file with seeded random
//! weights, written into a fresh temporary directory, plus raw safetensors writing for the
//! malformed-file tests.

use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

/// Knobs of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Synth {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    /// FoX Pro (QK-norm, shifts, output gate + norm) or plain FoX (LLaMA variant).
    pub pro: bool,
    pub seed: u64,
    /// When set, every forget gate is this constant logit (weights 0, bias = value).
    pub const_gate_logit: Option<f32>,
}

impl Default for Synth {
    fn default() -> Self {
        Synth {
            vocab: 32,
            hidden: 32,
            layers: 2,
            heads: 2,
            pro: true,
            seed: 1,
            const_gate_logit: None,
        }
    }
}

/// A directory of a test under the system temp dir, removed with everything in it when
/// dropped; it derefs to its path.
#[derive(Debug)]
pub struct TestDir(tempfile::TempDir);

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<std::ffi::OsStr> for TestDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.path().as_os_str()
    }
}

/// A new empty directory under the system temp dir (removed when dropped).
pub fn temp_dir(tag: &str) -> TestDir {
    TestDir(
        tempfile::Builder::new()
            .prefix(&format!("foxedge-test-{tag}-"))
            .tempdir()
            .unwrap(),
    )
}

pub fn config_json(s: &Synth) -> String {
    format!(
        r#"{{"vocab_size": {}, "hidden_size": {}, "hidden_ratio": 4, "intermediate_size": null,
  "num_hidden_layers": {}, "num_heads": {}, "num_kv_heads": null, "hidden_act": "swish",
  "window_size": null, "norm_eps": 1e-06, "tie_word_embeddings": false, "use_rope": false,
  "use_output_gate": {p}, "ogate_act": "sigmoid", "fgate_type": "full", "use_output_norm": {p},
  "qk_norm": {p}, "qk_norm_share_param_across_head": false, "use_k_shift": {p},
  "use_v_shift": {p}, "log_pruning_tolerance": null}}"#,
        s.vocab,
        s.hidden,
        s.layers,
        s.heads,
        p = s.pro
    )
}

/// (name, shape, values) of every tensor of the synthetic model.
pub fn tensors(s: &Synth) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(s.seed);
    let (v, d, h) = (s.vocab, s.hidden, s.heads);
    let i = (d as f64 * 4.0 * 2.0 / 3.0) as usize;
    let i = i.div_ceil(256) * 256;
    let mut out = Vec::new();
    let mut add =
        |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut rand::rngs::StdRng| {
            let n: usize = shape.iter().product();
            let vals = (0..n)
                .map(|_| offset + scale * rng.gen_range(-1.0f32..1.0))
                .collect();
            out.push((name, shape, vals));
        };
    let ws = 1.0 / (d as f32).sqrt();
    add(
        "model.embeddings.weight".into(),
        vec![v, d],
        1.0,
        0.0,
        &mut rng,
    );
    for l in 0..s.layers {
        let p = |x: &str| format!("model.layers.{l}.{x}");
        add(p("attn_norm.weight"), vec![d], 0.2, 1.0, &mut rng);
        add(p("attn.q_proj.weight"), vec![d, d], ws, 0.0, &mut rng);
        for which in ["k_proj", "v_proj"] {
            if s.pro {
                add(
                    p(&format!("attn.{which}.linear.weight")),
                    vec![d, d],
                    ws,
                    0.0,
                    &mut rng,
                );
                add(
                    p(&format!("attn.{which}.shift_proj.weight")),
                    vec![h, d],
                    ws,
                    0.0,
                    &mut rng,
                );
            } else {
                add(
                    p(&format!("attn.{which}.weight")),
                    vec![d, d],
                    ws,
                    0.0,
                    &mut rng,
                );
            }
        }
        add(p("attn.o_proj.weight"), vec![d, d], ws, 0.0, &mut rng);
        match s.const_gate_logit {
            Some(z) => {
                add(p("attn.fgate_proj.weight"), vec![h, d], 0.0, 0.0, &mut rng);
                add(p("attn.fgate_proj.bias"), vec![h], 0.0, z, &mut rng);
            }
            None => {
                add(
                    p("attn.fgate_proj.weight"),
                    vec![h, d],
                    ws * 2.0,
                    0.0,
                    &mut rng,
                );
                add(p("attn.fgate_proj.bias"), vec![h], 1.5, 2.0, &mut rng);
            }
        }
        if s.pro {
            add(p("attn.ogate_proj.weight"), vec![d, d], ws, 0.0, &mut rng);
            add(p("attn.output_norm.weight"), vec![d], 0.2, 1.0, &mut rng);
            add(p("attn.q_norm.weight"), vec![d], 0.3, 1.0, &mut rng);
            add(p("attn.k_norm.weight"), vec![d], 0.3, 1.0, &mut rng);
        }
        add(p("mlp_norm.weight"), vec![d], 0.2, 1.0, &mut rng);
        add(p("mlp.gate_proj.weight"), vec![2 * i, d], ws, 0.0, &mut rng);
        add(
            p("mlp.down_proj.weight"),
            vec![d, i],
            1.0 / (i as f32).sqrt(),
            0.0,
            &mut rng,
        );
    }
    add("model.norm.weight".into(), vec![d], 0.2, 1.0, &mut rng);
    add("lm_head.weight".into(), vec![v, d], ws, 0.0, &mut rng);
    out
}

/// Serializes tensors as safetensors bytes with the given dtype ("F32", "F16", "BF16"),
/// header padded to 8 bytes.
pub fn safetensors_bytes(ts: &[(String, Vec<usize>, Vec<f32>)], dtype: &str) -> Vec<u8> {
    let size = if dtype == "F32" { 4 } else { 2 };
    let mut header = String::from("{");
    let mut off = 0usize;
    for (k, (name, shape, vals)) in ts.iter().enumerate() {
        let n = vals.len() * size;
        if k > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
            off + n
        ));
        off += n;
    }
    header.push('}');
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for (_, _, vals) in ts {
        for &x in vals {
            match dtype {
                "F32" => out.extend_from_slice(&x.to_le_bytes()),
                "F16" => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
                _ => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            }
        }
    }
    out
}

/// GPT-2's `vocab.json` and `merges.txt` (with the tiktoken reference ids).
pub fn gpt2_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2")
}

/// tokenizer_config.json of the official FoX checkpoints (the fields that matter here).
pub const OFFICIAL_CONFIG: &str = r#"{
  "add_bos_token": true, "add_prefix_space": false,
  "added_tokens_decoder": {"50256": {"content": "<|endoftext|>", "lstrip": false,
    "normalized": true, "rstrip": false, "single_word": false, "special": true}},
  "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": true,
  "eos_token": "<|endoftext|>", "model_max_length": 1024,
  "tokenizer_class": "JSONGPT2Tokenizer", "unk_token": "<|endoftext|>"
}"#;

/// special_tokens_map.json of the official FoX checkpoints.
pub const OFFICIAL_MAP: &str = r#"{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
  "unk_token": "<|endoftext|>"}"#;

/// Copies GPT-2's files and the official configs into `dir`: with a model of vocabulary
/// 50257 it is laid out like the official checkpoints.
pub fn write_official_tokenizer(dir: &Path) {
    for f in ["vocab.json", "merges.txt"] {
        std::fs::copy(gpt2_dir().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("tokenizer_config.json"), OFFICIAL_CONFIG).unwrap();
    std::fs::write(dir.join("special_tokens_map.json"), OFFICIAL_MAP).unwrap();
}

/// Writes a synthetic model directory and returns its path.
pub fn write_model(s: &Synth, tag: &str) -> TestDir {
    write_model_dtype(s, tag, "F32")
}

pub fn write_model_dtype(s: &Synth, tag: &str, dtype: &str) -> TestDir {
    let dir = temp_dir(tag);
    std::fs::write(dir.join("config.json"), config_json(s)).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors_bytes(&tensors(s), dtype),
    )
    .unwrap();
    dir
}

/// Copies a model directory's config and replaces its weights file with `bytes`.
pub fn with_weights(config: &str, bytes: &[u8], tag: &str) -> TestDir {
    let dir = temp_dir(tag);
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir
}

pub fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}
