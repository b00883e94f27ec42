"""Checkpoint directories: a JSON manifest plus one raw file per tensor, published atomically.

A checkpoint directory ``D`` holds::

    D/MANIFEST.json         written last: D is a checkpoint once this file is complete
    D/data/obs.bin          tensor "obs": raw little-endian bytes in row-major (C) order
    D/data/next/obs.bin     tensor "next/obs" ('/' in a tensor name nests folders)

and ``MANIFEST.json`` reads::

    {"format": "replaybuf.checkpoint", "format_version": 1, "kind": "ReplayBuffer",
     "created": "2026-01-01T00:00:00+00:00",
     "versions": {"torch": "...", "torchrl": "...", "tensordict": "..."},
     "meta": {...the caller's JSON: config, counters, episode table...},
     "tensors": {"obs": {"file": "data/obs.bin", "shape": [100, 4], "dtype": "float32",
                         "bytes": 1600, "sha256": "9f86d0..."}}}

Nothing in a checkpoint is ever unpickled: the manifest is JSON and tensors are raw bytes. Files
the manifest does not list (``prefetch.pkl``, ``*.pt``...) are never opened.

Commit protocol (``P`` is D's parent, ``u`` a fresh uuid; ``[lock P]`` is an ``flock`` on P held
only for the short steps, while the writer keeps its tmp folder locked as proof that it is alive)::

    [lock P] recover(D)
    write P/.D.replaybuf-tmp-u/data/*.bin, then its MANIFEST.json; fsync each file and folder
    [lock P] rename D -> P/.D.replaybuf-old-u       (only when D exists)
             rename P/.D.replaybuf-tmp-u -> D;  fsync P;  remove P/.D.replaybuf-old-u

    killed while writing the tmp folder  ->  D is the previous checkpoint, tmp an orphan
    killed between the two renames       ->  D is missing, tmp is complete: recovery renames it in
    killed after the second rename       ->  D is the new checkpoint, old an orphan

:func:`recover` (which every reader and writer runs first) puts a complete checkpoint back at D
and then deletes the dead ``.D.replaybuf-tmp-*`` / ``.D.replaybuf-old-*`` siblings, and nothing
else. For fault-injection tests, ``REPLAYBUF_CRASH_AT=<phase>[:<k>]`` makes the process SIGKILL
itself the k-th time it reaches ``phase`` (see :data:`CRASH_PHASES`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replaybuf.errors import (
    CheckpointError,
    CheckpointKindError,
    CorruptCheckpointError,
    InsufficientSpaceError,
    NoCheckpointError,
    SchemaError,
    UnsafeCheckpointError,
    UnsupportedVersionError,
)
from replaybuf.metadata import library_versions

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process locking
    fcntl = None  # type: ignore[assignment]

FORMAT = "replaybuf.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
CHUNK_BYTES = 32 << 20  # tensors move in slices of at most this many bytes
MAX_MANIFEST_BYTES = 1 << 30
CRASH_ENV = "REPLAYBUF_CRASH_AT"
CRASH_PHASES = (
    "after_tmp_created",
    "after_data_chunk",
    "after_data_file",
    "before_manifest",
    "after_manifest",
    "after_old_renamed",
    "after_publish_rename",
    "before_old_removed",
    "during_old_removal",
    "recover_after_rename",
)
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}  # fmt: skip
_NAME_PART = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_crash_counts: dict[str, int] = {}


# ---------------------------------------------------------------------------------------------
# public API


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its manifest describes it."""

    name: str
    file: str  # relative to the checkpoint directory
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    sha256: str


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
        self._finalizer = weakref.finalize(self, _close_all, list(self._fds.values()))

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

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
                f" {_dtype_name(info.dtype)}, got shape {tuple(out.shape)} dtype"
                f" {_dtype_name(out.dtype)}"
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


def write_checkpoint(
    directory: str | os.PathLike[str],
    kind: str,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    durable: bool = True,
) -> Path:
    """Write a checkpoint of ``kind`` at ``directory``, replacing any previous one atomically.

    Args:
        directory: the checkpoint folder. Its parent is created when missing. An existing
            ``directory`` must be a replaybuf checkpoint or empty; anything else is refused.
        kind: what saved it, e.g. ``"ReplayBuffer"``; :func:`read_checkpoint` checks it.
        meta: JSON data (str keys; finite floats; tuples come back as lists).
        tensors: name -> tensor on any device, contiguous or not (a memmap tensor is streamed
            in ``CHUNK_BYTES`` slices, so extra RAM stays bounded). Names are relative paths of
            ``[A-Za-z0-9_.-]`` parts joined by '/', no part starting with '.'.
        durable: fsync every file and folder (the default). ``False`` keeps atomicity against
            a killed process but not against power loss.

    Returns:
        ``directory`` as an absolute path.
    """
    target = _target(directory)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty str, got {kind!r}")
    meta = dict(meta)
    _check_json(meta, "meta")
    items = _check_tensors(tensors)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _parent_lock(target.parent):
        _recover_locked(target)
        _refuse_foreign(target)
        needed = sum(t.numel() * t.element_size() for t in items.values()) + (1 << 20)
        free = shutil.disk_usage(target.parent).free
        if free < needed:
            raise InsufficientSpaceError(str(target.parent), needed, free)
        tmp = _sibling(target, "tmp", uuid.uuid4().hex)
        tmp.mkdir()
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        _flock(tmp_fd, blocking=False)  # marks tmp as alive: recover() leaves it alone
    try:
        _crash_point("after_tmp_created")
        try:
            _write_tree(tmp, target, kind, meta, items, durable)
        except BaseException as exc:
            _remove_tree(tmp)
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            raise CheckpointError(f"writing checkpoint {str(target)!r} failed: {exc}") from exc
        with _parent_lock(target.parent):
            try:
                _refuse_foreign(target)
                _publish(tmp, target, durable)
            except BaseException:
                _recover_locked(target, keep=tmp)  # roll forward if tmp got in, else back
                if tmp.exists():
                    _remove_tree(tmp)
                raise
    finally:
        os.close(tmp_fd)
    return target


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
    checkpoint, problems = _open_checkpoint(_target(directory), kind, verify, stop_early=True)
    if problems:
        raise problems[0]
    return checkpoint


def verify_checkpoint(directory: str | os.PathLike[str]) -> list[str]:
    """Every problem found in the checkpoint at ``directory``; an empty list when it is sound."""
    try:
        checkpoint, problems = _open_checkpoint(_target(directory), None, True, stop_early=False)
    except CheckpointError as exc:
        return [str(exc)]
    checkpoint.close()
    return [str(p) for p in problems]


def describe_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the checkpoint at ``directory`` holds (sizes checked, checksums not)."""
    target = _target(directory)
    with read_checkpoint(target, verify=False) as checkpoint:
        listed = {MANIFEST, *(info.file for info in checkpoint.tensors.values())}
        return {
            "directory": str(target),
            "kind": checkpoint.kind,
            "format_version": checkpoint.manifest["format_version"],
            "created": checkpoint.manifest.get("created"),
            "versions": checkpoint.manifest.get("versions"),
            "tensors": {
                name: {"shape": list(i.shape), "dtype": _dtype_name(i.dtype), "bytes": i.nbytes}
                for name, i in checkpoint.tensors.items()
            },
            "bytes": sum(i.nbytes for i in checkpoint.tensors.values()),
            "meta": checkpoint.meta,
            "extra_files": sorted(set(_walk_files(target)) - listed),
        }


def recover(directory: str | os.PathLike[str]) -> list[str]:
    """Finish or undo an interrupted save at ``directory`` and delete its dead siblings.

    With ``directory`` missing, the newest complete ``.<name>.replaybuf-tmp-*`` (a save killed
    between its two renames) is renamed in, else the newest complete ``-old-*`` backup. Then
    every ``.<name>.replaybuf-tmp-*`` / ``-old-*`` folder whose writer is gone is removed; a tmp
    folder still locked by a live writer is left alone. Returns what was done, one line each.
    """
    target = _target(directory)
    if not _siblings(target):
        return []
    with _parent_lock(target.parent):
        return _recover_locked(target)


# ---------------------------------------------------------------------------------------------
# writing


def _write_tree(
    tmp: Path, target: Path, kind: str, meta: dict, items: dict[str, torch.Tensor], durable: bool
) -> None:
    """Data files, then the manifest, into ``tmp``; errors name the file and ``target``."""
    entries: dict[str, dict[str, Any]] = {}
    folders: set[Path] = set()  # data folders below tmp
    for name, tensor in items.items():
        rel = _data_file(name)
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        folders.update(p for p in path.parents if tmp in p.parents)
        try:
            nbytes, digest = _write_tensor(path, tensor, durable)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {str(target)!r}: writing {rel} failed: {exc}"
            ) from exc
        entries[name] = {
            "file": rel,
            "shape": list(tensor.shape),
            "dtype": _dtype_name(tensor.dtype),
            "bytes": nbytes,
            "sha256": digest,
        }
        _crash_point("after_data_file")
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "meta": meta,
        "tensors": entries,
    }
    payload = json.dumps(document, indent=1, allow_nan=False).encode()
    if durable:
        for folder in sorted(folders, key=lambda p: -len(p.parts)):  # deepest first
            _fsync_dir(folder)
    _crash_point("before_manifest")
    try:
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(payload))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            _fsync_dir(tmp)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {str(target)!r}: writing {MANIFEST} failed: {exc}"
        ) from exc
    _crash_point("after_manifest")


def _write_tensor(path: Path, tensor: torch.Tensor, durable: bool) -> tuple[int, str]:
    """Stream ``tensor`` into a new file at ``path``; returns (bytes written, sha256 hex)."""
    total = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with _Sha256() as digest:
            for chunk in _chunks(_plain(tensor)):
                if chunk.device.type != "cpu":
                    chunk = chunk.to("cpu")
                chunk = chunk.resolve_conj().resolve_neg().contiguous()
                data = _byte_view(chunk)  # a view: a CPU memmap tensor is not copied
                digest.update(data)  # on a helper thread, while this one writes
                _write_all(fd, memoryview(data))
                digest.wait()  # ``data`` may be a temporary: hashed before it is dropped
                total += data.nbytes
                _crash_point("after_data_chunk")
            if durable:
                os.fsync(fd)
            return total, digest.hexdigest()
    finally:
        os.close(fd)


def _publish(tmp: Path, target: Path, durable: bool) -> None:
    old = _sibling(target, "old", tmp.name.rsplit("-", 1)[1])
    had_old = os.path.lexists(target)
    if had_old:
        os.rename(target, old)
        _crash_point("after_old_renamed")
    os.rename(tmp, target)
    _crash_point("after_publish_rename")
    if durable:
        _fsync_dir(target.parent)
    _crash_point("before_old_removed")
    if had_old:
        _remove_tree(old, crash_phase="during_old_removal")


def _refuse_foreign(target: Path) -> None:
    """Only a replaybuf checkpoint or an empty folder may be replaced."""
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir():
        raise CheckpointError(
            f"{str(target)!r} exists and is a file or symlink, not a checkpoint folder;"
            " refusing to replace it"
        )
    if not any(target.iterdir()):
        return
    try:
        _read_manifest(target)
    except UnsupportedVersionError:
        return  # ours, from another version
    except CheckpointError as exc:
        raise CheckpointError(
            f"{str(target)!r} exists and is not a replaybuf checkpoint ({exc});"
            " refusing to replace a folder replaybuf did not write"
        ) from None


# ---------------------------------------------------------------------------------------------
# reading and validation


def _open_checkpoint(
    target: Path, kind: str | None, verify: bool, *, stop_early: bool
) -> tuple[Checkpoint, list[CheckpointError]]:
    """Open and check ``target``; fatal problems raise, per-file problems are returned."""
    with _parent_lock(target.parent, best_effort=True):  # no publish can run meanwhile
        if _siblings(target):
            _recover_locked(target)
        manifest, infos, fds, problems = _scan(target, kind, stop_early=stop_early)
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


def _scan(target: Path, kind: str | None, *, stop_early: bool) -> tuple[dict, dict, dict, list]:
    """Parse the manifest and open every data file, checking paths and sizes (not hashes)."""
    problems: list[CheckpointError] = []
    infos: dict[str, TensorInfo] = {}
    fds: dict[str, int] = {}
    dir_fd = _open_dir(target)
    try:
        manifest = _parse_manifest(target, _read_file(dir_fd, MANIFEST, target), kind)
        for name, entry in manifest["tensors"].items():
            try:
                info = _parse_entry(target, name, entry)
                fds[name] = _open_data_file(dir_fd, info, target)
                infos[name] = info
            except CheckpointError as exc:
                problems.append(exc)
                if stop_early:
                    break
    except BaseException:
        _close_all(list(fds.values()))
        raise
    finally:
        os.close(dir_fd)
    return manifest, infos, fds, problems


def _read_manifest(target: Path) -> dict[str, Any]:
    dir_fd = _open_dir(target)
    try:
        return _parse_manifest(target, _read_file(dir_fd, MANIFEST, target), None)
    finally:
        os.close(dir_fd)


def _parse_manifest(target: Path, raw: bytes, kind: str | None) -> dict[str, Any]:
    where = f"checkpoint {str(target)!r}"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: {MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CorruptCheckpointError(f"{where}: {MANIFEST} format expected {FORMAT!r}, got {got!r}")
    version = doc.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise UnsupportedVersionError(version, FORMAT_VERSION, where)
    for key, typ in (("kind", str), ("meta", dict), ("tensors", dict)):
        if not isinstance(doc.get(key), typ):
            raise CorruptCheckpointError(
                f"{where}: {MANIFEST} field {key!r} expected a {typ.__name__}, got {doc.get(key)!r}"
            )
    if kind is not None and doc["kind"] != kind:
        raise CheckpointKindError(
            f"{where} holds a {doc['kind']!r} checkpoint; expected a {kind!r} checkpoint"
        )
    return doc


def _parse_entry(target: Path, name: object, entry: object) -> TensorInfo:
    """A manifest tensor entry, checked field by field; paths are checked before any open."""
    where = f"checkpoint {str(target)!r}: {MANIFEST}: tensor {name!r}"
    if not isinstance(name, str) or not _valid_name(name):
        raise UnsafeCheckpointError(f"{where}: the name is not a safe relative name")
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where}: expected an object, got {entry!r}")
    file = entry.get("file")
    if not _safe_relative(file):
        raise UnsafeCheckpointError(
            f"{where}: file {file!r} is not a relative path inside the checkpoint"
        )
    if file != _data_file(name):
        raise CorruptCheckpointError(f"{where}: file expected {_data_file(name)!r}, got {file!r}")
    shape, dtype_name, nbytes = entry.get("shape"), entry.get("dtype"), entry.get("bytes")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise CorruptCheckpointError(f"{where}: shape expected a list of ints >= 0, got {shape!r}")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise CorruptCheckpointError(
            f"{where}: dtype expected one of {sorted(_DTYPES)}, got {dtype_name!r}"
        )
    dtype = _DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if not _is_count(nbytes) or nbytes != expected:
        raise CorruptCheckpointError(
            f"{where}: bytes expected {expected} (shape {shape} x {dtype_name}), got {nbytes!r}"
        )
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise CorruptCheckpointError(f"{where}: sha256 expected 64 hex digits, got {digest!r}")
    return TensorInfo(name, file, tuple(shape), dtype, nbytes, digest)


def _open_data_file(dir_fd: int, info: TensorInfo, target: Path) -> int:
    fd = _open_nofollow(dir_fd, info.file, target)
    size = os.fstat(fd).st_size
    if size != info.nbytes:
        os.close(fd)
        raise CorruptCheckpointError(
            f"checkpoint {str(target)!r}: {info.file}: expected {info.nbytes} bytes, got {size}"
        )
    return fd


def _open_nofollow(dir_fd: int, rel: str, target: Path) -> int:
    """Open ``rel`` under ``dir_fd`` read-only, refusing symlinks at every step before opening."""
    parts = rel.split("/")
    current, opened = dir_fd, []
    try:
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            so_far = "/".join(parts[: depth + 1])
            try:
                mode = os.stat(part, dir_fd=current, follow_symlinks=False).st_mode
            except FileNotFoundError:
                if rel == MANIFEST:
                    raise NoCheckpointError(
                        f"no complete checkpoint in {str(target)!r} (no {MANIFEST})"
                    ) from None
                raise CorruptCheckpointError(
                    f"checkpoint {str(target)!r}: {rel}: missing"
                ) from None
            if stat.S_ISLNK(mode):
                raise UnsafeCheckpointError(
                    f"checkpoint {str(target)!r}: {so_far} is a symlink; refusing to open {rel}"
                )
            if not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
                want = "a regular file" if last else "a folder"
                raise CorruptCheckpointError(f"checkpoint {str(target)!r}: {so_far} is not {want}")
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if last else os.O_DIRECTORY)
            try:
                current = os.open(part, flags, dir_fd=current)
            except OSError as exc:  # e.g. ELOOP: replaced by a symlink since the stat
                raise UnsafeCheckpointError(
                    f"checkpoint {str(target)!r}: cannot open {rel} safely: {exc}"
                ) from None
            opened.append(current)
        return opened.pop()
    finally:
        _close_all(opened)


def _read_file(dir_fd: int, rel: str, target: Path) -> bytes:
    fd = _open_nofollow(dir_fd, rel, target)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"checkpoint {str(target)!r}: {rel}: expected at most {MAX_MANIFEST_BYTES} bytes,"
                f" got {size}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _open_dir(target: Path) -> int:
    try:
        return os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise NoCheckpointError(f"no complete checkpoint in {str(target)!r}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint {str(target)!r}: {exc}") from exc


def _hash_fd(fd: int, info: TensorInfo) -> str:
    """sha256 of a data file, reading one buffer while the other is hashed."""
    size = min(CHUNK_BYTES, max(info.nbytes, 1))
    buffers = [memoryview(bytearray(size)), memoryview(bytearray(size))]
    with _Sha256() as digest:
        for i, offset in enumerate(range(0, info.nbytes, size)):
            view = buffers[i % 2][: min(size, info.nbytes - offset)]
            _pread_exact(fd, view, offset, info)  # the other buffer is still being hashed
            digest.wait()
            digest.update(view)
        return digest.hexdigest()


def _read_tensor(fd: int, info: TensorInfo, out: torch.Tensor, verify: bool, target: Path) -> None:
    offset = 0
    staging: torch.Tensor | None = None
    with _Sha256() as digest:
        for chunk in _chunks(_plain(out)):
            n = chunk.numel() * chunk.element_size()
            if n == 0:
                continue
            direct = chunk.device.type == "cpu" and chunk.is_contiguous()
            if not direct:
                digest.wait()  # the staging buffer is about to be reused
                if staging is None:
                    staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=out.is_cuda)
            landing = chunk if direct else staging[:n].view(info.dtype).view(chunk.shape)
            data = _byte_view(landing)
            _pread_exact(fd, memoryview(data), offset, info)
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


def _pread_exact(fd: int, view: memoryview, offset: int, info: TensorInfo) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{info.file}: expected {info.nbytes} bytes, the file ended at {offset + done}"
            )
        done += n


def _sha_mismatch(target: Path, info: TensorInfo, actual: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {str(target)!r}: {info.file}: sha256 expected {info.sha256}, got {actual}"
        " (file altered or damaged)"
    )


class _Sha256:
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

    def __enter__(self) -> _Sha256:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
        if self._pool is not None:
            self._pool.shutdown()


# ---------------------------------------------------------------------------------------------
# recovery and locking


def _recover_locked(target: Path, keep: Path | None = None) -> list[str]:
    """Make ``target`` whole and delete dead siblings; the caller holds the parent lock."""
    done: list[str] = []
    dead = [(p, role) for p, role in _siblings(target) if p != keep and not _alive(p)]
    if not os.path.lexists(target):
        for role in ("tmp", "old"):  # a finished tmp is newer than any backup
            complete = [p for p, r in dead if r == role and _is_complete(p)]
            if complete:
                best = max(complete, key=lambda p: (_created(p), p.name))
                try:
                    os.rename(best, target)
                    _fsync_dir(target.parent)
                except OSError as exc:
                    raise CheckpointError(
                        f"cannot recover {str(target)!r} from {best.name}: {exc}"
                    ) from exc
                dead = [(p, r) for p, r in dead if p != best]
                done.append(f"renamed {best.name} to {target.name}")
                _crash_point("recover_after_rename")
                break
    for path, _ in dead:
        _remove_tree(path)  # best effort: a read-only parent still lets a checkpoint load
        done.append(f"{'left' if os.path.lexists(path) else 'removed'} {path.name}")
    return done


def _siblings(target: Path) -> list[tuple[Path, str]]:
    """The ``.<name>.replaybuf-tmp-<hex>`` / ``-old-<hex>`` folders next to ``target``."""
    pattern = re.compile(re.escape(f".{target.name}.replaybuf-") + r"(tmp|old)-[0-9a-f]{32}")
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return []
    return [
        (Path(e.path), m.group(1))
        for e in entries
        if (m := pattern.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)
    ]


def _sibling(target: Path, role: str, token: str) -> Path:
    return target.parent / f".{target.name}.replaybuf-{role}-{token}"


def _alive(path: Path) -> bool:
    """Whether a live writer holds ``path`` (a tmp folder) locked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return not _flock(fd, blocking=False)
    finally:
        os.close(fd)


def _is_complete(path: Path) -> bool:
    """A manifest that parses and every file it lists present at its size (hashes not read)."""
    try:
        _, _, fds, problems = _scan(path, None, stop_early=True)
    except CheckpointError:
        return False
    _close_all(list(fds.values()))
    return not problems


def _created(path: Path) -> str:
    try:
        return str(_read_manifest(path).get("created", ""))
    except CheckpointError:
        return ""


@contextlib.contextmanager
def _parent_lock(parent: Path, *, best_effort: bool = False) -> Iterator[None]:
    """An exclusive ``flock`` on ``parent``: publishing, recovery and opening never overlap."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        if not best_effort:  # a reader of a missing or unreadable parent goes on unlocked
            raise
        yield
        return
    try:
        _flock(fd, blocking=True)
        yield
    finally:
        os.close(fd)


def _flock(fd: int, *, blocking: bool) -> bool:
    """Lock ``fd`` exclusively; False when another holder has it (non-blocking only)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: proceed unlocked
        return True
    return True


def _remove_tree(path: Path, crash_phase: str | None = None) -> None:
    """Delete a folder we created: the manifest first, so a half-deleted one reads incomplete."""
    with contextlib.suppress(OSError):  # best effort: a leftover is retried by the next recover
        os.unlink(path / MANIFEST)
    if crash_phase:
        _crash_point(crash_phase)
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# small helpers


def _target(directory: str | os.PathLike[str]) -> Path:
    target = Path(os.path.abspath(os.fspath(directory)))
    if target.name in ("", ".", ".."):
        raise ValueError(f"directory must name a folder, got {os.fspath(directory)!r}")
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise CheckpointError("the checkpoint format is little-endian; this host is big-endian")
    return target


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}"
        )
    items, folded = {}, {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not _valid_name(name):
            raise ValueError(
                f"tensor name must be '/'-joined parts of [A-Za-z0-9_.-], none empty or starting"
                f" with '.' (no '..', no absolute path), got {name!r}"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(
                f"tensor {name!r} must be a dense torch.Tensor, got {type(tensor).__name__}"
            )
        if _dtype_name(tensor.dtype) not in _DTYPES:
            raise TypeError(
                f"tensor {name!r} dtype must be one of {sorted(_DTYPES)}, got {tensor.dtype}"
            )
        if name.lower() in folded:  # data/Obs.bin and data/obs.bin collide on some filesystems
            raise ValueError(
                f"tensor names {folded[name.lower()]!r} and {name!r} differ only in case"
            )
        folded[name.lower()] = name
        items[name] = tensor
    return items


def _check_json(value: object, path: str) -> None:
    """Reject what JSON would silently change or cannot hold; the error names the spot."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite float for JSON, got {value!r}")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path} keys must be str for JSON, got {key!r}")
            _check_json(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]")
    else:
        raise TypeError(
            f"{path} must be JSON data (dict, list, str, int, float, bool, None),"
            f" got {type(value).__name__}"
        )


def _valid_name(name: str) -> bool:
    return bool(name) and all(_NAME_PART.fullmatch(part) for part in name.split("/"))


def _safe_relative(file: object) -> bool:
    if (
        not isinstance(file, str)
        or not file
        or file.startswith("/")
        or "\\" in file
        or "\0" in file
    ):
        return False
    return all(part not in ("", ".", "..") for part in file.split("/"))


def _data_file(name: str) -> str:
    return f"data/{name}.bin"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain-tensor alias (a MemoryMappedTensor's per-op overhead is not needed here)."""
    tensor = tensor.detach()
    return tensor if type(tensor) is torch.Tensor else tensor.as_subclass(torch.Tensor)


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``t`` covering it in row-major order, each at most ``CHUNK_BYTES``."""
    if t.dim() == 0 or t.numel() * t.element_size() <= CHUNK_BYTES:
        yield t
        return
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes > CHUNK_BYTES:  # one row is too big: split it along its own first dim
        for i in range(t.shape[0]):
            yield from _chunks(t[i])
        return
    step = CHUNK_BYTES // row_bytes
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


def _byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, as a writable numpy uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _walk_files(root: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):  # os.walk does not follow symlinked folders
        rel = Path(folder).relative_to(root)
        for name in dirs + files:
            path = rel / name
            if name in files or (root / path).is_symlink():
                yield path.as_posix()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _crash_point(phase: str) -> None:
    """SIGKILL this process at ``phase`` when ``REPLAYBUF_CRASH_AT`` asks for it (tests only)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != phase:
        return
    _crash_counts[phase] = _crash_counts.get(phase, 0) + 1
    if _crash_counts[phase] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
