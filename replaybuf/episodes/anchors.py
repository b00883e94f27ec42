"""A dense set of anchor rows supporting O(1) uniform draws.

Uniform sampling over valid steps must not scan episodes (ARES does, per sample), and a boolean
mask would need a scan per draw. So the valid rows are kept packed in ``rows[:count]`` with
``pos[row]`` giving each row's place (-1 when absent): a draw is ``rows[randint(count)]``, an add
appends, and a removal fills each hole with a survivor from the tail. ``count`` lives on the host
so no update or draw needs a device synchronisation.

Adds and removes run on numpy columns on the host (a torch fancy index costs several times a
numpy one on the CPU and a launch plus a copy on CUDA, and each flush makes several). Draws read
those columns on the CPU, and elsewhere a device copy updated when read
(:mod:`replaybuf.storage.mirror`).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from replaybuf.storage import DeviceMirror

Rows = torch.Tensor | np.ndarray  # int64 rows on the host
_CPU = torch.device("cpu")


class AnchorSet:
    """The set of rows that may start a sample, packed for uniform draws."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        mirror: bool | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        # On the host whatever torch's default device (the draws' device copy is the mirror's).
        self._rows = torch.full((capacity,), -1, dtype=torch.long, device=_CPU)
        self._pos = torch.full((capacity,), -1, dtype=torch.long, device=_CPU)
        self._host = (self._rows.numpy(), self._pos.numpy())  # every update goes through these
        self.count = 0
        # The device copy draws read off the CPU (``mirror``: tests mirror on the CPU too).
        self._mirror: DeviceMirror | None = None
        if mirror or (mirror is None and device.type != "cpu"):
            self._mirror = DeviceMirror(self._host, device)
        # replaybuf.accel.numba_kernels.remove_anchors for removals (None: numpy); not with a
        # device copy, which needs the places and rows each removal changed, as the numpy path
        # has them.
        self._kernels = kernels if self._mirror is None else None

    def __len__(self) -> int:
        return self.count

    @property
    def rows(self) -> torch.Tensor:
        """The packed rows (``[:count]`` hold the set) where draws read them, up to date."""
        return self._read(0)

    @property
    def pos(self) -> torch.Tensor:
        """Each row's place in :attr:`rows` (-1: absent), beside :attr:`rows`."""
        return self._read(1)

    def _read(self, column: int) -> torch.Tensor:
        if self._mirror is None:
            return (self._rows, self._pos)[column]
        self._mirror.publish()
        return self._mirror.table[column]

    @property
    def nbytes(self) -> int:
        host = self._rows.nbytes + self._pos.nbytes
        return host + (0 if self._mirror is None else self._mirror.nbytes)

    def contains(self, rows: torch.Tensor) -> torch.Tensor:
        """Bool per row (on the rows' device, which is where the set is read): is it in the set."""
        return self.pos[rows] >= 0

    def add(self, new_rows: Rows) -> None:
        """Add rows that are not in the set yet."""
        k = new_rows.shape[0]
        if k == 0:
            return
        begin, end = self.count, self.count + k
        rows, pos = self._host
        new = _host(new_rows)
        rows[begin:end] = new
        pos[new] = np.arange(begin, end)
        self.count = end
        if self._mirror is not None:
            self._mirror.touched(np.arange(begin, end))
            self._mirror.touched(new)

    def remove(self, old_rows: Rows) -> None:
        """Remove rows that are in the set (each once)."""
        old = _host(old_rows)
        self._remove(old, self._host[1][old])

    def _remove(self, old: np.ndarray, holes: np.ndarray) -> None:
        """Remove rows ``old`` (in the set, each once) whose places are ``holes``."""
        k = old.shape[0]
        if k == 0:
            return
        new_count = self.count - k
        # Free the rows' places; holes inside the kept prefix are refilled by the tail rows
        # that stay (as many as holes).
        rows, pos = self._host
        pos[old] = -1
        holes = holes[holes < new_count]
        tail = rows[new_count : self.count]
        movers = tail[pos[tail] >= 0]
        rows[holes] = movers
        pos[movers] = holes
        rows[new_count : self.count] = -1
        if self._mirror is not None:  # places holes and the tail, rows old and movers
            for changed in (holes, np.arange(new_count, self.count), old, movers):
                self._mirror.touched(changed)
        self.count = new_count

    def remove_present(self, rows: Rows) -> None:
        """Remove those of ``rows`` that are in the set (each row once)."""
        rows = _host(rows)
        if self._kernels is not None:  # contiguous int64 rows (no copy when they are)
            old = np.ascontiguousarray(rows, dtype=np.int64)
            self.count = self._kernels.remove_anchors(old, *self._host, self.count)
            return
        at = self._host[1][rows]  # one gather of the places, for the test and the holes
        present = at >= 0
        self._remove(rows[present], at[present])

    def remove_present_groups(self, rows: np.ndarray, ends: np.ndarray) -> None:
        """:meth:`remove_present` for each group of ``rows`` in turn (group g ends at
        ``ends[g]``): the set ends as after one call per group, in one compiled call."""
        if self._kernels is not None:
            old = np.ascontiguousarray(rows, dtype=np.int64)
            bounds = np.ascontiguousarray(ends, dtype=np.int64)
            self.count = self._kernels.remove_anchor_groups(old, bounds, *self._host, self.count)
            return
        begin = 0
        for end in ends.tolist():
            self.remove_present(rows[begin:end])
            begin = end

    def compiled_columns(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The host columns ``(rows, pos)`` when removals run compiled (no device copy to
        tell of changes), for a kernel that removes rows as :meth:`remove_present_groups`
        does and sets :attr:`count`; else None."""
        return self._host if self._kernels is not None else None

    @property
    def on_host(self) -> bool:
        """Whether draws read the host columns (no device copy): :meth:`sample_host` works."""
        return self._mirror is None

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` rows uniformly with replacement."""
        if self._mirror is None:
            return torch.from_numpy(self.sample_host(batch_size, generator))
        places, rows = self.draw_places(batch_size, generator)
        return rows.index_select(0, places)

    def draw_places(
        self, shape: int | tuple[int, ...], generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample`'s draws (``shape`` of them, uniform with replacement) as places in
        :attr:`rows` (returned too), before the lookup: a fused kernel does it in its launch."""
        rows = self.rows
        size = (shape,) if isinstance(shape, int) else shape
        places = torch.randint(0, self.count, size, generator=generator, device=rows.device)
        return places, rows

    def sample_host(self, batch_size: int, generator: torch.Generator) -> np.ndarray:
        """:meth:`sample`'s rows as a contiguous int64 numpy array (the same draws).

        For a set whose draws read the host columns (:attr:`on_host`), where numpy's take is
        cheaper than torch's index.
        """
        # device: the host columns', not torch's default device (set_default_device("cuda")).
        picks = torch.randint(
            0, self.count, (batch_size,), generator=generator, device=self._rows.device
        )
        return self._host[0].take(picks.numpy())

    def sample_distinct(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Up to ``batch_size`` distinct rows, uniformly without replacement."""
        rows = self.rows
        perm = torch.randperm(self.count, generator=generator, device=rows.device)
        return rows[perm[:batch_size]]

    def snapshot(self) -> torch.Tensor:
        """A copy of the rows in the set now, where draws read them."""
        return self.rows[: self.count].clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rows in the set, in their packed order (which seeded draws follow)."""
        return {"rows": self.snapshot()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Hold exactly ``state``'s rows, in its order (distinct rows, checked by the caller)."""
        self.remove(self._rows[: self.count].clone())
        self.add(state["rows"].cpu())


def _host(rows: Rows) -> np.ndarray:
    """``rows`` as a numpy array (a view of a CPU tensor)."""
    return rows if isinstance(rows, np.ndarray) else rows.numpy()
