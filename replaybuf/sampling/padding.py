"""Padding of sequence batches past an episode's end: zeros (or a fill) where a mask says."""

from __future__ import annotations

import torch


def zero_of(value: torch.Tensor) -> bool | int:
    """A Python zero that keeps ``value``'s dtype in ``torch.where`` (no tensor to allocate)."""
    return False if value.dtype == torch.bool else 0


def pad_copy(value: torch.Tensor, mask: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """``value`` (``[B, L, ...]``) with ``fill`` wherever ``mask`` (``[B, L]``) is False."""
    keep = mask.reshape(*mask.shape, *[1] * (value.dim() - 2))
    return kept_or_zero(keep, value) if not fill else torch.where(keep, value, fill)


def kept_or_zero(keep: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``value`` where ``keep`` (broadcast to it) is True, else zero.

    Integer and bool values are multiplied by the mask, exact for them: on the CPU
    ``torch.where`` (and ``masked_fill``) copy uint8 slowly, a padded batch of frames many
    times the product's cost. Floats keep ``torch.where``: a product would turn a stored NaN
    or inf into NaN.
    """
    if not exact_product(value):
        return torch.where(keep, value, zero_of(value))
    return value * keep


def exact_product(value: torch.Tensor) -> bool:
    """Whether multiplying ``value`` by a 0/1 mask is exact: integers and bools, not floats."""
    return not (value.dtype.is_floating_point or value.dtype.is_complex)


def pad_in_place(value: torch.Tensor, pad: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """:func:`pad_copy` written into ``value`` (a fresh gather no other field shares) where
    ``pad`` (``[B, L]``) is True: on CUDA ``masked_fill_`` costs less than half a
    ``torch.where`` with a scalar. On the CPU integer and bool values are multiplied by the
    mask instead, as in :func:`kept_or_zero`."""
    pad = pad.reshape(*pad.shape, *[1] * (value.dim() - 2))
    if not fill and value.is_cpu and exact_product(value):
        return value.mul_(~pad)
    return value.masked_fill_(pad, fill)
