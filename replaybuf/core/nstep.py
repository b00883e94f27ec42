"""Pure n-step return math: discounted sums and bootstrap discounts (torch or numpy).

For a window of m rewards starting at step t::

    R = r_t + γ r_{t+1} + ... + γ^(m-1) r_{t+m-1}
    next_discount = γ^m   (0 when obs_{t+m} is the final observation of a terminated episode)

so that a target is ``R + next_discount * V(obs_{t+m})``. A truncated episode (time limit)
bootstraps from its final observation; only termination zeroes the discount.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

Array = TypeVar("Array", torch.Tensor, np.ndarray)
_CPU = torch.device("cpu")


def compute_discounted_return(
    rewards: Sequence[float] | torch.Tensor, gamma: float
) -> float | torch.Tensor:
    """``Σ_k γ^k r_k``: a float for a list, a tensor reduced over the last dim for a tensor.

    A floating tensor keeps its dtype; integer or bool rewards give the default float dtype.
    """
    if isinstance(rewards, torch.Tensor):
        steps = rewards.shape[-1]
        powers = gamma ** torch.arange(steps, dtype=torch.float64, device=rewards.device)
        return (rewards.to(torch.float64) * powers).sum(-1).to(return_dtype(rewards.dtype))
    total = 0.0
    for reward in reversed(list(rewards)):
        total = float(reward) + gamma * total
    return total


def return_dtype(reward_dtype: torch.dtype) -> torch.dtype:
    """A discounted sum keeps a floating reward dtype; integer or bool rewards give floats."""
    return reward_dtype if reward_dtype.is_floating_point else torch.get_default_dtype()


def discount_powers(gamma: float, n: int, device: torch.device) -> torch.Tensor:
    """``[γ^0, γ^1, ..., γ^n]`` (float64, computed once, stored float32) on ``device``, cached."""
    key = (float(gamma), int(n), str(device))
    powers = _POWERS.get(key)
    if powers is None:
        if len(_POWERS) > 64:
            _POWERS.clear()
        exact = gamma ** torch.arange(n + 1, dtype=torch.float64, device=_CPU)
        powers = exact.to(device=device, dtype=torch.float32)
        _POWERS[key] = powers
    return powers


_POWERS: dict[tuple[float, int, str], torch.Tensor] = {}


def host_powers(gamma: float, n: int) -> np.ndarray:
    """:func:`discount_powers` on the CPU as a numpy view, cached (the host sampling path asks
    twice per batch: two cache hits instead of two ``numpy()`` wrappers)."""
    key = (float(gamma), int(n))
    powers = _HOST_POWERS.get(key)
    if powers is None:
        if len(_HOST_POWERS) > 64:
            _HOST_POWERS.clear()
        powers = _HOST_POWERS[key] = discount_powers(gamma, n, _CPU).numpy()
    return powers


_HOST_POWERS: dict[tuple[float, int], np.ndarray] = {}


def reward_powers(gamma: float, n: int, dtype: np.dtype) -> np.ndarray:
    """γ^0..γ^(n-1) that weigh float32 / float64 host rewards: float64 powers for float64
    rewards, else :func:`host_powers`' float32 ones."""
    if dtype == np.float64:
        return gamma ** np.arange(n, dtype=np.float64)
    return host_powers(gamma, n)[:n]


def torch_reward_powers(
    gamma: float, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """γ^0..γ^(n-1) that weigh tensor rewards summed in ``dtype``: float64 powers for float64
    sums, else :func:`discount_powers`' float32 table; cached (replaybuf.accel.fused reads them
    too)."""
    if dtype != torch.float64:
        return discount_powers(gamma, n, device)[:n]
    key = (float(gamma), int(n), str(device))
    powers = _F64_POWERS.get(key)
    if powers is None:
        if len(_F64_POWERS) > 64:
            _F64_POWERS.clear()
        powers = _F64_POWERS[key] = gamma ** torch.arange(n, dtype=dtype, device=device)
    return powers


_F64_POWERS: dict[tuple[float, int, str], torch.Tensor] = {}


def window_return(rewards: Array, valid: Array, gamma: float) -> Array:
    """Discounted sum over the valid prefix of each window (time-major, as ``index.Windows``).

    Args:
        rewards: ``[n, B, *reward_shape]`` rewards of steps t..t+n-1 (invalid ones arbitrary);
            a tensor, or a float32 / float64 ``[n, B]`` numpy array (the host index path).
        valid: ``[n, B]`` bool, True for the m steps that belong to the window.
        gamma: the discount.

    Returns:
        ``[B, *reward_shape]`` in the rewards' floating dtype (see :func:`return_dtype`).
        Float64 rewards are summed in float64; others in float32 (n terms, so the rounding
        stays within float32's own precision).
    """
    n = rewards.shape[0]
    # Rows outside the window may hold anything (even NaN): select, never multiply by 0.
    if isinstance(rewards, np.ndarray):
        powers = reward_powers(gamma, n, rewards.dtype)
        return powers @ np.where(valid, rewards, rewards.dtype.type(0))
    dtype = return_dtype(rewards.dtype)
    if n == 1:  # one step: no weights, no sum (on CUDA each is a kernel launch)
        keep = valid[0].reshape(*valid.shape[1:], *([1] * (rewards.dim() - 2)))
        return torch.where(keep, rewards[0].to(dtype), 0.0)
    powers = torch_reward_powers(gamma, n, dtype, rewards.device)  # [n]
    extra = [1] * (rewards.dim() - 2)
    keep = valid.reshape(*valid.shape, *extra)  # [n, B, 1...]
    weights = powers.to(dtype).reshape(n, 1, *extra)
    return torch.where(keep, rewards.to(dtype) * weights, 0.0).sum(0)


def bootstrap_discount(m: Array, terminal: Array, gamma: float, n_max: int | None = None) -> Array:
    """``γ^m`` per window (float32), 0 where it ends on a terminated episode's final observation.

    γ^m is read from a cached table of powers (one gather, no pow); tensors or numpy arrays.
    Pass ``n_max >= m.max()`` when known, to avoid reading ``m`` back (a device
    synchronisation on CUDA).
    """
    # In a condition mypy matches math.prod against typeshed's literal-int overload only.
    top = (
        int(m.max())
        if n_max is None and math.prod(m.shape)  # type: ignore[arg-type]
        else (n_max or 0)
    )
    if isinstance(m, np.ndarray):
        return host_powers(gamma, top)[m] * ~terminal
    powers = discount_powers(gamma, top, m.device)
    return powers.index_select(0, m.reshape(-1)).reshape(m.shape) * ~terminal
