"""Compiled CPU kernels for frame stacks (numba; the ``fast`` extra): the rows of k-frame stacks
over CPU episode storage, and of a batch's n-step windows. Loaded with, and re-exported by,
:mod:`replaybuf.accel.numba_kernels` (see there), whose callers reach them as its members."""

from __future__ import annotations

import numpy as np
from numba import njit, types

_I64 = types.int64[::1]
_BOOL = types.boolean[::1]
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)  # read only: writable ones convert


@njit(types.Tuple((_I64, _BOOL))(_I64_IN, types.int64, _I64_IN), cache=True, boundscheck=False)
def stack_rows(rows: np.ndarray, k: int, prev_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`replaybuf.core.index.stack_rows` of ``rows [N]`` (k >= 1), flattened: ``stacked``
    and ``real`` ``[N * k]``, row i's stack at ``[i * k, (i + 1) * k)``, oldest first. The
    numpy version makes ~4 calls per step back; this is one loop, one step back for every row
    at a time (independent loads)."""
    count = rows.shape[0]
    stacked = np.empty(count * k, np.int64)
    real = np.empty(count * k, np.bool_)
    for i in range(count):
        stacked[i * k + k - 1] = rows[i]
        real[i * k + k - 1] = True
    for j in range(1, k):  # position k - 1 - j: j steps back, or the episode's first row
        for i in range(count):
            at = i * k + k - 1 - j
            here = stacked[at + 1]
            before = prev_row[here]
            real[at] = before >= 0
            stacked[at] = before if before >= 0 else here
    return stacked, real


@njit(
    types.Tuple((_I64, _BOOL, types.int64))(_I64_IN, _I64_IN, types.int64, types.int64, _I64_IN),
    cache=True,
    boundscheck=False,
)
def window_stacks(
    ends: np.ndarray, actual_n: np.ndarray, n: int, k: int, prev_row: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """The frame-stack rows of a batch's n-step windows (``ends [2B]`` as
    :func:`nstep_windows` gives them, ``actual_n [B]``), and ``shift``. Where every window is
    ``n < k`` steps long, :func:`stack_rows` of the windows' last rows ``k + n`` deep
    (``[B * (k + n)]``: each window's frames once, its start's stack the first k, its end's the
    last k) and ``shift`` n; else :func:`stack_rows` of ``ends`` (``[2B * k]``) and 0."""
    count = actual_n.shape[0]
    once = n < k
    for b in range(count):
        if actual_n[b] != n:
            once = False
            break
    if once:
        rows, real = stack_rows(ends[count:], k + n, prev_row)
        return rows, real, n
    rows, real = stack_rows(ends, k, prev_row)
    return rows, real, 0
