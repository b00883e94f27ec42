"""``CollectorWriter``: TorchRL collector batches written into an episode buffer, one episode
per trajectory (see :mod:`replaybuf.integrations.torchrl`)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Hashable, Mapping
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDictBase

from replaybuf.buffers import EpisodeReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.errors import ArgumentError, ArgumentTypeError, EpisodeStateError
from replaybuf.integrations.torchrl import batch as batches
from replaybuf.integrations.torchrl.drive import Call, adrive, drive
from replaybuf.integrations.torchrl.keys import NestedKey, as_key, dotted, extras_keys
from replaybuf.integrations.torchrl.plan import (
    Open,
    Plan,
    Segment,
    append_call,
    lost_segments,
    split_segments,
)
from replaybuf.storage import to_leaves

STATUSES = ("terminated", "truncated")


class CollectorWriter:
    """Writes successive collector batches into an episode buffer, one episode per trajectory.

    Args:
        buffer: a :class:`SyncEpisodeReplayBuffer` (use :meth:`write`) or an
            :class:`EpisodeReplayBuffer` (use :meth:`awrite`).
        observation_key, action_key, reward_key: where the batch holds obs_t, a_t and r_t; the
            observation key may name a sub-TensorDict (stored as a nested observation).
        next_observation_key: obs_{t+1}; defaults to ``("next", *observation_key)``.
        done_key, terminated_key, truncated_key: the end flags; any of them may be absent
            from a batch, but not all three. A step ends its episode when any present flag is
            set; the episode is ``terminated`` when ``terminated`` is set (or when only
            ``done`` exists), else ``truncated``.
        trajectory_key: the collector's trajectory ids. Without them, each leading index of a
            ``[*envs, T]`` batch (or the whole ``[T]`` batch) is one environment's stream.
        mask_key: ``False`` marks padding steps, skipped (collectors set it when preempted).
        extras: stored name -> batch key, written with each step (e.g. ``{"log_prob":
            "sample_log_prob"}``); sampling returns them as top-level keys.
        agent_id: passed to ``start_episode``.
    """

    def __init__(
        self,
        buffer: SyncEpisodeReplayBuffer | EpisodeReplayBuffer,
        *,
        observation_key: NestedKey = "observation",
        action_key: NestedKey = "action",
        reward_key: NestedKey = ("next", "reward"),
        next_observation_key: NestedKey | None = None,
        done_key: NestedKey = ("next", "done"),
        terminated_key: NestedKey = ("next", "terminated"),
        truncated_key: NestedKey = ("next", "truncated"),
        trajectory_key: NestedKey = ("collector", "traj_ids"),
        mask_key: NestedKey = ("collector", "mask"),
        extras: Mapping[str, NestedKey] | None = None,
        agent_id: str = "torchrl",
    ) -> None:
        if not isinstance(buffer, SyncEpisodeReplayBuffer | EpisodeReplayBuffer):
            raise ArgumentTypeError(
                "buffer must be a SyncEpisodeReplayBuffer or an EpisodeReplayBuffer, "
                f"got {type(buffer).__name__}"
            )
        if not isinstance(agent_id, str):
            raise ArgumentTypeError(f"agent_id must be a str, got {type(agent_id).__name__}")
        self.buffer = buffer
        self.agent_id = agent_id
        self.observation_key = as_key(observation_key, "observation_key")
        self.action_key = as_key(action_key, "action_key")
        self.reward_key = as_key(reward_key, "reward_key")
        self.next_observation_key = (
            ("next", *self.observation_key)
            if next_observation_key is None
            else as_key(next_observation_key, "next_observation_key")
        )
        self.done_key = as_key(done_key, "done_key")
        self.terminated_key = as_key(terminated_key, "terminated_key")
        self.truncated_key = as_key(truncated_key, "truncated_key")
        self.trajectory_key = as_key(trajectory_key, "trajectory_key")
        self.mask_key = as_key(mask_key, "mask_key")
        self.extras = extras_keys(extras)
        self._open: dict[Hashable, Open] = {}

    @property
    def open_episodes(self) -> dict[Hashable, int]:
        """Trajectory (id, or ``("stream", i)`` without ids) -> episode id, still running."""
        return {trajectory: o.episode for trajectory, o in self._open.items()}

    # ----------------------------------------------------------------- public calls
    def write(self, batch: TensorDictBase) -> int:
        """Write one collector batch (sync buffer); returns the number of steps written."""
        sync = self._sync_buffer("write")
        return drive(sync, self._write(batch, "CollectorWriter.write"))

    async def awrite(self, batch: TensorDictBase) -> int:
        """:meth:`write` for an :class:`EpisodeReplayBuffer`; each buffer call is awaited."""
        aio = self._async_buffer("awrite")
        return await adrive(aio, self._write(batch, "CollectorWriter.awrite"))

    def finish(self, status: str = "truncated") -> int:
        """End every running episode (final observation: its last next observation); returns
        how many. ``truncated`` (the default) bootstraps from it, as a cut trajectory should."""
        sync = self._sync_buffer("finish")
        return drive(sync, self._finish(status))

    async def afinish(self, status: str = "truncated") -> int:
        """:meth:`finish` for an :class:`EpisodeReplayBuffer`."""
        aio = self._async_buffer("afinish")
        return await adrive(aio, self._finish(status))

    def _sync_buffer(self, method: str) -> SyncEpisodeReplayBuffer:
        if not isinstance(self.buffer, SyncEpisodeReplayBuffer):
            raise ArgumentTypeError(
                f"{method} needs a SyncEpisodeReplayBuffer, got an EpisodeReplayBuffer; "
                f"use await writer.a{method}(...)"
            )
        return self.buffer

    def _async_buffer(self, method: str) -> EpisodeReplayBuffer:
        if not isinstance(self.buffer, EpisodeReplayBuffer):
            raise ArgumentTypeError(
                f"{method} needs an EpisodeReplayBuffer, got a SyncEpisodeReplayBuffer; "
                f"use writer.{method[1:]}(...)"
            )
        return self.buffer

    # ----------------------------------------------------------------- the write
    def _write(self, batch: TensorDictBase, what: str) -> Generator[Call, Any, int]:
        """The buffer calls that write ``batch``, checked whole before the first is made."""
        plan = self._plan(batch, what)
        written = 0
        try:
            for steps in plan.rounds:
                yield from self._append(plan, steps)
                written += len(steps)
                yield from self._end(plan, steps)
        finally:  # also after an error: the writer must match what the buffer holds
            self._keep_running(plan)
        return written

    def _append(self, plan: Plan, steps: list[tuple[Segment, int]]) -> Generator[Call, Any, None]:
        """One ``append_batch`` of a step per segment; an episode the buffer lost meanwhile
        (evicted, cleared, ended by someone else) continues its trajectory in a new episode."""
        for segment, _ in steps:
            if segment.episode is None:
                segment.episode = yield ("start_episode", (self.agent_id,))
        try:
            yield append_call(plan, steps)
        except EpisodeStateError:
            lost = yield from lost_segments(steps)
            if not lost:
                raise
            for segment in lost:
                segment.episode = yield ("start_episode", (self.agent_id,))
            yield append_call(plan, steps)
        for segment, position in steps:
            segment.written = position

    def _end(self, plan: Plan, steps: list[tuple[Segment, int]]) -> Generator[Call, Any, None]:
        """End the segments whose last step is in ``steps`` and ends their episode."""
        for segment, position in steps:
            if segment.status is None or position != segment.positions[-1]:
                continue
            final = plan.next_observation[position]
            with contextlib.suppress(EpisodeStateError):  # evicted or cleared since its last
                yield ("end_episode", (segment.episode, segment.status, final))  # step: done
            segment.ended = True
            self._open.pop(segment.trajectory, None)

    def _keep_running(self, plan: Plan) -> None:
        """Remember each episode left running with its last next observation."""
        for segment in plan.segments:
            if not segment.ended and segment.written is not None:
                tail = plan.next_observation[segment.written].clone()
                # Written steps went into an episode, so its id is set.
                self._open[segment.trajectory] = Open(cast(int, segment.episode), tail)

    def _finish(self, status: str) -> Generator[Call, Any, int]:
        if status not in STATUSES:
            raise ArgumentError(f"status must be 'terminated' or 'truncated', got {status!r}")
        ended = 0
        for trajectory, running in list(self._open.items()):
            try:
                yield ("end_episode", (running.episode, status, running.tail))
                ended += 1
            except EpisodeStateError:
                pass  # evicted or cleared by the buffer: nothing is left to end
            del self._open[trajectory]
        return ended

    # ----------------------------------------------------------------- checks and plan
    def _plan(self, batch: TensorDictBase, what: str) -> Plan:
        """Check ``batch`` whole and decide the episode of every step and the write order."""
        if not isinstance(batch, TensorDictBase):
            raise ArgumentTypeError(
                f"{what}: batch must be a TensorDict, got {type(batch).__name__}"
            )
        if batch.batch_dims == 0:
            raise ArgumentError(f"{what}: batch expected batch dims [T] or [*envs, T], got []")
        shape = tuple(batch.batch_size)
        flat = batch.reshape(-1)
        observation = batches.require(flat, self.observation_key, "observation_key", what)
        next_observation = batches.require(
            flat, self.next_observation_key, "next_observation_key", what
        )
        batches.same_structure(observation, next_observation, what)
        action = batches.require(flat, self.action_key, "action_key", what)
        if not isinstance(action, torch.Tensor):
            raise ArgumentTypeError(
                f"{what}: action_key {dotted(self.action_key)!r} must name a tensor"
            )
        reward = batches.require(flat, self.reward_key, "reward_key", what)
        if not isinstance(reward, torch.Tensor):
            raise ArgumentTypeError(
                f"{what}: reward_key {dotted(self.reward_key)!r} must name a tensor"
            )
        reward = batches.per_step(reward, "reward", what, vector_ok=True)
        extras = {
            name: batches.require(flat, key, f"extras[{name!r}]", what)
            for name, key in self.extras.items()
        }
        flags = batches.end_flags(
            flat, self.done_key, self.terminated_key, self.truncated_key, what
        )
        ends, terminated = batches.ends(flags)
        trajectories, known = batches.trajectories(flat, shape, self.trajectory_key, what)
        valid = batches.valid_steps(flat, self.mask_key, what) & known
        plan = Plan(observation, action, reward, next_observation, extras, [], [])
        self._check_spec(plan, valid, what)
        split_segments(plan, shape, valid, trajectories, ends, terminated, self._open, what)
        return plan

    def _check_spec(self, plan: Plan, valid: np.ndarray, what: str) -> None:
        """Check one step's row against the spec the buffer stores (if any) before writing."""
        positions = np.flatnonzero(valid)
        sync = self.buffer.sync if isinstance(self.buffer, EpisodeReplayBuffer) else self.buffer
        spec = sync.spec
        if spec is None or positions.size == 0:
            return
        row = torch.tensor(positions[:1], dtype=torch.long)
        data: dict[str, Any] = {
            "observation": plan.observation[row],
            "action": plan.action[row],
            "reward": plan.reward[row],
        }
        if plan.extras:
            data["extras"] = {name: value[row] for name, value in plan.extras.items()}
        spec.check(to_leaves(data, batched=True, what=what, spec=spec), 1, what)
