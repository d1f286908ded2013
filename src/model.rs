//! A loaded FoX checkpoint: validated config and weights, immutable and shareable.

use crate::config::{Config, QK_NORM_EPS};
use crate::error::{Error, Result};
use crate::matrix::WeightMatrix;
use crate::tokenizer::Tokenizer;
use crate::weights::WeightFile;
use foxedge_core::quant::WeightFormat;
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

/// How [`Model::open_with`] holds the weights.
///
/// The dense layers are the q / k / v / o, output-gate and MLP matrices of every block;
/// the vocabulary matrices are the token embeddings and the LM head (one matrix when
/// tied). The small per-head projections (forget gate, k / v token shift) stay in their
/// stored float format and vectors (norm weights, biases) are widened to f32 whatever
/// the options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Format of the dense layers' weights; `None` = as stored (a quantized file loads
    /// zero-copy). Another format is converted once at load.
    pub weights: Option<WeightFormat>,
    /// Format of the embeddings and the LM head; `None` = [`ModelOptions::weights`]'s
    /// format, or as stored when that is `None` too.
    pub vocab_weights: Option<WeightFormat>,
    /// Tasks a product's outputs (and a conversion's rows) are split into on the current
    /// rayon pool; 0 = the pool's thread count.
    pub threads: usize,
}

impl ModelOptions {
    /// The format the embeddings and the LM head are held in (None: as stored).
    pub fn vocab_format(&self) -> Option<WeightFormat> {
        self.vocab_weights.or(self.weights)
    }
}

/// Key or value projection: plain, or with the data-dependent token shift (spec §3.3).
#[derive(Debug)]
pub(crate) enum KvProj {
    Plain(WeightMatrix),
    /// `linear` `[D, D]`, `shift` `[H, D]`.
    Shift {
        linear: WeightMatrix,
        shift: WeightMatrix,
    },
}

impl KvProj {
    pub(crate) fn linear(&self) -> &WeightMatrix {
        match self {
            KvProj::Plain(t) => t,
            KvProj::Shift { linear, .. } => linear,
        }
    }
    pub(crate) fn shift(&self) -> Option<&WeightMatrix> {
        match self {
            KvProj::Plain(_) => None,
            KvProj::Shift { shift, .. } => Some(shift),
        }
    }
}

/// The weights of one block (spec §2).
#[derive(Debug)]
pub(crate) struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q_proj: WeightMatrix,
    pub k_proj: KvProj,
    pub v_proj: KvProj,
    pub o_proj: WeightMatrix,
    pub fgate_w: WeightMatrix,
    pub fgate_b: Vec<f32>,
    pub ogate: Option<WeightMatrix>,
    pub output_norm: Option<Vec<f32>>,
    /// (q_norm, k_norm), each `[D]` or `[hd]` when shared across heads.
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    pub mlp_norm: Vec<f32>,
    /// `[2I, D]`: rows `0..I` gate, `I..2I` up.
    pub gate_up: WeightMatrix,
    pub down: WeightMatrix,
    /// ACP logit bound per head from the QK-norm scales, `U_h = max|γq_h|·max|γk_h|·sqrt(hd)`
    /// (None without QK-norm: then a session uses the observed norms).
    pub u_bound: Option<Vec<f64>>,
}

impl LayerWeights {
    /// Every matrix of the block.
    fn matrices(&self) -> impl Iterator<Item = &WeightMatrix> {
        fn kv(p: &KvProj) -> [Option<&WeightMatrix>; 2] {
            [Some(p.linear()), p.shift()]
        }
        [Some(&self.q_proj)]
            .into_iter()
            .chain(kv(&self.k_proj))
            .chain(kv(&self.v_proj))
            .chain([
                Some(&self.o_proj),
                Some(&self.fgate_w),
                self.ogate.as_ref(),
                Some(&self.gate_up),
                Some(&self.down),
            ])
            .flatten()
    }
}

/// Below this many multiply-adds a product runs on the calling thread: 2^17 weights of
/// one row are at most 512 KiB, ~20 µs at DRAM speed, well above rayon's fork cost.
const PAR_MIN_MACS: usize = 1 << 17;

/// Progress of a load, called after each weight matrix with (parameters done, total).
pub type LoadProgress<'a> = &'a dyn Fn(u64, u64);

/// A FoX model: config plus weights (memory-mapped where they are used as stored).
/// Immutable once opened, `Send + Sync`; share it between sessions and threads with
/// `Arc<Model>`.
#[derive(Debug)]
pub struct Model {
    pub(crate) config: Config,
    pub(crate) file: WeightFile,
    pub(crate) embeddings: WeightMatrix,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) norm: Vec<f32>,
    /// None when `tie_word_embeddings` (then the embedding matrix is the output matrix).
    pub(crate) lm_head: Option<WeightMatrix>,
    dir: PathBuf,
    params: usize,
    /// The directory's tokenizer, read on first use.
    tokenizer: OnceLock<Tokenizer>,
    /// Threads of a large product (resolved: >= 1).
    threads: usize,
    options: ModelOptions,
    /// [`Model::identity`].
    identity: u64,
}

impl Model {
    /// Opens a checkpoint directory holding `config.json` and `model.safetensors` (or the
    /// `model.safetensors` file itself, with `config.json` beside it), weights as stored.
    ///
    /// Errors: [`Error::Io`] when a file cannot be read, [`Error::BadModel`] naming the field
    /// or tensor at fault (missing, extra, wrong shape, truncated, corrupt), and
    /// [`Error::Unsupported`] for valid configurations this engine does not run.
    pub fn open(path: impl AsRef<Path>) -> Result<Model> {
        Self::open_with(path, &ModelOptions::default())
    }

    /// [`Model::open`] with the weights held as `opts` says (converted or quantized at
    /// load where that differs from the file).
    ///
    /// Errors: as [`Model::open`]; also [`Error::BadModel`] for a weight outside the range
    /// of the requested format, [`Error::OutOfMemory`] for a converted copy that cannot be
    /// allocated.
    pub fn open_with(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Model> {
        Self::open_with_progress(path, opts, &|_, _| {})
    }

    /// [`Model::open_with`] reporting progress after each weight matrix.
    pub fn open_with_progress(
        path: impl AsRef<Path>,
        opts: &ModelOptions,
        progress: LoadProgress<'_>,
    ) -> Result<Model> {
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
        let identity = identity(&text, &st, opts)?;
        let mut model = Self::from_parts(config, file, dir, *opts, progress)?;
        model.identity = identity;
        Ok(model)
    }

    /// A 64-bit identity of the model as loaded: XXH3-64 of `config.json`'s bytes, the
    /// safetensors header (its length prefix and JSON), the weight file's size and the
    /// formats the weights are held in ([`ModelOptions`]). Session files carry it, so a
    /// session is never restored onto another model or another quantization of it.
    pub fn identity(&self) -> u64 {
        self.identity
    }

    fn from_parts(
        config: Config,
        mut file: WeightFile,
        dir: PathBuf,
        options: ModelOptions,
        progress: LoadProgress<'_>,
    ) -> Result<Model> {
        let c = &config;
        let (v, d, h, hd, i) = (
            c.vocab_size,
            c.hidden_size,
            c.num_heads,
            c.head_dim(),
            c.intermediate_size,
        );
        let threads = match options.threads {
            0 => rayon::current_num_threads().max(1),
            n => n,
        };
        let total = file.total_params();
        let mut params = 0usize;
        // Vectors: widened to f32.
        let mut vector = |f: &mut WeightFile, name: String, shape: &[usize]| -> Result<Vec<f32>> {
            params += shape.iter().product::<usize>();
            f.take_vector(&name, shape)
        };
        let mut done = 0u64;
        // Matrices: in the format `target` (None: as stored).
        let mut matrix = |f: &mut WeightFile,
                          name: String,
                          shape: (usize, usize),
                          target: Option<WeightFormat>|
         -> Result<WeightMatrix> {
            let m = f.take_matrix(&name, shape, target, threads)?;
            done += (shape.0 * shape.1) as u64;
            progress(done.min(total), total);
            Ok(m)
        };
        let dense = options.weights;
        let vocab = options.vocab_format();
        let embeddings = matrix(&mut file, "model.embeddings.weight".into(), (v, d), vocab)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let attn_norm = vector(&mut file, p("attn_norm.weight"), &[d])?;
            let q_proj = matrix(&mut file, p("attn.q_proj.weight"), (d, d), dense)?;
            let mut kv = |f: &mut WeightFile, which: &str, shift: bool| -> Result<KvProj> {
                let name = |s: &str| p(&format!("attn.{which}.{s}"));
                if shift {
                    Ok(KvProj::Shift {
                        linear: matrix(f, name("linear.weight"), (d, d), dense)?,
                        shift: matrix(f, name("shift_proj.weight"), (h, d), None)?,
                    })
                } else {
                    Ok(KvProj::Plain(matrix(f, name("weight"), (d, d), dense)?))
                }
            };
            let k_proj = kv(&mut file, "k_proj", c.use_k_shift)?;
            let v_proj = kv(&mut file, "v_proj", c.use_v_shift)?;
            let o_proj = matrix(&mut file, p("attn.o_proj.weight"), (d, d), dense)?;
            let fgate_w = matrix(&mut file, p("attn.fgate_proj.weight"), (h, d), None)?;
            let fgate_b = vector(&mut file, p("attn.fgate_proj.bias"), &[h])?;
            let ogate = if c.use_output_gate {
                Some(matrix(
                    &mut file,
                    p("attn.ogate_proj.weight"),
                    (d, d),
                    dense,
                )?)
            } else {
                None
            };
            let output_norm = if c.use_output_norm {
                Some(vector(&mut file, p("attn.output_norm.weight"), &[d])?)
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
                    vector(&mut file, p("attn.q_norm.weight"), &[w])?,
                    vector(&mut file, p("attn.k_norm.weight"), &[w])?,
                ))
            } else {
                None
            };
            let mlp_norm = vector(&mut file, p("mlp_norm.weight"), &[d])?;
            let gate_up = matrix(&mut file, p("mlp.gate_proj.weight"), (2 * i, d), dense)?;
            let down = matrix(&mut file, p("mlp.down_proj.weight"), (d, i), dense)?;
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
        let norm = vector(&mut file, "model.norm.weight".into(), &[d])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(matrix(&mut file, "lm_head.weight".into(), (v, d), vocab)?)
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
            params: 0,
            threads,
            options,
            tokenizer: OnceLock::new(),
            identity: 0,
        };
        model.params = params
            + model
                .matrices()
                .map(|m| m.shape().0 * m.shape().1)
                .sum::<usize>();
        model.compute_bounds()?;
        Ok(model)
    }

    /// Per-head QK-norm logit bounds (spec §5), through foxedge-core.
    fn compute_bounds(&mut self) -> Result<()> {
        let (h, hd) = (self.config.num_heads, self.config.head_dim());
        for lw in &mut self.layers {
            let Some((gq, gk)) = &lw.qk_norm else {
                continue;
            };
            let mut u = Vec::with_capacity(h);
            for head in 0..h {
                let (sq, sk) = if gq.len() == hd {
                    (&gq[..], &gk[..])
                } else {
                    (
                        &gq[head * hd..(head + 1) * hd],
                        &gk[head * hd..(head + 1) * hd],
                    )
                };
                u.push(foxedge_core::threshold::bound_from_qk_norm(sq, sk, hd)?);
            }
            lw.u_bound = Some(u);
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

    /// Tasks a large product is split into (resolved from [`ModelOptions::threads`]).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The options it was opened with.
    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// Every weight matrix: the embeddings, each block's, the LM head if untied.
    pub(crate) fn matrices(&self) -> impl Iterator<Item = &WeightMatrix> {
        std::iter::once(&self.embeddings)
            .chain(self.layers.iter().flat_map(LayerWeights::matrices))
            .chain(self.lm_head.as_ref())
    }

    /// Bytes of the weight matrices in the formats they run in, plus the f32 vectors.
    pub fn weight_bytes(&self) -> usize {
        let vectors = self.params
            - self
                .matrices()
                .map(|m| m.shape().0 * m.shape().1)
                .sum::<usize>();
        self.matrices().map(WeightMatrix::bytes).sum::<usize>() + 4 * vectors
    }

    /// Bytes of weight matrices held in memory of their own (converted or copied at
    /// load), not read in place from the model file's map.
    pub fn converted_weight_bytes(&self) -> usize {
        self.matrices()
            .filter(|m| !m.is_mapped())
            .map(WeightMatrix::bytes)
            .sum()
    }

    /// The format of the dense layers' weights (the first block's q projection), and of
    /// the LM head.
    pub fn weight_formats(&self) -> (WeightFormat, WeightFormat) {
        let dense = self
            .layers
            .first()
            .map_or(self.embeddings.format(), |l| l.q_proj.format());
        (dense, self.lm_head().format())
    }

    /// The ACP logit bound `U_h` of each head of `layer` from its QK-norm scales, or None
    /// for a model without QK-norm.
    pub fn logit_bounds(&self, layer: usize) -> Option<&[f64]> {
        self.layers.get(layer)?.u_bound.as_deref()
    }

    /// `y (+)= x Wᵀ` for `rows` rows of `x` with matrix `m` of this model, on one thread
    /// for small products and on the model's threads otherwise.
    pub(crate) fn linear(
        &self,
        m: &WeightMatrix,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        accumulate: bool,
    ) -> Result<()> {
        let (out, inp) = m.shape();
        let threads = if rows.saturating_mul(out).saturating_mul(inp) < PAR_MIN_MACS {
            1
        } else {
            self.threads
        };
        m.apply(x, rows, y, accumulate, threads)
    }

    /// `y_k (+)= x W_kᵀ` for several matrices of this model on the same `rows` rows of
    /// `x`, in one parallel region (one fork-join instead of one per matrix; the results
    /// equal [`Model::linear`]'s bit for bit), on one thread when all of them together
    /// are small.
    pub(crate) fn linear_many(
        &self,
        x: &[f32],
        rows: usize,
        products: &mut [(&WeightMatrix, &mut [f32], bool)],
    ) -> Result<()> {
        let macs = products.iter().fold(0usize, |a, (m, ..)| {
            let (out, inp) = m.shape();
            a.saturating_add(rows.saturating_mul(out).saturating_mul(inp))
        });
        let threads = if macs < PAR_MIN_MACS { 1 } else { self.threads };
        WeightMatrix::apply_many(products, x, rows, threads)
    }

    /// The embedding rows of `ids` into `h` (`[ids.len(), D]`).
    pub(crate) fn embed(&self, ids: &[u32], h: &mut [f32]) -> Result<()> {
        let d = self.config.hidden_size;
        for (row, &id) in h.chunks_exact_mut(d).zip(ids) {
            self.embeddings.row(id as usize, row)?;
        }
        Ok(())
    }

    /// The output matrix `[V, D]`.
    pub(crate) fn lm_head(&self) -> &WeightMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embeddings)
    }
}

/// eps of the QK-norm, re-exported for sessions.
pub(crate) const QK_EPS: f64 = QK_NORM_EPS;

/// [`Model::identity`] of a config text, a safetensors file (already opened and checked by
/// [`WeightFile::open`], so its header length is sane) and the load options' formats.
fn identity(config: &str, weights: &Path, opts: &ModelOptions) -> Result<u64> {
    use std::io::Read;
    let mut f = std::fs::File::open(weights).map_err(|e| Error::io(weights, e))?;
    let size = f.metadata().map_err(|e| Error::io(weights, e))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| Error::io(weights, e))?;
    let n = u64::from_le_bytes(len).min(size.saturating_sub(8));
    let mut header = Vec::new();
    f.take(n)
        .read_to_end(&mut header)
        .map_err(|e| Error::io(weights, e))?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"foxedge model identity 1");
    h.update(&(config.len() as u64).to_le_bytes());
    h.update(config.as_bytes());
    h.update(&len);
    h.update(&header);
    h.update(&size.to_le_bytes());
    for f in [opts.weights, opts.vocab_format()] {
        h.update(f.map_or("stored", |f| f.name()).as_bytes());
        h.update(b"\0");
    }
    Ok(h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn model_is_send_sync() {
        assert_send_sync::<Model>();
    }

    /// Relative RMS error of each matrix of the bundled model converted to each format,
    /// row by row against the f32 file (the figures `tests/weight_formats.rs` derives its
    /// logit tolerances from), and the formats and byte counts the options ask for.
    #[test]
    fn conversion_errors_per_format() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(crate::BUNDLED_MODEL);
        let base = Model::open(&dir).unwrap();
        assert_eq!(base.converted_weight_bytes(), 0);
        assert_eq!(base.weight_bytes(), 4 * base.info().params);
        for (f, bound) in [
            (WeightFormat::F32, 0.0),
            (WeightFormat::Bf16, 3e-3),
            (WeightFormat::F16, 5e-4),
            (WeightFormat::Q8, 1e-2),
            (WeightFormat::Q4, 0.1),
        ] {
            let opts = ModelOptions {
                weights: Some(f),
                ..ModelOptions::default()
            };
            let q = Model::open_with(&dir, &opts).unwrap();
            assert_eq!(q.weight_formats(), (f, f));
            let mut worst = 0.0f64;
            for (a, b) in base.matrices().zip(q.matrices()) {
                assert_eq!(a.name(), b.name());
                let (out, inp) = a.shape();
                let (mut x, mut y) = (vec![0.0f32; inp], vec![0.0f32; inp]);
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for r in 0..out {
                    a.row(r, &mut x).unwrap();
                    b.row(r, &mut y).unwrap();
                    for (&u, &v) in x.iter().zip(&y) {
                        num += (f64::from(u) - f64::from(v)).powi(2);
                        den += f64::from(u).powi(2);
                    }
                }
                let e = (num / den).sqrt();
                let small = a.name().contains("fgate") || a.name().contains("shift");
                if small {
                    assert_eq!(e, 0.0, "{}: small projections stay as stored", a.name());
                }
                worst = worst.max(e);
            }
            eprintln!("{f}: worst matrix relative RMS error {worst:.3e}");
            assert!(worst <= bound, "{f}: {worst}");
            let bytes = q.weight_bytes() as f64 / base.weight_bytes() as f64;
            eprintln!("{f}: {:.3} of the f32 bytes", bytes);
        }
    }
}
