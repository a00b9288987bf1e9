//! The data server's gate: one thread accepts every connection and runs every handshake, over
//! non-blocking sockets and `poll`, so a connection that has not authenticated costs a descriptor
//! and a small buffer, never a thread.
//!
//! Why this shape: the port is reachable by anyone who can route to it, and an unauthenticated
//! socket must not be able to take anything an authenticated peer needs. So:
//!
//! - a handshake must complete within
//!   [`handshake_timeout`](super::DataServerConfig::handshake_timeout) of the accept;
//! - connections still in the handshake are capped in total
//!   ([`max_handshakes`](super::DataServerConfig::max_handshakes)) and per source address
//!   ([`max_handshakes_per_peer`](super::DataServerConfig::max_handshakes_per_peer)), apart from
//!   the authenticated ones. At a cap the *oldest* pending handshake (of that address, for the
//!   per-address cap) is closed to make room, not the newcomer: a real client sends its hello the
//!   moment it connects, so it finishes long before a flood can push it out, while a flood only
//!   ever displaces its own sockets. A newcomer whose hello has already arrived never displaces
//!   anyone;
//! - an authenticated connection takes a place among
//!   [`max_connections`](super::DataServerConfig::max_connections) (and
//!   [`max_connections_per_peer`](super::DataServerConfig::max_connections_per_peer) per address);
//!   at a cap the connection idle longest is closed to make room (see
//!   [`Conns::admit`](super::conns::Conns::admit)), and only when every one is in the middle of a
//!   request is the newcomer answered `BUSY`;
//! - out of file descriptors (`EMFILE`), the oldest pending handshake gives its descriptor back
//!   (else the connection idle longest), so a flood cannot keep a real peer out by exhausting
//!   them either. Every descriptor an authenticated connection needs is made here, for that
//!   reason. (A node should still run with a generous limit:
//!   [`raise_open_file_limit`](crate::raise_open_file_limit).)
//!
//! Every refusal is counted in the server's metrics and logged through the server's
//! [`WarnLimiter`](crate::warn::WarnLimiter).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

use super::io::{configure, tokens_equal};
use super::protocol::{self, HELLO_LEN, Hello, HelloStatus};
use super::server::{Shared, bump, serve};
use crate::warn::warn_limited;

/// Connections accepted per wake-up before pending handshakes are read again.
const ACCEPT_BURST: usize = 64;
/// The longest the gate sleeps (it flushes suppressed warnings and notices a stop as it wakes).
const MAX_WAIT: Duration = Duration::from_secs(1);
/// Back-off after an accept error that is not about descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// A connection in the handshake.
#[derive(Debug)]
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    /// The hello so far; its length is what is wanted (the fixed part, then the token too).
    buf: Vec<u8>,
    filled: usize,
    hello: Option<Hello>,
}

/// What reading a pending handshake came to.
enum Step {
    /// Needs more bytes.
    Keep,
    /// The whole hello is here.
    Complete,
    /// The peer closed it or the socket failed: dropped without an answer (not worth a warning).
    Gone(Option<io::Error>),
    /// Not the protocol: dropped without an answer.
    Malformed(protocol::FrameError),
}

/// The source a per-peer limit counts: the IPv4 address (an IPv4-mapped IPv6 one counts as its
/// IPv4 address), or the IPv6 /64 prefix (one host usually holds a whole /64).
fn peer_ip(peer: &SocketAddr) -> IpAddr {
    match peer.ip().to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
        v4 => v4,
    }
}

struct Gate<'a> {
    shared: &'a Arc<Shared>,
    /// Oldest first (all share one timeout, so deadlines are in order too).
    pending: VecDeque<Pending>,
}

/// Runs the gate until the server stops.
pub(super) fn run(shared: &Arc<Shared>, listener: &TcpListener) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "tcp data server: cannot make the listener non-blocking; not accepting");
        return;
    }
    let mut gate = Gate { shared, pending: VecDeque::new() };
    while !shared.stop.load(Ordering::SeqCst) {
        shared.warns.flush_to_log("tcp data server");
        gate.expire(Instant::now());
        gate.publish();
        let Some((listener_ready, ready)) = gate.wait(listener) else { continue };
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        gate.advance_ready(&ready);
        if listener_ready {
            gate.accept_burst(listener);
        }
    }
}

impl Gate<'_> {
    fn publish(&self) {
        self.shared.handshaking.store(self.pending.len(), Ordering::SeqCst);
    }

    /// Closes handshakes past their deadline.
    fn expire(&mut self, now: Instant) {
        while self.pending.front().is_some_and(|p| p.deadline <= now) {
            if let Some(p) = self.pending.pop_front() {
                bump(&self.shared.metrics.handshake_timeouts);
                warn_limited!(self.shared.warns, "handshake_timeout", peer = %p.peer,
                    "tcp data server: no complete handshake in time; closing the connection");
            }
        }
    }

    /// Sleeps until the listener or a pending socket is readable, the next deadline, or
    /// [`MAX_WAIT`]; returns which are readable (`None`: nothing to do, or the poll failed).
    fn wait(&self, listener: &TcpListener) -> Option<(bool, Vec<bool>)> {
        let now = Instant::now();
        let wait = self
            .pending
            .front()
            .map_or(MAX_WAIT, |p| p.deadline.saturating_duration_since(now))
            .min(MAX_WAIT)
            .min(self.shared.config.warn_interval.max(Duration::from_millis(10)))
            .max(Duration::from_millis(1));
        let timeout = Timespec::try_from(wait).ok()?;
        let mut fds = Vec::with_capacity(1 + self.pending.len());
        fds.push(PollFd::new(listener, PollFlags::IN));
        for p in &self.pending {
            fds.push(PollFd::new(&p.stream, PollFlags::IN));
        }
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return None,
            Err(e) => {
                warn_limited!(self.shared.warns, "poll_failed", error = %e, "tcp data server: poll failed");
                std::thread::sleep(ACCEPT_BACKOFF);
                return None;
            }
        }
        let listener_ready = !fds[0].revents().is_empty();
        let ready = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
        Some((listener_ready, ready))
    }

    /// Reads every pending handshake `poll` found readable (`ready[i]` for `pending[i]`).
    fn advance_ready(&mut self, ready: &[bool]) {
        let old = std::mem::take(&mut self.pending);
        for (i, mut p) in old.into_iter().enumerate() {
            if !ready.get(i).copied().unwrap_or(false) {
                self.pending.push_back(p);
                continue;
            }
            match advance(&mut p) {
                Step::Keep => self.pending.push_back(p),
                step => self.conclude(p, step),
            }
        }
    }

    fn accept_burst(&mut self, listener: &TcpListener) {
        for _ in 0..ACCEPT_BURST {
            match listener.accept() {
                Ok((stream, peer)) => {
                    if self.shared.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    self.admit(stream, peer);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if out_of_descriptors(&e) => {
                    // Out of descriptors: a pending handshake gives its one back, so a real peer
                    // still gets in; with none pending, the connection idle longest does.
                    warn_limited!(self.shared.warns, "accept_no_descriptors", error = %e,
                        "tcp data server: out of file descriptors; closing the oldest pending handshake or the connection idle longest (raise RLIMIT_NOFILE)");
                    if !self.evict_pending(None) {
                        // An evicted connection's thread gives its descriptors back as it ends:
                        // give it a moment before accepting again.
                        self.shared.conns.lock().evict_idlest(self.shared, None, "out of file descriptors");
                        std::thread::sleep(ACCEPT_BACKOFF);
                        return;
                    }
                }
                Err(e) => {
                    warn_limited!(self.shared.warns, "accept_failed", error = %e, "tcp data server: accept failed");
                    std::thread::sleep(ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Takes a newly accepted connection into the handshake (its hello is usually here already).
    fn admit(&mut self, stream: TcpStream, peer: SocketAddr) {
        bump(&self.shared.metrics.accepted);
        if let Err(e) = stream.set_nonblocking(true) {
            warn_limited!(self.shared.warns, "socket_setup", %peer, error = %e,
                "tcp data server: cannot configure an accepted socket; closing");
            return;
        }
        let mut p = Pending {
            stream,
            peer,
            deadline: Instant::now() + self.shared.config.handshake_timeout,
            buf: vec![0u8; HELLO_LEN],
            filled: 0,
            hello: None,
        };
        match advance(&mut p) {
            Step::Keep => {}
            step => return self.conclude(p, step),
        }
        // It has to wait: make room for it if a cap is reached (the oldest pending goes).
        let config = &self.shared.config;
        let ip = peer_ip(&peer);
        let of_peer = self.pending.iter().filter(|q| peer_ip(&q.peer) == ip).count();
        if of_peer >= config.max_handshakes_per_peer.max(1) {
            self.evict_pending(Some(ip));
        } else if self.pending.len() >= config.max_handshakes.max(1) {
            self.evict_pending(None);
        }
        self.pending.push_back(p);
    }

    /// Closes the oldest pending handshake (of `ip`, if given); false when there is none.
    fn evict_pending(&mut self, ip: Option<IpAddr>) -> bool {
        let at = match ip {
            Some(ip) => self.pending.iter().position(|q| peer_ip(&q.peer) == ip),
            None => (!self.pending.is_empty()).then_some(0),
        };
        let Some(victim) = at.and_then(|i| self.pending.remove(i)) else { return false };
        bump(&self.shared.metrics.refused_handshake_limit);
        let (limit, scope) = match ip {
            Some(_) => (self.shared.config.max_handshakes_per_peer, "per peer"),
            None => (self.shared.config.max_handshakes, "in total"),
        };
        warn_limited!(self.shared.warns, "handshake_limit", peer = %victim.peer, limit, scope,
            "tcp data server: too many connections in the handshake; closed the oldest");
        true
    }

    /// Ends a handshake that is no longer pending.
    fn conclude(&mut self, p: Pending, step: Step) {
        match step {
            Step::Keep => self.pending.push_back(p),
            Step::Complete => self.answer(p),
            Step::Gone(error) => {
                let error = error.map(|e| e.to_string());
                tracing::debug!(peer = %p.peer, ?error, "tcp data server: connection closed in the handshake");
            }
            Step::Malformed(reason) => {
                bump(&self.shared.metrics.refused_malformed);
                warn_limited!(self.shared.warns, "malformed_hello", peer = %p.peer, %reason,
                    "tcp data server: malformed hello; closing the connection");
            }
        }
    }

    /// Checks a complete hello, answers it, and hands an accepted connection to a thread of its own.
    fn answer(&mut self, p: Pending) {
        let shared = self.shared;
        let Some(hello) = p.hello else { return };
        let token = p.buf.get(HELLO_LEN..).unwrap_or_default();
        let status = if hello.version != protocol::VERSION {
            bump(&shared.metrics.refused_version);
            HelloStatus::BadVersion
        } else if shared.config.cluster_token.as_ref().is_some_and(|t| !tokens_equal(t.as_bytes(), token)) {
            bump(&shared.metrics.refused_unauthorized);
            HelloStatus::Unauthorized
        } else {
            HelloStatus::Ok
        };
        let peer = p.peer;
        if status != HelloStatus::Ok {
            // The answer fits an empty socket buffer; if even that fails the peer learns nothing more.
            let _ = (&p.stream).write(&protocol::encode_hello_reply(status));
            if status == HelloStatus::Unauthorized {
                warn_limited!(shared.warns, "unauthorized", %peer,
                    "tcp data server: wrong cluster token; closing the connection");
            } else {
                warn_limited!(shared.warns, "bad_version", %peer, version = hello.version,
                    supported = protocol::VERSION, "tcp data server: foreign protocol version; closing the connection");
            }
            return;
        }
        let Pending { stream, .. } = p;
        // Both handles the connection needs are made here, where running out of descriptors can
        // be answered by closing a pending handshake.
        let handles = self.clone_socket(&stream).and_then(|c| Ok((c, self.clone_socket(&stream)?)));
        let (control, write_half) = match handles {
            Ok(handles) => handles,
            Err(e) => {
                warn_limited!(shared.warns, "socket_setup", %peer, error = %e,
                    "tcp data server: cannot clone an authenticated socket; closing");
                return;
            }
        };
        // Answers are written while the socket is still non-blocking: 8 bytes always fit a fresh
        // connection's send buffer, and the gate never waits on a peer.
        let admitted = shared.conns.lock().admit(shared, peer_ip(&peer), control);
        let Some((id, activity)) = admitted else {
            bump(&shared.metrics.refused_limit);
            let _ = (&stream).write(&protocol::encode_hello_reply(HelloStatus::Busy));
            warn_limited!(shared.warns, "busy", %peer, limit = shared.config.max_connections,
                per_peer = shared.config.max_connections_per_peer,
                "tcp data server: every connection is in the middle of a request; answered busy");
            return;
        };
        let answered = (&stream).write(&protocol::encode_hello_reply(HelloStatus::Ok));
        if !matches!(answered, Ok(n) if n == protocol::HELLO_REPLY_LEN) {
            tracing::debug!(%peer, "tcp data server: could not answer a hello; closing");
            shared.conns.lock().remove(id);
            return;
        }
        if let Err(e) = stream.set_nonblocking(false).and_then(|()| configure(&stream, shared.config.io_timeout)) {
            warn_limited!(shared.warns, "socket_setup", %peer, error = %e,
                "tcp data server: cannot configure an authenticated socket; closing");
            shared.conns.lock().remove(id);
            return;
        }
        let spawned = {
            let shared = Arc::clone(shared);
            std::thread::Builder::new().name("umbp-tcp-serve".into()).spawn(move || {
                serve(&shared, stream, write_half, peer, &activity);
                shared.conns.lock().remove(id);
            })
        };
        match spawned {
            Ok(t) => shared.conns.lock().set_thread(id, t),
            Err(e) => {
                warn_limited!(shared.warns, "spawn_failed", %peer, error = %e,
                    "tcp data server: cannot spawn a connection thread; closing");
                shared.conns.lock().remove(id);
            }
        }
    }
}

impl Gate<'_> {
    /// `stream.try_clone()`; out of descriptors, the oldest pending handshakes give theirs back.
    fn clone_socket(&mut self, stream: &TcpStream) -> io::Result<TcpStream> {
        let mut tries = 0;
        loop {
            match stream.try_clone() {
                Err(e) if out_of_descriptors(&e) && tries < 4 && self.evict_pending(None) => tries += 1,
                cloned => return cloned,
            }
        }
    }
}

/// Whether `e` says this process or the system is out of file descriptors.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(code) if code == libc_emfile() || code == libc_enfile())
}

/// Reads what has arrived of `p`'s hello without blocking.
fn advance(p: &mut Pending) -> Step {
    loop {
        if p.filled < p.buf.len() {
            let Some(spare) = p.buf.get_mut(p.filled..) else { return Step::Gone(None) };
            match (&p.stream).read(spare) {
                Ok(0) => return Step::Gone(None),
                Ok(n) => p.filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Step::Gone(Some(e)),
            }
            continue;
        }
        if p.hello.is_some() {
            return Step::Complete;
        }
        let Ok(head) = <[u8; HELLO_LEN]>::try_from(&p.buf[..HELLO_LEN]) else { return Step::Gone(None) };
        match protocol::decode_hello(&head) {
            Ok(hello) => {
                p.hello = Some(hello);
                p.buf.resize(HELLO_LEN + hello.token_len, 0);
            }
            Err(e) => return Step::Malformed(e),
        }
    }
}

/// `EMFILE`: this process is out of file descriptors.
const fn libc_emfile() -> i32 {
    rustix::io::Errno::MFILE.raw_os_error()
}

/// `ENFILE`: the system is out of file descriptors.
const fn libc_enfile() -> i32 {
    rustix::io::Errno::NFILE.raw_os_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_peer_limits_count_ipv4_hosts_and_ipv6_prefixes() {
        let at = |s: &str| peer_ip(&s.parse::<SocketAddr>().expect("address"));
        assert_eq!(at("10.0.0.1:1"), at("10.0.0.1:2"));
        assert_ne!(at("10.0.0.1:1"), at("10.0.0.2:1"));
        assert_eq!(at("[::ffff:10.0.0.1]:1"), at("10.0.0.1:9"), "an IPv4-mapped source is its IPv4 host");
        assert_eq!(at("[2001:db8:1:2::1]:1"), at("[2001:db8:1:2:ffff::9]:1"), "one /64");
        assert_ne!(at("[2001:db8:1:2::1]:1"), at("[2001:db8:1:3::1]:1"));
    }
}
