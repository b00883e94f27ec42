"""Staging of appended rows before they are written to TorchRL storage in one call.

TorchRL's per-call write costs tens of microseconds and a TensorDict per step costs more, so
appended steps are copied (``copy_``) into preallocated host columns, one per field, and written
to storage ``capacity`` rows at a time. Copying also decouples us from the caller's arrays, which
vectorized environments reuse for the next step.
"""

from __future__ import annotations

import torch

from replaybuf.schema import FieldSpec, Key


class RowStager:
    """Up to ``capacity`` rows of every field of ``spec``, with the storage rows they go to."""

    def __init__(self, spec: FieldSpec, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[Key] = list(spec)
        self.columns = [torch.empty((capacity, *spec[k].shape), dtype=spec[k].dtype) for k in spec]
        self.rows: list[int] = []
        self._arrays: list | None = None  # numpy views of the columns, for stage_one

    def __len__(self) -> int:
        return len(self.rows)

    def fits(self, count: int) -> bool:
        return len(self.rows) + count <= self.capacity

    def stage(self, rows: list[int], leaves: dict[Key, torch.Tensor]) -> None:
        """Copy ``len(rows)`` rows of ``leaves`` (each ``[len(rows), ...]``); caller checks fits."""
        begin, end = len(self.rows), len(self.rows) + len(rows)
        for key, column in zip(self.keys, self.columns, strict=True):
            column[begin:end].copy_(leaves[key])
        self.rows.extend(rows)

    def stage_one(self, row: int, values: list) -> None:
        """Copy one row given as numpy-assignable ``values`` in column order; caller checks fits.

        Used by the per-step fast path (:mod:`replaybuf.fastrow`): numpy item assignment into a
        view costs far less than a ``copy_`` per field.
        """
        if self._arrays is None:
            self._arrays = [column.numpy() for column in self.columns]
        at = len(self.rows)
        for array, value in zip(self._arrays, values):  # noqa: B905 (lengths match: one plan)
            array[at] = value
        self.rows.append(row)

    def drain(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The staged rows' storage slots and data (views into the columns, in ``keys``
        order), then empty. The data must be consumed (written) before the next stage."""
        count = len(self.rows)
        slots = torch.tensor(self.rows, dtype=torch.long)
        self.rows = []
        return slots, [c[:count] for c in self.columns]
