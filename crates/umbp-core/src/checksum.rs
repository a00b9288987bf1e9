//! The end-to-end value checksum: CRC-32C (Castagnoli), folded with carry-less multiplies
//! (`crc-fast`: VPCLMULQDQ with AVX-512 where the CPU has it, PCLMULQDQ or the AArch64 PMULL
//! otherwise, a table without either). On this project's VM it sums 61–84 GB/s from cache and
//! ~15 GB/s from DRAM, against 15–21 and ~11 for the SSE 4.2 `crc32` loop.
//!
//! A writer computes it over the value at put, the medium keeps it beside the key
//! ([`CommitRequest::crc32c`](crate::CommitRequest::crc32c)), and a reader checks the bytes it
//! copied against it ([`ResolvedEntry::crc32c`](crate::ResolvedEntry::crc32c)). One function, so
//! writers and readers can never disagree on the polynomial or the seed.

/// The CRC-32C of `value`.
pub fn value_crc32c(value: &[u8]) -> u32 {
    // CRC-32/ISCSI is CRC-32C; its 32-bit value comes back widened to u64.
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, value) as u32
}

/// The CRC-32C of the value made of `parts` in order (a value assembled from ranges): the same
/// sum as [`value_crc32c`] of their concatenation.
pub fn value_crc32c_of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut digest = ValueCrc32c::new();
    for part in parts {
        digest.update(part);
    }
    digest.finish()
}

/// [`value_crc32c`] summed piece by piece, as the bytes arrive: a reader that copies a value in
/// blocks sums each block right after copying it, while it is still in cache.
#[derive(Debug, Clone)]
pub struct ValueCrc32c(crc_fast::Digest);

impl ValueCrc32c {
    /// Nothing summed yet.
    pub fn new() -> Self {
        Self(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }

    /// Adds the next bytes of the value.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The sum of everything added, in order.
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

impl Default for ValueCrc32c {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summed_in_pieces_is_the_sum_of_the_whole() {
        let value: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut d = ValueCrc32c::new();
        for block in value.chunks(4_096 + 7) {
            d.update(block);
        }
        assert_eq!(d.finish(), value_crc32c(&value));
        assert_eq!(ValueCrc32c::default().finish(), value_crc32c(&[]));
    }

    #[test]
    fn is_the_castagnoli_crc() {
        // The check value of CRC-32C (RFC 3720, appendix B.4).
        assert_eq!(value_crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(value_crc32c(&[]), 0);
        assert_ne!(value_crc32c(&[0]), value_crc32c(&[1]), "one flipped bit changes it");
        let whole: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let (a, rest) = whole.split_at(3);
        let (b, c) = rest.split_at(4093);
        assert_eq!(value_crc32c_of_parts([a, b, c]), value_crc32c(&whole), "parts sum as their concatenation");
        assert_eq!(value_crc32c_of_parts([&whole[..]]), value_crc32c(&whole));
        // The same function as the SSE 4.2 instruction's (the SSD record's CRC), at every length
        // around the folding loops' block sizes.
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for len in (0..300).chain([511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097, 5000]) {
            assert_eq!(value_crc32c(&data[..len]), crc32c::crc32c(&data[..len]), "length {len}");
        }
    }
}
