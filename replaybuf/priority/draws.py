"""The arithmetic of a proportional draw: masses, the items that own them, relative powers.

Item i owns the masses (c_{i-1}, c_i], c_i = w_0+..+w_i, and a draw takes
u = (1 - U[0, 1)) · total in (0, total] (u > 0 never lands on a leading absent item). In the
torch backend's blocks (:mod:`replaybuf.priority.torch_index`), :func:`locate` finds the block
b with starts[b] < u <= starts[b+1]; inside it, u' = u - starts[b] > 0 (a difference of
distinct floats is never 0) is clamped to the row's own cumulative sum, and the item is the
first j whose running sum reaches u', so w_j > 0. :func:`locate_host` does the same in numpy on
the CPU, with the same results.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def sample_masses(
    batch_size: int, total: torch.Tensor | float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``batch_size`` float64 masses u = (1 - U[0, 1)) · total, uniform on (0, total]."""
    uniform = torch.rand(batch_size, generator=generator, device=device, dtype=torch.float64)
    if uniform.device.type == "cpu" and not isinstance(total, torch.Tensor):
        # The same IEEE operations in numpy, in place: a numpy call costs less than torch's.
        view = uniform.numpy()
        np.subtract(1.0, view, out=view)
        view *= total
        return uniform
    return uniform.neg_().add_(1.0).mul_(total)  # [B] (1 - U) · total; 1 - U is exact on 2**-53


def block_width(capacity: int) -> int:
    """F, the items per block of the torch backend: a power of two near sqrt(capacity) / 32,
    at least 32 (32 at 1M items, 128 at 10M)."""
    return max(32, 1 << (max(math.isqrt(capacity) // 32, 1) - 1).bit_length())


def locate(
    starts: torch.Tensor, leaves: torch.Tensor, masses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The items owning ``masses`` ([B] in (0, total]) and their float64 weights ([B] each).

    ``starts`` ([nb+1]) are the cumulative block sums from 0, ``leaves`` ([nb, F]) the weights.
    """
    nb, width = leaves.shape
    block = torch.searchsorted(starts[1:], masses).clamp_max_(nb - 1)  # [B] starts[b] < u
    inside = masses - starts.index_select(0, block)  # [B] > 0
    rows = leaves.index_select(0, block)  # [B, F]
    running = rows.cumsum(1)  # [B, F]
    inside = torch.minimum(inside, running[:, -1])  # round-off: u' <= the row's own total
    column = (running < inside.unsqueeze(1)).sum(1).unsqueeze_(1)  # [B, 1] first c_j >= u'
    weights = rows.gather(1, column).squeeze_(1)  # [B]
    return torch.add(column.squeeze_(1), block, alpha=width), weights


def locate_host(
    starts: np.ndarray, running: np.ndarray, leaves: np.ndarray, masses: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`locate` in numpy, for an index on the CPU, with the same IEEE operations and
    results; ``running`` ([nb, F]) holds each block's running sums, kept by the index (the same
    sequential sums :func:`locate` takes of the rows it gathers).

    The masses are searched in ascending order (numpy's ``searchsorted`` then starts each
    search where the last one ended, and the row gathers walk memory forwards), and the items
    go back to the draw order, so a batch is not sorted by slot. numpy, not torch: for a few
    hundred draws a numpy call costs less than torch's.
    """
    nb, width = running.shape
    order = np.argsort(masses)  # [B]
    ordered = masses[order]
    block = np.searchsorted(starts[1:], ordered)  # [B] first starts[b + 1] >= u
    np.minimum(block, nb - 1, out=block)
    inside = ordered - starts[block]  # [B] > 0
    rows = running[block]  # [B, F]
    np.minimum(inside, rows[:, -1], out=inside)  # round-off: u' <= the row's own total
    found = np.argmax(rows >= inside[:, None], axis=1)  # [B] first c_j >= u' (sums never fall)
    found += block * width
    items = np.empty_like(found)
    items[order] = found
    return items, leaves.reshape(-1)[items]


def relative_power(weights: torch.Tensor, smallest: float, power: float) -> torch.Tensor:
    """float32 (weights / smallest) ** power, for float ``weights`` of any shape that hold the
    index's weights exactly."""
    if weights.device.type == "cpu":  # numpy: its calls cost less than torch's here
        host_ratio = weights.numpy().astype(np.float64) / smallest  # a new array: safe in place
        return torch.from_numpy(np.power(host_ratio, power, out=host_ratio).astype(np.float32))
    ratio = weights.to(torch.float64) / smallest  # a new tensor: safe to work in place
    return ratio.pow_(power).to(torch.float32)


def nearest_positive(items: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each item moved to the nearest item of positive weight at or before it (else after it)."""
    positive = torch.nonzero(weights > 0).flatten()  # [m] sorted, m >= 1 when total > 0
    below = torch.searchsorted(positive, items, right=True) - 1  # [B] -1 when none before
    return positive.index_select(0, below.clamp_min(0))
