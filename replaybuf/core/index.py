"""Pure index math over linked episode rows: n-step windows and sequences.

Every stored row holds one observation of one episode. Row ``r`` of step t links to the row of
step t+1 of the same episode through ``next_row[r]`` (-1 while that observation does not exist
yet; ``succ[r]`` is the same link with ``r`` itself in place of -1), so episodes may interleave
freely in storage. An episode of T steps occupies T+1 rows, the
last one its final observation, which is never a sampling anchor::

    rows:      obs_0 ──▶ obs_1 ──▶ ... ──▶ obs_{T-1} ──▶ obs_T (final, end_kind 1 or 2)
    anchors:   yes       yes               yes            no
    in progress (no final yet):  obs_0 ──▶ ... ──▶ obs_k   (obs_k is not an anchor: no next)

A row is an *anchor* (a valid step) when it has an action and its next observation exists.
An n-step window from anchor t takes m = min(n, steps available) steps: it stops at the final
observation (``terminal`` / ``truncated``), or early at an in-progress episode's newest
observation (``cut``). A window never crosses an episode boundary because links never do.

With frame stacking, ``prev_row`` is the reverse link (-1 at an episode's first row) and the
stack of a row is the k rows ending at it, oldest first, clamped at the first row::

    k = 4, step 1:   [obs_0, obs_0, obs_0, obs_1]   (real: F F T T)

:func:`nstep_windows` runs on torch tensors (any device) or on numpy arrays: for CPU storage
the sampler hands it numpy views of the same columns, because at batch sizes of a few hundred
a torch call's dispatch costs several times a numpy call, and a window is a dozen such calls
(see ``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

Array = TypeVar("Array", torch.Tensor, np.ndarray)
AnyArray = torch.Tensor | np.ndarray

END_NONE = 0  # not a final observation
END_TERMINATED = 1  # final observation of a terminated episode: no bootstrap
END_TRUNCATED = 2  # final observation of a truncated episode: bootstrap from it


class Windows(NamedTuple):
    """n-step windows for a batch of anchors (all torch or all numpy); shapes in comments.

    Time-major (step k first): every slice ``rows[k]`` is contiguous, so the reward gather
    needs no copy and the per-step reductions run over whole rows.
    """

    rows: AnyArray  # [n_max + 1, B] rows of obs_t, obs_{t+1}, ... of the episode, repeating
    #                its last observation row (past a per-sample n they run on, masked by valid)
    valid: AnyArray  # [n_max, B] bool, k < m: step t+k belongs to the window
    m: AnyArray  # [B] steps in the window (actual_n)
    last_row: AnyArray  # [B] row of obs_{t+m}
    terminal: AnyArray  # [B] obs_{t+m} is a terminated episode's final observation
    truncated: AnyArray  # [B] obs_{t+m} is a truncated episode's final observation
    cut: AnyArray  # [B] m < n because the episode has no newer observation yet


def gather(column: Array, rows: Array) -> Array:
    """``column[rows]`` of a 1-D column: numpy indexing, or torch's ``index_select`` (its
    fastest gather; ``tensor[rows]`` takes the slower advanced-indexing path)."""
    if isinstance(column, np.ndarray):
        return column[rows]
    return column.index_select(0, rows)


def walk(start: Array, steps: int, succ: Array) -> list[Array]:
    """``[start, succ[start], succ[succ[start]], ...]``: ``steps`` gathers along the links,
    each ending in a self-loop at an episode's final (or newest) observation."""
    chain = [start]
    for _ in range(steps):
        chain.append(gather(succ, chain[-1]))
    return chain


def nstep_windows(
    start: Array, n: Array | int, n_max: int, succ: Array, end_kind: Array
) -> Windows:
    """Follow links from each anchor in ``start`` for up to ``n`` steps (per sample if an array).

    ``succ`` / ``end_kind`` are per-row ``[R]`` columns; ``succ[r]`` is ``next_row[r]``, or
    ``r`` itself where the row has no successor. That self-loop makes the walk one gather per
    step with no masking: once it reaches an episode's final (or newest) observation it stays
    there, and step t+k is in the window exactly when its observation row differs from the
    next one. O(B · n_max), independent of how many rows are stored.
    """
    host = isinstance(start, np.ndarray)
    chain = walk(start, n_max, succ)
    rows = (np if host else torch).stack(chain)  # [n_max + 1, B]
    if n_max == 1:  # every anchor has a next row: all valid, m = 1 (three calls fewer)
        valid, m, last = rows[:1] >= 0, (np if host else torch).ones_like(start), chain[-1]
    elif isinstance(n, int):
        valid = rows[1:] != rows[:-1]
        m, last = valid.sum(0), chain[-1]
    else:  # per-sample n: also stop after n steps
        steps = np.arange(n_max) if host else torch.arange(n_max, device=start.device)
        valid = (rows[1:] != rows[:-1]) & (steps[:, None] < n)
        m = valid.sum(0)
        if host:
            last = rows[m, np.arange(rows.shape[1])]
        else:
            last = rows.gather(0, m.unsqueeze(0)).squeeze(0)
    kind = gather(end_kind, last)
    if n_max == 1:  # m = n = 1: never cut
        cut = (np if host else torch).zeros_like(kind, dtype=bool)
    else:
        cut = (m < n) & (kind == END_NONE)
    return Windows(
        rows=rows,
        valid=valid,
        m=m,
        last_row=last,
        terminal=kind == END_TERMINATED,
        truncated=kind == END_TRUNCATED,
        cut=cut,
    )


def sequence_rows(start: Array, length: int, succ: Array) -> tuple[Array, Array]:
    """Rows of ``length`` consecutive steps from each anchor, and of their observations.

    Returns ``obs_rows [B, length + 1]`` (obs_t .. obs_{t+length}; positions past the window
    repeat the last real row) and ``mask [B, length]`` (True for steps inside the episode).
    ``succ`` as in :func:`nstep_windows` (torch or numpy): a chain of ``length`` gathers.
    """
    chain = walk(start, length, succ)
    stacked = np.stack(chain, 1) if isinstance(start, np.ndarray) else torch.stack(chain, 1)
    return stacked, stacked[:, 1:] != stacked[:, :-1]


def jump_levels(steps: int) -> int:
    """Jump tables needed to walk ``steps`` >= 1 links: succ^1, succ^2, ..., succ^(2^(k-1))
    with 2^k > steps."""
    return max(1, steps.bit_length())


def jump_tables(succ: torch.Tensor, levels: int, known: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[succ, succ^2, succ^4, ...]`` (``levels`` tables, succ^(2^k) = succ^(2^(k-1)) applied
    twice), extending ``known`` (a prefix of the same list, possibly empty) in place.

    Self-loops are fixed points, so a jump past an episode's end stays at its last row, as
    the step-by-step walk does. Used on CUDA, where a walk of L steps is then about log2(L)
    gathers instead of L kernel launches; rebuilding a level is one gather over all rows.
    """
    if not known:
        known.append(succ)
    while len(known) < levels:
        known.append(known[-1].index_select(0, known[-1]))
    return known[:levels]


def jump(rows: torch.Tensor, steps: int, jumps: list[torch.Tensor]) -> torch.Tensor:
    """succ^steps of ``rows``: one gather per set bit of ``steps`` (``jumps`` long enough)."""
    level = 0
    while steps:
        if steps & 1:
            rows = jumps[level].index_select(0, rows.reshape(-1)).reshape(rows.shape)
        steps >>= 1
        level += 1
    return rows


def sequence_rows_by_jumps(
    start: torch.Tensor, length: int, jumps: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_rows` with jump tables (``jump_levels(length)`` of them).

    Built time-major, ``[length + 1, B]``: positions 2^k .. 2^(k+1)-1 are table k applied to
    positions 0 .. 2^k-1, one ``index_select`` into a contiguous slice per level; returned
    batch-major (a transposed view).
    """
    batch = start.shape[0]
    chain = torch.empty((length + 1, batch), dtype=start.dtype, device=start.device)
    chain[0] = start
    done, level = 1, 0
    while done < length + 1:
        need = min(done, length + 1 - done)
        torch.index_select(
            jumps[level], 0, chain[:need].view(-1), out=chain[done : done + need].view(-1)
        )
        done, level = done + need, level + 1
    rows = chain.t()  # [B, length + 1]
    return rows, rows[:, 1:] != rows[:, :-1]


def full_sequence_starts_by_jumps(
    anchors: torch.Tensor, length: int, jumps: list[torch.Tensor]
) -> torch.Tensor:
    """:func:`full_sequence_starts` with jump tables (``jump_levels(length)`` of them)."""
    before_last = jump(anchors, length - 1, jumps)
    return jumps[0].index_select(0, before_last) != before_last


def full_sequence_starts(anchors: Array, length: int, succ: Array) -> Array:
    """The anchors from which ``length`` (>= 1) consecutive steps all exist (bool
    ``[len(anchors)]``): those whose walk still moves at its last step."""
    chain = walk(anchors, length, succ)
    return chain[-1] != chain[-2]


def stack_rows(rows: Array, k: int, prev_row: Array) -> tuple[Array, Array]:
    """The rows of the ``k``-frame stack ending at each of ``rows``, and which are real frames.

    Returns ``stacked [*rows.shape, k]`` (position k-1 is the row itself, position k-1-j the row
    j steps earlier in its episode, or the episode's first row where there is none) and
    ``real [*rows.shape, k]`` (False at those padding positions). k-1 chained gathers:
    O(rows · k), whatever the number of stored rows. Torch tensors or numpy arrays (the host
    path, as :func:`nstep_windows`).
    """
    xp = np if isinstance(rows, np.ndarray) else torch
    flat = rows.reshape(-1)
    cur = flat
    held, real = [flat], [xp.ones_like(flat, dtype=bool)]
    for _ in range(k - 1):
        prev = gather(prev_row, cur)
        has = prev >= 0  # False at the first row, and so at every position before it
        cur = xp.where(has, prev, cur)
        held.append(cur)
        real.append(has)
    shape = (*rows.shape, k)
    stacked = xp.stack(held[::-1], 1).reshape(shape)  # [*rows, k], oldest first
    return stacked, xp.stack(real[::-1], 1).reshape(shape)


def stack_windows(start: Array, obs_rows: Array, k: int, prev_row: Array) -> tuple[Array, Array]:
    """Rows from which the k-frame stacks of consecutive observations are cut, without overlap.

    ``obs_rows [B, P]`` are consecutive rows of one episode each, starting at ``start [B]``.
    Returns ``window [B, k - 1 + P]`` (the k-1 frames before ``start``, padded as in
    :func:`stack_rows`, then ``obs_rows``) and ``real`` of the same shape: the stack of
    ``obs_rows[:, p]`` is ``window[:, p : p + k]``. Gathering the window reads k-1+P frames per
    row instead of k·P. Torch tensors or numpy arrays, as :func:`stack_rows`.
    """
    host = isinstance(start, np.ndarray)
    cat: Callable[..., Any] = np.concatenate if host else torch.cat
    before, real = stack_rows(start, k, prev_row)  # [B, k]
    ones = (np if host else torch).ones_like(obs_rows, dtype=bool)
    window = cat([before[:, : k - 1], obs_rows], 1)  # [B, k - 1 + P]
    return window, cat([real[:, : k - 1], ones], 1)
