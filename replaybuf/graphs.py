"""Captured CUDA graphs of a batch's device work: its launches replayed as one.

On CUDA storage a uniform n-step or sequence batch is 4-10 launches (the draw, the fused
Triton kernel, one gather per field, padding), and each costs the host 10-40 µs (measured on
an H200's host) for about a microsecond of GPU work: the batch waits on Python, not on the
GPU. A CUDA graph of that work replays it in one launch. Written by hand: TorchRL samples
without graphs, and ``torch.compile(mode="reduce-overhead")`` recompiles per batch size and
takes seconds on a first batch.

What a replay must not get wrong, and how it does not:

- The graph reads the tensors it saw at capture (storage columns, row links, the anchor table)
  at their addresses. The caller names them (``inputs``); an entry keeps them alive (no read
  after free) and a replay whose inputs moved (a reallocation, a restore) captures again.
- What changes between batches is read on the device: the anchor count is a device scalar,
  rewritten in stream order when it changed, and the draws come from the buffer's own
  generator, registered with the graph (each replay advances it).
- Its outputs are static buffers that every replay rewrites. The graph packs them into one
  flat tensor per element size, which is cloned after the replay (one copy each); the values
  handed out are views of the clones, so a batch the caller keeps never changes.
- A key is captured the third time it is asked for (a one-off batch size never pays for a
  capture), at most :data:`LIMIT` graphs are kept (least recently used dropped), and a key whose
  capture failed (an op that cannot be captured) is never tried again.

``REPLAYBUF_CUDA_GRAPHS=0`` switches graphs off.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

GRAPHS_ENV = "REPLAYBUF_CUDA_GRAPHS"  # "0": never capture
CAPTURE_AT = 3  # a key is captured the time it is asked for
LIMIT = 8  # graphs kept per buffer
# Batches above this many bytes run uncaptured: the launches a graph saves weigh nothing
# beside their copies, and a graph holds its outputs twice (static and packed).
MAX_BYTES = 64 << 20
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Build = Callable[[], tuple[Any, list[torch.Tensor]]]  # (meta, outputs) of one batch


class NotCapturable(Exception):
    """Raised by a build whose work cannot be graphed (a path that reads host state)."""


@dataclass
class _Entry:
    graph: Any  # torch.cuda.CUDAGraph (or the tests' stand-in)
    inputs: tuple[torch.Tensor, ...]  # kept alive: the graph reads them
    signature: tuple[int, ...]
    meta: Any
    packed: list[torch.Tensor]  # the static flat outputs, one per element size
    sizes: list[list[int]]  # each packed tensor's pieces, in elements
    layout: list[tuple[int, int, torch.dtype, torch.Size]]  # per output: pack, piece, dtype, shape
    stream: int | None = None  # the stream of the last replay (its cuda_stream handle)


class BatchGraphs:
    """One buffer's captured batch graphs, by key (what the batch asks for)."""

    def __init__(self, device: torch.device, generator: torch.Generator) -> None:
        self.device = device
        self.generator = generator
        self.count = torch.zeros((), dtype=torch.long, device=device)  # the anchor count
        self._count = 0  # what count holds (its writes are stream-ordered, never read back)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._asked: dict[Hashable, int] = {}
        self._failed: set[Hashable] = set()
        self._lock = threading.Lock()

    @staticmethod
    def enabled(device: torch.device) -> bool:
        """Whether batches on ``device`` may be graphed (CUDA, not switched off)."""
        return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0"

    def draw(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniform places in ``[0, count)``, ``shape`` of them, read from the device count:
        graph-safe (a host count would be frozen into the graph). 62 random bits modulo the
        count: a bias under count / 2^62."""
        raw = torch.randint(0, 2**62, shape, generator=self.generator, device=self.device)
        return raw.remainder(self.count)

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
            if entry is None and self._asked.get(key, 0) + 1 < CAPTURE_AT:
                self._asked[key] = self._asked.get(key, 0) + 1
                return None
            stream = _current_stream(self.device)
            # Another stream's copies may still read the static outputs or the count.
            for other in self._entries.values() if entry is None else [entry]:
                if stream is not None and other.stream not in (None, stream.cuda_stream):
                    stream.wait_stream(torch.cuda.ExternalStream(other.stream, self.device))
            if count != self._count:
                self.count.fill_(count)  # a launch, in stream order with the replays
                self._count = count
            if entry is None:
                entry = self._capture(key, inputs, signature, build)
                if entry is None:
                    return None
            else:
                self._entries.move_to_end(key)
                entry.graph.replay()
            entry.stream = None if stream is None else stream.cuda_stream
            return entry.meta, _unpack(entry)

    def clear(self) -> None:
        """Drop every graph (their memory goes back to torch's allocator)."""
        with self._lock:
            for key in list(self._entries):
                self._drop(key)
            self._asked.clear()

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
            entry = _capture(self.device, self.generator, build, inputs, signature)
        except (NotCapturable, RuntimeError, AttributeError):
            # NotCapturable: a path that reads the host; RuntimeError: CUDA refused an op
            # during capture; AttributeError: a torch without graph-safe generators.
            entry = None
        if entry is None:
            self._failed.add(key)
            return None
        self._entries[key] = entry
        while len(self._entries) > LIMIT:
            self._drop(next(iter(self._entries)))
        return entry


def _capture(
    device: torch.device,
    generator: torch.Generator,
    build: Build,
    inputs: tuple[torch.Tensor, ...],
    signature: tuple[int, ...],
) -> _Entry | None:
    """A captured, once-replayed graph of ``build``; None when its outputs are too large."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # capture needs a stream other than the default one
    side.wait_stream(current)
    with torch.cuda.stream(side):
        _, warm = build()  # outside the graph: compiles, fills caches, sizes the outputs
        if sum(t.numel() * t.element_size() for t in warm) > MAX_BYTES:
            current.wait_stream(side)
            return None
        del warm
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(generator)
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            meta, outputs = build()
            packed, sizes, layout = _pack(outputs)
        finally:
            graph.capture_end()
        del outputs  # what the packed copies hold
        graph.replay()
    current.wait_stream(side)
    return _Entry(graph, inputs, signature, meta, packed, sizes, layout)


def _pack(
    outputs: list[torch.Tensor],
) -> tuple[list[torch.Tensor], list[list[int]], list[tuple[int, int, torch.dtype, torch.Size]]]:
    """``outputs`` as one flat tensor per element size (viewed as an integer type of that
    size), and where each output lies in them."""
    groups: dict[int, list[torch.Tensor]] = {}
    layout = []
    for value in outputs:
        flat = value.reshape(-1)
        carrier = _CARRIERS.get(value.element_size(), value.dtype)
        flat = flat.view(carrier) if flat.dtype != carrier else flat
        size = value.element_size()
        group = groups.setdefault(size, [])
        layout.append((list(groups).index(size), len(group), value.dtype, value.shape))
        group.append(flat)
    packed = [torch.cat(group) for group in groups.values()]
    sizes = [[piece.numel() for piece in group] for group in groups.values()]
    return packed, sizes, layout


def _unpack(entry: _Entry) -> list[torch.Tensor]:
    """Fresh copies of the last replay's outputs: one clone per packed tensor, cut in views."""
    pieces = [
        torch.split_with_sizes(flat.clone(), sizes)
        for flat, sizes in zip(entry.packed, entry.sizes, strict=True)
    ]
    values = []
    for group, at, dtype, shape in entry.layout:
        piece = pieces[group][at]
        values.append((piece if piece.dtype == dtype else piece.view(dtype)).view(shape))
    return values


def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream replays and copies run on (None off CUDA: the tests' stand-in graphs)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None
