"""The format's vocabulary, as pure checks: constants, dtypes, tensor names, paths, JSON meta.

Nothing here touches the filesystem. The writer checks its arguments with these functions before
it creates anything, and the reader checks every manifest entry with them before it opens a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from replaybuf.errors import ArgumentError, ArgumentTypeError, CheckpointError

FORMAT = "replaybuf.persist.format"
FORMAT_VERSION = 2  # 2: the manifest carries CHECKSUM; 1 (still read) did not
READABLE_VERSIONS = (1, 2)
CHECKSUM = "manifest_sha256"  # sha256 of the manifest's canonical JSON without this field
MANIFEST = "MANIFEST.json"
MAX_MANIFEST_BYTES = 1 << 30
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}  # fmt: skip
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_NAME_PART = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its manifest describes it."""

    name: str
    file: str  # relative to the checkpoint directory
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    sha256: str


def target_path(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as an absolute path that names a folder."""
    target = Path(os.path.abspath(os.fspath(directory)))
    if target.name in ("", ".", ".."):
        raise ArgumentError(
            f"directory must name a folder, got {os.fspath(directory)!r}", argument="directory"
        )
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise CheckpointError("the checkpoint format is little-endian; this host is big-endian")
    return target


def check_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to write, after checking every name, layout and dtype."""
    if not isinstance(tensors, Mapping):
        raise ArgumentTypeError(
            f"tensors must be a mapping of name -> tensor, got {type(tensors).__name__}"
        )
    items: dict[str, torch.Tensor] = {}
    folded: dict[str, str] = {}  # lower-cased name -> name
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not valid_name(name):
            raise ArgumentError(
                f"tensor name must be '/'-joined parts of [A-Za-z0-9_.-], none empty or starting"
                f" with '.' (no '..', no absolute path), got {name!r}"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise ArgumentTypeError(
                f"tensor {name!r} must be a dense torch.Tensor, got {type(tensor).__name__}"
            )
        if dtype_name(tensor.dtype) not in DTYPES:
            raise ArgumentTypeError(
                f"tensor {name!r} dtype must be one of {sorted(DTYPES)}, got {tensor.dtype}"
            )
        if name.lower() in folded:  # data/Obs.bin and data/obs.bin collide on some filesystems
            raise ArgumentError(
                f"tensor names {folded[name.lower()]!r} and {name!r} differ only in case"
            )
        folded[name.lower()] = name
        items[name] = tensor
    return items


def check_json(value: object, path: str) -> None:
    """Reject what JSON would silently change or cannot hold; the error names the spot."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ArgumentError(f"{path} must be a finite float for JSON, got {value!r}")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArgumentTypeError(f"{path} keys must be str for JSON, got {key!r}")
            check_json(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json(item, f"{path}[{i}]")
    else:
        raise ArgumentTypeError(
            f"{path} must be JSON data (dict, list, str, int, float, bool, None),"
            f" got {type(value).__name__}"
        )


def manifest_digest(document: Mapping[str, object]) -> str:
    """sha256 of ``document``'s canonical JSON (sorted keys, no spaces), ``CHECKSUM`` left out.

    Computed over the parsed document, so the manifest's layout (indentation) does not matter,
    while any change of a key or value does.
    """
    rest = {key: value for key, value in document.items() if key != CHECKSUM}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(document: dict) -> dict:
    """``document`` with its ``CHECKSUM`` field set (recomputed if it had one)."""
    return {
        **{k: v for k, v in document.items() if k != CHECKSUM},
        CHECKSUM: manifest_digest(document),
    }


def valid_name(name: str) -> bool:
    """A tensor name: '/'-joined parts of ``[A-Za-z0-9_.-]``, none empty or starting with '.'."""
    return bool(name) and all(_NAME_PART.fullmatch(part) for part in name.split("/"))


def safe_relative(file: object) -> bool:
    """A manifest ``file``: a relative path with no empty, '.' or '..' part."""
    if (
        not isinstance(file, str)
        or not file
        or file.startswith("/")
        or "\\" in file
        or "\0" in file
    ):
        return False
    return all(part not in ("", ".", "..") for part in file.split("/"))


def data_file(name: str) -> str:
    """Where tensor ``name`` lives, relative to the checkpoint directory."""
    return f"data/{name}.bin"


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
