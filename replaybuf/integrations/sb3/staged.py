"""Steps of a one-environment adapter's episode in progress that ``add`` has not handed to the
episode buffer yet.

``add``'s fast path (:mod:`~replaybuf.integrations.sb3.fastadd`) with ``n_envs == 1`` writes
each step's observation, action and reward into these arrays (row assignments, no call into
the episode buffer) and hands them over in one ``append_steps`` call: before the episode ends,
when the arrays are full, and before anything reads the episode buffer (``sample``, ``size``,
``stats``, ``episode_buffer``, pickling, ``reset``, ``close``) or another path writes it.
``append_steps`` leaves what as many per-step appends leave, so nothing observable depends on
when the steps are handed over.
"""

from __future__ import annotations

import numpy as np

from replaybuf.buffers import SyncEpisodeReplayBuffer
from replaybuf.integrations.sb3.held import HeldAside

# Steps held at most: a handover's fixed cost is spread over this many adds; bounded by bytes
# for large observations.
_STEPS = 128
_BYTES = 1 << 20


class StagedSteps:
    """Up to ``capacity`` consecutive steps of one episode (``episode``), oldest first."""

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        obs_dtype: np.dtype,
        action_dim: int,
        action_dtype: np.dtype,
    ) -> None:
        """Empty arrays for as many steps as fit ``_BYTES`` (1 to ``_STEPS``)."""
        step_bytes = (
            int(np.prod(obs_shape, dtype=np.int64)) * obs_dtype.itemsize
            + action_dim * action_dtype.itemsize
            + 4
        )
        self.capacity = max(1, min(_STEPS, _BYTES // max(step_bytes, 1)))
        self.obs = np.zeros((self.capacity, *obs_shape), dtype=obs_dtype)
        self.action = np.zeros((self.capacity, action_dim), dtype=action_dtype)
        self.reward = np.zeros(self.capacity, dtype=np.float32)
        self.count = 0
        self.episode = -1  # the episode the staged steps belong to (set at its start)
        # The row holding the held-aside transition's obs, action and reward, and the bytes of
        # its next observation, not yet copied into the held-aside arrays (-1 and None: they
        # are there).
        self.held_at = -1
        self.next_obs: bytes | None = None

    def hand_over(self, buffer: SyncEpisodeReplayBuffer, held: HeldAside) -> None:
        """Copy the held-aside transition (its staged row, its next observation's bytes) into
        ``held``, then append the staged steps to their episode; on an error they stay staged
        (the episode buffer appends none of them then)."""
        at = self.held_at
        if at >= 0:
            held.obs[0] = self.obs[at]
            held.action[0] = self.action[at]
            held.reward[0] = self.reward[at]
            next_obs = held.next_obs
            assert self.next_obs is not None  # kept with held_at
            next_obs[0] = np.frombuffer(self.next_obs, next_obs.dtype).reshape(next_obs.shape[1:])
            self.held_at, self.next_obs = -1, None
        count = self.count
        if count == 1:
            # One step: the per-step append (fewer checks than a run of steps).
            buffer.append_observation_action_reward(
                self.episode, self.obs[0], self.action[0], self.reward[0, ...]
            )
        elif count:
            buffer.append_steps(
                self.episode, self.obs[:count], self.action[:count], self.reward[:count]
            )
        self.count = 0
