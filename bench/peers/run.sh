#!/usr/bin/env bash
# umbp beside Mooncake Store and Redis (issue 16, item 1), from a fresh clone, in one command:
#
#   bench/peers/run.sh [bench_peers.py args...]     e.g. --phase-mib 256 --rounds 3 (default 1024, 3)
#
# 1. Debian packages: redis-server (the Redis peer) and libibverbs1 (the Mooncake wheel links it),
#    installed with apt-get when missing and running as root; otherwise it says so and the peer that
#    needs them is skipped.
# 2. A venv at target/peers-venv (UMBP_PEERS_VENV) with mooncake-transfer-engine-non-cuda (TCP
#    transport; it ships mooncake_master), redis + hiredis, numpy, maturin; a peer whose package does
#    not install is skipped.
# 3. Release builds: `cargo build --release -p umbp` (the holder's binary) and the release wheel of
#    ./python into the same venv (python/bench/run.sh's recipe). A few minutes on 2 cores the first time.
# 4. bench/peers/bench_peers.py: every system on free loopback ports, one holder + one client process
#    each, rounds interleaved; prints one markdown table with the ratios umbp/peer (its docstring says
#    what is measured and how).
#
# Needs ~5x --phase-mib of free memory (two client buffers + one holder of 3x at a time).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${UMBP_PEERS_VENV:-$ROOT/target/peers-venv}
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== apt-get install ${missing[*]}" >&2
        { apt-get install -y "${missing[@]}" >/dev/null 2>&1 \
            || { apt-get update >/dev/null 2>&1 && apt-get install -y "${missing[@]}" >/dev/null 2>&1; }; } \
            || echo "!! apt-get install ${missing[*]} failed: the peers needing them will be skipped" >&2
    else
        echo "!! missing ${missing[*]} and not root with apt-get: install them, or the peers needing them are skipped" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "== venv $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
echo "== pip: numpy maturin redis hiredis mooncake-transfer-engine-non-cuda" >&2
pip numpy "maturin>=1.7,<2" wheel "setuptools>=61" >&2
pip redis hiredis >&2 || echo "!! redis-py/hiredis did not install: Redis will be skipped" >&2
pip mooncake-transfer-engine-non-cuda >&2 || echo "!! mooncake-transfer-engine-non-cuda did not install: Mooncake will be skipped" >&2

echo "== cargo build --release -p umbp" >&2
cargo build --release -p umbp >&2
echo "== release wheel into $VENV" >&2
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps ./python >&2

echo "== bench ($(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
PATH="$VENV/bin:$PATH" GLOG_minloglevel=${GLOG_minloglevel:-2} \
    "$VENV/bin/python" bench/peers/bench_peers.py --umbp "$ROOT/target/release/umbp" "$@"
