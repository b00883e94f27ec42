"""Epochs over a sharded buffer: every shard's epoch, each row once, interleaved at random.

Each shard runs its own epoch iterator (in its actor, the next batch fetched while the caller
works), which visits every step valid in that shard at its start exactly once, in a shuffled
order. The handle deals rows from those streams into batches of ``batch_size``: how many rows
a batch takes from each shard is a multivariate hypergeometric draw over the rows each shard
has left (estimated from its valid steps at the epoch's start), so that the interleaving of
independently shuffled shard orders is a uniformly shuffled order of the union. Every row a
shard streams is dealt exactly once, whatever the estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import ray
import torch
from tensordict import TensorDictBase

from replaybuf.errors import EmptyBufferError
from replaybuf.integrations.ray.packing import unpack_batch
from replaybuf.integrations.ray.shard_calls import await_shard
from replaybuf.integrations.ray.shard_routing import globalize, merge

if TYPE_CHECKING:
    from replaybuf.integrations.ray.shard_base import ShardedBase

_WHAT = "iterate_epochs"


class _Stream:
    """One shard's epoch: its batches as they arrive, and the rows not yet dealt."""

    def __init__(self, handle: ShardedBase, shard: int, estimate: int) -> None:
        self.handle, self.shard, self.left = handle, shard, estimate
        self.rows: list[TensorDictBase] = []  # fetched, not yet dealt (batch slices)
        self.have = 0
        self.done = False
        self.token: int | None = None
        self.pending: Any = None

    def weight(self) -> int:
        """The rows this stream is thought to have left (>= what it holds; 0 when drained)."""
        return self.have if self.done else max(self.left, self.have, 1)

    async def open(self, batch_size: int, options: dict[str, Any]) -> None:
        actor = self.handle.actors[self.shard]
        ref = actor.epochs_open.remote(batch_size, 1, **options)
        self.token = await await_shard(self.shard, self.handle.num_shards, _WHAT, ref)
        self.pending = actor.epochs_next.remote(self.token)

    async def fetch(self) -> None:
        """The shard's next batch into ``rows`` (or ``done``); the one after is requested."""
        handle = self.handle
        packed = await await_shard(self.shard, handle.num_shards, _WHAT, self.pending)
        if packed is None:
            self.done, self.pending = True, None
            return
        self.pending = handle.actors[self.shard].epochs_next.remote(self.token)
        batch = unpack_batch(packed, handle.device, copy=False)
        self.rows.append(globalize(batch, self.shard, handle.num_shards))
        self.have += batch.batch_size[0]

    async def take(self, count: int) -> list[TensorDictBase]:
        """Up to ``count`` rows (fewer only once the shard's epoch is over)."""
        while self.have < count and not self.done:
            await self.fetch()
        out: list[TensorDictBase] = []
        while count > 0 and self.rows:
            head = self.rows[0]
            size = head.batch_size[0]
            if size <= count:
                out.append(self.rows.pop(0))
            else:
                out.append(head[:count])
                self.rows[0] = head[count:]
                size = count
            count -= size
            self.have -= size
            self.left -= size
        return out

    def close(self) -> None:
        if self.pending is not None and self.token is not None and ray.is_initialized():
            with contextlib.suppress(Exception):  # the actor or Ray is gone: nothing to drop
                self.handle.actors[self.shard].epochs_close.remote(self.token)
        self.pending = None


async def _one_epoch(
    handle: ShardedBase, batch_size: int, drop_last: bool, options: dict[str, Any]
) -> AsyncIterator[TensorDictBase]:
    stats = await handle.stats()
    sizes = [s["valid_steps"] for s in stats["shards"]]
    if not sum(sizes):
        raise EmptyBufferError("cannot iterate: 0 valid step(s) stored in all shards")
    streams = [_Stream(handle, k, size) for k, size in enumerate(sizes) if size]
    rng = handle._rng
    try:
        for stream in streams:
            await stream.open(batch_size, options)
        while True:
            parts: list[TensorDictBase] = []
            need = batch_size
            while need > 0:
                weights = [s.weight() for s in streams]
                if not sum(weights):
                    break
                if options["shuffle"]:
                    draw = rng.multivariate_hypergeometric(weights, min(need, sum(weights)))
                    counts = [int(c) for c in draw]
                else:  # shard by shard, in order
                    first = next(i for i, w in enumerate(weights) if w)
                    counts = [need if i == first else 0 for i in range(len(weights))]
                for stream, count in zip(streams, counts, strict=True):
                    if count:
                        got = await stream.take(int(count))
                        parts += got
                        need -= sum(p.batch_size[0] for p in got)
            if not parts:
                return
            if options["shuffle"]:
                batch = merge(parts, rng)
            else:
                batch = cast(TensorDictBase, torch.cat(parts, 0))  # TensorDicts concatenate
            if batch.batch_size[0] < batch_size and drop_last:
                return
            yield batch.clone() if len(parts) == 1 else batch  # owned, writable memory
    finally:
        for stream in streams:
            stream.close()


async def interleaved_epochs(
    handle: ShardedBase,
    batch_size: int,
    n_epochs: int,
    drop_last: bool,
    options: dict[str, Any],
) -> AsyncIterator[TensorDictBase]:
    """``n_epochs`` epochs of the union, each over the steps valid at its start (per shard)."""
    for _ in range(n_epochs):
        async for batch in _one_epoch(handle, batch_size, drop_last, options):
            yield batch
