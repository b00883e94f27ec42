"""PER's weight math as public functions: importance weights and R2D2 sequence priorities.

Pure tensor functions (memorax's ``compute_importance_weights``; R2D2's mixed max/mean priority);
the buffers' own importance weights live in :mod:`replaybuf.priority.policy`.
"""

from __future__ import annotations

from typing import Any

import torch

from replaybuf.errors import ArgumentError


def _check_unit_interval(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ArgumentError(f"{name} must be a number in [0, 1], got {value!r}", argument=name)
    return float(value)


def compute_importance_weights(
    probabilities: torch.Tensor, buffer_size: int, beta: float = 0.4
) -> torch.Tensor:
    """PER importance weights w_i = (N · P(i))^-beta / max_j (N · P(j))^-beta (memorax's).

    The maximum is taken over ``probabilities`` itself (not over the whole buffer) and is
    reached at the smallest probability, so w_i = (P(i) / P_min)^-beta: every weight lies in
    (0, 1] and the largest is 1.

    Args:
        probabilities: The probabilities P(i) with which the items were sampled, any shape,
            each finite and > 0 (a host sync on CUDA checks them).
        buffer_size: N, the number of items stored, >= 1.
        beta: The correction exponent in [0, 1] (0: no correction, 1: full correction).

    Returns:
        The weights, same shape, dtype and device as ``probabilities``.
    """
    beta = _check_unit_interval("beta", beta)
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ArgumentError(
            f"buffer_size must be an int >= 1, got {buffer_size!r}", argument="buffer_size"
        )
    probabilities = torch.as_tensor(probabilities)
    if not probabilities.dtype.is_floating_point:
        raise ArgumentError(
            f"probabilities must be floating point, got dtype {probabilities.dtype}",
            argument="probabilities",
        )
    bad = ~torch.isfinite(probabilities) | (probabilities <= 0)
    if bool(bad.any()):
        got = probabilities.flatten()[torch.nonzero(bad.flatten())[0]].item()
        raise ArgumentError(
            f"probabilities must be finite and > 0, got {got!r}", argument="probabilities"
        )
    if probabilities.numel() == 0:
        return probabilities.clone()
    scaled = buffer_size * probabilities.double()  # N · P(i)
    weights = scaled.pow(-beta)
    return (weights / weights.max()).to(probabilities.dtype)


def sequence_priority(
    td_errors: torch.Tensor, eta: float = 0.9, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """R2D2's priority of a sequence: eta · max_t |delta_t| + (1 - eta) · mean_t |delta_t|.

    Args:
        td_errors: TD errors ``[..., T]``, time on the last dim.
        eta: The weight of the max, in [0, 1] (R2D2 uses 0.9).
        mask: Optional bool ``[..., T]``; False marks padded steps, which are ignored. A
            sequence without any valid step gets priority 0.

    Returns:
        The priorities ``[...]``, in ``td_errors``' dtype.
    """
    eta = _check_unit_interval("eta", eta)
    td_errors = torch.as_tensor(td_errors)
    if not td_errors.dtype.is_floating_point or td_errors.dim() < 1:
        raise ArgumentError(
            f"td_errors must be a floating point tensor [..., T], got dtype {td_errors.dtype} "
            f"and shape {tuple(td_errors.shape)}"
        )
    if mask is None:
        mask = torch.ones_like(td_errors, dtype=torch.bool)
    elif mask.dtype != torch.bool or mask.shape != td_errors.shape:
        raise ArgumentError(
            f"mask must be bool with the shape of td_errors {tuple(td_errors.shape)}, "
            f"got dtype {mask.dtype} and shape {tuple(mask.shape)}"
        )
    size = torch.where(mask, td_errors.abs(), 0.0)  # [..., T]; |delta| >= 0, so 0 pads max
    if td_errors.shape[-1] == 0:
        return size.sum(-1)  # [...] zeros: no step at all
    count = mask.sum(-1).clamp_min(1)  # [...]
    return eta * size.amax(-1) + (1 - eta) * size.sum(-1) / count
