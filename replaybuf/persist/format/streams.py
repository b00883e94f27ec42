"""Bounded-memory byte streaming shared by the writer and the reader.

Tensors move in views of at most :data:`CHUNK_BYTES` (a memmap tensor is never materialised),
and sha256 runs on a helper thread so hashing overlaps the next read or write.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from replaybuf.errors import CorruptCheckpointError
from replaybuf.persist.format.names import TensorInfo

CHUNK_BYTES = 32 << 20  # tensors move in slices of at most this many bytes (tests lower it)


class Sha256:
    """sha256 whose large updates run on a helper thread (hashlib releases the GIL), so hashing
    overlaps the caller's next read or write. Call :meth:`wait` before reusing a buffer."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None

    def update(self, data) -> None:
        self.wait()
        if memoryview(data).nbytes < 1 << 20:
            self._digest.update(data)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "replaybuf-sha256")
        self._pending = self._pool.submit(self._digest.update, data)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._digest.hexdigest()

    def __enter__(self) -> Sha256:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
        if self._pool is not None:
            self._pool.shutdown()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain-tensor alias (a MemoryMappedTensor's per-op overhead is not needed here)."""
    tensor = tensor.detach()
    return tensor if type(tensor) is torch.Tensor else tensor.as_subclass(torch.Tensor)


def chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``t`` covering it in row-major order, each at most ``CHUNK_BYTES``."""
    if t.dim() == 0 or t.numel() * t.element_size() <= CHUNK_BYTES:
        yield t
        return
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes > CHUNK_BYTES:  # one row is too big: split it along its own first dim
        for i in range(t.shape[0]):
            yield from chunks(t[i])
        return
    step = CHUNK_BYTES // row_bytes
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


def byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, as a writable numpy uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def pread_exact(fd: int, view: memoryview, offset: int, info: TensorInfo) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file that ends early is corrupt."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{info.file}: expected {info.nbytes} bytes, the file ended at {offset + done}"
            )
        done += n


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
