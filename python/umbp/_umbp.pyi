"""Type stubs of the native module ``umbp._umbp`` (built from crates/umbp-py)."""

from typing import Any, Dict, List, Optional, Sequence, final, overload

__version__: str

KIND_INVALID_INPUT: int
KIND_RETRY: int
KIND_UNAVAILABLE: int
KIND_CLOSED: int
KIND_INTERNAL: int
KIND_NOT_FOUND: int

class Error(Exception):
    """Base class of every error the umbp pool raises."""

class InvalidInputError(Error):
    """The request can never succeed as given: fix it, do not retry it."""

class RetryError(Error):
    """A transient condition: the same call may succeed later."""

class UnavailableError(Error):
    """The master or a peer cannot be reached."""

class ClosedError(Error):
    """The client was closed."""

class InternalError(Error):
    """A bug or a broken invariant."""

class NotFoundError(Error):
    """The key is not in the pool."""

class ConfigError(InvalidInputError, ValueError):
    """A node's settings are invalid (an unknown medium, a required setting missing, a setting of
    the wrong type or of another medium): an InvalidInputError and a ValueError."""

@final
class Pool:
    """One node of a umbp pool in this process. Every I/O call releases the GIL.

    With ``detail=True`` a batch answers per key an ``int`` (put: 1; get: the value's size) or a
    ``(kind, message)`` tuple (``KIND_*``)."""

    @staticmethod
    def local(
        capacity_bytes: int,
        page_size: int = 65536,
        prefault: bool = False,
        medium: str = "dram",
        medium_settings: Optional[Dict[str, Any]] = None,
        gpu: Optional[str] = None,
        gpu_device: int = 0,
    ) -> "Pool":
        """An embedded master and one node lending ``capacity_bytes`` of ``medium``, in this process."""
    @staticmethod
    def node(
        master_address: str,
        node_id: str,
        node_address: str = "127.0.0.1",
        lend_bytes: int = 0,
        page_size: int = 2097152,
        data_host: Optional[str] = None,
        data_port: int = 0,
        peer_port: int = 0,
        bounce_bytes: int = 67108864,
        recache_bytes: Optional[int] = None,
        prefault: bool = False,
        medium: Optional[str] = None,
        medium_settings: Optional[Dict[str, Any]] = None,
        gpu: Optional[str] = None,
        gpu_device: int = 0,
    ) -> "Pool":
        """Joins the pool whose master is at ``master_address``."""
    @property
    def distributed(self) -> bool: ...
    @property
    def node_id(self) -> str: ...
    @property
    def master_address(self) -> str: ...
    @property
    def peer_address(self) -> Optional[str]: ...
    @property
    def data_endpoint(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @overload
    def put_ptrs(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[bool]: ...
    @overload
    def put_ptrs(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], detail: bool) -> List[Any]: ...
    @overload
    def get_ptrs(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[bool]: ...
    @overload
    def get_ptrs(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], detail: bool) -> List[Any]: ...
    def get_ranges_ptrs(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
        detail: bool = False,
    ) -> List[Any]:
        """Reads ranges of each key's value (disjoint, inside the value) into their pointers."""
    def put_ranges_ptrs(
        self,
        keys: Sequence[str],
        object_sizes: Sequence[int],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
        detail: bool = False,
    ) -> List[Any]:
        """Writes values assembled from ranges that tile them; each published whole."""
    def put_buffers(self, keys: Sequence[str], values: Sequence[Any], detail: bool = True) -> List[Any]:
        """Puts objects exporting the buffer protocol, without copying them first."""
    def get_into_buffers(self, keys: Sequence[str], buffers: Sequence[Any], detail: bool = True) -> List[Any]:
        """Gets keys into writable buffers."""
    def get_bytes(self, key: str, size_hint: int = 65536) -> Optional[bytes]:
        """The value as bytes, or None on a miss."""
    def exists(self, keys: Sequence[str]) -> List[bool]: ...
    def exists_prefix(self, keys: Sequence[str]) -> int: ...
    def register_memory(self, ptr: int, size: int) -> str: ...
    def deregister_memory(self, ptr: int) -> bool: ...
    def clear(self) -> None: ...
    def flush(self) -> None: ...
    def report_external_kv_blocks(self, hashes: Sequence[Any], tier: Any) -> None: ...
    def revoke_external_kv_blocks(self, hashes: Sequence[Any], tier: Any) -> None: ...
    def revoke_all_external_kv_blocks_at_tier(self, tier: Any) -> None: ...
    def match_external_kv(self, hashes: Sequence[Any], count_as_hit: bool = False) -> List[UMBPExternalKvNodeMatch]: ...
    def close(self) -> None: ...

@final
class UMBPExternalKvNodeMatch:
    """One node that holds some of the hashes a ``match_external_kv`` asked for."""

    node_id: str
    peer_address: str
    @property
    def hashes_by_tier(self) -> Dict[int, List[str]]:
        """``{tier: [hash, ...]}``, fastest tier first (a ``UMBPTierType`` key finds its int)."""
    def matched_hash_count(self) -> int:
        """Distinct hashes matched (a hash on two tiers counts once)."""

@final
class UMBPExternalKvHitCountEntry:
    """How often counted matches found one hash."""

    hash: str
    hit_count_total: int

@final
class UMBPMasterClient:
    """The master's control plane for schedulers and sidecars: no medium, no heartbeat thread.
    Hashes are ``str`` or ``int``; tiers ``int``, ``UMBPTierType`` or a name."""

    def __init__(self, master_address: str, node_id: str = "", node_address: str = "") -> None: ...
    @property
    def node_id(self) -> str: ...
    def register_self(self, tier_capacities: Optional[Dict[Any, Any]] = None) -> None: ...
    def unregister_self(self) -> None: ...
    def is_registered(self) -> bool: ...
    def report_external_kv_blocks(self, node_id: str, hashes: Sequence[Any], tier: Any) -> bool:
        """Additive; ``False`` when ``node_id`` is not a live registered node (ignored)."""
    def revoke_external_kv_blocks(self, node_id: str, hashes: Sequence[Any], tier: Any) -> None: ...
    def revoke_all_external_kv_blocks_at_tier(self, node_id: str, tier: Any) -> None: ...
    def match_external_kv(self, hashes: Sequence[Any], count_as_hit: bool = False) -> List[UMBPExternalKvNodeMatch]: ...
    def get_external_kv_hit_counts(self, hashes: Sequence[Any]) -> List[UMBPExternalKvHitCountEntry]: ...

def cli_main(argv: Sequence[str]) -> int:
    """Run the ``umbp`` command line with ``argv`` (the program name first) and return its exit status;
    the GIL is released while it runs. ``python -m umbp`` calls it."""
    ...
