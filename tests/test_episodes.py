"""SyncEpisodeReplayBuffer through its public API, checked against the reference model."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from episode_helpers import (
    action,
    assert_episode_record,
    assert_nstep_batch,
    assert_sequence_batch,
    batch_of,
    extras,
    final_obs,
    mirrored,
    pairs_of,
    step,
)
from episode_program import Program, reference_for
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tensordict import TensorDict

from replaybuf import (
    EmptyBufferError,
    EpisodeStateError,
    MetadataError,
    SchemaError,
    SyncEpisodeReplayBuffer,
)
from replaybuf.accel.numba_loader import NUMBA_ENV, kernels_unavailable_reason


@pytest.fixture
def make(make_episode_buffer):
    """A factory for sync episode buffers (conftest's), all closed at the end."""
    return make_episode_buffer


gammas = st.sampled_from([1.0, 0.99, 0.9, 0.5])
n_args = st.one_of(
    st.integers(1, 4),
    st.tuples(st.integers(1, 3), st.integers(0, 2)).map(lambda p: (p[0], p[0] + p[1])),
)
picks = st.integers(0, 30)
operations = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("start"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append_batch"), st.lists(picks, min_size=1, max_size=3), st.integers(1, 3)),
    st.tuples(st.just("end"), picks, st.sampled_from(["terminated", "truncated", "COMPLETED"])),
    st.tuples(st.just("start_many"), st.integers(1, 3)),
    st.tuples(
        st.just("end_many"),
        st.lists(picks, min_size=1, max_size=4),
        st.lists(st.sampled_from(["terminated", "truncated"]), min_size=1, max_size=2),
    ),
    st.tuples(st.just("sample_all"), st.integers(1, 5), gammas),
    st.tuples(st.just("sample"), n_args, gammas),
    st.tuples(st.just("sequences"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("episode"), picks),
    st.tuples(st.just("sample_episodes"), st.integers(1, 3)),
    st.tuples(st.just("epochs"), st.integers(1, 5), st.integers(1, 3)),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    max_steps=st.integers(2, 12),
    max_episodes=st.one_of(st.none(), st.integers(1, 4)),
    storage=st.sampled_from(["tensor", "tensor", "memmap"]),
    ops=st.lists(operations, min_size=8, max_size=40),
    torch_index=st.booleans(),
)
def test_random_interleavings_agree_with_the_reference(
    make, max_steps, max_episodes, storage, ops, torch_index
):
    if torch_index:  # CUDA storage's path (device copies, torch index math), on the CPU
        with mirrored():
            buf = make(max_steps, max_episodes, storage=storage)
        assert buf._core.links.host is None
    else:
        buf = make(max_steps, max_episodes, storage=storage)
    program = Program(buf)
    program.check()
    for name, *args in ops:
        getattr(program, name)(*args)
        program.check()
    stats = program.buf.stats()
    assert stats["steps"] <= max_steps  # storage never holds more than it may
    assert max_episodes is None or stats["episodes"] <= max_episodes
    event(f"evicted: {min(stats['evicted_episodes'], 3)}")
    event(f"valid steps: {min(stats['valid_steps'], 5)}")
    program.buf.close()


def test_many_short_episodes_are_evicted_by_the_row_budget_before_max_steps(make):
    # Without max_episodes, final observations share a reserve of max(16, max_steps / 16) rows.
    buf = make(20)
    program = Program(buf)
    assert program.ref.row_capacity == 20 + 16
    for _ in range(30):
        program.start("a")
        e = program.running()[0]
        program.append(e)
        program.end(e, "terminated")
        program.check()
    assert buf.stats()["evicted_episodes"] > 0
    assert buf.stats()["steps"] < 20
    program.sample_all(2, 0.9)


def test_final_observation_rows_never_outnumber_max_steps(make):
    buf = make(8, 10**9, storage="tensor")
    assert buf.stats()["rows"] == 16  # at most one final row per stored step
    program = Program(buf)
    for _ in range(12):
        program.append(0, 1)
        program.end(0, "terminated")
        program.check()
    assert buf.stats()["episodes"] == 8
    program.sample_all(3, 0.5)


def test_eviction_takes_oldest_finished_first_then_oldest_in_progress(make):
    buf = make(6)
    a, b, c = (buf.start_episode() for _ in range(3))
    for e in (a, b, c):
        for t in range(2):
            buf.append_observation_action_reward(e, *step(e, t))
    buf.end_episode(b, "truncated", final_observation=final_obs(b, 2))
    d = buf.start_episode()
    # 6 steps stored; d's first step needs room: b (finished) goes first, though a is older
    buf.append_observation_action_reward(d, *step(d, 0))
    assert buf.stats()["evicted_episodes"] == 1
    with pytest.raises(EpisodeStateError, match=f"episode {b}: it was evicted"):
        buf.get_episode(b)
    assert buf.stats()["in_progress"] == 3
    evicted = []
    for t in (1, 2, 3, 4):  # then the oldest in progress: a (at d's step 2), c (at step 4)
        buf.append_observation_action_reward(d, *step(d, t))
        evicted.append(buf.stats()["evicted_episodes"])
    assert evicted == [1, 2, 2, 3]
    with pytest.raises(EpisodeStateError, match=f"append to episode {a}: it was evicted"):
        buf.append_observation_action_reward(a, *step(a, 2))
    with pytest.raises(EpisodeStateError, match=f"end episode {c}: it was evicted"):
        buf.end_episode(c, final_observation=final_obs(c, 2))
    assert buf.stats()["episodes"] == 1
    assert buf.sample_n_step(9, replace=False)["episode_id"].unique().tolist() == [d]


def test_an_episode_is_never_evicted_for_its_own_append(make):
    buf = make(3)
    e = buf.start_episode()
    for t in range(3):
        buf.append_observation_action_reward(e, *step(e, t))
    before = buf.stats()
    with pytest.raises(ValueError, match=r"cannot make room .*episode\(s\) \[0\] being written"):
        buf.append_observation_action_reward(e, *step(e, 3))
    assert buf.stats() == before
    buf.end_episode(e, "terminated", final_observation=final_obs(e, 3))
    assert len(buf) == 3


def test_max_episodes_is_enforced_at_start_episode(make):
    buf = make(50, 2)
    ids = [buf.start_episode() for _ in range(3)]
    assert buf.stats()["episodes"] == 2
    assert buf.stats()["evicted_episodes"] == 1
    with pytest.raises(EpisodeStateError, match=f"episode {ids[0]}: it was evicted"):
        buf.append_observation_action_reward(ids[0], *step(ids[0], 0))


# --------------------------------------------------------------------------- uniformity
def _interleaved(buf, lengths_and_status, seed=0):
    """Episodes of the given lengths, their steps interleaved at random; returns the ref."""
    ref = reference_for(buf)
    rng = np.random.default_rng(seed)
    for _ in lengths_and_status:
        e = buf.start_episode()
        assert e == ref.start()
    todo = [e for e, (length, _) in enumerate(lengths_and_status) for _ in range(length)]
    rng.shuffle(todo)
    for e in todo:
        o, a, r, x = step(e, ref.episodes[e].steps)
        buf.append_observation_action_reward(e, o, a, r, x)
        ref.append([e], [o], [a], [r], [x])
    for e, (_, status) in enumerate(lengths_and_status):
        if status is not None:
            final = final_obs(e, ref.episodes[e].steps)
            buf.end_episode(e, status, final_observation=final)
            ref.end(e, status, final)
    return ref


def test_n_step_sampling_is_uniform_over_valid_steps(make):
    buf = make(200, storage="tensor", seed=1234)
    shape = [(3, "terminated"), (7, None), (12, "truncated"), (20, None), (1, "terminated")]
    ref = _interleaved(buf, shape)
    cells = sorted(ref.valid_pairs())
    assert len(cells) == len(buf) == 3 + 6 + 12 + 19 + 1
    counts = Counter()
    for _ in range(40):
        counts.update(pairs_of(buf.sample_n_step(500, n=3, gamma=0.9)))
    assert set(counts) == set(cells)
    observed = [counts[c] for c in cells]
    assert chisquare(observed).pvalue > 0.001


def test_a_low_high_n_draws_each_n_uniformly_per_sample(make):
    buf = make(200, storage="tensor", seed=3)
    ref = _interleaved(buf, [(150, "terminated")])
    counts = Counter()
    for _ in range(10):
        batch = buf.sample_n_step(512, n=(2, 5), gamma=0.9)
        assert_nstep_batch(batch[:32], ref, (2, 5), 0.9)
        far = batch["start_step"] < 140  # windows that cannot reach the end: actual_n == n
        counts.update(batch["actual_n"][far].tolist())
    assert set(counts) == {2, 3, 4, 5}
    assert chisquare([counts[k] for k in (2, 3, 4, 5)]).pvalue > 0.001


def test_strict_sequence_starts_are_uniform_over_starts_that_fit(make):
    buf = make(200, storage="tensor", seed=99)
    ref = _interleaved(buf, [(4, "terminated"), (9, None), (15, "truncated"), (2, None)])
    cells = sorted(ref.sequence_starts(4))
    counts = Counter()
    for _ in range(30):
        batch = buf.sample_sequences(256, 4)
        counts.update(
            zip(batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist(), strict=True)
        )
    assert set(counts) == set(cells)
    assert chisquare([counts[c] for c in cells]).pvalue > 0.001


def test_strict_sequences_stay_uniform_when_few_starts_fit(make):
    # 150 one-step episodes and one of 5 steps: 3 of 155 valid steps start a run of 3, so
    # rejection sampling mostly fails and the exact scan fills the batch
    buf = make(200, storage="tensor", seed=5)
    ref = _interleaved(buf, [(1, "terminated")] * 150 + [(5, "truncated")])
    cells = sorted(ref.sequence_starts(3))
    assert cells == [(150, 0), (150, 1), (150, 2)]
    counts = Counter()
    for _ in range(10):
        batch = buf.sample_sequences(300, 3)
        assert batch["mask"].all()
        assert_sequence_batch(batch[:20], ref, 3)
        counts.update(
            zip(batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist(), strict=True)
        )
    assert set(counts) == set(cells)
    assert chisquare([counts[c] for c in cells]).pvalue > 0.001


# --------------------------------------------------------------------------- input kinds
def test_numpy_python_and_nested_dict_inputs_round_trip(make):
    buf = make(32)
    e = buf.start_episode()
    for t in range(3):
        observation = {
            "pixels": np.full((2, 2), t, dtype=np.uint8),
            "state": {"pos": torch.tensor([t, -t], dtype=torch.float32), "t": t},
        }
        buf.append_observation_action_reward(
            e, observation, float(t) / 2, np.float32(t), {"h": np.arange(3) + t}
        )
    final = {
        "pixels": np.full((2, 2), 9, dtype=np.uint8),
        "state": {"pos": torch.tensor([9.0, 9.0]), "t": 9},
    }
    buf.end_episode(e, "truncated", final_observation=final)
    record = buf.get_episode(e)
    assert record["observation", "pixels"].dtype == torch.uint8
    assert record["observation", "pixels"][:, 0, 0].tolist() == [0, 1, 2, 9]
    assert record["observation", "state", "t"].tolist() == [0, 1, 2, 9]
    assert record["action"].tolist() == [0.0, 0.5, 1.0]
    assert record["reward"].tolist() == [0.0, 1.0, 2.0]
    assert record["h"].tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    batch = buf.sample_n_step(10, n=2, gamma=0.5, replace=False)
    for i in range(batch.batch_size[0]):
        t = int(batch["start_step"][i])
        m = int(batch["actual_n"][i])
        assert int(batch["observation", "state", "t"][i]) == t
        assert int(batch["next_observation", "state", "t"][i]) == (9 if t + m == 3 else t + m)
        assert batch["h"][i].tolist() == [t, t + 1, t + 2]
        assert float(batch["reward"][i]) == pytest.approx(sum(0.5**k * (t + k) for k in range(m)))
        assert bool(batch["truncated"][i]) == (t + m == 3)
        assert not bool(batch["terminated"][i])


def test_grad_requiring_expanded_and_strided_inputs_are_stored_detached(make):
    buf = make(8)
    e = buf.start_episode()
    base = torch.arange(3.0, requires_grad=True)
    for t in range(2):
        observation = (base * (t + 1))[None].expand(2, 3)  # non-leaf, expanded
        buf.append_observation_action_reward(
            e, observation, torch.arange(4)[::2], torch.tensor(1.0, requires_grad=True)
        )
    buf.end_episode(e, "truncated", final_observation=torch.ones(3, 2).t())
    record = buf.get_episode(e)
    assert not record["observation"].requires_grad
    assert record["observation"][:, 0].tolist() == [[0, 1, 2], [0, 2, 4], [1, 1, 1]]
    assert record["action"].tolist() == [[0, 2], [0, 2]]
    batch = buf.sample_n_step(2, n=1, replace=False)
    assert not batch["reward"].requires_grad


NO_KERNELS = kernels_unavailable_reason()
INDEX_PATHS = [
    pytest.param("numba", marks=pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")),
    "numpy",
    "torch",
]


@pytest.mark.parametrize("index_path", INDEX_PATHS)
@pytest.mark.parametrize(
    ("reward", "dtype"),
    [
        (1, torch.float32),  # integer rewards sum into the default float dtype
        (torch.tensor(1.0, dtype=torch.float64), torch.float64),
        (torch.tensor(1.0, dtype=torch.float16), torch.float16),
        (torch.tensor([1.0, 2.0]), torch.float32),  # a vector reward per step
    ],
    ids=["int", "float64", "float16", "vector"],
)
def test_discounted_returns_of_every_reward_dtype(make, reward, dtype, index_path, monkeypatch):
    monkeypatch.setenv(NUMBA_ENV, "0" if index_path == "numpy" else "1")  # read when built
    if index_path == "torch":  # CUDA storage's path (device copies, torch index math)
        with mirrored():
            buf = make(8)
        assert buf._core.links.host is None
    else:
        buf = make(8)
    e = buf.start_episode()
    for t in range(3):
        buf.append_observation_action_reward(e, float(t), 0, reward)
    buf.end_episode(e, "terminated", final_observation=3.0)
    batch = buf.sample_n_step(3, n=3, gamma=0.5, replace=False)
    assert batch["reward"].dtype == dtype
    scale = torch.as_tensor(reward, dtype=torch.float64)
    for start, value in zip(batch["start_step"].tolist(), batch["reward"], strict=True):
        want = {0: 1.75, 1: 1.5, 2: 1.0}[start] * scale
        assert torch.equal(value.to(torch.float64), want)


def test_appended_arrays_are_copied_so_callers_may_reuse_them(make):
    buf = make(8)
    e, empty = buf.start_episode(), buf.start_episode()
    array = np.zeros(2, dtype=np.float32)
    buf.append_observation_action_reward(e, array, 0, 0.0)
    array[:] = 5
    buf.end_episode(e, "terminated", final_observation=array)
    array[:] = 7
    buf.end_episode(empty, "terminated", final_observation=array)
    array[:] = 9
    assert buf.get_episode(e)["observation"].tolist() == [[0, 0], [5, 5]]
    assert buf.get_episode(empty)["observation"].tolist() == [[7, 7]]


def test_extras_round_trip_through_every_reader(make):
    buf = make(16)
    ref = _interleaved(buf, [(4, "terminated"), (3, None)])
    record = buf.get_episode(0)
    assert record["logp"].tolist() == [-(t + 1) / 8 for t in range(4)]
    batch = buf.sample_n_step(16, n=2, replace=False)
    assert_nstep_batch(batch, ref, 2, 0.99)
    assert set(batch.keys()) >= {"logp", "flag"}
    assert_sequence_batch(buf.sample_sequences(8, 3, strict=False), ref, 3)


@pytest.mark.parametrize(
    "name", ["reward", "next_observation", "terminal", "mask", "episode_id", "length", "terminated"]
)
def test_extras_name_colliding_with_a_returned_key_raises(make, name):
    buf = make(8)
    e = buf.start_episode()
    with pytest.raises(SchemaError, match=f"extras names \\['{name}'\\] collide"):
        buf.append_observation_action_reward(e, 0.0, 0, 0.0, {name: 1.0})
    assert buf.stats()["steps"] == 0
    assert buf.spec is None


def test_zero_step_episode_holds_nothing_to_sample(make):
    buf = make(8)
    e = buf.start_episode()
    buf.end_episode(e, "truncated", final_observation=torch.zeros(3))
    assert len(buf) == 0
    assert buf.stats()["truncated"] == 1
    with pytest.raises(EmptyBufferError, match="0 valid step"):
        buf.sample_n_step(1)
    record = buf.get_episode(e)
    assert int(record["length"]) == 0
    assert record["observation"].tolist() == [[0.0, 0.0, 0.0]]


def test_get_episode_of_a_fresh_episode_has_an_empty_observation(make):
    buf = make(8)
    ref = _interleaved(buf, [(2, "terminated")])
    e = buf.start_episode()
    ref.start()
    record = buf.get_episode(e)
    assert record["observation"].shape == (0, 3)
    assert record["action"].shape == (0,)
    assert_episode_record(record, ref, e)


# --------------------------------------------------------------------------- min_steps, empty
def test_sampling_below_min_steps_raises_until_enough_valid_steps(make):
    buf = make(32, min_steps=5)
    e = buf.start_episode()
    for t in range(5):
        buf.append_observation_action_reward(e, *step(e, t))
    assert len(buf) == 4
    for call in (
        lambda: buf.sample_n_step(2),
        lambda: buf.sample_sequences(2, 1),
        lambda: buf.iterate_epochs(2),
    ):
        with pytest.raises(EmptyBufferError, match=r"4 valid step\(s\) stored.*min_steps=5"):
            call()
    buf.append_observation_action_reward(e, *step(e, 5))
    assert buf.sample_n_step(2).batch_size == (2,)


def test_sampling_an_empty_buffer_raises(make):
    buf = make(8)
    with pytest.raises(EmptyBufferError, match="0 valid step"):
        buf.sample_n_step(1)
    with pytest.raises(EmptyBufferError, match="holds none"):
        buf.sample_episodes(1)
    e = buf.start_episode()
    buf.append_observation_action_reward(e, *step(e, 0))
    with pytest.raises(EmptyBufferError, match="0 valid step"):
        buf.sample_sequences(1, 1)


# --------------------------------------------------------------------------- clear, memory
def test_clear_drops_every_episode_and_old_ids_stay_invalid(make):
    buf = make(32, 4)
    _interleaved(buf, [(3, "terminated"), (4, None)])
    buf.clear()
    assert len(buf) == 0
    stats = buf.stats()
    assert (stats["episodes"], stats["steps"], stats["valid_steps"]) == (0, 0, 0)
    with pytest.raises(EmptyBufferError, match="0 valid step"):
        buf.sample_n_step(1)
    with pytest.raises(EpisodeStateError, match="append to episode 1: it was evicted or cleared"):
        buf.append_observation_action_reward(1, *step(1, 4))
    e = buf.start_episode()
    assert e == 2
    for t in range(3):
        buf.append_observation_action_reward(e, *step(e, t))
    assert sorted(pairs_of(buf.sample_n_step(9, replace=False))) == [(2, 0), (2, 1)]


def test_memory_holds_every_completed_append(make):
    buf = make(32, storage="tensor")
    e = buf.start_episode()
    for t in range(3):
        buf.append_observation_action_reward(e, *step(e, t))
    rows = buf.memory.storage.get(torch.arange(3))
    assert sorted(rows["observation"][:, 1].tolist()) == [0, 1, 2]


# --------------------------------------------------------------------------- save / load
def test_save_and_load_metadata(make, tmp_path):
    buf = make(32, 4)
    ref = _interleaved(buf, [(3, "terminated"), (2, None)])
    buf.save(tmp_path / "episodes")
    assert (tmp_path / "episodes.metadata").exists()
    other = make(32, 4)
    document = other.load(tmp_path / "episodes")
    assert document["steps"] == ref.steps == 5
    assert document["valid_steps"] == ref.valid_steps == 4
    assert document["episodes"] == 2
    assert document["next_episode_id"] == 2
    assert other.spec == buf.spec
    e = other.start_episode()
    with pytest.raises(SchemaError, match="expected shape"):
        other.append_observation_action_reward(e, torch.zeros(4), action(0, 0), 0.0, extras(0))
    with pytest.raises(MetadataError, match="max_steps: metadata has 32, this buffer 16"):
        make(16).load(tmp_path / "episodes")
    with pytest.raises(MetadataError, match="does not exist"):
        other.load(tmp_path / "missing")


# --------------------------------------------------------------------------- storages
@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_both_storages_serve_the_same_samples(make, storage, tmp_path):
    buf = make(40, 5, storage=storage, seed=7)
    assert buf.stats()["storage"] == storage
    ref = _interleaved(buf, [(5, "terminated"), (8, "truncated"), (4, None), (0, "terminated")])
    for n in (1, 3, (1, 4)):
        assert_nstep_batch(buf.sample_n_step(64, n, 0.9), ref, n, 0.9)
    assert_sequence_batch(buf.sample_sequences(16, 5, strict=False), ref, 5)
    assert_sequence_batch(buf.sample_sequences(16, 5, strict=True), ref, 5)
    if storage == "memmap":
        assert list(tmp_path.glob("replaybuf-*"))
    buf.close()
    assert not list(tmp_path.glob("replaybuf-*"))


def test_stored_bytes_per_transition_stay_within_1_1x_of_the_payload(make):
    episodes, length = 3, 1000
    buf = make(episodes * length, episodes, storage="tensor")
    ids = [buf.start_episode() for _ in range(episodes)]
    frame = torch.zeros(len(ids), 4, 84, 84, dtype=torch.uint8)
    for t in range(length):
        frame[:, 0, 0, 0] = t % 256
        buf.append_batch(ids, frame, torch.zeros(len(ids), dtype=torch.int64), torch.ones(3))
    for e in ids:
        buf.end_episode(e, "truncated", final_observation=frame[0])
    stats = buf.stats()
    assert stats["steps"] == episodes * length
    payload = 4 * 84 * 84 + 8 + 4  # observation + int64 action + float32 reward
    assert stats["bytes"] / stats["steps"] <= 1.1 * payload
    # the storage never grows: replacing a whole episode keeps the bytes
    e = buf.start_episode()
    for _ in range(10):
        buf.append_observation_action_reward(e, frame[0], 0, 1.0)
    after = buf.stats()
    assert after["evicted_episodes"] == 1
    assert after["steps"] == (episodes - 1) * length + 10
    assert after["bytes"] == stats["bytes"]


def test_python_number_rewards_are_float32_even_when_the_first_is_an_int(tmp_path):
    with SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path, seed=0) as buf:
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, torch.zeros(2), 0, 0)
        buf.append_observation_action_reward(ep, torch.zeros(2), 1, 0.5)
        buf.end_episode(ep, "terminated", final_observation=torch.zeros(2))
        batch = buf.sample_n_step(4, n=2, gamma=1.0, replace=False)
        assert batch["reward"].dtype == torch.float32
        assert sorted(batch["reward"].tolist()) == [0.5, 0.5]


def test_sequence_padding_marks_episode_id_and_step_minus_one(tmp_path):
    with SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path, seed=0) as buf:
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, torch.zeros(2), 0, 1.0)
        buf.end_episode(ep, "terminated", final_observation=torch.ones(2))
        seq = buf.sample_sequences(3, 4, strict=False)
        assert seq["mask"].tolist() == [[True, False, False, False]] * 3
        assert seq["episode_id"].tolist() == [[ep, -1, -1, -1]] * 3
        assert seq["step"].tolist() == [[0, -1, -1, -1]] * 3


@pytest.mark.parametrize("strict", [True, False])
def test_sequence_batches_keep_their_key_order(tmp_path, strict):
    """observation, action, reward, next_observation, terminated, truncated, step, episode_id,
    the extras (top-level, in their stored order), mask: padded or not."""
    with SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path, seed=0) as buf:
        ep = buf.start_episode()
        for t in range(4):
            obs = {"a": torch.zeros(3), "b": torch.zeros(2)}
            extras = {"h": torch.zeros(4), "flag": t % 2 == 0}
            buf.append_observation_action_reward(ep, obs, t, 1.0, extras=extras)
        buf.end_episode(ep, "terminated", {"a": torch.ones(3), "b": torch.ones(2)})
        keys = list(buf.sample_sequences(2, 3, strict=strict).keys(True, True))
        assert keys == [
            ("observation", "a"), ("observation", "b"), "action", "reward",
            ("next_observation", "a"), ("next_observation", "b"), "terminated", "truncated",
            "step", "episode_id", "flag", "h", "mask",
        ]  # fmt: skip


def test_an_episode_holding_no_rows_is_not_evicted_for_step_pressure(tmp_path):
    with SyncEpisodeReplayBuffer(2, scratch_dir=tmp_path, seed=0) as buf:
        old = buf.start_episode()
        fresh = buf.start_episode()  # older than `writer` but holds nothing
        writer = buf.start_episode()
        buf.append_observation_action_reward(old, torch.zeros(2), 0, 1.0)
        buf.append_observation_action_reward(writer, torch.zeros(2), 0, 1.0)
        buf.append_observation_action_reward(writer, torch.zeros(2), 0, 1.0)  # evicts `old`
        stats = buf.stats()
        assert (stats["evicted_episodes"], stats["episodes"]) == (1, 2)  # `fresh` survived
        buf.append_observation_action_reward(fresh, torch.zeros(2), 0, 1.0)  # still appendable
        assert buf.stats()["evicted_episodes"] == 2  # that append had to evict `writer`


def test_the_readme_worked_example_holds(tmp_path):
    """README "Episodes and n-step returns": γ = 0.5, n = 3, episodes A, B, C."""
    with SyncEpisodeReplayBuffer(50, scratch_dir=tmp_path, seed=0) as buf:
        a, b, c = (buf.start_episode(name) for name in "ABC")
        for t, r in enumerate((1.0, 2.0, 4.0)):
            buf.append_observation_action_reward(a, torch.tensor([0.0, t]), 0, r)
        buf.end_episode(a, "terminated", final_observation=torch.tensor([0.0, 3]))
        buf.append_observation_action_reward(b, torch.tensor([1.0, 0]), 0, 1.0)
        buf.end_episode(b, "truncated", final_observation=torch.tensor([1.0, 1]))
        for t in range(3):
            buf.append_observation_action_reward(c, torch.tensor([2.0, t]), 0, 1.0)
        batch = buf.sample_n_step(10, n=3, gamma=0.5, replace=False)
        rows = {
            (int(e), int(t)): (m, r, nxt, term, trunc, cut, disc)
            for e, t, m, r, nxt, term, trunc, cut, disc in zip(
                batch["episode_id"].tolist(),
                batch["start_step"].tolist(),
                batch["actual_n"].tolist(),
                batch["reward"].tolist(),
                batch["next_observation"][:, 1].tolist(),
                batch["terminated"].tolist(),
                batch["truncated"].tolist(),
                batch["cut"].tolist(),
                batch["next_discount"].tolist(),
                strict=True,
            )
        }
        assert rows == {
            (a, 0): (3, 3.0, 3.0, True, False, False, 0.0),
            (a, 1): (2, 4.0, 3.0, True, False, False, 0.0),
            (a, 2): (1, 4.0, 3.0, True, False, False, 0.0),
            (b, 0): (1, 1.0, 1.0, False, True, False, 0.5),
            (c, 0): (2, 1.5, 2.0, False, False, True, 0.25),
            (c, 1): (1, 1.0, 2.0, False, False, True, 0.5),
        }


def _sorted_transitions(buf: SyncEpisodeReplayBuffer) -> TensorDict:
    """Every stored 3-step transition, ordered by (episode, step)."""
    batch = buf.sample_n_step(len(buf), n=3, gamma=0.9, replace=False)
    order = sorted(range(len(buf)), key=lambda i: pairs_of(batch)[i])
    return batch[torch.tensor(order)]


@pytest.mark.parametrize("evict", [False, True], ids=["room", "evicting"])
@pytest.mark.parametrize("envs", [2, 64])
def test_a_wide_append_batch_stores_exactly_what_per_step_appends_store(make, envs, evict):
    # A vector env: every slot runs episodes of its own length; an ended episode's slot starts
    # a new one in the same call. Fed once as append_batch calls, once step by step in the same
    # order, both buffers must hold the same episodes and transitions; with room for all, the
    # same rows, links and bookkeeping bit for bit (evictions may free rows in another order).
    lengths = [3 + (slot * 7) % 11 for slot in range(envs)]  # 3..13 steps
    # Evicting: room for every episode in progress (13 steps each) but not for the 30 steps
    # per slot written, so whole finished episodes get evicted on the way.
    size = 16 * envs if evict else 30 * envs
    episodes = 4 * envs if evict else 30 * envs  # also the reserve of final-observation rows
    batched, stepped = (make(size, episodes, storage="tensor") for _ in "ab")
    for buf in (batched, stepped):
        current = [buf.start_episode() for _ in range(envs)]
        age = [0] * envs
        for _ in range(30):
            steps = [step(current[s], age[s]) for s in range(envs)]
            if buf is batched:
                buf.append_batch(list(current), *batch_of(steps))
            else:
                for s in range(envs):
                    buf.append_observation_action_reward(current[s], *steps[s])
            for s in range(envs):
                age[s] += 1
                if age[s] == lengths[s]:
                    status = "terminated" if s % 2 else "truncated"
                    buf.end_episode(current[s], status, final_obs(current[s], age[s]))
                    current[s], age[s] = buf.start_episode(), 0
        buf.sample_n_step(1)  # flush the staged rows and bookkeeping
    assert batched.stats() == stepped.stats()
    assert (batched.stats()["evicted_episodes"] > 0) == evict
    for episode_id in batched._core.episodes:
        one, other = batched.get_episode(episode_id), stepped.get_episode(episode_id)
        assert (one == other).all(), episode_id
    assert (_sorted_transitions(batched) == _sorted_transitions(stepped)).all()
    if not evict:
        a, b = batched._core, stepped._core
        for name in ("next_row", "succ", "episode", "step", "end_kind", "alloc"):
            assert torch.equal(getattr(a.links, name), getattr(b.links, name)), name
        assert list(a.free) == list(b.free)


def _fill_every_end_kind(buf, extra=None) -> None:
    """Nine episodes of 3-6 steps: ends of every kind, and episodes still running."""
    for e in range(9):
        ep = buf.start_episode()
        for t in range(3 + e % 4):
            o, a, r, x = step(ep, t)
            if extra is not None:
                x = {**x, "extra": extra(ep, t)}
            buf.append_observation_action_reward(ep, o, a, r, extras=x)
        if e % 3:
            buf.end_episode(ep, "terminated" if e % 3 == 1 else "truncated", final_obs(ep, 9))


@pytest.mark.parametrize("n", [1, 3, (1, 4)], ids=["n1", "n3", "random-n"])
@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_numpy_gathers_give_the_batches_storage_delivery_gives(
    make_episode_buffer, monkeypatch, n, storage
):
    """CPU storage sampled on the CPU gathers in numpy; two buffers fed and seeded alike, one
    made to gather through SlotStorage.deliver: the same batches, key for key, dtype for
    dtype, and no field shares memory with storage."""
    bufs = [make_episode_buffer(60, seed=3, storage=storage) for _ in range(2)]
    for buf in bufs:
        _fill_every_end_kind(buf)
    slow = bufs[1]._core.slots
    _general_paths_for(bufs[1], host_views=False)  # neither one pass nor numpy gathers
    delivered = {id(buf._core.slots): 0 for buf in bufs}
    for buf in bufs:
        slots = buf._core.slots
        deliver = slots.deliver

        def counted(parts, device, slots=slots, deliver=deliver):
            delivered[id(slots)] += 1
            return deliver(parts, device)

        monkeypatch.setattr(slots, "deliver", counted)
    batches = [[buf.sample_n_step(64, n=n, gamma=0.9) for _ in range(3)] for buf in bufs]
    assert delivered == {id(bufs[0]._core.slots): 0, id(slow): 3}
    stored = [slow.column(key).numpy() for key in slow.spec]
    for got, want in zip(*batches, strict=True):
        assert list(got.keys(include_nested=True)) == list(want.keys(include_nested=True))
        for key in want.keys(include_nested=True, leaves_only=True):
            assert got[key].dtype == want[key].dtype, key
            assert torch.equal(got[key], want[key]), key
            assert not any(np.shares_memory(got[key].numpy(), column) for column in stored), key


def test_a_column_numpy_lacks_samples_through_storage_delivery(make_episode_buffer):
    """A bfloat16 field has no numpy view: its batches take SlotStorage.deliver, same values."""
    buf = make_episode_buffer(60, seed=3)
    _fill_every_end_kind(buf, lambda e, t: torch.tensor(e + t / 4, dtype=torch.bfloat16))
    batch = buf.sample_n_step(32, n=2)
    assert buf._core.slots.host_view(("extras", "extra")) is None
    assert buf._core.slots.host_view(("observation",)) is not None
    assert batch["extra"].dtype == torch.bfloat16
    want = batch["episode_id"] + batch["start_step"] / 4
    assert torch.equal(batch["extra"], want.to(torch.bfloat16))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@pytest.mark.parametrize("n", [1, 3, (1, 4)], ids=["n1", "n3", "random-n"])
@pytest.mark.parametrize("frame_stack", [None, 2])
def test_compiled_and_numpy_index_give_the_same_n_step_batches(
    make_episode_buffer, monkeypatch, n, frame_stack
):
    """Two buffers fed alike and seeded alike, one sampling through replaybuf.accel.numba_kernels
    and one
    through numpy: the same batches (rewards equal to 1e-6: the sums' order may differ)."""
    bufs = []
    for flag in ("1", "0"):  # the kernels are chosen when a buffer is built
        monkeypatch.setenv(NUMBA_ENV, flag)
        bufs.append(make_episode_buffer(60, seed=3, frame_stack=frame_stack))
    for buf in bufs:
        _fill_every_end_kind(buf)
    from replaybuf.accel import numba_kernels as kernels

    calls = []
    for name in ("nstep_windows", "frame_nstep"):  # frame stacks: the one-call frame kernel
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, f=kernel: calls.append(1) or f(*a))
    batches = [[buf.sample_n_step(64, n=n, gamma=0.9) for _ in range(3)] for buf in bufs]
    assert len(calls) == 3  # the first buffer's batches, not the second's, ran the kernel
    for got, want in zip(*batches, strict=True):
        assert list(got.keys(include_nested=True)) == list(want.keys(include_nested=True))
        for key in want.keys(include_nested=True, leaves_only=True):
            if key == "reward":
                torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(got[key], want[key]), key


def _general_paths_for(buf, host_views: bool) -> None:
    """Make ``buf`` sample n-step batches through the general path (the fast paths'
    reference), gathering with numpy (``host_views``) or through SlotStorage.deliver."""
    from replaybuf.sampling.nstep import NStepBuilder
    from replaybuf.sampling.paths import GeneralNStep

    buf._core.flush()  # the columns exist: choosing now is for good
    paths = buf._chosen_paths()
    builder = NStepBuilder(buf._core, buf.device, paths.builder.math, host_views)
    general = GeneralNStep(builder, buf._generator)
    buf._paths = dataclasses.replace(paths, n_step=general, builder=builder)


def _general_n_step(buf, batch_size, n, gamma):
    """``sample_n_step`` through the general path (what the one-pass path skips)."""
    from replaybuf.sampling.paths import GeneralNStep

    return GeneralNStep(buf._chosen_paths().builder, buf._generator)(batch_size, n, gamma, True)


def _assert_same_batches(got: TensorDict, want: TensorDict) -> None:
    assert list(got.keys(include_nested=True)) == list(want.keys(include_nested=True))
    assert got.batch_size == want.batch_size
    assert got.device == want.device
    for key in want.keys(include_nested=True, leaves_only=True):
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    episodes=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from(["terminated", "truncated", None])),
        min_size=1,
        max_size=12,
    ),
    max_steps=st.integers(9, 40),  # an episode in progress (<= 9 steps) is never evicted
    storage=st.sampled_from(["tensor", "memmap"]),
    n=st.integers(1, 5),
    gamma=st.sampled_from([0.3, 0.5, 0.99, 1.0]),
    batch_size=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    reward_dtype=st.sampled_from([torch.float32, torch.float64]),
    nested=st.booleans(),
    frame_stack=st.sampled_from([None, 1, 2, 4]),
    padding=st.sampled_from(["reset", "zero"]),
)
def test_one_pass_uniform_n_step_batches_are_the_general_paths(
    make_episode_buffer,
    episodes,
    max_steps,
    storage,
    n,
    gamma,
    batch_size,
    seed,
    reward_dtype,
    nested,
    frame_stack,
    padding,
):
    """``sample_n_step`` on CPU storage (draw, windows and gathers in one pass: the seam's
    HostNStep) against the general path on the same buffer, the generator
    seeded alike: the same batch, key for key, over random episode layouts with evictions,
    episodes in progress and both end kinds; float32 and float64 rewards (the kernel's two
    signatures), flat and nested observations (one leaf of no elements), with and without
    frame stacks (both paddings; episode e's frames are nonzero from e = 1, so a padding frame
    left unzeroed or zeroed wrongly shows)."""
    from replaybuf.sampling.host import HostNStep

    def observed(value: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if not nested:
            return value
        return {"pos": value, "img": value.to(torch.uint8), "empty": value[:0]}  # no elements

    stacking = {} if frame_stack is None else {"frame_stack_padding": padding}
    buf = make_episode_buffer(max_steps, storage=storage, frame_stack=frame_stack, **stacking)
    for length, status in episodes:
        ep = buf.start_episode()
        for t in range(length):
            o, a, r, x = step(ep, t)
            reward = torch.tensor(r, dtype=reward_dtype)
            buf.append_observation_action_reward(ep, observed(o), a, reward, extras=x)
        if status is not None:
            buf.end_episode(ep, status, observed(final_obs(ep, length)))
    if len(buf) == 0:
        with pytest.raises(EmptyBufferError):
            buf.sample_n_step(batch_size, n=n, gamma=gamma)
        return
    buf._generator.manual_seed(seed)
    got = buf.sample_n_step(batch_size, n=n, gamma=gamma)
    assert isinstance(buf._chosen_paths().n_step, HostNStep)  # the one-pass path ran
    buf._generator.manual_seed(seed)
    _assert_same_batches(got, _general_n_step(buf, batch_size, n, gamma))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_the_chosen_paths_live_as_long_as_the_columns(make_episode_buffer):
    """The paths (the one-pass plan holds views of the columns) are chosen once and kept while
    the storage's ``derived`` cache holds their token: chosen anew when the columns are
    (re)allocated, with the general path's batches still, and dropped when the storage
    closes, so no view keeps its memory mapped."""
    from replaybuf.sampling.host import HostNStep

    buf = make_episode_buffer(60, seed=3, storage="memmap")
    _fill_every_end_kind(buf)
    slots = buf._core.slots
    buf.sample_n_step(8)
    paths = buf._chosen_paths()
    assert isinstance(paths.n_step, HostNStep)
    buf.sample_n_step(8)
    assert buf._chosen_paths() is paths  # kept
    slots._after_first_write()  # what an allocation of the columns runs: new views
    assert paths.token not in slots.derived.values()
    buf._generator.manual_seed(9)
    got = buf.sample_n_step(16, n=2)
    assert buf._chosen_paths() is not paths
    buf._generator.manual_seed(9)
    _assert_same_batches(got, _general_n_step(buf, 16, 2, 0.99))
    buf.close()
    assert slots.derived == {}


def test_each_configuration_gets_its_path(make_episode_buffer, monkeypatch):
    """The seam's choice: the one-pass path for CPU storage delivering on the CPU with the
    kernels (frame stacks too); the general path for priorities, another delivery device,
    fields the kernel or numpy cannot take and the numpy index (no numba). The one-pass path
    hands a random n and draws without replacement to the general path: the same batches."""
    from replaybuf.sampling import choose
    from replaybuf.sampling.host import HostNStep
    from replaybuf.sampling.paths import GeneralNStep

    def filled(**kwargs):
        buf = make_episode_buffer(60, seed=3, **kwargs)
        _fill_every_end_kind(buf)
        buf.sample_n_step(4)  # flushed
        return buf

    def path(buf, device=None):
        device = buf.device if device is None else torch.device(device)
        return choose(buf._core, device, buf._generator, buf._draws).n_step

    plain = filled()
    assert isinstance(path(plain, "meta"), GeneralNStep)
    assert isinstance(path(filled(prioritized=True)), GeneralNStep)
    stacked = filled(frame_stack=2)
    assert isinstance(path(stacked), HostNStep)
    assert stacked.sample_n_step(4)["observation"].shape == (4, 2, 3)
    for n, replace in (((1, 3), True), (2, False)):
        plain._generator.manual_seed(5)
        got = plain.sample_n_step(6, n=n, gamma=0.9, replace=replace)
        plain._generator.manual_seed(5)
        general = GeneralNStep(plain._chosen_paths().builder, plain._generator)
        _assert_same_batches(got, general(6, n, 0.9, replace))
    for name, dtype in (
        ("reward", torch.float16),
        ("reward", torch.int64),
        ("extra", torch.bfloat16),
    ):
        odd = make_episode_buffer(60, seed=3)  # a field the kernel or numpy cannot take
        for t in range(4):
            o, a, r, x = step(0, t)
            r = torch.tensor(r).to(dtype) if name == "reward" else r
            extras = {**x, "extra": torch.tensor(t, dtype=dtype)} if name == "extra" else x
            odd.append_observation_action_reward(
                odd.start_episode() if t == 0 else 0, o, a, r, extras=extras
            )
        assert odd.sample_n_step(2).batch_size == (2,)  # sampling works
        assert isinstance(path(odd), GeneralNStep), (name, dtype)
    monkeypatch.setenv(NUMBA_ENV, "0")
    assert isinstance(path(filled()), GeneralNStep)
    if NO_KERNELS is None:
        assert isinstance(path(plain), HostNStep)


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("frame_stack", [None, 2])
def test_cpu_storage_samples_on_the_cpu_under_another_default_device(
    make_episode_buffer, frame_stack, prioritized
):
    """A CPU buffer's host bookkeeping, staging, the numbers it converts, its draws, n-step
    powers, importance weights and priority updates given as lists are made on the CPU, not
    on torch's default device (a trainer may call ``torch.set_default_device("cuda")``; the
    meta device stands in for it here): a buffer built, filled and sampled inside the context
    gives the batches one outside does, on the CPU."""
    calls = {
        "n=1": lambda b: b.sample_n_step(8),
        "n=3": lambda b: b.sample_n_step(8, n=3, gamma=0.7),
        "random n": lambda b: b.sample_n_step(8, n=(1, 3)),
        "distinct": lambda b: b.sample_n_step(8, replace=False),
        "sequences": lambda b: b.sample_sequences(4, 2),
        "padded sequences": lambda b: b.sample_sequences(4, 3, strict=False),
        "epoch": lambda b: next(iter(b.iterate_epochs(8))),
    }
    if prioritized:  # update by a list of ids and one of floats, then draw by priority

        def updated(b):
            ids = b.sample_n_step(8)["index"].tolist()
            assert b.update_priorities(ids, [float(i % 3) for i in range(8)]) == 8
            return b.sample_n_step(8)

        calls["after an update"] = updated
    script = []  # _fill_every_end_kind's episodes, their tensors made outside the context
    for e in range(9):
        end = None if e % 3 == 0 else ("terminated" if e % 3 == 1 else "truncated")
        script.append(([step(e, t) for t in range(3 + e % 4)], end, final_obs(e, 9)))

    def made_and_filled():
        buf = make_episode_buffer(60, seed=3, frame_stack=frame_stack, prioritized=prioritized)
        for steps, end, final in script:
            ep = buf.start_episode()
            for o, a, r, x in steps:  # r: a Python float, made a tensor by the buffer
                buf.append_observation_action_reward(ep, o, a, r, extras=x)
            if end is not None:
                buf.end_episode(ep, end, final)
        return buf

    bufs = [made_and_filled()]
    with torch.device("meta"):  # built, filled and flushed inside the context
        bufs.append(made_and_filled())
    from replaybuf.core import nstep

    for name, call in calls.items():
        want = call(bufs[0])
        nstep._POWERS.clear()  # so that the powers are made again inside the context
        nstep._HOST_POWERS.clear()
        with torch.device("meta"):
            got = call(bufs[1])
        assert got.device == torch.device("cpu"), name
        _assert_same_batches(got, want)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int64, torch.bool, torch.float32, torch.float64, torch.bfloat16]
)
def test_padding_zeroes_past_the_end_and_keeps_every_real_value(dtype):
    """Sequence padding (``padding.pad_copy``: a new tensor; ``pad_in_place``: into a fresh
    gather): zero at padded steps, the stored value elsewhere; a float NaN or inf at a real
    step stays (on the CPU integers and bools are multiplied by the mask, floats go through
    ``torch.where`` / ``masked_fill_``)."""
    from replaybuf.sampling.padding import pad_copy as _pad
    from replaybuf.sampling.padding import pad_in_place as _pad_in_place

    g = torch.Generator().manual_seed(0)
    value = torch.randint(0, 200, (3, 5, 2, 4), generator=g).to(dtype)
    if dtype.is_floating_point:
        value[0, 0, 0, 0], value[0, 1, 0, 0] = float("nan"), float("inf")
        value[2, 4, 0, 0] = float("nan")  # at a padded step: must become 0
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [True] * 4 + [False]])
    out = _pad(value, mask, False if dtype == torch.bool else 0)
    want = value.clone()  # the slow way: zero each padded step
    for b, t in itertools.product(range(3), range(5)):
        if not mask[b, t]:
            want[b, t] = 0
    assert out.dtype == dtype
    assert out.data_ptr() != value.data_ptr()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    fresh = value.clone()  # a fresh gather: padded in place
    assert _pad_in_place(fresh, ~mask, False if dtype == torch.bool else 0) is fresh
    torch.testing.assert_close(fresh, want, rtol=0, atol=0, equal_nan=True)
    ids = _pad(torch.arange(15).reshape(3, 5), mask, -1)  # episode ids pad with -1
    assert ids[1].tolist() == [5, 6, -1, -1, -1]
