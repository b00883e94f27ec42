"""The sharded buffer's reads: samples split across shards, episodes, priorities.

:class:`ShardedReads` is the sampling part of :class:`~replaybuf.integrations.ray.sharded.
ShardedEpisodeReplayBuffer`. A sample is one round trip to every shard: each draws a share
(its share under the last split, plus a margin) and reports its mass right after (valid steps,
or its priority total; for strict sequences its qualifying starts). The split is then drawn over
those masses, a multinomial with the handle's generator (a multivariate hypergeometric without
replacement), and each share cut from its shard's draw. Each shard draws uniformly (or ∝
priority) over its own steps, so every step of the union is equally likely (or ∝ its priority).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tensordict import TensorDict

from replaybuf.args import host_tensor, positive_int
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    EmptyBufferError,
    IndexOutOfRangeError,
)
from replaybuf.integrations.ray.packing import pack_value, unpack_batch
from replaybuf.integrations.ray.shard_base import ShardedBase
from replaybuf.integrations.ray.shard_calls import await_shard
from replaybuf.integrations.ray.shard_routing import (
    ask_counts,
    globalize,
    merge,
    merge_packed,
    rescale_weights,
    shard_batch,
    split_draws,
    split_id,
    too_few_steps,
    weight_factor,
)


class ShardedReads(ShardedBase):
    """Sampling, whole episodes and priority updates across the shards."""

    async def sample_episodes(
        self, k: int, *, replace: bool = False, layout: str | None = None
    ) -> list[TensorDict]:
        """``k`` whole episodes drawn uniformly over every shard's (distinct unless
        ``replace``; fewer if fewer are stored)."""
        k = positive_int(k, "k")
        masses = await self._all("sample_episodes", lambda a: a.mass.remote("episodes"))
        counts = split_draws(self._rng, k, [m[0] for m in masses], replace)
        if not sum(counts):
            raise EmptyBufferError("cannot sample episodes: no shard holds one")
        picks = [(s, c) for s, c in enumerate(counts) if c]
        parts = await asyncio.gather(
            *(self._on(s, "sample_episodes", c, replace=replace, layout=layout) for s, c in picks)
        )
        episodes = [
            globalize(episode, s, self.num_shards)
            for (s, _), got in zip(picks, parts, strict=True)
            for episode in got
        ]
        return [episodes[i] for i in self._rng.permutation(len(episodes))]

    async def get_episode(self, episode_id: int, *, layout: str | None = None) -> TensorDict:
        """One whole stored episode, time-major (its ids global)."""
        shard, _ = split_id(episode_id, self.num_shards)
        record = await self._on_episode("get_episode", episode_id, layout=layout)
        return globalize(record, shard, self.num_shards)

    async def update_priorities(self, index: Any, priority: Any) -> int:
        """Set sampled steps' priorities by a batch's global ``index``: each id goes to its
        shard (``index % K``), all shards at once; returns how many applied."""
        ids = host_tensor(index).reshape(-1).cpu()
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise ArgumentTypeError(
                f"index must hold integer ids, got dtype {ids.dtype}", argument="index"
            )
        ids = ids.long()
        if isinstance(priority, int | float) and not isinstance(priority, bool):
            values = torch.full(ids.shape, float(priority), dtype=torch.float64)
        else:
            values = host_tensor(priority).detach().reshape(-1).cpu()
        if values.numel() != ids.numel():
            raise ArgumentError(
                f"priority must have one value per index: expected {ids.numel()}, got "
                f"{values.numel()}",
                argument="priority",
            )
        if bool((ids < 0).any()):
            raise IndexOutOfRangeError(
                f"index: id {int(ids[ids < 0][0])} was never handed out (ids are >= 0)",
                argument="index",
            )
        shards = ids % self.num_shards
        touched = shards.unique().tolist()
        applied = await asyncio.gather(
            *(
                self._on(
                    s,
                    "update_priorities",
                    ids[shards == s] // self.num_shards,
                    values[shards == s],
                )
                for s in touched
            )
        )
        return int(sum(applied))

    async def _sample(
        self,
        method: str,
        what: str,
        length: int,
        batch_size: int,
        args: tuple[Any, ...],
        options: dict[str, Any],
    ) -> TensorDict:
        """One round trip to every shard: each draws a share of the batch and reports its
        mass right after; the split is then drawn over those masses and each share cut from
        what its shard drew (shares asked with a margin over the last split: a shard that drew
        too few is asked for the rest, a second round trip that rarely happens)."""
        batch_size = positive_int(batch_size, "batch_size")
        self._check_usable(method)
        packed = {k: pack_value(v) for k, v in options.items()}
        asks = ask_counts(batch_size, self._masses.get((what, length)), self.num_shards)
        replies = await self._draws(method, what, length, asks, args, packed)
        masses = [mass for _, mass in replies]
        self._masses[what, length] = [m[0] for m in masses]
        have, need = sum(m[1] for m in masses), max(1, self._min_steps)
        verb = "sample" if method == "sample_n_step" else "sample sequences"
        if have < need:
            raise too_few_steps(verb, have, need, self._min_steps)
        replace = options.get("replace", True)
        counts = split_draws(self._rng, batch_size, [m[0] for m in masses], replace)
        if not sum(counts):
            raise EmptyBufferError(
                f"cannot {verb}: no shard holds a step to draw"
                + (f" ({length} consecutive steps)" if what == "sequences" else "")
            )
        parts = [got for got, _ in replies]
        short = [
            max(0, c - (0 if p is None else p.batch_size[0]))
            for c, p in zip(counts, parts, strict=True)
        ]
        extra: list[Any] = [None] * self.num_shards
        if any(short):  # the masses moved since the last split: draw the rest
            more = await self._draws(method, what, length, short, args, packed)
            masses += [mass for _, mass in more]
            extra = [got for got, _ in more]
        smallest = min(m[2] for m in masses)
        beta = masses[0][3]
        pieces = []  # (packed batch, rows taken, shard, weight factor), in shard order
        for shard, (count, part) in enumerate(zip(counts, parts, strict=True)):
            factor = weight_factor(masses[shard][2], smallest, beta)
            if part is not None and count:
                pieces.append((part, min(count, part.batch_size[0]), shard, factor))
            if short[shard] and extra[shard] is not None:
                pieces.append((extra[shard], extra[shard].batch_size[0], shard, factor))
        batch = merge_packed(pieces, self.num_shards, self._rng, self._device)
        if batch is None:  # text or jagged fields: merge them as TensorDicts
            tds = []
            for part, rows, shard, factor in pieces:
                piece = unpack_batch(part, self._device, copy=False)[:rows]
                tds.append(rescale_weights(globalize(piece, shard, self.num_shards), factor))
            batch = merge(tds, self._rng)
            batch = batch.clone() if len(tds) == 1 else batch
        return shard_batch(batch)

    async def _draws(
        self,
        method: str,
        what: str,
        length: int,
        counts: list[int],
        args: tuple[Any, ...],
        options: dict[str, Any],
    ) -> list[tuple[Any, tuple[float, int, float, float]]]:
        """Every shard's ``draw`` of ``counts[k]`` rows (0: its mass only), in parallel."""
        return list(
            await asyncio.gather(
                *(
                    await_shard(
                        s,
                        self.num_shards,
                        method,
                        actor.draw.remote(((method, (c, *args), options), what, length)),
                    )
                    for s, (actor, c) in enumerate(zip(self._actors, counts, strict=True))
                )
            )
        )
