"""Fused CUDA kernels (Triton): the index math of n-step, frame-stacked and sequence batches.

On CUDA storage :func:`replaybuf.core.index.nstep_windows`,
:func:`replaybuf.core.nstep.window_return` and :func:`replaybuf.core.nstep.bootstrap_discount`
are ~15 small torch ops per batch, :func:`replaybuf.core.index.stack_rows` 3 per stacked frame,
and a sequence batch's draw, walk and padding ~30. Each op is a kernel launch whose host cost is
many times its GPU work: a batch is bound by launches, not by the GPU. Each kernel here does its
whole job in one launch:

- :mod:`~replaybuf.accel.fused.windows`: the n-step window (with the anchor lookup and both
  observations' frame stacks), and the frame-stack rows of given rows;
- :mod:`~replaybuf.accel.fused.sequence_walk`: a sequence batch's walk (with its strict draw's
  choice);
- :mod:`~replaybuf.accel.fused.device_draw`: uniform places against an anchor count read on the
  device (what a captured graph replays, :mod:`replaybuf.accel.graphs`);
- :mod:`~replaybuf.accel.fused.strict_redraw`: a strict sequence draw's unlucky slots drawn again
  on the device (so that it needs no host synchronisation);
- :mod:`~replaybuf.accel.fused.common`: whether Triton runs here, and the launch checks.

Written by hand because torch has no such op, and ``torch.compile`` recompiles for new batch
sizes and n, and compiles for a long while on the first batch. Triton ships with torch's CUDA
builds on Linux; without it (CPU-only builds), on GPUs it does not build for, for rewards it does
not take, or with ``REPLAYBUF_TRITON=0``, the torch ops run: the same batches for the same
anchors (returns to rounding), though the draws differ (the torch generator's, and a strict
sequence draw's rejection), as uniform. The tests compare the two, running the kernels in
Triton's interpreter on the CPU.
"""

from replaybuf.accel.fused.common import BLOCK, INTERPRET, TRITON_ENV, triton_cdiv
from replaybuf.accel.fused.device_draw import draw
from replaybuf.accel.fused.sequence_walk import Walk, sequence_tile, sequences, walks
from replaybuf.accel.fused.strict_redraw import Redraw
from replaybuf.accel.fused.windows import nstep_windows, stack_rows

__all__ = [
    "BLOCK",
    "INTERPRET",
    "TRITON_ENV",
    "Redraw",
    "Walk",
    "draw",
    "nstep_windows",
    "sequence_tile",
    "sequences",
    "stack_rows",
    "triton_cdiv",
    "walks",
]
