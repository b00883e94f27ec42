"""Staging of appended rows before they are written to TorchRL storage in one call.

TorchRL's write has a large fixed cost per call and a TensorDict per step costs more, so
appended steps are copied into preallocated host columns, one per field (``copy_``, or numpy
assignment through :attr:`RowStager.arrays` on the fast paths), and written to storage
``capacity`` rows at a time. Copying also decouples us from the caller's arrays, which
vectorized environments reuse for the next step.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replaybuf.storage.bools import assign_view
from replaybuf.storage.schema import FieldSpec, Key

_CPU = torch.device("cpu")  # staging is on the host, whatever torch's default device
_NO_SLOTS = torch.empty(0, dtype=torch.long, device=_CPU)
_SLICES = 1024  # column slices kept (see RowStager.slices)


class RowStager:
    """Up to ``capacity`` rows of every field of ``spec``, with the storage rows they go to."""

    def __init__(self, spec: FieldSpec, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[Key] = list(spec)
        # One row more than staged: the spare row (index ``capacity``), where the per-step path
        # checks a step before an eviction that flushes the staged rows.
        with torch.inference_mode(False):  # made at a first append (storage.NORMAL_TENSORS)
            self.columns = [
                torch.empty((capacity + 1, *spec[k].shape), dtype=spec[k].dtype, device=_CPU)
                for k in spec
            ]
        # Storage rows of the staged rows: int64, so that drain makes one tensor of them with
        # torch.frombuffer (torch.tensor converts a list of Python ints one int at a time).
        self.rows = array("q")
        # Rows of this flush written straight to storage instead (SlotStorage.write_batch):
        # they count toward a flush as staged rows do, so flushes come as often either way.
        self.direct = 0
        # numpy views of the columns, for the per-step fast path (replaybuf.storage.fastrow:
        # numpy item assignment costs far less than a copy_ per field); None where a dtype has
        # no numpy twin (bfloat16, ...).
        self.arrays: list[np.ndarray] | None = None
        with contextlib.suppress(TypeError):
            self.arrays = [column.numpy() for column in self.columns]
        # What batches of numpy values are assigned into (bool columns as uint8, so that they
        # hold 0 or 1: replaybuf.storage.bools).
        self.targets = None if self.arrays is None else list(map(assign_view, self.arrays))
        # The columns as row words, for the compiled scatter into storage (SlotStorage.write_rows).
        self.words = [row_words(column) for column in self.columns]
        self._slices: dict[tuple[int, int], list[torch.Tensor]] = {}  # see slices

    def slices(self, at: int, count: int) -> list[torch.Tensor]:
        """Views of rows ``at`` .. ``at + count`` of every column. Kept: slicing is a torch
        call per field, and a vector env stages the same slices over and over."""
        views = self._slices.get((at, count))
        if views is None:
            if len(self._slices) >= _SLICES:
                self._slices.clear()
            views = self._slices[at, count] = [column[at : at + count] for column in self.columns]
        return views

    def put(self, values: list[Any], rows: array) -> None:
        """Stage ``rows`` with ``values`` (per column, in column order, ``[len(rows), ...]``):
        CPU tensors of the columns' dtypes in one ``torch._foreach_copy_``, or numpy arrays
        one slice assignment each (see :meth:`replaybuf.storage.fastrow.RowPlan.batch_values`)."""
        at, count = len(self.rows), len(rows)
        if type(values[0]) is torch.Tensor:
            torch._foreach_copy_(self.slices(at, count), values)
        else:
            assert self.targets is not None  # numpy values come only with numpy views (RowPlan)
            for column, value in zip(self.targets, values, strict=True):
                column[at : at + count] = value
        self.rows.extend(rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> int:
        """Rows of the next flush: staged, or written straight to storage."""
        return len(self.rows) + self.direct

    def fits(self, count: int) -> bool:
        return self.pending + count <= self.capacity

    def stage(self, rows: Sequence[int], leaves: dict[Key, torch.Tensor]) -> None:
        """Copy ``len(rows)`` rows of ``leaves`` (each ``[len(rows), ...]``); caller checks fits."""
        begin, end = len(self.rows), len(self.rows) + len(rows)
        for key, column in zip(self.keys, self.columns, strict=True):
            column[begin:end].copy_(leaves[key])
        self.rows.extend(rows)

    def stage_spare(self, row: int, arrays: list[np.ndarray]) -> None:
        """Stage the spare row's contents, written through ``arrays`` (:attr:`arrays`), for
        ``row``; caller checks fits."""
        at, spare = len(self.rows), self.capacity
        for column in arrays:
            column[at] = column[spare]
        self.rows.append(row)

    def drain(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The staged rows' storage slots and data (views into the columns, in ``keys``
        order), then empty. The data must be consumed (written) before the next stage."""
        count = len(self.rows)
        slots = torch.frombuffer(self.rows, dtype=torch.long) if count else _NO_SLOTS
        # The tensor views the old array's memory (written through TorchRL's set, TorchRL keeps
        # it as its last cursor): that array is never touched again; staging starts a new one.
        self.rows = array("q")
        return slots, self.slices(0, count)


def row_words(tensor: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU ``tensor`` (``[rows, ...]``, any dtype) as a ``[rows, row words]``
    numpy view of the widest unsigned word (64, 32, 16 or 8 bits) that divides its row bytes
    and its address: what :func:`replaybuf.accel.numba_kernels.scatter_rows` takes (a word a
    copy: fewer, wider copies than byte by byte). None for a row of no bytes."""
    if tensor.numel() == 0:
        return None
    rows = tensor.view(tensor.shape[0], -1).view(torch.uint8).numpy()
    for word in (np.uint64, np.uint32, np.uint16):
        size = np.dtype(word).itemsize
        if rows.shape[1] % size == 0 and rows.ctypes.data % size == 0:
            return rows.view(word)
    return rows
