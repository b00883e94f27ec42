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


def window_return(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted sum over the valid prefix of each window.

    Args:
        rewards: ``[B, n, *reward_shape]`` rewards of steps t..t+n-1 (invalid ones arbitrary).
        valid: ``[B, n]`` bool, True for the m steps that belong to the window.
        gamma: the discount.

    Returns:
        ``[B, *reward_shape]`` in the rewards' floating dtype (see :func:`return_dtype`),
        accumulated in float64.
    """
    n = rewards.shape[1]
    powers = gamma ** torch.arange(n, dtype=torch.float64, device=rewards.device)  # [n]
    weights = valid.to(torch.float64) * powers  # [B, n]
    weights = weights.reshape(*weights.shape, *([1] * (rewards.dim() - 2)))
    # Masked rows may hold anything (even NaN from unused storage): select, never multiply.
    terms = torch.where(weights != 0, rewards.to(torch.float64) * weights, 0.0)
    return terms.sum(1).to(return_dtype(rewards.dtype))


def bootstrap_discount(m: torch.Tensor, terminal: torch.Tensor, gamma: float) -> torch.Tensor:
    """``γ^m`` per window, 0 where the window ends on a terminated episode's final observation."""
    discount = torch.pow(torch.tensor(gamma, dtype=torch.float64, device=m.device), m)
    return torch.where(terminal, 0.0, discount).to(torch.float32)
