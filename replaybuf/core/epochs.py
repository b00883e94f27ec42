"""Epoch plans: which stored items each batch of an epoch visits. Pure index math over torch.

An epoch visits every item that was stored when it started exactly once: a permutation of the
items (or their stored order when ``shuffle=False``) cut into consecutive batches.
"""

from __future__ import annotations

import torch


def num_batches(items: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches in one epoch: rounded up, or down with ``drop_last`` (ObjectRL rounds up)."""
    if drop_last:
        return items // batch_size
    return -(-items // batch_size)


def epoch_order(
    items: torch.Tensor, shuffle: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """``items`` in the order one epoch visits them: permuted by ``generator``, or as given."""
    if not shuffle:
        return items
    perm = torch.randperm(items.shape[0], generator=generator, device=items.device)
    return items[perm]


def epoch_batches(order: torch.Tensor, batch_size: int, drop_last: bool) -> list[torch.Tensor]:
    """``order`` cut into batches of ``batch_size``; the short tail is kept unless ``drop_last``."""
    count = num_batches(order.shape[0], batch_size, drop_last)
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(count)]
