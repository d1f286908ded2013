//! LongCrawl64's text escaping (tokenizer class `JSONGPT2Tokenizer`): before BPE a text
//! becomes `json.dumps(text)[1:-1]` (Python defaults), after decoding it is read back as the
//! body of a JSON string.
//!
//! [`escape`] equals Python's `json.dumps(text)[1:-1]` with `ensure_ascii=True`: `"` and `\`
//! get a backslash; `\n \r \t \b \f` their short escapes; every other character outside
//! `' '..='~'` becomes `\uxxxx` (lowercase hex), a character above U+FFFF a UTF-16 surrogate
//! pair `\udXXX\udXXX`. `/` is not escaped. The output is ASCII.
//!
//! [`Unescaper`] reads escaped text back, escape by escape, left to right:
//! - `\" \\ \/ \b \f \n \r \t` and `\uXXXX` (hex in either case) as `json.loads` reads them;
//!   a high surrogate escape followed by a low one is one character;
//! - a lone surrogate escape (which `json.loads` keeps but UTF-8 cannot hold) becomes U+FFFD;
//! - what `json.loads` rejects is read best-effort, like Python's `unicode_escape` codec with
//!   `errors="ignore"`: a `\u` with fewer than four hex digits is dropped together with those
//!   digits, a `\` at the very end is dropped, and a backslash before any other character is
//!   kept as written (`\q` stays `\q`);
//! - everything else (raw control characters, unescaped quotes, non-ASCII) passes through.
//!
//! So every text that `json.loads('"' + s + '"')` accepts without lone surrogates decodes
//! exactly as Python decodes it. Unlike the Python class, the best-effort rules apply to each
//! escape on its own rather than switching the whole text to `unicode_escape` (which would
//! also turn non-ASCII into mojibake and JSON's `\/` into `\/`): that keeps decoding local,
//! so a stream of pieces decodes to the same text as the whole.

/// `json.dumps(text)[1:-1]` with Python's defaults (see the module doc).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    push_u_escape(&mut out, *u);
                }
            }
        }
    }
    out
}

fn push_u_escape(out: &mut String, unit: u16) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push_str("\\u");
    for shift in [12, 8, 4, 0] {
        out.push(char::from(HEX[usize::from((unit >> shift) & 0xf)]));
    }
}

/// Reads escaped text back (rules in the module doc), accepting it in pieces: an escape split
/// across pieces is held until it is complete, so the concatenated output does not depend
/// on where the input was cut.
#[derive(Debug, Clone, Default)]
pub struct Unescaper {
    /// An incomplete escape at the end of the input so far (starts with `\`).
    pending: String,
}

/// The outcome of reading one escape at the start of a text.
enum Step {
    /// `consumed` bytes were read; `out` is what they decode to.
    Done { consumed: usize, out: Option<char> },
    /// The text ends inside a possible escape.
    NeedMore,
}

impl Unescaper {
    /// Appends the decoding of `piece` to `out`, holding back an unfinished escape.
    pub fn push(&mut self, piece: &str, out: &mut String) {
        let owned;
        let text = if self.pending.is_empty() {
            piece
        } else {
            self.pending.push_str(piece);
            owned = std::mem::take(&mut self.pending);
            owned.as_str()
        };
        self.run(text, false, out);
    }

    /// Ends the text: an unfinished escape is resolved by the end-of-text rules.
    pub fn finish(&mut self, out: &mut String) {
        let rest = std::mem::take(&mut self.pending);
        self.run(&rest, true, out);
    }

    fn run(&mut self, mut text: &str, at_end: bool, out: &mut String) {
        while let Some(i) = text.find('\\') {
            out.push_str(&text[..i]);
            text = &text[i..];
            match read_escape(text, at_end) {
                Step::Done { consumed, out: c } => {
                    out.extend(c);
                    text = &text[consumed..];
                }
                Step::NeedMore => {
                    self.pending.push_str(text);
                    return;
                }
            }
        }
        out.push_str(text);
    }
}

/// Decodes a whole escaped text ([`Unescaper`] in one piece).
pub fn unescape(text: &str) -> String {
    let mut u = Unescaper::default();
    let mut out = String::with_capacity(text.len());
    u.push(text, &mut out);
    u.finish(&mut out);
    out
}

/// Reads the escape at the start of `s` (`s` starts with `\`).
fn read_escape(s: &str, at_end: bool) -> Step {
    let b = s.as_bytes();
    let Some(&kind) = b.get(1) else {
        return if at_end {
            Step::Done {
                consumed: 1,
                out: None,
            }
        } else {
            Step::NeedMore
        };
    };
    let short = match kind {
        b'"' => Some('"'),
        b'\\' => Some('\\'),
        b'/' => Some('/'),
        b'b' => Some('\u{8}'),
        b'f' => Some('\u{c}'),
        b'n' => Some('\n'),
        b'r' => Some('\r'),
        b't' => Some('\t'),
        _ => None,
    };
    if let Some(c) = short {
        return Step::Done {
            consumed: 2,
            out: Some(c),
        };
    }
    if kind != b'u' {
        // Not a JSON escape: kept as written. The backslash goes out here; the character
        // after it is not a backslash (`\\` is an escape), so it is read as plain text next.
        return Step::Done {
            consumed: 1,
            out: Some('\\'),
        };
    }
    let digits = b[2..]
        .iter()
        .take(4)
        .take_while(|c| c.is_ascii_hexdigit())
        .count();
    if digits < 4 {
        return if 2 + digits < b.len() || at_end {
            // Fewer than four hex digits: `\u` and the digits are dropped.
            Step::Done {
                consumed: 2 + digits,
                out: None,
            }
        } else {
            Step::NeedMore
        };
    }
    let unit = hex4(&b[2..6]);
    match unit {
        0xD800..=0xDBFF => match low_surrogate(&b[6..]) {
            Low::Found(low) => {
                let c = 0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                Step::Done {
                    consumed: 12,
                    out: char::from_u32(c),
                }
            }
            Low::Partial if !at_end => Step::NeedMore,
            _ => Step::Done {
                consumed: 6,
                out: Some(char::REPLACEMENT_CHARACTER),
            },
        },
        0xDC00..=0xDFFF => Step::Done {
            consumed: 6,
            out: Some(char::REPLACEMENT_CHARACTER),
        },
        u => Step::Done {
            consumed: 6,
            out: char::from_u32(u32::from(u)),
        },
    }
}

enum Low {
    Found(u16),
    /// What follows could still become a low surrogate escape.
    Partial,
    Absent,
}

/// Whether `b` starts with `\uDC00`..`\uDFFF` (a prefix of one counts as [`Low::Partial`]).
fn low_surrogate(b: &[u8]) -> Low {
    let pattern: [fn(u8) -> bool; 6] = [
        |c| c == b'\\',
        |c| c == b'u',
        |c| c == b'd' || c == b'D',
        |c| matches!(c, b'c'..=b'f' | b'C'..=b'F'),
        |c| c.is_ascii_hexdigit(),
        |c| c.is_ascii_hexdigit(),
    ];
    for (i, ok) in pattern.iter().enumerate() {
        match b.get(i) {
            None => return Low::Partial,
            Some(&c) if !ok(c) => return Low::Absent,
            _ => {}
        }
    }
    Low::Found(hex4(&b[2..6]))
}

/// The value of four ASCII hex digits (the caller checked them).
fn hex4(b: &[u8]) -> u16 {
    b.iter().fold(0u16, |v, &c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => 0,
        };
        (v << 4) | u16::from(d)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escape_matches_python_json_dumps() {
        // Expected strings are json.dumps(text)[1:-1] from CPython 3.11.
        let cases = [
            ("", ""),
            ("plain / text", "plain / text"),
            ("a\"b\\c", "a\\\"b\\\\c"),
            ("\n\r\t\u{8}\u{c}", "\\n\\r\\t\\b\\f"),
            ("\u{0}\u{1f}\u{7f}\u{80}", "\\u0000\\u001f\\u007f\\u0080"),
            ("café", "caf\\u00e9"),
            ("日本", "\\u65e5\\u672c"),
            ("🦊", "\\ud83e\\udd8a"),
            ("\u{ffff}\u{10000}", "\\uffff\\ud800\\udc00"),
        ];
        for (text, want) in cases {
            assert_eq!(escape(text), want, "{text:?}");
        }
    }

    #[test]
    fn unescape_reads_json_and_best_effort() {
        let cases = [
            ("a\\nb\\/c\\\"\\\\", "a\nb/c\"\\"),
            ("\\u00E9\\u00e9", "éé"),
            ("\\ud83e\\udd8a!", "🦊!"),
            ("\\ud83e\\uDD8A", "🦊"),
            // Lone surrogates.
            ("\\ud83e!", "\u{fffd}!"),
            ("\\udd8a", "\u{fffd}"),
            ("\\ud83e\\u0041", "\u{fffd}A"),
            ("\\ud83e", "\u{fffd}"),
            // Best effort.
            ("\\u12x", "x"),
            ("\\u12", ""),
            ("end\\", "end"),
            ("\\q\\x41\\'", "\\q\\x41\\'"),
            ("raw\nnewline \"quote\" é", "raw\nnewline \"quote\" é"),
        ];
        for (text, want) in cases {
            assert_eq!(unescape(text), want, "{text:?}");
        }
    }

    #[test]
    fn every_cut_gives_the_same_text() {
        let text = "a\\ud83e\\udd8a\\u00e9\\n\\q\\u12x\\\\\\ud83e\\u0041 end\\";
        let whole = unescape(text);
        for cut in 0..=text.len() {
            for cut2 in cut..=text.len() {
                let mut u = Unescaper::default();
                let mut out = String::new();
                u.push(&text[..cut], &mut out);
                u.push(&text[cut..cut2], &mut out);
                u.push(&text[cut2..], &mut out);
                u.finish(&mut out);
                assert_eq!(out, whole, "cuts {cut} {cut2}");
            }
        }
    }

    proptest! {
        #[test]
        fn unescape_inverts_escape(text in any::<String>()) {
            let e = escape(&text);
            prop_assert!(e.is_ascii());
            prop_assert_eq!(unescape(&e), text);
        }

        #[test]
        fn pieces_decode_like_the_whole(
            text in "[a\\\\u0-9dDcC\"n/é🦊]{0,40}",
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(text.len() + 1)).collect();
            at.retain(|&i| text.is_char_boundary(i));
            at.sort_unstable();
            let mut u = Unescaper::default();
            let mut out = String::new();
            let mut start = 0;
            for &i in &at {
                u.push(&text[start..i], &mut out);
                start = i;
            }
            u.push(&text[start..], &mut out);
            u.finish(&mut out);
            prop_assert_eq!(out, unescape(&text));
        }
    }
}
