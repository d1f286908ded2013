//! Progress bars (indicatif) on stderr for work that takes more than a couple of seconds.
//! They are drawn only when stderr is a terminal, and never with `quiet` (the `--quiet` and
//! `--json` flags), so pipes, logs and JSON output stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// Redraws per second.
const HZ: u8 = 4;

fn target(quiet: bool) -> ProgressDrawTarget {
    if quiet || !std::io::stderr().is_terminal() {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr_with_hz(HZ)
    }
}

/// The bar's template: elapsed time, bar, done/total `unit`, time left, message.
fn bar_template(unit: &str) -> String {
    format!(
        "{{elapsed_precise}} [{{bar:30}}] {{human_pos}}/{{human_len}} {unit}, {{eta}} left {{msg}}"
    )
}

const SPINNER_TEMPLATE: &str = "{spinner} {msg} ({elapsed})";

/// A bar over `len` units named `unit` (e.g. "cells", "tokens"), with the elapsed time and
/// the time left; the message (`set_message`) names the current step.
pub fn bar(len: u64, unit: &str, quiet: bool) -> ProgressBar {
    let style = ProgressStyle::with_template(&bar_template(unit))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let b = ProgressBar::with_draw_target(Some(len), target(quiet)).with_style(style);
    b.enable_steady_tick(Duration::from_millis(1000 / u64::from(HZ)));
    b
}

/// A spinner with `message` and the elapsed seconds, for work of unknown length.
pub fn spinner(message: String, quiet: bool) -> ProgressBar {
    let style = ProgressStyle::with_template(SPINNER_TEMPLATE)
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let s = ProgressBar::with_draw_target(None, target(quiet))
        .with_style(style)
        .with_message(message);
    s.enable_steady_tick(Duration::from_millis(100));
    s
}

#[cfg(test)]
mod tests {
    /// The templates parse (a bad template would silently fall back to the default style).
    #[test]
    fn templates_parse() {
        use indicatif::ProgressStyle;
        let t = super::bar_template("cells");
        assert!(ProgressStyle::with_template(&t).is_ok(), "{t}");
        assert!(ProgressStyle::with_template(super::SPINNER_TEMPLATE).is_ok());
    }

    #[test]
    fn quiet_bars_are_hidden() {
        assert!(super::bar(3, "cells", true).is_hidden());
        assert!(super::spinner("x".into(), true).is_hidden());
    }
}
