"""Sequence batches: ``[B, length]`` runs of consecutive steps of one episode each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.accel.fused import Walk
from replaybuf.accel.fused import sequences as fused_sequences
from replaybuf.core import (
    END_TERMINATED,
    END_TRUNCATED,
    jump_levels,
    sequence_rows,
    sequence_rows_by_jumps,
)
from replaybuf.sampling.common import Values, keys_of, tensor_of
from replaybuf.sampling.frames import stacked_observations
from replaybuf.sampling.padding import pad_copy, pad_in_place, zero_of
from replaybuf.sampling.ragged import ragged_keys_of, ragged_values
from replaybuf.sampling.view import EpisodeView
from replaybuf.storage import Key, Part, build_tensordict


def sequence_batch(
    core: EpisodeView,
    start: torch.Tensor,
    length: int,
    device: torch.device,
    walk: Walk | None = None,
    full: bool = False,
) -> TensorDict:
    """``[B, length]`` consecutive steps from each anchor; ``mask`` marks real steps.

    Positions past an episode's end are zero-filled, with ``episode_id`` and ``step`` -1;
    ``full`` says no anchor has fewer than ``length`` steps ahead (a strict draw), so nothing
    is filled. ``walk`` is the fused kernel's walk of these anchors, where it drew them.
    Like :func:`nstep_batch`, every field is gathered as a plain tensor and one TensorDict is
    built at the end (frame-stacked observations excepted: they come from
    :func:`stacked_observations`): TensorDict reshapes, ``apply`` and ``set`` cost more than
    the gathers themselves here (and on CUDA their Python time is what the learner waits for).
    """
    walk = walk or _walk(core, start, length, full)
    keys, values = sequence_values(core, start, length, device, walk, full)
    batch = build_tensordict(keys, values, (start.shape[0], length), device)
    ragged = ragged_keys_of(core, "observation", "action", "reward", "extras")
    if ragged:  # always padded: a jagged tensor holds one ragged dimension after B only
        obs_rows, step_rows = walk.obs_rows.cpu().numpy(), walk.step_rows.cpu().numpy()
        real = walk.mask.cpu().numpy()
        for key in ragged:
            pairs: tuple[tuple[Key, np.ndarray], ...]
            if key[0] == "observation":
                pairs = (
                    (key, obs_rows[:, :length]),
                    (("next_observation", *key[1:]), obs_rows[:, 1:]),
                )
            else:
                pairs = ((key[1:] if key[0] == "extras" else key, step_rows),)
            for out_key, rows in pairs:
                entries = ragged_values(core, key, out_key, rows, device, "padded", real)
                for k, v in entries.items():
                    batch.set(k, v)
    return batch


def sequence_values(
    core: EpisodeView,
    start: torch.Tensor,
    length: int,
    device: torch.device,
    walk: Walk | None = None,
    full: bool = False,
) -> tuple[list[Key], list[torch.Tensor]]:
    """:func:`sequence_batch`'s keys and values (``[B, length, ...]`` each), in its order."""
    walk = walk or _walk(core, start, length, full)
    padded = not full and _padded(walk.mask)
    slots = core.slots
    # Padded and without frame stacking, the observations at t and t+1 are gathered apart
    # (fresh tensors, filled in place) rather than as two overlapping views of one gather;
    # not from CPU storage to a GPU, where that would copy twice the observations' bytes.
    staged = slots.storing_device.type == "cpu" and device.type != "cpu"
    apart = padded and core.frame_stack is None and not staged
    batch = start.shape[0]
    obs_keys, step_keys = keys_of(core, "observation"), keys_of(core, "action", "reward", "extras")
    parts: list[Part] = []
    if apart:
        for rows in (walk.step_rows, walk.next_rows):
            parts += [(slots.column(key), rows.reshape(-1)) for key in obs_keys]
    elif core.frame_stack is None:
        parts += [(slots.column(key), walk.obs_rows.reshape(-1)) for key in obs_keys]
    parts += [(slots.column(key), walk.step_rows.reshape(-1)) for key in step_keys]
    flat = (walk.terminal, walk.truncated, walk.step, walk.episode, walk.mask, walk.pad)
    parts += [(value, None) for value in flat]
    # One pinned transfer from CPU storage to CUDA (frame-stacked observations make a second).
    delivered = slots.deliver(parts, device)
    terminal, truncated, step_id, episode_id, mask, pad = delivered[-6:]
    observed = len(obs_keys)
    if apart:  # [B * length, *field] each -> [B, length, *field]
        now_after = [v.reshape(batch, length, *v.shape[1:]) for v in delivered[: 2 * observed]]
        delivered = delivered[2 * observed :]
        observations = list(zip(now_after[:observed], now_after[observed:], strict=True))
    else:
        if core.frame_stack is None:  # [B * (length + 1), *field] -> [B, length + 1, *field]
            both = [v.reshape(batch, length + 1, *v.shape[1:]) for v in delivered[:observed]]
            delivered = delivered[observed:]
        else:  # [B, length + 1, k, *field], rebuilt from one frame per step
            stacked = stacked_observations(core, start, walk.obs_rows, device)
            both = [stacked.get(key) for key in obs_keys]
        observations = [(value[:, :length], value[:, 1:]) for value in both]
    steps = {  # [B * length, *field] -> [B, length, *field]; a prefix of delivered
        key: value.reshape(batch, length, *value.shape[1:])
        for key, value in zip(step_keys, delivered, strict=False)
    }
    # Key order: observation, action, reward, next_observation, terminated, truncated, step,
    # episode_id, the extras (top-level keys), mask.
    now = [(key, pair[0]) for key, pair in zip(obs_keys, observations, strict=True)]
    after = [
        (("next_observation", *key[1:]), pair[1])
        for key, pair in zip(obs_keys, observations, strict=True)
    ]
    acted = [(key, value) for key, value in steps.items() if key[0] != "extras"]
    extras = [(key[1:], value) for key, value in steps.items() if key[0] == "extras"]
    if padded:  # zeros past the end (the walk's own values already are)
        if apart:  # fresh gathers, like every other field: filled in place
            now, after = (
                [(key, pad_in_place(value, pad, zero_of(value))) for key, value in group]
                for group in (now, after)
            )
        else:  # overlapping views of one gather: new tensors
            now = [(key, pad_copy(value, mask, zero_of(value))) for key, value in now]
            after = [(key, pad_copy(value, mask, zero_of(value))) for key, value in after]
        acted, extras = (
            [(key, pad_in_place(value, pad, zero_of(value))) for key, value in group]
            for group in (acted, extras)
        )
    ends = [(("terminated",), terminal), (("truncated",), truncated)]
    ids = [(("step",), step_id), (("episode_id",), episode_id)]
    keys, values = zip(*now, *acted, *after, *ends, *ids, *extras, (("mask",), mask), strict=True)
    return list(keys), list(values)


def _padded(mask: torch.Tensor) -> bool:
    """Whether a walk's ``mask`` has a position past an episode's end: read on the host for
    CPU tensors; assumed (no device synchronisation) elsewhere."""
    return not mask.is_cpu or not mask.numpy().all()


def _walk(core: EpisodeView, start: torch.Tensor, length: int, full: bool) -> Walk:
    """The :class:`~replaybuf.accel.fused.Walk` of anchors ``start``: in the fused kernel where it
    runs; else in numpy for CPU storage, or in torch with jump tables (a walk of L links in
    ~log2(L) gathers: on CUDA kernel launches, not bytes, are what a walk costs)."""
    links, host = core.links, core.links.host
    # Tensors, or numpy arrays on the host path until tensor_of at the end.
    step_rows: Values
    next_rows: Values
    pad: Values
    real: Values
    if host is None:
        walk = fused_sequences(start.unsqueeze(1), None, length, links, strict=False)
        if walk is not None:
            return walk
        jumps = links.jumps(jump_levels(length))
        obs_rows, mask = sequence_rows_by_jumps(start, length, jumps)  # [B, L + 1], [B, L]
        step_rows = obs_rows[:, :length].contiguous()
        next_rows = obs_rows[:, 1:].contiguous()
        next_kind = links.end_kind.index_select(0, next_rows.reshape(-1)).view(mask.shape)
        step = links.step.index_select(0, step_rows.reshape(-1)).view(mask.shape)
        episode = links.episode.index_select(0, start).unsqueeze(1).expand(-1, length)
        padded = not full  # unknown without a device synchronisation: filled as if
        pad = ~mask
    else:
        at = start.numpy()
        rows, real = sequence_rows(at, length, host.succ)
        step_rows, next_rows = (np.ascontiguousarray(r) for r in (rows[:, :length], rows[:, 1:]))
        next_kind, step = host.end_kind[next_rows], host.step[step_rows]
        episode = np.broadcast_to(host.episode[at][:, None], real.shape)
        padded = not full and not real.all()
        pad = ~real
        obs_rows, mask = torch.from_numpy(rows), torch.from_numpy(real)
    terminal, truncated = next_kind == END_TERMINATED, next_kind == END_TRUNCATED
    if padded:  # False and -1 past the end
        real = mask.numpy() if host is not None else mask
        terminal, truncated = terminal & real, truncated & real
        where: Callable[..., Any] = np.where if host is not None else torch.where
        step, episode = where(real, step, -1), where(real, episode, -1)
    else:  # its own array (a caller may write into a batch)
        episode = episode.copy() if host is not None else episode.clone()
    values = (step_rows, next_rows, pad, terminal, truncated, step, episode)
    step_rows, next_rows, pad, terminal, truncated, step, episode = (tensor_of(v) for v in values)
    return Walk(
        start, obs_rows, step_rows, next_rows, mask, pad, terminal, truncated, step, episode, None
    )
