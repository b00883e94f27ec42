"""Proportional sampling by weight over ``capacity`` items: a sum tree with min and max.

Item i is drawn with probability w_i / Σ_j w_j, with replacement; an item of weight 0 is absent
and never drawn. Imports torch only (TorchRL's compiled extension lazily, at first use).

Two backends share one layout and one descent, so they agree draw for draw:

* ``"torchrl-segment-tree"``: TorchRL's C++ trees (CPU only), used where ``torchrl._torchrl``
  loads. That extension only loads with the torch it was built for.
* ``"torch"``: arrays on ``device`` (CUDA included), P = next power of two >= capacity::

      node 1 = w0+..+w7                      sums:  float64 [2P]   (node 0 unused)
      ├── node 2 = w0+..+w3                  min/max: float32 [2P, 2], columns
      │   ├── node 4 = w0+w1  → leaves 8, 9           (min of w > 0, else +inf; -max w)
      │   └── node 5 = w2+w3  → leaves 10, 11
      └── node 3 ...          → leaves 12..15  (leaf of item i = P + i; children of n: 2n, 2n+1)

Why float64 sums: parents are always recomputed from their children (never updated by deltas),
so there is no drift, but at 1,000,000 items a float32 sum and a float32 uniform number resolve
only ~2**24 steps of the total: an average item would own ~17 of them (±6 % bias). Weights
themselves are float32 (``get`` returns float32); their float64 sums add them exactly enough.

Descent (TorchRL's ``ScanLowerBound``): item i owns the masses (c_{i-1}, c_i], c_i = w_0+..+w_i.
Draw u = (1 - U[0, 1)) · total in (0, total], then at each node go right iff u > left sum,
subtracting it. u > 0 never lands on a leading zero item; round-off at the top of the range
(u - left may exceed the right sum by an ulp) is guarded: the torch backend clamps u to the
chosen child's sum, so it only ever enters a subtree of positive sum; the TorchRL backend moves a
zero-weight result to the nearest positive item. Both happen only in such round-off events.
"""

from __future__ import annotations

import abc
import functools
import importlib
import math
import os
from typing import Any

import torch

BACKEND_TORCH = "torch"
BACKEND_SEGMENT_TREE = "torchrl-segment-tree"
BACKENDS = ("auto", BACKEND_TORCH, BACKEND_SEGMENT_TREE)
BACKEND_ENV = "REPLAYBUF_PRIORITY_BACKEND"  # overrides backend="auto" (CI runs the fallback)
FLOAT32_MAX = torch.finfo(torch.float32).max  # TorchRL's min-tree identity (padding leaves)


# --------------------------------------------------------------------------- pure helpers
def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


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


def ancestors(leaves: torch.Tensor, levels: int) -> torch.Tensor:
    """Row j holds the nodes j+1 levels above ``leaves`` (parents first, the root last)."""
    shifts = torch.arange(1, levels + 1, device=leaves.device)  # [L]
    return torch.bitwise_right_shift(leaves.unsqueeze(0), shifts.unsqueeze(1))  # [L, k]


def sample_masses(
    batch_size: int, total: torch.Tensor | float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``batch_size`` float64 masses u = (1 - U[0, 1)) · total, uniform on (0, total]."""
    uniform = torch.rand(batch_size, generator=generator, device=device, dtype=torch.float64)
    return uniform.neg_().add_(1.0).mul_(total)  # [B] (1 - U) · total; 1 - U is exact on 2**-53


def descend(sums: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """Items owning ``masses`` in the float64 sum tree ``sums`` ([2P]); one gather per level.

    Invariant per sample: 0 < u <= sum of the current node, hence the node's sum is > 0. Going
    right (u > left) keeps u > 0; clamping u to the right sum keeps u <= it despite round-off.
    """
    return descend_with_sums(sums, masses)[0]


def descend_with_sums(
    sums: torch.Tensor, masses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`descend`'s items and the float64 leaf sums (their weights) it ended on."""
    leaves = sums.shape[0] // 2  # P
    lefts, rights = sums[0::2], sums[1::2]  # [P] each: row n = sum of node 2n, of node 2n+1
    node = torch.ones_like(masses, dtype=torch.long)  # [B] the root
    u = masses
    left = right = go_right = masses  # (log2 P >= 1 whenever a draw happens past the root)
    for _ in range(leaves.bit_length() - 1):  # log2 P levels
        left, right = lefts.index_select(0, node), rights.index_select(0, node)  # [B]
        go_right = u > left  # [B]
        u = torch.where(go_right, torch.minimum(u - left, right), u)
        node = torch.add(go_right, node, alpha=2)  # child 2n + go_right, in one kernel
    if leaves == 1:
        return node - 1, sums.index_select(0, node)
    return node - leaves, torch.where(go_right, right, left)


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
class PriorityIndex(abc.ABC):
    """Weights of ``capacity`` items and proportional sampling over them.

    ``total``, ``min_positive`` and ``max`` are cached on the host after each ``set`` / ``load``
    (the one host sync those make on CUDA, besides validating their input), so they and
    ``sample`` never wait for the device.
    """

    backend: str
    capacity: int
    device: torch.device

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._stats = (0.0, math.inf, 0.0)  # total, min_positive, max

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, capacity={self.capacity}, "
            f"device={self.device}, total={self.total()!r})"
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
        weights = torch.as_tensor(weights)
        if weights.shape == items.shape and weights.dtype.is_floating_point:
            weights32 = weights.to(self.device, torch.float32)
            lowest, highest = torch.stack(torch.aminmax(weights32)).tolist()  # NaN fails both
            if lowest >= 0 and highest <= FLOAT32_MAX:
                self._write(items, torch.where(weights32 > 0, weights32, 0.0))  # -0.0 as 0.0
                self._stats = self._read_stats()
                return
        self.set(items, weights)  # raises set's error for the bad input

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
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if generator.device.type != self.device.type:
            raise ValueError(
                f"generator must live on the index's device {self.device}, "
                f"got one on {generator.device}"
            )
        if not self._stats[0] > 0:
            raise ValueError("nothing to sample: every weight is 0")
        items, sums = self._sample(batch_size, generator)
        return items, sums.to(dtype)

    def weights(self) -> torch.Tensor:
        """All ``capacity`` weights, float32 on the CPU (for checkpoints)."""
        return self._read(torch.arange(self.capacity, device=self.device)).cpu()

    def load(self, weights: torch.Tensor) -> None:
        """Replace every weight by ``weights`` (as returned by :meth:`weights`)."""
        weights = torch.as_tensor(weights)
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
        items = torch.as_tensor(items)
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
        items, weights = self._items(items), torch.as_tensor(weights)
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


class TorchPriorityIndex(PriorityIndex):
    """The pure-torch backend: the trees are tensors on ``device`` (see the module docstring)."""

    backend = BACKEND_TORCH

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        self._leaves = next_power_of_two(capacity)  # P
        self._levels = self._leaves.bit_length() - 1  # log2 P
        self._sums = torch.zeros(2 * self._leaves, dtype=torch.float64, device=device)  # [2P]
        # [2P, 2]: (min of positive weights, else +inf; minus the max weight). Negating the max
        # lets one amin update both columns.
        self._extremes = torch.zeros(2 * self._leaves, 2, dtype=torch.float32, device=device)
        self._extremes[:, 0] = math.inf

    def _write(self, items: torch.Tensor, weights: torch.Tensor) -> None:
        items, weights = last_write_wins(items, weights)  # [k], [k]
        nodes = items + self._leaves  # [k] leaves
        self._sums.index_copy_(0, nodes, weights.double())
        self._extremes.index_copy_(0, nodes, leaf_extremes(weights))
        # Parents are recomputed from both children, level by level: duplicates are harmless.
        # Levels of at most k nodes are recomputed whole (2 kernels instead of 6 per level).
        whole = min(self._levels, nodes.numel().bit_length())  # levels 0 .. whole-1: 2**d <= k
        for parents in ancestors(nodes, self._levels - whole):  # [k] per level, bottom-up
            self._recompute(parents)
        for level in reversed(range(whole)):
            lo, hi = 1 << level, 2 << level
            torch.sum(self._sums[hi : 2 * hi].view(-1, 2), 1, out=self._sums[lo:hi])
            torch.amin(self._extremes[hi : 2 * hi].view(-1, 2, 2), 1, out=self._extremes[lo:hi])

    def _recompute(self, parents: torch.Tensor) -> None:
        sums = self._sums.view(-1, 2).index_select(0, parents).sum(1)  # [k]
        extremes = self._extremes.view(-1, 2, 2).index_select(0, parents).amin(1)  # [k, 2]
        self._sums.index_copy_(0, parents, sums)
        self._extremes.index_copy_(0, parents, extremes)

    def _read(self, items: torch.Tensor) -> torch.Tensor:
        return self._sums.index_select(0, items + self._leaves).float()

    def _rebuild(self, weights: torch.Tensor) -> None:
        p = self._leaves
        self._sums[p:].zero_()
        self._sums[p : p + self.capacity] = weights.double()
        self._extremes[p:] = leaf_extremes(torch.zeros(p, device=self.device))
        self._extremes[p : p + self.capacity] = leaf_extremes(weights)
        for level in reversed(range(self._levels)):  # whole levels, bottom-up
            lo, hi = 1 << level, 2 << level
            self._sums[lo:hi] = self._sums[hi : 2 * hi].view(-1, 2).sum(1)
            self._extremes[lo:hi] = self._extremes[hi : 2 * hi].view(-1, 2, 2).amin(1)

    def _read_stats(self) -> tuple[float, float, float]:
        root = torch.stack([self._sums[1], *self._extremes[1].double()])
        total, smallest, negated_max = root.tolist()  # the one host sync
        return total, smallest, 0.0 - negated_max

    def _sample(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        masses = sample_masses(batch_size, self._sums[1], generator, self.device)  # [B]
        return descend_with_sums(self._sums, masses)


def leaf_extremes(weights: torch.Tensor) -> torch.Tensor:
    """Rows (weight if > 0 else +inf, -weight) of the min/max tree for float32 ``weights``."""
    positive = torch.where(weights > 0, weights, math.inf)
    return torch.stack([positive, 0.0 - weights], 1)  # [k, 2]


class SegmentTreePriorityIndex(PriorityIndex):
    """TorchRL's C++ trees (CPU): a float64 sum tree, float32 min trees for min and -max.

    The sum tree is TorchRL's ``SumSegmentTreeFp64`` rather than ``Fp32`` for the reason the
    module docstring gives; its pairwise sums equal the torch backend's bit for bit.
    """

    backend = BACKEND_SEGMENT_TREE

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity, device)
        sum_tree, min_tree = _segment_trees()  # checked by make_priority_index
        self._sums, self._min, self._negated_max = (
            sum_tree(capacity),
            min_tree(capacity),
            min_tree(capacity),
        )
        self._rebuild(torch.zeros(capacity))

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
        return torch.as_tensor(sums, dtype=torch.float64).reshape(items.shape)

    def _rebuild(self, weights: torch.Tensor) -> None:
        self._write(torch.arange(self.capacity), weights)

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
        items = self._sums.scan_lower_bound(masses).clamp_max(self.capacity - 1)  # [B]
        sums = self._leaf_sums(items)  # [B] float64; read once: guard and importance weights
        # A zero leaf only after round-off at the top of the range; min() is the cheapest test.
        if batch_size and sums.min().item() == 0:
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
            ``device``, CUDA included) or "auto": the segment tree on CPU where TorchRL's
            extension loads, else "torch". ``REPLAYBUF_PRIORITY_BACKEND`` overrides "auto".

    Raises:
        ValueError: a bad capacity or backend name, or a backend that cannot run here (why).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    device = torch.device(device)
    if _chosen_backend(backend, device) == BACKEND_SEGMENT_TREE:
        return SegmentTreePriorityIndex(capacity, device)
    return TorchPriorityIndex(capacity, device)
