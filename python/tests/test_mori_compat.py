"""The ``mori.umbp`` surface: config objects, enums and UMBPClient's answers."""

from __future__ import annotations

import numpy as np
import pytest

import mori.umbp as mu


def local_client(capacity: int = 64 << 20) -> mu.UMBPClient:
    cfg = mu.UMBPConfig()
    cfg.dram.capacity_bytes = capacity
    return mu.UMBPClient(cfg)


def test_nested_config_fields_are_live_and_typed():
    cfg = mu.UMBPConfig.from_environment()
    cfg.dram.capacity_bytes = 123
    cfg.ssd.io.queue_depth = 7
    cfg.ssd.durability.mode = mu.UMBPDurabilityMode.Relaxed
    assert cfg.dram.capacity_bytes == 123 and cfg.ssd.io.queue_depth == 7
    assert cfg.ssd.durability.mode == mu.UMBPDurabilityMode.Relaxed
    assert type(cfg.ssd.enabled) is bool and type(cfg.ssd.storage_dir) is str
    assert type(cfg.ssd.spdk_proxy_tenant_id) is int and hasattr(cfg.ssd, "high_watermark")
    assert cfg.distributed is None and cfg.standalone_process is None
    d = mu.UMBPDistributedConfig()
    d.master_config.master_address = "h:1"
    d.master_config.tags = ["a=b"]
    d.io_engine.port = 9
    assert d.master_config.master_address == "h:1" and d.io_engine.port == 9
    for f in ("staging_buffer_size", "ranged_scratch_size", "ssd_staging_buffer_size", "ssd_staging_buffer_slots",
              "peer_service_port", "cache_remote_fetches", "dram_page_size", "medium"):
        assert hasattr(d, f), f


def test_from_environment(monkeypatch):
    monkeypatch.setenv("UMBP_DRAM_CAPACITY", str(32 << 20))
    monkeypatch.setenv("UMBP_SSD_ENABLED", "0")
    monkeypatch.setenv("UMBP_SSD_DIR", "/x")
    cfg = mu.UMBPConfig.from_environment()
    assert cfg.dram.capacity_bytes == 32 << 20 and cfg.ssd.enabled is False and cfg.ssd.storage_dir == "/x"
    monkeypatch.delenv("UMBP_SSD_ENABLED")
    assert mu.UMBPConfig.from_environment().ssd.enabled is True  # mori's default


def test_enums():
    assert mu.UMBPDeploymentMode.Local.name == "Local"
    assert {m.name for m in mu.UMBPDeploymentMode} == {"Local", "StandaloneProcess", "Distributed"}
    assert {m.name for m in mu.UMBPRole} == {"Standalone", "SharedSSDLeader", "SharedSSDFollower"}
    assert mu.UMBPTierType.HBM != mu.UMBPTierType.DRAM
    assert mu.UMBPIoBackend.Posix != mu.UMBPIoBackend.IoUring
    assert mu.UMBPMedium.DRAM and mu.UMBPHostBufferBacking.AnonymousShm
    assert not hasattr(mu, "UMBPStandaloneProcessConfig")


def test_client_methods():
    c = local_client()
    assert c.get_deployment_mode() == mu.UMBPDeploymentMode.Local and not c.is_distributed()
    assert c.supports_ranged_io() is True
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    p, q = src.ctypes.data, dst.ctypes.data
    assert c.put_from_ptr("a", p, 1024) is True
    assert c.put_from_ptr("a", p + 1, 1024) is True  # write-once: True, bytes kept
    assert c.get_into_ptr("a", q, 1024) is True and (dst[:1024] == src[:1024]).all()
    assert c.exists("a") and not c.exists("b")
    assert c.batch_put_from_ptr(["b", "c"], [p, p + 1024], [1024, 1024]) == [True, True]
    assert c.batch_put_from_ptr_with_depth(["d"], [p + 2048], [1024], [3]) == [True]
    assert c.batch_get_into_ptr(["c", "zz"], [q, q + 1024], [1024, 1024]) == [True, False]
    assert c.batch_exists(["a", "b", "zz", "c"]) == [True, True, False, True]
    assert c.batch_exists_consecutive(["a", "b", "zz", "c"]) == 2
    assert c.flush() is True
    assert c.register_memory(p, src.nbytes) is True
    assert c.register_memory(p, src.nbytes) is False  # overlap: refused, not raised
    assert c.deregister_memory(p) is True
    # mori's device hint does not decide: the address does (host memory here, so it registers).
    assert c.register_memory(p, src.nbytes, None, 0) is True
    assert c.deregister_memory(p) is True
    assert c.register_memory(4096, 1 << 20) is False  # neither host nor device memory: refused
    # The local pool is a node of its own in-process master: its external blocks are indexed there.
    assert c.report_external_kv_blocks(["h"], mu.UMBPTierType.DRAM) is True
    assert c.revoke_all_external_kv_blocks_at_tier(mu.UMBPTierType.HBM) is True
    assert c.report_external_kv_blocks([], mu.UMBPTierType.DRAM) is False  # bad input: False
    assert c.clear() is True
    assert c.batch_exists(["a", "b"]) == [False, False]
    c.close()
    assert c.put_from_ptr("a", p, 16) is False
    assert c.clear() is False


def test_ranged_io_moves_parts_of_values():
    c = local_client()
    src = np.arange(10_000, dtype=np.uint32).view(np.uint8)  # 40 000 distinct-ish bytes
    size = src.nbytes
    p = src.ctypes.data
    # One value assembled from three ranges given out of order, another from one.
    cuts = [(25_000, size - 25_000), (0, 9_999), (9_999, 15_001)]
    ok = c.batch_put_ranges_from_ptr(
        ["v", "w"],
        [size, 100],
        [[p + off for off, _ in cuts], [p]],
        [[n for _, n in cuts], [100]],
        [[off for off, _ in cuts], [0]],
    )
    assert ok == [True, True]
    whole = np.zeros_like(src)
    assert c.get_into_ptr("v", whole.ctypes.data, size) is True and (whole == src).all()
    # Two ranges of "v" into two buffers, one range of "w", a missing key.
    a, b, d = np.zeros(300, np.uint8), np.zeros(7, np.uint8), np.zeros(10, np.uint8)
    got = c.batch_get_ranges_into_ptr(
        ["v", "w", "zz"],
        [[a.ctypes.data, b.ctypes.data], [d.ctypes.data], [d.ctypes.data]],
        [[300, 7], [10], [10]],
        [[4_000, size - 7], [90], [0]],
    )
    assert got == [True, True, False]
    assert (a == src[4_000:4_300]).all() and (b == src[size - 7:]).all() and (d == src[90:100]).all()
    # Ranges that do not tile, overlap or overrun fail their key alone; ragged lists: all False.
    assert c.batch_put_ranges_from_ptr(["gap", "ok"], [100, 8], [[p, p + 60], [p]], [[50, 40], [8]],
                                       [[0, 60], [0]]) == [False, True]
    assert c.batch_get_ranges_into_ptr(["v"], [[a.ctypes.data, b.ctypes.data]], [[300, 7]], [[0, 100]]) == [False]
    assert c.batch_get_ranges_into_ptr(["w"], [[d.ctypes.data]], [[10]], [[95]]) == [False]
    assert c.batch_get_ranges_into_ptr(["v", "w"], [[a.ctypes.data]], [[300]], [[0]]) == [False, False]
    assert c.batch_put_ranges_from_ptr(["x"], [8], [[p]], [[8, 8]], [[0]]) == [False]
    assert not c.exists("gap") and not c.exists("x") and c.exists("ok")
    c.close()


def test_bad_input_answers_all_false():
    c = local_client()
    buf = np.zeros(64, dtype=np.uint8)
    p = buf.ctypes.data
    assert c.batch_put_from_ptr(["a", "b"], [p], [8, 8]) == [False, False]  # ragged
    assert c.batch_put_from_ptr_with_depth(["a"], [p], [8], [1, 2]) == [False]
    assert c.batch_get_into_ptr(["a", "b"], [p, p], [8]) == [False, False]
    assert c.batch_put_from_ptr(["a"], ["nope"], [8]) == [False]
    assert c.batch_put_from_ptr(["a"], [p], [-1]) == [False]
    assert c.batch_put_from_ptr([1], [p], [8]) == [False]
    assert c.batch_put_from_ptr(["a"], [8], [4096]) == [False]  # unmapped: no crash
    assert c.get_into_ptr("a", 0, 8) is False
    assert c.batch_exists([]) == [] and c.batch_exists_consecutive([]) == 0
    assert c.batch_put_from_ptr(None, None, None) == []
    c.close()


def test_standalone_process_is_refused():
    cfg = mu.UMBPConfig()
    cfg.standalone_process = object()
    with pytest.raises(RuntimeError):
        mu.UMBPClient(cfg)


def test_host_mem_allocator():
    a = mu.UMBPHostMemAllocator()
    h = a.alloc(10_000, mu.UMBPHostBufferBacking.AnonymousHugetlb, 2 << 20, -1, True)
    assert h and h.ptr and h.mapped_size >= 10_000 and h.actual_alignment > 0
    assert h.actual_backing == mu.UMBPHostBufferBacking.Anonymous  # hugetlb demoted
    c = local_client()
    src = np.frombuffer(b"m" * 10_000, dtype=np.uint8)
    assert c.register_memory(h.ptr, h.mapped_size)
    import ctypes

    ctypes.memmove(h.ptr, src.ctypes.data, 10_000)
    assert c.put_from_ptr("h", h.ptr, 10_000)
    out = np.zeros(10_000, dtype=np.uint8)
    assert c.get_into_ptr("h", out.ctypes.data, 10_000) and bytes(out) == b"m" * 10_000
    assert c.deregister_memory(h.ptr)
    a.free(h)
    assert not h
    assert not a.alloc(0)
    c.close()


def test_enums_print_like_pybind():
    assert str(mu.UMBPDeploymentMode.Local) == "UMBPDeploymentMode.Local"
    assert f"{mu.UMBPHostBufferBacking.Anonymous}" == "UMBPHostBufferBacking.Anonymous"
    assert mu.UMBPRole.Standalone == 0


def test_more_malformed_batches():
    c = local_client()
    buf = np.zeros(64, dtype=np.uint8)
    p = buf.ctypes.data
    assert c.batch_put_from_ptr("ab", [p, p], [8, 8]) == [False, False]  # a str is not a key list
    assert c.batch_get_into_ptr(["a"], [p], [2**70]) == [False]
    assert c.batch_exists([None]) == [False]
    assert c.batch_put_from_ptr_with_depth(["a"], [p], [8], None) == [False]
    assert c.batch_put_from_ptr(("t",), (p,), (8,)) == [True]  # tuples are sequences too
    c.close()
