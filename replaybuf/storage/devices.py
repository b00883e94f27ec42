"""Device and storage-kind arguments: where a buffer's rows live, checked once at construction."""

from __future__ import annotations

from typing import Literal

import torch

from replaybuf.errors import ArgumentError

StorageKind = Literal["memmap", "tensor"]
StorageChoice = Literal["auto", "memmap", "tensor"]
STORAGE_CHOICES = ("auto", "memmap", "tensor")

# ``storage="auto"`` on the CPU keeps a buffer whose rows plan at most this many bytes in RAM
# (tensor storage) and puts larger ones in memmap files on disk. 256 MiB holds the usual
# state-vector buffer in RAM, as SB3's numpy arrays and TorchRL's default storage do (10^6
# HalfCheetah transitions plan 173 MB), at a cost no training machine notices, while image
# buffers (10^6 Atari frames, 7 GB) and large state ones go to disk, where RAM is not spent.
AUTO_TENSOR_MAX_BYTES = 256 * 2**20

# For constructors and loads, which allocate every tensor a buffer keeps: normal tensors even
# when called in inference mode (an RL collector), as later writes outside it are in place,
# which inference tensors refuse. A decorator (a fresh context per call).
NORMAL_TENSORS = torch.inference_mode(False)


def resolve_device(value: torch.device | str, name: str) -> torch.device:
    """Parse a device argument, failing clearly for unknown devices and absent CUDA."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(
            f"{name} must be a torch.device or a device string, got {value!r}"
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"{name}={value!r} asks for CUDA, but no CUDA device is available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ArgumentError(
                f"{name}={value!r}: CUDA device {index} does not exist "
                f"({torch.cuda.device_count()} available)"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ArgumentError(f"{name} must be 'cpu' or a CUDA device, got {value!r}")
    return device


def resolve_kind(storage: str, storing_device: torch.device) -> StorageChoice:
    """The storage kind to build, checked: ``auto`` is tensor storage on CUDA, and stays
    ``auto`` on the CPU, where :func:`auto_kind` chooses once the planned size is known."""
    if storage not in STORAGE_CHOICES:
        raise ArgumentError(f"storage must be one of {STORAGE_CHOICES}, got {storage!r}")
    if storage == "auto":
        return "auto" if storing_device.type == "cpu" else "tensor"
    if storage == "memmap" and storing_device.type != "cpu":
        raise ArgumentError(
            f"storage='memmap' keeps rows in files on the CPU; got storing_device={storing_device}"
        )
    return storage  # type: ignore[return-value]


def auto_kind(planned: int, free_ram: int) -> StorageKind:
    """What ``storage="auto"`` picks on the CPU for rows that plan ``planned`` bytes: tensor
    storage up to :data:`AUTO_TENSOR_MAX_BYTES` when they take at most half the available
    RAM (``free_ram`` bytes), memmap files otherwise."""
    return "tensor" if planned <= min(AUTO_TENSOR_MAX_BYTES, free_ram // 2) else "memmap"
