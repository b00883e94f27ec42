"""ARES's episode replay buffer API over replaybuf: code written for ARES runs unchanged.

ARES (an LLM-agent framework) keeps episodes of any JSON-like observations and actions, with
string ids, and samples n-step windows as frozen :class:`ReplaySample` records. Here every
step is stored in a :class:`~replaybuf.SyncEpisodeReplayBuffer` (observations and actions as
JSON-like fields, never pickled) and every sample comes from its ``sample_n_step``.

Where ARES's own behaviour is a bug, replaybuf's stands:

* an n-step window may end at an in-progress episode's last observation (ARES raises
  ``IndexError`` there);
* ``total_steps`` counts the steps stored, also after an in-progress episode is evicted;
* an episode longer than ``max_steps`` is refused with an error when its step cannot fit,
  instead of evicting itself.

Values come back in their JSON form: tuples and numpy arrays as lists, numpy numbers as Python
numbers. ``max_steps=None`` lets the storage grow (doubling, each step copied a bounded number
of times on average) until the memory preflight refuses.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import NonTensorData

from replaybuf.buffers import SyncEpisodeReplayBuffer
from replaybuf.core import compute_discounted_return
from replaybuf.errors import ArgumentError, EmptyBufferError, EpisodeStateError

_FIRST_STEPS = 1024  # the storage of a buffer with max_steps=None, to begin with
_SPEC = {"observation": "json", "action": "json"}


class EpisodeStatus(enum.Enum):
    """How an episode stands: ARES's statuses."""

    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    TRUNCATED = "TRUNCATED"


@dataclass(frozen=True)
class ReplaySample:
    """One n-step window: ``obs_t``, ``action_t``, the rewards after it and where it ends."""

    episode_id: str
    agent_id: str
    obs_t: Any
    action_t: Any
    rewards_seq: list[float]
    next_obs: Any  # the observation after the window (a terminated episode's final one too)
    terminal: bool  # the window reached a terminated episode's end
    next_discount: float  # gamma ** actual_n, 0 when terminal
    discount_powers: list[float]  # gamma ** k for each reward
    start_step: int
    actual_n: int
    gamma: float

    @property
    def reward(self) -> float:
        """The window's discounted return, ``sum(gamma ** k * r_k)``."""
        return float(compute_discounted_return(self.rewards_seq, self.gamma))


@dataclass
class _Entry:
    """A live episode: its id in the replaybuf buffer, its agent, whether it ended."""

    number: int
    agent_id: str
    finished: bool = False


class EpisodeReplayBuffer:
    """ARES's asyncio episode replay buffer, stored in replaybuf."""

    def __init__(self, max_episodes: int | None = None, max_steps: int | None = None) -> None:
        self.max_episodes = max_episodes
        self.max_steps = max_steps
        self._lock = asyncio.Lock()
        self._buffer = self._new_buffer(max_steps or _FIRST_STEPS)
        self._entries: dict[str, _Entry] = {}  # in start order
        self._ids: dict[int, str] = {}  # replaybuf id -> ARES id

    def _new_buffer(self, steps: int) -> SyncEpisodeReplayBuffer:
        # A final-observation row for every episode that can hold a step: without a cap of
        # its own, replaybuf would evict short episodes when those rows run out, before
        # max_steps (ARES evicts only past max_steps or max_episodes).
        episodes = self.max_episodes if self.max_episodes is not None else steps
        return SyncEpisodeReplayBuffer(steps, episodes, storage="tensor", spec=_SPEC)

    # ----------------------------------------------------------------- lifecycle
    async def start_episode(self, agent_id: str) -> str:
        """Start an episode for ``agent_id``; returns its id (a uuid string)."""
        async with self._lock:
            if self.max_steps is None:
                self._grow_if_full()
            number = self._buffer.start_episode(str(agent_id))
            episode_id = str(uuid.uuid4())
            self._entries[episode_id] = _Entry(number, str(agent_id))
            self._ids[number] = episode_id
            self._forget_evicted()
            return episode_id

    async def append_observation_action_reward(
        self, episode_id: str, observation: Any, action: Any, reward: float
    ) -> None:
        """Record one step of a running episode."""
        async with self._lock:
            entry = self._entry(episode_id)
            if entry.finished:
                raise EpisodeStateError(f"Cannot append to finished episode {episode_id}")
            if self.max_steps is None:
                self._grow_if_full()
            self._buffer.append_observation_action_reward(
                entry.number, observation, action, float(reward)
            )
            self._forget_evicted()

    async def end_episode(
        self,
        episode_id: str,
        status: EpisodeStatus | str = EpisodeStatus.COMPLETED,
        final_observation: Any = None,
    ) -> None:
        """End an episode as COMPLETED (terminated) or TRUNCATED, with the observation it
        ended in (None when there is none to keep, as at a terminal state)."""
        async with self._lock:
            entry = self._entry(episode_id)
            name = status.value if isinstance(status, EpisodeStatus) else str(status).upper()
            if name == EpisodeStatus.IN_PROGRESS.value:
                raise ArgumentError("Cannot end episode with status IN_PROGRESS")
            if name not in (EpisodeStatus.COMPLETED.value, EpisodeStatus.TRUNCATED.value):
                raise ArgumentError(f"Unknown episode status {status!r}")
            if entry.finished:
                raise EpisodeStateError(f"Episode {episode_id} is already finished")
            self._buffer.end_episode(
                entry.number,
                "terminated" if name == EpisodeStatus.COMPLETED.value else "truncated",
                NonTensorData(final_observation),  # None too: a JSON value here, not "missing"
            )
            entry.finished = True

    # ----------------------------------------------------------------- sampling
    async def sample_n_step(
        self, batch_size: int, n: int = 1, gamma: float = 0.99
    ) -> list[ReplaySample]:
        """Up to ``batch_size`` distinct n-step windows, uniform over the valid steps
        (``[]`` when there is none)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ArgumentError(f"n must be >= 1, got {n!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1:
            raise ArgumentError(f"gamma must be in (0, 1], got {gamma!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ArgumentError(f"batch_size must be >= 1, got {batch_size!r}")
        async with self._lock:
            try:
                # No window is longer than the buffer's longest episode: a larger n (ARES
                # takes any) gives the same windows, and the buffer refuses it.
                steps = min(n, self._buffer.max_steps)
                batch = self._buffer.sample_n_step(batch_size, steps, float(gamma), replace=False)
            except EmptyBufferError:
                return []
            return self._samples(batch, float(gamma))

    def _samples(self, batch: Any, gamma: float) -> list[ReplaySample]:
        numbers = batch["episode_id"].tolist()
        rewards = {e: self._buffer.get_episode(e)["reward"].tolist() for e in set(numbers)}
        out = []
        starts, actual = batch["start_step"].tolist(), batch["actual_n"].tolist()
        terminal = batch["terminated"].tolist()
        observations, nexts = batch["observation"], batch["next_observation"]
        actions = batch["action"]
        for i, number in enumerate(numbers):
            start, m = starts[i], actual[i]
            out.append(
                ReplaySample(
                    episode_id=self._ids[number],
                    agent_id=self._entries[self._ids[number]].agent_id,
                    obs_t=observations[i],
                    action_t=actions[i],
                    rewards_seq=rewards[number][start : start + m],
                    next_obs=nexts[i],
                    terminal=bool(terminal[i]),
                    next_discount=0.0 if terminal[i] else gamma**m,
                    discount_powers=[gamma**k for k in range(m)],
                    start_step=start,
                    actual_n=m,
                    gamma=gamma,
                )
            )
        return out

    # ----------------------------------------------------------------- the rest
    async def get_stats(self) -> dict[str, int]:
        """Counts: episodes, in progress, completed (ended either way), steps, agents."""
        async with self._lock:
            stats = self._buffer.stats()
            return {
                "total_episodes": stats["episodes"],
                "in_progress": stats["in_progress"],
                "completed": stats["terminated"] + stats["truncated"],
                "total_steps": stats["steps"],
                "num_agents": len(stats["agents"]),
            }

    async def clear(self) -> None:
        """Drop every episode."""
        async with self._lock:
            self._buffer.clear()
            self._entries.clear()
            self._ids.clear()

    def close(self) -> None:
        """Release the storage (not in ARES's API: its buffer holds Python lists)."""
        self._buffer.close()

    # ----------------------------------------------------------------- bookkeeping
    def _entry(self, episode_id: str) -> _Entry:
        entry = self._entries.get(episode_id) if isinstance(episode_id, str) else None
        if entry is None:
            raise EpisodeStateError(f"Episode {episode_id} not found")
        return entry

    def _forget_evicted(self) -> None:
        """Drop the ids of episodes the buffer evicted (oldest first, as ARES does)."""
        ids = self._buffer.episode_ids()
        if len(ids) == len(self._entries):
            return
        stored = set(ids)
        for episode_id in [k for k, e in self._entries.items() if e.number not in stored]:
            del self._ids[self._entries.pop(episode_id).number]

    def _grow_if_full(self) -> None:
        """With ``max_steps=None``: before a write that could make the buffer evict (its steps
        or, without ``max_episodes``, its episodes at the cap), move every episode into a
        buffer twice as large (the memory preflight refuses when that cannot fit)."""
        stats, cap = self._buffer.stats(), self._buffer.max_steps
        if stats["steps"] < cap and (self.max_episodes is not None or stats["episodes"] < cap):
            return
        bigger = self._new_buffer(2 * self._buffer.max_steps)
        try:
            numbers = {entry.number: episode_id for episode_id, entry in self._entries.items()}
            moved = {
                number: _copy_episode(self._buffer, bigger, number, self._entries[k].agent_id)
                for number, k in numbers.items()
            }
        except BaseException:
            bigger.close()
            raise
        self._buffer.close()
        self._buffer = bigger
        self._ids = {moved[number]: episode_id for number, episode_id in numbers.items()}
        for number, episode_id in numbers.items():
            self._entries[episode_id].number = moved[number]


def _copy_episode(
    source: SyncEpisodeReplayBuffer, target: SyncEpisodeReplayBuffer, e: int, agent: str
) -> int:
    """Episode ``e`` of ``source`` started, stepped and (if it ended) ended in ``target``."""
    record = source.get_episode(e)
    number = target.start_episode(agent)
    steps = int(record["length"])
    observations: Sequence[Any] = record["observation"] if steps or _ended(record) else []
    actions, rewards = record["action"], record["reward"].tolist()
    for t in range(steps):
        target.append_observation_action_reward(number, observations[t], actions[t], rewards[t])
    if _ended(record):
        status = "terminated" if bool(record["terminated"]) else "truncated"
        target.end_episode(number, status, NonTensorData(observations[steps]))
    return number


def _ended(record: Any) -> bool:
    return bool(record["terminated"]) or bool(record["truncated"])


__all__ = [
    "ArgumentError",
    "EpisodeReplayBuffer",
    "EpisodeStatus",
    "ReplaySample",
    "compute_discounted_return",
]
