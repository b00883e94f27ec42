"""An episode buffer past one machine: K buffer actors behind one handle, sampled as one.

:class:`ShardedEpisodeReplayBuffer` holds K shard actors (:mod:`~replaybuf.integrations.ray.
shard_actor`) and mirrors :class:`~replaybuf.integrations.ray.RemoteEpisodeReplayBuffer`'s
awaited methods. Episodes live wholly in one shard; ids carry their shard
(:mod:`~replaybuf.integrations.ray.shard_routing`). Samples are split across shards by a draw
over their valid steps (or priority totals), so they are uniform (or prioritized) over the
union. See ``docs/sharding.md``.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from tensordict import TensorDict

from replaybuf.args import NArg, check_min_steps, check_seed, positive_int
from replaybuf.buffers import EpisodeReplayBuffer
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
)
from replaybuf.integrations.ray import shard_manifest
from replaybuf.integrations.ray.shard_actor import RemoteShardActor
from replaybuf.integrations.ray.shard_epochs import interleaved_epochs
from replaybuf.integrations.ray.shard_reads import ShardedReads

__all__ = ["ShardedEpisodeReplayBuffer"]


def _check_num_shards(num_shards: Any) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ArgumentError(
            f"num_shards must be an int >= 1, got {num_shards!r}", argument="num_shards"
        )
    return num_shards


def _absolute(path: str | os.PathLike) -> str:
    """``path`` made absolute (the shards may run in another working directory)."""
    return os.path.abspath(path)


def _shard_seed(seed: int | None, shard: int) -> int | None:
    """Shard ``shard``'s sampler seed, derived from the buffer's (independent streams)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


def _per_shard(value: Any, num_shards: int, name: str) -> list[Any]:
    """An actor option for every shard: one value for all, or a list of one per shard."""
    if isinstance(value, list | tuple):
        if len(value) != num_shards:
            raise ArgumentError(
                f"{name}: expected one value per shard ({num_shards}), got {len(value)}",
                argument=name,
            )
        return list(value)
    return [value] * num_shards


class ShardedEpisodeReplayBuffer(ShardedReads):
    """K episode buffers in K Ray actors behind one picklable handle, sampled as one buffer.

    Every method is awaited and mirrors the single actor's. ``await create(...)`` or
    ``await open(directory)`` make one; copies (pickled to collectors) share the shards and
    get their own sampling stream.
    """

    @classmethod
    async def create(
        cls,
        num_shards: int,
        max_steps_per_shard: int,
        max_episodes_per_shard: int | None = None,
        *,
        device: torch.device | str = "cpu",
        directory: str | os.PathLike | None = None,
        seed: int | None = None,
        min_steps: int = 0,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        scheduling_strategy: Any = None,
        placement_group: Any = None,
        max_restarts: int = 0,
        actor_options: dict[str, Any] | None = None,
        **buffer_kwargs: Any,
    ) -> ShardedEpisodeReplayBuffer:
        """Start ``num_shards`` buffer actors and return a handle on them.

        Each shard holds ``max_steps_per_shard`` steps (and ``max_episodes_per_shard``
        episodes) and evicts its own oldest episodes. ``directory``: the buffer's home, whose
        checkpoint (if any) the shards load, where ``save_checkpoint()`` writes, and where a
        restarted shard (``max_restarts`` > 0) reloads from. ``seed`` seeds the split of
        batches and each shard's sampler; ``min_steps`` counts over all shards.
        ``scheduling_strategy`` (one, or a list of one per shard), ``placement_group`` (shard k
        on bundle k mod bundles), ``resources``, ``num_cpus``/``num_gpus`` and
        ``actor_options`` are Ray actor options; ``buffer_kwargs`` are every shard's buffer's.
        """
        num_shards = _check_num_shards(num_shards)
        max_steps = positive_int(max_steps_per_shard, "max_steps_per_shard")
        seed = check_seed(seed)
        min_steps = check_min_steps(min_steps, max_steps * num_shards)
        try:  # a misspelt argument fails here, before a process starts
            inspect.signature(EpisodeReplayBuffer).bind(
                max_steps, max_episodes_per_shard, **buffer_kwargs
            )
        except TypeError as exc:
            raise ArgumentTypeError(f"ShardedEpisodeReplayBuffer.create: {exc}") from exc
        strategies = _per_shard(scheduling_strategy, num_shards, "scheduling_strategy")
        if placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundles = len(placement_group.bundle_specs)
            strategies = [
                PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=k)
                for k in (s % bundles for s in range(num_shards))
            ]
        home = None if directory is None else _absolute(directory)
        actors = []
        for k in range(num_shards):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
            options["max_restarts"] = max_restarts
            if resources is not None:
                options["resources"] = resources
            if strategies[k] is not None:
                options["scheduling_strategy"] = strategies[k]
            options.update(actor_options or {})
            kwargs = {**buffer_kwargs, "max_steps": max_steps, "device": "cpu"}
            kwargs["max_episodes"] = max_episodes_per_shard
            kwargs["seed"] = _shard_seed(seed, k)
            actor = cast(  # Ray types it as the handle or the class; it is the handle
                ActorHandle, RemoteShardActor.options(**options).remote(home, k, num_shards, kwargs)
            )
            actors.append(actor)
        handle = cls(actors, device=device, home=home, seed=seed, min_steps=min_steps)
        handle._max_steps = max_steps
        try:
            await handle._all("create", lambda a: a.start.remote())
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            handle._closed = True
            raise
        return handle

    @classmethod
    async def open(
        cls,
        directory: str | os.PathLike,
        num_shards: int | None = None,
        max_steps_per_shard: int | None = None,
        **kwargs: Any,
    ) -> ShardedEpisodeReplayBuffer:
        """Load the sharded checkpoint at ``directory`` onto as many shards as it was saved
        from; where there is none, create one there (``num_shards`` and
        ``max_steps_per_shard`` needed then). ``kwargs``: :meth:`create`'s (a checkpoint load
        takes ``device``, ``storage``, ``scratch_dir``, ``seed``, ``min_steps`` and the actor
        options from them)."""
        root = Path(directory)
        if num_shards is not None:
            num_shards = _check_num_shards(num_shards)
        if (root / shard_manifest.MANIFEST).exists() or num_shards is None:
            manifest = shard_manifest.read(root, num_shards)  # clear errors, before any actor
            num_shards = int(manifest["num_shards"])
            max_steps_per_shard = int(manifest["max_steps_per_shard"])
        elif max_steps_per_shard is None:
            raise ArgumentError(
                f"{root}: no sharded checkpoint there; creating one needs max_steps_per_shard",
                argument="max_steps_per_shard",
            )
        return await cls.create(num_shards, max_steps_per_shard, directory=root, **kwargs)

    # ----------------------------------------------------------------- reads
    async def sample_n_step(
        self,
        batch_size: int,
        n: NArg = 1,
        gamma: float = 0.99,
        *,
        replace: bool = True,
        layout: str | None = None,
    ) -> TensorDict:
        """``batch_size`` n-step transitions, uniform (or prioritized) over every shard's
        valid steps, delivered on this handle's device."""
        options = {"replace": replace, "layout": layout}
        return await self._sample("sample_n_step", "steps", 1, batch_size, (n, gamma), options)

    async def sample_sequences(
        self,
        batch_size: int,
        seq_len: int,
        *,
        strict: bool = True,
        layout: str | None = None,
        burn_in: int = 0,
    ) -> TensorDict:
        """``[batch_size, burn_in + seq_len]`` runs of steps, uniform over the union's starts
        (strict: where ``seq_len`` steps fit); ``burn_in`` steps before each start."""
        seq_len = positive_int(seq_len, "seq_len")
        what = "sequences" if strict else "steps"
        options = {"strict": strict, "layout": layout, "burn_in": burn_in}
        return await self._sample(
            "sample_sequences", what, seq_len, batch_size, (seq_len,), options
        )

    def iterate_epochs(
        self,
        batch_size: int,
        n_epochs: int = 1,
        *,
        n: NArg = 1,
        gamma: float = 0.99,
        shuffle: bool = True,
        drop_last: bool = False,
        layout: str | None = None,
    ):
        """``async for`` n-step batches; each epoch visits every step valid (in its shard) at
        the epoch's start exactly once, the shards' shuffled plans interleaved at random."""
        batch_size = positive_int(batch_size, "batch_size")
        n_epochs = positive_int(n_epochs, "n_epochs")
        self._check_usable("iterate_epochs")
        options = {"n": n, "gamma": gamma, "shuffle": shuffle, "layout": layout}
        return interleaved_epochs(self, batch_size, n_epochs, drop_last, options)

    # ----------------------------------------------------------------- lifecycle
    async def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Checkpoint every shard (``directory/shard-<k>/g<generation>``, written by the shard on
        its node: use a shared file system across nodes), then publish the manifest last;
        returns ``directory`` (default: the home given to :meth:`create` / :meth:`open`)."""
        self._check_usable("save_checkpoint")
        if directory is None and self._home is None:
            raise ArgumentError(
                "save_checkpoint() needs a directory: this buffer has no home directory "
                "(create(directory=...) or open(directory) give it one)",
                argument="directory",
            )
        root = Path(_absolute(directory if directory is not None else str(self._home)))
        await self._save(root, durable)
        return root

    # ----------------------------------------------------------------- introspection
    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"ShardedEpisodeReplayBuffer({self.num_shards} shards, device={self._device}, {state})"
        )
