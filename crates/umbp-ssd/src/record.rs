//! The on-drive record format.
//!
//! ```text
//! ┌──────────────── header block (4 KiB multiple) ────────────────┐┌──── value (4 KiB multiple) ────┐
//! │ magic u32 │ version u16 │ flags u16 │ key_len u32 │ header_crc │ value_size u64 │ seq u64 │     │
//! │ data_crc u32 │ value_crc u32 │ key bytes … │ zero padding      ││ value bytes … │ padding        │
//! └────────────────────────────────────────────────────────────────┘└────────────────────────────────┘
//! ```
//!
//! All integers are little-endian. `header_crc` is CRC-32C over the 40 header bytes (with the
//! `header_crc` field read as 0) followed by the key: a header that passes it names a record length
//! that can be trusted, so a scan can step over a record whose *value* is corrupt. `data_crc` is
//! CRC-32C over the key and then the value: the drive's integrity, computed and checked here.
//! `value_crc` (bytes 36..40, reserved and zero before it had a meaning) is the *writer's* CRC-32C
//! of the value (`CommitRequest::crc32c`), kept for the reader and never computed nor checked
//! here; it means something only with [`FLAG_VALUE_CRC`] set, so records written before it read as
//! having none (same format version). `seq` orders records of one key across the whole log (the
//! highest wins at recovery). Every record starts and ends on a 4 KiB boundary, so a record can be
//! read and written with `O_DIRECT` straight from and into staging pages.
//!
//! `flags`: [`FLAG_TOMBSTONE`], [`FLAG_VALUE_CRC`]; a header with any other bit set is not a
//! record this version can interpret (invalid, like a torn one).

/// Every record boundary is a multiple of this.
pub(crate) const ALIGN: u64 = 4096;
/// `"UMBP"` as a little-endian `u32`.
pub(crate) const MAGIC: u32 = 0x554D_4250;
/// The record format version this crate writes and reads.
pub(crate) const VERSION: u16 = 1;
/// Fixed header bytes before the key.
pub(crate) const FIXED: usize = 40;
/// `flags` bit: the record is a tombstone — its key was evicted at its `seq`, so no record of the
/// key with a smaller `seq` may be recovered. Its 8-byte value is the horizon: the highest segment id
/// that existed when the key was evicted (only those segments can hold older records of it).
pub(crate) const FLAG_TOMBSTONE: u16 = 1;
/// `flags` bit: the `value_crc` field holds the writer's CRC-32C of the value. Without it the
/// field means nothing (it was reserved, written as zero, before this bit existed).
pub(crate) const FLAG_VALUE_CRC: u16 = 2;
/// Every `flags` bit this version knows.
pub(crate) const KNOWN_FLAGS: u16 = FLAG_TOMBSTONE | FLAG_VALUE_CRC;

/// The longest key a record may carry (keys are prefix hashes: far shorter in practice).
pub(crate) const MAX_KEY_LEN: usize = 64 * 1024;

/// Rounds `n` up to the record alignment.
pub(crate) const fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Bytes of the header block of a record whose key is `key_len` bytes long.
pub(crate) const fn header_len(key_len: usize) -> u64 {
    align_up((FIXED + key_len) as u64)
}

/// Bytes a record of this key and value occupies on the drive.
pub(crate) const fn record_len(key_len: usize, value_size: u64) -> u64 {
    header_len(key_len) + align_up(value_size)
}

/// A decoded, header-CRC-verified header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) key: String,
    pub(crate) value_size: u64,
    pub(crate) seq: u64,
    pub(crate) data_crc: u32,
    pub(crate) flags: u16,
    /// The writer's CRC-32C of the value: `Some` exactly when `flags` has [`FLAG_VALUE_CRC`].
    pub(crate) value_crc: Option<u32>,
}

impl Header {
    /// The record's length on the drive; `None` when the header's `value_size` is too large to
    /// describe any record (the arithmetic would overflow).
    pub(crate) fn record_len(&self) -> Option<u64> {
        checked_record_len(self.key.len(), self.value_size)
    }

    /// Whether the header's flags and size agree: a tombstone carries exactly 8 value bytes (its
    /// horizon). A header that passes its CRC but not this is not a record this version wrote.
    pub(crate) fn well_formed(&self) -> bool {
        self.flags & FLAG_TOMBSTONE == 0 || self.value_size == 8
    }
}

/// [`record_len`] with checked arithmetic (`value_size` comes from the drive): `None` on overflow.
pub(crate) fn checked_record_len(key_len: usize, value_size: u64) -> Option<u64> {
    let value = value_size.checked_add(ALIGN - 1)? / ALIGN * ALIGN;
    header_len(key_len).checked_add(value)
}

/// Verifies a whole record read into `buf` (its header block, then its value and padding): the
/// header CRC, a length that fits `buf`, a well-formed header and the data CRC. Returns the header
/// and the value bytes; `None` for anything else. Nothing is sliced before the lengths are checked.
pub(crate) fn verify_record(buf: &[u8]) -> Option<(Header, &[u8])> {
    let h = decode_header(buf).ok()?;
    if !h.well_formed() {
        return None;
    }
    let len = usize::try_from(h.record_len()?).ok()?;
    if len > buf.len() {
        return None;
    }
    let hl = usize::try_from(header_len(h.key.len())).ok()?;
    let end = hl.checked_add(usize::try_from(h.value_size).ok()?)?;
    let body = buf.get(hl..end)?;
    (data_crc(h.key.as_bytes(), body) == h.data_crc).then_some((h, body))
}

/// Why a header block is not a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// The block is shorter than the header it claims (read more: `needed` bytes).
    Short { needed: usize },
    /// Not a record of ours, a torn write, or a corrupt header.
    Invalid,
}

/// CRC-32C of `key` followed by `value`.
pub(crate) fn data_crc(key: &[u8], value: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(key), value)
}

/// Writes the header block of a record into `block` (which must be `header_len(key.len())` bytes,
/// zeroed or not: the padding is zeroed here), with the writer's checksum `value_crc` if any.
pub(crate) fn encode_header(
    block: &mut [u8],
    key: &str,
    value_size: u64,
    seq: u64,
    data_crc: u32,
    value_crc: Option<u32>,
) {
    let flags = if value_crc.is_some() { FLAG_VALUE_CRC } else { 0 };
    encode_header_flags(block, key, value_size, seq, data_crc, flags, value_crc.unwrap_or(0));
}

/// [`encode_header`] with `flags` and the `value_crc` field as given, whatever they say (see
/// [`FLAG_TOMBSTONE`], [`FLAG_VALUE_CRC`]).
pub(crate) fn encode_header_flags(
    block: &mut [u8],
    key: &str,
    value_size: u64,
    seq: u64,
    data_crc: u32,
    flags: u16,
    value_crc: u32,
) {
    debug_assert_eq!(block.len() as u64, header_len(key.len()));
    block.fill(0);
    block[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    block[4..6].copy_from_slice(&VERSION.to_le_bytes());
    block[6..8].copy_from_slice(&flags.to_le_bytes());
    block[8..12].copy_from_slice(&(key.len() as u32).to_le_bytes());
    block[16..24].copy_from_slice(&value_size.to_le_bytes());
    block[24..32].copy_from_slice(&seq.to_le_bytes());
    block[32..36].copy_from_slice(&data_crc.to_le_bytes());
    block[36..40].copy_from_slice(&value_crc.to_le_bytes());
    block[FIXED..FIXED + key.len()].copy_from_slice(key.as_bytes());
    let crc = header_crc(block, key.len());
    block[12..16].copy_from_slice(&crc.to_le_bytes());
}

fn header_crc(block: &[u8], key_len: usize) -> u32 {
    let crc = crc32c::crc32c(&block[0..12]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &block[16..FIXED + key_len])
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

/// Decodes and verifies the header at the start of `block`.
pub(crate) fn decode_header(block: &[u8]) -> Result<Header, HeaderError> {
    if block.len() < FIXED {
        return Err(HeaderError::Short { needed: ALIGN as usize });
    }
    if u32_at(block, 0) != MAGIC || u16::from_le_bytes([block[4], block[5]]) != VERSION {
        return Err(HeaderError::Invalid);
    }
    let key_len = u32_at(block, 8) as usize;
    if key_len == 0 || key_len > MAX_KEY_LEN {
        return Err(HeaderError::Invalid);
    }
    if block.len() < FIXED + key_len {
        return Err(HeaderError::Short { needed: header_len(key_len) as usize });
    }
    if header_crc(block, key_len) != u32_at(block, 12) {
        return Err(HeaderError::Invalid);
    }
    let key = std::str::from_utf8(&block[FIXED..FIXED + key_len]).map_err(|_| HeaderError::Invalid)?.to_owned();
    let flags = u16::from_le_bytes([block[6], block[7]]);
    if flags & !KNOWN_FLAGS != 0 {
        // A flag this version does not know: not a record it can interpret.
        return Err(HeaderError::Invalid);
    }
    let value_crc = (flags & FLAG_VALUE_CRC != 0).then(|| u32_at(block, 36));
    Ok(Header {
        key,
        value_size: u64_at(block, 16),
        seq: u64_at(block, 24),
        data_crc: u32_at(block, 32),
        flags,
        value_crc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_any_flipped_byte() {
        let key = "prefix-hash-0042";
        let mut block = vec![0u8; header_len(key.len()) as usize];
        encode_header(&mut block, key, 12345, 7, 0xDEAD_BEEF, Some(0x8a91_36aa));
        let h = decode_header(&block).expect("valid header");
        let want = Header {
            key: key.into(),
            value_size: 12345,
            seq: 7,
            data_crc: 0xDEAD_BEEF,
            flags: FLAG_VALUE_CRC,
            value_crc: Some(0x8a91_36aa),
        };
        assert_eq!(h, want);
        let mut tomb = vec![0u8; header_len(key.len()) as usize];
        encode_header_flags(&mut tomb, key, 8, 9, 1, FLAG_TOMBSTONE, 0);
        assert_eq!(decode_header(&tomb).map(|h| h.flags), Ok(FLAG_TOMBSTONE));
        assert_eq!(h.record_len(), Some(4096 + 16384));
        for i in 0..FIXED + key.len() {
            let mut bad = block.clone();
            bad[i] ^= 0x01;
            assert!(decode_header(&bad).is_err(), "flipping byte {i} went unnoticed");
        }
    }

    #[test]
    fn long_keys_take_more_header_blocks() {
        assert_eq!(header_len(1), 4096);
        assert_eq!(header_len(4096 - FIXED), 4096);
        assert_eq!(header_len(4096 - FIXED + 1), 8192);
        let key = "k".repeat(5000);
        let mut block = vec![0u8; header_len(key.len()) as usize];
        encode_header(&mut block, &key, 1, 1, 0, None);
        assert_eq!(decode_header(&block[..4096]), Err(HeaderError::Short { needed: 8192 }));
        assert_eq!(decode_header(&block).map(|h| h.key), Ok(key));
    }

    #[test]
    fn a_crc_valid_header_with_an_absurd_size_is_no_record_and_never_panics() {
        let key = "k";
        let hl = header_len(key.len()) as usize;
        let mut buf = vec![0u8; hl + 4096];
        for size in [u64::MAX, u64::MAX - 4095, 1 << 62, 8193] {
            encode_header(&mut buf[..hl], key, size, 1, 0, None);
            let h = decode_header(&buf).expect("the header itself is valid");
            assert_eq!(h.record_len().is_none(), size > u64::MAX - 8192, "{size}: overflow detected");
            assert!(verify_record(&buf).is_none(), "{size}: a record longer than the buffer");
        }
        let value = [7u8; 100];
        buf[hl..hl + 100].copy_from_slice(&value);
        encode_header(&mut buf[..hl], key, 100, 1, data_crc(key.as_bytes(), &value), None);
        assert_eq!(verify_record(&buf).map(|(h, v)| (h.value_size, v.len())), Some((100, 100)));
    }

    #[test]
    fn a_tombstone_must_carry_exactly_eight_bytes() {
        let key = "k";
        let hl = header_len(key.len()) as usize;
        for size in [0u64, 3, 8, 9, 4096] {
            let mut buf = vec![0u8; hl + 4096];
            let crc = data_crc(key.as_bytes(), &buf[hl..hl + size as usize]);
            encode_header_flags(&mut buf[..hl], key, size, 1, crc, FLAG_TOMBSTONE, 0);
            assert_eq!(verify_record(&buf).is_some(), size == 8, "a tombstone of {size} bytes");
        }
    }

    /// The writer's checksum lives in the header's last fixed field, behind its flag: encoded with
    /// one, it decodes back; without, the header reads as having none.
    #[test]
    fn the_writers_checksum_round_trips_behind_its_flag() {
        let key = "k";
        let mut block = vec![0u8; header_len(key.len()) as usize];
        for crc in [0, 1, 0x8a91_36aa, u32::MAX] {
            encode_header(&mut block, key, 100, 3, 5, Some(crc));
            assert_eq!(&block[36..40], &crc.to_le_bytes(), "stored in the reserved field");
            let h = decode_header(&block).expect("a header with FLAG_VALUE_CRC is valid");
            assert_eq!((h.flags, h.value_crc), (FLAG_VALUE_CRC, Some(crc)));
            assert!(h.well_formed(), "the new flag is well formed");
        }
        encode_header(&mut block, key, 100, 3, 5, None);
        assert_eq!((decode_header(&block).map(|h| (h.flags, h.value_crc))), Ok((0, None)));
        // A field written without its flag means nothing (a record from before the flag existed
        // has zero there; any other value is ignored the same way).
        encode_header_flags(&mut block, key, 100, 3, 5, 0, 0x1234_5678);
        assert_eq!(decode_header(&block).map(|h| h.value_crc), Ok(None));
        // A whole record with a checksum verifies as before (the drive's CRC is another one).
        let hl = header_len(key.len()) as usize;
        let mut buf = vec![0u8; hl + 4096];
        buf[hl..hl + 100].fill(7);
        encode_header(&mut buf[..hl], key, 100, 3, data_crc(key.as_bytes(), &[7u8; 100]), Some(9));
        assert_eq!(verify_record(&buf).map(|(h, v)| (h.value_crc, v.len())), Some((Some(9), 100)));
    }

    /// A bit this version does not know still makes a header invalid, beside the known ones.
    #[test]
    fn an_unknown_flag_is_still_invalid() {
        let key = "k";
        let mut block = vec![0u8; header_len(key.len()) as usize];
        for known in [0, FLAG_TOMBSTONE, FLAG_VALUE_CRC, KNOWN_FLAGS] {
            encode_header_flags(&mut block, key, 8, 1, 0, known, 0);
            assert!(decode_header(&block).is_ok(), "flags {known:#x} are known");
            for bit in (0..16).map(|b| 1u16 << b).filter(|b| b & KNOWN_FLAGS == 0) {
                encode_header_flags(&mut block, key, 8, 1, 0, known | bit, 0);
                assert_eq!(decode_header(&block), Err(HeaderError::Invalid), "flags {:#x}", known | bit);
            }
        }
    }

    proptest::proptest! {
        /// Any header the encoder writes decodes to exactly what it was given.
        #[test]
        fn headers_round_trip(
            key in "[a-z0-9/-]{1,80}",
            value_size in 0u64..(1 << 40),
            seq: u64,
            data_crc: u32,
            value_crc: Option<u32>,
            tombstone: bool,
        ) {
            let mut block = vec![0u8; header_len(key.len()) as usize];
            let flags = if tombstone { FLAG_TOMBSTONE } else { 0 } | value_crc.map_or(0, |_| FLAG_VALUE_CRC);
            if tombstone {
                encode_header_flags(&mut block, &key, value_size, seq, data_crc, flags, value_crc.unwrap_or(0));
            } else {
                encode_header(&mut block, &key, value_size, seq, data_crc, value_crc);
            }
            let h = decode_header(&block).expect("an encoded header decodes");
            proptest::prop_assert_eq!(h, Header { key, value_size, seq, data_crc, flags, value_crc });
        }
    }

    #[test]
    fn zeroes_are_not_a_record() {
        assert_eq!(decode_header(&[0u8; 4096]), Err(HeaderError::Invalid));
    }
}
