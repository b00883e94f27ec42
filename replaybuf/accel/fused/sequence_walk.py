"""The fused sequence kernel (Triton) and its launcher: a sequence batch's walk in one launch.

On CUDA storage a sequence batch's draw, walk and padding are ~30 small torch ops.
:func:`sequences` walks the anchors' rows, with a strict draw's choice among each slot's
candidates, in one launch; with a :class:`~replaybuf.accel.fused.strict_redraw.Redraw` it also
draws the slots whose candidates all fell short again on the device, so that the batch needs
no host synchronisation.
No ``from __future__ import annotations`` here: Triton reads the kernels' annotations.
"""

from typing import Any, NamedTuple

import torch

from replaybuf.accel.fused import common, strict_redraw
from replaybuf.accel.fused.common import tl, triton
from replaybuf.accel.fused.strict_redraw import Redraw

SEQUENCE_TILE = 2048  # positions per program of the sequence kernel (slots x span)
MAX_SPAN = 4096  # positions of one slot in the sequence kernel (longer: the torch ops)


if triton is not None:  # the kernel's annotations need Triton

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

        Following ``length`` links one by one is ``length`` dependent loads, each waiting for
        the one before. Rows of one episode are usually evenly spaced (a vectorized env appends
        its envs' steps side by side, so an episode's rows lie ``num_envs`` apart), so the walk
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
    if length >= MAX_SPAN or not common.runs_on(rows):
        return False
    return common.long_columns(rows, links.succ, links.step, links.episode)


def sequences(
    draws: torch.Tensor,
    table: torch.Tensor | None,
    length: int,
    links: Any,
    strict: bool,
    redraw: Redraw | None = None,
) -> Walk | None:
    """A sequence batch's :class:`Walk`, or None where the kernel does not apply (as
    :func:`~replaybuf.accel.fused.windows.nstep_windows`). ``draws [B, T]`` are the candidate
    anchors, or places in ``table`` (the packed anchor rows) when it is given; with ``strict``
    each slot takes its first candidate with ``length`` steps ahead, else its only one (T = 1).

    A strict slot whose T candidates all fall short has ``found`` False, and the caller draws
    it again; unless ``redraw`` is given (with ``table``, whose count it holds): then three
    more launches draw those slots again on the device, each uniformly among the anchors with
    ``length`` steps ahead, exactly (counted and picked by a scan of the table, which costs
    only when a slot needs it), so that no host synchronisation is needed. At least one anchor
    must have ``length`` steps ahead (the caller checks on the host); ``found`` is then True
    everywhere."""
    if not common.long_columns(draws) or not walks(links, draws if table is None else table):
        return None
    batch, tries = draws.shape
    assert strict or tries == 1, "a draw that is not strict takes its one candidate"
    if length >= MAX_SPAN or not common.int32_offsets(4 * batch * (length + 1) + batch * tries):
        return None  # a span past MAX_SPAN: the torch ops' jump tables
    device = draws.device
    cells = batch * length
    rows = torch.empty((batch, length + 1), dtype=torch.long, device=device)
    ints = torch.empty(4 * cells + batch, dtype=torch.long, device=device)
    flags = torch.empty(4 * cells + batch, dtype=torch.uint8, device=device)
    if batch:
        span, slots = sequence_tile(length)
        with common.current(device):
            _sequence_kernel[(common.triton_cdiv(batch, slots),)](
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
    picks = strict_redraw.pick_full(found, table, length, links.succ, redraw)
    span, slots = sequence_tile(length)
    _sequence_kernel[(common.triton_cdiv(batch, slots),)](
        picks, picks, links.succ, links.end_kind, links.step, links.episode, rows, ints, flags,
        batch, length, links.succ.shape[0], TRIES=1, PICK=False, STRICT=False, SLOTS=slots,
        SPAN=span, REPAIR=True,
    )  # fmt: skip


def sequence_tile(length: int) -> tuple[int, int]:
    """The sequence kernel's positions per slot (a power of two past ``length``) and slots
    per program (a power of two, up to 64, about SEQUENCE_TILE positions in all)."""
    span = 1 << length.bit_length()  # the least power of two > length
    return span, max(1, min(64, SEQUENCE_TILE // span))
