//! Vulkan backend benchmark and on-device correctness check (what the H100 run uses).
//!
//! `cargo run --release -p foxedge-vulkan --example vk_bench -- [--quick] [--lengths 4096,16384]
//!  [--batches 1,8] [--decode 32768,4096]`
//!
//! 1. Correctness on this device: the layer-1 fixture (dense and ACP; f32 and f16 storage,
//!    every prefill kernel) against the official outputs; random inputs at L = 2048 against
//!    the CPU backend; decode against the CPU backend.
//! 2. Prefill timing: H = 4, d = 64, per (L, B): dense, and ACP for each of the 4 layers of
//!    fox-tiny-pro with real-gate statistics (below). Device time of the kernel on resident
//!    inputs: `reps` calls in one command buffer, wall time of submit-to-fence / reps, the
//!    median of 5 such samples. Host decisions (f64 cumsum + start blocks through
//!    foxedge-core) are timed separately.
//! 3. Decode timing: 8 heads x N cached entries, d = 64, one query (the ggml shapes).
//!
//! Gates for L > 1024: fox-tiny-pro's real log gates are 1024 positions long per (layer,
//! head) (`log_fgate.npy`). Each head's gates at length L are drawn i.i.d. from that head's
//! 1024 real values (bootstrap): same per-head distribution, so the same mean decay, which
//! is what sets the ACP boundary. Thresholds: the model's own per (layer, head),
//! `delta_L = delta_1024 - ln(L / 1024)` (the `- ln L` term of delta = -2U - ln L + ln eps).
//! q, k, v: random in [-1, 1] (the kernel's speed does not depend on their values).

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use bench::{arg_list, rel_l2};
use foxedge_vulkan::{
    Acp, AttentionShape, DecodeArgs, DecodeOptions, FlashConfig, Layout, PrefillArgs,
    PrefillKernel, PrefillOptions, Storage, Vulkan,
};
use half::f16;
use rand::Rng;
use std::time::Instant;

/// Seconds per call of a prepared run: warm-up, reps sized to ~0.1 s, median of 5.
fn time_it(run: &dyn Fn(usize) -> foxedge_vulkan::Result<std::time::Duration>) -> (f64, f64) {
    bench::time_it(run, 1, 1, 0.1, (3, 400))
}

/// `e <= tol`, false for NaN.
fn within(e: f64, tol: f64) -> bool {
    e <= tol
}

/// One prefill kernel variant of the timing table.
#[derive(Clone, Debug)]
struct Variant {
    name: String,
    kern: PrefillKernel,
    flash: FlashConfig,
    half: bool,
}

impl Variant {
    fn select(&self, vk: &Vulkan) {
        vk.set_prefill_kernel(self.kern);
        vk.set_prefill_flash(self.flash);
    }
}

/// Prefill variants by name (`--kernels scalar32,scalar16,cm,fa2,fa4,fa8,fa4nb,fa8nb,auto`;
/// default: scalar32, scalar16, cm, fa4, fa8, auto), those this device runs. `auto` is
/// what `PrefillKernel::Auto` picks (f16).
fn variants(vk: &Vulkan, args: &[String]) -> Vec<Variant> {
    let names: Vec<String> = args
        .iter()
        .position(|a| a == "--kernels")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| {
            ["scalar32", "scalar16", "cm", "fa4", "fa8", "auto"]
                .map(str::to_string)
                .to_vec()
        });
    let mut out = Vec::new();
    for n in names {
        let mut flash = FlashConfig::default();
        let (kern, half) = match n.as_str() {
            "scalar32" => (PrefillKernel::Scalar, false),
            "scalar16" => (PrefillKernel::Scalar, true),
            "cm" => (PrefillKernel::CoopMat, true),
            "auto" => (PrefillKernel::Auto, true),
            x if x.starts_with("fa") => {
                let nb = x.ends_with("nb");
                let digits = x.trim_start_matches("fa").trim_end_matches("nb");
                flash.subgroups = digits.parse().unwrap_or(4);
                flash.shared_blocks = !nb;
                (PrefillKernel::Flash, true)
            }
            other => {
                eprintln!("unknown kernel variant {other}");
                continue;
            }
        };
        if vk.supports(kern) {
            out.push(Variant {
                name: n,
                kern,
                flash,
                half,
            });
        } else {
            println!("variant {n}: not supported on this device");
        }
    }
    out
}

/// The tensor-core variants (f16 only) of `vs`, plus the scalar kernel (f32 and f16).
fn check_variants(vs: &[Variant]) -> Vec<Variant> {
    let mut out = vec![Variant {
        name: "scalar".into(),
        kern: PrefillKernel::Scalar,
        flash: FlashConfig::default(),
        half: false,
    }];
    out.extend(
        vs.iter()
            .filter(|v| v.kern != PrefillKernel::Scalar)
            .cloned(),
    );
    out
}

fn check_fixture(vk: &Vulkan, vs: &[Variant], failures: &mut Vec<String>) {
    let (qs, q) = common::npy_f32("kernel_l1_q.npy");
    let (_, k) = common::npy_f32("kernel_l1_k.npy");
    let (_, v) = common::npy_f32("kernel_l1_v.npy");
    let (_, g) = common::npy_f32("kernel_l1_log_fgate.npy");
    let (_, o) = common::npy_f32("kernel_l1_o.npy");
    let (_, o_acp) = common::npy_f32("kernel_l1_o_acp.npy");
    let (_, thr) = common::npy_f32("kernel_l1_threshold.npy");
    let sh = common::shape(1, qs[0], qs[0], qs[1], qs[1], qs[2], Layout::HeadFirst);
    let t: Vec<f64> = thr.iter().map(|&x| f64::from(x)).collect();
    let h16 = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
    let (q16, k16, v16) = (h16(&q), h16(&k), h16(&v));
    for var in check_variants(vs) {
        var.select(vk);
        let kern = var.kern;
        let vn = &var.name;
        for acp in [false, true] {
            let opts = PrefillOptions {
                sm_scale: Some(0.125),
                acp: if acp { Acp::Threshold(&t) } else { Acp::Off },
                block_q: 128,
                block_k: 64,
                heads: None,
            };
            let want = if acp { &o_acp } else { &o };
            let mut out = vec![f32::NAN; sh.q_len()];
            if kern == PrefillKernel::Scalar {
                let args = PrefillArgs {
                    shape: sh,
                    q: &q,
                    k: &k,
                    v: &v,
                    log_fgate: &g,
                    seq_start: None,
                };
                match vk.prefill(&args, &opts, &mut out, None) {
                    Ok(_) => {
                        let e = rel_l2(&out, want);
                        println!("check fixture L1 {vn} f32 acp={acp}: rel L2 {e:.2e} (tol 2e-5)");
                        if !within(e, 2e-5) {
                            failures.push(format!("fixture {vn} f32 acp={acp}: {e:.2e}"));
                        }
                    }
                    Err(e) => failures.push(format!("fixture {vn} f32: {e}")),
                }
            }
            let args = PrefillArgs {
                shape: sh,
                q: &q16,
                k: &k16,
                v: &v16,
                log_fgate: &g,
                seq_start: None,
            };
            match vk.prefill(&args, &opts, &mut out, None) {
                Ok(_) => {
                    // f16 rounding of q/k/v (the official bf16 kernel sits at ~4e-3).
                    let e = rel_l2(&out, want);
                    println!("check fixture L1 {vn} f16 acp={acp}: rel L2 {e:.2e} (tol 5e-3)");
                    if !within(e, 5e-3) {
                        failures.push(format!("fixture {vn} f16 acp={acp}: {e:.2e}"));
                    }
                }
                Err(e) => failures.push(format!("fixture {vn} f16: {e}")),
            }
        }
    }
    vk.set_prefill_kernel(PrefillKernel::Auto);
}

fn check_random_vs_cpu(vk: &Vulkan, vs: &[Variant], failures: &mut Vec<String>) {
    let sh = common::shape(2, 4, 2, 1000, 2048, 64, Layout::SeqFirst);
    let mut r = common::rng(99);
    let q: Vec<f16> = common::randn(&mut r, sh.q_len(), 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let k: Vec<f16> = common::randn(&mut r, sh.kv_len(), 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let v: Vec<f16> = common::randn(&mut r, sh.kv_len(), 1.0)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let g = common::log_gates(&mut r, sh.gate_len(), 2.0);
    let u = [4.0f64; 4];
    for acp in [false, true] {
        let opts = PrefillOptions {
            acp: if acp {
                Acp::Bound {
                    u: &u,
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
            ..Default::default()
        };
        let cargs = foxedge_cpu::PrefillArgs {
            shape: sh,
            q: &q,
            k: &k,
            v: &v,
            log_fgate: &g,
            seq_start: Some(&[0, 300]),
        };
        let copts = foxedge_cpu::PrefillOptions {
            acp: if acp {
                foxedge_cpu::Acp::Bound {
                    u: &u,
                    ln_eps: -10.0,
                }
            } else {
                foxedge_cpu::Acp::Off
            },
            ..Default::default()
        };
        let mut cout = vec![0.0f32; sh.q_len()];
        let cst = match foxedge_cpu::prefill(&cargs, &copts, &mut cout, None) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("cpu prefill: {e}"));
                return;
            }
        };
        for var in check_variants(vs) {
            var.select(vk);
            let vn = &var.name;
            let args = PrefillArgs {
                shape: sh,
                q: &q,
                k: &k,
                v: &v,
                log_fgate: &g,
                seq_start: Some(&[0, 300]),
            };
            let mut out = vec![f32::NAN; sh.q_len()];
            match vk.prefill(&args, &opts, &mut out, None) {
                Ok(st) => {
                    let e = rel_l2(&out, &cout);
                    let same = st.heads.iter().zip(&cst.heads).all(|(a, b)| {
                        a.kept_pairs == b.kept_pairs && a.total_pairs == b.total_pairs
                    });
                    println!(
                        "check random GQA seq_q<seq_k padded f16 {vn} acp={acp}: rel L2 vs CPU {e:.2e} (tol 1e-3), stats equal {same}"
                    );
                    if !within(e, 1e-3) || !same {
                        failures.push(format!("random {vn} acp={acp}: {e:.2e} stats {same}"));
                    }
                }
                Err(e) => failures.push(format!("random {vn}: {e}")),
            }
        }
    }
    vk.set_prefill_kernel(PrefillKernel::Auto);
}

/// Ragged shapes vs the CPU backend (f16 inputs on both sides): seq_k not a multiple of
/// the 64-key tile, odd seq_q, GQA, left padding, ACP with query/key blocks other than the
/// kernel tiles, strong and weak decay. Output rel L2 <= 1e-3 (P is rounded to f16 for the
/// PV product on the tensor cores), lse within 1e-3 (-inf on the same padded rows), same
/// pair statistics.
fn check_shapes_vs_cpu(vk: &Vulkan, vs: &[Variant], failures: &mut Vec<String>) {
    // (batch, heads_q, heads_kv, seq_q, seq_k, layout, seq_start, gate bias, acp, block_q, block_k)
    #[allow(clippy::type_complexity)]
    let cases: [(
        usize,
        usize,
        usize,
        usize,
        usize,
        Layout,
        Option<Vec<usize>>,
        f32,
        bool,
        usize,
        usize,
    ); 4] = [
        (
            1,
            4,
            2,
            777,
            1999,
            Layout::SeqFirst,
            None,
            2.0,
            true,
            96,
            48,
        ),
        (
            2,
            4,
            4,
            1100,
            1100,
            Layout::HeadFirst,
            Some(vec![0, 333]),
            4.0,
            false,
            64,
            64,
        ),
        (
            3,
            2,
            1,
            50,
            300,
            Layout::SeqFirst,
            Some(vec![0, 17, 299]),
            -1.0,
            true,
            16,
            32,
        ),
        (
            1,
            8,
            8,
            4099,
            4099,
            Layout::HeadFirst,
            None,
            3.0,
            true,
            128,
            64,
        ),
    ];
    for (ci, (b, hq, hkv, tq, tk, lay, start, bias, acp, bq, bk)) in cases.into_iter().enumerate() {
        let sh = common::shape(b, hq, hkv, tq, tk, 64, lay);
        let mut r = common::rng(1234 + ci as u64);
        let h16 = |x: Vec<f32>| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
        let q = h16(common::randn(&mut r, sh.q_len(), 1.0));
        let k = h16(common::randn(&mut r, sh.kv_len(), 1.0));
        let v = h16(common::randn(&mut r, sh.kv_len(), 1.0));
        let g = common::log_gates(&mut r, sh.gate_len(), bias);
        let u = vec![4.0f64; hq];
        let copts = foxedge_cpu::PrefillOptions {
            acp: if acp {
                foxedge_cpu::Acp::Bound {
                    u: &u,
                    ln_eps: -10.0,
                }
            } else {
                foxedge_cpu::Acp::Off
            },
            block_q: bq,
            block_k: bk,
            ..Default::default()
        };
        let cargs = foxedge_cpu::PrefillArgs {
            shape: sh,
            q: &q,
            k: &k,
            v: &v,
            log_fgate: &g,
            seq_start: start.as_deref(),
        };
        let rows = b * hq * tq;
        let mut cout = vec![0.0f32; sh.q_len()];
        let mut clse = vec![0.0f32; rows];
        let cst = match foxedge_cpu::prefill(&cargs, &copts, &mut cout, Some(&mut clse)) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("shapes case {ci} cpu: {e}"));
                continue;
            }
        };
        let opts = PrefillOptions {
            acp: if acp {
                Acp::Bound {
                    u: &u,
                    ln_eps: -10.0,
                }
            } else {
                Acp::Off
            },
            block_q: bq,
            block_k: bk,
            ..Default::default()
        };
        for var in vs.iter().filter(|v| v.kern != PrefillKernel::Scalar) {
            var.select(vk);
            let args = PrefillArgs {
                shape: sh,
                q: &q,
                k: &k,
                v: &v,
                log_fgate: &g,
                seq_start: start.as_deref(),
            };
            let mut out = vec![f32::NAN; sh.q_len()];
            let mut lse = vec![f32::NAN; rows];
            match vk.prefill(&args, &opts, &mut out, Some(&mut lse)) {
                Ok(st) => {
                    let e = rel_l2(&out, &cout);
                    let le = lse
                        .iter()
                        .zip(&clse)
                        .map(|(a, c)| {
                            if c.is_finite() {
                                f64::from((a - c).abs())
                            } else if *a == *c {
                                0.0
                            } else {
                                f64::INFINITY
                            }
                        })
                        .fold(0.0, f64::max);
                    let same = st.heads.iter().zip(&cst.heads).all(|(a, c)| {
                        a.kept_pairs == c.kept_pairs && a.total_pairs == c.total_pairs
                    });
                    println!(
                        "check shapes case {ci} ({b}x{hq}/{hkv} q{tq} k{tk} acp={acp} bq{bq} bk{bk}) {}: rel L2 vs CPU {e:.2e}, lse {le:.1e}, stats equal {same}",
                        var.name
                    );
                    if !within(e, 1e-3) || !within(le, 1e-3) || !same {
                        failures.push(format!(
                            "shapes case {ci} {}: {e:.2e} lse {le:.1e} stats {same}",
                            var.name
                        ));
                    }
                }
                Err(e) => failures.push(format!("shapes case {ci} {}: {e}", var.name)),
            }
        }
    }
    vk.set_prefill_kernel(PrefillKernel::Auto);
    vk.set_prefill_flash(FlashConfig::default());
}

/// Real-gate statistics: bootstrap of each head's 1024 real gates to length `l`.
fn gates(real: &[f32], layer: usize, b: usize, h: usize, l: usize, seed: u64) -> Vec<f32> {
    let src = &real[(layer * 4 + h) * 1024..(layer * 4 + h + 1) * 1024];
    let mut r = common::rng(seed ^ ((layer * 64 + b * 4 + h) as u64) << 20);
    (0..l).map(|_| src[r.gen_range(0..1024)]).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let lengths = arg_list(
        &args,
        "--lengths",
        if quick { &[4096] } else { &[4096, 16384] },
    );
    let batches = arg_list(&args, "--batches", if quick { &[1] } else { &[1, 8] });
    let dec = arg_list(&args, "--decode", &[32768, 4096]);
    let vk = match Vulkan::new() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("no Vulkan device: {e}");
            std::process::exit(2);
        }
    };
    println!("device: {}", vk.info());
    match vk.coopmat_layout() {
        Ok(Some(map)) => {
            for lane in [0usize, 1, 2, 3, 4] {
                println!(
                    "coopmat f32 16x16 layout lane {lane}: (row, col) {:?}",
                    &map[lane * 8..lane * 8 + 8]
                );
            }
        }
        Ok(None) => println!("coopmat f32 16x16 layout: not available"),
        Err(e) => println!("coopmat layout probe failed: {e}"),
    }
    println!(
        "flash kernel (register softmax; accumulator layout probed): {}",
        vk.supports(PrefillKernel::Flash)
    );
    let vars = variants(&vk, &args);
    println!(
        "prefill variants: {:?}",
        vars.iter().map(|v| v.name.as_str()).collect::<Vec<_>>()
    );

    let mut failures = Vec::new();
    check_fixture(&vk, &vars, &mut failures);
    check_random_vs_cpu(&vk, &vars, &mut failures);
    check_shapes_vs_cpu(&vk, &vars, &mut failures);
    // (L, B, gates) -> ms per variant, for the pivot table at the end.
    let mut pivot: Vec<(String, Vec<(String, f64)>)> = Vec::new();

    let (_, real) = common::npy_f32("log_fgate.npy");
    let (_, thr) = common::npy_f32("acp_threshold.npy");
    let mut table = Vec::new();
    let d = 64;
    let h = 4;
    for &l in &lengths {
        for &b in &batches {
            let sh = AttentionShape {
                batch: b,
                heads_q: h,
                heads_kv: h,
                seq_q: l,
                seq_k: l,
                head_dim: d,
                layout: Layout::HeadFirst,
            };
            let mut r = common::rng(l as u64 * 31 + b as u64);
            let q32: Vec<f32> = (0..sh.q_len()).map(|_| r.gen_range(-1.0..1.0)).collect();
            let k32: Vec<f32> = (0..sh.kv_len()).map(|_| r.gen_range(-1.0..1.0)).collect();
            let v32: Vec<f32> = (0..sh.kv_len()).map(|_| r.gen_range(-1.0..1.0)).collect();
            let h16 = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
            let (q16, k16, v16) = (h16(&q32), h16(&k32), h16(&v32));
            let dense_flops = 4.0 * (d * b * h) as f64 * (l * (l + 1) / 2) as f64;
            for layer in [None, Some(0), Some(1), Some(2), Some(3)] {
                let li = layer.unwrap_or(0);
                let mut g = vec![0.0f32; sh.gate_len()];
                for bb in 0..b {
                    for hh in 0..h {
                        let gh = gates(&real, li, bb, hh, l, 7);
                        g[(bb * h + hh) * l..(bb * h + hh + 1) * l].copy_from_slice(&gh);
                    }
                }
                let deltas: Vec<f64> = (0..b * h)
                    .map(|bh| f64::from(thr[li * 4 + bh % h]) - (l as f64 / 1024.0).ln())
                    .collect();
                let opts = PrefillOptions {
                    acp: if layer.is_some() {
                        Acp::Threshold(&deltas)
                    } else {
                        Acp::Off
                    },
                    block_q: 64,
                    block_k: 64,
                    ..Default::default()
                };
                // Host decisions alone (what prepare does before packing): cumsum + boundary.
                let t0 = Instant::now();
                let grid = foxedge_core::boundary::BlockGrid::new(64, 64, l, l).expect("grid");
                let mut c = vec![0.0f64; l];
                let mut st = vec![0u32; grid.q_blocks()];
                for bh in 0..b * h {
                    let _ = foxedge_core::gate::cumsum_strided(
                        &g[bh * l..(bh + 1) * l],
                        1,
                        0.0,
                        &mut c,
                    );
                    let _ = foxedge_core::boundary::start_blocks(
                        &grid,
                        &c,
                        layer.map(|_| deltas[bh]),
                        0,
                        &mut st,
                    );
                }
                let host_ms = t0.elapsed().as_secs_f64() * 1e3;
                let name = layer.map_or("dense".to_string(), |x| format!("ACP L{x}"));
                let mut prow = (format!("| {l} | {b} | {name} |"), Vec::new());
                for var in &vars {
                    var.select(&vk);
                    let (vname, half) = (&var.name, var.half);
                    let prepared = if half {
                        vk.prepare_prefill(
                            &PrefillArgs {
                                shape: sh,
                                q: &q16,
                                k: &k16,
                                v: &v16,
                                log_fgate: &g,
                                seq_start: None,
                            },
                            &opts,
                        )
                    } else {
                        vk.prepare_prefill(
                            &PrefillArgs {
                                shape: sh,
                                q: &q32,
                                k: &k32,
                                v: &v32,
                                log_fgate: &g,
                                seq_start: None,
                            },
                            &opts,
                        )
                    };
                    let p = match prepared {
                        Ok(p) => p,
                        Err(e) => {
                            println!("L={l} B={b} {name} {vname}: {e}");
                            continue;
                        }
                    };
                    let (s, spread) = time_it(&|n| p.run(n));
                    prow.1.push((vname.clone(), s * 1e3));
                    let kept = p.stats().kept_fraction();
                    let flops = 4.0 * d as f64 * p.stats().kept_pairs() as f64;
                    let vname = match (var.kern, p.flash()) {
                        (PrefillKernel::Auto, Some(f)) => format!("auto=fa{}", f.subgroups),
                        (PrefillKernel::Auto, None) => format!("auto=cm:{}", p.coopmat()),
                        _ => vname.clone(),
                    };
                    let row = format!(
                        "| {l} | {b} | {name} | {vname} | {:.3} | {:.1} | {:.1} | {:.3} | {:.2} | {:.0}% |",
                        s * 1e3,
                        flops / s / 1e12,
                        dense_flops / s / 1e12,
                        kept,
                        host_ms,
                        spread * 100.0
                    );
                    println!("{row}");
                    table.push(row);
                }
                pivot.push(prow);
            }
        }
    }
    vk.set_prefill_kernel(PrefillKernel::Auto);
    vk.set_prefill_flash(FlashConfig::default());

    // Decode: 8 heads x n entries, one query, d = 64.
    let mut dtable = Vec::new();
    for &n in &dec {
        let heads = 8;
        let mut r = common::rng(n as u64);
        let k32: Vec<f32> = (0..heads * n * d).map(|_| r.gen_range(-1.0..1.0)).collect();
        let v32: Vec<f32> = (0..heads * n * d).map(|_| r.gen_range(-1.0..1.0)).collect();
        let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
        let q: Vec<f32> = (0..heads * d).map(|_| r.gen_range(-1.0..1.0)).collect();
        let mut cs = Vec::new();
        for hh in 0..heads {
            let g = gates(&real, 3, 0, hh % 4, n, 11);
            let mut acc = 0.0f64;
            cs.push(
                g.iter()
                    .map(|&x| {
                        acc += f64::from(x);
                        acc
                    })
                    .collect::<Vec<f64>>(),
            );
        }
        let q_c: Vec<f64> = cs.iter().map(|c| c[n - 1]).collect();
        for split in [128usize, 256, 512, 2048] {
            for half in [true, false] {
                let res = if half {
                    check_and_time_cache(&vk, (&k16, &v16), &cs, (&q, &q_c), split, &mut failures)
                } else {
                    check_and_time_cache(&vk, (&k32, &v32), &cs, (&q, &q_c), split, &mut failures)
                };
                if let Some((s, spread, bytes)) = res {
                    let row = format!(
                        "| {n} | {heads} | {} | {split} | {:.1} | {:.2} | {:.0}% |",
                        if half { "f16" } else { "f32" },
                        s * 1e6,
                        bytes / s / 1e12,
                        spread * 100.0
                    );
                    println!("{row}");
                    dtable.push(row);
                }
            }
        }
    }

    println!(
        "\n## prefill (H = 4, d = 64; ms per call, kernel only, inputs resident; TFLOP/s of kept work and dense-equivalent)"
    );
    println!(
        "| L | B | gates | kernel | ms | kept TFLOP/s | dense-equiv TFLOP/s | kept frac | host decisions ms | spread |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &table {
        println!("{r}");
    }
    println!("\n## prefill ms per variant (same run)");
    println!(
        "| L | B | gates | {} |",
        vars.iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    for (key, ms) in &pivot {
        let cells: Vec<String> = vars
            .iter()
            .map(|v| {
                ms.iter()
                    .find(|(n, _)| n == &v.name)
                    .map_or("-".to_string(), |(_, t)| format!("{t:.3}"))
            })
            .collect();
        println!("{key} {} |", cells.join(" | "));
    }
    println!("\n## decode (one query, dense; K/V bytes read per step)");
    println!("| cached | heads | storage | split | us | TB/s | spread |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in &dtable {
        println!("{r}");
    }
    if failures.is_empty() {
        println!("\nall correctness checks passed");
    } else {
        println!("\nCORRECTNESS FAILURES:");
        for f in &failures {
            println!("  {f}");
        }
        std::process::exit(1);
    }
}

/// [`check_and_time_decode`] with one query per head over head-major `k`, `v` (each head
/// `cs[h].len()` rows).
fn check_and_time_cache<T: Storage>(
    vk: &Vulkan,
    (k, v): (&[T], &[T]),
    cs: &[Vec<f64>],
    (q, q_c): (&[f32], &[f64]),
    split: usize,
    failures: &mut Vec<String>,
) -> Option<(f64, f64, f64)> {
    let stride = k.len() / cs.len();
    let hs: Vec<_> = k
        .chunks_exact(stride)
        .zip(v.chunks_exact(stride))
        .zip(cs)
        .map(|((k, v), c)| foxedge_vulkan::CacheHead { k, v, c, pos: None })
        .collect();
    let a = DecodeArgs {
        head_dim: q.len() / cs.len(),
        n_queries: 1,
        q,
        q_c,
        q_pos: None,
        heads: &hs,
    };
    check_and_time_decode(vk, &a, split, failures)
}

fn check_and_time_decode<T: Storage>(
    vk: &Vulkan,
    a: &DecodeArgs<'_, f32, T>,
    split: usize,
    failures: &mut Vec<String>,
) -> Option<(f64, f64, f64)> {
    let opts = DecodeOptions {
        split,
        ..Default::default()
    };
    let p = match vk.prepare_decode(a, &opts) {
        Ok(p) => p,
        Err(e) => {
            failures.push(format!("decode prepare: {e}"));
            return None;
        }
    };
    let n = a.heads[0].c.len();
    let d = a.head_dim;
    let mut out = vec![0.0f32; a.heads.len() * d];
    if let Err(e) = p.run(1).and_then(|_| p.read(&mut out, None)) {
        failures.push(format!("decode run: {e}"));
        return None;
    }
    // Against the CPU backend on the same cache.
    let hs: Vec<_> = a
        .heads
        .iter()
        .map(|h| foxedge_cpu::CacheHead {
            k: h.k,
            v: h.v,
            c: h.c,
            pos: None,
        })
        .collect();
    let ca = foxedge_cpu::DecodeArgs {
        head_dim: d,
        n_queries: 1,
        q: a.q,
        q_c: a.q_c,
        q_pos: None,
        heads: &hs,
    };
    let mut cout = vec![0.0f32; out.len()];
    if foxedge_cpu::decode(&ca, &foxedge_cpu::DecodeOptions::default(), &mut cout, None).is_ok() {
        let e = rel_l2(&out, &cout);
        if split == 128 {
            println!(
                "check decode {n} x {} {:?}: rel L2 vs CPU {e:.2e} (tol 1e-4)",
                a.heads.len(),
                <T as Storage>::DTYPE
            );
        }
        if !within(e, 1e-4) {
            failures.push(format!("decode {n} {:?}: {e:.2e}", <T as Storage>::DTYPE));
        }
    }
    let (s, spread) = time_it(&|r| p.run(r));
    let bytes = (2
        * a.heads.len()
        * n
        * d
        * if <T as Storage>::DTYPE == foxedge_vulkan::DType::F16 {
            2
        } else {
            4
        }) as f64;
    Some((s, spread, bytes))
}
