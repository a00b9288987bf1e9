"""``python -m umbp``: the umbp command line from the installed package."""

from __future__ import annotations

import subprocess
import sys

import umbp
from conftest import umbp_binary


def run(*args, env_bin=None, **kw):
    import os

    env = dict(os.environ)
    if env_bin is not None:
        env["UMBP_BIN"] = env_bin
    return subprocess.run([sys.executable, "-m", "umbp", *args], capture_output=True, text=True, env=env, timeout=60, **kw)


def test_help_lists_the_commands():
    r = run("--help", env_bin=umbp_binary())
    assert r.returncode == 0, r.stderr
    for cmd in ("master", "node", "put", "get", "stat"):
        assert cmd in r.stdout


def test_stat_sees_a_node_of_this_package(master):
    with umbp.Client.connect(master, node_id="py-node", lend_bytes=16 << 20) as c:
        c.put("k", b"v")
        c.flush()
        r = run("stat", "--master", master, env_bin=umbp_binary())
        assert r.returncode == 0, r.stderr
        assert "py-node" in r.stdout


def test_without_a_binary_it_says_how_to_get_one(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "UMBP_BIN"}
    env["PATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "umbp", "--help"], capture_output=True, text=True, env=env, timeout=60)
    if getattr(umbp._umbp, "cli_main", None) is None:
        assert r.returncode == 2 and "UMBP_BIN" in r.stderr
    else:
        assert r.returncode == 0
