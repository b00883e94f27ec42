"""start_episodes and end_episodes: what loops of start_episode and end_episode do, in one call;
batched evictions: what evicting one episode at a time does.

Three buffers run the same random program: one through the bulk calls, one through them with
the core's batched paths off (``core.batched = False``: final rows and evictions one episode at
a time, the reference), one through loops of the single calls. The first two must agree in
their stored data, stats, ids, anchor order, free rows and seeded samples; the loop in
everything but which row holds which step (see :func:`contents`), and it may differ only where
it evicts an episode named in the same call, which end_episodes never does.
"""

from __future__ import annotations

import asyncio
import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from episode_helpers import batch_of, final_obs, step
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replaybuf import (
    ArgumentError,
    EpisodeReplayBuffer,
    EpisodeStateError,
    SyncEpisodeReplayBuffer,
)
from replaybuf.errors import ReplayBufError


def snapshot(buf: SyncEpisodeReplayBuffer) -> dict:
    """Everything observable and the bookkeeping that orders later rows and draws."""
    core = buf._core
    core.flush()
    live = sorted(item for item in core.finished if item[1] in core.episodes)
    out = {
        "stats": buf.stats(),
        "ids": buf.episode_ids(),
        "anchors": core.anchors.rows[: len(core.anchors)].tolist(),
        "free": list(core.free),
        "finished": live,
        "next_row": core.links.column("next_row").tolist(),
        "episode": core.links.column("episode").tolist(),
        "end_kind": core.links.column("end_kind").tolist(),
        "step": core.links.column("step").tolist(),
        "episodes": {},
    }
    for e in buf.episode_ids():
        record = buf.get_episode(e)
        out["episodes"][e] = {k: record[k].tolist() for k in record.keys() if k != "extras"}  # noqa: SIM118 (iterating a TensorDict walks its batch)
    if len(buf):
        buf._generator.manual_seed(7)
        batch = buf.sample_n_step(6, n=2, gamma=0.5)
        out["sample"] = (batch["episode_id"].tolist(), batch["start_step"].tolist())
    return out


def contents(buf: SyncEpisodeReplayBuffer) -> dict:
    """:func:`snapshot` less row placement: the loop of single calls evicts one episode at a
    time, and each eviction's freed rows are handed out again in storage order, so its steps
    may sit in other rows (and seeded draws, which follow the anchor order, may differ)."""
    snap = snapshot(buf)
    episode, step_of = snap["episode"], snap["step"]
    return {
        "stats": snap["stats"],
        "ids": snap["ids"],
        "free": len(snap["free"]),
        "finished": snap["finished"],
        "anchors": sorted((episode[row], step_of[row]) for row in snap["anchors"]),
        "episodes": snap["episodes"],
    }


op = st.one_of(
    st.tuples(st.just("start"), st.integers(1, 4)),
    st.tuples(st.just("batch"), st.lists(st.integers(0, 20), min_size=1, max_size=5)),
    st.tuples(st.just("step"), st.integers(0, 20)),
    st.tuples(
        st.just("end"),
        st.lists(st.integers(0, 20), min_size=1, max_size=6),
        st.sampled_from(["terminated", "truncated", "mixed"]),
    ),
)
ops = st.lists(op, min_size=4, max_size=30)


class Driver:
    """One buffer driven through the bulk calls (``bulk``) or loops of single calls."""

    def __init__(self, buf: SyncEpisodeReplayBuffer, bulk: bool) -> None:
        self.buf, self.bulk = buf, bulk

    def running(self) -> list[int]:
        core = self.buf._core
        return [e for e in self.buf.episode_ids() if core.episodes[e].in_progress]

    def start(self, count: int) -> None:
        count = min(count, self.buf.max_episodes or count)
        if self.bulk:
            self.buf.start_episodes(count)
        else:
            for _ in range(count):
                self.buf.start_episode()

    def batch(self, picks: list[int]) -> None:
        running = self.running()
        ids = sorted({running[p % len(running)] for p in picks}) if running else []
        if ids:
            steps = [step(e, self.buf._core.episodes[e].steps) for e in ids]
            self.buf.append_batch(ids, *batch_of(steps))

    def step(self, pick: int) -> None:
        running = self.running()
        if running:
            e = running[pick % len(running)]
            self.buf.append_observation_action_reward(e, *step(e, self.buf._core.episodes[e].steps))

    def end(self, picks: list[int], how: str) -> list[int]:
        running = self.running()
        ids = sorted({running[p % len(running)] for p in picks}) if running else []
        if not ids:
            return ids
        statuses = (
            [("terminated", "truncated")[i % 2] for i in range(len(ids))] if how == "mixed" else how
        )
        finals = torch.stack([final_obs(e, self.buf._core.episodes[e].steps) for e in ids])
        if self.bulk:
            self.buf.end_episodes(ids, statuses, finals)
        else:
            for i, e in enumerate(ids):
                status = statuses if isinstance(statuses, str) else statuses[i]
                self.buf.end_episode(e, status, finals[i])
        return ids


def apply(drivers: list[Driver], name: str, args: tuple) -> list:
    """The op on every driver: all complete, or all refuse (no room) with the same error."""
    outcomes = []
    for driver in drivers:
        try:
            outcomes.append(("ok", getattr(driver, name)(*args)))
        except ReplayBufError as error:
            outcomes.append(("error", type(error).__name__))
    return outcomes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_steps=st.integers(4, 24),
    max_episodes=st.one_of(st.none(), st.integers(2, 8)),
    program=ops,
    small_stager=st.booleans(),
)
def test_bulk_calls_and_batched_evictions_agree_with_loops_and_one_by_one(
    max_steps, max_episodes, program, small_stager
):
    rows = 3 if small_stager else 512  # 3: flushes between the rows of one call
    with mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=rows, _FLUSH_BYTES=0):
        bufs = [
            SyncEpisodeReplayBuffer(max_steps, max_episodes, storage="tensor", seed=0)
            for _ in range(3)
        ]
        bufs[1]._core.batched = False
        drivers = [Driver(bufs[0], True), Driver(bufs[1], True), Driver(bufs[2], False)]
        for name, *args in program:
            outcomes = apply(drivers, name, tuple(args))
            assert outcomes[0] == outcomes[1]
            if name == "end" and outcomes[2][0] == "ok":
                # The loop may evict an episode its own later end names (end_episodes spares
                # every episode of the call): those programs are not comparable.
                assume(all(e in bufs[2]._core.episodes for e in outcomes[2][1]))
            assume(outcomes[0][0] == outcomes[2][0])
            assert snapshot(bufs[0]) == snapshot(bufs[1])
            assert contents(bufs[0]) == contents(bufs[2])
        for buf in bufs:
            buf.close()


def filled(max_steps: int = 50, max_episodes: int | None = 10) -> tuple:
    buf = SyncEpisodeReplayBuffer(max_steps, max_episodes, storage="tensor", seed=0)
    ids = buf.start_episodes(3)
    for t in range(2):
        buf.append_batch(ids, *batch_of([step(e, t) for e in ids]))
    buf.end_episode(ids[2], "terminated", final_obs(ids[2], 2))
    return buf, ids


@pytest.mark.parametrize(
    ("ids", "statuses", "finals", "error", "match"),
    [
        ([0, 99], "terminated", torch.zeros(2, 3), EpisodeStateError, r"episode_ids\[1\].*unknown"),
        ([0, 0], "terminated", torch.zeros(2, 3), ArgumentError, r"distinct.*indices 0 and 1"),
        ([0, 2], "terminated", torch.zeros(2, 3), EpisodeStateError, r"episode_ids\[1\].*ended"),
        ([0, 1], "terminated", torch.zeros(3, 3), ArgumentError, r"final_observations.*3"),
        ([0, 1], "terminated", torch.zeros(2, 4), ReplayBufError, r"final_observations\[0\]"),
        ([0, 1], "terminated", None, ArgumentError, "final_observations is required"),
        ([0, 1], ["terminated", "done"], torch.zeros(2, 3), ArgumentError, r"statuses\[1\]"),
        ([0, 1], ["terminated"], torch.zeros(2, 3), ArgumentError, "one status per episode"),
        ([0, 1], 3, torch.zeros(2, 3), ReplayBufError, "statuses"),
        ("01", "terminated", torch.zeros(2, 3), ReplayBufError, "episode_ids"),
    ],
)
def test_bad_end_episodes_input_names_the_argument_and_changes_nothing(
    ids, statuses, finals, error, match
):
    buf, _ = filled()
    before = snapshot(buf)
    with pytest.raises(error, match=match):
        buf.end_episodes(ids, statuses, finals)
    assert snapshot(buf) == before


def test_end_episodes_takes_numpy_dicts_and_zero_step_episodes():
    buf, ids = filled()
    fresh = buf.start_episode()  # no steps: keeps its final observation itself
    finals = np.stack([final_obs(e, 2).numpy() for e in ids[:2]] + [np.zeros(3, np.float32)])
    buf.end_episodes(np.array([ids[0], ids[1], fresh]), ["truncated", "COMPLETED", "truncated"],
                     finals)  # fmt: skip
    assert [buf._core.episodes[e].status for e in (*ids[:2], fresh)] == [
        "truncated",
        "terminated",
        "truncated",
    ]
    assert buf.get_episode(ids[0])["observation"][-1].tolist() == final_obs(ids[0], 2).tolist()
    buf.end_episodes([], "terminated", torch.zeros(0, 3))  # nothing to end: nothing changes


def test_start_episodes_refuses_more_than_max_episodes_and_evicts_as_a_loop_would():
    buf, _ = filled(max_episodes=4)
    with pytest.raises(ArgumentError, match="count must be at most max_episodes=4"):
        buf.start_episodes(5)
    with pytest.raises(ArgumentError, match="count"):
        buf.start_episodes(0)
    loop, _ = filled(max_episodes=4)
    assert buf.start_episodes(3) == [loop.start_episode() for _ in range(3)]
    assert contents(buf) == contents(loop)  # one eviction's rows in storage order, not three


def test_end_episodes_refused_for_room_changes_nothing():
    """Ending needs a final row per episode; when evicting every other episode cannot free
    enough (a checkpoint pins rows), the call refuses before ending any."""
    buf = SyncEpisodeReplayBuffer(4, None, storage="tensor", seed=0)
    ids = buf.start_episodes(4)
    buf.append_batch(ids, *batch_of([step(e, 0) for e in ids]))
    while buf._core.free:  # only the pinned snapshot's rows are left
        buf._core.free.pop()
    buf._core.pinned = True
    before = (buf.stats(), buf.episode_ids())
    with pytest.raises(ReplayBufError):
        buf.end_episodes(ids, "terminated", torch.zeros(4, 3))
    assert (buf.stats(), buf.episode_ids()) == before


async def test_async_bulk_calls_complete_or_never_start_under_cancellation():
    buf = EpisodeReplayBuffer(200, 40, storage="tensor", seed=0)
    ids = await buf.start_episodes(4)
    await buf.append_batch(ids, *batch_of([step(e, 0) for e in ids]))
    finals = torch.stack([final_obs(e, 1) for e in ids])
    for _ in range(20):
        task = asyncio.ensure_future(buf.end_episodes(ids, "truncated", finals))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        statuses = {buf.sync._core.episodes[e].status for e in ids}
        assert statuses in ({"in_progress"}, {"truncated"})  # all ended or none
        if statuses == {"truncated"}:
            break
    else:
        await buf.end_episodes(ids, "truncated", finals)
    assert {buf.sync._core.episodes[e].status for e in ids} == {"truncated"}
    assert len(await buf.start_episodes(2)) == 2
    await buf.close()
