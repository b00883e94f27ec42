"""One row's fields copied from CPU tensors' addresses in one compiled call (numba; the ``fast``
extra): the torch-tensor inputs of the per-step writes. Loaded with, and re-exported by,
:mod:`replaybuf.accel.numba_kernels`.

Written by hand because torch has no cheap way from a small CPU tensor to a row of another:
``Tensor.numpy()`` then a numpy item assignment, or an indexed ``copy_``, costs several times
what ``data_ptr()`` does (docs/performance.md). The caller checks each tensor first (a strided,
contiguous CPU tensor of the field's exact dtype and shape, no negative bit) and passes its
address; this kernel only copies bytes, converting a bool field's to 0 or 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = types.int64[::1]
_I64_2D_IN = types.Array(types.int64, 2, "C", readonly=True)  # read only: writable ones convert


def _to_pointer(typingctx: Any, address: Any) -> Any:
    """An int64 address as a ``void*`` (numba has no cast from an integer to a pointer)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


_pointer: Any = intrinsic(_to_pointer)  # called in kernels with the address alone


@njit(types.void(_I64_2D_IN, _I64, types.int64), cache=True, boundscheck=False)
def copy_row(layout: np.ndarray, sources: np.ndarray, row: int) -> None:
    """Copy field ``i``'s bytes from address ``sources[i]`` into row ``row`` of its column,
    for each ``i`` whose ``sources[i]`` is not 0, and set ``sources[i]`` back to 0.

    ``layout[i]`` is (column address, row stride in bytes, row size in bytes, 1 for a bool
    field); the caller guarantees each address holds a whole row and ``row`` is inside every
    column. A bool field's bytes are stored as 0 or 1 (any nonzero byte is True), as torch
    converts them on the general path.
    """
    for i in range(layout.shape[0]):
        source = sources[i]
        if source == 0:
            continue
        size = layout[i, 2]
        into = carray(_pointer(layout[i, 0] + row * layout[i, 1]), (size,), np.uint8)
        given = carray(_pointer(source), (size,), np.uint8)
        if layout[i, 3]:
            for j in range(size):
                into[j] = given[j] != 0
        else:
            into[:] = given
        sources[i] = 0
