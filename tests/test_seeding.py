"""Seeds: without ``seed=`` a buffer draws its sampler seed from torch's global CPU generator, so
``torch.manual_seed(s)`` before building it repeats its batches (as TorchRL's samplers do); an
explicit seed takes nothing from that generator. ``reset()`` / ``clear()`` keep the sampler's
state."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replaybuf import EpisodeReplayBuffer, ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.args import seed_or_draw

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ring_batches(prioritized: bool = False, storing: str = "cpu", **kwargs) -> list[list[int]]:
    with ReplayBuffer(storing, storing, 64, prioritized=prioritized, **kwargs) as buf:
        buf.add_batch({"x": torch.arange(64.0)})
        return [buf.sample_batch(16)["x"].long().tolist() for _ in range(3)]


def _episodes(buf: SyncEpisodeReplayBuffer) -> SyncEpisodeReplayBuffer:
    for e in range(4):
        ep = buf.start_episode(f"a{e}")
        for t in range(10):
            buf.append_observation_action_reward(ep, torch.tensor([float(10 * e + t)]), 0, 1.0)
        buf.end_episode(ep, "terminated", torch.tensor([-1.0]))
    return buf


def _episode_batches(prioritized: bool = False, storing: str = "cpu", **kwargs) -> list[list]:
    buf = SyncEpisodeReplayBuffer(
        100, storing_device=storing, device=storing, prioritized=prioritized, **kwargs
    )
    with _episodes(buf):
        return [buf.sample_n_step(16, n=2)["observation"].flatten().tolist() for _ in range(3)]


def _aio_batches(**kwargs) -> list[list]:
    async def run() -> list[list]:
        async with EpisodeReplayBuffer(100, **kwargs) as buf:
            for e in range(4):
                ep = await buf.start_episode(f"a{e}")
                for t in range(10):
                    obs = torch.tensor([float(10 * e + t)])
                    await buf.append_observation_action_reward(ep, obs, 0, 1.0)
                await buf.end_episode(ep, "terminated", torch.tensor([-1.0]))
            out = []
            for _ in range(3):
                batch = await buf.sample_n_step(16, n=2)
                out.append(batch["observation"].flatten().tolist())
            return out

    return asyncio.run(run())


BUILDERS = {
    "ring": _ring_batches,
    "ring-prioritized": lambda **kw: _ring_batches(prioritized=True, **kw),
    "episodes": _episode_batches,
    "episodes-prioritized": lambda **kw: _episode_batches(prioritized=True, **kw),
    "aio": _aio_batches,
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_torch_manual_seed_repeats_a_buffer_built_without_seed(kind):
    build = BUILDERS[kind]
    torch.manual_seed(123)
    first = build()
    torch.manual_seed(123)
    assert build() == first
    torch.manual_seed(124)
    assert build() != first


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_an_explicit_seed_takes_nothing_from_the_global_generator(kind):
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    BUILDERS[kind](seed=5)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_no_seed_draws_one_value_from_the_global_generator(kind):
    """The draw moves the global stream on (as TorchRL's samplers do at every sample)."""
    torch.manual_seed(7)
    untouched = torch.rand(4)
    torch.manual_seed(7)
    BUILDERS[kind]()
    assert not torch.equal(torch.rand(4), untouched)


def test_the_drawn_seed_follows_the_cpu_generator_under_a_default_device():
    torch.manual_seed(3)
    first = seed_or_draw(None)
    with torch.device("meta"):  # a default device must not change where the seed comes from
        torch.manual_seed(3)
        again = seed_or_draw(None)
    assert again == first
    assert seed_or_draw(5) == 5


def test_loading_a_checkpoint_takes_nothing_from_the_global_generator(tmp_path):
    with ReplayBuffer("cpu", "cpu", 16, seed=1) as buf:
        buf.add_batch({"x": torch.arange(16.0)})
        buf.save_checkpoint(tmp_path / "ring")
    with _episodes(SyncEpisodeReplayBuffer(100, seed=1)) as ebuf:
        ebuf.save_checkpoint(tmp_path / "episodes")
    torch.manual_seed(9)
    expected = torch.rand(4)
    torch.manual_seed(9)
    ReplayBuffer.load_checkpoint(tmp_path / "ring").close()
    SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "episodes").close()
    assert torch.equal(torch.rand(4), expected)


def test_reset_and_clear_keep_the_sampler_state():
    """A reset empties the rows, not the random stream: refilled alike, the next batches are
    the ones an uninterrupted stream gives, not the first batches again."""
    with ReplayBuffer("cpu", "cpu", 64, seed=0) as buf:
        buf.add_batch({"x": torch.arange(64.0)})
        first = buf.sample_batch(16)["x"].tolist()
        buf.reset()
        buf.add_batch({"x": torch.arange(64.0)})
        assert buf.sample_batch(16)["x"].tolist() != first
    with _episodes(SyncEpisodeReplayBuffer(100, seed=0)) as ebuf:
        first = ebuf.sample_n_step(16)["observation"].flatten().tolist()
        ebuf.clear()
        _episodes(ebuf)
        assert ebuf.sample_n_step(16)["observation"].flatten().tolist() != first


@cuda
@pytest.mark.parametrize("kind", ["ring", "episodes"])
def test_cuda_storage_without_seed_repeats_under_torch_manual_seed(kind):
    """On CUDA storage the episode buffer's device draws take their key from the drawn seed."""
    build = BUILDERS[kind]
    torch.manual_seed(11)
    first = build(storing="cuda")
    torch.manual_seed(11)
    assert build(storing="cuda") == first
    torch.manual_seed(12)
    assert build(storing="cuda") != first
