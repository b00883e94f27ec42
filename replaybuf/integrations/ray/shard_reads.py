"""The sharded buffer's reads: samples split across shards, episodes, priorities.

:class:`ShardedReads` is the sampling part of :class:`~replaybuf.integrations.ray.sharded.
ShardedEpisodeReplayBuffer`. A sample takes two round trips: every shard's mass (valid steps,
or its priority total; for strict sequences its qualifying starts), then each shard's share of
the batch, drawn by a multinomial over the masses with the handle's generator (a multivariate
hypergeometric without replacement). Each shard draws its share uniformly (or ∝ priority) over
its own steps, so every step of the union is equally likely (or ∝ its priority).
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
    globalize,
    merge,
    rescale_weights,
    shard_batch,
    split_draws,
    split_id,
    too_few_steps,
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
        """Split ``batch_size`` over the shards by their masses at one round trip, draw each
        share in its shard at a second (in parallel), merge with ids and weights global."""
        batch_size = positive_int(batch_size, "batch_size")
        masses = await self._all(method, lambda a: a.mass.remote(what, length))
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
        picks = [(s, c) for s, c in enumerate(counts) if c]
        packed = {pack_value(k): pack_value(v) for k, v in options.items()}
        results = await asyncio.gather(
            *(
                await_shard(
                    s,
                    self.num_shards,
                    method,
                    self._actors[s].draw.remote((method, (c, *args), packed)),
                )
                for s, c in picks
            )
        )
        smallest = min([m[2] for m in masses] + [r[1] for r in results])
        beta = masses[0][3]
        copy = len(picks) == 1  # one part: its tensors are the batch, writable
        parts = [
            rescale_weights(
                globalize(unpack_batch(got, self._device, copy=copy), s, self.num_shards),
                shard_min,
                smallest,
                beta,
            )
            for (s, _), (got, shard_min) in zip(picks, results, strict=True)
        ]
        return shard_batch(merge(parts, self._rng))
