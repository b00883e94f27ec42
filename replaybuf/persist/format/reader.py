"""Reading a checkpoint: recover, validate, then stream tensors out with optional re-hashing."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replaybuf.errors import CheckpointError, CorruptCheckpointError, SchemaError
from replaybuf.persist.format import streams
from replaybuf.persist.format.manifest import scan
from replaybuf.persist.format.names import MANIFEST, TensorInfo, dtype_name, target_path
from replaybuf.persist.format.publish import parent_lock, recover_locked, siblings


@dataclass(eq=False)
class Checkpoint:
    """A validated checkpoint, opened as a snapshot.

    Every data file is held open from :func:`read_checkpoint` on, so a later save into the same
    directory cannot change what this object loads. Call :meth:`close` (or use ``with``) to
    release the files; garbage collection closes them too.
    """

    directory: Path
    manifest: dict[str, Any]
    tensors: dict[str, TensorInfo]
    verified: bool = False  # every sha256 was checked when the checkpoint was opened
    _fds: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, streams.close_all, list(self._fds.values()))

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    @property
    def format_version(self) -> int:
        """The manifest's ``format_version``: meta written by version 1 may lack newer keys."""
        return self.manifest["format_version"]

    def load(self, name: str, *, verify: bool = False) -> torch.Tensor:
        """Tensor ``name`` read into a fresh CPU tensor; see :meth:`load_into` for ``verify``."""
        info = self._info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        return self.load_into(name, out, verify=verify)

    def load_into(self, name: str, out: torch.Tensor, *, verify: bool = False) -> torch.Tensor:
        """Stream tensor ``name`` into ``out`` (CPU, memmap or CUDA), one bounded chunk at a time.

        ``out`` must have the stored shape and dtype. ``verify`` hashes the bytes again as they
        arrive: use it after ``read_checkpoint(verify=False)`` to read each file once instead of
        twice. On a mismatch ``out`` holds garbage and :class:`CorruptCheckpointError` names the
        file.
        """
        info = self._info(name)
        if tuple(out.shape) != info.shape or out.dtype != info.dtype:
            raise SchemaError(
                f"load_into({name!r}): out expected shape {info.shape} dtype"
                f" {dtype_name(info.dtype)}, got shape {tuple(out.shape)} dtype"
                f" {dtype_name(out.dtype)}"
            )
        if not self._finalizer.alive:
            raise CheckpointError(f"checkpoint {str(self.directory)!r} is closed")
        _read_tensor(self._fds[name], info, out, verify, self.directory)
        return out

    def close(self) -> None:
        """Release the data files. Loading afterwards raises :class:`CheckpointError`."""
        self._finalizer()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(
                f"no tensor {name!r} in checkpoint; it holds {sorted(self.tensors)}"
            ) from None


def read_checkpoint(
    directory: str | os.PathLike[str], kind: str | None = None, *, verify: bool = True
) -> Checkpoint:
    """Recover, validate and open the checkpoint at ``directory``.

    Validation, before anything is returned: ``MANIFEST.json`` present (else
    :class:`NoCheckpointError`), valid JSON of this format, a supported ``format_version``
    (:class:`UnsupportedVersionError`), ``kind`` as asked (:class:`CheckpointKindError`), every
    file a plain relative path inside the checkpoint and no symlink on the way
    (:class:`UnsafeCheckpointError`, checked before opening), each file's size equal to
    shape x itemsize, and with ``verify`` its sha256 (:class:`CorruptCheckpointError`). Files are
    opened read-only; the checkpoint is never written to (a read-only checkpoint loads).
    """
    checkpoint, problems = _open_checkpoint(target_path(directory), kind, verify, stop_early=True)
    if problems:
        raise problems[0]
    return checkpoint


def verify_checkpoint(directory: str | os.PathLike[str]) -> list[str]:
    """Every problem found in the checkpoint at ``directory``; an empty list when it is sound."""
    try:
        target = target_path(directory)
        checkpoint, problems = _open_checkpoint(target, None, True, stop_early=False)
    except CheckpointError as exc:
        return [str(exc)]
    checkpoint.close()
    return [str(p) for p in problems]


def describe_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the checkpoint at ``directory`` holds (sizes checked, checksums not)."""
    target = target_path(directory)
    with read_checkpoint(target, verify=False) as checkpoint:
        listed = {MANIFEST, *(info.file for info in checkpoint.tensors.values())}
        return {
            "directory": str(target),
            "kind": checkpoint.kind,
            "format_version": checkpoint.manifest["format_version"],
            "created": checkpoint.manifest.get("created"),
            "versions": checkpoint.manifest.get("versions"),
            "tensors": {
                name: {"shape": list(i.shape), "dtype": dtype_name(i.dtype), "bytes": i.nbytes}
                for name, i in checkpoint.tensors.items()
            },
            "bytes": sum(i.nbytes for i in checkpoint.tensors.values()),
            "meta": checkpoint.meta,
            "extra_files": sorted(set(_walk_files(target)) - listed),
        }


def _open_checkpoint(
    target: Path, kind: str | None, verify: bool, *, stop_early: bool
) -> tuple[Checkpoint, list[CheckpointError]]:
    """Open and check ``target``; fatal problems raise, per-file problems are returned."""
    with parent_lock(target.parent, best_effort=True):  # no publish can run meanwhile
        if siblings(target):
            recover_locked(target)
        manifest, infos, fds, problems = scan(target, kind, stop_early=stop_early)
    checkpoint = Checkpoint(target, manifest, infos, verify, fds)
    if verify and not (problems and stop_early):
        for name, info in infos.items():  # hashed outside the lock: the open files suffice
            actual = _hash_fd(fds[name], info)
            if actual != info.sha256:
                problems.append(_sha_mismatch(target, info, actual))
                if stop_early:
                    break
    if problems and stop_early:
        checkpoint.close()
    return checkpoint, problems


def _hash_fd(fd: int, info: TensorInfo) -> str:
    """sha256 of a data file, reading one buffer while the other is hashed."""
    size = min(streams.CHUNK_BYTES, max(info.nbytes, 1))
    buffers = [memoryview(bytearray(size)), memoryview(bytearray(size))]
    with streams.Sha256() as digest:
        for i, offset in enumerate(range(0, info.nbytes, size)):
            view = buffers[i % 2][: min(size, info.nbytes - offset)]
            streams.pread_exact(fd, view, offset, info)  # the other buffer is still being hashed
            digest.wait()
            digest.update(view)
        return digest.hexdigest()


def _read_tensor(fd: int, info: TensorInfo, out: torch.Tensor, verify: bool, target: Path) -> None:
    offset = 0
    staging: torch.Tensor | None = None
    with streams.Sha256() as digest:
        for chunk in streams.chunks(streams.plain(out)):
            n = chunk.numel() * chunk.element_size()
            if n == 0:
                continue
            direct = chunk.device.type == "cpu" and chunk.is_contiguous()
            if direct:
                landing = chunk
            else:
                digest.wait()  # the staging buffer is about to be reused
                if staging is None:
                    staging = torch.empty(
                        streams.CHUNK_BYTES, dtype=torch.uint8, pin_memory=out.is_cuda
                    )
                landing = staging[:n].view(info.dtype).view(chunk.shape)
            data = streams.byte_view(landing)
            streams.pread_exact(fd, memoryview(data), offset, info)
            if info.dtype == torch.bool and bool((landing.view(torch.uint8) > 1).any()):
                raise CorruptCheckpointError(
                    f"checkpoint {str(target)!r}: {info.file}: a bool tensor holds bytes other"
                    " than 0 and 1"
                )
            if verify:
                digest.wait()
                digest.update(data)
            if not direct:
                chunk.copy_(landing)
            offset += n
        if verify and digest.hexdigest() != info.sha256:
            raise _sha_mismatch(target, info, digest.hexdigest())


def _sha_mismatch(target: Path, info: TensorInfo, actual: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {str(target)!r}: {info.file}: sha256 expected {info.sha256}, got {actual}"
        " (file altered or damaged)"
    )


def _walk_files(root: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):  # os.walk does not follow symlinked folders
        rel = Path(folder).relative_to(root)
        for name in dirs + files:
            path = rel / name
            if name in files or (root / path).is_symlink():
                yield path.as_posix()
