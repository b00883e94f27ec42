"""The checkpoint of a sharded buffer: one episode checkpoint per shard, then a manifest.

Layout of a checkpoint directory ``D`` of ``K`` shards, generation ``g``::

    D/SHARDS.json               written last, atomically: names the generation's shard folders
    D/shard-<k>/g<g>/           shard k's episode checkpoint (its own MANIFEST.json inside)

A save writes every shard's checkpoint into a new generation's folders, then publishes the
manifest (temp file, fsync, ``os.replace``, fsync of ``D``), then removes older generations.
A crash before the manifest is replaced leaves the previous manifest and the previous
generation's folders: the previous complete set.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from replaybuf.errors import (
    CheckpointKindError,
    CorruptCheckpointError,
    NoCheckpointError,
    UnsupportedVersionError,
)

MANIFEST = "SHARDS.json"
FORMAT = "replaybuf.sharded"
FORMAT_VERSION = 1
KIND = "ShardedEpisodeReplayBuffer"
SHARD_KIND = "EpisodeReplayBuffer"
SHARD_MANIFEST = "MANIFEST.json"  # an episode checkpoint's own (replaybuf.persist.format)


def shard_dir(root: Path, shard: int, generation: int) -> Path:
    """Where shard ``shard`` of generation ``generation`` is saved."""
    return root / f"shard-{shard}" / f"g{generation:06d}"


def next_generation(root: Path) -> int:
    """The generation after the published one (1 where none is readable)."""
    try:
        return int(json.loads((root / MANIFEST).read_text())["generation"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def publish(root: Path, num_shards: int, generation: int, extra: dict[str, Any], durable: bool):
    """Write the manifest naming generation ``generation``'s shard folders, atomically."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "shard_kind": SHARD_KIND,
        "num_shards": num_shards,
        "generation": generation,
        "shards": [shard_dir(Path("."), k, generation).as_posix() for k in range(num_shards)],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    temp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(temp, "w") as out:
        json.dump(manifest, out, indent=1)
        out.flush()
        if durable:
            os.fsync(out.fileno())
    os.replace(temp, root / MANIFEST)
    if durable:
        folder = os.open(root, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def prune(root: Path, num_shards: int, generation: int) -> None:
    """Remove the shard folders of generations other than ``generation`` (best effort)."""
    keep = {shard_dir(root, k, generation).name for k in range(num_shards)}
    for k in range(num_shards):
        for old in (root / f"shard-{k}").glob("g*"):
            if old.name not in keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def read(root: Path, num_shards: int | None = None) -> dict[str, Any]:
    """The checked manifest of ``root``: format, version, kind, ``num_shards`` (if given, it
    must match) and every shard's checkpoint folder with an episode checkpoint inside."""
    path = root / MANIFEST
    if not path.is_file():
        raise NoCheckpointError(f"{root}: no sharded checkpoint ({MANIFEST} is missing)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: not a readable JSON manifest ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UnsupportedVersionError(manifest.get("format_version"), FORMAT_VERSION, str(path))
    if manifest.get("kind") != KIND or manifest.get("shard_kind") != SHARD_KIND:
        raise CheckpointKindError(
            f"{path}: a checkpoint of kind {manifest.get('kind')!r} with shards of kind "
            f"{manifest.get('shard_kind')!r}, expected {KIND!r} with {SHARD_KIND!r} shards"
        )
    k, shards = manifest.get("num_shards"), manifest.get("shards")
    if type(k) is not int or k < 1 or not isinstance(shards, list) or len(shards) != k:
        raise CorruptCheckpointError(
            f"{path}: num_shards {k!r} does not match its list of {len(shards or [])} shards"
        )
    if num_shards is not None and num_shards != k:
        raise CheckpointKindError(
            f"{path}: a checkpoint of {k} shards, num_shards={num_shards} asked "
            "(a sharded checkpoint restores onto the same number of shards)",
            argument="num_shards",
        )
    for shard, name in enumerate(shards):
        _check_shard(root, shard, name)
    return manifest


def _check_shard(root: Path, shard: int, name: Any) -> None:
    """Shard ``shard``'s folder is inside ``root`` and holds an episode checkpoint."""
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CorruptCheckpointError(f"{root / MANIFEST}: shard {shard}'s folder {name!r}")
    inner = root / name / SHARD_MANIFEST
    try:
        kind = json.loads(inner.read_text()).get("kind")
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{root}: shard {shard}'s checkpoint {root / name} is missing or unreadable ({exc})"
        ) from exc
    if kind != SHARD_KIND:
        raise CheckpointKindError(
            f"{root / name}: shard {shard} holds a checkpoint of kind {kind!r}, "
            f"expected {SHARD_KIND!r}"
        )


def current_shard(root: Path, shard: int, num_shards: int) -> Path | None:
    """Shard ``shard``'s folder in the published checkpoint of ``root``; None if none is."""
    if not (root / MANIFEST).exists():
        return None
    return root / read(root, num_shards)["shards"][shard]
