"""``python -m umbp``: the umbp command line built into the installed package (``_umbp.cli_main``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import umbp
from conftest import free_port


def run(*args, **kw):
    # The package's own command line, never a binary found elsewhere.
    env = {k: v for k, v in os.environ.items() if k != "UMBP_BIN"}
    return subprocess.run(
        [sys.executable, "-m", "umbp", *args], capture_output=True, text=True, env=env, timeout=60, **kw
    )


def test_the_command_line_is_built_into_the_native_module():
    assert callable(umbp._umbp.cli_main)


def test_help_lists_the_commands_and_exits_0():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("master", "node", "put", "get", "exists", "rm", "stat"):
        assert cmd in r.stdout


def test_bad_usage_exits_2_without_a_traceback():
    r = run("no-such-command")
    assert r.returncode == 2
    assert "Usage" in r.stderr and "Traceback" not in r.stderr


def test_stat_sees_a_node_of_this_package(master):
    with umbp.Client.connect(master, node_id="py-node", lend_bytes=16 << 20) as c:
        c.put("k", b"v")
        c.flush()
        r = run("stat", "--master", master)
        assert r.returncode == 0, r.stderr
        assert "py-node" in r.stdout


def test_put_get_and_a_missing_key_exit_codes(master, tmp_path):
    with umbp.Client.connect(master, node_id="py-lender", lend_bytes=16 << 20) as c:
        src = tmp_path / "value"
        src.write_bytes(b"x" * 5000)
        r = run("put", "--master", master, "cli-key", str(src))
        assert r.returncode == 0, r.stderr
        r = subprocess.run(
            [sys.executable, "-m", "umbp", "get", "--master", master, "cli-key", "-"], capture_output=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == b"x" * 5000
        assert c.get("cli-key") == b"x" * 5000
        r = run("get", "--master", master, "never-put")
        assert r.returncode == 1 and "not found" in r.stderr


def test_in_process_calls_return_their_status_and_can_repeat(master, capfd):
    # Called twice in one interpreter: the second call must not trip over the first one's logging
    # setup or runtime, and neither may exit the interpreter.
    for _ in range(2):
        assert umbp._umbp.cli_main(["umbp", "stat", "--master", master]) == 0
        assert "master " in capfd.readouterr().out
    assert umbp._umbp.cli_main(["umbp", "--help"]) == 0
    assert umbp._umbp.cli_main(["umbp", "--bogus"]) == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_master_stops_cleanly_on_a_signal(sig):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "UMBP_BIN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "umbp", "master", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("master ready"), line
        proc.send_signal(sig)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert rc == 0, err
    assert "master stopped" in err and "Traceback" not in err and "KeyboardInterrupt" not in err
