"""A chunk of transitions written at a ring's cursor in a few calls: the fast path of
``ReplayBuffer.add_batch``.

The general path (:meth:`~replaybuf.storage.schema.FieldSpec.match`, then
``SlotStorage.extend`` with TorchRL's bookkeeping through its writer's state dicts and its
storage's methods, each taking a ``multiprocessing`` lock) costs more than copying a 1,000-row
chunk. Here a TensorDict or dict of CPU tensors holding exactly the spec's flat fields, each of
the field's dtype and row shape and all with one row count in ``[1, capacity]``, is checked
whole; then each is copied through numpy views into the columns at TorchRL's writer cursor (one
run, or two where the ring wraps), TorchRL's index column is written where it may not yet hold
its slots, and TorchRL's counters advance as its ``extend`` would
(:meth:`~replaybuf.storage.torchrl_state.RowBookkeeping.wrote_rows`). Anything else is
declined before anything is written and takes the general path, which converts, keeps the
newest rows of an oversized chunk, or raises the precise error.

:func:`chunk_writer` is chosen once per allocation (kept in ``SlotStorage.derived``) wherever
``add``'s row path applies (:mod:`replaybuf.storage.ringrow`): the same columns, views and
counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.storage.ringrow import RingRow, declined, row_writer
from replaybuf.storage.slots import SlotStorage

_KEY = "storage.ringchunk"  # its entry in SlotStorage.derived
# What Tensor.numpy() raises for tensors it cannot view (see replaybuf.storage.ringrow).
_NO_VIEW = (RuntimeError, TypeError)

ChunkWriter = Callable[[Any], int]  # a chunk -> the rows written, or -1: declined


class RingChunk:
    """Writes a chunk of rows, flat fields by name, at TorchRL's writer cursor."""

    def __init__(self, row: RingRow) -> None:
        # Per field name: its position, torch dtype and row shape.
        self.fields = {name: (at, dtype, shape) for at, name, dtype, shape, *_ in row.fields}
        self.views = row.targets  # bool columns as uint8: replaybuf.storage.bools
        self.index = row.index
        self.book = row.book
        self.slots = row.slots
        self.capacity = row.slots.capacity

    def __call__(self, batch: Any) -> int:
        """Write ``batch`` at the cursor and return its row count; -1 (nothing written) when
        it is not exactly the spec's fields as CPU tensors of one row count in
        ``[1, capacity]``."""
        kind = type(batch)
        if kind is not TensorDict and kind is not dict:
            return -1
        fields = self.fields
        arrays: list[Any] = [None] * len(fields)
        rows = -1
        seen = 0
        try:
            for name, value in batch.items():
                field = fields.get(name)
                if field is None or type(value) is not torch.Tensor:
                    return -1
                at, dtype, shape = field
                if value.dtype is not dtype or not value.is_cpu:
                    return -1
                size = value.shape
                if rows < 0:  # the first field fixes the row count
                    if not size:
                        return -1
                    rows = size[0]
                if size != (rows, *shape):
                    return -1
                if not value.data_ptr():  # no memory behind it (numpy() would view it)
                    return -1
                arrays[at] = value.numpy()  # refuses grad, conj/neg views, sparse
                seen += 1
        except _NO_VIEW:  # the general path detaches or refuses
            return -1
        capacity = self.capacity
        if seen != len(fields) or not 0 < rows <= capacity:
            return -1
        slots, book = self.slots, self.book
        cursor = book.cursor.value
        end = cursor + rows
        if end > slots._reserved:  # memmap files grow ahead of the rows (may raise: unwritten)
            slots._reserve(end)
        if end <= capacity:
            for view, array in zip(self.views, arrays, strict=True):
                view[cursor:end] = array
        else:
            head = capacity - cursor
            for view, array in zip(self.views, arrays, strict=True):
                view[cursor:] = array[:head]
                view[: rows - head] = array[head:]
        index = self.index
        if index is not None and slots._index_known < min(end, capacity):
            # TorchRL's index column holds each row's own slot, written on the ring's first pass
            written = np.arange(cursor, end) % capacity
            index[written] = written
            slots._index_written(cursor, rows)
        book.wrote_rows(cursor, rows)
        return rows


def chunk_writer(slots: SlotStorage) -> ChunkWriter:
    """The chunk writer for ``slots`` as they are now: chosen once per allocation."""
    writer = slots.derived.get(_KEY)
    if writer is None:
        row = row_writer(slots)
        writer = slots.derived[_KEY] = RingChunk(row) if isinstance(row, RingRow) else declined
    return writer
