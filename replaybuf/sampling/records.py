"""Whole stored episodes, time-major, as TensorDicts (``get_episode``, ``sample_episodes``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replaybuf.core import (
    END_TERMINATED,
    END_TRUNCATED,
)
from replaybuf.episodes import Episode
from replaybuf.sampling.common import keys_of, put_extras
from replaybuf.sampling.frames import lone_stack, stacked_observations
from replaybuf.sampling.ragged import episode_objects, kept_values, ragged_keys_of, ragged_values
from replaybuf.sampling.view import EpisodeView
from replaybuf.storage import Key


def episode_record(
    core: EpisodeView, episode: Episode, device: torch.device, ragged: str = "nested"
) -> TensorDict:
    """A whole stored episode, time-major, in a TensorDict with empty batch size.

    ``observation`` holds obs_0 .. obs_T (T+1 rows, the final observation last) for an ended
    episode and obs_0 .. obs_{T-1} for one in progress (each a ``[k, ...]`` stack with frame
    stacking); ``action``, ``reward`` and extras hold T rows. A ragged field is a jagged tensor
    over the time steps (or padded, as ``ragged`` says); a non-tensor field, one
    ``NonTensorData`` holding the list of the episode's values.
    """
    steps = episode.rows
    obs_rows = [*steps, *([episode.final_row] if episode.final_row is not None else [])]
    spec = core.slots.spec
    obs_keys = keys_of(core, "observation")
    out = TensorDict({}, batch_size=[], device=device)
    if spec is not None and obs_rows:
        rows = torch.tensor(obs_rows, dtype=torch.long, device=core.slots.storing_device)
        if obs_keys:
            stacked = stacked_observations(core, rows[:1], rows.unsqueeze(0), device)  # [1, T+1]
            out.set("observation", stacked.get("observation")[0])
        step_td = core.slots.gather(
            rows[: len(steps)], device, keys_of(core, "action", "reward", "extras")
        )
    elif spec is not None:  # no step yet: empty fields of the stored shapes
        empty = spec.fixed.zeros(0, device)
        if obs_keys:
            observation = empty.get("observation")
            if core.frame_stack is not None:  # [0, *field] -> [0, k, *field]
                k = core.frame_stack
                observation = _apply(observation, lambda v: v.new_zeros((0, k, *v.shape[1:])), 0)
            out.set("observation", observation)
        step_td = empty.exclude("observation")
    else:
        step_td = TensorDict({}, batch_size=[0], device=device)
    if episode.final_observation is not None:  # a zero-step episode's only observation
        final = episode.final_observation.get("observation", None)
        if final is not None:
            final = final.to(device)
            out.set("observation", _apply(final, lambda v: lone_stack(core, v).unsqueeze(0), 1))
    for name in ("action", "reward"):
        if name in step_td:
            out.set(name, step_td.get(name))
    put_extras(out, step_td)
    for key, value in _ragged_entries(core, episode, obs_rows, device, ragged).items():
        out.set(key, value)
    out.set("episode_id", torch.tensor(episode.episode_id, device=device))
    out.set("terminated", torch.tensor(episode.end_kind == END_TERMINATED, device=device))
    out.set("truncated", torch.tensor(episode.end_kind == END_TRUNCATED, device=device))
    out.set("length", torch.tensor(episode.steps, device=device))
    return out


def _ragged_entries(
    core: EpisodeView, episode: Episode, obs_rows: list[int], device: torch.device, form: str
) -> dict[Key, Any]:
    """The episode's ragged and non-tensor fields: observations over its observation rows
    (a zero-step episode's from its kept final observation), the rest over its steps."""
    entries: dict[Key, Any] = {}
    steps = np.asarray(episode.rows, dtype=np.int64)
    kept = episode.final_ragged or {}
    keys = ragged_keys_of(core, "observation", "action", "reward", "extras")
    for key in (*keys, *(k for k in kept if k not in keys)):  # no spec yet: the kept ones
        out_key = key[1:] if key[0] == "extras" else key
        if key[0] == "observation" and key in kept:
            entries.update(kept_values(core, key, kept[key], device, form))
            continue
        rows = np.asarray(obs_rows, dtype=np.int64) if key[0] == "observation" else steps
        entries.update(ragged_values(core, key, out_key, rows, device, form))
    return episode_objects(entries)


def _apply(
    value: torch.Tensor | TensorDictBase,
    fn: Callable[[torch.Tensor], torch.Tensor],
    rows: int,
) -> torch.Tensor | TensorDictBase:
    """``fn`` on a tensor, or on each leaf of a (nested) observation TensorDict, giving ``rows``
    time steps."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value.apply(fn, batch_size=[rows])
