//! Integer arrays from `.npy` files (npyz) for the library's own readers of token-id
//! fixtures; the command line has its own reader and writer (`src/cli/npy.rs`).

use crate::error::{Error, Result};
use npyz::{DType, NpyFile, Order, TypeChar};
use std::path::Path;

/// The first line of `e`, at most 160 characters (a parse error can quote the whole header).
fn first_line(e: &std::io::Error) -> String {
    let s = e.to_string();
    s.lines().next().unwrap_or("").chars().take(160).collect()
}

/// An int32 or uint8 array in C order, widened to i32.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NpyArray {
    pub shape: Vec<usize>,
    data: Vec<i32>,
}

impl NpyArray {
    /// Reads an int32 (either byte order) or uint8 `.npy` file in C order.
    pub fn read(path: impl AsRef<Path>) -> Result<NpyArray> {
        let path = path.as_ref();
        let bad = |m: String| Error::invalid(format!("{}: {m}", path.display()));
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let r = std::io::BufReader::new(f);
        // npyz multiplies the shape's dimensions unchecked: an overflowing shape panics
        // inside it in a debug build (caught here) and wraps in a release build (the element
        // count is checked below).
        let npy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || NpyFile::new(r)))
            .map_err(|_| bad("the shape's element count overflows".into()))?
            .map_err(|e| bad(format!("not a readable .npy file: {}", first_line(&e))))?;
        if npy.order() != Order::C {
            return Err(bad("Fortran-order arrays are not supported".into()));
        }
        let shape = npy
            .shape()
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| bad("shape does not fit in memory".into()))?;
        let read_err = |e: std::io::Error| bad(format!("reading the data: {e}"));
        let data = match npy.dtype() {
            DType::Plain(t) if t.type_char() == TypeChar::Int && t.size_field() == 4 => {
                npy.into_vec::<i32>().map_err(read_err)?
            }
            DType::Plain(t) if t.type_char() == TypeChar::Uint && t.size_field() == 1 => npy
                .into_vec::<u8>()
                .map_err(read_err)?
                .into_iter()
                .map(i32::from)
                .collect(),
            d => {
                return Err(bad(format!(
                    "dtype {} (expected int32 or uint8)",
                    d.descr()
                )));
            }
        };
        if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(data.len()) {
            return Err(bad(format!("{} elements for shape {shape:?}", data.len())));
        }
        Ok(NpyArray { shape, data })
    }

    /// The elements (uint8 widened).
    pub fn to_i32(&self) -> Result<Vec<i32>> {
        Ok(self.data.clone())
    }
}
