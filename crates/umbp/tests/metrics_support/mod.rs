//! `GET /metrics` of a running `umbp` process, as curl sends it, for the process tests that read a
//! node's or master's Prometheus endpoint.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The whole HTTP reply (status line, headers and body) of `GET /metrics` at `addr`; panics unless
/// it is a `200`.
pub(crate) fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: curl/8\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("read");
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    reply
}
