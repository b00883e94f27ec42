"""Ragged fields: values whose leading size varies from step to step, stored flat.

A ragged field (token ids, a list of numbers of any length, and the encoded bytes of text,
``bytes`` and JSON-like values) keeps its values end to end in one TorchRL storage, an arena
of ``[tokens, *shape]``, and each row's span in it on the host: ``start << 24 | length``, 8
bytes a row (rows with no value: -1). A write appends at the arena's head; a freed row's
values are garbage until the head reaches the arena's end, when the live values are moved to
its front in order (compaction), or, when they fill more than ``FILL`` of it, into a larger
arena (only when they would fill more than ``GROW_AT`` of it: between the two thresholds a
compaction frees enough, and a growth is always by more than ``GROW_AT / FILL``, so each value
is moved a bounded number of times on average). A field declared with ``reserve`` gets an
arena of ``reserve / FILL`` values at its first write. Otherwise, and past it, the arena grows
by a quarter at a time, but never past ``mean * rows / FILL``: the mean row's values times
the rows a full buffer holds (``rows_hint``, by default every row). So once the buffer is
full its arena holds the live values within ``1 / FILL`` of their own size, not a growth
step's quarter more.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

from replaybuf.errors import CapacityError
from replaybuf.storage.devices import StorageKind
from replaybuf.storage.quiet import quiet_allocation

LENGTH_BITS = 24
MAX_LENGTH = (1 << LENGTH_BITS) - 1  # values of one row at most
FILL = 0.92  # the share of a new arena the live values fill
GROW_AT = 0.96  # live values above this share of the arena: grow instead of compacting
_MIN_TOKENS = 1024
_MOVE_CHUNK = 1 << 20  # values moved per copy when compacting (bounds the temporary)
_CPU = torch.device("cpu")


@dataclass
class Ragged:
    """Rows of a ragged field: their values end to end and each row's length."""

    values: torch.Tensor  # [total, *shape]
    lengths: torch.Tensor  # [rows] int64, on the CPU
    kind: str = "ragged"  # or the non-tensor kind whose encoded bytes these are

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @classmethod
    def of_rows(
        cls,
        rows: list[torch.Tensor],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        kind: str = "ragged",
    ) -> Ragged:
        """Rows given one tensor each (``[length, *shape]``)."""
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
        if rows:
            values = torch.cat([r.to(_CPU) for r in rows])
        else:
            values = torch.empty((0, *shape), dtype=dtype)
        return cls(values, lengths, kind)

    def unsqueeze(self, dim: int) -> Ragged:
        """Itself: a one-row Ragged already has its row dimension (mirrors ``Tensor``)."""
        return self

    def split(self) -> list[torch.Tensor]:
        """Each row's values (views)."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def row(self, i: int) -> torch.Tensor:
        """Row ``i``'s values (a view)."""
        start = int(self.lengths[:i].sum())
        return self.values[start : start + int(self.lengths[i])]


def pack(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return (starts << LENGTH_BITS) | lengths


def unpack(spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of packed spans (a row with none: length 0)."""
    empty = spans < 0
    starts = np.where(empty, 0, spans >> LENGTH_BITS)
    lengths = np.where(empty, 0, spans & MAX_LENGTH)
    return starts, lengths


class RaggedColumn:
    """One ragged field of ``capacity`` rows: its arena and its rows' spans."""

    def __init__(
        self,
        capacity: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        kind: StorageKind,
        device: torch.device,
        scratch: Path | None,
        name: str,
        reserve: int | None = None,
    ) -> None:
        self.shape, self.dtype, self.kind, self.device = shape, dtype, kind, device
        self._scratch, self._name = scratch, name  # memmap arenas: scratch/ragged-<name>-<n>
        self.reserve = reserve
        self.spans = np.full(capacity, -1, dtype=np.int64)  # host: 8 bytes a row
        self.head = 0  # where the next values go
        self.live = 0  # values the rows' spans cover
        self.rows_live = 0  # rows that hold a span
        self._arena: torch.Tensor | None = None  # [tokens, *shape], allocated on first use
        # The rows a full buffer holds (None: every row), for the arena's final size.
        self.rows_hint: Callable[[], int] | None = None
        self._storages = 0  # arenas made so far (each memmap one gets a folder of its own)
        self._folder: Path | None = None  # the memmap arena's files
        self._next_folder: Path | None = None

    @property
    def tokens(self) -> int:
        """The arena's size in values (0 before the first write)."""
        return 0 if self._arena is None else int(self._arena.shape[0])

    @property
    def nbytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size() * math.prod(self.shape)
        return self.tokens * element + self.spans.nbytes

    # ----------------------------------------------------------------- writes
    def write(self, rows: np.ndarray, data: Ragged) -> None:
        """Give ``rows`` (free or overwritten ones) the values of ``data``, row for row."""
        lengths = data.lengths.numpy()
        if lengths.size and int(lengths.max()) > MAX_LENGTH:
            raise CapacityError(f"a row holds at most {MAX_LENGTH} values")
        self.release(rows)
        total = int(lengths.sum())
        if self.head + total > self.tokens:
            self._make_room(total, len(rows))
        arena = self._arena
        if total:
            assert arena is not None, "room was made above"
            arena[self.head : self.head + total].copy_(data.values.to(self.device))
        starts = self.head + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.spans[rows] = pack(starts, lengths.astype(np.int64))
        self.head += total
        self.live += total
        self.rows_live += len(rows)

    def release(self, rows: np.ndarray) -> None:
        """Free ``rows``' values (they become garbage until the next compaction)."""
        spans = self.spans[rows]
        held = spans >= 0
        if held.any():
            self.live -= int((spans[held] & MAX_LENGTH).sum())
            self.rows_live -= int(held.sum())
            self.spans[rows[held]] = -1

    def clear(self) -> None:
        self.spans.fill(-1)
        self.head = self.live = self.rows_live = 0

    def close(self) -> None:
        """Drop the arena and remove its memmap files (the column holds nothing after)."""
        self.clear()
        self._arena = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _make_room(self, incoming: int, incoming_rows: int) -> None:
        """Room for ``incoming`` values at the head: compact, or move into a larger arena."""
        need = self.live + incoming
        if need > GROW_AT * self.tokens:
            if self.reserve is not None and not self.tokens:  # room for the declared values
                grow = math.ceil(self.reserve / FILL)
            else:  # geometric, up to what the rows of a full buffer need at the mean row
                rows = self.rows_live + incoming_rows
                full = self.rows_hint() if self.rows_hint is not None else self.spans.shape[0]
                projected = math.ceil(need / max(rows, 1) * max(full, rows) / FILL)
                grow = min(max(_MIN_TOKENS, math.ceil(self.tokens * 1.25)), projected)
            size = max(grow, math.ceil(need / FILL))
            old = self._folder
            self._move_live(self._new_arena(size))
            if old is not None:  # the previous arena's files (unmapped once dropped)
                shutil.rmtree(old, ignore_errors=True)
        else:
            self._move_live(self._arena)

    def _new_arena(self, tokens: int) -> torch.Tensor:
        """A fresh arena in TorchRL storage (memmap files or a tensor on the device)."""
        folder = None
        if self.kind == "memmap":
            if self._scratch is not None:
                folder = self._scratch / f"ragged-{self._name}-{self._storages}"
            storage = LazyMemmapStorage(tokens, scratch_dir=folder, auto_cleanup=False)
        else:
            storage = LazyTensorStorage(tokens, device=self.device)
        self._storages += 1
        self._next_folder = folder
        with torch.inference_mode(False), quiet_allocation():  # TorchRL logs allocations
            example = torch.zeros((1, *self.shape), dtype=self.dtype)
            storage.set(torch.zeros(1, dtype=torch.long), example)
        arena = storage._storage  # TorchRL's allocated tensor (see storage.torchrl_state)
        return arena.as_subclass(torch.Tensor)

    def _move_live(self, target: torch.Tensor | None) -> None:
        """Move every live row's values, in arena order, to the front of ``target`` (the
        arena itself: a compaction, moving values only towards the front)."""
        assert target is not None, "an arena exists once a write made room"
        rows = np.flatnonzero(self.spans >= 0)
        starts, lengths = unpack(self.spans[rows])
        order = np.argsort(starts, kind="stable")
        rows, starts, lengths = rows[order], starts[order], lengths[order]
        new_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        source = self._arena
        if source is not None and lengths.size:
            flat = _ranges(starts, lengths)
            for at in range(0, flat.shape[0], _MOVE_CHUNK):  # forward: never overwrites unread
                part = torch.from_numpy(flat[at : at + _MOVE_CHUNK]).to(source.device)
                values = source.index_select(0, part)
                target[at : at + part.shape[0]].copy_(values)
        self.spans[rows] = pack(new_starts, lengths)
        self.head = int(lengths.sum())
        self.live = self.head
        if target is not self._arena:
            self._arena, self._folder = target, self._next_folder

    # ----------------------------------------------------------------- reads
    def take(self, rows: np.ndarray, device: torch.device) -> Ragged:
        """The values of ``rows`` (row for row, a row with none: empty) on ``device``."""
        starts, lengths = unpack(self.spans[rows.reshape(-1)])
        flat = _ranges(starts, lengths)
        if self._arena is None or flat.shape[0] == 0:
            values = torch.empty((0, *self.shape), dtype=self.dtype, device=device)
        else:
            at = torch.from_numpy(flat).to(self._arena.device)
            values = self._arena.index_select(0, at).to(device)
        return Ragged(values, torch.from_numpy(lengths))

    def state_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[0, rows)`` as CSR: their values end to end and ``rows + 1`` offsets."""
        taken = self.take(np.arange(rows, dtype=np.int64), _CPU)
        offsets = torch.zeros(rows + 1, dtype=torch.long)
        torch.cumsum(taken.lengths, 0, out=offsets[1:])
        return taken.values, offsets

    def load_rows(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """Rows ``[0, len(offsets) - 1)`` from CSR (checked by the caller); the rest none."""
        self.clear()
        lengths = (offsets[1:] - offsets[:-1]).to(torch.long)
        rows = np.flatnonzero(lengths.numpy() > 0)
        if rows.size:
            self.write(rows, Ragged(values, lengths[rows]))


class RaggedFields(dict[Any, RaggedColumn]):
    """Each ragged field's column, by key, and what a storage does to all of them at once."""

    def write(self, slots: np.ndarray, leaves: dict[Any, Ragged]) -> None:
        """Give ``slots`` (int64) the values of each ragged field, row for row."""
        for key, value in leaves.items():
            self[key].write(slots, value)

    def release(self, slots: np.ndarray) -> None:
        """Free ``slots``' ragged values (freed or evicted rows)."""
        for column in self.values():
            column.release(slots)

    def close(self) -> None:
        """Close every column and forget them."""
        for column in self.values():
            column.close()
        self.clear()


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``start .. start + length - 1`` of each span, end to end (int64)."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, np.int64)
    offsets = np.cumsum(lengths) - lengths  # each span's place in the output
    positions = np.arange(total, dtype=np.int64)
    return positions - np.repeat(offsets, lengths) + np.repeat(starts, lengths)
