"""Pickling SB3ReplayBuffer: ``pickle`` and SB3's ``save_replay_buffer``/``load_replay_buffer``.

A loaded adapter must hold everything the saved one held (every stored row and bookkeeping
tensor of its episode buffer, its episodes in progress, held-aside transitions, counters and
sampler states), sample what the saved one samples, go on adding as it would, and own its
storage (new memmap files, its own lock).
"""

from __future__ import annotations

import copy
import io
import pickle
import tempfile
import threading
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")
pytest.importorskip("gymnasium")

from stable_baselines3 import DQN  # after the skip: the extra is optional
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.save_util import load_from_pkl, save_to_pkl
from test_sb3 import (
    BOX_ACTIONS,
    OBS,
    drawn,
    feed,
    sample_keys,
    sb3_table,
    vec_steps,
)

from replaybuf import ArgumentError, BufferClosedError, EmptyBufferError
from replaybuf.integrations.sb3 import SB3ReplayBuffer
from replaybuf.integrations.sb3.pickling import ADAPTER_FIELDS

STORAGES = ["tensor", "memmap"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """SB3's small networks run several times faster on one thread of a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make(tmp_path):
    """A factory for SB3ReplayBuffers with scratch files under ``tmp_path``; every buffer it
    made or was handed (loaded ones) is closed after the test."""
    made: list[SB3ReplayBuffer] = []

    def factory(buffer_size=1000, **kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("scratch_dir", tmp_path)
        kwargs.setdefault("seed", 0)
        buf = SB3ReplayBuffer(buffer_size, OBS, BOX_ACTIONS, **kwargs)
        made.append(buf)
        return buf

    factory.made = made  # type: ignore[attr-defined]
    yield factory
    for buf in made:
        buf.close()


def loads(data: bytes, make) -> SB3ReplayBuffer:
    loaded = pickle.loads(data)
    assert isinstance(loaded, SB3ReplayBuffer)
    make.made.append(loaded)
    return loaded


def _bytes(value) -> tuple:
    array = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.dtype.str, array.shape, array.tobytes()


def everything(rb: SB3ReplayBuffer) -> dict:
    """Every field the adapter holds, its episode buffer's whole state, and what the adapter
    reports (SB3's attributes and counters, stats, each stored episode as read back)."""
    buf = rb.episode_buffer
    state = buf.state_dict()
    held = rb._held
    out = {
        "sb3": (rb.buffer_size, rb.n_envs, rb.obs_shape, rb.action_dim, rb.device),
        "spaces": (rb.observation_space, rb.action_space),
        "options": (rb.handle_timeout_termination, rb.n_steps, rb.gamma, rb.segment_steps),
        "counters": (rb.pos, rb.full, rb.size(), rb.transitions, len(buf)),
        "stats": rb.stats(),
        "adapter": {name: getattr(rb, name) for name in ADAPTER_FIELDS},
        "held": (list(held.pending), *(_bytes(a) for a in (held.obs, held.next_obs))),
        "held_rest": (_bytes(held.action), _bytes(held.reward)),
        "generator": _bytes(rb._generator.get_state()),
        "meta": state["meta"],
        "tensors": {name: _bytes(t) for name, t in state["tensors"].items()},
        "episodes": {},
        "buffer": (buf.max_steps, buf.max_episodes, buf.device, buf.storing_device),
    }
    for e in buf.episode_ids():
        record = buf.get_episode(e)
        out["episodes"][e] = {k: _bytes(record[k]) for k in record.keys()}  # noqa: SIM118 (a TensorDict's keys)
    return out


def same_draws(a: SB3ReplayBuffer, b: SB3ReplayBuffer, times: int = 3) -> None:
    for _ in range(times):
        first, second = a.sample(64), b.sample(64)
        assert sample_keys(first) == sample_keys(second)
        if first.discounts is not None:
            assert torch.equal(first.discounts, second.discounts)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_steps", [1, 3])
def test_pickle_round_trips_every_field_and_the_draws(make, storage, n_steps):
    """Dones, timeouts, jumps, segment splits and evictions before the save: the loaded buffer
    holds the same state, draws the same samples, and stays equal after the same adds."""
    rng = np.random.default_rng(20)
    ours = make(60, n_envs=2, storage=storage, n_steps=n_steps, gamma=0.9, segment_steps=7, seed=7)
    feed(vec_steps(rng, 2, 90, BOX_ACTIONS, p_done=0.1, p_jump=0.05), ours)
    ours.sample(64)  # both samplers move on from their seeded states
    stats = ours.stats()
    assert stats["evicted_episodes"] > 0
    assert stats["segments_split"] > 0
    assert stats["discontinuities"] > 0
    assert ours._held.count == 2
    assert ours.full

    loaded = loads(pickle.dumps(ours, protocol=pickle.HIGHEST_PROTOCOL), make)
    assert loaded is not ours
    assert loaded.episode_buffer.state_dict()["meta"]["storage"] == storage
    assert everything(loaded) == everything(ours)
    copied = copy.deepcopy(ours)  # through the same state
    make.made.append(copied)
    assert everything(copied) == everything(ours)
    same_draws(ours, loaded)
    assert everything(loaded) == everything(ours)  # the samplers moved on alike

    more = vec_steps(rng, 2, 40, BOX_ACTIONS, p_done=0.1, p_jump=0.05)
    feed(more, ours, loaded)
    assert everything(loaded) == everything(ours)
    same_draws(ours, loaded)
    ours.close()  # the loaded buffer owns its storage
    assert loaded.sample(8).observations.shape == (8, 3)


@pytest.mark.parametrize("storage", STORAGES)
def test_loaded_samples_are_exactly_the_stored_transitions(make, storage):
    """Before any eviction SB3's own buffer holds the same transitions: every sample of the
    loaded buffer is one of SB3's rows, and every row is drawn."""
    rng = np.random.default_rng(21)
    sb3 = ReplayBuffer(1000, OBS, BOX_ACTIONS, "cpu", n_envs=2)
    ours = make(1000, n_envs=2, storage=storage)
    feed(vec_steps(rng, 2, 60, BOX_ACTIONS, p_done=0.2, p_jump=0.1), sb3, ours)
    loaded = loads(pickle.dumps(ours), make)
    table = sb3_table(sb3)
    assert len(table) == loaded.transitions == 120
    assert (loaded.pos, loaded.full, loaded.size()) == (sb3.pos, sb3.full, sb3.size())
    assert set(drawn(loaded)) == table


@pytest.mark.parametrize("storage", STORAGES)
def test_an_empty_buffer_round_trips(make, storage):
    ours = make(100, n_envs=2, storage=storage, n_steps=2)
    loaded = loads(pickle.dumps(ours), make)
    assert everything(loaded) == everything(ours)
    assert (loaded.transitions, loaded.pos, loaded.full) == (0, 0, False)
    with pytest.raises(EmptyBufferError):
        loaded.sample(1)
    feed(vec_steps(np.random.default_rng(22), 2, 30, BOX_ACTIONS), ours, loaded)
    assert everything(loaded) == everything(ours)
    same_draws(ours, loaded)


def test_a_reset_buffer_round_trips_and_a_loaded_one_resets(make):
    rng = np.random.default_rng(23)
    ours = make(100, n_envs=2, storage="memmap")
    feed(vec_steps(rng, 2, 20, BOX_ACTIONS), ours)
    ours.reset()
    feed(vec_steps(rng, 2, 5, BOX_ACTIONS), ours)
    loaded = loads(pickle.dumps(ours), make)
    assert everything(loaded) == everything(ours)
    loaded.reset()
    assert (loaded.transitions, loaded.pos, loaded.full) == (0, 0, False)
    feed(vec_steps(rng, 2, 5, BOX_ACTIONS), loaded)
    assert loaded.transitions == 10


# --------------------------------------------------------------------------- through SB3
@pytest.mark.parametrize("storage", STORAGES)
def test_dqn_save_and_load_replay_buffer(tmp_path, storage):
    """``model.save_replay_buffer`` writes the adapter, ``load_replay_buffer`` (into another
    model) gives it back whole, and training goes on with it."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def dqn():
        return DQN(
            "MlpPolicy",
            "CartPole-v1",
            buffer_size=200,
            learning_starts=50,
            target_update_interval=100,
            policy_kwargs={"net_arch": [16]},
            replay_buffer_class=SB3ReplayBuffer,
            replay_buffer_kwargs={"scratch_dir": scratch, "storage": storage, "max_episodes": 60},
            seed=0,
            device="cpu",
        )

    model, other = dqn(), dqn()
    saved = model.replay_buffer
    loaded: list[SB3ReplayBuffer] = []
    try:
        model.learn(300)
        assert saved.stats()["evicted_episodes"] > 0
        assert saved.full
        (tmp_path / "saved").mkdir()
        path = tmp_path / "saved" / "rb.pkl"
        model.save_replay_buffer(path)
        assert path.stat().st_size > 0
        other.replay_buffer.close()  # replaced by the load
        other.load_replay_buffer(path)
        got = other.replay_buffer
        loaded.append(got)
        assert isinstance(got, SB3ReplayBuffer)
        assert got is not saved
        assert everything(got) == everything(saved)
        assert got.episode_buffer.state_dict()["meta"]["storage"] == storage
        folders = sorted(scratch.glob("replaybuf-*"))
        assert len(folders) == (2 if storage == "memmap" else 0)  # the saved one's, the loaded's

        model.save_replay_buffer(str(tmp_path / "saved" / "plain"))  # SB3 adds the .pkl suffix
        stream = io.BytesIO()
        model.save_replay_buffer(stream)
        stream.seek(0)
        for source in (str(tmp_path / "saved" / "plain"), stream):
            other.load_replay_buffer(source)
            loaded.append(other.replay_buffer)
            assert everything(other.replay_buffer) == everything(saved)

        # Training goes on from the loaded buffer as from the saved one (the same adds).
        other.load_replay_buffer(path)
        loaded.append(other.replay_buffer)
        got = other.replay_buffer
        batch = got.sample(32)
        assert batch.observations.shape == (32, 4)
        assert batch.actions.shape == (32, 1)
        other.learn(100, reset_num_timesteps=False)
        assert got.stats()["adds"] == saved.stats()["adds"] + 100
        assert 200 - got.segment_steps <= got.transitions <= 200
    finally:
        saved.close()
        for buf in loaded:
            buf.close()
    assert not list(scratch.glob("replaybuf-*"))


# --------------------------------------------------------------------------- what a pickle is
def test_the_pickle_holds_plain_data_only(make):
    """No TorchRL storage, tensordict, lock, thread, file or torch storage: the only classes a
    load looks up are the adapter's, its spaces' and numpy's."""
    ours = make(100, n_envs=2, storage="memmap")
    feed(vec_steps(np.random.default_rng(24), 2, 30, BOX_ACTIONS), ours)
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    loaded = Recording(io.BytesIO(pickle.dumps(ours, protocol=pickle.HIGHEST_PROTOCOL))).load()
    make.made.append(loaded)
    modules = {module.split(".")[0] for module, _ in found}
    assert modules <= {"numpy", "gymnasium", "replaybuf"}, found
    assert {(m, n) for m, n in found if m.startswith("replaybuf")} == {
        ("replaybuf.integrations.sb3.buffer", "SB3ReplayBuffer")
    }
    assert everything(loaded) == everything(ours)


def test_a_loaded_buffer_has_its_own_lock_and_storage(make, tmp_path):
    ours = make(100, n_envs=2, storage="memmap")
    feed(vec_steps(np.random.default_rng(25), 2, 30, BOX_ACTIONS), ours)
    loaded = loads(pickle.dumps(ours), make)
    lock, theirs = loaded.episode_buffer._lock, ours.episode_buffer._lock
    assert lock is not theirs
    assert type(lock) is type(theirs)
    with theirs:  # the saved buffer's lock held by this thread does not block the loaded one
        results: list[int] = []
        worker = threading.Thread(target=lambda: results.append(len(loaded.sample(16).dones)))
        worker.start()
        worker.join(timeout=30)
        assert results == [16]
    assert len(list(tmp_path.glob("replaybuf-*"))) == 2
    ours.close()
    assert len(list(tmp_path.glob("replaybuf-*"))) == 1
    assert loaded.sample(16).observations.shape == (16, 3)
    loaded.close()
    assert not list(tmp_path.glob("replaybuf-*"))


def test_memmap_files_go_to_the_saved_scratch_dir_or_else_the_temp_dir(tmp_path, monkeypatch):
    saved_dir, temp = tmp_path / "saved-scratch", tmp_path / "temp"
    saved_dir.mkdir()
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    ours = SB3ReplayBuffer(100, OBS, BOX_ACTIONS, "cpu", storage="memmap", scratch_dir=saved_dir)
    feed(vec_steps(np.random.default_rng(26), 1, 20, BOX_ACTIONS), ours)
    data = pickle.dumps(ours)
    expected = everything(ours)
    ours.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved folder exists: no warning
        here = pickle.loads(data)
    assert len(list(saved_dir.glob("replaybuf-*"))) == 1
    assert not list(temp.iterdir())
    assert everything(here) == expected
    here.close()

    saved_dir.rmdir()  # another machine, a removed folder: the system temp dir instead
    with pytest.warns(RuntimeWarning, match="scratch_dir"):
        there = pickle.loads(data)
    try:
        assert len(list(temp.glob("replaybuf-*"))) == 1
        assert everything(there) == expected
    finally:
        there.close()
    assert not list(temp.glob("replaybuf-*"))


def test_a_closed_buffer_loads_closed_and_a_foreign_state_does_not_load(make, tmp_path):
    ours = make(100)
    feed(vec_steps(np.random.default_rng(27), 1, 5, BOX_ACTIONS), ours)
    state = ours.__getstate__()
    state["format"] = 99
    with pytest.raises(ArgumentError, match="format"):
        SB3ReplayBuffer.__new__(SB3ReplayBuffer).__setstate__(state)
    ours.close()
    # SB3's save_to_pkl opens its file before it pickles: a closed buffer must still pickle,
    # or an empty .pkl would be left behind.
    path = tmp_path / "closed.pkl"
    save_to_pkl(path, ours)
    assert path.stat().st_size > 0
    loaded = load_from_pkl(path)
    assert loaded.closed
    assert (loaded.n_envs, loaded.max_steps) == (ours.n_envs, ours.max_steps)
    with pytest.raises(BufferClosedError):
        loaded.sample(4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_storage_round_trips(make):
    """Rows stored on CUDA pickle as CPU arrays and come back on CUDA, with the same draws."""
    ours = make(100, n_envs=2, device="cuda", storing_device="cuda", n_steps=2)
    feed(vec_steps(np.random.default_rng(28), 2, 40, BOX_ACTIONS), ours)
    ours.sample(16)
    loaded = loads(pickle.dumps(ours), make)
    assert loaded.episode_buffer.storing_device.type == "cuda"
    assert everything(loaded) == everything(ours)
    same_draws(ours, loaded)
    assert all(t.device.type == "cuda" for t in loaded.sample(8) if t is not None)
