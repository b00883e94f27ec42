"""``prefetch=k``: batches drawn ahead on a thread are the batches drawn without it, in order;
the thread stops when the iterator closes, ends or is dropped, and its errors surface at their
batch."""

from __future__ import annotations

import gc
import itertools
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from replaybuf import (
    BufferClosedError,
    EpisodeReplayBuffer,
    ReplayBuffer,
    SyncEpisodeReplayBuffer,
)
from replaybuf.buffers.prefetch import Prefetcher


def fill_episodes(buf: SyncEpisodeReplayBuffer, episodes: int, steps: int) -> None:
    """Episodes whose observation is ``[episode, step]``."""
    for e in range(episodes):
        episode = buf.start_episode()
        for t in range(steps):
            buf.append_observation_action_reward(
                episode, torch.tensor([float(e), float(t)]), t, float(t)
            )
        buf.end_episode(episode, "terminated", torch.tensor([float(e), float(steps)]))


def take(iterable, k: int) -> list:
    return list(itertools.islice(iterable, k))


def same(a: list[TensorDict], b: list[TensorDict]) -> bool:
    return len(a) == len(b) and all((x == y).all() for x, y in zip(a, b, strict=True))


def wait_for_threads(count: int, timeout: float = 5.0) -> int:
    """``threading.active_count()`` once it falls to ``count`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def ring(tmp_path, seed: int = 0, prioritized: bool = False) -> ReplayBuffer:
    tmp_path.mkdir(exist_ok=True)
    buf = ReplayBuffer(
        "cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path, seed=seed, prioritized=prioritized
    )
    buf.add_batch({"obs": torch.arange(40.0).unsqueeze(1), "action": torch.arange(40)})
    return buf


def episodes(tmp_path, seed: int = 0) -> SyncEpisodeReplayBuffer:
    tmp_path.mkdir(exist_ok=True)
    buf = SyncEpisodeReplayBuffer(1_000, scratch_dir=tmp_path, seed=seed)
    fill_episodes(buf, episodes=4, steps=7)
    return buf


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_prefetched_dataset_yields_the_batches_drawn_without_prefetch(tmp_path, prioritized):
    with (
        ring(tmp_path / "a", prioritized=prioritized) as plain,
        ring(tmp_path / "b", prioritized=prioritized) as ahead,
    ):
        expected = take(plain.as_dataset(8), 12)
        with iter(ahead.as_dataset(8, prefetch=3)) as batches:
            assert same(take(batches, 12), expected)


@pytest.mark.parametrize("kwargs", [{"n": 3, "gamma": 0.9}, {"seq_len": 4}, {"n": (1, 3)}])
def test_episode_batches_with_prefetch_match_those_without(tmp_path, kwargs):
    with episodes(tmp_path / "a") as plain, episodes(tmp_path / "b") as ahead:
        expected = take(plain.as_dataset(5, **kwargs), 10)
        batches = iter(ahead.as_dataset(5, prefetch=2, **kwargs))
        try:
            assert same(take(batches, 10), expected)
        finally:
            batches.close()


def test_a_plain_dataloader_serves_prefetched_batches(tmp_path):
    from torch.utils.data import DataLoader

    with ring(tmp_path / "a") as plain, ring(tmp_path / "b") as ahead:
        expected = take(plain.as_dataset(4), 5)
        got = take(DataLoader(ahead.as_dataset(4, prefetch=2), batch_size=None), 5)
        assert same(got, expected)


def test_ring_epochs_with_prefetch_serve_every_transition_once_in_the_same_order(tmp_path):
    with ring(tmp_path / "a") as plain, ring(tmp_path / "b") as ahead:
        expected = list(plain.create_epoch_iterator(6, n_epochs=2))
        got = list(ahead.create_epoch_iterator(6, n_epochs=2, prefetch=3))
        assert same(got, expected)
        for epoch in (got[:7], got[7:]):  # 40 transitions: 7 batches per epoch
            seen = torch.cat([b["action"] for b in epoch]).sort().values
            assert torch.equal(seen, torch.arange(40))


def test_get_next_batch_reads_a_prefetched_epoch_then_falls_back(tmp_path):
    with ring(tmp_path) as buf:
        buf.create_epoch_iterator(10, prefetch=2)
        seen = torch.cat([buf.get_next_batch(10)["action"] for _ in range(4)])
        assert torch.equal(seen.sort().values, torch.arange(40))
        assert buf.get_next_batch(3).batch_size == torch.Size([3])  # uniform draws now


@pytest.mark.parametrize("shuffle", [True, False])
def test_episode_epochs_with_prefetch_deliver_every_step_once(tmp_path, shuffle):
    with episodes(tmp_path / "a") as plain, episodes(tmp_path / "b") as ahead:
        expected = list(plain.iterate_epochs(5, 2, n=2, shuffle=shuffle))
        got = list(ahead.iterate_epochs(5, 2, n=2, shuffle=shuffle, prefetch=2))
        assert same(got, expected)
        steps = torch.cat([b["observation"] for b in got[: len(got) // 2]])
        assert len({tuple(row.tolist()) for row in steps}) == len(ahead) == steps.shape[0]


async def test_async_epochs_with_prefetch_match_those_without(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with (
        EpisodeReplayBuffer(1_000, scratch_dir=tmp_path / "a", seed=0) as plain,
        EpisodeReplayBuffer(1_000, scratch_dir=tmp_path / "b", seed=0) as ahead,
    ):
        fill_episodes(plain.sync, episodes=4, steps=7)
        fill_episodes(ahead.sync, episodes=4, steps=7)
        expected = [b async for b in plain.iterate_epochs(4, 2, n=3)]
        got = [b async for b in ahead.iterate_epochs(4, 2, n=3, prefetch=2)]
        assert same(got, expected)
        # asyncio.to_thread's pool keeps its threads: count the prefetch thread by name
        assert not [t for t in threading.enumerate() if t.name == "replaybuf-prefetch"]


def test_closing_the_iterator_stops_the_thread(tmp_path):
    with ring(tmp_path) as buf:
        before = threading.active_count()
        batches = iter(buf.as_dataset(4, prefetch=2))
        assert threading.active_count() == before + 1
        take(batches, 3)
        batches.close()
        assert threading.active_count() == before  # close() joins the thread
        with pytest.raises(StopIteration):
            next(batches)


def test_a_dropped_iterator_stops_its_thread(tmp_path):
    from torch.utils.data import DataLoader

    with ring(tmp_path) as buf:
        before = threading.active_count()
        loader = iter(DataLoader(buf.as_dataset(4, prefetch=2), batch_size=None))
        take(loader, 2)
        del loader  # a DataLoader never closes its dataset's iterator: the finalizer does
        gc.collect()
        assert wait_for_threads(before) == before


def test_an_exhausted_epoch_iterator_ends_its_thread(tmp_path):
    with ring(tmp_path) as buf:
        before = threading.active_count()
        assert len(list(buf.create_epoch_iterator(16, prefetch=4))) == 3
        assert wait_for_threads(before) == before


def test_at_most_k_batches_are_drawn_ahead():
    calls = itertools.count()

    def draws():
        while True:
            yield TensorDict({"i": torch.tensor([next(calls)])}, [1])

    with Prefetcher(draws(), 3) as batches:
        assert int(next(batches)["i"]) == 0
        time.sleep(0.2)
        assert next(calls) == 4  # the one taken and three ahead, no more


def test_an_error_in_the_thread_is_raised_at_its_batch():
    def draws():
        for i in range(3):
            yield TensorDict({"i": torch.tensor([i])}, [1])
        raise ValueError("draw 3 failed")

    with Prefetcher(draws(), 2) as batches:
        assert [int(next(batches)["i"]) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="draw 3 failed"):
            next(batches)
        with pytest.raises(StopIteration):
            next(batches)
        assert not batches.alive


def test_a_sampling_error_reaches_the_consumer_after_the_batches_before_it(tmp_path):
    with ring(tmp_path) as buf:
        calls = itertools.count()
        sample = buf.sample_batch

        def flaky(batch_size):
            if next(calls) == 2:
                raise RuntimeError("storage went away")
            return sample(batch_size)

        buf.sample_batch = flaky  # type: ignore[method-assign]
        batches = iter(buf.as_dataset(4, prefetch=3))
        assert len(take(batches, 2)) == 2
        with pytest.raises(RuntimeError, match="storage went away"):
            next(batches)


@pytest.mark.parametrize("make", [ring, episodes])
def test_closing_the_buffer_ends_the_iterator_with_buffer_closed_error(tmp_path, make):
    before = threading.active_count()
    buf = make(tmp_path)
    batches = iter(buf.as_dataset(4, prefetch=2))
    next(batches)
    buf.close()
    with pytest.raises(BufferClosedError, match="closed"):
        next(batches)  # batches drawn before the close are not served
    assert wait_for_threads(before) == before


def test_closing_the_buffer_mid_epoch_ends_a_prefetched_epoch(tmp_path):
    buf = episodes(tmp_path)
    epochs = buf.iterate_epochs(2, prefetch=2)
    next(epochs)
    buf.close()
    with pytest.raises(BufferClosedError):
        next(epochs)


@pytest.mark.parametrize(
    ("prefetch", "error", "match"),
    [
        (-1, ValueError, "prefetch must be >= 0, got -1"),
        (5000, ValueError, "prefetch must be <= 1024"),
        ("2", TypeError, "prefetch must be an int"),
        (True, TypeError, "prefetch must be an int"),
    ],
)
def test_bad_prefetch_is_refused_before_a_thread_starts(tmp_path, prefetch, error, match):
    with ring(tmp_path / "a") as buf, episodes(tmp_path / "b") as eps:
        before = threading.active_count()
        for call in (
            lambda: buf.as_dataset(4, prefetch=prefetch),
            lambda: buf.create_epoch_iterator(4, prefetch=prefetch),
            lambda: eps.as_dataset(4, prefetch=prefetch),
            lambda: eps.iterate_epochs(4, prefetch=prefetch),
        ):
            with pytest.raises(error, match=match):
                call()
        assert threading.active_count() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_prefetched_match_and_serve_another_stream(tmp_path):
    def cuda_ring(path):
        path.mkdir()
        buf = ReplayBuffer("cuda", "cpu", 64, storage="memmap", scratch_dir=path, seed=0)
        buf.add_batch({"obs": torch.arange(40.0).unsqueeze(1), "action": torch.arange(40)})
        return buf

    with cuda_ring(tmp_path / "a") as plain, cuda_ring(tmp_path / "b") as ahead:
        expected = take(plain.as_dataset(8), 6)
        with iter(ahead.as_dataset(8, prefetch=2)) as batches:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                got = take(batches, 6)
                sums = [float(b["obs"].sum()) for b in got]
        assert same(got, expected)
        assert sums == [float(b["obs"].sum()) for b in expected]
