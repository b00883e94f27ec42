"""Writing a checkpoint: stream and hash each tensor into a tmp folder, manifest last, publish."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from replaybuf.errors import ArgumentError, CheckpointError, InsufficientSpaceError
from replaybuf.persist.format import streams
from replaybuf.persist.format.crash import crash_point
from replaybuf.persist.format.names import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    check_json,
    check_tensors,
    data_file,
    dtype_name,
    seal,
    target_path,
)
from replaybuf.persist.format.publish import (
    flock,
    parent_lock,
    publish,
    recover_locked,
    refuse_foreign,
    remove_tree,
    sibling,
)
from replaybuf.persist.metadata import library_versions


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
    target = target_path(directory)
    if not isinstance(kind, str) or not kind:
        raise ArgumentError(f"kind must be a non-empty str, got {kind!r}", argument="kind")
    meta = dict(meta)
    check_json(meta, "meta")
    items = check_tensors(tensors)
    tmp, tmp_fd = _make_tmp(target, items)
    try:
        crash_point("after_tmp_created")
        try:
            _write_tree(tmp, target, kind, meta, items, durable)
        except BaseException as exc:
            remove_tree(tmp)
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            raise CheckpointError(f"writing checkpoint {str(target)!r} failed: {exc}") from exc
        with parent_lock(target.parent):
            try:
                refuse_foreign(target)
                publish(tmp, target, durable)
            except BaseException:
                recover_locked(target, keep=tmp)  # roll forward if tmp got in, else back
                if tmp.exists():
                    remove_tree(tmp)
                raise
    finally:
        os.close(tmp_fd)
    return target


def _make_tmp(target: Path, items: dict[str, torch.Tensor]) -> tuple[Path, int]:
    """Under the parent lock: recover, refuse a foreign folder, check space, make a locked tmp."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with parent_lock(target.parent):
        recover_locked(target)
        refuse_foreign(target)
        needed = sum(t.numel() * t.element_size() for t in items.values()) + (1 << 20)
        free = shutil.disk_usage(target.parent).free
        if free < needed:
            raise InsufficientSpaceError(str(target.parent), needed, free)
        tmp = sibling(target, "tmp", uuid.uuid4().hex)
        tmp.mkdir()
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        flock(tmp_fd, blocking=False)  # marks tmp as alive: recover() leaves it alone
    return tmp, tmp_fd


def _write_tree(
    tmp: Path, target: Path, kind: str, meta: dict, items: dict[str, torch.Tensor], durable: bool
) -> None:
    """Data files, then the manifest, into ``tmp``; errors name the file and ``target``."""
    entries: dict[str, dict[str, Any]] = {}
    folders: set[Path] = set()  # data folders below tmp
    for name, tensor in items.items():
        rel = data_file(name)
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
            "dtype": dtype_name(tensor.dtype),
            "bytes": nbytes,
            "sha256": digest,
        }
        crash_point("after_data_file")
    payload = _manifest(kind, meta, entries)
    if durable:
        for folder in sorted(folders, key=lambda p: -len(p.parts)):  # deepest first
            streams.fsync_dir(folder)
    crash_point("before_manifest")
    _write_manifest(tmp, target, payload, durable)
    crash_point("after_manifest")


def _manifest(kind: str, meta: dict, entries: dict[str, dict[str, Any]]) -> bytes:
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "meta": meta,
        "tensors": entries,
    }
    return json.dumps(seal(document), indent=1, allow_nan=False).encode()


def _write_manifest(tmp: Path, target: Path, payload: bytes, durable: bool) -> None:
    try:
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            streams.write_all(fd, memoryview(payload))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            streams.fsync_dir(tmp)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {str(target)!r}: writing {MANIFEST} failed: {exc}"
        ) from exc


def _write_tensor(path: Path, tensor: torch.Tensor, durable: bool) -> tuple[int, str]:
    """Stream ``tensor`` into a new file at ``path``; returns (bytes written, sha256 hex)."""
    total = 0
    scratch: torch.Tensor | None = None  # the private copy of the current chunk
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with streams.Sha256() as digest:
            for chunk in streams.chunks(streams.plain(tensor)):
                # Hash and write one private copy of each chunk (at most CHUNK_BYTES): rows the
                # snapshot does not own (free rows under an episode buffer's high-water mark)
                # may be rewritten by appends while this streams, and the file must still
                # match its sha256. Those rows are never read back; owned rows are pinned.
                chunk = chunk.resolve_conj().resolve_neg()
                nbytes = chunk.numel() * chunk.element_size()
                if scratch is None or scratch.numel() < nbytes:
                    scratch = torch.empty(nbytes, dtype=torch.uint8)
                copy = scratch[:nbytes].view(chunk.dtype).view(chunk.shape)
                copy.copy_(chunk)  # one buffer, reused: bounded RAM however big the tensor
                data = streams.byte_view(copy)
                digest.update(data)  # on a helper thread, while this one writes
                streams.write_all(fd, memoryview(data))
                digest.wait()  # ``data`` may be a temporary: hashed before it is dropped
                total += data.nbytes
                crash_point("after_data_chunk")
            if durable:
                os.fsync(fd)
            return total, digest.hexdigest()
    finally:
        os.close(fd)
