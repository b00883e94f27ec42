"""The strict sequence draw's redraw on the device (Triton): the slots whose candidates all fell
short, each drawn again uniformly among the anchors with ``length`` steps ahead.

Two launches: one counts, per part of the packed anchor rows, the anchors with ``length`` steps
ahead; one picks, per slot to redraw, the k-th of them (k from Philox's bits). Both scan the
table only where some slot needs it, so a batch with none pays two empty launches. The walk of
the picked anchors is the sequence kernel's (:mod:`replaybuf.accel.fused.sequence_walk`).
Launchers read PARTS and SCAN from this module at call time (the tests shrink them).
No ``from __future__ import annotations`` here: Triton reads the kernels' annotations.
"""

from typing import NamedTuple

import torch

from replaybuf.accel.fused.common import INTERPRET, tl, triton


class Redraw(NamedTuple):
    """The device draws' state, which a strict draw's redraw reads on the device (a buffer's
    :class:`replaybuf.accel.graphs.BatchGraphs`): the round (the draws made so far), the anchor
    count and the Philox key."""

    rounds: torch.Tensor
    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, which nothing calls
    seed: int


# A strict redraw's scan of the packed anchor rows: PARTS programs in parallel, each over its
# share in steps of SCAN anchors (1M anchors: one step each). Each step walks ``length`` links,
# so the scan costs ~``length`` dependent loads, paid only by a batch with a slot to redraw.
# Triton's interpreter runs each program in Python: a few parts there (the tests).
PARTS = 8 if INTERPRET else 1024
SCAN = 1024


if triton is not None:  # the kernels' annotations need Triton

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


def pick_full(
    found: torch.Tensor, table: torch.Tensor, length: int, succ: torch.Tensor, redraw: Redraw
) -> torch.Tensor:
    """Per slot of a strict walk whose ``found`` is False: an anchor row drawn uniformly among
    the packed anchor rows ``table`` with ``length`` steps ahead along ``succ``; -1 for the other
    slots (``[B]`` int64). Launched on the current device, which the caller made ``found``'s."""
    batch = found.shape[0]
    counts = torch.empty(PARTS, dtype=torch.int32, device=found.device)
    picks = torch.empty(batch, dtype=torch.long, device=found.device)
    _count_full_kernel[(PARTS,)](
        found, table, redraw.count, succ, counts, batch, length, PARTS=PARTS, BLOCK=SCAN
    )
    _pick_kernel[(batch,)](
        found, table, redraw.count, succ, counts, redraw.rounds, picks, redraw.seed,
        length, PARTS=PARTS, BLOCK=SCAN,
    )  # fmt: skip
    return picks
