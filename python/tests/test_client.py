"""The binding itself: umbp.Client and the native Pool, in a local pool."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

import umbp


@pytest.fixture
def client():
    with umbp.Client.local(256 << 20) as c:
        yield c


def test_put_get_round_trip(client):
    client.put("a", b"hello")
    assert client.get("a") == b"hello"
    assert client.get("missing") is None
    assert client.exists("a") and not client.exists("missing")


def test_buffers_of_every_kind(client):
    arr = np.arange(300_000, dtype=np.uint32)
    client.put_batch(["bytes", "bytearray", "memoryview", "numpy"], [b"x" * 10, bytearray(b"y" * 20), memoryview(b"z" * 30), arr])
    assert client.get("bytes") == b"x" * 10
    assert client.get("bytearray") == b"y" * 20
    assert client.get("memoryview") == b"z" * 30
    out = np.zeros_like(arr)
    assert client.get_into("numpy", out) == arr.nbytes
    assert (out == arr).all()
    # get() of a value larger than its first buffer reads it again at the right size.
    assert client.get("numpy", size_hint=16) == arr.tobytes()


def test_write_once(client):
    client.put("k", b"first")
    client.put("k", b"second")  # succeeds, keeps the stored bytes
    assert client.get("k") == b"first"


def test_get_batch_reports_misses_and_sizes(client):
    client.put_batch(["a", "b"], [b"1" * 100, b"2" * 200])
    bufs = [bytearray(256) for _ in range(3)]
    assert client.get_batch(["a", "nope", "b"], bufs) == [100, None, 200]
    assert bytes(bufs[0][:100]) == b"1" * 100 and bytes(bufs[2][:200]) == b"2" * 200
    assert client.exists_batch(["a", "nope", "b"]) == [True, False, True]


def test_typed_errors(client):
    with pytest.raises(umbp.BatchError) as e:
        client.put_batch(["", "ok"], [b"x", b"y"])
    assert isinstance(e.value.errors[0], umbp.InvalidInputError)
    assert e.value.results == [None, 1]
    assert client.get("ok") == b"y"
    with pytest.raises(umbp.InvalidInputError):
        client.put_batch(["a"], [b"1", b"2"])  # ragged
    with pytest.raises(umbp.InvalidInputError, match="2 keys but 1 buffers"):
        client.get_batch(["a", "b"], [bytearray(8)])  # ragged
    with pytest.raises(umbp.InvalidInputError):
        client.put("k", 12345)  # not a buffer
    with pytest.raises(umbp.InvalidInputError):
        client.get_into("k", b"read-only")  # get needs a writable buffer
    client.put("big", b"x" * 1000)
    with pytest.raises(umbp.BatchError) as e:
        client.get_into("big", bytearray(10))
    assert isinstance(e.value.errors[0], umbp.InvalidInputError)
    assert issubclass(umbp.BatchError, umbp.Error)
    for cls in (umbp.InvalidInputError, umbp.RetryError, umbp.UnavailableError, umbp.ClosedError, umbp.InternalError):
        assert issubclass(cls, umbp.Error)


def test_bad_pointers_are_errors_not_crashes(client):
    with pytest.raises(umbp.BatchError) as e:
        client.put_from_ptr("k", 8, 4096)
    assert isinstance(e.value.errors[0], umbp.InvalidInputError)
    with pytest.raises(umbp.BatchError):
        client.get_into_ptr("k", 0, 16)
    with pytest.raises(umbp.InvalidInputError):
        client.register_memory(4096, 1 << 20)
    # A detailed native answer names the failure per key.
    res = client.pool.put_ptrs(["k"], [8], [100], True)
    assert res[0][0] == umbp._umbp.KIND_INVALID_INPUT and "not mapped" in res[0][1]
    assert client.pool.put_ptrs(["k"], [8], [100]) == [False]


def test_raw_pointers_and_registration(client):
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register_memory(src.ctypes.data, src.nbytes)
    client.register_memory(dst.ctypes.data, dst.nbytes)
    with pytest.raises(umbp.InvalidInputError):
        client.register_memory(src.ctypes.data, 4096)  # overlaps
    half = src.nbytes // 2
    client.batch_put_from_ptr(["r0", "r1"], [src.ctypes.data, src.ctypes.data + half], [half, half])
    assert client.batch_get_into_ptr(["r1", "r0"], [dst.ctypes.data, dst.ctypes.data + half], [half, half]) == [half, half]
    assert (dst[:half] == src[half:]).all() and (dst[half:] == src[:half]).all()
    assert client.deregister_memory(src.ctypes.data)
    assert not client.deregister_memory(src.ctypes.data)
    assert client.deregister_memory(dst.ctypes.data)
    # Unregistered memory still works (staged).
    assert client.get_into_ptr("r0", dst.ctypes.data, half) == half


def test_a_gpu_runtime_is_chosen_by_name_and_device_memory_needs_one():
    with pytest.raises(umbp.ConfigError, match="unknown GPU runtime"):
        umbp.Client.local(8 << 20, gpu="quantum")
    src = np.zeros(1 << 16, dtype=np.uint8)
    with umbp.Client.local(8 << 20) as plain:
        # No runtime: an address that is not host memory cannot be a device buffer either.
        with pytest.raises(umbp.InvalidInputError, match="needs a pool started with a gpu runtime"):
            plain.register_memory(4096, 1 << 20)
        assert plain.register_memory(src.ctypes.data, src.nbytes) == "host"
    with umbp.Client.local(8 << 20, gpu="fake") as with_gpu:
        # The runtime is asked first; host memory is still host memory.
        assert with_gpu.register_memory(src.ctypes.data, src.nbytes) == "host"
        with pytest.raises(umbp.InvalidInputError) as e:
            with_gpu.register_memory(4096, 1 << 20)
        assert "needs a pool started" not in str(e.value)


def test_clear_and_flush(client):
    client.put_batch(["a", "b"], [b"1", b"2"])
    client.flush()
    client.clear()
    assert client.exists_batch(["a", "b"]) == [False, False]
    client.put("a", b"again")
    assert client.get("a") == b"again"


def test_close_and_reopen():
    c = umbp.Client.local(16 << 20)
    c.put("k", b"v")
    c.close()
    c.close()  # idempotent
    assert c.closed
    with pytest.raises(umbp.ClosedError):
        c.get("k")
    with pytest.raises(umbp.ClosedError):
        c.put("k", b"v")
    with umbp.Client.local(16 << 20) as c2:
        assert c2.get("k") is None  # a new local pool starts empty
        c2.put("k", b"v2")
        assert c2.get("k") == b"v2"
    assert c2.closed


def test_gil_released_during_a_long_batch():
    """A second Python thread keeps running while one thread is inside a large batch."""
    with umbp.Client.local(512 << 20) as c:
        n, size = 128, 1 << 20
        data = np.ones(n * size, dtype=np.uint8)
        keys = [f"g{i}" for i in range(n)]
        ptrs = [data.ctypes.data + i * size for i in range(n)]
        ticks = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.0005)

        started = threading.Event()

        def batch():
            started.set()
            c.batch_put_from_ptr(keys, ptrs, [size] * n)
            out = np.zeros_like(data)
            c.batch_get_into_ptr(keys, [out.ctypes.data + i * size for i in range(n)], [size] * n)
            assert (out == data).all()

        t = threading.Thread(target=spin)
        t.start()
        started_at = time.perf_counter()
        batch()
        ended_at = time.perf_counter()
        stop.set()
        t.join()
        during = [x for x in ticks if started_at < x < ended_at]
        # If the batch held the GIL the spinner could not tick at all while it ran.
        assert ended_at - started_at > 0.01
        assert len(during) >= 3, f"{len(during)} ticks in {ended_at - started_at:.3f}s"


def test_repr_and_properties(client):
    assert client.node_id == "local"
    assert not client.distributed
    assert client.master_address.startswith("127.0.0.1:")
    assert "local" in repr(client)
    assert isinstance(umbp.__version__, str)


def test_ctypes_buffers(client):
    raw = (ctypes.c_char * 64).from_buffer_copy(b"q" * 64)
    client.put("ct", raw)
    assert client.get("ct") == b"q" * 64


def test_two_nodes_of_a_real_master(master):
    """Client.connect: one node lends DRAM and writes, a client-only node reads it over TCP."""
    with umbp.Client.connect(master, node_id="lender", lend_bytes=64 << 20, page_size=64 << 10) as a:
        assert a.distributed and a.node_id == "lender"
        data = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
        a.put_batch(["x", "y"], [data, b"small"])
        a.flush()
        with umbp.Client.connect(master, node_id="reader", recache_bytes=None) as b:
            assert b.exists_batch(["x", "y", "z"]) == [True, True, False]
            out = np.zeros_like(data)
            assert b.get_into("x", out) == data.nbytes and (out == data).all()
            assert b.get("y") == b"small"
            b.put("new", b"placed on the lender")  # a client-only node writes to other nodes
            b.flush()
            assert a.get("new") == b"placed on the lender"


def test_start_failures_are_typed(master):
    import socket

    with pytest.raises(umbp.UnavailableError):
        umbp.Client.connect("127.0.0.1:1", node_id="nobody")  # no master there
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(umbp.InvalidInputError) as e:
            umbp.Client.connect(master, node_id="clash", lend_bytes=4 << 20, peer_port=port)
        assert str(e.value).count(f"127.0.0.1:{port}") == 1, str(e.value)
    with pytest.raises(umbp.InvalidInputError):
        umbp.Client.connect(master, node_id="", lend_bytes=0)
    with pytest.raises(umbp.InvalidInputError):
        umbp.Client.connect(master, node_id="tiny", lend_bytes=1 << 20)  # less than one 2 MiB page


def test_a_node_closed_and_reopened_under_its_id(master):
    with umbp.Client.connect(master, node_id="again", lend_bytes=8 << 20, page_size=64 << 10) as a:
        a.put("k1", b"one")
        a.flush()
    with umbp.Client.connect(master, node_id="again", lend_bytes=8 << 20, page_size=64 << 10) as a:
        assert a.get("k1") is None  # its memory went with it
        a.put("k2", b"two")
        a.flush()
        assert a.get("k2") == b"two"


def test_every_native_name_is_in_the_type_stubs():
    import ast
    from pathlib import Path

    stub = ast.parse((Path(umbp.__file__).parent / "_umbp.pyi").read_text())
    declared = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    declared |= {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(umbp._umbp) if not n.startswith("_")} | {"__version__"}
    assert public - declared == set()
