"""``replaybuf verify``'s check of a buffer checkpoint: exactly what loading it checks.

Each buffer kind's loader is split in two, ``examine`` (read the checkpoint and check
everything: manifest, meta fields, tensor list, shapes, links, generator state) and the build;
this runs the first for the checkpoint's kind, so verify refuses exactly what a load refuses
before it builds the buffer.
"""

from __future__ import annotations

import os

from replaybuf.errors import CheckpointKindError
from replaybuf.persist import episodes, ring
from replaybuf.persist.format.manifest import read_manifest
from replaybuf.persist.format.names import target_path

EXAMINERS = {ring.KIND: ring.examine, episodes.KIND: episodes.examine}


def examine_checkpoint(directory: str | os.PathLike[str]) -> str:
    """Run the load checks of the checkpoint at ``directory`` for its kind; returns the kind.

    Raises what the load would raise (a :class:`CheckpointError` subclass naming the field or
    file, or a ``ValueError`` for a device this host lacks).
    """
    kind = read_manifest(target_path(directory))["kind"]
    if kind not in EXAMINERS:
        raise CheckpointKindError(
            f"checkpoint {os.fspath(directory)!r}: kind expected one of {sorted(EXAMINERS)}, "
            f"got {kind!r}"
        )
    checkpoint, *_ = EXAMINERS[kind](directory)
    checkpoint.close()
    return kind
