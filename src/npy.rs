//! A minimal NumPy `.npy` (format 1.0/2.0/3.0) reader and writer for little-endian
//! int32, float32 and uint8 arrays in C order: what the fixtures and `foxedge logits` use.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

/// The element data of an array.
#[derive(Debug, Clone, PartialEq)]
pub enum NpyData {
    I32(Vec<i32>),
    F32(Vec<f32>),
    U8(Vec<u8>),
}

/// An n-dimensional array read from or written to `.npy`.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    pub data: NpyData,
}

const MAGIC: &[u8] = b"\x93NUMPY";

fn bad(what: &str, m: impl Into<String>) -> Error {
    Error::invalid(format!("{what}: {}", m.into()))
}

/// Value of `'key': value` in the header dict, as raw text up to the next top-level comma.
fn header_field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("'{key}':");
    let start = header.find(&pat)? + pat.len();
    let rest = header[start..].trim_start();
    if rest.starts_with('(') {
        let end = rest.find(')')?;
        Some(&rest[..=end])
    } else {
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        Some(rest[..end].trim())
    }
}

impl NpyArray {
    /// Number of elements (product of the shape).
    pub fn len(&self) -> usize {
        match &self.data {
            NpyData::I32(v) => v.len(),
            NpyData::F32(v) => v.len(),
            NpyData::U8(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Parses `.npy` bytes; `what` names the source in errors.
    pub fn parse(bytes: &[u8], what: &str) -> Result<NpyArray> {
        if bytes.len() < 10 || &bytes[..6] != MAGIC {
            return Err(bad(what, "not a .npy file (bad magic)"));
        }
        let major = bytes[6];
        let (hlen, hstart): (usize, usize) = match major {
            1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
            2 | 3 => {
                if bytes.len() < 12 {
                    return Err(bad(what, "truncated header"));
                }
                let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
                (n as usize, 12)
            }
            v => return Err(bad(what, format!("unsupported .npy version {v}"))),
        };
        let hend = hstart
            .checked_add(hlen)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| bad(what, "truncated header"))?;
        let header = std::str::from_utf8(&bytes[hstart..hend])
            .map_err(|_| bad(what, "header is not text"))?;
        let descr = header_field(header, "descr").ok_or_else(|| bad(what, "no 'descr'"))?;
        let descr = descr.trim_matches(|c| c == '\'' || c == '"');
        let fortran =
            header_field(header, "fortran_order").ok_or_else(|| bad(what, "no 'fortran_order'"))?;
        if fortran != "False" {
            return Err(bad(what, "Fortran-order arrays are not supported"));
        }
        let shape_txt = header_field(header, "shape").ok_or_else(|| bad(what, "no 'shape'"))?;
        let inner = shape_txt.trim_start_matches('(').trim_end_matches(')');
        let mut shape = Vec::new();
        for part in inner.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            shape.push(
                part.parse::<usize>()
                    .map_err(|_| bad(what, format!("bad shape entry {part:?}")))?,
            );
        }
        let n = shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .ok_or_else(|| bad(what, "shape overflows"))?;
        let body = &bytes[hend..];
        let (size, kind) = match descr {
            "<i4" => (4, 0),
            "<f4" => (4, 1),
            "|u1" | "<u1" => (1, 2),
            other => {
                return Err(bad(
                    what,
                    format!("dtype {other} (only <i4, <f4 and |u1 are supported)"),
                ));
            }
        };
        let need = n
            .checked_mul(size)
            .ok_or_else(|| bad(what, "size overflows"))?;
        if body.len() != need {
            return Err(bad(
                what,
                format!("data has {} bytes, shape needs {need}", body.len()),
            ));
        }
        let data = match kind {
            0 => NpyData::I32(
                body.chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            1 => NpyData::F32(
                body.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            _ => NpyData::U8(body.to_vec()),
        };
        Ok(NpyArray { shape, data })
    }

    /// Reads a `.npy` file.
    pub fn read(path: impl AsRef<Path>) -> Result<NpyArray> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&bytes, &path.display().to_string())
    }

    /// Serializes to `.npy` version 1.0 bytes (header padded to a multiple of 64).
    pub fn to_bytes(&self) -> Vec<u8> {
        let descr = match self.data {
            NpyData::I32(_) => "<i4",
            NpyData::F32(_) => "<f4",
            NpyData::U8(_) => "|u1",
        };
        let shape = match self.shape.len() {
            1 => format!("({},)", self.shape[0]),
            _ => format!(
                "({})",
                self.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        let total = 10 + header.len() + 1;
        header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
        header.push('\n');
        let mut out = Vec::with_capacity(10 + header.len() + self.len() * 4);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        match &self.data {
            NpyData::I32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            NpyData::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            NpyData::U8(v) => out.extend_from_slice(v),
        }
        out
    }

    /// Writes a `.npy` file.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        f.write_all(&self.to_bytes())
            .map_err(|e| Error::io(path, e))
    }

    /// The elements as i32 (uint8 widened); error for float arrays.
    pub fn to_i32(&self) -> Result<Vec<i32>> {
        match &self.data {
            NpyData::I32(v) => Ok(v.clone()),
            NpyData::U8(v) => Ok(v.iter().map(|&b| b as i32).collect()),
            NpyData::F32(_) => Err(Error::invalid("expected an integer array, got float32")),
        }
    }

    /// The elements as f32; error for integer arrays.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        match &self.data {
            NpyData::F32(v) => Ok(v.clone()),
            _ => Err(Error::invalid("expected a float32 array")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all_dtypes_and_shapes() {
        let arrays = [
            NpyArray {
                shape: vec![3],
                data: NpyData::I32(vec![-1, 0, 7]),
            },
            NpyArray {
                shape: vec![2, 3],
                data: NpyData::F32(vec![0.5, -1.0, 2.0, 3.0, f32::MIN, 1e-30]),
            },
            NpyArray {
                shape: vec![2, 1, 2],
                data: NpyData::U8(vec![0, 255, 1, 2]),
            },
            NpyArray {
                shape: vec![],
                data: NpyData::F32(vec![4.0]),
            },
        ];
        for a in arrays {
            let b = a.to_bytes();
            assert_eq!(
                (b.len()
                    - a.len()
                        * if matches!(a.data, NpyData::U8(_)) {
                            1
                        } else {
                            4
                        })
                    % 64,
                0
            );
            assert_eq!(NpyArray::parse(&b, "t").unwrap(), a);
        }
    }

    #[test]
    fn rejects_malformed() {
        let good = NpyArray {
            shape: vec![4],
            data: NpyData::I32(vec![1, 2, 3, 4]),
        }
        .to_bytes();
        assert!(NpyArray::parse(&good[..good.len() - 1], "t").is_err());
        assert!(NpyArray::parse(&good[..8], "t").is_err());
        assert!(NpyArray::parse(b"hello world", "t").is_err());
        let mut f8 = good.clone();
        let at = f8.windows(3).position(|w| w == b"<i4").unwrap();
        f8[at..at + 3].copy_from_slice(b"<f8");
        assert!(NpyArray::parse(&f8, "t").is_err());
    }
}
