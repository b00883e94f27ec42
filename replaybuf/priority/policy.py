"""Proportional prioritization (Schaul et al. 2016) over a buffer's item slots.

Item i is drawn with probability P(i) = p_i^α / Σ_j p_j^α and weighted by PER's importance
weight w_i = (N·P(i))^-β / max_j (N·P(j))^-β. The maximum is reached at the smallest stored
probability, so N cancels: w_i = (P(i) / P_min)^-β. New items enter at the current maximum
weight (1 when nothing is stored); removed or overwritten items get weight 0 at once.

The buffers map their own ids (which detect an overwritten slot) to items; this module only
knows items, weights and the tree in :mod:`replaybuf.priority.base`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from replaybuf.args import host_tensor
from replaybuf.errors import ArgumentError, ArgumentTypeError
from replaybuf.priority.backends import make_priority_index
from replaybuf.priority.draws import relative_power

if TYPE_CHECKING:
    from replaybuf.priority.base import PriorityIndex


# The bounds a buffer takes and a checkpoint's meta is checked against (one range, so every
# buffer that can be built can be saved and loaded again).
MAX_ALPHA = 100.0  # p ** alpha of any priority above 1 overflows float32 well before this
MAX_EPS = 1e6  # far above any |TD error| scale; bounds a tampered checkpoint's value


def check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= MAX_ALPHA:
        raise ArgumentError(f"alpha must lie in [0, {MAX_ALPHA:g}], got {alpha!r}")
    return float(alpha)


def check_beta(beta: Any) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta <= 1:
        raise ArgumentError(f"beta must lie in [0, 1], got {beta!r}")
    return float(beta)


def check_eps(eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps <= MAX_EPS:
        raise ArgumentError(f"eps must lie in [0, {MAX_EPS:g}], got {eps!r}")
    return float(eps)


def ring_ids(slots: torch.Tensor, writes: int, capacity: int) -> torch.Tensor:
    """The id (write number) of the row each ring slot holds after ``writes`` writes."""
    if writes % capacity == 0:  # the ring is whole: slot s holds write writes - capacity + s
        return slots + (writes - capacity)
    return writes - 1 - (writes - 1 - slots) % capacity


def parse_ids(index: Any, device: torch.device) -> torch.Tensor:
    """``index`` (ids from a sampled batch) as a flat long tensor on ``device``."""
    ids = host_tensor(index).reshape(-1)
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ArgumentTypeError(f"index must hold integer ids, got dtype {ids.dtype}")
    return ids.to(device=device, dtype=torch.long)


def check_priorities(priority: Any, count: int, device: torch.device) -> torch.Tensor:
    """``priority`` as a float tensor of ``count`` finite values >= 0, else a clear error."""
    if isinstance(priority, int | float) and not isinstance(priority, bool):
        priority = [priority] * count
    # Priorities are data, never differentiated: a |TD error| that still requires grad is fine.
    values = host_tensor(priority, torch.float64).detach().reshape(-1)
    if values.numel() != count:
        raise ArgumentError(
            f"priority must have one value per index: expected {count}, got {values.numel()}"
        )
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        first = values[bad][0].item()
        raise ArgumentError(f"priority must be finite and >= 0, got {first}")
    return values.to(device)


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))  # native order


def host_update_inputs(index: Any, priority: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``index`` and ``priority`` as numpy ``(ids int64 [k], values float64 [k])``, k >= 1,
    where both come as CPU tensors or numpy arrays (int64 ids; float values, finite, >= 0);
    None otherwise: :func:`parse_ids` and :func:`check_priorities` then run, and raise their
    errors. On the CPU this path makes numpy calls where they make torch calls, which cost
    several times more each."""
    ids, values = _host_array(index), _host_array(priority)
    if ids is None or values is None or ids.dtype != np.int64 or values.dtype not in _FLOATS:
        return None
    ids, values = ids.reshape(-1), values.reshape(-1).astype(np.float64)
    if ids.shape[0] == 0 or values.shape != ids.shape:
        return None
    if not (values.min() >= 0 and values.max() < math.inf):  # NaN fails both
        return None
    return ids, values


def _host_array(value: Any) -> np.ndarray | None:
    """A numpy array (a plain one, as torch.as_tensor reads it: no matrix, the data under a
    mask) or a CPU tensor's numpy view, else None. Arrays torch.as_tensor refuses (negative
    strides; other byte orders fail the dtype checks) get None too: the checked path raises.
    A CUDA tensor (a batch's index and TD errors on the learner's GPU, storage on the CPU)
    is copied to the host first, as the checked path would copy it."""
    if isinstance(value, np.ndarray):
        array = np.asarray(value)
        return array if all(stride >= 0 for stride in array.strides) else None
    if isinstance(value, torch.Tensor) and value.device.type in ("cpu", "cuda"):
        try:
            return value.detach().cpu().numpy()
        except (RuntimeError, TypeError):  # bfloat16, a conjugate or negative view
            return None
    return None


class Prioritizer:
    """Weights p^α of a buffer's items, PER sampling and importance weights."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        alpha: float,
        beta: float,
        eps: float,
        backend: str = "auto",
    ) -> None:
        self.alpha, self.beta, self.eps = check_alpha(alpha), check_beta(beta), check_eps(eps)
        self.tree: PriorityIndex = make_priority_index(capacity, device, backend)

    @property
    def backend(self) -> str:
        return self.tree.backend

    def admit(self, items: torch.Tensor) -> None:
        """New items enter at the current maximum weight (1 when nothing is stored)."""
        if items.numel() == 0:
            return
        top = self.tree.max()
        weight = top if top > 0 else 1.0
        self.tree.set(
            items, torch.full(items.shape, weight, dtype=torch.float64, device=items.device)
        )

    def remove(self, items: torch.Tensor) -> None:
        """Items that left the buffer: never drawn again."""
        if items.numel():
            self.tree.set(items, torch.zeros(items.shape, dtype=torch.float64, device=items.device))

    def update(self, items: torch.Tensor, priority: torch.Tensor) -> None:
        """Set p = priority + eps for ``items`` (already checked and still stored)."""
        if items.numel():
            self.tree.set_in_range(items, (priority + self.eps) ** self.alpha)

    def update_host(self, items: np.ndarray, priority: np.ndarray) -> bool:
        """:meth:`update` for numpy ``items`` (int64, in range) and float64 ``priority``
        (checked), where the tree writes on the host without torch calls; False: nothing was
        written (call :meth:`update`)."""
        if items.shape[0] == 0:
            return True
        weights = torch.from_numpy(priority).add(self.eps).pow_(self.alpha)  # update()'s ops
        return self.tree.set_in_range_host(items, weights.numpy())

    def state_dict(self) -> dict[str, Any]:
        """alpha, beta, eps and a copy of every item's weight p^alpha."""
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "eps": self.eps,
            "weights": self.tree.weights(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state``'s exponents and weights (checked by the caller: finite, >= 0)."""
        self.alpha, self.beta = check_alpha(state["alpha"]), check_beta(state["beta"])
        self.eps = check_eps(state["eps"])
        self.tree.load(state["weights"])

    def draw(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` items drawn ∝ weight, and their importance weights (float32 ``[B]``)."""
        if not math.isfinite(self.tree.min_positive()) or self.beta == 0:
            items = self.tree.sample(batch_size, generator)
            return items, torch.ones(items.shape, dtype=torch.float32, device=items.device)
        return self.tree.sample_relative(batch_size, generator, -self.beta)

    def importance(self, items: torch.Tensor) -> torch.Tensor:
        """(P(i) / P_min)^-β, the PER weight normalised by its maximum over stored items."""
        if not math.isfinite(self.tree.min_positive()) or self.beta == 0:
            return torch.ones(items.shape, dtype=torch.float32, device=items.device)
        return self.importance_of(self.tree.get(items))

    def importance_of(self, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`importance` from the items' tree ``weights`` (``tree.get``'s, any float dtype
        that holds them exactly)."""
        smallest = self.tree.min_positive()
        if not math.isfinite(smallest) or self.beta == 0:
            return torch.ones(weights.shape, dtype=torch.float32, device=weights.device)
        return relative_power(weights, smallest, -self.beta)


def priority_stats(priorities: Prioritizer | None) -> dict[str, Any]:
    """The ``stats()`` entries about prioritization (which backend runs, α, β)."""
    if priorities is None:
        return {"prioritized": False, "priority_backend": None, "priority_kernels": None}
    return {
        "prioritized": True,
        "priority_backend": priorities.backend,
        "priority_kernels": priorities.tree.kernels,
        "alpha": priorities.alpha,
        "beta": priorities.beta,
        "eps": priorities.eps,
    }
