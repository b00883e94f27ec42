"""The small pieces every batch builder shares: key groups, value conversion, extras."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replaybuf.accel.fused import Redraw
from replaybuf.sampling.view import EpisodeView
from replaybuf.storage import Key

# Uniform places in the packed anchor rows for a shape, those rows, and the device draws'
# state where the places came from them (a buffer's draw)
Draw = Callable[[tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, Redraw | None]]


Values = torch.Tensor | np.ndarray  # index math results: numpy on the host paths


def keys_of(core: EpisodeView, *groups: str) -> tuple[Key, ...]:
    """The fixed-shape fields under ``groups`` (ragged ones: :mod:`replaybuf.sampling.ragged`)."""
    spec = core.slots.spec  # None only before the first step, when nothing is sampled
    return () if spec is None else spec.fixed.group(*groups)


def tensor_of(value: Values) -> torch.Tensor:
    """A host path's numpy result as a tensor (a view, no copy); tensors pass through."""
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def put_extras(out: TensorDict, rows: TensorDictBase) -> None:
    """Extras are stored under ``extras`` and returned as top-level keys."""
    extras = rows.get("extras", None)
    if extras is not None:
        # items(), not iteration: iterating a TensorDict walks its batch dim, not its keys.
        for name, value in extras.items():
            out.set(name, value)


def nstep_keys(core: EpisodeView) -> tuple[Key, ...]:
    """The keys of the core's n-step batches, in :func:`nstep_values`' order."""
    return nstep_key_order(keys_of(core, "observation"), keys_of(core, "action", "extras"))


@functools.lru_cache(maxsize=64)
def nstep_key_order(obs_keys: tuple[Key, ...], step_keys: tuple[Key, ...]) -> tuple[Key, ...]:
    """The keys of an n-step batch, in :func:`nstep_batch`'s value order (cached per spec:
    the same for every batch)."""
    keys: list[Key] = []
    for key in obs_keys:
        keys += [key, ("next_observation", *key[1:])]
    keys += [key[1:] if key[0] == "extras" else key for key in step_keys]  # extras: top-level
    keys += [("reward",), ("terminated",), ("truncated",), ("cut",), ("next_discount",)]
    keys += [("actual_n",), ("start_step",), ("episode_id",)]
    return tuple(keys)
