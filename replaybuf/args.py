"""Argument checks at the public boundary: one message shape, ``name must be ..., got ...``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_CPU = torch.device("cpu")
NArg = int | tuple[int, int]  # an n-step n, or a (low, high) range drawn per sample


def host_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.as_tensor(value, dtype)`` that ignores ``torch.set_default_device``: a tensor
    keeps its device, anything else (lists, arrays, numbers) is built on the CPU. Callers then
    move it where it belongs (``as_tensor`` would follow the default device, moving even a
    tensor there, and a buffer's inputs must not depend on it)."""
    if isinstance(value, torch.Tensor):
        return value if dtype is None else value.to(dtype)
    return torch.as_tensor(value, dtype=dtype, device=_CPU)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1, else ``TypeError`` / ``ValueError`` naming ``name``."""
    return int_at_least(value, name, 1)


def int_at_least(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def index_tensor(indices: Any, name: str, size: int, device: torch.device) -> torch.Tensor:
    """A list, range, array or tensor of indices in ``[0, size)`` as a long tensor on ``device``.

    Raises ``TypeError`` for non-integer input and ``IndexError`` for an index out of range.
    """
    if isinstance(indices, (range, Sequence)) and not isinstance(indices, (str, bytes)):
        indices = list(indices)
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in indices):
            raise TypeError(f"{name} must hold ints, got {indices!r}")
        tensor = torch.tensor(indices, dtype=torch.long, device=_CPU)
    elif isinstance(indices, np.ndarray):
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {indices.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(indices))  # reversed views have -strides
    elif isinstance(indices, torch.Tensor):
        tensor = indices
    else:
        raise TypeError(f"{name} must be a list, range, array or tensor of ints, got {indices!r}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
    tensor = tensor.reshape(-1).to(torch.long)
    if tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise IndexError(f"{name} must lie in [0, {size}) (the stored items), got {bad}")
    return tensor.to(device)


def check_n(n: Any) -> NArg:
    """An n-step ``n``: an int >= 1, or a ``(low, high)`` pair with 1 <= low <= high."""
    if isinstance(n, tuple | list):
        if len(n) != 2:
            raise ValueError(f"n must be an int or a (low, high) pair, got {n!r}")
        low = positive_int(n[0], "n[0] (low)")
        high = positive_int(n[1], "n[1] (high)")
        if high < low:
            raise ValueError(f"n must have low <= high, got {tuple(n)!r}")
        return (low, high)
    return positive_int(n, "n")


def check_gamma(gamma: Any) -> float:
    """A discount in (0, 1], as a float."""
    if isinstance(gamma, bool) or not isinstance(gamma, int | float | np.integer | np.floating):
        raise TypeError(f"gamma must be a float in (0, 1], got {gamma!r}")
    if not 0.0 < float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in (0, 1], got {gamma}")
    return float(gamma)
