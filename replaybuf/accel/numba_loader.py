"""Whether replaybuf's compiled CPU kernels (:mod:`replaybuf.accel.numba_kernels`, numba) run here.

The kernels are an extra (``pip install 'replaybuf[fast]'``): without numba, or with
``REPLAYBUF_NUMBA=0``, every caller runs its numpy path instead, with the same results (to
rounding where replaybuf.accel.numba_kernels says so). One choice follows from it:
``"auto"`` prioritized buffers on the CPU take TorchRL's segment tree, where it loads, when the
kernels do not run. This module never imports numba itself; the first call to
:func:`compiled_kernels` does (on a fresh install that compiles the kernels once, then numba
caches them).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

NUMBA_ENV = "REPLAYBUF_NUMBA"  # "0": run the numpy paths, not replaybuf.accel.numba_kernels


@functools.cache
def _load_kernels() -> ModuleType | str:
    """:mod:`replaybuf.accel.numba_kernels` (compiled at import), or why it does not load."""
    try:
        return importlib.import_module("replaybuf.accel.numba_kernels")
    except Exception as error:  # ImportError without numba; numba's own errors otherwise
        return f"replaybuf.accel.numba_kernels does not load ({type(error).__name__}: {error})"


def compiled_kernels() -> ModuleType | None:
    """The kernels module, or None: numba is missing, they fail to compile, or
    ``REPLAYBUF_NUMBA=0`` (read at each call; callers ask once, when they are built)."""
    if os.environ.get(NUMBA_ENV, "1") == "0":
        return None
    kernels = _load_kernels()
    return None if isinstance(kernels, str) else kernels


def kernels_unavailable_reason() -> str | None:
    """Why the numpy paths run instead of the kernels, or None when the kernels run."""
    if os.environ.get(NUMBA_ENV, "1") == "0":
        return f"{NUMBA_ENV}=0"
    kernels = _load_kernels()
    return kernels if isinstance(kernels, str) else None
