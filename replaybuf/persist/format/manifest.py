"""Reading a checkpoint's manifest and opening its files safely, checking everything on the way.

The manifest is parsed as JSON and checked field by field; every listed file must be a plain
relative path inside the checkpoint, reached without a symlink at any step (checked before it is
opened), and of the size its shape and dtype imply. Checksums are the reader's business.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from replaybuf.errors import (
    CheckpointError,
    CheckpointKindError,
    CorruptCheckpointError,
    NoCheckpointError,
    UnsafeCheckpointError,
    UnsupportedVersionError,
)
from replaybuf.persist.format.names import (
    CHECKSUM,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    READABLE_VERSIONS,
    SHA256_HEX,
    TensorInfo,
    data_file,
    is_count,
    manifest_digest,
    safe_relative,
    valid_name,
)
from replaybuf.persist.format.streams import close_all


def scan(target: Path, kind: str | None, *, stop_early: bool) -> tuple[dict, dict, dict, list]:
    """Parse the manifest and open every data file, checking paths and sizes (not hashes).

    Returns ``(manifest, infos, fds, problems)``: per-file problems are collected (only the
    first with ``stop_early``); a missing or invalid manifest raises.
    """
    problems: list[CheckpointError] = []
    infos: dict[str, TensorInfo] = {}
    fds: dict[str, int] = {}
    dir_fd = open_dir(target)
    try:
        manifest = parse_manifest(target, read_file(dir_fd, MANIFEST, target), kind)
        for name, entry in manifest["tensors"].items():
            try:
                info = parse_entry(target, name, entry)
                fds[name] = open_data_file(dir_fd, info, target)
                infos[name] = info
            except CheckpointError as exc:
                problems.append(exc)
                if stop_early:
                    break
    except BaseException:
        close_all(list(fds.values()))
        raise
    finally:
        os.close(dir_fd)
    return manifest, infos, fds, problems


def read_manifest(target: Path) -> dict[str, Any]:
    """The checked manifest of ``target``, any kind, without opening its data files."""
    dir_fd = open_dir(target)
    try:
        return parse_manifest(target, read_file(dir_fd, MANIFEST, target), None)
    finally:
        os.close(dir_fd)


TOP_KEYS = ("format", "format_version", "kind", "created", "versions", "meta", "tensors")
ENTRY_KEYS = ("file", "shape", "dtype", "bytes", "sha256")


def parse_manifest(target: Path, raw: bytes, kind: str | None) -> dict[str, Any]:
    """The manifest's JSON, its top-level fields checked (names, types, version, checksum)."""
    where = f"checkpoint {str(target)!r}: {MANIFEST}"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CorruptCheckpointError(f"{where}: format expected {FORMAT!r}, got {got!r}")
    version = doc.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise UnsupportedVersionError(version, FORMAT_VERSION, f"checkpoint {str(target)!r}")
    expected = {*TOP_KEYS, CHECKSUM} if version >= 2 else set(TOP_KEYS)
    check_keys(doc, expected, where, "field")
    if version >= 2:  # the checksum first: it names the file for any edit of the manifest
        digest = doc[CHECKSUM]
        if not isinstance(digest, str) or digest != manifest_digest(doc):
            raise CorruptCheckpointError(
                f"{where}: {CHECKSUM} does not match the manifest's contents (file altered or"
                f" damaged): expected {manifest_digest(doc)}, got {digest!r}"
            )
    for key, typ in (("kind", str), ("created", str), ("versions", dict)):
        if not isinstance(doc[key], typ):
            raise CorruptCheckpointError(
                f"{where}: field {key!r} expected a {typ.__name__}, got {doc[key]!r}"
            )
    for key, typ in (("meta", dict), ("tensors", dict)):
        if not isinstance(doc[key], typ):
            raise CorruptCheckpointError(
                f"{where}: field {key!r} expected a dict, got {doc[key]!r}"
            )
    if not all(isinstance(v, str) for v in doc["versions"].values()):
        raise CorruptCheckpointError(f"{where}: field 'versions' expected str values")
    if kind is not None and doc["kind"] != kind:
        raise CheckpointKindError(
            f"checkpoint {str(target)!r} holds a {doc['kind']!r} checkpoint; expected a {kind!r}"
            f" checkpoint (its {MANIFEST} field 'kind')"
        )
    return doc


def check_keys(doc: dict, expected: set[str], where: str, what: str) -> None:
    """``doc`` has exactly the keys ``expected``: a missing or unknown one is named."""
    missing, unknown = sorted(expected - set(doc)), sorted(set(doc) - expected)
    if missing or unknown:
        parts = [f"missing {what} {missing}"] * bool(missing) + [
            f"unknown {what} {unknown}"
        ] * bool(unknown)
        raise CorruptCheckpointError(f"{where}: {', '.join(parts)}")


def parse_entry(target: Path, name: object, entry: object) -> TensorInfo:
    """A manifest tensor entry, checked field by field; paths are checked before any open."""
    where = f"checkpoint {str(target)!r}: {MANIFEST}: tensor {name!r}"
    if not isinstance(name, str) or not valid_name(name):
        raise UnsafeCheckpointError(f"{where}: the name is not a safe relative name")
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where}: expected an object, got {entry!r}")
    check_keys(entry, set(ENTRY_KEYS), where, "field")
    file = entry.get("file")
    if not safe_relative(file):
        raise UnsafeCheckpointError(
            f"{where}: file {file!r} is not a relative path inside the checkpoint"
        )
    if file != data_file(name):
        raise CorruptCheckpointError(f"{where}: file expected {data_file(name)!r}, got {file!r}")
    shape, dtype_name, nbytes = entry.get("shape"), entry.get("dtype"), entry.get("bytes")
    if not isinstance(shape, list) or not all(is_count(n) for n in shape):
        raise CorruptCheckpointError(f"{where}: shape expected a list of ints >= 0, got {shape!r}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise CorruptCheckpointError(
            f"{where}: dtype expected one of {sorted(DTYPES)}, got {dtype_name!r}"
        )
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if not is_count(nbytes) or nbytes != expected:
        raise CorruptCheckpointError(
            f"{where}: bytes expected {expected} (shape {shape} x {dtype_name}), got {nbytes!r}"
        )
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise CorruptCheckpointError(f"{where}: sha256 expected 64 hex digits, got {digest!r}")
    return TensorInfo(name, file, tuple(shape), dtype, nbytes, digest)


def open_data_file(dir_fd: int, info: TensorInfo, target: Path) -> int:
    fd = open_nofollow(dir_fd, info.file, target)
    size = os.fstat(fd).st_size
    if size != info.nbytes:
        os.close(fd)
        raise CorruptCheckpointError(
            f"checkpoint {str(target)!r}: {info.file}: expected {info.nbytes} bytes, got {size}"
        )
    return fd


def open_nofollow(dir_fd: int, rel: str, target: Path) -> int:
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
        close_all(opened)


def read_file(dir_fd: int, rel: str, target: Path) -> bytes:
    fd = open_nofollow(dir_fd, rel, target)
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


def open_dir(target: Path) -> int:
    try:
        return os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise NoCheckpointError(f"no complete checkpoint in {str(target)!r}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint {str(target)!r}: {exc}") from exc
