//! The `foxedge` binary: `generate` with no arguments, options, errors, `logits`
//! reproducing the golden logits through .npy files, text in and out (`tokenize`,
//! `detokenize`, `generate`) on a directory laid out like the official checkpoints,
//! `quantize` and `bench --model`.

mod common;

use common::*;
use std::process::Command;

fn foxedge() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_foxedge"));
    // Run from the repository root, as `cargo run` does.
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// Fails with the command's stderr unless it exited successfully.
fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn generate_with_no_options_streams_text_and_stats() {
    let out = foxedge()
        .args(["generate", "--max-tokens", "40"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("import os\n"), "{text}");
    let last = text.lines().last().unwrap();
    for key in [
        "prefill",
        "decode",
        "tok/s",
        "certified",
        "forced",
        "peak",
        "pruned",
        "max B_t",
    ] {
        assert!(last.contains(key), "stats line lacks {key}: {last}");
    }
}

#[test]
fn generate_json_and_options() {
    let out = foxedge()
        .args([
            "generate",
            "--prompt",
            "def f(x):\n",
            "--max-tokens",
            "30",
            "--budget",
            "32",
            "--window",
            "8",
        ])
        .args([
            "--sinks",
            "2",
            "--log-eps",
            "-8",
            "--seed",
            "7",
            "--temperature",
            "0",
            "--json",
        ])
        .args(["--backend", "cpu", "--model", model_dir().to_str().unwrap()])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["backend"], "cpu");
    assert!(v["decode_tokens"].as_u64().unwrap() >= 1);
    assert!(
        v["peak_cache_bytes"].as_u64().unwrap()
            <= 16 * 32 * foxedge::session::entry_bytes(64, foxedge::CacheDtype::default()) as u64
    );
    // Greedy is deterministic.
    let again = foxedge()
        .args([
            "generate",
            "--prompt",
            "def f(x):\n",
            "--max-tokens",
            "30",
            "--budget",
            "32",
            "--window",
            "8",
        ])
        .args([
            "--sinks",
            "2",
            "--log-eps",
            "-8",
            "--seed",
            "7",
            "--temperature",
            "0",
            "--json",
        ])
        .output()
        .unwrap();
    let a = String::from_utf8_lossy(&again.stdout);
    assert_eq!(text.lines().next(), a.lines().next());
}

/// `--backend vulkan`: `generate` and `bench --model` first run an untimed warm-up session;
/// its tokens stay out of the reported session's statistics (the same prompt and decode
/// counts as on the CPU) and the bench reports every row. Without a Vulkan driver both
/// fail with the backend's error.
#[test]
fn vulkan_generate_and_bench_warm_up_outside_their_figures() {
    let generate = |backend: &str| {
        foxedge()
            .args(["generate", "--prompt", "def f(x):\n", "--max-tokens", "3"])
            .args(["--temperature", "0", "--json", "--backend", backend])
            .output()
            .unwrap()
    };
    let json = |out: &std::process::Output| -> serde_json::Value {
        assert_succeeded(out);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_json::from_str(text.lines().last().unwrap()).unwrap()
    };
    let out = generate("vulkan");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("backend unavailable: vulkan"), "{err}");
        return;
    }
    let (cpu, vk) = (json(&generate("cpu")), json(&out));
    for key in ["prefill_tokens", "decode_tokens", "tokens"] {
        assert_eq!(cpu[key], vk[key], "{key}");
    }
    let out = foxedge()
        .args([
            "bench",
            "--model",
            "models/fox-tiny-pro",
            "--backend",
            "vulkan",
        ])
        .args([
            "--prompt", "16", "--gen", "2", "--depth", "0,32", "--reps", "1",
        ])
        .arg("--json")
        .output()
        .unwrap();
    assert_succeeded(&out);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for row in rows {
        assert_eq!(row["samples"].as_array().unwrap().len(), 1);
        assert!(row["median_tps"].as_f64().unwrap() > 0.0);
    }
}

/// Usage errors (a bad value, conflicting or unknown flags, a missing required one, an unknown
/// command) and errors while running exit 1, as `foxedge: <message>`.
#[test]
fn bad_arguments_fail_cleanly() {
    for (args, code) in [
        (vec!["generate", "--max-tokens", "abc"], 1),
        (vec!["generate", "--no-acp", "--log-eps", "-5"], 1),
        (vec!["generate", "--backend", "tpu"], 1),
        (vec!["generate", "--budget", "4", "--window", "8"], 1),
        (vec!["generate", "--model", "/nonexistent"], 1),
        (vec!["generate", "--frobnicate"], 1),
        (vec!["logits", "--input", "x.npy"], 1),
        (vec!["nosuch"], 1),
        (vec!["bench", "--lengths", "1"], 1),
        (vec!["bench", "--pool", "a.json", "--full"], 1),
        (vec!["generate", "--weights", "q5"], 1),
        (vec!["quantize", "--to", "q8", "--out", "/tmp/x"], 1),
        (
            vec![
                "quantize",
                "--model",
                "/nonexistent",
                "--to",
                "q8",
                "--out",
                "/tmp/x",
            ],
            1,
        ),
        (
            vec!["bench", "--model", "models/fox-tiny-pro", "--reps", "0"],
            1,
        ),
        (
            vec!["inspect", "--text", "/nonexistent", "--plot", "x.png"],
            1,
        ),
        (
            vec!["logits", "--input", "/nonexistent", "--output", "x.npy"],
            1,
        ),
    ] {
        let out = foxedge().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("foxedge: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let out = foxedge()
        .args(["generate", "--backend", "hybrid", "--max-tokens", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("backend unavailable"),
        "{err}"
    );
}

/// `--help` of the command and of every subcommand prints its usage on stdout and exits 0;
/// `--version` prints the version; no arguments prints the help on stderr and exits 2.
#[test]
fn help_and_version() {
    for sub in [
        vec![],
        vec!["generate"],
        vec!["tokenize"],
        vec!["detokenize"],
        vec!["logits"],
        vec!["bench"],
        vec!["inspect"],
        vec!["quantize"],
    ] {
        for flag in ["--help", "-h"] {
            let out = foxedge().args(&sub).arg(flag).output().unwrap();
            assert_succeeded(&out);
            let text = String::from_utf8_lossy(&out.stdout);
            let usage = format!("Usage: foxedge {}", sub.join(" "));
            assert!(text.contains(usage.trim_end()), "{sub:?} {flag}:\n{text}");
            assert!(text.contains("--help"), "{sub:?} {flag}:\n{text}");
        }
    }
    let out = foxedge().arg("help").arg("generate").output().unwrap();
    assert_succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--max-tokens"));
    let out = foxedge().arg("--version").output().unwrap();
    assert_succeeded(&out);
    let v = format!("foxedge {}\n", env!("CARGO_PKG_VERSION"));
    assert_eq!(String::from_utf8_lossy(&out.stdout), v);
    let out = foxedge().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage: foxedge <COMMAND>"));
}

#[test]
fn logits_command_reproduces_golden_logits() {
    let dir = synth::temp_dir("cli-logits");
    let input = dir.join("ids.npy");
    let ids = input_ids();
    let ids32: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    write_npy(&input, &[ids.len()], &ids32);
    let (_, want) = npy_f32("logits.npy");
    for acp in [vec!["--no-acp"], vec!["--log-eps", "-10"]] {
        let output = dir.join("logits.npy");
        let out = foxedge()
            .args([
                "logits",
                "--model",
                model_dir().to_str().unwrap(),
                "--input",
            ])
            .arg(&input)
            .arg("--output")
            .arg(&output)
            .args(&acp)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let (shape, got) = read_npy::<f32>(&output);
        assert_eq!(shape, vec![1024, 256]);
        let (max, rel) = errors(&got, &want);
        assert!(max <= 2e-3 && rel <= 1e-4, "{acp:?}: {max:.3e} {rel:.3e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `foxedge bench` prints its table (every backend opened, the auto/best line, the
/// control pairs) and writes its JSON and PNG plots; `foxedge inspect` writes the decay
/// picture. Cells of 128 tokens and a few calls each: the output is checked, not the
/// figures. Under CI a missing Vulkan device fails it.
#[test]
fn bench_and_inspect_write_the_table_and_the_pictures() {
    let dir = synth::temp_dir("cli-bench");
    let json = dir.join("bench.json");
    let out = foxedge()
        .args(["bench", "--lengths", "128", "--reps", "2", "--warm", "1"])
        // A budget well above a CPU call of this cell (28 ms quiet, 53 ms on a loaded
        // 2-core host): past it, `bench` skips the cpu2 control by design.
        .args([
            "--budget-s",
            "0.2",
            "--batch-ms",
            "2",
            "--control",
            "--plot",
        ])
        .arg(&dir)
        .arg("--out")
        .arg(&json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let table = String::from_utf8_lossy(&out.stdout);
    let vulkan = !err.contains("skipping vulkan");
    if !vulkan {
        common::device::missing(
            "bench_and_inspect_write_the_table_and_the_pictures",
            &"bench ran cpu and auto only",
        );
    }
    let mut backends = vec!["cpu", "auto", "cpu2"];
    if vulkan {
        backends.extend(["vulkan", "hybrid", "vulkan2"]);
    }
    for op in ["prefill", "decode"] {
        for b in &backends {
            let row = [op, "128", "dense", b];
            let found = table
                .lines()
                .any(|l| l.split_whitespace().take(4).eq(row.iter().copied()));
            assert!(found, "no row {row:?}:\n{table}");
        }
        let png = std::fs::read(dir.join(format!("{op}_throughput.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{op} plot");
    }
    assert!(
        table.contains("# auto / best single backend >= 0.95 in "),
        "{table}"
    );
    assert!(
        table.contains(
            "# auto / best single backend by total time (mean call time over the samples): "
        ),
        "{table}"
    );
    assert!(table.contains("# control (cpu / cpu2, two identical engines)"));
    assert_eq!(
        table.contains("# control (vulkan / vulkan2, two identical engines)"),
        vulkan,
        "{table}"
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2 * 2 * backends.len(), "{report}");
    assert_eq!(report["auto_vs_best"].as_array().unwrap().len(), 4);

    // The report pools with itself: one row per cell, two readings each.
    let twice = format!("{},{}", json.display(), json.display());
    let out = foxedge()
        .args(["bench", "--pool", &twice])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let pooled = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        pooled.lines().filter(|l| l.contains("| 2 |")).count(),
        4,
        "{pooled}"
    );
    assert!(pooled.contains("# pooled >= 0.95 in "), "{pooled}");
    assert!(
        pooled.contains("# identical engines (control pairs)"),
        "{pooled}"
    );

    let text = dir.join("text.txt");
    std::fs::write(&text, "def f(x):\n    return x + 1\n".repeat(8)).unwrap();
    let picture = dir.join("decay.png");
    let out = foxedge()
        .args(["inspect", "--text"])
        .arg(&text)
        .arg("--plot")
        .arg(&picture)
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert!(std::fs::read(&picture).unwrap().starts_with(b"\x89PNG"));
    std::fs::remove_dir_all(dir).ok();
}

/// A directory laid out like the official checkpoints (config.json, model.safetensors,
/// vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json; random weights,
/// vocabulary 50257): `tokenize` prints the reference ids (tiktoken's r50k of the
/// JSON-escaped text, BOS first), `detokenize` gives the text back, `generate --prompt`
/// streams text and stops at a `--stop` string without printing it.
#[test]
fn official_layout_directory_tokenize_detokenize_generate() {
    let s = synth::Synth {
        vocab: 50257,
        hidden: 16,
        layers: 2,
        heads: 2,
        pro: true,
        seed: 31,
        const_gate_logit: None,
    };
    let dir = synth::write_model_dtype(&s, "cli-official", "F32");
    synth::write_official_tokenizer(&dir);
    let m = dir.to_str().unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(synth::gpt2_dir().join("reference.json")).unwrap(),
    )
    .unwrap();
    let ids_of = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut checked = 0;
    for case in reference["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        // Empty text, quotes and backslashes, CRLF, accents, CJK, emoji, NUL.
        let wanted = [
            "She said",
            "line one\r\n",
            "caf\u{e9}",
            "\u{65e5}\u{672c}",
            "I love",
            "x\u{0}y",
        ];
        if !(text.is_empty() || wanted.iter().any(|w| text.starts_with(w))) {
            continue;
        }
        let mut want = vec![50256];
        want.extend(ids_of(&case["json_gpt2"]));
        // Through a file: argv cannot carry every text (NUL).
        let file = dir.join("text.txt");
        std::fs::write(&file, text).unwrap();
        let out = foxedge()
            .args(["tokenize", "--model", m, "--file"])
            .arg(&file)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let got: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got, want, "{text:?}");
        let list: Vec<String> = got.iter().map(u32::to_string).collect();
        let out = foxedge()
            .args(["detokenize", "--model", m, "--ids", &list.join(",")])
            .output()
            .unwrap();
        assert_succeeded(&out);
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            format!("<|endoftext|>{text}")
        );
        let out = foxedge()
            .args(["detokenize", "--model", m, "--skip-special", "--ids"])
            .arg(format!("{got:?}"))
            .output()
            .unwrap();
        assert_succeeded(&out);
        assert_eq!(String::from_utf8(out.stdout).unwrap(), text);
        checked += 1;
    }
    assert_eq!(checked, 7);
    let out = foxedge()
        .args([
            "tokenize",
            "--model",
            m,
            "--no-bos",
            "--text",
            "Hello, world!",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[15496,11,995,0]\n");

    let prompt = "def square(x):\n";
    let generate = |extra: &[&str]| {
        let out = foxedge()
            .args(["generate", "--model", m, "--prompt", prompt])
            .args(["--max-tokens", "30", "--seed", "4", "--top-k", "100"])
            .args(extra)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.starts_with(prompt), "{text}");
        let end = text.rfind("\n[stats] ").expect("a statistics line");
        text[prompt.len()..end].to_string()
    };
    let text = generate(&[]);
    let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    assert!(starts.len() > 10, "{text:?}");
    let stop = &text[starts[5]..starts[8]];
    let cut = generate(&["--stop", "\u{1}unused", "--stop", stop]);
    assert_eq!(cut, text[..text.find(stop).unwrap()]);

    // Errors are named: a model directory without a tokenizer, a bad id, no input.
    std::fs::remove_file(dir.join("vocab.json")).unwrap();
    for (args, needle) in [
        (vec!["tokenize", "--model", m, "--text", "a"], "vocab.json"),
        (
            vec!["generate", "--model", m, "--prompt", "a"],
            "vocab.json",
        ),
        (
            vec!["detokenize", "--model", m, "--ids", "1,x"],
            "item 1 `x`",
        ),
        (vec!["tokenize", "--model", m], "--text"),
    ] {
        let out = foxedge().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("foxedge: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let out = foxedge()
        .args(["detokenize", "--ids", "104,105,300"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("token id 300"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

/// The bundled byte model: `tokenize` is BOS 0 then the bytes, `detokenize` the bytes back.
#[test]
fn bundled_model_tokenize_and_detokenize() {
    let out = foxedge()
        .args(["tokenize", "--text", "hi\n"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[0,104,105,10]\n");
    let out = foxedge()
        .args(["detokenize", "--skip-special", "--ids", "0 104 105"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi");
}

/// `foxedge quantize` writes a directory that `logits` opens as stored (Q8 tiles read in
/// place), giving the logits of `--weights q8` on the original; `bench --model` on it
/// reports every row in JSON.
#[test]
fn quantize_then_bench_the_model() {
    let dir = synth::temp_dir("cli-quantize");
    let q8 = dir.join("q8");
    let out = foxedge()
        .args(["quantize", "--quiet", "--model"])
        .arg(model_dir())
        .args(["--to", "q8", "--out"])
        .arg(&q8)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dense layers q8"), "{err}");
    for f in ["config.json", "model.safetensors"] {
        assert!(q8.join(f).is_file(), "{f}");
    }
    let input = dir.join("ids.npy");
    let ids: Vec<i32> = input_ids()[..64].iter().map(|&x| x as i32).collect();
    write_npy(&input, &[ids.len()], &ids);
    let logits = |model: &std::path::Path, extra: &[&str], tag: &str| {
        let output = dir.join(format!("{tag}.npy"));
        let out = foxedge()
            .args(["logits", "--quiet", "--no-acp", "--model"])
            .arg(model)
            .args(extra)
            .arg("--input")
            .arg(&input)
            .arg("--output")
            .arg(&output)
            .output()
            .unwrap();
        assert_succeeded(&out);
        read_npy::<f32>(&output).1
    };
    let stored = logits(&q8, &[], "stored");
    let at_load = logits(&model_dir(), &["--weights", "q8"], "at-load");
    assert_eq!(
        stored, at_load,
        "the saved tiles are the ones quantized at load"
    );
    let f32 = logits(&model_dir(), &[], "f32");
    let (_, rel) = errors(&stored, &f32);
    assert!(rel > 0.0 && rel < 0.02, "q8 against f32: rel L2 {rel}");

    let out = foxedge()
        .args(["bench", "--model"])
        .arg(&q8)
        .args([
            "--prompt", "16", "--gen", "4", "--depth", "0,32", "--reps", "2", "--json",
        ])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    assert_eq!(r["dense_weights"], "q8");
    assert_eq!(r["converted_bytes"], 0);
    let rows = r["rows"].as_array().unwrap();
    let tests: Vec<(&str, u64)> = rows
        .iter()
        .map(|row| {
            (
                row["test"].as_str().unwrap(),
                row["depth"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tests,
        [
            ("prefill", 0),
            ("decode", 16),
            ("continuation", 32),
            ("decode", 48)
        ]
    );
    for row in rows {
        assert_eq!(row["samples"].as_array().unwrap().len(), 2);
        assert!(row["median_tps"].as_f64().unwrap() > 0.0);
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `generate --session FILE`: a missing file starts a session and saves it; a later run
/// restores it and continues the stream (its statistics carry on); a damaged file is a
/// named error that leaves the file as it was.
#[test]
fn generate_session_file_continues_and_refuses_damage() {
    let dir = synth::temp_dir("cli-session");
    let file = dir.join("chat.fxs");
    let run = |prompt: &str| {
        foxedge()
            .args(["generate", "--prompt", prompt, "--max-tokens", "8"])
            .args(["--temperature", "0", "--json", "--cache", "f16"])
            .args(["--model", model_dir().to_str().unwrap()])
            .arg("--session")
            .arg(&file)
            .output()
            .unwrap()
    };
    let tokens = |out: &std::process::Output| {
        let text = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        v["tokens"].as_u64().unwrap()
    };
    let first = run("def f(x):\n");
    assert_succeeded(&first);
    let n1 = tokens(&first);
    assert!(file.exists() && n1 > 8);
    let second = run("    return");
    assert_succeeded(&second);
    assert!(tokens(&second) > n1, "the restored stream continues");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&file, &bytes).unwrap();
    let bad = run("x");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("bad session file: checksum mismatch"), "{err}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        bytes,
        "the file is left as it was"
    );
    let _ = std::fs::remove_dir_all(dir);
}
