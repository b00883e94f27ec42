"""Eviction: which whole episodes go to make room, and how an episode's rows are freed.

Plain functions over the :class:`~replaybuf.episodes.core.EpisodeCore` state: the core calls
:func:`make_room` before every write that needs steps, rows or an episode slot.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Generator
from typing import TYPE_CHECKING

import numpy as np
import torch

from replaybuf.episodes.episode import Episode, RowsPinned
from replaybuf.episodes.staging import drop_run
from replaybuf.errors import CapacityError
from replaybuf.storage import to_device_async

if TYPE_CHECKING:
    from replaybuf.episodes.core import EpisodeCore


def make_room(core: EpisodeCore, steps: int, rows: int, episodes: int, protected: set[int]) -> None:
    """Evict whole episodes so that ``steps`` steps, ``rows`` rows and ``episodes`` fit.

    Nothing changes if it cannot be done (see :func:`choose_victims` for the order and the
    errors).
    """
    victims = choose_victims(core, steps, rows, episodes, protected)
    if not victims:
        return
    # Rows must be written and their bookkeeping placed before they are freed; an episode
    # that ended before the last flush has none pending (a vector env's steady state, where a
    # flush per eviction would write a few scattered rows each time instead of a full stager).
    # With priorities every staged step is admitted first, at the maximum as it stands
    # before the victims' priorities leave the tree.
    if core.priorities is not None or not all(flushed(core, episode) for episode in victims):
        core.flush()
    remove_episodes(core, victims)
    core.evicted += len(victims)


def choose_victims(
    core: EpisodeCore, steps: int, rows: int, episodes: int, protected: set[int]
) -> list[Episode]:
    """The episodes to evict so that ``steps`` steps, ``rows`` rows and ``episodes`` fit
    (none when they fit already).

    Oldest finished episodes go first (by start order), then oldest in progress; episodes
    in ``protected`` (those being written) never go, and an episode holding no rows goes
    only when the episode count is over.

    Raises:
        RowsPinned: the rows needed are held by an open checkpoint snapshot.
        ValueError: no choice of victims makes room.
    """
    over_steps = core.steps + steps - core.max_steps
    over_rows = rows - len(core.free)
    cap = core.max_episodes
    over_eps = len(core.episodes) + episodes - cap if cap else 0
    frees_rows = not core.pinned  # while a snapshot is open, evicted rows stay quarantined
    victims: list[Episode] = []
    if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
        return victims
    candidates = eviction_order(core, protected)
    try:
        for episode in candidates:
            steps = len(episode.rows)
            holds = steps + (episode.final_row is not None)
            if holds == 0 and over_eps <= 0:
                continue  # evicting it frees no step or row; only max_episodes needs it
            victims.append(episode)
            over_steps -= steps
            over_rows -= holds if frees_rows else 0
            over_eps -= 1
            if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
                return victims
        if core.pinned and over_rows > 0:
            raise RowsPinned("every free row is held by an open checkpoint snapshot")
        raise CapacityError(
            f"cannot make room for {steps} step(s) and {episodes} episode(s): "
            f"max_steps={core.max_steps}, max_episodes={core.max_episodes}, and "
            f"episode(s) {sorted(protected)} being written cannot be evicted",
            # the limit reached: the steps' (the rows' follow it), else the episodes'
            argument="max_steps" if over_steps > 0 or over_rows > 0 else "max_episodes",
        )
    finally:
        candidates.close()  # puts the finished episodes it popped back on the heap


def eviction_order(core: EpisodeCore, protected: set[int]) -> Generator[Episode, None, None]:
    """Candidates in eviction order, popping the finished heap lazily (O(k log E) for k).

    Popped entries go back on the heap when the caller stops; entries of episodes that are
    gone by then are dropped on a later pass (lazy deletion).
    """
    popped: list[tuple[int, int]] = []
    try:
        while core.finished:
            item = heapq.heappop(core.finished)
            episode = core.episodes.get(item[1])
            if episode is None:
                continue  # stale: evicted or cleared since it finished
            popped.append(item)
            if item[1] not in protected:
                yield episode
        for episode in list(core.episodes.values()):
            if episode.in_progress and episode.episode_id not in protected:
                yield episode
    finally:
        for item in popped:
            heapq.heappush(core.finished, item)


def flushed(core: EpisodeCore, episode: Episode) -> bool:
    """Whether every row of ``episode`` is written and placed (it ended before a flush)."""
    return not episode.in_progress and episode.end_flush < core.flushes


def remove_episodes(core: EpisodeCore, episodes: list[Episode]) -> None:
    """:func:`remove_episode` for each of ``episodes``, in order, in one pass over the row
    columns: the state ends as after removing them one by one (the anchor set's order and the
    free list's too, so seeded draws and later rows), at a few numpy calls for all of them
    instead of a dozen per episode. ``core.batched`` False removes them one by one (the
    reference the tests compare with)."""
    if len(episodes) == 1 or not core.batched:
        for episode in episodes:
            remove_episode(core, episode)
        return
    parts: list[array] = []
    for episode in episodes:
        rows = array("q", episode.rows)
        if episode.final_row is not None:
            rows.append(episode.final_row)
        parts.append(rows)
    ends = np.cumsum([len(rows) for rows in parts], dtype=np.int64)
    if ends[-1]:
        held = np.frombuffer(b"".join(parts), np.int64)
        core.anchors.remove_present_groups(held, ends)
        core.links.release(held)
        core.slots.release_ragged(held)
        if core.priorities is not None:
            device = core.slots.storing_device
            core.priorities.remove(to_device_async(torch.from_numpy(held.copy()), device))
        freed = core.quarantine if core.pinned else core.free
        for rows in parts:
            rows.reverse()  # each episode's rows in the order pops hand them out again
            freed.extend(rows)
    stored, running = core.episodes, core.running
    steps = valid = 0
    went = False  # an episode in progress went: the batch run ends
    for episode, rows in zip(episodes, parts, strict=True):
        count = len(rows) - (episode.final_row is not None)  # its steps
        steps += count
        valid += count if episode.final_row is not None or not count else count - 1
        del stored[episode.episode_id]
        went = running.pop(episode.episode_id, None) is not None or went
    core.steps -= steps
    core.valid_steps -= valid
    if went:
        drop_run(core)


def remove_episode(core: EpisodeCore, episode: Episode) -> None:
    """Drop an episode and free its rows (staged writes must be flushed already)."""
    rows = array("q", episode.rows)  # a copy (one memcpy), read below and then reversed
    if episode.final_row is not None:
        rows.append(episode.final_row)
    if rows:
        held = np.frombuffer(rows, np.int64)
        core.anchors.remove_present(held)
        core.links.release(held)
        core.slots.release_ragged(held)  # ragged values: garbage until the arena compacts
        if core.priorities is not None:  # evicted steps leave the distribution at once
            device = core.slots.storing_device
            core.priorities.remove(to_device_async(torch.from_numpy(held.copy()), device))
        rows.reverse()  # the order pops hand them out again: the episode's own
        if core.pinned:
            core.quarantine.extend(rows)
        else:
            core.free.extend(rows)
    core.steps -= episode.steps
    core.valid_steps -= episode.valid_steps
    del core.episodes[episode.episode_id]  # its heap entry, if any, is dropped lazily
    if core.running.pop(episode.episode_id, None) is not None:
        drop_run(core)
