"""EpisodeReplayBuffer under asyncio: concurrent writers and readers, cancellation, waiting."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from episode_helpers import batch_of, final_obs, obs, reward, step

from replaybuf import (
    BufferClosedError,
    EmptyBufferError,
    EpisodeReplayBuffer,
    EpisodeStateError,
    SchemaError,
)
from replaybuf.buffers.aio import WRITE_BUDGET

GAMMA = 0.9


@pytest.fixture
async def buf(tmp_path):
    buffer = EpisodeReplayBuffer(300, 16, scratch_dir=tmp_path, seed=0)
    yield buffer
    await buffer.close()


def check_rows_online(batch, gamma: float = GAMMA) -> None:
    """What every n-step row must satisfy, whatever happened concurrently (data names (e, t))."""
    for i in range(batch.batch_size[0]):
        e, t, m = (int(batch[k][i]) for k in ("episode_id", "start_step", "actual_n"))
        assert batch["observation"][i].tolist() == obs(e, t).tolist()
        assert int(batch["action"][i]) == 1000 * e + t
        next_e, next_t, is_final = batch["next_observation"][i].tolist()
        assert (next_e, next_t) == (e, t + m), "window crossed episodes or skipped steps"
        want = sum(gamma**k * reward(e, t + k) for k in range(m))
        assert math.isclose(float(batch["reward"][i]), want, rel_tol=1e-6, abs_tol=1e-6)
        terminal, truncated, cut = (bool(batch[k][i]) for k in ("terminated", "truncated", "cut"))
        assert not (terminal and truncated)
        if terminal or truncated:
            assert is_final == 1
            assert not cut
        want_discount = 0.0 if terminal else gamma**m
        assert math.isclose(float(batch["next_discount"][i]), want_discount, rel_tol=1e-6)


class Writers:
    """Episode-writing tasks that record every append whose await returned."""

    def __init__(self, buf: EpisodeReplayBuffer, rng: random.Random) -> None:
        self.buf = buf
        self.rng = rng
        self.completed: dict[int, int] = {}  # episode -> steps whose append returned
        self.status: dict[int, str] = {}  # episode -> how it ended (if it did)
        self.refusals: list[tuple[int, str]] = []  # appends refused: the episode was evicted

    async def pause(self) -> None:
        for _ in range(self.rng.randint(0, 3)):
            await asyncio.sleep(0)

    async def episode(self, length: int, end: str | None) -> None:
        e = await self.buf.start_episode(self.rng.choice(["a", "b"]))
        self.completed[e] = 0
        for t in range(length):
            await self.pause()
            try:
                await self.buf.append_observation_action_reward(e, *step(e, t))
            except EpisodeStateError as exc:
                self.refusals.append((e, str(exc)))
                return
            self.completed[e] = t + 1
        await self.pause()
        if end is not None:
            try:
                await self.buf.end_episode(e, end, final_observation=final_obs(e, length))
            except EpisodeStateError:
                return
            self.status[e] = "terminated" if end == "COMPLETED" else end

    async def vector(self, envs: int, length: int) -> None:
        """A vectorized environment: ``envs`` episodes, one append_batch per step."""
        ids = [await self.buf.start_episode("vec") for _ in range(envs)]
        for e in ids:
            self.completed[e] = 0
        for t in range(length):
            await self.pause()
            steps = [step(e, t) for e in ids]
            try:
                await self.buf.append_batch(
                    ids,
                    torch.stack([s[0] for s in steps]),
                    torch.stack([s[1] for s in steps]),
                    torch.tensor([s[2] for s in steps]),
                    {k: torch.stack([s[3][k] for s in steps]) for k in ("logp", "flag")},
                )
            except EpisodeStateError:
                return  # one of them was evicted: the whole batch was refused
            for e in ids:
                self.completed[e] = t + 1

    def spawn(self, count: int) -> list[asyncio.Task]:
        tasks = []
        for _ in range(count):
            end = self.rng.choice(["terminated", "truncated", "COMPLETED", None])
            tasks.append(asyncio.create_task(self.episode(self.rng.randint(0, 30), end)))
        tasks.append(asyncio.create_task(self.vector(3, self.rng.randint(1, 20))))
        return tasks

    async def verify(self) -> None:
        """Each episode holds exactly its completed appends, or was evicted; counts agree."""
        evicted = steps = valid = 0
        live: dict[str, int] = {"in_progress": 0, "terminated": 0, "truncated": 0}
        for e, count in self.completed.items():
            try:
                record = await self.buf.get_episode(e)
            except EpisodeStateError as exc:
                self.refusals.append((e, str(exc)))
                evicted += 1
                continue
            status = self.status.get(e, "in_progress")
            live[status] += 1
            assert int(record["length"]) == count, e
            assert record["action"].tolist() == [1000 * e + t for t in range(count)]
            expected_obs = [obs(e, t).tolist() for t in range(count)]
            if status != "in_progress":
                expected_obs.append(final_obs(e, count).tolist())
            assert record["observation"].tolist() == expected_obs
            assert bool(record["terminated"]) == (status == "terminated")
            assert bool(record["truncated"]) == (status == "truncated")
            steps += count
            valid += count if status != "in_progress" else max(count - 1, 0)
        for e, message in self.refusals:
            assert f"episode {e}: it was evicted" in message
        stats = await self.buf.stats()
        assert {k: stats[k] for k in live} == live
        assert stats["episodes"] == sum(live.values())
        assert stats["evicted_episodes"] == evicted
        assert stats["steps"] == steps
        assert stats["valid_steps"] == valid == len(self.buf)


async def consistent_stats(buf: EpisodeReplayBuffer) -> None:
    stats = await buf.stats()
    assert stats["episodes"] == stats["in_progress"] + stats["terminated"] + stats["truncated"]
    assert stats["steps"] >= stats["valid_steps"] == len(buf)
    assert stats["steps"] <= 300
    assert stats["episodes"] <= 16
    assert sum(stats["agents"].values()) == stats["episodes"]


@pytest.mark.timeout(60)
async def test_concurrent_writers_samplers_and_epochs_agree_with_what_writers_recorded(buf):
    writers = Writers(buf, random.Random(1))
    tasks = writers.spawn(24)
    done = asyncio.Event()
    sampled = 0

    async def sampler() -> None:
        nonlocal sampled
        while not done.is_set():
            try:
                batch = await buf.sample_n_step(32, n=(1, 4), gamma=GAMMA)
            except EmptyBufferError:
                await asyncio.sleep(0)
                continue
            check_rows_online(batch)
            sampled += batch.batch_size[0]

    async def sequences() -> None:
        while not done.is_set():
            await buf.wait_for_steps(1)
            batch = await buf.sample_sequences(8, 3, strict=False)
            for b in range(8):
                e, t = int(batch["episode_id"][b, 0]), int(batch["step"][b, 0])
                real = int(batch["mask"][b].sum())
                assert batch["observation"][b, :real, 1].tolist() == list(range(t, t + real))
                assert (batch["episode_id"][b, :real] == e).all()

    async def epochs() -> None:
        while not done.is_set():
            await buf.wait_for_steps(1)
            async for batch in buf.iterate_epochs(16, n=2, gamma=GAMMA):
                check_rows_online(batch)

    async def stats_reader() -> None:
        while not done.is_set():
            await consistent_stats(buf)
            await asyncio.sleep(0)

    readers = [asyncio.create_task(f()) for f in (sampler, sequences, epochs, stats_reader)]
    await asyncio.gather(*tasks)
    done.set()
    await asyncio.gather(*readers)
    assert sampled > 0
    await writers.verify()
    await consistent_stats(buf)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [2, 3, 4])
async def test_cancelled_appenders_leave_exactly_their_completed_steps(buf, seed):
    rng = random.Random(seed)
    writers = Writers(buf, rng)
    tasks = writers.spawn(20)
    cancelled = 0
    while not all(t.done() for t in tasks):
        for _ in range(rng.randint(1, 20)):
            await asyncio.sleep(0)
        running = [t for t in tasks if not t.done()]
        if running and rng.random() < 0.5:
            rng.choice(running).cancel()
            cancelled += 1
        if rng.random() < 0.3:
            await consistent_stats(buf)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    assert cancelled > 0
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) > 0
    await writers.verify()
    # the lock is free and the buffer usable
    e = await asyncio.wait_for(buf.start_episode(), 1)
    await asyncio.wait_for(buf.append_observation_action_reward(e, *step(e, 0)), 1)


@pytest.mark.timeout(60)
async def test_wait_for_steps_wakes_when_data_arrives(buf):
    waiter = asyncio.create_task(buf.wait_for_steps(3))
    e = await buf.start_episode()
    for t in range(3):
        await buf.append_observation_action_reward(e, *step(e, t))
        await asyncio.sleep(0)
        assert not waiter.done()  # t + 1 steps appended: t valid
    await buf.append_observation_action_reward(e, *step(e, 3))
    await asyncio.wait_for(waiter, 1)
    assert len(buf) == 3
    await asyncio.wait_for(buf.wait_for_steps(2), 1)  # already there: returns at once


@pytest.mark.timeout(60)
async def test_wait_for_steps_raises_buffer_closed_on_close(tmp_path):
    buffer = EpisodeReplayBuffer(16, scratch_dir=tmp_path)
    waiters = [asyncio.create_task(buffer.wait_for_steps(k)) for k in (1, 5)]
    await asyncio.sleep(0)
    await buffer.close()
    for waiter in waiters:
        with pytest.raises(BufferClosedError, match="closed while waiting"):
            await asyncio.wait_for(waiter, 1)
    with pytest.raises(BufferClosedError, match="the buffer is closed"):
        await buffer.wait_for_steps(1)
    with pytest.raises(BufferClosedError, match="the buffer is closed"):
        await buffer.stats()


@pytest.mark.timeout(60)
async def test_a_cancelled_waiter_is_forgotten(buf):
    waiter = asyncio.create_task(buf.wait_for_steps(2))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    e = await buf.start_episode()
    for t in range(4):
        await buf.append_observation_action_reward(e, *step(e, t))
    await asyncio.wait_for(buf.wait_for_steps(3), 1)


@pytest.mark.timeout(60)
async def test_a_failing_append_does_not_affect_other_tasks_or_hold_the_lock(buf):
    ids = [await buf.start_episode() for _ in range(4)]
    for e in ids:
        await buf.append_observation_action_reward(e, *step(e, 0))
    failures = []

    async def good(e: int) -> None:
        for t in range(1, 10):
            await asyncio.sleep(0)
            await buf.append_observation_action_reward(e, *step(e, t))

    async def bad(e: int) -> None:
        await asyncio.sleep(0)
        _, a, r, x = step(e, 1)
        try:
            await buf.append_observation_action_reward(e, torch.zeros(7), a, r, x)
        except SchemaError as exc:
            failures.append(str(exc))

    await asyncio.gather(good(ids[0]), bad(ids[1]), good(ids[2]), bad(ids[3]))
    assert len(failures) == 2
    assert all("field 'observation' expected shape [3], got [7]" in f for f in failures)
    stats = await asyncio.wait_for(buf.stats(), 1)
    assert stats["steps"] == 10 + 1 + 10 + 1
    for e, length in zip(ids, (10, 1, 10, 1), strict=True):
        record = await asyncio.wait_for(buf.get_episode(e), 1)
        assert int(record["length"]) == length
    await asyncio.wait_for(buf.append_observation_action_reward(ids[1], *step(ids[1], 1)), 1)


async def _filled(buf: EpisodeReplayBuffer) -> set[tuple[int, int]]:
    """A few ended and running episodes; returns the valid (episode, step) pairs."""
    valid = set()
    for length, end in ((5, "terminated"), (9, None), (3, "truncated"), (12, None)):
        e = await buf.start_episode()
        for t in range(length):
            await buf.append_observation_action_reward(e, *step(e, t))
        if end:
            await buf.end_episode(e, end, final_observation=final_obs(e, length))
        valid |= {(e, t) for t in range(length if end else length - 1)}
    return valid


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("batch_size", "shuffle"), [(7, True), (4, False), (100, True)])
async def test_iterate_epochs_yields_every_valid_step_once_per_epoch(buf, batch_size, shuffle):
    valid = await _filled(buf)
    assert len(buf) == len(valid)
    per_epoch = -(-len(valid) // batch_size)
    batches = [
        b async for b in buf.iterate_epochs(batch_size, 3, n=3, gamma=GAMMA, shuffle=shuffle)
    ]
    assert len(batches) == 3 * per_epoch
    for epoch in range(3):
        seen = [
            (int(e), int(t))
            for b in batches[epoch * per_epoch : (epoch + 1) * per_epoch]
            for e, t in zip(b["episode_id"], b["start_step"], strict=True)
        ]
        assert sorted(seen) == sorted(valid)
    for b in batches:
        check_rows_online(b)


@pytest.mark.timeout(60)
async def test_epochs_with_concurrent_writers_visit_each_valid_step_at_most_once(buf):
    valid_before = await _filled(buf)
    writers = Writers(buf, random.Random(5))
    epochs: list[list[tuple[int, int]]] = []

    async def reader() -> None:
        seen: list[tuple[int, int]] = []
        async for b in buf.iterate_epochs(5, 1, n=2, gamma=GAMMA):
            check_rows_online(b)
            seen += list(zip(b["episode_id"].tolist(), b["start_step"].tolist(), strict=True))
            await asyncio.sleep(0)
        epochs.append(seen)

    tasks = [asyncio.create_task(reader())]
    tasks += [asyncio.create_task(writers.episode(8, None)) for _ in range(3)]
    await asyncio.gather(*tasks)
    (seen,) = epochs
    assert len(seen) == len(set(seen))
    # no eviction happened (300 steps, at most 7 episodes), so every step valid at the start
    # is visited; steps that became valid during the epoch may not be
    assert (await buf.stats())["evicted_episodes"] == 0
    assert valid_before <= set(seen)


@pytest.mark.timeout(60)
async def test_leaving_an_epoch_early_releases_the_buffer(buf):
    await _filled(buf)
    epochs = buf.iterate_epochs(2, 5)
    async for _ in epochs:
        break
    await epochs.aclose()
    e = await asyncio.wait_for(buf.start_episode(), 1)
    await asyncio.wait_for(buf.append_observation_action_reward(e, *step(e, 0)), 1)
    assert (await asyncio.wait_for(buf.sample_n_step(4), 1)).batch_size == (4,)


@pytest.mark.timeout(60)
async def test_closing_mid_epoch_raises_buffer_closed_in_the_reader(tmp_path):
    buffer = EpisodeReplayBuffer(64, scratch_dir=tmp_path, seed=0)
    await _filled(buffer)
    epochs = buffer.iterate_epochs(2, 3)
    await anext(epochs)
    await buffer.close()  # while the next batch is being prepared
    with pytest.raises(BufferClosedError, match="the buffer is closed"):
        await anext(epochs)


async def test_nowait_appends_store_what_awaited_appends_store_and_wake_waiters(tmp_path):
    async with (
        EpisodeReplayBuffer(64, scratch_dir=tmp_path, seed=0) as awaited,
        EpisodeReplayBuffer(64, scratch_dir=tmp_path, seed=0) as nowait,
    ):
        waiter = asyncio.create_task(nowait.wait_for_steps(4))
        await asyncio.sleep(0)
        a, b = await awaited.start_episode(), await nowait.start_episode()
        for t in range(5):
            await awaited.append_observation_action_reward(a, *step(a, t))
            nowait.append_observation_action_reward_nowait(b, *step(b, t))
        await awaited.append_batch([a], *batch_of([step(a, 5)]))
        nowait.append_batch_nowait([b], *batch_of([step(b, 5)]))
        await asyncio.wait_for(waiter, 1)  # woken by a nowait append, not by polling
        for buffer, e in ((awaited, a), (nowait, b)):
            await buffer.end_episode(e, "terminated", final_observation=final_obs(e, 6))
        one, two = await awaited.get_episode(a), await nowait.get_episode(b)
        for key in one.keys(include_nested=True, leaves_only=True):
            assert torch.equal(one[key], two[key]), key


async def test_nowait_appends_refuse_a_closed_buffer_and_bad_input_like_the_coroutines(tmp_path):
    buffer = EpisodeReplayBuffer(16, scratch_dir=tmp_path)
    e = await buffer.start_episode()
    buffer.append_observation_action_reward_nowait(e, *step(e, 0))
    with pytest.raises(SchemaError, match="field 'observation' expected shape"):
        buffer.append_observation_action_reward_nowait(e, torch.zeros(5), *step(e, 1)[1:])
    assert len(buffer) == 0
    assert (await buffer.stats())["steps"] == 1
    await buffer.close()
    with pytest.raises(BufferClosedError):
        buffer.append_observation_action_reward_nowait(e, *step(e, 1))


async def test_awaited_writes_yield_to_other_tasks_once_every_write_budget_calls(buf):
    """Per-step writes yield on a budget (a yield costs more than an append), so a collector
    awaiting appends back to back still lets other tasks run, WRITE_BUDGET calls apart."""
    turns = 0
    running = True

    async def ticker() -> None:
        nonlocal turns
        while running:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    e = await buf.start_episode()
    calls = 4 * WRITE_BUDGET
    before = turns
    for t in range(calls):
        await buf.append_observation_action_reward(e, *step(e, t))
    ran = turns - before
    running = False
    await task
    assert calls // WRITE_BUDGET - 1 <= ran <= calls // WRITE_BUDGET + 1
    assert (await buf.stats())["steps"] == calls
    for _ in range(WRITE_BUDGET):  # bad input raises alike whether or not the call yields
        with pytest.raises(SchemaError, match="field 'observation' expected shape"):
            await buf.append_observation_action_reward(e, torch.zeros(5), *step(e, 1)[1:])
    assert (await buf.stats())["steps"] == calls
