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
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from replaybuf.buffers import EpisodeReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.episodes import RETURNED_KEYS
from replaybuf.errors import EpisodeStateError
from replaybuf.storage import to_leaves

NestedKey = str | tuple[str, ...]
Key = tuple[str, ...]
STATUSES = ("terminated", "truncated")
# One buffer call: (method name, positional arguments); its result is sent back.
Call = tuple[str, tuple[Any, ...]]


def _key(value: Any, name: str) -> Key:
    """A TensorDict key as a tuple, or ``TypeError`` naming the argument."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(part, str) for part in value):
        return value
    raise TypeError(f"{name} must be a str or a tuple of str (a TensorDict key), got {value!r}")


@dataclass
class _Open:
    """An episode left running at the end of a batch: its id and its last next observation."""

    episode: int
    tail: Any


@dataclass
class _Segment:
    """The steps of one episode inside one batch (flat positions, in time order)."""

    trajectory: Hashable
    episode: int | None  # None until its first step starts a new episode
    positions: list[int] = field(default_factory=list)
    status: str | None = None  # how it ends inside this batch; None: it runs on
    written: int | None = None  # position of the last step written, once one is
    ended: bool = False  # its end_episode went through


@dataclass
class _Plan:
    """A checked batch, flattened, and the order to write it in."""

    observation: Any
    action: torch.Tensor
    reward: torch.Tensor
    next_observation: Any
    extras: dict[str, torch.Tensor]
    segments: list[_Segment]
    rounds: list[list[tuple[_Segment, int]]]  # steps written together by one append_batch


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
            raise TypeError(
                "buffer must be a SyncEpisodeReplayBuffer or an EpisodeReplayBuffer, "
                f"got {type(buffer).__name__}"
            )
        if not isinstance(agent_id, str):
            raise TypeError(f"agent_id must be a str, got {type(agent_id).__name__}")
        self.buffer = buffer
        self.agent_id = agent_id
        self.observation_key = _key(observation_key, "observation_key")
        self.action_key = _key(action_key, "action_key")
        self.reward_key = _key(reward_key, "reward_key")
        self.next_observation_key = (
            ("next", *self.observation_key)
            if next_observation_key is None
            else _key(next_observation_key, "next_observation_key")
        )
        self.done_key = _key(done_key, "done_key")
        self.terminated_key = _key(terminated_key, "terminated_key")
        self.truncated_key = _key(truncated_key, "truncated_key")
        self.trajectory_key = _key(trajectory_key, "trajectory_key")
        self.mask_key = _key(mask_key, "mask_key")
        self.extras = _extras(extras)
        self._open: dict[Hashable, _Open] = {}

    @property
    def open_episodes(self) -> dict[Hashable, int]:
        """Trajectory (id, or ``("stream", i)`` without ids) -> episode id, still running."""
        return {trajectory: o.episode for trajectory, o in self._open.items()}

    # ----------------------------------------------------------------- public calls
    def write(self, batch: TensorDictBase) -> int:
        """Write one collector batch (sync buffer); returns the number of steps written."""
        sync = self._sync_buffer("write")
        return _drive(sync, self._write(batch, "CollectorWriter.write"))

    async def awrite(self, batch: TensorDictBase) -> int:
        """:meth:`write` for an :class:`EpisodeReplayBuffer`; each buffer call is awaited."""
        aio = self._async_buffer("awrite")
        return await _adrive(aio, self._write(batch, "CollectorWriter.awrite"))

    def finish(self, status: str = "truncated") -> int:
        """End every running episode (final observation: its last next observation); returns
        how many. ``truncated`` (the default) bootstraps from it, as a cut trajectory should."""
        sync = self._sync_buffer("finish")
        return _drive(sync, self._finish(status))

    async def afinish(self, status: str = "truncated") -> int:
        """:meth:`finish` for an :class:`EpisodeReplayBuffer`."""
        aio = self._async_buffer("afinish")
        return await _adrive(aio, self._finish(status))

    def _sync_buffer(self, method: str) -> SyncEpisodeReplayBuffer:
        if not isinstance(self.buffer, SyncEpisodeReplayBuffer):
            raise TypeError(
                f"{method} needs a SyncEpisodeReplayBuffer, got an EpisodeReplayBuffer; "
                f"use await writer.a{method}(...)"
            )
        return self.buffer

    def _async_buffer(self, method: str) -> EpisodeReplayBuffer:
        if not isinstance(self.buffer, EpisodeReplayBuffer):
            raise TypeError(
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

    def _append(self, plan: _Plan, steps: list[tuple[_Segment, int]]) -> Generator[Call, Any, None]:
        """One ``append_batch`` of a step per segment; an episode the buffer lost meanwhile
        (evicted, cleared, ended by someone else) continues its trajectory in a new episode."""
        for segment, _ in steps:
            if segment.episode is None:
                segment.episode = yield ("start_episode", (self.agent_id,))
        try:
            yield _append_call(plan, steps)
        except EpisodeStateError:
            lost = yield from _lost(steps)
            if not lost:
                raise
            for segment in lost:
                segment.episode = yield ("start_episode", (self.agent_id,))
            yield _append_call(plan, steps)
        for segment, position in steps:
            segment.written = position

    def _end(self, plan: _Plan, steps: list[tuple[_Segment, int]]) -> Generator[Call, Any, None]:
        """End the segments whose last step is in ``steps`` and ends their episode."""
        for segment, position in steps:
            if segment.status is None or position != segment.positions[-1]:
                continue
            final = plan.next_observation[position]
            with contextlib.suppress(EpisodeStateError):  # evicted or cleared since its last
                yield ("end_episode", (segment.episode, segment.status, final))  # step: done
            segment.ended = True
            self._open.pop(segment.trajectory, None)

    def _keep_running(self, plan: _Plan) -> None:
        """Remember each episode left running with its last next observation."""
        for segment in plan.segments:
            if not segment.ended and segment.written is not None:
                tail = plan.next_observation[segment.written].clone()
                self._open[segment.trajectory] = _Open(segment.episode, tail)

    def _finish(self, status: str) -> Generator[Call, Any, int]:
        if status not in STATUSES:
            raise ValueError(f"status must be 'terminated' or 'truncated', got {status!r}")
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
    def _plan(self, batch: TensorDictBase, what: str) -> _Plan:
        """Check ``batch`` whole and decide the episode of every step and the write order."""
        if not isinstance(batch, TensorDictBase):
            raise TypeError(f"{what}: batch must be a TensorDict, got {type(batch).__name__}")
        if batch.batch_dims == 0:
            raise ValueError(f"{what}: batch expected batch dims [T] or [*envs, T], got []")
        shape = tuple(batch.batch_size)
        flat = batch.reshape(-1)
        observation = _require(flat, self.observation_key, "observation_key", what)
        next_observation = _require(flat, self.next_observation_key, "next_observation_key", what)
        _same_structure(observation, next_observation, what)
        action = _require(flat, self.action_key, "action_key", what)
        if not isinstance(action, torch.Tensor):
            raise TypeError(f"{what}: action_key {_name(self.action_key)!r} must name a tensor")
        reward = _require(flat, self.reward_key, "reward_key", what)
        if not isinstance(reward, torch.Tensor):
            raise TypeError(f"{what}: reward_key {_name(self.reward_key)!r} must name a tensor")
        reward = _per_step(reward, "reward", what, vector_ok=True)
        extras = {
            name: _require(flat, key, f"extras[{name!r}]", what)
            for name, key in self.extras.items()
        }
        flags = self._flags(flat, what)
        ends, terminated = _ends(flags)
        trajectories, known = self._trajectories(flat, shape, what)
        valid = self._valid(flat, what) & known
        plan = _Plan(observation, action, reward, next_observation, extras, [], [])
        self._check_spec(plan, valid, what)
        self._segment(plan, shape, valid, trajectories, ends, terminated, what)
        return plan

    def _flags(self, flat: TensorDictBase, what: str) -> dict[str, np.ndarray]:
        keys = {"done": self.done_key, "terminated": self.terminated_key}
        keys["truncated"] = self.truncated_key
        flags = {}
        for name, key in keys.items():
            value = flat.get(key, None)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(
                    f"{what}: {name} flag {_name(key)!r} expected a bool tensor, got {got}"
                )
            flags[name] = _per_step(value, name, what).cpu().numpy()
        if not flags:
            raise KeyError(
                f"{what}: batch has none of the end flags {_name(self.done_key)!r}, "
                f"{_name(self.terminated_key)!r}, {_name(self.truncated_key)!r}"
            )
        return flags

    def _valid(self, flat: TensorDictBase, what: str) -> np.ndarray:
        mask = flat.get(self.mask_key, None)
        if mask is None:
            return np.ones(flat.shape[0], dtype=bool)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{what}: mask {_name(self.mask_key)!r} expected a bool tensor")
        return _per_step(mask, "mask", what).cpu().numpy()

    def _trajectories(
        self, flat: TensorDictBase, shape: tuple[int, ...], what: str
    ) -> tuple[list[Hashable], np.ndarray]:
        """Each step's trajectory (its collector id, else its stream: the leading index), and
        which steps have one (a preempted worker leaves id -1 in steps it never filled)."""
        ids = flat.get(self.trajectory_key, None)
        if ids is None:
            streams = np.arange(flat.shape[0]) // shape[-1]
            return [("stream", int(s)) for s in streams], np.ones(flat.shape[0], dtype=bool)
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.is_complex():
            raise TypeError(
                f"{what}: trajectory ids {_name(self.trajectory_key)!r} must be integers"
            )
        ids_np = _per_step(ids, "trajectory ids", what).cpu().numpy()
        return [int(i) for i in ids_np], ids_np >= 0

    def _check_spec(self, plan: _Plan, valid: np.ndarray, what: str) -> None:
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

    def _segment(
        self,
        plan: _Plan,
        shape: tuple[int, ...],
        valid: np.ndarray,
        trajectories: list[Hashable],
        ends: np.ndarray,
        terminated: np.ndarray,
        what: str,
    ) -> None:
        """Split the valid steps into episode segments and group them by time index."""
        current: dict[Hashable, _Segment] = {}
        seen: set[Hashable] = set()  # trajectories met earlier in this batch
        last_time: dict[Hashable, int] = {}
        rounds: dict[int, list[tuple[_Segment, int]]] = {}
        for position in np.flatnonzero(valid).tolist():
            trajectory = trajectories[position]
            time = position % shape[-1]
            if last_time.get(trajectory, -1) >= time:
                raise ValueError(
                    f"{what}: trajectory {trajectory} has two steps at time index {time} or "
                    "out of order; expected the time dimension last and one environment per "
                    "trajectory"
                )
            last_time[trajectory] = time
            segment = current.get(trajectory)
            if segment is None:
                running = None if trajectory in seen else self._open.get(trajectory)
                seen.add(trajectory)
                segment = _Segment(trajectory, None if running is None else running.episode)
                current[trajectory] = segment
                plan.segments.append(segment)
            segment.positions.append(position)
            rounds.setdefault(time, []).append((segment, position))
            if ends[position]:
                segment.status = "terminated" if terminated[position] else "truncated"
                del current[trajectory]
        plan.rounds = [rounds[time] for time in sorted(rounds)]


def _append_call(plan: _Plan, steps: list[tuple[_Segment, int]]) -> Call:
    """The ``append_batch`` call for one step of each segment in ``steps``."""
    rows = torch.tensor([position for _, position in steps], dtype=torch.long)
    ids = [segment.episode for segment, _ in steps]
    extras = {name: value[rows] for name, value in plan.extras.items()} or None
    return (
        "append_batch",
        (ids, plan.observation[rows], plan.action[rows], plan.reward[rows], extras),
    )


def _lost(steps: list[tuple[_Segment, int]]) -> Generator[Call, Any, list[_Segment]]:
    """The segments whose episode is no longer running in the buffer (probed one by one)."""
    lost = []
    for segment, _ in steps:
        try:
            record = yield ("get_episode", (segment.episode,))
        except EpisodeStateError:
            lost.append(segment)
            continue
        if bool(record["terminated"]) or bool(record["truncated"]):
            lost.append(segment)
    return lost


def _extras(extras: Mapping[str, NestedKey] | None) -> dict[str, Key]:
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise TypeError(f"extras must map stored names to batch keys, got {extras!r}")
    out = {}
    for name, key in extras.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"extras names must be non-empty str, got {name!r}")
        if name in RETURNED_KEYS:
            raise ValueError(f"extras name {name!r} collides with a key sampling returns")
        out[name] = _key(key, f"extras[{name!r}]")
    return out


def _name(key: Key | str) -> str:
    """A TensorDict key as users read it: ``next.reward``."""
    return ".".join((key,) if isinstance(key, str) else key)


def _require(flat: TensorDictBase, key: Key, name: str, what: str) -> Any:
    value = flat.get(key, None)
    if value is None:
        keys = sorted(_name(k) for k in flat.keys(include_nested=True, leaves_only=True))
        raise KeyError(
            f"{what}: {name} {_name(key)!r} is not in the batch (its keys: {', '.join(keys)})"
        )
    return value


def _per_step(value: torch.Tensor, name: str, what: str, vector_ok: bool = False) -> torch.Tensor:
    """``[N]`` or ``[N, 1]`` (TorchRL's trailing 1) as ``[N]``; other trailing shapes pass
    unchanged when ``vector_ok`` (vector rewards) and are refused otherwise (flags, ids)."""
    if value.dim() == 2 and value.shape[1] == 1:
        return value[:, 0]
    if value.dim() != 1 and not vector_ok:
        raise ValueError(
            f"{what}: {name} expected one value per step (shape [..., 1] or [...]), got "
            f"trailing shape {list(value.shape[1:])}"
        )
    return value


def _ends(flags: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Which steps end an episode, and which of those terminate it."""
    ends = np.zeros_like(next(iter(flags.values())))
    for value in flags.values():
        ends |= value
    if "terminated" in flags:
        terminated = flags["terminated"]
    elif "truncated" in flags:
        terminated = ends & ~flags["truncated"]
    else:
        terminated = ends  # only "done": nothing says it was a time limit
    return ends, terminated


def _same_structure(observation: Any, next_observation: Any, what: str) -> None:
    """obs_t and obs_{t+1} must agree leaf by leaf (the final observation is stored as one)."""
    first = _leaf_specs(observation)
    second = _leaf_specs(next_observation)
    if first != second:
        raise ValueError(
            f"{what}: next observation expected the observation's fields {first}, got {second}"
        )


def _leaf_specs(value: Any) -> dict[str, tuple[list[int], torch.dtype]]:
    if isinstance(value, torch.Tensor):
        return {"": (list(value.shape[1:]), value.dtype)}
    if isinstance(value, TensorDictBase):
        return {
            str(k): (list(v.shape[1:]), v.dtype)
            for k, v in value.items(include_nested=True, leaves_only=True)
        }
    raise TypeError(f"observation must be a tensor or a TensorDict, got {type(value).__name__}")


def _drive(buffer: Any, calls: Generator[Call, Any, int]) -> int:
    """Make the buffer calls ``calls`` yields, sending back results and throwing back errors."""
    try:
        call = next(calls)
        while True:
            try:
                result = getattr(buffer, call[0])(*call[1])
            except Exception as exc:
                call = calls.throw(exc)
            else:
                call = calls.send(result)
    except StopIteration as stop:
        return stop.value


async def _adrive(buffer: Any, calls: Generator[Call, Any, int]) -> int:
    """:func:`_drive` for an :class:`EpisodeReplayBuffer`: each call is awaited."""
    try:
        call = next(calls)
        while True:
            try:
                result = await getattr(buffer, call[0])(*call[1])
            except Exception as exc:
                call = calls.throw(exc)
            else:
                call = calls.send(result)
    except StopIteration as stop:
        return stop.value
