"""Eviction: which whole episodes go to make room, and how an episode's rows are freed.

Plain functions over the :class:`~replaybuf.episodes.core.EpisodeCore` state: the core calls
:func:`make_room` before every write that needs steps, rows or an episode slot.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Generator
from itertools import accumulate, repeat
from typing import TYPE_CHECKING

import numpy as np
import torch

from replaybuf.core import END_NONE
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
    taken = take_finished(core, steps, rows, episodes, protected) if core.batched else None
    victims = choose_victims(core, steps, rows, episodes, protected) if taken is None else taken
    if not victims:
        return
    try:
        # Rows must be written and their bookkeeping placed before they are freed; an episode
        # that ended before the last flush has none pending (a vector env's steady state,
        # where a flush per eviction would write a few scattered rows each time instead of a
        # full stager). With priorities every staged step is admitted first, at the maximum
        # as it stands before the victims' priorities leave the tree.
        if core.priorities is not None or not all_flushed(core, victims):
            core.flush()
    except BaseException:
        if taken:  # their heap entries go back
            for episode in taken:
                core.finished.push((episode.seq, episode.episode_id))
        raise
    remove_episodes(core, victims)
    core.evicted += len(victims)


def take_finished(
    core: EpisodeCore, steps: int, rows: int, episodes: int, protected: set[int]
) -> list[Episode] | None:
    """:func:`choose_victims`' victims when finished episodes alone make room (a vector
    env's steady state), their heap entries taken off the finished heap (they are about to
    go: no later eviction pops them again as stale); else None, with the heap as it was
    but for stale entries dropped."""
    over_steps = core.steps + steps - core.max_steps
    over_rows = rows - len(core.free)
    cap = core.max_episodes
    over_eps = len(core.episodes) + episodes - cap if cap else 0
    if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
        return []
    frees_rows = not core.pinned  # while a snapshot is open, evicted rows stay quarantined
    finished, stored = core.finished, core.episodes.get
    fifo, heap = finished.fifo, finished.heap  # FinishedOrder.pop, inline (one per victim)
    victims: list[Episode] = []
    kept: list[tuple[int, int]] = []  # popped entries that stay on the heap
    while fifo or heap:
        item = heapq.heappop(heap) if heap and (not fifo or heap[0] < fifo[0]) else fifo.popleft()
        episode = stored(item[1])
        if episode is None:
            continue  # stale: evicted or cleared since it finished
        if item[1] in protected:
            kept.append(item)
            continue
        held = len(episode.own if episode.run is None else episode.rows)
        holds = held + (episode.final_row is not None)
        if holds == 0 and over_eps <= 0:
            kept.append(item)  # evicting it frees no step or row; only max_episodes needs it
            continue
        victims.append(episode)
        over_steps -= held
        over_rows -= holds if frees_rows else 0
        over_eps -= 1
        if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
            for item in kept:
                finished.push(item)
            return victims
    for item in kept:
        finished.push(item)
    for episode in victims:
        finished.push((episode.seq, episode.episode_id))
    return None


def all_flushed(core: EpisodeCore, victims: list[Episode]) -> bool:
    """:func:`flushed` for every one of ``victims``."""
    flushes = core.flushes
    for episode in victims:
        if episode.end_kind == END_NONE or episode.end_flush >= flushes:
            return False
    return True


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
            held = len(episode.rows)
            holds = held + (episode.final_row is not None)
            if holds == 0 and over_eps <= 0:
                continue  # evicting it frees no step or row; only max_episodes needs it
            victims.append(episode)
            over_steps -= held
            over_rows -= holds if frees_rows else 0
            over_eps -= 1
            if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
                return victims
        if core.pinned and over_rows > 0:
            raise RowsPinned("every free row is held by an open checkpoint snapshot")
        raise CapacityError(
            f"cannot make room for {steps} step(s) and {episodes} episode(s): "
            f"max_steps={core.max_steps}, max_episodes={core.max_episodes}, and "
            f"episode(s) {_some(protected)} being written cannot be evicted",
            # the limit reached: the steps' (the rows' follow it), else the episodes'
            argument="max_steps" if over_steps > 0 or over_rows > 0 else "max_episodes",
        )
    finally:
        candidates.close()  # puts the finished episodes it popped back on the heap


def _some(ids: set[int], shown: int = 8) -> str:
    """``ids`` sorted, the first few and the last when there are many (a vector env's
    thousands would make an error message of pages)."""
    ordered = sorted(ids)
    if len(ordered) <= shown:
        return str(ordered)
    head = ", ".join(map(str, ordered[: shown - 1]))
    return f"[{head}, ..., {ordered[-1]}] ({len(ordered)} in all)"


def eviction_order(core: EpisodeCore, protected: set[int]) -> Generator[Episode, None, None]:
    """Candidates in eviction order, popping the finished heap lazily (O(k log E) for k).

    Popped entries go back on the heap when the caller stops; entries of episodes that are
    gone by then are dropped on a later pass (lazy deletion).
    """
    popped: list[tuple[int, int]] = []
    try:
        while core.finished:
            item = core.finished.pop()
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
            core.finished.push(item)


def flushed(core: EpisodeCore, episode: Episode) -> bool:
    """Whether every row of ``episode`` is written and placed (it ended before a flush)."""
    return not episode.in_progress and episode.end_flush < core.flushes


def remove_episodes(core: EpisodeCore, episodes: list[Episode]) -> None:
    """:func:`remove_episode` for each of ``episodes``, in order, in one pass over the row
    columns: the state ends as the one-by-one reference leaves it (the anchor set's order and
    the free list's too, so seeded draws and later rows), at a few numpy calls for all of them
    instead of a dozen per episode. ``core.batched`` False removes them one by one (the
    reference the tests compare with).

    The rows freed go onto the free stack in storage order (handed out lowest first), all of
    them as one group: a vector env's next batch then gets runs of neighbouring rows, which
    its writes and bookkeeping reach in order rather than one cache line apart."""
    if len(episodes) == 1 or not core.batched:
        free, quarantine = len(core.free), len(core.quarantine)
        # (a map, not a loop: no loop variable left holding the last one, see Spares.keep)
        deque(map(remove_episode, repeat(core), episodes), maxlen=0)
        if len(episodes) > 1:  # one group in storage order, as the batched pass frees them
            core.free[free:] = array("q", sorted(core.free[free:], reverse=True))
            core.quarantine[quarantine:] = sorted(core.quarantine[quarantine:], reverse=True)
        if core.batched:
            core.spares.keep(episodes)
        return
    owns, finals, ids, in_progress = _read_victims(episodes)
    lengths = list(map(len, owns))  # steps
    ends = np.fromiter(accumulate(lengths), np.int64, len(lengths))
    steps = int(ends[-1])
    ended = [row for row in finals if row is not None]  # final rows
    if steps or ended:
        freed = _free_rows(core, np.frombuffer(b"".join(owns), np.int64), ends, ended)
        if core.pinned:
            core.quarantine.extend(freed.tolist())
        else:
            core.free.frombytes(freed.tobytes())
    valid = steps  # less one for each in progress with steps (its last has no next yet)
    if len(ended) < len(finals):
        valid -= sum(1 for held, row in zip(lengths, finals, strict=True) if held and row is None)
    deque(map(core.episodes.__delitem__, ids), maxlen=0)
    went = False  # an episode in progress went: the batch run ends
    if in_progress:
        running = core.running
        went = any([running.pop(episode_id, None) is not None for episode_id in ids])
    core.steps -= steps
    core.valid_steps -= valid
    if went:
        drop_run(core)
    core.spares.keep(episodes)


def _free_rows(
    core: EpisodeCore, stepped: np.ndarray, ends: np.ndarray, ended: list[int]
) -> np.ndarray:
    """Take the victims' rows, their steps ``stepped`` (episode g's end at ``ends[g]``) and
    final rows ``ended``, out of the anchors, links, ragged values and priorities; returns
    them in descending storage order, the free stack's (pops hand out the lowest first)."""
    finals = np.array(ended, np.int64)
    anchors, links = core.anchors.compiled_columns(), core.links.release_columns()
    if anchors is not None and links is not None and core.kernels is not None:
        # The passes of the general path below in one compiled call (one dispatch, no
        # intermediate array).
        held = np.empty(stepped.shape[0] + finals.shape[0], np.int64)
        core.anchors.count = core.kernels.evict_rows(
            stepped, ends, finals, *anchors, core.anchors.count, *links, held
        )
        core.links.released(held)
    else:
        # Each episode's steps as one group, as remove_episode removes them; its final row
        # is never an anchor (nothing follows it), so it changes nothing there.
        core.anchors.remove_present_groups(stepped, ends)
        held = np.concatenate((stepped, finals)) if ended else stepped
        core.links.release(held)
    core.slots.ragged.release(held)
    if core.priorities is not None:
        device = core.slots.storing_device
        core.priorities.remove(to_device_async(torch.from_numpy(held.copy()), device))
    return np.sort(held)[::-1]  # (numpy's sort: several times numba's)


def _read_victims(episodes: list[Episode]) -> tuple[list[array], list[int | None], list[int], bool]:
    """Each victim's settled rows, final row and id, and whether any is in progress: one read
    of each record (see :mod:`replaybuf.episodes.spares` on loops). A function of its own, so
    that no loop variable outlives it holding a record (:meth:`Spares.keep` counts them)."""
    owns, finals, ids = [], [], []
    in_progress = False
    for episode in episodes:
        owns.append(episode.own if episode.run is None else episode.rows)
        finals.append(episode.final_row)
        ids.append(episode.episode_id)
        in_progress = in_progress or episode.end_kind == END_NONE
    return owns, finals, ids, in_progress


def remove_episode(core: EpisodeCore, episode: Episode) -> None:
    """Drop an episode and free its rows (staged writes must be flushed already)."""
    rows = array("q", episode.rows)  # a copy (one memcpy): the final row goes after it
    if episode.final_row is not None:
        rows.append(episode.final_row)
    if rows:
        held = np.frombuffer(rows, np.int64)
        core.anchors.remove_present(held)
        core.links.release(held)
        core.slots.ragged.release(held)  # ragged values: garbage until the arena compacts
        if core.priorities is not None:  # evicted steps leave the distribution at once
            device = core.slots.storing_device
            core.priorities.remove(to_device_async(torch.from_numpy(held.copy()), device))
        freed = np.sort(held)[::-1]  # storage order, as pops hand them out (lowest first)
        if core.pinned:
            core.quarantine.extend(freed.tolist())
        else:
            core.free.frombytes(freed.tobytes())
    core.steps -= episode.steps
    core.valid_steps -= episode.valid_steps
    del core.episodes[episode.episode_id]  # its heap entry, if any, is dropped lazily
    if core.running.pop(episode.episode_id, None) is not None:
        drop_run(core)
