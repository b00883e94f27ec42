"""``EpisodeReplayBuffer``: the asyncio facade over :class:`SyncEpisodeReplayBuffer`.

Each coroutine first yields once to the event loop (a cancellation point), then runs its
synchronous core call to completion under one lock, with no ``await`` inside. So under
cancellation an operation either completes or never started, and concurrent tasks (collectors,
learners, stats readers) never observe a half-applied write. The per-step writes (start,
append, end) yield once every ``WRITE_BUDGET`` calls instead (a cooperative budget): a yield
costs more than an append, and a call that does not yield runs at once and completes.

The ``*_nowait`` appends (anyio's ``send_nowait`` shape) run the core call at once in the
caller's task, never yielding. They are safe beside the coroutines because no task ever holds
the lock across an ``await``. A collector loop that uses them must still await something (its
environment, a sleep) to let other tasks run.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict

from replaybuf.args import NArg, check_min_steps
from replaybuf.buffers.aio_state import AsyncEpisodePersistence
from replaybuf.buffers.dataset import ReplayDataset
from replaybuf.buffers.episodes import SyncEpisodeReplayBuffer
from replaybuf.episodes import RowsPinned
from replaybuf.errors import BufferClosedError

T = TypeVar("T")
_RETRY: Any = object()  # a call refused by RowsPinned, to run again
# Per-step writes between two yields to the event loop (see EpisodeReplayBuffer._write).
WRITE_BUDGET = 16


class EpisodeReplayBuffer(AsyncEpisodePersistence):
    """Many asyncio tasks write episodes while others sample from the same buffer.

    Takes the arguments of :class:`SyncEpisodeReplayBuffer`. ``len(buf)`` (valid steps) is the
    one plain call; everything else is awaited.
    """

    def __init__(
        self,
        max_steps: int,
        max_episodes: int | None = None,
        *,
        device: torch.device | str = "cpu",
        storing_device: torch.device | str = "cpu",
        storage: str = "auto",
        scratch_dir: str | os.PathLike | None = None,
        seed: int | None = None,
        min_steps: int = 0,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        priority_backend: str = "auto",
        frame_stack: int | None = None,
        frame_stack_padding: str = "reset",
        layout: str = "replaybuf",
        spec: Any = None,
        ragged: str = "nested",
    ) -> None:
        self._attach(
            SyncEpisodeReplayBuffer(
                max_steps,
                max_episodes,
                device=device,
                storing_device=storing_device,
                storage=storage,
                scratch_dir=scratch_dir,
                seed=seed,
                min_steps=min_steps,
                prioritized=prioritized,
                alpha=alpha,
                beta=beta,
                eps=eps,
                priority_backend=priority_backend,
                frame_stack=frame_stack,
                frame_stack_padding=frame_stack_padding,
                layout=layout,
                spec=spec,
                ragged=ragged,
            )
        )

    def _attach(self, sync: SyncEpisodeReplayBuffer) -> None:
        self._sync = sync
        self._lock = asyncio.Lock()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._budget = WRITE_BUDGET  # per-step writes left before the next yield
        self._saving = asyncio.Lock()  # one checkpoint at a time
        self._idle = asyncio.Event()  # set while no checkpoint copies rows
        self._idle.set()

    @classmethod
    def _wrap(cls, sync: SyncEpisodeReplayBuffer) -> EpisodeReplayBuffer:
        buffer = cls.__new__(cls)
        buffer._attach(sync)
        return buffer

    @property
    def sync(self) -> SyncEpisodeReplayBuffer:
        """The synchronous core (for code that holds no event loop; not for concurrent use)."""
        return self._sync

    @property
    def frame_stack(self) -> int | None:
        """Frames per returned observation stack (None: observations as stored)."""
        return self._sync.frame_stack

    @property
    def frame_stack_padding(self) -> str:
        """Frames before an episode's first: ``"reset"`` (the first again) or ``"zero"``."""
        return self._sync.frame_stack_padding

    @property
    def memory(self):
        return self._sync.memory

    def __len__(self) -> int:
        return len(self._sync)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        await asyncio.sleep(0)  # cancellation point: nothing has changed yet
        while True:
            async with self._lock:
                try:
                    result = fn(*args, **kwargs)  # synchronous and atomic: no await inside
                except RowsPinned:
                    result = _RETRY  # refused before changing anything
            if result is not _RETRY:
                self._wake_waiters()
                return result
            await self._idle.wait()  # every free row is pinned: retry once the checkpoint ends

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_call` for the per-step writes (start, append, end), yielding to the event
        loop once every ``WRITE_BUDGET`` calls instead of every call.

        A yield costs more than an append (a turn of the event loop), so a collector that
        awaits one append per step spent most of its time there. Like a cooperative budget
        (tokio's), other tasks still run at least every ``WRITE_BUDGET`` writes; a call that
        does not yield runs at once, under no lock (none is ever held across an ``await``),
        and completes: under cancellation it either completed or never started, as before.
        """
        self._budget -= 1
        result = _RETRY
        if self._budget > 0 and not self._lock.locked():
            try:
                result = fn(*args)  # synchronous and atomic, as under the lock
            except RowsPinned:
                result = _RETRY  # refused before changing anything: wait in _call
        if result is not _RETRY:
            self._wake_waiters()
            return result
        self._budget = WRITE_BUDGET
        return await self._call(fn, *args)

    def _wake_waiters(self) -> None:
        if not self._waiters:
            return
        have = len(self._sync)
        keep = []
        for need, future in self._waiters:
            if future.done():
                continue
            if have >= need:
                future.set_result(None)
            else:
                keep.append((need, future))
        self._waiters = keep

    # ----------------------------------------------------------------- writes
    async def start_episode(self, agent_id: str = "default") -> int:
        return await self._write(self._sync.start_episode, agent_id)

    async def append_observation_action_reward(
        self,
        episode_id: int,
        observation: Any,
        action: Any,
        reward: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        await self._write(
            self._sync.append_observation_action_reward,
            episode_id,
            observation,
            action,
            reward,
            extras,
        )

    def append_observation_action_reward_nowait(
        self,
        episode_id: int,
        observation: Any,
        action: Any,
        reward: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """:meth:`append_observation_action_reward` now, without yielding (see the module doc).

        Raises :class:`~replaybuf.episodes.core.RowsPinned` where the coroutine would wait: every
        free row pinned by a checkpoint in flight (nothing is changed then).
        """
        self._sync.append_observation_action_reward(episode_id, observation, action, reward, extras)
        self._wake_waiters()

    def append_batch_nowait(
        self,
        episode_ids: Sequence[int],
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """:meth:`append_batch` now, without yielding; raises ``RowsPinned`` where it would wait."""
        self._sync.append_batch(episode_ids, observations, actions, rewards, extras)
        self._wake_waiters()

    async def append_batch(
        self,
        episode_ids: Sequence[int],
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        await self._write(
            self._sync.append_batch, episode_ids, observations, actions, rewards, extras
        )

    async def append_steps(
        self,
        episode_id: int,
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Several consecutive steps of one episode in one call (see
        :meth:`SyncEpisodeReplayBuffer.append_steps`): under cancellation, all or none."""
        await self._write(
            self._sync.append_steps, episode_id, observations, actions, rewards, extras
        )

    async def end_episode(
        self, episode_id: int, status: str = "terminated", final_observation: Any = None
    ) -> None:
        await self._write(self._sync.end_episode, episode_id, status, final_observation)

    async def start_episodes(self, count: int, agent_id: str = "default") -> list[int]:
        """Start ``count`` episodes at once (see :meth:`SyncEpisodeReplayBuffer.start_episodes`)."""
        return await self._write(self._sync.start_episodes, count, agent_id)

    async def end_episodes(
        self,
        episode_ids: Sequence[int],
        statuses: str | Sequence[str] = "terminated",
        final_observations: Any = None,
    ) -> None:
        """End several episodes at once (see :meth:`SyncEpisodeReplayBuffer.end_episodes`):
        under cancellation, all of them ended or none."""
        await self._write(self._sync.end_episodes, episode_ids, statuses, final_observations)

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
        return await self._call(
            self._sync.sample_n_step, batch_size, n, gamma, replace=replace, layout=layout
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
        return await self._call(
            self._sync.sample_sequences,
            batch_size,
            seq_len,
            strict=strict,
            layout=layout,
            burn_in=burn_in,
        )

    async def get_episode(self, episode_id: int, *, layout: str | None = None) -> TensorDict:
        return await self._call(self._sync.get_episode, episode_id, layout=layout)

    async def sample_episodes(
        self, k: int, *, replace: bool = False, layout: str | None = None
    ) -> list[TensorDict]:
        return await self._call(self._sync.sample_episodes, k, replace=replace, layout=layout)

    async def update_priorities(self, index: Any, priority: Any) -> int:
        """See :meth:`SyncEpisodeReplayBuffer.update_priorities`."""
        return await self._call(self._sync.update_priorities, index, priority)

    async def set_beta(self, beta: float) -> None:
        await self._call(self._sync.set_beta, beta)

    async def stats(self) -> dict[str, Any]:
        return await self._call(self._sync.stats)

    async def episode_ids(self) -> list[int]:
        return await self._call(self._sync.episode_ids)

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
        prefetch: int = 0,
    ) -> AsyncIterator[TensorDict]:
        """Async n-step epoch batches; the next batch is prepared while the caller works.

        Each batch is built under the lock, so writers interleave between batches; semantics
        are those of :meth:`SyncEpisodeReplayBuffer.iterate_epochs`. ``prefetch=k`` builds
        ``k`` batches ahead on a thread instead of on the event loop (the sync core's thread
        lock keeps each build atomic; awaiting one costs an ``asyncio.to_thread`` hop).
        """
        # A generator (closed below, when this one ends), though annotated as an iterator.
        batches = cast(
            "Generator[TensorDict, None, None]",
            await self._call(
                self._sync.iterate_epochs,
                batch_size,
                n_epochs,
                n=n,
                gamma=gamma,
                shuffle=shuffle,
                drop_last=drop_last,
                layout=layout,
                prefetch=prefetch,
            ),
        )

        async def prepare() -> TensorDict | None:
            if prefetch:  # drawn ahead by the prefetch thread: wait off the event loop
                return await asyncio.to_thread(next, batches, None)
            async with self._lock:
                return next(batches, None)

        pending = asyncio.ensure_future(prepare())
        try:
            while True:
                batch = await pending
                if batch is None:
                    return
                pending = asyncio.ensure_future(prepare())  # overlaps the caller's work
                yield batch
        finally:
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled():
                pending.exception()  # retrieved: an abandoned prefetch must not log an error
            batches.close()

    async def wait_for_steps(self, min_steps: int) -> None:
        """Return once at least ``min_steps`` valid steps are stored (no polling); more than
        ``max_steps``, which would wait forever, is refused."""
        need = check_min_steps(min_steps, self._sync.max_steps)
        self._sync._check_open()
        if len(self._sync) >= need:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((need, future))
        try:
            await future
        finally:
            self._waiters = [(n, f) for n, f in self._waiters if f is not future]

    def as_dataset(
        self,
        batch_size: int,
        *,
        n: NArg | None = None,
        seq_len: int | None = None,
        gamma: float | None = None,
        strict: bool = True,
        layout: str | None = None,
        prefetch: int = 0,
        burn_in: int = 0,
    ) -> ReplayDataset:
        """The sync buffer's :meth:`SyncEpisodeReplayBuffer.as_dataset`; iterate it on the event
        loop's thread, or while no task uses the buffer (a ``prefetch`` thread samples the sync
        core under its thread lock, as every call of this facade does)."""
        return self._sync.as_dataset(
            batch_size,
            n=n,
            seq_len=seq_len,
            gamma=gamma,
            strict=strict,
            layout=layout,
            prefetch=prefetch,
            burn_in=burn_in,
        )

    # ----------------------------------------------------------------- lifecycle
    async def clear(self) -> None:
        await self._call(self._sync.clear)

    async def close(self) -> None:
        """Close the buffer (after a checkpoint in flight is written); waiters in
        :meth:`wait_for_steps` get BufferClosedError."""
        async with self._saving:
            await self._idle.wait()
            async with self._lock:
                self._sync.close()
        waiters, self._waiters = self._waiters, []
        for _, future in waiters:
            if not future.done():
                future.set_exception(BufferClosedError("the buffer was closed while waiting"))

    async def __aenter__(self) -> EpisodeReplayBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
