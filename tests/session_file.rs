//! Save, restore and fork: a restored or forked session continues bit-identically; a
//! damaged, truncated or foreign file is a named error that leaves the session as it was.

mod common;

use common::synth::{Synth, temp_dir, write_model};
use common::*;
use foxedge::{Budget, Error, Model, Session, SessionFileError, SessionOptions};
use std::sync::Arc;

/// Feeds `ids` in calls of `sizes` (cycled; scored sessions get a score per position) and
/// returns the last token's logits after every call.
fn run(s: &mut Session, ids: &[u32], sizes: &[usize], at0: usize) -> Vec<f32> {
    let v = s.model().info().vocab;
    let mut out = Vec::new();
    let mut logits = vec![0.0f32; v];
    let (mut at, mut i) = (0, 0);
    while at < ids.len() {
        let n = sizes[i % sizes.len()].min(ids.len() - at);
        if s.options().scored {
            let sc: Vec<f32> = (at0 + at..at0 + at + n)
                .map(|p| ((p * 37) % 11) as f32 - 5.0)
                .collect();
            s.feed_scored(&ids[at..at + n], &sc, Some(&mut logits))
                .unwrap();
        } else {
            s.feed(&ids[at..at + n], Some(&mut logits)).unwrap();
        }
        out.extend_from_slice(&logits);
        at += n;
        i += 1;
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn option_sets() -> Vec<SessionOptions> {
    vec![
        SessionOptions::default(),
        dense_opts(),
        SessionOptions {
            budget: Some(Budget::EntriesPerHead(48)),
            window: 8,
            sinks: 3,
            ..Default::default()
        },
        SessionOptions {
            budget: Some(Budget::EntriesPerLayer(120)),
            window: 4,
            sinks: 1,
            scored: true,
            certified_eviction: false,
            ..Default::default()
        },
    ]
}

/// The state after a save/restore (file or bytes, a new session or in place) and after a
/// fork continues exactly as the original does.
#[test]
fn restored_and_forked_sessions_continue_bit_identically() {
    let model = tiny();
    let ids = input_ids();
    let dir = temp_dir("session-file");
    for (k, opts) in option_sets().into_iter().enumerate() {
        let mut a = session(&model, opts.clone());
        run(&mut a, &ids[..300], &[130, 1, 1, 17, 1, 40], 0);
        let saved = a.save_bytes().unwrap();
        let path = dir.join(format!("s{k}.fxs"));
        a.save(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), saved);
        let mut b = Session::load_bytes(model.clone(), &saved).unwrap();
        let mut c = Session::load(model.clone(), &path).unwrap();
        let mut d = session(&model, SessionOptions::default());
        run(&mut d, &ids[500..520], &[20], 0);
        d.restore(&path).unwrap();
        let mut f = a.fork().unwrap();
        for s in [&b, &c, &d, &f] {
            assert_eq!(s.options(), a.options(), "options {k}");
            assert_eq!(s.position(), a.position());
            assert_eq!(s.stats(), a.stats(), "stats {k}");
            assert_eq!(s.save_bytes().unwrap(), saved, "state {k}");
        }
        let sizes = [1, 1, 5, 1, 64, 1, 1];
        let want = bits(&run(&mut a, &ids[300..500], &sizes, 300));
        for (name, s) in [
            ("bytes", &mut b),
            ("file", &mut c),
            ("in place", &mut d),
            ("fork", &mut f),
        ] {
            assert_eq!(
                bits(&run(s, &ids[300..500], &sizes, 300)),
                want,
                "{name}, options {k}"
            );
            assert_eq!(s.stats().evicted_forced, a.stats().evicted_forced);
            assert_eq!(s.stats().kept_pairs, a.stats().kept_pairs);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A fork is independent: feeding it does not move the original.
#[test]
fn a_fork_branches() {
    let model = tiny();
    let ids = input_ids();
    let mut a = session(&model, SessionOptions::default());
    run(&mut a, &ids[..200], &[200], 0);
    let mut control = Session::load_bytes(model.clone(), &a.save_bytes().unwrap()).unwrap();
    let mut f = a.fork().unwrap();
    run(&mut f, &ids[600..700], &[1, 30], 0);
    assert_eq!(f.position(), 300);
    assert_eq!(a.position(), 200);
    let want = bits(&run(&mut control, &ids[200..260], &[1, 7], 200));
    assert_eq!(bits(&run(&mut a, &ids[200..260], &[1, 7], 200)), want);
}

fn reason(e: Error) -> SessionFileError {
    match e {
        Error::SessionFile { reason, .. } => reason,
        other => panic!("expected a session file error, got {other}"),
    }
}

/// Truncated, damaged, foreign and empty files are refused with their reason, and the
/// session they were restored into keeps its state.
#[test]
fn bad_files_are_named_errors_and_change_nothing() {
    let model = tiny();
    let ids = input_ids();
    let mut a = session(
        &model,
        SessionOptions {
            budget: Some(Budget::EntriesPerHead(40)),
            window: 4,
            ..Default::default()
        },
    );
    run(&mut a, &ids[..100], &[100], 0);
    let good = a.save_bytes().unwrap();
    let mut s = session(&model, SessionOptions::default());
    run(&mut s, &ids[200..230], &[30], 0);
    let before = s.save_bytes().unwrap();
    let mut check = |bytes: &[u8], want: SessionFileError, what: &str| {
        let e = s.restore_bytes(bytes).unwrap_err();
        assert_eq!(e.kind(), foxedge::ErrorKind::BadSessionFile, "{what}: {e}");
        assert_eq!(reason(e), want, "{what}");
        assert_eq!(
            s.save_bytes().unwrap(),
            before,
            "{what}: the session changed"
        );
        let e = Session::load_bytes(model.clone(), bytes).unwrap_err();
        assert_eq!(reason(e), want, "{what} (load)");
    };
    check(b"", SessionFileError::NotASessionFile, "empty");
    check(
        b"GIF89a..",
        SessionFileError::NotASessionFile,
        "other format",
    );
    for cut in (8..good.len())
        .step_by(good.len() / 97 + 1)
        .chain([good.len() - 1])
    {
        check(
            &good[..cut],
            SessionFileError::Truncated,
            &format!("cut at {cut}"),
        );
    }
    for at in (32..good.len()).step_by(good.len() / 53 + 1) {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        check(&bad, SessionFileError::Checksum, &format!("flip at {at}"));
    }
    let mut v2 = good.clone();
    v2[8] = 2;
    check(&v2, SessionFileError::Version, "version 2");
    let mut longer = good.clone();
    longer.push(0);
    check(&longer, SessionFileError::Corrupt, "trailing byte");

    // Another model: same shapes would still differ in identity.
    let dir = write_model(&Synth::default(), "session-file-other");
    let other = Arc::new(Model::open(&dir).unwrap());
    let mut o = session(&other, SessionOptions::default());
    o.feed(&[1, 2, 3], None).unwrap();
    check(
        &o.save_bytes().unwrap(),
        SessionFileError::OtherModel,
        "other model",
    );
    let _ = std::fs::remove_dir_all(dir);

    // A missing file is an I/O error; the session is unchanged.
    let e = s.restore("/nonexistent/foxedge/session.fxs").unwrap_err();
    assert_eq!(e.kind(), foxedge::ErrorKind::Io);
    assert_eq!(s.save_bytes().unwrap(), before);
}

/// Values behind a valid checksum that no stream can produce are refused as corrupt.
#[test]
fn corrupt_contents_behind_a_valid_checksum() {
    let model = tiny();
    let ids = input_ids();
    let mut a = session(&model, SessionOptions::default());
    run(&mut a, &ids[..64], &[64], 0);
    let good = a.save_bytes().unwrap();
    // Rewrites the checksum after a change of the payload.
    let reseal = |mut b: Vec<u8>| {
        let n = b.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
        b
    };
    assert!(Session::load_bytes(model.clone(), &reseal(good.clone())).is_ok());
    let mut bad_backend = good.clone();
    bad_backend[32 + 16] = 9; // the backend code, after the 16-byte shape
    let e = Session::load_bytes(model.clone(), &reseal(bad_backend)).unwrap_err();
    assert_eq!(reason(e), SessionFileError::Corrupt);
    // Bytes of the payload set to 0xff in turn (each of the options, statistics and the
    // first layer's state, then about 1,500 spread over the rest): refused or restored,
    // never a panic; a restored one feeds (or reports an error) without panicking.
    let end = good.len() - 8;
    let spread = (end / 1500) | 1;
    for at in (32..end.min(600)).chain((600..end).step_by(spread)) {
        let mut b = good.clone();
        b[at] = 0xff;
        if let Ok(mut s) = Session::load_bytes(model.clone(), &reseal(b)) {
            let _ = s.feed(&ids[64..66], None);
        }
    }
}
