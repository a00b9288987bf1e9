//! The bytes of the shared-memory socket, and sending a message with one file descriptor.
//!
//! All integers little-endian. A stream socket, so every message has a fixed length (the hello's
//! token follows its fixed part); a descriptor rides on the first byte of its reply (`SCM_RIGHTS`).
//!
//! | message | bytes |
//! |---|---|
//! | hello (client) | `magic: u32` (`USHM`) · `version: u16` · `token_len: u16` · token |
//! | hello reply | `status: u8` · 3 zero · `slots: u32` · `server_id: u64`; with `OK`, the epoch table's file |
//! | request | `op: u8` (1: get region) · 7 zero · `region_id: u64` |
//! | region reply | `status: u8` · 3 zero · `slot: u32` · `offset: u64` · `len: u64` · `epoch: u64`; with `OK`, the region's file |
//!
//! A refused hello is answered with its status and the connection closed; so is a malformed request.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// `USHM`.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"USHM");
/// The protocol version.
pub(crate) const VERSION: u16 = 1;
/// Longest token accepted (the TCP data plane's limit).
pub(crate) const MAX_TOKEN_LEN: usize = 1024;
/// Bytes of the hello's fixed part.
pub(crate) const HELLO_LEN: usize = 8;
/// Bytes of a hello reply.
pub(crate) const HELLO_REPLY_LEN: usize = 16;
/// Bytes of a request.
pub(crate) const REQUEST_LEN: usize = 16;
/// Bytes of a region reply.
pub(crate) const REGION_REPLY_LEN: usize = 32;
/// The one request op: send me a region.
pub(crate) const OP_GET_REGION: u8 = 1;

/// A reply's status byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Done; a descriptor comes with the reply.
    Ok = 0,
    /// Wrong cluster token.
    BadToken = 1,
    /// The peer's credentials are not allowed.
    Forbidden = 2,
    /// A malformed hello or request.
    BadRequest = 3,
    /// No such region.
    UnknownRegion = 4,
}

impl Status {
    pub(crate) fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Ok,
            1 => Self::BadToken,
            2 => Self::Forbidden,
            3 => Self::BadRequest,
            4 => Self::UnknownRegion,
            _ => return None,
        })
    }
}

/// The hello's fixed part, then the token.
pub(crate) fn encode_hello(token: &[u8]) -> io::Result<Vec<u8>> {
    let token_len = u16::try_from(token.len())
        .ok()
        .filter(|&l| usize::from(l) <= MAX_TOKEN_LEN)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "cluster token too long"))?;
    let mut out = Vec::with_capacity(HELLO_LEN + token.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&token_len.to_le_bytes());
    out.extend_from_slice(token);
    Ok(out)
}

/// The token length a hello's fixed part announces, `None` when it is not our hello.
pub(crate) fn decode_hello(b: &[u8; HELLO_LEN]) -> Option<usize> {
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let version = u16::from_le_bytes([b[4], b[5]]);
    let token_len = usize::from(u16::from_le_bytes([b[6], b[7]]));
    (magic == MAGIC && version == VERSION && token_len <= MAX_TOKEN_LEN).then_some(token_len)
}

/// A hello reply.
pub(crate) fn encode_hello_reply(status: Status, slots: u32, server_id: u64) -> [u8; HELLO_REPLY_LEN] {
    let mut out = [0u8; HELLO_REPLY_LEN];
    out[0] = status as u8;
    out[4..8].copy_from_slice(&slots.to_le_bytes());
    out[8..16].copy_from_slice(&server_id.to_le_bytes());
    out
}

/// A hello reply's (status byte, slots, server id).
pub(crate) fn decode_hello_reply(b: &[u8; HELLO_REPLY_LEN]) -> (u8, u32, u64) {
    (b[0], u32_at(b, 4), u64_at(b, 8))
}

/// A get-region request.
pub(crate) fn encode_request(region_id: u64) -> [u8; REQUEST_LEN] {
    let mut out = [0u8; REQUEST_LEN];
    out[0] = OP_GET_REGION;
    out[8..16].copy_from_slice(&region_id.to_le_bytes());
    out
}

/// A request's region id, `None` for an unknown op or nonzero padding.
pub(crate) fn decode_request(b: &[u8; REQUEST_LEN]) -> Option<u64> {
    (b[0] == OP_GET_REGION && b[1..8].iter().all(|&x| x == 0)).then(|| u64_at(b, 8))
}

/// Where a region is in its file, and which registration of it this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RegionReply {
    pub(crate) slot: u32,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) epoch: u64,
}

/// A region reply.
pub(crate) fn encode_region_reply(status: Status, r: RegionReply) -> [u8; REGION_REPLY_LEN] {
    let mut out = [0u8; REGION_REPLY_LEN];
    out[0] = status as u8;
    out[4..8].copy_from_slice(&r.slot.to_le_bytes());
    out[8..16].copy_from_slice(&r.offset.to_le_bytes());
    out[16..24].copy_from_slice(&r.len.to_le_bytes());
    out[24..32].copy_from_slice(&r.epoch.to_le_bytes());
    out
}

/// A region reply's status byte and fields.
pub(crate) fn decode_region_reply(b: &[u8; REGION_REPLY_LEN]) -> (u8, RegionReply) {
    (b[0], RegionReply { slot: u32_at(b, 4), offset: u64_at(b, 8), len: u64_at(b, 16), epoch: u64_at(b, 24) })
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Sends `bytes`, with `fd` attached to the first byte when given.
pub(crate) fn send_with_fd(stream: &mut UnixStream, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let Some(fd) = fd else { return stream.write_all(bytes) };
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for a descriptor in the control buffer"));
    }
    let sent = loop {
        match rustix::net::sendmsg(&*stream, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // The descriptor went with the first byte; the rest (if the socket took less) follows plainly.
    stream.write_all(&bytes[sent..])
}

/// Receives exactly `buf.len()` bytes and at most one descriptor attached to them. End of stream
/// before the first byte is `UnexpectedEof`.
pub(crate) fn recv_with_fd(stream: &mut UnixStream, buf: &mut [u8]) -> io::Result<Option<OwnedFd>> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(&*stream, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(msg) => break msg,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if msg.bytes == 0 {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    let truncated = msg.flags.contains(rustix::net::ReturnFlags::CTRUNC);
    let mut received = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for fd in fds {
                // Keep the first; any other is closed as it drops.
                if received.is_none() {
                    received = Some(fd);
                }
            }
        }
    }
    if truncated {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more descriptors than expected"));
    }
    stream.read_exact(&mut buf[msg.bytes..])?;
    Ok(received)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn messages_round_trip() {
        let hello = encode_hello(b"tok").expect("hello");
        let fixed: [u8; HELLO_LEN] = hello[..HELLO_LEN].try_into().expect("fixed part");
        assert_eq!(decode_hello(&fixed), Some(3));
        assert_eq!(&hello[HELLO_LEN..], b"tok");
        let mut bad = fixed;
        bad[0] ^= 1;
        assert_eq!(decode_hello(&bad), None, "another magic");
        let mut bad = fixed;
        bad[4] = 9;
        assert_eq!(decode_hello(&bad), None, "another version");
        assert!(encode_hello(&vec![0; MAX_TOKEN_LEN + 1]).is_err());
        assert_eq!(decode_hello_reply(&encode_hello_reply(Status::Ok, 77, 5)), (0, 77, 5));
        assert_eq!(decode_request(&encode_request(u64::MAX)), Some(u64::MAX));
        let mut bad = encode_request(1);
        bad[0] = 2;
        assert_eq!(decode_request(&bad), None);
        let r = RegionReply { slot: 3, offset: 4096, len: 1 << 20, epoch: 9 };
        assert_eq!(decode_region_reply(&encode_region_reply(Status::UnknownRegion, r)), (4, r));
        for b in 0..=4 {
            assert_eq!(Status::from_byte(b).map(|s| s as u8), Some(b));
        }
        assert_eq!(Status::from_byte(5), None);
    }

    #[test]
    fn a_descriptor_travels_with_its_message() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        let file = std::fs::File::open("/proc/self/exe").expect("a file");
        send_with_fd(&mut a, &[1, 2, 3, 4], Some(file.as_fd())).expect("send");
        send_with_fd(&mut a, &[5, 6], None).expect("send");
        let mut buf = [0u8; 4];
        let fd = recv_with_fd(&mut b, &mut buf).expect("recv").expect("a descriptor");
        assert_eq!(buf, [1, 2, 3, 4]);
        let (x, y) = (rustix::fs::fstat(&fd).expect("stat"), rustix::fs::fstat(&file).expect("stat"));
        assert_eq!((x.st_dev, x.st_ino), (y.st_dev, y.st_ino), "the same file");
        assert!(rustix::io::fcntl_getfd(&fd).expect("flags").contains(rustix::io::FdFlags::CLOEXEC));
        let mut buf = [0u8; 2];
        assert!(recv_with_fd(&mut b, &mut buf).expect("recv").is_none());
        assert_eq!(buf, [5, 6]);
        drop(a);
        let err = recv_with_fd(&mut b, &mut buf).expect_err("closed");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
