//! Text generation: a prompt's token ids in, text pieces out.
//!
//! [`generate`] feeds the prompt ([`feed_prompt`]), then ([`continue_text`], or
//! [`TextGenerator`] one step at a time) repeats: draw the next id with the [`Sampler`],
//! stop at EOS, decode the id with the tokenizer's [`StreamDecoder`], feed the id to the
//! session, pass the text through the stop-string matcher and hand out what is final.
//!
//! Invariants:
//! - every id drawn except EOS is fed to the session, so afterwards the session's stream is
//!   the prompt followed by [`Generation::tokens`];
//! - the pieces handed out concatenate to the decoded text of [`Generation::tokens`] (special
//!   tokens skipped) or, when the text up to some id contains a stop string, to that text
//!   cut where the stop string's earliest occurrence starts; no piece ends inside a UTF-8
//!   character or an escape, and no piece holds the start of a stop string that later ids
//!   might complete (it is held back until it cannot).

use crate::error::{Error, Result};
use crate::sample::Sampler;
use crate::session::Session;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::ops::ControlFlow;

/// When generation stops, besides the caller's callback.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GenerateOptions {
    /// Ids to draw at most (EOS included).
    pub max_tokens: usize,
    /// Stop when the tokenizer's EOS id is drawn (it is neither fed nor printed).
    pub stop_at_eos: bool,
    /// Stop when the generated text contains one of these (non-empty) strings; the text from
    /// the stop string on is not handed out.
    pub stop: Vec<String>,
}

impl GenerateOptions {
    /// At most `max_tokens` ids, stopping at EOS, no stop strings.
    pub fn new(max_tokens: usize) -> Self {
        GenerateOptions {
            max_tokens,
            stop_at_eos: true,
            stop: Vec::new(),
        }
    }

    /// Checks the stop strings (none may be empty).
    pub fn validate(&self) -> Result<()> {
        match self.stop.iter().position(String::is_empty) {
            Some(i) => Err(Error::invalid(format!("stop string {i} is empty"))),
            None => Ok(()),
        }
    }
}

/// Why [`continue_text`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The EOS id was drawn.
    Eos,
    /// The text reached stop string `i` of [`GenerateOptions::stop`].
    StopString(usize),
    /// `max_tokens` ids were drawn.
    MaxTokens,
    /// The callback returned [`ControlFlow::Break`].
    Caller,
}

/// What a generation produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// The ids drawn and fed to the session, in order (EOS excluded).
    pub tokens: Vec<u32>,
    pub reason: StopReason,
}

/// Feeds `prompt` to `session`, writes the next-token logits into `logits` (`vocab`
/// floats) and records the prompt in the sampler's repetition window.
///
/// Errors: an empty prompt (there would be no logits to draw from), and those of
/// [`Session::feed`], which leave the session unchanged when they come from validation.
pub fn feed_prompt(
    session: &mut Session,
    sampler: &mut Sampler,
    prompt: &[u32],
    logits: &mut [f32],
) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::invalid(
            "the prompt has no tokens (empty text and no BOS to add)",
        ));
    }
    session.feed(prompt, Some(logits))?;
    sampler.accept(prompt);
    Ok(())
}

/// One step of a [`TextGenerator`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Text now final (often empty: an unfinished character, or a possible stop string).
    pub text: String,
    /// Set when the generation has ended (this step's text is its last).
    pub stop: Option<StopReason>,
}

/// Generation driven one id at a time (see the module doc), for callers that do something
/// between ids; [`continue_text`] drives it with a callback.
#[derive(Debug)]
pub struct TextGenerator<'a> {
    opts: &'a GenerateOptions,
    eos: Option<u32>,
    decoder: StreamDecoder,
    stops: StopMatcher<'a>,
    tokens: Vec<u32>,
    done: bool,
}

impl<'a> TextGenerator<'a> {
    /// A generation with `tokenizer`'s decoder and EOS under `opts`.
    ///
    /// Errors: invalid options ([`GenerateOptions::validate`]).
    pub fn new(tokenizer: &Tokenizer, opts: &'a GenerateOptions) -> Result<Self> {
        opts.validate()?;
        Ok(TextGenerator {
            opts,
            eos: tokenizer.eos().filter(|_| opts.stop_at_eos),
            decoder: tokenizer.stream(true),
            stops: StopMatcher::new(&opts.stop),
            tokens: Vec::new(),
            done: false,
        })
    }

    /// Draws the next id from `logits` (the next-token logits after the last id fed to
    /// `session`); unless it is EOS, decodes it and feeds it, leaving the logits that follow
    /// it in `logits`. At the end (EOS, a stop string, `max_tokens` ids) the step's text
    /// includes what was held back and `stop` says why.
    ///
    /// Errors: a step after the end, logits of the wrong length (nothing changes then), and
    /// those of the sampler, the tokenizer and the session.
    pub fn step(
        &mut self,
        session: &mut Session,
        sampler: &mut Sampler,
        logits: &mut [f32],
    ) -> Result<Step> {
        if self.done {
            return Err(Error::invalid("the generation has ended"));
        }
        let vocab = session.model().info().vocab;
        if logits.len() != vocab {
            return Err(Error::invalid(format!(
                "logits buffer has {} floats: expected vocab = {vocab}",
                logits.len()
            )));
        }
        if self.tokens.len() >= self.opts.max_tokens {
            return Ok(self.end(String::new(), StopReason::MaxTokens));
        }
        let id = sampler.sample(logits)?;
        if Some(id) == self.eos {
            return Ok(self.end(String::new(), StopReason::Eos));
        }
        let piece = self.decoder.push(id)?;
        session.feed(&[id], Some(logits))?;
        self.tokens.push(id);
        let (text, hit) = self.stops.push(&piece);
        if let Some(i) = hit {
            self.done = true;
            return Ok(Step {
                text,
                stop: Some(StopReason::StopString(i)),
            });
        }
        if self.tokens.len() == self.opts.max_tokens {
            return Ok(self.end(text, StopReason::MaxTokens));
        }
        Ok(Step { text, stop: None })
    }

    /// The end of the text: an unfinished character or escape, then what the matcher held,
    /// unless that completes a stop string.
    fn end(&mut self, mut text: String, reason: StopReason) -> Step {
        self.done = true;
        let (tail, hit) = self.stops.push(&self.decoder.finish());
        text.push_str(&tail);
        match hit {
            Some(i) => Step {
                text,
                stop: Some(StopReason::StopString(i)),
            },
            None => {
                text.push_str(&self.stops.finish());
                Step {
                    text,
                    stop: Some(reason),
                }
            }
        }
    }

    /// The ids drawn and fed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// Generates from `logits`, the next-token logits after the last id fed to `session`
/// (see the module doc). `on_piece` receives each piece of final text (never empty) and
/// may stop the generation with [`ControlFlow::Break`] ([`StopReason::Caller`]); the id
/// whose text it received has then been fed. On return `logits` follow the last id fed.
///
/// Errors: as [`TextGenerator::new`] and [`TextGenerator::step`].
pub fn continue_text(
    session: &mut Session,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    logits: &mut [f32],
    opts: &GenerateOptions,
    mut on_piece: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    let mut g = TextGenerator::new(tokenizer, opts)?;
    loop {
        let step = g.step(session, sampler, logits)?;
        let flow = if step.text.is_empty() {
            ControlFlow::Continue(())
        } else {
            on_piece(&step.text)
        };
        let reason = match (step.stop, flow) {
            (Some(r), _) => Some(r),
            (None, ControlFlow::Break(())) => Some(StopReason::Caller),
            (None, ControlFlow::Continue(())) => None,
        };
        if let Some(reason) = reason {
            return Ok(Generation {
                tokens: g.tokens,
                reason,
            });
        }
    }
}

/// Feeds `prompt` to `session`, then generates ([`continue_text`]): the whole of a text
/// generation. Checks the options and the prompt before anything is fed.
///
/// Errors: as [`feed_prompt`] and [`continue_text`].
pub fn generate(
    session: &mut Session,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_piece: impl FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    opts.validate()?;
    let mut logits = vec![0.0f32; session.model().info().vocab];
    feed_prompt(session, sampler, prompt, &mut logits)?;
    continue_text(session, tokenizer, sampler, &mut logits, opts, on_piece)
}

/// Finds stop strings in text that arrives in pieces.
///
/// Invariant: `pending` is the text pushed but not yet returned; after each push without a
/// match it is the longest suffix of the text that is a proper prefix of some stop string,
/// so no occurrence of a stop string can start in text already returned.
#[derive(Debug, Clone)]
pub(crate) struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    pub(crate) fn new(stops: &'a [String]) -> Self {
        StopMatcher {
            stops,
            pending: String::new(),
        }
    }

    /// Adds `piece`; returns the text now final and, when the text so far contains a stop
    /// string, its index (the earliest occurrence; among stop strings starting there, the
    /// first listed). After a match the returned text ends where that occurrence starts.
    pub(crate) fn push(&mut self, piece: &str) -> (String, Option<usize>) {
        self.pending.push_str(piece);
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = hit {
            let mut text = std::mem::take(&mut self.pending);
            text.truncate(at);
            return (text, Some(i));
        }
        let keep = self.held_suffix();
        let cut = self.pending.len() - keep;
        let rest = self.pending.split_off(cut);
        (std::mem::replace(&mut self.pending, rest), None)
    }

    /// The text held back (the end of the stream: it can no longer become a stop string).
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length in bytes of the longest suffix of `pending` that is a proper prefix of a stop
    /// string. Such a suffix starts where a stop string's first character would, so at a
    /// character boundary.
    fn held_suffix(&self) -> usize {
        let p = self.pending.as_bytes();
        self.stops
            .iter()
            .map(|s| {
                let s = s.as_bytes();
                (1..s.len().min(p.len() + 1))
                    .rev()
                    .find(|&n| p.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pushes `pieces` through a matcher; returns the text out and the stop index.
    fn run(stops: &[String], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops);
        let mut out = String::new();
        for p in pieces {
            let (t, hit) = m.push(p);
            out.push_str(&t);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_caught_and_not_emitted() {
        let stops = strings(&["\n\nUser:", "END"]);
        assert_eq!(
            run(&stops, &["Hello", " there\n", "\nUs", "er", ": more"]),
            ("Hello there".to_string(), Some(0))
        );
        assert_eq!(
            run(&stops, &["abcE", "N", "Dxyz"]),
            ("abc".to_string(), Some(1))
        );
        // A partial match that fails is emitted in full.
        assert_eq!(
            run(&stops, &["EN", "d ok\n", "\nUse"]),
            ("ENd ok\n\nUse".to_string(), None)
        );
        // The earliest occurrence wins, then the first listed.
        let stops = strings(&["bc", "abc", "a"]);
        assert_eq!(run(&stops, &["xabc"]), ("x".to_string(), Some(1)));
        let stops = strings(&["ab", "a"]);
        assert_eq!(run(&stops, &["xab"]), ("x".to_string(), Some(0)));
    }

    #[test]
    fn text_that_cannot_start_a_stop_string_is_not_held() {
        let stops = strings(&["<|im_end|>"]);
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hi <|im"), ("hi ".to_string(), None));
        assert_eq!(m.push("_e"), (String::new(), None));
        assert_eq!(m.push("x"), ("<|im_ex".to_string(), None));
        // Multi-byte characters: the held suffix starts at a character boundary.
        let stops = strings(&["é!"]);
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("caf\u{e9}"), ("caf".to_string(), None));
        assert_eq!(m.push("?"), ("\u{e9}?".to_string(), None));
    }

    #[test]
    fn empty_stop_strings_are_refused() {
        let o = GenerateOptions {
            stop: strings(&["a", ""]),
            ..GenerateOptions::new(4)
        };
        assert!(
            o.validate()
                .unwrap_err()
                .to_string()
                .contains("stop string 1")
        );
    }

    proptest! {
        /// Against the definition: the first text so far (at the end of a piece) that
        /// contains a stop string is cut before its earliest occurrence (without one, the
        /// whole text is the output), and every text returned is final (a prefix of the
        /// output).
        #[test]
        fn matcher_equals_cutting_the_whole_text(
            text in "[ab\u{e9}\n]{0,40}",
            stops in prop::collection::vec("[ab\u{e9}\n]{1,4}", 0..4),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let mut at: Vec<usize> = cuts.iter().map(|c| *c.get(&bounds)).collect();
            at.sort_unstable();
            let mut pieces = Vec::new();
            let mut start = 0;
            for &i in &at {
                pieces.push(&text[start..i]);
                start = i;
            }
            pieces.push(&text[start..]);
            let mut want = (text.clone(), None);
            let mut so_far = String::new();
            for p in &pieces {
                so_far.push_str(p);
                let first = stops
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| so_far.find(s.as_str()).map(|at| (at, i)))
                    .min();
                if let Some((at, i)) = first {
                    want = (so_far[..at].to_string(), Some(i));
                    break;
                }
            }
            prop_assert_eq!(run(&stops, &pieces), want.clone());
            let mut m = StopMatcher::new(&stops);
            let mut out = String::new();
            for p in &pieces {
                let (t, hit) = m.push(p);
                out.push_str(&t);
                prop_assert!(want.0.starts_with(&out));
                if hit.is_some() {
                    break;
                }
            }
        }
    }
}
