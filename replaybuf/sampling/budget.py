"""The memory a batch will take, checked before anything is drawn or allocated.

``sample_batch(10**9)`` would otherwise allocate until the operating system kills the
process. Every sampling call of the ring and episode buffers (sync and asyncio alike) asks
:func:`ensure_batch_fits` first, after its arguments are checked and before its generator
is touched, so a refusal leaves the buffer and its random state as they were.

The bytes are an upper bound of the batch's output and the scratch that builds it: every
stored field of a sampled row (for episode batches, counted again for the next observation,
``k`` times with frame stacking), the window's rows and rewards for n-step batches, and
:data:`ROW_OVERHEAD` for the draws, ids, weights, masks and window info. Ragged rows count
their 8-byte span only (their lengths are unknown until drawn).

A batch needing under :data:`ALWAYS_FITS` bytes is never checked: reading the free memory
(``/proc/meminfo``, ``cudaMemGetInfo``) costs more than drawing a small batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from replaybuf.errors import InsufficientSpaceError
from replaybuf.storage import FieldSpec
from replaybuf.storage.space import free_bytes

ROW_OVERHEAD = 128  # bytes per sampled row beyond its fields (see the module docstring)
WINDOW_STEP = 24  # bytes per step of an n-step window: its row, validity and reward
ALWAYS_FITS = 64 << 20  # batches smaller than this are not checked


def always_fits(batch_size: int, row_bytes: int) -> bool:
    """Whether :func:`ensure_batch_fits` passes ``batch_size`` rows of ``row_bytes`` without
    reading the free memory (under :data:`ALWAYS_FITS`): then its verdict never changes."""
    return batch_size * (row_bytes + ROW_OVERHEAD) < ALWAYS_FITS


def ensure_batch_fits(
    batch_size: int, row_bytes: int, devices: Iterable[torch.device], what: str = "batch"
) -> None:
    """Raise :class:`InsufficientSpaceError` (``argument="batch_size"``) unless
    ``batch_size`` rows of ``row_bytes`` each fit in the free memory of every one of
    ``devices`` (the training device, and the storing device the draws and gathers run on).

    An ``InsufficientSpaceError`` (a ``MemoryError``) rather than an argument error: the
    same ``batch_size`` fits on a machine with more memory free, and the check is about the
    memory, as the storage's own check before allocating the rows is."""
    if always_fits(batch_size, row_bytes):
        return
    needed = batch_size * (row_bytes + ROW_OVERHEAD)
    for device in dict.fromkeys(devices):
        free = free_bytes("tensor", device, Path("."))
        if needed > free:
            where = f"{device} memory" if device.type == "cuda" else "host memory (RAM)"
            error = InsufficientSpaceError(where, needed, free, f"a {what} of {batch_size=:,}")
            error.argument = "batch_size"
            raise error


def transition_bytes(spec: FieldSpec | None, stack: int = 1, window: int = 0) -> int:
    """An upper bound of one sampled transition's bytes: every field ``2 * stack`` times
    (observations are gathered at both window ends, ``stack`` frames each; counting every
    field so keeps this one cached sum, cheap on the sampling path), plus ``window`` steps
    of an n-step window's scratch. ``spec`` None (nothing stored yet): the scratch only."""
    row = 0 if spec is None else spec.row_bytes
    return row * 2 * stack + window * WINDOW_STEP


def sequence_bytes(spec: FieldSpec | None, seq_len: int, stack: int = 1) -> int:
    """An upper bound of one sampled sequence's bytes: ``seq_len`` steps of every field
    ``stack + 1`` times (a step's frames and the next observation's) and their overhead."""
    row = 0 if spec is None else spec.row_bytes
    return seq_len * (row * (stack + 1) + ROW_OVERHEAD)
