"""Shared fixtures: the SGLang store (downloaded at test time), a real ``umbp master`` process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _clean_umbp_env(monkeypatch):
    """No UMBP_* or rank variable of the caller's shell leaks into a test."""
    for k in list(os.environ):
        if k.startswith("UMBP_") or k in ("LOCAL_RANK", "SGLANG_DP_RANK", "SGLANG_DP_SIZE"):
            monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="session")
def sglang():
    """``(umbp_store, hicache_storage)``: SGLang's modules, unmodified, over our ``mori.umbp``."""
    return sglang_harness.import_store(sglang_harness.fetch_or_skip())


def umbp_command() -> list:
    """The ``umbp`` command line: the installed package's own (``python -m umbp``), or the binary
    UMBP_BIN names (to run the suite against a separately built ``umbp``)."""
    binary = os.environ.get("UMBP_BIN")
    return [binary] if binary else [sys.executable, "-m", "umbp"]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.fixture
def master():
    """A real ``umbp master`` process on a free port; yields its ``host:port``."""
    port = free_port()
    proc = subprocess.Popen(
        [*umbp_command(), "master", "--listen", f"127.0.0.1:{port}", "--heartbeat-ttl", "2s"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_port(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
