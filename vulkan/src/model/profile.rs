//! Per-command GPU profile of the device model (`FOXEDGE_VK_PROFILE=1`): a timestamp after
//! every command a [`super::ops::Rec`] records, each gap charged to the kind of the command
//! before it, summed per kind and printed (stderr) when the stream is dropped, in two tables:
//! the one-token steps (per step), and the multi-row runs (prefill and continuation chunks,
//! per run, with the matrix products' rate: `2 n rows K` flops over the command's time).
//! Off by default: a recording without a [`Prof`] writes no timestamps.
//!
//! A timestamp (`ALL_COMMANDS` stage) is written when every command before it has
//! completed, so a gap is its command's device time plus the barrier before it, in µs
//! (`timestampPeriod` ns per tick).

use crate::device::{Context, Stamps};
use crate::error::Result;
use std::collections::BTreeMap;
use vulkano::command_buffer::{AutoCommandBufferBuilder, PrimaryAutoCommandBuffer};

/// Environment variable: `1` turns the profile on. Read once.
pub(crate) const PROFILE_ENV: &str = "FOXEDGE_VK_PROFILE";

/// Whether [`PROFILE_ENV`] is `1`.
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(PROFILE_ENV).is_some_and(|v| v == "1"))
}

/// The timestamps of one recording: stamp 0 at its start, stamp `i + 1` after command `i`
/// (of kind `kinds[i]`).
pub(crate) struct Prof {
    stamps: Stamps,
    cap: u32,
    /// (kind, flops) of every command.
    kinds: Vec<(&'static str, f64)>,
}

impl Prof {
    /// A profile of at most `cap - 1` commands, reset and started in `b`; `None` where the
    /// queue has no timestamps.
    pub fn start(
        ctx: &Context,
        cap: u32,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
    ) -> Result<Option<Self>> {
        let Some(stamps) = Stamps::new(ctx, cap.max(2)) else {
            return Ok(None);
        };
        stamps.reset(b)?;
        stamps.stamp(b, 0)?;
        Ok(Some(Self {
            stamps,
            cap: cap.max(2),
            kinds: Vec::new(),
        }))
    }

    /// Stamps the end of a command of `kind` doing `flops` floating-point operations (0:
    /// not counted) (commands past the pool's size go untimed; [`Prof::dropped`] counts
    /// them).
    pub fn mark(
        &mut self,
        b: &mut AutoCommandBufferBuilder<PrimaryAutoCommandBuffer>,
        kind: &'static str,
        flops: f64,
    ) -> Result<()> {
        let i = self.kinds.len() as u32 + 1;
        if i < self.cap {
            self.stamps.stamp(b, i)?;
        }
        self.kinds.push((kind, flops));
        Ok(())
    }

    /// Commands recorded past the pool's size (not timed).
    pub fn dropped(&self) -> usize {
        self.kinds.len().saturating_sub(self.cap as usize - 1)
    }

    /// Adds the gaps of the last completed submission to `acc` (call after its fence).
    pub fn collect(&self, acc: &mut Profile) {
        let n = self.kinds.len().min(self.cap as usize - 1);
        let gaps = self.stamps.gaps_us_first(n as u32 + 1);
        if gaps.len() != n {
            return;
        }
        for (&(kind, flops), us) in self.kinds.iter().zip(gaps) {
            let e = acc.kinds.entry(kind).or_default();
            e.0 += us;
            e.1 += 1;
            e.2 += flops;
        }
        acc.untimed += self.dropped() as u64;
        acc.submissions += 1;
    }
}

/// GPU time per command kind, summed over submissions (or over runs of several
/// submissions, [`Profile::add_run`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Profile {
    /// kind -> (µs, commands, flops).
    kinds: BTreeMap<&'static str, (f64, u64, f64)>,
    submissions: u64,
    untimed: u64,
    /// Runs and their tokens, where the profile counts runs.
    runs: u64,
    tokens: u64,
}

impl Profile {
    /// Counts one run of `tokens` tokens (its submissions collected before or after).
    pub fn add_run(&mut self, tokens: usize) {
        self.runs += 1;
        self.tokens += tokens as u64;
    }

    /// The table, one line per kind (largest total first): commands and µs per submission
    /// (per run where runs are counted), µs per command, share of the total, and TFLOP/s
    /// for the kinds whose commands count flops.
    pub fn table(&self, what: &str) -> String {
        use std::fmt::Write;
        let (count, per) = if self.runs > 0 {
            (self.runs, "run")
        } else {
            (self.submissions, "sub")
        };
        let n = count.max(1) as f64;
        let total: f64 = self.kinds.values().map(|v| v.0).sum();
        let cmds: u64 = self.kinds.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = self.kinds.iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        let tokens = if self.runs > 0 {
            format!(
                " ({} tokens, {:.2} µs per token, {} submissions)",
                self.tokens,
                total / self.tokens.max(1) as f64,
                self.submissions
            )
        } else {
            String::new()
        };
        let mut s = format!(
            "foxedge-vulkan: GPU profile of {count} {what}{tokens}: {:.1} µs and {:.1} \
             commands each{}\n{:<14} {:>9} {:>10} {:>10} {:>6} {:>8}\n",
            total / n,
            cmds as f64 / n,
            if self.untimed > 0 {
                format!(" ({} commands past the query pool untimed)", self.untimed)
            } else {
                String::new()
            },
            "kind",
            format!("cmds/{per}"),
            format!("µs/{per}"),
            "µs/cmd",
            "share",
            "TFLOP/s",
        );
        for (kind, (us, c, flops)) in rows {
            let rate = if *flops > 0.0 && *us > 0.0 {
                format!("{:>8.2}", flops / us * 1e-6)
            } else {
                format!("{:>8}", "")
            };
            let _ = writeln!(
                s,
                "{kind:<14} {:>9.1} {:>10.1} {:>10.2} {:>5.1}% {rate}",
                *c as f64 / n,
                us / n,
                us / (*c).max(1) as f64,
                100.0 * us / total.max(1e-9),
            );
        }
        s
    }

    pub fn is_empty(&self) -> bool {
        self.submissions == 0
    }

    /// (µs, commands) of `kind` summed over the submissions.
    #[cfg(test)]
    pub fn kind(&self, kind: &str) -> Option<(f64, u64)> {
        self.kinds.get(kind).map(|k| (k.0, k.1))
    }

    /// Flops counted for `kind`, summed over the submissions.
    #[cfg(test)]
    pub fn flops(&self, kind: &str) -> Option<f64> {
        self.kinds.get(kind).map(|k| k.2)
    }

    /// Runs profiled ([`Profile::add_run`]).
    #[cfg(test)]
    pub fn runs(&self) -> u64 {
        self.runs
    }

    /// Submissions profiled.
    #[cfg(test)]
    pub fn submissions(&self) -> u64 {
        self.submissions
    }
}

#[cfg(test)]
mod tests;
