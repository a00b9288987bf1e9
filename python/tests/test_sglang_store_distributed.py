"""SGLang's unmodified UMBPStore on this pool, distributed deployment: a real ``umbp master``
process, a writer node in a second process, a reader node (this process) with another node id."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sglang_harness
from conftest import free_port
from sglang_harness import FakeHostPool, expected, storage_config

HERE = Path(__file__).resolve().parent


def start_writer(master, pages, seed, element_size, tp_rank=0, tp_size=1, env_extra=None):
    env = dict(os.environ)
    env.update({"UMBP_MASTER_ADDRESS": master, "UMBP_NODE_ADDRESS": "127.0.0.1", **(env_extra or {})})
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sglang_node.py"), str(sglang_harness.fetch_sglang()), str(pages), str(seed),
         str(element_size), str(tp_rank), str(tp_size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"writer failed: {line} {proc.stderr.read()[-3000:]}")
    return proc, line


def stop(proc):
    proc.stdin.close()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("element_size", [64 << 10, 1 << 20])
def test_one_node_writes_another_reads(sglang, master, monkeypatch, element_size):
    store_mod, hicache = sglang
    pages, seed = 6, 11
    writer, ready = start_writer(master, pages, seed, element_size)
    try:
        assert ready[1:3] == ["1", "1"], ready  # every page stored, flush acknowledged
        assert ready[3] == "127.0.0.1:dp0:pp0:tp0"  # the store's default node id
        assert ready[5] == "1"  # the host pool was registered for zero copy
        monkeypatch.setenv("UMBP_MASTER_ADDRESS", master)
        monkeypatch.setenv("UMBP_NODE_ADDRESS", "127.0.0.1")
        monkeypatch.setenv("UMBP_NODE_ID", "reader")
        cfg = storage_config(hicache, extra={"dram_capacity_bytes": 64 << 20})
        pool = FakeHostPool(pages + 2, element_size=element_size)
        store = store_mod.UMBPStore(cfg, pool)
        try:
            assert store.client.is_distributed()
            assert store.client.get_deployment_mode().name == "Distributed"
            assert store.client._pool.node_id == "reader"
            keys = [f"page{i}" for i in range(pages)]
            assert store.batch_exists(keys) == pages
            assert store.batch_exists(keys[:2] + ["absent"] + keys[2:]) == 2
            assert store.batch_get_v1(keys, pool.indices(range(pages))) == [True] * pages
            for p in range(pages):
                for part in range(2):
                    assert np.array_equal(pool.page_object(p, part), expected(pool, p, part, seed)), (p, part)
            # Write-once across nodes: the reader's different bytes do not replace the writer's.
            pool.page_object(0, 0)[:] = 7
            assert store.batch_set_v1([keys[0]], pool.indices([0])) == [True]
            assert store.batch_get_v1([keys[0]], pool.indices([pages])) == [True]
            assert np.array_equal(pool.page_object(pages, 0), expected(pool, 0, 0, seed))
        finally:
            store.close()
    finally:
        stop(writer)


def free_port_pair() -> int:
    """A port P with P + 1 free too (rank 1 binds base + 1)."""
    import socket

    for _ in range(100):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def test_each_rank_is_a_node_with_offset_ports(sglang, master):
    base = free_port_pair()
    writer, ready = start_writer(master, 1, 3, 64 << 10, tp_rank=1, tp_size=2,
                                 env_extra={"UMBP_PEER_SERVICE_PORT": str(base)})
    try:
        assert ready[3] == "127.0.0.1:dp0:pp0:tp1"
        assert ready[4] == f"127.0.0.1:{base + 1}"  # scalar port + rank
    finally:
        stop(writer)
