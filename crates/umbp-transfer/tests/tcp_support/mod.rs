//! Helpers shared by the TCP data-plane tests.

use std::ptr::NonNull;
use std::time::Duration;

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, TransferRef};
use umbp_transfer::{DataServerConfig, TcpEngine, TcpEngineConfig, TransferItem};

/// A heap buffer handed to engines as a host region. Tests only look at its bytes while no transfer
/// touches them.
#[derive(Debug)]
pub struct HostBuf {
    data: Vec<u8>,
}

impl HostBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        Self { data: vec![0u8; len] }
    }

    /// `len` copies of `byte`.
    pub fn filled(len: usize, byte: u8) -> Self {
        Self { data: vec![byte; len] }
    }

    /// `len` bytes of [`pattern`] `seed`.
    pub fn with_pattern(len: usize, seed: u64) -> Self {
        Self { data: pattern(len, seed) }
    }

    /// The buffer as a host region.
    pub fn region(&mut self) -> LocalRegion {
        let ptr = NonNull::new(self.data.as_mut_ptr()).expect("vec pointer is non-null");
        // SAFETY: every test declares its buffers before the engines they are registered with, so
        // the engines (locals drop in reverse order) stop before the buffers are freed.
        unsafe { LocalRegion::new(ptr, self.data.len() as u64, MemoryLocation::Host) }
    }

    /// Registers the buffer with `registrar`.
    pub fn register(&mut self, registrar: &dyn MemoryRegistrar) -> TransferRef {
        registrar.register_memory(self.region()).expect("host memory registers")
    }

    /// The bytes (only while no transfer touches them).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Deterministic bytes (xorshift), different per seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes()[..(len - out.len()).min(8)]);
    }
    out
}

/// An engine with [`fast_config`].
pub fn engine() -> TcpEngine {
    TcpEngine::new(fast_config()).expect("engine starts")
}

/// Small timeouts so failure paths finish quickly.
pub fn fast_config() -> TcpEngineConfig {
    let server = DataServerConfig { io_timeout: Duration::from_secs(5), ..DataServerConfig::default() };
    TcpEngineConfig {
        server,
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(5),
        ..TcpEngineConfig::default()
    }
}

/// A transfer item.
pub fn item(
    src: &TransferRef,
    src_offset: u64,
    dst: &TransferRef,
    dst_offset: u64,
    size: u64,
    tag: u64,
) -> TransferItem {
    TransferItem { src: src.clone(), src_offset, dst: dst.clone(), dst_offset, size, tag }
}
