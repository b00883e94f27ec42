"""What the per-step fast paths need to copy CPU tensors into a row by address: the compiled
copy (:func:`replaybuf.accel.numba_rows.copy_row`), the columns' layout it takes, and which
fields' tensors may go that way.

A tensor's bytes are copied from its ``data_ptr()`` only after its caller checked that it is a
strided CPU tensor of the field's exact dtype and shape, contiguous (always so when 0-d) and
without torch's negative bit (by torch's guard in one call, :mod:`replaybuf.storage.tensorguard`,
or inline, attribute by attribute): then its bytes are the values it holds, row-major. A tensor
whose ``data_ptr()`` is 0 has no memory behind it (a zero tensor's, or functionalization's):
the caller declines it to the general path. Complex fields never go this way (a conjugate bit
would need checking too); their tensors take ``numpy()``. A bool field's bytes are stored as
0 or 1 (a bool tensor viewed from bytes may hold any nonzero byte), as the general path
stores them.

The callers' ``sources`` array is shared by their calls: each call clears the addresses it
noted before it returns or raises, and a call nested in another on the same thread (user code
run while a value is looked up) is declined, so that no call reads another's addresses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from replaybuf.accel.numba_loader import compiled_kernels

CopyRow = Callable[[np.ndarray, np.ndarray, int], None]  # (layout, sources, row)
# A field's tensors: never copied by address, copied when contiguous, always (0-d: contiguous).
NEVER, CONTIGUOUS, ALWAYS = 0, 1, 2


def row_copier(columns: list[np.ndarray]) -> CopyRow | None:
    """The compiled row copy for ``columns`` (numpy views, ``[rows, ...]`` each), or None where
    the kernels do not run or a column's rows are not contiguous."""
    kernels = compiled_kernels()
    if kernels is None or not all(column.flags.c_contiguous for column in columns):
        return None
    return _entry_point(kernels.copy_row)


def _entry_point(kernel: CopyRow) -> CopyRow:
    """The compiled function of ``kernel``'s one signature, called without the dispatcher's
    type matching (half a per-step call's cost of it). The callers pass exactly that
    signature's types: their layout (read-only) and sources arrays and an int row. The
    dispatcher itself where numba keeps compiled functions otherwise."""
    overloads = getattr(kernel, "overloads", None)
    if not isinstance(overloads, dict) or len(overloads) != 1:
        return kernel
    entry = getattr(next(iter(overloads.values())), "entry_point", None)
    return entry if callable(entry) else kernel


def layout(columns: list[np.ndarray]) -> np.ndarray:
    """``copy_row``'s read-only layout of ``columns``: (address, row stride, row bytes, 1 for
    bool) each."""
    rows = [
        (
            column.__array_interface__["data"][0],
            column.strides[0],
            column[0].nbytes,
            column.dtype == np.bool_,
        )
        for column in columns
    ]
    out = np.array(rows, np.int64).reshape(-1, 4)
    out.flags.writeable = False
    return out


def by_address(copy_row: CopyRow | None, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """When a field's tensors are copied by address: NEVER, CONTIGUOUS or ALWAYS."""
    if copy_row is None or dtype.is_complex:
        return NEVER
    return ALWAYS if shape == () else CONTIGUOUS
