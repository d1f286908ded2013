//! A plain f64 FoX forward written from docs/FOX_MODEL_SPEC.md, independent of the engine:
//! it reads config.json and model.safetensors itself and runs dense causal attention.

use foxedge::config::{Config, HiddenAct, OgateAct};
use std::collections::HashMap;
use std::path::Path;

pub struct RefModel {
    pub cfg: Config,
    w: HashMap<String, (Vec<usize>, Vec<f64>)>,
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(a, g)| a * r * g).collect()
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn logsig(x: f64) -> f64 {
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

impl RefModel {
    pub fn load(dir: &Path) -> RefModel {
        let cfg =
            Config::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut w = HashMap::new();
        for (name, view) in st.tensors() {
            let data: Vec<f64> = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
                safetensors::Dtype::BF16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|c| {
                        f64::from(f32::from_bits(
                            u32::from(u16::from_le_bytes([c[0], c[1]])) << 16,
                        ))
                    })
                    .collect(),
                safetensors::Dtype::F16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|c| f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
                    .collect(),
                d => panic!("dtype {d:?}"),
            };
            w.insert(name, (view.shape().to_vec(), data));
        }
        RefModel { cfg, w }
    }

    pub fn t(&self, name: &str) -> &[f64] {
        &self.w.get(name).unwrap_or_else(|| panic!("{name}")).1
    }

    /// `y = x·Wᵀ` for one row.
    fn lin(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (shape, w) = &self.w[name];
        let (out, inp) = (shape[0], shape[1]);
        (0..out)
            .map(|o| (0..inp).map(|i| w[o * inp + i] * x[i]).sum())
            .collect()
    }

    fn group_rms(&self, x: &mut [f64], w: &[f64], hd: usize, eps: f64) {
        for (h, g) in x.chunks_mut(hd).enumerate() {
            let wg = if w.len() == hd {
                w
            } else {
                &w[h * hd..(h + 1) * hd]
            };
            let y = rms(g, wg, eps);
            g.copy_from_slice(&y);
        }
    }

    /// Hidden states `[layers + 1][T][D]` and logits `[T][V]` of a full dense forward.
    pub fn forward(&self, ids: &[u32]) -> (Vec<Vec<Vec<f64>>>, Vec<Vec<f64>>) {
        let c = &self.cfg;
        let (d, nh, hd, i_sz) = (
            c.hidden_size,
            c.num_heads,
            c.head_dim(),
            c.intermediate_size,
        );
        let t_len = ids.len();
        let emb = self.t("model.embeddings.weight");
        let mut h: Vec<Vec<f64>> = ids
            .iter()
            .map(|&id| emb[id as usize * d..][..d].to_vec())
            .collect();
        let mut hidden = vec![h.clone()];
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let x: Vec<Vec<f64>> = h
                .iter()
                .map(|r| rms(r, self.t(&p("attn_norm.weight")), c.norm_eps))
                .collect();
            let mut q: Vec<Vec<f64>> = x
                .iter()
                .map(|r| self.lin(&p("attn.q_proj.weight"), r))
                .collect();
            let mut kv = Vec::new();
            for (which, shift) in [("k_proj", c.use_k_shift), ("v_proj", c.use_v_shift)] {
                let lw = if shift {
                    p(&format!("attn.{which}.linear.weight"))
                } else {
                    p(&format!("attn.{which}.weight"))
                };
                let raw: Vec<Vec<f64>> = x.iter().map(|r| self.lin(&lw, r)).collect();
                let out = if shift {
                    let sw = p(&format!("attn.{which}.shift_proj.weight"));
                    (0..t_len)
                        .map(|t| {
                            let a = self.lin(&sw, &x[t]);
                            (0..d)
                                .map(|ch| {
                                    let al = sig(a[ch / hd]);
                                    let prev = if t == 0 { 0.0 } else { raw[t - 1][ch] };
                                    al * prev + (1.0 - al) * raw[t][ch]
                                })
                                .collect()
                        })
                        .collect()
                } else {
                    raw
                };
                kv.push(out);
            }
            let v = kv.pop().unwrap();
            let mut k = kv.pop().unwrap();
            if c.qk_norm {
                for r in 0..t_len {
                    self.group_rms(&mut q[r], self.t(&p("attn.q_norm.weight")), hd, 1e-5);
                    self.group_rms(&mut k[r], self.t(&p("attn.k_norm.weight")), hd, 1e-5);
                }
            }
            let fb = self.t(&p("attn.fgate_proj.bias"));
            let lf: Vec<Vec<f64>> = x
                .iter()
                .map(|r| {
                    self.lin(&p("attn.fgate_proj.weight"), r)
                        .iter()
                        .zip(fb)
                        .map(|(z, b)| logsig(z + b))
                        .collect()
                })
                .collect();
            let scale = 1.0 / (hd as f64).sqrt();
            let mut o = vec![vec![0.0; d]; t_len];
            for hh in 0..nh {
                let mut cs = vec![0.0; t_len];
                let mut acc = 0.0;
                for t in 0..t_len {
                    acc += lf[t][hh];
                    cs[t] = acc;
                }
                for i in 0..t_len {
                    let qi = &q[i][hh * hd..(hh + 1) * hd];
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            scale
                                * qi.iter()
                                    .zip(&k[j][hh * hd..(hh + 1) * hd])
                                    .map(|(a, b)| a * b)
                                    .sum::<f64>()
                                + cs[i]
                                - cs[j]
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let wts: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = wts.iter().sum();
                    for (j, wj) in wts.iter().enumerate() {
                        for ch in 0..hd {
                            o[i][hh * hd + ch] += wj / z * v[j][hh * hd + ch];
                        }
                    }
                }
            }
            for t in 0..t_len {
                if c.use_output_norm {
                    self.group_rms(
                        &mut o[t],
                        self.t(&p("attn.output_norm.weight")),
                        hd,
                        c.norm_eps,
                    );
                }
                if c.use_output_gate {
                    let g = self.lin(&p("attn.ogate_proj.weight"), &x[t]);
                    for ch in 0..d {
                        let a = match c.ogate_act {
                            OgateAct::Sigmoid => sig(g[ch]),
                            OgateAct::Silu => g[ch] * sig(g[ch]),
                        };
                        o[t][ch] *= a;
                    }
                }
                let a = self.lin(&p("attn.o_proj.weight"), &o[t]);
                for ch in 0..d {
                    h[t][ch] += a[ch];
                }
                let y = rms(&h[t], self.t(&p("mlp_norm.weight")), c.norm_eps);
                let gu = self.lin(&p("mlp.gate_proj.weight"), &y);
                let act: Vec<f64> = (0..i_sz)
                    .map(|j| {
                        let g = gu[j];
                        let a = match c.hidden_act {
                            HiddenAct::Swish => g * sig(g),
                            HiddenAct::Sigmoid => sig(g),
                        };
                        a * gu[i_sz + j]
                    })
                    .collect();
                let m = self.lin(&p("mlp.down_proj.weight"), &act);
                for ch in 0..d {
                    h[t][ch] += m[ch];
                }
            }
            hidden.push(h.clone());
        }
        let head = if c.tie_word_embeddings {
            "model.embeddings.weight"
        } else {
            "lm_head.weight"
        };
        let logits = h
            .iter()
            .map(|r| {
                let y = rms(r, self.t("model.norm.weight"), c.norm_eps);
                self.lin(head, &y)
            })
            .collect();
        (hidden, logits)
    }

    /// Logits of the last token `toks[t]` (t = toks.len() - 1) of a ONE-layer model that
    /// attends only the positions in `retained[h]` per head, with a constant log gate
    /// `log_f` (so D = (t - j)·log_f). Everything in f64 from the token stream.
    pub fn step_with_retained(&self, toks: &[u32], retained: &[Vec<u64>], log_f: f64) -> Vec<f64> {
        let c = &self.cfg;
        assert_eq!(c.num_hidden_layers, 1);
        let (d, hd, i_sz) = (c.hidden_size, c.head_dim(), c.intermediate_size);
        let t = toks.len() - 1;
        let emb = self.t("model.embeddings.weight");
        let p = |s: &str| format!("model.layers.0.{s}");
        let x_of = |j: usize| {
            rms(
                &emb[toks[j] as usize * d..][..d],
                self.t(&p("attn_norm.weight")),
                c.norm_eps,
            )
        };
        let kv_of = |j: usize, which: &str, norm: Option<&str>| -> Vec<f64> {
            let lw = p(&format!("attn.{which}.linear.weight"));
            let sw = p(&format!("attn.{which}.shift_proj.weight"));
            let xj = x_of(j);
            let raw = self.lin(&lw, &xj);
            let prev = if j == 0 {
                vec![0.0; d]
            } else {
                self.lin(&lw, &x_of(j - 1))
            };
            let a = self.lin(&sw, &xj);
            let mut out: Vec<f64> = (0..d)
                .map(|ch| {
                    let al = sig(a[ch / hd]);
                    al * prev[ch] + (1.0 - al) * raw[ch]
                })
                .collect();
            if let Some(n) = norm {
                self.group_rms(&mut out, self.t(&p(n)), hd, 1e-5);
            }
            out
        };
        let xt = x_of(t);
        let mut q = self.lin(&p("attn.q_proj.weight"), &xt);
        self.group_rms(&mut q, self.t(&p("attn.q_norm.weight")), hd, 1e-5);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut o = vec![0.0; d];
        for (h, pos) in retained.iter().enumerate() {
            let ks: Vec<Vec<f64>> = pos
                .iter()
                .map(|&j| kv_of(j as usize, "k_proj", Some("attn.k_norm.weight")))
                .collect();
            let vs: Vec<Vec<f64>> = pos
                .iter()
                .map(|&j| kv_of(j as usize, "v_proj", None))
                .collect();
            let s: Vec<f64> = pos
                .iter()
                .zip(&ks)
                .map(|(&j, k)| {
                    scale
                        * (0..hd)
                            .map(|ch| q[h * hd + ch] * k[h * hd + ch])
                            .sum::<f64>()
                        + (t as f64 - j as f64) * log_f
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for (wj, v) in w.iter().zip(&vs) {
                for ch in 0..hd {
                    o[h * hd + ch] += wj / z * v[h * hd + ch];
                }
            }
        }
        self.group_rms(
            &mut o,
            self.t(&p("attn.output_norm.weight")),
            hd,
            c.norm_eps,
        );
        let g = self.lin(&p("attn.ogate_proj.weight"), &xt);
        for ch in 0..d {
            o[ch] *= sig(g[ch]);
        }
        let mut h: Vec<f64> = emb[toks[t] as usize * d..][..d].to_vec();
        let a = self.lin(&p("attn.o_proj.weight"), &o);
        for ch in 0..d {
            h[ch] += a[ch];
        }
        let y = rms(&h, self.t(&p("mlp_norm.weight")), c.norm_eps);
        let gu = self.lin(&p("mlp.gate_proj.weight"), &y);
        let act: Vec<f64> = (0..i_sz)
            .map(|j| gu[j] * sig(gu[j]) * gu[i_sz + j])
            .collect();
        let m = self.lin(&p("mlp.down_proj.weight"), &act);
        for ch in 0..d {
            h[ch] += m[ch];
        }
        let y = rms(&h, self.t("model.norm.weight"), c.norm_eps);
        self.lin("lm_head.weight", &y)
    }
}
