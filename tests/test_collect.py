"""``collect``: gymnasium vector envs into an episode buffer, checked against what each
sub-environment really did (a recording wrapper inside the vector env is the ground truth)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaybuf import EpisodeReplayBuffer, SchemaError, SyncEpisodeReplayBuffer
from replaybuf.collecting import collect

gym = pytest.importorskip("gymnasium")
AutoresetMode = pytest.importorskip("gymnasium.vector").AutoresetMode
NUM_ENVS = 3
TIME_LIMIT = 20  # truncates some random CartPole episodes; others terminate before


class Recorder(gym.Wrapper):
    """Logs one sub-environment's episodes: observations, actions, rewards and end flags."""

    def __init__(self, env, log: list) -> None:
        super().__init__(env)
        self.episodes: list[dict] = []
        log.append(self)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.episodes.append({"obs": [obs], "action": [], "reward": [], "end": None})
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        episode = self.episodes[-1]
        episode["obs"].append(obs)
        episode["action"].append(int(action))
        episode["reward"].append(float(reward))
        if terminated or truncated:
            episode["end"] = "terminated" if terminated else "truncated"
        return obs, reward, terminated, truncated, info


def make_envs(log: list, mode=AutoresetMode.NEXT_STEP, num_envs: int = NUM_ENVS):
    return gym.make_vec(
        "CartPole-v1",
        num_envs=num_envs,
        vectorization_mode="sync",
        max_episode_steps=TIME_LIMIT,
        wrappers=[lambda env: Recorder(env, log)],
        vector_kwargs={"autoreset_mode": mode},
    )


def random_policy(seed: int = 0):
    rng = np.random.default_rng(seed)
    return lambda obs: rng.integers(0, 2, size=len(obs))


@pytest.fixture
def buffer(tmp_path):
    with SyncEpisodeReplayBuffer(10_000, scratch_dir=tmp_path, seed=0) as buf:
        yield buf


def check_against_recording(buf: SyncEpisodeReplayBuffer, log: list, stats: dict) -> None:
    """Each stored episode is a recorded one (a prefix of it when collection cut it), with its
    observations, actions, rewards, true final observation and end; each step stored once."""
    recorded = {np.asarray(e["obs"][0]).tobytes(): e for recorder in log for e in recorder.episodes}
    actions = sum(len(e["action"]) for e in recorded.values())
    stored = buf.sample_episodes(10_000)
    assert sum(int(r["length"]) for r in stored) == stats["steps"] == buf.stats()["steps"]
    cut = []
    for record in stored:
        episode = recorded.pop(record["observation"][0].numpy().tobytes())
        length = int(record["length"])
        expected_obs = torch.as_tensor(np.stack(episode["obs"][: length + 1]))
        assert torch.equal(record["observation"], expected_obs)  # the final one included
        assert record["action"].tolist() == episode["action"][:length]
        assert torch.allclose(record["reward"], torch.tensor(episode["reward"][:length]))
        natural = episode["end"] is not None and len(episode["action"]) == length
        if natural:
            assert bool(record["terminated"]) == (episode["end"] == "terminated")
            assert bool(record["truncated"]) == (episode["end"] == "truncated")
        else:  # cut by the end of collection: truncated, bootstrapping from where it stood
            assert bool(record["truncated"])
            cut.append(record)
    assert len(cut) == stats["cut"]
    assert all(len(e["action"]) <= 1 for e in recorded.values())  # only a dropped last step
    assert 0 <= actions - stats["steps"] < NUM_ENVS  # the last vector step may store fewer
    assert len(stored) - len(cut) == stats["episodes"] == stats["terminated"] + stats["truncated"]
    assert buf.stats()["in_progress"] == 0


@pytest.mark.parametrize(
    "mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
)
def test_every_step_is_stored_once_with_true_final_observations(buffer, mode):
    log: list = []
    envs = make_envs(log, mode)
    stats = collect(envs, random_policy(), buffer, 200, seed=0)
    envs.close()
    assert stats["steps"] == 200
    assert stats["terminated"] > 0
    assert stats["truncated"] > 0
    check_against_recording(buffer, log, stats)
    assert len(buffer) == 200  # every stored step is sampleable


def test_exactly_steps_are_stored_when_num_envs_does_not_divide_it(buffer):
    log: list = []
    envs = make_envs(log)
    stats = collect(envs, random_policy(), buffer, 100, seed=1)
    envs.close()
    assert stats["steps"] == len(buffer) == 100
    check_against_recording(buffer, log, stats)


def test_returns_are_the_reward_sums_of_finished_episodes(buffer):
    envs = make_envs([])
    stats = collect(envs, random_policy(), buffer, 150, seed=2)
    envs.close()
    natural = [  # ended by the env: terminated, or truncated by its time limit
        r
        for r in buffer.sample_episodes(1_000)
        if bool(r["terminated"]) or int(r["length"]) == TIME_LIMIT
    ]
    assert len(natural) == stats["episodes"] == len(stats["returns"])
    assert sorted(stats["returns"]) == sorted(float(r["reward"].sum()) for r in natural)


def test_an_async_buffer_is_written_through_its_core(tmp_path):
    async def run() -> dict:
        async with EpisodeReplayBuffer(1_000, scratch_dir=tmp_path, seed=0) as buf:
            envs = make_envs([])
            stats = collect(envs, random_policy(), buf, 50, seed=0)
            envs.close()
            assert len(buf) == 50
            return stats

    import asyncio

    assert asyncio.run(run())["steps"] == 50


def test_a_torch_policy_gets_tensors_and_may_return_tensors(buffer):
    seen = []

    def policy(obs):
        seen.append(type(obs))
        return torch.zeros(len(obs), dtype=torch.int64)

    envs = make_envs([])
    collect(envs, policy, buffer, 30, torch_policy=True)
    envs.close()
    assert set(seen) == {torch.Tensor}
    assert buffer.spec[("action",)].dtype == torch.int64


def test_progress_bar_only_when_asked_or_on_a_terminal(buffer, capsys):
    pytest.importorskip("tqdm")
    envs = make_envs([])
    collect(envs, random_policy(), buffer, 30, progress=True)
    assert "30/30" in capsys.readouterr().err
    collect(envs, random_policy(), buffer, 30)  # stderr is captured here: not a terminal
    envs.close()
    assert capsys.readouterr().err == ""


def test_an_interrupt_leaves_only_finished_episodes(buffer):
    calls = 0
    policy = random_policy()

    def interrupted(obs):
        nonlocal calls
        calls += 1
        if calls == 10:
            raise KeyboardInterrupt
        return policy(obs)

    envs = make_envs([])
    with pytest.raises(KeyboardInterrupt):
        collect(envs, interrupted, buffer, 1_000)
    envs.close()
    stats = buffer.stats()
    assert stats["in_progress"] == 0
    assert len(buffer) == stats["steps"] == 9 * NUM_ENVS


# ----------------------------------------------------------------- bad input
def unchanged(buf: SyncEpisodeReplayBuffer, before: dict) -> bool:
    return buf.stats() == before


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (lambda obs: np.zeros(2, dtype=np.int64), r"policy actions expected shape \[3\]"),
        (lambda obs: np.full(3, 5), "policy action for env 0 expected to lie in the action"),
        (lambda obs: np.zeros(3, dtype=np.float32), "Discrete.* expected an integer dtype"),
        (lambda obs: np.zeros(3, dtype=bool), "Discrete.* expected an integer dtype"),
        (lambda obs: [[0, 1]] * 3, r"policy actions expected shape \[3\]"),
        (lambda obs: [0, [1, 2], 0], "expected an array, a tensor or a list of numbers"),
    ],
)
def test_a_policy_not_matching_the_action_space_writes_nothing(buffer, policy, match):
    before = buffer.stats()
    envs = make_envs([])
    with pytest.raises(ValueError, match=match):
        collect(envs, policy, buffer, 10)
    envs.close()
    assert unchanged(buffer, before)


def test_an_env_not_matching_what_the_buffer_stores_writes_nothing(buffer):
    episode = buffer.start_episode()
    buffer.append_observation_action_reward(episode, np.zeros(2, np.float32), 0, 1.0)
    before = buffer.stats()
    envs = make_envs([])
    with pytest.raises(SchemaError, match=r"'observation' expected shape \[2\], got \[4\]"):
        collect(envs, random_policy(), buffer, 10)
    envs.close()
    assert unchanged(buffer, before)


def test_an_action_dtype_differing_from_the_stored_one_writes_nothing(buffer):
    episode = buffer.start_episode()
    buffer.append_observation_action_reward(
        episode, np.zeros(4, np.float32), np.array(0, np.int32), 1.0
    )  # a 0-d array keeps its dtype (a numpy scalar is a Python number here)
    before = buffer.stats()
    envs = make_envs([])
    with pytest.raises(
        SchemaError, match=r"'action' expected dtype torch\.int32, got torch\.int64"
    ):
        collect(envs, random_policy(), buffer, 10)
    envs.close()
    assert unchanged(buffer, before)


def test_bad_arguments(buffer, make_buffer):
    envs = make_envs([])
    with pytest.raises(TypeError, match=r"envs must be a gymnasium vector environment"):
        collect(gym.make("CartPole-v1"), random_policy(), buffer, 10)
    with pytest.raises(TypeError, match="buffer must be a SyncEpisodeReplayBuffer"):
        collect(envs, random_policy(), make_buffer(), 10)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        collect(envs, random_policy(), buffer, 0)
    envs.close()
    assert buffer.stats()["episodes"] == 0


# ----------------------------------------------------------------- actions as spaces take them
def collected_actions(buf: SyncEpisodeReplayBuffer) -> torch.Tensor:
    """Every stored action, episode by episode."""
    return torch.cat([r["action"] for r in buf.sample_episodes(10_000)])


VALUE = 0.1234567890123  # not a float32: stored as float32(VALUE)


def pendulums(num_envs: int = 2):
    return gym.make_vec("Pendulum-v1", num_envs=num_envs, vectorization_mode="sync")


BFLOAT16_VALUE = float(torch.tensor(0.1234567890123, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("make", "stored"),
    [
        pytest.param(lambda n, v: np.full((n, 1), v, dtype=np.float64), VALUE, id="float64-array"),
        pytest.param(lambda n, v: torch.full((n, 1), v, dtype=torch.float64), VALUE, id="tensor"),
        pytest.param(lambda n, v: [[v]] * n, VALUE, id="list-of-floats"),
        pytest.param(lambda n, v: [np.array([v])] * n, VALUE, id="list-of-arrays"),
        pytest.param(
            lambda n, v: torch.full((n, 1), v, dtype=torch.bfloat16), BFLOAT16_VALUE, id="bf16"
        ),
    ],
)
def test_box_actions_of_another_float_dtype_are_cast_to_the_space(buffer, make, stored):
    envs = pendulums()
    stats = collect(envs, lambda obs: make(len(obs), VALUE), buffer, 30)
    envs.close()
    assert stats["steps"] == 30
    assert buffer.spec[("action",)].dtype == torch.float32
    assert torch.equal(collected_actions(buffer), torch.full((30, 1), np.float32(stored)))


def test_box_actions_of_integers_and_out_of_bounds_pass_as_the_env_takes_them(buffer):
    envs = pendulums()  # Box(-2, 2): Pendulum clips the torque itself
    collect(envs, lambda obs: np.full((len(obs), 1), 5, dtype=np.int64), buffer, 10)
    envs.close()
    assert torch.equal(collected_actions(buffer), torch.full((10, 1), 5.0))


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (lambda obs: np.full((2, 1), 1e300), "float32 cannot represent"),
        (lambda obs: np.zeros((2, 1), dtype=np.complex64), "expected a dtype that casts"),
        (lambda obs: np.zeros(2), r"expected shape \[2, 1\]"),
    ],
)
def test_box_actions_the_env_would_refuse_write_nothing(buffer, policy, match):
    envs = pendulums()
    with pytest.raises(ValueError, match=f"collect: policy actions.*{match}"):
        collect(envs, policy, buffer, 10)
    envs.close()
    assert buffer.stats()["episodes"] == 0


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: np.ones(n, dtype=np.int32), id="int32"),
        pytest.param(lambda n: np.ones(n, dtype=np.uint8), id="uint8"),
        pytest.param(lambda n: torch.ones(n, dtype=torch.int32), id="int32-tensor"),
        pytest.param(lambda n: [1] * n, id="python-ints"),
        pytest.param(lambda n: [np.array(1, dtype=np.int16)] * n, id="0-d-arrays"),
        pytest.param(lambda n: [torch.tensor(1, dtype=torch.int8)] * n, id="0-d-tensors"),
    ],
)
def test_discrete_actions_of_any_integer_dtype_are_stored_as_the_space_dtype(buffer, make):
    log: list = []
    envs = make_envs(log)
    collect(envs, lambda obs: make(len(obs)), buffer, 30)
    envs.close()
    assert buffer.spec[("action",)].dtype == torch.int64  # Discrete's dtype
    assert torch.equal(collected_actions(buffer), torch.ones(30, dtype=torch.int64))
    assert {a for r in log for e in r.episodes for a in e["action"]} == {1}


class Grid(gym.Env):
    """A MultiDiscrete-action env: the reward is the action's sum; 4 steps an episode."""

    observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 4])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action)), action
        self.t += 1
        return np.full(2, self.t / 4, np.float32), float(np.sum(action)), self.t == 4, False, {}


def test_multi_discrete_actions_of_another_integer_dtype_are_cast(buffer):
    envs = gym.vector.SyncVectorEnv([Grid, Grid])
    stats = collect(envs, lambda obs: np.tile(np.array([2, 3], np.int32), (len(obs), 1)), buffer, 8)
    assert stats["returns"] == [20.0, 20.0]
    assert buffer.spec[("action",)].dtype == torch.int64
    assert torch.equal(collected_actions(buffer), torch.tensor([[2, 3]] * 8))
    with pytest.raises(ValueError, match="policy action for env 0 expected to lie in"):
        collect(envs, lambda obs: np.tile(np.array([3, 0], np.int8), (len(obs), 1)), buffer, 8)
    with pytest.raises(ValueError, match=r"MultiDiscrete.* expected an integer dtype"):
        collect(envs, lambda obs: np.ones((len(obs), 2)), buffer, 8)
    envs.close()
    assert buffer.stats()["steps"] == 8
