#!/usr/bin/env bash
# The third-party wheels test_sglang_direct_linker.py needs beyond torch and numpy, and how to run
# it on a machine without internet that has torch (e.g. Python 3.12, torch 2.11+cu130, a GPU).
#
#   linker_env.sh download DIR [PYVER]  on a machine with internet: the wheels (no dependencies
#                                       resolved: the list is complete) for CPython PYVER
#                                       (default 3.12), manylinux x86_64, plus the sglang wheel
#   linker_env.sh install DIR [TARGET]  on the test machine: installs them into this python, or
#                                       into directory TARGET (then put it first on PYTHONPATH)
#   linker_env.sh run [pytest args]     runs the test (UMBP_LINKER_DEVICE defaults to cuda here)
#
# PYTHON picks the interpreter (default python3); it must already import torch (with its own
# dependencies: typing-extensions, filelock, fsspec, jinja2, sympy, networkx, triton), numpy, pytest,
# umbp and mori.umbp. Versions are the ones the test passed with (torch 2.11.0); where the sglang
# 0.5.23 wheel pins one (transformers, tokenizers, sentencepiece, compressed-tensors,
# apache-tvm-ffi) it is that pin. torchvision must match torch: 0.26.0 for torch 2.11.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"

# Imported by SGLang's import chain (top-level module in brackets where it differs) ...
imported=(
  apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 dill==0.4.1 gguf==0.19.0
  huggingface-hub==1.33.0 ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 orjson==3.13.0
  pillow==13.0.0 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
  pyyaml==6.0.4 pyzmq==27.3.0 regex==2026.12.2 requests==2.34.2 safetensors==0.8.0
  sentencepiece==0.2.1 starlette==1.10.0 tokenizers==0.23.2 torchvision==0.26.0 tqdm==4.70.1
  transformers==5.19.0
  nvidia-ml-py==13.610.43  # [pynvml]: imported only where torch sees CUDA
)
# sgl_kernel (sglang-kernel 0.4.10) is also imported where torch sees CUDA, but that wheel is
# built for torch 2.14.1 and 373 MB: the harness stubs it when it cannot be imported.
# ... and what those need at import or install.
dependencies=(
  annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 asttokens==3.0.2
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 executing==2.3.0
  h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 httpx==0.29.0 idna==3.21
  ipython-pygments-lexers==1.1.1 jedi==0.20.1 markdown-it-py==4.3.0 matplotlib-inline==0.2.2
  mdurl==0.1.2 packaging==26.4 parso==0.8.7 pexpect==4.9.0 prompt-toolkit==3.0.53 ptyprocess==0.7.0
  pure-eval==0.2.4 pygments==2.21.0 rich==15.0.0 shellingham==1.5.4 stack-data==0.6.3
  traitlets==5.16.1 typer==0.29.2 typing-inspection==0.4.5 urllib3==2.8.0 wcwidth==0.9.4
)

case "${1:-}" in
download)
  dir="${2:?usage: linker_env.sh download DIR [PYVER]}"
  ver="${3:-3.12}"
  mkdir -p "$dir"
  "$py" -m pip download --no-deps --only-binary=:all: --python-version "$ver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 -d "$dir" \
    "${imported[@]}" "${dependencies[@]}"
  # SGLang's own files come from its wheel (pure Python; any tag will do).
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --platform manylinux_2_34_x86_64 -d "$dir" sglang==0.5.23
  ;;
install)
  dir="${2:?usage: linker_env.sh install DIR [TARGET]}"
  target=()
  if [ -n "${3:-}" ]; then
    target=(--target "$3")
    export PYTHONPATH="$3${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # --no-deps: torch is already there and must stay the one installed.
  find "$dir" -name '*.whl' ! -name 'sglang-*' -print0 |
    xargs -0 "$py" -m pip install --no-index --no-deps "${target[@]}"
  mkdir -p "$root/target/sglang-cache"
  cp -n "$dir"/sglang-0.5.23-*.whl "$root/target/sglang-cache/" || true
  "$py" -c "import torch, torchvision, transformers, umbp, mori.umbp; print('torch', torch.__version__)"
  ;;
run)
  shift
  cd "$root"
  UMBP_REQUIRE_TORCH=1 UMBP_REQUIRE_SGLANG=1 UMBP_LINKER_DEVICE="${UMBP_LINKER_DEVICE:-cuda}" \
    "$py" -m pytest -q python/tests/test_sglang_direct_linker.py "$@"
  ;;
*)
  sed -n '2,16p' "$0"
  exit 2
  ;;
esac
