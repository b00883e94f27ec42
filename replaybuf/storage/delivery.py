"""Delivery of gathered rows to the training device: plain copies, or one pinned transfer.

A batch is a list of parts, each a tensor and the rows to take from it. Towards CUDA, a batch
from CPU storage is gathered into one reusable pinned buffer and sent in one non-blocking copy
(:class:`PinnedStager`), as each host-to-device copy has a fixed cost and a copy from pageable
memory waits for all the GPU's queued work first.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# A part of a delivery: a tensor and the rows to take from it: a long tensor of rows, a slice
# of consecutive rows, or None for all of it, as is.
Part = tuple[torch.Tensor, "torch.Tensor | slice | None"]


def to_device_async(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device``. Host values bound for CUDA go through pinned memory without
    blocking: a copy from pageable memory waits for all the GPU's queued work first. PyTorch's
    pinned allocator keeps the block until the copy has run, and ``value`` may be reused at
    once (``pin_memory`` copied it)."""
    if device.type != "cuda" or value.device.type != "cpu":
        return value.to(device)
    return value.pin_memory().to(device, non_blocking=True)


def count_rows(rows: torch.Tensor | slice) -> int:
    """How many rows ``rows`` (a long tensor of rows or a slice of them) takes."""
    return rows.stop - rows.start if isinstance(rows, slice) else rows.shape[0]


def rows_of(column: torch.Tensor, rows: torch.Tensor | slice | None) -> torch.Tensor:
    """``column``'s rows as a new tensor, never a view of stored data (``rows`` None:
    ``column`` itself, a value computed for this batch)."""
    if rows is None:
        return column
    if isinstance(rows, slice):
        return column[rows].clone()
    return torch.index_select(column, 0, rows)


def _part_layout(parts: list[Part]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The shape and dtype each part takes in a delivered batch."""
    return tuple(
        ((t.shape[0] if rows is None else count_rows(rows), *t.shape[1:]), t.dtype)
        for t, rows in parts
    )


def _views(flat: torch.Tensor, offsets: list[int], layout) -> list[torch.Tensor]:
    """Typed views of a byte buffer, one per part of ``layout`` at its byte offset."""
    out = []
    for offset, (shape, dtype) in zip(offsets, layout, strict=True):
        size = math.prod(shape) * dtype.itemsize
        out.append(flat[offset : offset + size].view(dtype).view(shape))
    return out


class PinnedStager:
    """Gathers CPU rows into one reusable pinned buffer, then copies it to CUDA in one transfer.

    Every part of a batch (each field's rows, and small tensors computed on the host) lands in
    its own 64-byte-aligned slice of one pinned byte buffer, so a batch costs one non-blocking
    host-to-device copy instead of one per field; the batch's tensors are typed views of the
    device copy. Two buffers per batch layout alternate; before one is refilled we wait on the
    CUDA event recorded after its last copy, so a non-blocking copy is never overwritten
    mid-flight. Only the most recently used layouts keep their buffers (``sample_all`` on a
    growing buffer asks for a new shape each time); dropping one is safe, as PyTorch's pinned
    allocator holds a block until the copies recorded on it finish.
    """

    max_shapes = 8
    align = 64

    def __init__(self) -> None:
        # Per layout: up to two (pinned bytes, offsets, typed views of them, CUDA event).
        self._sets: dict[tuple, list[tuple[torch.Tensor, list[int], list[torch.Tensor], Any]]] = {}
        self._turn: dict[tuple, int] = {}

    def clear(self) -> None:
        """Drop every buffer (a closed storage keeps no pinned memory)."""
        self._sets.clear()
        self._turn.clear()

    def deliver(self, parts: list[Part], device: torch.device) -> list[torch.Tensor]:
        """Each part's rows (or the part itself) as a tensor on CUDA ``device``."""
        layout = _part_layout(parts)
        signature = (device, layout)
        sets = self._sets.pop(signature, [])
        self._sets[signature] = sets  # most recently used last
        if len(self._sets) > self.max_shapes:
            oldest = next(iter(self._sets))
            del self._sets[oldest]
            self._turn.pop(oldest, None)
        turn = self._turn.get(signature, 0)
        self._turn[signature] = turn ^ 1
        if len(sets) <= turn:
            offsets, size = [], 0
            for shape, dtype in layout:
                offsets.append(size)
                size += -(-math.prod(shape) * dtype.itemsize // self.align) * self.align
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            sets.append((host, offsets, _views(host, offsets, layout), None))
        host, offsets, views, event = sets[turn]
        if event is not None:
            event.synchronize()
        for (t, rows), view in zip(parts, views, strict=True):
            if rows is None:
                view.copy_(t)
            elif isinstance(rows, slice):
                view.copy_(t[rows])
            else:
                torch.index_select(t, 0, rows, out=view)
        with torch.cuda.device(device):
            flat = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        sets[turn] = (host, offsets, views, event)
        return _views(flat, offsets, layout)
