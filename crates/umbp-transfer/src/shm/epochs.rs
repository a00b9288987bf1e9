//! The epoch table: one 64-bit word per region slot in a sealed memory file, written by the server
//! and mapped read-only by every client. A slot holds the epoch of the region registered in it, or
//! 0 when none is; epochs are never reused by a server, so "the word still equals my epoch" means
//! "my mapping is of the region as it is registered now".

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// Bytes per slot.
const SLOT: usize = std::mem::size_of::<u64>();

/// A mapping of an epoch table: the server's (read-write) or a client's (read-only).
#[derive(Debug)]
pub(crate) struct EpochTable {
    base: NonNull<AtomicU64>,
    slots: u32,
    map_len: usize,
}

// SAFETY: the table is a mapping of plain words accessed only through atomics; it has no thread
// affinity.
unsafe impl Send for EpochTable {}
// SAFETY: as above; every access is an atomic load or store.
unsafe impl Sync for EpochTable {}

impl EpochTable {
    /// A fresh table of `slots` zeroed words, and the file to pass to clients: sealed against
    /// shrinking, growing and any new writable mapping (`F_SEAL_FUTURE_WRITE`), so only this mapping
    /// can change it and a client can map it only read-only.
    pub(crate) fn create(slots: u32) -> io::Result<(Self, OwnedFd)> {
        let map_len = table_len(slots)?;
        let fd = rustix::fs::memfd_create("umbp-shm-epochs", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, map_len as u64)?;
        let table = Self::map(&fd, slots, map_len, ProtFlags::READ | ProtFlags::WRITE)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL)?;
        Ok((table, fd))
    }

    /// Maps a table of `slots` words a server passed, read-only; refuses a file that is too short or
    /// could shrink (a read past its end would be a `SIGBUS`).
    pub(crate) fn open(fd: impl AsFd, slots: u32) -> io::Result<Self> {
        let map_len = table_len(slots)?;
        check_backing(&fd, 0, map_len as u64)?;
        Self::map(&fd, slots, map_len, ProtFlags::READ)
    }

    fn map(fd: impl AsFd, slots: u32, map_len: usize, prot: ProtFlags) -> io::Result<Self> {
        // SAFETY: a null hint and no MAP_FIXED: a fresh range; the file holds `map_len` bytes.
        let ptr = unsafe { rustix::mm::mmap(ptr::null_mut(), map_len, prot, MapFlags::SHARED, fd, 0) }?;
        let base = NonNull::new(ptr.cast::<AtomicU64>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { base, slots, map_len })
    }

    /// Slots in the table.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// The epoch in `slot` (0: none, or a slot past the table).
    pub(crate) fn load(&self, slot: u32) -> u64 {
        if slot >= self.slots {
            return 0;
        }
        // SAFETY: `slot < slots`, inside the live mapping of `slots` aligned words (page-aligned
        // base); every access to the words is atomic.
        unsafe { (*self.base.as_ptr().add(slot as usize)).load(Ordering::Acquire) }
    }

    /// Sets `slot` to `epoch`. Only the server's read-write mapping may call this.
    pub(crate) fn store(&self, slot: u32, epoch: u64) {
        if slot >= self.slots {
            return;
        }
        // SAFETY: as in `load`; the server maps its table read-write.
        unsafe { (*self.base.as_ptr().add(slot as usize)).store(epoch, Ordering::Release) }
    }
}

impl Drop for EpochTable {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `map_len` bytes, unmapped once.
        if let Err(err) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.map_len) } {
            tracing::error!(error = %err, "munmap of an epoch table failed");
        }
    }
}

/// Bytes of a table of `slots` words, rounded to a page.
fn table_len(slots: u32) -> io::Result<usize> {
    if slots == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "an epoch table of 0 slots"));
    }
    Ok((slots as usize * SLOT).next_multiple_of(4096))
}

/// Checks that `fd` is a file at least `offset + len` bytes long and sealed against shrinking, so a
/// mapping of that range can never fault for lack of a page.
pub(crate) fn check_backing(fd: impl AsFd, offset: u64, len: u64) -> io::Result<()> {
    let seals = rustix::fs::fcntl_get_seals(&fd)?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "the file is not sealed against shrinking"));
    }
    let size = u64::try_from(rustix::fs::fstat(&fd)?.st_size).unwrap_or(0);
    match offset.checked_add(len) {
        Some(end) if end <= size && len > 0 => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{len} bytes at {offset} do not fit a file of {size} bytes"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_sees_the_servers_stores_and_cannot_write() {
        let (server, fd) = EpochTable::create(1000).expect("table");
        let client = EpochTable::open(&fd, 1000).expect("a read-only mapping");
        assert_eq!(client.load(7), 0);
        server.store(7, 42);
        assert_eq!(client.load(7), 42);
        assert_eq!(client.load(1000), 0, "past the table reads as none");
        // F_SEAL_FUTURE_WRITE: no new writable shared mapping of the file.
        // SAFETY: a fresh range if it succeeded (it must not), unmapped below.
        let writable = unsafe {
            rustix::mm::mmap(ptr::null_mut(), 4096, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        };
        if let Ok(p) = writable {
            // SAFETY: unmapping what was just mapped.
            let _ = unsafe { rustix::mm::munmap(p, 4096) };
            panic!("a client could map the epoch table writable");
        }
        assert_eq!(rustix::fs::ftruncate(&fd, 0), Err(rustix::io::Errno::PERM));
        assert!(EpochTable::open(&fd, 100_000).is_err(), "a table longer than its file is refused");
    }

    #[test]
    fn backing_checks_refuse_unsealed_and_short_files() {
        let plain = rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
        rustix::fs::ftruncate(&plain, 8192).expect("size");
        assert!(check_backing(&plain, 0, 4096).is_err(), "not sealed against shrinking");
        rustix::fs::fcntl_add_seals(&plain, SealFlags::SHRINK).expect("seal");
        assert!(check_backing(&plain, 0, 8192).is_ok());
        assert!(check_backing(&plain, 4096, 4096).is_ok());
        assert!(check_backing(&plain, 4096, 4097).is_err(), "past the end");
        assert!(check_backing(&plain, u64::MAX, 2).is_err(), "overflow");
        assert!(check_backing(&plain, 0, 0).is_err(), "empty");
    }
}
