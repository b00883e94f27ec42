"""Space checks for storage: enough room before allocating, and disk blocks reserved as rows come.

A memmap file whose blocks the disk cannot supply kills the process with SIGBUS at the first
write that touches them. So the rows' bytes (the whole capacity) are checked against what is
free before the first write allocates them. TorchRL makes its memmap files sparse (their size
set, no block written), so they take disk blocks only as rows are written; the storage
reserves blocks (``posix_fallocate``) a slice of rows ahead of its writes
(:func:`reserve_rows`), so that a disk filled since the check raises
:class:`InsufficientSpaceError` at a write instead of SIGBUS.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDictBase

from replaybuf.errors import InsufficientSpaceError
from replaybuf.storage import scratch
from replaybuf.storage.devices import StorageKind
from replaybuf.storage.schema import FieldSpec

# TorchRL's own column of row slots (int64), which TensorDictReplayBuffer.extend writes; a
# ragged field's span per row (on the host) is as wide.
INDEX_BYTES = 8
# Memmap files get their disk blocks reserved this many slices of the capacity at a time,
# ahead of the rows written: the files grow with the data, at most a slice ahead of it.
RESERVE_SLICES = 64
_CPU = torch.device("cpu")


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


def free_ram() -> int:
    """Bytes of host RAM available now."""
    return free_bytes("tensor", _CPU, Path(tempfile.gettempdir()))


def _where(kind: StorageKind, device: torch.device, folder: Path) -> str:
    """Where a storage of ``kind`` allocates, in words, for the error message."""
    if kind == "memmap":
        return f"disk at {folder}"
    return f"{device} memory" if device.type == "cuda" else "host memory (RAM)"


def ensure_space(kind: StorageKind, device: torch.device, folder: Path, needed: int) -> None:
    """Raise :class:`InsufficientSpaceError` unless ``needed`` bytes are free where a storage
    of ``kind`` on ``device`` (memmap: in ``folder``) would allocate them."""
    free = free_bytes(kind, device, folder)
    if needed > free and kind == "memmap" and scratch.drain_if_pending():
        free = free_bytes(kind, device, folder)  # with the files a reset left to remove
    if needed > free:
        raise InsufficientSpaceError(_where(kind, device, folder), needed, free)


def plan(capacity: int, spec: FieldSpec, index_column: bool) -> tuple[int, int]:
    """Bytes ``capacity`` rows of ``spec`` take: in the storage (every column TorchRL
    allocates: the fixed fields, and its int64 index column where it keeps one), and on the
    host for the ragged fields' spans (8 bytes a row each). Ragged fields' arenas grow with
    their values and are not planned."""
    index = INDEX_BYTES if index_column else 0
    spans = capacity * INDEX_BYTES * len(spec.ragged_keys)
    return capacity * (spec.fixed.row_bytes + index), spans


def check_plan(
    kind: StorageKind, device: torch.device, folder: Path, planned: tuple[int, int]
) -> None:
    """:func:`ensure_space` for a :func:`plan`: the storage's bytes where a storage of
    ``kind`` allocates them, the spans' in host RAM."""
    stored, spans = planned
    if kind == "tensor" and device.type == "cpu":
        stored, spans = stored + spans, 0  # both in RAM: one check
    ensure_space(kind, device, folder, stored)
    if spans:
        ensure_space("tensor", _CPU, folder, spans)


def reserve_ahead(
    stored: TensorDictBase,
    reserved: int,
    stop: int,
    folder: Path | None,
    needed: int,
    release: Callable[[], None] | None,
) -> int:
    """Reserve the blocks of rows ``[reserved, stop)`` of ``stored``'s memmap files and of a
    slice (``1 / RESERVE_SLICES`` of the capacity) beyond; the rows now reserved
    (:func:`reserve_rows` for the rest)."""
    capacity = stored.shape[0]
    step = -(-capacity // RESERVE_SLICES)
    stop = min(capacity, max(stop, reserved + step))
    reserve_rows(stored, reserved, stop, folder, needed, release)
    return stop


def reserve_rows(
    stored: TensorDictBase,
    start: int,
    stop: int,
    folder: Path | None,
    needed: int,
    release: Callable[[], None] | None = None,
) -> None:
    """Reserve the disk blocks of rows ``[start, stop)`` in every memmap file of ``stored``,
    so a full disk fails now, not as SIGBUS when those rows are written.

    On a full disk, ``release()`` (when given) undoes the allocation, then
    :class:`InsufficientSpaceError` reports ``needed`` bytes against what is free in
    ``folder`` (None: the file's folder).
    """
    for _, value in stored.items(include_nested=True, leaves_only=True):
        filename = getattr(value, "filename", None)
        if not filename or value.numel() == 0:  # TorchRL writes no file for no bytes
            continue
        row = value[0].numel() * value.element_size()
        fd = os.open(filename, os.O_RDWR)
        try:
            try:
                os.posix_fallocate(fd, start * row, (stop - start) * row)
            except OSError as exc:
                # The files a reset left to remove hold blocks: once they are gone, again.
                if exc.errno != errno.ENOSPC or not scratch.drain_if_pending():
                    raise
                os.posix_fallocate(fd, start * row, (stop - start) * row)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                where = folder or Path(filename).parent
                free = shutil.disk_usage(where).free
                if release is not None:
                    release()  # back to empty and usable, as before this first write
                raise InsufficientSpaceError(f"disk at {where}", needed, free) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        finally:
            os.close(fd)
