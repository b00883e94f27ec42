"""Episode records kept after eviction and handed out again to the episodes started next.

A vector env of short episodes starts and evicts about as many episodes as it has envs every
few steps. New :class:`Episode` records (and their row arrays) are objects the garbage
collector tracks; thousands of them surviving each round trigger a full collection over every
object of the process (hundreds of thousands with torch loaded) every few thousand calls,
which over a long run costs as much as the writes themselves. Records reused in place allocate
nothing, so the steady state leaves the collector nothing new to track.

A record is only kept when nothing but the evicting call holds it (its reference count says
so), so a record still referenced anywhere (a checkpoint snapshot, a batch run) is never
changed under its holder.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter, delitem, is_

from replaybuf.core import END_NONE
from replaybuf.episodes.episode import Episode

LIMIT = 1 << 16  # records kept at most (about 100 bytes each; their row arrays are emptied)

_COUNT = getattr(sys, "getrefcount", None)  # CPython's; elsewhere nothing is kept
# What _COUNT reads, through map, for a record a list alone holds (the list, map's own).
_ALONE = None if _COUNT is None else next(map(_COUNT, [object()]))
_OWN = attrgetter("own")
_ALL = slice(None)


def _set(records: list[Episode], name: str, values: Iterable[object]) -> None:
    """``record.<name> = value`` for each record, in one C-level pass."""
    deque(map(setattr, records, repeat(name), values), maxlen=0)


class Spares:
    """The evicted records waiting to be handed out again (see the module docstring)."""

    def __init__(self) -> None:
        self.records: list[Episode] = []

    def keep(self, evicted: list[Episode]) -> None:
        """Keep those of ``evicted`` (out of every table, listed once) that nothing else holds,
        emptied to a new episode's state but for the id, agent and start order."""
        if _COUNT is None or len(self.records) >= LIMIT:
            return
        counts = list(map(_COUNT, evicted))  # read as _ALONE is: nothing else may hold a ref
        alone = [e for e, c in zip(evicted, counts, strict=True) if c == _ALONE]
        if not alone:
            return
        deque(map(delitem, map(_OWN, alone), repeat(_ALL)), maxlen=0)
        _set(alone, "final_row", repeat(None))
        _set(alone, "end_kind", repeat(END_NONE))
        _set(alone, "end_flush", repeat(-1))
        for name in ("final_observation", "final_ragged", "run"):  # mostly None already
            if not all(map(is_, map(attrgetter(name), alone), repeat(None))):
                _set(alone, name, repeat(None))
        self.records += alone[: LIMIT - len(self.records)]

    def episodes(self, ids: range, agent_id: str, seq: int) -> list[Episode]:
        """New episodes ``ids`` of ``agent_id`` numbered from ``seq`` in start order: kept
        records first, new ones for the rest."""
        count = len(ids)
        records = self.records
        cut = len(records) - min(count, len(records))
        reused = records[cut:]
        del records[cut:]
        used = len(reused)
        if used:
            _set(reused, "episode_id", ids[:used])
            _set(reused, "agent_id", repeat(agent_id))
            _set(reused, "seq", range(seq, seq + used))
        if used < count:
            reused += map(
                Episode, ids[used:], repeat(agent_id, count - used), range(seq + used, seq + count)
            )
        return reused
