"""Device and storage-kind arguments: where a buffer's rows live, checked once at construction."""

from __future__ import annotations

from typing import Literal

import torch

from replaybuf.errors import ArgumentError

StorageKind = Literal["memmap", "tensor"]
STORAGE_CHOICES = ("auto", "memmap", "tensor")

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


def resolve_kind(storage: str, storing_device: torch.device) -> StorageKind:
    """The storage kind to build: ``auto`` means memmap on CPU and tensor storage on CUDA."""
    if storage not in STORAGE_CHOICES:
        raise ArgumentError(f"storage must be one of {STORAGE_CHOICES}, got {storage!r}")
    if storage == "auto":
        return "memmap" if storing_device.type == "cpu" else "tensor"
    if storage == "memmap" and storing_device.type != "cpu":
        raise ArgumentError(
            f"storage='memmap' keeps rows in files on the CPU; got storing_device={storing_device}"
        )
    return storage  # type: ignore[return-value]
