"""Episodes started and ended in bulk: ``start_episodes`` and ``end_episodes``.

The arguments of ``end_episodes`` (ids, statuses, batched final observations) are checked
here, all of them before anything is applied; then :func:`end_many` applies them as a loop of
``end_episode`` would, runs of final rows staged in whole-array steps. Plain functions over the
:class:`~replaybuf.episodes.core.EpisodeCore` state.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDictBase

from replaybuf.args import positive_int
from replaybuf.episodes.assign import final_row
from replaybuf.episodes.episode import STATUSES, Episode
from replaybuf.episodes.eviction import choose_victims, make_room
from replaybuf.episodes.staging import drop_run, flush_if_full, pack_staged, stage
from replaybuf.errors import ArgumentError, ArgumentTypeError, EpisodeStateError
from replaybuf.storage import FieldSpec, Key, Leaf

if TYPE_CHECKING:
    from replaybuf.episodes.core import EpisodeCore

_WHAT = "end_episodes"


def checked_starts(count: Any, agent_id: Any, max_episodes: int | None) -> None:
    """``start_episodes``' arguments: ``count`` a positive int, at most ``max_episodes``."""
    count = positive_int(count, "count")
    if max_episodes is not None and count > max_episodes:
        raise ArgumentError(
            f"start_episodes: count must be at most max_episodes={max_episodes}, got {count}"
        )
    if not isinstance(agent_id, str):
        raise ArgumentTypeError(f"agent_id must be a str, got {type(agent_id).__name__}")


def checked_ends(
    core: EpisodeCore, episode_ids: Any, statuses: Any, final_observations: Any
) -> tuple[list[Episode], list[int], list[dict[Key, Leaf]] | None, Any] | None:
    """``end_episodes``' arguments, all checked (nothing changes): :func:`end_many`'s
    episodes, end kinds, final rows and batch, or None when no episode is named."""
    ids = end_ids(episode_ids)
    count = len(ids)
    kinds = end_kinds(statuses, count)
    if final_observations is None:
        raise ArgumentError(f"{_WHAT}: final_observations is required, got None")
    if not count:
        return None
    episodes = _running_distinct(core, ids)
    if episodes is None:
        episodes = _checked_episodes(core, ids)
    batch = final_values(core, count, final_observations)
    if batch is not None:
        return episodes, kinds, None, batch
    what = f"{_WHAT}: final_observations"
    rows = final_rows_data(core, split_rows(final_observations, count, what), what)
    return episodes, kinds, rows, None


def _running_distinct(core: EpisodeCore, ids: list[Any]) -> list[Episode] | None:
    """The episodes of ``ids`` if all are plain ints naming distinct episodes in progress
    (C-level passes: a vector env's every reset), else None (check them one by one)."""
    if set(map(type, ids)) != {int}:  # a bool would find episode 0 or 1
        return None
    found = list(map(core.running.get, ids))
    if not all(found) or len(set(ids)) != len(ids):  # an Episode is always true
        return None
    return found  # type: ignore[return-value]


def _checked_episodes(core: EpisodeCore, ids: list[Any]) -> list[Episode]:
    """The episodes of ``ids``, each checked in turn: the first bad or repeated id raises,
    naming its index."""
    episodes = []
    seen: dict[int, int] = {}
    for i, episode_id in enumerate(ids):
        try:
            episode = core.in_progress(episode_id, "end")
        except EpisodeStateError as error:
            raise EpisodeStateError(f"{_WHAT}: episode_ids[{i}]: {error}") from None
        if episode.episode_id in seen:
            raise ArgumentError(
                f"{_WHAT}: episode_ids must be distinct, got episode {episode_id} at indices "
                f"{seen[episode.episode_id]} and {i}"
            )
        seen[episode.episode_id] = i
        episodes.append(episode)
    return episodes


def end_ids(episode_ids: Any) -> list[Any]:
    """``episode_ids`` as a list (an integer numpy array's as plain ints); each id is checked
    when looked up."""
    if type(episode_ids) is np.ndarray and episode_ids.ndim == 1 and episode_ids.dtype.kind in "iu":
        return episode_ids.tolist()
    if isinstance(episode_ids, (str, bytes, Mapping)) or not isinstance(
        episode_ids, (Sequence, np.ndarray, torch.Tensor)
    ):
        raise ArgumentTypeError(
            f"{_WHAT}: episode_ids must be a sequence of ints, got {type(episode_ids).__name__}"
        )
    return list(episode_ids)


def end_kinds(statuses: Any, count: int) -> list[int]:
    """The end kind of each of ``count`` episodes: ``statuses`` one status for all or one
    per episode."""
    if isinstance(statuses, str):
        return [_kind(statuses, "statuses")] * count
    if not isinstance(statuses, Sequence):
        raise ArgumentTypeError(
            f"{_WHAT}: statuses must be a str or a sequence of str, got {type(statuses).__name__}"
        )
    if len(statuses) != count:
        raise ArgumentError(
            f"{_WHAT}: statuses must hold one status per episode ({count}), got {len(statuses)}"
        )
    return [_kind(status, f"statuses[{i}]") for i, status in enumerate(statuses)]


def _kind(status: Any, name: str) -> int:
    if not isinstance(status, str) or status.lower() not in STATUSES:
        raise ArgumentError(
            f"{_WHAT}: {name} must be 'terminated', 'truncated' or 'COMPLETED', got {status!r}"
        )
    return STATUSES[status.lower()]


def split_rows(value: Any, count: int, what: str) -> list[Any]:
    """``value`` (``[count, ...]`` tensors or arrays, a TensorDict of batch ``[count]``, a dict
    of those, or a sequence of ``count`` rows) as ``count`` rows, one per episode."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        got = value.shape[0] if value.ndim else None
        if got != count:
            raise ArgumentError(
                f"{what}: leading dimension expected {count} (len(episode_ids)), "
                f"got {'none (a 0-d value)' if got is None else got}"
            )
        return list(value)
    if isinstance(value, TensorDictBase):
        got = value.batch_size[0] if value.batch_dims else None
        if got != count:
            raise ArgumentError(
                f"{what}: batch size expected [{count}] (len(episode_ids)), "
                f"got {list(value.batch_size)}"
            )
        return [value[i] for i in range(count)]
    if isinstance(value, Mapping):
        columns = {name: split_rows(v, count, f"{what}[{name!r}]") for name, v in value.items()}
        return [{name: rows[i] for name, rows in columns.items()} for i in range(count)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != count:
            raise ArgumentError(
                f"{what}: expected {count} rows (len(episode_ids)), got {len(value)}"
            )
        return list(value)
    raise ArgumentError(
        f"{what}: expected [{count}, ...] values (len(episode_ids) rows), "
        f"got {type(value).__name__}"
    )


def start_many(core: EpisodeCore, count: int, agent_id: str) -> list[int]:
    """Start ``count`` episodes (at most ``max_episodes``): what ``count`` calls of
    :meth:`EpisodeCore.start` do, their evictions made at once."""
    make_room(core, 0, 0, count, set())
    first, seq = core.next_id, core.next_seq
    ids = range(first, first + count)
    # What core.register does for each: new episodes are in progress, so in both tables.
    new = core.spares.episodes(ids, agent_id, seq)
    core.episodes.update(zip(ids, new, strict=True))
    core.running.update(zip(ids, new, strict=True))
    core.next_id += count
    core.next_seq += count
    return list(range(first, first + count))


def final_rows_data(core: EpisodeCore, observations: list[Any], what: str) -> list[dict[Key, Leaf]]:
    """:meth:`EpisodeCore.final_row_data` of each final observation (``what[i]`` naming a bad one).
    Before any step fixed the spec, the first fixes the observation's fields for the
    others, as a loop of ``end_episode`` would."""
    rows: list[dict[Key, Leaf]] = []
    saved = core._first_obs_spec
    try:
        for i, observation in enumerate(observations):
            rows.append(core.final_row_data(observation, f"{what}[{i}]"))
            if core.slots.spec is None and core._first_obs_spec is None:
                core._first_obs_spec = FieldSpec.of(rows[0], 0)
    finally:
        core._first_obs_spec = saved
    return rows


def final_values(core: EpisodeCore, count: int, observations: Any) -> Any:
    """``observations`` (``[count, ...]``) if ``end_many``'s batched path takes them:
    a numpy array or CPU tensor of the observation field's exact dtype and shape, with a
    per-step plan; else None (convert each with :meth:`EpisodeCore.final_row_data`)."""
    plan = core._plan
    if plan is None or not core.batched:
        return None
    return plan.final_batch(count, observations)


def end_many(
    core: EpisodeCore, episodes: list[Episode], end_kinds: list[int], finals: Any, batch: Any
) -> None:
    """End ``episodes`` (distinct, in progress, checked): what :meth:`EpisodeCore.end` does
    for each in turn, except that no episode of the call is evicted to make room for another's final
    row. ``batch``: the final observations from :func:`final_values` (then ``finals`` is
    None), else ``finals`` holds each one's :meth:`EpisodeCore.final_row_data`.

    Runs of episodes whose final rows fit the stager and the free rows are staged in
    whole-array steps; the rest, one by one (a flush or an eviction between them). Room
    is checked first: a refusal (``CapacityError``, or ``RowsPinned`` while a checkpoint
    pins the rows) changes nothing.
    """
    drop_run(core)  # as the first end would (the episodes' rows settle, read below)
    protected = {episode.episode_id for episode in episodes}
    steps = [len(episode.own) for episode in episodes]
    need = len(steps) - steps.count(0)
    if need > len(core.free):
        choose_victims(core, 0, need, 0, protected)  # raises if no eviction makes room
    stager = core._stager
    count, at = len(episodes), 0
    while at < count:
        episode = episodes[at]
        take = 0
        if batch is not None and stager is not None and _room_free(core):
            room = min(stager.capacity - stager.pending, len(core.free))
            # The episodes from ``at`` on up to the next one without steps, as many as fit.
            stop = steps.index(0, at) if 0 in steps[at:] else count
            take = max(0, min(room, stop - at))
        if take:
            _end_run(core, episodes[at : at + take], end_kinds[at : at + take], batch, at)
            at += take
            continue
        if not episode.own:  # a zero-step episode keeps its final observation itself
            if finals is None:
                core.end(episode, end_kinds[at], core.final_row_data(batch[at], "end_episodes"))
            else:
                core.end(episode, end_kinds[at], finals[at])
        else:
            row_data = finals[at] if finals is not None else None
            flush_if_full(core, 1)
            make_room(core, 0, 1, 0, protected)
            if row_data is None:  # the batched path's values, through the spare row
                _end_run(core, [episode], end_kinds[at : at + 1], batch, at)
            else:
                row = final_row(core, episode, end_kinds[at])
                stage(core, [row], {k: v.unsqueeze(0) for k, v in row_data.items()})
                core._finish(episode, end_kinds[at])
        at += 1


def _room_free(core: EpisodeCore) -> bool:
    """No eviction due but for rows: steps within max_steps, episodes within max_episodes."""
    cap = core.max_episodes
    return core.steps <= core.max_steps and not (cap and len(core.episodes) > cap)


def _end_run(
    core: EpisodeCore, episodes: list[Episode], end_kinds: list[int], batch: Any, at: int
) -> None:
    """Stage the final rows of ``episodes`` (with steps; the stager and the free rows hold
    them) from ``batch[at : at + len(episodes)]``, their bookkeeping packed in whole-array
    steps, and mark them ended."""
    stager, plan = core._stager, core._plan
    assert stager is not None
    assert plan is not None
    count = len(episodes)
    drop_run(core)  # settles the run's rows (each episode's last row is read below)
    pack_staged(core)  # staged bookkeeping stays in staging order
    free = core.free
    cut = len(free) - count
    rows = free[cut:]
    rows.reverse()  # the order count pops would hand them out in
    del free[cut:]
    plan.put_finals(len(stager), batch[at : at + count])
    stager.rows.extend(rows)
    packed = core._packed
    # One read of each record, then one write (see replaybuf.episodes.spares on loops).
    id_list, steps_list, lasts = [], [], []
    for episode in episodes:
        own = episode.own
        id_list.append(episode.episode_id)
        steps_list.append(len(own))
        lasts.append(own[-1])
    ids, steps = array("q", id_list), array("q", steps_list)
    packed.add_rows(rows, ids, steps, core.allocations, array("q", end_kinds))
    packed.sources.fromlist(lasts)
    packed.targets.extend(rows)
    core.allocations += count
    core.valid_steps += count
    # Each episode marked ended, as EpisodeCore._finish does.
    flushes, running, entries = core.flushes, core.running, []
    for episode, row, kind in zip(episodes, rows, end_kinds, strict=True):
        episode.final_row = row
        episode.end_kind = kind
        episode.end_flush = flushes
        del running[episode.episode_id]
        entries.append((episode.seq, episode.episode_id))
    core.finished.extend(entries)
