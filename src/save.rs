//! Writing a loaded model back as a model directory: `config.json` copied, one
//! `model.safetensors` holding every weight matrix in the format the model holds it (so a
//! model opened with `--weights q8` is written quantized, and the file loads zero-copy),
//! vectors as stored, and the tokenizer files copied.
//!
//! Layout of the written safetensors file (any safetensors reader accepts it; quantized
//! matrices are U8 tensors described in `__metadata__`, see [`crate::weights`]): the
//! header is padded with spaces so that the data starts 64 bytes after a 64-byte
//! boundary of the file, then the packed tensors (whole 64-byte tiles), then f32, then
//! f16 / bf16 tensors, each group by name, so that every tensor starts aligned for its
//! kernels when the file is mapped (the map starts on a page).

use crate::error::{Error, Result};
use crate::matrix::WeightMatrix;
use crate::model::Model;
use crate::weights::QuantEntry;
use foxedge_core::quant::WeightFormat;
use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Files copied from the source directory when present.
pub const TOKENIZER_FILES: [&str; 5] = [
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// What [`Model::save`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveReport {
    /// The directory written.
    pub dir: PathBuf,
    /// Bytes of the written `model.safetensors`.
    pub file_bytes: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Files copied beside it (`config.json` and the tokenizer files found).
    pub copied: Vec<String>,
}

/// One tensor's bytes to write.
enum Item<'a> {
    Matrix(&'a WeightMatrix),
    Raw(&'a [u8]),
}

/// One tensor of the written file: its header entry and its bytes.
struct Planned<'a> {
    /// [`group_of`] its dtype.
    group: u8,
    name: &'a str,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    item: Item<'a>,
}

/// Order of the written groups: packed tiles, then 4-byte, then 2-byte elements.
fn group_of(dtype: Dtype) -> u8 {
    match dtype {
        Dtype::U8 => 0,
        Dtype::F32 => 1,
        _ => 2,
    }
}

impl Model {
    /// Writes this model to directory `out` (created if needed) as described in the
    /// module docs; `progress(done, total)` is called with bytes of tensor data written.
    /// The file is written beside its final name and renamed when complete.
    ///
    /// Errors: [`Error::InvalidArgument`] when `out` is the directory the model was
    /// loaded from (its file is in use); [`Error::Io`] naming the file that could not be
    /// written or copied.
    pub fn save(&self, out: &Path, progress: &dyn Fn(u64, u64)) -> Result<SaveReport> {
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
        let same = match (out.canonicalize(), self.dir().canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same {
            return Err(Error::invalid(format!(
                "{}: the output directory is the model's own directory",
                out.display()
            )));
        }
        let by_name: HashMap<&str, &WeightMatrix> =
            self.matrices().map(|m| (m.name(), m)).collect();
        let mut items: Vec<Planned<'_>> = Vec::new();
        let mut meta: HashMap<String, String> = HashMap::new();
        for (name, dtype, shape, bytes) in self.file.raw_tensors() {
            let (dtype, shape, len, item) = match by_name.get(name) {
                Some(m) => {
                    let (o, i) = m.shape();
                    let (dtype, shape) = match m.format() {
                        WeightFormat::F32 => (Dtype::F32, vec![o, i]),
                        WeightFormat::F16 => (Dtype::F16, vec![o, i]),
                        WeightFormat::Bf16 => (Dtype::BF16, vec![o, i]),
                        f => {
                            let q = QuantEntry {
                                format: f.name().into(),
                                layout: foxedge_cpu::linear::PACKED_LAYOUT.into(),
                                shape: vec![o, i],
                            };
                            let text = serde_json::to_string(&q)
                                .map_err(|e| Error::Internal(format!("{name}: {e}")))?;
                            meta.insert(name.to_string(), text);
                            (Dtype::U8, vec![m.bytes()])
                        }
                    };
                    (dtype, shape, m.bytes(), Item::Matrix(m))
                }
                None => (dtype, shape.to_vec(), bytes.len(), Item::Raw(bytes)),
            };
            items.push(Planned {
                group: group_of(dtype),
                name,
                dtype,
                shape,
                len,
                item,
            });
        }
        items.sort_by(|a, b| (a.group, a.name).cmp(&(b.group, b.name)));

        let mut header: BTreeMap<String, serde_json::Value> = BTreeMap::new();
        let mut offset = 0usize;
        for p in &items {
            let info = TensorInfo {
                dtype: p.dtype,
                shape: p.shape.clone(),
                data_offsets: (offset, offset + p.len),
            };
            header.insert(p.name.to_string(), to_json(&info)?);
            offset += p.len;
        }
        if !meta.is_empty() {
            header.insert("__metadata__".into(), to_json(&meta)?);
        }
        let mut text = serde_json::to_string(&header)
            .map_err(|e| Error::Internal(format!("safetensors header: {e}")))?
            .into_bytes();
        text.resize((8 + text.len()).next_multiple_of(64) - 8, b' ');

        let path = out.join("model.safetensors");
        let tmp = out.join("model.safetensors.partial");
        let io = |e| Error::io(&tmp, e);
        let write = || -> Result<()> {
            let f = std::fs::File::create(&tmp).map_err(io)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            w.write_all(&(text.len() as u64).to_le_bytes())
                .map_err(io)?;
            w.write_all(&text).map_err(io)?;
            let mut done = 0u64;
            for p in &items {
                match p.item {
                    Item::Matrix(m) => m.write_to(&mut w),
                    Item::Raw(b) => w.write_all(b),
                }
                .map_err(io)?;
                done += p.len as u64;
                progress(done, offset as u64);
            }
            let f = w.into_inner().map_err(|e| io(e.into_error()))?;
            f.sync_all().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
        };
        if let Err(e) = write() {
            std::fs::remove_file(&tmp).ok();
            return Err(e);
        }

        let mut copied = Vec::new();
        for name in std::iter::once("config.json").chain(TOKENIZER_FILES) {
            let src = self.dir().join(name);
            if src.is_file() {
                let dst = out.join(name);
                std::fs::copy(&src, &dst).map_err(|e| Error::io(&dst, e))?;
                copied.push(name.to_string());
            }
        }
        Ok(SaveReport {
            dir: out.to_path_buf(),
            file_bytes: (8 + text.len() + offset) as u64,
            tensors: items.len(),
            copied,
        })
    }
}

/// A header value as JSON.
fn to_json<T: serde::Serialize>(v: &T) -> Result<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| Error::Internal(format!("safetensors header: {e}")))
}
