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
             final/<j>/<i>            final observation field i of the j-th zero-step episode
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

from replaybuf.core import END_NONE
from replaybuf.episodes import (
    COUNTERS,
    FRAME_PADDINGS,
    SAVED,
    EpisodeCore,
    core_state,
    restore_core,
)
from replaybuf.errors import (
    CheckpointKindError,
    CorruptCheckpointError,
    MetadataError,
    NoCheckpointError,
)
from replaybuf.persist.format import Checkpoint, read_checkpoint, write_checkpoint
from replaybuf.persist.ring import (
    GENERATOR,
    meta_int,
    meta_spec,
    restore_generator,
    row_tensor_names,
)
from replaybuf.persist.state import StateSource, state_of
from replaybuf.sampling import LAYOUTS, DeviceDraws
from replaybuf.storage import FieldSpec, Key, key_name

if TYPE_CHECKING:
    from replaybuf.buffers import SyncEpisodeReplayBuffer

KIND = "EpisodeReplayBuffer"
LINKS = SAVED  # the row links a state keeps (next_row, episode, step, end_kind, alloc)
PRIORITY = "priority/weights"
DRAWS = "sampler/device_draws"  # the device draws' key and round (replaybuf.accel.graphs)
OVERRIDES = (
    "device",
    "storing_device",
    "storage",
    "scratch_dir",
    "min_steps",
    "priority_backend",
    "layout",
)
_STATUS = {0: "in_progress", 1: "terminated", 2: "truncated"}


@dataclass
class EpisodeParts:
    """A ``SyncEpisodeReplayBuffer``'s configuration and components, for its checkpoints."""

    max_steps: int
    max_episodes: int | None
    min_steps: int
    frame_stack: int | None
    frame_stack_padding: str
    layout: str  # the buffer's default batch layout
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
        for key, name in row_tensor_names(spec).items():
            tensors[name] = storage["columns"][key]
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
        "first_obs_spec": None if first is None else first.to_json(),
        "episodes": table,
        "episodes_by_status": {s: sum(_STATUS[e[3]] == s for e in table) for s in _STATUS.values()},
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
@dataclass
class Saved:
    """A checkpoint's meta and small tensors, checked against each other."""

    meta: dict[str, Any]
    spec: FieldSpec | None
    first_obs_spec: FieldSpec | None
    table: list[list[Any]]
    small: dict[str, torch.Tensor]


def load(
    cls: type[SyncEpisodeReplayBuffer],
    directory: str | os.PathLike[str],
    overrides: Mapping[str, Any],
) -> SyncEpisodeReplayBuffer:
    """A new ``cls`` holding the checkpoint at ``directory``."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise TypeError(
            f"load_checkpoint() overrides must be among {list(OVERRIDES)}, got {unknown}"
        )
    with _open(directory) as checkpoint:
        where = f"checkpoint {str(checkpoint.directory)!r}"
        saved = check(checkpoint, where)
        meta = saved.meta
        kwargs: dict[str, Any] = {
            "max_episodes": meta["max_episodes"],
            "device": meta["device"],
            "storing_device": meta["storing_device"],
            "storage": meta["storage"],
            "min_steps": meta["min_steps"],
            "layout": meta.get("layout", "replaybuf"),  # none in checkpoints made before it
            **_stacking(meta),
            **{k: meta[k] for k in ("prioritized", "alpha", "beta", "eps") if k in meta},
            **overrides,
        }
        buffer = cls(meta["max_steps"], **kwargs)
        try:
            buffer.load_state_dict(checkpoint)
        except BaseException:
            buffer.close()  # nothing half-made stays behind
            raise
    return buffer


def _stacking(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The saved frame stacking (checked by :func:`check`); none in checkpoints made before it."""
    return {
        "frame_stack": meta.get("frame_stack"),
        "frame_stack_padding": meta.get("frame_stack_padding", "reset"),
    }


def _open(directory: str | os.PathLike[str]) -> Checkpoint:
    try:
        return read_checkpoint(directory, KIND, verify=False)
    except CheckpointKindError as exc:
        raise CheckpointKindError(f"{exc}; load it with that class's load_checkpoint") from None


def check(checkpoint: StateSource, where: str) -> Saved:
    """Meta ranges, tensor shapes, and every link against the episode table."""
    meta = checkpoint.meta
    max_steps = meta_int(meta, "max_steps", where, low=1)
    rows = meta_int(meta, "rows", where, low=max_steps)
    for name in ("next_id", "next_seq", "steps", "valid_steps", "evicted", "min_steps"):
        meta_int(meta, name, where, low=0)
    allocations = meta_int(meta, "allocations", where, low=0)
    if not isinstance(meta.get("prioritized"), bool):
        raise CorruptCheckpointError(f"{where}: meta 'prioritized' expected a bool")
    high_water = meta_int(meta, "high_water", where, low=0, high=rows)
    if meta.get("max_episodes") is not None:
        meta_int(meta, "max_episodes", where, low=1)
    if meta.get("frame_stack") is not None:
        meta_int(meta, "frame_stack", where, low=1)
    if meta.get("layout", "replaybuf") not in LAYOUTS:
        raise CorruptCheckpointError(
            f"{where}: meta 'layout' expected one of {LAYOUTS}, got {meta['layout']!r}"
        )
    if _stacking(meta)["frame_stack_padding"] not in FRAME_PADDINGS:
        raise CorruptCheckpointError(
            f"{where}: meta 'frame_stack_padding' expected one of {FRAME_PADDINGS}, "
            f"got {meta['frame_stack_padding']!r}"
        )
    spec, first = meta_spec(meta, "spec", where), meta_spec(meta, "first_obs_spec", where)
    table = meta.get("episodes")
    if not isinstance(table, list) or not all(_is_entry(e) for e in table):
        raise CorruptCheckpointError(f"{where}: meta 'episodes' is malformed")
    small = {}
    for name in ("index/anchors", "index/free", "index/episode_rows", GENERATOR):
        small[name] = checkpoint.load(name, verify=True)
    for name in LINKS:
        small[f"links/{name}"] = checkpoint.load(f"links/{name}", verify=True)
    if meta["prioritized"]:
        small[PRIORITY] = checkpoint.load(PRIORITY, verify=True)
    if DRAWS in checkpoint.tensors:
        draws = small[DRAWS] = checkpoint.load(DRAWS, verify=True)
        if draws.dtype != torch.long or tuple(draws.shape) != (2,) or bool((draws < 0).any()):
            raise CorruptCheckpointError(
                f"{where}: {DRAWS} expected two int64 values >= 0 (key, round), got "
                f"{draws.dtype} {tuple(draws.shape)} {draws.tolist()}"
            )
    saved = Saved(meta, spec, first, table, small)
    _check_rows(checkpoint, saved, high_water, where)
    _check_links(saved, rows, where)
    _check_priorities(saved, rows, allocations, where)
    return saved


def _check_priorities(saved: Saved, rows: int, allocations: int, where: str) -> None:
    """Allocation ids below the count; weights (if any) >= 0 and 0 where no step can start."""
    alloc = saved.small["links/alloc"]
    if alloc.numel() and int(alloc.max()) >= allocations:
        raise CorruptCheckpointError(f"{where}: links/alloc holds ids >= allocations={allocations}")
    weights = saved.small.get(PRIORITY)
    if weights is None:
        return
    anchors = saved.small["links/next_row"] >= 0
    if weights.shape != (rows,) or not bool(torch.isfinite(weights).all()):
        raise CorruptCheckpointError(f"{where}: {PRIORITY} expected {rows} finite weights")
    if bool(((weights != 0) & ~anchors).any()) or bool((weights < 0).any()):
        raise CorruptCheckpointError(f"{where}: {PRIORITY} must be >= 0, and 0 off the anchors")


def _is_entry(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 6
        and all(
            isinstance(v, int) and not isinstance(v, bool) for v in (entry[0], entry[2], entry[4])
        )
        and isinstance(entry[1], str)
        and entry[3] in _STATUS
        and isinstance(entry[5], bool)
    )


def _check_rows(checkpoint: StateSource, saved: Saved, high_water: int, where: str) -> None:
    names = row_tensor_names(saved.spec) if saved.spec is not None else {}
    for key, name in names.items():
        info = checkpoint.tensors.get(name)
        assert saved.spec is not None  # names is empty without a spec
        field = saved.spec[key]
        if info is None or (info.shape, info.dtype) != ((high_water, *field.shape), field.dtype):
            got = None if info is None else f"shape {list(info.shape)} dtype {info.dtype}"
            raise CorruptCheckpointError(
                f"{where}: field {key_name(key)!r} expected {name} of shape "
                f"{[high_water, *field.shape]} dtype {field.dtype}, got {got}"
            )


def _check_links(saved: Saved, rows: int, where: str) -> None:
    """Each episode's rows chain through ``next_row``, owned and numbered; sets agree."""
    s, meta = saved.small, saved.meta
    next_row, owner, step, end_kind = (s[f"links/{n}"] for n in LINKS[:4])
    for name in LINKS:
        tensor = s[f"links/{name}"]
        if tensor.shape != (rows,):
            raise CorruptCheckpointError(
                f"{where}: links/{name} expected shape [{rows}], got {list(tensor.shape)}"
            )
    flat = s["index/episode_rows"]
    counts = [e[4] + e[5] for e in saved.table]
    if flat.numel() != sum(counts) or (
        flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < rows
    ):
        raise CorruptCheckpointError(
            f"{where}: index/episode_rows does not match the episode table"
        )
    repeats = torch.tensor(counts, dtype=torch.long)  # long for an empty table too, not float
    ids = torch.repeat_interleave(
        torch.tensor([e[0] for e in saved.table], dtype=torch.long), repeats
    )
    local = (
        torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.long)
    )
    last = torch.cat([torch.arange(c) == c - 1 for c in counts]) if counts else local.bool()
    expected_next = torch.where(last, -1, torch.roll(flat, -1))
    in_progress = torch.repeat_interleave(
        torch.tensor([e[3] == END_NONE for e in saved.table], dtype=torch.bool), repeats
    )
    kinds = torch.repeat_interleave(
        torch.tensor([e[3] for e in saved.table], dtype=torch.int8), repeats
    )
    ok = (
        torch.equal(owner[flat], ids)
        and torch.equal(step[flat], local)
        and torch.equal(next_row[flat], expected_next)
        and torch.equal(
            end_kind[flat], torch.where(last & ~in_progress, kinds, END_NONE).to(torch.int8)
        )
    )
    anchors, free = s["index/anchors"], s["index/free"]
    if free.numel() and not 0 <= int(free.min()) <= int(free.max()) < rows:
        raise CorruptCheckpointError(f"{where}: index/free holds rows outside [0, {rows})")
    used = torch.zeros(rows, dtype=torch.long).index_add_(0, flat, torch.ones_like(flat))
    used.index_add_(0, free, torch.ones_like(free))
    ok = ok and bool((used == 1).all())  # every row is either an episode's or free, once
    expected_anchors = torch.nonzero(next_row >= 0).squeeze(1)
    ok = ok and torch.equal(torch.sort(anchors).values, expected_anchors)
    ok = (
        ok
        and anchors.numel() == meta["valid_steps"]
        and sum(e[4] for e in saved.table) == meta["steps"]
    )
    if not ok:
        raise CorruptCheckpointError(
            f"{where}: links, anchors or free rows disagree with the episode table"
        )


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
    theirs.update(_stacking(meta))
    for name, value in mine.items():
        if theirs[name] != value:
            raise MetadataError(
                f"{where}: {name} expected {value!r} (this buffer's), got {theirs[name]!r}"
            )


def restore(parts: EpisodeParts, saved: Saved, source: StateSource) -> None:
    """Fill the empty core of ``parts`` with a checked state, and the sampler state."""
    meta, s = saved.meta, saved.small
    names = row_tensor_names(saved.spec) if saved.spec is not None else {}
    obs_keys = list(saved.spec or saved.first_obs_spec or {})
    if saved.spec is not None:
        obs_keys = [key for key in obs_keys if key[0] == "observation"]

    def fill(key: Key, out: torch.Tensor) -> None:
        source.load_into(names[key], out, verify=True)  # streamed, hashed on the way

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
    restore_core(parts.core, state, fill, final)
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
        saved.update(_stacking(meta))
    for name, value in saved.items():
        if name in kwargs and kwargs[name] != value:
            raise ValueError(
                f"open({str(checkpoint.directory)!r}): {name}={kwargs[name]!r}, but the "
                f"checkpoint there holds a buffer with {name}={value!r}"
            )
    overrides = {k: v for k, v in kwargs.items() if k not in (*saved, "seed")}
    return load(cls, directory, overrides)
