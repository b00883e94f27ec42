"""Proportional sampling by weight over ``capacity`` items, with the total, min and max.

Item i is drawn with probability w_i / Σ_j w_j, with replacement; an item of weight 0 is absent
and never drawn. Imports torch and numpy (TorchRL's compiled extension lazily, at first use).

Both backends give item i the masses (c_{i-1}, c_i], c_i = w_0+..+w_i, and draw
u = (1 - U[0, 1)) · total in (0, total] (u > 0 never lands on a leading absent item):

* ``"torchrl-segment-tree"``: TorchRL's C++ sum tree (CPU only), used where ``torchrl._torchrl``
  loads; that extension only loads with the torch it was built for. Its ``scan_lower_bound``
  descends the tree; round-off at the top of the range can end on an absent item, which is then
  moved to the nearest present one (only in such round-off events).
* ``"torch"``: two levels of tensors on ``device`` (CUDA included), written by hand because
  TorchRL's trees exist only in C++ on the CPU. Items sit in blocks of F::

      leaves  [nb, F] float64   w_0 .. w_{F-1} | w_F .. w_{2F-1} | ... (padding 0)
      blocks  [nb]    float64   the sum of each block (on the CPU: its last running sum)
      starts  [nb+1]  float64   0, blocks[0], blocks[0]+blocks[1], ...  (cumulative)

  A draw is ~15 kernels whatever the capacity (a binary tree descent costs ~4 per level, 80 at
  1M items): ``searchsorted`` finds the block b with starts[b] < u <= starts[b+1]; inside it,
  u' = u - starts[b] > 0 (a difference of distinct floats is never 0) is clamped to the row's
  own cumulative sum, and the item is the first j whose running sum reaches u', so w_j > 0.
  F grows with sqrt(capacity) to keep both the row scan and the O(nb) rebuild of ``starts``
  after each ``set`` small. On the CPU the index also keeps every block's running sums
  (``[nb, F]``, 8 bytes more per item, rebuilt for the blocks a ``set`` touches), so a draw
  gathers them instead of summing the rows it gathers (:func:`locate_host`). Where numba is
  installed, :mod:`replaybuf.accel.numba_kernels` runs the CPU draws and small writes compiled,
  with the
  same results bit for bit (``kernels`` says which runs: "numba" or "numpy").

  On CUDA (``FLAT_DEVICES``) a draw is shorter still: each ``set`` rebuilds one flat
  cumulative sum over all items instead of the blocks (a few kernels; cheap on a GPU, ~1 ms
  at 1M items on a CPU), and a draw is one ``randint`` and one ``searchsorted`` in it: ~4
  kernels instead of ~15, and the GPU's cost per draw is kernel launches, not arithmetic. The
  total, minimum and maximum are then reduced from the weights themselves, and come to the
  host in one copy with the top of the sums. The flat sums are integers:
  item i gets ceil(w_i · 2**62 / total) units (>= 1 when w_i > 0, 0 when absent). Integer
  addition is exact in any order, so a parallel scan gives an absent item exactly its
  predecessor's sum and the first sum >= u (u in [1, last sum]) always belongs to a present
  item; float sums from a parallel scan can differ in the last bit there. Rounding up moves
  an item's share by at most 1 unit in 2**62 of the total, relatively ~2**-40 for an average
  item of 1M.

Why float64 sums: at 1,000,000 items a float32 sum and a float32 uniform number resolve only
~2**24 steps of the total: an average item would own ~17 of them (±6 % bias). Sums are always
recomputed from the weights, never updated by deltas, so they do not drift. Weights themselves
are float32 (``get`` returns float32); float64 sums add them exactly enough.
"""

from __future__ import annotations

import abc
import functools
import importlib
import math
import os
import struct
from types import ModuleType
from typing import Any

import numpy as np
import torch

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.args import host_tensor

BACKEND_TORCH = "torch"
BACKEND_SEGMENT_TREE = "torchrl-segment-tree"
BACKENDS = ("auto", BACKEND_TORCH, BACKEND_SEGMENT_TREE)
BACKEND_ENV = "REPLAYBUF_PRIORITY_BACKEND"  # overrides backend="auto" (CI runs the fallback)
FLOAT32_MAX = torch.finfo(torch.float32).max  # TorchRL's min-tree identity (padding leaves)
FLAT_DEVICES = ("cuda",)  # where the torch backend keeps flat cumulative sums, not blocks
_UNITS = 2.0**62  # integer units the flat sums divide the total into


# --------------------------------------------------------------------------- pure helpers
def last_write_wins(items: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort ``items`` and give every copy of a duplicate the value of its last occurrence.

    Writing the result with ``index_copy_`` is then deterministic although indices repeat: all
    writes to one slot carry the same bits. No boolean masks, so no host sync on CUDA (and no
    ``searchsorted``, whose CPU kernel goes multi-threaded, and stalls, for a few items).
    """
    items, values = items.flip(0), values.flip(0)  # the last occurrence comes first
    order = torch.argsort(items, stable=True)  # [k] equal items keep that order
    ordered = items.index_select(0, order)  # [k] sorted
    starts = torch.ones_like(ordered, dtype=torch.bool)  # [k] first of a run of equal items
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(ordered.numel(), device=ordered.device)
    first = torch.where(starts, position, 0).cummax(0).values  # [k] start of each one's run
    return ordered, values.index_select(0, order.index_select(0, first))


def last_write_wins_host(items: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`last_write_wins` in numpy, deduplicated: each distinct item once, sorted, with the
    value of its last occurrence."""
    unique, last = np.unique(items[::-1], return_index=True)  # first in reverse = last
    return unique, values[::-1][last]


def sample_masses(
    batch_size: int, total: torch.Tensor | float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``batch_size`` float64 masses u = (1 - U[0, 1)) · total, uniform on (0, total]."""
    uniform = torch.rand(batch_size, generator=generator, device=device, dtype=torch.float64)
    if uniform.device.type == "cpu" and not isinstance(total, torch.Tensor):
        # The same IEEE operations in numpy, in place: a fraction of torch's per-call cost.
        view = uniform.numpy()
        np.subtract(1.0, view, out=view)
        view *= total
        return uniform
    return uniform.neg_().add_(1.0).mul_(total)  # [B] (1 - U) · total; 1 - U is exact on 2**-53


def block_width(capacity: int) -> int:
    """F, the items per block of the torch backend: a power of two near sqrt(capacity) / 32,
    at least 32 (32 at 1M items, 128 at 10M)."""
    return max(32, 1 << (max(math.isqrt(capacity) // 32, 1) - 1).bit_length())


def locate(
    starts: torch.Tensor, leaves: torch.Tensor, masses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The items owning ``masses`` ([B] in (0, total]) and their float64 weights ([B] each).

    ``starts`` ([nb+1]) are the cumulative block sums from 0, ``leaves`` ([nb, F]) the weights.
    """
    nb, width = leaves.shape
    block = torch.searchsorted(starts[1:], masses).clamp_max_(nb - 1)  # [B] starts[b] < u
    inside = masses - starts.index_select(0, block)  # [B] > 0
    rows = leaves.index_select(0, block)  # [B, F]
    running = rows.cumsum(1)  # [B, F]
    inside = torch.minimum(inside, running[:, -1])  # round-off: u' <= the row's own total
    column = (running < inside.unsqueeze(1)).sum(1).unsqueeze_(1)  # [B, 1] first c_j >= u'
    weights = rows.gather(1, column).squeeze_(1)  # [B]
    return torch.add(column.squeeze_(1), block, alpha=width), weights


def locate_host(
    starts: np.ndarray, running: np.ndarray, leaves: np.ndarray, masses: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`locate` in numpy, for an index on the CPU, with the same IEEE operations and
    results; ``running`` ([nb, F]) holds each block's running sums, kept by the index (the same
    sequential sums :func:`locate` takes of the rows it gathers).

    The masses are searched in ascending order (numpy's ``searchsorted`` then starts each
    search where the last one ended, and the row gathers walk memory forwards: ~15% cheaper at
    1M items), and the items go back to the draw order, so a batch is not sorted by slot.
    numpy, not torch: a call costs a fraction of torch's for a few hundred draws.
    """
    nb, width = running.shape
    order = np.argsort(masses)  # [B]
    ordered = masses[order]
    block = np.searchsorted(starts[1:], ordered)  # [B] first starts[b + 1] >= u
    np.minimum(block, nb - 1, out=block)
    inside = ordered - starts[block]  # [B] > 0
    rows = running[block]  # [B, F]
    np.minimum(inside, rows[:, -1], out=inside)  # round-off: u' <= the row's own total
    found = np.argmax(rows >= inside[:, None], axis=1)  # [B] first c_j >= u' (sums never fall)
    found += block * width
    items = np.empty_like(found)
    items[order] = found
    return items, leaves.reshape(-1)[items]


def relative_power(weights: torch.Tensor, smallest: float, power: float) -> torch.Tensor:
    """float32 (weights / smallest) ** power, for float ``weights`` of any shape that hold the
    index's weights exactly."""
    if weights.device.type == "cpu":  # numpy: a fraction of torch's per-call cost here
        ratio = weights.numpy().astype(np.float64) / smallest  # a new array: safe in place
        return torch.from_numpy(np.power(ratio, power, out=ratio).astype(np.float32))
    ratio = weights.to(torch.float64) / smallest  # a new tensor: safe to work in place
    return ratio.pow_(power).to(torch.float32)


def nearest_positive(items: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each item moved to the nearest item of positive weight at or before it (else after it)."""
    positive = torch.nonzero(weights > 0).flatten()  # [m] sorted, m >= 1 when total > 0
    below = torch.searchsorted(positive, items, right=True) - 1  # [B] -1 when none before
    return positive.index_select(0, below.clamp_min(0))


# --------------------------------------------------------------------------- TorchRL extension
@functools.cache
def _segment_trees() -> tuple[Any, Any] | str:
    """TorchRL's (SumSegmentTreeFp64, MinSegmentTreeFp32) classes, or why they do not load."""
    try:
        extension = importlib.import_module("torchrl._torchrl")
        return extension.SumSegmentTreeFp64, extension.MinSegmentTreeFp32
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        return (
            f"torchrl._torchrl does not load with torch {torch.__version__} "
            f"({type(exc).__name__}: {exc}); it only loads with the torch TorchRL was built for"
        )


def segment_tree_unavailable_reason() -> str | None:
    """Why TorchRL's compiled segment trees cannot be used here, or None when they load."""
    trees = _segment_trees()
    return trees if isinstance(trees, str) else None


# --------------------------------------------------------------------------- the index
_CPU = torch.device("cpu")


class PriorityIndex(abc.ABC):
    """Weights of ``capacity`` items and proportional sampling over them.

    ``total``, ``min_positive`` and ``max`` are cached on the host after each ``set`` / ``load``
    (the one host sync those make on CUDA, besides validating their input), so they and
    ``sample`` never wait for the device.
    """

    backend: str
    kernels: str  # what runs draws and writes: "torchrl", "numba", "numpy" or "torch"
    capacity: int
    device: torch.device

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._stats = (0.0, math.inf, 0.0)  # total, min_positive, max

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, kernels={self.kernels!r}, "
            f"capacity={self.capacity}, device={self.device}, total={self.total()!r})"
        )

    def set(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        """Give ``items`` (long ``[k]``) the ``weights`` (``[k]``, finite, >= 0; 0 = absent).

        Duplicate items in one call: the last value wins. Weights are stored as float32. Bad
        input raises ``ValueError`` and changes nothing.
        """
        items, weights = self._checked(items, weights)
        if items.numel():
            self._write(items, weights)
            self._stats = self._read_stats()

    def set_in_range(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        """:meth:`set` for ``items`` known to be long ``[k]`` on ``device`` and in range (as
        :meth:`sample` returns them, or checked before): only ``weights`` are checked."""
        if items.numel() == 0:
            return
        weights = host_tensor(weights).detach()  # data, never differentiated
        if weights.shape == items.shape and weights.dtype.is_floating_point:
            weights32 = weights.to(self.device, torch.float32)
            lowest, highest = torch.stack(torch.aminmax(weights32)).tolist()  # NaN fails both
            if lowest >= 0 and highest <= FLOAT32_MAX:
                self._write(items, torch.where(weights32 > 0, weights32, 0.0))  # -0.0 as 0.0
                self._stats = self._read_stats()
                return
        self.set(items, weights)  # raises set's error for the bad input

    @property
    def host_writes(self) -> bool:
        """Whether :meth:`set_in_range_host` may write (else it always declines)."""
        return False

    def set_in_range_host(self, items: np.ndarray, weights: np.ndarray) -> bool:
        """:meth:`set_in_range` for numpy ``items`` (int64 ``[k]``, k >= 1, in range) and
        float64 ``weights``, where this index writes them without torch calls; False where it
        does not, or the weights fail its checks (nothing written: call set_in_range)."""
        return False

    def get(self, items: torch.Tensor) -> torch.Tensor:
        """The float32 weights ``[k]`` of ``items`` (long ``[k]``), on ``device``.

        Items out of range raise ``ValueError`` on the CPU. On CUDA they are not checked, as
        that would cost a host sync per call (``get`` follows every ``sample``); pass items
        that ``sample`` returned or that were checked before.
        """
        items = self._items(items)
        if self.device.type == "cpu" and bool(self._out_of_range(items).any()):
            raise self._range_error(items)
        return self._read(items)

    def total(self) -> float:
        """The sum of all weights."""
        return self._stats[0]

    def min_positive(self) -> float:
        """The smallest weight > 0, or ``inf`` if every weight is 0."""
        return self._stats[1]

    def max(self) -> float:
        """The largest weight (0.0 if every weight is 0)."""
        return self._stats[2]

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` items (long ``[B]`` on ``device``), item i w.p. weight_i / total.

        Draws with replacement, using only ``generator`` (on ``device``) for randomness, and
        never returns an item of weight 0.
        """
        return self.sample_weighted(batch_size, generator)[0]

    def sample_weighted(
        self, batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample`'s items and their weights (as :meth:`get` would return them), read in
        the same pass: ``(items [B], weights [B])``, both on ``device``.

        The draws equal :meth:`sample`'s for the same generator state. ``dtype=torch.float64``
        returns the same weights without the conversion (float32 values are exact in float64).
        """
        self._check_draw(batch_size, generator)
        items, sums = self._sample(batch_size, generator)
        return items, sums.to(dtype)

    def sample_relative(
        self, batch_size: int, generator: torch.Generator, power: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample`'s items and float32 (weight / min_positive) ** ``power`` of each:
        PER's importance weights for ``power = -beta``. The draws equal :meth:`sample`'s."""
        items, sums = self.sample_weighted(batch_size, generator, torch.float64)
        return items, relative_power(sums, self._stats[1], power)

    def _check_draw(self, batch_size: int, generator: torch.Generator) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if generator.device.type != self.device.type:
            raise ValueError(
                f"generator must live on the index's device {self.device}, "
                f"got one on {generator.device}"
            )
        if not self._stats[0] > 0:
            raise ValueError("nothing to sample: every weight is 0")

    def weights(self) -> torch.Tensor:
        """All ``capacity`` weights, float32 on the CPU (for checkpoints)."""
        return self._read(torch.arange(self.capacity, device=self.device)).cpu()

    def load(self, weights: torch.Tensor) -> None:
        """Replace every weight by ``weights`` (as returned by :meth:`weights`)."""
        weights = host_tensor(weights).detach()
        if tuple(weights.shape) != (self.capacity,):
            raise ValueError(
                f"weights must have shape ({self.capacity},), got {tuple(weights.shape)}"
            )
        items = torch.arange(self.capacity, device=self.device)
        items, weights = self._checked(items, weights)
        self._rebuild(weights)
        self._stats = self._read_stats()

    # ---------------------------------------------------------------- validation
    def _items(self, items: torch.Tensor) -> torch.Tensor:
        items = host_tensor(items)
        if items.dtype.is_floating_point or items.dtype.is_complex or items.dtype == torch.bool:
            raise ValueError(f"items must be an integer tensor, got dtype {items.dtype}")
        if items.dim() != 1:
            raise ValueError(f"items must be 1-D [k], got shape {tuple(items.shape)}")
        return items.to(self.device, torch.long)

    def _out_of_range(self, items: torch.Tensor) -> torch.Tensor:
        return (items < 0) | (items >= self.capacity)

    def _range_error(self, items: torch.Tensor) -> ValueError:
        at = int(torch.nonzero(self._out_of_range(items))[0])
        got = int(items[at])
        return ValueError(f"items must lie in [0, {self.capacity}), got {got} at position {at}")

    def _checked(
        self, items: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``items`` (long) and ``weights`` (float32, -0.0 as 0.0) on ``device``, else raise."""
        items, weights = self._items(items), host_tensor(weights).detach()
        if items.shape != weights.shape:
            raise ValueError(
                f"items and weights must have the same shape, got items {tuple(items.shape)} "
                f"and weights {tuple(weights.shape)}"
            )
        if weights.dtype.is_complex or weights.dtype == torch.bool:
            raise ValueError(f"weights must be real numbers, got dtype {weights.dtype}")
        weights32 = weights.to(self.device, torch.float32)
        bad = ~torch.isfinite(weights32) | (weights32 < 0)  # [k]
        flags = torch.stack([self._out_of_range(items).any(), bad.any()]).tolist()  # one sync
        if flags[0]:
            raise self._range_error(items)
        if flags[1]:
            at = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"weights must be finite and >= 0 in float32 (at most {FLOAT32_MAX:.7g}), "
                f"got {weights[at].item()!r} at position {at}"
            )
        return items, torch.where(weights32 > 0, weights32, 0.0)  # -0.0 stored as 0.0

    # ---------------------------------------------------------------- backend parts
    @abc.abstractmethod
    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        """Store checked float32 ``weights`` for checked ``items`` (both ``[k]``, k >= 1)."""

    @abc.abstractmethod
    def _read(self, items: torch.Tensor) -> torch.Tensor:
        """The float32 weights of checked ``items``."""

    @abc.abstractmethod
    def _rebuild(self, weights: torch.Tensor) -> None:
        """Replace all ``capacity`` weights by checked float32 ``weights``."""

    @abc.abstractmethod
    def _read_stats(self) -> tuple[float, float, float]:
        """(total, min_positive, max) read from the trees."""

    @abc.abstractmethod
    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` items drawn with ``generator`` and their float64 leaf sums; the total
        is known to be > 0."""


class _LeafIndex(PriorityIndex):
    """What both pure-torch structures share: the float64 weights, ``[nb, F]`` on ``device``."""

    backend = BACKEND_TORCH
    kernels = "torch"

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        self._width = block_width(capacity)  # F
        blocks = -(-capacity // self._width)  # nb
        self._leaves = torch.zeros(blocks, self._width, dtype=torch.float64, device=device)

    def _store(self, items: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Write the weights (duplicates: the last one wins); the written items, sorted."""
        if self.device.type == "cpu":  # numpy's unique: a third of the torch version's cost
            unique, values = last_write_wins_host(items.numpy(), weights.numpy())
            items, weights = torch.from_numpy(unique), torch.from_numpy(values)
        else:
            items, weights = last_write_wins(items, weights)  # [k], [k]
        self._leaves.view(-1).index_copy_(0, items, weights.double())
        return items

    def _read(self, items: torch.Tensor) -> torch.Tensor:
        return self._leaves.view(-1).index_select(0, items).float()

    def _rebuild(self, weights: torch.Tensor) -> None:
        self._leaves.zero_()
        self._leaves.view(-1)[: self.capacity] = weights.double()
        self._summarize()

    @abc.abstractmethod
    def _summarize(self) -> None:
        """Recompute everything derived from the weights."""


class TorchPriorityIndex(_LeafIndex):
    """The pure-torch backend: blocked weights on ``device`` (see the module docstring)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        blocks = self._leaves.shape[0]  # nb
        self._blocks = torch.zeros(blocks, dtype=torch.float64, device=device)  # [nb] sums
        self._starts = torch.zeros(blocks + 1, dtype=torch.float64, device=device)  # [nb+1]
        # [nb] float32 each: the smallest positive weight (+inf if none) and the largest weight
        # of every block; separate contiguous columns, so that their reductions stay fast.
        self._lowest, self._highest = block_extremes(torch.zeros(blocks, 1, device=device))
        # [nb, F] float64: each block's running sums, for the CPU draw (locate_host); other
        # devices take them per draw (locate). On the CPU a block's sum is its last running
        # sum (sequential), so the kernels' sums equal these bit for bit.
        self._running: torch.Tensor | None = None
        # On the CPU: numpy views of (leaves, running, blocks, lowest, highest, starts), which
        # every write and draw use (these tensors are only ever written in place), and the
        # compiled kernels where they load.
        self._host: tuple[np.ndarray, ...] | None = None
        self.compiled: ModuleType | None = None
        if device.type == "cpu":
            self._running = torch.zeros_like(self._leaves)
            self._attach_host(compiled_kernels())

    def _attach_host(self, compiled: ModuleType | None) -> None:
        """The CPU's numpy views and kernels (rebuilt after unpickling: views do not survive a
        copy, and a module cannot be pickled)."""
        tensors = (self._leaves, self._running, self._blocks, self._lowest, self._highest)
        self._host = tuple(t.numpy() for t in (*tensors, self._starts))
        self.compiled = compiled
        self.kernels = "numpy" if compiled is None else "numba"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_host=None, compiled=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._running is not None:  # the CPU: the same kernels as the original
            self._attach_host(compiled_kernels() if self.kernels == "numba" else None)

    @property
    def host_writes(self) -> bool:
        return self._host is not None and self.compiled is not None

    def set_in_range_host(self, items: np.ndarray, weights: np.ndarray) -> bool:
        # set_in_range's checks and _write's compiled branch, in numpy: their dozen torch
        # calls cost ~90 µs of a 170 µs update of 256 items at 1M (the kernel ~50 µs).
        host, compiled = self._host, self.compiled
        if host is None or compiled is None or items.shape[0] * 4 >= self._blocks.numel():
            return False
        with np.errstate(over="ignore"):  # an overflow to inf fails the check below, quietly
            weights32 = weights.astype(np.float32)  # torch's .to(float32) rounding
        if not (weights32.min() >= 0 and weights32.max() <= FLOAT32_MAX):  # NaN fails both
            return False
        stored = np.where(weights32 > 0, weights32, np.float32(0)).astype(np.float64)  # -0.0
        compiled.write(np.ascontiguousarray(items, dtype=np.int64), stored, *host)
        self._stats = self._read_stats()
        return True

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        few = items.numel() * 4 < self._blocks.numel()  # else many blocks: redo them all
        if few and self.compiled is not None and self._host is not None:
            weights64 = np.ascontiguousarray(weights.numpy(), dtype=np.float64)
            items64 = np.ascontiguousarray(items.numpy(), dtype=np.int64)
            self.compiled.write(items64, weights64, *self._host)
            return
        items = self._store(items, weights)
        if not few:
            self._summarize()
            return
        # Duplicate blocks recompute the same values: harmless with index_copy_.
        blocks = items.div(self._width, rounding_mode="floor")  # [k]
        rows = self._leaves.index_select(0, blocks)  # [k, F]
        if self._running is not None:
            running = rows.cumsum(1)
            self._running.index_copy_(0, blocks, running)
            self._blocks.index_copy_(0, blocks, running[:, -1])
        else:
            self._blocks.index_copy_(0, blocks, rows.sum(1))
        lowest, highest = block_extremes(rows.float())
        self._lowest.index_copy_(0, blocks, lowest)
        self._highest.index_copy_(0, blocks, highest)
        torch.cumsum(self._blocks, 0, out=self._starts[1:])

    def _summarize(self) -> None:
        """Recompute every block's sum and extremes, and the cumulative starts."""
        if self._running is not None:
            torch.cumsum(self._leaves, 1, out=self._running)
            self._blocks.copy_(self._running[:, -1])
        else:
            torch.sum(self._leaves, 1, out=self._blocks)
        lowest, highest = block_extremes(self._leaves.float())
        self._lowest.copy_(lowest)  # in place: the host views stay valid
        self._highest.copy_(highest)
        torch.cumsum(self._blocks, 0, out=self._starts[1:])

    def _read_stats(self) -> tuple[float, float, float]:
        if self._host is not None:  # numpy: a fraction of torch's per-call cost
            lowest, highest, starts = self._host[3:]
            return float(starts[-1]), float(lowest.min()), float(highest.max())
        smallest, largest = self._lowest.min().double(), self._highest.max().double()
        total, smallest, largest = torch.stack([self._starts[-1], smallest, largest]).tolist()
        return total, smallest, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is not None:  # the CPU: numpy views of the same tensors
            leaves, running, starts = self._host[0], self._host[1], self._host[5]
            masses = sample_masses(batch_size, starts[-1], generator, self.device).numpy()
            if self.compiled is None:
                items, weights = locate_host(starts, running, leaves, masses)
            else:
                items, weights = np.empty(batch_size, np.int64), np.empty(batch_size)
                self.compiled.locate(starts, running, leaves, masses, items, weights)
            return torch.from_numpy(items), torch.from_numpy(weights)
        masses = sample_masses(batch_size, self._starts[-1], generator, self.device)  # [B]
        return locate(self._starts, self._leaves, masses)

    def sample_relative(
        self, batch_size: int, generator: torch.Generator, power: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is None or self._host is None:
            return super().sample_relative(batch_size, generator, power)
        # One kernel from U to the relative weights: on the CPU each numpy call between these
        # steps costs microseconds, more so after a batch's gathers have evicted the caches.
        self._check_draw(batch_size, generator)
        leaves, running, starts = self._host[0], self._host[1], self._host[5]
        uniform = torch.rand(
            batch_size, generator=generator, dtype=torch.float64, device=self.device
        )
        items, relative = np.empty(batch_size, np.int64), np.empty(batch_size, np.float32)
        self.compiled.draw_relative(
            uniform.numpy(), starts, running, leaves, self._stats[1], power, items, relative
        )
        return torch.from_numpy(items), torch.from_numpy(relative)


class FlatPriorityIndex(_LeafIndex):
    """The pure-torch backend on FLAT_DEVICES (CUDA): flat int64 cumulative units of the
    weights, no blocks (see the module docstring); a draw is a ``randint`` and a
    ``searchsorted``, a write ~10 kernels fewer than keeping blocks as well."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        self._cumulative = torch.zeros(self._leaves.numel(), dtype=torch.long, device=device)
        self._total = torch.zeros((), dtype=torch.float64, device=device)
        self._top = 0  # the last cumulative unit, on the host

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        self._store(items, weights)
        self._summarize()

    def _summarize(self) -> None:
        """Rebuild the total and the flat cumulative integer units (no host sync)."""
        leaves = self._leaves.view(-1)
        self._total = leaves.sum()
        units = (leaves * (_UNITS / self._total)).ceil_()  # NaN only where every w is 0
        units = torch.where(leaves > 0, units, 0.0).long()
        torch.cumsum(units, 0, out=self._cumulative)

    def _flat_masses(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` int64 masses uniform on [1, last cumulative unit] (one kernel: the
        top is read on the host when the weights change, not per draw)."""
        return torch.randint(
            1, self._top + 1, (batch_size,), generator=generator, device=self.device
        )

    def _read_stats(self) -> tuple[float, float, float]:
        leaves = self._leaves.view(-1)
        smallest = torch.where(leaves > 0, leaves, math.inf).min()
        stats = torch.stack([self._total, smallest, leaves.max()])  # float64 [3]
        # One copy to the host for the float stats and the int64 top: the floats travel as
        # their bit patterns (int64 views) and are unpacked here.
        raw = torch.cat([stats.view(torch.long), self._cumulative[-1:]]).tolist()
        total, smallest_, largest = struct.unpack("3d", struct.pack("3q", *raw[:3]))
        self._top = raw[3]
        return total, smallest_, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The first sum >= u belongs to a present item.
        items = torch.searchsorted(self._cumulative, self._flat_masses(batch_size, generator))
        return items, self._leaves.view(-1).index_select(0, items)


def block_extremes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 weights ``[k, F]``: the smallest positive weight (+inf if none) and
    the largest weight, ``[k]`` each."""
    return torch.where(rows > 0, rows, math.inf).amin(1), rows.amax(1)


def leaf_extremes(weights: torch.Tensor) -> torch.Tensor:
    """(weight if > 0 else +inf, -weight) along a new last dim, for float32 ``weights``."""
    positive = torch.where(weights > 0, weights, math.inf)
    return torch.stack([positive, 0.0 - weights], -1)  # [..., 2]


class SegmentTreePriorityIndex(PriorityIndex):
    """TorchRL's C++ trees (CPU): a float64 sum tree, float32 min trees for min and -max.

    The sum tree is TorchRL's ``SumSegmentTreeFp64`` rather than ``Fp32`` for the reason the
    module docstring gives; its pairwise sums equal the torch backend's sequential ones to
    rounding, so the two backends draw alike but for masses within rounding of an item's edge.
    """

    backend = BACKEND_SEGMENT_TREE
    kernels = "torchrl"

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        sum_tree, min_tree = _segment_trees()  # checked by make_priority_index
        self._sums, self._min, self._negated_max = (
            sum_tree(capacity),
            min_tree(capacity),
            min_tree(capacity),
        )
        self._rebuild(torch.zeros(capacity, device=_CPU))

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        # The C++ batch update applies entries in order: duplicates, the last value wins.
        items = items.contiguous()
        extremes = leaf_extremes(weights)  # [k, 2]
        self._sums.update(items, weights.double())
        self._min.update(items, extremes[:, 0].contiguous())
        self._negated_max.update(items, extremes[:, 1].contiguous())

    def _read(self, items: torch.Tensor) -> torch.Tensor:
        return self._leaf_sums(items).float()

    def _leaf_sums(self, items: torch.Tensor) -> torch.Tensor:
        # pybind11 resolves a 1-element tensor to the scalar ``at(int)``: reshape its float.
        sums = self._sums.at(items.contiguous())
        if isinstance(sums, torch.Tensor) and sums.shape == items.shape:
            return sums  # float64, like the tree
        return torch.as_tensor(sums, dtype=torch.float64, device=_CPU).reshape(items.shape)

    def _rebuild(self, weights: torch.Tensor) -> None:
        self._write(torch.arange(self.capacity, device=_CPU), weights)

    def _read_stats(self) -> tuple[float, float, float]:
        # The roots include TorchRL's padding leaves; the min tree pads with FLOAT32_MAX.
        total = self._sums.query(0, self.capacity)
        smallest = self._min.query(0, self.capacity)
        largest = 0.0 - self._negated_max.query(0, self.capacity)
        if smallest >= FLOAT32_MAX and largest < FLOAT32_MAX:
            smallest = math.inf  # only padding: no positive weight
        return total, smallest, largest

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        masses = sample_masses(batch_size, self._stats[0], generator, self.device)  # [B]
        items = self._sums.scan_lower_bound(masses).clamp_max_(self.capacity - 1)  # [B]
        sums = self._leaf_sums(items)  # [B] float64; read once: guard and importance weights
        # A zero leaf only after round-off at the top of the range; min() is the cheapest test.
        if batch_size and sums.numpy().min() == 0:
            absent = sums == 0
            items = torch.where(absent, nearest_positive(items, self.weights()), items)
            sums = self._leaf_sums(items)
        return items, sums


# --------------------------------------------------------------------------- factory
def _chosen_backend(backend: str, device: torch.device) -> str:
    """The backend to build: ``backend`` unless "auto", then the env var, then what loads."""
    source = f"backend={backend!r}"
    if backend == "auto" and os.environ.get(BACKEND_ENV):
        backend, source = os.environ[BACKEND_ENV], f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r}"
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == BACKEND_TORCH or (backend == "auto" and device.type != "cpu"):
        return BACKEND_TORCH
    if backend == "auto" and compiled_kernels() is not None:
        # with replaybuf.accel.numba_kernels it draws ~2x faster than TorchRL's tree
        return BACKEND_TORCH
    reason = segment_tree_unavailable_reason()  # the extension is first loaded here
    if backend == "auto":
        return BACKEND_TORCH if reason else BACKEND_SEGMENT_TREE
    if device.type != "cpu":
        raise ValueError(
            f"{source} keeps its trees in host memory and cannot serve device {device}; "
            f"use backend {BACKEND_TORCH!r} or 'auto' there"
        )
    if reason:
        raise ValueError(f"{source} is unavailable: {reason}; use {BACKEND_TORCH!r} or 'auto'")
    return backend


def make_priority_index(
    capacity: int, device: torch.device | str, backend: str = "auto"
) -> PriorityIndex:
    """A :class:`PriorityIndex` of ``capacity`` items, every weight 0.

    Args:
        capacity: Number of items (ids ``0 .. capacity-1``), >= 1.
        device: Where ``get`` and ``sample`` results live (and, for "torch", the trees).
        backend: "torchrl-segment-tree" (TorchRL's C++ trees, CPU only), "torch" (tensors on
            ``device``, CUDA included) or "auto": on the CPU "torch" where its numba kernels
            load (:mod:`replaybuf.accel.numba_kernels`, the ``fast`` extra), else the segment tree
            where
            TorchRL's extension loads, else "torch"; "torch" on other devices.
            ``REPLAYBUF_PRIORITY_BACKEND`` overrides "auto".

    Raises:
        ValueError: a bad capacity or backend name, or a backend that cannot run here (why).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    device = torch.device(device)
    if _chosen_backend(backend, device) == BACKEND_SEGMENT_TREE:
        return SegmentTreePriorityIndex(capacity, device)
    if device.type in FLAT_DEVICES:
        return FlatPriorityIndex(capacity, device)
    return TorchPriorityIndex(capacity, device)
