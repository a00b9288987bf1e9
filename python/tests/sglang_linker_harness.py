"""Runs SGLang's unmodified ``UMBPDirectLinker`` here, on real torch: extracts the whole ``sglang``
tree of the pinned wheel (the linker's import chain reaches ~540 of its modules: the KV pools,
the runtime context, the server arguments) and imports it without running ``sglang/__init__.py``
(the engine's entry point). Unlike ``sglang_harness`` nothing of SGLang or torch is stubbed;
the one third-party package stubbed, and only when it cannot be imported, is in
:data:`UNIMPORTABLE`.

The two harnesses cannot share ``sys.modules`` (the other stubs ``torch`` and parts of
``sglang.srt``), so :func:`isolated_sglang` swaps the ``sglang`` modules in and back out.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
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


# Packages SGLang's import chain reaches that cannot be imported beside the torch under test,
# with why. Each is stubbed only when importing it fails; its stub's attributes raise if called.
UNIMPORTABLE = {
    # sglang-kernel 0.4.10, the wheel's pin: CUDA ops built for (and pinned to) torch 2.14.1, 373
    # MB. Imported only where torch sees CUDA, by quantization modules the KV pool module imports
    # (``from sgl_kernel import int8_scaled_mm``); nothing on the linker's path calls it.
    "sgl_kernel",
}


class _Unavailable:
    """Any attribute of a stubbed package: raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *_a, **_k):
        raise RuntimeError(f"{self._name} is a stub: the package cannot be imported here")

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``roots`` and their submodules to stub packages."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def attr(a, n=spec.name):
            if a.startswith("__"):
                raise AttributeError(a)
            return _Unavailable(f"{n}.{a}")

        m.__getattr__ = attr
        return m

    def exec_module(self, module):
        pass


def _unimportable() -> list:
    """The packages of :data:`UNIMPORTABLE` that fail to import here."""
    out = []
    for name in sorted(UNIMPORTABLE):
        try:
            importlib.import_module(name)
        except (ImportError, OSError):
            out.append(name)
    return out


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

    stubbed = _unimportable()
    finder = _StubFinder(stubbed)
    sys.meta_path.insert(0, finder)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(sglang_dir / "sglang")]
    pkg.__file__ = str(sglang_dir / "sglang" / "__init__.py")
    pkg._umbp_stubbed = stubbed
    sys.modules["sglang"] = pkg
    try:
        yield pkg
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if _is_sglang(k) or k.split(".")[0] in finder.roots]:
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
