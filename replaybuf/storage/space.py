"""Space checks for storage: enough room before allocating, and disk blocks reserved after.

A memmap file whose blocks the disk cannot supply kills the process with SIGBUS at the first
write that touches them. So the rows' bytes are checked against what is free before the first
write allocates them, and every memmap file's blocks are reserved (``posix_fallocate``) right
after, so that a full disk raises :class:`InsufficientSpaceError` instead.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDictBase

from replaybuf.errors import InsufficientSpaceError
from replaybuf.storage.devices import StorageKind


def free_bytes(kind: StorageKind, device: torch.device, folder: Path) -> int:
    """Bytes free where a storage of ``kind`` would allocate (disk, host RAM or GPU memory)."""
    if kind == "memmap":
        return shutil.disk_usage(folder).free
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _where(kind: StorageKind, device: torch.device, folder: Path) -> str:
    """Where a storage of ``kind`` allocates, in words, for the error message."""
    if kind == "memmap":
        return f"disk at {folder}"
    return f"{device} memory" if device.type == "cuda" else "host memory (RAM)"


def ensure_space(kind: StorageKind, device: torch.device, folder: Path, needed: int) -> None:
    """Raise :class:`InsufficientSpaceError` unless ``needed`` bytes are free where a storage
    of ``kind`` on ``device`` (memmap: in ``folder``) would allocate them."""
    free = free_bytes(kind, device, folder)
    if needed > free:
        raise InsufficientSpaceError(_where(kind, device, folder), needed, free)


def reserve_files(
    stored: TensorDictBase, folder: Path | None, needed: int, release: Callable[[], None]
) -> None:
    """Reserve disk blocks for every memmap file of ``stored``, so a full disk fails now, not
    as SIGBUS later.

    On a full disk, ``release()`` undoes the allocation, then :class:`InsufficientSpaceError`
    reports ``needed`` bytes against what is free in ``folder`` (None: the file's folder).
    """
    for _, value in stored.items(include_nested=True, leaves_only=True):
        filename = getattr(value, "filename", None)
        if not filename or value.numel() == 0:  # TorchRL writes no file for no bytes
            continue
        size = os.path.getsize(filename)
        fd = os.open(filename, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                where = folder or Path(filename).parent
                free = shutil.disk_usage(where).free
                release()  # back to empty and usable, as before this first write
                raise InsufficientSpaceError(f"disk at {where}", needed, free) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        finally:
            os.close(fd)
