"""umbp beside its peers (Mooncake Store, Redis): one holder process, one client process per system,
the same workload against each, rounds interleaved, one markdown table with the ratios umbp/peer.

    python bench/peers/bench_peers.py [--phase-mib 1024] [--rounds 3] [--lat-calls 1000] [--json]

Normally started by ``bench/peers/run.sh``, which installs the peers and builds umbp first.

Per round and per system (systems interleaved: umbp, mooncake, redis, umbp, ...), on a freshly
started holder:

* batch put then batch get of ``--phase-mib`` MiB of distinct keys, 64 KiB values, then 1 MiB
  values (GB/s; every 97th value's bytes compared with what was put);
* ``--lat-calls`` single-key puts of 64 KiB, then as many single-key gets (p50/p99 µs).

The clients, all Python, from numpy buffers:

* umbp: ``umbp.Client.connect`` as a client-only node (``lend_bytes=0``, ``recache_bytes=None``)
  with both buffers registered (``register_memory``); ``batch_put_from_ptr`` /
  ``batch_get_into_ptr`` and ``put_from_ptr`` / ``get_into_ptr`` -- the path SGLang's store takes.
  Holder: ``umbp master`` + ``umbp node --capacity ... --page-size 64KiB``.
* Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, TCP transport): the buffers
  registered with ``register_buffer``; ``batch_put_from`` / ``batch_get_into`` in calls of 256 keys
  (a whole phase in one call overflows its TCP lane queue) and ``put_from`` / ``get_into``. Holder: ``mooncake_master`` + a Python process that mounts the segment.
* Redis (Debian ``redis-server``, no persistence; redis-py + hiredis): pipelined SET/GET in
  chunks of 64 MiB, each value a ``memoryview`` of the source and each reply copied into the
  destination buffer; single SET/GET.

A system that cannot be imported or started is reported (``skipped: why``) and the others go on.
A cell is the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VALUES = (64 << 10, 1 << 20)
LAT_VALUE = 64 << 10
VERIFY_EVERY = 97
REDIS_CHUNK = 64 << 20
# Keys per Mooncake batch call: its TCP transport rejects a 4096-key batch ("TCP lane queue-full",
# rc -800 after 60 s); 256 keys (16 MiB of 64 KiB values) is what SGLang-sized batches look like.
MOONCAKE_CHUNK = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing on port {port} after {timeout}s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def holder_bytes(phase: int, lat_calls: int) -> int:
    """What one round stores (both phases, the latency keys), with room below eviction watermarks."""
    stored = 2 * phase + lat_calls * LAT_VALUE
    page = 2 << 20
    return -(-(stored * 3 // 2 + (128 << 20)) // page) * page


class System:
    """One peer: ``start`` a fresh holder, run the client calls, ``stop`` it."""

    name = "?"

    def start(self, capacity: int) -> None: ...
    def connect(self, src: np.ndarray, dst: np.ndarray) -> None: ...
    def batch_put(self, keys: list[str], offs: list[int], value: int) -> None: ...
    def batch_get(self, keys: list[str], offs: list[int], value: int) -> None: ...
    def put1(self, key: str, off: int, value: int) -> None: ...
    def until_visible(self, keys: list[str]) -> None:
        """Returns once a reader sees every key (the peers' puts are visible when they return)."""
    def get1(self, key: str, off: int, value: int) -> None: ...
    def stop(self) -> None: ...


class Umbp(System):
    name = "umbp"

    def __init__(self, binary: str):
        import umbp  # noqa: F401 -- fail at construction when the wheel is missing

        self.binary = binary
        self.master = self.node = self.client = None
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"no umbp binary at {binary}")

    def start(self, capacity: int) -> None:
        port = free_port()
        self.addr = f"127.0.0.1:{port}"
        self.master = subprocess.Popen([self.binary, "master", "--listen", self.addr, "--heartbeat-ttl", "2s"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, self.master)
        self.node = subprocess.Popen([self.binary, "node", "--master", self.addr, "--node-id", "holder",
                                      "--capacity", str(capacity), "--page-size", "64KiB"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.node.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"umbp node did not start: {line!r}")

    def connect(self, src, dst) -> None:
        import umbp

        self.client = umbp.Client.connect(self.addr, node_id=f"bench-{os.getpid()}-{time.time_ns()}",
                                          recache_bytes=None)
        self.s, self.d = src.ctypes.data, dst.ctypes.data
        self.client.register_memory(self.s, src.nbytes)
        self.client.register_memory(self.d, dst.nbytes)

    def batch_put(self, keys, offs, value):
        self.client.batch_put_from_ptr(keys, [self.s + o for o in offs], [value] * len(keys))

    def until_visible(self, keys):
        # A umbp put returns when the bytes are committed on the holder; the master indexes them when
        # the holder ships its ADDs (every 128 events, or at its next heartbeat: 1 s with the
        # master's --heartbeat-ttl 2s, as `umbp bench` does). Waited for, untimed, as `umbp bench`
        # does; the wait is reported beside the table.
        deadline = time.time() + 30
        left = keys
        while left:
            seen = self.client.exists_batch(left)
            left = [k for k, ok in zip(left, seen) if not ok]
            if left and time.time() > deadline:
                raise RuntimeError(f"umbp: {len(left)} keys not indexed after 30 s")
            if left:
                time.sleep(0.01)

    def batch_get(self, keys, offs, value):
        got = self.client.batch_get_into_ptr(keys, [self.d + o for o in offs], [value] * len(keys))
        if any(g != value for g in got):
            raise RuntimeError(f"umbp: a batch get missed ({[g for g in got if g != value][:2]}, {sum(g != value for g in got)} of {len(got)})")

    def put1(self, key, off, value):
        self.client.put_from_ptr(key, self.s + off, value)

    def get1(self, key, off, value):
        if self.client.get_into_ptr(key, self.d + off, value) != value:
            raise RuntimeError(f"umbp: get of {key} missed")

    def stop(self):
        if self.client is not None:
            self.client.close()
            self.client = None
        stop(self.node)
        stop(self.master)


MOONCAKE_HOLDER = textwrap.dedent("""
    import sys, time
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
    print("ready" if rc == 0 else f"setup failed rc={rc}", flush=True)
    if rc == 0:
        sys.stdin.read()
    s.close()
""")


class Mooncake(System):
    name = "mooncake"

    def __init__(self):
        from mooncake.store import MooncakeDistributedStore  # noqa: F401

        self.bin = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        if not os.access(self.bin, os.X_OK):
            raise RuntimeError("no mooncake_master on PATH")
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # else it advertises the external address
        self.master = self.holder = self.store = None

    def start(self, capacity: int) -> None:
        rpc, http = free_port(), free_port()
        self.master_addr = f"127.0.0.1:{rpc}"
        self.meta = f"http://127.0.0.1:{http}/metadata"
        self.master = subprocess.Popen([self.bin, "--rpc_port", str(rpc), "--rpc_address", "127.0.0.1",
                                        "--enable_http_metadata_server=true",
                                        "--http_metadata_server_host", "127.0.0.1",
                                        "--http_metadata_server_port", str(http)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(rpc, self.master)
        wait_port(http, self.master)
        self.holder = subprocess.Popen([sys.executable, "-c", MOONCAKE_HOLDER, self.meta, str(capacity), self.master_addr],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.holder.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"mooncake holder did not start: {line!r}")

    def connect(self, src, dst):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        # No segment of its own (0): every put lands in the holder's.
        rc = self.store.setup("127.0.0.1", self.meta, 0, 16 << 20, "tcp", "", self.master_addr)
        if rc != 0:
            raise RuntimeError(f"mooncake client setup rc={rc}")
        self.s, self.d = src.ctypes.data, dst.ctypes.data
        for p, n in ((self.s, src.nbytes), (self.d, dst.nbytes)):
            if self.store.register_buffer(p, n) != 0:
                raise RuntimeError("mooncake register_buffer failed")

    def batch_put(self, keys, offs, value):
        rcs = []
        for i in range(0, len(keys), MOONCAKE_CHUNK):
            ks = keys[i:i + MOONCAKE_CHUNK]
            rcs += self.store.batch_put_from(ks, [self.s + o for o in offs[i:i + MOONCAKE_CHUNK]], [value] * len(ks))
        bad = [r for r in rcs if r != 0]
        if bad:
            raise RuntimeError(f"mooncake: {len(bad)} of {len(keys)} puts failed (first rc {bad[0]})")

    def batch_get(self, keys, offs, value):
        rcs = []
        for i in range(0, len(keys), MOONCAKE_CHUNK):
            ks = keys[i:i + MOONCAKE_CHUNK]
            rcs += self.store.batch_get_into(ks, [self.d + o for o in offs[i:i + MOONCAKE_CHUNK]], [value] * len(ks))
        if any(r != value for r in rcs):
            raise RuntimeError(f"mooncake: a batch get failed ({[r for r in rcs if r != value][:1]})")

    def put1(self, key, off, value):
        rc = self.store.put_from(key, self.s + off, value)
        if rc != 0:
            raise RuntimeError(f"mooncake put rc={rc}")

    def get1(self, key, off, value):
        rc = self.store.get_into(key, self.d + off, value)
        if rc != value:
            raise RuntimeError(f"mooncake get rc={rc}")

    def stop(self):
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.holder is not None and self.holder.poll() is None:
            self.holder.stdin.close()
            try:
                self.holder.wait(15)
            except subprocess.TimeoutExpired:
                self.holder.kill()
        stop(self.master)


class Redis(System):
    name = "redis"

    def __init__(self):
        import hiredis  # noqa: F401 -- redis-py uses it when present; without it the figures lie
        import redis  # noqa: F401

        self.bin = shutil.which("redis-server")
        if self.bin is None:
            raise RuntimeError("no redis-server on PATH (Debian: apt-get install redis-server)")
        self.proc = self.r = None

    def start(self, capacity: int) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="umbp-peers-redis-")
        self.proc = subprocess.Popen([self.bin, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc)

    def connect(self, src, dst):
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=self.port)
        self.src, self.dst = memoryview(src), dst

    def _chunks(self, keys, offs, value):
        per = max(1, REDIS_CHUNK // value)
        for i in range(0, len(keys), per):
            yield keys[i:i + per], offs[i:i + per]

    def batch_put(self, keys, offs, value):
        for ks, os_ in self._chunks(keys, offs, value):
            p = self.r.pipeline(transaction=False)
            for k, o in zip(ks, os_):
                p.set(k, self.src[o:o + value])
            p.execute()

    def batch_get(self, keys, offs, value):
        for ks, os_ in self._chunks(keys, offs, value):
            p = self.r.pipeline(transaction=False)
            for k in ks:
                p.get(k)
            for o, v in zip(os_, p.execute()):
                if v is None or len(v) != value:
                    raise RuntimeError("redis: a batch get missed")
                self.dst[o:o + value] = np.frombuffer(v, dtype=np.uint8)

    def put1(self, key, off, value):
        self.r.set(key, self.src[off:off + value])

    def get1(self, key, off, value):
        v = self.r.get(key)
        if v is None or len(v) != value:
            raise RuntimeError(f"redis: get of {key} missed")
        self.dst[off:off + value] = np.frombuffer(v, dtype=np.uint8)

    def stop(self):
        if self.r is not None:
            self.r.close()
            self.r = None
        stop(self.proc)
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)


def verify(src: np.ndarray, dst: np.ndarray, offs: list[int], value: int, who: str) -> None:
    for o in offs[::VERIFY_EVERY] + offs[-1:]:
        if not np.array_equal(src[o:o + value], dst[o:o + value]):
            raise RuntimeError(f"{who}: wrong bytes at offset {o} (value {value})")


def one_round(sys_: System, r: int, src, dst, phase: int, lat_calls: int) -> dict:
    out = {}
    sys_.start(holder_bytes(phase, lat_calls))
    try:
        sys_.connect(src, dst)
        for value in VALUES:
            n = phase // value
            keys = [f"{sys_.name}-r{r}-v{value}-{i}" for i in range(n)]
            offs = [i * value for i in range(n)]
            dst[:] = 0
            t = time.perf_counter()
            sys_.batch_put(keys, offs, value)
            out[("put", value)] = n * value / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            sys_.until_visible(keys)
            out[("visible_s", value)] = time.perf_counter() - t
            t = time.perf_counter()
            sys_.batch_get(keys, offs, value)
            out[("get", value)] = n * value / (time.perf_counter() - t) / 1e9
            verify(src, dst, offs, value, sys_.name)
        # Latency: distinct keys, values at distinct offsets of the same 64 MiB-or-less window.
        slots = max(1, min(lat_calls, phase // LAT_VALUE))
        keys = [f"{sys_.name}-r{r}-lat-{i}" for i in range(lat_calls)]
        offs = [(i % slots) * LAT_VALUE for i in range(lat_calls)]
        put_us, get_us = [], []
        for k, o in zip(keys, offs):
            t = time.perf_counter()
            sys_.put1(k, o, LAT_VALUE)
            put_us.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        sys_.until_visible(keys)
        out[("visible_s", LAT_VALUE, "single")] = time.perf_counter() - t
        dst[:slots * LAT_VALUE] = 0
        for k, o in zip(keys, offs):
            t = time.perf_counter()
            sys_.get1(k, o, LAT_VALUE)
            get_us.append((time.perf_counter() - t) * 1e6)
        verify(src, dst, offs[:slots], LAT_VALUE, sys_.name + " single get")
        for op, xs in (("put", put_us), ("get", get_us)):
            q = statistics.quantiles(xs, n=100)
            out[(op + "_p50",)] = statistics.median(xs)
            out[(op + "_p99",)] = q[98]
    finally:
        sys_.stop()
    return out


def fmt_ratio(a: float | None, b: float | None, lower_better: bool = False) -> str:
    if not a or not b:
        return "–"
    return f"{(b / a) if lower_better else (a / b):.2f}×"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--umbp", default=os.environ.get("UMBP_BIN") or str(ROOT / "target/release/umbp"))
    ap.add_argument("--phase-mib", type=int, default=1024, help="bytes per batch phase (default 1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lat-calls", type=int, default=1000)
    ap.add_argument("--systems", default="umbp,mooncake,redis")
    ap.add_argument("--json", action="store_true", help="also print the cells as one JSON line")
    a = ap.parse_args()
    phase = a.phase_mib << 20

    systems: list[System] = []
    skipped = {}
    makers = {"umbp": lambda: Umbp(a.umbp), "mooncake": Mooncake, "redis": Redis}
    for name in a.systems.split(","):
        try:
            systems.append(makers[name]())
        except Exception as e:  # noqa: BLE001 -- a peer that cannot be set up is reported, not fatal
            skipped[name] = f"{type(e).__name__}: {e}"
            print(f"!! {name} skipped: {skipped[name]}", file=sys.stderr)

    src = np.random.default_rng(16).integers(0, 256, size=phase, dtype=np.uint8)
    dst = np.zeros(phase, dtype=np.uint8)
    cells: dict[str, list[dict]] = {s.name: [] for s in systems}
    t0 = time.time()
    for r in range(a.rounds):
        for s in systems:
            if s.name in skipped:
                continue
            t = time.time()
            try:
                cells[s.name].append(one_round(s, r, src, dst, phase, a.lat_calls))
            except Exception as e:  # noqa: BLE001
                skipped[s.name] = f"round {r}: {type(e).__name__}: {e}"
                print(f"!! {s.name} failed: {skipped[s.name]}", file=sys.stderr)
                continue
            print(f"== round {r + 1}/{a.rounds} {s.name}: {time.time() - t:.1f}s "
                  f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr)

    med = {name: {k: statistics.median(c[k] for c in cs) for k in cs[0]} for name, cs in cells.items() if cs}
    peers = [n for n in ("mooncake", "redis") if n in med]
    u = med.get("umbp", {})
    cols = [("put", 64 << 10, "put 64K"), ("get", 64 << 10, "get 64K"), ("put", 1 << 20, "put 1M"), ("get", 1 << 20, "get 1M")]
    print(f"\nbatch phases of {a.phase_mib} MiB, {a.lat_calls} single 64 KiB calls, median of {a.rounds} "
          f"interleaved rounds, one holder + one client process each, loopback TCP; "
          f"{time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}\n")
    head = "| system | " + " | ".join(c[2] + " GB/s" for c in cols) + " | get p50 / p99 µs | put p50 / p99 µs |"
    print(head)
    print("|" + "---|" * (len(cols) + 3))
    for name, m in med.items():
        print(f"| {name} | " + " | ".join(f"{m[(op, v)]:.2f}" for op, v, _ in cols)
              + f" | {m[('get_p50',)]:,.0f} / {m[('get_p99',)]:,.0f} | {m[('put_p50',)]:,.0f} / {m[('put_p99',)]:,.0f} |")
    for p in peers:
        if not u:
            break
        m = med[p]
        print(f"| umbp / {p} | " + " | ".join(fmt_ratio(u[(op, v)], m[(op, v)]) for op, v, _ in cols)
              + f" | {fmt_ratio(u[('get_p50',)], m[('get_p50',)], True)} / {fmt_ratio(u[('get_p99',)], m[('get_p99',)], True)}"
              + f" | {fmt_ratio(u[('put_p50',)], m[('put_p50',)], True)} / {fmt_ratio(u[('put_p99',)], m[('put_p99',)], True)} |")
    for name, m in med.items():
        waits = {k: v for k, v in m.items() if k[0] == "visible_s"}
        if any(v > 0.005 for v in waits.values()):
            print(f"\n{name}: wait (untimed) until a reader saw the keys after each put phase: " + ", ".join(
                f"{'single-key' if len(k) > 2 else (str(k[1] >> 10) + ' KiB batch')} {v:.2f}s" for k, v in waits.items()))
    print("\nThroughput ratios: umbp / peer (> 1: umbp faster). Latency ratios: peer / umbp (> 1: umbp faster).")
    for name, why in skipped.items():
        print(f"\n{name}: not measured -- {why}")
    if a.json:
        print(json.dumps({"phase_mib": a.phase_mib, "rounds": a.rounds, "lat_calls": a.lat_calls, "skipped": skipped,
                          "median": {n: {"_".join(map(str, k)): v for k, v in m.items()} for n, m in med.items()}}))
    return 0 if "umbp" in med else 1


if __name__ == "__main__":
    sys.exit(main())
