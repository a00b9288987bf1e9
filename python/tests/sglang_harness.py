"""Runs SGLang's unmodified ``UMBPStore`` here: fetches the pinned ``sglang`` wheel from PyPI
(cached under ``target/``), extracts only the files the store needs, and stubs what it imports
that this machine lacks -- ``torch`` (annotations only), ``sglang.srt.environ`` and the host memory
pool (a numpy-backed fake with the methods the store calls). SGLang's code is never committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np

SGLANG_VERSION = "0.5.23"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "target" / "sglang-cache"
# The files the store's import chain reaches (the rest of SGLang is never imported).
NEEDED = (
    "sglang/srt/mem_cache/hicache_storage.py",
    "sglang/srt/mem_cache/storage/umbp/umbp_store.py",
    "sglang/srt/mem_cache/storage/umbp/umbp_host_allocator.py",
    "sglang/srt/mem_cache/storage/umbp/umbp_direct_linker.py",
    "sglang/srt/disaggregation/kv_events.py",
)


class Unavailable(Exception):
    """The wheel cannot be had (offline and not cached)."""


def fetch_or_skip(fetch=None) -> Path:
    """``fetch()`` (default: :func:`fetch_sglang`), or a pytest skip saying why the wheel cannot be
    had here; with ``UMBP_REQUIRE_SGLANG`` set, the failure instead."""
    import pytest

    try:
        return (fetch or fetch_sglang)()
    except Unavailable as e:
        if os.environ.get("UMBP_REQUIRE_SGLANG"):
            raise
        pytest.skip(str(e))


def fetch_sglang() -> Path:
    """The directory holding the extracted ``sglang`` files, downloading the wheel on first use."""
    dest = CACHE / f"sglang-{SGLANG_VERSION}"
    if all((dest / f).exists() for f in NEEDED):
        return dest
    wheel_env = os.environ.get("UMBP_SGLANG_WHEEL")
    wheels = list(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if wheel_env:
        wheels = [Path(wheel_env)]
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--platform", "manylinux_2_34_x86_64", "-d", str(CACHE), f"sglang=={SGLANG_VERSION}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise Unavailable(f"pip download sglang=={SGLANG_VERSION} failed: {r.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in NEEDED:
            z.extract(name, dest)
    return dest


class _Env:
    """``envs.X.get()`` of ``sglang.srt.environ``: nothing set."""

    def __getattr__(self, name):
        return types.SimpleNamespace(get=lambda: None, is_set=lambda: False)


def install_stubs(sglang_dir: Path) -> None:
    """Makes ``import sglang.srt.mem_cache.storage.umbp.umbp_store`` resolve to the wheel's files
    without running ``sglang/__init__.py`` (which pulls in the whole engine)."""
    if "sglang" in sys.modules and getattr(sys.modules["sglang"], "_umbp_stub", False):
        return
    torch = types.ModuleType("torch")

    class Tensor:  # annotations only: the store is driven with numpy-backed fakes
        pass

    class dtype:
        pass

    torch.Tensor = Tensor
    torch.dtype = dtype
    torch.uint8 = dtype()
    sys.modules.setdefault("torch", torch)

    def package(name: str, path: Path) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        m._umbp_stub = True
        sys.modules[name] = m
        return m

    package("sglang", sglang_dir / "sglang")
    package("sglang.srt", sglang_dir / "sglang" / "srt")
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = _Env()
    sys.modules["sglang.srt.environ"] = environ
    pool_host = types.ModuleType("sglang.srt.mem_cache.memory_pool_host")

    class HostKVCache:
        pass

    pool_host.HostKVCache = HostKVCache
    sys.modules["sglang.srt.mem_cache.memory_pool_host"] = pool_host


def import_kv_events(sglang_dir: Path):
    """SGLang's ``kv_events`` module (the KV cache events and their ``KVEventBatch`` wire format),
    unmodified. It imports two modules only its publisher side uses (``runtime_context``, whose
    import pulls in the whole server-args tree, and ``utils.network``); they are stubbed with the
    two names it takes, which raise if anything calls them."""
    install_stubs(sglang_dir)
    import importlib

    def unused(*_a, **_k):
        raise RuntimeError("stub: the KV event publisher is not run here")

    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = unused
    sys.modules.setdefault("sglang.srt.runtime_context", runtime)
    network = types.ModuleType("sglang.srt.utils.network")
    network.NetworkAddress = type("NetworkAddress", (), {"parse": staticmethod(unused)})
    sys.modules.setdefault("sglang.srt.utils.network", network)
    if "sglang.srt.utils" not in sys.modules:
        utils = types.ModuleType("sglang.srt.utils")
        utils.__path__ = []
        sys.modules["sglang.srt.utils"] = utils
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def import_store(sglang_dir: Path):
    """SGLang's ``umbp_store`` and ``hicache_storage`` modules, unmodified."""
    install_stubs(sglang_dir)
    import importlib

    store = importlib.import_module("sglang.srt.mem_cache.storage.umbp.umbp_store")
    hicache = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    return store, hicache


class _Storage:
    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def data_ptr(self) -> int:
        return int(self._arr.ctypes.data)

    def nbytes(self) -> int:
        return int(self._arr.nbytes)


class FakeTensor:
    """The bits of a torch tensor the store touches on the host pool's buffer."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def numel(self) -> int:
        return int(self.arr.size)

    def untyped_storage(self) -> _Storage:
        return _Storage(self.arr)

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)


class FakeHostPool:
    """A page-first host KV pool: ``pages`` pages of ``page_size`` tokens; each page holds a K and
    a V object of ``element_size`` bytes (MHA), or one object (MLA), in one numpy buffer."""

    layout = "page_first"
    stores_page_envelope = False

    def __init__(self, pages: int, page_size: int = 4, element_size: int = 64 << 10, mla: bool = False):
        self.page_size = page_size
        self.element_size = element_size
        self.mla = mla
        self.parts = 1 if mla else 2
        self.buf = np.zeros(pages * self.parts * element_size, dtype=np.uint8)
        self.kv_buffer = FakeTensor(self.buf)

    def indices(self, pages) -> np.ndarray:
        """Host token indices covering ``pages`` (page numbers)."""
        return np.concatenate([np.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])

    def page_object(self, page: int, part: int = 0) -> np.ndarray:
        """The bytes of one stored object (a view into the buffer)."""
        start = (page * self.parts + part) * self.element_size
        return self.buf[start : start + self.element_size]

    def get_page_buffer_meta(self, indices):
        indices = indices.tolist()
        base = int(self.buf.ctypes.data)
        ptrs = []
        for i in range(0, len(indices), self.page_size):
            page = indices[i] // self.page_size
            for part in range(self.parts):
                ptrs.append(base + (page * self.parts + part) * self.element_size)
        return ptrs, [self.element_size] * len(ptrs)

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int:
        return self.element_size

    def get_ksize_per_token(self) -> int:
        return self.element_size // self.page_size


def storage_config(hicache, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, extra=None):
    """A ``HiCacheStorageConfig`` for one rank."""
    return hicache.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="test/model",
        extra_config=extra,
    )


def fill(pool: FakeHostPool, pages, seed: int) -> None:
    """Deterministic bytes in every object of ``pages``."""
    for p in pages:
        for part in range(pool.parts):
            rng = np.random.default_rng(seed * 1_000_003 + p * 7 + part)
            pool.page_object(p, part)[:] = rng.integers(0, 256, pool.element_size, dtype=np.uint8)


def expected(pool: FakeHostPool, page: int, part: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1_000_003 + page * 7 + part)
    return rng.integers(0, 256, pool.element_size, dtype=np.uint8)
