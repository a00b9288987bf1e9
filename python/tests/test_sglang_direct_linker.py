"""SGLang's unmodified ``UMBPDirectLinker`` (``--enable-unified-cache-external-linker
--unified-cache-external-linker-backend mori``) of the pinned wheel, on real torch, over this
pool's ``mori.umbp``: it starts, offloads KV pages of a real SGLang KV pool with
``batch_put_ranges_from_ptr`` and loads them back, layer group by layer group, with
``batch_get_ranges_into_ptr``, byte-exact.

Needs torch (about 4 GB with its CUDA wheels, so the CI has none): without it this module is
skipped, and with ``UMBP_REQUIRE_TORCH=1`` it fails instead. ``UMBP_LINKER_DEVICE`` (default
``cpu``) places the KV pool: ``cuda`` on a GPU machine. Run it with
``python/tests/linker_env.sh`` (which also lists the wheels it needs).

What runs is SGLang's own code: the server arguments are published into
``sglang.srt.runtime_context`` as the scheduler does (with a local model config, as nothing may
reach the Hub), the KV pool is ``DSATokenToKVPool`` (DeepSeek sparse attention, 64-token pages:
one packed object per page for the MLA KV of every layer and one for the indexer keys -- the
plain MLA/MHA strategies of the pinned wheel refuse the direct linker), the allocator
``PagedTokenToKVPoolAllocator``, and the linker is made by ``create_unified_cache_linker``.
Only ``sglang/__init__.py`` (the engine entry point) is not run. SGLang's import chain imports
these third-party packages beyond torch, triton and numpy, all real (``linker_env.sh`` pins them
and their dependencies): IPython, PIL (pillow), compressed_tensors, dill, gguf, huggingface_hub,
loguru, msgspec, orjson, psutil, pybase64, pydantic, regex, requests, safetensors, sentencepiece,
starlette, tokenizers, torchvision, tqdm, transformers, tvm_ffi (apache-tvm-ffi), yaml (pyyaml),
zmq (pyzmq); where torch sees CUDA also pynvml (nvidia-ml-py) and sgl_kernel, which is stubbed
when it cannot be imported (sglang-kernel 0.4.10 is built for torch 2.14.1; see
``sglang_linker_harness.UNIMPORTABLE``; nothing on the linker's path calls it).
"""

from __future__ import annotations

import gc
import logging
import os
import time

import numpy as np
import pytest

if os.environ.get("UMBP_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch", reason="torch is not installed (the CI has none)")

import sglang_harness  # noqa: E402
import sglang_linker_harness  # noqa: E402
from conftest import free_port  # noqa: E402

# Read at import: the suite's autouse fixture clears every UMBP_* variable inside tests.
DEVICE = os.environ.get("UMBP_LINKER_DEVICE", "cpu")
PAGE = 64  # DSA's physical page
LAYERS = 3
PAGES = 4  # pages offloaded and loaded back
POOL_PAGES = 2 * PAGES + 1
LINKER_LOG = "sglang.srt.mem_cache.storage.umbp.umbp_direct_linker"


class Sgl:
    """SGLang's modules, imported from the wheel's files."""


@pytest.fixture(scope="module")
def sgl(tmp_path_factory):
    d = sglang_harness.fetch_or_skip(sglang_linker_harness.fetch_full_sglang)
    import importlib

    model = sglang_linker_harness.write_model_config(tmp_path_factory.mktemp("model"), LAYERS)
    with sglang_linker_harness.isolated_sglang(d):
        s = Sgl()
        for attr, name in [
            ("linker_mod", "sglang.srt.mem_cache.storage.umbp.umbp_direct_linker"),
            ("store_mod", "sglang.srt.mem_cache.storage.umbp.umbp_store"),
            ("hicache", "sglang.srt.mem_cache.hicache_storage"),
            ("params_mod", "sglang.srt.mem_cache.cache_init_params"),
            ("assembler", "sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler"),
            ("ucl", "sglang.srt.mem_cache.unified_cache.unified_cache_linker"),
            ("factory", "sglang.srt.mem_cache.unified_cache.linker_factory"),
            ("component_type", "sglang.srt.mem_cache.unified_cache.component_type"),
            ("memory_pool", "sglang.srt.mem_cache.memory_pool"),
            ("allocator", "sglang.srt.mem_cache.allocator.paged"),
            ("rc", "sglang.srt.runtime_context"),
            ("server_args", "sglang.srt.server_args"),
            ("utils", "sglang.srt.utils"),
        ]:
            setattr(s, attr, importlib.import_module(name))
        s.model = str(model)
        try:
            yield s
        finally:
            s.rc.reset_context()
            gc.unfreeze()  # the linker freezes the GC once, as in a scheduler


def publish(s, linker_config: dict):
    """Publishes the server arguments as the scheduler process does."""
    args = s.server_args.ServerArgs(
        model_path=s.model,
        skip_tokenizer_init=True,
        device=DEVICE,
        page_size=PAGE,
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="mori",
        unified_cache_external_linker_config=linker_config,
    )
    gpu = 0 if DEVICE == "cuda" else None
    s.rc.publish(args, role="scheduler", ranks=s.rc.SpawnRanks(world_rank=0, gpu_id=gpu))
    return args


def make_params(s):
    """A DSA KV pool, its paged allocator and the cache parameters, as the scheduler builds them."""
    mp = s.memory_pool
    size = POOL_PAGES * PAGE
    kv = mp.DSATokenToKVPool(
        size=size,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device=DEVICE,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=576,
    )
    alloc = s.allocator.PagedTokenToKVPoolAllocator(
        size, PAGE, torch.bfloat16, DEVICE, kv, need_sort=True
    )
    req_to_token = mp.ReqToTokenPool(size=4, max_context_len=size, device=DEVICE, enable_memory_saver=False)
    params = s.params_mod.CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=PAGE,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
    )
    return kv, alloc, params


def create_linker(s, args, params):
    """As ``sglang.srt.mem_cache.registry`` does for ``--enable-unified-cache-external-linker``."""
    memory = s.rc.get_memory()
    return s.factory.create_unified_cache_linker(
        args,
        params,
        backend=memory.unified_cache_external_linker_backend,
        config=s.factory.get_startup_linker_config(),
        components={s.component_type.ComponentType.FULL},
        forward_stream=None,
    )


def page_bytes(kv, pages) -> list:
    """Copies of every byte of ``pages`` (page numbers): each layer's KV rows and indexer rows."""
    out = []
    for page in pages:
        rows = slice(page * PAGE, (page + 1) * PAGE)
        for buf in kv.kv_buffer:
            out.append(buf[rows].view(torch.uint8).cpu().numpy().copy())
        for buf in kv.index_k_with_scale_buffer:
            out.append(buf[page].cpu().numpy().copy())
    return out


def fill_random(kv, pages, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for page in pages:
        rows = slice(page * PAGE, (page + 1) * PAGE)
        for buf in kv.kv_buffer:
            src = torch.randint(0, 256, buf[rows].view(torch.uint8).shape, dtype=torch.uint8, generator=g)
            buf[rows].view(torch.uint8).copy_(src.to(buf.device))
        for buf in kv.index_k_with_scale_buffer:
            src = torch.randint(0, 256, buf[page].shape, dtype=torch.uint8, generator=g)
            buf[page].copy_(src.to(buf.device))


def zero_pages(kv, pages) -> None:
    for page in pages:
        for buf in kv.kv_buffer:
            buf[page * PAGE : (page + 1) * PAGE].zero_()
        for buf in kv.index_k_with_scale_buffer:
            buf[page].zero_()


def indices(pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages]).to(DEVICE)


class Counting:
    """Wraps the compat client's ranged calls to count them (and their ranges)."""

    def __init__(self, client, monkeypatch):
        self.calls = {"put": 0, "get": 0}
        self.ranges = {"put": 0, "get": 0}
        put, get = client.batch_put_ranges_from_ptr, client.batch_get_ranges_into_ptr

        def counted_put(keys, object_sizes, ptrs, sizes, offsets):
            self.calls["put"] += 1
            self.ranges["put"] += sum(len(r) for r in sizes)
            return put(keys, object_sizes, ptrs, sizes, offsets)

        def counted_get(keys, ptrs, sizes, offsets):
            self.calls["get"] += 1
            self.ranges["get"] += sum(len(r) for r in sizes)
            return get(keys, ptrs, sizes, offsets)

        monkeypatch.setattr(client, "batch_put_ranges_from_ptr", counted_put)
        monkeypatch.setattr(client, "batch_get_ranges_into_ptr", counted_get)


def counted_linker(s, args, params, monkeypatch):
    """``(linker, its compat client, Counting)``: the ranged calls are counted from the moment
    the linker's store builds its client."""
    made = {}
    real_init = s.store_mod.UMBPStore.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made["client"] = self.client
        made["counter"] = Counting(self.client, monkeypatch)

    with monkeypatch.context() as m:
        m.setattr(s.store_mod.UMBPStore, "__init__", init)
        linker = create_linker(s, args, params)
    return linker, made["client"], made["counter"]


def wait_offloads(linker, n: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while linker.num_completed_offloads() < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{linker.num_completed_offloads()} of {n} offloads completed")
        time.sleep(0.01)
    return [linker.pop_completed_offload() for _ in range(n)]


def deployment(request, monkeypatch):
    """The linker's storage config for one deployment, and the env the store reads."""
    if request.param == "distributed":
        master = request.getfixturevalue("master")
        monkeypatch.setenv("UMBP_MASTER_ADDRESS", master)
        monkeypatch.setenv("UMBP_NODE_ADDRESS", "127.0.0.1")
        monkeypatch.setenv("UMBP_NODE_ID", "linker-node")
        monkeypatch.setenv("UMBP_PEER_SERVICE_PORT", str(free_port()))
    return {"dram_capacity_bytes": 64 << 20}


@pytest.fixture(params=["distributed", "local"])
def linker_config(request, monkeypatch):
    return request.param, deployment(request, monkeypatch)


def test_linker_moves_kv_pages_with_ranged_calls(sgl, linker_config, monkeypatch, caplog):
    mode, config = linker_config
    s = sgl
    args = publish(s, config)
    kv, alloc, params = make_params(s)
    caplog.set_level(logging.INFO, logger=LINKER_LOG)
    linker, client, counter = counted_linker(s, args, params, monkeypatch)
    try:
        assert isinstance(linker, s.linker_mod.UMBPDirectLinker)
        want_mode = "Distributed" if mode == "distributed" else "Local"
        assert client.get_deployment_mode().name == want_mode
        assert any(
            f"UMBPDirectLinker topology={want_mode}+None ranged_io=yes" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        assert isinstance(linker.pool_group, s.assembler.DevicePoolGroup)
        assert isinstance(linker.layer_done_counter, s.ucl.LayerWiseLoadCounter)
        PoolName = s.hicache.PoolName
        assert set(linker.pools) == {PoolName.KV, PoolName.INDEXER}

        src_pages = list(range(1, PAGES + 1))  # page 0 is SGLang's padding page
        dst_pages = list(range(PAGES + 1, 2 * PAGES + 1))
        fill_random(kv, src_pages, seed=7)
        want = page_bytes(kv, src_pages)
        hashes = [f"{mode}-page-{i:04d}" for i in range(PAGES)]
        PoolTransfer = s.hicache.PoolTransfer

        # Offload: the write-through path hands device indices and page hashes.
        transfer = PoolTransfer(name=PoolName.KV, device_indices=indices(src_pages), keys=list(hashes))
        assert linker.offload([transfer]) is True
        assert wait_offloads(linker, 1) == [True]
        assert counter.calls["put"] >= 2  # one per pool (KV and indexer)
        # KV: one range per layer per page; indexer: one per layer per page.
        assert counter.ranges["put"] == 2 * LAYERS * PAGES
        assert counter.calls["get"] == 0

        # The objects are in the pool under the linker's keys, one per page holding every
        # layer: <model path, '/' -> '-'>_<hash>_cp0_pp0_<pool> (MLA pages carry no tp term).
        prefix = "-".join(s.model.split("/"))
        keys = [f"{prefix}_{h}_cp0_pp0_{p.value}" for p in (PoolName.KV, PoolName.INDEXER) for h in hashes]
        assert client.batch_exists(keys) == [True] * len(keys)
        assert client.batch_exists([f"{prefix}_{hashes[0]}_tp0_cp0_pp0_kv"]) == [False]

        # Lookup: every prefix of the offloaded pages is restorable; an unknown page ends it.
        lookup = [PoolTransfer(name=PoolName.KV, keys=hashes + ["absent"])]
        assert linker.lookup("req-1", lookup) == list(range(1, PAGES + 1))

        # Load into other pages of the pool, layer-wise, as a forward would consume them.
        zero_pages(kv, dst_pages)
        load = PoolTransfer(name=PoolName.KV, device_indices=indices(dst_pages), keys=list(hashes))
        assert linker.load("req-1", [load]) is True
        index = linker.start_layer_wise_loading()
        assert index >= 0
        done = linker.layer_done_counter
        done.set_consumer(index)
        for layer in range(LAYERS):
            done.wait_until(layer)
        assert linker.finish_layer_wise_loading(index) is True
        assert counter.calls["get"] >= 2
        assert counter.ranges["get"] == 2 * LAYERS * PAGES
        got = page_bytes(kv, dst_pages)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), f"object {i} differs"
        # The source pages are untouched by the load.
        assert all(np.array_equal(a, b) for a, b in zip(page_bytes(kv, src_pages), want))
    finally:
        linker.close()
        client.close()
        s.rc.reset_context()


def test_linker_refuses_a_client_without_ranged_io(sgl, monkeypatch):
    """SGLang's own gate: the linker does not start on a client that does not advertise ranged I/O."""
    s = sgl
    args = publish(s, {"dram_capacity_bytes": 16 << 20})
    _, _, params = make_params(s)
    import umbp.mori

    monkeypatch.setattr(umbp.mori.UMBPClient, "supports_ranged_io", lambda self: False)
    try:
        with pytest.raises(ValueError, match="Direct UMBP needs ranged multi-buffer I/O"):
            create_linker(s, args, params)
    finally:
        s.rc.reset_context()


def test_another_node_loads_what_one_offloaded(sgl, master, monkeypatch):
    """Two linkers, each a node of one pool (as two engines): what one offloads, the other finds
    through the master and loads with ranged gets, byte-exact."""
    s = sgl
    monkeypatch.setenv("UMBP_MASTER_ADDRESS", master)
    monkeypatch.setenv("UMBP_NODE_ADDRESS", "127.0.0.1")
    args = publish(s, {"dram_capacity_bytes": 64 << 20})
    PoolName, PoolTransfer = s.hicache.PoolName, s.hicache.PoolTransfer
    linkers = []
    try:
        for node in ("writer", "reader"):
            monkeypatch.setenv("UMBP_NODE_ID", f"linker-{node}")
            monkeypatch.setenv("UMBP_PEER_SERVICE_PORT", str(free_port()))
            kv, _, params = make_params(s)
            linkers.append((kv, *counted_linker(s, args, params, monkeypatch)))
        (kv_w, writer, _, _), (kv_r, reader, _, reader_counter) = linkers
        pages = list(range(1, PAGES + 1))
        fill_random(kv_w, pages, seed=23)
        want = page_bytes(kv_w, pages)
        hashes = [f"cross-page-{i:04d}" for i in range(PAGES)]
        assert writer.offload([PoolTransfer(name=PoolName.KV, device_indices=indices(pages), keys=list(hashes))])
        assert wait_offloads(writer, 1) == [True]

        # The reader's pool learns of the writer's objects through the master (bounded wait).
        lookup = [PoolTransfer(name=PoolName.KV, keys=list(hashes))]
        deadline = time.monotonic() + 20
        while reader.lookup("req-x", lookup) != list(range(1, PAGES + 1)):
            assert time.monotonic() < deadline, "the reader never saw the writer's pages"
            time.sleep(0.05)
        zero_pages(kv_r, pages)
        assert reader.load("req-x", [PoolTransfer(name=PoolName.KV, device_indices=indices(pages), keys=list(hashes))])
        index = reader.start_layer_wise_loading()
        # False when a ranged get of the writer's objects failed (the linker logs which pool).
        assert reader.finish_layer_wise_loading(index) is True, "the reader's cross-node load failed"
        assert reader_counter.ranges["get"] == 2 * LAYERS * PAGES
        for i, (a, b) in enumerate(zip(page_bytes(kv_r, pages), want)):
            assert np.array_equal(a, b), f"object {i} differs"
    finally:
        for _, linker, client, _ in linkers:
            linker.close()
            client.close()
        s.rc.reset_context()
