//! `CxlPageMemorySource`, `CxlConfig` and `make_cxl_backend`.

use std::ffi::c_void;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use parking_lot::Mutex;
use rustix::fs::FallocateFlags;
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};
use umbp_core::{BackendError, MediumBackend, MemoryLocation, TierType};
use umbp_page::{PageBackend, PageBackendConfig, PageMemorySource, RawBuffer, SourceError};

const NAME: &str = "CxlPageMemorySource";
/// A device-DAX device's mapping alignment when sysfs does not say (the kernel's default `align`).
pub const DEFAULT_DAX_ALIGN: u64 = 2 << 20;
/// Where the kernel describes device-DAX devices (`<name>/align`, `<name>/size`).
const DAX_SYSFS: &str = "/sys/bus/dax/devices";

/// Errors of opening the CXL medium's device or file. Each names the path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CxlError {
    /// No path was configured.
    #[error("cxl medium: no path configured (a /dev/daxX.Y device or a file)")]
    NoPath,
    /// The path is a directory (or a block device, socket, …): only a character device or a file maps.
    #[error("cxl medium: {path} is a {kind}, not a device-DAX device or a file")]
    NotMappable {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The path could not be opened for reading and writing (missing parent, permissions, …).
    #[error("cxl medium: cannot open {path} for reading and writing")]
    Open {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A device smaller than the capacity (a device cannot grow).
    #[error("cxl medium: {path} holds {size} bytes, less than the {capacity} bytes asked for")]
    TooSmall {
        /// The path.
        path: PathBuf,
        /// The device's size.
        size: u64,
        /// The capacity (rounded up to the alignment).
        capacity: u64,
    },
    /// A file shorter than the capacity that could not be grown to it (a full or read-only filesystem,
    /// a file-size limit).
    #[error("cxl medium: cannot grow {path} to {capacity} bytes")]
    Grow {
        /// The path.
        path: PathBuf,
        /// The capacity (rounded up to the alignment).
        capacity: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A capacity of zero, or one that overflows when rounded to the alignment.
    #[error("cxl medium: {path}: invalid capacity {capacity} (alignment {align})")]
    Capacity {
        /// The path.
        path: PathBuf,
        /// The configured capacity.
        capacity: u64,
        /// The mapping alignment.
        align: u64,
    },
    /// The backend configuration is invalid (a page larger than the capacity, …).
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl CxlError {
    /// What the caller should do next: a backend error answers for itself; every other error is a
    /// setting or a machine to fix ([`InvalidInput`](umbp_core::ErrorKind::InvalidInput)).
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Backend(err) => err.kind(),
            _ => umbp_core::ErrorKind::InvalidInput,
        }
    }
}

/// Settings of a CXL medium: the one place their names (the settings file's `[node.cxl]` keys),
/// defaults and meaning are written.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CxlConfig {
    /// The device-DAX device (`/dev/daxX.Y`), the file on a DAX-mounted filesystem, or a regular or
    /// tmpfs file standing in for them. A file shorter than the capacity is grown (and its blocks
    /// reserved). Default: none (required).
    pub path: Option<PathBuf>,
    /// Bytes to lend from the start of the device or file (`"1GiB"` or bytes), rounded up to the
    /// mapping alignment. Default: 1 GiB.
    #[serde(with = "umbp_core::units::serde::size")]
    pub capacity_bytes: u64,
}

impl Default for CxlConfig {
    fn default() -> Self {
        Self { path: None, capacity_bytes: 1 << 30 }
    }
}

impl CxlConfig {
    /// Lends `capacity_bytes` of `path`.
    pub fn new(path: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        Self { path: Some(path.into()), capacity_bytes }
    }
}

/// Live mappings and the next free offset of the device or file.
#[derive(Default)]
struct Mapped {
    buffers: Vec<(NonNull<u8>, usize)>,
    next_offset: u64,
}

/// Memory of a device-DAX device or a file as a [`PageMemorySource`]: each buffer is a `MAP_SHARED`
/// mapping of the next aligned range of the device or file, up to the capacity. The memory is host
/// memory ([`MemoryLocation::Host`]): the CPU loads and stores it like DRAM, so the transfer layer's
/// host engines copy it. Dropping the source unmaps it.
pub struct CxlPageMemorySource {
    path: PathBuf,
    file: File,
    align: u64,
    /// The mapped length the device or file holds: the capacity rounded up to `align`.
    limit: u64,
    mapped: Mutex<Mapped>,
}

// SAFETY: the source holds addresses of its own shared mappings; they carry no thread affinity and are
// only unmapped under the mutex.
unsafe impl Send for CxlPageMemorySource {}
// SAFETY: as above; every access to `mapped` is under its mutex.
unsafe impl Sync for CxlPageMemorySource {}

impl fmt::Debug for CxlPageMemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("path", &self.path)
            .field("align", &self.align)
            .field("limit", &self.limit)
            .field("buffers", &self.mapped.lock().buffers.len())
            .finish()
    }
}

impl CxlPageMemorySource {
    /// Opens `config.path` and makes sure it holds the capacity: a device-DAX device must be at least
    /// that large (its size and alignment read from sysfs, alignment 2 MiB when sysfs does not say);
    /// a regular file shorter than that is grown, with its blocks reserved (`fallocate`) so a full
    /// filesystem is an error here and not a `SIGBUS` on a later copy. Nothing is mapped until
    /// [`allocate`](PageMemorySource::allocate).
    pub fn open(config: &CxlConfig) -> Result<Self, CxlError> {
        let path = config.path.clone().filter(|p| !p.as_os_str().is_empty()).ok_or(CxlError::NoPath)?;
        // A missing path is created as a file; an existing one is checked before it is opened, so
        // a directory or a FIFO is named rather than failing to open (or blocking).
        let existing = match std::fs::metadata(&path) {
            Ok(meta) => Some(meta),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => return Err(CxlError::Open { path, source }),
        };
        let is_device = match existing.as_ref().map(std::fs::Metadata::file_type) {
            None => false,
            Some(t) if t.is_file() => false,
            Some(t) if t.is_char_device() => true,
            Some(t) => {
                let kind = if t.is_dir() {
                    "directory"
                } else if t.is_block_device() {
                    "block device"
                } else {
                    "special file"
                };
                return Err(CxlError::NotMappable { path, kind });
            }
        };
        let file = match OpenOptions::new().read(true).write(true).create(!is_device).open(&path) {
            Ok(file) => file,
            Err(source) => return Err(CxlError::Open { path, source }),
        };
        let (align, device_size) = if is_device {
            let rdev = existing.as_ref().map_or(0, std::os::unix::fs::MetadataExt::rdev);
            dax_geometry(&dax_sysfs_dir(&path, rdev))
        } else {
            (page_size(), None)
        };
        let capacity = config.capacity_bytes;
        let limit = capacity
            .checked_next_multiple_of(align)
            .filter(|&l| l > 0 && usize::try_from(l).is_ok())
            .ok_or_else(|| CxlError::Capacity { path: path.clone(), capacity, align })?;
        if is_device {
            if let Some(size) = device_size.filter(|&size| size < limit) {
                return Err(CxlError::TooSmall { path, size, capacity: limit });
            }
        } else {
            let len = file.metadata().map_err(|source| CxlError::Open { path: path.clone(), source })?.size();
            if len < limit
                && let Err(source) = reserve(&file, limit)
            {
                // A failed fallocate may keep the blocks it got before running out: give them back
                // (remove a file this call created, cut one that existed back to its length).
                let undo = if existing.is_none() { std::fs::remove_file(&path) } else { file.set_len(len) };
                if let Err(e) = undo {
                    tracing::warn!(source = NAME, path = %path.display(), error = %e, "could not undo a failed grow");
                }
                return Err(CxlError::Grow { path, capacity: limit, source });
            }
        }
        Ok(Self { path, file, align, limit, mapped: Mutex::new(Mapped::default()) })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapping alignment: the device's `align`, or the base page size for a file.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// The bytes of the device or file this source may map: the capacity rounded up to
    /// [`align`](Self::align).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn failure(&self, requested: u64, source: io::Error) -> SourceError {
        SourceError::Allocation { source_name: format!("{NAME}({})", self.path.display()), requested, source }
    }

    fn unmap(buffers: Vec<(NonNull<u8>, usize)>) {
        for (base, len) in buffers {
            // SAFETY: each (base, len) is a live mapping made by `allocate` and unmapped once (it was
            // taken out of `mapped`, or never added); `release`'s contract says the caller
            // deregistered it, so no copy uses it.
            if let Err(e) = unsafe { rustix::mm::munmap(base.as_ptr().cast::<c_void>(), len) } {
                tracing::warn!(source = NAME, bytes = len, error = %e, "munmap failed");
            }
        }
    }
}

impl Drop for CxlPageMemorySource {
    fn drop(&mut self) {
        self.release();
    }
}

impl PageMemorySource for CxlPageMemorySource {
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
        let mut mapped = self.mapped.lock();
        let mut offset = mapped.next_offset;
        let mut taken: Vec<(NonNull<u8>, usize)> = Vec::new();
        for &size in sizes.iter().filter(|&&s| s != 0) {
            let len = size.checked_next_multiple_of(self.align).filter(|&len| len <= self.limit - offset);
            let Some(len) = len else {
                Self::unmap(taken);
                let reason = format!(
                    "{size} bytes at offset {offset} run past the {} bytes of {}",
                    self.limit,
                    self.path.display()
                );
                return Err(SourceError::Invalid { source_name: NAME.into(), reason });
            };
            // `len <= limit`, which `open` checked fits `usize`.
            let len_usize = usize::try_from(len).unwrap_or(usize::MAX);
            // SAFETY: a fresh shared mapping of our own open file at an aligned offset inside the range
            // `open` made sure the file or device holds; it overlaps no Rust object.
            let mapped_at = unsafe {
                rustix::mm::mmap(
                    std::ptr::null_mut(),
                    len_usize,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED,
                    &self.file,
                    offset,
                )
            };
            match mapped_at.map(|p| NonNull::new(p.cast::<u8>())) {
                Ok(Some(base)) => taken.push((base, len_usize)),
                Ok(None) | Err(_) => {
                    Self::unmap(taken);
                    let error = mapped_at.err().map_or_else(|| io::Error::other("mmap returned null"), io::Error::from);
                    return Err(self.failure(size, error));
                }
            }
            offset += len;
        }
        let out = taken
            .iter()
            // SAFETY: each base is a live read-write mapping of exactly `len` bytes, valid until
            // `release` unmaps it.
            .map(|&(base, len)| unsafe { RawBuffer::new(base, len as u64) })
            .collect();
        mapped.buffers.extend(taken);
        mapped.next_offset = offset;
        Ok(out)
    }

    fn release(&self) {
        let buffers = {
            let mut mapped = self.mapped.lock();
            mapped.next_offset = 0;
            std::mem::take(&mut mapped.buffers)
        };
        Self::unmap(buffers);
    }

    /// Host memory: CXL Type-3 memory and persistent memory are loads and stores of the CPU, and
    /// `MemoryLocation` has no variant that would make an engine treat them differently (it tells host
    /// memory from one GPU's device memory, which is what picks an engine).
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }

    fn name(&self) -> &str {
        NAME
    }
}

/// The system's base page size.
fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// Extends `file` to `len` bytes with its blocks reserved, so a full filesystem fails now rather than
/// as a `SIGBUS` on a store into the mapping; a filesystem without `fallocate` is only extended.
fn reserve(file: &File, len: u64) -> io::Result<()> {
    match rustix::fs::fallocate(file, FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(Errno::OPNOTSUPP) => {
            tracing::warn!(source = NAME, bytes = len, "fallocate unsupported; file extended without reserving blocks");
            file.set_len(len)
        }
        Err(e) => Err(e.into()),
    }
}

/// The sysfs directory of a device-DAX device: by its name under `/sys/bus/dax/devices`, or, for a
/// device reached through another name (a symlink, a udev alias), by its number under `/sys/dev/char`.
fn dax_sysfs_dir(path: &Path, rdev: u64) -> PathBuf {
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    match canonical.file_name() {
        Some(name) if Path::new(DAX_SYSFS).join(name).exists() => Path::new(DAX_SYSFS).join(name),
        _ => PathBuf::from(format!("/sys/dev/char/{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev))),
    }
}

/// A device-DAX device's mapping alignment and size from its sysfs directory: `align` (bytes;
/// [`DEFAULT_DAX_ALIGN`] when missing, unreadable or not a power of two) and `size` (`None` when
/// missing: the mapping itself then finds out).
fn dax_geometry(dir: &Path) -> (u64, Option<u64>) {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let align = read("align").filter(|a| a.is_power_of_two()).unwrap_or(DEFAULT_DAX_ALIGN);
    (align, read("size"))
}

/// Builds the CXL medium: a [`PageBackend`] over one mapping of `config.capacity_bytes` (rounded up to
/// the alignment) of `config.path`, returned as the interface (only the composition root names
/// concrete backends). `backend` supplies the page size, TTLs, leases and clock; its buffer sizes are
/// replaced. The tier is [`TierType::Dram`]: to the routing plane this is byte-addressable host
/// memory, and a tier of its own would be a wire change (see `docs/architecture.md`). The device or
/// file is opened (and a file grown) now; nothing is mapped until `init`.
pub fn make_cxl_backend(config: &CxlConfig, backend: PageBackendConfig) -> Result<Box<dyn MediumBackend>, CxlError> {
    let source = CxlPageMemorySource::open(config)?;
    let backend = PageBackendConfig { tier: TierType::Dram, buffer_sizes: vec![source.limit()], ..backend };
    Ok(Box::new(PageBackend::new(backend, Box::new(source))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dax_geometry_reads_align_and_size_and_defaults_to_two_mib() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(dax_geometry(dir.path()), (DEFAULT_DAX_ALIGN, None), "no sysfs attributes");
        std::fs::write(dir.path().join("align"), "1073741824\n").expect("write");
        std::fs::write(dir.path().join("size"), "68719476736\n").expect("write");
        assert_eq!(dax_geometry(dir.path()), (1 << 30, Some(64 << 30)));
        std::fs::write(dir.path().join("align"), "3000\n").expect("write");
        assert_eq!(dax_geometry(dir.path()).0, DEFAULT_DAX_ALIGN, "not a power of two");
    }

    #[test]
    fn buffers_are_consecutive_aligned_ranges_of_the_file_and_release_unmaps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cxl");
        let source = CxlPageMemorySource::open(&CxlConfig::new(&path, 3 * page_size())).expect("open");
        let buffers = source.allocate(&[100, 0, page_size()]).expect("allocate");
        assert_eq!(buffers.len(), 2, "zero sizes are skipped");
        assert_eq!(buffers[0].len(), page_size(), "usable = rounded to the alignment");
        // SAFETY: the buffers are live mappings of at least one page each until `release`.
        unsafe {
            buffers[0].base().as_ptr().write(7);
            buffers[1].base().as_ptr().write(9);
        }
        let bytes = std::fs::read(&path).expect("read the file");
        assert_eq!((bytes[0], bytes[page_size() as usize]), (7, 9), "MAP_SHARED: stores reach the file");
        let err = source.allocate(&[page_size(), page_size()]).expect_err("one page left");
        assert!(matches!(err, SourceError::Invalid { .. }), "{err}");
        assert_eq!(source.allocate(&[page_size()]).expect("the last page").len(), 1, "a failed call keeps nothing");
        source.release();
        source.release();
        assert_eq!(source.allocate(&[3 * page_size()]).expect("all of it again").len(), 1, "release resets");
        assert_eq!(source.location(), MemoryLocation::Host);
        assert_eq!(source.device(), None);
    }

    #[test]
    fn a_longer_file_is_kept_and_a_shorter_one_grown() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cxl");
        std::fs::write(&path, vec![1u8; 5 * page_size() as usize]).expect("write");
        CxlPageMemorySource::open(&CxlConfig::new(&path, 2 * page_size())).expect("open");
        assert_eq!(std::fs::metadata(&path).expect("meta").len(), 5 * page_size(), "never shrunk");
        CxlPageMemorySource::open(&CxlConfig::new(&path, 8 * page_size() - 1)).expect("open");
        assert_eq!(std::fs::metadata(&path).expect("meta").len(), 8 * page_size(), "grown to the aligned capacity");
    }

    #[test]
    fn make_cxl_backend_is_a_host_page_backend_of_the_aligned_capacity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = CxlConfig::new(dir.path().join("cxl"), (1 << 20) + 1);
        let backend =
            make_cxl_backend(&config, PageBackendConfig::new(TierType::Hbm, 4096, Vec::new())).expect("backend");
        assert_eq!(backend.tier(), TierType::Dram);
        backend.init(std::sync::Arc::new(umbp_testkit::LocalOnlyRegistrar::new())).expect("init maps the file");
        assert_eq!(backend.capacity().total_bytes, (1 << 20) + page_size());
        backend.shutdown();
    }
}
