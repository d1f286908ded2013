//! `tokenizer_config.json` and `special_tokens_map.json` (Hugging Face `transformers` layout):
//! the fields that change how text becomes ids. Every error names the file and the field.

use super::tok_error;
use crate::error::Result;
use serde_json::{Map, Value};

/// `tokenizer_class` of LongCrawl64 checkpoints: text is JSON-escaped before BPE.
pub const JSON_GPT2_CLASS: &str = "JSONGPT2Tokenizer";

/// The special-token names read from either file, in the order they are looked up.
pub const SPECIAL_FIELDS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// One entry of `added_tokens_decoder`: `id -> {content, special}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedEntry {
    pub id: u32,
    pub content: String,
    pub special: bool,
}

/// What the two files say; absent fields keep the `transformers` defaults of the slow GPT-2
/// tokenizer (no BOS added, no prefix space, no JSON escaping).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// `tokenizer_class`.
    pub class: Option<String>,
    /// `add_bos_token`: prepend the BOS id when encoding the start of a text.
    pub add_bos: bool,
    /// `add_prefix_space`: a space is put before the text (vocab.json + merges.txt only).
    pub add_prefix_space: bool,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` (content strings), in the order of
    /// [`SPECIAL_FIELDS`]; tokenizer_config.json wins over special_tokens_map.json.
    pub specials: [Option<String>; 4],
    /// `additional_special_tokens` of either file.
    pub additional: Vec<String>,
    /// `added_tokens_decoder` of tokenizer_config.json.
    pub added: Vec<AddedEntry>,
}

impl TokenizerConfig {
    /// Whether the text is JSON-escaped before BPE ([`JSON_GPT2_CLASS`]).
    pub fn json_escape(&self) -> bool {
        self.class.as_deref() == Some(JSON_GPT2_CLASS)
    }

    /// Parses the two files' texts (either may be absent).
    pub fn parse(config: Option<&str>, special_map: Option<&str>) -> Result<TokenizerConfig> {
        const CFG: &str = "tokenizer_config.json";
        const MAP: &str = "special_tokens_map.json";
        let mut c = TokenizerConfig::default();
        if let Some(text) = special_map {
            let obj = object(MAP, text)?;
            read_specials(MAP, &obj, &mut c)?;
        }
        if let Some(text) = config {
            let obj = object(CFG, text)?;
            c.class = opt_string(CFG, &obj, "tokenizer_class")?;
            c.add_bos = opt_bool(CFG, &obj, "add_bos_token")?.unwrap_or(false);
            c.add_prefix_space = opt_bool(CFG, &obj, "add_prefix_space")?.unwrap_or(false);
            read_specials(CFG, &obj, &mut c)?;
            if let Some(v) = obj.get("added_tokens_decoder") {
                c.added = added_tokens(v)?;
            }
        }
        Ok(c)
    }
}

fn object(file: &str, text: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(tok_error(file, "expected a JSON object at the top level")),
        Err(e) => Err(tok_error(file, format!("invalid JSON: {e}"))),
    }
}

fn field_error(file: &str, field: &str, expected: &str, got: &Value) -> crate::Error {
    let mut shown = got.to_string();
    if shown.len() > 80 {
        let mut end = 80;
        while !shown.is_char_boundary(end) {
            end -= 1;
        }
        shown.truncate(end);
        shown.push_str("...");
    }
    tok_error(
        file,
        format!("field `{field}`: expected {expected}, got {shown}"),
    )
}

fn opt_bool(file: &str, obj: &Map<String, Value>, field: &str) -> Result<Option<bool>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(field_error(file, field, "true or false", v)),
    }
}

fn opt_string(file: &str, obj: &Map<String, Value>, field: &str) -> Result<Option<String>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(field_error(file, field, "a string", v)),
    }
}

/// A token given as a string or as an `AddedToken` object (`{"content": ...}`).
fn token_content(file: &str, field: &str, v: &Value) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(m) => match m.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(
                file,
                field,
                "an object with a string `content`",
                v,
            )),
        },
        _ => Err(field_error(file, field, "a string or a token object", v)),
    }
}

fn read_specials(file: &str, obj: &Map<String, Value>, c: &mut TokenizerConfig) -> Result<()> {
    for (slot, field) in c.specials.iter_mut().zip(SPECIAL_FIELDS) {
        if let Some(v) = obj.get(field)
            && let Some(s) = token_content(file, field, v)?
        {
            *slot = Some(s);
        }
    }
    match obj.get("additional_special_tokens") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for v in items {
                if let Some(s) = token_content(file, "additional_special_tokens", v)?
                    && !c.additional.contains(&s)
                {
                    c.additional.push(s);
                }
            }
        }
        Some(v) => {
            return Err(field_error(
                file,
                "additional_special_tokens",
                "an array",
                v,
            ));
        }
    }
    Ok(())
}

fn added_tokens(v: &Value) -> Result<Vec<AddedEntry>> {
    const CFG: &str = "tokenizer_config.json";
    const FIELD: &str = "added_tokens_decoder";
    let Value::Object(m) = v else {
        return Err(field_error(CFG, FIELD, "an object", v));
    };
    let mut out = Vec::with_capacity(m.len());
    for (key, entry) in m {
        let id: u32 = key.parse().map_err(|_| {
            tok_error(
                CFG,
                format!("field `{FIELD}`: key {key:?} is not a token id"),
            )
        })?;
        let content = token_content(CFG, FIELD, entry)?
            .ok_or_else(|| tok_error(CFG, format!("field `{FIELD}`: id {id} has no content")))?;
        let special = match entry.get("special") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(field_error(CFG, FIELD, "`special` true or false", v)),
        };
        out.push(AddedEntry {
            id,
            content,
            special,
        });
    }
    out.sort_by_key(|e| e.id);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_official_layout() {
        let cfg = r#"{"add_bos_token": true, "add_prefix_space": false,
            "bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>",
            "__type": "AddedToken"}, "tokenizer_class": "JSONGPT2Tokenizer",
            "added_tokens_decoder": {"50256": {"content": "<|endoftext|>", "special": true}},
            "model_max_length": 1000000000000000019884624838656}"#;
        let map = r#"{"unk_token": "<|endoftext|>", "bos_token": "x"}"#;
        let c = TokenizerConfig::parse(Some(cfg), Some(map)).unwrap();
        assert!(c.add_bos && !c.add_prefix_space && c.json_escape());
        let eot = Some("<|endoftext|>".to_string());
        assert_eq!(c.specials, [eot.clone(), eot.clone(), eot.clone(), None]);
        assert_eq!(
            c.added,
            vec![AddedEntry {
                id: 50256,
                content: "<|endoftext|>".into(),
                special: true
            }]
        );
        assert_eq!(
            TokenizerConfig::parse(None, None).unwrap(),
            TokenizerConfig::default()
        );
    }

    #[test]
    fn bad_fields_are_named() {
        for (text, field) in [
            (r#"{"add_bos_token": "yes"}"#, "add_bos_token"),
            (r#"{"bos_token": 3}"#, "bos_token"),
            (r#"{"eos_token": {"id": 3}}"#, "eos_token"),
            (r#"{"tokenizer_class": []}"#, "tokenizer_class"),
            (
                r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#,
                "added_tokens_decoder",
            ),
            (
                r#"{"additional_special_tokens": "a"}"#,
                "additional_special_tokens",
            ),
        ] {
            let e = TokenizerConfig::parse(Some(text), None).unwrap_err();
            let s = e.to_string();
            assert!(
                s.contains("tokenizer_config.json") && s.contains(field),
                "{s}"
            );
        }
        let e = TokenizerConfig::parse(None, Some("[1]")).unwrap_err();
        assert!(e.to_string().contains("special_tokens_map.json"), "{e}");
        let e = TokenizerConfig::parse(Some("{"), None).unwrap_err();
        assert!(e.to_string().contains("invalid JSON"), "{e}");
    }
}
