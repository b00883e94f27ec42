"""Captured CUDA graphs of a batch's device work: its launches replayed as one.

On CUDA storage a uniform n-step or sequence batch is 4-10 launches (the draw, the fused
Triton kernel, one gather per field, padding), and each costs the host many times the GPU work
it launches: the batch waits on Python, not on the GPU. A CUDA graph of that work replays it in
one launch. Written by hand: TorchRL samples without graphs, and
``torch.compile(mode="reduce-overhead")`` recompiles per batch size and compiles for a long
while on a first batch.

What a replay must not get wrong, and how it does not:

- The graph reads the tensors it saw at capture (storage columns, row links, the anchor table)
  at their addresses. The caller names them (``inputs``); an entry keeps them alive (no read
  after free) and a replay whose inputs moved (a reallocation, a restore) captures again.
- What changes between batches is read on the device: the anchor count is a device scalar,
  rewritten in stream order when it changed, and the draws are Philox bits for (slot, round)
  under the buffer's seed (:func:`replaybuf.accel.fused.draw`), where the round is a device counter
  the graph itself advances. A replay writes nothing from the host (a torch generator in a
  graph costs two launches per replay, for its seed and offset).
- Its outputs are static buffers that every replay rewrites. The graph packs them into one
  byte buffer (each dtype's outputs together, aligned), which is cloned after the replay (one
  copy); the values handed out are views of the clone, so a batch the caller keeps never
  changes.
- A key is captured the third time it is asked for (a one-off batch size never pays for a
  capture), at most :data:`LIMIT` graphs are kept (least recently used dropped; a key dropped
  twice is not captured again), and a key whose capture failed (an op that cannot be
  captured: a warning says which) is never tried again.
- Replays and draws on another stream than the last one wait for it: every graph shares the
  count, the round and (per key) its static outputs.

``REPLAYBUF_CUDA_GRAPHS=0`` switches graphs off.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from replaybuf.accel import fused

GRAPHS_ENV = "REPLAYBUF_CUDA_GRAPHS"  # "0": never capture
CAPTURE_AT = 3  # a key is captured the third time it is asked for
LIMIT = 8  # graphs kept per buffer
# Batches above this many bytes run uncaptured: the launches a graph saves weigh nothing
# beside their copies, and a graph holds its outputs twice (static and packed).
MAX_BYTES = 64 << 20
ALIGN = 16  # bytes: each dtype's part of the packed buffer starts at a multiple of this

Build = Callable[[], tuple[Any, list[torch.Tensor]]]  # (meta, outputs) of one batch
# Where each dtype's outputs lie in the packed bytes: (dtype, first byte, end byte, the
# outputs' sizes in elements, their shapes, their places in the output list).
Part = tuple[torch.dtype, int, int, list[int], list[torch.Size], list[int]]


class NotCapturable(Exception):
    """Raised by a build whose work cannot be graphed (a path that reads host state)."""


@dataclass
class _Entry:
    graph: Any  # torch.cuda.CUDAGraph (or the tests' stand-in)
    inputs: tuple[torch.Tensor, ...]  # kept alive: the graph reads them
    signature: tuple[int, ...]
    meta: Any
    packed: torch.Tensor  # the static outputs' bytes (uint8)
    parts: list[Part]
    outputs: int  # how many


class BatchGraphs:
    """One buffer's captured batch graphs, by key (what the batch asks for), and the device
    draws they replay (which the buffer's uncaptured batches make too, so that a batch does
    not depend on whether a graph served it)."""

    def __init__(self, device: torch.device, seed: int, rounds: int = 0) -> None:
        self.device = device
        self.seed = seed  # the draws' Philox key (under 2^63)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # the anchor count
        self.rounds = torch.full((), rounds, dtype=torch.long, device=device)  # draws so far
        self._count = 0  # what count holds (its writes are stream-ordered, never read back)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._asked: dict[Hashable, int] = {}
        self._evicted: dict[Hashable, int] = {}
        self._failed: set[Hashable] = set()
        self._lock = threading.Lock()
        # The stream of the last replay or draw: count, rounds and the static outputs are
        # shared by every graph, so work on another stream waits for it (rare: kept as a
        # torch stream, which also keeps a stream made by torch alive).
        self._stream: torch.cuda.Stream | None = None
        self._stream_handle: int | None = None

    @staticmethod
    def enabled(device: torch.device) -> bool:
        """Whether batches on ``device`` may be graphed (CUDA, not switched off)."""
        return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0"

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniform places in ``[0, count)``, ``shape`` of them (:func:`replaybuf.accel.fused.draw`),
        then the round advanced: both on the device, so a graph replays them."""
        places = fused.draw(self.rounds, self.count, shape, self.seed)
        if places is None:
            raise NotCapturable("the draw kernel does not run here")
        self.rounds.add_(1)
        return places

    @property
    def redraw(self) -> fused.Redraw:
        """What a strict sequence draw's redraw reads on the device (its round and count)."""
        return fused.Redraw(self.rounds, self.count, self.seed)

    def places(self, shape: tuple[int, ...], count: int) -> torch.Tensor | None:
        """:meth:`draw` outside any graph (``count``: the anchor count now), or None where the
        draw kernel does not run (no Triton, switched off)."""
        with self._lock:
            self._order_after_last()
            self._write_count(count)
            try:
                return self.draw(shape)
            except NotCapturable:
                return None

    def round(self) -> int:
        """The draws made so far (reads the device: for checkpoints)."""
        with self._lock:
            return int(self.rounds)

    def run(
        self, key: Hashable, inputs: Sequence[torch.Tensor], count: int, build: Build
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """The batch of ``build`` by a replay of its graph: ``build``'s meta and fresh copies
        of its outputs; None where this key is not (or cannot be) graphed, and the caller runs
        its work itself. ``count``: the anchor count :meth:`draw` reads."""
        if key in self._failed:
            return None
        inputs = tuple(inputs)
        signature = tuple(t.data_ptr() for t in inputs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.signature != signature:
                self._drop(key)  # an input moved: capture again, from now
                entry = None
            if entry is None:
                asked = self._asked[key] = self._asked.get(key, 0) + 1
                if asked < CAPTURE_AT:
                    return None
            self._order_after_last()
            self._write_count(count)
            if entry is None:
                entry = self._capture(key, inputs, signature, build)
                if entry is None:
                    return None
            else:
                self._entries.move_to_end(key)
                entry.graph.replay()
            return entry.meta, _unpack(entry)

    def clear(self) -> None:
        """Drop every graph (their memory goes back to torch's allocator)."""
        with self._lock:
            for key in list(self._entries):
                self._drop(key)
            self._asked.clear()

    def _order_after_last(self) -> None:
        """Order the current stream after the last replay's or draw's (a no-op on the same
        stream: one handle read)."""
        handle = _raw_stream(self.device)
        if handle is None or handle == self._stream_handle:
            return
        current = torch.cuda.current_stream(self.device)
        if self._stream is not None:
            current.wait_stream(self._stream)
        self._stream, self._stream_handle = current, handle

    def _write_count(self, count: int) -> None:
        if count != self._count:
            self.count.fill_(count)  # a launch, in stream order with the replays
            self._count = count

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        reset = getattr(entry.graph, "reset", None)
        if reset is not None:
            reset()

    def _capture(
        self, key: Hashable, inputs: tuple[torch.Tensor, ...], signature: tuple[int, ...],
        build: Build,
    ) -> _Entry | None:  # fmt: skip
        """Capture ``build`` (after one run outside the graph: kernels compiled, caches
        filled) and replay it once; None, and the key marked failed, where it cannot be."""
        try:
            entry = _capture(self.device, build, inputs, signature, self.rounds)
        except NotCapturable:  # a path that reads the host (the kernels declined, say)
            entry = None
        except torch.cuda.OutOfMemoryError:
            raise  # the uncaptured batch would need the memory too: the caller should know
        except RuntimeError as error:  # CUDA refused an op during capture
            warnings.warn(
                f"replaybuf: batches {key!r} run without a CUDA graph: {error}",
                RuntimeWarning,
                stacklevel=4,
            )
            entry = None
        if entry is None:
            self._failed.add(key)
            return None
        self._entries[key] = entry
        while len(self._entries) > LIMIT:
            # Least recently used out; a key evicted twice (more keys in turn than LIMIT)
            # stops being graphed rather than being captured again and again.
            evicted = next(iter(self._entries))
            self._drop(evicted)
            self._asked.pop(evicted, None)
            self._evicted[evicted] = self._evicted.get(evicted, 0) + 1
            if self._evicted[evicted] >= 2:
                self._failed.add(evicted)
        return entry


def _capture(
    device: torch.device,
    build: Build,
    inputs: tuple[torch.Tensor, ...],
    signature: tuple[int, ...],
    rounds: torch.Tensor,
) -> _Entry | None:
    """A captured, once-replayed graph of ``build`` (its draws advance ``rounds``); None when
    its outputs are too large."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # capture needs a stream other than the default one
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            if warm_up(build, rounds) > MAX_BYTES:
                return None
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                meta, outputs = build()
                packed, parts = _pack(outputs)
            finally:
                graph.capture_end()
            count = len(outputs)
            del outputs  # what the packed copy holds
            graph.replay()
    finally:  # the side stream's work (a draw's round at least) before anything after
        current.wait_stream(side)
    return _Entry(graph, inputs, signature, meta, packed, parts, count)


def warm_up(build: Build, rounds: torch.Tensor) -> int:
    """Run ``build`` once outside any graph (its kernels compiled, caches filled) and return
    its outputs' bytes, leaving the draws' round as it was: the replay after the capture makes
    this batch's draw, the one an uncaptured batch would have made."""
    before = rounds.clone()
    _, outputs = build()
    rounds.copy_(before)
    return sum(t.numel() * t.element_size() for t in outputs)


def _pack(outputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[Part]]:
    """``outputs``' bytes in one uint8 tensor, each dtype's together from a multiple of
    :data:`ALIGN` (one ``cat``), and where they lie."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, value in enumerate(outputs):
        by_dtype.setdefault(value.dtype, []).append(i)
    pieces: list[torch.Tensor] = []
    parts: list[Part] = []
    end = 0
    for dtype, places in by_dtype.items():
        values = [outputs[i] for i in places]
        first = end
        for value in values:
            pieces.append(_bytes(value))
            end += value.numel() * value.element_size()
        parts.append((dtype, first, end, [v.numel() for v in values], [v.shape for v in values],
                      places))  # fmt: skip
        pad = -end % ALIGN
        if pad:
            pieces.append(torch.empty(pad, dtype=torch.uint8, device=outputs[0].device))
            end += pad
    if not pieces:
        return torch.empty(0, dtype=torch.uint8), parts
    return torch.cat(pieces), parts


def _bytes(value: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as flat bytes (a copy where it is not contiguous)."""
    return value.reshape(-1).view(torch.uint8)


def _unpack(entry: _Entry) -> list[torch.Tensor]:
    """Fresh copies of the last replay's outputs: one clone of the packed bytes, cut into
    views (per dtype a slice and a dtype view, then one ``unbind`` where its outputs share a
    shape, else a split and a shape view each: each view is a host call of its own)."""
    data = entry.packed.clone()
    values: list[torch.Tensor] = [data] * entry.outputs  # each place filled below
    for dtype, first, end, sizes, shapes, places in entry.parts:
        typed = data[first:end].view(dtype)
        if len(places) == 1:
            values[places[0]] = typed.view(shapes[0])
        elif all(shape == shapes[0] for shape in shapes):
            for place, piece in zip(
                places, typed.view(len(places), *shapes[0]).unbind(0), strict=True
            ):
                values[place] = piece
        else:
            for place, piece, shape in zip(
                places, torch.split_with_sizes(typed, sizes), shapes, strict=True
            ):
                values[place] = piece if piece.dim() == len(shape) == 1 else piece.view(shape)
    return values


def _raw_stream(device: torch.device) -> int | None:
    """The handle of the stream replays and copies run on (None off CUDA: the tests'
    stand-in graphs); cheaper than building a ``torch.cuda.Stream`` object."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch._C._cuda_getCurrentRawStream(index)
