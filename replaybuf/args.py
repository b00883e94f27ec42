"""Argument checks at the public boundary: one message shape, ``name must be ..., got ...``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replaybuf.errors import ArgumentError, ArgumentTypeError, IndexOutOfRangeError

_CPU = torch.device("cpu")
NArg = int | tuple[int, int]  # an n-step n, or a (low, high) range drawn per sample
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a torch.long (and every size) holds
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes [0, 2**64)


def host_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.as_tensor(value, dtype)`` that ignores ``torch.set_default_device``: a tensor
    keeps its device, anything else (lists, arrays, numbers) is built on the CPU. Callers then
    move it where it belongs (``as_tensor`` would follow the default device, moving even a
    tensor there, and a buffer's inputs must not depend on it)."""
    if isinstance(value, torch.Tensor):
        return value if dtype is None else value.to(dtype)
    return torch.as_tensor(value, dtype=dtype, device=_CPU)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int in [1, 2**63), else :class:`ArgumentTypeError` /
    :class:`ArgumentError` naming ``name``."""
    if type(value) is int and 0 < value <= INT64_MAX:  # the common case, checked in one go
        return value
    return int_at_least(value, name, 1)


def int_at_least(value: Any, name: str, low: int, high: int = INT64_MAX) -> int:
    """``value`` as an int in ``[low, high]`` (``high``: int64's largest, by default, so that
    no size or count overflows torch's), else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}", argument=name
        )
    if value < low:
        raise ArgumentError(f"{name} must be >= {low}, got {value}", argument=name)
    if value > high:
        bound = "2**63 - 1 (int64)" if high == INT64_MAX else f"{high}"
        raise ArgumentError(f"{name} must be <= {bound}, got {value}", argument=name)
    return int(value)


def check_min_steps(min_steps: Any, max_steps: int) -> int:
    """``min_steps`` in [0, ``max_steps``]: a buffer holds at most ``max_steps`` valid steps,
    so a larger minimum would refuse every sample forever."""
    min_steps = int_at_least(min_steps, "min_steps", 0)
    if min_steps > max_steps:
        raise ArgumentError(
            f"min_steps must be <= max_steps ({max_steps}): the buffer never holds more valid "
            f"steps than max_steps, got min_steps={min_steps}",
            argument="min_steps",
        )
    return min_steps


def check_seed(seed: Any, name: str = "seed") -> int | None:
    """A generator seed: None, or an int in [0, 2**64) (what ``manual_seed`` accepts)."""
    return None if seed is None else int_at_least(seed, name, 0, SEED_MAX)


def seed_or_draw(seed: int | None) -> int:
    """``seed`` (already checked), or for ``None`` one drawn from torch's global CPU generator.

    As TorchRL's samplers and SB3 (which seeds torch) behave: ``torch.manual_seed(s)`` before
    a buffer is built makes its batches repeat exactly. The draw takes one int64 from that
    generator; an explicit seed takes nothing from it. Always the CPU generator, whatever
    ``torch.set_default_device`` says, so a CUDA buffer's seed follows ``torch.manual_seed`` too.
    """
    if seed is not None:
        return seed
    return int(torch.randint(0, INT64_MAX, (), dtype=torch.int64, device=_CPU))


def check_int64(value: int, name: str, error: type[Exception] = ArgumentError) -> int:
    """A Python int that torch stores as int64, else ``error`` naming ``name`` (a field)."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise error(  # type: ignore[call-arg]
            f"{name} holds {value}, beyond int64 [-2**63, 2**63 - 1]", argument=name
        )
    return value


def index_tensor(indices: Any, name: str, size: int, device: torch.device) -> torch.Tensor:
    """A list, range, array or tensor of indices in ``[0, size)`` as a long tensor on ``device``.

    Raises ``TypeError`` for non-integer input and ``IndexError`` for an index out of range.
    """
    if isinstance(indices, (range, Sequence)) and not isinstance(indices, (str, bytes)):
        indices = list(indices)
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in indices):
            raise ArgumentTypeError(f"{name} must hold ints, got {indices!r}", argument=name)
        try:
            tensor = torch.tensor(indices, dtype=torch.long, device=_CPU)
        except (OverflowError, RuntimeError, ValueError):  # an int beyond int64
            bad = next(i for i in indices if not INT64_MIN <= i <= INT64_MAX)
            raise IndexOutOfRangeError(
                f"{name} must lie in [0, {size}) (the stored items), got {bad}", argument=name
            ) from None
    elif isinstance(indices, np.ndarray):
        if indices.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"{name} must hold integers, got dtype {indices.dtype}", argument=name
            )
        tensor = torch.from_numpy(np.ascontiguousarray(indices))  # reversed views have -strides
    elif isinstance(indices, torch.Tensor):
        tensor = indices
    else:
        raise ArgumentTypeError(
            f"{name} must be a list, range, array or tensor of ints, got {indices!r}",
            argument=name,
        )
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ArgumentTypeError(
            f"{name} must hold integers, got dtype {tensor.dtype}", argument=name
        )
    tensor = tensor.reshape(-1).to(torch.long)
    if tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise IndexOutOfRangeError(
                f"{name} must lie in [0, {size}) (the stored items), got {bad}", argument=name
            )
    return tensor.to(device)


def check_n(n: Any, longest: int) -> NArg:
    """An n-step ``n``: an int >= 1, or a ``(low, high)`` pair with 1 <= low <= high.

    ``longest`` is the longest window the buffer can ever hold (its ``max_steps``: a window
    never crosses an episode's end, and no episode is longer). An int above it is clamped to
    it: the windows are the same, and the cost no longer grows with n. A pair is kept as
    given (clamping it would change the distribution n is drawn from); the n-step path
    clamps each drawn n instead, and sizes its windows by ``min(high, longest)``."""
    if type(n) is int and 0 < n <= INT64_MAX:  # the common case, checked in one go
        return min(n, longest)
    if isinstance(n, tuple | list):
        if len(n) != 2:
            raise ArgumentError(f"n must be an int or a (low, high) pair, got {n!r}", argument="n")
        low = positive_int(n[0], "n[0] (low)")
        high = positive_int(n[1], "n[1] (high)")
        if high < low:
            raise ArgumentError(f"n must have low <= high, got {tuple(n)!r}", argument="n")
        return (low, high)
    return min(positive_int(n, "n"), longest)


def check_gamma(gamma: Any) -> float:
    """A discount in (0, 1], as a float."""
    if type(gamma) is float and 0.0 < gamma <= 1.0:  # the common case (NaN fails it)
        return gamma
    if isinstance(gamma, bool) or not isinstance(gamma, int | float | np.integer | np.floating):
        raise ArgumentTypeError(f"gamma must be a float in (0, 1], got {gamma!r}", argument="gamma")
    if not 0.0 < float(gamma) <= 1.0:
        raise ArgumentError(f"gamma must lie in (0, 1], got {gamma}", argument="gamma")
    return float(gamma)
