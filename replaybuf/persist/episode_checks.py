"""Checks of an episode buffer's saved state (a checkpoint or a ``state_dict()``) before any
of it is restored: meta ranges, tensor shapes and dtypes, ragged offsets, and every row link
against the episode table. A state that fails raises ``CorruptCheckpointError`` naming what."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from replaybuf.core import END_NONE
from replaybuf.episodes import SAVED
from replaybuf.errors import CorruptCheckpointError
from replaybuf.persist.episode_meta import (
    DRAWS,
    PRIORITY,
    STATUS,
    check_meta,
    check_tensor_list,
    expected_tensors,
)
from replaybuf.persist.meta_checks import format_version
from replaybuf.persist.ragged import check_ragged
from replaybuf.persist.ring import GENERATOR, meta_spec, row_tensor_names
from replaybuf.persist.state import StateSource
from replaybuf.storage import FieldSpec, key_name

LINKS = SAVED  # the row links a state keeps (next_row, episode, step, end_kind, alloc)
__all__ = ["DRAWS", "LINKS", "PRIORITY", "STATUS", "Saved", "check", "stacking"]


@dataclass
class Saved:
    """A checkpoint's meta and small tensors, checked against each other."""

    meta: dict[str, Any]
    spec: FieldSpec | None
    first_obs_spec: FieldSpec | None
    table: list[list[Any]]
    small: dict[str, torch.Tensor]
    declared: FieldSpec | None = None


def stacking(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The saved frame stacking (checked by :func:`check`); none in checkpoints made before it."""
    return {
        "frame_stack": meta.get("frame_stack"),
        "frame_stack_padding": meta.get("frame_stack_padding", "reset"),
    }


def check(checkpoint: StateSource, where: str) -> Saved:
    """Meta fields, the tensor list, tensor shapes, and every link against the episode table.

    The meta and the list of tensors (names, shapes, dtypes from the manifest) are checked
    before any tensor is read; then the small tensors are read and checked against them.
    """
    version = format_version(checkpoint)
    meta = check_meta(checkpoint.meta, version, where)
    rows, high_water, allocations = meta["rows"], meta["high_water"], meta["allocations"]
    spec, first = meta_spec(meta, "spec", where), meta_spec(meta, "first_obs_spec", where)
    declared = meta_spec(meta, "declared", where)
    check_tensor_list(
        checkpoint.tensors, expected_tensors(meta, spec, first, version), version, where
    )
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
    saved = Saved(meta, spec, first, meta["episodes"], small, declared)
    _check_rows(checkpoint, saved, high_water, where)
    check_ragged(checkpoint, spec, high_water, where)
    _check_finals(checkpoint, saved, where)
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


def _check_finals(checkpoint: StateSource, saved: Saved, where: str) -> None:
    """Each zero-step episode's final observation: every field, of its shape and dtype."""
    spec = saved.first_obs_spec
    if saved.spec is not None:
        spec = FieldSpec({k: saved.spec[k] for k in saved.spec.group("observation")})
    zero = sum(1 for e in saved.table if e[3] != END_NONE and not e[4] and not e[5])
    for j in range(zero):
        for i, (key, field) in enumerate((spec or {}).items()):
            info = checkpoint.tensors.get(f"final/{j}/{i}")
            shape = tuple(field.shape)
            if info is None or info.dtype != field.dtype:
                ok = False
            elif field.is_ragged:  # [length, *shape]
                ok = len(info.shape) == len(shape) + 1 and tuple(info.shape[1:]) == shape
            else:
                ok = tuple(info.shape) == shape
            if not ok:
                got = None if info is None else f"shape {list(info.shape)} dtype {info.dtype}"
                raise CorruptCheckpointError(
                    f"{where}: final/{j}/{i} (field {key_name(key)!r}) expected "
                    f"{field.describe()}, got {got}"
                )


def _check_rows(checkpoint: StateSource, saved: Saved, high_water: int, where: str) -> None:
    names = row_tensor_names(saved.spec.fixed) if saved.spec is not None else {}
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
