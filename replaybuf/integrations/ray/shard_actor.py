"""One shard of a sharded buffer: the buffer actor, plus what the handle needs to sample
the union exactly and to survive a restart.

A shard builds its buffer on its first call, not in ``__init__``: from the published
checkpoint of its home directory if there is one (:mod:`~replaybuf.integrations.ray.
shard_manifest`), else empty. Ray reruns ``__init__`` when it restarts a dead actor
(``max_restarts``), so a restarted shard comes back from its last checkpoint the same way.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import ray
import torch

from replaybuf.buffers import EpisodeReplayBuffer
from replaybuf.core import full_sequence_starts, full_sequence_starts_by_jumps, jump_levels
from replaybuf.integrations.ray import shard_manifest
from replaybuf.integrations.ray.actor import _BufferActor
from replaybuf.integrations.ray.packing import PackedBatch
from replaybuf.integrations.ray.portable import portable_errors

# What a checkpoint load takes from the constructor's arguments (the rest is the checkpoint's).
_LOAD_OVERRIDES = ("storing_device", "storage", "scratch_dir")


class _ShardActor(_BufferActor):
    """An episode buffer actor that restores itself from its home's checkpoint when (re)started,
    and reports the masses (valid steps, priority totals) a sample across shards is split by."""

    def __init__(self, home: str | None, shard: int, num_shards: int, kwargs: dict[str, Any]):
        super().__init__()
        self._home = None if home is None else Path(home)
        self._shard, self._num_shards, self._kwargs = shard, num_shards, kwargs
        self._down = False  # shutdown() ran: never rebuild
        self._building: asyncio.Lock | None = None
        self._source: str | None = None  # the checkpoint the buffer was loaded from

    async def _ready(self) -> EpisodeReplayBuffer:
        """The buffer, built on first use (from the home checkpoint, else empty)."""
        if self._buffer is None and not self._down:
            if self._building is None:
                self._building = asyncio.Lock()
            async with self._building:
                if self._buffer is None and not self._down:
                    with portable_errors():
                        self._buffer = await self._build()
        return self._live()

    async def _build(self) -> EpisodeReplayBuffer:
        source = None
        if self._home is not None:
            source = await asyncio.to_thread(
                shard_manifest.current_shard, self._home, self._shard, self._num_shards
            )
        if source is None:
            return EpisodeReplayBuffer(**self._kwargs)
        overrides = {k: v for k, v in self._kwargs.items() if k in _LOAD_OVERRIDES}
        self._source = str(source)
        return await EpisodeReplayBuffer.load_checkpoint(source, **overrides)

    async def start(self) -> str | None:
        """Build the buffer now (a bad argument returns as itself); the checkpoint it loaded."""
        await self._ready()
        return self._source

    async def call(self, request: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
        await self._ready()
        return await super().call(request)

    async def epochs_open(self, batch_size: int, n_epochs: int, **kwargs: Any) -> int:
        await self._ready()
        return await super().epochs_open(batch_size, n_epochs, **kwargs)

    async def shutdown(self) -> None:
        self._down = True
        await super().shutdown()

    async def mass(self, what: str, length: int = 1) -> tuple[float, int, float, float]:
        """``(mass, valid steps, smallest priority weight, beta)`` for a draw of ``what``:
        ``"steps"`` (valid steps, or their priority total), ``"sequences"`` (strict starts of
        ``length`` steps, or their priority total) or ``"episodes"`` (stored episodes)."""
        return self._mass(await self._ready(), what, length)

    def _mass(
        self, buffer: EpisodeReplayBuffer, what: str, length: int
    ) -> tuple[float, int, float, float]:
        sync = buffer.sync
        with sync._lock:
            core = sync._core
            core.flush()  # staged steps count (and get their priorities), as for a sample
            priorities = core.priorities
            smallest = math.inf if priorities is None else priorities.tree.min_positive()
            beta = 0.0 if priorities is None else priorities.beta
            valid = core.valid_steps
            if what == "episodes":
                return float(len(core.episodes)), valid, smallest, beta
            if what == "steps" or length <= 1:
                mass = float(valid) if priorities is None else priorities.tree.total()
                return mass, valid, smallest, beta
            rows = core.anchors.snapshot()
            host = core.links.host
            if host is None:
                jumps = core.links.jumps(jump_levels(length))
                ok = full_sequence_starts_by_jumps(rows, length, jumps)
            else:
                ok = torch.from_numpy(full_sequence_starts(rows.numpy(), length, host.succ))
            eligible = rows[ok]
            if priorities is None:
                return float(eligible.shape[0]), valid, smallest, beta
            total = float(priorities.tree.get(eligible).double().sum()) if len(eligible) else 0.0
            return total, valid, smallest, beta

    async def draw(
        self, order: tuple[tuple[str, tuple[Any, ...], dict[str, Any]], str, int]
    ) -> tuple[PackedBatch | None, tuple[float, int, float, float]]:
        """For ``order = (request, what, length)``: a sample of ``request[1][0]`` rows (none
        where that is 0 or this shard has nothing to draw from) and this shard's :meth:`mass`
        for ``what`` right after it (no other call runs in between).

        One argument, not three: Ray serializes each argument of a call on its own.
        """
        request, what, length = order
        buffer = await self._ready()
        result = None
        if request[1][0] > 0 and self._mass(buffer, what, length)[0] > 0:
            result = await self.call(request)
        return result, self._mass(buffer, what, length)


RemoteShardActor = ray.remote(_ShardActor)
