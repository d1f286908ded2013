//! Tokenizers against reference ids: GPT-2 (r50k) and LongCrawl64's JSON-escaped GPT-2, made
//! by Python `tiktoken` (tests/fixtures/gpt2/make_reference.py); streaming decoding; a model
//! directory laid out like the official FoX checkpoints; directories without a tokenizer.

mod common;

use common::synth::{Synth, gpt2_dir, write_model_dtype, write_official_tokenizer};
use foxedge::tokenizer::JSON_GPT2_CLASS;
use foxedge::{
    Error, Model, Sampler, SamplerConfig, Session, SessionOptions, Tokenizer, TokenizerSource,
};
use proptest::prelude::*;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

const EOT: u32 = 50256;

/// GPT-2 as `transformers` loads it: `<|endoftext|>` special, no BOS added, no escaping.
fn plain() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let d = common::synth::temp_dir("gpt2");
        for f in ["vocab.json", "merges.txt"] {
            std::fs::copy(gpt2_dir().join(f), d.join(f)).unwrap();
        }
        let cfg = r#"{"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}"#;
        std::fs::write(d.join("tokenizer_config.json"), cfg).unwrap();
        Tokenizer::from_dir(&d, 50257).unwrap()
    })
}

fn json() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let d = common::synth::temp_dir("jsongpt2");
        write_official_tokenizer(&d);
        Tokenizer::from_dir(&d, 50257).unwrap()
    })
}

fn reference() -> Value {
    let text = std::fs::read_to_string(gpt2_dir().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Pieces of a streamed decode (the last one from `finish`).
fn stream(t: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut s = t.stream(skip_special);
    let mut pieces: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
    pieces.push(s.finish());
    pieces
}

#[test]
fn gpt2_ids_equal_tiktoken_r50k() {
    let t = plain();
    assert_eq!(t.source(), TokenizerSource::VocabMerges);
    assert_eq!(
        (t.size(), t.adds_bos(), t.json_escaped()),
        (50257, false, false)
    );
    let r = reference();
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids_of(&c["gpt2"]);
        assert_eq!(t.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(t.decode(&want, false).unwrap(), text, "{text:?}");
        assert_eq!(stream(t, &want, false).concat(), text, "{text:?}");
    }
}

#[test]
fn jsongpt2_ids_equal_tiktoken_of_json_dumps() {
    let t = json();
    assert!(t.json_escaped() && t.adds_bos());
    assert_eq!((t.bos(), t.eos()), (Some(EOT), Some(EOT)));
    let r = reference();
    assert_eq!(r["bos"].as_u64(), Some(u64::from(EOT)));
    for c in r["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids_of(&c["json_gpt2"]);
        assert_eq!(
            foxedge::tokenizer::json_escape::escape(text),
            c["escaped"].as_str().unwrap()
        );
        assert_eq!(t.encode(text, false).unwrap(), want, "{text:?}");
        let mut with_bos = vec![EOT];
        with_bos.extend(&want);
        assert_eq!(t.encode(text, true).unwrap(), with_bos, "{text:?}");
        assert_eq!(t.decode(&want, false).unwrap(), text, "{text:?}");
        if !text.contains("<|endoftext|>") {
            assert_eq!(t.decode(&with_bos, true).unwrap(), text, "{text:?}");
        }
        let pieces = stream(t, &want, false);
        assert_eq!(pieces.concat(), text, "{text:?}");
        // No piece ends inside an escape: every piece is text of the original.
        if !text.contains('\\') {
            assert!(pieces.iter().all(|p| !p.contains('\\')), "{pieces:?}");
        }
    }
}

#[test]
fn jsongpt2_decodes_model_output_like_json_loads() {
    let r = reference();
    for c in r["unescape"].as_array().unwrap() {
        let bpe_text = c["bpe_text"].as_str().unwrap();
        let ids = plain().encode(bpe_text, false).unwrap();
        assert_eq!(
            json().decode(&ids, false).unwrap(),
            c["text"].as_str().unwrap()
        );
    }
    // The BOS text is kept unless special tokens are skipped.
    assert_eq!(json().decode(&[EOT, 71], false).unwrap(), "<|endoftext|>h");
    assert_eq!(json().decode(&[EOT, 71], true).unwrap(), "h");
    assert!(json().decode(&[50257], false).is_err());
}

#[test]
fn streaming_never_splits_a_character() {
    // "🦊" is one token per byte group in GPT-2: its 4 UTF-8 bytes span several tokens.
    let t = plain();
    let ids = t.encode("a🦊b日本", false).unwrap();
    let pieces = stream(t, &ids, false);
    assert_eq!(pieces.concat(), "a🦊b日本");
    assert!(ids.len() > 4, "{ids:?}");
    assert!(
        pieces.iter().any(|p| p.is_empty()),
        "some ids complete nothing"
    );
    // A truncated character at the end becomes U+FFFD, as in the whole decode.
    let cut = &ids[..2];
    assert_eq!(
        stream(t, cut, false).concat(),
        t.decode(cut, false).unwrap()
    );
    assert!(t.decode(cut, false).unwrap().ends_with('\u{fffd}'));
}

#[test]
fn official_layout_model_directory_runs_text_in_and_out() {
    let s = Synth {
        vocab: 50257,
        hidden: 16,
        layers: 2,
        heads: 2,
        pro: true,
        seed: 11,
        const_gate_logit: None,
    };
    let dir = write_model_dtype(&s, "official", "BF16");
    write_official_tokenizer(&dir);
    let model = Arc::new(Model::open(&dir).unwrap());
    let vocab = model.info().vocab;
    let tok = Tokenizer::from_dir(&dir, vocab).unwrap();
    assert_eq!(
        (tok.bos(), tok.eos(), tok.adds_bos(), tok.json_escaped()),
        (Some(EOT), Some(EOT), true, true)
    );
    let prompt = tok.encode("Hello \"world\"\n", true).unwrap();
    assert_eq!(prompt[0], EOT);
    let mut session = Session::new(model, SessionOptions::default()).unwrap();
    let mut logits = vec![0.0f32; vocab];
    session.feed(&prompt, Some(&mut logits)).unwrap();
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.1,
        repetition_window: 32,
        seed: 5,
    })
    .unwrap();
    sampler.accept(&prompt);
    let mut dec = tok.stream(true);
    let mut ids = Vec::new();
    let mut text = String::new();
    for _ in 0..12 {
        let id = sampler.sample(&logits).unwrap();
        ids.push(id);
        text.push_str(&dec.push(id).unwrap());
        session.feed(&[id], Some(&mut logits)).unwrap();
    }
    text.push_str(&dec.finish());
    assert_eq!(text, tok.decode(&ids, true).unwrap());
}

#[test]
fn directories_without_tokenizer_files() {
    // The bundled byte-level model.
    let bundled = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(foxedge::BUNDLED_MODEL);
    let t = Tokenizer::from_dir(&bundled, 256).unwrap();
    assert_eq!(t.source(), TokenizerSource::Bytes);
    assert_eq!(t.encode("hi", true).unwrap(), vec![0, 104, 105]);
    // Another vocabulary: the model opens and runs on ids; text is a named error.
    let s = Synth {
        vocab: 300,
        ..Synth::default()
    };
    let dir = write_model_dtype(&s, "notok", "F32");
    let model = Arc::new(Model::open(&dir).unwrap());
    let mut session = Session::new(model, SessionOptions::default()).unwrap();
    let mut logits = vec![0.0f32; 300];
    session.feed(&[1, 299, 7], Some(&mut logits)).unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let e = Tokenizer::from_dir(&dir, 300).unwrap_err();
    assert!(matches!(e, Error::NoTokenizer { vocab: 300, .. }), "{e}");
    assert!(e.to_string().contains("no tokenizer"), "{e}");
}

#[test]
fn without_a_configuration_special_token_text_is_plain_text() {
    let t = Tokenizer::from_dir(gpt2_dir(), 50257).unwrap();
    assert_eq!((t.bos(), t.eos(), t.adds_bos()), (None, None, false));
    let ids = t.encode("a<|endoftext|>", true).unwrap();
    assert_eq!(ids, vec![64, 27, 91, 437, 1659, 5239, 91, 29]);
    assert_eq!(t.decode(&[50256], true).unwrap(), "<|endoftext|>");
}

#[test]
fn a_tokenizer_larger_than_the_model_is_refused() {
    let e = Tokenizer::from_dir(gpt2_dir(), 50000).unwrap_err();
    assert!(e.to_string().contains("vocab.json"), "{e}");
    assert!(
        e.to_string()
            .contains("below the model's vocabulary size 50000"),
        "{e}"
    );
}

#[test]
fn json_class_name_is_the_official_one() {
    assert_eq!(JSON_GPT2_CLASS, "JSONGPT2Tokenizer");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn gpt2_round_trips_and_streams(text in any::<String>()) {
        for t in [plain(), json()] {
            let ids = t.encode(&text, true).unwrap();
            prop_assert_eq!(&t.decode(&ids, true).unwrap(), &text);
            prop_assert_eq!(stream(t, &ids, true).concat(), text.clone());
        }
    }

    #[test]
    fn gpt2_streams_arbitrary_ids_like_the_whole(ids in prop::collection::vec(0u32..50257, 0..24)) {
        for t in [plain(), json()] {
            let whole = t.decode(&ids, false).unwrap();
            prop_assert_eq!(stream(t, &ids, false).concat(), whole);
        }
    }
}
