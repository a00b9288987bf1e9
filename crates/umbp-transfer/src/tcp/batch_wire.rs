//! The bytes of GET_KEYS, the batched keyed read for holders on this host (see
//! [`keyed`](super::keyed)): one request names many keys, one reply answers each of them with a
//! `MAPPED` descriptor (or why not), and one settle frame ends every read lease the reply opened.
//!
//! Request (after the 40-byte header: `op` GET_KEYS, `flags` [`FLAG_SHARED`](super::protocol::FLAG_SHARED),
//! `offset` the key count, `length` the body's bytes), per key: the destination's capacity (u64),
//! the key's length (u32), the key. Reply (after a 24-byte header with status `OK`; `length` the
//! body's bytes), per key in request order: a status byte (a [`Status`]), three zero bytes, the
//! entry's length (u32) and the entry — a [`Descriptor`] for `MAPPED`, the value's size (u64) for
//! `TOO_SMALL`, nothing otherwise. When at least one entry is `MAPPED`, the client copies from its
//! mappings and sends one `Done` settle frame; the server keeps every lease it answered open until
//! then (or until the connection ends).
//!
//! PUT_KEYS, the batched keyed write, has the same shape: per key, the value's size (u64), a
//! checksum flag byte (0: none; 1: the CRC-32C that follows; 2: summed while copied, sent with the
//! settle), three zero bytes, the CRC-32C (u32, 0 unless the flag is 1) and the key's length (u32),
//! then the key; `region` is the tier. Its first reply answers each key with a `MAPPED` descriptor
//! of the slot the holder allocated (or `EXISTS`, `NO_SPACE`, `BUSY`, `FAILED`, `UNSUPPORTED`);
//! when any slot was allocated the client copies the values into them and sends a `Done` settle
//! frame followed by one byte per key (1: copied, commit it; 0: abort it) and, when any key's flag
//! was 2, one CRC-32C (u32) per key (0 for the others); the holder answers with a second reply of
//! one status byte per key (`OK`: committed; `FAILED`: aborted or too late). Flag 2 lets a client
//! read each value once, summing each block right after it copied it in, instead of reading it a
//! second time for the sum before the request (a holder older than flag 2 refuses the request and
//! closes the connection: the client then writes those keys the routed way).
//!
//! Every length is bounded before anything is allocated: a decoder error means a broken peer, and
//! the connection is closed.

use super::protocol::{
    Descriptor, FrameError, MAX_KEY_LEN, MAX_REQUEST_BYTES, Status, descriptor_len, encode_descriptor,
};

/// The most keys one GET_KEYS may name.
pub(crate) const MAX_BATCH_KEYS: usize = 1024;
/// Bytes of one request entry's fixed part (capacity, key length).
const ENTRY_HEAD_LEN: usize = 12;
/// Bytes of one answer's fixed part (status, reserved, length).
const ANSWER_HEAD_LEN: usize = 8;
/// Bytes of one PUT_KEYS request entry's fixed part (size, checksum flag, reserved, checksum, key
/// length).
const PUT_ENTRY_HEAD_LEN: usize = 20;

/// The longest GET_KEYS request body.
pub(crate) const fn max_request_body() -> u64 {
    (MAX_BATCH_KEYS as u64) * (ENTRY_HEAD_LEN as u64 + MAX_KEY_LEN)
}

/// The longest PUT_KEYS request body.
pub(crate) const fn max_put_request_body() -> u64 {
    (MAX_BATCH_KEYS as u64) * (PUT_ENTRY_HEAD_LEN as u64 + MAX_KEY_LEN)
}

/// The longest GET_KEYS or PUT_KEYS reply body.
pub(crate) const fn max_reply_body() -> u64 {
    (MAX_BATCH_KEYS as u64) * (ANSWER_HEAD_LEN + Descriptor::max_len()) as u64
}

/// One key of a GET_KEYS request: the key and how many bytes its destination takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchEntry<'a> {
    pub(crate) key: &'a str,
    pub(crate) cap: u64,
}

/// The request body for `entries` (1 to [`MAX_BATCH_KEYS`] keys of at most
/// [`MAX_KEY_LEN`] bytes each: the caller checks).
pub(crate) fn encode_request(entries: &[BatchEntry<'_>]) -> Vec<u8> {
    let len: usize = entries.iter().map(|e| ENTRY_HEAD_LEN + e.key.len()).sum();
    let mut out = Vec::with_capacity(len);
    for e in entries {
        out.extend_from_slice(&e.cap.to_le_bytes());
        out.extend_from_slice(&u32::try_from(e.key.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(e.key.as_bytes());
    }
    out
}

/// Parses a request body of `count` keys. Keys must be non-empty UTF-8 of at most
/// [`MAX_KEY_LEN`] bytes and the body must end exactly after the last.
pub(crate) fn decode_request(body: &[u8], count: u64) -> Result<Vec<BatchEntry<'_>>, FrameError> {
    let count =
        usize::try_from(count).ok().filter(|c| (1..=MAX_BATCH_KEYS).contains(c)).ok_or(FrameError::TooLong(count))?;
    let mut entries = Vec::with_capacity(count);
    let mut at = 0usize;
    for _ in 0..count {
        let head = body.get(at..at + ENTRY_HEAD_LEN).ok_or(FrameError::TooLong(body.len() as u64))?;
        let cap = u64::from_le_bytes(head[0..8].try_into().map_err(|_| FrameError::TooLong(0))?);
        let key_len = u32::from_le_bytes(head[8..12].try_into().map_err(|_| FrameError::TooLong(0))?) as usize;
        if key_len == 0 || key_len as u64 > MAX_KEY_LEN {
            return Err(FrameError::TooLong(key_len as u64));
        }
        at += ENTRY_HEAD_LEN;
        let key = body.get(at..at + key_len).ok_or(FrameError::TooLong(body.len() as u64))?;
        let key = std::str::from_utf8(key).map_err(|_| FrameError::BadStatus(0))?;
        at += key_len;
        entries.push(BatchEntry { key, cap });
    }
    if at != body.len() {
        return Err(FrameError::TooLong(body.len() as u64));
    }
    Ok(entries)
}

/// The checksum a batched same-host put stores with a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutChecksum {
    /// None: the value is stored without one, and its readers cannot check it.
    None,
    /// This CRC-32C of the value, summed by the caller.
    Given(u32),
    /// Summed while the value is copied in, each block right after it was copied (the value is
    /// read once, not twice), and sent to the holder with the settle.
    WhileCopying,
}

impl PutChecksum {
    /// The flag byte and the CRC-32C field of a request entry.
    fn wire(self) -> (u8, u32) {
        match self {
            Self::None => (0, 0),
            Self::Given(crc) => (1, crc),
            Self::WhileCopying => (2, 0),
        }
    }
}

/// One key of a PUT_KEYS request: the key, its value's size and checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PutEntry<'a> {
    pub(crate) key: &'a str,
    pub(crate) size: u64,
    pub(crate) checksum: PutChecksum,
}

/// Bytes of one key's CRC-32C in a PUT_KEYS settle (see the module docs).
pub(crate) const SETTLE_CRC_LEN: usize = 4;

/// The PUT_KEYS request body for `entries` (bounds as [`encode_request`]).
pub(crate) fn encode_put_request(entries: &[PutEntry<'_>]) -> Vec<u8> {
    let len: usize = entries.iter().map(|e| PUT_ENTRY_HEAD_LEN + e.key.len()).sum();
    let mut out = Vec::with_capacity(len);
    for e in entries {
        out.extend_from_slice(&e.size.to_le_bytes());
        let (flag, crc) = e.checksum.wire();
        out.extend_from_slice(&[flag, 0, 0, 0]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&u32::try_from(e.key.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(e.key.as_bytes());
    }
    out
}

/// Parses a PUT_KEYS request body of `count` keys (rules as [`decode_request`]; a value is 1 byte
/// or more, the checksum flag 0, 1 or 2).
pub(crate) fn decode_put_request(body: &[u8], count: u64) -> Result<Vec<PutEntry<'_>>, FrameError> {
    let count =
        usize::try_from(count).ok().filter(|c| (1..=MAX_BATCH_KEYS).contains(c)).ok_or(FrameError::TooLong(count))?;
    let mut entries = Vec::with_capacity(count);
    let mut at = 0usize;
    for _ in 0..count {
        let head = body.get(at..at + PUT_ENTRY_HEAD_LEN).ok_or(FrameError::TooLong(body.len() as u64))?;
        let size = u64::from_le_bytes(head[0..8].try_into().map_err(|_| FrameError::TooLong(0))?);
        let crc = u32::from_le_bytes(head[12..16].try_into().map_err(|_| FrameError::TooLong(0))?);
        let checksum = match head[8] {
            0 => PutChecksum::None,
            1 => PutChecksum::Given(crc),
            2 => PutChecksum::WhileCopying,
            v => return Err(FrameError::BadStatus(v)),
        };
        let key_len = u32::from_le_bytes(head[16..20].try_into().map_err(|_| FrameError::TooLong(0))?) as usize;
        if key_len == 0 || key_len as u64 > MAX_KEY_LEN || size == 0 || size > MAX_REQUEST_BYTES {
            return Err(FrameError::TooLong(key_len as u64));
        }
        at += PUT_ENTRY_HEAD_LEN;
        let key = body.get(at..at + key_len).ok_or(FrameError::TooLong(body.len() as u64))?;
        let key = std::str::from_utf8(key).map_err(|_| FrameError::BadStatus(0))?;
        at += key_len;
        entries.push(PutEntry { key, size, checksum });
    }
    if at != body.len() {
        return Err(FrameError::TooLong(body.len() as u64));
    }
    Ok(entries)
}

/// One key's answer in a GET_KEYS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BatchAnswer {
    /// Where the value lies and how long its read lease lasts.
    Mapped(Descriptor),
    /// The value (this many bytes) is larger than the stated capacity.
    TooSmall(u64),
    /// Any other status with no entry: `Miss`, `Busy`, `Unsupported` (GET_KEYS); `Exists`,
    /// `NoSpace`, `Busy`, `Failed`, `Unsupported` (PUT_KEYS).
    Other(Status),
}

/// Appends one answer to a reply body.
pub(crate) fn encode_answer(out: &mut Vec<u8>, answer: &BatchAnswer) {
    match answer {
        BatchAnswer::Mapped(d) => encode_mapped(out, d.size, d.lease_ns, d.crc32c, d.ranges.iter().copied()),
        BatchAnswer::TooSmall(size) => {
            answer_head(out, Status::TooSmall, 8);
            out.extend_from_slice(&size.to_le_bytes());
        }
        BatchAnswer::Other(s) => answer_head(out, *s, 0),
    }
}

/// Appends a `MAPPED` answer of these descriptor fields (see [`encode_descriptor`]) without
/// building a [`Descriptor`]: the same bytes as [`encode_answer`] of one.
pub(crate) fn encode_mapped(
    out: &mut Vec<u8>,
    size: u64,
    lease_ns: u64,
    crc32c: Option<u32>,
    ranges: impl ExactSizeIterator<Item = (u64, u64, u64)>,
) {
    answer_head(out, Status::Mapped, descriptor_len(ranges.len()));
    encode_descriptor(out, size, lease_ns, crc32c, ranges);
}

/// An answer's status and the length of its entry.
fn answer_head(out: &mut Vec<u8>, status: Status, entry_len: usize) {
    out.extend_from_slice(&[status as u8, 0, 0, 0]);
    out.extend_from_slice(&u32::try_from(entry_len).unwrap_or(u32::MAX).to_le_bytes());
}

/// A guess at a reply body's bytes for `count` answers (one range each), to allocate it once.
pub(crate) const fn reply_capacity(count: usize) -> usize {
    count * (ANSWER_HEAD_LEN + descriptor_len(1))
}

/// Parses a reply body that answers `count` keys, exactly.
pub(crate) fn decode_reply(body: &[u8], count: usize) -> Result<Vec<BatchAnswer>, FrameError> {
    let mut answers = Vec::with_capacity(count.min(MAX_BATCH_KEYS));
    let mut at = 0usize;
    for _ in 0..count {
        let head = body.get(at..at + ANSWER_HEAD_LEN).ok_or(FrameError::TooLong(body.len() as u64))?;
        let status = Status::ALL.get(usize::from(head[0])).copied().ok_or(FrameError::BadStatus(head[0]))?;
        let len = u32::from_le_bytes(head[4..8].try_into().map_err(|_| FrameError::TooLong(0))?) as usize;
        at += ANSWER_HEAD_LEN;
        let entry = body.get(at..at + len).ok_or(FrameError::TooLong(len as u64))?;
        at += len;
        answers.push(match (status, len) {
            (Status::Mapped, _) => BatchAnswer::Mapped(Descriptor::decode(entry)?),
            (Status::TooSmall, 8) => {
                BatchAnswer::TooSmall(u64::from_le_bytes(entry.try_into().map_err(|_| FrameError::TooLong(8))?))
            }
            (
                Status::Miss | Status::Busy | Status::Unsupported | Status::Exists | Status::NoSpace | Status::Failed,
                0,
            ) => BatchAnswer::Other(status),
            _ => return Err(FrameError::BadStatus(status as u8)),
        });
    }
    if at != body.len() {
        return Err(FrameError::TooLong(body.len() as u64));
    }
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor() -> Descriptor {
        Descriptor { size: 10, lease_ns: 5, ranges: vec![(1, 0, 4), (2, 8, 6)], crc32c: Some(7) }
    }

    #[test]
    fn a_request_round_trips_and_must_end_exactly() {
        let entries = vec![BatchEntry { key: "a", cap: 1 }, BatchEntry { key: "bcd", cap: u64::MAX }];
        let body = encode_request(&entries);
        assert_eq!(decode_request(&body, 2).unwrap(), entries);
        assert!(decode_request(&body, 1).is_err(), "bytes left over");
        assert!(decode_request(&body, 3).is_err(), "a key missing");
        assert!(decode_request(&body, 0).is_err(), "no keys");
        assert!(decode_request(&body[..body.len() - 1], 2).is_err(), "a key cut short");
    }

    #[test]
    fn a_request_refuses_empty_long_and_non_utf8_keys() {
        let mut body = encode_request(&[BatchEntry { key: "k", cap: 1 }]);
        body[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(decode_request(&body[..12], 1).is_err(), "empty key");
        body[8..12].copy_from_slice(&(MAX_KEY_LEN as u32 + 1).to_le_bytes());
        assert!(decode_request(&body, 1).is_err(), "key too long");
        let mut bad = encode_request(&[BatchEntry { key: "k", cap: 1 }]);
        bad[12] = 0xff;
        assert!(decode_request(&bad, 1).is_err(), "not UTF-8");
        assert!(decode_request(&[], MAX_BATCH_KEYS as u64 + 1).is_err(), "too many keys");
    }

    #[test]
    fn a_reply_round_trips_every_answer_kind() {
        let answers = vec![
            BatchAnswer::Mapped(descriptor()),
            BatchAnswer::TooSmall(99),
            BatchAnswer::Other(Status::Miss),
            BatchAnswer::Other(Status::Busy),
            BatchAnswer::Other(Status::Unsupported),
        ];
        let mut body = Vec::new();
        for a in &answers {
            encode_answer(&mut body, a);
        }
        assert_eq!(decode_reply(&body, answers.len()).unwrap(), answers);
        assert!(decode_reply(&body, answers.len() - 1).is_err(), "bytes left over");
        assert!(decode_reply(&body, answers.len() + 1).is_err(), "an answer missing");
    }

    /// A `MAPPED` answer written straight from a holder's ranges is byte for byte the answer of
    /// the same descriptor, in the layout every client reads (pinned here by hand).
    #[test]
    fn a_mapped_answer_from_ranges_keeps_the_wire_layout() {
        let ranges = [(3u64, 4096u64, 1000u64), (4, 0, 24)];
        let mut direct = Vec::new();
        encode_mapped(&mut direct, 1024, 77, Some(0xDEAD_BEEF), ranges.iter().copied());
        let d = Descriptor { size: 1024, lease_ns: 77, ranges: ranges.to_vec(), crc32c: Some(0xDEAD_BEEF) };
        let mut built = Vec::new();
        encode_answer(&mut built, &BatchAnswer::Mapped(d.clone()));
        assert_eq!(direct, built);
        let mut expected = vec![Status::Mapped as u8, 0, 0, 0];
        expected.extend_from_slice(&(32u32 + 2 * 24).to_le_bytes());
        expected.extend_from_slice(&1024u64.to_le_bytes());
        expected.extend_from_slice(&77u64.to_le_bytes());
        expected.extend_from_slice(&2u32.to_le_bytes());
        expected.extend_from_slice(&[1, 0, 0, 0]);
        expected.extend_from_slice(&0xDEAD_BEEFu32.to_le_bytes());
        expected.extend_from_slice(&[0; 4]);
        for (region, offset, len) in ranges {
            for v in [region, offset, len] {
                expected.extend_from_slice(&v.to_le_bytes());
            }
        }
        assert_eq!(direct, expected);
        assert_eq!(decode_reply(&direct, 1).unwrap(), vec![BatchAnswer::Mapped(d)]);
        let mut too_small = Vec::new();
        encode_answer(&mut too_small, &BatchAnswer::TooSmall(5));
        assert_eq!(too_small, [&[Status::TooSmall as u8, 0, 0, 0, 8, 0, 0, 0][..], &5u64.to_le_bytes()].concat());
    }

    #[test]
    fn a_reply_refuses_statuses_that_are_no_answer() {
        for status in [Status::Ok, Status::BadRequest, Status::UnknownRegion] {
            let mut body = Vec::new();
            encode_answer(&mut body, &BatchAnswer::Other(status));
            assert!(decode_reply(&body, 1).is_err(), "{status:?}");
        }
        let mut body = Vec::new();
        encode_answer(&mut body, &BatchAnswer::Other(Status::Miss));
        body[4] = 1;
        body.push(0);
        assert!(decode_reply(&body, 1).is_err(), "a miss with an entry");
    }

    #[test]
    fn a_put_request_round_trips_and_refuses_what_is_no_value() {
        let entries = vec![
            PutEntry { key: "a", size: 1, checksum: PutChecksum::Given(0xdead_beef) },
            PutEntry { key: "bcd", size: 1 << 20, checksum: PutChecksum::None },
            PutEntry { key: "e", size: 7, checksum: PutChecksum::WhileCopying },
        ];
        let body = encode_put_request(&entries);
        assert_eq!(decode_put_request(&body, 3).unwrap(), entries);
        assert!(decode_put_request(&body, 2).is_err(), "bytes left over");
        assert!(decode_put_request(&body, 4).is_err(), "a key missing");
        let mut empty = encode_put_request(&[PutEntry { key: "k", size: 0, checksum: PutChecksum::None }]);
        assert!(decode_put_request(&empty, 1).is_err(), "an empty value");
        empty[0] = 1;
        empty[8] = 3;
        assert!(decode_put_request(&empty, 1).is_err(), "a checksum flag that is not 0, 1 or 2");
    }
}
