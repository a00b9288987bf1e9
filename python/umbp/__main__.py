"""``python -m umbp ...``: the ``umbp`` command line (master, node, put, get, exists, rm, stat, ...).

The command line is the ``umbp`` binary's own code, linked into the native module (``_umbp.cli_main``),
so the installed package is all an operator needs: no binary to find, no process to exec.
"""

import signal
import sys


def main() -> int:
    from . import _umbp

    # Behave as the binary does: until a command installs its own SIGINT handler, Ctrl-C ends the
    # process (the default action) instead of setting Python's KeyboardInterrupt flag, which would
    # only be seen after the command returned. `master`, `node` and the client commands then catch
    # SIGINT and SIGTERM themselves and stop cleanly, returning their exit status.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return int(_umbp.cli_main(["umbp", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
