//! The profile on lavapipe: a recorded step (or a multi-row run) with timestamps after
//! every command gives the same logits, bit for bit, as one without, and charges every
//! command to its kind once per submission (and the products' flops to theirs).
//!
//! Vulkan device: lavapipe here and in CI. With `CI` set, a missing device fails the tests;
//! without it they print why and return.

use crate::device::Context;
use crate::model::weights::tests::device;
use crate::model::{
    Act, DeviceModel, DeviceStream, Gates, LayerPlan, LayerWeights, ModelOptions, ModelShape,
    ModelWeights, Output, QkNorm, RowOp, StepAcp, StepHead, Weights,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// A random FoX Pro model of 2 layers: vocab 64, hidden 32, 2 heads of 16, MLP 64.
fn tiny_model(ctx: &Arc<Context>) -> Arc<DeviceModel> {
    let shape = ModelShape {
        vocab: 64,
        hidden: 32,
        layers: 2,
        heads: 2,
        head_dim: 16,
        intermediate: 64,
        norm_eps: 1e-6,
        qk_eps: 1e-6,
        qk_norm: QkNorm::PerHead,
        k_shift: true,
        v_shift: true,
        output_gate: Some(Act::Sigmoid),
        output_norm: true,
        mlp_act: Act::Silu,
    };
    let (v, d, h, i) = (64, 32, 2, 64);
    let mut r = StdRng::seed_from_u64(7);
    let mut m = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| r.gen_range(-s..s)).collect() };
    let emb = m(v * d, 1.0);
    let head = m(v * d, 0.2);
    let norm = m(d, 1.0);
    let per: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| {
            vec![
                m(d, 1.0),         // 0 attn_norm
                m(d * d, 0.2),     // 1 q
                m(d * d, 0.2),     // 2 k
                m(d * d, 0.2),     // 3 v
                m(h * d, 0.2),     // 4 k shift
                m(h * d, 0.2),     // 5 v shift
                m(h * d, 0.2),     // 6 fgate
                m(h, 1.0),         // 7 fgate bias
                m(d * d, 0.2),     // 8 ogate
                m(d, 1.0),         // 9 output norm
                m(d, 1.0),         // 10 q norm
                m(d, 1.0),         // 11 k norm
                m(d * d, 0.2),     // 12 o
                m(d, 1.0),         // 13 mlp norm
                m(2 * i * d, 0.2), // 14 gate_up
                m(d * i, 0.2),     // 15 down
            ]
        })
        .collect();
    let layers = per
        .iter()
        .map(|t| LayerWeights {
            attn_norm: &t[0],
            q: Weights::F32(&t[1]),
            k: Weights::F32(&t[2]),
            v: Weights::F32(&t[3]),
            k_shift: Some(Weights::F32(&t[4])),
            v_shift: Some(Weights::F32(&t[5])),
            fgate: Weights::F32(&t[6]),
            fgate_bias: &t[7],
            ogate: Some(Weights::F32(&t[8])),
            output_norm: Some(&t[9]),
            q_norm: Some(&t[10]),
            k_norm: Some(&t[11]),
            o: Weights::F32(&t[12]),
            mlp_norm: &t[13],
            gate_up: Weights::F32(&t[14]),
            down: Weights::F32(&t[15]),
        })
        .collect();
    let w = ModelWeights {
        embeddings: Weights::F32(&emb),
        layers,
        norm: &norm,
        lm_head: Weights::F32(&head),
    };
    Arc::new(DeviceModel::upload(ctx, shape, &w, ModelOptions::default()).expect("uploads"))
}

/// Feeds `tokens` one step each (dense attention, no evictions); returns every step's
/// logits.
fn stream(model: &Arc<DeviceModel>, profiling: bool, tokens: &[u32]) -> (DeviceStream, Vec<f32>) {
    let mut s = DeviceStream::new(model.clone()).expect("stream");
    s.set_profiling(profiling);
    let (nl, nh) = (model.shape.layers, model.shape.heads);
    let mut c_prev = vec![0.0f64; nl * nh];
    let mut all = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        let plan: Vec<Vec<StepHead>> = (0..nl)
            .map(|l| {
                (0..nh)
                    .map(|h| StepHead {
                        ops: Vec::new(),
                        live: pos,
                        evict: Vec::new(),
                        c_prev: c_prev[l * nh + h],
                        pos: pos as u64,
                        acp: StepAcp::Dense,
                    })
                    .collect()
            })
            .collect();
        let mut logits = vec![0.0f32; model.shape.vocab];
        let (_, out) = s
            .step(t, &plan, Output::Last(&mut logits))
            .expect("step runs");
        for l in 0..nl {
            for h in 0..nh {
                c_prev[l * nh + h] = out.c_t(l, h);
            }
        }
        all.extend(logits);
    }
    (s, all)
}

#[test]
fn a_profiled_step_times_every_command_and_changes_nothing() {
    let Some(ctx) = device("profiled_step") else {
        return;
    };
    let model = tiny_model(&ctx);
    let tokens = [3u32, 17, 40, 5];
    let (plain, want) = stream(&model, false, &tokens);
    assert!(plain.gpu_profile().is_empty());
    let (prof, got) = stream(&model, true, &tokens);
    assert_eq!(
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "the profile must not change the step"
    );
    let p = prof.gpu_profile();
    if p.is_empty() {
        eprintln!("profiled_step: the device's queue has no timestamps");
        return;
    }
    assert_eq!(p.submissions(), tokens.len() as u64);
    let n = tokens.len() as u64;
    let nl = model.shape.layers as u64;
    // Per layer: the normed projections, one head group's head_step (attention inputs,
    // gates, row operations, ACP) and decode, o of the normed and gated attention output,
    // the normed gate_up, down of the gated activation; and once: the embedding, the normed
    // LM head. No norm, activation, gate or row-operation dispatch of its own, and no copy
    // inside the layers.
    for (kind, per_step) in [
        ("embed", 1),
        ("mv_pre", nl),
        ("head_step", nl),
        ("decode", nl),
        ("mv_o", nl),
        ("mv_gate_up", nl),
        ("mv_down", nl),
        ("lm_head", 1),
    ] {
        let (us, cmds) = p.kind(kind).unwrap_or_else(|| panic!("{kind} timed"));
        assert_eq!(cmds, per_step * n, "{kind}");
        assert!(us.is_finite() && us >= 0.0, "{kind}: {us} µs");
    }
    // The host inputs to the device, the readback (two copies), the logits and the
    // non-finite flag.
    assert_eq!(p.kind("copy").map(|k| k.1), Some(5 * n));
    for kind in [
        "attn_post",
        "rmsnorm",
        "swiglu",
        "attn_pre",
        "gate_step",
        "cache_ops",
        "acp_blocks",
    ] {
        assert!(p.kind(kind).is_none(), "{kind}");
    }
    let table = p.table("steps");
    assert!(table.contains("mv_gate_up") && table.contains("GPU profile of 4 steps"));
}

/// Runs `tokens` as one fresh chunk (dense causal attention, every row stored); returns
/// every token's logits.
fn chunk(model: &Arc<DeviceModel>, profiling: bool, tokens: &[u32]) -> (DeviceStream, Vec<f32>) {
    let mut s = DeviceStream::new(model.clone()).expect("stream");
    s.set_profiling(profiling);
    let nh = model.shape.heads;
    let n = tokens.len();
    let mut plan = |g: &Gates<'_>| {
        let mut c = vec![0.0f64; nh * n];
        let mut ops = vec![Vec::new(); nh];
        for h in 0..nh {
            let mut acc = 0.0f64;
            for t in 0..n {
                acc += f64::from(g.log_f[t * nh + h]);
                c[h * n + t] = acc;
                ops[h].push(RowOp::Put {
                    token: t as u32,
                    slot: t as u32,
                    c: acc,
                    pos: t as u64,
                });
            }
        }
        Ok(LayerPlan::Chunk {
            c,
            delta: vec![None; nh],
            ops,
        })
    };
    let mut logits = vec![0.0f32; n * model.shape.vocab];
    s.run(tokens, &mut plan, Output::All(&mut logits))
        .expect("chunk runs");
    (s, logits)
}

#[test]
fn a_profiled_chunk_times_every_command_and_counts_the_products_flops() {
    let Some(ctx) = device("profiled_chunk") else {
        return;
    };
    let model = tiny_model(&ctx);
    let tokens = [3u32, 17, 40, 5, 9, 63, 0, 21, 8];
    let (plain, want) = chunk(&model, false, &tokens);
    assert!(plain.run_gpu_profile().is_empty());
    let (prof, got) = chunk(&model, true, &tokens);
    assert_eq!(
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "the profile must not change the run"
    );
    assert!(prof.gpu_profile().is_empty(), "no one-token step ran");
    let p = prof.run_gpu_profile();
    if p.is_empty() {
        eprintln!("profiled_chunk: the device's queue has no timestamps");
        return;
    }
    let sh = model.shape;
    let (n, nl) = (tokens.len() as f64, sh.layers as u64);
    let (d, i, pw) = (
        sh.hidden as f64,
        sh.intermediate as f64,
        sh.proj_width() as f64,
    );
    assert_eq!(p.runs(), 1);
    assert_eq!(p.submissions(), nl + 1);
    let npre = model.layers[0].pre.len() as u64;
    for (kind, cmds, flops) in [
        ("embed", 1, 0.0),
        ("rmsnorm", 2 * nl + 1, 0.0),
        ("mm_pre", npre * nl, 2.0 * n * d * pw),
        ("attn_pre", nl, 0.0),
        ("prefill", nl, 0.0),
        ("attn_post", nl, 0.0),
        ("mm_o", nl, 2.0 * n * d * d),
        ("mm_gate_up", nl, 2.0 * n * d * 2.0 * i),
        ("swiglu", nl, 0.0),
        ("mm_down", nl, 2.0 * n * i * d),
        ("mm_lm_head", 1, 0.0),
    ] {
        let (us, c) = p.kind(kind).unwrap_or_else(|| panic!("{kind} timed"));
        assert_eq!(c, cmds, "{kind}");
        assert!(us.is_finite() && us >= 0.0, "{kind}: {us} µs");
        if flops > 0.0 {
            assert_eq!(p.flops(kind), Some(flops * nl as f64), "{kind} flops");
        }
    }
    assert_eq!(p.flops("mm_lm_head"), Some(2.0 * n * d * sh.vocab as f64));
    for kind in [
        "mv_pre",
        "mv_o",
        "mv_gate_up",
        "mv_down",
        "lm_head",
        "decode",
    ] {
        assert!(p.kind(kind).is_none(), "{kind}");
    }
    let table = p.table("multi-row runs");
    assert!(
        table.contains("GPU profile of 1 multi-row runs (9 tokens")
            && table.contains("mm_down")
            && table.contains("TFLOP/s"),
        "{table}"
    );
}
