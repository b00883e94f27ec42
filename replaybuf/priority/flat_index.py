"""The pure-torch priority index on CUDA: flat integer cumulative sums, no blocks.

Each ``set`` rebuilds one flat cumulative sum over all items instead of the blocks (a few
kernels, cheap on a GPU), and a draw is one ``randint`` and one ``searchsorted`` in it: on a
GPU the cost of a draw is its kernel launches, not its arithmetic. The total, minimum and
maximum are reduced from the weights themselves, and come to the host in one copy with the top
of the sums.

The flat sums are integers: item i gets ceil(w_i · 2**62 / total) units (>= 1 when w_i > 0, 0
when absent). Integer addition is exact in any order, so a parallel scan gives an absent item
exactly its predecessor's sum and the first sum >= u (u in [1, last sum]) always belongs to a
present item; float sums from a parallel scan can differ in the last bit there. Rounding up
moves an item's share by at most 1 unit in 2**62 of the total, relatively ~2**-40 for an
average item of 1M.
"""

from __future__ import annotations

import math
import struct

import torch

from replaybuf.priority.leaves import LeafIndex

_UNITS = 2.0**62  # integer units the flat sums divide the total into


class FlatPriorityIndex(LeafIndex):
    """The pure-torch backend on FLAT_DEVICES (CUDA): flat int64 cumulative units of the
    weights, no blocks (see the module docstring); a draw is a ``randint`` and a
    ``searchsorted``, a write some ten kernels fewer than keeping blocks as well."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        self._cumulative = torch.zeros(self._leaves.numel(), dtype=torch.long, device=device)
        self._total = torch.zeros((), dtype=torch.float64, device=device)
        self._top = 0  # the last cumulative unit, on the host

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        self._store(items, weights)
        self._summarize()

    def _summarize(self) -> None:
        """Rebuild the total and the flat cumulative integer units (no host sync)."""
        leaves = self._leaves.view(-1)
        self._total = leaves.sum()
        units = (leaves * (_UNITS / self._total)).ceil_()  # NaN only where every w is 0
        units = torch.where(leaves > 0, units, 0.0).long()
        torch.cumsum(units, 0, out=self._cumulative)

    def _flat_masses(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` int64 masses uniform on [1, last cumulative unit] (one kernel: the
        top is read on the host when the weights change, not per draw)."""
        return torch.randint(
            1, self._top + 1, (batch_size,), generator=generator, device=self.device
        )

    def _read_stats(self) -> tuple[float, float, float]:
        leaves = self._leaves.view(-1)
        smallest = torch.where(leaves > 0, leaves, math.inf).min()
        stats = torch.stack([self._total, smallest, leaves.max()])  # float64 [3]
        # One copy to the host for the float stats and the int64 top: the floats travel as
        # their bit patterns (int64 views) and are unpacked here.
        raw = torch.cat([stats.view(torch.long), self._cumulative[-1:]]).tolist()
        total, smallest_, largest = struct.unpack("3d", struct.pack("3q", *raw[:3]))
        self._top = raw[3]
        return total, smallest_, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The first sum >= u belongs to a present item.
        items = torch.searchsorted(self._cumulative, self._flat_masses(batch_size, generator))
        return items, self._leaves.view(-1).index_select(0, items)
