"""ARES's episode replay buffer API (``replaybuf.compat.ares``) against a slow reference.

Observation t of episode k is ``{"k": k, "t": t}`` (any JSON-like value would do), its action
``["act", t]`` and its reward :func:`reward`; the final observation is ``{"k": k, "end": T}``.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf import EpisodeStateError, ReplayBufError
from replaybuf.compat.ares import (
    EpisodeReplayBuffer,
    EpisodeStatus,
    ReplaySample,
    compute_discounted_return,
)


def reward(k: int, t: int) -> float:
    return ((3 * k + t) % 5 - 2) / 2


def obs(k: int, t: int) -> Any:
    return {"k": k, "t": t}


class Model:
    """Each episode's steps, how it ended and its agent: what samples must agree with."""

    def __init__(self) -> None:
        self.k: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.status: dict[str, str] = {}
        self.agent: dict[str, str] = {}


async def play(buf: EpisodeReplayBuffer, program: list[tuple[int, int]]) -> Model:
    model = Model()
    running: list[str] = []
    for op, i in program:
        if op == 0 or not running:
            k = len(model.k)
            e = await buf.start_episode(f"agent{k % 3}")
            model.k[e], model.steps[e], model.status[e] = k, 0, "IN_PROGRESS"
            model.agent[e] = f"agent{k % 3}"
            running.append(e)
        elif op == 1:
            e = running[i % len(running)]
            k, t = model.k[e], model.steps[e]
            if await evicted(
                buf.append_observation_action_reward(e, obs(k, t), ["act", t], reward(k, t))
            ):
                running.remove(e)  # max_episodes evicts the oldest in progress too, as ARES does
                continue
            model.steps[e] += 1
        else:
            e = running.pop(i % len(running))
            status = "COMPLETED" if i % 2 else "TRUNCATED"
            k = model.k[e]
            if not await evicted(buf.end_episode(e, status, {"k": k, "end": model.steps[e]})):
                model.status[e] = status
    return model


async def evicted(call: Any) -> bool:
    """Run ``call``; whether it named an episode the buffer has evicted (and so refused)."""
    try:
        await call
    except EpisodeStateError as exc:
        if "not found" not in str(exc):
            raise
        return True
    return False


def check(sample: ReplaySample, model: Model, n: int, gamma: float) -> None:
    e = sample.episode_id
    k, steps, status = model.k[e], model.steps[e], model.status[e]
    last = steps if status != "IN_PROGRESS" else steps - 1  # the last observation stored
    t, m = sample.start_step, sample.actual_n
    assert sample.agent_id == model.agent[e]
    assert 0 <= t < last
    assert m == min(n, last - t)
    assert sample.obs_t == obs(k, t)
    assert sample.action_t == ["act", t]
    assert sample.rewards_seq == [reward(k, t + j) for j in range(m)]
    ends = t + m == steps and status != "IN_PROGRESS"
    assert sample.next_obs == ({"k": k, "end": steps} if ends else obs(k, t + m))
    assert sample.terminal == (ends and status == "COMPLETED")
    assert sample.next_discount == (0.0 if sample.terminal else gamma**m)
    assert sample.discount_powers == [gamma**j for j in range(m)]
    assert math.isclose(sample.reward, sum(gamma**j * r for j, r in enumerate(sample.rewards_seq)))


programs = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), min_size=1, max_size=80)


@settings(max_examples=40, deadline=None)
@given(
    program=programs,
    n=st.integers(1, 4),
    gamma=st.sampled_from([0.5, 0.9, 1.0]),
    limits=st.sampled_from([(None, None), (None, 3), (20, None), (20, 3)]),
)
def test_samples_agree_with_the_reference_over_random_layouts(
    program: list[tuple[int, int]], n: int, gamma: float, limits: tuple[int | None, int | None]
) -> None:
    async def run() -> None:
        max_steps, max_episodes = limits
        buf = EpisodeReplayBuffer(max_episodes=max_episodes, max_steps=max_steps)
        model = await play(buf, program)
        samples = await buf.sample_n_step(64, n, gamma)
        keys = [(s.episode_id, s.start_step) for s in samples]
        assert len(keys) == len(set(keys)), "drawn without replacement"
        for sample in samples:
            check(sample, model, n, gamma)
        stats = await buf.get_stats()
        if max_steps is None and max_episodes is None:  # nothing evicted: every valid step
            valid = sum(
                s if model.status[e] != "IN_PROGRESS" else max(s - 1, 0)
                for e, s in model.steps.items()
            )
            assert len(samples) == min(64, valid)
            assert stats["total_episodes"] == len(model.k)
            assert stats["total_steps"] == sum(model.steps.values())
            assert stats["in_progress"] == sum(s == "IN_PROGRESS" for s in model.status.values())
            assert stats["num_agents"] == len(set(model.agent.values()))
        if max_episodes is not None:
            assert stats["total_episodes"] <= max_episodes
        if max_steps is not None:
            assert stats["total_steps"] <= max_steps
        buf.close()

    asyncio.run(run())


@pytest.mark.asyncio
async def test_aress_own_example_observations_and_string_ids() -> None:
    buf = EpisodeReplayBuffer()
    e = await buf.start_episode("agent-0")
    uuid.UUID(e)  # a uuid string
    await buf.append_observation_action_reward(e, {"obs": [1, 2, 3]}, 0, 1.0)
    await buf.append_observation_action_reward(e, {"obs": [4, 5, 6]}, 1, 0.5)
    await buf.end_episode(e, EpisodeStatus.COMPLETED, {"obs": [7, 8, 9]})
    samples = await buf.sample_n_step(10, n=2, gamma=0.5)
    by_start = {s.start_step: s for s in samples}
    assert by_start[0].obs_t == {"obs": [1, 2, 3]}
    assert by_start[0].rewards_seq == [1.0, 0.5]
    assert by_start[0].reward == 1.25 == compute_discounted_return([1.0, 0.5], 0.5)
    assert by_start[0].terminal
    assert by_start[1].next_obs == {"obs": [7, 8, 9]}
    with pytest.raises(AttributeError):
        by_start[0].reward_seq = []  # type: ignore[attr-defined]  # frozen
    buf.close()


@pytest.mark.asyncio
async def test_errors_are_aress_value_errors_in_its_words() -> None:
    buf = EpisodeReplayBuffer()
    e = await buf.start_episode("a")
    with pytest.raises(ValueError, match="Episode nope not found"):
        await buf.append_observation_action_reward("nope", 1, 1, 1.0)
    with pytest.raises(ValueError, match="Cannot end episode with status IN_PROGRESS"):
        await buf.end_episode(e, EpisodeStatus.IN_PROGRESS, None)
    await buf.append_observation_action_reward(e, "o", "a", 1.0)
    await buf.end_episode(e, "COMPLETED", "end")
    with pytest.raises(ValueError, match=f"Cannot append to finished episode {e}"):
        await buf.append_observation_action_reward(e, "o", "a", 1.0)
    with pytest.raises(ValueError, match=f"Episode {e} is already finished"):
        await buf.end_episode(e, "TRUNCATED", "end")
    for n, gamma in ((0, 0.9), (1, 0.0), (1, 1.5)):
        with pytest.raises(ValueError, match=r"n must be >= 1|gamma must be in"):
            await buf.sample_n_step(4, n, gamma)
    with pytest.raises(ReplayBufError):  # and in replaybuf's hierarchy
        await buf.end_episode("nope", "COMPLETED", None)
    with pytest.raises(EpisodeStateError):
        await buf.end_episode(e, "COMPLETED", None)
    buf.close()


@pytest.mark.asyncio
async def test_nothing_valid_samples_an_empty_list() -> None:
    buf = EpisodeReplayBuffer()
    assert await buf.sample_n_step(8) == []
    e = await buf.start_episode("a")
    await buf.append_observation_action_reward(e, "only", 0, 1.0)  # no next observation yet
    assert await buf.sample_n_step(8) == []
    await buf.append_observation_action_reward(e, "second", 0, 1.0)
    (sample,) = await buf.sample_n_step(8, n=3)
    # ARES raises IndexError for a window reaching an in-progress episode's last observation
    assert sample.next_obs == "second"
    assert sample.actual_n == 1
    assert not sample.terminal
    buf.close()


@pytest.mark.asyncio
async def test_eviction_drops_the_oldest_finished_episode_and_its_id() -> None:
    buf = EpisodeReplayBuffer(max_episodes=2)
    a = await buf.start_episode("x")
    await buf.end_episode(a, "COMPLETED", "a")
    b = await buf.start_episode("x")
    c = await buf.start_episode("x")  # evicts a, the oldest finished
    with pytest.raises(ValueError, match=f"Episode {a} not found"):
        await buf.end_episode(a, "COMPLETED", "a")
    assert (await buf.get_stats())["total_episodes"] == 2
    await buf.end_episode(b, "TRUNCATED", "b")
    await buf.end_episode(c, "TRUNCATED", "c")
    buf.close()


@pytest.mark.asyncio
async def test_unlimited_storage_grows_and_keeps_every_step() -> None:
    buf = EpisodeReplayBuffer(max_steps=None)
    tasks = []

    async def agent(k: int) -> None:
        e = await buf.start_episode(f"agent{k}")
        for t in range(300):
            await buf.append_observation_action_reward(e, obs(k, t), ["act", t], reward(k, t))
            await asyncio.sleep(0)
        await buf.end_episode(e, "COMPLETED", {"k": k, "end": 300})

    tasks = [asyncio.create_task(agent(k)) for k in range(8)]
    await asyncio.gather(*tasks)
    stats = await buf.get_stats()
    assert stats["total_steps"] == 2400
    assert stats["completed"] == 8
    assert len(await buf.sample_n_step(5000)) == 2400  # every step, each once
    await buf.clear()
    assert (await buf.get_stats())["total_episodes"] == 0
    buf.close()
