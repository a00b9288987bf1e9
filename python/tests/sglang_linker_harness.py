"""Runs SGLang's unmodified ``UMBPDirectLinker`` here, on real torch: extracts the whole ``sglang``
tree of the pinned wheel (the linker's import chain reaches ~540 of its modules: the KV pools,
the runtime context, the server arguments) and imports it without running ``sglang/__init__.py``
(the engine's entry point). Unlike ``sglang_harness`` nothing of SGLang or torch is stubbed.

The two harnesses cannot share ``sys.modules`` (the other stubs ``torch`` and parts of
``sglang.srt``), so :func:`isolated_sglang` swaps the ``sglang`` modules in and back out.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types
import zipfile
from pathlib import Path

from sglang_harness import CACHE, SGLANG_VERSION, Unavailable, fetch_sglang

FULL = CACHE / f"sglang-{SGLANG_VERSION}-full"
# Written after the extraction finished, so a half-extracted tree is redone.
MARKER = FULL / ".complete"


def fetch_full_sglang() -> Path:
    """The directory holding every file of the wheel's ``sglang`` package (extracted once)."""
    if MARKER.exists():
        return FULL
    fetch_sglang()  # downloads the wheel on first use (or raises Unavailable)
    wheel_env = os.environ.get("UMBP_SGLANG_WHEEL")
    wheels = [Path(wheel_env)] if wheel_env else sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        raise Unavailable(f"no sglang {SGLANG_VERSION} wheel under {CACHE}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(FULL, [n for n in z.namelist() if n.startswith("sglang/")])
    MARKER.write_text(wheels[0].name)
    return FULL


def _is_sglang(name: str) -> bool:
    return name == "sglang" or name.startswith("sglang.")


@contextlib.contextmanager
def isolated_sglang(sglang_dir: Path):
    """Makes ``sglang`` resolve to ``sglang_dir``'s files for the block, restoring whatever
    ``sglang`` modules were loaded before (another harness's stubs) afterwards."""
    saved = {k: v for k, v in sys.modules.items() if _is_sglang(k)}
    for k in saved:
        del sys.modules[k]
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and not hasattr(torch_mod, "__version__"):
        del sys.modules["torch"]  # the other harness's annotation-only stub
    import torch  # noqa: F401  (real torch before any SGLang module binds it)

    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(sglang_dir / "sglang")]
    pkg.__file__ = str(sglang_dir / "sglang" / "__init__.py")
    sys.modules["sglang"] = pkg
    try:
        yield pkg
    finally:
        for k in [k for k in sys.modules if _is_sglang(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def write_model_config(directory: Path, num_layers: int) -> Path:
    """A local Hugging Face config (no weights): ``ServerArgs`` resolves the model's
    architecture from it while publishing the runtime context, and nothing here may reach
    the Hub."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": num_layers,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory
