"""The pure-torch priority index on the CPU (and other devices but CUDA): blocked weights.

Items sit in blocks of F (:func:`replaybuf.priority.draws.block_width`)::

    leaves  [nb, F] float64   w_0 .. w_{F-1} | w_F .. w_{2F-1} | ... (padding 0)
    blocks  [nb]    float64   the sum of each block (on the CPU: its last running sum)
    starts  [nb+1]  float64   0, blocks[0], blocks[0]+blocks[1], ...  (cumulative)

A draw is a fixed number of kernels whatever the capacity, where a binary tree's descent
takes several per level: ``searchsorted`` finds the block, then a scan of one row the item
(:func:`replaybuf.priority.draws.locate`). F grows with sqrt(capacity) to keep both the row
scan and the O(nb) rebuild of ``starts`` after each ``set`` small. On the CPU the index also
keeps every block's running sums (``[nb, F]``, 8 bytes more per item, rebuilt for the blocks a
``set`` touches), so a draw gathers them instead of summing the rows it gathers
(:func:`replaybuf.priority.draws.locate_host`). Where numba is installed,
:mod:`replaybuf.accel.numba_kernels` runs the CPU draws and small writes compiled, with the
same results bit for bit (``kernels`` says which runs: "numba" or "numpy").
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np
import torch

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.priority.base import FLOAT32_MAX
from replaybuf.priority.draws import locate, locate_host, sample_masses
from replaybuf.priority.leaves import LeafIndex


def block_extremes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 weights ``[k, F]``: the smallest positive weight (+inf if none) and
    the largest weight, ``[k]`` each."""
    return torch.where(rows > 0, rows, math.inf).amin(1), rows.amax(1)


class TorchPriorityIndex(LeafIndex):
    """The pure-torch backend: blocked weights on ``device`` (see the module docstring)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        blocks = self._leaves.shape[0]  # nb
        self._blocks = torch.zeros(blocks, dtype=torch.float64, device=device)  # [nb] sums
        self._starts = torch.zeros(blocks + 1, dtype=torch.float64, device=device)  # [nb+1]
        # [nb] float32 each: the smallest positive weight (+inf if none) and the largest weight
        # of every block; separate contiguous columns, so that their reductions stay fast.
        self._lowest, self._highest = block_extremes(torch.zeros(blocks, 1, device=device))
        # [nb, F] float64: each block's running sums, for the CPU draw (locate_host); other
        # devices take them per draw (locate). On the CPU a block's sum is its last running
        # sum (sequential), so the kernels' sums equal these bit for bit.
        self._running: torch.Tensor | None = None
        # On the CPU: numpy views of (leaves, running, blocks, lowest, highest, starts), which
        # every write and draw use (these tensors are only ever written in place), and the
        # compiled kernels where they load.
        self._host: tuple[np.ndarray, ...] | None = None
        self.compiled: ModuleType | None = None
        if device.type == "cpu":
            self._running = torch.zeros_like(self._leaves)
            self._attach_host(compiled_kernels())

    def _attach_host(self, compiled: ModuleType | None) -> None:
        """The CPU's numpy views and kernels (rebuilt after unpickling: views do not survive a
        copy, and a module cannot be pickled)."""
        assert self._running is not None  # made on the CPU, the only device with host views
        tensors = (self._leaves, self._running, self._blocks, self._lowest, self._highest)
        self._host = tuple(t.numpy() for t in (*tensors, self._starts))
        self.compiled = compiled
        self.kernels = "numpy" if compiled is None else "numba"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_host=None, compiled=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._running is not None:  # the CPU: the same kernels as the original
            self._attach_host(compiled_kernels() if self.kernels == "numba" else None)

    @property
    def host_writes(self) -> bool:
        return self._host is not None and self.compiled is not None

    def set_in_range_host(self, items: np.ndarray, weights: np.ndarray) -> bool:
        # set_in_range's checks and _write's compiled branch, in numpy: their dozen torch
        # calls would cost more than the compiled write itself.
        host, compiled = self._host, self.compiled
        if host is None or compiled is None or items.shape[0] * 4 >= self._blocks.numel():
            return False
        with np.errstate(over="ignore"):  # an overflow to inf fails the check below, quietly
            weights32 = weights.astype(np.float32)  # torch's .to(float32) rounding
        if not (weights32.min() >= 0 and weights32.max() <= FLOAT32_MAX):  # NaN fails both
            return False
        stored = np.where(weights32 > 0, weights32, np.float32(0)).astype(np.float64)  # -0.0
        compiled.write(np.ascontiguousarray(items, dtype=np.int64), stored, *host)
        self._stats = self._read_stats()
        return True

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        few = items.numel() * 4 < self._blocks.numel()  # else many blocks: redo them all
        if few and self.compiled is not None and self._host is not None:
            weights64 = np.ascontiguousarray(weights.numpy(), dtype=np.float64)
            items64 = np.ascontiguousarray(items.numpy(), dtype=np.int64)
            self.compiled.write(items64, weights64, *self._host)
            return
        items = self._store(items, weights)
        if not few:
            self._summarize()
            return
        # Duplicate blocks recompute the same values: harmless with index_copy_.
        blocks = items.div(self._width, rounding_mode="floor")  # [k]
        rows = self._leaves.index_select(0, blocks)  # [k, F]
        if self._running is not None:
            running = rows.cumsum(1)
            self._running.index_copy_(0, blocks, running)
            self._blocks.index_copy_(0, blocks, running[:, -1])
        else:
            self._blocks.index_copy_(0, blocks, rows.sum(1))
        lowest, highest = block_extremes(rows.float())
        self._lowest.index_copy_(0, blocks, lowest)
        self._highest.index_copy_(0, blocks, highest)
        torch.cumsum(self._blocks, 0, out=self._starts[1:])

    def _summarize(self) -> None:
        """Recompute every block's sum and extremes, and the cumulative starts."""
        if self._running is not None:
            torch.cumsum(self._leaves, 1, out=self._running)
            self._blocks.copy_(self._running[:, -1])
        else:
            torch.sum(self._leaves, 1, out=self._blocks)
        lowest, highest = block_extremes(self._leaves.float())
        self._lowest.copy_(lowest)  # in place: the host views stay valid
        self._highest.copy_(highest)
        torch.cumsum(self._blocks, 0, out=self._starts[1:])

    def _read_stats(self) -> tuple[float, float, float]:
        if self._host is not None:  # numpy: its calls cost less than torch's
            lowest, highest, starts = self._host[3:]
            return float(starts[-1]), float(lowest.min()), float(highest.max())
        smallest, largest = self._lowest.min().double(), self._highest.max().double()
        total, smallest, largest = torch.stack([self._starts[-1], smallest, largest]).tolist()
        return total, smallest, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is not None:  # the CPU: numpy views of the same tensors
            leaves, running, starts = self._host[0], self._host[1], self._host[5]
            host_masses = sample_masses(batch_size, starts[-1], generator, self.device).numpy()
            if self.compiled is None:
                items, weights = locate_host(starts, running, leaves, host_masses)
            else:
                items, weights = np.empty(batch_size, np.int64), np.empty(batch_size)
                self.compiled.locate(starts, running, leaves, host_masses, items, weights)
            return torch.from_numpy(items), torch.from_numpy(weights)
        masses = sample_masses(batch_size, self._starts[-1], generator, self.device)  # [B]
        return locate(self._starts, self._leaves, masses)

    def sample_relative(
        self, batch_size: int, generator: torch.Generator, power: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is None or self._host is None:
            return super().sample_relative(batch_size, generator, power)
        # One kernel from U to the relative weights: on the CPU each numpy call between these
        # steps costs microseconds, more so after a batch's gathers have evicted the caches.
        self._check_draw(batch_size, generator)
        leaves, running, starts = self._host[0], self._host[1], self._host[5]
        uniform = torch.rand(
            batch_size, generator=generator, dtype=torch.float64, device=self.device
        )
        items, relative = np.empty(batch_size, np.int64), np.empty(batch_size, np.float32)
        self.compiled.draw_relative(
            uniform.numpy(), starts, running, leaves, self._stats[1], power, items, relative
        )
        return torch.from_numpy(items), torch.from_numpy(relative)
