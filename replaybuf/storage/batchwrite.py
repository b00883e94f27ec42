"""A batch of steps copied into its storage rows straight from the caller's arrays, by
address, in one compiled call (:func:`replaybuf.accel.numba_rows.scatter_from`).

Through the stager, a vector env's ``append_batch`` copies its values into the staging
columns, and the next flush copies them from there into storage: three passes over memory
that a 1,000-env batch no longer finds in cache when the flush comes. This makes one.

Only values whose bytes are their values go this way, checked here: contiguous CPU tensors
without the negative or conjugate bit and C-contiguous numpy arrays (their dtype and shape
are the caller's to check, :meth:`replaybuf.storage.fastrow.RowPlan.batch_values`). Only into
CPU columns whose rows are contiguous, of no complex dtype, with the compiled kernels loaded;
everything else goes through the stager, the general path the tests compare this with.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.storage.addresses import layout

# (layout, sources, rows, column rows)
Scatter = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]


class BatchWriter:
    """Copies ``[rows, ...]`` values of the fields ``columns`` hold (in that order) into
    their rows by address."""

    def __init__(self, columns: list[np.ndarray], scatter: Scatter) -> None:
        self.layout = layout(columns)
        self.size = columns[0].shape[0]
        self._scatter = scatter

    @classmethod
    def of(cls, columns: list[np.ndarray | None]) -> BatchWriter | None:
        """A writer into ``columns`` (numpy views of the storage columns), or None where the
        kernels do not run or a column does not qualify (see the module docstring)."""
        kernels = compiled_kernels()
        if kernels is None or not columns:
            return None
        arrays: list[np.ndarray] = []
        for column in columns:
            if column is None or column.ndim == 0 or column.dtype.kind == "c":
                return None
            if not column[0].flags.c_contiguous:
                return None
            arrays.append(column)
        if len({column.shape[0] for column in arrays}) != 1:
            return None
        return cls(arrays, kernels.scatter_from)

    def write(self, rows: array, values: list[Any]) -> bool:
        """Copy ``values[i][j]`` into row ``rows[j]`` of column ``i``; False, with nothing
        written, when a value's bytes are not its values (see the module docstring)."""
        sources = np.empty(len(values), np.int64)
        for i, value in enumerate(values):
            if type(value) is torch.Tensor:
                if not value.is_contiguous() or value.is_neg() or value.is_conj():
                    return False
                sources[i] = value.data_ptr()
            elif type(value) is np.ndarray and value.flags.c_contiguous:
                sources[i] = value.__array_interface__["data"][0]
            else:
                return False
        self._scatter(self.layout, sources, np.frombuffer(rows, np.int64), self.size)
        return True
