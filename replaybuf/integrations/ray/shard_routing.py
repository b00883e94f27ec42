"""Where things live in a sharded buffer: global ids, rows of a vector step, batch splits.

Pure functions, no Ray: :class:`~replaybuf.integrations.ray.sharded.ShardedEpisodeReplayBuffer`
uses them to route writes and to merge what its shards sample.

Ids are arithmetic, so a handle needs no table: a shard's local id ``l`` (an episode id, or a
priority ``index``) is ``l * K + k`` globally, for shard ``k`` of ``K``; ``g % K`` is the shard
and ``g // K`` the local id again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replaybuf.errors import ArgumentTypeError, EmptyBufferError, EpisodeStateError
from replaybuf.integrations.ray.packing import PackedArray, PackedBatch

# Batch keys holding a shard's local ids: made global when batches leave the handle.
ID_KEYS = ("episode_id", "index")


def to_global(local: int, shard: int, num_shards: int) -> int:
    """The global id of shard ``shard``'s local id ``local``."""
    return local * num_shards + shard


def split_id(episode_id: Any, num_shards: int, name: str = "episode_id") -> tuple[int, int]:
    """``(shard, local id)`` of a global episode id; a clear error for anything else."""
    if isinstance(episode_id, np.integer | torch.Tensor) and not isinstance(episode_id, bool):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # one element
            episode_id = int(episode_id)
    if type(episode_id) is not int:
        raise ArgumentTypeError(
            f"{name} must be an int (an id this buffer handed out), got "
            f"{type(episode_id).__name__}",
            argument=name,
        )
    if episode_id < 0:
        raise EpisodeStateError(
            f"{name} {episode_id}: unknown episode (ids of a sharded buffer are >= 0)",
            argument=name,
        )
    return episode_id % num_shards, episode_id // num_shards


def group_rows(shards: Sequence[int]) -> dict[int, list[int]]:
    """The rows of a vector step each shard gets, in row order, by shard."""
    groups: dict[int, list[int]] = {}
    for row, shard in enumerate(shards):
        groups.setdefault(shard, []).append(row)
    return groups


def take_rows(value: Any, rows: list[int]) -> Any:
    """The ``rows`` (leading dim) of a vector step's value: tensors, arrays, nested dicts,
    TensorDicts, lists and tuples; ``None`` stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor | TensorDictBase):
        return value[torch.tensor(rows, dtype=torch.long, device=value.device)]
    if isinstance(value, np.ndarray):
        return value[rows]
    if isinstance(value, dict):
        return {key: take_rows(item, rows) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [value[row] for row in rows]
    raise ArgumentTypeError(
        f"append_batch: a value with one row per episode (tensor, array, list or dict of them) "
        f"is needed to route rows to shards, got {type(value).__name__}"
    )


def split_draws(
    rng: np.random.Generator, batch_size: int, masses: Sequence[float], replace: bool = True
) -> list[int]:
    """How many of ``batch_size`` draws each shard makes: multinomial over ``masses`` (valid
    steps, or priority totals); without ``replace`` (integer masses), multivariate
    hypergeometric, so the split is that of ``batch_size`` distinct draws from the union."""
    weights = np.asarray(masses, dtype=np.float64)
    total = float(weights.sum())
    if not total > 0:
        return [0] * len(weights)
    if not replace:
        counts = np.asarray([int(m) for m in masses], dtype=np.int64)
        take = min(batch_size, int(counts.sum()))
        return [int(c) for c in rng.multivariate_hypergeometric(counts, take)]
    return [int(c) for c in rng.multinomial(batch_size, weights / total)]


def ask_counts(batch_size: int, masses: Sequence[float] | None, num_shards: int) -> list[int]:
    """How many rows to ask each shard for, before its mass now is known: its share under
    the last masses seen plus 4 standard deviations and 8 (the whole batch when none were
    seen, or for a shard that had nothing then), so that one round trip almost always
    suffices."""
    total = 0.0 if masses is None else float(sum(masses))
    if masses is None or not total > 0:
        return [batch_size] * num_shards
    asks = []
    for mass in masses:
        p = mass / total
        mean = batch_size * p
        margin = 4 * math.sqrt(batch_size * p * (1 - p)) + 8
        asks.append(min(batch_size, math.ceil(mean + margin)) if p > 0 else min(batch_size, 8))
    return asks


def globalize(batch: TensorDictBase, shard: int, num_shards: int) -> TensorDictBase:
    """A shard's batch (or episode) with its episode ids and priority indices made global."""
    for key in ID_KEYS:
        if key in batch:
            batch.set(key, batch.get(key) * num_shards + shard)
    return batch


def weight_factor(shard_min: float, global_min: float, beta: float) -> float:
    """What a shard's PER weights are multiplied by to be normalised by the union's smallest
    priority, not the shard's (1 without priorities or ``beta``).

    A shard returns w = (p_i / p_min,shard)^-beta; over the union P(i) = p_i / sum_j p_j, so
    (N P(i))^-beta / max_j (N P(j))^-beta = (p_i / p_min)^-beta = w * (p_min,shard / p_min)^-beta.
    """
    if beta == 0 or not np.isfinite(shard_min):
        return 1.0
    return float((shard_min / global_min) ** (-beta))


def rescale_weights(batch: TensorDictBase, factor: float) -> TensorDictBase:
    """A shard's batch with its ``weight`` times :func:`weight_factor`'s ``factor``."""
    if "weight" in batch and factor != 1.0:
        weight = batch.get("weight")
        batch.set("weight", (weight.double() * factor).to(weight.dtype))
    return batch


def merge(parts: list[TensorDictBase], rng: np.random.Generator) -> TensorDictBase:
    """The shards' batches as one, rows in a random order (so any slice of the batch is a
    uniform sample too, not one shard's rows)."""
    if len(parts) == 1:
        return parts[0]
    batch = cast(TensorDictBase, torch.cat(parts, 0))  # TensorDicts concatenate
    rows = batch.batch_size[0]
    order = torch.from_numpy(rng.permutation(rows)).to(batch.device)
    return batch[order]


def merge_packed(
    pieces: Sequence[tuple[PackedBatch, int, int, float]],
    num_shards: int,
    rng: np.random.Generator,
    device: torch.device,
) -> TensorDict | None:
    """:func:`globalize`, :func:`rescale_weights` and :func:`merge` of packed shard batches
    in one pass per field, on their numpy arrays, into one TensorDict that owns its memory.

    ``pieces`` holds ``(batch, rows, shard, weight factor)``: the first ``rows`` rows of each
    batch are taken, their ids made global and their ``weight`` times the factor. The rows are
    shuffled as :func:`merge` shuffles them (the same draw from ``rng``). Each field is one
    concatenation and one gather, where TensorDicts would slice, set, concatenate and index
    every field in turn. None where a field is not a plain array (text, jagged tensors, a
    weight with no numpy dtype) or the batches' fields differ: the caller then merges
    TensorDicts.
    """
    first = pieces[0][0]
    keys, tail = [key for key, _ in first.leaves], first.batch_size[1:]
    for packed, _, _, _ in pieces:
        if [key for key, _ in packed.leaves] != keys or packed.batch_size[1:] != tail:
            return None
        for key, leaf in packed.leaves:
            if not isinstance(leaf, PackedArray):
                return None
            if not isinstance(getattr(torch, leaf.dtype, None), torch.dtype):
                return None  # unpack_batch names the unknown dtype
            if key == ("weight",) and leaf.dtype != leaf.array.dtype.name:
                return None  # bfloat16 weights travel as bits: rescale them as tensors
    rows = sum(take for _, take, _, _ in pieces)
    order = rng.permutation(rows) if len(pieces) > 1 else None
    fields: dict[str, Any] = {}
    for i, key in enumerate(keys):
        arrays = []
        for packed, take, shard, factor in pieces:
            array = cast(PackedArray, packed.leaves[i][1]).array[:take]
            if len(key) == 1 and key[0] in ID_KEYS:
                array = array * num_shards + shard
            elif key == ("weight",) and factor != 1.0:
                array = (array.astype(np.float64) * factor).astype(array.dtype)
            arrays.append(array)
        if order is not None:
            merged = np.concatenate(arrays).take(order, axis=0)
        else:
            merged = np.array(arrays[0])  # a copy: the received array is read-only
        tensor = torch.from_numpy(merged)
        dtype = getattr(torch, cast(PackedArray, first.leaves[i][1]).dtype)
        if tensor.dtype != dtype:  # bits of a dtype numpy lacks
            tensor = tensor.view(dtype)
        place = fields
        for part in key[:-1]:
            place = place.setdefault(part, {})
        place[key[-1]] = tensor if device.type == "cpu" else tensor.to(device)
    return TensorDict(fields, batch_size=[rows, *tail], device=device)


def too_few_steps(what: str, have: int, need: int, min_steps: int) -> EmptyBufferError:
    """The error of a sample from shards that hold too little (the single buffer's text)."""
    return EmptyBufferError(
        f"cannot {what}: {have} valid step(s) stored in all shards, need at least {need}"
        + (f" (min_steps={min_steps})" if min_steps else "")
    )


def shard_batch(value: Any) -> TensorDict:
    """Narrow a result's type for the type checker (shards return TensorDicts here)."""
    if not isinstance(value, TensorDictBase):
        raise ArgumentTypeError(f"a shard returned {type(value).__name__}, not a TensorDict")
    return cast(TensorDict, value)
