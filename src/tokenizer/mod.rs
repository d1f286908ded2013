//! Text to token ids and back, for a model directory in the Hugging Face layout.
//!
//! [`Tokenizer::from_dir`] picks, in this order:
//! 1. `tokenizer.json`, read by the `tokenizers` crate (any model type it knows);
//! 2. `vocab.json` + `merges.txt`: GPT-2's byte-level BPE (the `tokenizers` crate's BPE with
//!    the byte-level pre-tokenizer and decoder), as the official FoX checkpoints ship it;
//! 3. no tokenizer files and a vocabulary of 256: the byte tokenizer of the bundled model
//!    (id = byte, BOS = EOS = 0);
//! 4. otherwise [`Error::NoTokenizer`]: the model still runs on ids, text needs a tokenizer.
//!
//! `tokenizer_config.json` (and `special_tokens_map.json` for fields it lacks) decide the
//! rest: `add_bos_token` prepends BOS at the start of a text, `bos_token`/`eos_token` name the
//! BOS/EOS ids, and `tokenizer_class: "JSONGPT2Tokenizer"` turns on LongCrawl64's JSON
//! escaping ([`json_escape`]). The special tokens are those the two files name (BOS, EOS,
//! UNK, PAD, `additional_special_tokens`, special `added_tokens_decoder` entries) and the
//! special added tokens of `tokenizer.json`; text naming one (`<|endoftext|>`) encodes to that
//! token, as in `transformers`. Without the files nothing is special: GPT-2's bare
//! `vocab.json` + `merges.txt` encode `<|endoftext|>` as the text it is.
//!
//! Decoding joins the tokens' bytes and reads them as UTF-8, an invalid sequence becoming
//! U+FFFD (`String::from_utf8_lossy`), then undoes the JSON escaping where it applies.
//! [`StreamDecoder`] does the same one id at a time.

mod bpe;
mod config;
pub mod json_escape;
mod stream;

pub use config::{AddedEntry, JSON_GPT2_CLASS, TokenizerConfig};
pub use stream::StreamDecoder;

use crate::error::{Error, Result};
use std::path::Path;
use std::sync::Arc;
use tokenizers::AddedToken;

pub(crate) fn tok_error(file: &str, message: impl Into<String>) -> Error {
    Error::Tokenizer {
        file: file.to_string(),
        message: message.into(),
    }
}

/// Which files a [`Tokenizer`] was built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerSource {
    /// No files: one token per byte (the bundled byte-level model).
    Bytes,
    /// `vocab.json` + `merges.txt` (GPT-2 byte-level BPE).
    VocabMerges,
    /// `tokenizer.json`.
    TokenizerJson,
}

/// A tokenizer: immutable, cheap to clone (shared), `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    source: TokenizerSource,
    /// The `tokenizers` pipeline (None for [`TokenizerSource::Bytes`]).
    hf: Option<tokenizers::Tokenizer>,
    /// Bytes of each id when the tokenizer is byte-level (None: decode through `hf`).
    pieces: Option<Vec<Option<Box<[u8]>>>>,
    /// Special ids (BOS, EOS, added special tokens), indexed by id.
    special: Vec<bool>,
    /// Ids are `0..size`.
    size: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    json_escape: bool,
    add_prefix_space: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inner;
        f.debug_struct("Tokenizer")
            .field("source", &i.source)
            .field("size", &i.size)
            .field("bos", &i.bos)
            .field("eos", &i.eos)
            .field("add_bos", &i.add_bos)
            .field("json_escape", &i.json_escape)
            .finish()
    }
}

/// Reads `dir/name` as UTF-8 text; `None` when the file does not exist.
fn read_text(dir: &Path, name: &str) -> Result<Option<String>> {
    let path = dir.join(name);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    String::from_utf8(bytes).map(Some).map_err(|e| {
        tok_error(
            name,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

impl Tokenizer {
    /// The tokenizer of the model directory `dir`, whose model has `vocab` logits (rules in
    /// the module doc). Every token id must be below `vocab`.
    ///
    /// Errors: [`Error::Tokenizer`] naming the file for a corrupt or inconsistent file (or
    /// one of `vocab.json`/`merges.txt` without the other), [`Error::Io`] for a file that
    /// exists but cannot be read, [`Error::NoTokenizer`] when there are no tokenizer files
    /// and `vocab != 256`.
    pub fn from_dir(dir: impl AsRef<Path>, vocab: usize) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let config = TokenizerConfig::parse(
            read_text(dir, "tokenizer_config.json")?.as_deref(),
            read_text(dir, "special_tokens_map.json")?.as_deref(),
        )?;
        if let Some(text) = read_text(dir, "tokenizer.json")? {
            return Self::from_tokenizer_json(&text, &config, vocab);
        }
        match (read_text(dir, "vocab.json")?, read_text(dir, "merges.txt")?) {
            (Some(v), Some(m)) => Self::from_vocab_merges(&v, &m, &config, vocab),
            (Some(_), None) => Err(tok_error("merges.txt", "missing (vocab.json is present)")),
            (None, Some(_)) => Err(tok_error("vocab.json", "missing (merges.txt is present)")),
            (None, None) if vocab == 256 => Ok(Self::bytes()),
            (None, None) => Err(Error::NoTokenizer {
                dir: dir.to_path_buf(),
                vocab,
            }),
        }
    }

    /// The byte tokenizer: id `b` is byte `b`; BOS = EOS = 0, prepended at the start.
    pub fn bytes() -> Tokenizer {
        let pieces = (0..=255u8).map(|b| Some(Box::from([b]))).collect();
        let mut special = vec![false; 256];
        special[0] = true;
        Tokenizer {
            inner: Arc::new(Inner {
                source: TokenizerSource::Bytes,
                hf: None,
                pieces: Some(pieces),
                special,
                size: 256,
                bos: Some(0),
                eos: Some(0),
                add_bos: true,
                json_escape: false,
                add_prefix_space: false,
            }),
        }
    }

    /// GPT-2 byte-level BPE from the texts of `vocab.json` and `merges.txt`.
    fn from_vocab_merges(
        vocab_text: &str,
        merges_text: &str,
        config: &TokenizerConfig,
        limit: usize,
    ) -> Result<Tokenizer> {
        let vocab = bpe::parse_vocab(vocab_text, "vocab.json", limit)?;
        let merges = bpe::parse_merges(merges_text)?;
        let mut specials = Vec::new();
        for name in named_specials(config) {
            if !vocab.contains_key(&name) {
                return Err(tok_error(
                    "vocab.json",
                    format!(
                        "has no token {name:?}, named as a special token by \
                         tokenizer_config.json or special_tokens_map.json"
                    ),
                ));
            }
            specials.push(name);
        }
        for e in &config.added {
            match vocab.get(&e.content) {
                Some(&id) if id == e.id => {
                    if e.special && !specials.contains(&e.content) {
                        specials.push(e.content.clone());
                    }
                }
                Some(&id) => {
                    return Err(tok_error(
                        "tokenizer_config.json",
                        format!(
                            "added_tokens_decoder gives {:?} id {}, vocab.json gives {id}",
                            e.content, e.id
                        ),
                    ));
                }
                None => {
                    return Err(tok_error(
                        "tokenizer_config.json",
                        format!(
                            "added_tokens_decoder: token {:?} (id {}) is not in vocab.json; \
                             added tokens need a tokenizer.json",
                            e.content, e.id
                        ),
                    ));
                }
            }
        }
        let mut hf = bpe::gpt2_tokenizer(vocab, merges)?;
        hf.add_special_tokens(specials.iter().map(|s| AddedToken::from(s.clone(), true)))
            .map_err(|e| tok_error("tokenizer_config.json", e.to_string()))?;
        Self::finish(hf, TokenizerSource::VocabMerges, config, limit, true)
    }

    /// A `tokenizer.json` (checked first, see [`bpe::check_tokenizer_json`]).
    fn from_tokenizer_json(
        text: &str,
        config: &TokenizerConfig,
        limit: usize,
    ) -> Result<Tokenizer> {
        const FILE: &str = "tokenizer.json";
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| tok_error(FILE, format!("invalid JSON: {e}")))?;
        bpe::check_tokenizer_json(&v, limit)?;
        let mut hf: tokenizers::Tokenizer =
            serde_json::from_value(v).map_err(|e| tok_error(FILE, e.to_string()))?;
        // Encoding here never truncates or pads.
        hf.with_truncation(None)
            .map_err(|e| tok_error(FILE, e.to_string()))?;
        hf.with_padding(None);
        for name in named_specials(config) {
            if hf.token_to_id(&name).is_none() {
                return Err(tok_error(
                    FILE,
                    format!(
                        "has no token {name:?}, named as a special token by \
                         tokenizer_config.json or special_tokens_map.json"
                    ),
                ));
            }
        }
        let byte_level = matches!(
            hf.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        Self::finish(
            hf,
            TokenizerSource::TokenizerJson,
            config,
            limit,
            byte_level,
        )
    }

    /// Resolves ids, special tokens and BOS/EOS; builds the byte table when `byte_level`.
    fn finish(
        hf: tokenizers::Tokenizer,
        source: TokenizerSource,
        config: &TokenizerConfig,
        limit: usize,
        byte_level: bool,
    ) -> Result<Tokenizer> {
        let file = match source {
            TokenizerSource::TokenizerJson => "tokenizer.json",
            _ => "vocab.json",
        };
        let all = hf.get_vocab(true);
        let size = all.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        if size == 0 {
            return Err(tok_error(file, "the vocabulary is empty"));
        }
        if size > limit {
            return Err(tok_error(
                file,
                format!(
                    "has token ids up to {}, the model has {limit} logits",
                    size - 1
                ),
            ));
        }
        let mut special = vec![false; size];
        for (id, t) in hf.get_added_tokens_decoder() {
            if t.special {
                special[id as usize] = true;
            }
        }
        let id_of = |name: &Option<String>| name.as_ref().and_then(|n| hf.token_to_id(n));
        for name in named_specials(config) {
            if let Some(id) = hf.token_to_id(&name) {
                special[id as usize] = true;
            }
        }
        let bos = id_of(&config.specials[0]);
        let eos = id_of(&config.specials[1]);
        if config.add_bos && bos.is_none() {
            return Err(tok_error(
                "tokenizer_config.json",
                "add_bos_token is true but no bos_token is named",
            ));
        }
        let pieces = byte_level.then(|| {
            let table = bpe::char_bytes();
            let mut p: Vec<Option<Box<[u8]>>> = vec![None; size];
            for (token, id) in &all {
                p[*id as usize] = Some(bpe::token_bytes(&table, token).into_boxed_slice());
            }
            p
        });
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                source,
                add_prefix_space: config.add_prefix_space && source == TokenizerSource::VocabMerges,
                hf: Some(hf),
                pieces,
                special,
                size,
                bos,
                eos,
                add_bos: config.add_bos,
                json_escape: config.json_escape(),
            }),
        })
    }

    /// Token ids of `text`. With `add_special`, the BOS id is prepended when the
    /// configuration asks for it (`add_bos_token`): pass true for the start of a text, false
    /// for a continuation.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let i = &self.inner;
        let mut ids = Vec::new();
        if add_special && i.add_bos {
            ids.extend(i.bos);
        }
        let Some(hf) = &i.hf else {
            ids.extend(text.bytes().map(u32::from));
            return Ok(ids);
        };
        let mut prepared = String::new();
        if i.add_prefix_space {
            prepared.push(' ');
        }
        if i.json_escape {
            prepared.push_str(&json_escape::escape(text));
        } else {
            prepared.push_str(text);
        }
        let enc = hf
            .encode(prepared.as_str(), false)
            .map_err(|e| tok_error(self.file(), format!("cannot encode: {e}")))?;
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids` (rules in the module doc); `skip_special` leaves out special
    /// tokens (BOS, EOS, ...) instead of writing their text.
    ///
    /// Errors: an id outside the tokenizer ([`Error::InvalidArgument`]).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let raw = self.decode_raw(ids, skip_special)?;
        Ok(if self.inner.json_escape {
            json_escape::unescape(&raw)
        } else {
            raw
        })
    }

    /// Decoding without the JSON unescaping.
    fn decode_raw(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let i = &self.inner;
        if let Some(pieces) = &i.pieces {
            let mut bytes = Vec::new();
            for &id in ids {
                if let Some(b) = self.piece(pieces, id, skip_special)? {
                    bytes.extend_from_slice(b);
                }
            }
            return Ok(String::from_utf8_lossy(&bytes).into_owned());
        }
        for &id in ids {
            self.check_id(id)?;
        }
        let hf =
            i.hf.as_ref()
                .ok_or_else(|| Error::Internal("tokenizer without bytes or pipeline".into()))?;
        hf.decode(ids, skip_special)
            .map_err(|e| tok_error(self.file(), format!("cannot decode: {e}")))
    }

    /// The file that defines the token pipeline, for error messages.
    fn file(&self) -> &'static str {
        match self.inner.source {
            TokenizerSource::TokenizerJson => "tokenizer.json",
            _ => "vocab.json",
        }
    }

    /// The bytes of `id` in a byte-level tokenizer (None: a special token being skipped).
    fn piece<'a>(
        &self,
        pieces: &'a [Option<Box<[u8]>>],
        id: u32,
        skip_special: bool,
    ) -> Result<Option<&'a [u8]>> {
        self.check_id(id)?;
        if skip_special && self.inner.special[id as usize] {
            return Ok(None);
        }
        match &pieces[id as usize] {
            Some(b) => Ok(Some(b)),
            None => Err(Error::invalid(format!(
                "token id {id} has no token in the tokenizer"
            ))),
        }
    }

    fn check_id(&self, id: u32) -> Result<()> {
        let i = &self.inner;
        let known = (id as usize) < i.size
            && match (&i.pieces, &i.hf) {
                (Some(p), _) => p[id as usize].is_some(),
                (None, Some(hf)) => hf.id_to_token(id).is_some(),
                (None, None) => false,
            };
        if known {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "token id {id} has no token in the tokenizer (ids 0..{})",
                i.size
            )))
        }
    }

    /// A decoder that turns ids into text pieces one at a time ([`StreamDecoder`]).
    pub fn stream(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special)
    }

    /// The BOS id, if the configuration names one.
    pub fn bos(&self) -> Option<u32> {
        self.inner.bos
    }

    /// The EOS id, if the configuration names one (generation stops there).
    pub fn eos(&self) -> Option<u32> {
        self.inner.eos
    }

    /// Whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.inner.add_bos
    }

    /// Whether text is JSON-escaped before BPE (LongCrawl64's `JSONGPT2Tokenizer`).
    pub fn json_escaped(&self) -> bool {
        self.inner.json_escape
    }

    /// Number of ids (`0..size`; a model may have more logits than this).
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Whether `id` is a special token (BOS, EOS, added special tokens).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// The files this tokenizer was built from.
    pub fn source(&self) -> TokenizerSource {
        self.inner.source
    }
}

/// The special tokens the configuration names (BOS, EOS, UNK, PAD, additional), deduplicated.
fn named_specials(config: &TokenizerConfig) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in config.specials.iter().flatten().chain(&config.additional) {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
