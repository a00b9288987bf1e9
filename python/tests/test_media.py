"""The Python config's ``medium``: nodes lending SSD, CXL and object-store media, and bad settings refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import umbp

from conftest import free_port, wait_port

# Read now: the autouse fixture clears every UMBP_* variable before each test.
MOTO_SERVER = os.environ.get("UMBP_MOTO_SERVER") or shutil.which("moto_server")
REQUIRE_MOTO = os.environ.get("UMBP_REQUIRE_MOTO") == "1"


def round_trip(client: umbp.Client, count: int = 8, size: int = 48 << 10) -> None:
    """Puts ``count`` distinct random values of ``size`` bytes and reads each back byte-exact."""
    rng = np.random.default_rng(size)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
    keys = [f"v{i}" for i in range(count)]
    client.put_batch(keys, values)
    outs = [np.zeros(size, dtype=np.uint8) for _ in range(count)]
    assert client.get_batch(keys, outs) == [size] * count
    for v, o in zip(values, outs):
        assert (v == o).all()
    assert client.get(keys[0]) == values[0].tobytes()
    assert client.get("missing") is None


@pytest.fixture
def shm_dir():
    """A directory in /dev/shm (tmpfs: the CXL tests' stand-in for a device-DAX device)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    d = tempfile.mkdtemp(prefix="umbp-py-cxl-", dir="/dev/shm")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_a_cxl_node_over_a_dev_shm_file(shm_dir):
    path = shm_dir / "cxl.img"
    with umbp.Client.local(8 << 20, medium="cxl", cxl_path=path) as c:
        round_trip(c)
        # The values are in the file: the mapping is MAP_SHARED.
        first = np.random.default_rng(48 << 10).integers(0, 256, 48 << 10, dtype=np.uint8).tobytes()
        assert first in path.read_bytes()


def test_a_cxl_node_of_a_real_master(master, shm_dir):
    """A distributed CXL node (``lend_bytes`` of the file) and a client-only reader."""
    with umbp.Client.connect(
        master, node_id="cxl-lender", lend_bytes=4 << 20, page_size=64 << 10, medium="cxl", cxl_path=str(shm_dir / "c")
    ) as a:
        a.put("k", b"through the mapping" * 100)
        a.flush()
        with umbp.Client.connect(master, node_id="cxl-reader", recache_bytes=None) as b:
            assert b.get("k") == b"through the mapping" * 100


def test_an_ssd_node_over_a_tmp_dir(tmp_path):
    with umbp.Client.local(
        16 << 20, medium="ssd", ssd_dirs=[tmp_path], medium_options={"staging_pages": 16, "sync_interval": "off"}
    ) as c:
        round_trip(c)
    assert any(tmp_path.iterdir()), "the SSD medium wrote nothing to its directory"


def test_an_ssd_node_takes_one_directory_as_a_str(tmp_path):
    with umbp.Client.local(4 << 20, medium="SSD", ssd_dirs=str(tmp_path)) as c:
        c.put("one", b"1" * 1000)
        assert c.get("one") == b"1" * 1000


def test_an_hbm_node_on_the_fake_runtime():
    """HBM through the same path (the fake runtime serves host memory: no GPU here)."""
    with umbp.Client.local(8 << 20, medium="hbm", medium_options={"runtime": "fake"}) as c:
        round_trip(c, count=4)
    with pytest.raises(umbp.ConfigError, match=r'unknown GPU runtime "nope"'):
        umbp.Client.local(8 << 20, medium="hbm", medium_options={"runtime": "nope"})


def test_dram_stays_the_default():
    with umbp.Client.local(4 << 20, medium_options={"transparent_hugepages": False}) as c:
        c.put("d", b"dram")
        assert c.get("d") == b"dram"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"medium": "tape"}, r'"tape" is not a medium: expected dram, hbm, ssd, cxl, object or none'),
        ({"medium": "cxl"}, r"medium \"cxl\" needs cxl_path"),
        ({"medium": "ssd"}, r"medium \"ssd\" needs ssd_dirs"),
        ({"medium": "object"}, r"medium \"object\" needs object_url"),
        ({"medium": "object", "object_url": "ftp://x/y"}, r"medium \"object\""),
        ({"medium": "dram", "cxl_path": "/dev/shm/x"}, r"cxl_path is a setting of medium \"cxl\", not \"dram\""),
        ({"medium": "cxl", "cxl_path": "/dev/shm/x", "medium_options": {"bogus": 1}}, r"unknown field `bogus`"),
        ({"medium": "cxl", "cxl_path": 7}, r"medium \"cxl\""),
        ({"medium": "ssd", "ssd_dirs": ["/tmp"], "medium_options": {"staging_pages": object()}}, r"staging_pages: a object"),
        ({"medium_options": {"capacity_bytes": 1}}, r"capacity is the capacity_bytes argument"),
        ({"medium": "none"}, r"medium 'none' lends nothing: leave capacity_bytes at 0"),
        ({"medium": "cxl", "cxl_path": "/dev/shm/x", "medium_options": {"cxl_path": "/y"}}, r"given both"),
        ({"medium_options": ["not", "a", "dict"]}, r"medium_options must be a dict"),
    ],
)
def test_bad_medium_settings_are_refused(kwargs, match):
    with pytest.raises(umbp.ConfigError, match=match) as e:
        umbp.Client.local(4 << 20, page_size=64 << 10, **kwargs)
    # One exception, both conventions: the pool's bad-input error and Python's.
    assert isinstance(e.value, umbp.InvalidInputError) and isinstance(e.value, ValueError)


def test_a_capacity_below_one_page_is_refused(shm_dir):
    with pytest.raises(ValueError, match=r"capacity_bytes = 4096 is smaller than one page"):
        umbp.Client.local(4096, medium="cxl", cxl_path=shm_dir / "x")
    assert not (shm_dir / "x").exists(), "nothing is created for a refused config"


def test_a_medium_that_refuses_its_settings_at_start_is_a_config_error(tmp_path):
    """Settings only the medium can judge (a directory as the CXL file, a missing SSD directory)."""
    with pytest.raises(umbp.ConfigError, match=r"is a directory"):
        umbp.Client.local(4 << 20, medium="cxl", cxl_path=tmp_path)
    with pytest.raises(umbp.ConfigError, match=r"does not exist"):
        umbp.Client.local(4 << 20, medium="ssd", ssd_dirs=[tmp_path / "unmounted"])


def test_node_medium_rules(master, shm_dir):
    with pytest.raises(umbp.ConfigError, match=r"medium 'none' lends nothing: leave lend_bytes at 0"):
        umbp.Client.connect(master, node_id="n1", lend_bytes=4 << 20, medium="none")
    with pytest.raises(umbp.ConfigError, match=r"lend_bytes = 0 is smaller than one page"):
        umbp.Client.connect(master, node_id="n2", medium="cxl", cxl_path=shm_dir / "n2")
    with pytest.raises(umbp.ConfigError, match=r"medium 'none' takes no settings"):
        umbp.Client.connect(master, node_id="n3", medium_options={"prefault": True})


@pytest.fixture
def moto():
    """A ``moto_server`` on a free loopback port (skipped, with the reason, when there is none)."""
    if not MOTO_SERVER or not os.path.isfile(MOTO_SERVER):
        why = "no S3 stand-in: moto_server is not on PATH (pip install 'moto[server]', or set UMBP_MOTO_SERVER)"
        if REQUIRE_MOTO:
            pytest.fail(why)
        print(f"skipped: {why}")
        pytest.skip(why)
    port = free_port()
    proc = subprocess.Popen(
        [MOTO_SERVER, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(port, proc, timeout=30.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_an_object_node_over_moto(moto, monkeypatch):
    # The medium reads credentials from the environment, as the AWS tools do; moto accepts any.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with umbp.Client.local(
        16 << 20,
        medium="object",
        object_url="s3://py-bucket/node",
        object_endpoint=moto,
        medium_options={"create_bucket": True, "cache_committed": False, "staging_pages": 16},
    ) as c:
        round_trip(c, count=4)
        # The values are objects in the bucket, under the prefix (moto answers unsigned requests).
        with urllib.request.urlopen(f"{moto}/py-bucket?list-type=2&prefix=node/", timeout=10) as r:
            listing = r.read().decode()
        assert listing.count("<Key>node/") >= 4, listing
