//! Fuzzes tokenizer loading: bytes -> tokenizer files in a model directory ->
//! `Tokenizer::from_dir`, then encoding, decoding and streaming with what loaded.
//!
//! Input: byte 0 selects the fuzzed file (mod 6); the rest is its content, the other files
//! are those of a valid tiny byte-level BPE (vocab.json: the 256 byte characters + "he", "ll",
//! "hell", "<|end|>"; merges.txt; tokenizer_config.json naming `<|end|>` BOS/EOS, JSON class):
//! 0 vocab.json, 1 merges.txt, 2 tokenizer.json (alone), 3 tokenizer_config.json,
//! 4 special_tokens_map.json, 5 vocab.json and merges.txt (bytes 1-2 LE: vocab.json length).
//! Loading must give Ok or a named error (`Error::Tokenizer`, `Error::Io`, ...), never a
//! panic or `Error::Internal`; a loaded tokenizer must encode, decode and stream without
//! panicking, and (vocab.json + merges.txt) its stream must concatenate to its decode.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use foxedge::{Error, Tokenizer, TokenizerSource};
use libfuzzer_sys::fuzz_target;

/// The model's vocabulary the tokenizer must fit.
const VOCAB: usize = 300;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("foxedge-fuzz-tok-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    })
}

/// GPT-2's byte-level alphabet (see foxedge's tokenizer::bpe).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + rank).expect("valid char")
    }
}

fn tiny_vocab() -> &'static str {
    static V: OnceLock<String> = OnceLock::new();
    V.get_or_init(|| {
        let mut parts: Vec<String> = (0..=255u8)
            .map(|b| {
                let key = byte_char(b)
                    .to_string()
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"");
                format!("\"{key}\": {b}")
            })
            .collect();
        for (i, t) in ["he", "ll", "hell", "<|end|>"].iter().enumerate() {
            parts.push(format!("\"{t}\": {}", 256 + i));
        }
        format!("{{{}}}", parts.join(", "))
    })
}

const TINY_MERGES: &str = "#version: 0.2\nh e\nl l\nhe ll\n";
const TINY_CONFIG: &str = r#"{"add_bos_token": true, "bos_token": "<|end|>",
  "eos_token": "<|end|>", "tokenizer_class": "JSONGPT2Tokenizer"}"#;
const FILES: [&str; 5] = [
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let d = dir();
    for f in FILES {
        let _ = std::fs::remove_file(d.join(f));
    }
    let write = |name: &str, bytes: &[u8]| std::fs::write(d.join(name), bytes).expect("write");
    let base = |skip: &str| {
        for (name, text) in [
            ("vocab.json", tiny_vocab()),
            ("merges.txt", TINY_MERGES),
            ("tokenizer_config.json", TINY_CONFIG),
        ] {
            if name != skip {
                write(name, text.as_bytes());
            }
        }
    };
    match mode % 6 {
        0 => {
            base("vocab.json");
            write("vocab.json", rest);
        }
        1 => {
            base("merges.txt");
            write("merges.txt", rest);
        }
        2 => write("tokenizer.json", rest),
        3 => {
            base("tokenizer_config.json");
            write("tokenizer_config.json", rest);
        }
        4 => {
            base("");
            write("special_tokens_map.json", rest);
        }
        _ => {
            if rest.len() < 2 {
                return;
            }
            let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
            base("");
            write("vocab.json", &rest[2..2 + n]);
            write("merges.txt", &rest[2 + n..]);
        }
    }

    let t = match Tokenizer::from_dir(d, VOCAB) {
        Ok(t) => t,
        Err(e) => {
            assert!(
                !matches!(e, Error::Internal(_)),
                "internal error on load: {e}"
            );
            return;
        }
    };
    let text = String::from_utf8_lossy(rest);
    for sample in ["hello world", "a\"é\n🦊\\u12", text.as_ref()] {
        let ids = match t.encode(sample, true) {
            Ok(ids) => ids,
            Err(e) => {
                assert!(
                    !matches!(e, Error::Internal(_)),
                    "internal error on encode: {e}"
                );
                continue;
            }
        };
        assert!(
            ids.iter().all(|&i| (i as usize) < VOCAB),
            "id beyond the vocab"
        );
        let whole = t.decode(&ids, false).expect("decoding encoded ids");
        let mut s = t.stream(false);
        let mut joined = String::new();
        for &id in &ids {
            joined.push_str(&s.push(id).expect("streaming encoded ids"));
        }
        joined.push_str(&s.finish());
        if t.source() != TokenizerSource::TokenizerJson {
            assert_eq!(joined, whole, "stream != decode");
        }
    }
    // Arbitrary ids: Ok or an error, never a panic.
    let ids: Vec<u32> = rest
        .chunks(2)
        .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
        .collect();
    let _ = t.decode(&ids, true);
});
