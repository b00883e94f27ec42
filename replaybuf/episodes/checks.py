"""Input checks for the episode write paths: appended steps and final observations.

Each function converts what the caller gave into leaves (``Key -> tensor``) and checks them
against the field spec the first step fixed (or, before any step, against the observation
fields a zero-step episode's final observation fixed), raising the precise error otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from replaybuf.errors import ArgumentTypeError, SchemaError
from replaybuf.storage import Field, FieldSpec, Key, Leaf, Ragged, to_leaves

_CPU = torch.device("cpu")  # host bookkeeping lives here, whatever torch's default device
_NUMBERS = (bool, int, float, np.number, np.bool_)
# Keys sampling and get_episode return; an extras field must not shadow one of them.
RETURNED_KEYS = frozenset(
    {
        "observation",
        "action",
        "reward",
        "next_observation",
        "terminal",  # the n-step flag's former name: still refused, to avoid confusion
        "truncated",
        "next_discount",
        "actual_n",
        "start_step",
        "episode_id",
        "cut",
        "step",
        "mask",
        "index",
        "weight",
        "terminated",
        "length",
        # the "torchrl" layout's keys (replaybuf.sampling.layout)
        "next",
        "done",
        "steps_to_next_obs",
        "gamma",
    }
)


def step_rows(
    data: dict[str, Any],
    extras: Any,
    batched: bool,
    what: str,
    spec: FieldSpec | None,
    first_obs_spec: FieldSpec | None,
    frame_stack: int | None,
    declared: FieldSpec | None = None,
) -> dict[Key, Any]:
    """The checked rows (``[rows, ...]`` per key) of appended steps.

    Args:
        data: ``observation``, ``action`` and ``reward`` as given (one step, or ``[rows, ...]``
            when ``batched``).
        extras: a dict of further fields, or None.
        batched: whether the values hold one step per row.
        what: the calling method's name, for error messages.
        spec: the buffer's field spec (None until the first step fixes it).
        first_obs_spec: observation fields a zero-step episode's final observation fixed.
        frame_stack: the buffer's ``frame_stack`` (a stacked observation's error says so).
        declared: fields declared up front (``spec=``), which the first step's values take.
    """
    if extras is not None:
        if not isinstance(extras, dict):
            raise ArgumentTypeError(f"{what}: extras must be a dict, got {type(extras).__name__}")
        clash = sorted(set(extras) & RETURNED_KEYS)
        if clash:
            raise SchemaError(f"{what}: extras names {clash} collide with keys sampling returns")
        data["extras"] = extras
    reward = data["reward"]
    if spec is None and not batched and isinstance(reward, _NUMBERS):
        # A first reward of 0 must not make every later reward an int: numbers are float32.
        data["reward"] = torch.tensor(float(reward), dtype=torch.float32, device=_CPU)
    dims = 1 if batched else 0
    row = to_leaves(
        data,
        batched=batched,
        what=what,
        spec=spec,
        ragged=frame_stack is None,
        declared=declared,
    )
    if spec is not None:
        check_fields(spec, row, dims, what, frame_stack)
    elif first_obs_spec is not None:
        observation = {key: value for key, value in row.items() if key[0] == "observation"}
        check_fields(first_obs_spec, observation, dims, what, frame_stack)
    if not batched:
        row = {key: value.unsqueeze(0) for key, value in row.items()}
    return row


def final_observation_leaves(
    final_observation: Any,
    what: str,
    spec: FieldSpec | None,
    first_obs_spec: FieldSpec | None,
    frame_stack: int | None,
    declared: FieldSpec | None = None,
) -> dict[Key, Any]:
    """The checked leaves of a final observation (one step, no batch dimension)."""
    obs = to_leaves(
        {"observation": final_observation},
        batched=False,
        what=what,
        spec=spec,
        ragged=frame_stack is None,
        declared=declared,
    )
    if spec is None:
        if first_obs_spec is not None:
            check_fields(first_obs_spec, obs, 0, what, frame_stack)
        return obs
    observed = FieldSpec({k: f for k, f in spec.items() if k[0] == "observation"})
    check_fields(observed, obs, 0, what, frame_stack)
    return obs


def zero_fields(spec: FieldSpec) -> dict[Key, Any]:
    """Zeros for every field but the observation's (a ragged one: no values): what a
    final-observation row holds there."""
    return {
        k: _no_values(f) if f.is_ragged else torch.zeros(f.shape, dtype=f.dtype, device=_CPU)
        for k, f in spec.items()
        if k[0] != "observation"
    }


def _no_values(field: Field) -> Ragged:
    """One row of a ragged field holding no values."""
    empty = torch.empty((0, *field.shape), dtype=field.dtype)
    return Ragged(empty, torch.zeros(1, dtype=torch.long), field.kind)


def check_fields(
    spec: FieldSpec,
    leaves: Mapping[Key, Leaf],
    dims: int,
    what: str,
    frame_stack: int | None,
) -> None:
    """``spec.check``; a stacked observation given to a frame-stacking buffer says so."""
    try:
        spec.check(leaves, dims, what)
    except SchemaError as exc:
        k = frame_stack
        stacked = k is not None and any(
            key in spec
            and key[0] == "observation"
            and isinstance(value, torch.Tensor)
            and tuple(value.shape[dims:]) == (k, *spec[key].shape)
            for key, value in leaves.items()
        )
        if not stacked:
            raise
        raise SchemaError(
            f"{exc} (frame_stack={k}: append one frame per step, e.g. observation[-1] of a "
            "stacked observation; the buffer rebuilds the stack when it samples)"
        ) from None
