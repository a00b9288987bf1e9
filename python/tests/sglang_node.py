"""A second process of the distributed test: a UMBPStore node that writes pages, flushes, says
READY, and keeps serving them until its stdin closes.

    python sglang_node.py <sglang_dir> <pages> <seed> <element_size> <tp_rank> <tp_size>
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_harness import FakeHostPool, fill, import_store, storage_config  # noqa: E402


def main() -> int:
    sglang_dir, pages, seed, element_size, tp_rank, tp_size = sys.argv[1:7]
    store_mod, hicache = import_store(Path(sglang_dir))
    pages, seed, element_size = int(pages), int(seed), int(element_size)
    cfg = storage_config(hicache, tp_rank=int(tp_rank), tp_size=int(tp_size), extra={"dram_capacity_bytes": 64 << 20})
    pool = FakeHostPool(pages, element_size=element_size)
    store = store_mod.UMBPStore(cfg, pool)
    fill(pool, range(pages), seed)
    keys = [f"page{i}" for i in range(pages)]
    ok = store.batch_set_v1(keys, pool.indices(range(pages)))
    flushed = store.flush()
    pool_obj = store.client._pool
    print(f"READY {int(all(ok))} {int(flushed)} {pool_obj.node_id} {pool_obj.peer_address} "
          f"{int(store._zero_copy_registered)}", flush=True)
    sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
