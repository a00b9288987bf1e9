#!/usr/bin/env bash
# The Python bench of the bench suite (`cargo xtask bench-python [ARGS]`): release builds of the
# `umbp` binary and of the wheel (into target/pyenv-release), then python/bench/bench_remote.py,
# RUNS times back to back (default 5), each run printing Python beside the Rust PoolClient.
#
#   python/bench/run.sh [bench_remote.py args...]     e.g. --json, --rounds 7
#
# A release build of both costs a few minutes on 2 cores the first time; later runs reuse them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${UMBP_PYENV:-$ROOT/target/pyenv-release}
RUNS=${RUNS:-5}

echo "== cargo build --release -p umbp" >&2
cargo build --release -p umbp >&2
if [ ! -x "$VENV/bin/python" ]; then
    echo "== venv $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
echo "== release wheel into $VENV" >&2
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.7,<2" numpy wheel "setuptools>=61" >&2
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps ./python >&2
for i in $(seq 1 "$RUNS"); do
    echo "== run $i of $RUNS ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1 /proc/loadavg))" >&2
    "$VENV/bin/python" python/bench/bench_remote.py --umbp target/release/umbp "$@"
done
