"""The episode buffer as a Ray async actor, for collectors and a learner on many processes or nodes.

:class:`RemoteEpisodeReplayBuffer` is a thin, picklable client: pass it to collector actors (or
look the actor up by name on another node) and ``await`` the same methods as on
:class:`replaybuf.EpisodeReplayBuffer`. The actor runs one ``EpisodeReplayBuffer`` in its event
loop, so its asyncio semantics (each call atomic, a checkpoint is a snapshot of one instant)
hold across processes.

Transport: a tensor never goes through ``torch``'s pickler (which copies each storage into a
bytes object). A sampled TensorDict leaves the actor as a :class:`PackedBatch`, a flat tuple of
``(key, numpy array)`` leaves; Ray serializes numpy arrays out of band, so a large batch is one
object in the shared-memory object store, written once and mapped by a reader on the same node.
The client rebuilds the TensorDict on its own ``device`` (one copy, so the tensors it returns
are writable and owned by the caller). Tensors passed to ``append_*`` travel the same way.

Modules: :mod:`~replaybuf.integrations.ray.packing` (tensors and batches in transit),
:mod:`~replaybuf.integrations.ray.portable` (errors that reach the client as their own class),
:mod:`~replaybuf.integrations.ray.actor` (the buffer in the actor),
:mod:`~replaybuf.integrations.ray.remote` (the client handle); the sharded buffer
(:class:`ShardedEpisodeReplayBuffer`, K actors sampled as one):
:mod:`~replaybuf.integrations.ray.sharded` (the handle's reads, create and open),
:mod:`~replaybuf.integrations.ray.shard_base` (its calls, writes and lifecycle),
:mod:`~replaybuf.integrations.ray.shard_actor` (a shard),
:mod:`~replaybuf.integrations.ray.shard_routing` (ids and splits),
:mod:`~replaybuf.integrations.ray.shard_epochs` (epochs),
:mod:`~replaybuf.integrations.ray.shard_manifest` (its checkpoints),
:mod:`~replaybuf.integrations.ray.shard_calls` (errors).

Needs the ``ray`` extra: ``pip install 'replaybuf[ray]'``.
"""

# Checked here, before any submodule: the error names the extra, also where a submodule is
# already imported.
try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("replaybuf.integrations.ray needs Ray: pip install 'replaybuf[ray]'") from exc

from replaybuf.integrations.ray.packing import PackedArray, PackedBatch, pack_batch, unpack_batch
from replaybuf.integrations.ray.remote import RemoteEpisodeReplayBuffer
from replaybuf.integrations.ray.shard_calls import ShardUnavailableError
from replaybuf.integrations.ray.sharded import ShardedEpisodeReplayBuffer

__all__ = [
    "PackedArray",
    "PackedBatch",
    "RemoteEpisodeReplayBuffer",
    "ShardUnavailableError",
    "ShardedEpisodeReplayBuffer",
    "pack_batch",
    "unpack_batch",
]
