"""Calls to one shard of a sharded buffer, with Ray's errors turned into the buffer's own.

An error raised in a shard's buffer comes back as its own class (as from the single actor);
a shard whose actor died raises :class:`ShardUnavailableError` naming the shard.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from replaybuf.errors import BufferClosedError, EpisodeStateError, ReplayBufError
from replaybuf.integrations.ray.portable import PortableError


class ShardUnavailableError(ReplayBufError, RuntimeError):
    """A shard of a sharded buffer cannot be reached: its actor died (killed, crashed, its
    node lost) or is restarting. ``shard`` is its number."""

    def __init__(self, *args: object, shard: int | None = None, argument: str | None = None):
        super().__init__(*args, argument=argument)
        self.shard = shard


def where(shard: int, num_shards: int) -> str:
    """How messages name a shard."""
    return f"shard {shard} of {num_shards}"


async def await_shard(shard: int, num_shards: int, method: str, ref: Any) -> Any:
    """Await one call on shard ``shard``; its errors as the buffer's own."""
    label = f"ShardedEpisodeReplayBuffer.{method}"
    try:
        return await ref
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # best effort: the actor may be gone already
            ray.cancel(ref)
        raise
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, PortableError):
            cause = cause.rebuild()
        if isinstance(cause, BufferClosedError):
            raise BufferClosedError(
                f"{label}: {where(shard, num_shards)} was shut down ({cause})"
            ) from error
        if isinstance(cause, Exception) and not isinstance(cause, RayTaskError):
            raise cause from error  # SchemaError, EmptyBufferError, ... as raised locally
        raise
    except ActorUnavailableError as error:
        raise ShardUnavailableError(
            f"{label}: {where(shard, num_shards)} is unavailable for now (restarting, or its "
            f"node unreachable); a retry may succeed: {error}",
            shard=shard,
        ) from error
    except RayActorError as error:
        raise ShardUnavailableError(
            f"{label}: {where(shard, num_shards)} is gone (its actor was killed, crashed or "
            f"lost its node; with max_restarts it comes back from its last checkpoint): "
            f"{type(error).__name__}",
            shard=shard,
        ) from error


def episode_error(error: EpisodeStateError, episode_id: int, shard: int, num_shards: int):
    """A shard's EpisodeStateError restated with the global id the caller passed."""
    return EpisodeStateError(
        f"episode_id {episode_id} ({where(shard, num_shards)}, local id "
        f"{episode_id // num_shards}): {error}",
        argument="episode_id",
    )
