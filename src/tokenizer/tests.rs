use super::*;
use proptest::prelude::*;

/// A fresh directory holding `files`, removed when dropped.
fn dir_with(tag: &str, files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix(&format!("foxedge-tok-{tag}-"))
        .tempdir()
        .unwrap();
    for (name, bytes) in files {
        std::fs::write(d.path().join(name), bytes).unwrap();
    }
    d
}

/// A tiny byte-level BPE: the 256 byte characters (ids 0..256 in byte order), then the
/// merges `h e`, `l l`, `he ll`, `Ġ w`, and `<|end|>` at 262.
fn tiny_vocab_merges() -> (String, String) {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(bpe::byte_char(b).to_string(), (b as u32).into());
    }
    for (i, t) in ["he", "ll", "hell", "Ġw", "<|end|>"].iter().enumerate() {
        vocab.insert(t.to_string(), (256 + i as u32).into());
    }
    let vocab = serde_json::Value::Object(vocab).to_string();
    (vocab, "#version: 0.2\nh e\nl l\nhe ll\nĠ w\n".to_string())
}

fn tiny_config(class: &str) -> String {
    format!(
        r#"{{"add_bos_token": true, "bos_token": "<|end|>", "eos_token": "<|end|>",
            "tokenizer_class": "{class}"}}"#
    )
}

fn tiny(class: &str) -> Tokenizer {
    let (v, m) = tiny_vocab_merges();
    let cfg = tiny_config(class);
    let d = dir_with(
        "tiny",
        &[
            ("vocab.json", v.as_bytes()),
            ("merges.txt", m.as_bytes()),
            ("tokenizer_config.json", cfg.as_bytes()),
        ],
    );
    Tokenizer::from_dir(d.path(), 300).unwrap()
}

#[test]
fn byte_tokenizer_for_a_256_vocabulary_without_files() {
    let d = dir_with("bytes", &[]);
    let t = Tokenizer::from_dir(d.path(), 256).unwrap();
    assert_eq!(t.source(), TokenizerSource::Bytes);
    assert_eq!(t.encode("hé", true).unwrap(), vec![0, 104, 0xC3, 0xA9]);
    assert_eq!(t.encode("hé", false).unwrap(), vec![104, 0xC3, 0xA9]);
    assert_eq!((t.bos(), t.eos(), t.adds_bos()), (Some(0), Some(0), true));
    assert_eq!(t.decode(&[0, 104, 0xC3, 0xA9], true).unwrap(), "hé");
    assert_eq!(t.decode(&[104, 0xC3], false).unwrap(), "h\u{fffd}");
    assert!(t.decode(&[256], false).is_err());
}

#[test]
fn no_tokenizer_for_another_vocabulary_is_a_named_error() {
    let d = dir_with("none", &[]);
    let e = Tokenizer::from_dir(d.path(), 300).unwrap_err();
    assert!(matches!(e, Error::NoTokenizer { vocab: 300, .. }), "{e}");
    assert_eq!(e.kind(), crate::ErrorKind::Unsupported);
}

#[test]
fn tiny_bpe_encodes_merges_and_bos() {
    let t = tiny("GPT2Tokenizer");
    assert_eq!(t.source(), TokenizerSource::VocabMerges);
    assert_eq!((t.bos(), t.eos(), t.size()), (Some(260), Some(260), 261));
    // "hello world": hell + o, Ġw + o r l d.
    let ids = t.encode("hello world", true).unwrap();
    assert_eq!(ids, vec![260, 258, b'o' as u32, 259, 111, 114, 108, 100]);
    assert_eq!(t.decode(&ids, true).unwrap(), "hello world");
    assert_eq!(t.decode(&ids, false).unwrap(), "<|end|>hello world");
    // Special-token text is the special token.
    assert_eq!(t.encode("a<|end|>", false).unwrap(), vec![97, 260]);
    assert!(t.is_special(260) && !t.is_special(97));
}

#[test]
fn json_class_escapes_before_bpe_and_unescapes_after() {
    let t = tiny(JSON_GPT2_CLASS);
    assert!(t.json_escaped());
    let text = "a\"é\n🦊";
    let ids = t.encode(text, false).unwrap();
    let escaped = json_escape::escape(text);
    assert_eq!(ids, escaped.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(t.decode(&ids, false).unwrap(), text);
}

#[test]
fn stream_pieces_concatenate_to_the_decode_and_hold_partial_escapes() {
    let t = tiny(JSON_GPT2_CLASS);
    let ids = t.encode("x🦊y\n", true).unwrap();
    let mut s = t.stream(true);
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(s.push(id).unwrap());
    }
    pieces.push(s.finish());
    assert_eq!(pieces.concat(), "x🦊y\n");
    // No piece holds half of the surrogate-pair escape.
    assert!(pieces.iter().all(|p| !p.contains('\\')), "{pieces:?}");
    assert!(pieces.contains(&"🦊".to_string()), "{pieces:?}");
    // An unknown id is an error and leaves the stream as it was.
    assert!(s.push(9999).is_err());
    assert_eq!(s.push(b'k' as u32).unwrap(), "k");
}

#[test]
fn tokenizer_json_gives_the_same_ids() {
    let (v, m) = tiny_vocab_merges();
    let vocab = bpe::parse_vocab(&v, "vocab.json", 300).unwrap();
    let merges = bpe::parse_merges(&m).unwrap();
    let mut hf = bpe::gpt2_tokenizer(vocab, merges).unwrap();
    hf.add_special_tokens([AddedToken::from("<|end|>", true)])
        .unwrap();
    let json = hf.to_string(false).unwrap();
    let cfg = tiny_config("GPT2Tokenizer");
    let d = dir_with(
        "json",
        &[
            ("tokenizer.json", json.as_bytes()),
            ("tokenizer_config.json", cfg.as_bytes()),
        ],
    );
    let a = Tokenizer::from_dir(d.path(), 300).unwrap();
    assert_eq!(a.source(), TokenizerSource::TokenizerJson);
    let b = tiny("GPT2Tokenizer");
    for text in ["hello world", "", "  x\n\ny", "é🦊<|end|>"] {
        assert_eq!(a.encode(text, true).unwrap(), b.encode(text, true).unwrap());
        let ids = b.encode(text, true).unwrap();
        assert_eq!(a.decode(&ids[1..], false).unwrap(), text);
    }
}

#[test]
fn other_decoders_stream_through_the_pipeline() {
    let json = r###"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3},
                  "unk_token": "[UNK]"}}"###;
    let d = dir_with("wordlevel", &[("tokenizer.json", json.as_bytes())]);
    let t = Tokenizer::from_dir(d.path(), 4).unwrap();
    let ids = t.encode("hello world !", true).unwrap();
    assert_eq!(ids, vec![1, 2, 3]);
    let whole = t.decode(&ids, false).unwrap();
    assert_eq!(whole, "hello world !");
    let mut s = t.stream(false);
    let mut text = String::new();
    for &id in &ids {
        text.push_str(&s.push(id).unwrap());
    }
    text.push_str(&s.finish());
    assert_eq!(text, whole);
    assert!(t.decode(&[4], false).is_err());
    // Ids beyond the model's logits are refused at load.
    let e = Tokenizer::from_dir(d.path(), 3).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
}

#[test]
fn corrupt_or_partial_files_are_named_errors() {
    let (v, m) = tiny_vocab_merges();
    type Files<'a> = Vec<(&'a str, &'a [u8])>;
    let cases: Vec<(Files, &str)> = vec![
        (vec![("vocab.json", v.as_bytes())], "merges.txt: missing"),
        (vec![("merges.txt", m.as_bytes())], "vocab.json: missing"),
        (
            vec![("vocab.json", b"{\"a\": 0"), ("merges.txt", m.as_bytes())],
            "vocab.json: invalid JSON",
        ),
        (
            vec![("vocab.json", v.as_bytes()), ("merges.txt", b"h e\nq z\n")],
            "merges.txt: merge 2",
        ),
        (
            vec![("vocab.json", v.as_bytes()), ("merges.txt", b"\xff\xfe")],
            "merges.txt: not UTF-8",
        ),
        (
            vec![
                ("vocab.json", v.as_bytes()),
                ("merges.txt", m.as_bytes()),
                ("tokenizer_config.json", b"{\"bos_token\": \"<s>\"}"),
            ],
            "vocab.json: has no token \"<s>\"",
        ),
        (
            vec![
                ("vocab.json", v.as_bytes()),
                ("merges.txt", m.as_bytes()),
                ("tokenizer_config.json", b"{\"add_bos_token\": true}"),
            ],
            "no bos_token",
        ),
        (
            vec![
                ("vocab.json", v.as_bytes()),
                ("merges.txt", m.as_bytes()),
                (
                    "tokenizer_config.json",
                    b"{\"added_tokens_decoder\": {\"7\": {\"content\": \"<|end|>\"}}}",
                ),
            ],
            "vocab.json gives 260",
        ),
        (
            vec![("tokenizer.json", b"{}")],
            "tokenizer.json: no `model`",
        ),
        (
            vec![(
                "tokenizer.json",
                br#"{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}"#,
            )],
            "tokenizer.json: merge 1",
        ),
        (vec![("tokenizer.json", b"\"x\"")], "tokenizer.json"),
    ];
    for (files, want) in cases {
        let d = dir_with("bad", &files);
        let e = Tokenizer::from_dir(d.path(), 300).unwrap_err();
        assert!(e.to_string().contains(want), "want {want:?}, got {e}");
        assert_eq!(e.kind(), crate::ErrorKind::BadModel, "{e}");
    }
}

proptest! {
    #[test]
    fn tiny_bpe_round_trips_and_streams(text in any::<String>(), json in any::<bool>()) {
        let t = tiny(if json { JSON_GPT2_CLASS } else { "GPT2Tokenizer" });
        let ids = t.encode(&text, true).unwrap();
        prop_assert_eq!(&t.decode(&ids, true).unwrap(), &text);
        let mut s = t.stream(true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&s.push(id).unwrap());
        }
        out.push_str(&s.finish());
        prop_assert_eq!(out, text);
    }

    #[test]
    fn byte_streams_decode_like_the_whole(ids in prop::collection::vec(0u32..256, 0..64)) {
        let t = Tokenizer::bytes();
        let whole = t.decode(&ids, false).unwrap();
        let mut s = t.stream(false);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&s.push(id).unwrap());
        }
        out.push_str(&s.finish());
        prop_assert_eq!(out, whole);
    }
}

#[test]
fn tokenizers_and_decoders_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<StreamDecoder>();
    send_sync::<crate::Sampler>();
}
