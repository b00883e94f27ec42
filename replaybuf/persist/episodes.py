"""``SyncEpisodeReplayBuffer`` <-> checkpoint directory (kind ``"EpisodeReplayBuffer"``).

A checkpoint holds::

    meta     config (max_steps, max_episodes, min_steps, rows, storage, devices, frame_stack,
             frame_stack_padding), counters
             (next_id, next_seq, steps, valid_steps, evicted, high_water), spec, the
             observation spec of a buffer that has only zero-step episodes, and the episode
             table: [id, agent, seq, end_kind, steps, has_final_row] in start order
    tensors  rows/<field>             storage rows [0, high_water) (streamed from storage)
             links/{next_row,episode,step,end_kind,alloc}   per-row bookkeeping, [rows]
                                      (prev_row, kept for frame stacking, is rebuilt on load)
             priority/weights         p^alpha per row (prioritized buffers only), [rows]
             index/anchors            the anchor rows in sampling order (so draws repeat)
             index/free               the free rows, in the order they will be handed out
             index/episode_rows       every episode's rows (then its final row), concatenated
             ragged/<i>/{values,offsets}   ragged field i (in the spec's order of ragged
                                      fields), rows [0, high_water) as CSR: values end to end,
                                      int64 offsets [high_water + 1]; text, bytes and JSON-like
                                      fields as their UTF-8 / raw bytes (uint8), never pickled
             final/<j>/<i>            final observation field i of the j-th zero-step episode
                                      (a ragged field: its values)
             sampler/generator_state
             sampler/device_draws     the device draws' key and round, int64 [2] (uniform
                                      draws from CUDA storage; absent before 2026-11-27)

Saving takes a snapshot: index state is copied first, then rows are streamed while the core is
pinned (rows freed by eviction are not reused), so the async facade can keep writers going
during the bulk copy. Loading validates everything (every link against the episode table)
before a buffer is created, and streams rows into fresh storage, verifying checksums.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replaybuf.episodes import (
    COUNTERS,
    EpisodeCore,
    core_state,
    restore_core,
)
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    CheckpointKindError,
    MetadataError,
    NoCheckpointError,
)
from replaybuf.persist.episode_checks import (
    DRAWS,
    LINKS,
    PRIORITY,
    STATUS,
    Saved,
    check,
    stacking,
)
from replaybuf.persist.format import Checkpoint, read_checkpoint, write_checkpoint
from replaybuf.persist.ragged import load_ragged, ragged_name
from replaybuf.persist.ring import GENERATOR, restore_generator, row_tensor_names
from replaybuf.persist.state import StateSource, state_of
from replaybuf.sampling import DeviceDraws
from replaybuf.storage import FieldSpec, Key

if TYPE_CHECKING:
    from replaybuf.buffers import SyncEpisodeReplayBuffer

KIND = "EpisodeReplayBuffer"
OVERRIDES = (
    "device",
    "storing_device",
    "storage",
    "scratch_dir",
    "min_steps",
    "priority_backend",
    "layout",
    "ragged",
)


@dataclass
class EpisodeParts:
    """A ``SyncEpisodeReplayBuffer``'s configuration and components, for its checkpoints."""

    max_steps: int
    max_episodes: int | None
    min_steps: int
    frame_stack: int | None
    frame_stack_padding: str
    layout: str  # the buffer's default batch layout
    ragged: str  # how ragged fields come out of batches ("nested" or "padded")
    device: torch.device
    storing_device: torch.device
    core: EpisodeCore
    generator: torch.Generator
    draws: DeviceDraws


# --------------------------------------------------------------------------------- saving
def compose(parts: EpisodeParts, copy: bool) -> dict[str, Any]:
    """The buffer's ``state_dict()``: index state copied now, rows as views unless ``copy``
    (a checkpoint streams them while the core is pinned)."""
    core = core_state(parts.core)
    storage, counters = core["storage"], core["counters"]
    spec, first = storage["spec"], core["first_obs_spec"]
    declared = parts.core.declared  # spec=, saved so that a loaded buffer declares the same
    tensors: dict[str, torch.Tensor] = {
        GENERATOR: parts.generator.get_state(),
        DRAWS: torch.tensor([parts.draws.seed, parts.draws.rounds()], dtype=torch.long),
        "index/anchors": core["anchors"],
        "index/free": core["free"],
        "index/episode_rows": core["episode_rows"],
    }
    for name in LINKS:
        tensors[f"links/{name}"] = core["links"][name]
    priorities = core["priorities"]
    if priorities is not None:
        tensors[PRIORITY] = priorities["weights"]
    if spec is not None:
        for key, name in row_tensor_names(spec.fixed).items():
            tensors[name] = storage["columns"][key]
        for key, (values, offsets) in storage["ragged"].items():
            name = ragged_name(spec, key)
            tensors[f"{name}/values"], tensors[f"{name}/offsets"] = values, offsets
    for j, leaves in enumerate(core["finals"]):
        for i, leaf in enumerate(leaves):
            tensors[f"final/{j}/{i}"] = leaf
    table = core["table"]
    meta = {
        "max_steps": parts.max_steps,
        "max_episodes": parts.max_episodes,
        "min_steps": parts.min_steps,
        "frame_stack": parts.frame_stack,
        "frame_stack_padding": parts.frame_stack_padding,
        "layout": parts.layout,
        "ragged": parts.ragged,
        "rows": parts.core.slots.capacity,
        "storage": parts.core.slots.kind,
        "device": str(parts.device),
        "storing_device": str(parts.storing_device),
        "generator_device": parts.generator.device.type,
        "next_id": counters["next_id"],
        "next_seq": counters["next_seq"],
        "allocations": counters["allocations"],
        **_priority_meta(priorities),
        "steps": counters["steps"],
        "valid_steps": counters["valid_steps"],
        "evicted": counters["evicted"],
        "high_water": core["high_water"],
        "spec": None if spec is None else spec.to_json(),
        "declared": None if declared is None else declared.to_json(),
        "first_obs_spec": None if first is None else first.to_json(),
        "episodes": table,
        "episodes_by_status": {s: sum(STATUS[e[3]] == s for e in table) for s in STATUS.values()},
    }
    return state_of(KIND, meta, tensors, copy)


def _priority_meta(priorities: dict[str, Any] | None) -> dict[str, Any]:
    if priorities is None:
        return {"prioritized": False}
    return {"prioritized": True, **{k: priorities[k] for k in ("alpha", "beta", "eps")}}


def write(directory: str | os.PathLike[str], state: dict[str, Any], durable: bool) -> Path:
    """Write a ``state_dict(copy=False)`` as a checkpoint at ``directory``."""
    return write_checkpoint(directory, KIND, state["meta"], state["tensors"], durable=durable)


# --------------------------------------------------------------------------------- loading
def load(
    cls: type[SyncEpisodeReplayBuffer],
    directory: str | os.PathLike[str],
    overrides: Mapping[str, Any],
) -> SyncEpisodeReplayBuffer:
    """A new ``cls`` holding the checkpoint at ``directory``."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ArgumentTypeError(
            f"load_checkpoint() overrides must be among {list(OVERRIDES)}, got {unknown}",
            argument="overrides",
        )
    checkpoint, _, kwargs = examine(directory, overrides)
    with checkpoint:
        # Any seed: the saved sampler state replaces it (none is drawn from torch's generator).
        buffer = cls(kwargs.pop("max_steps"), **{**kwargs, "seed": 0})
        try:
            buffer.load_state_dict(checkpoint)
        except BaseException:
            buffer.close()  # nothing half-made stays behind
            raise
    return buffer


def examine(
    directory: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> tuple[Checkpoint, Saved, dict[str, Any]]:
    """Read and check everything a load checks before it builds the buffer: the open checkpoint
    (sizes checked; the caller closes it), its checked state and the buffer's arguments.

    :func:`load` builds the buffer from these, and ``replaybuf verify`` calls this alone: one
    set of checks for both.
    """
    checkpoint = _open(directory)
    try:
        saved = check(checkpoint, f"checkpoint {str(checkpoint.directory)!r}")
    except BaseException:
        checkpoint.close()
        raise
    meta = saved.meta
    kwargs: dict[str, Any] = {
        "max_steps": meta["max_steps"],
        "max_episodes": meta["max_episodes"],
        "device": meta["device"],
        "storing_device": meta["storing_device"],
        "storage": meta["storage"],
        "min_steps": meta["min_steps"],
        "layout": meta["layout"],
        "spec": saved.declared,
        "ragged": meta["ragged"],
        **stacking(meta),
        **{k: meta[k] for k in ("prioritized", "alpha", "beta", "eps") if k in meta},
        **(overrides or {}),
    }
    return checkpoint, saved, kwargs


def _open(directory: str | os.PathLike[str]) -> Checkpoint:
    try:
        return read_checkpoint(directory, KIND, verify=False)
    except CheckpointKindError as exc:
        raise CheckpointKindError(f"{exc}; load it with that class's load_checkpoint") from None


def check_fits(saved: Saved, parts: EpisodeParts, where: str) -> None:
    """``saved`` can replace the contents of the buffer of ``parts``: the same ``max_steps``,
    rows, frame stacking and prioritization."""
    meta = saved.meta
    mine = {
        "max_steps": parts.max_steps,
        "rows": parts.core.slots.capacity,
        "prioritized": parts.core.priorities is not None,
        **{"frame_stack": parts.frame_stack, "frame_stack_padding": parts.frame_stack_padding},
    }
    theirs = {name: meta.get(name) for name in ("max_steps", "rows", "prioritized")}
    theirs.update(stacking(meta))
    for name, value in mine.items():
        if theirs[name] != value:
            raise MetadataError(
                f"{where}: {name} expected {value!r} (this buffer's), got {theirs[name]!r}"
            )


def restore(parts: EpisodeParts, saved: Saved, source: StateSource) -> None:
    """Fill the empty core of ``parts`` with a checked state, and the sampler state."""
    meta, s = saved.meta, saved.small
    names = row_tensor_names(saved.spec.fixed) if saved.spec is not None else {}
    obs_keys = list(saved.spec or saved.first_obs_spec or {})
    if saved.spec is not None:
        obs_keys = [key for key in obs_keys if key[0] == "observation"]

    def fill(key: Key, out: torch.Tensor) -> None:
        source.load_into(names[key], out, verify=True)  # streamed, hashed on the way

    def ragged(key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        assert saved.spec is not None  # a ragged field is one of the spec's
        return load_ragged(source, saved.spec, key)

    def final(j: int, key: Key) -> torch.Tensor:
        return source.load(f"final/{j}/{obs_keys.index(key)}", verify=True)

    state = {
        "counters": {name: meta[name] for name in COUNTERS},
        "high_water": meta["high_water"],
        "table": saved.table,
        "links": {name: s[f"links/{name}"] for name in LINKS},
        "anchors": s["index/anchors"],
        "free": s["index/free"],
        "episode_rows": s["index/episode_rows"],
        "priorities": None
        if PRIORITY not in s
        else {**{k: meta[k] for k in ("alpha", "beta", "eps")}, "weights": s[PRIORITY]},
        "storage": {"spec": saved.spec},
        "first_obs_spec": saved.first_obs_spec,
    }
    restore_core(parts.core, state, fill, ragged, final)
    restore_generator(parts.generator, s[GENERATOR], meta["generator_device"])
    if DRAWS in s:
        seed, rounds = (int(v) for v in s[DRAWS])
    else:  # saved before device draws: a key from the saved generator state, so loads agree
        digest = hashlib.sha256(s[GENERATOR].numpy().tobytes()).digest()
        seed, rounds = int.from_bytes(digest[:8], "little") >> 1, 0
    parts.draws.load_state_dict({"seed": seed, "rounds": rounds})


def open_or_create(
    cls: type[SyncEpisodeReplayBuffer], directory: str | os.PathLike[str], kwargs: Mapping[str, Any]
) -> SyncEpisodeReplayBuffer:
    """Load the checkpoint at ``directory`` if there is one, else ``cls(**kwargs)``.

    Loading, ``max_steps``, ``max_episodes``, ``frame_stack`` and ``frame_stack_padding`` (if
    given) must match the checkpoint's, ``seed`` is unused (the saved sampler goes on) and the
    other ``kwargs`` are overrides.
    """
    try:
        checkpoint = _open(directory)
    except NoCheckpointError:
        return cls(**kwargs)
    with checkpoint:
        meta = checkpoint.meta
        saved = {name: meta.get(name) for name in ("max_steps", "max_episodes")}
        saved.update(stacking(meta))
        theirs = meta.get("declared")
    for name, value in saved.items():
        if name in kwargs and kwargs[name] != value:
            raise ArgumentError(
                f"open({str(checkpoint.directory)!r}): {name}={kwargs[name]!r}, but the "
                f"checkpoint there holds a buffer with {name}={value!r}"
            )
    declared = kwargs.get("spec")
    if declared is not None and FieldSpec.declare(declared).to_json() != theirs:
        raise ArgumentError(
            f"open({str(checkpoint.directory)!r}): spec={declared!r}, but the checkpoint "
            f"there declares {theirs!r}"
        )
    overrides = {k: v for k, v in kwargs.items() if k not in (*saved, "seed", "spec")}
    return load(cls, directory, overrides)
