"""Python vs Rust: batch put/get of 64 KiB and 1 MiB values to a DRAM node in another process over
the TCP data plane, through ``umbp.Client`` (``batch_put_from_ptr`` / ``batch_get_into_ptr``,
the path SGLang's store takes) beside the Rust ``PoolClient`` (``umbp bench``'s remote rows), in
the same run.

    python python/bench/bench_remote.py [--umbp target/release/umbp] [--rounds 5] [--batch-mib 64] [--json]

Topology, the same as ``umbp bench``'s remote rows: a ``umbp master``; ``umbp bench-child`` (a DRAM
node) in a second process; this process a client-only node. Each round puts one batch of distinct
keys and gets it back; a cell is the median of the rounds. Use release builds of both the wheel
and the binary: debug figures say nothing about speed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import umbp

ROOT = Path(__file__).resolve().parents[2]
VALUE_SIZES = (64 << 10, 1 << 20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing on port {port}")


def child_capacity(rounds: int, batch: int) -> int:
    """DRAM the bench-child lends: what ``umbp bench`` gives its own (every round's keys of both sizes
    stay stored, with room below the master's eviction watermark), so both sides write to the same node."""
    stored = 2 * rounds * batch
    page = 64 << 10
    return -(-(stored + stored // 2 + (64 << 20)) // page) * page


def python_rows(binary: str, rounds: int, batch: int, register: bool) -> dict:
    """``{(op, value): GB/s}`` of umbp.Client against a bench-child node."""
    port = free_port()
    master = subprocess.Popen([binary, "master", "--listen", f"127.0.0.1:{port}", "--heartbeat-ttl", "2s"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        wait_port(port)
        addr = f"127.0.0.1:{port}"
        child = subprocess.Popen([binary, "bench-child", "--master", addr, "--capacity", str(child_capacity(rounds, batch))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = child.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"bench-child did not start: {line!r}")
        out = {}
        with umbp.Client.connect(addr, node_id="py-bench", recache_bytes=None) as c:
            src = (ctypes.c_uint8 * batch)()
            dst = (ctypes.c_uint8 * batch)()
            ctypes.memset(src, 7, batch)
            s, d = ctypes.addressof(src), ctypes.addressof(dst)
            if register:
                c.register_memory(s, batch)
                c.register_memory(d, batch)
            for value in VALUE_SIZES:
                n = batch // value
                ptrs_s = [s + i * value for i in range(n)]
                ptrs_d = [d + i * value for i in range(n)]
                sizes = [value] * n
                put, get = [], []
                for r in range(rounds):
                    keys = [f"py-{value}-{r}-{i}" for i in range(n)]
                    t = time.perf_counter()
                    c.batch_put_from_ptr(keys, ptrs_s, sizes)
                    put.append(n * value / (time.perf_counter() - t) / 1e9)
                    c.flush()
                    t = time.perf_counter()
                    c.batch_get_into_ptr(keys, ptrs_d, sizes)
                    get.append(n * value / (time.perf_counter() - t) / 1e9)
                out[("put", value)] = statistics.median(put)
                out[("get", value)] = statistics.median(get)
        return out
    finally:
        if child is not None:
            child.stdin.close()
            child.wait(10)
        master.terminate()
        master.wait(10)


def rust_rows(binary: str, rounds: int, batch: int) -> dict:
    """``{(op, value): GB/s}`` of the Rust PoolClient's remote rows (``umbp bench --json``)."""
    r = subprocess.run([binary, "bench", "--json", "--rounds", str(rounds), "--batch-bytes", str(batch),
                        "--latency-calls", "100"], capture_output=True, text=True, check=True)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return {(row["op"], row["value_bytes"]): row["pool_gbps"] for row in report["rows"] if row["path"] == "remote"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--umbp", default=os.environ.get("UMBP_BIN") or shutil.which("umbp") or str(ROOT / "target/release/umbp"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-mib", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    batch = a.batch_mib << 20
    py = python_rows(a.umbp, a.rounds, batch, register=False)
    py_reg = python_rows(a.umbp, a.rounds, batch, register=True)
    rust = rust_rows(a.umbp, a.rounds, batch)
    rows = []
    for op in ("put", "get"):
        for value in VALUE_SIZES:
            k = (op, value)
            rows.append({"op": op, "value_bytes": value, "python_gbps": py[k], "python_registered_gbps": py_reg[k],
                         "rust_gbps": rust.get(k, float("nan")), "ratio": py[k] / rust[k] if rust.get(k) else float("nan")})
    if a.json:
        print(json.dumps({"rounds": a.rounds, "batch_bytes": batch, "rows": rows}))
        return 0
    print(f"batch {a.batch_mib} MiB, median of {a.rounds} rounds, remote node over TCP (2 processes)\n")
    print("| op | value | Python GB/s | Python, registered GB/s | Rust PoolClient GB/s | Python / Rust |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        label = f"{r['value_bytes'] >> 10} KiB" if r["value_bytes"] < (1 << 20) else f"{r['value_bytes'] >> 20} MiB"
        print(f"| {r['op']} | {label} | {r['python_gbps']:.2f} | {r['python_registered_gbps']:.2f} | "
              f"{r['rust_gbps']:.2f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
