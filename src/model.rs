//! A loaded FoX checkpoint: validated config and weights, immutable and shareable.

use crate::config::{Config, QK_NORM_EPS};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use crate::weights::{Tensor, WeightFile};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Sizes of a loaded model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelInfo {
    /// V: vocabulary size (token ids are `0..vocab`).
    pub vocab: usize,
    pub layers: usize,
    pub heads: usize,
    /// hd = hidden / heads.
    pub head_dim: usize,
    /// D: residual width.
    pub hidden: usize,
    /// I: MLP width.
    pub intermediate: usize,
    /// Total parameters.
    pub params: usize,
}

/// Key or value projection: plain, or with the data-dependent token shift (spec §3.3).
#[derive(Debug)]
pub(crate) enum KvProj {
    Plain(Tensor),
    /// `linear` `[D, D]`, `shift` `[H, D]`.
    Shift {
        linear: Tensor,
        shift: Tensor,
    },
}

impl KvProj {
    pub(crate) fn linear(&self) -> &Tensor {
        match self {
            KvProj::Plain(t) => t,
            KvProj::Shift { linear, .. } => linear,
        }
    }
    pub(crate) fn shift(&self) -> Option<&Tensor> {
        match self {
            KvProj::Plain(_) => None,
            KvProj::Shift { shift, .. } => Some(shift),
        }
    }
}

/// The weights of one block (spec §2).
#[derive(Debug)]
pub(crate) struct LayerWeights {
    pub attn_norm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: KvProj,
    pub v_proj: KvProj,
    pub o_proj: Tensor,
    pub fgate_w: Tensor,
    pub fgate_b: Tensor,
    pub ogate: Option<Tensor>,
    pub output_norm: Option<Tensor>,
    /// (q_norm, k_norm), each `[D]` or `[hd]` when shared across heads.
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub mlp_norm: Tensor,
    /// `[2I, D]`: rows `0..I` gate, `I..2I` up.
    pub gate_up: Tensor,
    pub down: Tensor,
    /// ACP logit bound per head from the QK-norm scales, `U_h = max|γq_h|·max|γk_h|·sqrt(hd)`
    /// (None without QK-norm: then a session uses the observed norms).
    pub u_bound: Option<Vec<f64>>,
}

/// Takes a named tensor of a given shape from the weight file (and counts it).
type TakeFn<'a> = dyn FnMut(&mut WeightFile, String, &[usize]) -> Result<Tensor> + 'a;

/// A FoX model: config plus memory-mapped weights. Immutable once opened, `Send + Sync`;
/// share it between sessions and threads with `Arc<Model>`.
#[derive(Debug)]
pub struct Model {
    pub(crate) config: Config,
    pub(crate) file: WeightFile,
    pub(crate) embeddings: Tensor,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) norm: Tensor,
    /// None when `tie_word_embeddings` (then the embedding matrix is the output matrix).
    pub(crate) lm_head: Option<Tensor>,
    dir: PathBuf,
    params: usize,
    owned_bytes: usize,
    /// The directory's tokenizer, read on first use.
    tokenizer: OnceLock<Tokenizer>,
}

impl Model {
    /// Opens a checkpoint directory holding `config.json` and `model.safetensors` (or the
    /// `model.safetensors` file itself, with `config.json` beside it).
    ///
    /// Errors: [`Error::Io`] when a file cannot be read, [`Error::BadModel`] naming the field
    /// or tensor at fault (missing, extra, wrong shape, truncated, corrupt), and
    /// [`Error::Unsupported`] for valid configurations this engine does not run.
    pub fn open(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let dir = if path.is_file() {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        } else {
            path.to_path_buf()
        };
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let config = Config::from_json(&text)?;
        let st = if path.is_file() {
            path.to_path_buf()
        } else {
            dir.join("model.safetensors")
        };
        let file = WeightFile::open(&st)?;
        Self::from_parts(config, file, dir)
    }

    fn from_parts(config: Config, mut file: WeightFile, dir: PathBuf) -> Result<Model> {
        let c = &config;
        let (v, d, h, hd, i) = (
            c.vocab_size,
            c.hidden_size,
            c.num_heads,
            c.head_dim(),
            c.intermediate_size,
        );
        let mut params = 0usize;
        let mut owned = 0usize;
        let mut take = |f: &mut WeightFile, name: String, shape: &[usize]| -> Result<Tensor> {
            let t = f.take(&name, shape)?;
            params += shape.iter().product::<usize>();
            owned += WeightFile::owned_bytes(&t);
            Ok(t)
        };
        let embeddings = take(&mut file, "model.embeddings.weight".into(), &[v, d])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let kv = |f: &mut WeightFile,
                      take: &mut TakeFn<'_>,
                      which: &str,
                      shift: bool|
             -> Result<KvProj> {
                if shift {
                    Ok(KvProj::Shift {
                        linear: take(f, p(&format!("attn.{which}.linear.weight")), &[d, d])?,
                        shift: take(f, p(&format!("attn.{which}.shift_proj.weight")), &[h, d])?,
                    })
                } else {
                    Ok(KvProj::Plain(take(
                        f,
                        p(&format!("attn.{which}.weight")),
                        &[d, d],
                    )?))
                }
            };
            let attn_norm = take(&mut file, p("attn_norm.weight"), &[d])?;
            let q_proj = take(&mut file, p("attn.q_proj.weight"), &[d, d])?;
            let k_proj = kv(&mut file, &mut take, "k_proj", c.use_k_shift)?;
            let v_proj = kv(&mut file, &mut take, "v_proj", c.use_v_shift)?;
            let o_proj = take(&mut file, p("attn.o_proj.weight"), &[d, d])?;
            let fgate_w = take(&mut file, p("attn.fgate_proj.weight"), &[h, d])?;
            let fgate_b = take(&mut file, p("attn.fgate_proj.bias"), &[h])?;
            let ogate = if c.use_output_gate {
                Some(take(&mut file, p("attn.ogate_proj.weight"), &[d, d])?)
            } else {
                None
            };
            let output_norm = if c.use_output_norm {
                Some(take(&mut file, p("attn.output_norm.weight"), &[d])?)
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                let w = if c.qk_norm_share_param_across_head {
                    hd
                } else {
                    d
                };
                Some((
                    take(&mut file, p("attn.q_norm.weight"), &[w])?,
                    take(&mut file, p("attn.k_norm.weight"), &[w])?,
                ))
            } else {
                None
            };
            let mlp_norm = take(&mut file, p("mlp_norm.weight"), &[d])?;
            let gate_up = take(&mut file, p("mlp.gate_proj.weight"), &[2 * i, d])?;
            let down = take(&mut file, p("mlp.down_proj.weight"), &[d, i])?;
            layers.push(LayerWeights {
                attn_norm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                fgate_w,
                fgate_b,
                ogate,
                output_norm,
                qk_norm,
                mlp_norm,
                gate_up,
                down,
                u_bound: None,
            });
        }
        let norm = take(&mut file, "model.norm.weight".into(), &[d])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(take(&mut file, "lm_head.weight".into(), &[v, d])?)
        };
        file.check_no_extra()?;
        let mut model = Model {
            config,
            file,
            embeddings,
            layers,
            norm,
            lm_head,
            dir,
            params,
            owned_bytes: owned,
            tokenizer: OnceLock::new(),
        };
        model.compute_bounds()?;
        Ok(model)
    }

    /// Per-head QK-norm logit bounds (spec §5), through foxedge-core.
    fn compute_bounds(&mut self) -> Result<()> {
        let (h, hd) = (self.config.num_heads, self.config.head_dim());
        let mut bounds = Vec::with_capacity(self.layers.len());
        for lw in &self.layers {
            let Some((qn, kn)) = &lw.qk_norm else {
                bounds.push(None);
                continue;
            };
            let (gq, gk) = (self.file.get(qn), self.file.get(kn));
            let mut u = Vec::with_capacity(h);
            for head in 0..h {
                let (sq, sk) = if gq.len() == hd {
                    (gq, gk)
                } else {
                    (
                        &gq[head * hd..(head + 1) * hd],
                        &gk[head * hd..(head + 1) * hd],
                    )
                };
                u.push(foxedge_core::threshold::bound_from_qk_norm(sq, sk, hd)?);
            }
            bounds.push(Some(u));
        }
        for (lw, b) in self.layers.iter_mut().zip(bounds) {
            lw.u_bound = b;
        }
        Ok(())
    }

    /// Sizes of this model.
    pub fn info(&self) -> ModelInfo {
        let c = &self.config;
        ModelInfo {
            vocab: c.vocab_size,
            layers: c.num_hidden_layers,
            heads: c.num_heads,
            head_dim: c.head_dim(),
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            params: self.params,
        }
    }

    /// The parsed configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The directory the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer of the model's directory ([`Tokenizer::from_dir`] with this model's
    /// vocabulary), read on the first call and kept. Opening a model never reads the
    /// tokenizer files, so a directory without them, or with a damaged one, still runs on
    /// token ids.
    ///
    /// Errors (each call retries): [`Error::NoTokenizer`] when the directory has no tokenizer
    /// files and the vocabulary is not the 256 bytes, [`Error::Tokenizer`] naming a corrupt
    /// or inconsistent file, [`Error::Io`] for a file that exists but cannot be read.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(t);
        }
        let t = Tokenizer::from_dir(&self.dir, self.config.vocab_size)?;
        // A concurrent first call may have stored an equal tokenizer first; either is kept.
        Ok(self.tokenizer.get_or_init(|| t))
    }

    /// Bytes of weights converted to owned f32 at load (0 for an all-f32 aligned file,
    /// whose weights are used in place from the memory map).
    pub fn converted_weight_bytes(&self) -> usize {
        self.owned_bytes
    }

    /// The ACP logit bound `U_h` of each head of `layer` from its QK-norm scales, or None
    /// for a model without QK-norm.
    pub fn logit_bounds(&self, layer: usize) -> Option<&[f64]> {
        self.layers.get(layer)?.u_bound.as_deref()
    }

    #[inline]
    pub(crate) fn w<'a>(&'a self, t: &'a Tensor) -> &'a [f32] {
        self.file.get(t)
    }

    /// The output matrix `[V, D]`.
    pub(crate) fn lm_head(&self) -> &[f32] {
        self.w(self.lm_head.as_ref().unwrap_or(&self.embeddings))
    }
}

/// eps of the QK-norm, re-exported for sessions.
pub(crate) const QK_EPS: f64 = QK_NORM_EPS;

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn model_is_send_sync() {
        assert_send_sync::<Model>();
    }
}
