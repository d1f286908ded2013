//! Text generation end to end (`foxedge::generate`): a directory laid out like the official
//! FoX checkpoints (random weights, GPT-2 tokenizer with LongCrawl64's escaping) and the
//! bundled byte-level model. Checked against the definitions: the pieces are the decoded
//! text of the ids drawn, cut at the first stop string; the session holds the prompt and
//! every id drawn but EOS; the byte model draws exactly what the unfiltered sampler draws.

mod common;

use common::synth::{Synth, write_model_dtype, write_official_tokenizer};
use foxedge::generate::{GenerateOptions, StopReason, TextGenerator, generate};
use foxedge::{Model, Rng, Sampler, SamplerConfig, Session, SessionOptions};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

const EOT: u32 = 50256;

/// A FoX Pro model of vocabulary 50257 in the official layout (built once).
fn official() -> Arc<Model> {
    // The directory lives as long as the model: its tokenizer is read from it on demand.
    static M: OnceLock<(common::synth::TestDir, Arc<Model>)> = OnceLock::new();
    M.get_or_init(|| {
        let s = Synth {
            vocab: 50257,
            hidden: 32,
            layers: 2,
            heads: 2,
            pro: true,
            seed: 23,
            const_gate_logit: None,
        };
        let dir = write_model_dtype(&s, "generate-official", "F32");
        write_official_tokenizer(&dir);
        let model = Arc::new(Model::open(&dir).unwrap());
        (dir, model)
    })
    .1
    .clone()
}

fn sampler(seed: u64) -> Sampler {
    Sampler::new(SamplerConfig {
        temperature: 1.0,
        top_k: 200,
        seed,
        ..SamplerConfig::default()
    })
    .unwrap()
}

/// Runs `generate`; returns (pieces, result, session).
fn run(
    model: &Arc<Model>,
    prompt: &str,
    opts: &GenerateOptions,
    seed: u64,
) -> (Vec<String>, foxedge::Generation, Session) {
    let tok = model.tokenizer().unwrap();
    let ids = tok.encode(prompt, true).unwrap();
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut pieces = Vec::new();
    let g = generate(&mut session, tok, &mut sampler(seed), &ids, opts, |p| {
        pieces.push(p.to_string());
        ControlFlow::Continue(())
    })
    .unwrap();
    (pieces, g, session)
}

#[test]
fn pieces_are_the_decoded_ids_and_the_session_holds_them() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    let prompt = "She said \"hi\" \u{2014} caf\u{e9} \u{1F98A}\n";
    let n_prompt = tok.encode(prompt, true).unwrap().len();
    let opts = GenerateOptions::new(24);
    let (pieces, g, session) = run(&model, prompt, &opts, 3);
    assert_eq!(g.reason, StopReason::MaxTokens);
    assert_eq!(g.tokens.len(), 24);
    assert!(pieces.iter().all(|p| !p.is_empty()));
    assert_eq!(pieces.concat(), tok.decode(&g.tokens, true).unwrap());
    assert_eq!(session.position() as usize, n_prompt + 24);
    // Same seed, same ids.
    let (_, again, _) = run(&model, prompt, &opts, 3);
    assert_eq!(again.tokens, g.tokens);
}

/// The session after `generate` continues the stream: its next-token logits equal those of
/// a fresh session fed the prompt and the ids drawn (prefill kernel against one-at-a-time
/// decode: f32 sums in another order, so a relative L2 tolerance of 1e-4).
#[test]
fn the_session_continues_after_the_generated_ids() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    let ids = tok.encode("The quick brown fox", true).unwrap();
    let vocab = model.info().vocab;
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut logits = vec![0.0f32; vocab];
    let mut s = sampler(5);
    foxedge::generate::feed_prompt(&mut session, &mut s, &ids, &mut logits).unwrap();
    let g = foxedge::generate::continue_text(
        &mut session,
        tok,
        &mut s,
        &mut logits,
        &GenerateOptions::new(10),
        |_| ControlFlow::Continue(()),
    )
    .unwrap();
    let mut fresh = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut want = vec![0.0f32; vocab];
    let all: Vec<u32> = ids.iter().chain(&g.tokens).copied().collect();
    fresh.feed(&all, Some(&mut want)).unwrap();
    let (_, rel) = common::errors(&logits, &want);
    assert!(rel <= 1e-4, "relative L2 {rel:.3e}");
}

#[test]
fn a_stop_string_ends_the_text_where_it_starts() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    let prompt = "def f(x):\n";
    let (pieces, full, _) = run(&model, prompt, &GenerateOptions::new(40), 7);
    let text = pieces.concat();
    // A stop string from the middle of the text: three characters from its 8th.
    let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    assert!(starts.len() > 12, "{text:?}");
    let (a, b) = (starts[7], starts[10]);
    let stop = text[a..b].to_string();
    let at = text.find(&stop).unwrap();
    let opts = GenerateOptions {
        stop: vec!["\u{0}never".into(), stop.clone()],
        ..GenerateOptions::new(40)
    };
    let (pieces, g, session) = run(&model, prompt, &opts, 7);
    assert_eq!(g.reason, StopReason::StopString(1));
    assert_eq!(pieces.concat(), text[..at]);
    // It stopped at the first id whose text completed the stop string.
    assert_eq!(g.tokens[..], full.tokens[..g.tokens.len()]);
    let n = g.tokens.len();
    assert!(tok.decode(&g.tokens, true).unwrap().contains(&stop));
    assert!(
        !tok.decode(&g.tokens[..n - 1], true)
            .unwrap()
            .contains(&stop)
    );
    let n_prompt = tok.encode(prompt, true).unwrap().len();
    assert_eq!(session.position() as usize, n_prompt + n);
}

#[test]
fn the_callback_stops_the_generation() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    let ids = tok.encode("x", true).unwrap();
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut calls = 0;
    let g = generate(
        &mut session,
        tok,
        &mut sampler(1),
        &ids,
        &GenerateOptions::new(50),
        |_| {
            calls += 1;
            if calls == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
    )
    .unwrap();
    assert_eq!((g.reason, calls), (StopReason::Caller, 2));
    assert!(g.tokens.len() < 50);
    assert_eq!(session.position() as usize, ids.len() + g.tokens.len());
}

/// EOS, drawn greedily from logits that favour it, ends the text without being fed; with
/// `stop_at_eos` off it is text like any other id.
#[test]
fn eos_ends_the_generation_unfed() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    assert_eq!(tok.eos(), Some(EOT));
    let vocab = model.info().vocab;
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut greedy = Sampler::new(SamplerConfig::greedy()).unwrap();
    let mut logits = vec![0.0f32; vocab];
    logits[EOT as usize] = 5.0;
    let opts = GenerateOptions::new(8);
    let mut g = TextGenerator::new(tok, &opts).unwrap();
    let step = g.step(&mut session, &mut greedy, &mut logits).unwrap();
    assert_eq!(step.stop, Some(StopReason::Eos));
    assert!(step.text.is_empty() && g.tokens().is_empty());
    assert_eq!(session.position(), 0);
    assert!(g.step(&mut session, &mut greedy, &mut logits).is_err());

    let opts = GenerateOptions {
        stop_at_eos: false,
        ..GenerateOptions::new(1)
    };
    let mut g = TextGenerator::new(tok, &opts).unwrap();
    let mut logits = vec![0.0f32; vocab];
    logits[EOT as usize] = 5.0;
    let step = g.step(&mut session, &mut greedy, &mut logits).unwrap();
    assert_eq!(step.stop, Some(StopReason::MaxTokens));
    assert_eq!(g.tokens(), &[EOT]);
    assert_eq!(session.position(), 1);
}

/// Bad input is refused before anything is fed.
#[test]
fn bad_input_changes_nothing() {
    let model = official();
    let tok = model.tokenizer().unwrap();
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let on = |_: &str| ControlFlow::Continue(());
    let bad_stop = GenerateOptions {
        stop: vec![String::new()],
        ..GenerateOptions::new(4)
    };
    let e = generate(&mut session, tok, &mut sampler(0), &[EOT], &bad_stop, on).unwrap_err();
    assert!(e.to_string().contains("stop string 0 is empty"), "{e}");
    let opts = GenerateOptions::new(4);
    let e = generate(&mut session, tok, &mut sampler(0), &[], &opts, on).unwrap_err();
    assert!(e.to_string().contains("no tokens"), "{e}");
    let e = generate(&mut session, tok, &mut sampler(0), &[60000], &opts, on).unwrap_err();
    assert!(e.to_string().contains("60000"), "{e}");
    assert_eq!(session.position(), 0);
}

/// The bundled byte model: BOS 0 then the prompt's bytes, and the ids drawn are those of
/// the unfiltered `sample` with the same seed, as `foxedge generate` drew them before the
/// sampler chain existed.
#[test]
fn the_byte_model_draws_what_the_plain_sampler_draws() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(foxedge::BUNDLED_MODEL);
    let model = Arc::new(Model::open(dir).unwrap());
    let tok = model.tokenizer().unwrap();
    let prompt = "import os\n";
    let ids = tok.encode(prompt, true).unwrap();
    assert_eq!(ids[0], 0);
    assert_eq!(
        &ids[1..],
        prompt
            .as_bytes()
            .iter()
            .map(|&b| u32::from(b))
            .collect::<Vec<_>>()
    );
    let mut session = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut chain = Sampler::new(SamplerConfig {
        temperature: 0.8,
        seed: 9,
        ..SamplerConfig::default()
    })
    .unwrap();
    let mut text = String::new();
    let g = generate(
        &mut session,
        tok,
        &mut chain,
        &ids,
        &GenerateOptions::new(60),
        |p| {
            text.push_str(p);
            ControlFlow::Continue(())
        },
    )
    .unwrap();

    let mut plain = Session::new(model.clone(), SessionOptions::default()).unwrap();
    let mut logits = vec![0.0f32; 256];
    plain.feed(&ids, Some(&mut logits)).unwrap();
    let mut rng = Rng::new(9);
    let mut want = Vec::new();
    while want.len() < 60 {
        let next = foxedge::sample(&logits, 0.8, &mut rng).unwrap();
        if next == 0 {
            break;
        }
        want.push(next);
        plain.feed(&[next], Some(&mut logits)).unwrap();
    }
    assert_eq!(g.tokens, want);
    let bytes: Vec<u8> = want.iter().map(|&b| b as u8).collect();
    assert_eq!(text, String::from_utf8_lossy(&bytes));
}
