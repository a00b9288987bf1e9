"""SGLang's unmodified UMBPStore on this pool, local deployment (SGLang's default)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_harness import FakeHostPool, fill, storage_config


def make_store(sglang, pages=16, mla=False, extra=None, element_size=64 << 10):
    store_mod, hicache = sglang
    cfg = storage_config(hicache, mla=mla, extra={"dram_capacity_bytes": 128 << 20, **(extra or {})})
    pool = FakeHostPool(pages, element_size=element_size, mla=mla)
    store = store_mod.UMBPStore(cfg, pool)
    return store, pool, hicache


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("element_size", [64 << 10, 1 << 20])
def test_batch_set_get_v1_byte_exact(sglang, mla, element_size):
    store, pool, _ = make_store(sglang, mla=mla, element_size=element_size)
    assert store.client.get_deployment_mode().name == "Local"
    keys = [f"h{i}" for i in range(4)]
    fill(pool, range(4), seed=1)
    written = [pool.page_object(p, part).copy() for p in range(4) for part in range(pool.parts)]
    assert store.batch_set_v1(keys, pool.indices(range(4))) == [True] * 4
    # Read the pages back into pages 8..11 of the host pool.
    assert store.batch_get_v1(keys, pool.indices(range(8, 12))) == [True] * 4
    read = [pool.page_object(p, part) for p in range(8, 12) for part in range(pool.parts)]
    for w, r in zip(written, read):
        assert np.array_equal(w, r)
    store.close()


def test_batch_exists_counts_the_leading_hits(sglang):
    store, pool, _ = make_store(sglang)
    fill(pool, range(4), seed=2)
    store.batch_set_v1(["a", "b", "c"], pool.indices(range(3)))
    assert store.batch_exists(["a", "b", "c"]) == 3
    assert store.batch_exists(["a", "b", "x", "c"]) == 2
    assert store.batch_exists(["x", "a"]) == 0
    # A page whose V half is missing is not a hit.
    ptrs, sizes = pool.get_page_buffer_meta(pool.indices([3]))
    assert store.client.put_from_ptr("d_0_k", ptrs[0], sizes[0])
    assert store.batch_exists(["a", "d"]) == 1
    assert store.exists("a_0_k") and not store.exists("d_0_v")
    store.close()


def test_write_once_keeps_the_first_bytes(sglang):
    store, pool, _ = make_store(sglang)
    fill(pool, [0], seed=3)
    first = pool.page_object(0).copy()
    assert store.batch_set_v1(["w"], pool.indices([0])) == [True]
    fill(pool, [0], seed=4)  # different bytes under the same key
    assert store.batch_set_v1(["w"], pool.indices([0])) == [True]
    assert store.batch_get_v1(["w"], pool.indices([5])) == [True]
    assert np.array_equal(pool.page_object(5), first)
    store.close()


def test_clear(sglang):
    store, pool, _ = make_store(sglang)
    store.batch_set_v1(["a", "b"], pool.indices(range(2)))
    assert store.batch_exists(["a", "b"]) == 2
    store.clear()
    assert store.batch_exists(["a", "b"]) == 0
    assert store.batch_get_v1(["a"], pool.indices([3])) == [False]
    store.close()


def test_with_depth_path(sglang):
    """extra_info.prefix_keys routes batch_set_v1 through batch_put_from_ptr_with_depth."""
    store, pool, hicache = make_store(sglang)
    fill(pool, range(2), seed=5)
    info = hicache.HiCacheStorageExtraInfo(prefix_keys=["p0", "p1"])
    assert store.batch_set_v1(["d0", "d1"], pool.indices(range(2)), info) == [True, True]
    assert store.batch_exists(["d0", "d1"]) == 2
    store.close()


def test_legacy_set_get(sglang):
    store, pool, _ = make_store(sglang)
    fill(pool, range(3), seed=6)
    ptrs, sizes = pool.get_page_buffer_meta(pool.indices(range(3)))
    assert store.set("legacy", None, ptrs[0], sizes[0]) is True
    assert store.set("legacy2", None, None, None) is False
    out = np.zeros(sizes[0], dtype=np.uint8)
    assert store.get("legacy", out.ctypes.data, sizes[0]) == out.ctypes.data
    assert np.array_equal(out, pool.page_object(0, 0))
    assert store.get("nope", out.ctypes.data, sizes[0]) is None
    assert store.batch_set(["l1", "l2"], None, ptrs[1:3], sizes[1:3]) is True
    outs = [np.zeros(s, dtype=np.uint8) for s in sizes[1:3]]
    assert store.batch_get(["l1", "l2", "l3"], [o.ctypes.data for o in outs] + [out.ctypes.data], sizes[1:3] + [sizes[0]]) == 2
    assert np.array_equal(outs[0], pool.page_object(0, 1)) and np.array_equal(outs[1], pool.page_object(1, 0))
    assert store.flush() is True
    store.close()


def test_local_mode_does_not_register_memory(sglang):
    """Local: nothing to register (the store only registers in remote modes); no error either."""
    store, pool, _ = make_store(sglang)
    assert store._zero_copy_registered is False
    store.close()


def test_v2_side_pool(sglang):
    """The multi-pool v2 interface: a KV anchor plus a registered side pool (SWA)."""
    store, pool, hicache = make_store(sglang)
    side = FakeHostPool(8, element_size=32 << 10, mla=True)  # one object per page
    store.register_mem_host_pool_v2(side, hicache.PoolName.SWA)
    keys = ["s0", "s1", "s2"]
    fill(pool, range(3), seed=8)
    fill(side, range(3), seed=9)
    assert store.batch_set_v1(keys, pool.indices(range(3))) == [True] * 3
    put = hicache.PoolTransfer(name=hicache.PoolName.SWA, keys=keys, host_indices=side.indices(range(3)))
    assert store.batch_set_v2([put]) == {hicache.PoolName.SWA: [True] * 3}
    probe = hicache.PoolTransfer(name=hicache.PoolName.SWA, keys=keys)
    result = store.batch_exists_v2(keys + ["absent"], [probe])
    assert result.kv_hit_pages == 3 and result.extra_pool_hit_pages == {hicache.PoolName.KV: 3, hicache.PoolName.SWA: 3}
    get = hicache.PoolTransfer(name=hicache.PoolName.SWA, keys=keys, host_indices=side.indices(range(4, 7)))
    assert store.batch_get_v2([get]) == {hicache.PoolName.SWA: [True] * 3}
    for i in range(3):
        assert np.array_equal(side.page_object(4 + i), side.page_object(i))
    store.close()
