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

Each record is reset in one loop that touches it once: CPython 3.11+ stores to a slotted
attribute in a specialised instruction, several times cheaper than a C-level
``map(setattr, ...)`` pass per attribute, which also reads every record again.
"""

from __future__ import annotations

import sys

from replaybuf.core import END_NONE
from replaybuf.episodes.episode import Episode

LIMIT = 1 << 16  # records kept at most (about 100 bytes each; their row arrays are emptied)

_COUNT = getattr(sys, "getrefcount", None)  # CPython's; elsewhere nothing is kept


def _alone_count() -> int | None:
    """What ``_COUNT`` reads in :meth:`Spares.keep`'s loop for a record a list alone holds
    (the list, the loop variable, the call's argument)."""
    if _COUNT is None:
        return None
    counts = []
    for record in [object()]:
        counts.append(_COUNT(record))
    return counts[0]


_ALONE = _alone_count()


class Spares:
    """The evicted records waiting to be handed out again (see the module docstring)."""

    def __init__(self) -> None:
        self.records: list[Episode] = []

    def keep(self, evicted: list[Episode]) -> None:
        """Keep those of ``evicted`` (out of every table, listed once) that nothing else holds,
        emptied to a new episode's state but for the id, agent and start order."""
        records = self.records
        room = LIMIT - len(records)
        if _COUNT is None or room <= 0:
            return
        count, alone = _COUNT, _ALONE
        kept: list[Episode] = []
        for record in evicted:  # read as _ALONE is: nothing else may hold a reference
            if len(kept) == room:
                break
            if count(record) == alone:
                del record.own[:]
                record.final_row = None
                record.end_kind = END_NONE
                record.end_flush = -1
                record.final_observation = None
                record.final_ragged = None
                record.run = None
                kept.append(record)
        records += kept

    def episodes(self, ids: range, agent_id: str, seq: int) -> list[Episode]:
        """New episodes ``ids`` of ``agent_id`` numbered from ``seq`` in start order: kept
        records first, new ones for the rest."""
        count = len(ids)
        records = self.records
        cut = len(records) - min(count, len(records))
        reused = records[cut:]
        del records[cut:]
        used = len(reused)
        for record, episode_id in zip(reused, ids[:used], strict=True):
            record.episode_id = episode_id
            record.agent_id = agent_id
            record.seq = seq
            seq += 1
        if used < count:
            new = ids[used:]
            reused += map(Episode, new, [agent_id] * len(new), range(seq, seq + len(new)))
        return reused
