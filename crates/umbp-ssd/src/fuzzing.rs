//! Fuzzing entry points (issue 19): bytes read back from a drive, handed to the record decoder and
//! to restart recovery. Not API: hidden from the docs, called by the `fuzz/` crate's targets
//! (coverage-guided, long runs) and by `tests/fuzz_ssd.rs` (proptest, bounded, in CI). Each entry
//! point panics when a property fails, which is what both drivers catch.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, MemoryRegistrar};

use crate::record::{self, FIXED, FLAG_TOMBSTONE, FLAG_VALUE_CRC, HeaderError, KNOWN_FLAGS, MAX_KEY_LEN};
use crate::store::SegmentFile;
use crate::{IoEngineKind, SsdBackend, SsdConfig};

/// Decodes `data` as a record header block and as a whole record. Properties: a decoded header
/// says only what its bytes say (it encodes back to them, the writer's checksum field aside when
/// its flag is clear), a `Short` answer asks for more than was given, and a verified record lies
/// inside `data` and matches its CRC.
pub fn record(data: &[u8]) {
    match record::decode_header(data) {
        Ok(h) => {
            let klen = h.key.len();
            assert!((1..=MAX_KEY_LEN).contains(&klen), "a key of {klen} bytes");
            assert!(h.flags & !KNOWN_FLAGS == 0, "an unknown flag accepted");
            assert_eq!(h.value_crc.is_some(), h.flags & FLAG_VALUE_CRC != 0, "a writer's checksum iff its flag");
            let mut block = vec![0u8; record::header_len(klen) as usize];
            let value_crc = h.value_crc.unwrap_or(0);
            record::encode_header_flags(&mut block, &h.key, h.value_size, h.seq, h.data_crc, h.flags, value_crc);
            let (mut want, got) = (data[..FIXED + klen].to_vec(), &block[..FIXED + klen]);
            if h.value_crc.is_none() {
                want[36..40].fill(0);
            }
            assert_eq!(&want[..FIXED], &got[..FIXED], "a header re-encodes to its fixed fields");
            assert_eq!(&want[FIXED..], &got[FIXED..], "a header re-encodes to its key");
        }
        Err(HeaderError::Short { needed }) => assert!(needed > data.len(), "Short asks for {needed} of {}", data.len()),
        Err(HeaderError::Invalid) => {}
    }
    if let Some((h, body)) = record::verify_record(data) {
        assert_eq!(body.len() as u64, h.value_size, "the body is the value's size");
        let len = h.record_len().expect("a verified record has a length");
        assert!(len <= data.len() as u64, "a verified record inside the buffer");
        assert_eq!(record::data_crc(h.key.as_bytes(), body), h.data_crc, "a verified record matches its CRC");
        assert!(h.well_formed(), "a verified record is well formed");
    }
}

/// Record blocks for `record`, made by the encoder: a value, a value with the writer's
/// checksum, a tombstone, a key that takes two header blocks.
pub fn record_seeds() -> Vec<Vec<u8>> {
    let one = |key: &str, value: &[u8], seq: u64, flags: u16| {
        let hl = record::header_len(key.len()) as usize;
        let mut buf = vec![0u8; record::record_len(key.len(), value.len() as u64) as usize];
        buf[hl..hl + value.len()].copy_from_slice(value);
        let crc = record::data_crc(key.as_bytes(), value);
        let value_crc = if flags & FLAG_VALUE_CRC != 0 { crc32c::crc32c(value) } else { 0 };
        record::encode_header_flags(&mut buf[..hl], key, value.len() as u64, seq, crc, flags, value_crc);
        buf
    };
    vec![
        one("prefix-hash-0042", &[7u8; 100], 3, 0),
        one("prefix-hash-0043", &[8u8; 200], 6, FLAG_VALUE_CRC),
        one("evicted", &9u64.to_le_bytes(), 4, FLAG_TOMBSTONE),
        one(&"k".repeat(4100), b"long key", 5, 0),
    ]
}

/// A directory under the system's temporary directory, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("umbp-ssd-fuzz-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path).expect("a scratch directory");
        Self(path)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const PAGE: u64 = 4096;

fn config(dir: &Path) -> SsdConfig {
    SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(64 * PAGE)
        .staging_pages(16)
        .max_value_pages(4)
        .segment_bytes(1 << 20)
        .direct_io(false)
        .preallocate(false)
        .watermarks(None)
        .io_engine(IoEngineKind::Psync)
        .build()
        .expect("a valid fuzzing config")
}

/// Registers the staging arena with nobody, as a medium on a node without peers would.
#[derive(Debug)]
struct NoPeers;

impl MemoryRegistrar for NoPeers {
    fn register_memory(
        &self,
        region: umbp_core::LocalRegion,
    ) -> Result<umbp_core::TransferRef, umbp_core::RegistrationError> {
        Ok(umbp_core::TransferRef::local(region))
    }

    fn deregister(&self, _r: &umbp_core::TransferRef) {}
}

fn arena(b: &SsdBackend) -> NonNull<u8> {
    let r = b.buffer_ref(0).expect("a live backend publishes its arena");
    r.local_region().expect("the arena is local memory").ptr()
}

/// `key`'s value and the writer's checksum it was committed with, if it is served.
fn get(b: &SsdBackend, key: &str) -> Option<Served> {
    let r = b.batch_resolve(&[key.to_owned()], false).remove(0);
    if !r.found {
        return None;
    }
    let mut out = Vec::with_capacity(r.size as usize);
    let mut left = r.size;
    for page in &r.pages {
        let n = left.min(PAGE);
        // SAFETY: the page is inside the arena and leased to this reader until the release below.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(arena(b).as_ptr().add((u64::from(page.page_index) * PAGE) as usize), n as usize)
        });
        left -= n;
    }
    b.release_reads(&[umbp_core::ReadRelease::new(key, r.lease)]);
    Some((out, r.crc32c))
}

/// A record's value and its writer's checksum.
type Served = (Vec<u8>, Option<u32>);

/// Every record of `data` that passes both CRCs wherever it starts on a 4 KiB boundary: the
/// values (with their writer's checksums) a recovery of `data` may serve, by key.
fn candidates(data: &[u8]) -> std::collections::HashMap<String, Vec<Served>> {
    let mut out: std::collections::HashMap<String, Vec<Served>> = Default::default();
    for at in (0..data.len()).step_by(record::ALIGN as usize) {
        if let Some((h, body)) = record::verify_record(&data[at..]) {
            out.entry(h.key).or_default().push((body.to_vec(), h.value_crc));
        }
    }
    out
}

/// Recovers a backend from `data` as its one segment file. Properties: a corrupt segment never
/// fails `init` or panics, and every key it then serves comes back with the bytes and the writer's
/// checksum of one record of that key in `data` that passes both CRCs — never other bytes, never
/// another record's checksum. Returns how many keys it served.
pub fn recovery(data: &[u8]) -> usize {
    let dir = ScratchDir::new();
    std::fs::write(dir.0.join(SegmentFile::segment_name(1)), data).expect("writing the segment");
    let b = SsdBackend::new(config(&dir.0));
    b.init(Arc::new(NoPeers)).expect("a corrupt segment is not an init error");
    let valid = candidates(data);
    let mut served = 0;
    for (key, values) in &valid {
        if let Some(got) = get(&b, key) {
            served += 1;
            assert!(values.contains(&got), "{key} served bytes or a checksum no valid record of it holds");
        }
    }
    assert!(b.owned_key_count() >= served, "a key served that is not owned");
    b.shutdown();
    served
}

/// Segment files written by the backend itself: puts of several sizes, with and without the
/// writer's checksum, a key evicted (its tombstone) and put again with other bytes.
pub fn segment_seeds() -> Vec<Vec<u8>> {
    let dir = ScratchDir::new();
    let b = SsdBackend::new(config(&dir.0));
    b.init(Arc::new(NoPeers)).expect("a fresh backend");
    let put = |key: &str, bytes: &[u8]| {
        let a = b.batch_allocate(&[AllocateRequest::new(key, bytes.len() as u64)]).remove(0);
        assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocating {key}");
        for (chunk, page) in bytes.chunks(PAGE as usize).zip(&a.pages) {
            // SAFETY: the page is inside the registered arena and reserved for this slot.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    arena(&b).as_ptr().add((u64::from(page.page_index) * PAGE) as usize),
                    chunk.len(),
                )
            };
        }
        let crc = (key != "c").then(|| crc32c::crc32c(bytes));
        let commit = CommitRequest::new(a.slot_id, key).with_crc32c(crc);
        assert!(b.batch_commit(&[commit])[0].success, "committing {key}");
    };
    put("a", &[1u8; 100]);
    put("b", &(0..5000u32).map(|i| i as u8).collect::<Vec<_>>());
    put("c", b"c");
    let _ = b.evict(&["a".to_owned()]);
    put("a", &[2u8; 300]);
    b.shutdown();
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir.0)
        .expect("the directory")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).and_then(SegmentFile::parse_name).is_some())
        .collect();
    names.sort();
    let whole: Vec<u8> = names.iter().flat_map(|p| std::fs::read(p).expect("a segment file")).collect();
    vec![whole]
}
