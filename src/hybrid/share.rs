//! Whether a CPU measurement met a busy host, and when to measure again.
//!
//! The CPU share is the fraction of a core the pool's threads get while they want one:
//! each thread spins until its own CPU clock has advanced [`PROBE_CPU_S`], and the share
//! is their CPU seconds over their wall seconds ([`probe`]). Alone on its cores a thread
//! gets all of one (the share is close to 1); a thread that shares its core with other
//! runnable threads waits for its turns. On the dev machine's 2 cores (2 pool threads) it
//! read 0.97-1.0 quiet, 0.52 beside 1 process spinning, 0.25-0.36 beside 4 and 0.18-0.22
//! beside 8 (fair shares 2/3, 1/3, 1/5). The share of the pool's time over the samples
//! themselves says less: a short call's serial part (a decode step's set-up on the calling
//! thread) leaves the pool idle, and on the dev machine's 2 quiet cores it read 0.36-0.51
//! for steps under 0.3 ms.
//!
//! A calibration whose CPU samples met a busy host prices the CPU too high, and that error
//! does not correct itself: `auto` measures only the plans it runs, and a CPU priced 20x
//! too high is never run (on the H100 host a calibration beside 20 spinning processes put
//! the CPU's decode at 30-102 ns a pair against 1.8-2.6 quiet, and `auto` ran the GPU
//! alone at 0.38x the CPU's speed). A CPU priced too low is tried, measured, and corrected
//! by the plan's factor. So a CPU calibration below [`BUSY_SHARE`] is measured again
//! later ([`Remeasure`]), and of each backend's costs the faster are kept: contention only
//! slows a measurement, so of two the faster is nearer the host's own speed (keeping the
//! calmer kept, on a host busy throughout, a re-measure that priced the CPU's decode at
//! 5.18 ns a pair over the calibration's 2.45: run 192). The schedule asks for two quiet
//! measurements, as one may not be enough (on the H100 host one whose probes both read 0.99,
//! run 163, fitted the CPU's fixed cost of a decode step at 342 us against 85 on quiet
//! runs, and `auto` ran a third of its dense 1k steps on the GPU). The scheduler consults
//! the schedule until it is done, whatever the kept costs' share reads.

use std::time::{Duration, Instant};

/// A CPU measurement with a share below this met a busy host.
pub(super) const BUSY_SHARE: f64 = 0.75;

/// Seconds from a busy calibration to its first re-measure; each later one waits twice as
/// long as the one before, up to [`MAX_WAIT_S`].
const FIRST_WAIT_S: f64 = 1.0;

/// The longest wait between two re-measures. A try that finds the host still busy costs its
/// probe, 30-46 ms of wall time on the H100 host beside 20 spinning processes (traces
/// 209-212), so tries every 4 s cost about 1% of a busy host's time. Waits that kept
/// doubling (8, 16, 32 s) missed the host's quiet for a whole bench cell: in trace 211 the
/// tries at 1, 3 and 7 s read busy, the one at 15 s quiet, and by then `auto` had run
/// 2440 of the cell's 3680 dense 1k steps on the GPU at 0.40x the CPU's speed.
const MAX_WAIT_S: f64 = 4.0;

/// Re-measures at most, per kind of call: thirty cover about two minutes
/// (1 + 2 + 4 + 4 + ... s).
const MAX_TRIES: u32 = 30;

/// Quiet measurements after which no more re-measures are due.
const QUIET_NEEDED: u32 = 2;

/// The calling thread's CPU seconds, where the platform gives them.
fn thread_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// CPU seconds each pool thread spins for in [`probe`]: a few scheduler slices.
/// A woken thread gets more than its fair share at first: on the dev machine beside 4
/// spinning processes a 3 ms probe read 0.57 where 10 ms read 0.25-0.36 (fair: 0.33).
const PROBE_CPU_S: f64 = 10e-3;

/// Wall seconds after which a probing thread stops, whatever it got.
const PROBE_WALL_S: f64 = 0.1;

/// The CPU share of the current pool's threads (the global pool outside any): each spins
/// until its CPU clock has advanced [`PROBE_CPU_S`] (or [`PROBE_WALL_S`] passed), and the
/// share is the sum of their CPU seconds over the sum of their wall seconds. None where the
/// platform gives no thread CPU time. Costs about [`PROBE_CPU_S`] of wall time on a quiet
/// host, on every pool thread.
pub(super) fn probe() -> Option<f64> {
    #[cfg(test)]
    if ASSUME_QUIET.with(|q| q.get()) {
        return Some(1.0);
    }
    let each = rayon::broadcast(|_| {
        let (c0, w0) = (thread_cpu_seconds()?, Instant::now());
        loop {
            for _ in 0..256 {
                std::hint::spin_loop();
            }
            let (cpu, wall) = (thread_cpu_seconds()? - c0, w0.elapsed().as_secs_f64());
            if cpu >= PROBE_CPU_S || wall >= PROBE_WALL_S {
                return Some((cpu, wall));
            }
        }
    });
    let (cpu, wall) = each
        .into_iter()
        .try_fold((0.0, 0.0), |(c, w), x| x.map(|(xc, xw)| (c + xc, w + xw)))?;
    (wall > 0.0).then(|| (cpu / wall).min(1.0))
}

#[cfg(test)]
thread_local! {
    /// Set by a test of the scheduler on its thread: [`probe`] reads 1 there, whatever the
    /// other tests running beside it do to the cores (the probe itself is tested below).
    pub(super) static ASSUME_QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The calmer of two shares (the larger; a share measured beats none).
pub(super) fn calmer(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        _ => a.or(b),
    }
}

/// Whether a calibration whose CPU share was `share` should be measured again.
pub(super) fn busy(share: Option<f64>) -> bool {
    share.is_some_and(|s| s < BUSY_SHARE)
}

/// The re-measure schedule of one kind of call (prefill or decode): due [`FIRST_WAIT_S`]
/// after a busy calibration, then at doubling waits up to [`MAX_WAIT_S`], at most
/// [`MAX_TRIES`] times, and no more once [`QUIET_NEEDED`] re-measures were quiet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Remeasure {
    /// When the next re-measure is due (None: none is).
    due: Option<Instant>,
    tries: u32,
    quiet: u32,
}

impl Remeasure {
    /// The schedule after a calibration whose CPU share was `share`, made at `now`.
    pub(super) fn after(share: Option<f64>, now: Instant) -> Remeasure {
        Remeasure {
            due: busy(share).then(|| now + Duration::from_secs_f64(FIRST_WAIT_S)),
            tries: 0,
            quiet: 0,
        }
    }

    /// Whether a re-measure is still to come (due now or later).
    pub(super) fn pending(&self) -> bool {
        self.due.is_some()
    }

    pub(super) fn is_due(&self, now: Instant) -> bool {
        self.due.is_some_and(|d| now >= d)
    }

    /// A re-measure ran at `now` and read the CPU share `share` (None: it failed, or the
    /// platform gives no share; counted as busy).
    pub(super) fn tried(&mut self, share: Option<f64>, now: Instant) {
        self.tries += 1;
        if share.is_some() && !busy(share) {
            self.quiet += 1;
        }
        let wait = (FIRST_WAIT_S * 2f64.powi(self.tries.min(16) as i32)).min(MAX_WAIT_S);
        self.due = (self.quiet < QUIET_NEEDED && self.tries < MAX_TRIES)
            .then(|| now + Duration::from_secs_f64(wait));
    }

    pub(super) fn tries(&self) -> u32 {
        self.tries
    }

    /// Re-measures so far that read quiet.
    pub(super) fn quiet(&self) -> u32 {
        self.quiet
    }

    /// This schedule with its next re-measure due at `t` (tests step the clock with it).
    #[cfg(test)]
    pub(super) fn due_at(self, t: Instant) -> Remeasure {
        Remeasure {
            due: self.due.map(|_| t),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_calibration_is_never_measured_again() {
        let now = Instant::now();
        let r = Remeasure::after(Some(0.95), now);
        assert!(!r.is_due(now + Duration::from_secs(1000)));
        assert!(!r.pending());
        assert!(!Remeasure::after(None, now).is_due(now + Duration::from_secs(1000)));
    }

    #[test]
    fn busy_calibrations_are_measured_again_at_doubling_waits_until_quiet() {
        let t0 = Instant::now();
        let mut r = Remeasure::after(Some(0.3), t0);
        assert!(!r.is_due(t0 + Duration::from_millis(999)));
        let mut now = t0 + Duration::from_secs(1);
        let mut waits = Vec::new();
        while r.is_due(now) {
            r.tried(Some(0.4), now);
            let mut w = 0;
            while !r.is_due(now) && w < 1000 {
                now += Duration::from_secs(1);
                w += 1;
            }
            waits.push(w);
        }
        assert_eq!(r.tries(), MAX_TRIES);
        let mut expected = vec![2, 4];
        expected.resize(MAX_TRIES as usize - 1, 4);
        expected.push(1000);
        assert_eq!(waits, expected);
        // Two quiet re-measures end it.
        let mut r = Remeasure::after(Some(0.3), t0);
        r.tried(Some(0.9), t0 + Duration::from_secs(1));
        assert!(
            r.is_due(t0 + Duration::from_secs(3)),
            "one quiet: once more"
        );
        r.tried(Some(0.3), t0 + Duration::from_secs(3));
        r.tried(Some(0.95), t0 + Duration::from_secs(7));
        assert!(!r.is_due(t0 + Duration::from_secs(1000)), "two quiet: done");
        assert!(!r.pending());
        // A failed re-measure (no share) counts as busy.
        let mut r = Remeasure::after(Some(0.3), t0);
        r.tried(None, t0 + Duration::from_secs(1));
        r.tried(None, t0 + Duration::from_secs(3));
        assert!(r.is_due(t0 + Duration::from_secs(7)));
    }

    proptest::proptest! {
        /// Whatever the shares read, a schedule is due at most [`MAX_TRIES`] times, each
        /// wait twice the one before or [`MAX_WAIT_S`], and never again after
        /// [`QUIET_NEEDED`] quiet reads.
        #[test]
        fn a_schedule_is_bounded_and_stops_once_quiet(
            first in proptest::option::of(0.0f64..1.0),
            reads in proptest::collection::vec(proptest::option::of(0.0f64..1.0), 0..40),
        ) {
            let t0 = Instant::now();
            let mut r = Remeasure::after(first, t0);
            proptest::prop_assert_eq!(r.due.is_some(), busy(first));
            let (mut now, mut quiet, mut last_wait) = (t0, 0, 0.0f64);
            for &x in &reads {
                let Some(due) = r.due else { break };
                let wait = due.duration_since(now).as_secs_f64();
                proptest::prop_assert!(
                    (wait - (2.0 * last_wait).min(MAX_WAIT_S)).abs() < 1e-6 || last_wait == 0.0
                );
                proptest::prop_assert!(wait <= MAX_WAIT_S + 1e-6);
                last_wait = wait;
                now = due;
                r.tried(x, now);
                if x.is_some() && !busy(x) {
                    quiet += 1;
                }
                proptest::prop_assert!(r.tries() <= MAX_TRIES);
                if quiet >= QUIET_NEEDED || r.tries() == MAX_TRIES {
                    proptest::prop_assert!(r.due.is_none());
                }
            }
        }
    }

    #[test]
    fn the_calmer_share_is_the_larger() {
        assert_eq!(calmer(Some(0.3), Some(0.9)), Some(0.9));
        assert_eq!(calmer(Some(0.9), Some(0.3)), Some(0.9));
        assert_eq!(calmer(None, Some(0.3)), Some(0.3));
        assert_eq!(calmer(Some(0.3), None), Some(0.3));
        assert_eq!(calmer(None, None), None);
    }

    /// The share reads what the pool got: near 1 alone on the cores, and far lower with
    /// four spinning threads per core beside it (a fair share of 1/5).
    #[cfg(unix)]
    #[test]
    fn the_share_falls_when_other_threads_take_the_cores() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let stop = AtomicBool::new(false);
        let busy = std::thread::scope(|s| {
            for _ in 0..4 * cores {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(20));
            let b = probe().expect("unix gives thread CPU time");
            stop.store(true, Ordering::Relaxed);
            b
        });
        // The best of three: other tests may run beside this one.
        let quiet = (0..3).filter_map(|_| probe()).fold(0.0f64, f64::max);
        assert!(busy < BUSY_SHARE, "busy share {busy}");
        assert!(
            quiet > busy && quiet <= 1.0,
            "quiet share {quiet}, busy {busy}"
        );
    }
}
