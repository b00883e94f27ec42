"""What SlotStorage reads and repeats of TorchRL's storage and writer state.

TorchRL keeps the allocated columns, the stored length and the bookkeeping of a write in
private attributes and methods. Every such access is here, in one place, so that a TorchRL
upgrade that moves them has one module to check. The public writer ``state_dict`` /
``load_state_dict`` is used wherever it suffices.
"""

from __future__ import annotations

from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

from replaybuf.storage.devices import StorageKind
from replaybuf.storage.schema import Key

# TensorDictReplayBuffer writes its own "index" leaf into every stored row; we never return it.
INDEX_KEY = ("index",)
# What TorchRL's TensorStorage.set does besides copying (SlotStorage.write repeats it).
_SET_BOOKKEEPING = ("_set_last_cursor", "_get_new_len", "_bump_mutation_revision")
_BOOK = "storage.bookkeeping"  # record_slots' entry in a storage's derived cache


def new_memory(
    kind: StorageKind, capacity: int, device: torch.device, scratch: Path | None
) -> TensorDictReplayBuffer:
    """An empty TorchRL buffer of ``capacity`` rows: memmap files in ``scratch`` (never
    cleaned up by TorchRL, whose handlers would be process-wide), or tensors on ``device``."""
    if kind == "memmap":
        storage = LazyMemmapStorage(capacity, scratch_dir=scratch, auto_cleanup=False)
    else:
        storage = LazyTensorStorage(capacity, device=device)
    return TensorDictReplayBuffer(storage=storage, batch_size=None)


def allocated(memory: TensorDictReplayBuffer) -> TensorDictBase:
    """The TensorDict TorchRL allocated at the first write (a private attribute)."""
    return memory.storage._storage


def allocated_bytes(memory: TensorDictReplayBuffer) -> int:
    """Bytes of every allocated column (the user fields and TorchRL's own index column)."""
    leaves = allocated(memory).values(include_nested=True, leaves_only=True)
    return sum(v.numel() * v.element_size() for v in leaves)


def stored_columns(
    stored: TensorDictBase,
) -> tuple[list[tuple[Key, torch.Tensor]], torch.Tensor | None]:
    """The user fields' columns by flat key, in TorchRL's order, and its own index column
    (None where it keeps none), as plain tensors."""
    leaves = []
    for key, value in stored.items(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        if key != INDEX_KEY:
            leaves.append((key, value.as_subclass(torch.Tensor)))
    index = stored.get(INDEX_KEY[0], None)  # TorchRL's own column of row slots
    return leaves, None if index is None else index.as_subclass(torch.Tensor)


def takes_direct_writes(memory: TensorDictReplayBuffer) -> bool:
    """Whether writes may bypass TorchRL and repeat its bookkeeping through its own methods:
    only where this TorchRL has them and its writer keeps no more state than a cursor and a
    count."""
    return all(
        hasattr(memory.storage, name) for name in _SET_BOOKKEEPING
    ) and memory.writer.state_dict().keys() == {"_cursor", "_write_count"}


def record_write(storage, cursor: torch.Tensor | range | int, per_row: torch.Tensor) -> None:
    """What TorchRL's TensorStorage.set records besides the copy, through its own methods:
    the last cursor (``cursor``: the slots written, a tensor or a range, or the last of
    them), the length, and the revision that invalidates samplers' caches. ``per_row``: a
    tensor with one entry per written row along its first dimension (the slots, or a
    field's values)."""
    storage._set_last_cursor(cursor)
    # _get_new_len sets the length to min(length + rows, max_size), a no-op once the storage
    # is full (a ring's usual state), and a call costs more than len(): skipped then.
    if len(storage) < storage.max_size:
        # It counts per_row's rows; of its cursor it only asks whether it is one int (one
        # row without a leading dimension), which per_row, a tensor, is not.
        storage._get_new_len(per_row, per_row)
    storage._bump_mutation_revision()


def restore_state(memory: TensorDictReplayBuffer, rows: int, cursor: int, writes: int) -> bool:
    """Make TorchRL's writer and storage agree with ``rows`` rows filled from slot 0 (a loaded
    checkpoint): its cursor, write count and length, and its index column, which holds each
    row's own slot as TensorDictReplayBuffer.extend writes it. Whether it keeps that column."""
    memory.writer.load_state_dict({"_cursor": cursor, "_write_count": writes})
    # TorchRL has no public setter for how many rows a storage holds: `_len` is the private
    # attribute its TensorStorage reads for len(), fullness and sampling bounds.
    memory.storage._len = rows
    stored = allocated(memory)
    if INDEX_KEY[0] not in stored.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        return False
    index = stored.get(INDEX_KEY[0])
    index[:rows] = torch.arange(rows, dtype=index.dtype, device=index.device)
    return True


def release(memory: TensorDictReplayBuffer) -> list[torch.Tensor]:
    """Free a dropped TorchRL buffer's rows now rather than at the next garbage collection;
    the columns it held, in a list that holds their last references here.

    Its storage lists the sampler and writer that read it (``attach``), which refer back to
    it, and a locked TensorDict (memmap storage's) caches views of itself: reference cycles,
    so dropping the buffer alone would leave its rows (RAM, or mapped files) to the collector.
    Breaking both lets reference counting free every column no one else holds: when the
    returned list is emptied or dropped, where the caller chooses (unmapping memmap files is
    the kernel's work, which a reset hands to a background thread: see storage.scratch).
    """
    storage = memory.storage
    entities = getattr(storage, "_attached_entities", None)
    if isinstance(entities, list):
        entities.clear()
    data = getattr(storage, "_storage", None)
    held: list[torch.Tensor] = []
    if isinstance(data, TensorDictBase):
        data.unlock_()  # drops its cache (the views that refer back to it)
        held = list(data.values(include_nested=True, leaves_only=True))
        data.clear()
    return held


class RowBookkeeping:
    """What TorchRL's ``extend`` of one row records, written into the shared values behind its
    writer's and storage's counters: the cursor and write count, the length, the last cursor
    and the mutation revision (see :meth:`wrote`).

    TorchRL keeps each counter in a ``multiprocessing.Value`` behind a property whose getter
    and setter take that value's lock (several per counter and write, more than the copy of a
    row). The buffer's own lock already covers every write, and a same-sized int is written
    whole, so the values are read and written as the raw ``ctypes`` objects behind them
    (``Synchronized.get_obj()``, multiprocessing's public API). :func:`row_bookkeeping`
    gives this only where a TorchRL keeps its counters so.
    """

    def __init__(self, storage, values: list) -> None:
        self.storage = storage
        self.max_size = storage.max_size
        self.cursor, self.writes, self.length, self.last, self.revision = values

    def wrote(self, slot: int) -> None:
        """Record one row written at ``slot``, the writer's cursor (as ``extend`` would)."""
        self.storage._last_cursor = slot  # an int: every TorchRL reader takes it as the last slot
        self.last.value = slot
        length = self.length
        if length.value < self.max_size:
            length.value += 1
        self.revision.value += 1
        self.cursor.value = (slot + 1) % self.max_size
        self.writes.value += 1

    def wrote_rows(self, cursor: int, rows: int) -> None:
        """Record ``rows`` rows (at most ``max_size``) written from the writer's ``cursor``,
        wrapping, as ``extend`` would: the last cursor is their slots as a range, or where they
        wrap, the last slot (what every TorchRL reader takes of it)."""
        end = cursor + rows
        last = (end - 1) % self.max_size
        self.storage._last_cursor = range(cursor, end) if end <= self.max_size else last
        self.last.value = last
        length = self.length
        if length.value < self.max_size:
            length.value = min(length.value + rows, self.max_size)
        self.revision.value += 1
        self.cursor.value = end % self.max_size
        self.writes.value += rows

    def wrote_slots(self, last: int, rows: int) -> None:
        """Record ``rows`` rows written at slots the caller chose, ``last`` the last of them, as
        :func:`record_write` does (TorchRL's ``TensorStorage.set``: the writer's cursor and
        count stay as they are)."""
        self.storage._last_cursor = last
        self.last.value = last
        length = self.length
        if length.value < self.max_size:
            length.value = min(length.value + rows, self.max_size)
        self.revision.value += 1


def row_bookkeeping(memory: TensorDictReplayBuffer) -> RowBookkeeping | None:
    """:class:`RowBookkeeping` of ``memory`` (allocated, with TorchRL's round-robin writer: a
    ring's, or an episode storage's, whose writer stays unused), or None where this TorchRL
    keeps its counters otherwise (a compilable storage, renamed attributes)."""
    writer, storage = memory.writer, memory.storage
    shared = [
        getattr(writer, "_cursor_value", None),
        getattr(writer, "_write_count_value", None),
        getattr(storage, "_len_value", None),
        getattr(storage, "_last_cursor_index_value", None),
        getattr(storage, "_mutation_revision_value", None),
    ]
    if getattr(writer, "_compilable", True) or getattr(storage, "_compilable", True):
        return None
    held = [value for value in shared if isinstance(value, Synchronized)]
    if len(held) != len(shared) or writer.state_dict().keys() != {"_cursor", "_write_count"}:
        return None
    return RowBookkeeping(storage, [value.get_obj() for value in held])


def record_slots(
    derived: dict[str, Any], memory: TensorDictReplayBuffer, slots: torch.Tensor, last: int | None
) -> None:
    """:func:`record_write` of rows written at ``slots`` (``last``: the last of them, when the
    caller knows it), through :meth:`RowBookkeeping.wrote_slots` where this TorchRL keeps its
    counters so: without the locks of TorchRL's setters, which a flush of one staged row (each
    sample after a per-step append) otherwise pays several times. The bookkeeping is kept in
    ``derived`` (a storage's cache, emptied whenever its columns change)."""
    book = derived.get(_BOOK, False)
    if book is False:
        book = derived[_BOOK] = row_bookkeeping(memory)
    if book is None or last is None:
        record_write(memory.storage, slots if last is None else last, slots)
    else:
        book.wrote_slots(last, slots.shape[0])
