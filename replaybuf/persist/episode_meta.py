"""An episode buffer checkpoint's meta, every field checked against the others and against the
list of stored tensors, before any tensor is read or any loop runs over a count.

What the fields must satisfy (besides each one's type): ``rows`` is what ``max_steps`` and
``max_episodes`` reserve; ``frame_stack`` lies in ``[1, max_steps]``; the episode table's ids
and start numbers are unique, increasing and below ``next_id`` and ``next_seq``; ``evicted``
counts at most the ids no longer in the table; ``steps`` and ``episodes_by_status`` are the
table's; the tensors are exactly those the meta implies (rows of the spec's fields, ragged
fields, final observations of zero-step episodes, links, indexes, priorities), each of the
shape and dtype the meta implies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from replaybuf.core import END_NONE
from replaybuf.episodes import FRAME_PADDINGS, SAVED, final_rows_for
from replaybuf.errors import CorruptCheckpointError
from replaybuf.persist.meta_checks import (
    MAX_COUNT,
    check_meta_keys,
    meta_choice,
    meta_device,
    meta_int,
    meta_priority,
)
from replaybuf.persist.ragged import ragged_name
from replaybuf.persist.ring import GENERATOR, meta_spec, row_tensor_names
from replaybuf.sampling import FORMS, LAYOUTS
from replaybuf.storage import FieldSpec

PRIORITY = "priority/weights"
DRAWS = "sampler/device_draws"  # the device draws' key and round (replaybuf.accel.graphs)
STATUS = {0: "in_progress", 1: "terminated", 2: "truncated"}
INDEXES = ("index/anchors", "index/free", "index/episode_rows")
LINK_DTYPES = {"next_row": torch.int64, "episode": torch.int64, "step": torch.int64}
LINK_DTYPES |= {"end_kind": torch.int8, "alloc": torch.int64}
WHY = {  # the meta fields a tensor's shape comes from, for messages
    "index/anchors": "'s 'valid_steps'",
    "index/episode_rows": "'s 'episodes' table",
    "index/free": "'s 'rows' and 'episodes' table",
    "links/": "'s 'rows'",
    PRIORITY: "'s 'rows'",
    "rows": "'s 'high_water' and 'spec'",
}
REQUIRED = (
    *("max_steps", "max_episodes", "min_steps", "rows", "storage", "device", "storing_device"),
    *("generator_device", "next_id", "next_seq", "allocations", "prioritized", "steps"),
    *("valid_steps", "evicted", "high_water", "spec", "first_obs_spec", "episodes"),
    "episodes_by_status",
)
# Keys added to the meta after format version 1 first shipped, with what their absence meant.
LEGACY = {
    "frame_stack": None,
    "frame_stack_padding": "reset",
    "layout": "replaybuf",
    "ragged": "nested",
    "declared": None,
}


def check_meta(meta: Mapping[str, Any], version: int, where: str) -> dict[str, Any]:
    """The meta, every field checked, with the defaults of keys a version-1 checkpoint lacks."""
    priority_keys = ("alpha", "beta", "eps") if meta.get("prioritized") is True else ()
    since = f" (with 'prioritized' {meta.get('prioritized')!r})"
    meta = check_meta_keys(meta, (*REQUIRED, *priority_keys), LEGACY, version, where, since)
    max_steps = meta_int(meta, "max_steps", where, low=1)
    max_episodes = meta["max_episodes"]
    if max_episodes is not None:
        meta_int(meta, "max_episodes", where, low=1)
    rows = max_steps + final_rows_for(max_steps, max_episodes)
    meta_int(meta, "rows", where, rows, rows, since="what 'max_steps' and 'max_episodes' reserve")
    meta_int(meta, "min_steps", where, low=0)
    if meta["frame_stack"] is not None:
        meta_int(meta, "frame_stack", where, 1, max_steps, since="'max_steps'")
    paddings = FRAME_PADDINGS if meta["frame_stack"] is not None else ("reset",)
    meta_choice(meta, "frame_stack_padding", where, paddings)
    meta_choice(meta, "layout", where, LAYOUTS)
    meta_choice(meta, "ragged", where, FORMS)
    meta_choice(meta, "storage", where, ("memmap", "tensor"))
    meta_device(meta, "device", where)
    storing = meta_device(meta, "storing_device", where)
    meta_choice(meta, "generator_device", where, (storing.type,))
    meta_choice(meta, "prioritized", where, (False, True))
    if meta["prioritized"]:
        meta_priority(meta, where)
    high_water = meta_int(meta, "high_water", where, 0, rows, since="the 'rows'")
    _check_table(meta, max_steps, where)
    spec = meta_spec(meta, "spec", where)
    if spec is None and (meta["steps"] or high_water):
        raise CorruptCheckpointError(
            f"{where}: meta 'spec' expected a spec, as 'steps' ({meta['steps']}) or "
            f"'high_water' ({high_water}) are above 0"
        )
    first = meta_spec(meta, "first_obs_spec", where)
    if spec is not None and first is not None and set(first) != set(spec.group("observation")):
        raise CorruptCheckpointError(
            f"{where}: meta 'first_obs_spec' expected the fields of the 'spec' observation"
        )
    declared = meta_spec(meta, "declared", where)
    if declared is not None and spec is not None:
        for key in declared:
            if key not in spec or spec[key] != declared[key]:
                raise CorruptCheckpointError(
                    f"{where}: meta 'declared' field {key} disagrees with the 'spec'"
                )
    meta_int(meta, "valid_steps", where, 0, meta["steps"], since="the 'steps'")
    meta_int(meta, "allocations", where, low=0)
    return meta


def _check_table(meta: dict[str, Any], max_steps: int, where: str) -> None:
    """The episode table, and the counters it implies."""
    table = meta["episodes"]
    if not isinstance(table, list) or not all(_is_entry(e, max_steps) for e in table):
        raise CorruptCheckpointError(
            f"{where}: meta 'episodes' expected [id, agent, seq, end kind, steps (<= "
            f"{max_steps}), has final row] entries"
        )
    ids, seqs = [e[0] for e in table], [e[2] for e in table]
    since = "above the 'episodes' table's"
    next_id = meta_int(meta, "next_id", where, max(ids, default=-1) + 1, since=since + " ids")
    # An episode's id and start number are both taken from counters that only go up together
    meta_int(meta, "next_seq", where, next_id, next_id, since="the 'next_id'")
    if ids != seqs or ids != sorted(set(ids)):
        raise CorruptCheckpointError(
            f"{where}: meta 'episodes' expected increasing ids, each entry's start number its id"
        )
    since = "the 'next_id' less the 'episodes' in the table"
    meta_int(meta, "evicted", where, 0, next_id - len(table), since=since)
    steps = meta_int(meta, "steps", where, low=0)
    if steps != sum(e[4] for e in table):
        raise CorruptCheckpointError(
            f"{where}: meta 'steps' {steps} does not match the steps of the 'episodes' table "
            f"({sum(e[4] for e in table)})"
        )
    counts = {s: sum(STATUS[e[3]] == s for e in table) for s in STATUS.values()}
    by_status = meta["episodes_by_status"]
    if (
        not isinstance(by_status, dict)
        or by_status != counts
        or not all(type(v) is int for v in by_status.values())
    ):
        raise CorruptCheckpointError(
            f"{where}: meta 'episodes_by_status' expected {counts} (from 'episodes'), "
            f"got {by_status!r}"
        )


def _is_entry(entry: object, max_steps: int) -> bool:
    """[id, agent, seq, end kind, steps, has final row]: a final row only for an ended episode
    with steps (a zero-step episode's final observation is stored apart)."""
    return (
        isinstance(entry, list)
        and len(entry) == 6
        and all(type(v) is int and 0 <= v < MAX_COUNT for v in (entry[0], entry[2]))
        and isinstance(entry[1], str)
        and type(entry[3]) is int
        and entry[3] in STATUS
        and type(entry[4]) is int
        and 0 <= entry[4] <= max_steps
        and type(entry[5]) is bool
        and entry[5] == (entry[3] != END_NONE and entry[4] > 0)
    )


def zero_step_episodes(table: list[list[Any]]) -> int:
    """Ended episodes without steps: each keeps its final observation as ``final/<j>/<i>``."""
    return sum(1 for e in table if e[3] != END_NONE and not e[4] and not e[5])


def expected_tensors(
    meta: dict[str, Any], spec: FieldSpec | None, first: FieldSpec | None, version: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
    """Name -> (dtype, shape) of each tensor the meta implies (``None``: checked elsewhere)."""
    rows, table = meta["rows"], meta["episodes"]
    counts = sum(e[4] + e[5] for e in table)
    index_rows = {"index/anchors": meta["valid_steps"], "index/episode_rows": counts}
    index_rows["index/free"] = rows - counts
    out: dict[str, Any] = {GENERATOR: None}
    if version >= 2:
        out[DRAWS] = (torch.int64, (2,))
    out.update((name, (torch.int64, (index_rows[name],))) for name in INDEXES)
    out.update((f"links/{n}", (LINK_DTYPES[n], (rows,))) for n in SAVED)
    if meta["prioritized"]:
        out[PRIORITY] = (torch.float32, (rows,))
    if spec is not None:
        for key, name in row_tensor_names(spec.fixed).items():
            out[name] = (spec[key].dtype, (meta["high_water"], *spec[key].shape))
        for key in spec.ragged_keys:
            out[f"{ragged_name(spec, key)}/values"] = None  # check_ragged checks them
            out[f"{ragged_name(spec, key)}/offsets"] = None
    observation = FieldSpec({k: spec[k] for k in spec.group("observation")}) if spec else first
    for j in range(zero_step_episodes(table)):
        for i in range(len(observation or {})):
            out[f"final/{j}/{i}"] = None  # checked against their fields by _check_finals
    return out


def check_tensor_list(
    tensors: Mapping[str, Any], expected: dict[str, Any], version: int, where: str
) -> None:
    """The stored tensors are exactly ``expected``, of the dtypes and shapes given there."""
    optional = {DRAWS} if version < 2 else set()
    missing = sorted(set(expected) - set(tensors) - optional)
    unknown = sorted(set(tensors) - set(expected) - optional)
    if missing or unknown:
        said = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
        raise CorruptCheckpointError(
            f"{where}: tensors {', '.join(said)} (from the meta's spec, table and counters)"
        )
    for name, want in expected.items():
        info = tensors.get(name)
        if want is None or info is None:
            continue
        dtype, shape = want
        if info.dtype != dtype or tuple(info.shape) != shape:
            because = next((why for prefix, why in WHY.items() if name.startswith(prefix)), "")
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} expected shape {list(shape)} dtype {dtype} (from the"
                f" meta{because}), got shape {list(info.shape)} dtype {info.dtype}"
            )
    generator = tensors[GENERATOR]
    if generator.dtype != torch.uint8 or len(generator.shape) != 1:
        raise CorruptCheckpointError(f"{where}: tensor {GENERATOR!r} expected a 1-d uint8 tensor")
