//! Hand-written `--flag value` parsing shared by the subcommands.

use foxedge::{Error, Result};
use std::str::FromStr;

/// The arguments after the subcommand, consumed flag by flag.
#[derive(Debug)]
pub struct Args {
    rest: Vec<String>,
}

impl Args {
    pub fn new(rest: Vec<String>) -> Self {
        Args { rest }
    }

    /// Removes `--name` and returns whether it was present.
    pub fn flag(&mut self, name: &str) -> bool {
        match self.rest.iter().position(|a| a == name) {
            Some(i) => {
                self.rest.remove(i);
                true
            }
            None => false,
        }
    }

    /// Removes `--name VALUE` or `--name=VALUE` and returns VALUE.
    pub fn value(&mut self, name: &str) -> Result<Option<String>> {
        let eq = format!("{name}=");
        if let Some(i) = self.rest.iter().position(|a| a.starts_with(&eq)) {
            let a = self.rest.remove(i);
            return Ok(Some(a[eq.len()..].to_string()));
        }
        match self.rest.iter().position(|a| a == name) {
            Some(i) if i + 1 < self.rest.len() => {
                self.rest.remove(i);
                Ok(Some(self.rest.remove(i)))
            }
            Some(_) => Err(Error::InvalidArgument(format!("{name} needs a value"))),
            None => Ok(None),
        }
    }

    /// [`Args::value`] parsed as `T`.
    pub fn parsed<T: FromStr>(&mut self, name: &str) -> Result<Option<T>>
    where
        T::Err: std::fmt::Display,
    {
        match self.value(name)? {
            None => Ok(None),
            Some(v) => v
                .parse::<T>()
                .map(Some)
                .map_err(|e| Error::InvalidArgument(format!("{name} {v}: {e}"))),
        }
    }

    /// Errors if any argument was not consumed.
    pub fn finish(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "unknown argument(s): {} (see --help)",
                self.rest.join(" ")
            )))
        }
    }
}

/// Parses a budget: `N` entries per head, `Nl` entries per layer, or bytes with a
/// `B`, `KiB`, `MiB` or `GiB` suffix (whole session).
pub fn parse_budget(s: &str) -> Result<foxedge::Budget> {
    let bad = || {
        Error::InvalidArgument(format!(
            "--budget {s}: expected N, Nl, or N{{B,KiB,MiB,GiB}}"
        ))
    };
    let t = s.trim();
    for (suf, mul) in [
        ("GiB", 1usize << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ] {
        if let Some(n) = t.strip_suffix(suf) {
            let n: usize = n.trim().parse().map_err(|_| bad())?;
            return n
                .checked_mul(mul)
                .map(foxedge::Budget::Bytes)
                .ok_or_else(bad);
        }
    }
    if let Some(n) = t.strip_suffix('l') {
        return n
            .parse()
            .map(foxedge::Budget::EntriesPerLayer)
            .map_err(|_| bad());
    }
    t.parse()
        .map(foxedge::Budget::EntriesPerHead)
        .map_err(|_| bad())
}
