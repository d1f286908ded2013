//! `model.safetensors` through a memory map, validated tensor by tensor.
//!
//! Storage policy: f32 tensors whose data is 4-byte aligned in the file (the safetensors
//! writers pad the header to 8 bytes) are used in place from the map, so their memory is the
//! page cache, shared and evictable. f16 and bf16 tensors (and unaligned f32 data, or any data
//! on a big-endian host) are converted once at load into owned f32: 4 bytes per parameter of
//! anonymous memory (twice the file's 2 bytes for f16/bf16), in exchange for one f32 code path
//! in every matrix kernel.

use crate::error::{Error, Result};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// Where one tensor's f32 values live.
#[derive(Debug)]
enum Data {
    /// Byte range `[start, start + 4·len)` of the map, 4-byte aligned, little-endian f32.
    Mapped { start: usize, len: usize },
    /// Converted at load.
    Owned(Box<[f32]>),
}

/// A handle to one validated tensor of a [`WeightFile`].
#[derive(Debug)]
pub struct Tensor {
    data: Data,
}

/// One entry of the safetensors header after validation.
#[derive(Debug, Clone)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte offsets in the file.
    start: usize,
    end: usize,
}

/// A mapped, header-validated `model.safetensors`.
#[derive(Debug)]
pub struct WeightFile {
    map: Mmap,
    entries: BTreeMap<String, Entry>,
    /// Names handed out by [`WeightFile::take`]; the rest are "extra" tensors.
    taken: BTreeMap<String, ()>,
    file: String,
}

fn bad(item: &str, message: impl Into<String>) -> Error {
    Error::bad_model(item, message)
}

impl WeightFile {
    /// Maps `path` and validates its header: framing, JSON, dtypes, shapes, offsets inside the
    /// file, no overlap or gap (checked again by the `safetensors` crate).
    pub fn open(path: &Path) -> Result<WeightFile> {
        let file_name = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and private to this process. The one hazard of a file
        // map is another process truncating or rewriting the file while it is mapped (reads
        // would fault or change); model files are treated as immutable while in use, the
        // same contract every mmap-based model loader has.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let entries = parse_header(&map, &file_name)?;
        safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
            bad(
                &file_name,
                format!("rejected by the safetensors parser: {e}"),
            )
        })?;
        Ok(WeightFile {
            map,
            entries,
            taken: BTreeMap::new(),
            file: file_name,
        })
    }

    /// Takes tensor `name`, checking that it exists and has exactly `shape`, and that every
    /// value is finite. f16/bf16 (and unaligned f32) are converted to owned f32 here.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let item = format!("tensor `{name}`");
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| bad(&item, format!("missing from {}", self.file)))?;
        if e.shape != shape {
            return Err(bad(
                &item,
                format!("shape {:?}, expected {:?}", e.shape, shape),
            ));
        }
        let bytes = &self.map[e.start..e.end];
        let n = bytes.len() / e.dtype.size();
        let ptr_aligned = (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>());
        let data = if e.dtype == DType::F32 && ptr_aligned && cfg!(target_endian = "little") {
            Data::Mapped {
                start: e.start,
                len: n,
            }
        } else {
            let mut v = crate::error::try_zeroed::<f32>(n, &item)?;
            match e.dtype {
                DType::F32 => {
                    for (o, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                DType::F16 => {
                    for (o, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                DType::BF16 => {
                    for (o, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            }
            Data::Owned(v.into_boxed_slice())
        };
        let t = Tensor { data };
        if let Some(i) = self.get(&t).iter().position(|x| !x.is_finite()) {
            return Err(bad(&item, format!("element {i} is not finite")));
        }
        self.taken.insert(name.to_string(), ());
        Ok(t)
    }

    /// Error naming the tensors that were never taken (unexpected for this config).
    pub fn check_no_extra(&self) -> Result<()> {
        let extra: Vec<&str> = self
            .entries
            .keys()
            .filter(|k| !self.taken.contains_key(*k))
            .map(String::as_str)
            .collect();
        if extra.is_empty() {
            Ok(())
        } else {
            Err(bad(
                &self.file,
                format!("unexpected tensors for this config: {}", extra.join(", ")),
            ))
        }
    }

    /// The f32 values of `t`, which must come from this file.
    #[inline]
    pub fn get<'a>(&'a self, t: &'a Tensor) -> &'a [f32] {
        match &t.data {
            Data::Owned(v) => v,
            Data::Mapped { start, len } => {
                let bytes = &self.map[*start..*start + *len * 4];
                // SAFETY: `take` made this a `Mapped` only after checking that the range lies in
                // the map (validated header offsets), that its address is 4-byte aligned, and
                // that the host is little-endian; every bit pattern is a valid f32, and the
                // returned slice borrows `self`, so the map outlives it.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }

    /// Bytes of f32 weights held in anonymous memory (converted at load).
    pub fn owned_bytes(t: &Tensor) -> usize {
        match &t.data {
            Data::Owned(v) => v.len() * 4,
            Data::Mapped { .. } => 0,
        }
    }
}

/// Validates the header and returns every tensor entry with absolute offsets.
fn parse_header(map: &[u8], file: &str) -> Result<BTreeMap<String, Entry>> {
    if map.len() < 8 {
        return Err(bad(
            file,
            format!(
                "truncated: {} bytes, shorter than the 8-byte header length",
                map.len()
            ),
        ));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&map[..8]);
    let hlen = u64::from_le_bytes(n8);
    let data_start = usize::try_from(hlen)
        .ok()
        .and_then(|h| h.checked_add(8))
        .filter(|&s| s <= map.len())
        .ok_or_else(|| {
            bad(
                file,
                format!(
                    "header length {hlen} exceeds the file size {} (truncated or corrupt)",
                    map.len()
                ),
            )
        })?;
    let text = std::str::from_utf8(&map[8..data_start])
        .map_err(|_| bad(file, "header is not UTF-8 (corrupt)"))?;
    let json: Value = serde_json::from_str(text)
        .map_err(|e| bad(file, format!("header is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad(file, "header is not a JSON object"))?;
    let data_len = map.len() - data_start;
    let mut entries = BTreeMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let item = format!("tensor `{name}`");
        let info = v
            .as_object()
            .ok_or_else(|| bad(&item, "header entry is not an object"))?;
        let dtype = match info.get("dtype").and_then(Value::as_str) {
            Some("F32") => DType::F32,
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{item}: dtype {other} (only F32, F16 and BF16 weights are supported)"
                )));
            }
            None => return Err(bad(&item, "missing or non-string `dtype`")),
        };
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(&item, "missing `shape`"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(&item, "`shape` entries must be non-negative integers"))?;
        let offs = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(&item, "`data_offsets` must be [begin, end]"))?;
        let (b, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => return Err(bad(&item, "`data_offsets` must be integers")),
        };
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| bad(&item, format!("size of shape {shape:?} overflows")))?;
        if e < b || (e - b) as u128 != numel as u128 {
            return Err(bad(
                &item,
                format!("data_offsets [{b}, {e}] do not hold {numel} bytes of shape {shape:?}"),
            ));
        }
        if e > data_len as u64 {
            return Err(bad(
                &item,
                format!(
                    "data ends at byte {e} of the data section but the file has only {data_len} \
                     (truncated)"
                ),
            ));
        }
        entries.insert(
            name.clone(),
            Entry {
                dtype,
                shape,
                start: data_start + b as usize,
                end: data_start + e as usize,
            },
        );
    }
    Ok(entries)
}
