"""Proportional sampling by weight over ``capacity`` items, with the total, min and max.

Item i is drawn with probability w_i / Σ_j w_j, with replacement; an item of weight 0 is absent
and never drawn. Every backend gives item i the masses (c_{i-1}, c_i], c_i = w_0+..+w_i, and
draws u = (1 - U[0, 1)) · total in (0, total] (see :mod:`replaybuf.priority.draws`). The
backends (chosen in :mod:`replaybuf.priority.backends`):

* ``"torch"``: tensors on ``device``, blocked on the CPU
  (:mod:`replaybuf.priority.torch_index`) and flat on CUDA (:mod:`replaybuf.priority.flat_index`);
* ``"torchrl-segment-tree"``: TorchRL's C++ sum tree, CPU only
  (:mod:`replaybuf.priority.segment_tree`).

Why float64 sums: at 1,000,000 items a float32 sum and a float32 uniform number resolve only
~2**24 steps of the total: an average item would own ~17 of them (±6 % bias). Sums are always
recomputed from the weights, never updated by deltas, so they do not drift. Weights themselves
are float32 (``get`` returns float32); float64 sums add them exactly enough.
"""

from __future__ import annotations

import abc
import math

import numpy as np
import torch

from replaybuf.args import host_tensor
from replaybuf.errors import ArgumentError
from replaybuf.priority.draws import relative_power

BACKEND_TORCH = "torch"
BACKEND_SEGMENT_TREE = "torchrl-segment-tree"
FLOAT32_MAX = torch.finfo(torch.float32).max  # TorchRL's min-tree identity (padding leaves)


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
            raise ArgumentError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if generator.device.type != self.device.type:
            raise ArgumentError(
                f"generator must live on the index's device {self.device}, "
                f"got one on {generator.device}"
            )
        if not self._stats[0] > 0:
            raise ArgumentError("nothing to sample: every weight is 0")

    def weights(self) -> torch.Tensor:
        """All ``capacity`` weights, float32 on the CPU (for checkpoints)."""
        return self._read(torch.arange(self.capacity, device=self.device)).cpu()

    def load(self, weights: torch.Tensor) -> None:
        """Replace every weight by ``weights`` (as returned by :meth:`weights`)."""
        weights = host_tensor(weights).detach()
        if tuple(weights.shape) != (self.capacity,):
            raise ArgumentError(
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
            raise ArgumentError(f"items must be an integer tensor, got dtype {items.dtype}")
        if items.dim() != 1:
            raise ArgumentError(f"items must be 1-D [k], got shape {tuple(items.shape)}")
        return items.to(self.device, torch.long)

    def _out_of_range(self, items: torch.Tensor) -> torch.Tensor:
        return (items < 0) | (items >= self.capacity)

    def _range_error(self, items: torch.Tensor) -> ArgumentError:
        at = int(torch.nonzero(self._out_of_range(items))[0])
        got = int(items[at])
        return ArgumentError(f"items must lie in [0, {self.capacity}), got {got} at position {at}")

    def _checked(
        self, items: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``items`` (long) and ``weights`` (float32, -0.0 as 0.0) on ``device``, else raise."""
        items, weights = self._items(items), host_tensor(weights).detach()
        if items.shape != weights.shape:
            raise ArgumentError(
                f"items and weights must have the same shape, got items {tuple(items.shape)} "
                f"and weights {tuple(weights.shape)}"
            )
        if weights.dtype.is_complex or weights.dtype == torch.bool:
            raise ArgumentError(f"weights must be real numbers, got dtype {weights.dtype}")
        weights32 = weights.to(self.device, torch.float32)
        bad = ~torch.isfinite(weights32) | (weights32 < 0)  # [k]
        flags = torch.stack([self._out_of_range(items).any(), bad.any()]).tolist()  # one sync
        if flags[0]:
            raise self._range_error(items)
        if flags[1]:
            at = int(torch.nonzero(bad)[0])
            raise ArgumentError(
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
