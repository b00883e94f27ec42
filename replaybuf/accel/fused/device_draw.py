"""The device draw (Triton): uniform places against an anchor count read on the device.

What a captured CUDA graph replays (:mod:`replaybuf.accel.graphs`): the draw reads its round and
the count on the device, so no host value is baked into the graph.
No ``from __future__ import annotations`` here: Triton reads the kernel's annotations.
"""

import math

import torch

from replaybuf.accel.fused import common
from replaybuf.accel.fused.common import BLOCK, tl, triton

if triton is not None:  # the kernel's annotations need Triton

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


def draw(
    rounds: torch.Tensor, count: torch.Tensor, shape: tuple[int, ...], seed: int
) -> torch.Tensor | None:
    """``shape`` uniform draws in ``[0, count)`` with the count read on the device (``count``
    and ``rounds``: int64 device scalars): Philox's 64 bits for (slot, ``rounds``) under
    ``seed``, modulo the count (a bias under count / 2^64). The caller advances ``rounds``
    after each draw; nothing is read or written on the host, so a CUDA graph can replay it
    (replaybuf.accel.graphs). None where the kernel does not run (as
    :func:`replaybuf.accel.fused.windows.nstep_windows`)."""
    if not common.runs_on(count) or not common.long_columns(rounds, count):
        return None
    total = math.prod(shape)
    if not common.int32_offsets(total):
        return None
    out = torch.empty(shape, dtype=torch.long, device=count.device)
    if total:
        with common.current(count.device):
            _draw_kernel[(common.triton_cdiv(total, BLOCK),)](
                rounds, count, out, total, seed, BLOCK=BLOCK
            )  # fmt: skip
    return out
