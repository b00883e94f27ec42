"""The lockstep bookkeeping of ``append_batch``: a batch run and the packed staged columns.

A vectorized env appends one step to the same episodes, in the same order, call after call.
:class:`BatchRun` keeps the rows of such repeated batches as they come and makes their
bookkeeping later, for many batches at once; :class:`Packed` holds staged bookkeeping as int64
columns until a flush places it.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from replaybuf.episodes.episode import Episode

# A batch run settles its batches' rows into its episodes' arrays once this many are packed
# (checked at each pack, at every flush), which bounds its pending list.
_SETTLE_BATCHES = 256
Ints = array | np.ndarray


class BatchRun:
    """Repeated ``append_batch`` calls on the same episodes, their bookkeeping made in bulk.

    Holds the episodes of the last ``append_batch`` and the rows of later batches of the same
    episodes (a vectorized env between resets), so that such a batch costs no per-episode
    work: the core checks the ids once (:meth:`repeated`) and keeps the new
    rows here. Their bookkeeping (:meth:`pack`, at a flush) and each episode's row array
    (:meth:`settle_rows`, when read, or once ``_SETTLE_BATCHES`` are packed) are made later for
    many batches at once. Valid while ``allocations`` matches the core's (no row handed out
    since); the core drops it when any episode in progress ends or goes.
    """

    def __init__(
        self, episodes: list[Episode], ids: array, steps: array, rows: array, allocations: int
    ) -> None:
        self.episodes, self.episode_ids = episodes, ids.tolist()
        self.low_ids = min(self.episode_ids) <= 1  # ids a bool equals (see repeated)
        self.ids = np.frombuffer(ids, np.int64)
        # Each episode's step number in the first batch not yet packed; the rows of the last
        # packed batch, which that batch links from.
        self.steps = np.frombuffer(steps, np.int64) + 1
        self.tail = rows
        self.batches: list[array] = []  # rows of the later batches, oldest first
        self.packed = 0  # of ``batches``, how many are in the staged bookkeeping
        self.settled = 0  # ... and in their episodes' ``own`` arrays
        self.allocations = allocations
        self.protected: set[int] | None = None  # the episodes' ids, once an eviction asks
        for episode in episodes:
            episode.run = self

    def repeated(self, episode_ids: list[Any]) -> list[Episode] | None:
        """The run's episodes if ``episode_ids`` names them again (plain ints, same order);
        else None. The run lasts only while none of them has ended or gone."""
        if len(episode_ids) != len(self.episode_ids):
            return None
        # Ints first (True == 1 and 1.0 == 1, and comparing arrays raises): a sum of ints is
        # an int, and a float, numpy scalar, array or tensor in it makes something else or
        # raises. A bool adds as an int, but it equals only episode 0 or 1, so a run holding
        # those checks every type (slower than the sum).
        try:
            if self.low_ids:
                ints = list(map(type, episode_ids)).count(int) == len(episode_ids)
            else:
                ints = type(sum(episode_ids)) is int
            if not ints or episode_ids != self.episode_ids:
                return None
        except Exception:  # whatever a bad id raises here, the checks of every id name it
            return None
        # The caller's int objects: the next call's comparison takes identity shortcuts.
        self.episode_ids = episode_ids
        return self.episodes

    def add(self, rows: array, allocations: int) -> None:
        """One more batch of rows (one per episode, in order); ``allocations``: the core's
        count after it."""
        self.batches.append(rows)
        self.allocations = allocations

    def pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray] | None:
        """The batches not packed yet, or None: their rows (flat, batch-major), the episodes'
        ids, each episode's step in the first of them, the first's allocation and the rows
        the first links from (the batch before's). Nothing changes until :meth:`commit`."""
        new = self.batches[self.packed :]
        if not new:
            return None
        rows = np.frombuffer(b"".join(new), np.int64)
        # The run's batches were the last rows handed out, one allocation each, in order.
        first = self.allocations - len(new) * len(self.ids)
        return rows, self.ids, self.steps, first, np.frombuffer(self.tail, np.int64)

    def commit(self) -> None:
        """Count the :meth:`pending` batches as packed (their bookkeeping placed or packed)."""
        batches = len(self.batches) - self.packed
        if not batches:
            return
        self.steps = self.steps + batches  # a new array: a pending() result stays as it was
        self.tail, self.packed = self.batches[-1], len(self.batches)
        if self.packed >= _SETTLE_BATCHES:
            self.settle_rows()

    def pack(self, packed: Packed) -> None:
        """Add the bookkeeping of the batches not packed yet to ``packed``: each row's
        episode, step and allocation, and the link from the previous batch's row."""
        taken = self.pending()
        if taken is None:
            return
        rows, ids, first_steps, first, tail = taken
        count = len(ids)
        batches = len(rows) // count
        steps = first_steps + np.arange(batches, dtype=np.int64)[:, None]  # [batches, count]
        episodes = np.empty_like(steps)
        episodes[:] = ids
        packed.add_rows(rows, episodes, steps, first)
        packed.sources.frombytes(_bytes(tail))
        packed.sources.frombytes(_bytes(rows[:-count]))
        packed.targets.frombytes(_bytes(rows))
        self.commit()

    def settle_rows(self) -> None:
        """Append the batches' rows to their episodes' ``own`` arrays; drop the batches that
        are packed and settled."""
        new = self.batches[self.settled :]
        if new:
            table = np.frombuffer(b"".join(new), np.int64).reshape(len(new), len(self.ids))
            # Episode-major bytes, each episode's slice appended to its array.
            raw = memoryview(table.T.tobytes())
            width = 8 * len(new)
            at = 0
            for episode in self.episodes:
                episode.own.frombytes(raw[at : at + width])
                at += width
            self.settled = len(self.batches)
        done = min(self.packed, self.settled)
        if done:
            del self.batches[:done]
            self.packed -= done
            self.settled -= done


class Packed:
    """Staged bookkeeping as int64 columns, from the per-step lists or whole batches."""

    def __init__(self) -> None:
        # New rows: the row, its episode, step, end kind and allocation.
        self.rows, self.episodes, self.steps = array("q"), array("q"), array("q")
        self.ends, self.allocations = array("q"), array("q")
        self.sources, self.targets = array("q"), array("q")  # links: row -> next row

    def add_rows(
        self, rows: Ints, episodes: Ints, steps: Ints, allocation: int, ends: Ints | None = None
    ) -> None:
        """New rows, allocated in order from ``allocation`` (int64 arrays or contiguous numpy
        arrays): of episodes in progress, or with ``ends`` the final rows of episodes ending
        with those end kinds."""
        count = len(rows)
        self.rows.frombytes(_bytes(rows))
        self.episodes.frombytes(_bytes(episodes))
        self.steps.frombytes(_bytes(steps))
        if ends is None:
            self.ends.frombytes(bytes(8 * count))  # END_NONE
        else:
            self.ends.frombytes(_bytes(ends))
        numbers = np.arange(allocation, allocation + count, dtype=np.int64)
        self.allocations.frombytes(_bytes(numbers))

    def add_flat_rows(self, flat: list[int]) -> None:
        """New rows from the per-step list: 5 ints per row, in :class:`Packed` column order."""
        for column, at in zip(self._meta_columns(), range(5), strict=True):
            column.fromlist(flat[at::5])

    def add_flat_links(self, flat: list[int]) -> None:
        """Links from the per-step list: row, next row."""
        self.sources.fromlist(flat[0::2])
        self.targets.fromlist(flat[1::2])

    def _meta_columns(self) -> tuple[array, ...]:
        return self.rows, self.episodes, self.steps, self.ends, self.allocations

    def meta(self) -> tuple[np.ndarray, ...]:
        """Views of the row columns (the arrays must not grow while they are in use)."""
        return tuple(np.frombuffer(column, np.int64) for column in self._meta_columns())

    def links(self) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(self.sources, np.int64), np.frombuffer(self.targets, np.int64)


def _bytes(values: Ints) -> memoryview:
    """The bytes of an int64 array or contiguous numpy array, as ``array.frombytes`` takes
    them (a view, no copy)."""
    # numpy's stubs declare an ndarray's buffer protocol for Python 3.12+ only.
    return memoryview(values).cast("B")  # type: ignore[arg-type]
