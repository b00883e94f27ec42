"""Pure n-step return math: discounted sums and bootstrap discounts. Imports torch only.

For a window of m rewards starting at step t::

    R = r_t + γ r_{t+1} + ... + γ^(m-1) r_{t+m-1}
    next_discount = γ^m   (0 when obs_{t+m} is the final observation of a terminated episode)

so that a target is ``R + next_discount * V(obs_{t+m})``. A truncated episode (time limit)
bootstraps from its final observation; only termination zeroes the discount.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
        exact = gamma ** torch.arange(n + 1, dtype=torch.float64)
        powers = exact.to(device=device, dtype=torch.float32)
        _POWERS[key] = powers
    return powers


_POWERS: dict[tuple[float, int, str], torch.Tensor] = {}


def window_return(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted sum over the valid prefix of each window.

    Args:
        rewards: ``[B, n, *reward_shape]`` rewards of steps t..t+n-1 (invalid ones arbitrary).
        valid: ``[B, n]`` bool, True for the m steps that belong to the window.
        gamma: the discount.

    Returns:
        ``[B, *reward_shape]`` in the rewards' floating dtype (see :func:`return_dtype`).
        Float64 rewards are summed in float64; others in float32 (n terms, so the rounding
        stays within float32's own precision).
    """
    n = rewards.shape[1]
    dtype = return_dtype(rewards.dtype)
    powers = discount_powers(gamma, n, rewards.device)[:n]  # [n]
    if dtype == torch.float64:
        powers = gamma ** torch.arange(n, dtype=torch.float64, device=rewards.device)
    extra = [1] * (rewards.dim() - 2)
    keep = valid.reshape(*valid.shape, *extra)  # [B, n, 1...]
    # Rows outside the window may hold anything (even NaN): select, never multiply by 0.
    terms = torch.where(keep, rewards.to(dtype) * powers.to(dtype).reshape(n, *extra), 0.0)
    return terms.sum(1)


def bootstrap_discount(
    m: torch.Tensor, terminal: torch.Tensor, gamma: float, n_max: int | None = None
) -> torch.Tensor:
    """``γ^m`` per window (float32), 0 where it ends on a terminated episode's final observation.

    γ^m is read from a cached table of powers (one gather, no pow). Pass ``n_max >= m.max()``
    when known, to avoid reading ``m`` back (a device synchronisation on CUDA).
    """
    top = int(m.max()) if n_max is None and m.numel() else (n_max or 0)
    powers = discount_powers(gamma, top, m.device)
    discount = powers.index_select(0, m.reshape(-1)).reshape(m.shape)
    return torch.where(terminal, 0.0, discount)
