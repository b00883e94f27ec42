"""stable-baselines3: ``SB3ReplayBuffer``, a ``replay_buffer_class`` for DQN, SAC, TD3 and DDPG.

Pass it as ``DQN(..., replay_buffer_class=SB3ReplayBuffer)``; options go in
``replay_buffer_kwargs``. SB3 calls ``add(obs, next_obs, action, reward, done, infos)`` once
per vectorized step and ``sample(batch_size, env)`` per gradient step, and gets the same
``ReplayBufferSamples`` (shapes, dtypes, device) as from its own ``ReplayBuffer`` (or, with
``n_steps > 1``, its ``NStepReplayBuffer``).

How SB3's calls map onto episodes. Each environment index has one episode in progress in a
:class:`replaybuf.SyncEpisodeReplayBuffer`; ``add`` appends ``(obs[i], action[i], reward[i])``
to it, and when ``done[i]`` ends it with ``final_observation=next_obs[i]`` (SB3 puts the real
terminal observation there) as ``truncated`` if ``infos[i]["TimeLimit.truncated"]`` and
``handle_timeout_termination``, else ``terminated``. Each observation is stored once: step t's
next observation is the row of step t+1, so ``next_obs`` is not stored again (only final
observations take a row of their own).

A step's next observation only exists in storage once the next ``add`` appends it, so the latest
transition of each environment is held aside (``n_envs`` transitions, a few rows of RAM) and
sampled from there: ``sample`` draws uniformly over exactly the transitions SB3's buffer would
hold, newest included. If ``obs[i]`` is not (bit for bit) the ``next_obs[i]`` of the previous
``add`` without a ``done`` in between (a reset between two ``learn`` calls, a wrapper that edits
observations), the episode is ended as ``truncated`` at that ``next_obs`` and a new one begins,
so every transition comes back exactly as it was added.

Differences from SB3's ``ReplayBuffer``, all documented on :class:`SB3ReplayBuffer`: eviction
removes whole oldest episodes rather than single oldest rows of a ring; ``optimize_memory_usage``
is refused (never needed: next observations are never copied); there are no
``observations``/``actions``/... arrays to read. ``model.save_replay_buffer`` and
``load_replay_buffer`` work: the adapter pickles as plain data (its rows copied out of storage)
and is rebuilt on load with storage of its own.

Modules: :mod:`~replaybuf.integrations.sb3.buffer` (the adapter class),
:mod:`~replaybuf.integrations.sb3.checks` (its arguments' checks),
:mod:`~replaybuf.integrations.sb3.fastadd` (``add``'s fast path for exact numpy arguments),
:mod:`~replaybuf.integrations.sb3.held` (the held-aside newest transitions),
:mod:`~replaybuf.integrations.sb3.pickling` (what it pickles as, and how it is rebuilt),
:mod:`~replaybuf.integrations.sb3.samples` (a sample's fields),
:mod:`~replaybuf.integrations.sb3.staged` (one env's steps ``add`` has not handed over yet).

Needs the ``sb3`` extra: ``pip install 'replaybuf[sb3]'``.
"""

# Checked here, before any submodule: the error names the extra, also where a submodule is
# already imported.
try:
    import gymnasium  # noqa: F401
    import stable_baselines3  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "replaybuf.integrations.sb3 needs stable-baselines3: pip install 'replaybuf[sb3]'"
    ) from exc

from replaybuf.integrations.sb3.buffer import SB3ReplayBuffer

__all__ = ["SB3ReplayBuffer"]
