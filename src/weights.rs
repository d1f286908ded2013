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
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError, SafeTensors};
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
    /// Maps `path` and validates its header (the `safetensors` crate: framing, JSON, shapes,
    /// offsets that tile the data section exactly) and the dtypes.
    pub fn open(path: &Path) -> Result<WeightFile> {
        let file_name = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and private to this process. The one hazard of a file
        // map is another process truncating or rewriting the file while it is mapped (reads
        // would fault or change); model files are treated as immutable while in use, the
        // same contract every mmap-based model loader has.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let entries = read_header(&map, &file_name)?;
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

/// The engine's dtype of tensor `name`; F32, F16 and BF16 only, else [`Error::Unsupported`].
fn dtype_of(name: &str, info: &TensorInfo) -> Result<DType> {
    match info.dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F16 => Ok(DType::F16),
        Dtype::BF16 => Ok(DType::BF16),
        other => Err(Error::Unsupported(format!(
            "tensor `{name}`: dtype {other:?} (only F32, F16 and BF16 weights are supported)"
        ))),
    }
}

/// Reads the header through the `safetensors` crate and returns every tensor entry with
/// absolute offsets; a dtype other than F32, F16 or BF16 is [`Error::Unsupported`].
fn read_header(map: &[u8], file: &str) -> Result<BTreeMap<String, Entry>> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(map).map_err(|e| header_error(map, file, e))?;
    let data_start = 8 + header_len;
    // By name, so that the first unsupported tensor reported does not depend on hash order.
    let infos: BTreeMap<String, &TensorInfo> = metadata.tensors().into_iter().collect();
    let mut entries = BTreeMap::new();
    for (name, info) in infos {
        let dtype = dtype_of(&name, info)?;
        let (b, e) = info.data_offsets;
        entries.insert(
            name,
            Entry {
                dtype,
                shape: info.shape.clone(),
                start: data_start + b,
                end: data_start + e,
            },
        );
    }
    Ok(entries)
}

/// A header the `safetensors` crate rejected, as an error naming the file and, where the
/// header parses, the tensor at fault (an unsupported dtype is [`Error::Unsupported`]).
fn header_error(map: &[u8], file: &str, e: SafeTensorError) -> Error {
    // The header length field, for the messages (the crate read it the same way).
    let header_len = map
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    let size = map.len();
    let message = match e {
        SafeTensorError::HeaderTooSmall => {
            format!("truncated: {size} bytes, shorter than the 8-byte header length")
        }
        SafeTensorError::HeaderTooLarge => {
            format!("header length {header_len} is over the safetensors limit of 100 MB (corrupt)")
        }
        SafeTensorError::InvalidHeaderLength => format!(
            "header length {header_len} exceeds the file size {size} (truncated or corrupt)"
        ),
        SafeTensorError::InvalidHeader => "header is not UTF-8 (corrupt)".into(),
        SafeTensorError::InvalidHeaderStart | SafeTensorError::InvalidHeaderDeserialization => {
            "header is not valid JSON of a safetensors header (corrupt)".into()
        }
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "truncated: the header's tensors do not end at the end of the file ({size} bytes)"
        ),
        SafeTensorError::ValidationOverflow
        | SafeTensorError::TensorInvalidInfo
        | SafeTensorError::InvalidOffset(_) => match (tensor_at_fault(map, header_len), e) {
            (Some(fault), _) => return fault,
            (None, SafeTensorError::InvalidOffset(name)) => {
                format!("tensor `{name}`: data_offsets leave a gap or overlap another tensor")
            }
            (None, e) => format!("tensor offsets, shapes and dtypes disagree ({e}; corrupt)"),
        },
        other => format!("rejected by the safetensors parser: {other}"),
    };
    bad(file, message)
}

/// After the crate rejected the tensors' shapes or offsets (so the framing and the JSON were
/// valid): the first tensor by name with an unsupported dtype, a size that overflows, or
/// offsets that do not hold its shape. None if the header does not parse again or no
/// single tensor is at fault (a gap or an overlap between tensors).
fn tensor_at_fault(map: &[u8], header_len: u64) -> Option<Error> {
    let end = usize::try_from(header_len).ok()?.checked_add(8)?;
    let metadata: Metadata = serde_json::from_slice(map.get(8..end)?).ok()?;
    let infos: BTreeMap<String, &TensorInfo> = metadata.tensors().into_iter().collect();
    for (name, info) in &infos {
        if let Err(e) = dtype_of(name, info) {
            return Some(e);
        }
    }
    for (name, info) in infos {
        let item = format!("tensor `{name}`");
        let shape = &info.shape;
        let Some(numel) = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.size()))
        else {
            return Some(bad(&item, format!("size of shape {shape:?} overflows")));
        };
        let (b, e) = info.data_offsets;
        if e < b || e - b != numel {
            return Some(bad(
                &item,
                format!("data_offsets [{b}, {e}] do not hold {numel} bytes of shape {shape:?}"),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    /// A safetensors file: the header JSON (padded to 8 bytes) and `data` bytes.
    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut h = header.to_string();
        h.push_str(&" ".repeat((8 - h.len() % 8) % 8));
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        b.resize(b.len() + data, 0);
        b
    }

    fn err(bytes: &[u8]) -> Error {
        match read_header(bytes, "w") {
            Ok(e) => panic!("should fail: {e:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn entries_have_absolute_offsets() {
        let h = r#"{"b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}"#;
        let bytes = file(h, 12);
        let e = read_header(&bytes, "w").unwrap();
        let start = bytes.len() - 12;
        assert_eq!(e.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(
            (e["a"].dtype, e["a"].start, e["a"].end),
            (DType::F32, start, start + 8)
        );
        assert_eq!(
            (e["b"].dtype, e["b"].start, e["b"].shape.as_slice()),
            (DType::F16, start + 8, &[2][..])
        );
    }

    /// What the crate rejects names the tensor at fault where one is.
    #[test]
    fn rejected_headers_name_the_tensor() {
        let gap = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let e = err(&file(gap, 12));
        assert_eq!(e.kind(), ErrorKind::BadModel);
        assert!(
            e.to_string()
                .contains("tensor `b`: data_offsets leave a gap"),
            "{e}"
        );
        let size = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let e = err(&file(size, 8));
        assert!(
            e.to_string()
                .contains("tensor `a`: data_offsets [0, 8] do not hold 12 bytes"),
            "{e}"
        );
        let dtype = r#"{"z":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"U8","shape":[1],"data_offsets":[4,5]},"x":{"dtype":"I64","shape":[1],"data_offsets":[5,13]}}"#;
        let e = err(&file(dtype, 13));
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("tensor `x`: dtype I64"), "{e}");
        let not_json = file(r#"{"a": nope}"#, 0);
        assert!(err(&not_json).to_string().contains("not valid JSON"));
        let mut not_utf8 = file(r#"{"a": 1}"#, 0);
        not_utf8[9] = 0xff;
        assert!(err(&not_utf8).to_string().contains("UTF-8"));
    }

    proptest::proptest! {
        /// Any truncation or one-byte change of a valid file is read or rejected, never a
        /// panic; what is read lies inside the file.
        #[test]
        fn damaged_files_never_panic(cut in 0usize..200, at in 0usize..200, byte in 0u8..=255) {
            let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}}"#;
            let good = file(h, 14);
            let n = good.len();
            let mut bad = good[..cut.min(n)].to_vec();
            if !bad.is_empty() {
                let i = at % bad.len();
                bad[i] = byte;
            }
            if let Ok(entries) = read_header(&bad, "w") {
                for e in entries.values() {
                    proptest::prop_assert!(e.start <= e.end && e.end <= bad.len());
                }
            }
        }
    }
}
