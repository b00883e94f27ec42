"""The metadata file format shared by both buffers: JSON, versioned, written atomically.

``save(path)`` writes ``path + ".metadata"``; ``load(path)`` reads it. Nothing here executes code
from the file (plain ``json``), and a write never leaves a torn file: the bytes go to a temporary
sibling, are fsynced, and replace the old file with ``os.replace``.

Metadata holds no rows (ObjectRL's meaning of ``save``). So that nobody takes it for a save of
the contents, ``save`` returns a :class:`SavedMetadata` with ``contents_saved=False`` and the
first save of a process logs a warning naming ``save_checkpoint``, which saves everything.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensordict
import torch
import torchrl

from replaybuf.errors import MetadataError
from replaybuf.storage import FieldSpec

FORMAT = "replaybuf.persist.metadata"
FORMAT_VERSION = 1
SUFFIX = ".metadata"
NOTE = (
    "save() wrote metadata only (capacity, counters, field spec), not the stored transitions; "
    "use save_checkpoint(directory) to save the contents"
)
_logger = logging.getLogger("replaybuf")
_warned = False  # the metadata-only warning is logged once per process
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class SavedMetadata:
    """What ``save(path)`` wrote: the metadata file at ``path``, never the rows.

    ``contents_saved`` is always ``False`` and ``note`` says how to save the contents
    (``save_checkpoint``). ``os.fspath(saved)`` is the file's path.
    """

    path: Path
    contents_saved: bool = False
    note: str = NOTE

    def __fspath__(self) -> str:
        return os.fspath(self.path)


def saved_metadata(target: Path) -> SavedMetadata:
    """The result of a metadata save at ``target``; warns (once per process) that it holds no
    rows."""
    global _warned
    with _warned_lock:
        first, _warned = not _warned, True
    if first:
        _logger.warning("%s (wrote %s; logged once per process)", NOTE, target)
    return SavedMetadata(target)


def metadata_path(path: str | os.PathLike) -> Path:
    """``path`` with the metadata suffix, as ObjectRL names it."""
    return Path(os.fspath(path) + SUFFIX)


def library_versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
    }


def write_metadata(path: str | os.PathLike, buffer_kind: str, fields: dict[str, Any]) -> Path:
    """Atomically write the metadata of a buffer of ``buffer_kind``; returns the file written."""
    target = metadata_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "buffer": buffer_kind,
        "versions": library_versions(),
        **fields,
    }
    payload = json.dumps(document, indent=2, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return target


def read_metadata(path: str | os.PathLike, buffer_kind: str) -> dict[str, Any]:
    """Read and check a metadata file; raise :class:`MetadataError` naming what is wrong."""
    target = metadata_path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        raise MetadataError(f"metadata file {str(target)!r} does not exist") from None
    except OSError as exc:
        raise MetadataError(f"metadata file {str(target)!r} cannot be read: {exc}") from exc
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MetadataError(f"metadata file {str(target)!r} is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise MetadataError(f"{str(target)!r} is not a replaybuf metadata file")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise MetadataError(
            f"{str(target)!r}: format_version expected {FORMAT_VERSION}, got {version!r}"
        )
    if document.get("buffer") != buffer_kind:
        raise MetadataError(
            f"{str(target)!r}: buffer expected {buffer_kind!r}, got {document.get('buffer')!r}"
        )
    return document


def require_int(
    document: Mapping[str, Any],
    name: str,
    low: int,
    high: int | None = None,
    *,
    error: type[Exception] = MetadataError,
    context: str = "metadata field",
) -> int:
    """An integer field of ``document`` in ``[low, high]``, else ``error`` naming it."""
    value = document.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{context} {name!r} expected an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise error(f"{context} {name!r} expected {bound}, got {value}")
    return value


def read_spec(
    document: Mapping[str, Any],
    name: str = "spec",
    *,
    error: type[Exception] = MetadataError,
    context: str = "metadata field",
) -> FieldSpec | None:
    """The field spec recorded under ``name`` (``None`` if none), else ``error`` naming it."""
    data = document.get(name)
    if data is None:
        return None
    try:
        if not isinstance(data, dict):
            raise TypeError(f"expected an object, got {type(data).__name__}")
        return FieldSpec.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise error(f"{context} {name!r} is malformed: {exc}") from None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_ring_metadata(
    document: Mapping[str, Any], size: int, buffer_size: int, spec: FieldSpec | None
) -> tuple[int, FieldSpec | None]:
    """A ``ReplayBuffer`` file's ``buffer_size`` and spec, checked (against a buffer holding
    ``size`` rows: a buffer with rows must agree with the file)."""
    saved_size = require_int(document, "buffer_size", 1)
    require_int(document, "data_size", 0, saved_size)
    require_int(document, "pointer", 0, saved_size - 1)
    saved_spec = read_spec(document)
    if size and saved_size != buffer_size:
        raise MetadataError(f"buffer_size: metadata has {saved_size}, this buffer {buffer_size}")
    if size and saved_spec is not None and saved_spec != spec:
        raise MetadataError(f"spec: metadata has {saved_spec}, this buffer {spec}")
    return saved_size, saved_spec


def check_episode_metadata(
    document: Mapping[str, Any],
    max_steps: int,
    stacking: tuple[int | None, str],
    spec: FieldSpec | None,
) -> FieldSpec | None:
    """An episode buffer file's spec, after checking the file against a buffer of
    ``max_steps``, frame stacking ``stacking`` and field spec ``spec``."""
    saved_max = require_int(document, "max_steps", 1)
    for name in ("episodes", "steps", "valid_steps", "next_episode_id", "evicted_episodes"):
        require_int(document, name, 0)
    saved_spec = read_spec(document)
    if saved_max != max_steps:
        raise MetadataError(f"max_steps: metadata has {saved_max}, this buffer {max_steps}")
    # Files written before frame stacking existed hold neither key: no stacking.
    saved = (document.get("frame_stack"), document.get("frame_stack_padding", "reset"))
    if saved != stacking:
        raise MetadataError(
            f"frame_stack, frame_stack_padding: metadata has {saved}, this buffer {stacking}"
        )
    if saved_spec is not None and spec is not None and saved_spec != spec:
        raise MetadataError(f"spec: metadata has {saved_spec}, this buffer {spec}")
    return saved_spec
