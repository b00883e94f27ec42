"""Checkpoint directories: a JSON manifest plus one raw file per tensor, published atomically.

A checkpoint directory ``D`` holds::

    D/MANIFEST.json         written last: D is a checkpoint once this file is complete
    D/data/obs.bin          tensor "obs": raw little-endian bytes in row-major (C) order
    D/data/next/obs.bin     tensor "next/obs" ('/' in a tensor name nests folders)

and ``MANIFEST.json`` reads::

    {"format": "replaybuf.persist.format", "format_version": 2, "kind": "ReplayBuffer",
     "created": "2026-01-01T00:00:00+00:00",
     "versions": {"torch": "...", "torchrl": "...", "tensordict": "..."},
     "meta": {...the caller's JSON: config, counters, episode table...},
     "tensors": {"obs": {"file": "data/obs.bin", "shape": [100, 4], "dtype": "float32",
                         "bytes": 1600, "sha256": "9f86d0..."}},
     "manifest_sha256": "..."}   the sha256 of the rest of the manifest (canonical JSON)

Nothing in a checkpoint is ever unpickled: the manifest is JSON and tensors are raw bytes. Files
the manifest does not list (``prefetch.pkl``, ``*.pt``...) are never opened. A save writes a tmp
sibling and publishes it by rename; a process killed at any moment leaves the previous
checkpoint or the new one, which every reader and writer restores first (the protocol is in
:mod:`replaybuf.persist.format.publish`).

Modules, imported one way (each only from those above it)::

    names     pure: constants, dtypes, tensor names, paths, JSON meta checks
    streams   bounded-memory byte streaming, threaded sha256 (CHUNK_BYTES lives here)
    crash     the REPLAYBUF_CRASH_AT fault-injection hook
    manifest  parse and check a manifest, open its files without following symlinks
    publish   the commit protocol: publish, recover, locks
    writer    write_checkpoint
    reader    read_checkpoint, Checkpoint, verify_checkpoint, describe_checkpoint
"""

from replaybuf.persist.format.crash import CRASH_ENV, CRASH_PHASES
from replaybuf.persist.format.names import FORMAT, FORMAT_VERSION, MANIFEST, TensorInfo
from replaybuf.persist.format.publish import recover
from replaybuf.persist.format.reader import (
    Checkpoint,
    describe_checkpoint,
    read_checkpoint,
    verify_checkpoint,
)
from replaybuf.persist.format.writer import write_checkpoint

__all__ = [
    "CRASH_ENV",
    "CRASH_PHASES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "Checkpoint",
    "TensorInfo",
    "describe_checkpoint",
    "read_checkpoint",
    "recover",
    "verify_checkpoint",
    "write_checkpoint",
]
