"""The compiled eviction of several episodes at once: their anchors removed one group per
episode, and their rows released and listed for the free stack, in one call (kept beside
:mod:`replaybuf.accel.numba_kernels`, which exports them with its other kernels)."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from replaybuf.accel.numba_nstep import END_NONE

_I64 = types.int64[::1]
_I8 = types.int8[::1]
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)


@njit(types.int64(_I64_IN, _I64_IN, _I64, _I64, types.int64), cache=True, boundscheck=False)
def remove_anchor_groups(
    old: np.ndarray, ends: np.ndarray, rows: np.ndarray, pos: np.ndarray, count: int
) -> int:
    """``remove_anchors`` (:mod:`replaybuf.accel.numba_kernels`) for each group of ``old`` in
    turn (group g: ``old[ends[g-1]:ends[g]]``), in one call: the moves of one call per group
    (an eviction of several episodes, group by group, orders the anchors as evicting them one
    by one does)."""
    size = pos.shape[0]
    if not 0 <= count <= rows.shape[0] == size:
        raise ValueError("remove: count or columns out of shape")
    for i in range(old.shape[0]):
        if not 0 <= old[i] < size:
            raise IndexError("bookkeeping write: a row out of range")
    places = np.empty(old.shape[0], np.int64)
    begin = 0
    for g in range(ends.shape[0]):
        end = ends[g]
        if not begin <= end <= old.shape[0]:
            raise ValueError("remove: group ends out of order")
        removed = 0
        for i in range(begin, end):
            row = old[i]
            if pos[row] >= 0:
                places[removed] = pos[row]
                pos[row] = -1
                removed += 1
        kept = count - removed
        hole = 0
        for at in range(kept, count):
            row = rows[at]
            if pos[row] >= 0:
                while places[hole] >= kept:
                    hole += 1
                rows[places[hole]] = row
                pos[row] = places[hole]
                hole += 1
            rows[at] = -1
        count = kept
        begin = end
    return count


@njit(cache=True, boundscheck=False)
def release(
    rows: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    prev_row: np.ndarray,
    backward: bool,
) -> None:
    """The writes of ``release_rows`` (:mod:`replaybuf.accel.numba_kernels`) and of
    :func:`evict_rows`, on rows their callers checked: no episode, successor, predecessor
    (``backward``: prev_row is kept) or end kind."""
    for i in range(rows.shape[0]):
        row = rows[i]
        next_row[row] = -1
        succ[row] = row
        episode[row] = -1
        end_kind[row] = END_NONE
        if backward:
            prev_row[row] = -1


@njit(
    types.int64(
        _I64_IN, _I64_IN, _I64_IN, _I64, _I64, types.int64, _I64, _I64, _I64, _I8, _I64, _I64
    ),
    cache=True,
    boundscheck=False,
)
def evict_rows(
    old: np.ndarray,
    ends: np.ndarray,
    finals: np.ndarray,
    rows: np.ndarray,
    pos: np.ndarray,
    count: int,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    prev_row: np.ndarray,
    freed: np.ndarray,
) -> int:
    """An eviction's row work in one call (``remove_episodes``' general path makes four):
    :func:`remove_anchor_groups` of the steps ``old`` (groups ending at ``ends``), then
    ``release_rows`` of ``old`` and the final rows ``finals``, which ``freed`` receives (in
    that order). Returns the anchors' new count. Every row is checked before anything is
    written."""
    size = next_row.shape[0]
    held = old.shape[0] + finals.shape[0]
    if not (
        pos.shape[0] == succ.shape[0] == episode.shape[0] == end_kind.shape[0] == size
        and freed.shape[0] == held
        and (prev_row.shape[0] == 0 or prev_row.shape[0] == size)
    ):
        raise ValueError("eviction: the columns differ in length")
    for i in range(finals.shape[0]):
        if not 0 <= finals[i] < size:
            raise IndexError("bookkeeping write: a row out of range")
    count = remove_anchor_groups(old, ends, rows, pos, count)  # checks old's rows first
    freed[: old.shape[0]] = old
    freed[old.shape[0] :] = finals
    release(freed, next_row, succ, episode, end_kind, prev_row, prev_row.shape[0] == size)
    return count
