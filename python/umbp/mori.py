"""The ``mori.umbp`` surface over this pool: what SGLang's ``UMBPStore`` imports.

``pip install ./python/mori-compat`` installs a ``mori.umbp`` module that re-exports this one, so
SGLang's ``--hicache-storage-backend mori`` runs unmodified on umbp-rs. The names, fields and
defaults follow AMD mori's pybind module; the behaviour is this pool's (see docs/python.md,
"Differences from mori"). Configs are plain Python objects: nested fields are live, so
``cfg.ssd.io.queue_depth = 8`` changes ``cfg``, and every field is a real ``int``/``bool``/``str``/
``float``/enum, because the store casts to the existing field's type and probes with ``hasattr``.

Deployments: without ``config.distributed`` the client is a *local* pool (an embedded master and a
DRAM node of ``dram.capacity_bytes`` in this process); with it, the process is a node of the pool
whose master is ``distributed.master_config.master_address``, lending ``dram.capacity_bytes`` of
DRAM (``distributed.medium = UMBPMedium.NONE``: nothing).
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import sys
from typing import Any, List, Optional, Sequence, Tuple

from . import _umbp
from ._umbp import Error, Pool, UMBPMasterClient

__all__ = [
    "CacheRemoteAdmission",
    "UMBPClient",
    "UMBPConfig",
    "UMBPCopyPipelineConfig",
    "UMBPDeploymentMode",
    "UMBPDistributedConfig",
    "UMBPDramConfig",
    "UMBPDurabilityConfig",
    "UMBPDurabilityMode",
    "UMBPEvictionConfig",
    "UMBPHbmConfig",
    "UMBPHostBufferBacking",
    "UMBPHostBufferHandle",
    "UMBPHostMemAllocator",
    "UMBPIoBackend",
    "UMBPIoConfig",
    "UMBPIoEngineConfig",
    "UMBPMasterClient",
    "UMBPMasterClientConfig",
    "UMBPMedium",
    "UMBPRole",
    "UMBPSsdConfig",
    "UMBPSsdLayoutMode",
    "UMBPTierType",
]

GiB = 1 << 30
MiB = 1 << 20

# -- enums ---------------------------------------------------------------------------------------


class _Enum(enum.IntEnum):
    """An int enum that prints as ``Type.Member``, as pybind11's enums do (Python 3.11's IntEnum
    prints the bare number, which would make the store's log lines unreadable)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class UMBPRole(_Enum):
    """Role of a client sharing an SSD (this pool has no shared SSD: every role is a plain node)."""

    Standalone = 0
    SharedSSDLeader = 1
    SharedSSDFollower = 2


class UMBPDeploymentMode(_Enum):
    """How the client reaches its pool: embedded (Local) or as a node of a master (Distributed)."""

    Local = 0
    StandaloneProcess = 1
    Distributed = 2


class UMBPTierType(_Enum):
    """A storage tier."""

    Unknown = 0
    HBM = 1
    DRAM = 2
    SSD = 3


class UMBPIoBackend(_Enum):
    """SSD I/O engine (accepted; local mode keeps no SSD)."""

    Posix = 0
    IoUring = 1


class UMBPDurabilityMode(_Enum):
    """SSD durability (accepted; local mode keeps no SSD)."""

    Strict = 0
    Relaxed = 1


class UMBPSsdLayoutMode(_Enum):
    """SSD layout (accepted)."""

    SegmentedLog = 1


class UMBPMedium(_Enum):
    """What a distributed node lends the pool."""

    NONE = 0
    DRAM = 1
    HBM = 2
    SSD = 3


class CacheRemoteAdmission(_Enum):
    """Which values fetched from other nodes are re-cached locally."""

    SIZE = 0
    NEVER = 1
    ALWAYS = 2


class UMBPHostBufferBacking(_Enum):
    """Backing of a host buffer from :class:`UMBPHostMemAllocator`."""

    Anonymous = 0
    AnonymousHugetlb = 1
    AnonymousShm = 2
    AnonymousShmHugetlb = 3


# -- configs -------------------------------------------------------------------------------------


class _Config:
    """Plain attribute bag with a readable repr."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class UMBPDramConfig(_Config):
    """DRAM settings: ``capacity_bytes`` is what the local pool holds or a node lends."""

    def __init__(self) -> None:
        self.capacity_bytes = 4 * GiB
        self.use_shared_memory = False
        self.shm_name = "/umbp_dram"
        self.high_watermark = 0.9
        self.low_watermark = 0.7
        self.use_hugepages = False
        self.hugepage_size = 2 * MiB
        self.numa_node = -1
        # mori prefaults by default; touching 4 GiB at start-up is seconds of a worker's start, so
        # here only when asked (UMBP_DRAM_PREFAULT=1).
        self.prefault = False
        # Ours: page size of the local pool's DRAM (a value takes whole pages).
        self.page_size = 64 << 10


class UMBPIoConfig(_Config):
    """SSD I/O settings (accepted, unused)."""

    def __init__(self) -> None:
        self.backend = UMBPIoBackend.IoUring
        self.queue_depth = 4096


class UMBPDurabilityConfig(_Config):
    """SSD durability settings (accepted, unused)."""

    def __init__(self) -> None:
        self.mode = UMBPDurabilityMode.Strict
        self.enable_background_gc = True


class UMBPSsdConfig(_Config):
    """SSD settings. Accepted so the store can set them; the pool built by UMBPClient keeps no SSD
    tier (a node lending an SSD is started with ``umbp node --medium ssd``). ``enabled`` defaults
    to True as in mori, and means nothing here."""

    def __init__(self) -> None:
        self.enabled = True
        self.storage_dir = "/tmp/umbp_ssd"
        self.capacity_bytes = 32 * GiB
        self.layout_mode = UMBPSsdLayoutMode.SegmentedLog
        self.segment_size_bytes = 256 * MiB
        self.io = UMBPIoConfig()
        self.durability = UMBPDurabilityConfig()
        self.high_watermark = 0.9
        self.low_watermark = 0.7
        self.ssd_backend = "file"
        self.spdk_bdev_name = ""
        self.spdk_reactor_mask = "0x1"
        self.spdk_mem_size_mb = 256
        self.spdk_nvme_pci_addr = ""
        self.spdk_nvme_ctrl_name = "NVMe0"
        self.spdk_io_workers = 4
        self.spdk_proxy_shm_name = "/umbp_spdk_proxy"
        self.spdk_proxy_tenant_id = 0
        self.spdk_proxy_tenant_quota_bytes = 0
        self.spdk_proxy_max_channels = 8
        self.spdk_proxy_data_per_channel_mb = 32
        self.spdk_proxy_bin = ""
        self.spdk_proxy_startup_timeout_ms = 30000
        self.spdk_proxy_auto_start = True
        self.spdk_proxy_idle_exit_timeout_ms = 30000
        self.spdk_proxy_allow_borrow = False
        self.spdk_proxy_reserved_shared_bytes = 0


class UMBPEvictionConfig(_Config):
    """Eviction settings (accepted; the pool's master evicts by its own watermarks)."""

    def __init__(self) -> None:
        self.policy = "lru"
        self.candidate_window = 16
        self.auto_promote_on_read = True


class UMBPCopyPipelineConfig(_Config):
    """DRAM-to-SSD copy pipeline settings (accepted, unused)."""

    def __init__(self) -> None:
        self.async_enabled = True
        self.queue_depth = 4096
        self.worker_threads = 2
        self.batch_max_ops = 128


class UMBPMasterClientConfig(_Config):
    """Who this node is and where its master is."""

    def __init__(self) -> None:
        self.master_address = ""
        self.node_id = ""
        self.node_address = ""
        self.auto_heartbeat = True
        self.tags: List[str] = []


class UMBPIoEngineConfig(_Config):
    """Where this node's data server listens (port 0: any free port)."""

    def __init__(self) -> None:
        self.host = ""
        self.port = 0


class UMBPHbmConfig(_Config):
    """HBM settings (accepted; a node lending HBM is started with ``umbp node --medium hbm``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.device = 0
        self.capacity_bytes = 0


class UMBPDistributedConfig(_Config):
    """Set as ``UMBPConfig.distributed`` to make the client a node of a running pool."""

    def __init__(self) -> None:
        self.master_config = UMBPMasterClientConfig()
        self.io_engine = UMBPIoEngineConfig()
        self.staging_buffer_size = 64 * MiB
        self.ranged_scratch_size = 0
        self.ssd_staging_buffer_size = 256 * MiB
        self.ssd_staging_buffer_slots = 16
        self.peer_service_port = 0
        self.cache_remote_fetches = True
        self.cache_remote_admission = CacheRemoteAdmission.SIZE
        self.admission_max_block_bytes = 16 * MiB
        self.dram_page_size = 0
        self.hbm = UMBPHbmConfig()
        self.enable_ssd_tier = False
        self.medium = UMBPMedium.DRAM


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return v if v not in (None, "") else None


class UMBPConfig(_Config):
    """Everything :class:`UMBPClient` is built from."""

    def __init__(self) -> None:
        self.dram = UMBPDramConfig()
        self.ssd = UMBPSsdConfig()
        self.eviction = UMBPEvictionConfig()
        self.copy_pipeline = UMBPCopyPipelineConfig()
        self.role = UMBPRole.Standalone
        self.follower_mode = False
        self.force_ssd_copy_on_write = False
        self.distributed: Optional[UMBPDistributedConfig] = None
        self.standalone_process: Any = None

    @staticmethod
    def from_environment() -> "UMBPConfig":
        """Defaults, then the ``UMBP_*`` variables mori reads (``UMBP_DRAM_CAPACITY``,
        ``UMBP_SSD_ENABLED`` (on unless 0), ``UMBP_SSD_DIR``, ``UMBP_SSD_CAPACITY``,
        ``UMBP_DRAM_PREFAULT``, ...). ``UMBP_MASTER_ADDRESS`` is the store's to read."""
        cfg = UMBPConfig()

        def size(name: str, current: int) -> int:
            v = _env(name)
            return int(v) if v is not None else current

        def flt(name: str, current: float) -> float:
            v = _env(name)
            return float(v) if v is not None else current

        def flag(name: str, current: bool) -> bool:
            v = _env(name)
            return int(v) != 0 if v is not None else current

        def text(name: str, current: str) -> str:
            v = os.environ.get(name)
            return v if v is not None else current

        cfg.dram.capacity_bytes = size("UMBP_DRAM_CAPACITY", cfg.dram.capacity_bytes)
        cfg.ssd.enabled = flag("UMBP_SSD_ENABLED", cfg.ssd.enabled)
        cfg.ssd.storage_dir = text("UMBP_SSD_DIR", cfg.ssd.storage_dir)
        cfg.ssd.capacity_bytes = size("UMBP_SSD_CAPACITY", cfg.ssd.capacity_bytes)
        cfg.eviction.policy = text("UMBP_EVICTION_POLICY", cfg.eviction.policy)
        cfg.dram.high_watermark = flt("UMBP_DRAM_HIGH_WM", cfg.dram.high_watermark)
        cfg.dram.low_watermark = flt("UMBP_DRAM_LOW_WM", cfg.dram.low_watermark)
        cfg.ssd.high_watermark = flt("UMBP_SSD_HIGH_WM", cfg.ssd.high_watermark)
        cfg.ssd.low_watermark = flt("UMBP_SSD_LOW_WM", cfg.ssd.low_watermark)
        cfg.dram.use_hugepages = flag("UMBP_DRAM_USE_HUGEPAGES", cfg.dram.use_hugepages)
        cfg.dram.hugepage_size = size("UMBP_DRAM_HUGEPAGE_SIZE", cfg.dram.hugepage_size)
        cfg.dram.numa_node = size("UMBP_DRAM_NUMA_NODE", cfg.dram.numa_node)
        cfg.dram.prefault = flag("UMBP_DRAM_PREFAULT", cfg.dram.prefault)
        cfg.dram.page_size = size("UMBP_DRAM_PAGE_SIZE", cfg.dram.page_size)
        cfg.ssd.ssd_backend = text("UMBP_SSD_BACKEND", cfg.ssd.ssd_backend)
        role = (_env("UMBP_ROLE") or "").strip().lower()
        if role in ("leader", "shared_ssd_leader", "sharedssdleader"):
            cfg.role = UMBPRole.SharedSSDLeader
        elif role in ("follower", "shared_ssd_follower", "sharedssdfollower"):
            cfg.role = UMBPRole.SharedSSDFollower
        return cfg


# -- the client ----------------------------------------------------------------------------------


def _gpu_for_process() -> Tuple[Optional[str], int]:
    """The GPU runtime (and device) a client gets, so that an engine's device buffers register as
    they are (SGLang's direct linker registers its GPU KV pools by address): ``UMBP_GPU_RUNTIME``
    when set (``none`` / ``off`` / ``0``: no GPU), else ``auto`` when torch has initialised CUDA in
    this process (an engine rank has, before it builds its store), pinned on torch's current
    device; otherwise none, so a process that never used a GPU never probes one."""
    device = 0
    ready = False
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            ready = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
            if ready:
                device = int(torch.cuda.current_device())
        except Exception:  # a torch without CUDA, or one that fails to answer: no GPU
            ready = False
    name = _env("UMBP_GPU_RUNTIME")
    if name is not None:
        return (None if name.strip().lower() in ("none", "off", "0") else name), device
    return ("auto" if ready else None), device


# What a malformed batch raises while the native side converts it: a non-str key, a pointer or
# size that is not an int or is negative, a list that is not a list. Ragged lists raise
# InvalidInputError (an Error). Every one of them answers all-False.
_MALFORMED = (Error, TypeError, ValueError, OverflowError)


class UMBPClient:
    """A client of the pool, as mori's ``UMBPClient``: pointers are Python ints, answers are
    ``bool`` / ``list[bool]``, and nothing raises on bad input (it answers False)."""

    def __init__(self, config: Optional[UMBPConfig] = None) -> None:
        cfg = config if config is not None else UMBPConfig()
        self._config = cfg
        if getattr(cfg, "standalone_process", None) is not None:
            raise RuntimeError(
                "umbp: the standalone-process deployment is not supported; use the local pool "
                "(no distributed config) or a distributed one (UMBP_MASTER_ADDRESS)"
            )
        gpu, gpu_device = _gpu_for_process()
        d = cfg.distributed
        if d is None:
            self._mode = UMBPDeploymentMode.Local
            self._pool = Pool.local(
                int(cfg.dram.capacity_bytes),
                int(getattr(cfg.dram, "page_size", 64 << 10)),
                bool(cfg.dram.prefault),
                gpu=gpu,
                gpu_device=gpu_device,
            )
            return
        mc = d.master_config
        if not mc.master_address or not mc.node_id:
            raise ValueError("distributed.master_config needs master_address and node_id")
        lend = 0 if d.medium == UMBPMedium.NONE else int(cfg.dram.capacity_bytes)
        if not d.cache_remote_fetches or d.cache_remote_admission == CacheRemoteAdmission.NEVER:
            recache = None
        elif d.cache_remote_admission == CacheRemoteAdmission.ALWAYS or d.admission_max_block_bytes == 0:
            recache = 1 << 62
        else:
            recache = int(d.admission_max_block_bytes)
        self._mode = UMBPDeploymentMode.Distributed
        self._pool = Pool.node(
            str(mc.master_address),
            str(mc.node_id),
            str(mc.node_address or "127.0.0.1"),
            lend,
            int(d.dram_page_size) or (2 << 20),
            str(d.io_engine.host) or None,
            int(d.io_engine.port),
            int(d.peer_service_port),
            int(d.staging_buffer_size),
            recache,
            bool(cfg.dram.prefault),
            gpu=gpu,
            gpu_device=gpu_device,
        )

    # -- single keys -----------------------------------------------------------------------------

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        """Stores ``size`` bytes at ``src`` under ``key``; True also when the key was there."""
        return self.batch_put_from_ptr([key], [src], [size])[0]

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        """Reads ``key`` into ``size`` bytes at ``dst``."""
        return self.batch_get_into_ptr([key], [dst], [size])[0]

    def exists(self, key: str) -> bool:
        """Whether the pool holds ``key``."""
        return self.batch_exists([key])[0]

    # -- batches ---------------------------------------------------------------------------------

    def batch_put_from_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[bool]:
        """Stores ``sizes[i]`` bytes at ``ptrs[i]`` under ``keys[i]``; ragged lists: all False."""
        try:
            return self._pool.put_ptrs(keys, ptrs, sizes)
        except _MALFORMED:
            return [False] * _len(keys)

    def batch_put_from_ptr_with_depth(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], depths: Sequence[int]
    ) -> List[bool]:
        """As :meth:`batch_put_from_ptr`; the prefix depths are checked and otherwise ignored
        (the pool's eviction does not weigh depth)."""
        if _len(depths) != _len(keys):
            return [False] * _len(keys)
        return self.batch_put_from_ptr(keys, ptrs, sizes)

    def batch_get_into_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[bool]:
        """Reads ``keys[i]`` into ``sizes[i]`` bytes at ``ptrs[i]``; ragged lists: all False."""
        try:
            return self._pool.get_ptrs(keys, ptrs, sizes)
        except _MALFORMED:
            return [False] * _len(keys)

    def batch_exists(self, keys: Sequence[str]) -> List[bool]:
        """Whether the pool holds each key (all False when the pool cannot be asked)."""
        try:
            return self._pool.exists(keys)
        except _MALFORMED:
            return [False] * _len(keys)

    def batch_exists_consecutive(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, the pool holds."""
        n = 0
        for hit in self.batch_exists(keys):
            if not hit:
                break
            n += 1
        return n

    # -- maintenance, memory ---------------------------------------------------------------------

    def clear(self) -> bool:
        """Drops every value this node holds."""
        try:
            self._pool.clear()
            return True
        except Error:
            return False

    def flush(self) -> bool:
        """Publishes this node's stores to the master; when it returns every node sees them."""
        try:
            self._pool.flush()
            return True
        except Error:
            return False

    def is_distributed(self) -> bool:
        """Whether this client is a node of a running pool."""
        return self._mode == UMBPDeploymentMode.Distributed

    def get_deployment_mode(self) -> UMBPDeploymentMode:
        """``Local`` or ``Distributed``."""
        return self._mode

    def register_memory(self, ptr: int, size: int, loc: Any = None, device: int = -1) -> bool:
        """Registers memory for zero-copy I/O: host memory, or a device buffer when this process
        has a GPU runtime (see ``_gpu_for_process``; the address itself tells which). False when
        it cannot be (device memory with no GPU runtime, an unmapped range, an overlap), so the
        caller stays on the staging path. ``loc`` and ``device`` are mori's hints; the address
        decides."""
        try:
            self._pool.register_memory(int(ptr), int(size))
            return True
        except (Error, TypeError, ValueError, OverflowError):
            return False

    def deregister_memory(self, ptr: int) -> bool:
        """Undoes :meth:`register_memory`."""
        try:
            return self._pool.deregister_memory(int(ptr))
        except (Error, TypeError, ValueError, OverflowError):
            return False

    def supports_ranged_io(self) -> bool:
        """True: :meth:`batch_get_ranges_into_ptr` and :meth:`batch_put_ranges_from_ptr` move only
        the ranges' bytes (SGLang's direct linker asks before it starts)."""
        return True

    def batch_get_ranges_into_ptr(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> List[bool]:
        """Reads ranges of each key's value: ``sizes[i][j]`` bytes from offset ``src_offsets[i][j]``
        into ``ptrs[i][j]``; a key's ranges must be disjoint and inside its value (they need not
        cover it). Ragged lists: all False."""
        try:
            return self._pool.get_ranges_ptrs(keys, ptrs, sizes, src_offsets)
        except _MALFORMED:
            return [False] * _len(keys)

    def batch_put_ranges_from_ptr(
        self,
        keys: Sequence[str],
        object_sizes: Sequence[int],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> List[bool]:
        """Writes each key's value of ``object_sizes[i]`` bytes assembled from ranges: ``sizes[i][j]``
        bytes at ``ptrs[i][j]`` go to offset ``dst_offsets[i][j]``; a key's ranges must tile its
        value exactly. The value is published whole. Ragged lists: all False."""
        try:
            return self._pool.put_ranges_ptrs(keys, object_sizes, ptrs, sizes, dst_offsets)
        except _MALFORMED:
            return [False] * _len(keys)

    # The external KV index (blocks this engine holds outside the pool, for cache-aware routing):
    # the changes ride this node's heartbeat; matching asks the master.
    def report_external_kv_blocks(self, hashes: Sequence[Any], tier: Any) -> bool:
        """This node holds ``hashes`` at ``tier`` outside the pool: queued for its next heartbeat
        (True), or False for bad input or a client that lends no memory (not a registered node)."""
        try:
            self._pool.report_external_kv_blocks(list(hashes), tier)
            return True
        except _MALFORMED:
            return False

    def revoke_external_kv_blocks(self, hashes: Sequence[Any], tier: Any) -> bool:
        """This node no longer holds ``hashes`` at ``tier``: queued (True), or False."""
        try:
            self._pool.revoke_external_kv_blocks(list(hashes), tier)
            return True
        except _MALFORMED:
            return False

    def revoke_all_external_kv_blocks_at_tier(self, tier: Any) -> bool:
        """Every block this node holds at ``tier`` goes: queued (True), or False."""
        try:
            self._pool.revoke_all_external_kv_blocks_at_tier(tier)
            return True
        except _MALFORMED:
            return False

    def match_external_kv(self, hashes: Sequence[Any], count_as_hit: bool = False) -> list:
        """The nodes holding any of ``hashes`` outside the pool (``UMBPExternalKvNodeMatch``: node id,
        ``hashes_by_tier``), sorted by node id; [] on bad input or an unreachable master."""
        try:
            return self._pool.match_external_kv(list(hashes), count_as_hit)
        except _MALFORMED:
            return []

    def close(self) -> None:
        """Leaves the pool (not in mori's API; dropping the client does the same)."""
        self._pool.close()

    def __repr__(self) -> str:
        return f"<mori.umbp.UMBPClient (umbp) {self._mode.name} {self._pool!r}>"


def _len(keys: Any) -> int:
    try:
        return len(keys)
    except TypeError:
        return 0


# -- host memory ---------------------------------------------------------------------------------


class UMBPHostBufferHandle:
    """One allocation of :class:`UMBPHostMemAllocator`; falsy when the allocation failed."""

    def __init__(self) -> None:
        self.ptr = 0
        self.requested_size = 0
        self.mapped_size = 0
        self.actual_backing = UMBPHostBufferBacking.Anonymous
        self.actual_alignment = 0
        self._map: Optional[mmap.mmap] = None
        self._anchor: Any = None

    def __bool__(self) -> bool:
        return self.ptr != 0

    def __repr__(self) -> str:
        return (
            f"<UMBPHostBufferHandle ptr={self.ptr:#x} requested_size={self.requested_size} "
            f"mapped_size={self.mapped_size}>"
        )


class UMBPHostMemAllocator:
    """Page-aligned anonymous host memory for the HiCache host pool.

    Hugetlb backings are served with normal pages (``actual_backing`` says so, and SGLang logs the
    demotion); NUMA binding is not applied.
    """

    def alloc(
        self,
        size: int,
        backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
        hugepage_size: int = 2 * MiB,
        numa_node: int = -1,
        prefault: bool = True,
    ) -> UMBPHostBufferHandle:
        """Maps ``size`` bytes; a falsy handle when it cannot."""
        h = UMBPHostBufferHandle()
        if int(size) <= 0:
            return h
        page = mmap.PAGESIZE
        mapped = (int(size) + page - 1) // page * page
        shared = backing in (UMBPHostBufferBacking.AnonymousShm, UMBPHostBufferBacking.AnonymousShmHugetlb)
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
        try:
            m = mmap.mmap(-1, mapped, flags=flags)
        except (OSError, ValueError):
            return h
        anchor = ctypes.c_char.from_buffer(m)
        h.ptr = ctypes.addressof(anchor)
        h.requested_size = int(size)
        h.mapped_size = mapped
        h.actual_backing = UMBPHostBufferBacking.AnonymousShm if shared else UMBPHostBufferBacking.Anonymous
        h.actual_alignment = page
        h._map = m
        h._anchor = anchor
        if prefault:
            # One write per page, so the pages exist before the first transfer.
            view = memoryview(m)
            for off in range(0, mapped, page):
                view[off] = 0
            view.release()
        return h

    def free(self, handle: UMBPHostBufferHandle) -> None:
        """Unmaps ``handle``'s memory (the caller no longer uses it)."""
        m = handle._map
        handle._anchor = None
        handle._map = None
        handle.ptr = 0
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # someone still exports the memory; it goes when they do
