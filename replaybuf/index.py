"""Pure index math over linked episode rows: n-step windows and sequences. Imports torch only.

Every stored row holds one observation of one episode. Row ``r`` of step t links to the row of
step t+1 of the same episode through ``next_row[r]`` (-1 while that observation does not exist
yet), so episodes may interleave freely in storage. An episode of T steps occupies T+1 rows, the
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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

END_NONE = 0  # not a final observation
END_TERMINATED = 1  # final observation of a terminated episode: no bootstrap
END_TRUNCATED = 2  # final observation of a truncated episode: bootstrap from it


class Windows(NamedTuple):
    """n-step windows for a batch of anchors; shapes in comments."""

    rows: torch.Tensor  # [B, n_max] row of step t+k (the start row where k >= m)
    valid: torch.Tensor  # [B, n_max] bool, k < m
    m: torch.Tensor  # [B] steps in the window (actual_n)
    last_row: torch.Tensor  # [B] row of obs_{t+m}
    terminal: torch.Tensor  # [B] obs_{t+m} is a terminated episode's final observation
    truncated: torch.Tensor  # [B] obs_{t+m} is a truncated episode's final observation
    cut: torch.Tensor  # [B] m < n because the episode has no newer observation yet


def nstep_windows(
    start: torch.Tensor,
    n: torch.Tensor | int,
    n_max: int,
    next_row: torch.Tensor,
    end_kind: torch.Tensor,
) -> Windows:
    """Follow links from each anchor in ``start`` for up to ``n`` steps (per sample if a tensor).

    ``next_row`` / ``end_kind`` are per-row ``[R]`` tensors on one device. A row is an anchor
    exactly when it has a successor (``next_row >= 0``), so each step costs one gather: the
    whole call is O(B · n_max), independent of how many rows or episodes are stored.
    """
    per_sample = isinstance(n, torch.Tensor)
    if n_max == 1:  # one step: every anchor has its next row; 4 kernels instead of ~12
        last = next_row.index_select(0, start)  # [B]
        kind = end_kind.index_select(0, last)
        return Windows(
            rows=start.unsqueeze(1),
            valid=torch.ones((start.shape[0], 1), dtype=torch.bool, device=start.device),
            m=torch.ones_like(start),
            last_row=last,
            terminal=kind == END_TERMINATED,
            truncated=kind == END_TRUNCATED,
            cut=torch.zeros_like(start, dtype=torch.bool),
        )
    cur = start  # row of obs_{t+k} while the window is still growing
    active = torch.ones_like(start, dtype=torch.bool)
    held, taken = [start], [active]
    for k in range(n_max):
        nxt = next_row.index_select(0, cur)
        if k > 0:
            # Step t+k belongs to the window when t+k-1 did, k < n, and obs_{t+k} has a successor.
            active = active & (nxt >= 0)
            if per_sample:
                active = active & (k < n)
            held.append(cur)
            taken.append(active)
        cur = torch.where(active, nxt, cur)
    valid = torch.stack(taken, 1)  # [B, n_max]
    rows = torch.where(valid, torch.stack(held, 1), start.unsqueeze(1))  # [B, n_max]
    m = valid.sum(1)
    kind = end_kind.index_select(0, cur)
    return Windows(
        rows=rows,
        valid=valid,
        m=m,
        last_row=cur,
        terminal=kind == END_TERMINATED,
        truncated=kind == END_TRUNCATED,
        cut=(m < n) & (kind == END_NONE),
    )


def sequence_rows(
    start: torch.Tensor, length: int, next_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``length`` consecutive steps from each anchor, and of their observations.

    Returns ``obs_rows [B, length + 1]`` (obs_t .. obs_{t+length}; positions past the window
    repeat the last real row) and ``mask [B, length]`` (True for steps inside the episode).
    """
    batch = start.shape[0]
    obs_rows = torch.empty((batch, length + 1), dtype=torch.long, device=start.device)
    mask = torch.empty((batch, length), dtype=torch.bool, device=start.device)
    cur = start
    active = torch.ones(batch, dtype=torch.bool, device=start.device)
    for k in range(length):
        obs_rows[:, k] = cur
        nxt = next_row.index_select(0, cur)
        if k > 0:
            active = active & (nxt >= 0)
        mask[:, k] = active
        cur = torch.where(active, nxt, cur)
    obs_rows[:, length] = cur
    return obs_rows, mask


def full_sequence_starts(
    anchors: torch.Tensor, length: int, next_row: torch.Tensor
) -> torch.Tensor:
    """The anchors from which ``length`` consecutive steps all exist (bool ``[len(anchors)]``)."""
    _, mask = sequence_rows(anchors, length, next_row)
    return mask.all(1)


def stack_rows(
    rows: torch.Tensor, k: int, prev_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the ``k``-frame stack ending at each of ``rows``, and which are real frames.

    Returns ``stacked [*rows.shape, k]`` (position k-1 is the row itself, position k-1-j the row
    j steps earlier in its episode, or the episode's first row where there is none) and
    ``real [*rows.shape, k]`` (False at those padding positions). k-1 chained gathers:
    O(rows · k), whatever the number of stored rows.
    """
    flat = rows.reshape(-1)
    cur = flat
    held, real = [flat], [torch.ones_like(flat, dtype=torch.bool)]
    for _ in range(k - 1):
        prev = prev_row.index_select(0, cur)
        has = prev >= 0  # False at the first row, and so at every position before it
        cur = torch.where(has, prev, cur)
        held.append(cur)
        real.append(has)
    shape = (*rows.shape, k)
    stacked = torch.stack(held[::-1], 1).reshape(shape)  # [*rows, k], oldest first
    return stacked, torch.stack(real[::-1], 1).reshape(shape)


def stack_windows(
    start: torch.Tensor, obs_rows: torch.Tensor, k: int, prev_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows from which the k-frame stacks of consecutive observations are cut, without overlap.

    ``obs_rows [B, P]`` are consecutive rows of one episode each, starting at ``start [B]``.
    Returns ``window [B, k - 1 + P]`` (the k-1 frames before ``start``, padded as in
    :func:`stack_rows`, then ``obs_rows``) and ``real`` of the same shape: the stack of
    ``obs_rows[:, p]`` is ``window[:, p : p + k]``. Gathering the window reads k-1+P frames per
    row instead of k·P.
    """
    before, real = stack_rows(start, k, prev_row)  # [B, k]
    ones = torch.ones_like(obs_rows, dtype=torch.bool)
    window = torch.cat([before[:, : k - 1], obs_rows], 1)  # [B, k - 1 + P]
    return window, torch.cat([real[:, : k - 1], ones], 1)
