"""state_dict() / load_state_dict(): the whole buffer in memory, the same content a checkpoint
holds, restored so that a buffer continues exactly where the saved one would have."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from episode_helpers import action, extras, final_obs, obs, reward
from test_episode_checkpoint import fill, same_contents

from replaybuf import (
    CheckpointKindError,
    CorruptCheckpointError,
    EpisodeReplayBuffer,
    MetadataError,
    ReplayBuffer,
    SyncEpisodeReplayBuffer,
)
from replaybuf.persist.format import read_checkpoint


def ring(prioritized: bool = False, **kwargs) -> ReplayBuffer:
    buf = ReplayBuffer("cpu", "cpu", 40, seed=3, prioritized=prioritized, **kwargs)
    for k in range(55):  # wraps: the ring's pointer and its oldest rows matter
        buf.add({"obs": torch.full((3,), float(k)), "act": k, "nested": {"x": -k}})
    if prioritized:
        buf.update_priorities(torch.arange(20, 40), torch.linspace(0.1, 5.0, 20))
    return buf


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].cpu(), b[name].cpu()), name


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_ring_state_is_what_its_checkpoint_holds(tmp_path: Path, prioritized: bool) -> None:
    with ring(prioritized) as buf:
        state = buf.state_dict()
        buf.save_checkpoint(tmp_path / "ck")
        with read_checkpoint(tmp_path / "ck", "ReplayBuffer") as checkpoint:
            assert state["kind"] == checkpoint.kind
            assert state["meta"] == checkpoint.meta
            same_tensors(state["tensors"], {n: checkpoint.load(n) for n in checkpoint.tensors})


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_ring_continues_from_its_state_in_another_buffer(prioritized: bool) -> None:
    with ring(prioritized) as buf, ReplayBuffer("cpu", "cpu", 40, prioritized=prioritized) as back:
        back.add({"obs": torch.zeros(3), "act": 7, "nested": {"x": 1}})  # replaced whole
        back.load_state_dict(buf.state_dict())
        assert (len(back), back.pointer) == (len(buf), buf.pointer)
        assert (back.sample_all() == buf.sample_all()).all()
        for _ in range(3):  # the saved sampler goes on exactly
            assert (back.sample_batch(16) == buf.sample_batch(16)).all()
        row = {"obs": torch.ones(3), "act": 99, "nested": {"x": 5}}
        for b in (buf, back):
            b.add(row)
        assert (back.sample_all() == buf.sample_all()).all()
        if prioritized:
            batch = buf.sample_batch(8)
            assert back.update_priorities(batch["index"], torch.ones(8)) == 8


def test_copy_false_hands_out_stored_rows_by_reference() -> None:
    with ring() as buf:
        column = buf.memory.storage._storage["obs"]
        by_reference = buf.state_dict(copy=False)["tensors"]["rows/obs"]
        copied = buf.state_dict()["tensors"]["rows/obs"]
        assert np.shares_memory(by_reference.numpy(), column.numpy())
        assert not np.shares_memory(copied.numpy(), column.numpy())


def test_an_episode_state_is_what_its_checkpoint_holds(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(30, seed=5, prioritized=True, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.sample_n_step(4)
        state = buf.state_dict()
        buf.save_checkpoint(tmp_path / "ck")
        with read_checkpoint(tmp_path / "ck", "EpisodeReplayBuffer") as checkpoint:
            assert state["meta"] == checkpoint.meta
            same_tensors(state["tensors"], {n: checkpoint.load(n) for n in checkpoint.tensors})


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_an_episode_buffer_continues_from_its_state(tmp_path: Path, storage: str) -> None:
    kwargs = {"storage": storage, "scratch_dir": tmp_path, "frame_stack": 2}
    with (
        SyncEpisodeReplayBuffer(30, seed=5, **kwargs) as buf,
        SyncEpisodeReplayBuffer(30, seed=8, **kwargs) as back,
    ):
        fill(buf)
        fill(back)  # something to replace
        back.sample_n_step(4)
        back.load_state_dict(buf.state_dict())
        same_contents(buf, back)
        for _ in range(3):
            assert (buf.sample_n_step(16, n=(1, 3)) == back.sample_n_step(16, n=(1, 3))).all()
            assert (buf.sample_sequences(4, 2) == back.sample_sequences(4, 2)).all()
        running = [e for e, episode in buf._core.episodes.items() if episode.in_progress]
        assert running, "the layout leaves episodes in progress"
        for b in (buf, back):  # appending goes on where it stopped
            e = running[0]
            t = b._core.episodes[e].steps
            b.append_observation_action_reward(e, obs(e, t), action(e, t), reward(e, t), extras(t))
            b.end_episode(e, "terminated", final_observation=final_obs(e, t + 1))
        assert back.start_episode() == buf.start_episode()  # ids keep counting
        same_contents(buf, back)


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    with (
        SyncEpisodeReplayBuffer(30, seed=5, scratch_dir=tmp_path) as buf,
        SyncEpisodeReplayBuffer(31, seed=5, scratch_dir=tmp_path) as other,
        ring() as transitions,
    ):
        fill(buf)
        fill(other)
        before = other.state_dict()
        with pytest.raises(MetadataError, match="max_steps expected 31"):
            other.load_state_dict(buf.state_dict())
        with pytest.raises(CheckpointKindError, match="kind 'EpisodeReplayBuffer'"):
            other.load_state_dict(transitions.state_dict())
        tampered = buf.state_dict()
        tampered["tensors"]["links/step"] = tampered["tensors"]["links/step"][:-1]
        with pytest.raises(CorruptCheckpointError, match="links/step"):
            buf.load_state_dict(tampered)
        with pytest.raises(CorruptCheckpointError, match="mapping"):
            buf.load_state_dict({"meta": {}})
        after = other.state_dict()
        assert before["meta"] == after["meta"]
        same_tensors(before["tensors"], after["tensors"])
        with ReplayBuffer("cpu", "cpu", 41) as wrong:
            with pytest.raises(MetadataError, match="capacity expected 41"):
                wrong.load_state_dict(transitions.state_dict())
            assert len(wrong) == 0


async def test_the_async_facade_exposes_the_state() -> None:
    async with EpisodeReplayBuffer(30, seed=5) as buf, EpisodeReplayBuffer(30, seed=1) as back:
        fill(buf.sync)
        await back.load_state_dict(await buf.state_dict())
        same_contents(buf.sync, back.sync)
        assert (await buf.sample_n_step(8) == await back.sample_n_step(8)).all()
