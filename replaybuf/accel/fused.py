"""Fused CUDA kernels (Triton): the index math of n-step, frame-stacked and sequence batches.

On CUDA storage :func:`replaybuf.core.index.nstep_windows`,
:func:`replaybuf.core.nstep.window_return`
and :func:`replaybuf.core.nstep.bootstrap_discount` are ~15 small torch ops per batch,
:func:`replaybuf.core.index.stack_rows` 3 per stacked frame, and a sequence batch's draw, walk and
padding ~30. Each is a kernel launch that costs the host 6-20 µs (measured on an H200) for
about 1 µs of GPU work: a batch is bound by launches, not by the GPU. Each kernel here does
its whole job in one launch: the n-step window (with the anchor lookup and both observations'
frame stacks), the frame-stack rows of given rows, and a sequence batch's walk (with its
strict draw's choice). A fourth draws uniform places against an anchor count read on the
device (what a captured graph replays, :mod:`replaybuf.accel.graphs`), and two more draw a strict
sequence draw's unlucky slots again on the device (so that it needs no host synchronisation).

Written by hand because torch has no such op, and ``torch.compile`` recompiles for new batch
sizes and n, and takes seconds on the first batch. Triton ships with torch's CUDA builds on
Linux; without it (CPU-only builds), on GPUs it does not build for, for rewards it does not
take, or with ``REPLAYBUF_TRITON=0``, the torch ops run: the same batches for the same
anchors (returns to rounding), though the draws differ (the torch generator's, and a strict
sequence draw's rejection), as uniform. The tests compare the two, running the kernels in
Triton's interpreter on the CPU.
No ``from __future__ import annotations`` here: Triton reads the kernels' annotations.
"""

import contextlib
import functools
import math
import os
from typing import Any, NamedTuple

import torch

from replaybuf.core import discount_powers, torch_reward_powers

try:  # torch's CUDA builds bring Triton, and import it themselves: no cost here
    import triton
    import triton.language as tl
except Exception:  # ImportError without Triton; its own errors on a broken install
    triton = tl = None

TRITON_ENV = "REPLAYBUF_TRITON"  # "0": run the torch ops instead
BLOCK = 128  # anchors per program
SEQUENCE_TILE = 2048  # positions per program of the sequence kernel (slots x span)
MAX_SPAN = 4096  # positions of one slot in the sequence kernel (longer: the torch ops)
# Set before Triton is imported, Triton's interpreter runs the kernel on CPU tensors (the tests).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:  # the kernel's annotations need Triton

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

    @triton.jit
    def _sequence_kernel(
        draw_ptr,
        table_ptr,
        succ_ptr,
        kind_ptr,
        step_ptr,
        episode_ptr,
        rows_ptr,
        ints_ptr,
        flags_ptr,
        batch,
        length,
        capacity,
        TRIES: tl.constexpr,
        PICK: tl.constexpr,
        STRICT: tl.constexpr,
        SLOTS: tl.constexpr,
        SPAN: tl.constexpr,
        REPAIR: tl.constexpr,
    ):
        """Per slot: its start (``draw`` itself, or ``table[draw]`` with PICK; STRICT: the first
        of its TRIES draws with ``length`` steps ahead), its ``length + 1`` rows (index.
        sequence_rows: the last real row repeats past the episode end) and what a sequence
        batch reads of them. SLOTS slots per program, each over SPAN >= length + 1 positions.

        Following ``length`` links one by one is ``length`` dependent loads (~0.5 µs each on
        an H200). Rows of one episode are usually evenly spaced (a vectorized env appends its
        envs' steps side by side, so an episode's rows lie ``num_envs`` apart), so the walk
        guesses row_k = row_0 + k·d (d = succ[row_0] - row_0) and checks every link of the
        guess at once: the rows are right up to the first link that breaks, and past it they
        repeat the row there when it is the episode's end (a self-loop). Only a slot whose
        layout breaks elsewhere follows its links one by one, from the break.

        REPAIR: a second launch on the same outputs that walks only the slots whose strict
        tries all fell short, from the starts :func:`_pick_kernel` chose (``draw``, one per
        slot; -1 where it chose none), leaving every other slot's values as they are."""
        i = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
        live = i < batch
        if REPAIR:
            had = tl.load(flags_ptr + 4 * batch * length + i, mask=live, other=1)
            chosen = tl.load(draw_ptr + i, mask=live, other=-1)
            live = live & (had == 0) & (chosen >= 0)
        k = tl.arange(0, SPAN)
        start = tl.zeros([SLOTS], tl.int64)
        found = i < 0  # all False
        width = length + 1
        cells = batch * length  # each output plane is [batch, length]
        on_row = k[None, :] <= length  # the positions of rows
        on_step = k[None, :] < length  # the positions of steps
        for t in range(0, TRIES):
            todo = live & ~found
            candidate = tl.load(draw_ptr + i * TRIES + t, mask=todo, other=0)
            if PICK:
                candidate = tl.load(table_ptr + candidate, mask=todo, other=0)
            start = tl.where(todo, candidate, start)  # the last try holds a place
            spacing = tl.load(succ_ptr + candidate, mask=todo, other=0) - candidate
            guess = candidate[:, None] + k[None, :] * spacing[:, None]  # [SLOTS, SPAN]
            inside = (guess >= 0) & (guess < capacity)
            check = todo[:, None] & on_step & inside
            after = tl.load(succ_ptr + guess, mask=check, other=-1)
            broken = on_step & (after != guess + spacing[:, None])
            first = tl.min(tl.where(broken, k[None, :], SPAN), axis=1)  # [SLOTS]
            at_first = k[None, :] == first[:, None]
            row_there = tl.sum(tl.where(at_first, guess, 0), axis=1)
            ends_there = tl.sum(tl.where(at_first & (after == guess), 1, 0), axis=1) > 0
            rows = tl.where(k[None, :] <= first[:, None], guess, row_there[:, None])
            # A break that is not an episode end: the links are followed one by one from it,
            # and only that walk writes the rows past it (no two stores to one cell).
            walk = todo & (first < length) & ~ends_there
            out = rows_ptr + i[:, None] * width + k[None, :]
            past = walk[:, None] & (k[None, :] > first[:, None])
            tl.store(out, rows, mask=todo[:, None] & on_row & ~past)
            if tl.max(walk.to(tl.int32), axis=0) > 0:
                row = row_there
                for j in range(0, length):
                    going = walk & (j >= first)
                    nxt = tl.load(succ_ptr + row, mask=going, other=0)
                    tl.store(rows_ptr + i * width + j + 1, nxt, mask=going)
                    row = tl.where(going, nxt, row)
            tl.debug_barrier()  # the rows, then what is read of them
            rows = tl.load(out, mask=todo[:, None] & on_row, other=0)
            nexts = tl.load(out + 1, mask=todo[:, None] & on_step, other=0)
            real = nexts != rows  # False past the episode's last stored row (a self-loop)
            kind = tl.load(kind_ptr + nexts, mask=todo[:, None] & on_step, other=0)
            step = tl.load(step_ptr + rows, mask=todo[:, None] & on_step, other=0)
            episode = tl.load(episode_ptr + candidate, mask=todo, other=0)
            at = i[:, None] * length + k[None, :]
            put = todo[:, None] & on_step
            tl.store(ints_ptr + at, rows, mask=put)  # the step's own row
            tl.store(ints_ptr + cells + at, nexts, mask=put)  # its next observation's
            tl.store(ints_ptr + 2 * cells + at, tl.where(real, step, -1), mask=put)
            tl.store(ints_ptr + 3 * cells + at, tl.where(real, episode[:, None], -1), mask=put)
            tl.store(flags_ptr + at, real.to(tl.uint8), mask=put)
            tl.store(flags_ptr + cells + at, (~real).to(tl.uint8), mask=put)
            tl.store(flags_ptr + 2 * cells + at, (real & (kind == 1)).to(tl.uint8), mask=put)
            tl.store(flags_ptr + 3 * cells + at, (real & (kind == 2)).to(tl.uint8), mask=put)
            # STRICT: index.full_sequence_starts, the walk still moved at its last step
            last = tl.sum(tl.where(k[None, :] == length - 1, real.to(tl.int32), 0), axis=1) > 0
            found = found | (todo & last) if STRICT else live
        tl.store(flags_ptr + 4 * cells + i, found.to(tl.uint8), mask=live)
        tl.store(ints_ptr + 4 * cells + i, start, mask=live)

    @triton.jit
    def _full_steps(rows, mask, length, succ_ptr):
        """Whether each of ``rows`` has ``length`` steps ahead in its episode: its walk still
        moves at its last link (:func:`replaybuf.core.index.full_sequence_starts`). One value is
        carried through the loop: a loop that also carried the previous row, started from
        the same value, counted every anchor as qualifying when Triton 3.6 compiled it for an
        H200 (not in the interpreter)."""
        row = rows
        for _step in range(1, length):  # to the step before the last
            row = tl.load(succ_ptr + row, mask=mask, other=0)
        after = tl.load(succ_ptr + row, mask=mask, other=0)
        return mask & (after != row)

    @triton.jit
    def _missing(found_ptr, batch, BLOCK: tl.constexpr):
        """How many slots of a strict draw found no start."""
        missing = tl.zeros([], tl.int32)
        for first in range(0, batch, BLOCK):
            j = first + tl.arange(0, BLOCK)
            found = tl.load(found_ptr + j, mask=j < batch, other=1)
            missing += tl.sum((found == 0).to(tl.int32), axis=0)
        return missing

    @triton.jit
    def _share(count_ptr, part, PARTS: tl.constexpr):
        """The places ``[low, high)`` of the packed anchor rows that part ``part`` of PARTS
        scans (the anchor count read on the device)."""
        count = tl.load(count_ptr)
        size = (count + PARTS - 1) // PARTS
        low = part * size
        return low, tl.minimum(low + size, count)

    @triton.jit
    def _count_full_kernel(
        found_ptr, table_ptr, count_ptr, succ_ptr, counts_ptr, batch, length,
        PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Per part of the packed anchor rows: how many have ``length`` steps ahead, counted
        only where some slot of the strict draw found no start (else 0: an empty scan)."""
        part = tl.program_id(0)
        low, high = _share(count_ptr, part, PARTS)
        high = tl.where(_missing(found_ptr, batch, BLOCK) > 0, high, low)
        total = tl.zeros([], tl.int32)
        for first in range(low, high, BLOCK):
            place = first + tl.arange(0, BLOCK)
            inside = place < high
            rows = tl.load(table_ptr + place, mask=inside, other=0)
            total += tl.sum(_full_steps(rows, inside, length, succ_ptr).to(tl.int32), axis=0)
        tl.store(counts_ptr + part, total)

    @triton.jit
    def _pick_kernel(
        found_ptr, table_ptr, count_ptr, succ_ptr, counts_ptr, rounds_ptr, picks_ptr, seed,
        length, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Per slot whose strict tries all fell short: an anchor drawn uniformly among those
        with ``length`` steps ahead (the k-th of them in table order, k from Philox's bits for
        (slot, round) in a lane the draws leave alone, modulo their count); -1 for the other
        slots, and where no anchor has (the host checks first that one has). Masks, not
        branches: every slot reads the counts, and only the ones to pick scan."""
        slot = tl.program_id(0)
        parts = tl.arange(0, PARTS)
        counts = tl.load(counts_ptr + parts).to(tl.int64)
        full = tl.sum(counts, axis=0)
        need = (tl.load(found_ptr + slot) == 0) & (full > 0)
        round_ = tl.load(rounds_ptr)
        lane = slot.to(tl.uint32)
        a, b, _, _ = tl.philox(
            seed, lane, round_.to(tl.uint32), (round_ >> 32).to(tl.uint32), lane * 0 + 1
        )
        bits = (a.to(tl.uint64) | (b.to(tl.uint64) << 32)) >> 1
        k = (bits % tl.maximum(full, 1).to(tl.uint64)).to(tl.int64)
        ends = tl.cumsum(counts, axis=0)
        part = tl.sum((ends <= k).to(tl.int32), axis=0)  # the part holding the k-th
        k -= tl.sum(tl.where(parts < part, counts, 0), axis=0)  # its rank in there
        low, high = _share(count_ptr, part, PARTS)
        high = tl.where(need, high, low)
        pick = tl.full([], -1, tl.int64)
        seen = tl.zeros([], tl.int64)
        for first in range(low, high, BLOCK):
            place = first + tl.arange(0, BLOCK)
            inside = (place < high) & (seen <= k)
            rows = tl.load(table_ptr + place, mask=inside, other=0)
            full_here = _full_steps(rows, inside, length, succ_ptr)
            rank = seen + tl.cumsum(full_here.to(tl.int64), axis=0) - 1
            hit = full_here & (rank == k)
            got = tl.sum(hit.to(tl.int32), axis=0) > 0
            pick = tl.where(got, tl.sum(tl.where(hit, rows, 0), axis=0), pick)
            seen += tl.sum(full_here.to(tl.int64), axis=0)
        tl.store(picks_ptr + slot, pick)

    @triton.jit
    def _draw_kernel(rounds_ptr, count_ptr, out_ptr, total, seed, BLOCK: tl.constexpr):
        """Per slot: Philox's 64 bits for (slot, round) under ``seed`` modulo the count, both
        read on the device (the round is the number of draws before this one)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < total
        round_ = tl.load(rounds_ptr)
        count = tl.load(count_ptr).to(tl.uint64)
        zero = i.to(tl.uint32) * 0
        low = zero + round_.to(tl.uint32)
        high = zero + (round_ >> 32).to(tl.uint32)
        a, b, _, _ = tl.philox(seed, i.to(tl.uint32), low, high, zero)
        bits = a.to(tl.uint64) | (b.to(tl.uint64) << 32)
        tl.store(out_ptr + i, (bits % count).to(tl.int64), mask=live)


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
    if not _runs_on(start) or n_max < 1:
        return None
    if rewards.dim() != 1 or rewards.dtype not in (torch.float32, torch.float64):
        return None
    if not rewards.is_contiguous() or not _long_columns(start):
        return None
    columns = (links.succ, links.end_kind, links.step, links.episode)
    if not _long_columns(*columns):  # the kernel writes step and episode as int64
        return None
    k = frame_stack or 0
    prev_row = links.prev_row if k else start  # unread without frame stacking
    if not _long_columns(prev_row, *(() if table is None else (table,))):
        return None
    batch = start.shape[0]
    if not _int32_offsets((5 + 2 * k) * batch):
        return None
    per_sample = isinstance(n_each, torch.Tensor)
    ints = torch.empty(5 * batch + 2 * batch * k, dtype=torch.long, device=device)
    total = torch.empty(batch, dtype=rewards.dtype, device=device)
    flags = torch.empty(3 * batch + 2 * batch * k, dtype=torch.uint8, device=device)
    discount = torch.empty(batch, dtype=torch.float32, device=device)
    if batch:
        n_column = n_each.contiguous() if per_sample else start  # unread without PER_SAMPLE
        reward_powers, discounts = powers or (
            torch_reward_powers(gamma, n_max, rewards.dtype, device),
            discount_powers(gamma, n_max, device),
        )
        with _current(device):
            _nstep_windows_kernel[(triton_cdiv(batch, BLOCK),)](
                start, start if table is None else table, n_column, *columns, prev_row,
                rewards, reward_powers, discounts, ints, total,
                flags, discount, batch, n_max if not per_sample else 0, n_max,
                PICK=table is not None, PER_SAMPLE=per_sample, ONE_STEP=n_max == 1,
                F64=rewards.dtype == torch.float64, K=k, BLOCK=BLOCK,
            )  # fmt: skip
    flag = flags.view(torch.bool)
    # unbind: one call for the planes' views (view ops cost the host ~1 µs each)
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
    if not _runs_on(rows) or not _long_columns(rows, prev_row):
        return None
    count = rows.numel()
    if not _int32_offsets(count * k):
        return None
    stacked = torch.empty((*rows.shape, k), dtype=torch.long, device=rows.device)
    real = torch.empty((*rows.shape, k), dtype=torch.uint8, device=rows.device)
    if count:
        grid = (triton_cdiv(count, BLOCK),)
        with _current(rows.device):
            _stack_rows_kernel[grid](rows, prev_row, stacked, real, count, K=k, BLOCK=BLOCK)
    return stacked, real.view(torch.bool)


class Walk(NamedTuple):
    """A sequence batch's rows and per-step values on the storing device (``[B, L]`` each
    but ``start``, ``obs_rows`` and ``found``). Past the episode's end the rows repeat its
    last real row, the flags are False and ``step`` and ``episode`` -1."""

    start: torch.Tensor  # [B] the anchors
    obs_rows: torch.Tensor  # [B, L + 1] obs_t .. obs_{t+L}, repeating the last real row
    step_rows: torch.Tensor  # [B, L] obs_rows[:, :L], contiguous
    next_rows: torch.Tensor  # [B, L] obs_rows[:, 1:], contiguous
    mask: torch.Tensor  # [B, L] bool: the step is in the episode
    pad: torch.Tensor  # [B, L] bool: ~mask
    terminal: torch.Tensor  # [B, L] bool
    truncated: torch.Tensor  # [B, L] bool
    step: torch.Tensor  # [B, L] int64, -1 past the end
    episode: torch.Tensor  # [B, L] int64, -1 past the end
    found: torch.Tensor | None  # [B] bool: a strict draw found a start (the kernel's walks)


def walks(links: Any, rows: torch.Tensor, length: int = 1) -> bool:
    """Whether :func:`sequences` takes these row links and anchor rows (or anchor table), for
    sequences of ``length``: on a device it runs on, contiguous int64, a span under MAX_SPAN
    (checked before drawing, so that a declined draw leaves the generator as it was)."""
    if length >= MAX_SPAN or not _runs_on(rows):
        return False
    return _long_columns(rows, links.succ, links.step, links.episode)


class Redraw(NamedTuple):
    """The device draws' state, which a strict draw's redraw reads on the device (a buffer's
    :class:`replaybuf.accel.graphs.BatchGraphs`): the round (the draws made so far), the anchor
    count and the Philox key."""

    rounds: torch.Tensor
    count: torch.Tensor
    seed: int


# A strict redraw's scan of the packed anchor rows: PARTS programs in parallel, each over its
# share in steps of SCAN anchors (1M anchors: one step each). Each step walks ``length`` links,
# so the scan costs ~``length`` dependent loads, paid only by a batch with a slot to redraw.
# Triton's interpreter runs each program in Python: a few parts there (the tests).
PARTS = 8 if INTERPRET else 1024
SCAN = 1024


def sequences(
    draws: torch.Tensor,
    table: torch.Tensor | None,
    length: int,
    links: Any,
    strict: bool,
    redraw: Redraw | None = None,
) -> Walk | None:
    """A sequence batch's :class:`Walk`, or None where the kernel does not apply (as
    :func:`nstep_windows`). ``draws [B, T]`` are the candidate anchors, or places in ``table``
    (the packed anchor rows) when it is given; with ``strict`` each slot takes its first
    candidate with ``length`` steps ahead, else its only one (T = 1).

    A strict slot whose T candidates all fall short has ``found`` False, and the caller draws
    it again; unless ``redraw`` is given (with ``table``, whose count it holds): then three
    more launches draw those slots again on the device, each uniformly among the anchors with
    ``length`` steps ahead, exactly (counted and picked by a scan of the table, which costs
    only when a slot needs it), so that no host synchronisation is needed. At least one anchor
    must have ``length`` steps ahead (the caller checks on the host); ``found`` is then True
    everywhere."""
    if not _long_columns(draws) or not walks(links, draws if table is None else table):
        return None
    batch, tries = draws.shape
    assert strict or tries == 1, "a draw that is not strict takes its one candidate"
    if length >= MAX_SPAN or not _int32_offsets(4 * batch * (length + 1) + batch * tries):
        return None  # a span past MAX_SPAN: the torch ops' jump tables
    device = draws.device
    cells = batch * length
    rows = torch.empty((batch, length + 1), dtype=torch.long, device=device)
    ints = torch.empty(4 * cells + batch, dtype=torch.long, device=device)
    flags = torch.empty(4 * cells + batch, dtype=torch.uint8, device=device)
    if batch:
        span, slots = sequence_tile(length)
        with _current(device):
            _sequence_kernel[(triton_cdiv(batch, slots),)](
                draws, draws if table is None else table, links.succ, links.end_kind,
                links.step, links.episode, rows, ints, flags, batch, length,
                links.succ.shape[0], TRIES=tries, PICK=table is not None, STRICT=strict,
                SLOTS=slots, SPAN=span, REPAIR=False,
            )  # fmt: skip
            if strict and redraw is not None and table is not None:
                _redraw(draws, table, length, links, redraw, rows, ints, flags)
    step_rows, next_rows, step, episode = ints[: 4 * cells].view(4, batch, length).unbind(0)
    bools = flags.view(torch.bool)
    mask, pad, terminal, truncated = bools[: 4 * cells].view(4, batch, length).unbind(0)
    start, found = ints[4 * cells :], bools[4 * cells :]
    return Walk(
        start, rows, step_rows, next_rows, mask, pad, terminal, truncated, step, episode, found
    )


def _redraw(
    draws: torch.Tensor,
    table: torch.Tensor,
    length: int,
    links: Any,
    redraw: Redraw,
    rows: torch.Tensor,
    ints: torch.Tensor,
    flags: torch.Tensor,
) -> None:
    """The slots of a strict walk that found no start, drawn again and walked in place (see
    :func:`sequences`), on the current device, which the caller made ``draws``'."""
    batch = draws.shape[0]
    found = flags[4 * batch * length :]
    counts = torch.empty(PARTS, dtype=torch.int32, device=draws.device)
    picks = torch.empty(batch, dtype=torch.long, device=draws.device)
    _count_full_kernel[(PARTS,)](
        found, table, redraw.count, links.succ, counts, batch, length, PARTS=PARTS, BLOCK=SCAN
    )
    _pick_kernel[(batch,)](
        found, table, redraw.count, links.succ, counts, redraw.rounds, picks, redraw.seed,
        length, PARTS=PARTS, BLOCK=SCAN,
    )  # fmt: skip
    span, slots = sequence_tile(length)
    _sequence_kernel[(triton_cdiv(batch, slots),)](
        picks, picks, links.succ, links.end_kind, links.step, links.episode, rows, ints, flags,
        batch, length, links.succ.shape[0], TRIES=1, PICK=False, STRICT=False, SLOTS=slots,
        SPAN=span, REPAIR=True,
    )  # fmt: skip


def sequence_tile(length: int) -> tuple[int, int]:
    """The sequence kernel's positions per slot (a power of two past ``length``) and slots
    per program (a power of two, up to 64, about SEQUENCE_TILE positions in all)."""
    span = 1 << length.bit_length()  # the least power of two > length
    return span, max(1, min(64, SEQUENCE_TILE // span))


def draw(
    rounds: torch.Tensor, count: torch.Tensor, shape: tuple[int, ...], seed: int
) -> torch.Tensor | None:
    """``shape`` uniform draws in ``[0, count)`` with the count read on the device (``count``
    and ``rounds``: int64 device scalars): Philox's 64 bits for (slot, ``rounds``) under
    ``seed``, modulo the count (a bias under count / 2^64). The caller advances ``rounds``
    after each draw; nothing is read or written on the host, so a CUDA graph can replay it
    (replaybuf.accel.graphs). None where the kernel does not run (as :func:`nstep_windows`)."""
    if not _runs_on(count) or not _long_columns(rounds, count):
        return None
    total = math.prod(shape)
    if not _int32_offsets(total):
        return None
    out = torch.empty(shape, dtype=torch.long, device=count.device)
    if total:
        with _current(count.device):
            _draw_kernel[(triton_cdiv(total, BLOCK),)](
                rounds, count, out, total, seed, BLOCK=BLOCK
            )  # fmt: skip
    return out


def _int32_offsets(cells: int) -> bool:
    """Whether a launch's output offsets (``cells`` elements per output) fit the int32 index
    arithmetic of the kernels (Triton types a Python int under 2^31 as int32)."""
    return cells < 2**31


def _long_columns(*tensors: torch.Tensor) -> bool:
    """Whether each is a contiguous int64 tensor, as the kernels read them."""
    return all(t.dtype == torch.long and t.is_contiguous() for t in tensors)


def _current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current CUDA device for a launch: Triton launches on the current
    device and its stream (storage on cuda:1 while cuda:0 is current, say)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``'s device: a GPU Triton compiles for (the CPU in the
    interpreter), with Triton there and not switched off."""
    if triton is None or os.environ.get(TRITON_ENV, "1") == "0":
        return False
    if INTERPRET:
        return tensor.device.type == "cpu"
    return tensor.device.type == "cuda" and _triton_compiles_for(tensor.device.index)


@functools.cache
def _triton_compiles_for(index: int | None) -> bool:
    """Triton builds for compute capability 7.0 (Volta) and newer; older GPUs, which torch
    still runs, keep the torch ops. AMD GPUs (ROCm builds of torch) report their own."""
    if torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(index) >= (7, 0)


def triton_cdiv(a: int, b: int) -> int:
    """Programs for ``a`` anchors at ``b`` per program."""
    return -(-a // b)
