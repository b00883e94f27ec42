"""The client: a picklable handle on the buffer actor whose awaited methods mirror
:class:`replaybuf.EpisodeReplayBuffer`'s."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from tensordict import TensorDict

from replaybuf.args import NArg
from replaybuf.buffers import EpisodeReplayBuffer
from replaybuf.errors import ArgumentError, ArgumentTypeError, BufferClosedError
from replaybuf.integrations.ray.actor import RemoteBufferActor
from replaybuf.integrations.ray.packing import pack_value, unpack_batch, unpack_result
from replaybuf.integrations.ray.portable import PortableError
from replaybuf.storage import resolve_device


def _rebuild(
    actor: ActorHandle, device: str, name: str | None, closed: bool
) -> RemoteEpisodeReplayBuffer:
    """Unpickle a client without checking its device here (a collector may have no GPU)."""
    client = RemoteEpisodeReplayBuffer.__new__(RemoteEpisodeReplayBuffer)
    client._actor, client._device, client._name, client._closed = (
        actor,
        torch.device(device),
        name,
        closed,
    )
    return client


class RemoteEpisodeReplayBuffer:
    """A handle on an :class:`~replaybuf.EpisodeReplayBuffer` running in a Ray actor.

    Every method is awaited and mirrors the local one. Batches arrive as TensorDicts on
    ``device``. The handle pickles (send it to collector actors); :meth:`close` shuts the actor
    down for every handle, after which any method raises :class:`BufferClosedError`.
    """

    def __init__(
        self, actor: ActorHandle, *, device: torch.device | str = "cpu", name: str | None = None
    ) -> None:
        """Wrap a buffer actor's handle (:meth:`create` and :meth:`get` are the usual way)."""
        if not isinstance(actor, ActorHandle):
            raise ArgumentTypeError(f"actor must be a Ray actor handle, got {type(actor).__name__}")
        self._actor = actor
        self._device = resolve_device(device, "device")
        self._name = name
        self._closed = False

    @classmethod
    async def create(
        cls,
        max_steps: int,
        max_episodes: int | None = None,
        *,
        device: torch.device | str = "cpu",
        directory: str | os.PathLike | None = None,
        name: str | None = None,
        namespace: str | None = None,
        lifetime: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        scheduling_strategy: Any = None,
        actor_options: dict[str, Any] | None = None,
        **buffer_kwargs: Any,
    ) -> RemoteEpisodeReplayBuffer:
        """Start a buffer actor and return a handle on it (a bad argument raises here, as itself).

        ``device`` is where this handle delivers batches (the actor samples on CPU). With
        ``directory`` the actor runs ``EpisodeReplayBuffer.open(directory, ...)`` on its node:
        it loads the checkpoint there, if any, and ``save_checkpoint()`` writes there.
        ``name``/``namespace``/``lifetime`` (``"detached"``), ``num_cpus``, ``num_gpus``,
        ``resources`` and ``scheduling_strategy`` are Ray actor options (``actor_options``
        passes any other); ``buffer_kwargs`` are the buffer's (``storage``, ``seed``, ...).
        """
        device = resolve_device(device, "device")
        try:  # a misspelt argument fails here, before a process starts
            inspect.signature(EpisodeReplayBuffer).bind(max_steps, max_episodes, **buffer_kwargs)
        except TypeError as exc:
            raise ArgumentTypeError(f"RemoteEpisodeReplayBuffer.create: {exc}") from exc
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        for key, value in (
            ("name", name),
            ("namespace", namespace),
            ("lifetime", lifetime),
            ("resources", resources),
            ("scheduling_strategy", scheduling_strategy),
        ):
            if value is not None:
                options[key] = value
        options.update(actor_options or {})
        # Ray types the result as the handle or the class itself; it is the handle.
        actor = cast(ActorHandle, RemoteBufferActor.options(**options).remote())
        kwargs = {"max_steps": max_steps, **buffer_kwargs}
        if max_episodes is not None:  # unset: open() takes a checkpoint's max_episodes as is
            kwargs["max_episodes"] = max_episodes
        kwargs["device"] = "cpu"  # batches leave the actor through host memory anyway
        client = cls(actor, device=device, name=name)
        try:
            await client._await(
                "create", actor.open.remote(None if directory is None else str(directory), kwargs)
            )
        except BaseException:
            ray.kill(actor, no_restart=True)
            client._closed = True
            raise
        return client

    @classmethod
    def get(
        cls, name: str, *, namespace: str | None = None, device: torch.device | str = "cpu"
    ) -> RemoteEpisodeReplayBuffer:
        """A handle on the buffer actor created with ``name`` (e.g. detached, on another node)."""
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"name must be a non-empty str, got {name!r}")
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError as exc:
            raise ArgumentError(
                f"name: no Ray actor named {name!r} in namespace {namespace or 'current'}"
            ) from exc
        return cls(actor, device=device, name=name)

    def with_device(self, device: torch.device | str) -> RemoteEpisodeReplayBuffer:
        """Another handle on the same actor that delivers batches on ``device``."""
        client = type(self)(self._actor, device=device, name=self._name)
        client._closed = self._closed
        return client

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the actor handle plus settings, so collectors on any node can use it."""
        return _rebuild, (self._actor, str(self._device), self._name, self._closed)

    def __repr__(self) -> str:
        """Name, device and whether this handle was closed."""
        state = "closed" if self._closed else "open"
        return f"RemoteEpisodeReplayBuffer({self._label()}, device={self._device}, {state})"

    @property
    def actor(self) -> ActorHandle:
        """The Ray actor handle (for ``ray.kill``, ``ray.get_actor`` or custom calls)."""
        return self._actor

    @property
    def device(self) -> torch.device:
        """Where this handle delivers batches."""
        return self._device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called on this handle (or the one it was copied from)."""
        return self._closed

    # ----------------------------------------------------------------- calling the actor
    def _label(self) -> str:
        """How error messages name the actor."""
        return f"buffer actor {self._name!r}" if self._name else "buffer actor"

    def _check_usable(self, method: str) -> None:
        """Raise BufferClosedError naming ``method`` before a call that cannot reach the actor."""
        if self._closed:
            raise BufferClosedError(
                f"RemoteEpisodeReplayBuffer.{method}: the buffer was shut down (close() was called)"
            )
        if not ray.is_initialized():
            raise BufferClosedError(
                f"RemoteEpisodeReplayBuffer.{method}: Ray is not running in this process "
                "(ray.shutdown() was called, or ray.init() never was), so the "
                f"{self._label()} cannot be reached"
            )

    async def _await(self, method: str, ref: Any) -> Any:
        """Await one actor call, turning Ray's errors into the buffer's own."""
        try:
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # best effort: the actor may be gone already
                ray.cancel(ref)  # the actor cancels the coroutine: it completed or never started
            raise
        except RayTaskError as error:
            cause = error.cause
            if isinstance(cause, PortableError):
                cause = cause.rebuild()
            if isinstance(cause, BufferClosedError):
                raise BufferClosedError(
                    f"RemoteEpisodeReplayBuffer.{method}: the buffer was shut down "
                    f"({self._label()}: {cause})"
                ) from error
            if isinstance(cause, Exception) and not isinstance(cause, RayTaskError):
                raise cause from error  # SchemaError, EmptyBufferError, ... as raised locally
            raise
        except ActorUnavailableError:
            raise  # a transient network failure: the actor may come back, retrying may work
        except RayActorError as error:
            raise BufferClosedError(
                f"RemoteEpisodeReplayBuffer.{method}: the {self._label()} is gone (shut down "
                f"through another handle, killed, or its node died): {type(error).__name__}"
            ) from error

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one buffer method in the actor: arguments packed there, results unpacked here."""
        self._check_usable(method)
        packed_args = tuple(pack_value(a) for a in args)
        packed_kwargs = {k: pack_value(v) for k, v in kwargs.items()}
        ref = self._actor.call.remote((method, packed_args, packed_kwargs))
        return unpack_result(await self._await(method, ref), self._device)

    # ----------------------------------------------------------------- writes
    async def start_episode(self, agent_id: str = "default") -> int:
        """Start an episode in the remote buffer and return its id."""
        return await self._call("start_episode", agent_id)

    async def append_observation_action_reward(
        self,
        episode_id: int,
        observation: Any,
        action: Any,
        reward: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Record one step (one actor round trip: prefer :meth:`append_batch` for many envs)."""
        await self._call(
            "append_observation_action_reward", episode_id, observation, action, reward, extras
        )

    async def append_batch(
        self,
        episode_ids: Sequence[int],
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """One step for each of several episodes in one round trip; leading dim = episodes."""
        await self._call("append_batch", list(episode_ids), observations, actions, rewards, extras)

    async def append_steps(
        self,
        episode_id: int,
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Several consecutive steps of one episode in one round trip; leading dim = steps."""
        await self._call("append_steps", episode_id, observations, actions, rewards, extras)

    async def start_episodes(self, count: int, agent_id: str = "default") -> list[int]:
        """Start ``count`` episodes in one round trip and return their ids, in order."""
        return list(await self._call("start_episodes", count, agent_id))

    async def end_episode(
        self, episode_id: int, status: str = "terminated", final_observation: Any = None
    ) -> None:
        """End an episode: ``terminated`` (or ``COMPLETED``) or ``truncated``."""
        await self._call("end_episode", episode_id, status, final_observation)

    async def end_episodes(
        self,
        episode_ids: Sequence[int],
        statuses: str | Sequence[str] = "terminated",
        final_observations: Any = None,
    ) -> None:
        """End several episodes in one round trip (all of them or none, as the buffer's call);
        the arguments go to the actor as given, where the buffer checks them."""
        await self._call("end_episodes", episode_ids, statuses, final_observations)

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
        """``batch_size`` n-step transitions, delivered on this handle's device."""
        return await self._call(
            "sample_n_step", batch_size, n, gamma, replace=replace, layout=layout
        )

    async def sample_sequences(
        self,
        batch_size: int,
        seq_len: int,
        *,
        strict: bool = True,
        layout: str | None = None,
        burn_in: int = 0,
    ) -> TensorDict:
        """``[batch_size, burn_in + seq_len]`` runs of steps, delivered on this handle's
        device (see :meth:`SyncEpisodeReplayBuffer.sample_sequences`)."""
        return await self._call(
            "sample_sequences", batch_size, seq_len, strict=strict, layout=layout, burn_in=burn_in
        )

    async def get_episode(self, episode_id: int, *, layout: str | None = None) -> TensorDict:
        """One whole stored episode, time-major."""
        return await self._call("get_episode", episode_id, layout=layout)

    async def sample_episodes(
        self, k: int, *, replace: bool = False, layout: str | None = None
    ) -> list[TensorDict]:
        """``k`` whole episodes drawn uniformly."""
        return await self._call("sample_episodes", k, replace=replace, layout=layout)

    async def iterate_epochs(
        self,
        batch_size: int,
        n_epochs: int = 1,
        *,
        n: NArg = 1,
        gamma: float = 0.99,
        shuffle: bool = True,
        drop_last: bool = False,
        layout: str | None = None,
    ) -> AsyncIterator[TensorDict]:
        """``async for`` n-step epoch batches; the next one is fetched while the caller works.

        The iterator lives in the actor (semantics of ``EpisodeReplayBuffer.iterate_epochs``);
        leaving the loop early tells the actor to drop it.
        """
        what = "iterate_epochs"
        self._check_usable(what)
        options: dict[str, Any] = {"n": n, "gamma": gamma, "shuffle": shuffle}
        options.update(drop_last=drop_last, layout=layout)
        ref = self._actor.epochs_open.remote(batch_size, n_epochs, **options)
        token = await self._await(what, ref)
        pending = None
        try:
            pending = self._actor.epochs_next.remote(token)
            while True:
                packed = await self._await(what, pending)
                if packed is None:
                    pending = None
                    return
                self._check_usable(what)
                pending = self._actor.epochs_next.remote(token)  # overlaps the caller's work
                yield unpack_batch(packed, self._device)
        finally:
            if pending is not None and not self._closed and ray.is_initialized():
                with contextlib.suppress(Exception):  # the actor or Ray is gone: nothing to drop
                    self._actor.epochs_close.remote(token)  # not awaited: may run in a finalizer

    async def update_priorities(self, index: Any, priority: Any) -> int:
        """Set sampled steps' priorities (by a batch's ``index``); returns how many applied."""
        return await self._call("update_priorities", index, priority)

    async def set_beta(self, beta: float) -> None:
        """Change the importance-weight exponent of a prioritized buffer."""
        await self._call("set_beta", beta)

    async def stats(self) -> dict[str, Any]:
        """The remote buffer's counters (``valid_steps`` is its ``len``)."""
        return await self._call("stats")

    async def wait_for_steps(self, min_steps: int) -> None:
        """Return once the remote buffer holds at least ``min_steps`` valid steps."""
        await self._call("wait_for_steps", min_steps)

    # ----------------------------------------------------------------- lifecycle
    async def clear(self) -> None:
        """Drop every episode (ids keep counting)."""
        await self._call("clear")

    async def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Checkpoint the buffer from inside the actor: ``directory`` is on the actor's node."""
        return await self._call(
            "save_checkpoint", None if directory is None else str(directory), durable=durable
        )

    async def save(self, path: str | os.PathLike) -> None:
        """Write the remote buffer's metadata to ``path + ".metadata"`` on the actor's node."""
        await self._call("save", str(path))

    async def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Read and check metadata at ``path`` on the actor's node."""
        return await self._call("load", str(path))

    async def close(self) -> None:
        """Close the buffer (its files are removed) and end the actor, for every handle.

        Idempotent; after it, any method raises :class:`BufferClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return  # the cluster went away with Ray: nothing is left to shut down
        try:
            await self._actor.shutdown.remote()
        except RayActorError:
            pass  # already dead: nothing to close
        finally:
            ray.kill(self._actor, no_restart=True)

    async def __aenter__(self) -> RemoteEpisodeReplayBuffer:
        """``async with``: :meth:`close` on exit."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the buffer and end its actor."""
        await self.close()
