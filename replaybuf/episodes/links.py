"""Per-row bookkeeping: the links between an episode's rows, their owners, steps and end kinds.

Every write runs on numpy columns on the host; readers get the columns on the storing device
(the same tensors on the CPU, a device copy updated when read elsewhere). Also here: the check
that the bookkeeping fits before it is allocated.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

from replaybuf.core import END_NONE, jump_tables
from replaybuf.errors import IndexOutOfRangeError, InsufficientSpaceError, InvalidStateError
from replaybuf.storage import DeviceMirror, free_bytes

_CPU = torch.device("cpu")  # host bookkeeping lives here, whatever torch's default device


SAVED = ("next_row", "episode", "step", "end_kind", "alloc")  # what a state holds


class HostLinks(NamedTuple):
    """numpy views of :class:`RowLinks` columns on the host (``RowLinks.host`` on the CPU)."""

    succ: np.ndarray
    end_kind: np.ndarray
    step: np.ndarray
    episode: np.ndarray
    next_row: np.ndarray
    alloc: np.ndarray
    prev_row: np.ndarray | None


class _Column:
    """A :class:`RowLinks` column as readers see it: on the storing device, up to date.

    Read-only: an assignment would hide the column from later updates.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, links: RowLinks | None, owner: type | None = None) -> Any:
        if links is None:  # on the class
            return self
        return links.column(self.name)

    def __set__(self, links: RowLinks, value: object) -> None:
        raise AttributeError(f"RowLinks.{self.name} is read-only: write through place/connect")


def _int64(values: np.ndarray) -> np.ndarray:
    """Row indices as the compiled writes take them: contiguous int64 (no copy when they are)."""
    return np.ascontiguousarray(values, dtype=np.int64)


class RowLinks:
    """Per-row bookkeeping: links, owners, steps and end kinds, read on the storing device.

    Every write (:meth:`place`, :meth:`connect`, :meth:`release`, from int64 numpy arrays)
    runs on numpy columns on the host: a torch fancy index costs several times a numpy one on
    the CPU and a launch plus a copy on CUDA, and a flush makes a dozen. On the CPU the
    columns are the tensors readers get (``host`` holds their numpy views, for the numpy
    index math). Elsewhere (``mirror``) readers get a device copy, updated when read (see
    :mod:`replaybuf.storage.mirror`); tests mirror on the CPU too.
    """

    next_row = _Column()
    # next_row with a self-loop where it is -1, so that following links is one gather per
    # step with no mask (see index.nstep_windows). Derived: every write to next_row sets it.
    succ = _Column()
    episode = _Column()
    step = _Column()
    end_kind = _Column()
    # Which allocation of the row holds it now: an id handed out with a sample stays
    # recognisable after the row is freed and reused (see :meth:`ids`).
    alloc = _Column()
    # The reverse of next_row (-1 at an episode's first row), kept only for frame stacking.
    prev_row = _Column()

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        backward: bool = False,
        mirror: bool | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        self.capacity = capacity
        # Host columns, whatever the default device.
        long: dict[str, Any] = {"dtype": torch.long, "device": _CPU}
        self._tensors: dict[str, torch.Tensor | None] = {
            "succ": torch.arange(capacity, **long),
            "end_kind": torch.zeros(capacity, dtype=torch.int8, device=_CPU),
            "step": torch.zeros(capacity, **long),
            "episode": torch.full((capacity,), -1, **long),
            "next_row": torch.full((capacity,), -1, **long),
            "alloc": torch.full((capacity,), -1, **long),
            "prev_row": torch.full((capacity,), -1, **long) if backward else None,
        }
        # The numpy views every write goes through; they share memory with the tensors, which
        # are only ever written in place.
        views: dict[str, Any] = {
            name: None if t is None else t.numpy() for name, t in self._tensors.items()
        }
        self._master = HostLinks(**views)
        self.version = 0  # bumped whenever succ changes: invalidates the jump tables
        self._jumps: list[torch.Tensor] = []  # index.jump_tables of succ, built on demand
        self._jumps_version = 0
        self._mirror: DeviceMirror | None = None
        self._views = self._tensors
        if mirror or (mirror is None and device.type != "cpu"):
            names = [name for name, t in self._tensors.items() if t is not None]
            self._mirror = DeviceMirror([getattr(self._master, n) for n in names], device)
            self._views = dict.fromkeys(self._tensors)
            self._views.update(zip(names, self._mirror.table, strict=True))
        # numpy views for the n-step sampler on CPU storage (None: it runs in torch, on the
        # device copy, with no host synchronisation).
        self.host: HostLinks | None = None if self._mirror is not None else self._master
        # replaybuf.accel.numba_kernels' place/connect/release loops (None: the numpy paths),
        # with prev_row as an empty column when it is not kept.
        self._kernels = kernels
        no_prev = np.empty(0, np.int64)
        self._prev = no_prev if self._master.prev_row is None else self._master.prev_row

    def column(self, name: str) -> torch.Tensor | None:
        """A column on the storing device, with every write so far."""
        if self._mirror is not None:
            self._mirror.publish()
        return self._views[name]

    @property
    def nbytes(self) -> int:
        mirrored = 0 if self._mirror is None else self._mirror.nbytes
        host = sum(t.numel() * t.element_size() for t in self._tensors.values() if t is not None)
        return host + mirrored

    def _touched(self, *rows: np.ndarray) -> None:
        if self._mirror is not None:
            for r in rows:
                self._mirror.touched(r)

    def place(
        self,
        rows: np.ndarray,
        episodes: np.ndarray,
        steps: np.ndarray,
        ends: np.ndarray,
        allocations: np.ndarray,
    ) -> None:
        """Set up new rows (distinct): their episode, step, end kind and allocation; each gets
        no successor (and no predecessor) until :meth:`connect` links it."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            rows, episodes, steps, ends, allocations = map(
                _int64, (rows, episodes, steps, ends, allocations)
            )
            self._kernels.place_rows(
                rows, episodes, steps, ends, allocations,
                c.next_row, c.succ, c.episode, c.end_kind, c.step, c.alloc, self._prev,
            )  # fmt: skip
            self._touched(rows)
            return
        c.next_row[rows] = -1
        c.succ[rows] = rows
        c.episode[rows] = episodes
        c.step[rows] = steps
        c.end_kind[rows] = ends
        c.alloc[rows] = allocations
        if c.prev_row is not None:
            c.prev_row[rows] = -1
        self._touched(rows)

    def connect(self, sources: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        """Link each of ``sources`` to the row in ``targets`` that follows it; returns
        ``sources`` as a new CPU tensor."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            sources, targets = _int64(sources), _int64(targets)
            self._kernels.connect_rows(sources, targets, c.next_row, c.succ, self._prev)
        else:
            c.next_row[sources] = targets
            c.succ[sources] = targets
            if c.prev_row is not None:
                c.prev_row[targets] = sources
        if c.prev_row is not None:
            self._touched(targets)
        self._touched(sources)
        return torch.from_numpy(sources.copy())

    def place_steps(self, meta: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """:meth:`place` then :meth:`connect` in one compiled call (only when :attr:`compiled`),
        from the per-step lists as the core stages them: ``meta`` five ints a row (row,
        episode, step, end kind, allocation), ``pairs`` two a link (source, target). Returns
        the sources (a view of ``pairs``)."""
        if self._kernels is None:
            raise InvalidStateError(
                "RowLinks.place_steps needs replaybuf.accel.numba_kernels (see compiled)"
            )
        self.version += 1
        c = self._master
        self._kernels.place_steps(
            meta, pairs, c.next_row, c.succ, c.episode, c.end_kind, c.step, c.alloc, self._prev
        )
        sources, targets = pairs[0::2], pairs[1::2]
        self._touched(meta[0::5], sources, targets)
        return sources

    @property
    def compiled(self) -> bool:
        """Whether writes run through replaybuf.accel.numba_kernels (so :meth:`place_batches`
        works)."""
        return self._kernels is not None

    def place_batches(
        self, rows: np.ndarray, ids: np.ndarray, steps: np.ndarray, first: int, tail: np.ndarray
    ) -> torch.Tensor:
        """:meth:`place` and :meth:`connect` for a batch run's batches in one compiled pass
        (:func:`replaybuf.accel.numba_kernels.place_batches`; only when :attr:`compiled`);
        returns the rows linked from, the new anchors, as a CPU tensor."""
        if self._kernels is None:
            raise InvalidStateError(
                "RowLinks.place_batches needs replaybuf.accel.numba_kernels (see compiled)"
            )
        self.version += 1
        c = self._master
        rows, ids, steps, tail = map(_int64, (rows, ids, steps, tail))
        sources = np.empty_like(rows)
        self._kernels.place_batches(
            rows, ids, steps, first, tail, sources,
            c.next_row, c.succ, c.episode, c.end_kind, c.step, c.alloc, self._prev,
        )  # fmt: skip
        self._touched(rows, sources)
        return torch.from_numpy(sources)

    def release(self, rows: np.ndarray) -> None:
        """Free rows (int64): no episode, successor, predecessor or end kind."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            rows = _int64(rows)
            self._kernels.release_rows(rows, c.next_row, c.succ, c.episode, c.end_kind, self._prev)
        else:
            c.next_row[rows] = -1
            c.succ[rows] = rows
            c.episode[rows] = -1
            c.end_kind[rows] = END_NONE
            if c.prev_row is not None:
                c.prev_row[rows] = -1
        self._touched(rows)

    def release_columns(self) -> tuple[np.ndarray, ...] | None:
        """``next_row, succ, episode, end_kind, prev_row`` (empty when not kept), the columns
        :meth:`release` writes, when it runs compiled: a kernel releasing rows as it does
        writes them, then calls :meth:`released`; else None."""
        if self._kernels is None:
            return None
        c = self._master
        return c.next_row, c.succ, c.episode, c.end_kind, self._prev

    def released(self, rows: np.ndarray) -> None:
        """What :meth:`release` does besides the column writes (after a kernel's)."""
        self.version += 1
        self._touched(rows)

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Ids of the rows' current contents: allocation * capacity + row (unique for life)."""
        return self.alloc.index_select(0, rows) * self.capacity + rows

    def live(self, ids: torch.Tensor, allocations: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, live)`` for ids from :meth:`ids`; live: still that row's anchor.

        Args:
            ids: ids from :meth:`ids`.
            allocations: rows ever handed out (an id naming a later allocation never existed).

        Raises:
            IndexError: an id no row ever had.
        """
        capacity = self.capacity
        never = (ids < 0) | (ids // capacity >= allocations)
        if bool(never.any()):
            raise IndexOutOfRangeError(
                f"index must hold ids of sampled steps, got {int(ids[never][0])}, which no "
                "step ever had"
            )
        rows = ids % capacity
        live = (self.alloc.index_select(0, rows) == ids // capacity) & (
            self.next_row.index_select(0, rows) >= 0
        )
        return rows, live

    def live_host(self, ids: np.ndarray, allocations: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`live` in numpy on the host columns, the live rows only: ``(rows[live],
        live)``; None where some id was never a row's (then :meth:`live` raises)."""
        host = self.host
        assert host is not None, "the host columns: CPU storage"
        capacity = self.capacity
        made = ids // capacity  # the allocation each id names
        if ids.min() < 0 or made.max() >= allocations:
            return None
        rows = ids % capacity
        live = (host.alloc[rows] == made) & (host.next_row[rows] >= 0)
        return rows[live], live

    def jumps(self, levels: int) -> list[torch.Tensor]:
        """``index.jump_tables`` of ``succ`` (succ^1, succ^2, succ^4, ...), kept until the
        links change; for walks on CUDA (8 bytes a row per level, built on first use)."""
        if self._jumps_version != self.version:
            self._jumps, self._jumps_version = [], self.version
        return jump_tables(self.succ, levels, self._jumps)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the columns a checkpoint keeps (:data:`SAVED`; ``succ`` and ``prev_row``
        follow from ``next_row``), on the CPU."""
        return {name: self._tensors[name].clone() for name in SAVED}  # type: ignore[union-attr]

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        """Set the :data:`SAVED` columns (host tensors, checked by the caller), then recompute
        ``succ`` and ``prev_row`` from ``next_row``."""
        for name, value in saved.items():
            column = self._tensors[name]
            assert column is not None, f"no column {name} to restore"
            column.copy_(value)
        c = self._master
        rows = np.arange(c.next_row.shape[0])
        c.succ[:] = np.where(c.next_row >= 0, c.next_row, rows)
        if c.prev_row is not None:
            c.prev_row.fill(-1)
            linked = np.flatnonzero(c.next_row >= 0)
            c.prev_row[c.next_row[linked]] = linked
        self.version += 1
        if self._mirror is not None:
            self._mirror.changed_all()


# Bookkeeping bytes per row on the host: next_row, succ, episode, step, alloc (int64), end_kind
# (int8), the anchor set's two int64 columns and the free list's int64 entry; prev_row adds 8.
# Storage off the CPU also keeps a device copy of the links and anchors, every column int64.
_HOST_ROW_BYTES = 8 * 5 + 1 + 16 + 8
_MIRROR_ROW_BYTES = 8 * 6 + 16


def check_bookkeeping_space(capacity: int, device: torch.device, backward: bool) -> None:
    """Raise :class:`InsufficientSpaceError` before allocating row bookkeeping that cannot fit
    (on the host, and its copy on the storing device; the allocator's own error names no
    argument)."""
    places = [(_CPU, _HOST_ROW_BYTES)]
    if device.type != "cpu":
        places.append((device, _MIRROR_ROW_BYTES))
    for place, row_bytes in places:
        needed = capacity * (row_bytes + 8 * backward)
        free = free_bytes("tensor", place, Path(tempfile.gettempdir()))
        if needed > free:
            where = f"{place} memory" if place.type == "cuda" else "host memory (RAM)"
            raise InsufficientSpaceError(f"{where}, for the rows' bookkeeping", needed, free)
