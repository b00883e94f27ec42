"""layout="torchrl": batches TorchRL's losses and value estimators take unchanged, whose n-step
targets are replaybuf's own (reward + next_discount * V(next_observation))."""

from __future__ import annotations

import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.objectives import DQNLoss, SACLoss, ValueEstimators
from torchrl.objectives.value import TD0Estimator

from replaybuf import EpisodeReplayBuffer, SyncEpisodeReplayBuffer, as_dataset

GAMMA = 0.9


def filled(continuous: bool = False, **kwargs) -> SyncEpisodeReplayBuffer:
    """Episodes of every ending (terminated, truncated, in progress) with float observations."""
    buf = SyncEpisodeReplayBuffer(500, seed=3, **kwargs)
    g = torch.Generator().manual_seed(0)
    for e, (length, status) in enumerate([(6, "terminated"), (9, "truncated"), (4, None)] * 3):
        ep = buf.start_episode(f"agent{e % 2}")
        for t in range(length):
            action = torch.rand(2, generator=g) * 2 - 1 if continuous else t % 2
            obs = torch.tensor([e, t, 0.5, -1.0]) + torch.rand(4, generator=g) / 10
            buf.append_observation_action_reward(ep, obs, action, float(t + 1) / 4)
        if status is not None:
            buf.end_episode(ep, status, torch.tensor([e, length, 1.0, 1.0]))
    return buf


def twin_batches(buf: SyncEpisodeReplayBuffer, **kwargs):
    """The same draws in both layouts."""
    buf._generator.manual_seed(11)
    native = buf.sample_n_step(64, n=3, gamma=GAMMA, **kwargs)
    buf._generator.manual_seed(11)
    return native, buf.sample_n_step(64, n=3, gamma=GAMMA, layout="torchrl", **kwargs)


def test_the_torchrl_layout_holds_torchrls_keys_and_shapes() -> None:
    with filled() as buf:
        native, batch = twin_batches(buf)
        assert torch.equal(batch["observation"], native["observation"])
        assert torch.equal(batch["next", "observation"], native["next_observation"])
        assert torch.equal(batch["next", "reward"], native["reward"].unsqueeze(-1))
        for flag in ("terminated", "truncated"):
            assert batch["next", flag].shape == (64, 1)
            assert torch.equal(batch["next", flag].squeeze(-1), native[flag])
        done = native["terminated"] | native["truncated"]
        assert torch.equal(batch["next", "done"].squeeze(-1), done)
        assert torch.equal(batch["steps_to_next_obs"].squeeze(-1), native["actual_n"])
        powers = torch.tensor(GAMMA, dtype=torch.float32) ** native["actual_n"]
        assert torch.allclose(batch["gamma"].squeeze(-1), powers)
        for flag in ("terminated", "truncated", "cut"):  # the draws hold every ending
            assert native[flag].any(), flag
        assert "next_discount" not in batch
        assert "next_observation" not in batch
        for kept in ("cut", "start_step", "episode_id"):
            assert torch.equal(batch[kept], native[kept])


def test_td0_targets_on_the_torchrl_layout_are_replaybufs_n_step_targets() -> None:
    value = TensorDictModule(nn.Linear(4, 1), in_keys=["observation"], out_keys=["state_value"])
    estimator = TD0Estimator(gamma=GAMMA, value_network=value)
    with filled() as buf:
        native, batch = twin_batches(buf)
        target = estimator.value_estimate(batch.clone())
        with torch.no_grad():
            next_value = value.module(native["next_observation"]).squeeze(-1)
        want = native["reward"] + native["next_discount"] * next_value
        torch.testing.assert_close(target.squeeze(-1), want)


def test_dqn_loss_computes_on_the_torchrl_layout_with_replaybufs_targets() -> None:
    from torchrl.modules import QValueActor

    torch.manual_seed(0)
    q = nn.Linear(4, 2)
    actor = QValueActor(q, in_keys=["observation"], action_space="categorical")
    loss = DQNLoss(actor, action_space="categorical", loss_function="l2")
    loss.make_value_estimator(ValueEstimators.TD0, gamma=GAMMA)
    with filled() as buf:
        native, batch = twin_batches(buf)
        out = loss(batch)
        with torch.no_grad():
            target = (
                native["reward"]
                + native["next_discount"] * q(native["next_observation"]).max(-1).values
            )
        taken = q(native["observation"]).gather(-1, native["action"].unsqueeze(-1)).squeeze(-1)
        want = ((taken - target) ** 2).mean()
        torch.testing.assert_close(out["loss"], want)


def test_sac_loss_computes_on_the_torchrl_layout() -> None:
    from tensordict.nn import NormalParamExtractor
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator

    torch.manual_seed(0)
    body = TensorDictModule(
        nn.Sequential(nn.Linear(4, 4), NormalParamExtractor()),
        in_keys=["observation"],
        out_keys=["loc", "scale"],
    )
    actor = ProbabilisticActor(
        body, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True
    )

    class Critic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(6, 1)

        def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
            return self.net(torch.cat([observation, action], -1))

    critic = ValueOperator(Critic(), in_keys=["observation", "action"])
    loss = SACLoss(actor, critic, num_qvalue_nets=2, target_entropy=-2.0)
    loss.make_value_estimator(ValueEstimators.TD0, gamma=GAMMA)
    with filled(continuous=True) as buf:
        out = loss(buf.sample_n_step(32, n=3, gamma=GAMMA, layout="torchrl"))
        assert all(torch.isfinite(out[key]).all() for key in ("loss_actor", "loss_qvalue"))


def test_sequences_episodes_epochs_and_datasets_take_the_layout_too() -> None:
    with filled(layout="torchrl") as buf:  # the buffer's default
        seq = buf.sample_sequences(4, 3)
        assert seq["next", "reward"].shape == (4, 3, 1)
        assert torch.equal(
            seq["next", "done"], seq["next", "terminated"] | seq["next", "truncated"]
        )
        assert "steps_to_next_obs" not in seq
        episode = buf.get_episode(0)
        assert episode.batch_size == (6,)
        assert torch.equal(episode["next", "observation"][:-1], episode["observation"][1:])
        assert episode["next", "terminated"][-1].item()
        assert not episode["next", "done"][:-1].any()
        assert buf.get_episode(2).batch_size == (3,)  # in progress: its last step has no next
        assert buf.get_episode(1, layout="replaybuf")["observation"].shape == (10, 4)
        for batch in buf.iterate_epochs(32, n=2, gamma=GAMMA):
            assert batch["next", "reward"].shape[-1] == 1
        batch = next(iter(as_dataset(buf, 8, n=2, gamma=GAMMA)))
        assert ("next", "terminated") in batch.keys(include_nested=True)
        assert all(e.batch_size[0] > 0 for e in buf.sample_episodes(2))


def test_one_name_for_each_flag_in_the_replaybuf_layout() -> None:
    with filled() as buf:
        keys = [
            set(buf.sample_n_step(8).keys()),
            set(buf.sample_sequences(2, 2).keys()),
            set(buf.get_episode(0).keys()),
        ]
        for names in keys:
            assert {"terminated", "truncated"} <= names
            assert "terminal" not in names


async def test_the_async_facade_passes_the_layout_on() -> None:
    async with EpisodeReplayBuffer(100, seed=0) as buf:
        ep = await buf.start_episode()
        for t in range(3):
            await buf.append_observation_action_reward(ep, torch.zeros(2) + t, t, 1.0)
        await buf.end_episode(ep, "terminated", torch.ones(2))
        batch = await buf.sample_n_step(4, layout="torchrl")
        assert batch["next", "terminated"].shape == (4, 1)
        assert (await buf.get_episode(ep, layout="torchrl")).batch_size == (3,)


def test_a_bad_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        SyncEpisodeReplayBuffer(10, layout="rllib")
    with filled() as buf, pytest.raises(ValueError, match="layout must be one of"):
        buf.sample_n_step(4, layout="TorchRL")
