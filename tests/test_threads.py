"""Both sync buffers shared between threads: collector threads write while a learner samples.

Every stored value is a function of where it was written (writer, episode, step or row id), so
each sampled window and every row read back afterwards is checked against what was written.
A thread switch every microsecond makes interleavings inside a call likely.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer

pytestmark = pytest.mark.timeout(120)


@contextmanager
def frequent_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Run each target in its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def guard(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
    with frequent_switches():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def obs(writer: int, episode: int, step: int) -> torch.Tensor:
    return torch.tensor([writer, episode, step], dtype=torch.float32)


def check_window(batch, owners: dict[int, tuple[int, int]], i: int) -> None:
    """Sample ``i`` of an n-step batch (gamma 1) is the window its episode wrote."""
    writer, episode = owners[int(batch["episode_id"][i])]
    start, m = int(batch["start_step"][i]), int(batch["actual_n"][i])
    assert torch.equal(batch["observation"][i], obs(writer, episode, start))
    assert int(batch["action"][i]) == start
    assert torch.equal(batch["next_observation"][i], obs(writer, episode, start + m))
    assert float(batch["reward"][i]) == sum(float(t + 1) for t in range(start, start + m))


@pytest.mark.parametrize("batched", [False, True], ids=["one-step", "append_batch"])
def test_episode_writers_and_a_sampler_see_only_what_was_written(batched: bool) -> None:
    writers, episodes, length = 3, 40, 25
    buf = SyncEpisodeReplayBuffer(1_000, seed=0)  # 3,000 steps: older episodes are evicted
    owners: dict[int, tuple[int, int]] = {}
    done = threading.Event()
    sampled = [0]

    def write_one(writer: int) -> None:
        for episode in range(episodes):
            ep = buf.start_episode(f"w{writer}")
            owners[ep] = (writer, episode)
            for t in range(length):
                buf.append_observation_action_reward(ep, obs(writer, episode, t), t, float(t + 1))
            buf.end_episode(ep, "terminated", obs(writer, episode, length))

    def write_batched(writer: int) -> None:
        for pair in range(0, episodes, 2):  # two episodes in lockstep, as a vector env
            ids = [buf.start_episode(f"w{writer}") for _ in range(2)]
            for k, ep in enumerate(ids):
                owners[ep] = (writer, pair + k)
            for t in range(length):
                o = torch.stack([obs(writer, pair + k, t) for k in range(2)])
                buf.append_batch(ids, o, torch.tensor([t, t]), torch.tensor([t + 1.0, t + 1.0]))
            for k, ep in enumerate(ids):
                buf.end_episode(ep, "terminated", obs(writer, pair + k, length))

    def sample() -> None:
        while not done.is_set() or sampled[0] == 0:
            if len(buf) == 0:
                continue
            batch = buf.sample_n_step(16, n=3, gamma=1.0)
            for i in range(batch.shape[0]):
                check_window(batch, owners, i)
            sampled[0] += 1

    write = write_batched if batched else write_one
    collectors = [lambda w=w: write(w) for w in range(writers)]

    def collect_then_stop() -> None:
        try:
            run_threads(collectors)
        finally:
            done.set()

    run_threads([collect_then_stop, sample])
    assert sampled[0] > 0
    stats = buf.stats()
    assert stats["steps"] <= 1_000
    assert stats["episodes"] + stats["evicted_episodes"] == writers * episodes
    for ep, (writer, episode) in owners.items():  # every stored row is the one written
        if ep not in buf._core.episodes:
            continue
        record = buf.get_episode(ep)
        assert int(record["length"]) == length
        expected = torch.stack([obs(writer, episode, t) for t in range(length + 1)])
        assert torch.equal(record["observation"], expected)
        assert torch.equal(record["action"], torch.arange(length))
        assert torch.equal(record["reward"], torch.arange(1, length + 1, dtype=torch.float32))
    buf.close()


@pytest.mark.parametrize("batched", [False, True], ids=["add", "add_batch"])
def test_ring_writers_and_a_sampler_lose_and_tear_nothing(batched: bool) -> None:
    writers, calls, rows = 4, 150, 8
    total = writers * calls * (rows if batched else 1)
    buf = ReplayBuffer("cpu", "cpu", total, seed=0)
    done = threading.Event()

    def row(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"id": ids, "obs": ids.float()[:, None].expand(-1, 3) * 2, "reward": -ids.float()}

    def write(writer: int) -> None:
        for call in range(calls):
            first = (writer * calls + call) * (rows if batched else 1)
            if batched:
                buf.add_batch(row(torch.arange(first, first + rows)))
            else:
                one = row(torch.tensor([first]))
                buf.add({k: v[0] for k, v in one.items()})

    def consistent(batch) -> None:
        ids = batch["id"].float()
        assert torch.equal(batch["obs"], ids[:, None].expand(-1, 3) * 2)
        assert torch.equal(batch["reward"], -ids)

    def sample() -> None:
        while not done.is_set():
            if len(buf):
                consistent(buf.sample_batch(32))

    def collect_then_stop() -> None:
        try:
            run_threads([lambda w=w: write(w) for w in range(writers)])
        finally:
            done.set()

    run_threads([collect_then_stop, sample])
    assert len(buf) == total
    everything = buf.sample_all()
    consistent(everything)
    assert torch.equal(everything["id"].sort().values, torch.arange(total))
    buf.close()


def test_an_epoch_iterator_shares_the_buffer_with_a_writer_thread() -> None:
    buf = ReplayBuffer("cpu", "cpu", 10_000, seed=0)
    buf.add_batch({"x": torch.arange(2_000), "y": -torch.arange(2_000)})
    seen: list[torch.Tensor] = []
    planned = threading.Event()  # an epoch is planned when it starts: at its first batch

    def learn() -> None:
        try:
            for batch in buf.create_epoch_iterator(64):
                planned.set()
                assert torch.equal(batch["y"], -batch["x"])
                seen.append(batch["x"])
        finally:
            planned.set()  # a reader that fails early does not leave the writer waiting

    def write() -> None:
        assert planned.wait(60), "the epoch never started"
        for k in range(2_000, 4_000, 10):
            buf.add_batch({"x": torch.arange(k, k + 10), "y": -torch.arange(k, k + 10)})

    run_threads([learn, write])
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(2_000))
    assert len(buf) == 4_000
    buf.close()


def test_a_refused_sample_leaves_the_lock_free_for_other_threads() -> None:
    """``sample_n_step`` takes its lock by hand: whatever it refuses or raises, another thread
    can take the lock right after (the lock is re-entrant, so only another thread would see a
    leak)."""
    buf = SyncEpisodeReplayBuffer(100, 10, seed=0)

    def take_and_release(taken: list[bool]) -> None:
        got = buf._lock.acquire(timeout=5)
        taken.append(got)
        if got:
            buf._lock.release()

    def lock_is_free() -> bool:
        taken: list[bool] = []
        other = threading.Thread(target=take_and_release, args=(taken,))
        other.start()
        other.join()
        return taken == [True]

    def failing_path(*args: object) -> None:
        raise RuntimeError("the path failed")

    def fill() -> None:
        episode = buf.start_episode()
        for t in range(4):
            buf.append_observation_action_reward(episode, torch.full((3,), float(t)), t, 1.0)

    refusals: list[tuple[Callable[[], object], type[BaseException] | tuple]] = [
        (lambda: buf.sample_n_step(4), ValueError),  # nothing stored yet
        (lambda: buf.sample_n_step(0), ValueError),
        (lambda: buf.sample_n_step("4"), TypeError),
        (lambda: buf.sample_n_step(4, n=0), ValueError),
        (lambda: buf.sample_n_step(4, gamma=2.0), ValueError),
        (lambda: buf.sample_n_step(4, layout="rllib"), ValueError),
        (fill, ()),  # stored steps from here on
        (lambda: buf.sample_n_step(10**15), MemoryError),  # more than memory holds
        (lambda: buf.sample_n_step(4), ()),  # a batch: the paths are chosen now
    ]
    for call, expected in refusals:
        if expected:
            with pytest.raises(expected):
                call()
        else:
            call()
        assert lock_is_free()
    paths = buf._paths
    assert paths is not None
    buf._paths = dataclasses.replace(paths, n_step=failing_path)  # the path itself raises
    with pytest.raises(RuntimeError, match="the path failed"):
        buf.sample_n_step(4)
    assert lock_is_free()
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.sample_n_step(4)
    assert lock_is_free()
