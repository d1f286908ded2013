//! `model.safetensors` through a memory map, validated tensor by tensor.
//!
//! Tensors: F32, F16 and BF16 (any safetensors writer), and U8 tensors holding a weight
//! matrix quantized by `foxedge quantize`: Q8 or Q4 tiles in the packed layout of
//! `foxedge_cpu::linear::PackedView`, described in the header's `__metadata__` under the
//! tensor's own name by a JSON object ([`QuantEntry`]):
//!
//! ```text
//! "__metadata__": { "model.layers.0.attn.q_proj.weight":
//!                   "{\"format\":\"q8\",\"layout\":\"packed16\",\"shape\":[768,768]}" }
//! ```
//!
//! The U8 tensor's own shape is `[bytes]`, the packed size of that logical shape.
//!
//! Storage policy: weight matrices are taken in the format they run in
//! ([`crate::matrix::WeightMatrix`]): in place from the map when that is their stored format
//! and their data is aligned for the kernels, else copied or converted once at load, after
//! which the source pages are dropped from this process's memory (`MADV_DONTNEED`; they
//! stay in the page cache). Vectors (norm weights, biases) are widened to f32.

use crate::error::{Error, Result};
use crate::matrix::WeightMatrix;
use foxedge_core::quant::WeightFormat;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

/// How a quantized matrix is stored, as written in the header's `__metadata__`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuantEntry {
    /// `q8` or `q4` ([`WeightFormat::name`]).
    pub format: String,
    /// `foxedge_cpu::linear::PACKED_LAYOUT`.
    pub layout: String,
    /// The logical shape `[out, in]`.
    pub shape: Vec<usize>,
}

/// One entry of the safetensors header after validation.
#[derive(Debug, Clone)]
struct Entry {
    /// F32 / F16 / Bf16 elements, or Q8 / Q4 packed tiles.
    stored: WeightFormat,
    dtype: Dtype,
    /// The logical shape (of a quantized matrix: from its [`QuantEntry`]).
    shape: Vec<usize>,
    /// Absolute byte offsets in the file.
    start: usize,
    end: usize,
}

/// A mapped, header-validated `model.safetensors`.
#[derive(Debug)]
pub struct WeightFile {
    map: Arc<Mmap>,
    entries: BTreeMap<String, Entry>,
    /// Names handed out by the `take_*` methods; the rest are "extra" tensors.
    taken: BTreeSet<String>,
    file: String,
}

fn bad(item: &str, message: impl Into<String>) -> Error {
    Error::bad_model(item, message)
}

impl WeightFile {
    /// Maps `path` and validates its header (the `safetensors` crate: framing, JSON, shapes,
    /// offsets that tile the data section exactly), the dtypes and the quantization entries.
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
            map: Arc::new(map),
            entries,
            taken: BTreeSet::new(),
            file: file_name,
        })
    }

    /// The entry of tensor `name`, marked as taken, after checking its logical shape.
    fn entry(&mut self, name: &str, shape: &[usize]) -> Result<Entry> {
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
        let e = e.clone();
        self.taken.insert(name.to_string());
        Ok(e)
    }

    /// Takes vector (or any small float tensor) `name` of exactly `shape`, widened to f32;
    /// every value must be finite.
    pub fn take_vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let item = format!("tensor `{name}`");
        let e = self.entry(name, shape)?;
        if e.stored.is_block() {
            return Err(bad(
                &item,
                format!("stored as {}; expected a float tensor", e.stored),
            ));
        }
        let n: usize = shape.iter().product();
        let mut v = crate::error::try_zeroed::<f32>(n, &item)?;
        foxedge_core::quant::decode_row(e.stored, &self.map[e.start..e.end], &mut v)?;
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(bad(&item, format!("element {i} is not finite")));
        }
        Ok(v)
    }

    /// Takes weight matrix `name` of shape `[out, inp]`, to run in `target` (None: as
    /// stored), converting with `threads` tasks where needed (see the module docs).
    pub(crate) fn take_matrix(
        &mut self,
        name: &str,
        (out, inp): (usize, usize),
        target: Option<WeightFormat>,
        threads: usize,
    ) -> Result<WeightMatrix> {
        let e = self.entry(name, &[out, inp])?;
        let target = target.unwrap_or(e.stored);
        let m = WeightMatrix::load(
            name,
            &self.map,
            e.start,
            e.end - e.start,
            e.stored,
            (out, inp),
            target,
            threads,
        )?;
        if !m.is_mapped() {
            self.release(e.start, e.end);
        }
        Ok(m)
    }

    /// Drops the whole pages of `[start, end)` from this process's resident memory.
    fn release(&self, start: usize, end: usize) {
        const PAGE: usize = 4096;
        let (a, b) = (start.next_multiple_of(PAGE), end - end % PAGE);
        if b > a {
            // SAFETY: the map is private and never written, so MADV_DONTNEED only drops
            // clean pages: any later read of them (another tensor sharing an edge page, or
            // a borrow that is still alive) faults the same bytes in again from the file,
            // under the same immutable-file contract as the map itself. The range lies
            // inside the map (validated header offsets). Failure only keeps pages resident.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a)
            };
        }
    }

    /// Weights in the file, counted by logical shape.
    pub(crate) fn total_params(&self) -> u64 {
        self.entries
            .values()
            .map(|e| e.shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// Error naming the tensors that were never taken (unexpected for this config).
    pub fn check_no_extra(&self) -> Result<()> {
        let extra: Vec<&str> = self
            .entries
            .keys()
            .filter(|k| !self.taken.contains(*k))
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

    /// Every tensor as stored, by name: safetensors dtype, logical shape, bytes.
    pub(crate) fn raw_tensors(&self) -> impl Iterator<Item = (&str, Dtype, &[usize], &[u8])> {
        self.entries.iter().map(|(n, e)| {
            (
                n.as_str(),
                e.dtype,
                e.shape.as_slice(),
                &self.map[e.start..e.end],
            )
        })
    }
}

/// The stored format of tensor `name` from its dtype: F32, F16, BF16, or U8 with a
/// quantization entry; anything else is [`Error::Unsupported`].
fn format_of(name: &str, info: &TensorInfo, quant: Option<&str>) -> Result<WeightFormat> {
    match info.dtype {
        Dtype::F32 => Ok(WeightFormat::F32),
        Dtype::F16 => Ok(WeightFormat::F16),
        Dtype::BF16 => Ok(WeightFormat::Bf16),
        Dtype::U8 => match quant {
            Some(text) => Ok(parse_quant(name, text)?.0),
            None => Err(Error::Unsupported(format!(
                "tensor `{name}`: dtype U8 without a quantized-weights entry in __metadata__ \
                 (only F32, F16, BF16 and foxedge's packed Q8 / Q4 are supported)"
            ))),
        },
        other => Err(Error::Unsupported(format!(
            "tensor `{name}`: dtype {other:?} (only F32, F16, BF16 and foxedge's packed Q8 / \
             Q4 weights are supported)"
        ))),
    }
}

/// A quantization entry's format and logical shape `[out, in]`.
fn parse_quant(name: &str, text: &str) -> Result<(WeightFormat, Vec<usize>)> {
    let item = format!("tensor `{name}`");
    let q: QuantEntry = serde_json::from_str(text)
        .map_err(|e| bad(&item, format!("its __metadata__ entry is not valid ({e})")))?;
    let format = match q.format.parse::<WeightFormat>() {
        Ok(f) if f.is_block() => f,
        _ => {
            return Err(Error::Unsupported(format!(
                "tensor `{name}`: quantized format `{}` (this build reads q8 and q4)",
                q.format
            )));
        }
    };
    if q.layout != foxedge_cpu::linear::PACKED_LAYOUT {
        return Err(Error::Unsupported(format!(
            "tensor `{name}`: layout `{}` (this build reads `{}`)",
            q.layout,
            foxedge_cpu::linear::PACKED_LAYOUT
        )));
    }
    if q.shape.len() != 2 {
        return Err(bad(
            &item,
            format!("quantized shape {:?} is not [out, in]", q.shape),
        ));
    }
    Ok((format, q.shape))
}

/// Reads the header through the `safetensors` crate and returns every tensor entry with
/// absolute offsets and its logical shape; checks each quantized tensor's byte count.
fn read_header(map: &[u8], file: &str) -> Result<BTreeMap<String, Entry>> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(map).map_err(|e| header_error(map, file, e))?;
    let data_start = 8 + header_len;
    let empty = HashMap::new();
    let quant = metadata.metadata().as_ref().unwrap_or(&empty);
    // By name, so that the first unsupported tensor reported does not depend on hash order.
    let infos: BTreeMap<String, &TensorInfo> = metadata.tensors().into_iter().collect();
    let mut entries = BTreeMap::new();
    for (name, info) in infos {
        let q = quant.get(&name).map(String::as_str);
        let stored = format_of(&name, info, q)?;
        let (b, e) = info.data_offsets;
        let shape = match (stored.is_block(), q) {
            (true, Some(text)) => {
                let shape = parse_quant(&name, text)?.1;
                let want =
                    foxedge_cpu::linear::PackedWeights::packed_bytes(stored, shape[0], shape[1])
                        .map_err(|err| {
                            bad(
                                &format!("tensor `{name}`"),
                                format!("{stored} {shape:?}: {err}"),
                            )
                        })?;
                if info.shape != [want] {
                    return Err(bad(
                        &format!("tensor `{name}`"),
                        format!(
                            "U8 shape {:?}, expected [{want}] for {stored} {shape:?} packed",
                            info.shape
                        ),
                    ));
                }
                shape
            }
            _ => info.shape.clone(),
        };
        entries.insert(
            name,
            Entry {
                stored,
                dtype: info.dtype,
                shape,
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
    let empty = HashMap::new();
    let quant = metadata.metadata().as_ref().unwrap_or(&empty);
    for (name, info) in &infos {
        if let Err(e) = format_of(name, info, quant.get(name).map(String::as_str)) {
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
            (e["a"].stored, e["a"].start, e["a"].end),
            (WeightFormat::F32, start, start + 8)
        );
        assert_eq!(
            (e["b"].stored, e["b"].start, e["b"].shape.as_slice()),
            (WeightFormat::F16, start + 8, &[2][..])
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

    /// A U8 tensor with a quantization entry: logical shape from the entry, byte count
    /// checked; a missing, malformed or foreign entry is a named error.
    #[test]
    fn quantized_entries() {
        let q = |meta: &str, bytes: usize| {
            let h = format!(
                r#"{{"__metadata__":{{"w":{}}},"w":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[0,{bytes}]}}}}"#,
                serde_json::to_string(meta).unwrap()
            );
            file(&h, bytes)
        };
        // Q8 [20, 40]: two groups of 16 rows, one tile pair each (1088 bytes).
        let good = r#"{"format":"q8","layout":"packed16","shape":[20,40]}"#;
        let bytes = q(good, 2176);
        let e = read_header(&bytes, "w").unwrap();
        assert_eq!(
            (e["w"].stored, e["w"].shape.as_slice()),
            (WeightFormat::Q8, &[20, 40][..])
        );
        let cases = [
            (q(good, 2175), ErrorKind::BadModel, "expected [2176]"),
            (
                q(r#"{"format":"q8"}"#, 2176),
                ErrorKind::BadModel,
                "not valid",
            ),
            (
                q(
                    r#"{"format":"q5","layout":"packed16","shape":[20,40]}"#,
                    2176,
                ),
                ErrorKind::Unsupported,
                "q5",
            ),
            (
                q(
                    r#"{"format":"f16","layout":"packed16","shape":[20,40]}"#,
                    2176,
                ),
                ErrorKind::Unsupported,
                "f16",
            ),
            (
                q(r#"{"format":"q4","layout":"rows","shape":[20,40]}"#, 2176),
                ErrorKind::Unsupported,
                "layout `rows`",
            ),
            (
                q(r#"{"format":"q4","layout":"packed16","shape":[800]}"#, 2176),
                ErrorKind::BadModel,
                "not [out, in]",
            ),
            (
                q(r#"{"format":"q4","layout":"packed16","shape":[0,5]}"#, 2176),
                ErrorKind::BadModel,
                "q4 [0, 5]",
            ),
        ];
        for (bytes, kind, needle) in cases {
            let e = err(&bytes);
            assert_eq!(e.kind(), kind, "{e}");
            assert!(
                e.to_string().contains("tensor `w`") && e.to_string().contains(needle),
                "{e}"
            );
        }
        let plain = r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let e = err(&file(plain, 4));
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("U8 without"), "{e}");
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
