//! What one object holds and what it is named.
//!
//! An object is one value: a fixed header, the key, then the value.
//!
//! ```text
//! 0..8    magic "UMBPOBJ1"
//! 8..12   key length (u32, little endian)
//! 12..20  value length (u64)
//! 20..28  seq: the commit's sequence number (u64), also in the object's name
//! 28..32  CRC-32C of the value (computed by this medium at upload)
//! 32..36  the writer's CRC-32C of the value, as committed (kept, never checked by the medium)
//! 36..40  flags: bit 0 set when the writer committed a CRC-32C
//! 40..44  CRC-32C of bytes 0..40 and the key (the header's own check)
//! 44..    key, value
//! ```
//!
//! The name is `{prefix}{hex(key)}.{seq:016x}`: every commit writes a fresh name, so a delete of
//! an evicted value that lands late can never remove a newer value of the same key, and recovery
//! keeps the highest seq of a key. The header's own CRC lets recovery check an object from its
//! first bytes (a ranged read); the value's CRC is checked by every download.

use std::fmt;

/// The magic at the start of every object this medium writes.
const MAGIC: &[u8; 8] = b"UMBPOBJ1";
/// Bytes before the key.
pub(crate) const HEADER_LEN: usize = 44;
/// The longest key the medium stores: its hex form must fit an S3 object name (1,024 bytes) with a
/// prefix of up to [`MAX_PREFIX_LEN`] bytes and the seq.
pub(crate) const MAX_KEY_LEN: usize = 400;
/// The longest prefix (see [`MAX_KEY_LEN`]).
pub(crate) const MAX_PREFIX_LEN: usize = 200;

/// The fields of an object's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) key_len: u32,
    pub(crate) value_len: u64,
    pub(crate) seq: u64,
    pub(crate) value_crc: u32,
    /// The writer's checksum, when it committed one.
    pub(crate) writer_crc: Option<u32>,
}

/// Why an object's bytes are not a value this medium wrote.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RecordError {
    #[error("shorter ({0} bytes) than a header")]
    Short(usize),
    #[error("no UMBPOBJ1 magic: not an object this medium wrote")]
    Magic,
    #[error("header CRC mismatch (torn or overwritten object)")]
    HeaderCrc,
    #[error("{got} bytes, the header says {want}")]
    Length { got: u64, want: u64 },
    #[error("the object holds key {got:?}, not {want:?}")]
    Key { got: String, want: String },
    #[error("the header says seq {header}, the name {name}")]
    Seq { header: u64, name: u64 },
    #[error("value CRC mismatch")]
    ValueCrc,
}

/// The header and key of a value: `HEADER_LEN + key.len()` bytes.
pub(crate) fn encode_head(key: &str, value_len: u64, seq: u64, value_crc: u32, writer_crc: Option<u32>) -> Vec<u8> {
    let key_len = u32::try_from(key.len()).unwrap_or(u32::MAX);
    let mut out = Vec::with_capacity(HEADER_LEN + key.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key_len.to_le_bytes());
    out.extend_from_slice(&value_len.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&value_crc.to_le_bytes());
    out.extend_from_slice(&writer_crc.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&u32::from(writer_crc.is_some()).to_le_bytes());
    let head_crc = crc32c::crc32c_append(crc32c::crc32c(&out), key.as_bytes());
    out.extend_from_slice(&head_crc.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks the header at the start of `bytes` (which must hold at least the header and the key)
/// and returns it with the key.
pub(crate) fn decode_head(bytes: &[u8]) -> Result<(Header, String), RecordError> {
    if bytes.len() < HEADER_LEN {
        return Err(RecordError::Short(bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err(RecordError::Magic);
    }
    let key_len = u32_at(bytes, 8);
    let writer_crc = (u32_at(bytes, 36) & 1 == 1).then(|| u32_at(bytes, 32));
    let header = Header {
        key_len,
        value_len: u64_at(bytes, 12),
        seq: u64_at(bytes, 20),
        value_crc: u32_at(bytes, 28),
        writer_crc,
    };
    let key_end = HEADER_LEN + key_len as usize;
    if key_len as usize > MAX_KEY_LEN || bytes.len() < key_end {
        return Err(RecordError::Short(bytes.len()));
    }
    let want = crc32c::crc32c_append(crc32c::crc32c(&bytes[..40]), &bytes[HEADER_LEN..key_end]);
    if want != u32_at(bytes, 40) {
        return Err(RecordError::HeaderCrc);
    }
    let key = String::from_utf8(bytes[HEADER_LEN..key_end].to_vec()).map_err(|_| RecordError::HeaderCrc)?;
    Ok((header, key))
}

/// Checks a whole object against the key and seq it was fetched for; returns the value's bytes.
pub(crate) fn check_object<'a>(bytes: &'a [u8], key: &str, seq: u64) -> Result<(&'a [u8], Header), RecordError> {
    let (header, got) = decode_head(bytes)?;
    if got != key {
        return Err(RecordError::Key { got, want: key.to_owned() });
    }
    if header.seq != seq {
        return Err(RecordError::Seq { header: header.seq, name: seq });
    }
    let start = HEADER_LEN + key.len();
    let len = (bytes.len() - start) as u64;
    if len != header.value_len {
        return Err(RecordError::Length { got: len, want: header.value_len });
    }
    let value = &bytes[start..];
    if crc32c::crc32c(value) != header.value_crc {
        return Err(RecordError::ValueCrc);
    }
    Ok((value, header))
}

/// Bytes an object of a `key_len`-byte key and a `value_len`-byte value takes.
pub(crate) fn object_len(key_len: usize, value_len: u64) -> u64 {
    // Saturating: `value_len` may come from a damaged header.
    ((HEADER_LEN + key_len) as u64).saturating_add(value_len)
}

/// An object's name, parsed: the key and the commit's seq.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Name {
    pub(crate) key: String,
    pub(crate) seq: u64,
}

impl Name {
    /// The object name of `key`'s value committed as `seq`, under `prefix`.
    pub(crate) fn render(prefix: &str, key: &str, seq: u64) -> String {
        let mut out = String::with_capacity(prefix.len() + 2 * key.len() + 17);
        out.push_str(prefix);
        for b in key.as_bytes() {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        out.push('.');
        out.push_str(&format!("{seq:016x}"));
        out
    }

    /// Parses a listed object name under `prefix`; `None` for a name this medium never writes.
    pub(crate) fn parse(prefix: &str, name: &str) -> Option<Self> {
        let rest = name.strip_prefix(prefix)?;
        let (hex, seq) = rest.rsplit_once('.')?;
        let lower_hex = |t: &str| t.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
        // Exactly the form `render` writes, so a name parses back to one object only.
        if seq.len() != 16 || !lower_hex(seq) || hex.is_empty() || hex.len() % 2 != 0 || hex.len() > 2 * MAX_KEY_LEN {
            return None;
        }
        let seq = u64::from_str_radix(seq, 16).ok()?;
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let bytes: Option<Vec<u8>> =
            hex.as_bytes().chunks_exact(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect();
        let key = String::from_utf8(bytes?).ok()?;
        Some(Self { key, seq })
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}@{}", self.key, self.seq)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn object(key: &str, value: &[u8], seq: u64) -> Vec<u8> {
        let mut o = encode_head(key, value.len() as u64, seq, crc32c::crc32c(value), Some(0xfeed));
        o.extend_from_slice(value);
        o
    }

    #[test]
    fn an_object_round_trips_and_every_corruption_is_caught() {
        let o = object("k/ü", b"value bytes", 7);
        assert_eq!(o.len() as u64, object_len("k/ü".len(), 11));
        assert_eq!(check_object(&o, "k/ü", 7).map(|(v, _)| v), Ok(&b"value bytes"[..]));
        let (h, key) = decode_head(&o[..HEADER_LEN + "k/ü".len()]).expect("the head alone checks");
        assert_eq!((h.value_len, h.seq, h.writer_crc, key.as_str()), (11, 7, Some(0xfeed), "k/ü"));
        let none = encode_head("k", 1, 1, 0, None);
        assert_eq!(decode_head(&none).map(|(h, _)| h.writer_crc), Ok(None), "no writer checksum stays none");
        assert_eq!(check_object(&o, "other", 7), Err(RecordError::Key { got: "k/ü".into(), want: "other".into() }));
        assert_eq!(check_object(&o, "k/ü", 8), Err(RecordError::Seq { header: 7, name: 8 }));
        assert_eq!(check_object(&o[..o.len() - 1], "k/ü", 7), Err(RecordError::Length { got: 10, want: 11 }));
        for at in [0, 9, 13, 21, 30, 33, 37, 41, HEADER_LEN + 1] {
            let mut bad = o.clone();
            bad[at] ^= 0x40;
            assert!(check_object(&bad, "k/ü", 7).is_err(), "a flipped header byte {at} passed");
        }
        let mut bad = o.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(check_object(&bad, "k/ü", 7).map(|(v, _)| v), Err(RecordError::ValueCrc));
        assert_eq!(decode_head(&o[..10]), Err(RecordError::Short(10)));
    }

    #[test]
    fn names_round_trip_and_foreign_names_are_refused() {
        let n = Name::render("p/", "a key/ü", 0xabc);
        assert!(n.starts_with("p/") && n.ends_with(".0000000000000abc"), "{n}");
        assert_eq!(Name::parse("p/", &n), Some(Name { key: "a key/ü".into(), seq: 0xabc }));
        for foreign in [
            "q/6b.0000000000000001",
            "p/6b",
            "p/6b.1",
            "p/6.0000000000000001",
            "p/zz.0000000000000001",
            "p/.0000000000000001",
            "p/6b.000000000000000A",
            "p/6b.+00000000000000a",
            "p/6B.0000000000000001",
        ] {
            assert_eq!(Name::parse("p/", foreign), None, "{foreign}");
        }
        assert!(Name::render("", &"k".repeat(MAX_KEY_LEN), u64::MAX).len() + MAX_PREFIX_LEN <= 1024);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

        /// What a store hands back is untrusted: any bytes decode to an error or a head, never a
        /// panic, and a damaged object of this medium is an error or the very value it holds.
        #[test]
        fn any_bytes_decode_without_panicking(data in proptest::collection::vec(any::<u8>(), 0..160)) {
            let _ = decode_head(&data);
            let _ = check_object(&data, "k", 1);
            if let Ok((h, key)) = decode_head(&data) {
                prop_assert_eq!(h.key_len as usize, key.len());
                let _ = object_len(key.len(), h.value_len);
            }
        }

        #[test]
        fn a_mutated_object_is_an_error_or_its_own_value(
            value in proptest::collection::vec(any::<u8>(), 0..64),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
            cut in any::<usize>(),
        ) {
            let mut o = encode_head("key", value.len() as u64, 9, crc32c::crc32c(&value), None);
            o.extend_from_slice(&value);
            for (at, byte) in edits {
                let i = at % o.len();
                o[i] = byte;
            }
            if cut % 3 == 0 {
                o.truncate(cut % (o.len() + 1));
            }
            if let Ok((got, _)) = check_object(&o, "key", 9) {
                prop_assert_eq!(got, value.as_slice(), "a damaged object passed with other bytes");
            }
        }

        #[test]
        fn any_name_parses_without_panicking(name in ".{0,80}") {
            if let Some(n) = Name::parse("p/", &name) {
                prop_assert_eq!(Name::render("p/", &n.key, n.seq), name);
            }
        }
    }
}
