//! The one error type of the decision layer. Every fallible function in `foxedge-core`
//! returns it; nothing in this crate panics on caller input.

use core::fmt;

/// What was wrong with the caller's input. Values that locate the problem (positions,
/// heads, sizes) are carried so that a message can name them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Error {
    /// A log forget gate is NaN, infinite or positive. `index` is the flat position in the
    /// slice that was validated.
    BadLogGate { index: usize, value: f32 },
    /// A shape field is zero, inconsistent, or its product overflows `usize`.
    BadShape(&'static str),
    /// A buffer has the wrong number of elements.
    BadLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A scalar argument is out of its domain (NaN bound, ln eps > 0, zero block size...).
    BadArgument(&'static str),
    /// A fixed-capacity structure would exceed its capacity.
    Capacity { what: &'static str, capacity: usize },
    /// A q or k vector exceeded the logit bound that a streaming threshold was derived from.
    BoundViolated { observed: f32, bound: f32 },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::BadLogGate { index, value } => write!(
                f,
                "log forget gate at position {index} is {value}: it must be finite and <= 0"
            ),
            Error::BadShape(why) => write!(f, "bad shape: {why}"),
            Error::BadLength {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected} elements, got {got}"),
            Error::BadArgument(why) => write!(f, "bad argument: {why}"),
            Error::Capacity { what, capacity } => {
                write!(f, "{what}: capacity {capacity} exceeded")
            }
            Error::BoundViolated { observed, bound } => write!(
                f,
                "logit bound violated: observed {observed} > bound {bound} used for the threshold"
            ),
        }
    }
}

#[cfg(feature = "std")]
extern crate std;

#[cfg(feature = "std")]
impl std::error::Error for Error {}

/// Result alias of this crate.
pub type Result<T> = core::result::Result<T, Error>;
