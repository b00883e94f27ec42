"""The compiled anchor removal of several evicted episodes at once, one group per episode
(kept beside :mod:`replaybuf.accel.numba_kernels`, which exports it with its other kernels)."""

from __future__ import annotations

import numpy as np
from numba import njit, types

_I64 = types.int64[::1]
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
