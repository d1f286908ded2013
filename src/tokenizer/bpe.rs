//! Byte-level BPE files: GPT-2's `vocab.json` + `merges.txt`, and the checks a
//! `tokenizer.json` BPE model gets before the `tokenizers` crate builds it. The BPE itself is
//! the `tokenizers` crate's; this module reads and validates its inputs so that a corrupt file
//! is a named error (with the line or token at fault) rather than a failure deep inside it.

use super::tok_error;
use crate::error::Result;
use serde_json::Value;
use std::collections::HashMap;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

/// GPT-2's byte-level alphabet: byte `b` is written as the character `BYTE_CHARS[b]`.
/// Printable bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other 68
/// bytes, in increasing order, are U+0100, U+0101, ...
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

/// The inverse of [`byte_char`]: `table[c]` is the byte written as `c` (for `c < 324`).
pub fn char_bytes() -> [Option<u8>; 324] {
    let mut t = [None; 324];
    for b in 0..=255u8 {
        t[byte_char(b) as usize] = Some(b);
    }
    t
}

/// The bytes a byte-level token stands for, as the `tokenizers` ByteLevel decoder reads it:
/// each character through the alphabet when all of them are in it, else the token's UTF-8.
pub fn token_bytes(table: &[Option<u8>; 324], token: &str) -> Vec<u8> {
    let mapped: Option<Vec<u8>> = token
        .chars()
        .map(|c| table.get(c as usize).copied().flatten())
        .collect();
    mapped.unwrap_or_else(|| token.as_bytes().to_vec())
}

/// `vocab.json`: token -> id. Ids must be unique and below `limit` (the model's vocabulary).
pub fn parse_vocab(text: &str, file: &str, limit: usize) -> Result<HashMap<String, u32>> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| tok_error(file, format!("invalid JSON: {e}")))?;
    let Value::Object(m) = v else {
        return Err(tok_error(file, "expected an object of token -> id"));
    };
    vocab_from_map(&m, file, limit)
}

fn vocab_from_map(
    m: &serde_json::Map<String, Value>,
    file: &str,
    limit: usize,
) -> Result<HashMap<String, u32>> {
    let mut vocab = HashMap::with_capacity(m.len());
    let mut by_id: HashMap<u32, &str> = HashMap::with_capacity(m.len());
    for (token, id) in m {
        let id = id
            .as_u64()
            .filter(|&i| (i as u128) < limit as u128)
            .ok_or_else(|| {
                tok_error(
                    file,
                    format!(
                        "token {token:?} has id {id}, not an integer below the model's \
                         vocabulary size {limit}"
                    ),
                )
            })? as u32;
        if let Some(other) = by_id.insert(id, token) {
            return Err(tok_error(
                file,
                format!("id {id} is given to both {other:?} and {token:?}"),
            ));
        }
        vocab.insert(token.clone(), id);
    }
    if vocab.is_empty() {
        return Err(tok_error(file, "the vocabulary is empty"));
    }
    Ok(vocab)
}

/// `merges.txt`: one merge `a b` per line, in rank order. A first line starting with
/// `#version` is skipped, a trailing `\r` is ignored and a final empty line is allowed.
pub fn parse_merges(text: &str) -> Result<Vec<(String, String)>> {
    const FILE: &str = "merges.txt";
    let mut merges = Vec::new();
    let body = text.strip_suffix('\n').unwrap_or(text);
    if body.is_empty() {
        return Ok(merges);
    }
    for (i, line) in body.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if i == 0 && line.starts_with("#version") {
            continue;
        }
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                merges.push((a.to_string(), b.to_string()));
            }
            _ => {
                return Err(tok_error(
                    FILE,
                    format!(
                        "line {}: expected two tokens separated by one space, got {:?}",
                        i + 1,
                        clip(line)
                    ),
                ));
            }
        }
    }
    Ok(merges)
}

fn clip(s: &str) -> String {
    s.chars().take(60).collect()
}

/// Checks that every merge joins two vocabulary tokens into a vocabulary token (`b` loses
/// `prefix`, the continuing-subword prefix, first), as the BPE builder assumes.
fn check_merges(
    vocab: &HashMap<String, u32>,
    merges: &[(String, String)],
    prefix: &str,
    file: &str,
) -> Result<()> {
    for (rank, (a, b)) in merges.iter().enumerate() {
        let what = |m: String| tok_error(file, format!("merge {} ({a:?} {b:?}): {m}", rank + 1));
        for t in [a, b] {
            if !vocab.contains_key(t) {
                return Err(what(format!("{t:?} is not in the vocabulary")));
            }
        }
        let tail = b
            .strip_prefix(prefix)
            .ok_or_else(|| what(format!("{b:?} does not start with the prefix {prefix:?}")))?;
        let joined = format!("{a}{tail}");
        if !vocab.contains_key(&joined) {
            return Err(what(format!(
                "the merged token {joined:?} is not in the vocabulary"
            )));
        }
    }
    Ok(())
}

/// GPT-2's tokenizer from `vocab.json` + `merges.txt`: the `tokenizers` BPE with the
/// byte-level pre-tokenizer (GPT-2's split regex, no prefix space) and decoder.
pub fn gpt2_tokenizer(
    vocab: HashMap<String, u32>,
    merges: Vec<(String, String)>,
) -> Result<tokenizers::Tokenizer> {
    check_merges(&vocab, &merges, "", "merges.txt")?;
    let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| tok_error("merges.txt", e.to_string()))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tk.with_decoder(Some(ByteLevel::new(false, true, true)));
    Ok(tk)
}

/// Checks a `tokenizer.json` before the `tokenizers` crate reads it: for a BPE model, the
/// vocabulary (ids unique and below `limit`) and every merge, so that the BPE builder never
/// sees a merge it cannot build.
pub fn check_tokenizer_json(v: &Value, limit: usize) -> Result<()> {
    const FILE: &str = "tokenizer.json";
    let Some(model) = v.get("model") else {
        return Err(tok_error(FILE, "no `model` object"));
    };
    let bpe = match model.get("type") {
        Some(Value::String(t)) => t == "BPE",
        None => model.get("merges").is_some(),
        Some(_) => false,
    };
    if let Some(Value::Array(added)) = v.get("added_tokens") {
        for t in added {
            if let Some(id) = t.get("id").and_then(Value::as_u64)
                && id as u128 >= limit as u128
            {
                return Err(tok_error(
                    FILE,
                    format!("added token id {id} is not below the model's vocabulary size {limit}"),
                ));
            }
        }
    }
    if !bpe {
        return Ok(());
    }
    let vocab = match model.get("vocab") {
        Some(Value::Object(m)) => vocab_from_map(m, FILE, limit)?,
        _ => {
            return Err(tok_error(
                FILE,
                "model.vocab: expected an object of token -> id",
            ));
        }
    };
    let prefix = match model.get("continuing_subword_prefix") {
        Some(Value::String(p)) => p.as_str(),
        _ => "",
    };
    let mut merges = Vec::new();
    match model.get("merges") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, m) in items.iter().enumerate() {
                let pair = match m {
                    Value::String(s) => s
                        .split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string())),
                    Value::Array(ab) => match ab.as_slice() {
                        [Value::String(a), Value::String(b)] => Some((a.clone(), b.clone())),
                        _ => None,
                    },
                    _ => None,
                };
                merges.push(pair.ok_or_else(|| {
                    tok_error(
                        FILE,
                        format!("model.merges[{i}]: expected \"a b\" or [a, b]"),
                    )
                })?);
            }
        }
        Some(_) => return Err(tok_error(FILE, "model.merges: expected an array")),
    }
    check_merges(&vocab, &merges, prefix, FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_is_gpt2s() {
        assert_eq!(byte_char(b'!'), '!');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(0), '\u{100}');
        assert_eq!(byte_char(0xAD), '\u{143}');
        let t = char_bytes();
        assert_eq!(t.iter().flatten().count(), 256);
        for b in 0..=255u8 {
            assert_eq!(t[byte_char(b) as usize], Some(b));
        }
        assert_eq!(token_bytes(&t, "ĠHello"), b" Hello");
        assert_eq!(token_bytes(&t, "<|endoftext|>"), b"<|endoftext|>");
        assert_eq!(token_bytes(&t, "日本"), "日本".as_bytes());
    }

    #[test]
    fn merges_parse_and_errors_name_the_line() {
        let m = parse_merges("#version: 0.2\nĠ t\r\na b\n").unwrap();
        assert_eq!(m, vec![("Ġ".into(), "t".into()), ("a".into(), "b".into())]);
        assert!(parse_merges("").unwrap().is_empty());
        let e = parse_merges("#version: 0.2\na b\nab\n").unwrap_err();
        assert!(e.to_string().contains("merges.txt: line 3"), "{e}");
        let e = parse_merges("a b c").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }

    #[test]
    fn vocab_errors_are_named() {
        for (text, what) in [
            ("[]", "expected an object"),
            ("{}", "empty"),
            (r#"{"a": -1}"#, "not an integer"),
            (r#"{"a": 5}"#, "below the model's vocabulary size 5"),
            (r#"{"a": 0, "b": 0}"#, "id 0 is given to both"),
            ("{", "invalid JSON"),
        ] {
            let e = parse_vocab(text, "vocab.json", 5).unwrap_err();
            assert!(e.to_string().contains(what), "{text}: {e}");
            assert!(e.to_string().contains("vocab.json"), "{e}");
        }
    }

    #[test]
    fn merges_outside_the_vocabulary_are_errors_not_panics() {
        let vocab: HashMap<String, u32> = [("a", 0), ("b", 1)]
            .iter()
            .map(|(t, i)| (t.to_string(), *i))
            .collect();
        // The merged token "ab" is missing (and longer than every token).
        let e = gpt2_tokenizer(vocab.clone(), vec![("a".into(), "b".into())]).unwrap_err();
        assert!(
            e.to_string().contains("\"ab\" is not in the vocabulary"),
            "{e}"
        );
        let e = gpt2_tokenizer(vocab, vec![("a".into(), "c".into())]).unwrap_err();
        assert!(
            e.to_string().contains("\"c\" is not in the vocabulary"),
            "{e}"
        );
    }
}
