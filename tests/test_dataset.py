"""``as_dataset``: buffers as endless IterableDatasets of TensorDict batches for a DataLoader."""

from __future__ import annotations

import itertools
import pickle
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

import replaybuf.buffers.dataset
from replaybuf import EmptyBufferError, EpisodeReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.buffers.dataset import ReplayDataset, as_dataset, keep_batch


def fill_episodes(buf: SyncEpisodeReplayBuffer, episodes: int = 3, steps: int = 6) -> None:
    """Episodes whose observation is ``[episode, step]`` and reward ``step``."""
    for e in range(episodes):
        episode = buf.start_episode()
        for t in range(steps):
            buf.append_observation_action_reward(
                episode, torch.tensor([float(e), float(t)]), t, float(t)
            )
        buf.end_episode(episode, "terminated", torch.tensor([float(e), float(steps)]))


@pytest.fixture
def episodes(tmp_path):
    with SyncEpisodeReplayBuffer(1_000, scratch_dir=tmp_path, seed=0) as buf:
        fill_episodes(buf)
        yield buf


def take(iterable, k: int) -> list:
    return list(itertools.islice(iterable, k))


def test_a_dataloader_serves_transition_batches_as_tensordicts(make_buffer):
    buf = make_buffer(16)
    buf.add_batch({"obs": torch.arange(16.0).unsqueeze(1), "action": torch.arange(16)})
    dataset = as_dataset(buf, 8)
    assert isinstance(dataset, ReplayDataset)
    for loader in (dataset.loader(), DataLoader(dataset, batch_size=None, collate_fn=keep_batch)):
        batches = take(loader, 3)
        assert len(batches) == 3
        for batch in batches:
            assert isinstance(batch, TensorDict)
            assert batch.batch_size == torch.Size([8])
            assert torch.equal(batch["obs"][:, 0].long(), batch["action"])  # rows stay whole


def test_each_batch_is_drawn_from_the_live_buffer(make_buffer):
    buf = make_buffer(1)
    buf.add({"obs": torch.zeros(2)})
    batches = iter(as_dataset(buf, 4).loader())
    assert (next(batches)["obs"] == 0).all()
    buf.add({"obs": torch.ones(2)})  # overwrites the one slot between two batches
    assert (next(batches)["obs"] == 1).all()


def test_n_step_batches_are_what_sample_n_step_draws(tmp_path, episodes):
    with SyncEpisodeReplayBuffer(1_000, scratch_dir=tmp_path, seed=0) as twin:
        fill_episodes(twin)
        for batch in take(as_dataset(episodes, 16, n=3, gamma=0.5).loader(), 2):
            expected = twin.sample_n_step(16, 3, 0.5)
            assert (batch == expected).all()
            assert int(batch["actual_n"].max()) <= 3


def test_without_n_or_seq_len_an_episode_buffer_gives_one_step_transitions(episodes):
    (batch,) = take(as_dataset(episodes, 32), 1)
    assert (batch["actual_n"] == 1).all()
    assert torch.equal(batch["next_observation"][:, 1], batch["observation"][:, 1] + 1)
    assert torch.equal(
        batch["next_discount"][~batch["terminated"]],
        torch.full_like(batch["next_discount"][~batch["terminated"]], 0.99),
    )


def test_seq_len_gives_sequences(episodes):
    (batch,) = take(as_dataset(episodes, 5, seq_len=4).loader(), 1)
    assert batch.batch_size == torch.Size([5, 4])
    assert batch["mask"].all()
    steps = batch["observation"][..., 1]
    assert torch.equal(steps[:, 1:], steps[:, :-1] + 1)  # consecutive steps of one episode


async def test_an_async_episode_buffer_is_sampled_through_its_core(tmp_path):
    async with EpisodeReplayBuffer(1_000, scratch_dir=tmp_path, seed=0) as buf:
        fill_episodes(buf.sync)
        (batch,) = take(as_dataset(buf, 4, n=2).loader(), 1)
        assert batch.batch_size == torch.Size([4])
        assert int(batch["actual_n"].max()) <= 2


@pytest.mark.filterwarnings("ignore:.*pin_memory")  # no accelerator here: pinning is skipped
def test_pin_memory_passes_tensordicts_through(episodes):
    (batch,) = take(as_dataset(episodes, 4).loader(pin_memory=True), 1)
    assert isinstance(batch, TensorDict)
    if torch.cuda.is_available():
        assert batch["observation"].is_pinned()


def test_an_empty_buffer_raises_when_iterated_not_when_built(make_buffer, tmp_path):
    dataset = as_dataset(make_buffer(4), 2)
    with pytest.raises(EmptyBufferError, match="the buffer is empty"):
        next(iter(dataset))
    with (
        SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path) as buf,
        pytest.raises(EmptyBufferError, match="0 valid step"),
    ):
        next(iter(as_dataset(buf, 2, n=3)))


def test_iterating_in_a_dataloader_worker_is_refused(episodes, monkeypatch):
    # What a forked worker sees (a real forked worker costs seconds to shut down here).
    worker = SimpleNamespace(id=0, num_workers=2)
    monkeypatch.setattr(replaybuf.buffers.dataset, "get_worker_info", lambda: worker)
    with pytest.raises(RuntimeError, match=r"training process .*num_workers=2.*prefetch=k"):
        next(iter(as_dataset(episodes, 4)))


def test_a_plain_dataloader_with_batch_size_none_passes_tensordicts_through(make_buffer, episodes):
    buf = make_buffer(16)
    buf.add_batch({"obs": torch.arange(16.0).unsqueeze(1), "action": torch.arange(16)})
    for dataset, shape in (
        (as_dataset(buf, 8), (8,)),
        (as_dataset(episodes, 8, n=3), (8,)),
        (as_dataset(episodes, 3, seq_len=4), (3, 4)),
    ):
        (batch,) = take(DataLoader(dataset, batch_size=None), 1)  # torch's default collate_fn
        assert isinstance(batch, TensorDict)
        assert batch.batch_size == torch.Size(shape)
    # Every other input still goes through torch's own default_convert.
    assert DataLoader(as_dataset(buf, 2), batch_size=None).collate_fn([1, 2]) == [1, 2]


def test_loader_refuses_workers_and_points_to_prefetch(episodes):
    with pytest.raises(ValueError, match=r"num_workers=0, got num_workers=2.*prefetch=k"):
        as_dataset(episodes, 4).loader(num_workers=2)


@pytest.mark.filterwarnings("ignore:Got pickle error")  # the spawned worker is refused
def test_spawned_workers_are_refused_before_they_start(episodes):
    spawned = DataLoader(
        as_dataset(episodes, 4), batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    with pytest.raises(TypeError, match="ReplayDataset cannot be pickled"):
        next(iter(spawned))
    with pytest.raises(TypeError, match="use num_workers=0"):
        pickle.dumps(as_dataset(episodes, 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 3, "seq_len": 4}, ValueError, "give n .* or seq_len .*, not both"),
        ({"seq_len": 4, "gamma": 0.9}, ValueError, "gamma applies to n-step transitions"),
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1, got 0"),
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"gamma": 1.5}, ValueError, "gamma must lie in \\(0, 1\\], got 1.5"),
        ({"strict": "yes", "seq_len": 2}, TypeError, "strict must be a bool"),
    ],
)
def test_bad_arguments_for_an_episode_buffer(episodes, kwargs, error, match):
    with pytest.raises(error, match=match):
        as_dataset(episodes, 4, **kwargs)


def test_bad_arguments_for_a_transition_buffer(make_buffer):
    buf = make_buffer()
    with pytest.raises(ValueError, match=r"a ReplayBuffer samples stored transitions.*got n=3"):
        as_dataset(buf, 4, n=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        as_dataset(buf, 0)
    with pytest.raises(TypeError, match=r"buffer must be a ReplayBuffer, .* got list"):
        as_dataset([], 4)
