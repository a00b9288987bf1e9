//! The wire protocol of the TCP data plane, byte by byte.
//!
//! Every integer is little-endian. Every frame starts with the magic `"UMBP"` (the bytes
//! `55 4d 42 50`, read as the little-endian `u32` `0x504d_4255`) and the protocol version
//! ([`VERSION`], currently 2: version 2 added the value checksum to the keyed ops' trailer,
//! descriptor and PUT_KEY).
//!
//! # Handshake
//! The client speaks first, once per connection:
//!
//! | bytes | field     | meaning                                             |
//! |-------|-----------|-----------------------------------------------------|
//! | 0..4  | magic     | `"UMBP"`                                            |
//! | 4..6  | version   | the client's protocol version                       |
//! | 6..8  | token_len | length of the cluster token, at most [`MAX_TOKEN_LEN`] |
//! | 8..   | token     | `token_len` bytes (empty when the client has none)  |
//!
//! The server answers with 8 bytes: magic, version (`u16`), status (`u8`: [`HelloStatus`]) and one
//! reserved zero byte. A server configured with a token accepts only that exact token; a server
//! without one accepts any. A server at its connection cap closes its connection idle longest to
//! make room, and answers `BUSY` only when every connection is in the middle of a request.
//! On any status but `OK` the server closes the connection after the answer; a bad magic or an
//! over-long token closes it without an answer. Either way the reason is counted and logged
//! (`tracing::warn`, rate-limited per kind) and no other connection is affected. The whole
//! handshake must arrive within the server's handshake timeout (1 s by default) of the accept,
//! however the bytes are paced; a server with too many connections in the handshake closes the
//! oldest of them (see `DataServerConfig`), so a client sends its hello as soon as it connects.
//!
//! # Requests (client → server), 40 bytes
//!
//! | bytes  | field      | meaning                                            |
//! |--------|------------|----------------------------------------------------|
//! | 0..4   | magic      | `"UMBP"`                                           |
//! | 4..6   | version    | [`VERSION`]                                        |
//! | 6      | op         | `1` = READ, `2` = WRITE ([`Op`])                   |
//! | 7      | flags      | must be 0 (reserved)                               |
//! | 8..16  | request_id | chosen by the client, echoed in the reply          |
//! | 16..24 | region_id  | the region, as assigned by the server at registration |
//! | 24..32 | offset     | byte offset inside the region                      |
//! | 32..40 | length     | bytes to move, at most [`MAX_REQUEST_BYTES`]       |
//!
//! A WRITE header is followed by exactly `length` payload bytes, always — whether or not the server
//! accepts the request. A READ header is followed by nothing.
//!
//! # Keyed requests
//! Two ops name a key instead of a region, so that a get or a put is one exchange with the holder
//! (its data server resolves, moves and settles on its own connection thread):
//!
//! - **GET_KEY** (op 3): `region_id` 0, `offset` the most bytes the client can take, `length` the
//!   key's length (at most [`MAX_KEY_LEN`]); the key's bytes (UTF-8) follow. Reply `OK` with
//!   `length` = the value's size, the value, then a 16-byte **trailer**: magic, a verdict byte
//!   (0 = intact, 1 = lapsed — the send outlived the holder's read lease and the bytes must be
//!   discarded), a checksum byte (1 = the next field holds the CRC-32C its writer put with the
//!   value, 0 = none), two zero bytes, the CRC-32C (`u32`, 0 when none), four zero bytes. The
//!   client checks the bytes it received against that checksum. `TOO_SMALL` carries the value's size in `length` and no
//!   payload; `MISS`, `BUSY`, `BAD_REQUEST` (not UTF-8) and `UNSUPPORTED` carry nothing.
//! - **PUT_KEY** (op 4): `region_id` the tier (`TierType` as a number), `offset` the key's length
//!   (at most [`MAX_KEY_LEN`]), `length` key and value together; the key, then the value follow —
//!   always in full, as a WRITE's payload. With [`FLAG_CHECKSUM`] in `flags`, the key is followed
//!   by the value's CRC-32C (4 bytes, counted in `length`), which the holder stores with the value.
//!   Reply `OK` (written and committed), `EXISTS`,
//!   `NO_SPACE`, `BUSY`, `FAILED`, `BAD_REQUEST` or `UNSUPPORTED`, with no payload.
//!
//! A server without a keyed handler answers `UNSUPPORTED`; a server older than these ops closes
//! the connection at the unknown op. Either way the client takes the routed path.
//!
//! ## Keyed gets over shared memory
//! A client on the holder's host that has mapped (or can map) the holder's regions (see `shm`)
//! sets [`FLAG_SHARED`] in a GET_KEY's `flags`. The server may then answer **`MAPPED`** instead of
//! `OK`: `length` = the bytes of a **descriptor** that follows in place of the value —
//!
//! | bytes  | field     | meaning                                                          |
//! |--------|-----------|------------------------------------------------------------------|
//! | 0..8   | size      | the value's size                                                 |
//! | 8..16  | lease_ns  | nanoseconds from when the server **received** the request to the end of its read lease |
//! | 16..20 | count     | ranges that follow, 1 to [`MAX_SHARED_RANGES`]                   |
//! | 20     | checksum  | 1: `crc32c` holds the value's checksum (GET_KEY only), 0: none   |
//! | 21..24 | reserved  | 0                                                                |
//! | 24..28 | crc32c    | the CRC-32C its writer put with the value (0 when none)           |
//! | 28..32 | reserved  | 0                                                                |
//! | 32..   | ranges    | `count` × (region_id `u64`, offset `u64`, len `u64`), in value order, lens adding up to `size` |
//!
//! — and keeps the read lease open. The client copies the ranges from its mappings of the
//! holder's regions and then sends an 8-byte **settle** frame (magic, a verdict byte, three zero
//! bytes): `0` = done (the server closes the lease; nothing more is sent), `1` = send the bytes
//! instead (a region it cannot map: the server answers with an ordinary GET_KEY reply — `OK`,
//! value and trailer under the same lease, or a status). The lease is the client's to judge: it
//! keeps the bytes only when its copy ended within `lease_ns` of when **it sent** the request
//! (which precedes the server's receipt), so no clock is shared, only the passage of time (see
//! `keyed` for why that is sound). The server waits for the settle frame within its IO timeout; a
//! connection that breaks or times out closes the lease. A server older than the flag answers
//! `BAD_REQUEST` (the client then asks again without it).
//!
//! A **PUT_KEY** with [`FLAG_SHARED`] carries the key and then the value's size (8 bytes, so
//! `length` = key length + 8) instead of the value. The server allocates; on a slot it answers
//! `MAPPED` with the slot's descriptor (`lease_ns`: from the receipt to the slot's end) — any other
//! outcome is the ordinary final reply — and waits for the settle frame: `0` = the client copied
//! the value into its mappings (the server commits if the settle arrived before the slot's end:
//! every byte was written before the settle left), `1` = the value's bytes follow the settle (as
//! a PUT_KEY's would). Then the ordinary final reply (`OK`, `FAILED`, `UNSUPPORTED`, ...). A server
//! older than the flag reads the 8 bytes as the value, discards them and answers `BAD_REQUEST`.
//!
//! ## Batches over shared memory
//! Two more ops carry many keys of one holder **on this host** in one exchange, `flags`
//! [`FLAG_SHARED`] always, `offset` the key count (1 to 1,024), `length` the body's bytes (bodies
//! in [`batch_wire`](super::batch_wire)):
//!
//! - **GET_KEYS** (op 5): per key its destination's capacity and the key. Reply `OK` whose
//!   payload answers every key in order: a `MAPPED` descriptor (as above), `TOO_SMALL` with the
//!   size, `MISS`, `BUSY` or `UNSUPPORTED`. If any key was `MAPPED`, the client copies those from
//!   its mappings and sends one `Done` settle frame, which closes every lease the reply opened. A
//!   batch is never served as bytes: what the client cannot map it reads the routed way.
//! - **PUT_KEYS** (op 6): `region_id` the tier; per key the value's size, its checksum (none, given,
//!   or summed while copied) and the key. Reply `OK` answering every key: a `MAPPED` descriptor of
//!   the slot allocated for it (`lease_ns` to the slot's end), `EXISTS`, `NO_SPACE`, `BUSY`,
//!   `FAILED` or `UNSUPPORTED`. If any slot was allocated, the client copies the values into their
//!   slots and sends a `Done` settle frame followed by one byte per key (1: copied, commit it; 0:
//!   abort it) and, when any key's checksum is summed while copied, one CRC-32C per key; the server
//!   commits each copied slot if the settle arrived before the slot's end and answers a second
//!   `OK` reply whose payload is one status byte per key (`OK` committed, `FAILED` not).
//!
//! A server older than these ops closes the connection at the unknown op; the client then asks
//! that holder no batch for 30 s.
//!
//! # Replies (server → client), 24 bytes
//!
//! | bytes  | field      | meaning                                            |
//! |--------|------------|----------------------------------------------------|
//! | 0..4   | magic      | `"UMBP"`                                           |
//! | 4..6   | version    | [`VERSION`]                                        |
//! | 6      | status     | [`Status`]                                         |
//! | 7      | reserved   | 0                                                  |
//! | 8..16  | request_id | the request's id                                   |
//! | 16..24 | length     | payload bytes that follow                          |
//!
//! A successful READ reply carries `length` (= the request's length) payload bytes; every other
//! reply carries none (`length` = 0).
//!
//! # Deadlines and idle connections
//! Once the first byte of a request header arrives, the server must receive the rest of the header
//! and the whole WRITE payload within its IO timeout in total, however the bytes are paced; a batch
//! of replies must leave within the IO timeout too. A request that misses its deadline closes the
//! connection. A connection with no request for the server's idle timeout is closed, and so is the
//! connection idle longest when the server needs room for a new one; clients close pooled
//! connections idle for their own (shorter) idle timeout, check an idle connection for an end of
//! stream before reusing it, and send a request lost with a closed connection once more on a new
//! one (a READ or WRITE may be repeated safely: it names the same range and the same bytes).
//!
//! # Ordering and pipelining
//! A server handles a connection's requests strictly in order and answers each one, so replies come
//! back in request order. A client writes many requests back to back and reads replies as they
//! come (it must keep reading while it writes, or both sides stall on full socket buffers).
//!
//! # What the server does with a bad request
//! - Unknown region, a range outside the region (checked arithmetic, before any memory is touched) or
//!   non-zero flags: the request gets a status ([`Status::UnknownRegion`], [`Status::OutOfRange`],
//!   [`Status::BadRequest`]); the payload of such a WRITE is read and discarded (through a small
//!   fixed scratch buffer) so the connection stays in sync and keeps serving.
//! - A GPU region whose staging copy the server's GPU runtime fails: [`Status::DeviceError`] (the
//!   WRITE payload is still read in full). A READ larger than the staging buffer whose copy fails
//!   after its first piece has left closes the connection instead: its reply is already under way.
//! - Bad magic, bad version, unknown op, or `length` > [`MAX_REQUEST_BYTES`]: the stream can no
//!   longer be trusted, so the server logs the reason and closes that connection.
//!
//! # Where the bytes go
//! Payload bytes move straight between the socket and the registered region: a `readv`/`writev`
//! system call on slices over the region memory, gathered with the headers. Each side reads headers
//! through a small (4 KiB) buffer so that tiny frames share system calls; a payload smaller than
//! that buffer may arrive in it as read-ahead and is copied out, while a larger payload is read
//! with only one header's worth of read-ahead, so it lands in region memory directly. Nothing is
//! ever allocated from a length a peer sent.
//!
//! GPU regions (device memory, which neither the CPU nor the socket can touch) are the exception:
//! their bytes pass through a per-connection host staging buffer, copied with the server's GPU
//! runtime (socket → staging → device for a WRITE, device → staging → socket for a READ), in
//! pieces of at most the staging size. The bytes on the wire are the same.

/// The frame magic: the bytes `"UMBP"`.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"UMBP");
/// The protocol version this build speaks.
pub(crate) const VERSION: u16 = 2;
/// Bytes of the fixed part of the client hello (the token follows).
pub(crate) const HELLO_LEN: usize = 8;
/// Bytes of the server's answer to a hello.
pub(crate) const HELLO_REPLY_LEN: usize = 8;
/// Longest cluster token accepted.
pub(crate) const MAX_TOKEN_LEN: usize = 1024;
/// Bytes of a request header.
pub(crate) const REQUEST_LEN: usize = 40;
/// Bytes of a reply header.
pub(crate) const REPLY_LEN: usize = 24;
/// The longest key a GET_KEY or PUT_KEY may name. A longer one is not the protocol: the server
/// closes the connection.
pub(crate) const MAX_KEY_LEN: u64 = 8 << 10;
/// Bytes of the trailer that ends a successful GET_KEY payload.
pub(crate) const TRAILER_LEN: usize = 16;
/// GET_KEY `flags` bit: the client can copy the value from shared mappings of this server's
/// regions, so a `MAPPED` answer (a descriptor instead of the bytes) is welcome.
pub(crate) const FLAG_SHARED: u8 = 1;
/// PUT_KEY `flags` bit: the value's CRC-32C (4 bytes) follows the key.
pub(crate) const FLAG_CHECKSUM: u8 = 2;
/// Bytes of the checksum a PUT_KEY with [`FLAG_CHECKSUM`] carries after its key.
pub(crate) const CHECKSUM_LEN: u64 = 4;
/// The most ranges a `MAPPED` descriptor names; a value in more pieces is sent as bytes.
pub(crate) const MAX_SHARED_RANGES: usize = 1024;
/// Bytes of a `MAPPED` descriptor's fixed part.
pub(crate) const DESCRIPTOR_HEAD_LEN: usize = 32;
/// Bytes of one range of a `MAPPED` descriptor.
pub(crate) const DESCRIPTOR_RANGE_LEN: usize = 24;
/// Bytes of the settle frame a client sends after a `MAPPED` answer.
pub(crate) const SETTLE_LEN: usize = 8;
/// The most bytes one request may move. A peer claiming more is not speaking the protocol; the
/// client splits larger runs into several requests.
pub(crate) const MAX_REQUEST_BYTES: u64 = 1 << 30;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Region → socket.
    Read = 1,
    /// Socket → region.
    Write = 2,
    /// A keyed read: the holder resolves a key, sends its value and ends the read lease, in one
    /// exchange (see [`keyed`](super::keyed)).
    GetKey = 3,
    /// A keyed write: the holder allocates a slot for a key, receives its value and commits it, in
    /// one exchange (see [`keyed`](super::keyed)).
    PutKey = 4,
    /// A batched keyed read for a holder on this host: the holder resolves many keys and answers
    /// each with where its value lies in shared memory (see [`batch_wire`](super::batch_wire)).
    GetKeys = 5,
    /// A batched keyed write for a holder on this host: the holder allocates a slot per key, the
    /// client copies the values into them through its mappings, the holder commits them (see
    /// [`batch_wire`](super::batch_wire)).
    PutKeys = 6,
}

impl Op {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Read),
            2 => Some(Self::Write),
            3 => Some(Self::GetKey),
            4 => Some(Self::PutKey),
            5 => Some(Self::GetKeys),
            6 => Some(Self::PutKeys),
            _ => None,
        }
    }
}

/// The outcome of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Status {
    /// Done; a READ reply carries the payload.
    Ok = 0,
    /// No live region has this id (never registered, or deregistered).
    UnknownRegion = 1,
    /// `offset + length` lies beyond the region (or overflows).
    OutOfRange = 2,
    /// The request is well-framed but not acceptable (non-zero flags).
    BadRequest = 3,
    /// The region is GPU memory and the server's GPU runtime failed to copy it through host
    /// staging. (A client that predates this status reads it as a malformed reply and drops the
    /// connection: the request fails either way.)
    DeviceError = 4,
    /// Keyed: the holder does not hold the key.
    Miss = 5,
    /// Keyed: the holder holds the key (or has room for it) but cannot serve it now (every staging
    /// page is held): ask again shortly.
    Busy = 6,
    /// GET_KEY: the value is larger than the capacity the request stated; the reply's `length` is
    /// the value's size and no payload follows.
    TooSmall = 7,
    /// PUT_KEY: the holder already holds the key; its stored value was kept.
    Exists = 8,
    /// PUT_KEY: the holder has no room for the value.
    NoSpace = 9,
    /// PUT_KEY: the holder could not store the value (allocation or commit failed).
    Failed = 10,
    /// Keyed: this server serves no keyed requests, or not for this value (one in device memory):
    /// use the routed path.
    Unsupported = 11,
    /// GET_KEY with [`FLAG_SHARED`]: a descriptor of the value's ranges follows instead of the
    /// value; the read lease stays open until the client's settle frame.
    Mapped = 12,
}

impl Status {
    /// Every status, in wire order.
    pub(crate) const ALL: [Status; 13] = [
        Self::Ok,
        Self::UnknownRegion,
        Self::OutOfRange,
        Self::BadRequest,
        Self::DeviceError,
        Self::Miss,
        Self::Busy,
        Self::TooSmall,
        Self::Exists,
        Self::NoSpace,
        Self::Failed,
        Self::Unsupported,
        Self::Mapped,
    ];

    fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(usize::from(v)).copied()
    }

    /// The `status=` metric label.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::UnknownRegion => "unknown_region",
            Self::OutOfRange => "out_of_range",
            Self::BadRequest => "bad_request",
            Self::DeviceError => "device_error",
            Self::Miss => "miss",
            Self::Busy => "busy",
            Self::TooSmall => "too_small",
            Self::Exists => "exists",
            Self::NoSpace => "no_space",
            Self::Failed => "failed",
            Self::Unsupported => "unsupported",
            Self::Mapped => "mapped",
        }
    }
}

/// The server's answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HelloStatus {
    /// Authenticated; requests may follow.
    Ok = 0,
    /// The token did not match.
    Unauthorized = 1,
    /// The server does not speak the client's version.
    BadVersion = 2,
    /// The server serves as many connections as it may; try again later or elsewhere.
    Busy = 3,
}

impl HelloStatus {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Ok),
            1 => Some(Self::Unauthorized),
            2 => Some(Self::BadVersion),
            3 => Some(Self::Busy),
            _ => None,
        }
    }
}

/// Why bytes are not a frame of this protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FrameError {
    /// The first four bytes are not `"UMBP"`.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A version this build does not speak.
    #[error("unsupported protocol version {0}")]
    BadVersion(u16),
    /// An op code that is neither READ nor WRITE.
    #[error("unknown op {0}")]
    BadOp(u8),
    /// A status code outside [`Status`] or [`HelloStatus`].
    #[error("unknown status {0}")]
    BadStatus(u8),
    /// A length beyond what the protocol allows.
    #[error("length {0} exceeds the protocol limit")]
    TooLong(u64),
    /// A token longer than [`MAX_TOKEN_LEN`].
    #[error("token of {0} bytes exceeds {MAX_TOKEN_LEN}")]
    TokenTooLong(usize),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut x = [0u8; 2];
    x.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(x)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn check_prefix(b: &[u8]) -> Result<(), FrameError> {
    let magic = u32_at(b, 0);
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16_at(b, 4);
    if version != VERSION {
        return Err(FrameError::BadVersion(version));
    }
    Ok(())
}

/// The fixed part of a client hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The client's version.
    pub(crate) version: u16,
    /// Length of the token that follows.
    pub(crate) token_len: usize,
}

/// Encodes a client hello including its token.
pub(crate) fn encode_hello(token: &[u8]) -> Result<Vec<u8>, FrameError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(FrameError::TokenTooLong(token.len()));
    }
    let mut out = Vec::with_capacity(HELLO_LEN + token.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    // `token.len() <= MAX_TOKEN_LEN` (1024) fits a u16.
    out.extend_from_slice(&u16::try_from(token.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(token);
    Ok(out)
}

/// Decodes the fixed part of a client hello. The version is returned, not checked: the server
/// answers a foreign version with [`HelloStatus::BadVersion`].
pub(crate) fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<Hello, FrameError> {
    let magic = u32_at(b, 0);
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let token_len = usize::from(u16_at(b, 6));
    if token_len > MAX_TOKEN_LEN {
        return Err(FrameError::TokenTooLong(token_len));
    }
    Ok(Hello { version: u16_at(b, 4), token_len })
}

/// Encodes the server's answer to a hello.
pub(crate) fn encode_hello_reply(status: HelloStatus) -> [u8; HELLO_REPLY_LEN] {
    let mut out = [0u8; HELLO_REPLY_LEN];
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = status as u8;
    out
}

/// Decodes the server's answer to a hello.
pub(crate) fn decode_hello_reply(b: &[u8; HELLO_REPLY_LEN]) -> Result<HelloStatus, FrameError> {
    let magic = u32_at(b, 0);
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    // The version is not checked here: a server of another version says so in the status.
    HelloStatus::from_u8(b[6]).ok_or(FrameError::BadStatus(b[6]))
}

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    /// READ or WRITE.
    pub(crate) op: Op,
    /// Reserved, 0.
    pub(crate) flags: u8,
    /// Echoed in the reply.
    pub(crate) id: u64,
    /// The region.
    pub(crate) region: u64,
    /// Offset inside the region.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) length: u64,
}

impl Request {
    /// The 40 header bytes.
    pub(crate) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut out = [0u8; REQUEST_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.op as u8;
        out[7] = self.flags;
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.region.to_le_bytes());
        out[24..32].copy_from_slice(&self.offset.to_le_bytes());
        out[32..40].copy_from_slice(&self.length.to_le_bytes());
        out
    }

    /// Parses a header; any error means the connection is out of sync and must be closed.
    pub(crate) fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, FrameError> {
        check_prefix(b)?;
        let op = Op::from_u8(b[6]).ok_or(FrameError::BadOp(b[6]))?;
        let length = u64_at(b, 32);
        if length > MAX_REQUEST_BYTES {
            return Err(FrameError::TooLong(length));
        }
        Ok(Self { op, flags: b[7], id: u64_at(b, 8), region: u64_at(b, 16), offset: u64_at(b, 24), length })
    }
}

/// A reply header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    /// The outcome.
    pub(crate) status: Status,
    /// The request's id.
    pub(crate) id: u64,
    /// Payload bytes that follow.
    pub(crate) length: u64,
}

impl Reply {
    /// The 24 header bytes.
    pub(crate) fn encode(&self) -> [u8; REPLY_LEN] {
        let mut out = [0u8; REPLY_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.status as u8;
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.length.to_le_bytes());
        out
    }

    /// Parses a header; any error means the connection is out of sync and must be closed.
    pub(crate) fn decode(b: &[u8; REPLY_LEN]) -> Result<Self, FrameError> {
        check_prefix(b)?;
        let status = Status::from_u8(b[6]).ok_or(FrameError::BadStatus(b[6]))?;
        let length = u64_at(b, 16);
        if length > MAX_REQUEST_BYTES {
            return Err(FrameError::TooLong(length));
        }
        Ok(Self { status, id: u64_at(b, 8), length })
    }
}

/// What the trailer of a GET_KEY reply says about the bytes before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trailer {
    /// The holder's read lease covered the whole send: the bytes are the value.
    Intact = 0,
    /// The send outlived the read lease: the pages may have been reused under it, so the bytes
    /// must be discarded.
    Lapsed = 1,
}

impl Trailer {
    /// The 16 trailer bytes: the magic, the verdict, whether a checksum follows, two zero bytes,
    /// the value's CRC-32C (0 when none), four zero bytes.
    pub(crate) fn encode(self, crc32c: Option<u32>) -> [u8; TRAILER_LEN] {
        let mut out = [0u8; TRAILER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = self as u8;
        out[5] = u8::from(crc32c.is_some());
        out[8..12].copy_from_slice(&crc32c.unwrap_or(0).to_le_bytes());
        out
    }

    /// Parses a trailer into its verdict and the value's checksum; an error means the connection
    /// is out of sync.
    pub(crate) fn decode(b: &[u8; TRAILER_LEN]) -> Result<(Self, Option<u32>), FrameError> {
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let verdict = match b[4] {
            0 => Self::Intact,
            1 => Self::Lapsed,
            v => return Err(FrameError::BadStatus(v)),
        };
        let crc32c = match b[5] {
            0 => None,
            1 => Some(u32_at(b, 8)),
            v => return Err(FrameError::BadStatus(v)),
        };
        Ok((verdict, crc32c))
    }
}

/// A `MAPPED` answer's descriptor: where a value lies in the holder's regions and how long the
/// read lease lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    /// The value's size.
    pub(crate) size: u64,
    /// Nanoseconds from the server's receipt of the request to the end of the read lease.
    pub(crate) lease_ns: u64,
    /// (region id, offset, len), in value order.
    pub(crate) ranges: Vec<(u64, u64, u64)>,
    /// The CRC-32C its writer put with the value (a GET_KEY's answer only).
    pub(crate) crc32c: Option<u32>,
}

/// Bytes of a descriptor over `ranges` ranges.
pub(crate) const fn descriptor_len(ranges: usize) -> usize {
    DESCRIPTOR_HEAD_LEN + DESCRIPTOR_RANGE_LEN * ranges
}

/// Appends the bytes of a [`Descriptor`] of these fields to `out` without building one (a holder
/// answers every key of a batch so: no ranges vector per key). `ranges` are (region id, offset,
/// len), in value order, 1 to [`MAX_SHARED_RANGES`] of them.
pub(crate) fn encode_descriptor(
    out: &mut Vec<u8>,
    size: u64,
    lease_ns: u64,
    crc32c: Option<u32>,
    ranges: impl ExactSizeIterator<Item = (u64, u64, u64)>,
) {
    out.reserve(descriptor_len(ranges.len()));
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&lease_ns.to_le_bytes());
    out.extend_from_slice(&u32::try_from(ranges.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&[u8::from(crc32c.is_some()), 0, 0, 0]);
    out.extend_from_slice(&crc32c.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    for (region, offset, len) in ranges {
        out.extend_from_slice(&region.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
}

impl Descriptor {
    /// The descriptor's bytes (`ranges` must hold 1 to [`MAX_SHARED_RANGES`] entries).
    pub(crate) fn encode(&self) -> Vec<u8> {
        // `encode_descriptor` reserves the descriptor's bytes.
        let mut out = Vec::new();
        encode_descriptor(&mut out, self.size, self.lease_ns, self.crc32c, self.ranges.iter().copied());
        out
    }

    /// The longest descriptor a client accepts.
    pub(crate) const fn max_len() -> usize {
        descriptor_len(MAX_SHARED_RANGES)
    }

    /// Parses a descriptor: the count must match the length, the ranges must add up to the size
    /// (checked arithmetic), and there must be at least one. Any error means a broken peer.
    pub(crate) fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < DESCRIPTOR_HEAD_LEN || b.len() > Self::max_len() {
            return Err(FrameError::TooLong(b.len() as u64));
        }
        let size = u64_at(b, 0);
        let lease_ns = u64_at(b, 8);
        let count = u32_at(b, 16) as usize;
        let crc32c = match b[20] {
            0 => None,
            1 => Some(u32_at(b, 24)),
            v => return Err(FrameError::BadStatus(v)),
        };
        if count == 0 || b.len() != descriptor_len(count) {
            return Err(FrameError::TooLong(b.len() as u64));
        }
        let mut total = 0u64;
        let ranges: Vec<(u64, u64, u64)> = (0..count)
            .map(|i| {
                let at = DESCRIPTOR_HEAD_LEN + DESCRIPTOR_RANGE_LEN * i;
                (u64_at(b, at), u64_at(b, at + 8), u64_at(b, at + 16))
            })
            .collect();
        for (_, _, len) in &ranges {
            total = total.checked_add(*len).ok_or(FrameError::TooLong(u64::MAX))?;
        }
        if total != size {
            return Err(FrameError::TooLong(total));
        }
        Ok(Self { size, lease_ns, ranges, crc32c })
    }
}

/// What a client's settle frame (after a `MAPPED` answer) asks of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    /// The copy is over (good or not): close the read lease.
    Done = 0,
    /// The client cannot copy from its mappings: send the value as an ordinary GET_KEY reply, under
    /// the same lease.
    SendBytes = 1,
}

impl Settle {
    /// The 8 settle bytes: the magic, the verdict, three reserved zero bytes.
    pub(crate) fn encode(self) -> [u8; SETTLE_LEN] {
        let mut out = [0u8; SETTLE_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = self as u8;
        out
    }

    /// Parses a settle frame; an error means the connection is out of sync.
    pub(crate) fn decode(b: &[u8; SETTLE_LEN]) -> Result<Self, FrameError> {
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        match b[4] {
            0 => Ok(Self::Done),
            1 => Ok(Self::SendBytes),
            v => Err(FrameError::BadStatus(v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn magic_is_umbp_on_the_wire() {
        let r = Request { op: Op::Read, flags: 0, id: 1, region: 2, offset: 3, length: 4 };
        assert_eq!(&r.encode()[0..4], b"UMBP");
        assert_eq!(&encode_hello_reply(HelloStatus::Ok)[0..4], b"UMBP");
    }

    #[test]
    fn hello_round_trips_and_rejects_long_tokens() {
        let bytes = encode_hello(b"secret").expect("short token");
        let mut head = [0u8; HELLO_LEN];
        head.copy_from_slice(&bytes[..HELLO_LEN]);
        assert_eq!(decode_hello(&head), Ok(Hello { version: VERSION, token_len: 6 }));
        assert_eq!(&bytes[HELLO_LEN..], b"secret");
        assert!(encode_hello(&[0u8; MAX_TOKEN_LEN + 1]).is_err());
        head[6..8].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(decode_hello(&head), Err(FrameError::TokenTooLong(usize::from(u16::MAX))));
        for s in [HelloStatus::Ok, HelloStatus::Unauthorized, HelloStatus::BadVersion, HelloStatus::Busy] {
            assert_eq!(decode_hello_reply(&encode_hello_reply(s)), Ok(s));
        }
    }

    #[test]
    fn trailers_round_trip_and_reject_garbage() {
        for t in [Trailer::Intact, Trailer::Lapsed] {
            for crc in [None, Some(0), Some(0xdead_beef)] {
                assert_eq!(Trailer::decode(&t.encode(crc)), Ok((t, crc)));
            }
        }
        let mut b = Trailer::Intact.encode(Some(7));
        b[5] = 2;
        assert_eq!(Trailer::decode(&b), Err(FrameError::BadStatus(2)), "a checksum byte beyond 0/1");
        b[5] = 0;
        assert_eq!(Trailer::decode(&b), Ok((Trailer::Intact, None)), "no checksum: its field is ignored");
        b[4] = 2;
        assert_eq!(Trailer::decode(&b), Err(FrameError::BadStatus(2)));
        b[0] = 0;
        assert!(matches!(Trailer::decode(&b), Err(FrameError::BadMagic(_))));
    }

    #[test]
    fn descriptors_and_settles_round_trip_and_reject_garbage() {
        let d = Descriptor { size: 30, lease_ns: 5_000_000, ranges: vec![(7, 0, 10), (7, 4096, 20)], crc32c: None };
        assert_eq!(Descriptor::decode(&d.encode()), Ok(d.clone()));
        let with = Descriptor { crc32c: Some(0x0102_0304), ..d.clone() };
        assert_eq!(Descriptor::decode(&with.encode()), Ok(with.clone()), "a checksum round-trips");
        let mut b = with.encode();
        b[20] = 3;
        assert_eq!(Descriptor::decode(&b), Err(FrameError::BadStatus(3)), "a checksum byte beyond 0/1");
        let mut b = d.encode();
        b[0] = 31;
        assert!(Descriptor::decode(&b).is_err(), "ranges must add up to the size");
        let b = d.encode();
        assert!(Descriptor::decode(&b[..b.len() - 1]).is_err(), "the count must match the length");
        let empty = Descriptor { size: 0, lease_ns: 1, ranges: Vec::new(), crc32c: None };
        assert!(Descriptor::decode(&empty.encode()).is_err(), "at least one range");
        let over = Descriptor { size: u64::MAX, lease_ns: 1, ranges: vec![(1, 0, u64::MAX), (1, 0, 1)], crc32c: None };
        assert!(Descriptor::decode(&over.encode()).is_err(), "checked sums");
        for s in [Settle::Done, Settle::SendBytes] {
            assert_eq!(Settle::decode(&s.encode()), Ok(s));
        }
        let mut b = Settle::Done.encode();
        b[4] = 9;
        assert_eq!(Settle::decode(&b), Err(FrameError::BadStatus(9)));
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let good = Request { op: Op::Write, flags: 0, id: 9, region: 1, offset: 0, length: 10 }.encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Request::decode(&b), Err(FrameError::BadMagic(_))));
        let mut b = good;
        b[4] = 99;
        assert_eq!(Request::decode(&b), Err(FrameError::BadVersion(99)));
        let mut b = good;
        b[6] = 9;
        assert_eq!(Request::decode(&b), Err(FrameError::BadOp(9)));
        let mut b = good;
        b[32..40].copy_from_slice(&(MAX_REQUEST_BYTES + 1).to_le_bytes());
        assert_eq!(Request::decode(&b), Err(FrameError::TooLong(MAX_REQUEST_BYTES + 1)));
        let mut r = Reply { status: Status::Ok, id: 1, length: 0 }.encode();
        r[6] = 200;
        assert_eq!(Reply::decode(&r), Err(FrameError::BadStatus(200)));
    }

    proptest! {
        #[test]
        fn requests_round_trip(write in any::<bool>(), flags in any::<u8>(), id in any::<u64>(),
                               region in any::<u64>(), offset in any::<u64>(), length in 0..=MAX_REQUEST_BYTES) {
            let op = if write { Op::Write } else { Op::Read };
            let r = Request { op, flags, id, region, offset, length };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn replies_round_trip(status in 0usize..Status::ALL.len(), id in any::<u64>(), length in 0..=MAX_REQUEST_BYTES) {
            let r = Reply { status: Status::ALL[status], id, length };
            prop_assert_eq!(Reply::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), REQUEST_LEN)) {
            let mut b = [0u8; REQUEST_LEN];
            b.copy_from_slice(&bytes);
            let _ = Request::decode(&b);
            let mut r = [0u8; REPLY_LEN];
            r.copy_from_slice(&bytes[..REPLY_LEN]);
            let _ = Reply::decode(&r);
        }
    }
}
