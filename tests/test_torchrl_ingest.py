"""TorchRL collector batches written into episode buffers by ``CollectorWriter``.

Real collectors on CartPole (one env, a ``SerialEnv`` of two, a two-worker
``MultiSyncCollector``) produce batches; every stored episode is checked step by step against
the trajectories the batches hold, grouped by ``("collector", "traj_ids")``.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from tensordict import TensorDict

from replaybuf import EpisodeReplayBuffer, SchemaError, SyncEpisodeReplayBuffer
from replaybuf.integrations.torchrl import CollectorWriter

pytest.importorskip("gymnasium")
collectors = pytest.importorskip("torchrl.collectors")
envs = pytest.importorskip("torchrl.envs")

Collector = getattr(collectors, "Collector", None) or collectors.SyncDataCollector
MultiSyncCollector = (
    getattr(collectors, "MultiSyncCollector", None) or collectors.MultiSyncDataCollector
)
MAX_STEPS = 20  # StepCounter truncates here; random CartPole episodes also terminate before
TRAJ = {"traj": ("collector", "traj_ids")}  # stored with each step: the test's ground truth


def make_env():
    """CartPole with a 20-step time limit: batches hold terminated and truncated episodes."""
    return envs.TransformedEnv(envs.GymEnv("CartPole-v1"), envs.StepCounter(max_steps=MAX_STEPS))


def collect(collector) -> list[TensorDict]:
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


@pytest.fixture(scope="module")
def single_env_batches() -> list[TensorDict]:
    """Flat ``[T]`` batches of one env; 37 frames per batch, so episodes span batches."""
    torch.manual_seed(0)
    env = make_env()
    env.set_seed(0)
    return collect(Collector(env, None, frames_per_batch=37, total_frames=37 * 6))


@pytest.fixture(scope="module")
def two_env_batches() -> list[TensorDict]:
    """``[2, T]`` batches of a ``SerialEnv`` of two CartPoles."""
    torch.manual_seed(1)
    env = envs.SerialEnv(2, make_env)
    env.set_seed(1)
    return collect(Collector(env, None, frames_per_batch=50, total_frames=50 * 4))


@pytest.fixture
def buffer(tmp_path):
    with SyncEpisodeReplayBuffer(10_000, scratch_dir=tmp_path, seed=0) as buf:
        yield buf


def trajectories(batches: list[TensorDict]) -> dict[int, TensorDict]:
    """Each trajectory's steps in time order: batches joined along time, grouped by id."""
    steps = torch.cat(batches, dim=-1).reshape(-1)
    ids = steps["collector", "traj_ids"]
    return {int(t): steps[ids == t] for t in ids.unique()}


def check_episodes(buf: SyncEpisodeReplayBuffer, batches: list[TensorDict], finished: bool):
    """Every step stored once, in the episode of its trajectory, with its obs/action/reward;
    episodes end where the trajectory does, with its last ("next", "observation") as final."""
    expected = trajectories(batches)
    stats = buf.stats()
    assert stats["steps"] == sum(b.numel() for b in batches)
    assert stats["episodes"] == len(expected)
    seen = set()
    for episode_id in range(stats["episodes"]):
        record = buf.get_episode(episode_id)
        traj = int(record["traj"][0])
        assert (record["traj"] == traj).all()
        assert traj not in seen
        seen.add(traj)
        steps = expected[traj]
        assert torch.equal(record["action"], steps["action"])
        assert torch.equal(record["reward"], steps["next", "reward"].squeeze(-1))
        ended = bool(steps["next", "done"][-1])
        if ended or finished:
            final = steps["next", "observation"][-1:]
            assert torch.equal(record["observation"], torch.cat([steps["observation"], final]))
            terminated = bool(steps["next", "terminated"][-1])
            assert bool(record["terminated"]) == terminated
            assert bool(record["truncated"]) == (not terminated)
        else:
            assert torch.equal(record["observation"], steps["observation"])
            assert not record["terminated"]
            assert not record["truncated"]
    assert seen == set(expected)
    return stats


def test_single_env_batches_land_once_split_on_done(buffer, single_env_batches):
    writer = CollectorWriter(buffer, extras=TRAJ)
    written = [writer.write(batch) for batch in single_env_batches]
    assert written == [37] * 6
    stats = check_episodes(buffer, single_env_batches, finished=False)
    assert stats["terminated"] > 0
    assert stats["truncated"] > 0
    assert stats["in_progress"] == 1
    assert writer.finish() == 1
    assert writer.open_episodes == {}
    check_episodes(buffer, single_env_batches, finished=True)
    assert len(buffer) == sum(b.numel() for b in single_env_batches)


def test_two_env_batches_continue_episodes_across_batches(buffer, two_env_batches):
    assert two_env_batches[0].batch_size == torch.Size([2, 25])
    ids = [set(b["collector", "traj_ids"].unique().tolist()) for b in two_env_batches]
    assert any(a & b for a, b in itertools.pairwise(ids))  # episodes span batches
    writer = CollectorWriter(buffer, extras=TRAJ)
    for batch in two_env_batches:
        writer.write(batch)
        assert len(writer.open_episodes) <= 2  # at most one running episode per env
    check_episodes(buffer, two_env_batches, finished=False)
    writer.finish()
    check_episodes(buffer, two_env_batches, finished=True)


def test_without_trajectory_ids_each_env_row_is_a_stream(buffer, two_env_batches):
    writer = CollectorWriter(buffer, trajectory_key=("collector", "absent"), extras=TRAJ)
    for batch in two_env_batches:
        writer.write(batch)
    assert set(writer.open_episodes) <= {("stream", 0), ("stream", 1)}
    writer.finish()
    check_episodes(buffer, two_env_batches, finished=True)  # the same episodes as with ids


def test_padding_steps_marked_by_the_mask_are_skipped(buffer, single_env_batches):
    batch = single_env_batches[0].clone()
    mask = torch.ones(batch.shape, dtype=torch.bool)
    mask[-5:] = False
    batch.set(("collector", "mask"), mask)
    assert CollectorWriter(buffer).write(batch) == 32
    assert buffer.stats()["steps"] == 32


async def test_async_buffer_gets_the_same_episodes(tmp_path, two_env_batches):
    async with EpisodeReplayBuffer(10_000, scratch_dir=tmp_path, seed=0) as buf:
        writer = CollectorWriter(buf, extras=TRAJ)
        for batch in two_env_batches:
            await writer.awrite(batch)
        running = len(writer.open_episodes)
        assert running > 0
        assert await writer.afinish() == running
        assert writer.open_episodes == {}
        check_episodes(buf.sync, two_env_batches, finished=True)
        with pytest.raises(TypeError, match=r"use await writer\.awrite"):
            writer.write(two_env_batches[0])


def run_multisync() -> list[TensorDict]:
    torch.manual_seed(2)
    collector = MultiSyncCollector(
        [make_env, make_env], None, frames_per_batch=60, total_frames=180
    )
    collector.set_seed(2)
    return collect(collector)


@pytest.mark.slow
@pytest.mark.skipif(
    bool(os.environ.get("REPLAYBUF_SKIP_MULTIPROCESS_TESTS")),
    reason="spawns two collector workers (10-30 s on a 2-core machine); "
    "REPLAYBUF_SKIP_MULTIPROCESS_TESTS is set",
)
def test_multisync_collector_batches(buffer):
    threads = torch.get_num_threads()
    try:
        batches = run_multisync()
    finally:
        torch.set_num_threads(threads)  # the collector lowers it for its workers
    assert batches[0].batch_size == torch.Size([2, 30])
    writer = CollectorWriter(buffer, extras=TRAJ)
    for batch in batches:
        writer.write(batch)
    writer.finish()
    stats = check_episodes(buffer, batches, finished=True)
    assert stats["steps"] == 180


# ----------------------------------------------------------------- bad input
def fake_batch(envs_: int = 2, steps: int = 4, **changes) -> TensorDict:
    """A ``[envs, steps]`` batch in the collector layout, one trajectory per env."""
    shape = (envs_, steps)
    td = TensorDict(
        {
            "observation": torch.randn(*shape, 3),
            "action": torch.randint(0, 2, shape),
            "collector": {"traj_ids": torch.arange(envs_).unsqueeze(1).expand(shape).clone()},
            "next": {
                "observation": torch.randn(*shape, 3),
                "reward": torch.ones(*shape, 1),
                "done": torch.zeros(*shape, 1, dtype=torch.bool),
                "terminated": torch.zeros(*shape, 1, dtype=torch.bool),
                "truncated": torch.zeros(*shape, 1, dtype=torch.bool),
            },
        },
        batch_size=shape,
    )
    for key, value in changes.items():
        td.set(tuple(key.split(".")), value)
    return td


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {
                "observation": torch.zeros(2, 4, 3).double(),
                "next.observation": torch.zeros(2, 4, 3).double(),
            },
            SchemaError,
            "field 'observation' expected dtype torch.float32, got torch.float64",
        ),
        ({"action": torch.zeros(2, 4, 2)}, SchemaError, "field 'action' expected shape \\[\\]"),
        ({"next.done": torch.zeros(2, 4, 1)}, TypeError, "done flag .* expected a bool tensor"),
        (
            {"collector.traj_ids": torch.zeros(2, 4, dtype=torch.long)},
            ValueError,
            "trajectory 0 has two steps at time index 0",
        ),
        ({"next.observation": torch.zeros(2, 4, 2)}, ValueError, "next observation expected"),
    ],
)
def test_a_bad_batch_raises_and_writes_nothing(buffer, changes, error, match):
    writer = CollectorWriter(buffer)
    writer.write(fake_batch())  # fixes the spec; both trajectories stay open
    before, running = buffer.stats(), writer.open_episodes
    with pytest.raises(error, match=match):
        writer.write(fake_batch(**changes))
    assert buffer.stats() == before
    assert writer.open_episodes == running


def test_a_missing_key_is_named(buffer):
    with pytest.raises(KeyError, match="action_key 'act' is not in the batch"):
        CollectorWriter(buffer, action_key="act").write(fake_batch())
    batch = fake_batch().exclude(("next", "done"), ("next", "terminated"), ("next", "truncated"))
    with pytest.raises(KeyError, match="none of the end flags"):
        CollectorWriter(buffer).write(batch)
    assert buffer.stats()["episodes"] == 0


def test_constructor_arguments_are_checked(buffer, make_buffer):
    with pytest.raises(TypeError, match="buffer must be a SyncEpisodeReplayBuffer"):
        CollectorWriter(make_buffer())
    with pytest.raises(ValueError, match="extras name 'reward' collides"):
        CollectorWriter(buffer, extras={"reward": "x"})
    with pytest.raises(TypeError, match="observation_key must be a str or a tuple"):
        CollectorWriter(buffer, observation_key=3)
    with pytest.raises(ValueError, match="status must be 'terminated' or 'truncated'"):
        CollectorWriter(buffer).finish("done")


def test_only_done_means_terminated_and_truncated_alone_means_truncated(buffer):
    done = torch.zeros(1, 3, 1, dtype=torch.bool)
    done[0, 2] = True
    writer = CollectorWriter(buffer, terminated_key="none", truncated_key="none")
    writer.write(fake_batch(1, 3, **{"next.done": done}))
    writer = CollectorWriter(buffer, done_key="none", terminated_key="none")
    writer.write(fake_batch(1, 3, **{"next.truncated": done}))
    assert [buffer.get_episode(i)["terminated"].item() for i in (0, 1)] == [True, False]
    assert buffer.get_episode(1)["truncated"].item()


def test_a_running_episode_the_buffer_lost_continues_in_a_new_one(buffer, two_env_batches):
    writer = CollectorWriter(buffer, extras=TRAJ)
    writer.write(two_env_batches[0])
    before = writer.open_episodes
    buffer.clear()  # drops the running episodes too
    assert writer.write(two_env_batches[1]) == 50
    continued = {int(t) for t in two_env_batches[1]["collector", "traj_ids"][:, 0]} & set(before)
    assert continued  # trajectories running at the clear went on in batch 1
    writer.finish()
    episodes = {int(r["traj"][0]): r for r in buffer.sample_episodes(1_000)}
    for traj in continued:  # its batch-1 steps, in a new episode
        assert int(episodes[traj]["episode_id"]) not in before.values()
        assert int(episodes[traj]["length"]) == int(
            (two_env_batches[1]["collector", "traj_ids"] == traj).sum()
        )
    assert buffer.stats()["steps"] == 50
    assert buffer.stats()["in_progress"] == 0


def test_finish_skips_episodes_the_buffer_no_longer_holds(buffer, two_env_batches):
    writer = CollectorWriter(buffer)
    writer.write(two_env_batches[0])
    assert writer.open_episodes
    buffer.clear()
    assert writer.finish() == 0
    assert writer.open_episodes == {}
