//! Running a client command of the `umbp` binary to completion: its exit status, stdout and stderr,
//! bounded by [`CLI_TIMEOUT`]. Shared by the process tests that drive client commands.

use std::io::{Read, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::cli_support::command;

/// The longest a client command may run in a test.
pub(crate) const CLI_TIMEOUT: Duration = Duration::from_secs(30);

/// What a client command did.
pub(crate) struct Out {
    pub(crate) code: i32,
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: String,
}

impl Out {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Runs a client command to completion (bounded), feeding `stdin`.
pub(crate) fn cli(args: &[&str], stdin: Option<&[u8]>) -> Out {
    cli_with(args, stdin, &[])
}

/// [`cli`] with extra environment variables.
pub(crate) fn cli_with(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Out {
    let mut cmd = command(args, env);
    cmd.env("RUST_LOG", "warn")
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn umbp");
    if let Some(data) = stdin {
        let mut pipe = child.stdin.take().expect("stdin");
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + CLI_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`umbp {}` ran past {CLI_TIMEOUT:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Out {
        code: status.code().unwrap_or(-1),
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}
