//! The facade's error type. Each variant maps to one distinct C ABI status code
//! (see [`ErrorKind`]); messages name the field, tensor or argument at fault.

use std::fmt;
use std::path::PathBuf;

/// Coarse class of an [`Error`], stable for the C ABI to map to integer codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A caller argument is out of range or inconsistent (token id, buffer length, option).
    InvalidArgument,
    /// The model directory, `config.json` or `model.safetensors` is malformed.
    BadModel,
    /// A file could not be opened, read or written.
    Io,
    /// The input is well formed but asks for something this engine does not implement.
    Unsupported,
    /// An allocation of the stated size could not be made.
    OutOfMemory,
    /// The requested compute backend does not exist in this build or on this machine.
    BackendUnavailable,
    /// A broken internal invariant (a bug): reported instead of panicking.
    Internal,
    /// A session file that cannot be restored ([`SessionFileError`] says why).
    BadSessionFile,
}

/// Why a session file was refused ([`Error::SessionFile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionFileError {
    /// The bytes do not start with the session file magic.
    NotASessionFile,
    /// A format version (or flags) this build does not read.
    Version,
    /// The file ends before its declared length.
    Truncated,
    /// The checksum does not match the contents: the file is damaged.
    Checksum,
    /// The file was saved from another model (identity or shape).
    OtherModel,
    /// The checksum matches but a value is impossible (a state no stream can reach).
    Corrupt,
}

impl fmt::Display for SessionFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SessionFileError::NotASessionFile => "not a session file",
            SessionFileError::Version => "unsupported format version",
            SessionFileError::Truncated => "truncated",
            SessionFileError::Checksum => "checksum mismatch",
            SessionFileError::OtherModel => "saved from another model",
            SessionFileError::Corrupt => "corrupt",
        })
    }
}

/// Every failure the facade reports.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A caller argument is wrong; the message names it.
    InvalidArgument(String),
    /// A model file is malformed. `item` names the file, config field or tensor.
    BadModel { item: String, message: String },
    /// An I/O error on `path`.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A valid but unsupported configuration or request.
    Unsupported(String),
    /// An allocation failed; `bytes` is what was requested.
    OutOfMemory { what: String, bytes: usize },
    /// The backend named in the message cannot be used.
    BackendUnavailable(String),
    /// A broken internal invariant.
    Internal(String),
    /// A tokenizer file is malformed, inconsistent or missing its partner; `file` names it.
    Tokenizer { file: String, message: String },
    /// A session file was refused; the caller's session is unchanged.
    SessionFile {
        reason: SessionFileError,
        message: String,
    },
    /// The model directory has no tokenizer files and its vocabulary is not the 256 bytes:
    /// the model runs on ids, but text cannot be encoded or decoded.
    NoTokenizer { dir: PathBuf, vocab: usize },
}

impl Error {
    /// The class of this error (what the C ABI maps to a status code).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::BadModel { .. } => ErrorKind::BadModel,
            Error::Io { .. } => ErrorKind::Io,
            Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::OutOfMemory { .. } => ErrorKind::OutOfMemory,
            Error::BackendUnavailable(_) => ErrorKind::BackendUnavailable,
            Error::Internal(_) => ErrorKind::Internal,
            Error::Tokenizer { .. } => ErrorKind::BadModel,
            Error::NoTokenizer { .. } => ErrorKind::Unsupported,
            Error::SessionFile { .. } => ErrorKind::BadSessionFile,
        }
    }

    pub(crate) fn bad_model(item: impl Into<String>, message: impl Into<String>) -> Self {
        Error::BadModel {
            item: item.into(),
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument(message.into())
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

impl Error {
    /// The message without the class word that [`Display`](fmt::Display) puts first
    /// ("invalid argument: ", "bad model file: ", ...): for interfaces that report the class
    /// separately, as the C ABI does with its status codes.
    pub fn message(&self) -> String {
        match self {
            Error::InvalidArgument(m)
            | Error::Unsupported(m)
            | Error::BackendUnavailable(m)
            | Error::Internal(m) => m.clone(),
            Error::BadModel { item, message } => format!("{item}: {message}"),
            Error::Io { path, source } => format!("{}: {source}", path.display()),
            Error::OutOfMemory { what, bytes } => format!("{what} needs {bytes} bytes"),
            Error::Tokenizer { file, message } => format!("tokenizer file {file}: {message}"),
            Error::SessionFile { reason, message } => format!("{reason}: {message}"),
            Error::NoTokenizer { dir, vocab } => format!(
                "no tokenizer: {} has no tokenizer.json and no vocab.json + merges.txt, and its \
                 vocabulary of {vocab} is not the 256 bytes (token ids still work)",
                dir.display()
            ),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let class = match self {
            Error::InvalidArgument(_) => "invalid argument: ",
            Error::BadModel { .. } => "bad model file: ",
            Error::Unsupported(_) => "unsupported: ",
            Error::OutOfMemory { .. } => "out of memory: ",
            Error::BackendUnavailable(_) => "backend unavailable: ",
            Error::Internal(_) => "internal error: ",
            Error::Tokenizer { .. } => "bad ",
            Error::SessionFile { .. } => "bad session file: ",
            Error::Io { .. } | Error::NoTokenizer { .. } => "",
        };
        write!(f, "{class}{}", self.message())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<foxedge_core::Error> for Error {
    fn from(e: foxedge_core::Error) -> Self {
        match e {
            foxedge_core::Error::Capacity { .. } => Error::Unsupported(e.to_string()),
            foxedge_core::Error::BoundViolated { .. } => Error::Internal(e.to_string()),
            _ => Error::InvalidArgument(e.to_string()),
        }
    }
}

/// Result alias of the facade.
pub type Result<T> = std::result::Result<T, Error>;

/// Allocates a zeroed `Vec<T>` of `n` elements, reporting failure as [`Error::OutOfMemory`].
pub(crate) fn try_zeroed<T: Copy + Default>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        what: what.to_string(),
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    v.resize(n, T::default());
    Ok(v)
}
