//! The end-to-end value checksum: CRC-32C (Castagnoli), with the CPU's instruction where it has one
//! (SSE 4.2 on x86-64, the CRC extension on AArch64).
//!
//! A writer computes it over the value at put, the medium keeps it beside the key
//! ([`CommitRequest::crc32c`](crate::CommitRequest::crc32c)), and a reader checks the bytes it
//! copied against it ([`ResolvedEntry::crc32c`](crate::ResolvedEntry::crc32c)). One function, so
//! writers and readers can never disagree on the polynomial or the seed.

/// The CRC-32C of `value`.
pub fn value_crc32c(value: &[u8]) -> u32 {
    crc32c::crc32c(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_the_castagnoli_crc() {
        // The check value of CRC-32C (RFC 3720, appendix B.4).
        assert_eq!(value_crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(value_crc32c(&[]), 0);
        assert_ne!(value_crc32c(&[0]), value_crc32c(&[1]), "one flipped bit changes it");
    }
}
