"""``append_steps`` (the sync buffer's and the asyncio facade's) against the per-step appends
it stands for."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import EpisodeReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    CapacityError,
    EpisodeStateError,
    ReplayBufError,
    SchemaError,
)

OBS = 3


def _rows(episode: int, first: int, count: int, torch_inputs: bool):
    """Steps ``first .. first + count`` of ``episode``: values that name their episode and step."""
    t = np.arange(first, first + count, dtype=np.float32)
    obs = np.stack([np.full(count, episode, np.float32), t, -t], axis=1)
    action = (1000 * episode + t).astype(np.float32)[:, None]
    reward = ((7 * episode + 3 * t) % 9 - 4).astype(np.float32) / 4
    if torch_inputs:
        return torch.from_numpy(obs), torch.from_numpy(action), torch.from_numpy(reward)
    return obs, action, reward


def _feed(buf: SyncEpisodeReplayBuffer, layout, chunked: bool) -> None:
    """Episodes of ``layout``: per episode (chunk sizes, how it ends, whether a second episode
    runs beside it with per-step appends); chunks through append_steps or step by step."""
    for index, (chunks, ending, beside) in enumerate(layout):
        episode = buf.start_episode()
        other = buf.start_episode("beside") if beside else None
        t = 0
        for size in chunks:
            obs, action, reward = _rows(episode, t, size, torch_inputs=index % 2 == 1)
            if chunked:
                buf.append_steps(episode, obs, action, reward)
            else:
                for i in range(size):
                    buf.append_observation_action_reward(episode, obs[i], action[i], reward[i])
            if other is not None and other not in buf._core.episodes:
                other = None  # evicted (the oldest episode in progress) to make room
            if other is not None:
                o, a, r = _rows(other, t, 1, False)
                buf.append_observation_action_reward(other, o[0], a[0], r[0])
            t += size
        if other is not None and other in buf._core.episodes:
            buf.end_episode(other, "truncated", np.full(OBS, -1, np.float32))
        if ending is not None:
            buf.end_episode(episode, ending, np.full(OBS, episode, np.float32))


layouts = st.lists(
    st.tuples(
        st.lists(st.integers(1, 40), min_size=1, max_size=5),
        st.sampled_from([None, "terminated", "truncated"]),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(layout=layouts, max_steps=st.sampled_from([64, 200, 2000]))
def test_append_steps_leaves_what_per_step_appends_leave(make_episode_buffer, layout, max_steps):
    # Bit for bit: rows, links, free rows, counters and seeded draws, evicting or not (small
    # buffers evict on the way, and a chunk may meet a full stager).
    chunked, stepped = (make_episode_buffer(max_steps, 12, storage="tensor", seed=5) for _ in "ab")
    outcomes = []
    for buf, chunk in ((chunked, True), (stepped, False)):
        try:
            _feed(buf, layout, chunk)
            outcomes.append(None)
        except (CapacityError, EpisodeStateError) as exc:  # evicted, or longer than the buffer
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]
    if outcomes[0] is CapacityError or len(stepped) == 0:
        # A refused chunk appends none of its steps; the per-step path stops at the step
        # that does not fit (the error test below).
        return
    a, b = chunked.sample_n_step(64, n=2), stepped.sample_n_step(64, n=2)
    assert chunked.stats() == stepped.stats()
    assert (a == b).all()
    for name in ("next_row", "succ", "episode", "step", "end_kind", "alloc"):
        assert torch.equal(getattr(chunked._core.links, name), getattr(stepped._core.links, name))
    assert list(chunked._core.free) == list(stepped._core.free)
    assert torch.equal(chunked._core.anchors.rows, stepped._core.anchors.rows)


@pytest.mark.parametrize("max_steps", [1500, 20_000], ids=["evicting", "full-stager"])
def test_append_steps_through_a_full_stager_and_evictions(make_episode_buffer, max_steps):
    # Thousands of steps: episodes are evicted mid-chunk (1,500 steps kept), or the stager
    # (4,096 rows of these fields) fills mid-chunk and is flushed (nothing evicted).
    chunked, stepped = (make_episode_buffer(max_steps, 40, storage="tensor") for _ in "ab")
    layout = [([300, 700, 5], "terminated", False)] * 6 + [([999], None, True)]
    _feed(chunked, layout, True)
    _feed(stepped, layout, False)
    assert chunked.stats() == stepped.stats()
    assert (chunked.stats()["evicted_episodes"] > 0) == (max_steps == 1500)
    assert (chunked.sample_n_step(300, n=3) == stepped.sample_n_step(300, n=3)).all()
    for name in ("next_row", "succ", "episode", "step", "end_kind", "alloc"):
        assert torch.equal(getattr(chunked._core.links, name), getattr(stepped._core.links, name))


def test_append_steps_first_steps_fix_the_fields(make_episode_buffer):
    buf = make_episode_buffer(100, 10)
    episode = buf.start_episode()
    buf.append_steps(episode, *_rows(episode, 0, 5, False))
    buf.end_episode(episode, "terminated", np.zeros(OBS, np.float32))
    assert len(buf) == 5
    assert buf.spec[("observation",)].shape == (OBS,)
    got = buf.get_episode(episode)
    assert torch.equal(got["observation"][:5, 1], torch.arange(5, dtype=torch.float32))


def test_append_steps_converts_what_the_per_step_path_converts(make_episode_buffer):
    buf = make_episode_buffer(100, 10)
    episode = buf.start_episode()
    buf.append_steps(episode, *_rows(episode, 0, 2, False))
    obs, action, reward = _rows(episode, 2, 3, False)
    buf.append_steps(episode, obs.tolist(), torch.from_numpy(action), reward.tolist())
    got = buf.get_episode(episode)
    assert torch.equal(got["observation"][:5, 1], torch.arange(5, dtype=torch.float32))


@pytest.mark.parametrize(
    ("change", "error", "names"),
    [
        (lambda o, a, r: (o, a, r[:, None]), ArgumentError, "rewards"),
        (lambda o, a, r: (o, a, r[:0]), ArgumentError, "rewards"),
        (lambda o, a, r: (o, a, 1.5), ArgumentTypeError, "rewards"),
        (lambda o, a, r: (o[:2], a, r), SchemaError, "observation"),
        (lambda o, a, r: (o, a[:, :0], r), SchemaError, "action"),
        (lambda o, a, r: (o[:, :2], a, r), SchemaError, "observation"),
    ],
)
def test_append_steps_refuses_bad_input_and_changes_nothing(
    make_episode_buffer, change, error, names
):
    buf = make_episode_buffer(100, 10)
    episode = buf.start_episode()
    buf.append_steps(episode, *_rows(episode, 0, 2, False))
    before = buf.stats()
    with pytest.raises(error, match=names) as raised:
        buf.append_steps(episode, *change(*_rows(episode, 2, 3, False)))
    assert isinstance(raised.value, ReplayBufError)
    assert buf.stats() == before
    buf.append_steps(episode, *_rows(episode, 2, 3, False))  # still appends where it was
    assert buf.stats()["steps"] == 5


def test_append_steps_refuses_an_unknown_ended_or_oversized_episode(make_episode_buffer):
    buf = make_episode_buffer(10, 4)
    episode = buf.start_episode()
    with pytest.raises(EpisodeStateError, match="unknown"):
        buf.append_steps(episode + 7, *_rows(episode, 0, 2, False))
    with pytest.raises(CapacityError, match="max_steps"):
        buf.append_steps(episode, *_rows(episode, 0, 11, False))
    assert buf.stats()["steps"] == 0  # nothing of the refused call stayed
    buf.append_steps(episode, *_rows(episode, 0, 10, False))
    buf.end_episode(episode, "terminated", np.zeros(OBS, np.float32))
    with pytest.raises(EpisodeStateError, match="ended"):
        buf.append_steps(episode, *_rows(episode, 10, 1, False))


def test_append_steps_with_extras_stores_what_per_step_appends_store(make_episode_buffer):
    chunked, stepped = (make_episode_buffer(200, 10, storage="tensor") for _ in "ab")
    for buf in (chunked, stepped):
        episode = buf.start_episode()
        obs, action, reward = _rows(episode, 0, 6, False)
        logp = np.linspace(-1, 0, 6, dtype=np.float32)
        flag = np.arange(12, dtype=np.int64).reshape(6, 2)
        if buf is chunked:
            buf.append_steps(episode, obs, action, reward, extras={"logp": logp, "flag": flag})
        else:
            for i in range(6):
                extras = {"logp": logp[i, ...], "flag": flag[i]}
                buf.append_observation_action_reward(episode, obs[i], action[i], reward[i], extras)
        buf.end_episode(episode, "truncated", np.zeros(OBS, np.float32))
    assert chunked.stats() == stepped.stats()
    assert (chunked.get_episode(0) == stepped.get_episode(0)).all()
    assert (chunked.sample_n_step(32, n=2) == stepped.sample_n_step(32, n=2)).all()


async def test_async_append_steps_stores_what_the_sync_call_stores(tmp_path):
    # The asyncio facade's append_steps is the sync core's, run atomically on the event loop.
    facade = EpisodeReplayBuffer(200, 8, storage="tensor", scratch_dir=tmp_path, seed=3)
    plain = SyncEpisodeReplayBuffer(200, 8, storage="tensor", scratch_dir=tmp_path, seed=3)
    try:
        for size in (5, 17, 1):
            episode = await facade.start_episode()
            assert plain.start_episode() == episode
            obs, action, reward = _rows(episode, 0, size, torch_inputs=size % 2 == 1)
            await facade.append_steps(episode, obs, action, reward)
            plain.append_steps(episode, obs, action, reward)
            final = np.full(OBS, episode, np.float32)
            await facade.end_episode(episode, "terminated", final)
            plain.end_episode(episode, "terminated", final)
        assert await facade.stats() == plain.stats()
        assert (await facade.sample_n_step(32, n=3) == plain.sample_n_step(32, n=3)).all()
        episode = await facade.start_episode()
        assert plain.start_episode() == episode
        obs, action, reward = _rows(episode, 0, 3, torch_inputs=False)
        with pytest.raises(SchemaError, match="observation"):  # refused whole, as in sync
            await facade.append_steps(episode, obs[:, :2], action, reward)
        assert await facade.stats() == plain.stats()
    finally:
        await facade.close()
        plain.close()


async def test_cancelled_async_append_steps_appends_all_steps_or_none(tmp_path):
    facade = EpisodeReplayBuffer(2000, 64, storage="tensor", scratch_dir=tmp_path, seed=0)
    try:
        episodes = [await facade.start_episode() for _ in range(24)]
        tasks = [
            asyncio.ensure_future(facade.append_steps(e, *_rows(e, 0, 7, torch_inputs=False)))
            for e in episodes
        ]
        await asyncio.sleep(0)  # each task runs to its first cancellation point, or completes
        for task in tasks:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = [isinstance(outcome, asyncio.CancelledError) for outcome in done]
        assert any(cancelled)  # both outcomes happened
        assert not all(cancelled)
        stored = await facade.stats()
        assert stored["steps"] == 7 * cancelled.count(False)
        for episode, was_cancelled in zip(episodes, cancelled, strict=True):
            if not was_cancelled:
                assert (await facade.get_episode(episode))["observation"].shape[0] == 7
    finally:
        await facade.close()
