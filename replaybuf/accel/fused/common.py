"""What every fused kernel's launcher shares: whether Triton runs here, and the checks and
helpers of a launch.

Triton ships with torch's CUDA builds on Linux; without it (CPU-only builds), on GPUs it does
not build for, or with ``REPLAYBUF_TRITON=0``, the launchers decline and the torch ops run.
Launchers read :func:`int32_offsets` through this module at call time (``common.int32_offsets``),
so that a test can patch it in one place.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

try:  # torch's CUDA builds bring Triton, and import it themselves: no cost here
    import triton
    import triton.language as tl
except Exception:  # ImportError without Triton; its own errors on a broken install
    triton = tl = None

TRITON_ENV = "REPLAYBUF_TRITON"  # "0": run the torch ops instead
BLOCK = 128  # anchors per program
# Set before Triton is imported, Triton's interpreter runs the kernel on CPU tensors (the tests).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def int32_offsets(cells: int) -> bool:
    """Whether a launch's output offsets (``cells`` elements per output) fit the int32 index
    arithmetic of the kernels (Triton types a Python int under 2^31 as int32)."""
    return cells < 2**31


def long_columns(*tensors: torch.Tensor) -> bool:
    """Whether each is a contiguous int64 tensor, as the kernels read them."""
    return all(t.dtype == torch.long and t.is_contiguous() for t in tensors)


def current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current CUDA device for a launch: Triton launches on the current
    device and its stream (storage on cuda:1 while cuda:0 is current, say)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``'s device: a GPU Triton compiles for (the CPU in the
    interpreter), with Triton there and not switched off."""
    if triton is None or os.environ.get(TRITON_ENV, "1") == "0":
        return False
    if INTERPRET:
        return tensor.device.type == "cpu"
    return tensor.device.type == "cuda" and triton_compiles_for(tensor.device.index)


@functools.cache
def triton_compiles_for(index: int | None) -> bool:
    """Triton builds for compute capability 7.0 (Volta) and newer; older GPUs, which torch
    still runs, keep the torch ops. AMD GPUs (ROCm builds of torch) report their own."""
    if torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(index) >= (7, 0)


def triton_cdiv(a: int, b: int) -> int:
    """Programs for ``a`` anchors at ``b`` per program."""
    return -(-a // b)
