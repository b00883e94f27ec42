"""``append_steps``: several consecutive steps of one episode in one call.

It leaves the state that as many per-step appends (``append_observation_action_reward``, one
row at a time) leave: the same rows handed out in the same order, the same bookkeeping in the
same staging order, flushes and evictions at the same steps, so the same seeded draws. Runs of
steps that need no eviction and fit the stager are staged as slices (one slice assignment per
field, the bookkeeping as whole arrays); a step that evicts or meets a full stager goes the
per-step path's way, one row.

Everything is checked before anything changes: the values, and that evicting can make room for
all the steps (evictions take whole episodes in one fixed order, so room for all the steps
means room for each one on the way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from replaybuf.episodes.assign import assign_row
from replaybuf.episodes.episode import Episode
from replaybuf.episodes.eviction import choose_victims, make_room
from replaybuf.episodes.staging import drop_run, flush_if_full, pack_staged
from replaybuf.errors import ArgumentError, ArgumentTypeError, UnsupportedError
from replaybuf.storage import Ragged

if TYPE_CHECKING:
    from replaybuf.episodes.core import EpisodeCore

_WHAT = "append_steps"
# Runs of at least this many steps get their bookkeeping as whole arrays (a fixed cost of a
# few numpy calls); shorter ones the per-step path's, row by row.
_PACKED = 16


def step_count(rewards: Any) -> int:
    """The number of steps ``rewards`` (``[steps]``: a numpy array, tensor or list) holds."""
    if isinstance(rewards, (np.ndarray, torch.Tensor)):
        if rewards.ndim != 1:
            raise ArgumentError(
                f"{_WHAT}: rewards must be one-dimensional, [steps], got shape "
                f"{list(rewards.shape)}"
            )
        count = int(rewards.shape[0])
    elif isinstance(rewards, (list, tuple)):
        count = len(rewards)
    else:
        raise ArgumentTypeError(
            f"{_WHAT}: rewards must be a [steps] numpy array, tensor or list, got "
            f"{type(rewards).__name__}"
        )
    if count == 0:
        raise ArgumentError(f"{_WHAT}: rewards must hold at least one step, got none")
    return count


def append_steps(
    core: EpisodeCore,
    episode: Episode,
    count: int,
    observations: Any,
    actions: Any,
    rewards: Any,
    extras: Any,
) -> None:
    """Stage ``count`` steps of ``episode`` (values ``[count, ...]``), checked first."""
    step = (observations, actions, rewards, extras)
    plan = core._plan
    values = None if plan is None else plan.batch_values(count, step)
    if values is None:
        rows = core.step_row(observations, actions, rewards, extras, True, _WHAT)
        for key, value in rows.items():
            if isinstance(value, Ragged):
                raise UnsupportedError(
                    f"{_WHAT}: {'.'.join(key)} is ragged; append such steps one at a time "
                    "(append_observation_action_reward)"
                )
            if value.shape[0] != count:
                raise ArgumentError(
                    f"{_WHAT}: {'.'.join(key)} holds {value.shape[0]} step(s), rewards {count}"
                )
    # Room for every step, or nothing changes (CapacityError, RowsPinned). Evicting every
    # other episode frees all the rows but the episode's own (none quarantined while no
    # snapshot pins them): if the episode fits then, there is room, and the search is spared.
    if core.pinned or len(episode.rows) + count > core.max_steps:
        choose_victims(core, count, count, 0, {episode.episode_id})
    if values is None:
        first = 0
        if core._plan is None:  # the first steps fix the fields: the general path's way
            core.append([episode], {key: value[:1] for key, value in rows.items()})
            first = 1
        plan = core._plan
        if plan is None:  # fields the per-step fast path does not write (nested, bfloat16)
            for i in range(first, count):
                core.append([episode], {key: value[i : i + 1] for key, value in rows.items()})
            return
        stager = core._stager
        assert stager is not None  # made with the plan
        values = [rows[key][first:].detach().cpu().numpy() for key in stager.keys]
        stage_steps(core, episode, count - first, values)
        return
    stage_steps(core, episode, count, values)


def stage_steps(core: EpisodeCore, episode: Episode, count: int, values: list[Any]) -> None:
    """Stage ``count`` steps whose values (per staging column, ``[count, ...]`` of its dtype)
    were checked and for which evicting can make room."""
    plan, stager = core._plan, core._stager
    assert plan is not None
    assert stager is not None
    arrays = plan.arrays
    values = [v.numpy() if type(v) is torch.Tensor else v for v in values]
    cap = core.max_episodes
    done = 0
    while done < count:
        evict = core.steps >= core.max_steps or not core.free or (cap and len(core.episodes) > cap)
        room = stager.capacity - stager.pending
        if evict or room <= 0:
            # One step as the per-step path takes it: into the spare row, then room made
            # (a full stager flushed, victims evicted), then staged.
            spare = stager.capacity
            for array, value in zip(arrays, values, strict=True):
                array[spare] = value[done]
            flush_if_full(core, 1)
            if evict:
                make_room(core, 1, 1, 0, {episode.episode_id})
            stager.stage_spare(assign_row(core, episode), arrays)
            done += 1
            continue
        take = min(count - done, room, core.max_steps - core.steps, len(core.free))
        at = len(stager.rows)
        for array, value in zip(arrays, values, strict=True):
            array[at : at + take] = value[done : done + take]
        if take < _PACKED:
            rows = stager.rows
            for _ in range(take):
                rows.append(assign_row(core, episode))
        else:
            stager.rows.extend(_assign(core, episode, take))
        done += take


def _assign(core: EpisodeCore, episode: Episode, count: int) -> Any:
    """Free rows for ``count`` new steps of ``episode``, linked in order after its last step:
    what ``count`` calls of :func:`replaybuf.episodes.assign.assign_row` hand out and stage,
    the bookkeeping packed as whole arrays (after what is staged already: staging order)."""
    if episode.run is not None:
        drop_run(core)
    free = core.free
    cut = len(free) - count
    rows = free[cut:]
    rows.reverse()  # the order count pops would hand them out in
    del free[cut:]
    pack_staged(core)
    packed = core._packed
    own = episode.own
    had = len(own)
    episodes = np.full(count, episode.episode_id, dtype=np.int64)
    steps = np.arange(had, had + count, dtype=np.int64)
    packed.add_rows(rows, episodes, steps, core.allocations)
    if had:
        packed.sources.append(own[-1])
        packed.targets.append(rows[0])
    if count > 1:
        packed.sources.extend(rows[:-1])
        packed.targets.extend(rows[1:])
    own.extend(rows)
    core.valid_steps += count if had else count - 1
    core.allocations += count
    core.steps += count
    return rows
