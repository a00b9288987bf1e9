"""``mori.umbp`` on umbp-rs: re-exports :mod:`umbp.mori` so SGLang's UMBP backend
(``--hicache-storage-backend mori``) runs on this pool. Do not install beside AMD's ``amd-mori``:
both provide the ``mori`` package."""

from umbp.mori import *  # noqa: F401,F403
from umbp.mori import __all__  # noqa: F401
