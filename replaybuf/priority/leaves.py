"""The float64 weights both pure-torch structures keep, and writes to them that repeat items.

An update may name one item several times; the last value wins, as it would written one by
one. ``index_copy_`` with repeated indices writes them in no set order, so duplicates are
first given their last value (:func:`last_write_wins`), which makes every write to one slot
carry the same bits.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from replaybuf.priority.base import BACKEND_TORCH, PriorityIndex
from replaybuf.priority.draws import block_width


def last_write_wins(items: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort ``items`` and give every copy of a duplicate the value of its last occurrence.

    Writing the result with ``index_copy_`` is then deterministic although indices repeat: all
    writes to one slot carry the same bits. No boolean masks, so no host sync on CUDA (and no
    ``searchsorted``, whose CPU kernel goes multi-threaded, and stalls, for a few items).
    """
    items, values = items.flip(0), values.flip(0)  # the last occurrence comes first
    order = torch.argsort(items, stable=True)  # [k] equal items keep that order
    ordered = items.index_select(0, order)  # [k] sorted
    starts = torch.ones_like(ordered, dtype=torch.bool)  # [k] first of a run of equal items
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(ordered.numel(), device=ordered.device)
    first = torch.where(starts, position, 0).cummax(0).values  # [k] start of each one's run
    return ordered, values.index_select(0, order.index_select(0, first))


def last_write_wins_host(items: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`last_write_wins` in numpy, deduplicated: each distinct item once, sorted, with the
    value of its last occurrence."""
    unique, last = np.unique(items[::-1], return_index=True)  # first in reverse = last
    return unique, values[::-1][last]


class LeafIndex(PriorityIndex):
    """What both pure-torch structures share: the float64 weights, ``[nb, F]`` on ``device``."""

    backend = BACKEND_TORCH
    kernels = "torch"

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        self._width = block_width(capacity)  # F
        blocks = -(-capacity // self._width)  # nb
        self._leaves = torch.zeros(blocks, self._width, dtype=torch.float64, device=device)

    def _store(self, items: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Write the weights (duplicates: the last one wins); the written items, sorted."""
        if self.device.type == "cpu":  # numpy's unique costs less than the torch version
            unique, values = last_write_wins_host(items.numpy(), weights.numpy())
            items, weights = torch.from_numpy(unique), torch.from_numpy(values)
        else:
            items, weights = last_write_wins(items, weights)  # [k], [k]
        self._leaves.view(-1).index_copy_(0, items, weights.double())
        return items

    def _read(self, items: torch.Tensor) -> torch.Tensor:
        return self._leaves.view(-1).index_select(0, items).float()

    def _rebuild(self, weights: torch.Tensor) -> None:
        self._leaves.zero_()
        self._leaves.view(-1)[: self.capacity] = weights.double()
        self._summarize()

    @abc.abstractmethod
    def _summarize(self) -> None:
        """Recompute everything derived from the weights."""
