"""The fused n-step window and frame-stack kernels (Triton) and their launchers.

On CUDA storage :func:`replaybuf.core.index.nstep_windows`,
:func:`replaybuf.core.nstep.window_return` and :func:`replaybuf.core.nstep.bootstrap_discount`
are ~15 small torch ops per batch, and :func:`replaybuf.core.index.stack_rows` 3 per stacked
frame. :func:`nstep_windows` does the whole window in one launch (with the anchor lookup and both
observations' frame stacks), :func:`stack_rows` the frame-stack rows of given rows.
No ``from __future__ import annotations`` here: Triton reads the kernels' annotations.
"""

from typing import Any

import torch

from replaybuf.accel.fused import common
from replaybuf.accel.fused.common import BLOCK, tl, triton
from replaybuf.core import discount_powers, torch_reward_powers

if triton is not None:  # the kernels' annotations need Triton

    @triton.jit
    def _stack(row, live, prev_ptr, stacked_ptr, real_ptr, K: tl.constexpr):
        """The k-frame stack ending at each ``row``: its rows, oldest first, each a step back
        along ``prev_row`` until the episode's first row, which then repeats (index.stack_rows),
        written at ``stacked_ptr`` and ``real_ptr`` (the K cells of each row)."""
        tl.store(stacked_ptr + (K - 1), row, mask=live)
        tl.store(real_ptr + (K - 1), tl.full(row.shape, 1, tl.uint8), mask=live)
        for j in tl.static_range(1, K):
            prev = tl.load(prev_ptr + row, mask=live, other=-1)
            has = prev >= 0  # False at the first row, and so at every position before it
            row = tl.where(has, prev, row)
            tl.store(stacked_ptr + (K - 1 - j), row, mask=live)
            tl.store(real_ptr + (K - 1 - j), has.to(tl.uint8), mask=live)

    @triton.jit
    def _nstep_windows_kernel(
        start_ptr,
        table_ptr,
        n_ptr,
        succ_ptr,
        kind_ptr,
        step_ptr,
        episode_ptr,
        prev_ptr,
        reward_ptr,
        reward_powers_ptr,
        discount_powers_ptr,
        ints_ptr,
        return_ptr,
        flags_ptr,
        discount_ptr,
        batch,
        n_fixed,
        n_max,
        PICK: tl.constexpr,  # the compile-time arguments
        PER_SAMPLE: tl.constexpr,
        ONE_STEP: tl.constexpr,
        F64: tl.constexpr,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Per anchor (``table[start]`` with PICK): follow ``succ`` for up to n steps while the
        row changes (index.Windows), summing γ^k r; then the last row's end kind, γ^m, the
        anchor's step and episode; with K > 0 the K-frame stacks of both observations."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < batch
        first = tl.load(start_ptr + i, mask=live, other=0)
        if PICK:
            first = tl.load(table_ptr + first, mask=live, other=0)
        if PER_SAMPLE:
            n = tl.load(n_ptr + i, mask=live, other=0)
        else:
            n = tl.zeros([BLOCK], tl.int64) + n_fixed
        total = tl.zeros([BLOCK], tl.float64 if F64 else tl.float32)
        row = first
        m = tl.zeros([BLOCK], tl.int64)
        going = live
        for k in range(0, n_max):
            after = tl.load(succ_ptr + row, mask=live, other=0)
            # A self-loop (the episode's last stored row) or step n ends the window; with
            # n = 1 every anchor has a next row (as index.nstep_windows).
            valid = live if ONE_STEP else going & (after != row) & (k < n)
            reward = tl.load(reward_ptr + row, mask=valid, other=0.0)
            weight = tl.load(reward_powers_ptr + k)
            total += tl.where(valid, reward * weight, 0.0)  # select: a NaN outside stays out
            m += valid.to(tl.int64)
            row = tl.where(valid, after, row)
            going = valid
        kind = tl.load(kind_ptr + row, mask=live, other=0)
        terminal = kind == 1  # index.END_TERMINATED
        # index.END_NONE: no newer observation yet (never with m = n = 1)
        cut = kind < 0 if ONE_STEP else (m < n) & (kind == 0)
        discount = tl.load(discount_powers_ptr + m, mask=live, other=0.0)
        discount = tl.where(terminal, 0.0, discount)
        tl.store(ints_ptr + i, first, mask=live)
        tl.store(ints_ptr + batch + i, row, mask=live)
        tl.store(ints_ptr + 2 * batch + i, m, mask=live)
        tl.store(ints_ptr + 3 * batch + i, tl.load(step_ptr + first, mask=live), mask=live)
        tl.store(ints_ptr + 4 * batch + i, tl.load(episode_ptr + first, mask=live), mask=live)
        tl.store(return_ptr + i, total, mask=live)
        tl.store(flags_ptr + i, terminal.to(tl.uint8), mask=live)
        tl.store(flags_ptr + batch + i, (kind == 2).to(tl.uint8), mask=live)  # END_TRUNCATED
        tl.store(flags_ptr + 2 * batch + i, cut.to(tl.uint8), mask=live)
        tl.store(discount_ptr + i, discount, mask=live)
        if K > 0:  # after the five int planes: the stacks of the 2B observations, K cells each
            stacks = ints_ptr + 5 * batch
            reals = flags_ptr + 3 * batch
            _stack(first, live, prev_ptr, stacks + i * K, reals + i * K, K)
            _stack(row, live, prev_ptr, stacks + (batch + i) * K, reals + (batch + i) * K, K)

    @triton.jit
    def _stack_rows_kernel(
        rows_ptr, prev_ptr, stacked_ptr, real_ptr, count, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Per row: the rows of its k-frame stack (:func:`_stack`)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < count
        row = tl.load(rows_ptr + i, mask=live, other=0)
        _stack(row, live, prev_ptr, stacked_ptr + i * K, real_ptr + i * K, K)


def nstep_windows(
    start: torch.Tensor,
    n_each: torch.Tensor | int,
    n_max: int,
    gamma: float,
    links: Any,
    rewards: torch.Tensor,
    table: torch.Tensor | None = None,
    frame_stack: int | None = None,
    powers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None:
    """``sampling._window_values`` on the storing device in one launch: the rows of both
    observations (``[2B]``), the values from ``reward`` to ``episode_id``, and with
    ``frame_stack=k`` the k-frame stacks of both observations (``stacked`` and ``real``,
    ``[2B, k]``, as :func:`stack_rows`); or None where it does not apply (no Triton, CPU
    tensors, a reward that is not 1-D float32 or float64, index columns that are not
    contiguous int64, outputs past int32 offsets). ``table``: ``start`` holds places in it
    (the packed anchor rows), looked up in the kernel. ``powers``: the reward and discount
    powers to read (a captured graph's, kept alive with it), else looked up in their caches."""
    device = start.device
    if not common.runs_on(start) or n_max < 1:
        return None
    if rewards.dim() != 1 or rewards.dtype not in (torch.float32, torch.float64):
        return None
    if not rewards.is_contiguous() or not common.long_columns(start):
        return None
    columns = (links.succ, links.end_kind, links.step, links.episode)
    if not common.long_columns(*columns):  # the kernel writes step and episode as int64
        return None
    k = frame_stack or 0
    prev_row = links.prev_row if k else start  # unread without frame stacking
    if not common.long_columns(prev_row, *(() if table is None else (table,))):
        return None
    batch = start.shape[0]
    if not common.int32_offsets((5 + 2 * k) * batch):
        return None
    per_sample = isinstance(n_each, torch.Tensor)
    ints = torch.empty(5 * batch + 2 * batch * k, dtype=torch.long, device=device)
    total = torch.empty(batch, dtype=rewards.dtype, device=device)
    flags = torch.empty(3 * batch + 2 * batch * k, dtype=torch.uint8, device=device)
    discount = torch.empty(batch, dtype=torch.float32, device=device)
    if batch:
        # start is unread without PER_SAMPLE. n_each is a tensor when per_sample, a test mypy
        # cannot follow through the flag.
        n_column = n_each.contiguous() if per_sample else start  # type: ignore[union-attr]
        reward_powers, discounts = powers or (
            torch_reward_powers(gamma, n_max, rewards.dtype, device),
            discount_powers(gamma, n_max, device),
        )
        with common.current(device):
            _nstep_windows_kernel[(common.triton_cdiv(batch, BLOCK),)](
                start, start if table is None else table, n_column, *columns, prev_row,
                rewards, reward_powers, discounts, ints, total,
                flags, discount, batch, n_max if not per_sample else 0, n_max,
                PICK=table is not None, PER_SAMPLE=per_sample, ONE_STEP=n_max == 1,
                F64=rewards.dtype == torch.float64, K=k, BLOCK=BLOCK,
            )  # fmt: skip
    flag = flags.view(torch.bool)
    # unbind: one call for the planes' views (each view op is a host call of its own)
    _, _, m, step, episode = ints[: 5 * batch].view(5, batch).unbind(0)
    terminal, truncated, cut = flag[: 3 * batch].view(3, batch).unbind(0)
    values = [total, terminal, truncated, cut, discount, m, step, episode]
    stacks = None
    if k:
        stacks = ints[5 * batch :].view(2 * batch, k), flag[3 * batch :].view(2 * batch, k)
    return ints[: 2 * batch], values, stacks


def stack_rows(
    rows: torch.Tensor, k: int, prev_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`replaybuf.core.index.stack_rows` in one launch (``stacked`` and ``real``,
    ``[*rows.shape, k]``), or None where it does not apply (as :func:`nstep_windows`)."""
    if not common.runs_on(rows) or not common.long_columns(rows, prev_row):
        return None
    count = rows.numel()
    if not common.int32_offsets(count * k):
        return None
    stacked = torch.empty((*rows.shape, k), dtype=torch.long, device=rows.device)
    real = torch.empty((*rows.shape, k), dtype=torch.uint8, device=rows.device)
    if count:
        grid = (common.triton_cdiv(count, BLOCK),)
        with common.current(rows.device):
            _stack_rows_kernel[grid](rows, prev_row, stacked, real, count, K=k, BLOCK=BLOCK)
    return stacked, real.view(torch.bool)
