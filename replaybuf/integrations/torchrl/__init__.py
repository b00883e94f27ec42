"""Write TorchRL collector batches into an episode buffer, episodes split on done.

A TorchRL collector (``Collector``, called ``SyncDataCollector`` before torchrl 0.14, and
``MultiSyncCollector`` / ``MultiSyncDataCollector``) yields batches in the ``("next", ...)``
layout: step t of an environment holds ``observation`` (obs_t), ``action`` (a_t) and, under
``"next"``, ``reward`` (r_t), ``done`` / ``terminated`` / ``truncated`` and ``observation``
(obs_{t+1}, the true final observation when the step ends the episode). The batch is
``[T]`` for one environment or ``[*envs, T]`` (time last) for batched envs and multi-collectors,
and ``("collector", "traj_ids")`` names each step's trajectory.

:class:`CollectorWriter` turns each trajectory into one replaybuf episode: a trajectory that
continues into the next batch continues in the same episode, and an episode ends (terminated or
truncated) with ``("next", "observation")`` of its last step as its final observation::

    from torchrl.collectors import Collector  # SyncDataCollector before torchrl 0.14
    from torchrl.envs import GymEnv, StepCounter, TransformedEnv
    from replaybuf import SyncEpisodeReplayBuffer
    from replaybuf.integrations.torchrl import CollectorWriter

    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter(max_steps=200))
    collector = Collector(env, None, frames_per_batch=256, total_frames=10_000)
    with SyncEpisodeReplayBuffer(100_000, seed=0) as buf:
        writer = CollectorWriter(buf)
        for batch in collector:
            writer.write(batch)
            if len(buf) >= 1_000:
                sample = buf.sample_n_step(256, n=3, gamma=0.99)
        writer.finish()  # episodes still running end as truncated (bootstrapped)
    collector.shutdown()

With an :class:`replaybuf.EpisodeReplayBuffer`, use ``await writer.awrite(batch)`` and
``await writer.afinish()``. Rewards and done flags of shape ``[..., 1]`` (TorchRL's layout) are
stored per step without the trailing 1. Every batch is checked whole (keys, shapes, dtypes,
the buffer's stored spec, trajectory order) before anything is written.

Modules: :mod:`~replaybuf.integrations.torchrl.writer` (the writer),
:mod:`~replaybuf.integrations.torchrl.batch` (reading and checking a batch),
:mod:`~replaybuf.integrations.torchrl.plan` (segments and write order),
:mod:`~replaybuf.integrations.torchrl.keys` (batch keys),
:mod:`~replaybuf.integrations.torchrl.drive` (running the buffer calls, sync or awaited).
"""

from replaybuf.integrations.torchrl.drive import Call
from replaybuf.integrations.torchrl.keys import Key, NestedKey
from replaybuf.integrations.torchrl.writer import STATUSES, CollectorWriter

__all__ = ["STATUSES", "Call", "CollectorWriter", "Key", "NestedKey"]
