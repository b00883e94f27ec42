"""Row assignment: free rows handed to new steps and final observations, bookkeeping staged.

A new row's bookkeeping (its episode, step, end kind and allocation, and the link from the
episode's previous row) is staged beside the row's data and placed in the row columns at the
next flush (:mod:`replaybuf.episodes.staging`). Plain functions over the
:class:`~replaybuf.episodes.core.EpisodeCore` state; :func:`assign_row` and
:func:`assign_rows` run on every append.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from replaybuf.core import END_NONE
from replaybuf.episodes.batch_run import BatchRun
from replaybuf.episodes.episode import Episode
from replaybuf.episodes.staging import drop_run, pack_staged

if TYPE_CHECKING:
    from replaybuf.episodes.core import EpisodeCore


def assign_row(core: EpisodeCore, episode: Episode) -> int:
    """A free row for one new step of ``episode``, linked after its previous step."""
    if episode.run is not None:
        # A step of its own ends the episode's lockstep run (a row handed out since the run's
        # last batch: no later batch can repeat it), so its pending rows settle once, here,
        # rather than through the ``rows`` property on every later step.
        drop_run(core)
    rows = episode.own
    row = core.free.pop()
    core._staged_meta += (row, episode.episode_id, len(rows), END_NONE, core.allocations)
    if rows:
        core._staged_links += (rows[-1], row)
        core.valid_steps += 1
    rows.append(row)
    core.allocations += 1
    core.steps += 1
    return row


def assign_rows(core: EpisodeCore, episodes: list[Episode]) -> array:
    """:func:`assign_row` for each of ``episodes``, in order, in whole-array steps.

    It runs once per ``append_batch``: a batch run's repeated batch costs no per-episode work;
    another batch reads its records in two comprehensions (no attribute pass per field).
    """
    count = len(episodes)
    free = core.free
    cut = len(free) - count
    rows = free[cut:]
    rows.reverse()  # the order count pops would hand them out in
    del free[cut:]
    run = core._run
    if run is not None and episodes is run.episodes and run.allocations == core.allocations:
        # The same episodes as the last batch, and no row handed out since: the run keeps
        # the rows; their bookkeeping and each episode's row array follow from its batches
        # later, a few numpy calls for many batches (BatchRun.pack and settle_rows).
        run.add(rows, core.allocations + count)
        linked = count
    else:
        drop_run(core)
        pack_staged(core)  # staged bookkeeping stays in staging order
        packed = core._packed
        # Comprehensions over the records (see replaybuf.episodes.spares on loops); settled:
        # no episode is in a run after drop_run.
        owns = [episode.own for episode in episodes]
        steps = array("q", list(map(len, owns)))
        ids = array("q", [episode.episode_id for episode in episodes])
        packed.add_rows(rows, ids, steps, core.allocations)
        if all(steps):  # every episode has a step to link from (all but their first calls)
            packed.sources.fromlist([own[-1] for own in owns])
            packed.targets.extend(rows)
            linked = count
        elif not any(steps):  # new episodes only (a vector env's first step): no links
            linked = 0
        else:
            had = [(own[-1], row) for own, row in zip(owns, rows, strict=True) if own]
            packed.sources.fromlist([source for source, _ in had])
            packed.targets.fromlist([target for _, target in had])
            linked = len(had)
        for own, row in zip(owns, rows, strict=True):  # each episode's new row
            own.append(row)
        core._run = BatchRun(episodes, ids, steps, rows, core.allocations + count)
    core.allocations += count
    core.steps += count
    core.valid_steps += linked
    return rows


def final_row(core: EpisodeCore, episode: Episode, end_kind: int) -> int:
    """A free row for ``episode``'s final observation, linked after its last step."""
    row = core.free.pop()
    core._staged_meta += (row, episode.episode_id, episode.steps, end_kind, core.allocations)
    core.allocations += 1
    core._staged_links += (episode.rows[-1], row)
    core.valid_steps += 1
    episode.final_row = row
    return row
