"""Compiled CPU kernels for n-step windows and frame stacks (numba; the ``fast`` extra): a
batch's windows over CPU episode storage, the rows of k-frame stacks, and a uniform
frame-stacked batch's draw lookup, windows and stack rows in one call. Loaded with, and
re-exported by, :mod:`replaybuf.accel.numba_kernels` (see there), whose callers reach them as
its members. The kernels that :func:`frame_nstep` calls live in this file with it: numba's
cache watches a kernel's own file only, so a callee elsewhere could leave a stale copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit, types

if TYPE_CHECKING:
    from numba.core.typing import Signature

_F32 = types.float32[::1]
_I64 = types.int64[::1]
_I8 = types.int8[::1]
_BOOL = types.boolean[::1]
_I64_2D = types.int64[:, ::1]
_BOOL_2D = types.boolean[:, ::1]
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)  # read only: writable ones convert
END_NONE, END_TERMINATED, END_TRUNCATED = 0, 1, 2  # replaybuf.core.index's end kinds


def _nstep_signature(reward: types.Float) -> Signature:
    """(ends, return, terminal, truncated, cut, discount, m, step, episode) of the anchors."""
    result = types.Tuple((_I64, reward[::1], _BOOL, _BOOL, _BOOL, _F32, _I64, _I64, _I64))
    return result(_I64, _I64, types.int64, _I64, _I8, _I64, _I64, reward[::1], reward[::1], _F32)


@njit(
    [_nstep_signature(types.float32), _nstep_signature(types.float64)],
    cache=True,
    boundscheck=False,
)
def nstep_windows(
    start: np.ndarray,
    n_each: np.ndarray,
    n_max: int,
    succ: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    episode: np.ndarray,
    reward: np.ndarray,
    reward_powers: np.ndarray,
    discount_powers: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """:func:`replaybuf.core.index.nstep_windows` and the values ``sampling._window_values`` makes
    of them, for anchors ``start [B]``, each walking up to ``n_each[b]`` links (or ``n_max``
    when ``n_each`` is empty) along ``succ`` (self-loops at an episode's last row).

    ``reward`` is the 1-D reward column, ``reward_powers`` γ^0..γ^(n_max-1) in its dtype, and
    ``discount_powers`` the float32 γ^0..γ^n_max. Returns the rows of both observations
    (``[2B]``: starts, then ends) and, per anchor, the discounted return, terminal, truncated,
    cut, the bootstrap discount (0 after termination), m, the start's step and episode.

    The return adds γ^k r_{t+k} in order k = 0, 1, ...; the numpy path's matrix product may
    round the last bit differently (the tests compare them to 1e-6).
    """
    count = start.shape[0]
    ends = np.empty(2 * count, np.int64)
    total = np.zeros(count, reward.dtype)
    m = np.zeros(count, np.int64)
    row = start.copy()
    ends[:count] = start
    for k in range(n_max):  # one link for every anchor at a time: independent loads
        for b in range(count):
            if m[b] == k and (n_each.shape[0] == 0 or k < n_each[b]):
                here = row[b]
                after = succ[here]
                if after != here:  # step t+k is in the episode: its reward is at row t+k
                    total[b] += reward_powers[k] * reward[here]
                    row[b] = after
                    m[b] = k + 1
    terminal = np.empty(count, np.bool_)
    truncated = np.empty(count, np.bool_)
    cut = np.empty(count, np.bool_)
    discount = np.empty(count, np.float32)
    first_step = np.empty(count, np.int64)
    first_episode = np.empty(count, np.int64)
    for b in range(count):
        kind = end_kind[row[b]]
        n = n_max if n_each.shape[0] == 0 else n_each[b]
        ends[count + b] = row[b]
        terminal[b] = kind == END_TERMINATED
        truncated[b] = kind == END_TRUNCATED
        cut[b] = m[b] < n and kind == END_NONE
        discount[b] = 0.0 if terminal[b] else discount_powers[m[b]]
        first_step[b] = step[start[b]]
        first_episode[b] = episode[start[b]]
    return ends, total, terminal, truncated, cut, discount, m, first_step, first_episode


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


def _frame_signature(reward: types.Float) -> Signature:
    """(rows, real, shift, [4, B] int64s, [3, B] flags, return, discount) of a draw."""
    values = (_I64_2D, _BOOL_2D, reward[::1], _F32)
    result = types.Tuple((_I64, _BOOL, types.int64, *values))
    links = (_I64, _I8, _I64, _I64)  # succ, end_kind, step, episode
    powers = (reward[::1], reward[::1], _F32)  # rewards, their powers, the discount powers
    return result(_I64, _I64, types.int64, types.int64, *links, *powers, _I64)


@njit(
    [_frame_signature(types.float32), _frame_signature(types.float64)],
    cache=True,
    boundscheck=False,
)
def frame_nstep(
    picks: np.ndarray,
    anchor_rows: np.ndarray,
    n: int,
    k: int,
    succ: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    episode: np.ndarray,
    reward: np.ndarray,
    reward_powers: np.ndarray,
    discount_powers: np.ndarray,
    prev_row: np.ndarray,
) -> tuple:
    """The windows of a uniform frame-stacked n-step batch, anchors ``anchor_rows[picks]``
    (``[B]``): their :func:`nstep_windows` (every one walking ``n``) and the rows of the k-frame
    stacks at both window ends, laid out as
    :func:`window_stacks` lays them out: where every window is
    ``n < k`` steps long, one stack ``k + n`` deep at each window's last row (``shift`` n: each
    frame once), else the ``2B`` stacks of both ends, ``k`` deep (``shift`` 0).

    Returns the stack rows and which are real frames, ``shift``, then nstep_windows' values
    but its ends, packed (each array returned costs the call a conversion): ``[4, B]`` int64
    anchor rows, m, step and episode; ``[3, B]`` terminal, truncated and cut; the discounted
    return and the bootstrap discount. The frames are gathered by the caller (numpy's take
    copies a row with memcpy, faster than a compiled loop).
    """
    count = picks.shape[0]
    start = np.empty(count, np.int64)
    for b in range(count):
        start[b] = anchor_rows[picks[b]]
    windows = nstep_windows(
        start, np.empty(0, np.int64), n, succ, end_kind, step, episode, reward,
        reward_powers, discount_powers,
    )  # fmt: skip
    actual_n = windows[6]
    rows, real, shift = window_stacks(windows[0], actual_n, n, k, prev_row)
    ints = np.empty((4, count), np.int64)
    flags = np.empty((3, count), np.bool_)
    for b in range(count):
        ints[0, b] = start[b]
        ints[1, b] = actual_n[b]
        ints[2, b] = windows[7][b]
        ints[3, b] = windows[8][b]
        flags[0, b] = windows[2][b]
        flags[1, b] = windows[3][b]
        flags[2, b] = windows[4][b]
    return rows, real, shift, ints, flags, windows[1], windows[5]
