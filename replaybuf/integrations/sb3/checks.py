"""The checks of :class:`~replaybuf.integrations.sb3.buffer.SB3ReplayBuffer`'s arguments: its
spaces at construction, and each ``add``'s arrays (``SchemaError`` naming the field)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from replaybuf.errors import ArgumentError, ArgumentTypeError, SchemaError

_NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float


def check_spaces(observation_space: Any, action_space: Any, optimize_memory_usage: bool) -> None:
    """Refuse ``Dict`` observation spaces, non-gymnasium spaces and the memory-optimised
    variant (which this buffer does not need: it stores each observation once)."""
    if isinstance(observation_space, spaces.Dict):
        raise ArgumentTypeError(
            "observation_space: Dict spaces are not supported by SB3ReplayBuffer "
            "(SB3 uses its DictReplayBuffer for them)"
        )
    if not isinstance(observation_space, spaces.Space) or not isinstance(
        action_space, spaces.Space
    ):
        raise ArgumentTypeError(
            "observation_space and action_space must be gymnasium spaces, got "
            f"{type(observation_space).__name__} and {type(action_space).__name__}"
        )
    if optimize_memory_usage:
        raise ArgumentError(
            "optimize_memory_usage=True is not supported and not needed: SB3ReplayBuffer "
            "stores each observation once already (leave it False)"
        )


def observations(
    value: Any,
    name: str,
    space: spaces.Space,
    n_envs: int,
    obs_shape: tuple[int, ...],
    dtype: np.dtype,
) -> np.ndarray:
    """``obs`` or ``next_obs`` as a contiguous ``[n_envs, *obs_shape]`` array of ``dtype``."""
    array = numeric(value, name, dtype, "the observation space's")
    want = (n_envs, *obs_shape)
    if isinstance(space, spaces.Discrete) and array.shape == (n_envs,):
        array = array.reshape(want)  # SB3 reshapes discrete observations the same way
    if array.shape != want:
        raise SchemaError(
            f"add: field {name!r} expected shape {list(want)} (n_envs, *observation shape), "
            f"got {list(array.shape)}"
        )
    return np.ascontiguousarray(array)


def actions(value: Any, n_envs: int, action_dim: int, dtype: np.dtype) -> np.ndarray:
    """``action`` as a contiguous ``[n_envs, action_dim]`` array of ``dtype``."""
    array = numeric(value, "action", dtype, "the action space's")
    n = n_envs
    if array.ndim == 0 or array.shape[0] != n or array.size != n * action_dim:
        raise SchemaError(
            f"add: field 'action' expected shape [{n}, {action_dim}] "
            f"(n_envs, action_dim), got {list(array.shape)}"
        )
    return np.ascontiguousarray(array.reshape(n, action_dim))


def per_env(value: Any, name: str, n_envs: int) -> np.ndarray:
    """``reward`` or ``done``: one number per environment (``[n_envs]``)."""
    array = numeric(value, name, None, "")
    if array.shape != (n_envs,):
        raise SchemaError(
            f"add: field {name!r} expected shape [{n_envs}] (n_envs), got {list(array.shape)}"
        )
    return array


def numeric(value: Any, name: str, dtype: np.dtype | None, whose: str) -> np.ndarray:
    """``value`` as a numeric numpy array, cast to ``dtype`` where that is safe (``whose``
    names the dtype's source in the error)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise SchemaError(f"add: field {name!r} expected numbers, got dtype {array.dtype}")
    if dtype is None or array.dtype == dtype:
        return array
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise SchemaError(
            f"add: field {name!r} expected dtype {dtype} ({whose}), got {array.dtype}, "
            "which does not cast to it safely"
        )
    return array.astype(dtype)


def timeouts(infos: Any, n_envs: int, handle: bool) -> np.ndarray:
    """Per environment, whether its info says ``TimeLimit.truncated`` (all False unless
    ``handle``: SB3's ``handle_timeout_termination``)."""
    if not handle:
        return np.zeros(n_envs, dtype=bool)
    if not isinstance(infos, Sequence) or len(infos) != n_envs:
        got = len(infos) if isinstance(infos, Sequence) else type(infos).__name__
        raise SchemaError(f"add: field 'infos' expected {n_envs} dicts, got {got}")
    for info in infos:
        if not isinstance(info, Mapping):
            raise SchemaError(f"add: field 'infos' expected dicts, got {type(info).__name__}")
    return np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
