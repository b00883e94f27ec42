"""Sequence batches: ``[B, length]`` runs of consecutive steps of one episode each.

A strict draw starts only where ``length`` steps fit (uniform over such starts, or by
priority); otherwise a sequence starts at any valid step and is zero-padded past its episode's
end, ``mask`` marking the real steps.

With a burn-in of k steps (R2D2's recurrent-state warm-up) a batch is ``[B, k + length]``: the
k steps before each sequence's start, then the sequence. The start is drawn exactly as without
a burn-in; the steps before it are only added. Where they would reach before the episode's
first step they do not exist: ``mask`` False, zeros, ``episode_id`` and ``step`` -1, as past
an episode's end. ``is_burn_in`` (``[B, k + length]``) is True at the first k positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.accel.fused import Walk
from replaybuf.accel.fused import sequences as fused_sequences
from replaybuf.args import int_at_least, positive_int
from replaybuf.core import (
    END_TERMINATED,
    END_TRUNCATED,
    jump_levels,
    sequence_rows,
    sequence_rows_by_jumps,
    stack_rows,
)
from replaybuf.errors import ArgumentError
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
    burn_in: int = 0,
) -> TensorDict:
    """``[B, length]`` consecutive steps from each anchor; ``mask`` marks real steps.

    Positions past an episode's end are zero-filled, with ``episode_id`` and ``step`` -1;
    ``full`` says no anchor has fewer than ``length`` steps ahead (a strict draw), so nothing
    is filled. ``walk`` is the fused kernel's walk of these anchors, where it drew them.
    ``burn_in`` k > 0: ``[B, k + length]``, the k steps before each anchor first (filled as
    past the end where they precede the episode) and ``is_burn_in`` (see the module).
    Like :func:`nstep_batch`, every field is gathered as a plain tensor and one TensorDict is
    built at the end (frame-stacked observations excepted: they come from
    :func:`stacked_observations`): TensorDict reshapes, ``apply`` and ``set`` cost more than
    the gathers themselves here (and on CUDA their Python time is what the learner waits for).
    """
    walk = walk or _walk(core, start, length, full)
    present = None
    if burn_in:
        walk, present = with_burn_in(core, walk, burn_in)
        start, length, full = walk.start, length + burn_in, False
    keys, values = sequence_values(core, start, length, device, walk, full, present)
    batch = build_tensordict(keys, values, (start.shape[0], length), device)
    if burn_in:
        position = torch.arange(length, device=device).expand(start.shape[0], length)
        batch.set("is_burn_in", position < burn_in)
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
    present: torch.Tensor | None = None,
) -> tuple[list[Key], list[torch.Tensor]]:
    """:func:`sequence_batch`'s keys and values (``[B, length, ...]`` each), in its order.
    ``present``: which of ``walk.obs_rows`` stand for real observations, where some before the
    first real one repeat it (a burn-in reaching before the episode; frame stacks read it)."""
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
            stacked = stacked_observations(core, start, walk.obs_rows, device, present)
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


def check_sequence_args(seq_len: Any, burn_in: Any, longest: int) -> tuple[int, int]:
    """``seq_len`` >= 1 (any length: a strict one no episode holds finds no start, a padded one
    is padded, and the batch's memory is checked) and ``burn_in`` in [0, ``longest``]
    (``max_steps``: no episode holds more steps before a sequence's start), else
    :class:`~replaybuf.errors.ArgumentTypeError` / :class:`~replaybuf.errors.ArgumentError`
    naming the argument."""
    seq_len = positive_int(seq_len, "seq_len")
    burn_in = int_at_least(burn_in, "burn_in", 0)
    if burn_in > longest:
        raise ArgumentError(
            f"burn_in must be <= {longest} (max_steps: no episode holds more steps before a "
            f"sequence's start), got {burn_in}",
            argument="burn_in",
        )
    return seq_len, burn_in


def with_burn_in(core: EpisodeView, walk: Walk, burn_in: int) -> tuple[Walk, torch.Tensor]:
    """``walk`` (``[B, L]`` from its anchors) with the ``burn_in`` steps before each anchor put
    first: a walk of ``burn_in + L`` positions whose ``start`` is its first row, and which of
    its ``burn_in + L + 1`` observation rows are real (``present``). Burn-in positions before
    the episode's first step repeat that step's row, with ``mask`` False, ``step`` and
    ``episode`` -1; no burn-in step ends an episode (its anchor comes after it)."""
    rows, real = rows_before(core, walk.start, burn_in)  # [B, k] each, storing device
    obs_rows = torch.cat([rows, walk.obs_rows], 1)  # [B, k + L + 1]
    mask = torch.cat([real, walk.mask], 1)
    back = torch.arange(-burn_in, 0, device=rows.device)
    missing = torch.tensor(-1, device=rows.device)
    step = torch.where(real, walk.step[:, :1] + back, missing)
    episode = torch.where(real, walk.episode[:, :1], missing)
    ended = torch.zeros_like(real)
    walked = Walk(
        obs_rows[:, 0],
        obs_rows,
        obs_rows[:, :-1].contiguous(),
        obs_rows[:, 1:].contiguous(),
        mask,
        ~mask,
        torch.cat([ended, walk.terminal], 1),
        torch.cat([ended, walk.truncated], 1),
        torch.cat([step, walk.step], 1),
        torch.cat([episode, walk.episode], 1),
        None,
    )
    present = torch.cat([real, torch.ones_like(walk.obs_rows, dtype=torch.bool)], 1)
    return walked, present


def rows_before(
    core: EpisodeView, start: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the ``count`` steps before each anchor ``start [B]`` in its episode, oldest
    first, and which exist (``[B, count]`` each, on ``start``'s device). A step before the
    episode's first does not: its place holds the first step's row.

    Along ``prev_row`` where the links keep it (frame stacking: ``count`` gathers, on the
    storing device); else from the episodes' own row lists, on the host (one lookup per
    distinct episode in the batch, and on a GPU one synchronisation to read the anchors')."""
    links = core.links
    host = links.host
    if host is not None and host.prev_row is not None:
        stacked, real = stack_rows(start.numpy(), count + 1, host.prev_row)
        return torch.from_numpy(stacked[:, :count]), torch.from_numpy(real[:, :count])
    if host is None and links.prev_row is not None:
        stacked_t, real_t = stack_rows(start, count + 1, links.prev_row)
        return stacked_t[:, :count], real_t[:, :count]
    return rows_before_by_episode(core, start, count)


def rows_before_by_episode(
    core: EpisodeView, start: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rows_before` from the episodes' row lists (where the links keep no
    ``prev_row``)."""
    links, host = core.links, core.links.host
    if host is not None:
        at = start.numpy()
        episode, step = host.episode[at], host.step[at]
    else:
        read = (links.episode.index_select(0, start), links.step.index_select(0, start))
        episode, step = torch.stack(read).cpu().numpy()
    steps = step[:, None] + np.arange(-count, 0)  # [B, count]
    real = steps >= 0
    steps = np.maximum(steps, 0)
    rows = np.empty_like(steps)
    ids, which = np.unique(episode, return_inverse=True)
    for j, episode_id in enumerate(ids.tolist()):
        pick = which == j
        # Episode.rows: obs_0 .. obs_{T-1}'s rows (an int64 array); read through a view
        rows[pick] = np.frombuffer(core.episodes[episode_id].rows, np.int64)[steps[pick]]
    device = start.device
    return torch.from_numpy(rows).to(device), torch.from_numpy(real).to(device)
