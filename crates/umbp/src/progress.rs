//! Progress of the long-running commands (`umbp demo`, `umbp bench`) on stderr. Their report goes
//! to stdout, so a pipe or a file still receives the report alone.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often a terminal line is redrawn.
const REDRAW: Duration = Duration::from_millis(100);

/// One phase of `total` steps: redrawn in place on a terminal, one line when it ends elsewhere (a log
/// file gets one line per phase, not a line per step).
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
        let mut p = Self {
            label: label.into(),
            total,
            done: 0,
            tty: std::io::stderr().is_terminal(),
            started: Instant::now(),
            drawn: None,
        };
        p.draw(false);
        p
    }

    /// `n` more steps done.
    pub(crate) fn advance(&mut self, n: usize) {
        self.done = self.done.saturating_add(n).min(self.total);
        if self.drawn.is_none_or(|at| at.elapsed() >= REDRAW) {
            self.draw(false);
        }
    }

    /// Ends the phase with its elapsed time.
    pub(crate) fn finish(mut self) {
        self.draw(true);
    }

    fn draw(&mut self, last: bool) {
        if !self.tty && !last {
            return;
        }
        let line =
            format!("{} {}/{} ({:.1} s)", self.label, self.done, self.total, self.started.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        // Progress is best effort: a closed stderr must not fail the command.
        let _ = if self.tty { write!(err, "\r\x1b[2K{line}") } else { Ok(()) };
        let _ = if last && self.tty {
            writeln!(err)
        } else if last {
            writeln!(err, "{line}")
        } else {
            Ok(())
        };
        let _ = err.flush();
        self.drawn = Some(Instant::now());
    }
}

/// One line of progress (a phase with no steps).
pub(crate) fn note(what: impl std::fmt::Display) {
    eprintln!("{what}");
}
