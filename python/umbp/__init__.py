"""umbp: the Python client of the umbp-rs KV-cache buffer pool.

Two deployments:

* ``Client.local(capacity_bytes=...)`` -- an embedded pool: a master and one node inside this
  process, nothing else to start. Values live as long as the client.
* ``Client.connect(master, node_id=...)`` -- this process becomes a node of a running pool
  (``umbp master`` somewhere, other nodes beside it). It may lend memory (``lend_bytes``) or
  nothing, and reads every node's keys over the data plane.

Either lends one medium, as ``umbp node --medium`` does: ``medium="dram"`` (the default),
``"ssd"`` (``ssd_dirs``), ``"cxl"`` (``cxl_path``), ``"object"`` (``object_url``,
``object_endpoint``), ``"hbm"`` or ``"none"``; ``medium_options`` holds any other setting of the
medium under its settings-file key (``{"staging_pages": 64, "io_engine": "io_uring"}``). Bad
settings raise :class:`ConfigError`, an ``InvalidInputError`` and a ``ValueError``.

Values are write-once: a second put of a key succeeds and keeps the stored bytes. Every call that
waits on I/O releases the GIL. Errors raise subclasses of :class:`umbp.Error`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from . import _umbp
from ._umbp import (
    ClosedError,
    ConfigError,
    Error,
    InternalError,
    InvalidInputError,
    NotFoundError,
    Pool,
    RetryError,
    UnavailableError,
    __version__,
)

__all__ = [
    "BatchError",
    "Client",
    "ClosedError",
    "ConfigError",
    "Error",
    "InternalError",
    "InvalidInputError",
    "NotFoundError",
    "Pool",
    "RetryError",
    "UnavailableError",
    "__version__",
]

_EXCEPTIONS = {
    _umbp.KIND_INVALID_INPUT: InvalidInputError,
    _umbp.KIND_RETRY: RetryError,
    _umbp.KIND_UNAVAILABLE: UnavailableError,
    _umbp.KIND_CLOSED: ClosedError,
    _umbp.KIND_INTERNAL: InternalError,
    _umbp.KIND_NOT_FOUND: NotFoundError,
}


def _exception(kind: int, message: str) -> Error:
    return _EXCEPTIONS.get(kind, InternalError)(message)


class BatchError(Error):
    """Some keys of a batch failed.

    ``errors`` maps the index of each failed key to its exception; ``results`` holds every key's
    outcome (``None`` for a failed one), so the caller can keep what succeeded.
    """

    def __init__(self, message: str, errors: dict, results: list):
        super().__init__(message)
        self.errors = errors
        self.results = results


def _raise_batch(op: str, keys: Sequence[str], detailed: list, miss_ok: bool) -> list:
    """Turns the native per-key answers into values, raising BatchError on any failure."""
    errors = {}
    results: list = []
    for i, r in enumerate(detailed):
        if isinstance(r, tuple):
            kind, message = r
            if miss_ok and kind == _umbp.KIND_NOT_FOUND:
                results.append(None)
                continue
            errors[i] = _exception(kind, f"{keys[i]!r}: {message}")
            results.append(None)
        else:
            results.append(r)
    if errors:
        first = next(iter(errors.values()))
        raise BatchError(f"{op}: {len(errors)} of {len(keys)} keys failed (first: {first})", errors, results)
    return results


def _medium_settings(
    ssd_dirs: Any, cxl_path: Any, object_url: Any, object_endpoint: Any, options: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """The medium's settings for the native pool: ``options`` plus the keyword ones that were given
    (the native side maps each to its medium's key, refusing one of another medium)."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"medium_options must be a dict, not {type(options).__name__}")
    settings = dict(options or {})
    for name, value in (
        ("ssd_dirs", ssd_dirs),
        ("cxl_path", cxl_path),
        ("object_url", object_url),
        ("object_endpoint", object_endpoint),
    ):
        if value is None:
            continue
        if name in settings:
            raise ConfigError(f"{name} given both as a keyword and in medium_options")
        settings[name] = value
    return settings


class Client:
    """A handle on a umbp pool; a context manager that closes it on exit.

    Build one with :meth:`local` or :meth:`connect`. Data goes in and out as any object exporting
    the buffer protocol (``bytes``, ``bytearray``, ``memoryview``, numpy arrays) or, for memory
    Python cannot see as a buffer (a torch tensor: ``t.data_ptr()``, ``t.nbytes``), as raw
    addresses through the ``*_ptr`` methods. Memory registered with :meth:`register_memory` moves
    without a staging copy.
    """

    def __init__(self, pool: Pool):
        self._pool = pool

    @classmethod
    def local(
        cls,
        capacity_bytes: int = 1 << 30,
        *,
        page_size: int = 64 << 10,
        prefault: bool = False,
        medium: str = "dram",
        ssd_dirs: Union[None, str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]] = None,
        cxl_path: Union[None, str, "os.PathLike[str]"] = None,
        object_url: Optional[str] = None,
        object_endpoint: Optional[str] = None,
        medium_options: Optional[Dict[str, Any]] = None,
        gpu: Optional[str] = None,
        gpu_device: int = 0,
    ) -> "Client":
        """An embedded pool: a master and one node lending ``capacity_bytes`` of ``medium``, in this process.

        ``prefault`` touches DRAM at start-up (other media ignore it). ``gpu`` names a GPU runtime
        (``"auto"``, ``"cuda"``, ``"cudart"``, ``"hip"``; default none) so that device buffers
        (a CUDA tensor's ``data_ptr()``) can be registered and moved; host memory is pinned with
        device ``gpu_device``'s context (the process's own GPU). See the module's docstring for the
        media and their settings."""
        settings = _medium_settings(ssd_dirs, cxl_path, object_url, object_endpoint, medium_options)
        return cls(
            Pool.local(
                int(capacity_bytes), int(page_size), bool(prefault), str(medium), settings, gpu, int(gpu_device)
            )
        )

    @classmethod
    def connect(
        cls,
        master: str,
        *,
        node_id: str,
        node_address: str = "127.0.0.1",
        lend_bytes: int = 0,
        page_size: int = 2 << 20,
        data_host: Optional[str] = None,
        data_port: int = 0,
        peer_port: int = 0,
        staging_bytes: int = 64 << 20,
        recache_bytes: Optional[int] = 16 << 20,
        medium: Optional[str] = None,
        ssd_dirs: Union[None, str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]] = None,
        cxl_path: Union[None, str, "os.PathLike[str]"] = None,
        object_url: Optional[str] = None,
        object_endpoint: Optional[str] = None,
        medium_options: Optional[Dict[str, Any]] = None,
        gpu: Optional[str] = None,
        gpu_device: int = 0,
    ) -> "Client":
        """Joins the pool whose master listens at ``master`` (``host:port``) as node ``node_id``.

        ``lend_bytes`` of ``medium`` are lent to the pool (default medium: DRAM, or none when
        ``lend_bytes`` is 0: a client-only node); ``node_address`` is the host other nodes reach
        this one at; ports 0 pick free ones; values fetched from other nodes up to
        ``recache_bytes`` are kept locally too (``None``: never); ``gpu`` and ``gpu_device`` as
        for :meth:`local` (a device buffer reads from and writes to other nodes through the
        ``staging_bytes`` pool, which must hold the largest such value).
        """
        return cls(
            Pool.node(
                master,
                node_id,
                node_address,
                int(lend_bytes),
                int(page_size),
                data_host,
                int(data_port),
                int(peer_port),
                int(staging_bytes),
                None if recache_bytes is None else int(recache_bytes),
                False,
                None if medium is None else str(medium),
                _medium_settings(ssd_dirs, cxl_path, object_url, object_endpoint, medium_options),
                gpu,
                int(gpu_device),
            )
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Leaves the pool (a local pool stops). Idempotent; later calls raise ClosedError."""
        self._pool.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._pool.closed

    @property
    def node_id(self) -> str:
        """This node's id (``"local"`` for a local pool)."""
        return self._pool.node_id

    @property
    def master_address(self) -> str:
        """The master's ``host:port`` (the embedded one's for a local pool)."""
        return self._pool.master_address

    @property
    def distributed(self) -> bool:
        """Whether this client joined a running master."""
        return self._pool.distributed

    @property
    def pool(self) -> Pool:
        """The native pool object (what ``mori.umbp`` is built on)."""
        return self._pool

    def __repr__(self) -> str:
        return f"<umbp.Client {self._pool!r}>"

    # -- single keys -----------------------------------------------------------------------------

    def put(self, key: str, data: Any) -> None:
        """Stores ``data`` (any buffer) under ``key``. A key already stored keeps its bytes."""
        self.put_batch([key], [data])

    def get(self, key: str, *, size_hint: int = 64 << 10) -> Optional[bytes]:
        """The value of ``key``, or ``None`` when the pool does not hold it."""
        return self._pool.get_bytes(key, size_hint)

    def get_into(self, key: str, buffer: Any) -> Optional[int]:
        """Reads ``key`` into the writable ``buffer``; the value's size, or ``None`` on a miss."""
        return self.get_batch([key], [buffer])[0]

    def exists(self, key: str) -> bool:
        """Whether the pool holds ``key``."""
        return self._pool.exists([key])[0]

    # -- batches ---------------------------------------------------------------------------------

    def put_batch(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        """Stores every ``values[i]`` under ``keys[i]``; raises BatchError naming the keys that failed."""
        _raise_batch("put", keys, self._pool.put_buffers(list(keys), list(values), True), miss_ok=False)

    def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> List[Optional[int]]:
        """Reads every ``keys[i]`` into ``buffers[i]``: each value's size, ``None`` for a miss."""
        return _raise_batch("get", keys, self._pool.get_into_buffers(list(keys), list(buffers), True), miss_ok=True)

    def exists_batch(self, keys: Iterable[str]) -> List[bool]:
        """Whether the pool holds each key."""
        return self._pool.exists(list(keys))

    # -- raw addresses ---------------------------------------------------------------------------

    def put_from_ptr(self, key: str, ptr: int, size: int) -> None:
        """Stores the ``size`` bytes at address ``ptr`` under ``key``."""
        self.batch_put_from_ptr([key], [ptr], [size])

    def get_into_ptr(self, key: str, ptr: int, size: int) -> Optional[int]:
        """Reads ``key`` into the ``size`` bytes at ``ptr``: the value's size, ``None`` on a miss."""
        return self.batch_get_into_ptr([key], [ptr], [size])[0]

    def batch_put_from_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Stores ``sizes[i]`` bytes at ``ptrs[i]`` under ``keys[i]``; raises BatchError on failures."""
        _raise_batch("put", keys, self._pool.put_ptrs(list(keys), list(ptrs), list(sizes), True), miss_ok=False)

    def batch_get_into_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> List[Optional[int]]:
        """Reads ``keys[i]`` into ``sizes[i]`` bytes at ``ptrs[i]``: sizes, ``None`` for misses."""
        return _raise_batch("get", keys, self._pool.get_ptrs(list(keys), list(ptrs), list(sizes), True), miss_ok=True)

    # -- memory, maintenance ---------------------------------------------------------------------

    def register_memory(self, ptr: int, size: int) -> str:
        """Registers ``size`` bytes at ``ptr`` for zero-copy I/O until :meth:`deregister_memory`:
        host memory, or device memory on a pool started with a ``gpu`` runtime. Answers where it
        lives: ``"host"`` or ``"gpu:N"``."""
        return self._pool.register_memory(int(ptr), int(size))

    def deregister_memory(self, ptr: int) -> bool:
        """Undoes :meth:`register_memory`; whether ``ptr`` was registered."""
        return self._pool.deregister_memory(int(ptr))

    def clear(self) -> None:
        """Drops every value this node holds."""
        self._pool.clear()

    def flush(self) -> None:
        """Publishes this node's stores to the master: when it returns every node sees them.

        A client that lends no memory owns nothing to publish (a no-op): the nodes holding its puts
        tell the master themselves, woken by each commit, within milliseconds."""
        self._pool.flush()
