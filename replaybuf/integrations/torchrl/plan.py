"""A checked batch's write plan: the episode segment of every step, and the rounds of steps
that one ``append_batch`` writes together (one step per segment, in time order)."""

from __future__ import annotations

from collections.abc import Generator, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replaybuf.errors import ArgumentError, EpisodeStateError
from replaybuf.integrations.torchrl.drive import Call


@dataclass
class Open:
    """An episode left running at the end of a batch: its id and its last next observation."""

    episode: int
    tail: Any


@dataclass
class Segment:
    """The steps of one episode inside one batch (flat positions, in time order)."""

    trajectory: Hashable
    episode: int | None  # None until its first step starts a new episode
    positions: list[int] = field(default_factory=list)
    status: str | None = None  # how it ends inside this batch; None: it runs on
    written: int | None = None  # position of the last step written, once one is
    ended: bool = False  # its end_episode went through


@dataclass
class Plan:
    """A checked batch, flattened, and the order to write it in."""

    observation: Any
    action: torch.Tensor
    reward: torch.Tensor
    next_observation: Any
    extras: dict[str, torch.Tensor]
    segments: list[Segment]
    rounds: list[list[tuple[Segment, int]]]  # steps written together by one append_batch


def split_segments(
    plan: Plan,
    shape: tuple[int, ...],
    valid: np.ndarray,
    trajectories: list[Hashable],
    ends: np.ndarray,
    terminated: np.ndarray,
    running: dict[Hashable, Open],
    what: str,
) -> None:
    """Split the valid steps into episode segments and group them by time index (a
    trajectory's first segment continues its episode in ``running``, if any)."""
    current: dict[Hashable, Segment] = {}
    seen: set[Hashable] = set()  # trajectories met earlier in this batch
    last_time: dict[Hashable, int] = {}
    rounds: dict[int, list[tuple[Segment, int]]] = {}
    for position in np.flatnonzero(valid).tolist():
        trajectory = trajectories[position]
        time = position % shape[-1]
        if last_time.get(trajectory, -1) >= time:
            raise ArgumentError(
                f"{what}: trajectory {trajectory} has two steps at time index {time} or "
                "out of order; expected the time dimension last and one environment per "
                "trajectory"
            )
        last_time[trajectory] = time
        part = current.get(trajectory)
        if part is None:
            was = None if trajectory in seen else running.get(trajectory)
            seen.add(trajectory)
            part = Segment(trajectory, None if was is None else was.episode)
            current[trajectory] = part
            plan.segments.append(part)
        part.positions.append(position)
        rounds.setdefault(time, []).append((part, position))
        if ends[position]:
            part.status = "terminated" if terminated[position] else "truncated"
            del current[trajectory]
    plan.rounds = [rounds[time] for time in sorted(rounds)]


def append_call(plan: Plan, steps: list[tuple[Segment, int]]) -> Call:
    """The ``append_batch`` call for one step of each segment in ``steps``."""
    rows = torch.tensor([position for _, position in steps], dtype=torch.long)
    ids = [part.episode for part, _ in steps]
    extras = {name: value[rows] for name, value in plan.extras.items()} or None
    return (
        "append_batch",
        (ids, plan.observation[rows], plan.action[rows], plan.reward[rows], extras),
    )


def lost_segments(steps: list[tuple[Segment, int]]) -> Generator[Call, Any, list[Segment]]:
    """The segments whose episode is no longer running in the buffer (probed one by one)."""
    gone = []
    for part, _ in steps:
        try:
            record = yield ("get_episode", (part.episode,))
        except EpisodeStateError:
            gone.append(part)
            continue
        if bool(record["terminated"]) or bool(record["truncated"]):
            gone.append(part)
    return gone
