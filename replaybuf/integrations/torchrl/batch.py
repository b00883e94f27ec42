"""Reading one collector batch, flattened to ``[N]`` steps: its required fields, per-step
values, end flags, padding mask and trajectory ids, each checked with an error naming the key."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from replaybuf.errors import ArgumentError, ArgumentTypeError, UnknownFieldError
from replaybuf.integrations.torchrl.keys import Key, dotted


def require(flat: TensorDictBase, key: Key, name: str, what: str) -> Any:
    """The batch's value at ``key`` (the writer's argument ``name``), or ``KeyError`` listing
    the batch's keys."""
    value = flat.get(key, None)
    if value is None:
        keys = sorted(dotted(k) for k in flat.keys(include_nested=True, leaves_only=True))
        raise UnknownFieldError(
            f"{what}: {name} {dotted(key)!r} is not in the batch (its keys: {', '.join(keys)})"
        )
    return value


def per_step(value: torch.Tensor, name: str, what: str, vector_ok: bool = False) -> torch.Tensor:
    """``[N]`` or ``[N, 1]`` (TorchRL's trailing 1) as ``[N]``; other trailing shapes pass
    unchanged when ``vector_ok`` (vector rewards) and are refused otherwise (flags, ids)."""
    if value.dim() == 2 and value.shape[1] == 1:
        return value[:, 0]
    if value.dim() != 1 and not vector_ok:
        raise ArgumentError(
            f"{what}: {name} expected one value per step (shape [..., 1] or [...]), got "
            f"trailing shape {list(value.shape[1:])}"
        )
    return value


def end_flags(
    flat: TensorDictBase, done_key: Key, terminated_key: Key, truncated_key: Key, what: str
) -> dict[str, np.ndarray]:
    """The end flags the batch has (``done``, ``terminated``, ``truncated``), ``[N]`` bool
    each; at least one of them."""
    keys = {"done": done_key, "terminated": terminated_key}
    keys["truncated"] = truncated_key
    flags = {}
    for name, key in keys.items():
        value = flat.get(key, None)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ArgumentTypeError(
                f"{what}: {name} flag {dotted(key)!r} expected a bool tensor, got {got}"
            )
        flags[name] = per_step(value, name, what).cpu().numpy()
    if not flags:
        raise UnknownFieldError(
            f"{what}: batch has none of the end flags {dotted(done_key)!r}, "
            f"{dotted(terminated_key)!r}, {dotted(truncated_key)!r}"
        )
    return flags


def ends(flags: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Which steps end an episode, and which of those terminate it."""
    ended = np.zeros_like(next(iter(flags.values())))
    for value in flags.values():
        ended |= value
    if "terminated" in flags:
        terminated = flags["terminated"]
    elif "truncated" in flags:
        terminated = ended & ~flags["truncated"]
    else:
        terminated = ended  # only "done": nothing says it was a time limit
    return ended, terminated


def valid_steps(flat: TensorDictBase, mask_key: Key, what: str) -> np.ndarray:
    """The steps that are not padding (``[N]`` bool; all of them without a mask)."""
    mask = flat.get(mask_key, None)
    if mask is None:
        return np.ones(flat.shape[0], dtype=bool)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ArgumentTypeError(f"{what}: mask {dotted(mask_key)!r} expected a bool tensor")
    return per_step(mask, "mask", what).cpu().numpy()


def trajectories(
    flat: TensorDictBase, shape: tuple[int, ...], trajectory_key: Key, what: str
) -> tuple[list[Hashable], np.ndarray]:
    """Each step's trajectory (its collector id, else its stream: the leading index), and
    which steps have one (a preempted worker leaves id -1 in steps it never filled)."""
    ids = flat.get(trajectory_key, None)
    if ids is None:
        streams = np.arange(flat.shape[0]) // shape[-1]
        return [("stream", int(s)) for s in streams], np.ones(flat.shape[0], dtype=bool)
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.is_complex():
        raise ArgumentTypeError(
            f"{what}: trajectory ids {dotted(trajectory_key)!r} must be integers"
        )
    ids_np = per_step(ids, "trajectory ids", what).cpu().numpy()
    return [int(i) for i in ids_np], ids_np >= 0


def same_structure(observation: Any, next_observation: Any, what: str) -> None:
    """obs_t and obs_{t+1} must agree leaf by leaf (the final observation is stored as one)."""
    first = _leaf_specs(observation)
    second = _leaf_specs(next_observation)
    if first != second:
        raise ArgumentError(
            f"{what}: next observation expected the observation's fields {first}, got {second}"
        )


def _leaf_specs(value: Any) -> dict[str, tuple[list[int], torch.dtype]]:
    """Each leaf's per-step shape and dtype (``""`` for a plain tensor)."""
    if isinstance(value, torch.Tensor):
        return {"": (list(value.shape[1:]), value.dtype)}
    if isinstance(value, TensorDictBase):
        return {
            str(k): (list(v.shape[1:]), v.dtype)
            for k, v in value.items(include_nested=True, leaves_only=True)
        }
    raise ArgumentTypeError(
        f"observation must be a tensor or a TensorDict, got {type(value).__name__}"
    )
