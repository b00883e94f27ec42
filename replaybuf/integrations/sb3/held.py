"""Each environment's newest transition, held aside until the next ``add`` stores its next
observation.

A step's next observation only exists in episode storage once the next ``add`` appends it (as
the next step's observation), so the newest transition of each environment lives here, a few
rows of RAM, and ``sample`` draws it from here.
"""

from __future__ import annotations

import numpy as np
import torch


class HeldAside:
    """Per environment: whether it holds a transition (``pending``) and that transition's
    ``obs``, ``next_obs``, ``action`` and ``reward`` (``[n_envs, ...]`` arrays)."""

    def __init__(
        self,
        n_envs: int,
        obs_shape: tuple[int, ...],
        obs_dtype: np.dtype,
        action_dim: int,
        action_dtype: np.dtype,
    ) -> None:
        """Nothing held: every environment's slot empty."""
        self.n_envs = n_envs
        self.pending = [False] * n_envs
        self.obs = np.zeros((n_envs, *obs_shape), dtype=obs_dtype)
        self.next_obs = np.zeros((n_envs, *obs_shape), dtype=obs_dtype)
        self.action = np.zeros((n_envs, action_dim), dtype=action_dtype)
        self.reward = np.zeros(n_envs, dtype=np.float32)

    @property
    def count(self) -> int:
        """How many environments hold a transition."""
        return sum(self.pending)

    def envs(self) -> np.ndarray:
        """The environments that hold a transition, in order (int64)."""
        return np.array([i for i, p in enumerate(self.pending) if p], dtype=np.int64)

    def jumped(self, obs: np.ndarray) -> list[int]:
        """The environments whose held transition led elsewhere than ``obs[i]`` (bit for bit):
        their episode cannot continue from ``obs[i]``."""
        pending, held = self.pending, self.next_obs
        if all(pending) and _same_bits(obs, held):
            return []
        return [i for i in range(self.n_envs) if pending[i] and not _same_bits(obs[i], held[i])]

    def keep(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
    ) -> None:
        """Hold each environment's new transition, where it did not end (``done``)."""
        if not done.any():
            self.keep_all(obs, next_obs, action, reward)
        else:
            keep = ~done
            self.obs[keep] = obs[keep]
            self.next_obs[keep] = next_obs[keep]
            self.action[keep] = action[keep]
            self.reward[keep] = reward[keep]

    def keep_all(
        self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray
    ) -> None:
        """Hold every environment's new transition (none ended)."""
        self.obs[...] = obs
        self.next_obs[...] = next_obs
        self.action[...] = action
        self.reward[...] = reward

    def fields(self, envs: np.ndarray) -> dict[str, torch.Tensor]:
        """The held transitions of ``envs`` as sample fields (one step each, none done)."""
        count = envs.shape[0]
        return {
            "obs": torch.from_numpy(self.obs[envs]),
            "action": torch.from_numpy(self.action[envs]),
            "next_obs": torch.from_numpy(self.next_obs[envs]),
            "done": torch.zeros(count, dtype=torch.bool),
            "reward": torch.from_numpy(self.reward[envs]),
            "steps": torch.ones(count, dtype=torch.long),
        }


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes (NaN equals itself)."""
    return a.tobytes() == b.tobytes()
