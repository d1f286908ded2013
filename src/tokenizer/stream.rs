//! Streaming detokenization: ids in one at a time, text pieces out.
//!
//! Invariant: the pieces of [`StreamDecoder::push`] followed by [`StreamDecoder::finish`]
//! concatenate to [`Tokenizer::decode`] of the same ids, and no piece ends inside a UTF-8
//! character or (with JSON escaping) inside an escape or a surrogate pair: a piece is text
//! that will not change whatever ids follow.
//!
//! Byte-level tokenizers hold back only an unfinished UTF-8 sequence (at most 3 bytes).
//! Other `tokenizer.json` decoders (SentencePiece-style `▁`, WordPiece `##`) are run on all
//! ids since the start and the new suffix is emitted once it does not end in U+FFFD (an
//! unfinished byte-fallback character): O(n) per id, and exact for decoders under which the
//! text of a prefix of ids is a prefix of the text of all of them.

use super::Tokenizer;
use super::json_escape::Unescaper;
use crate::error::Result;

/// Turns ids into text pieces (see the module doc). Reusable after [`StreamDecoder::finish`].
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special: bool,
    /// Byte-level: bytes not yet emitted (an unfinished UTF-8 sequence).
    bytes: Vec<u8>,
    /// Other decoders: all ids so far, and the length of their text already emitted.
    ids: Vec<u32>,
    shown: usize,
    unescape: Option<Unescaper>,
}

impl StreamDecoder {
    pub(super) fn new(tok: Tokenizer, skip_special: bool) -> StreamDecoder {
        let unescape = tok.json_escaped().then(Unescaper::default);
        StreamDecoder {
            tok,
            skip_special,
            bytes: Vec::new(),
            ids: Vec::new(),
            shown: 0,
            unescape,
        }
    }

    /// Adds one id; returns the text it completes (often empty).
    ///
    /// Errors: an id outside the tokenizer; the decoder is unchanged then.
    pub fn push(&mut self, id: u32) -> Result<String> {
        let raw = if let Some(pieces) = &self.tok.inner.pieces {
            if let Some(b) = self.tok.piece(pieces, id, self.skip_special)? {
                self.bytes.extend_from_slice(b);
            }
            take_utf8(&mut self.bytes, false)
        } else {
            self.tok.check_id(id)?;
            self.ids.push(id);
            let text = match self.tok.decode_raw(&self.ids, self.skip_special) {
                Ok(t) => t,
                Err(e) => {
                    self.ids.pop();
                    return Err(e);
                }
            };
            match text.get(self.shown..) {
                Some(new) if !new.is_empty() && !text.ends_with(char::REPLACEMENT_CHARACTER) => {
                    let new = new.to_string();
                    self.shown = text.len();
                    new
                }
                _ => String::new(),
            }
        };
        Ok(self.unescape_piece(&raw, false))
    }

    /// Ends the text: returns what was held back (an unfinished UTF-8 sequence becomes
    /// U+FFFD, an unfinished escape follows the end-of-text rules) and resets the decoder.
    pub fn finish(&mut self) -> String {
        let raw = if self.tok.inner.pieces.is_some() {
            take_utf8(&mut self.bytes, true)
        } else {
            let text = self
                .tok
                .decode_raw(&self.ids, self.skip_special)
                .unwrap_or_default();
            let rest = text.get(self.shown..).unwrap_or_default().to_string();
            self.ids.clear();
            self.shown = 0;
            rest
        };
        self.unescape_piece(&raw, true)
    }

    fn unescape_piece(&mut self, raw: &str, end: bool) -> String {
        let Some(u) = &mut self.unescape else {
            return raw.to_string();
        };
        let mut out = String::with_capacity(raw.len());
        u.push(raw, &mut out);
        if end {
            u.finish(&mut out);
        }
        out
    }
}

/// Removes and returns the longest decodable prefix of `buf`, as `String::from_utf8_lossy`
/// reads it (each invalid sequence → one U+FFFD). An unfinished sequence at the end stays in
/// `buf` unless `at_end`, where it becomes one U+FFFD.
fn take_utf8(buf: &mut Vec<u8>, at_end: bool) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < buf.len() {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                out.push_str(&String::from_utf8_lossy(&buf[start..valid]));
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = valid + n;
                    }
                    None if at_end => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = buf.len();
                    }
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn take_utf8_in_pieces_is_from_utf8_lossy(
            bytes in prop::collection::vec(
                prop_oneof![any::<u8>(), 0x80u8..0xC0, 0xE0u8..0xF5], 0..40),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            at.sort_unstable();
            let mut buf = Vec::new();
            let mut out = String::new();
            let mut start = 0;
            for &i in &at {
                buf.extend_from_slice(&bytes[start..i]);
                out.push_str(&take_utf8(&mut buf, false));
                start = i;
            }
            buf.extend_from_slice(&bytes[start..]);
            out.push_str(&take_utf8(&mut buf, true));
            prop_assert!(buf.is_empty());
            prop_assert_eq!(out, String::from_utf8_lossy(&bytes).into_owned());
        }
    }
}
