"""TorchRL's layout for an episode buffer's batches: the keys TorchRL's losses read.

replaybuf's own layout (``"replaybuf"``) names each value once, at the top level. TorchRL's
losses and value estimators read the step after under ``"next"``, rewards and flags with a
trailing singleton dimension, and an n-step window's length as ``steps_to_next_obs`` (the
discount is then ``gamma ** steps_to_next_obs``), as its ``MultiStep`` writes them::

    "replaybuf" layout          "torchrl" layout
    observation                 observation
    action, extras              action, extras
    next_observation            ("next", "observation")
    reward [B]                  ("next", "reward") [B, 1]
    terminated [B]              ("next", "terminated") [B, 1]
    truncated [B]               ("next", "truncated") [B, 1]
                                ("next", "done") [B, 1]: terminated or truncated
    actual_n [B]                steps_to_next_obs [B, 1]
                                gamma [B, 1]: gamma ** actual_n (n-step batches)
    next_discount [B]           (none: it is gamma * (1 - terminated))
    cut, start_step, step, episode_id, mask, index, weight: as they are

So TorchRL's target ``reward + gamma ** steps_to_next_obs * (1 - terminated) * V(next)`` is
replaybuf's ``reward + next_discount * V(next_observation)``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase

from replaybuf.sampling.ragged import stack_objects

LAYOUTS = ("replaybuf", "torchrl")
# Keys whose value moves under "next" (with a trailing singleton dim for the flags and reward).
_NEXT = {"reward": "reward", "terminated": "terminated", "truncated": "truncated"}
_DROPPED = ("next_discount", "actual_n")


def check_layout(layout: Any, name: str = "layout") -> str:
    """A layout name, else ``ValueError`` naming the argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def torchrl_transitions(batch: TensorDictBase, gamma: float | None) -> TensorDictBase:
    """An n-step batch (``[B]``) or a sequence batch (``[B, L]``) in TorchRL's layout;
    ``gamma``: the n-step batch's discount (None for sequences, whose steps are single)."""
    out = batch.empty()
    next_td = out.empty()
    for key, value in batch.items():
        if key == "next_observation":
            next_td.set("observation", value)
        elif key == "next_observation_length":  # a padded ragged observation's lengths
            next_td.set("observation_length", value)
        elif key in _NEXT:
            next_td.set(_NEXT[key], value.unsqueeze(-1))
        elif key not in _DROPPED:
            out.set(key, value)
    terminated, truncated = batch.get("terminated"), batch.get("truncated")
    next_td.set("done", (terminated | truncated).unsqueeze(-1))
    if "actual_n" in batch:
        steps = batch.get("actual_n").unsqueeze(-1)
        out.set("steps_to_next_obs", steps)
        if gamma is not None:
            powers = torch.full_like(steps, gamma, dtype=torch.float32)
            out.set("gamma", powers.pow(steps))
    out.set("next", next_td)
    return out


def torchrl_episode(record: TensorDictBase) -> TensorDict:
    """A whole episode (``get_episode``'s record) as its ``[T]`` transitions in TorchRL's
    layout: step t's observation, action and reward, and obs_{t+1} under ``"next"``. An
    episode in progress has no observation after its last step yet, so that step is left out
    (as sampling leaves it out); ``episode_id`` is per step."""
    length = int(record.get("length"))
    ended = bool(record.get("terminated")) or bool(record.get("truncated"))
    steps = length if ended else max(length - 1, 0)
    device = record.device
    out = TensorDict({}, batch_size=[steps], device=device)
    next_td = TensorDict({}, batch_size=[steps], device=device)
    for key, value in record.items():
        if key in ("length", "terminated", "truncated", "episode_id"):
            continue
        if key in ("observation", "observation_length"):  # obs_0 .. obs_T: this step and next
            out.set(key, _rows(value, 0, steps))
            next_td.set(key, _rows(value, 1, steps + 1))
        elif key == "reward":
            next_td.set("reward", value[:steps].unsqueeze(-1))
        else:
            out.set(key, _rows(value, 0, steps))
    last = torch.zeros(steps, 1, dtype=torch.bool, device=device)
    if ended and steps:
        last[-1] = True
    next_td.set("terminated", last & bool(record.get("terminated")))
    next_td.set("truncated", last & bool(record.get("truncated")))
    next_td.set("done", last.clone())
    out.set("next", next_td)
    out.set("episode_id", record.get("episode_id").expand(steps).clone())
    out.set("step", torch.arange(steps, device=device))
    return out


def _rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of an episode record's entry: a tensor, a jagged nested tensor (a
    ragged field), the ``NonTensorData`` list of a non-tensor field (as a per-row stack) or a
    TensorDict of them. Plain slicing serves only the first: a jagged tensor cannot be sliced
    along its batch dimension, and a list-valued ``NonTensorData`` is one item, not rows."""
    if isinstance(value, NonTensorData):
        items = value.tolist()[start:stop]
        return stack_objects(items) if items else NonTensorData([], batch_size=[0])
    if isinstance(value, TensorDictBase):
        rows = {key: _rows(entry, start, stop) for key, entry in value.items()}
        return TensorDict(rows, batch_size=[stop - start], device=value.device)
    if value.is_nested:
        offsets = value.offsets()
        start, stop = min(start, offsets.numel() - 1), min(stop, offsets.numel() - 1)
        low, high = int(offsets[start]), int(offsets[stop])
        return torch.nested.nested_tensor_from_jagged(
            value.values()[low:high], offsets[start : stop + 1] - low
        )
    return value[start:stop]
