"""The priority index on TorchRL's compiled segment trees (CPU only).

Used where ``torchrl._torchrl`` loads; that extension only loads with the torch it was built
for, which is why its classes are looked up lazily and a failure is reported, not raised. Its
``scan_lower_bound`` descends the tree; round-off at the top of the range can end on an absent
item, which is then moved to the nearest present one (only in such round-off events).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, cast

import torch

from replaybuf.priority.base import BACKEND_SEGMENT_TREE, FLOAT32_MAX, PriorityIndex
from replaybuf.priority.draws import nearest_positive, sample_masses

_CPU = torch.device("cpu")


@functools.cache
def _segment_trees() -> tuple[Any, Any] | str:
    """TorchRL's (SumSegmentTreeFp64, MinSegmentTreeFp32) classes, or why they do not load."""
    try:
        extension = importlib.import_module("torchrl._torchrl")
        return extension.SumSegmentTreeFp64, extension.MinSegmentTreeFp32
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        return (
            f"torchrl._torchrl does not load with torch {torch.__version__} "
            f"({type(exc).__name__}: {exc}); it only loads with the torch TorchRL was built for"
        )


def segment_tree_unavailable_reason() -> str | None:
    """Why TorchRL's compiled segment trees cannot be used here, or None when they load."""
    trees = _segment_trees()
    return trees if isinstance(trees, str) else None


def leaf_extremes(weights: torch.Tensor) -> torch.Tensor:
    """(weight if > 0 else +inf, -weight) along a new last dim, for float32 ``weights``."""
    positive = torch.where(weights > 0, weights, math.inf)
    return torch.stack([positive, 0.0 - weights], -1)  # [..., 2]


class SegmentTreePriorityIndex(PriorityIndex):
    """TorchRL's C++ trees (CPU): a float64 sum tree, float32 min trees for min and -max.

    The sum tree is TorchRL's ``SumSegmentTreeFp64`` rather than ``Fp32`` for the reason
    :mod:`replaybuf.priority.base` gives; its pairwise sums equal the torch backend's sequential
    ones to rounding, so the two backends draw alike but for masses within rounding of an
    item's edge.
    """

    backend = BACKEND_SEGMENT_TREE
    kernels = "torchrl"

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        # Classes, not the reason they do not load: checked by make_priority_index.
        sum_tree, min_tree = cast("tuple[Any, Any]", _segment_trees())
        self._sums, self._min, self._negated_max = (
            sum_tree(capacity),
            min_tree(capacity),
            min_tree(capacity),
        )
        self._rebuild(torch.zeros(capacity, device=_CPU))

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        # The C++ batch update applies entries in order: duplicates, the last value wins.
        items = items.contiguous()
        extremes = leaf_extremes(weights)  # [k, 2]
        self._sums.update(items, weights.double())
        self._min.update(items, extremes[:, 0].contiguous())
        self._negated_max.update(items, extremes[:, 1].contiguous())

    def _read(self, items: torch.Tensor) -> torch.Tensor:
        return self._leaf_sums(items).float()

    def _leaf_sums(self, items: torch.Tensor) -> torch.Tensor:
        # pybind11 resolves a 1-element tensor to the scalar ``at(int)``: reshape its float.
        sums = self._sums.at(items.contiguous())
        if isinstance(sums, torch.Tensor) and sums.shape == items.shape:
            return sums  # float64, like the tree
        return torch.as_tensor(sums, dtype=torch.float64, device=_CPU).reshape(items.shape)

    def _rebuild(self, weights: torch.Tensor) -> None:
        self._write(torch.arange(self.capacity, device=_CPU), weights)

    def _read_stats(self) -> tuple[float, float, float]:
        # The roots include TorchRL's padding leaves; the min tree pads with FLOAT32_MAX.
        total = self._sums.query(0, self.capacity)
        smallest = self._min.query(0, self.capacity)
        largest = 0.0 - self._negated_max.query(0, self.capacity)
        if smallest >= FLOAT32_MAX and largest < FLOAT32_MAX:
            smallest = math.inf  # only padding: no positive weight
        return total, smallest, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        masses = sample_masses(batch_size, self._stats[0], generator, self.device)  # [B]
        items = self._sums.scan_lower_bound(masses).clamp_max_(self.capacity - 1)  # [B]
        sums = self._leaf_sums(items)  # [B] float64; read once: guard and importance weights
        # A zero leaf only after round-off at the top of the range; min() is the cheapest test.
        if batch_size and sums.numpy().min() == 0:
            absent = sums == 0
            items = torch.where(absent, nearest_positive(items, self.weights()), items)
            sums = self._leaf_sums(items)
        return items, sums
