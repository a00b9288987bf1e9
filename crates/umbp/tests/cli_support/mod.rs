//! The child-process harness the `umbp` process tests share: a temporary directory, a child `umbp`
//! guarded by `Drop` (SIGKILLed, its log printed when the test panics), the ready-line parser and
//! value patterns. Every item is used by every test file that includes it.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(crate) const UMBP: &str = env!("CARGO_BIN_EXE_umbp");
pub(crate) const STARTUP: Duration = Duration::from_secs(30);

/// A temporary directory, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("umbp-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child `umbp` process, SIGKILLed on drop; its stderr goes to `log`.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Proc {
    /// Starts `umbp ARGS…` with `env` and waits for its ready line (`PREFIX … ready …`); returns the
    /// line, or why the process never became ready.
    pub(crate) fn try_start(
        dir: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        ready: &str,
    ) -> Result<(Self, String), String> {
        Self::try_spawn(dir, name, command(args, env), ready)
    }

    /// Starts `cmd` (an `umbp` command line, perhaps behind a wrapper such as `ip netns exec`) and
    /// waits for its ready line, as [`try_start`](Self::try_start).
    pub(crate) fn try_spawn(dir: &Path, name: &str, mut cmd: Command, ready: &str) -> Result<(Self, String), String> {
        let log = dir.join(format!("{name}.log"));
        cmd.stdout(Stdio::piped()).stderr(File::create(&log).expect("log file")).stdin(Stdio::null());
        let child = cmd.spawn().expect("spawn umbp");
        let mut proc = Self { name: name.to_owned(), child, log };
        let stdout = proc.child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + STARTUP;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) if line.starts_with(ready) && line.contains(" ready ") => return Ok((proc, line)),
                Ok(_) => {}
                Err(_) => {
                    if let Ok(Some(status)) = proc.child.try_wait() {
                        return Err(format!("{name} exited with {status} before it was ready:\n{}", proc.log_tail()));
                    }
                    if Instant::now() > deadline {
                        return Err(format!("{name} not ready in {STARTUP:?}:\n{}", proc.log_tail()));
                    }
                }
            }
        }
    }

    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub(crate) fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- last lines of {} ({}) ---\n{}", self.name, self.log.display(), self.log_tail());
        }
    }
}

/// `umbp ARGS…` with a clean `UMBP_*` environment plus `env`.
pub(crate) fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(UMBP);
    cmd.args(args);
    for (var, _) in std::env::vars() {
        if var.starts_with("UMBP_") {
            cmd.env_remove(var);
        }
    }
    cmd.env("RUST_LOG", "info").env("NO_COLOR", "1");
    for (var, value) in env {
        cmd.env(var, value);
    }
    cmd
}

/// The value of `name=` in a ready line.
pub(crate) fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

/// The bytes of `key`, `len` long: every key's value differs, so a mix-up is caught.
pub(crate) fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (0..len).map(|i| (seed.wrapping_add(i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8).collect()
}
