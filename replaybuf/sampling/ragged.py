"""Ragged and non-tensor fields in batches: nested tensors, padded tensors, Python objects.

A ragged field's rows come out as a ``torch.nested`` jagged tensor (``[N, j, *shape]``), or,
with the buffer's ``ragged="padded"``, zero-padded to the batch's longest row with a
``<name>_length`` entry beside it (sequences, whose ``[B, L]`` batches a jagged tensor cannot
hold, are always padded). Text, bytes and JSON-like fields come out as tensordict's
``NonTensorStack`` (TorchRL's convention for LLM data), decoded from their stored bytes: ``None``
at a sequence's padded positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack

from replaybuf.errors import ArgumentError
from replaybuf.sampling.view import EpisodeView
from replaybuf.storage import Key, Ragged, decode

FORMS = ("nested", "padded")


def check_ragged_form(form: Any, name: str = "ragged") -> str:
    """A ragged form's name, else ``ValueError`` naming the argument."""
    if form not in FORMS:
        raise ArgumentError(f"{name} must be one of {FORMS}, got {form!r}")
    return form


def ragged_keys_of(core: EpisodeView, *groups: str) -> tuple[Key, ...]:
    """The ragged and non-tensor fields under ``groups`` (none before the first step)."""
    spec = core.slots.spec
    if spec is None or not spec.ragged_keys:
        return ()
    return tuple(k for k in spec.group(*groups) if spec[k].is_ragged)


def length_key(key: Key) -> Key:
    """Where a padded field's row lengths go: beside it, ``<name>_length``."""
    return (*key[:-1], f"{key[-1]}_length")


def ragged_values(
    core: EpisodeView,
    key: Key,
    out_key: Key,
    rows: np.ndarray,
    device: torch.device,
    form: str,
    real: np.ndarray | None = None,
) -> dict[Key, Any]:
    """The entries of field ``key`` at ``rows`` (``[N]``, or ``[B, L]`` for sequences),
    under ``out_key``; ``real`` (``[B, L]``) marks the positions that hold a step."""
    field = core.slots.spec[key]  # type: ignore[index]
    flat = np.ascontiguousarray(rows.reshape(-1), dtype=np.int64)
    taken = core.slots.ragged[key].take(flat, device)
    lengths = taken.lengths.clone()
    values = taken.values
    if real is not None and not real.all():  # no values at padded positions
        keep = torch.from_numpy(real.reshape(-1))
        spans = torch.repeat_interleave(keep, lengths)
        values, lengths = values[spans.to(values.device)], lengths * keep
    if field.is_ragged and field.kind != "ragged":
        return {out_key: _objects(field.kind, values, lengths, rows.shape, real)}
    if form == "nested" and rows.ndim == 1:
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        jagged = torch.nested.nested_tensor_from_jagged(values, offsets.to(values.device))
        return {out_key: jagged}
    longest = int(lengths.max()) if lengths.numel() else 0
    padded = values.new_zeros((lengths.shape[0], longest, *field.shape))
    if values.shape[0]:
        row_of = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        at = torch.arange(values.shape[0]) - torch.repeat_interleave(starts, lengths)
        padded[row_of.to(values.device), at.to(values.device)] = values
    shape = tuple(rows.shape)
    return {
        out_key: padded.reshape(*shape, longest, *field.shape),
        length_key(out_key): lengths.reshape(shape).to(device),
    }


def _objects(
    kind: str,
    values: torch.Tensor,
    lengths: torch.Tensor,
    shape: tuple[int, ...],
    real: np.ndarray | None,
) -> NonTensorStack:
    """Decoded objects of a non-tensor field, as a stack of ``shape``."""
    raw = values.cpu().numpy().tobytes()
    objects: list[Any] = []
    at = 0
    flat_real = None if real is None else real.reshape(-1)
    for i, length in enumerate(lengths.tolist()):
        if flat_real is not None and not flat_real[i]:
            objects.append(None)
            continue
        objects.append(decode(kind, raw[at : at + length]))
        at += length
    if len(shape) == 2:
        width = shape[1]
        return NonTensorStack(
            *(stack_objects(objects[b * width : (b + 1) * width]) for b in range(shape[0]))
        )
    return stack_objects(objects)


def stack_objects(objects: list[Any]) -> NonTensorStack:
    """One object per row (``from_list`` would read a list-valued object as more rows)."""
    return NonTensorStack(*(NonTensorData(o) for o in objects))


def kept_values(
    core: EpisodeView, key: Key, value: Ragged, device: torch.device, form: str
) -> dict[Key, Any]:
    """The entries of a zero-step episode's final observation field (kept apart, one row)."""
    field = core.slots.spec[key] if core.slots.spec is not None else None
    kind = value.kind if field is None else field.kind
    if kind != "ragged":
        return {key: _objects(kind, value.values, value.lengths, (1,), None)}
    offsets = torch.tensor([0, value.values.shape[0]])
    if form == "nested":
        return {
            key: torch.nested.nested_tensor_from_jagged(value.values.to(device), offsets.to(device))
        }
    return {key: value.values.unsqueeze(0).to(device), length_key(key): value.lengths.to(device)}


def episode_objects(values: dict[Key, Any]) -> dict[Key, Any]:
    """A whole episode's entries (batch size ``[]``): each stack of objects as one
    ``NonTensorData`` holding the episode's list of them."""
    return {
        key: NonTensorData(value.tolist()) if isinstance(value, NonTensorStack) else value
        for key, value in values.items()
    }
