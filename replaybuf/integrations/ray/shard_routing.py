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


def rescale_weights(
    batch: TensorDictBase, shard_min: float, global_min: float, beta: float
) -> TensorDictBase:
    """PER weights normalised by the union's smallest priority, not the shard's.

    A shard returns w = (p_i / p_min,shard)^-beta; over the union P(i) = p_i / sum_j p_j, so
    (N P(i))^-beta / max_j (N P(j))^-beta = (p_i / p_min)^-beta = w * (p_min,shard / p_min)^-beta.
    """
    if "weight" not in batch or beta == 0 or not np.isfinite(shard_min):
        return batch
    factor = (shard_min / global_min) ** (-beta)
    if factor != 1.0:
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
