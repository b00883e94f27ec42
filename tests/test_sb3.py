"""SB3ReplayBuffer: stable-baselines3's replay-buffer contract on replaybuf episode storage.

Checked against SB3's own buffers fed the same transitions (the exact set of transitions each
can sample, n-step returns against ``NStepReplayBuffer``), and by training SB3 DQN and SAC with
it as ``replay_buffer_class``.
"""

from __future__ import annotations

import gc
import re
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402 - after the skip, as the extra is optional
from stable_baselines3 import DQN, SAC  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

from replaybuf import BufferClosedError, EmptyBufferError, SchemaError  # noqa: E402
from replaybuf.integrations.sb3 import SB3ReplayBuffer  # noqa: E402

OBS = spaces.Box(-10.0, 10.0, (3,), np.float32)
BOX_ACTIONS = spaces.Box(-1.0, 1.0, (2,), np.float32)
DISCRETE_ACTIONS = spaces.Discrete(5)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """SB3's small networks run several times faster on one thread of a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make(tmp_path):
    """A factory for SB3ReplayBuffers with scratch files under ``tmp_path``, all closed after."""
    made: list[SB3ReplayBuffer] = []

    def factory(buffer_size=1000, obs_space=OBS, action_space=BOX_ACTIONS, **kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("scratch_dir", tmp_path)
        kwargs.setdefault("seed", 0)
        buf = SB3ReplayBuffer(buffer_size, obs_space, action_space, **kwargs)
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()


# --------------------------------------------------------------------------- data and keys
def vec_steps(rng, n_envs, steps, action_space, *, p_done=0.1, p_trunc=0.5, p_jump=0.0):
    """What a VecEnv gives SB3's ``add``: obs continue from next_obs unless an env was done
    (then a reset observation) or, with ``p_jump``, jumps without a done."""
    shape = OBS.shape

    def fresh(k):
        return rng.standard_normal((k, *shape)).astype(np.float32)

    obs = fresh(n_envs)
    out = []
    for _ in range(steps):
        next_obs = fresh(n_envs)
        if isinstance(action_space, spaces.Discrete):
            action = rng.integers(0, action_space.n, n_envs)
        else:
            action = rng.uniform(-1, 1, (n_envs, *action_space.shape)).astype(np.float32)
        reward = rng.standard_normal(n_envs).astype(np.float32)
        done = rng.random(n_envs) < p_done
        truncated = done & (rng.random(n_envs) < p_trunc)
        infos = [
            {"TimeLimit.truncated": bool(t)} if d else {}
            for d, t in zip(done, truncated, strict=True)
        ]
        out.append((obs, next_obs, action, reward, done, infos))
        obs = next_obs.copy()
        restart = done | (rng.random(n_envs) < p_jump)
        obs[restart] = fresh(int(restart.sum()))
    return out


def feed(steps, *buffers):
    for step in steps:
        for buf in buffers:
            buf.add(*(np.copy(x) if isinstance(x, np.ndarray) else x for x in step))


def key(obs, action, reward, next_obs, done):
    """A transition as bytes, for exact comparison (dtypes included)."""
    return (
        np.asarray(obs).tobytes(),
        np.asarray(action).tobytes(),
        np.float32(reward).tobytes(),
        np.asarray(next_obs).tobytes(),
        float(done),
    )


def sample_keys(samples):
    fields = [t.cpu().numpy() for t in samples[:5]]
    obs, action, next_obs, done, reward = fields
    return [key(obs[i], action[i], reward[i, 0], next_obs[i], done[i, 0]) for i in range(len(obs))]


def sb3_table(rb: ReplayBuffer) -> set:
    """Every transition SB3's buffer holds, as its sample would return it."""
    done = rb.dones * (1 - rb.timeouts)
    return {
        key(
            rb.observations[p, e],
            rb.actions[p, e],
            rb.rewards[p, e],
            rb.next_observations[p, e],
            done[p, e],
        )
        for p in range(rb.size())
        for e in range(rb.n_envs)
    }


def drawn(buf, draws=40, batch=256):
    return Counter(k for _ in range(draws) for k in sample_keys(buf.sample(batch)))


# --------------------------------------------------------------------------- same as SB3
@pytest.mark.parametrize("handle_timeouts", [True, False])
@pytest.mark.parametrize("action_space", [BOX_ACTIONS, DISCRETE_ACTIONS], ids=["box", "discrete"])
@pytest.mark.parametrize("p_jump", [0.0, 0.15], ids=["continuous", "jumps"])
def test_samples_exactly_the_transitions_sb3_holds(make, handle_timeouts, action_space, p_jump):
    rng = np.random.default_rng(1)
    kwargs = {"n_envs": 2, "handle_timeout_termination": handle_timeouts}
    sb3 = ReplayBuffer(1000, OBS, action_space, "cpu", **kwargs)
    ours = make(1000, action_space=action_space, **kwargs)
    steps = vec_steps(rng, 2, 60, action_space, p_done=0.2, p_jump=p_jump)
    feed(steps, sb3, ours)
    table = sb3_table(sb3)
    assert len(table) == 120
    assert ours.transitions == 120
    assert ours.size() == sb3.size() == 60
    assert (ours.pos, ours.full) == (sb3.pos, sb3.full)
    counts = drawn(ours)
    assert set(counts) == table  # every sample is one of SB3's rows, and every row is drawn
    dones = [k[4] for k in table]
    assert 0 < sum(dones) < len(dones)
    stats = ours.stats()
    assert stats["discontinuities"] > 0 if p_jump else stats["discontinuities"] == 0
    if handle_timeouts:
        assert stats["truncated"] > 0
    else:
        assert stats["truncated"] == stats["discontinuities"]  # timeouts end as terminated


def test_draws_are_uniform_over_stored_and_newest_transitions(make):
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    ours = make(1000, n_envs=2)
    feed(vec_steps(rng, 2, 25, BOX_ACTIONS), ours)
    counts = drawn(ours, draws=40)
    assert len(counts) == 50
    assert scipy_stats.chisquare(list(counts.values())).pvalue > 1e-3


def test_shapes_dtypes_and_device_match_sb3(make):
    for action_space in (BOX_ACTIONS, DISCRETE_ACTIONS):
        rng = np.random.default_rng(3)
        sb3 = ReplayBuffer(100, OBS, action_space, "cpu", n_envs=2)
        ours = make(100, action_space=action_space, n_envs=2)
        feed(vec_steps(rng, 2, 10, action_space), sb3, ours)
        theirs, mine = sb3.sample(7), ours.sample(7)
        for name in ("observations", "actions", "next_observations", "dones", "rewards"):
            a, b = getattr(theirs, name), getattr(mine, name)
            assert (b.shape, b.dtype, b.device) == (a.shape, a.dtype, a.device), name
        assert mine.discounts is None


def test_discrete_and_image_observations(make):
    """SB3 reshapes Discrete observations to [n_envs, 1]; uint8 images keep their dtype."""
    discrete = make(100, obs_space=spaces.Discrete(7), action_space=DISCRETE_ACTIONS, n_envs=2)
    discrete.add(
        np.array([3, 4]), np.array([5, 6]), np.array([1, 2]), np.zeros(2), [0, 0], [{}, {}]
    )
    s = discrete.sample(16)
    assert s.observations.shape == (16, 1)
    assert s.observations.dtype == torch.int64
    assert set(s.next_observations[:, 0].tolist()) <= {5, 6}
    image = spaces.Box(0, 255, (4, 84, 84), np.uint8)
    pixels = make(100, obs_space=image, action_space=DISCRETE_ACTIONS)
    frame = np.full((1, 4, 84, 84), 7, np.uint8)
    pixels.add(frame, frame + 1, np.array([0]), np.ones(1), np.array([True]), [{}])
    s = pixels.sample(4)
    assert s.observations.dtype == torch.uint8
    assert int(s.next_observations.max()) == 8


@pytest.mark.parametrize("handle_timeouts", [True, False])
def test_n_step_returns_match_sb3_n_step_buffer(make, handle_timeouts):
    rng = np.random.default_rng(4)
    kwargs = {"n_envs": 2, "handle_timeout_termination": handle_timeouts}
    sb3 = NStepReplayBuffer(1000, OBS, BOX_ACTIONS, "cpu", n_steps=3, gamma=0.9, **kwargs)
    ours = make(1000, n_steps=3, gamma=0.9, **kwargs)
    feed(vec_steps(rng, 2, 60, BOX_ACTIONS, p_done=0.15), sb3, ours)

    def by_start(samples):
        obs, action, next_obs, done, reward, discount = (t.numpy() for t in samples)
        return {
            obs[i].tobytes(): (action[i], next_obs[i], done[i, 0], reward[i, 0], discount[i, 0])
            for i in range(len(obs))
        }

    np.random.seed(0)  # SB3 samples with NumPy's global generator
    theirs = {}
    for _ in range(20):
        theirs.update(by_start(sb3._get_samples(np.repeat(np.arange(sb3.pos), 8))))
    mine = {}
    for _ in range(40):
        mine.update(by_start(ours.sample(256)))
    assert len(theirs) == 120
    assert mine.keys() == theirs.keys()
    for start, (action, next_obs, done, reward, discount) in mine.items():
        t_action, t_next, t_done, t_reward, t_discount = theirs[start]
        assert action.tobytes() == t_action.tobytes()
        assert next_obs.tobytes() == t_next.tobytes()
        assert done == t_done
        assert reward == pytest.approx(t_reward, rel=1e-5, abs=1e-6)
        assert discount == pytest.approx(t_discount, rel=1e-6)


def test_image_observations_take_about_half_of_sb3s_memory(make):
    """Each frame is stored once (plus a 1/16 reserve for final frames and ~50 B of links)."""
    image, actions = spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6)
    sb3 = ReplayBuffer(1000, image, actions, "cpu")
    sb3_bytes = sum(
        a.nbytes
        for a in (sb3.observations, sb3.next_observations, sb3.actions, sb3.rewards, sb3.dones)
    )
    ours = make(1000, obs_space=image, action_space=actions)
    frame = np.zeros((1, 4, 84, 84), np.uint8)
    for _ in range(2):
        ours.add(frame, frame, np.array([1]), np.ones(1), np.zeros(1), [{}])
    ours.episode_buffer.memory  # noqa: B018 - writes the staged rows: the storage is allocated
    ratio = ours.stats()["bytes"] / sb3_bytes
    assert 0.5 < ratio < 0.55


# --------------------------------------------------------------------------- eviction
def test_eviction_keeps_the_newest_transitions_within_one_segment_of_capacity(make):
    rng = np.random.default_rng(5)
    ours = make(64, n_envs=2, max_episodes=64, segment_steps=4)  # 32 per env
    steps = vec_steps(rng, 2, 400, BOX_ACTIONS, p_done=0.03, p_jump=0.02)
    age = {}  # transition -> add index
    lowest = 64
    for t, step in enumerate(steps):
        feed([step], ours)
        obs, next_obs, action, reward, done, infos = step
        for e in range(2):
            truncated = bool(infos[e].get("TimeLimit.truncated", False))
            age[key(obs[e], action[e], reward[e], next_obs[e], done[e] and not truncated)] = t
        if t < 32:
            assert ours.transitions == 2 * (t + 1)
        else:
            lowest = min(lowest, ours.transitions)
            assert ours.transitions <= 64
    assert lowest > 64 - 4  # one eviction frees at most one segment beyond what is needed
    assert ours.full
    assert ours.pos == 400 % 32
    assert ours.stats()["evicted_episodes"] > 0
    assert ours.stats()["segments_split"] > 0
    oldest = min(age[k] for k in drawn(ours))  # every sample was fed, and is recent
    assert oldest >= 399 - (32 + 4)


def test_an_endless_episode_fits_a_small_buffer(make):
    """No done ever: segments let whole-episode eviction keep a full buffer, as SB3's ring."""
    rng = np.random.default_rng(6)
    ours = make(10, n_envs=1)
    feed(vec_steps(rng, 1, 100, BOX_ACTIONS, p_done=0.0), ours)
    assert 10 - ours.segment_steps <= ours.transitions <= 10


# --------------------------------------------------------------------------- SB3 training
def test_dqn_trains_on_cartpole(tmp_path):
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        buffer_size=1500,
        learning_starts=200,
        target_update_interval=250,
        policy_kwargs={"net_arch": [32, 32]},
        replay_buffer_class=SB3ReplayBuffer,
        replay_buffer_kwargs={"scratch_dir": tmp_path, "max_episodes": 1500},
        seed=0,
        device="cpu",
    )
    buf = model.replay_buffer
    assert isinstance(buf, SB3ReplayBuffer)
    try:
        model.learn(1200)
        assert buf.transitions == buf.size() == buf.pos == 1200
        assert not buf.full
        stats = buf.stats()
        assert stats["steps"] == 1200
        assert stats["evicted_episodes"] == 0
        ended = stats["terminated"] + stats["truncated"] - stats["segments_split"]
        assert ended == model._episode_num
        model.learn(1200, reset_num_timesteps=False)  # same env state: the episode continues
        assert buf.stats()["discontinuities"] == 0
        assert buf.full
        assert buf.pos == 2400 % 1500
        assert buf.stats()["evicted_episodes"] > 0
        assert 1500 - buf.segment_steps <= buf.transitions <= 1500
        held = buf.stats()["held_aside"]
        model.learn(100)  # reset_num_timesteps=True resets the env: the episode ends there
        assert buf.stats()["discontinuities"] == held
        batch = buf.sample(32)
        assert batch.actions.shape == (32, 1)
        assert batch.observations.shape == (32, 4)
    finally:
        buf.close()
    assert not list(tmp_path.glob("replaybuf-*"))


def test_sac_trains_on_pendulum(tmp_path):
    model = SAC(
        "MlpPolicy",
        "Pendulum-v1",
        buffer_size=1000,
        learning_starts=100,
        batch_size=64,
        policy_kwargs={"net_arch": [32, 32]},
        replay_buffer_class=SB3ReplayBuffer,
        replay_buffer_kwargs={"scratch_dir": tmp_path, "n_steps": 3, "gamma": 0.99},
        seed=0,
        device="cpu",
    )
    try:
        model.learn(300)
        buf = model.replay_buffer
        stats = buf.stats()
        # Pendulum only ends by its 200-step time limit: a truncation, never a termination.
        assert stats["terminated"] == stats["segments_split"] == 0
        assert stats["truncated"] == 1
        assert buf.transitions == 300
        batch = buf.sample(256)
        assert batch.dones.sum() == 0
        assert batch.actions.shape == (256, 1)
        assert batch.discounts is not None
        assert batch.discounts.max() <= 0.99**1 + 1e-6
    finally:
        model.replay_buffer.close()


# --------------------------------------------------------------------------- VecNormalize
def test_vec_normalize_is_applied_like_sb3(make):
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]))
    try:
        venv.seed(0)
        venv.reset()
        for _ in range(50):
            venv.step(np.array([[0.5]], np.float32))
        venv.training = False
        rng = np.random.default_rng(7)
        steps = vec_steps(rng, 1, 30, spaces.Box(-2.0, 2.0, (1,), np.float32))
        plain, normalised = make(100, action_space=venv.action_space), make(100)
        normalised = make(100, action_space=venv.action_space)
        feed(steps, plain, normalised)
        a, b = plain.sample(64), normalised.sample(64, env=venv)
        assert np.array_equal(b.observations.numpy(), venv.normalize_obs(a.observations.numpy()))
        assert np.array_equal(b.rewards.numpy(), venv.normalize_reward(a.rewards.numpy()))
        n_step = make(100, action_space=venv.action_space, n_steps=3)
        feed(steps, n_step)
        with pytest.raises(NotImplementedError, match="n_steps > 1"):
            n_step.sample(8, env=venv)
    finally:
        venv.close()


# --------------------------------------------------------------------------- validation
def test_invalid_adds_name_the_field_and_change_nothing(make):
    ours = make(100, n_envs=2)
    step = vec_steps(np.random.default_rng(8), 2, 2, BOX_ACTIONS)
    feed(step[:1], ours)
    obs, next_obs, action, reward, done, infos = step[1]
    bad = {
        "'obs' expected shape [2, 3]": (obs[:, :2], next_obs, action, reward, done, infos),
        "'next_obs' expected numbers": (obs, next_obs.astype(complex), action, reward, done, infos),
        "'action' expected shape [2, 2]": (obs, next_obs, action[:, :1], reward, done, infos),
        "'reward' expected shape [2]": (obs, next_obs, action, reward[:1], done, infos),
        "'done' expected numbers": (obs, next_obs, action, reward, ["a", "b"], infos),
        "'infos' expected 2 dicts": (obs, next_obs, action, reward, done, infos[:1]),
    }
    for message, args in bad.items():
        with pytest.raises(SchemaError, match=re.escape(message)):
            ours.add(*args)
        assert ours.transitions == 2
        assert ours.pos == 1
    pixels = make(10, obs_space=spaces.Box(0, 255, (2,), np.uint8))
    with pytest.raises(SchemaError, match="'obs' expected dtype uint8"):
        pixels.add(np.zeros((1, 2)), np.zeros((1, 2), np.uint8), np.zeros((1, 2)), [0], [0], [{}])
    ours.add(*step[1])  # a float64 reward or an int done cast as SB3 casts them
    assert ours.transitions == 4


def test_constructor_refuses_what_it_cannot_honour(make):
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        make(100, optimize_memory_usage=True)
    with pytest.raises(TypeError, match="Dict"):
        make(100, obs_space=spaces.Dict({"a": OBS}))
    with pytest.raises(ValueError, match="max_episodes must exceed n_envs"):
        make(100, n_envs=4, max_episodes=4)
    with pytest.raises(ValueError, match="segment_steps"):
        make(100, n_envs=4, segment_steps=26)


def test_sampling_an_empty_buffer_raises_and_one_add_is_enough(make):
    ours = make(10, n_steps=2, gamma=0.5)
    with pytest.raises(EmptyBufferError):
        ours.sample(4)
    ((obs, next_obs, action, reward, _, _),) = vec_steps(
        np.random.default_rng(12), 1, 1, BOX_ACTIONS
    )
    ours.add(obs, next_obs, action, reward, np.zeros(1), [{}])  # held aside, not stored yet
    batch = ours.sample(4)
    assert np.array_equal(batch.next_observations.numpy(), np.repeat(next_obs, 4, axis=0))
    assert batch.discounts.flatten().tolist() == [0.5] * 4


# --------------------------------------------------------------------------- lifecycle
def test_reset_close_and_garbage_collection(make, tmp_path):
    rng = np.random.default_rng(9)
    ours = make(100, n_envs=2)
    feed(vec_steps(rng, 2, 5, BOX_ACTIONS), ours)
    with pytest.raises(NotImplementedError):
        ours._get_samples(np.arange(3))
    ours.reset()
    assert (ours.transitions, ours.size(), ours.pos, ours.full) == (0, 0, 0, False)
    feed(vec_steps(rng, 2, 3, BOX_ACTIONS), ours)
    assert ours.transitions == 6
    ours.close()
    ours.close()
    with pytest.raises(BufferClosedError):
        ours.sample(1)
    with pytest.raises(BufferClosedError):
        feed(vec_steps(rng, 2, 1, BOX_ACTIONS), ours)
    assert not list(tmp_path.glob("replaybuf-*"))
    forgotten = SB3ReplayBuffer(10, OBS, BOX_ACTIONS, "cpu", storage="memmap", scratch_dir=tmp_path)
    feed(vec_steps(rng, 1, 3, BOX_ACTIONS), forgotten)
    assert list(tmp_path.glob("replaybuf-*"))
    del forgotten
    gc.collect()
    assert not list(tmp_path.glob("replaybuf-*"))


def test_seeded_sampling_is_reproducible(make):
    steps = vec_steps(np.random.default_rng(10), 2, 20, BOX_ACTIONS)
    a, b = make(100, n_envs=2, seed=5), make(100, n_envs=2, seed=5)
    np.random.seed(3)
    c = make(100, n_envs=2, seed=None)
    np.random.seed(3)
    d = make(100, n_envs=2, seed=None)
    feed(steps, a, b, c, d)
    assert sample_keys(a.sample(64)) == sample_keys(b.sample(64))
    assert sample_keys(c.sample(64)) == sample_keys(d.sample(64))


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_one_step_fields_are_what_sample_n_step_draws(make, storage):
    # sample's one-step path draws and gathers without the batch TensorDict: the same
    # values as sample_n_step(n=1) from the same generator state, and the same next draw.
    from replaybuf.integrations.sb3.samples import one_step_fields

    rb = make(300, n_envs=2, storage=storage)
    feed(vec_steps(np.random.default_rng(4), 2, 400, BOX_ACTIONS, p_jump=0.05), rb)
    buf = rb.episode_buffer
    state = buf._generator.get_state()
    fields = one_step_fields(buf, 97, 0.9)
    assert fields is not None
    after = buf._generator.get_state()
    buf._generator.set_state(state)
    batch = buf.sample_n_step(97, n=1, gamma=0.9)
    assert torch.equal(buf._generator.get_state(), after)
    for name, key in (
        ("obs", "observation"),
        ("next_obs", "next_observation"),
        ("action", "action"),
        ("done", "terminated"),
        ("reward", "reward"),
    ):
        got, want = fields[name], batch.get(key)
        assert got.dtype == want.dtype, name
        assert got.numpy().tobytes() == want.numpy().tobytes(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_samples_arrive_on_cuda(make):
    ours = make(100, n_envs=2, device="cuda", n_steps=2)
    feed(vec_steps(np.random.default_rng(11), 2, 20, BOX_ACTIONS), ours)
    batch = ours.sample(64)
    assert all(t.device.type == "cuda" for t in batch)
