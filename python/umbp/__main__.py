"""``python -m umbp ...``: the ``umbp`` command line (master, node, put, get, stat, ...)."""

import os
import shutil
import sys


def main() -> int:
    from . import _umbp

    cli = getattr(_umbp, "cli_main", None)
    if cli is not None:
        # The command line built into the native module: one install gives an operator everything.
        return int(cli(["umbp", *sys.argv[1:]]))
    # Until the native module carries the command line, run the `umbp` binary (UMBP_BIN or PATH).
    binary = os.environ.get("UMBP_BIN") or shutil.which("umbp")
    if binary is None:
        sys.stderr.write(
            "python -m umbp: this build of the umbp package has no built-in command line and no `umbp` "
            "binary was found (set UMBP_BIN or put it on PATH; `cargo install --path crates/umbp`)\n"
        )
        return 2
    os.execv(binary, [binary, *sys.argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
