"""Checkpoints, state dicts and metadata of the asyncio facade (a base class of
:class:`~replaybuf.buffers.aio.EpisodeReplayBuffer`): each one the sync core's, taken under the
facade's lock or in a worker thread so the event loop keeps running."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from replaybuf.buffers.episodes import SyncEpisodeReplayBuffer
from replaybuf.persist import episodes as episode_checkpoint
from replaybuf.persist.metadata import SavedMetadata

T = TypeVar("T")
F = TypeVar("F", bound="AsyncEpisodePersistence")  # the facade class itself


class AsyncEpisodePersistence:
    """``save_checkpoint`` / ``load_checkpoint`` / ``open``, ``state_dict`` /
    ``load_state_dict`` and ``save`` / ``load`` of the asyncio facade."""

    # What the facade provides (set in EpisodeReplayBuffer._attach).
    _sync: SyncEpisodeReplayBuffer
    _lock: asyncio.Lock
    _saving: asyncio.Lock  # one checkpoint at a time
    _idle: asyncio.Event  # set while no checkpoint copies rows

    if TYPE_CHECKING:  # declared for the type checker; the facade defines them

        async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

        @classmethod
        def _wrap(cls: type[F], sync: SyncEpisodeReplayBuffer) -> F: ...

    async def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Save a snapshot of one instant while other tasks keep appending and sampling.

        Under the lock only the index state is copied and the rows are pinned (rows freed by
        eviction are not reused); the rows stream to disk in a worker thread. Writers wait only
        if every free row is pinned. If this coroutine is cancelled during the write, the
        write still completes (it publishes atomically, or not at all on error).
        """
        async with self._saving:
            await asyncio.sleep(0)
            async with self._lock:
                target, snap = self._sync.begin_checkpoint(directory)
            self._idle.clear()
            write = asyncio.ensure_future(
                asyncio.to_thread(episode_checkpoint.write, target, snap, durable)
            )
            try:
                return await asyncio.shield(write)
            finally:
                if not write.done():  # cancelled: the thread goes on; keep rows pinned till then
                    await asyncio.wait([write])
                self._sync.end_checkpoint()
                self._idle.set()

    @classmethod
    async def load_checkpoint(cls: type[F], directory: str | os.PathLike, **overrides: Any) -> F:
        """A new buffer holding the checkpoint at ``directory`` (loaded in a worker thread)."""
        sync = await asyncio.to_thread(
            SyncEpisodeReplayBuffer.load_checkpoint, directory, **overrides
        )
        return cls._wrap(sync)

    @classmethod
    async def open(cls: type[F], directory: str | os.PathLike, **kwargs: Any) -> F:
        """Load the checkpoint at ``directory``, else create one with ``kwargs``; a later
        ``save_checkpoint()`` with no argument writes there."""
        sync = await asyncio.to_thread(SyncEpisodeReplayBuffer.open, directory, **kwargs)
        return cls._wrap(sync)

    async def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """See :meth:`SyncEpisodeReplayBuffer.state_dict` (taken under the lock: one instant)."""
        return await self._call(self._sync.state_dict, copy=copy)

    async def load_state_dict(self, state: Any) -> None:
        """See :meth:`SyncEpisodeReplayBuffer.load_state_dict`; waits for a checkpoint in flight
        (its pinned rows belong to the storage the state replaces)."""
        async with self._saving:
            await self._idle.wait()
            await self._call(self._sync.load_state_dict, state)

    async def save(self, path: str | os.PathLike) -> SavedMetadata:
        """Metadata only, not the episodes: see :meth:`SyncEpisodeReplayBuffer.save`
        (:meth:`save_checkpoint` saves the contents)."""
        return await self._call(self._sync.save, path)

    async def load(self, path: str | os.PathLike) -> dict[str, Any]:
        return await self._call(self._sync.load, path)
