"""The sharded buffer handle's state and plumbing: shards, calls, writes, lifecycle, stats.

:class:`ShardedBase` is the part of :class:`~replaybuf.integrations.ray.sharded.
ShardedEpisodeReplayBuffer` that does not sample. The handle is stateless but for its sampling
generator and round-robin position: each pickled copy spawns its own (numpy ``SeedSequence``
children), so collectors and learners never share a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from replaybuf.args import positive_int
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    BufferClosedError,
    EpisodeStateError,
)
from replaybuf.integrations.ray import shard_manifest
from replaybuf.integrations.ray.packing import pack_value, unpack_result
from replaybuf.integrations.ray.shard_calls import await_shard, episode_error
from replaybuf.integrations.ray.shard_routing import group_rows, split_id, take_rows, to_global
from replaybuf.storage import resolve_device

# stats() entries summed over shards; the others come from shard 0 (configuration).
_SUMMED = (
    *("episodes", "in_progress", "terminated", "truncated", "steps", "valid_steps"),
    *("evicted_episodes", "rows", "bytes", "max_steps"),
)


def _rebuild(cls: type[ShardedBase], state: tuple[Any, ...]) -> Any:
    """Unpickle a handle without checking its device here (a collector may have no GPU)."""
    handle = cls.__new__(cls)
    handle._restore(state)
    return handle


class ShardedBase:
    """Shards, calls to them, writes routed to them, and the buffer's lifecycle."""

    def __init__(
        self,
        actors: Sequence[ActorHandle],
        *,
        device: torch.device | str = "cpu",
        home: str | None = None,
        seed: int | None = None,
        min_steps: int = 0,
    ) -> None:
        """Wrap shard actors (``create`` and ``open`` are the usual way)."""
        actors = list(actors)
        if not actors or not all(isinstance(a, ActorHandle) for a in actors):
            raise ArgumentTypeError(
                f"actors must be a non-empty list of Ray actor handles, got {actors!r}"
            )
        self._restore(
            (tuple(actors), str(resolve_device(device, "device")), home, None, min_steps, False, 0)
        )
        if seed is not None:
            self._seeds = np.random.SeedSequence(seed)
            self._rng = np.random.default_rng(self._seeds)
            self._next = int(self._rng.integers(len(actors)))

    def _restore(self, state: tuple[Any, ...]) -> None:
        actors, device, home, seeds, min_steps, closed, max_steps = state
        self._actors: tuple[ActorHandle, ...] = actors
        self._device = torch.device(device)
        self._home: str | None = home
        self._seeds = seeds if seeds is not None else np.random.SeedSequence()
        self._rng = np.random.default_rng(self._seeds)
        self._next = int(self._rng.integers(len(actors)))  # round-robin start
        self._min_steps: int = min_steps
        self._closed: bool = closed
        self._max_steps: int = max_steps
        # The masses each shard reported at the last sample, by (what, length): the next
        # sample asks each shard for its share under them plus a margin.
        self._masses: dict[tuple[str, int], list[float]] = {}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the shard handles plus settings; the copy samples its own stream."""
        child = self._seeds.spawn(1)[0]
        state = (self._actors, str(self._device), self._home, child, self._min_steps)
        return _rebuild, (type(self), (*state, self._closed, self._max_steps))

    def with_device(self, device: torch.device | str) -> Any:
        """Another handle on the same shards that delivers batches on ``device``."""
        copy = _rebuild(type(self), self.__reduce__()[1][1])
        copy._device = resolve_device(device, "device")
        return copy

    @property
    def actors(self) -> tuple[ActorHandle, ...]:
        """The shard actors' handles, shard k at position k (for ``ray.kill`` or placement)."""
        return self._actors

    @property
    def num_shards(self) -> int:
        return len(self._actors)

    @property
    def device(self) -> torch.device:
        """Where this handle delivers batches."""
        return self._device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called on this handle (or the one it was copied from)."""
        return self._closed

    # ----------------------------------------------------------------- calling the shards
    def _check_usable(self, method: str) -> None:
        if self._closed:
            raise BufferClosedError(
                f"ShardedEpisodeReplayBuffer.{method}: the buffer was shut down (close() was "
                "called)"
            )
        if not ray.is_initialized():
            raise BufferClosedError(
                f"ShardedEpisodeReplayBuffer.{method}: Ray is not running in this process, so "
                "its shards cannot be reached"
            )

    async def _on(self, shard: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one buffer method on shard ``shard``; its result unpacked on this device."""
        self._check_usable(method)
        request = (
            method,
            tuple(pack_value(a) for a in args),
            {k: pack_value(v) for k, v in kwargs.items()},
        )
        ref = self._actors[shard].call.remote(request)
        result = await await_shard(shard, self.num_shards, method, ref)
        return unpack_result(result, self._device)

    async def _all(self, method: str, submit: Callable[[ActorHandle], Any]) -> list[Any]:
        """``submit(actor)`` on every shard at once; the results in shard order."""
        self._check_usable(method)
        k = self.num_shards
        refs = [submit(actor) for actor in self._actors]
        return list(
            await asyncio.gather(*(await_shard(s, k, method, ref) for s, ref in enumerate(refs)))
        )

    async def _on_episode(self, method: str, episode_id: Any, *args: Any, **kwargs: Any) -> Any:
        """``method(local id, *args)`` on the shard that holds ``episode_id``."""
        shard, local = split_id(episode_id, self.num_shards)
        try:
            return await self._on(shard, method, local, *args, **kwargs)
        except EpisodeStateError as error:
            raise episode_error(error, episode_id, shard, self.num_shards) from error

    async def _on_rows(self, shard: int, ids: list[Any], method: str, *args: Any) -> None:
        """``method(*args)`` on ``shard`` for the episodes ``ids`` (global) of a vector call;
        an unknown episode's error names those ids and the shard."""
        try:
            await self._on(shard, method, *args)
        except EpisodeStateError as error:
            raise EpisodeStateError(
                f"episode_ids {ids} (shard {shard} of {self.num_shards}): {error}",
                argument="episode_ids",
            ) from error

    # ----------------------------------------------------------------- writes
    async def start_episode(self, agent_id: str = "default") -> int:
        """Start an episode on the next shard in this handle's round-robin; its global id."""
        shard = self._next
        self._next = (shard + 1) % self.num_shards
        local = await self._on(shard, "start_episode", agent_id)
        return local * self.num_shards + shard

    async def append_observation_action_reward(
        self,
        episode_id: int,
        observation: Any,
        action: Any,
        reward: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Record one step of ``episode_id`` on its shard."""
        method = "append_observation_action_reward"
        await self._on_episode(method, episode_id, observation, action, reward, extras)

    async def append_batch(
        self,
        episode_ids: Sequence[int],
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """One step for each of several episodes: one round trip per shard touched, in
        parallel. Each shard's part is atomic; a part refused by one shard (say a schema
        error) does not undo the parts other shards stored."""
        ids = episode_ids.tolist() if isinstance(episode_ids, np.ndarray) else list(episode_ids)
        places = [split_id(e, self.num_shards, "episode_ids") for e in ids]
        groups = group_rows([shard for shard, _ in places])
        values = (observations, actions, rewards, extras)

        async def part(shard: int, rows: list[int]) -> None:
            local = [places[r][1] for r in rows]
            chunk = values if len(groups) == 1 else tuple(take_rows(v, rows) for v in values)
            await self._on_rows(shard, [ids[r] for r in rows], "append_batch", local, *chunk)

        await asyncio.gather(*(part(shard, rows) for shard, rows in groups.items()))

    async def end_episode(
        self, episode_id: int, status: str = "terminated", final_observation: Any = None
    ) -> None:
        """End an episode: ``terminated`` (or ``COMPLETED``) or ``truncated``."""
        await self._on_episode("end_episode", episode_id, status, final_observation)

    async def append_steps(
        self,
        episode_id: int,
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Several consecutive steps of ``episode_id`` in one round trip to its shard."""
        await self._on_episode("append_steps", episode_id, observations, actions, rewards, extras)

    async def start_episodes(self, count: int, agent_id: str = "default") -> list[int]:
        """Start ``count`` episodes, dealt to the shards in this handle's round-robin (one
        round trip per shard, in parallel); their global ids in the order dealt. Each shard's
        part is atomic; a part refused by one shard leaves the others' episodes started."""
        count = positive_int(count, "count")
        first, k = self._next, self.num_shards
        shards = [(first + i) % k for i in range(count)]
        groups = group_rows(shards)
        self._next = (first + count) % k
        parts = await asyncio.gather(
            *(
                self._on(shard, "start_episodes", len(rows), agent_id)
                for shard, rows in groups.items()
            )
        )
        ids = [0] * count
        for (shard, rows), local in zip(groups.items(), parts, strict=True):
            for row, episode in zip(rows, local, strict=True):
                ids[row] = to_global(episode, shard, k)
        return ids

    async def end_episodes(
        self,
        episode_ids: Sequence[int],
        statuses: str | Sequence[str] = "terminated",
        final_observations: Any = None,
    ) -> None:
        """End several episodes: one round trip per shard touched, in parallel. Each shard's
        part is atomic (all its episodes ended or none); a part refused by one shard does not
        undo the parts other shards ended."""
        ids = episode_ids.tolist() if isinstance(episode_ids, np.ndarray) else list(episode_ids)
        places = [split_id(e, self.num_shards, "episode_ids") for e in ids]
        groups = group_rows([shard for shard, _ in places])
        per_row = not isinstance(statuses, str)
        if per_row and (not isinstance(statuses, Sequence) or len(statuses) != len(ids)):
            raise ArgumentError(
                f"end_episodes: statuses must be one str or one per episode ({len(ids)}), "
                f"got {statuses!r}",
                argument="statuses",
            )

        async def part(shard: int, rows: list[int]) -> None:
            local = [places[r][1] for r in rows]
            status = [statuses[r] for r in rows] if per_row else statuses
            finals = final_observations if len(groups) == 1 else take_rows(final_observations, rows)
            await self._on_rows(
                shard, [ids[r] for r in rows], "end_episodes", local, status, finals
            )

        await asyncio.gather(*(part(shard, rows) for shard, rows in groups.items()))

    # ----------------------------------------------------------------- fan-out calls
    async def _every(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every shard at once (arguments the same for each)."""
        return list(
            await asyncio.gather(
                *(self._on(k, method, *args, **kwargs) for k in range(self.num_shards))
            )
        )

    async def set_beta(self, beta: float) -> None:
        """Change every shard's importance-weight exponent."""
        await self._every("set_beta", beta)

    async def clear(self) -> None:
        """Drop every episode of every shard (ids keep counting)."""
        await self._every("clear")

    async def stats(self) -> dict[str, Any]:
        """Counters summed over shards (``valid_steps`` is the union's), configuration, and
        ``shards``: each shard's own stats, shard k at position k."""
        shards = await self._every("stats")
        total = dict(shards[0])
        for key in _SUMMED:
            if key in total:
                total[key] = sum(s[key] for s in shards)
        agents: dict[str, int] = {}
        for s in shards:
            for agent, count in s.get("agents", {}).items():
                agents[agent] = agents.get(agent, 0) + count
        total.update(agents=agents, num_shards=self.num_shards, shards=shards)
        total["max_steps_per_shard"] = shards[0].get("max_steps")
        total["min_steps"] = self._min_steps
        return total

    async def wait_for_steps(self, min_steps: int, poll_s: float = 0.01) -> None:
        """Return once the shards hold at least ``min_steps`` valid steps together (polled)."""
        while True:
            if sum(s["valid_steps"] for s in await self._every("stats")) >= min_steps:
                return
            await asyncio.sleep(poll_s)

    # ----------------------------------------------------------------- lifecycle
    async def _save(self, root: Path, durable: bool) -> None:
        """Every shard's checkpoint into a new generation, then the manifest, then pruning."""
        await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
        generation = await asyncio.to_thread(shard_manifest.next_generation, root)
        folders = [shard_manifest.shard_dir(root, k, generation) for k in range(self.num_shards)]
        await asyncio.gather(
            *(
                self._on(k, "save_checkpoint", str(folder), durable=durable)
                for k, folder in enumerate(folders)
            )
        )
        extra = {"max_steps_per_shard": self._max_steps}
        await asyncio.to_thread(
            shard_manifest.publish, root, self.num_shards, generation, extra, durable
        )
        await asyncio.to_thread(shard_manifest.prune, root, self.num_shards, generation)

    async def close(self) -> None:
        """Close every shard's buffer (its files are removed) and end the shard actors, for
        every handle. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return

        async def down(actor: ActorHandle) -> None:
            try:
                with contextlib.suppress(RayActorError):
                    await actor.shutdown.remote()
            finally:
                ray.kill(actor, no_restart=True)

        await asyncio.gather(*(down(a) for a in self._actors), return_exceptions=True)

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
