"""The choice of a priority backend: by name, by environment variable, or what loads here.

``"torch"`` runs anywhere (blocked on the CPU, flat on ``FLAT_DEVICES``);
``"torchrl-segment-tree"`` needs TorchRL's compiled extension and the CPU. ``"auto"`` takes
``REPLAYBUF_PRIORITY_BACKEND`` when set, else on the CPU "torch" where its numba kernels load,
else the segment tree where it loads, else "torch".
"""

from __future__ import annotations

import os

import torch

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.errors import ArgumentError
from replaybuf.priority.base import BACKEND_SEGMENT_TREE, BACKEND_TORCH, PriorityIndex
from replaybuf.priority.flat_index import FlatPriorityIndex
from replaybuf.priority.segment_tree import (
    SegmentTreePriorityIndex,
    segment_tree_unavailable_reason,
)
from replaybuf.priority.torch_index import TorchPriorityIndex

BACKENDS = ("auto", BACKEND_TORCH, BACKEND_SEGMENT_TREE)
BACKEND_ENV = "REPLAYBUF_PRIORITY_BACKEND"  # overrides backend="auto" (CI runs the fallback)
FLAT_DEVICES = ("cuda",)  # where the torch backend keeps flat cumulative sums, not blocks


def _chosen_backend(backend: str, device: torch.device) -> str:
    """The backend to build: ``backend`` unless "auto", then the env var, then what loads."""
    source = f"backend={backend!r}"
    if backend == "auto" and os.environ.get(BACKEND_ENV):
        backend, source = os.environ[BACKEND_ENV], f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r}"
        if backend not in BACKENDS:
            raise ArgumentError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
    if backend not in BACKENDS:
        raise ArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == BACKEND_TORCH or (backend == "auto" and device.type != "cpu"):
        return BACKEND_TORCH
    if backend == "auto" and compiled_kernels() is not None:
        # with replaybuf.accel.numba_kernels it draws faster than TorchRL's tree
        return BACKEND_TORCH
    reason = segment_tree_unavailable_reason()  # the extension is first loaded here
    if backend == "auto":
        return BACKEND_TORCH if reason else BACKEND_SEGMENT_TREE
    if device.type != "cpu":
        raise ArgumentError(
            f"{source} keeps its trees in host memory and cannot serve device {device}; "
            f"use backend {BACKEND_TORCH!r} or 'auto' there"
        )
    if reason:
        raise ArgumentError(f"{source} is unavailable: {reason}; use {BACKEND_TORCH!r} or 'auto'")
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
            load (:mod:`replaybuf.accel.numba_kernels`, the ``fast`` extra), else the segment
            tree where TorchRL's extension loads, else "torch"; "torch" on other devices.
            ``REPLAYBUF_PRIORITY_BACKEND`` overrides "auto".

    Raises:
        ValueError: a bad capacity or backend name, or a backend that cannot run here (why).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ArgumentError(f"capacity must be an int >= 1, got {capacity!r}")
    device = torch.device(device)
    if _chosen_backend(backend, device) == BACKEND_SEGMENT_TREE:
        return SegmentTreePriorityIndex(capacity, device)
    if device.type in FLAT_DEVICES:
        return FlatPriorityIndex(capacity, device)
    return TorchPriorityIndex(capacity, device)
