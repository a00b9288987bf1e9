//! Socket helpers shared by the server and the client.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::protocol::{self, HELLO_REPLY_LEN, HelloStatus};
use crate::engine::FailureKind;

/// Writes every byte of `bufs` (a gather write: headers and region memory in one system call).
pub(crate) fn write_all_vectored(stream: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why [`dial`] could not open an authenticated connection.
#[derive(Debug)]
pub(crate) struct DialFailure {
    pub(crate) kind: FailureKind,
    /// What failed, naming the endpoint.
    pub(crate) message: String,
    /// The connection was made but lost during the handshake (the server dropped it, e.g. at its
    /// pending-handshake cap): worth another try.
    pub(crate) dropped: bool,
}

/// Connects to `endpoint` (within `connect_timeout`), applies the data plane's socket settings with
/// `io_timeout`, sends `hello` and checks the server's answer (all within one `io_timeout`): the one
/// handshake of the engine's pooled connections and of keyed requests.
pub(crate) fn dial(
    endpoint: &str,
    connect_timeout: Duration,
    io_timeout: Duration,
    hello: &[u8],
) -> Result<TcpStream, DialFailure> {
    let failed = |kind: FailureKind, message: String| DialFailure { kind, message, dropped: false };
    let addrs = endpoint
        .to_socket_addrs()
        .map_err(|e| failed(FailureKind::ConnectionLost, format!("cannot resolve {endpoint}: {e}")))?;
    let mut last = None;
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, connect_timeout.max(Duration::from_millis(1))) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = stream.ok_or_else(|| {
        let e = last.map_or_else(|| "no address".to_owned(), |e| e.to_string());
        failed(FailureKind::ConnectionLost, format!("cannot connect to {endpoint}: {e}"))
    })?;
    // Past the connect, a lost connection is the server dropping the handshake.
    let io_err = |what: &str, e: io::Error| {
        let kind = failure_kind(&e);
        DialFailure { dropped: kind == FailureKind::ConnectionLost, ..failed(kind, format!("{what} {endpoint}: {e}")) }
    };
    configure(&stream, io_timeout).map_err(|e| io_err("configuring the socket to", e))?;
    // The whole handshake within one IO timeout, however the peer paces its answer.
    let deadline = Instant::now() + io_timeout;
    stream.write_all(hello).map_err(|e| io_err("sending the hello to", e))?;
    let mut answer = [0u8; HELLO_REPLY_LEN];
    read_exact_until(&mut stream, &mut answer, deadline, &mut SocketClock::new(io_timeout))
        .map_err(|e| io_err("reading the hello answer of", e))?;
    match protocol::decode_hello_reply(&answer) {
        Ok(HelloStatus::Ok) => Ok(stream),
        Ok(HelloStatus::Unauthorized) => {
            Err(failed(FailureKind::Unauthorized, format!("{endpoint} refused the cluster token")))
        }
        Ok(HelloStatus::Busy) => {
            Err(failed(FailureKind::Busy, format!("{endpoint} is serving its maximum of connections (busy)")))
        }
        Ok(HelloStatus::BadVersion) => Err(failed(
            FailureKind::Protocol,
            format!("{endpoint} does not speak protocol version {}", protocol::VERSION),
        )),
        Err(e) => Err(failed(FailureKind::Protocol, format!("bad hello answer from {endpoint}: {e}"))),
    }
}

/// Whether an idle connection may be reused: the peer has not closed it and sent nothing unasked
/// (a non-blocking peek would block). Only for a socket nobody is reading now.
pub(crate) fn idle_and_open(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let open = matches!(stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    open && stream.set_nonblocking(false).is_ok()
}

/// Whether `e` is a socket timeout (`SO_RCVTIMEO` / `SO_SNDTIMEO` report `WouldBlock` on Unix).
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
}

/// The failure kind of a broken socket operation.
pub(crate) fn failure_kind(e: &io::Error) -> FailureKind {
    if is_timeout(e) { FailureKind::Timeout } else { FailureKind::ConnectionLost }
}

/// A socket timeout: `None` (blocking forever) is never used; zero is raised to 1 ms because the
/// socket API rejects a zero timeout.
pub(crate) fn timeout(d: Duration) -> Option<Duration> {
    Some(d.max(Duration::from_millis(1)))
}

/// Applies the data plane's socket settings: no Nagle delay, and a timeout on every read and write.
pub(crate) fn configure(stream: &TcpStream, io_timeout: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(timeout(io_timeout))?;
    stream.set_write_timeout(timeout(io_timeout))?;
    Ok(())
}

/// How far a socket timeout may drift from the exact time left before it is set again (setting it
/// is a system call; without slack a deadline would cost one per read).
const TIMEOUT_SLACK: Duration = Duration::from_millis(5);

/// The timeout currently set on one direction of a socket, moved towards a deadline when one is
/// armed: a read or write then never blocks past the deadline, whatever pace the peer keeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SocketClock {
    /// The timeout of one socket call when no deadline is nearer.
    base: Duration,
    /// What is set on the socket now.
    set: Duration,
}

impl SocketClock {
    /// A clock for a socket configured with `base` (see [`configure`]).
    pub(crate) fn new(base: Duration) -> Self {
        let base = base.max(Duration::from_millis(1));
        Self { base, set: base }
    }

    /// Before a socket call: `Err(TimedOut)` when `deadline` has passed; otherwise the timeout to
    /// set, if it must change (`apply` sets it).
    pub(crate) fn arm(
        &mut self,
        deadline: Option<Instant>,
        apply: impl FnOnce(Option<Duration>) -> io::Result<()>,
    ) -> io::Result<()> {
        let want = match deadline {
            None => self.base,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
                }
                left.min(self.base)
            }
        };
        if want.abs_diff(self.set) > TIMEOUT_SLACK || (want < self.set && want <= TIMEOUT_SLACK) {
            apply(timeout(want))?;
            self.set = want;
        }
        Ok(())
    }
}

/// Reads exactly `buf` from `stream` before `deadline` (each read's timeout shrinks to the time
/// left), then restores the socket's read timeout to `clock`'s base.
pub(crate) fn read_exact_until(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    clock: &mut SocketClock,
) -> io::Result<()> {
    let mut filled = 0;
    let mut result = Ok(());
    while filled < buf.len() {
        if let Err(e) = clock.arm(Some(deadline), |t| stream.set_read_timeout(t)) {
            result = Err(e);
            break;
        }
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                result = Err(io::ErrorKind::UnexpectedEof.into());
                break;
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    clock.arm(None, |t| stream.set_read_timeout(t))?;
    result
}

/// Writes every byte of `bufs` before `deadline` (see [`write_all_vectored`]).
pub(crate) fn write_all_vectored_until(
    stream: &mut TcpStream,
    mut bufs: &mut [IoSlice<'_>],
    deadline: Instant,
    clock: &mut SocketClock,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        clock.arm(Some(deadline), |t| stream.set_write_timeout(t))?;
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Compares tokens without an early exit on the first differing byte.
pub(crate) fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A socket reader for frames: headers come through a small buffer (so tiny requests share system
/// calls), payloads go straight into the caller's slice.
///
/// A payload read is a vectored read into (the rest of the payload, the buffer), so bytes that
/// follow the payload land in the buffer without another system call. After a payload of at least
/// the buffer's size, only `lookahead` bytes (one header) are read ahead: the next payload then
/// again arrives straight in its destination, and the only bytes ever copied are the read-ahead of
/// small frames.
#[derive(Debug)]
pub(crate) struct FrameReader {
    stream: TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    lookahead: usize,
    /// Reads never block past this (see [`SocketClock`]).
    deadline: Option<Instant>,
    clock: SocketClock,
}

impl FrameReader {
    /// A reader of `capacity` buffered bytes that reads `lookahead` bytes past a large payload, over
    /// a socket whose read timeout is `io_timeout`.
    pub(crate) fn new(stream: TcpStream, capacity: usize, lookahead: usize, io_timeout: Duration) -> Self {
        let capacity = capacity.max(lookahead).max(1);
        Self {
            stream,
            buf: vec![0u8; capacity].into_boxed_slice(),
            start: 0,
            end: 0,
            lookahead: lookahead.max(1),
            deadline: None,
            clock: SocketClock::new(io_timeout),
        }
    }

    /// Every later read fails with `TimedOut` once `deadline` passes (`None`: only the per-read
    /// timeout applies).
    pub(crate) fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    fn arm(&mut self) -> io::Result<()> {
        let stream = &self.stream;
        self.clock.arm(self.deadline, |t| stream.set_read_timeout(t))
    }

    /// The socket.
    pub(crate) fn get_ref(&self) -> &TcpStream {
        &self.stream
    }

    /// Bytes read and not consumed yet.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads into the empty buffer once, unless something is buffered already; returns the
    /// buffered count (0 at end of stream). Errors (timeouts included) are returned as they are.
    pub(crate) fn fill(&mut self) -> io::Result<usize> {
        if self.buffered() == 0 {
            self.start = 0;
            self.end = 0;
            self.arm()?;
            let n = self.stream.read(&mut self.buf)?;
            self.end = n;
        }
        Ok(self.buffered())
    }

    /// Fills `dst` completely: buffered bytes first, then vectored reads into (`dst`, buffer).
    pub(crate) fn read_exact_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let take = self.buffered().min(dst.len());
        let (head, mut rest) = dst.split_at_mut(take);
        head.copy_from_slice(&self.buf[self.start..self.start + take]);
        self.start += take;
        if rest.is_empty() {
            return Ok(());
        }
        // The buffer is empty now.
        let ahead = if rest.len() >= self.buf.len() { self.lookahead } else { self.buf.len() };
        while !rest.is_empty() {
            let wanted = rest.len();
            self.arm()?;
            let n = {
                let (spare, _) = self.buf.split_at_mut(ahead.min(self.buf.len()));
                let mut bufs = [IoSliceMut::new(rest), IoSliceMut::new(spare)];
                match self.stream.read_vectored(&mut bufs) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
            if n < wanted {
                rest = &mut rest[n..];
            } else {
                self.start = 0;
                self.end = n - wanted;
                rest = &mut [];
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn frame_reader_reads_payloads_and_headers_in_any_split() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut tx = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (rx, _) = listener.accept().expect("accept");
        // Frames: an 8-byte header then a payload of the size the header names.
        let sizes = [0usize, 1, 7, 100, 4096, 4097, 70_000, 3, 200_000, 5];
        let writer = std::thread::spawn(move || {
            for (i, &n) in sizes.iter().enumerate() {
                tx.write_all(&(n as u64).to_le_bytes()).expect("header");
                let payload: Vec<u8> = (0..n).map(|j| (i * 31 + j) as u8).collect();
                for piece in payload.chunks(777) {
                    tx.write_all(piece).expect("payload");
                }
            }
        });
        let mut r = FrameReader::new(rx, 64, 8, Duration::from_secs(5));
        for (i, &n) in sizes.iter().enumerate() {
            let mut head = [0u8; 8];
            r.read_exact_into(&mut head).expect("header");
            assert_eq!(u64::from_le_bytes(head), n as u64);
            let mut payload = vec![0u8; n];
            r.read_exact_into(&mut payload).expect("payload");
            assert!(payload.iter().enumerate().all(|(j, &b)| b == (i * 31 + j) as u8), "frame {i}");
        }
        writer.join().expect("writer");
        assert_eq!(r.fill().expect("eof"), 0);
    }
}
