"""The Ray actor side: one EpisodeReplayBuffer in an async actor's event loop.

Every method runs in the actor's loop, so the buffer's asyncio semantics (each call atomic, a
checkpoint a snapshot of one instant) hold for every client. Arguments arrive packed
(:mod:`replaybuf.integrations.ray.packing`) and TensorDicts leave packed; errors leave through
:func:`~replaybuf.integrations.ray.portable.portable_errors`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

import ray
from tensordict import TensorDict

from replaybuf.buffers import EpisodeReplayBuffer
from replaybuf.errors import BufferClosedError
from replaybuf.integrations.ray.packing import PackedBatch, pack_batch, pack_result, unpack_value
from replaybuf.integrations.ray.portable import portable_errors

# The EpisodeReplayBuffer coroutines a client may call through ``_BufferActor.call``.
_CALLS = frozenset(
    {
        "start_episode",
        "append_observation_action_reward",
        "append_batch",
        "append_steps",
        "end_episode",
        "start_episodes",
        "end_episodes",
        "sample_n_step",
        "sample_sequences",
        "get_episode",
        "sample_episodes",
        "update_priorities",
        "set_beta",
        "stats",
        "wait_for_steps",
        "clear",
        "save_checkpoint",
        "save",
        "load",
    }
)


@dataclass
class _Epoch:
    """An epoch iterator kept in the actor between a client's ``epochs_next`` calls."""

    batches: AsyncGenerator[TensorDict, None]
    lock: asyncio.Lock


class _BufferActor:
    """One EpisodeReplayBuffer in a Ray async actor; every method runs in the actor's loop."""

    def __init__(self) -> None:
        self._buffer: EpisodeReplayBuffer | None = None
        self._epochs: dict[int, _Epoch] = {}
        self._tokens = itertools.count()

    def _live(self) -> EpisodeReplayBuffer:
        """The buffer, or BufferClosedError once :meth:`shutdown` ran."""
        if self._buffer is None:
            raise BufferClosedError("the buffer is closed")
        return self._buffer

    async def open(self, directory: str | None, kwargs: dict[str, Any]) -> None:
        """Build the buffer here, not in ``__init__``, so a bad argument returns as itself."""
        with portable_errors():
            if directory is None:
                self._buffer = EpisodeReplayBuffer(**kwargs)
            else:
                self._buffer = await EpisodeReplayBuffer.open(directory, **kwargs)

    async def call(self, request: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
        """Run ``(method, args, kwargs)`` on the buffer; TensorDicts come back packed.

        One argument, not several: Ray serializes each argument of a call on its own.
        """
        method, args, kwargs = request
        if method not in _CALLS:
            raise AttributeError(f"the Ray buffer actor has no method {method!r}")
        buffer = self._live()
        args = tuple(unpack_value(a) for a in args)
        kwargs = {k: unpack_value(v) for k, v in kwargs.items()}
        with portable_errors():
            return pack_result(await getattr(buffer, method)(*args, **kwargs))

    async def epochs_open(self, batch_size: int, n_epochs: int, **kwargs: Any) -> int:
        """Start an epoch iterator and return its token for ``epochs_next``."""
        batches = self._live().iterate_epochs(batch_size, n_epochs, **kwargs)  # checks on 1st next
        token = next(self._tokens)
        # An async generator (closed with aclose), though annotated as an async iterator.
        self._epochs[token] = _Epoch(
            cast("AsyncGenerator[TensorDict, None]", batches), asyncio.Lock()
        )
        return token

    async def epochs_next(self, token: int) -> PackedBatch | None:
        """The iterator's next batch, packed; None once it is exhausted or closed."""
        epoch = self._epochs.get(token)
        if epoch is None:
            self._live()  # closed buffer: say so rather than end the iteration quietly
            return None
        async with epoch.lock:
            if token not in self._epochs:
                return None
            try:
                with portable_errors():
                    batch = await anext(epoch.batches)
            except StopAsyncIteration:
                self._epochs.pop(token, None)
                return None
            except BaseException:
                self._epochs.pop(token, None)
                await epoch.batches.aclose()
                raise
        return pack_batch(batch)

    async def epochs_close(self, token: int) -> None:
        """Drop an epoch iterator the client stopped using."""
        epoch = self._epochs.pop(token, None)
        if epoch is not None:
            async with epoch.lock:
                await epoch.batches.aclose()

    async def shutdown(self) -> None:
        """Close every epoch iterator and the buffer (after a checkpoint in flight is written)."""
        epochs, self._epochs = self._epochs, {}
        for token in list(epochs):
            epoch = epochs[token]
            async with epoch.lock:
                await epoch.batches.aclose()
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            await buffer.close()


RemoteBufferActor = ray.remote(_BufferActor)
