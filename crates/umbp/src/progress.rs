//! Progress of the long-running commands (`umbp demo`, `umbp bench`) on stderr. Their report goes
//! to stdout, so a pipe or a file still receives the report alone.
//!
//! Why not `indicatif`: its draw targets hide the bar entirely when stderr is not a terminal
//! (`ProgressDrawTarget::term`: "if the terminal is not user attended the entire progress bar will
//! be hidden"), so a bench run into a log file would show nothing for minutes; what we need there is
//! a plain line every 10 s, which is most of this file. On a terminal a one-line counter needs none
//! of its templates, and it would bring `console` and its own terminal probing into the CLI.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often a terminal line is redrawn.
const REDRAW: Duration = Duration::from_millis(100);
/// How often a line is written while a phase runs when stderr is not a terminal (a log file).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// One phase of `total` steps: redrawn in place on a terminal; elsewhere (a log file) one line about
/// every 10 s while it runs and one when it ends, not a line per step.
pub(crate) struct Progress {
    label: String,
    total: usize,
    done: usize,
    tty: bool,
    started: Instant,
    drawn: Option<Instant>,
}

impl Progress {
    /// Starts the phase `label` (`"umbp demo: put"`).
    pub(crate) fn new(label: impl Into<String>, total: usize) -> Self {
        let mut p = Self::with_terminal(label, total, std::io::stderr().is_terminal());
        p.draw(false);
        p
    }

    fn with_terminal(label: impl Into<String>, total: usize, tty: bool) -> Self {
        Self { label: label.into(), total, done: 0, tty, started: Instant::now(), drawn: None }
    }

    /// `n` more steps done.
    pub(crate) fn advance(&mut self, n: usize) {
        self.done = self.done.saturating_add(n).min(self.total);
        if self.due() {
            self.draw(false);
        }
    }

    /// Ends the phase with its elapsed time.
    pub(crate) fn finish(mut self) {
        self.draw(true);
    }

    /// Whether a step should draw now: every [`REDRAW`] on a terminal, every [`LOG_EVERY`] (from
    /// the start or the latest line) elsewhere.
    fn due(&self) -> bool {
        if self.tty {
            self.drawn.is_none_or(|at| at.elapsed() >= REDRAW)
        } else {
            self.drawn.unwrap_or(self.started).elapsed() >= LOG_EVERY
        }
    }

    /// What a draw writes: the line redrawn in place on a terminal (with a newline when it is the
    /// last), a plain line elsewhere; off a terminal, nothing before a line is due (the start of a
    /// phase).
    fn text(&self, last: bool) -> Option<String> {
        if !self.tty && !last && !self.due() {
            return None;
        }
        let line =
            format!("{} {}/{} ({:.1} s)", self.label, self.done, self.total, self.started.elapsed().as_secs_f64());
        Some(match (self.tty, last) {
            (true, false) => format!("\r\x1b[2K{line}"),
            (true, true) => format!("\r\x1b[2K{line}\n"),
            (false, _) => format!("{line}\n"),
        })
    }

    fn draw(&mut self, last: bool) {
        let Some(text) = self.text(last) else { return };
        let mut err = std::io::stderr().lock();
        // Progress is best effort: a closed stderr must not fail the command.
        let _ = err.write_all(text.as_bytes());
        let _ = err.flush();
        self.drawn = Some(Instant::now());
    }
}

/// One line of progress (a phase with no steps).
pub(crate) fn note(what: impl std::fmt::Display) {
    eprintln!("{what}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off a terminal, a running phase writes a line once [`LOG_EVERY`] has passed, not only when
    /// it ends; not at its start and not for every step.
    #[test]
    fn a_log_file_gets_a_line_about_every_ten_seconds() {
        let mut p = Progress::with_terminal("umbp bench: put", 100, false);
        p.done = 40;
        assert!(!p.due(), "a line right after the start");
        assert_eq!(p.text(false), None);
        p.started = Instant::now() - LOG_EVERY - Duration::from_millis(1);
        assert!(p.due());
        let line = p.text(false).expect("a progress line after 10 s");
        assert!(line.starts_with("umbp bench: put 40/100 (10.") && line.ends_with("s)\n"), "{line:?}");
        // After a line, the next is due LOG_EVERY later.
        p.drawn = Some(Instant::now());
        assert!(!p.due());
        assert!(p.text(true).is_some_and(|l| !l.contains('\r')));
    }
}
