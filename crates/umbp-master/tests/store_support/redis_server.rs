//! A throwaway `redis-server` for the Redis subject: a free loopback port, persistence off, killed
//! on drop. A missing `redis-server` fails the test (it never skips).

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_master::store::{RedisStore, RedisTimeouts};

use super::Subject;

/// How long a server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A running `redis-server` child process.
#[derive(Debug)]
pub(crate) struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    /// Starts a server on a free 127.0.0.1 port and waits (bounded) until it accepts connections.
    ///
    /// # Panics
    /// If `redis-server` is not installed or does not come up: the Redis subject must fail, not skip.
    pub(crate) fn start() -> Arc<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|addr| addr.port())
            .expect("a free loopback port");
        Self::start_on(port)
    }

    /// [`start`](Self::start) on a given port (to bring a server back where a store expects it).
    pub(crate) fn start_on(port: u16) -> Arc<Self> {
        Self::start_binary("redis-server", port)
    }

    /// [`start_on`](Self::start_on) with the server binary named (to test the message when it is
    /// missing).
    pub(crate) fn start_binary(binary: &str, port: u16) -> Arc<Self> {
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot start redis-server ({err}): the Redis store tests need it; install Debian's \
                     redis-server (`apt-get install redis-server`)"
                )
            });
        let server = Self { child, port };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server on port {port} did not start in {START_TIMEOUT:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        Arc::new(server)
    }

    /// `redis://127.0.0.1:PORT/DB`.
    pub(crate) fn url(&self, db: u8) -> String {
        format!("redis://127.0.0.1:{}/{db}", self.port)
    }

    /// The port.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) the server: a Redis that accepts connections and
    /// answers nothing.
    pub(crate) fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal}");
    }

    /// A store on this server (database 0) under `prefix`.
    pub(crate) fn store(&self, prefix: &str) -> RedisStore {
        RedisStore::connect_with(&self.url(0), prefix, RedisTimeouts::default()).expect("connect to the test redis")
    }

    /// [`store`](Self::store) as a contract-suite subject that keeps the server running.
    pub(crate) fn subject(self: Arc<Self>, prefix: &str) -> Subject {
        Subject::Redis(Box::new(self.store(prefix)), self)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
