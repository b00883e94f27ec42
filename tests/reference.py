"""A slow, obvious reference model of the episode buffer: plain Python lists per episode.

It knows the documented contract only (``issues show 3``), never the buffer's internals:

* step t of an episode is ``(obs_t, action_t, reward_t)``; an ended episode also has ``obs_T``;
* a step is *valid* once its next observation exists: every step of an ended episode, all but
  the newest step of one in progress;
* eviction drops whole episodes, oldest finished first (by start order), then oldest in
  progress, never one being written; if that cannot make room, the operation raises and
  nothing changes;
* ``max_steps`` bounds stored steps, ``max_episodes`` stored episodes (at ``start``) and
  ``row_capacity`` stored observations (steps plus one final-observation row per ended
  episode with steps; documented in ``SyncEpisodeReplayBuffer``'s ``final_rows_for``).

* with ``frame_stack=k`` every returned observation of step t is the list of the episode's
  frames ``t-k+1 .. t`` (stacked), where a frame before obs_0 is obs_0 again (padding
  ``"reset"``) or zeros (``"zero"``), gymnasium ``FrameStackObservation``'s two paddings.

Values are kept as the test gave them (usually torch tensors); every return and discount is
computed in float64 with plain loops.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch

TERMINATED = "terminated"
TRUNCATED = "truncated"
IN_PROGRESS = "in_progress"


@dataclass
class RefEpisode:
    episode_id: int
    agent_id: str
    observations: list[Any] = field(default_factory=list)  # obs_0 .. obs_{T-1}
    actions: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    extras: list[dict[str, Any] | None] = field(default_factory=list)
    status: str = IN_PROGRESS
    final_observation: Any = None

    @property
    def steps(self) -> int:
        return len(self.actions)

    @property
    def ended(self) -> bool:
        return self.status != IN_PROGRESS

    @property
    def valid_steps(self) -> int:
        if self.ended:
            return self.steps
        return max(self.steps - 1, 0)

    @property
    def rows(self) -> int:
        return self.steps + (1 if self.ended and self.steps else 0)

    def frame(self, t: int) -> Any:
        """obs_t as appended, the final observation when t == T of an ended episode."""
        if t < self.steps:
            return self.observations[t]
        assert self.ended, (self.episode_id, t)
        assert t == self.steps, (self.episode_id, t)
        return self.final_observation

    def observation(self, t: int, frame_stack: int | None = None, padding: str = "reset") -> Any:
        """obs_t as sampling returns it: the frame, or the stack of frames t-k+1 .. t."""
        if frame_stack is None:
            return self.frame(t)
        frames = []
        for j in range(frame_stack - 1, -1, -1):  # oldest first, obs_t last
            if t - j >= 0:
                frames.append(self.frame(t - j))
            elif padding == "reset":
                frames.append(self.frame(0))
            else:
                frames.append(_zeros_like(self.frame(0)))
        return _stack(frames)

    @property
    def stored_frames(self) -> int:
        """obs_0 .. obs_{T-1}, plus obs_T once ended."""
        return self.steps + (1 if self.ended else 0)


def _zeros_like(value: Any) -> Any:
    if isinstance(value, dict):
        return {name: _zeros_like(v) for name, v in value.items()}
    return torch.zeros_like(torch.as_tensor(value))


def _stack(values: list[Any]) -> Any:
    """Stack a list of tensors (or of dicts of them, leaf by leaf) along a new first dim."""
    if isinstance(values[0], dict):
        return {name: _stack([v[name] for v in values]) for name in values[0]}
    return torch.stack([torch.as_tensor(v) for v in values])


class ReferenceBuffer:
    """The documented episode buffer, as plain lists."""

    def __init__(
        self,
        max_steps: int,
        max_episodes: int | None = None,
        row_capacity: int | None = None,
        frame_stack: int | None = None,
        padding: str = "reset",
    ) -> None:
        self.frame_stack = frame_stack
        self.padding = padding
        self.max_steps = max_steps
        self.max_episodes = max_episodes
        self.row_capacity = row_capacity
        self.episodes: dict[int, RefEpisode] = {}  # in start order
        self.evicted_ids: list[int] = []
        self.next_id = 0

    # ----------------------------------------------------------------- counts
    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.episodes.values())

    @property
    def valid_steps(self) -> int:
        return sum(e.valid_steps for e in self.episodes.values())

    def stats(self) -> dict[str, Any]:
        agents: dict[str, int] = {}
        for e in self.episodes.values():
            agents[e.agent_id] = agents.get(e.agent_id, 0) + 1
        statuses = [e.status for e in self.episodes.values()]
        return {
            "episodes": len(self.episodes),
            "in_progress": statuses.count(IN_PROGRESS),
            "terminated": statuses.count(TERMINATED),
            "truncated": statuses.count(TRUNCATED),
            "steps": self.steps,
            "valid_steps": self.valid_steps,
            "agents": agents,
            "evicted_episodes": len(self.evicted_ids),
        }

    def valid_pairs(self) -> set[tuple[int, int]]:
        """Every (episode_id, t) that may be sampled now."""
        return {(e.episode_id, t) for e in self.episodes.values() for t in range(e.valid_steps)}

    # ----------------------------------------------------------------- eviction
    def _make_room(self, steps: int, rows: int, episodes: int, protected: set[int]) -> None:
        def over() -> list[int]:
            stored_rows = sum(e.rows for e in self.episodes.values())
            return [
                self.steps + steps - self.max_steps,
                0 if self.row_capacity is None else stored_rows + rows - self.row_capacity,
                0
                if self.max_episodes is None
                else len(self.episodes) + episodes - self.max_episodes,
            ]

        if max(over()) <= 0:
            return
        finished = [e for e in self.episodes.values() if e.ended]
        running = [e for e in self.episodes.values() if not e.ended]
        order = [e for e in finished + running if e.episode_id not in protected]
        # Decide on a copy first: if room cannot be made, nothing changes.
        kept = dict(self.episodes)
        victims = []
        for episode in order:
            if max(over()) <= 0:
                break
            if episode.rows == 0 and over()[2] <= 0:
                continue  # evicting it frees no step or row; only the episode count needs it
            victims.append(episode.episode_id)
            del self.episodes[episode.episode_id]
        if max(over()) > 0:
            self.episodes = kept
            raise ValueError("cannot make room")
        self.evicted_ids.extend(victims)

    # ----------------------------------------------------------------- writes
    def start(self, agent_id: str = "default") -> int:
        self._make_room(0, 0, 1, set())
        episode_id = self.next_id
        self.next_id += 1
        self.episodes[episode_id] = RefEpisode(episode_id, agent_id)
        return episode_id

    def append(self, episode_ids, observations, actions, rewards, extras=None) -> None:
        """One step per episode; the arguments are per-episode lists."""
        ids = list(episode_ids)
        for i in ids:
            assert i in self.episodes, i
            assert not self.episodes[i].ended, i
        self._make_room(len(ids), len(ids), 0, set(ids))
        for k, i in enumerate(ids):
            e = self.episodes[i]
            e.observations.append(observations[k])
            e.actions.append(actions[k])
            e.rewards.append(float(rewards[k]))
            e.extras.append(None if extras is None else extras[k])

    def end(self, episode_id: int, status: str, final_observation: Any) -> None:
        e = self.episodes[episode_id]
        assert not e.ended
        status = TERMINATED if status.lower() in ("terminated", "completed") else TRUNCATED
        if e.steps:
            self._make_room(0, 1, 0, {episode_id})
        e.status = status
        e.final_observation = final_observation

    def end_many(self, episode_ids: list[int], statuses: list[str], finals: list[Any]) -> None:
        """``end_episodes``: :meth:`end` for each in turn, no episode of the call evicted for
        another's final row; all or nothing (a refusal changes nothing)."""
        trial = copy.deepcopy(self)
        protected = set(episode_ids)
        for episode_id, status, final in zip(episode_ids, statuses, finals, strict=True):
            e = trial.episodes[episode_id]
            assert not e.ended
            if e.steps:
                trial._make_room(0, 1, 0, protected)
            e.status = TERMINATED if status.lower() in ("terminated", "completed") else TRUNCATED
            e.final_observation = final
        self.__dict__.update(trial.__dict__)

    # ----------------------------------------------------------------- expectations
    def observation(self, episode_id: int, t: int) -> Any:
        """obs_t of an episode as sampling returns it (stacked with frame stacking)."""
        return self.episodes[episode_id].observation(t, self.frame_stack, self.padding)

    def episode_observations(self, episode_id: int) -> list[Any]:
        """Every stored observation of an episode, as ``get_episode`` returns them."""
        e = self.episodes[episode_id]
        return [self.observation(episode_id, t) for t in range(e.stored_frames)]

    def nstep(self, episode_id: int, t: int, n: int, gamma: float) -> dict[str, Any]:
        """The n-step transition from step t, computed with plain loops in float64."""
        e = self.episodes[episode_id]
        assert 0 <= t < e.valid_steps, (episode_id, t)
        # Steps t, t+1, ... whose next observation exists.
        available = e.valid_steps - t
        m = min(n, available)
        total = 0.0
        for k in range(m):
            total += gamma**k * e.rewards[t + k]
        reaches_end = e.ended and t + m == e.steps
        terminal = reaches_end and e.status == TERMINATED
        truncated = reaches_end and e.status == TRUNCATED
        return {
            "observation": self.observation(episode_id, t),
            "action": e.actions[t],
            "extras": e.extras[t],
            "reward": total,
            "next_observation": self.observation(episode_id, t + m),
            "terminated": terminal,
            "truncated": truncated,
            "cut": m < n and not e.ended,
            "next_discount": 0.0 if terminal else math.pow(gamma, m),
            "actual_n": m,
            "start_step": t,
            "episode_id": episode_id,
        }

    def sequence(self, episode_id: int, t: int, length: int) -> list[dict[str, Any] | None]:
        """Per position k < length: the step t+k (with its next observation), or None (padding)."""
        e = self.episodes[episode_id]
        out: list[dict[str, Any] | None] = []
        for k in range(length):
            s = t + k
            if s >= e.valid_steps:
                out.append(None)
                continue
            out.append(
                {
                    "observation": self.observation(episode_id, s),
                    "action": e.actions[s],
                    "reward": e.rewards[s],
                    "extras": e.extras[s],
                    "next_observation": self.observation(episode_id, s + 1),
                    "terminated": e.status == TERMINATED and s + 1 == e.steps,
                    "truncated": e.status == TRUNCATED and s + 1 == e.steps,
                    "step": s,
                }
            )
        return out

    def sequence_starts(self, length: int) -> set[tuple[int, int]]:
        """The (episode_id, t) from which ``length`` valid steps follow."""
        return {
            (e.episode_id, t)
            for e in self.episodes.values()
            for t in range(e.valid_steps - length + 1)
        }
