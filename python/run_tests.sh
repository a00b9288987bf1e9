#!/usr/bin/env bash
# The Python suite from a machine with only a Rust toolchain and CPython (3.9+; CI uses 3.11):
# makes a venv under target/, installs maturin, pytest and numpy (and msgspec, pyzmq and pydantic,
# which SGLang's KV event module imports) from PyPI, builds and installs the
# umbp wheel and the mori.umbp compatibility package, and runs pytest (the distributed tests start
# their master with `python -m umbp master`, the command line built into the wheel; SGLang's wheel
# is downloaded by the tests into target/sglang-cache).
#
#   python/run_tests.sh [pytest args...]
#
# UMBP_PY_PROFILE: the cargo profile of the wheel (default dev: a release build of the binding
# costs minutes on 2 cores and the suite times nothing). PYTHON: the interpreter (default
# python3.11, else python3). UMBP_PYENV: the venv (default target/pyenv). UMBP_BIN: a built `umbp`
# binary the tests start their master with instead of `python -m umbp`.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${UMBP_PYENV:-$ROOT/target/pyenv}
PROFILE=${UMBP_PY_PROFILE:-dev}

step() { printf '== %s (%ss)\n' "$1" "$SECONDS"; }

if [ ! -x "$VENV/bin/python" ]; then
    step "venv $VENV from $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
step "build tools and test dependencies"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.7,<2" pytest numpy wheel "setuptools>=61" \
    msgspec pyzmq pydantic

step "umbp wheel (profile $PROFILE) and mori-compat"
PATH="$VENV/bin:$PATH" MATURIN_PEP517_ARGS="--profile $PROFILE" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall \
    --no-deps ./python ./python/mori-compat

step "pytest"
# The SGLang tests must run here: a failed download is a failure, not a skip.
UMBP_REQUIRE_SGLANG=1 "$VENV/bin/python" -m pytest -q python/tests "$@"
step "done"
