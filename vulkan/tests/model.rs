//! The device-resident model against a plain f64 FoX forward (docs/FOX_MODEL_SPEC.md,
//! sections 3 and 6) on random models of several shapes and every weight format (f32, f16,
//! bf16, and Q8 / Q4 blocks packed by foxedge-cpu, dequantized by the shaders): a fresh
//! chunk through the prefill path, then tokens one at a time against the resident cache,
//! with a budget that evicts the oldest row by swap-delete (the device applies the moves).
//!
//! Tolerance: |logit - reference| <= 2e-3 * (1 + |reference|). The device computes in f32
//! (products of up to 256 terms, attention over up to 60 keys, 2 layers); the reference in
//! f64 from the same stored weights (f16 / bf16 widened exactly, Q8 / Q4 dequantized
//! exactly: `d q` fits f32), so the difference is f32 rounding, about 1e-5 relative per op,
//! well inside the bound.

mod common;

use foxedge_core::quant::WeightFormat;
use foxedge_cpu::linear::PackedWeights;
use foxedge_vulkan::model::{
    Act, DeviceStream, Gates, HeadStep, LayerPlan, LayerWeights, ModelOptions, ModelShape,
    ModelWeights, Output, QkNorm, RowOp, TokenPlan, Weights, decode_blocks,
};
use half::{bf16, f16};
use rand::Rng;
use std::sync::Arc;

/// A random model's tensors (f32) and its shape.
struct Model {
    shape: ModelShape,
    /// Q8 / Q4: every matrix packed, in the order [`weights`] takes them.
    packed: Vec<PackedWeights>,
    emb: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm: Vec<f32>,
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    ks: Vec<f32>,
    vs: Vec<f32>,
    f: Vec<f32>,
    fb: Vec<f32>,
    g: Vec<f32>,
    on: Vec<f32>,
    qn: Vec<f32>,
    kn: Vec<f32>,
    o: Vec<f32>,
    mlp_norm: Vec<f32>,
    gu: Vec<f32>,
    down: Vec<f32>,
}

#[derive(Clone, Copy, PartialEq)]
enum Fmt {
    F32,
    F16,
    Bf16,
    Q8,
    Q4,
}

/// `x` (`[rows, cols]`) rounded through the storage format; Q8 / Q4 also packed.
fn stored(x: &[f32], rows: usize, cols: usize, f: Fmt) -> (Vec<f32>, Option<PackedWeights>) {
    let q = match f {
        Fmt::F32 => return (x.to_vec(), None),
        Fmt::F16 => return (x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(), None),
        Fmt::Bf16 => {
            return (
                x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                None,
            );
        }
        Fmt::Q8 => WeightFormat::Q8,
        Fmt::Q4 => WeightFormat::Q4,
    };
    let p = PackedWeights::quantize(q, rows, cols, 1, |r, out: &mut [f32]| {
        out.copy_from_slice(&x[r * cols..(r + 1) * cols]);
        Ok::<(), foxedge_core::Error>(())
    })
    .unwrap();
    let mut deq = vec![0.0f32; rows * cols];
    for (r, row) in deq.chunks_exact_mut(cols).enumerate() {
        p.view().row(r, row).unwrap();
    }
    (deq, Some(p))
}

fn random_model(shape: ModelShape, seed: u64, fmt: Fmt) -> Model {
    let mut r = common::rng(seed);
    let (d, h, i, v) = (shape.hidden, shape.heads, shape.intermediate, shape.vocab);
    let mut packed = Vec::new();
    let mut mat = |rows: usize, cols: usize| {
        let x = common::randn(&mut r, rows * cols, 1.0 / (cols as f32).sqrt());
        let (w, p) = stored(&x, rows, cols, fmt);
        packed.extend(p);
        w
    };
    // In the order `weights` takes them.
    let (emb, lm) = (mat(v, d), mat(v, d));
    let mut layers = Vec::new();
    let mut r2 = common::rng(seed + 1);
    let mut near1 = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| 1.0 + 0.2 * (r2.r#gen::<f32>() - 0.5))
            .collect()
    };
    let qk = if shape.qk_norm == QkNorm::Shared {
        shape.head_dim
    } else {
        d
    };
    for _ in 0..shape.layers {
        layers.push(Layer {
            attn_norm: near1(d),
            q: mat(d, d),
            k: mat(d, d),
            v: mat(d, d),
            ks: mat(h, d),
            vs: mat(h, d),
            f: mat(h, d),
            fb: (0..h).map(|j| 1.0 + j as f32).collect(),
            g: mat(d, d),
            on: near1(d),
            qn: near1(qk),
            kn: near1(qk),
            o: mat(d, d),
            mlp_norm: near1(d),
            gu: mat(2 * i, d),
            down: mat(d, i),
        });
    }
    Model {
        shape,
        packed,
        emb,
        norm: near1(d),
        lm,
        layers,
    }
}

/// Storage of one model in a format (keeps the converted vectors alive).
struct Stored {
    f16: Vec<Vec<f16>>,
    bf16: Vec<Vec<bf16>>,
}

fn weights<'a>(m: &'a Model, fmt: Fmt, st: &'a mut Stored) -> ModelWeights<'a> {
    // Every matrix in the order `w` below takes them.
    let mut mats: Vec<&Vec<f32>> = vec![&m.emb, &m.lm];
    for l in &m.layers {
        mats.extend([
            &l.q, &l.k, &l.v, &l.ks, &l.vs, &l.f, &l.g, &l.o, &l.gu, &l.down,
        ]);
    }
    st.f16 = mats
        .iter()
        .map(|x| x.iter().map(|&v| f16::from_f32(v)).collect())
        .collect();
    st.bf16 = mats
        .iter()
        .map(|x| x.iter().map(|&v| bf16::from_f32(v)).collect())
        .collect();
    let st: &'a Stored = st;
    let w = |i: usize| -> Weights<'a> {
        match fmt {
            Fmt::F32 => Weights::F32(mats[i]),
            Fmt::F16 => Weights::F16(&st.f16[i]),
            Fmt::Bf16 => Weights::Bf16(&st.bf16[i]),
            Fmt::Q8 => Weights::Q8(m.packed[i].view().tiles()),
            Fmt::Q4 => Weights::Q4(m.packed[i].view().tiles()),
        }
    };
    let s = &m.shape;
    let layers = m
        .layers
        .iter()
        .enumerate()
        .map(|(li, l)| {
            let b = 2 + 10 * li;
            LayerWeights {
                attn_norm: &l.attn_norm,
                q: w(b),
                k: w(b + 1),
                v: w(b + 2),
                k_shift: s.k_shift.then(|| w(b + 3)),
                v_shift: s.v_shift.then(|| w(b + 4)),
                fgate: w(b + 5),
                fgate_bias: &l.fb,
                ogate: s.output_gate.map(|_| w(b + 6)),
                output_norm: s.output_norm.then_some(&l.on[..]),
                q_norm: (s.qk_norm != QkNorm::Off).then_some(&l.qn[..]),
                k_norm: (s.qk_norm != QkNorm::Off).then_some(&l.kn[..]),
                o: w(b + 7),
                mlp_norm: &l.mlp_norm,
                gate_up: w(b + 8),
                down: w(b + 9),
            }
        })
        .collect();
    ModelWeights {
        embeddings: w(0),
        layers,
        norm: &m.norm,
        lm_head: w(1),
    }
}

// ---------------------------------------------------------------------------------------
// f64 reference
// ---------------------------------------------------------------------------------------

fn mv(w: &[f32], x: &[f64], rows: usize) -> Vec<f64> {
    let k = x.len();
    (0..rows)
        .map(|r| (0..k).map(|i| f64::from(w[r * k + i]) * x[i]).sum())
        .collect()
}

fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, &g)| v * r * f64::from(g))
        .collect()
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn act(a: Act, x: f64) -> f64 {
    match a {
        Act::Sigmoid => sig(x),
        Act::Silu => x * sig(x),
    }
}

/// One cache entry of the reference: (position, k, v, c).
type Entry = (u64, Vec<f64>, Vec<f64>, f64);

struct RefState {
    shift: Vec<(Vec<f64>, Vec<f64>)>,
    c: Vec<Vec<f64>>,
    cache: Vec<Vec<Vec<Entry>>>,
    pos: u64,
}

impl RefState {
    fn new(s: &ModelShape) -> Self {
        Self {
            shift: vec![(vec![0.0; s.hidden], vec![0.0; s.hidden]); s.layers],
            c: vec![vec![0.0; s.heads]; s.layers],
            cache: vec![vec![Vec::new(); s.heads]; s.layers],
            pos: 0,
        }
    }
}

/// One token through the reference, keeping at most `budget` entries per head (the oldest
/// evicted first, before the new one is stored); returns its logits.
fn ref_token(m: &Model, st: &mut RefState, id: u32, budget: usize) -> Vec<f64> {
    let s = &m.shape;
    let (d, nh, hd, i) = (s.hidden, s.heads, s.head_dim, s.intermediate);
    let mut h: Vec<f64> = m.emb[id as usize * d..][..d]
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    for (li, l) in m.layers.iter().enumerate() {
        let x = rms(&h, &l.attn_norm, s.norm_eps);
        let mut q = mv(&l.q, &x, d);
        let kr = mv(&l.k, &x, d);
        let vr = mv(&l.v, &x, d);
        let mut k = kr.clone();
        let mut v = vr.clone();
        if s.k_shift {
            let a = mv(&l.ks, &x, nh);
            for c in 0..d {
                let al = sig(a[c / hd]);
                k[c] = al * st.shift[li].0[c] + (1.0 - al) * kr[c];
            }
        }
        if s.v_shift {
            let a = mv(&l.vs, &x, nh);
            for c in 0..d {
                let al = sig(a[c / hd]);
                v[c] = al * st.shift[li].1[c] + (1.0 - al) * vr[c];
            }
        }
        st.shift[li] = (kr, vr);
        if s.qk_norm != QkNorm::Off {
            for hh in 0..nh {
                let wo = if s.qk_norm == QkNorm::Shared {
                    0
                } else {
                    hh * hd
                };
                let nq = rms(&q[hh * hd..(hh + 1) * hd], &l.qn[wo..wo + hd], s.qk_eps);
                let nk = rms(&k[hh * hd..(hh + 1) * hd], &l.kn[wo..wo + hd], s.qk_eps);
                q[hh * hd..(hh + 1) * hd].copy_from_slice(&nq);
                k[hh * hd..(hh + 1) * hd].copy_from_slice(&nk);
            }
        }
        let z = mv(&l.f, &x, nh);
        let mut o = vec![0.0; d];
        for hh in 0..nh {
            let zz = z[hh] + f64::from(l.fb[hh]);
            st.c[li][hh] += zz.min(0.0) - (-zz.abs()).exp().ln_1p();
            let cache = &mut st.cache[li][hh];
            if cache.len() + 1 > budget {
                let old = (0..cache.len()).min_by_key(|&j| cache[j].0).unwrap();
                cache.swap_remove(old);
            }
            cache.push((
                st.pos,
                k[hh * hd..(hh + 1) * hd].to_vec(),
                v[hh * hd..(hh + 1) * hd].to_vec(),
                st.c[li][hh],
            ));
            let ct = st.c[li][hh];
            let qh = &q[hh * hd..(hh + 1) * hd];
            let sc: Vec<f64> = cache
                .iter()
                .map(|(_, kk, _, cj)| {
                    qh.iter().zip(kk).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt() + ct
                        - cj
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let den: f64 = w.iter().sum();
            for (wj, (_, _, vv, _)) in w.iter().zip(cache.iter()) {
                for c in 0..hd {
                    o[hh * hd + c] += wj * vv[c] / den;
                }
            }
        }
        if s.output_norm {
            for hh in 0..nh {
                let n = rms(
                    &o[hh * hd..(hh + 1) * hd],
                    &l.on[hh * hd..(hh + 1) * hd],
                    s.norm_eps,
                );
                o[hh * hd..(hh + 1) * hd].copy_from_slice(&n);
            }
        }
        if let Some(a) = s.output_gate {
            let g = mv(&l.g, &x, d);
            for c in 0..d {
                o[c] *= act(a, g[c]);
            }
        }
        let ao = mv(&l.o, &o, d);
        for c in 0..d {
            h[c] += ao[c];
        }
        let y = rms(&h, &l.mlp_norm, s.norm_eps);
        let gu = mv(&l.gu, &y, 2 * i);
        let a: Vec<f64> = (0..i).map(|j| act(s.mlp_act, gu[j]) * gu[i + j]).collect();
        let dn = mv(&l.down, &a, d);
        for c in 0..d {
            h[c] += dn[c];
        }
    }
    st.pos += 1;
    let x = rms(&h, &m.norm, s.norm_eps);
    mv(&m.lm, &x, s.vocab)
}

// ---------------------------------------------------------------------------------------
// The caller's side: gates, c in f64, a budget with oldest-first swap-delete.
// ---------------------------------------------------------------------------------------

/// What a session keeps per (layer, head): each slot's position and c, the running c.
struct Book {
    slots: Vec<Vec<Vec<(u64, f64)>>>,
    c: Vec<Vec<f64>>,
    pos: u64,
    budget: usize,
}

impl Book {
    fn new(s: &ModelShape, budget: usize) -> Self {
        Self {
            slots: vec![vec![Vec::new(); s.heads]; s.layers],
            c: vec![vec![0.0; s.heads]; s.layers],
            pos: 0,
            budget,
        }
    }

    fn plan(&mut self, s: &ModelShape, g: &Gates<'_>, fresh: bool) -> LayerPlan {
        let (nh, n, l) = (s.heads, g.tokens, g.layer);
        let lf = |t: usize, h: usize| f64::from(g.log_f[t * nh + h]);
        if fresh {
            let mut c = vec![0.0; nh * n];
            let mut ops = vec![Vec::new(); nh];
            for h in 0..nh {
                for t in 0..n {
                    self.c[l][h] += lf(t, h);
                    c[h * n + t] = self.c[l][h];
                    let slot = self.slots[l][h].len() as u32;
                    self.slots[l][h].push((self.pos + t as u64, self.c[l][h]));
                    ops[h].push(RowOp::Put {
                        token: t as u32,
                        slot,
                        c: self.c[l][h],
                        pos: self.pos + t as u64,
                    });
                }
            }
            return LayerPlan::Chunk {
                c,
                delta: vec![None; nh],
                ops,
            };
        }
        let mut steps = Vec::new();
        for t in 0..n {
            let mut heads = Vec::new();
            for h in 0..nh {
                self.c[l][h] += lf(t, h);
                let ct = self.c[l][h];
                let sl = &mut self.slots[l][h];
                let mut ops = Vec::new();
                if sl.len() + 1 > self.budget {
                    let old = (0..sl.len()).min_by_key(|&j| sl[j].0).unwrap();
                    let last = sl.len() - 1;
                    if old != last {
                        ops.push(RowOp::Move {
                            from: last as u32,
                            to: old as u32,
                        });
                    }
                    sl.swap_remove(old);
                }
                let pos = self.pos + t as u64;
                ops.push(RowOp::Put {
                    token: t as u32,
                    slot: sl.len() as u32,
                    c: ct,
                    pos,
                });
                sl.push((pos, ct));
                let cs: Vec<f64> = sl.iter().map(|e| e.1).collect();
                // A threshold that prunes blocks far in the past (exercises the flags).
                let (kept, stats) = decode_blocks(&cs, ct, Some(-60.0), 64);
                heads.push(HeadStep {
                    ops,
                    live: sl.len(),
                    c_t: ct,
                    kept,
                    stats,
                });
            }
            steps.push(TokenPlan { heads });
        }
        LayerPlan::Tokens(steps)
    }
}

fn shapes() -> Vec<ModelShape> {
    vec![
        ModelShape {
            vocab: 97,
            hidden: 128,
            layers: 2,
            heads: 2,
            head_dim: 64,
            intermediate: 256,
            norm_eps: 1e-6,
            qk_eps: 1e-5,
            qk_norm: QkNorm::PerHead,
            k_shift: true,
            v_shift: true,
            output_gate: Some(Act::Sigmoid),
            output_norm: true,
            mlp_act: Act::Silu,
        },
        ModelShape {
            vocab: 50,
            hidden: 96,
            layers: 2,
            heads: 3,
            head_dim: 32,
            intermediate: 200,
            norm_eps: 1e-5,
            qk_eps: 1e-5,
            qk_norm: QkNorm::Shared,
            k_shift: false,
            v_shift: true,
            output_gate: Some(Act::Silu),
            output_norm: false,
            mlp_act: Act::Sigmoid,
        },
        ModelShape {
            vocab: 64,
            hidden: 64,
            layers: 1,
            heads: 4,
            head_dim: 16,
            intermediate: 128,
            norm_eps: 1e-6,
            qk_eps: 1e-5,
            qk_norm: QkNorm::Off,
            k_shift: false,
            v_shift: false,
            output_gate: None,
            output_norm: false,
            mlp_act: Act::Silu,
        },
    ]
}

fn check_close(got: &[f32], want: &[f64], what: &str) {
    for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 2e-3 * (1.0 + w.abs());
        assert!(
            (f64::from(g) - w).abs() <= tol,
            "{what}: logit {j}: device {g} vs reference {w}"
        );
    }
}

#[test]
fn device_model_matches_the_f64_reference() {
    let Some(vk) = common::device() else {
        return;
    };
    for (si, shape) in shapes().into_iter().enumerate() {
        for fmt in [Fmt::F32, Fmt::F16, Fmt::Bf16, Fmt::Q8, Fmt::Q4] {
            let m = random_model(shape, 40 + si as u64, fmt);
            let mut st = Stored {
                f16: vec![],
                bf16: vec![],
            };
            let w = weights(&m, fmt, &mut st);
            let block = matches!(fmt, Fmt::Q8 | Fmt::Q4);
            if block && shape.intermediate % 32 != 0 {
                // The block kernels take rows of whole blocks: down_proj [D, I] is refused.
                let e = vk
                    .load_model(shape, &w, ModelOptions::default())
                    .unwrap_err();
                assert!(matches!(e, foxedge_vulkan::Error::Unsupported(_)), "{e}");
                continue;
            }
            let dm = Arc::new(vk.load_model(shape, &w, ModelOptions::default()).unwrap());
            // Uploaded as stored: the matrices' bytes (Q8 / Q4: the packed tiles, 34 / 18
            // bytes per 32 weights, rows padded to 16) and the f32 vectors.
            let mats = w.embeddings.bytes()
                + w.lm_head.bytes()
                + w.layers
                    .iter()
                    .flat_map(|l| {
                        [
                            Some(l.q),
                            Some(l.k),
                            Some(l.v),
                            l.k_shift,
                            l.v_shift,
                            Some(l.fgate),
                            l.ogate,
                            Some(l.o),
                            Some(l.gate_up),
                            Some(l.down),
                        ]
                    })
                    .flatten()
                    .map(|x| x.bytes())
                    .sum::<u64>();
            let (d, h) = (shape.hidden, shape.heads);
            let qk = if shape.qk_norm == QkNorm::Shared {
                shape.head_dim
            } else {
                d
            };
            let vecs = 4 * (d + shape.layers * (3 * d + h + 2 * qk)) as u64;
            assert_eq!(dm.bytes(), mats + vecs);
            let mut ds = DeviceStream::new(dm).unwrap();
            let budget = 24;
            let mut book = Book::new(&shape, budget);
            let mut rs = RefState::new(&shape);
            let mut r = common::rng(7 + si as u64);
            let ids: Vec<u32> = (0..60)
                .map(|_| r.r#gen_range(0..shape.vocab as u32))
                .collect();
            let what = format!(
                "shape {si} {}",
                ["f32", "f16", "bf16", "q8", "q4"][fmt as usize]
            );

            // A fresh chunk of 17 tokens (under the budget), every row's logits.
            let n0 = 17;
            let mut all = vec![0.0f32; n0 * shape.vocab];
            let mut cb = |g: &Gates<'_>| Ok(book.plan(&shape, g, true));
            ds.run(&ids[..n0], &mut cb, Output::All(&mut all)).unwrap();
            book.pos += n0 as u64;
            for t in 0..n0 {
                let want = ref_token(&m, &mut rs, ids[t], budget);
                check_close(
                    &all[t * shape.vocab..(t + 1) * shape.vocab],
                    &want,
                    &format!("{what} prefill row {t}"),
                );
            }
            // Then tokens one at a time (the budget evicts from token 24 on), and a chunk of
            // 3 tokens through the token steps.
            let mut logits = vec![0.0f32; shape.vocab];
            let mut t = n0;
            while t < ids.len() {
                let n = if t == 40 { 3 } else { 1 };
                let mut cb = |g: &Gates<'_>| Ok(book.plan(&shape, g, false));
                let out = ds
                    .run(&ids[t..t + n], &mut cb, Output::Last(&mut logits))
                    .unwrap();
                book.pos += n as u64;
                assert_eq!(out.submissions as usize, shape.layers + 1);
                let mut want = Vec::new();
                for &id in &ids[t..t + n] {
                    want = ref_token(&m, &mut rs, id, budget);
                }
                check_close(&logits, &want, &format!("{what} token {t}"));
                t += n;
            }
            // Greedy selection on the device picks the reference's largest logit.
            let mut cb = |g: &Gates<'_>| Ok(book.plan(&shape, g, false));
            let out = ds.run(&[3], &mut cb, Output::Greedy).unwrap();
            let want = ref_token(&m, &mut rs, 3, budget);
            let best = (0..want.len())
                .max_by(|&a, &b| want[a].total_cmp(&want[b]))
                .unwrap();
            let tok = out.token.unwrap() as usize;
            assert!(
                tok == best || (want[best] - want[tok]).abs() < 1e-3,
                "{what}: greedy {tok} vs {best}"
            );
        }
    }
}

#[test]
fn a_model_over_its_budget_is_refused_before_allocating() {
    let Some(vk) = common::device() else {
        return;
    };
    let shape = shapes()[2];
    let m = random_model(shape, 3, Fmt::F32);
    let mut st = Stored {
        f16: vec![],
        bf16: vec![],
    };
    let w = weights(&m, Fmt::F32, &mut st);
    let e = vk
        .load_model(
            shape,
            &w,
            ModelOptions {
                budget_bytes: Some(1000),
            },
        )
        .unwrap_err();
    assert!(
        matches!(e, foxedge_vulkan::Error::DoesNotFit { budget: 1000, .. }),
        "{e}"
    );
    // A tensor of the wrong size names itself.
    let mut bad = w.clone();
    bad.norm = &m.norm[..10];
    let e = vk
        .load_model(shape, &bad, ModelOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("final norm"), "{e}");
}
