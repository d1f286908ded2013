//! NumPy `.npy` files of the command line, through npyz: token ids in, float32 arrays out.

use foxedge::{Error, Result};
use npyz::{DType, NpyFile, Order, TypeChar, WriterBuilder};
use std::io::{BufReader, BufWriter, Read};
use std::path::Path;

/// Token ids read from `.npy`: `shape` is `[T]` or `[B, T]` with `B, T > 0`; `ids` holds
/// `B · T` ids in C order.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenIds {
    pub shape: Vec<usize>,
    pub ids: Vec<u32>,
}

impl TokenIds {
    /// B (1 for a `[T]` array).
    pub fn rows(&self) -> usize {
        self.ids.len() / self.row_len()
    }

    /// T, the tokens of each row.
    pub fn row_len(&self) -> usize {
        self.shape[self.shape.len() - 1]
    }
}

/// The first line of `e`, at most 160 characters (a parse error can quote the whole header).
fn first_line(e: &std::io::Error) -> String {
    let s = e.to_string();
    s.lines().next().unwrap_or("").chars().take(160).collect()
}

/// Reads token ids from a `.npy` file: int32, int64 (either byte order) or uint8, C order,
/// shape `[T]` or `[B, T]`, every id in `0..2^32`.
pub fn read_token_ids(path: &Path) -> Result<TokenIds> {
    let f = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    parse_token_ids(BufReader::new(f), &path.display().to_string())
}

/// [`read_token_ids`] from any reader; `what` names the source in errors.
pub fn parse_token_ids(r: impl Read, what: &str) -> Result<TokenIds> {
    let bad = |m: String| Error::InvalidArgument(format!("{what}: {m}"));
    // npyz multiplies the shape's dimensions unchecked: an overflowing shape panics inside
    // it in a debug build (caught here) and wraps in a release build (checked below).
    let npy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || NpyFile::new(r)))
        .map_err(|_| bad("the shape's element count overflows".into()))?
        .map_err(|e| bad(format!("not a readable .npy file: {}", first_line(&e))))?;
    if npy.order() != Order::C {
        return Err(bad("Fortran-order arrays are not supported".into()));
    }
    let shape: Vec<usize> = npy
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad("shape does not fit in memory".into()))?;
    let n = match shape.as_slice() {
        [_] | [_, _] => shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("the shape's element count overflows".into()))?,
        s => {
            return Err(bad(format!(
                "token ids must be [T] or [B, T], got shape {s:?}"
            )));
        }
    };
    if n == 0 {
        return Err(bad("no tokens".into()));
    }
    let ts = match npy.dtype() {
        DType::Plain(ts) => ts,
        d => return Err(bad(format!("dtype {} is not a token id type", d.descr()))),
    };
    let read_err = |e: std::io::Error| bad(format!("reading the data: {e}"));
    let wide: Vec<i64> = match (ts.type_char(), ts.size_field()) {
        (TypeChar::Int, 4) => npy
            .into_vec::<i32>()
            .map_err(read_err)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (TypeChar::Int, 8) => npy.into_vec::<i64>().map_err(read_err)?,
        (TypeChar::Uint, 1) => npy
            .into_vec::<u8>()
            .map_err(read_err)?
            .into_iter()
            .map(i64::from)
            .collect(),
        _ => {
            return Err(bad(format!(
                "dtype {ts} (token ids must be int32, int64 or uint8)"
            )));
        }
    };
    if wide.len() != n {
        return Err(bad(format!("{} ids for shape {shape:?}", wide.len())));
    }
    let ids = wide
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            u32::try_from(x).map_err(|_| bad(format!("token {x} at {i} is not in 0..2^32")))
        })
        .collect::<Result<Vec<u32>>>()?;
    Ok(TokenIds { shape, ids })
}

/// Writes `data` as a little-endian float32 `.npy` of `shape` (C order).
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let io = |e: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        source: e,
    };
    if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(data.len()) {
        return Err(Error::Internal(format!(
            "{}: shape {shape:?} does not hold {} values",
            path.display(),
            data.len()
        )));
    }
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let f = std::fs::File::create(path).map_err(io)?;
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape)
        .writer(BufWriter::new(f))
        .begin_nd()
        .map_err(io)?;
    w.extend(data.iter().copied()).map_err(io)?;
    w.finish().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `data` as `.npy` bytes of dtype `descr` (e.g. `<i4`) and `shape`.
    fn npy<T: npyz::Serialize + Copy>(descr: &str, shape: &[u64], data: &[T]) -> Vec<u8> {
        let mut out = Vec::new();
        let ts: npyz::TypeStr = descr.parse().unwrap();
        let mut w = npyz::WriteOptions::new()
            .dtype(DType::Plain(ts))
            .shape(shape)
            .writer(&mut out)
            .begin_nd()
            .unwrap();
        w.extend(data.iter().copied()).unwrap();
        w.finish().unwrap();
        out
    }

    fn parse(bytes: &[u8]) -> Result<TokenIds> {
        parse_token_ids(bytes, "t")
    }

    #[test]
    fn reads_every_id_type_and_both_byte_orders() {
        let want = |shape: &[usize]| TokenIds {
            shape: shape.to_vec(),
            ids: vec![0, 7, 255, 3, 1, 2],
        };
        let v = [0i64, 7, 255, 3, 1, 2];
        let i32s: Vec<i32> = v.iter().map(|&x| x as i32).collect();
        let u8s: Vec<u8> = v.iter().map(|&x| x as u8).collect();
        assert_eq!(parse(&npy("<i4", &[6], &i32s)).unwrap(), want(&[6]));
        assert_eq!(parse(&npy(">i4", &[2, 3], &i32s)).unwrap(), want(&[2, 3]));
        assert_eq!(parse(&npy("<i8", &[3, 2], &v)).unwrap(), want(&[3, 2]));
        assert_eq!(parse(&npy("|u1", &[1, 6], &u8s)).unwrap(), want(&[1, 6]));
        let t = parse(&npy("<i4", &[2, 3], &i32s)).unwrap();
        assert_eq!((t.rows(), t.row_len()), (2, 3));
        let t = parse(&npy("<i4", &[6], &i32s)).unwrap();
        assert_eq!((t.rows(), t.row_len()), (1, 6));
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let ok = npy("<i4", &[4], &[1i32, 2, 3, 4]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (npy("<f4", &[2], &[1.0f32, 2.0]), "dtype"),
            (npy("<i4", &[1, 2, 2], &[1i32, 2, 3, 4]), "shape"),
            (npy("<i4", &[0], &[] as &[i32]), "no tokens"),
            (npy("<i4", &[0, 3], &[] as &[i32]), "no tokens"),
            (npy("<i4", &[2], &[1i32, -5]), "-5"),
            (npy("<i8", &[1], &[1i64 << 40]), "1099511627776"),
            (ok[..ok.len() - 2].to_vec(), "reading the data"),
            (ok[..20].to_vec(), ".npy"),
            (b"hello, world".to_vec(), ".npy"),
            (Vec::new(), ".npy"),
        ];
        for (bytes, needle) in cases {
            let e = parse(&bytes).unwrap_err();
            let msg = e.to_string();
            assert!(msg.starts_with("invalid argument: t: "), "{msg}");
            assert!(msg.contains(needle), "`{msg}` should mention `{needle}`");
        }
        // A shape whose element count overflows u64, and one too large to allocate.
        for shape in [
            "(4294967296, 4294967296, 4294967296)",
            "(1, 4611686018427387904)",
        ] {
            let mut h = format!("{{'descr': '<i4', 'fortran_order': False, 'shape': {shape}, }}");
            h.push_str(&" ".repeat(63 - (h.len() + 10) % 64));
            h.push('\n');
            let mut b = b"\x93NUMPY\x01\x00".to_vec();
            b.extend_from_slice(&(h.len() as u16).to_le_bytes());
            b.extend_from_slice(h.as_bytes());
            b.extend_from_slice(&[0; 16]);
            assert!(parse(&b).is_err(), "{shape}");
        }
        let mut fortran = npy("<i4", &[2, 2], &[1i32, 2, 3, 4]);
        let at = fortran.windows(5).position(|w| w == b"False").unwrap();
        fortran[at..at + 5].copy_from_slice(b"True ");
        assert!(parse(&fortran).unwrap_err().to_string().contains("Fortran"));
    }

    #[test]
    fn writes_float32_that_npyz_reads_back() {
        let dir = std::env::temp_dir().join(format!("foxedge-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        let data = [0.5f32, -1.0, f32::MIN, 1e-30, 3.0, 4.0];
        write_f32(&p, &[1, 2, 3], &data).unwrap();
        let f = NpyFile::new(std::fs::File::open(&p).unwrap()).unwrap();
        assert_eq!(f.shape(), &[1, 2, 3]);
        assert_eq!(f.dtype().descr(), "'<f4'");
        assert_eq!(f.into_vec::<f32>().unwrap(), data);
        assert!(write_f32(&p, &[4], &data).is_err());
        let missing = dir.join("no/such/dir/a.npy");
        assert!(matches!(
            write_f32(&missing, &[6], &data),
            Err(Error::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    proptest! {
        /// Any bytes, and any truncation or one-byte change of a valid file, give ids or an
        /// error, never a panic; what parses has as many ids as its shape says.
        #[test]
        fn arbitrary_bytes_never_panic(
            junk in proptest::collection::vec(any::<u8>(), 0..200),
            cut in 0usize..200,
            at in 0usize..200,
            byte in any::<u8>(),
        ) {
            let _ = parse(&junk);
            let mut good = npy("<i4", &[3, 4], &(0..12).collect::<Vec<i32>>());
            let n = good.len();
            let _ = parse(&good[..cut.min(n)]);
            good[at % n] = byte;
            if let Ok(t) = parse(&good) {
                prop_assert_eq!(t.ids.len(), t.shape.iter().product::<usize>());
            }
        }
    }
}
