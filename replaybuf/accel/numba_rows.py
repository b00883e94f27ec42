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
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)
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


@njit(cache=True, boundscheck=False)
def _scatter_words(
    base: int, stride: int, source: int, width: int, rows: np.ndarray, word: Any, flag: int
) -> None:
    """One field of :func:`scatter_from` in words of ``word``'s type (``width`` of them a row,
    ``stride`` and ``base`` multiples of its size): the copies LLVM can widen."""
    count = rows.shape[0]
    given = carray(_pointer(source), (count * width,), word.dtype)
    for j in range(count):
        into = carray(_pointer(base + rows[j] * stride), (width,), word.dtype)
        at = j * width
        if flag:
            for k in range(width):
                into[k] = given[at + k] != 0
        else:
            for k in range(width):
                into[k] = given[at + k]


@njit(types.void(_I64_2D_IN, _I64, _I64_IN, types.int64), cache=True, boundscheck=False)
def scatter_from(layout: np.ndarray, sources: np.ndarray, rows: np.ndarray, size: int) -> None:
    """Copy row ``j`` of each field ``i``, ``layout[i, 2]`` bytes at ``sources[i] + j *
    layout[i, 2]`` (a contiguous ``[len(rows), ...]`` source), into row ``rows[j]`` of its
    column (``layout`` as :func:`copy_row` takes it), a bool field's bytes as 0 or 1. The
    rows are checked to lie inside the columns' ``size`` rows before anything is written."""
    for j in range(rows.shape[0]):
        if not 0 <= rows[j] < size:
            raise IndexError("row write: a slot out of range")
    for i in range(layout.shape[0]):
        base, stride, width, flag = layout[i, 0], layout[i, 1], layout[i, 2], layout[i, 3]
        source = sources[i]
        if flag == 0 and (base | stride | width | source) % 8 == 0:
            _scatter_words(base, stride, source, width // 8, rows, np.zeros(1, np.uint64), 0)
        elif flag == 0 and (base | stride | width | source) % 4 == 0:
            _scatter_words(base, stride, source, width // 4, rows, np.zeros(1, np.uint32), 0)
        else:
            _scatter_words(base, stride, source, width, rows, np.zeros(1, np.uint8), flag)
