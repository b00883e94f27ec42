"""Frame-stack deduplication: one frame stored per step, k-frame stacks rebuilt when sampling.

Three layers: the index math (``stack_rows`` / ``stack_windows``) against a plain-loop oracle;
random programs of appends, ends, evictions and every reader against the reference model
(``tests/reference.py`` with ``frame_stack``); and named cases (the worked example, zero
padding, dict observations, errors that change nothing, checkpoints, metadata, memory).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from episode_helpers import (
    action,
    assert_episode_record,
    assert_nstep_batch,
    final_obs,
    obs,
    reward,
)
from episode_program import Program, reference_for
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from replaybuf import (
    CorruptCheckpointError,
    EpisodeReplayBuffer,
    MetadataError,
    SchemaError,
    SyncEpisodeReplayBuffer,
)
from replaybuf.accel.numba_loader import kernels_unavailable_reason
from replaybuf.core.index import stack_rows, stack_windows
from replaybuf.persist.format.names import seal


@pytest.fixture
def make(make_episode_buffer):
    """A factory for frame-stacking sync buffers (``frame_stack=3`` unless given)."""
    return functools.partial(make_episode_buffer, frame_stack=3)


def frame(e: int, t: int) -> torch.Tensor:
    """A frame that is never all zeros, so zero padding cannot pass for a real frame."""
    return torch.tensor([[e + 1, t + 1], [7, 7]], dtype=torch.uint8)


# --------------------------------------------------------------------------- index math
def oracle_stack(episodes: list[list[int]], row: int, k: int) -> tuple[list[int], list[bool]]:
    """The stack of ``row`` by plain lookup: its episode's rows t-k+1 .. t, clamped at 0."""
    rows = next(r for r in episodes if row in r)
    t = rows.index(row)
    return [rows[max(t - j, 0)] for j in range(k - 1, -1, -1)], [
        t - j >= 0 for j in range(k - 1, -1, -1)
    ]


def prev_links(episodes: list[list[int]], capacity: int) -> torch.Tensor:
    prev_row = torch.full((capacity,), -1, dtype=torch.long)
    for rows in episodes:
        for a, b in itertools.pairwise(rows):
            prev_row[b] = a
    return prev_row


def test_stack_rows_table_case():
    #   rows:   3 ──▶ 0 ──▶ 5        (one episode: steps 0, 1, 2)
    prev_row = prev_links([[3, 0, 5]], 6)
    stacked, real = stack_rows(torch.tensor([3, 0, 5]), 4, prev_row)
    assert stacked.tolist() == [[3, 3, 3, 3], [3, 3, 3, 0], [3, 3, 0, 5]]
    assert real.tolist() == [
        [False, False, False, True],
        [False, False, True, True],
        [False, True, True, True],
    ]
    single, real1 = stack_rows(torch.tensor([[5]]), 1, prev_row)  # k = 1: the row itself
    assert single.tolist() == [[[5]]]
    assert real1.tolist() == [[[True]]]


@pytest.mark.parametrize("host", [False, True], ids=["torch", "numpy"])
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_stack_rows_and_windows_match_the_plain_oracle(host, lengths, k, seed):
    """On torch tensors and on numpy arrays (the host path): the same rows as the oracle."""
    capacity = sum(lengths) + 3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(capacity, generator=g).tolist()  # episodes interleave in storage
    episodes, at = [], 0
    for n in lengths:
        episodes.append(perm[at : at + n])
        at += n
    prev_row = prev_links(episodes, capacity)
    every = [r for rows in episodes for r in rows]
    arrays = (lambda t: t.numpy()) if host else (lambda t: t)
    stacked, real = stack_rows(arrays(torch.tensor(every)), k, arrays(prev_row))
    assert isinstance(stacked, np.ndarray) == host
    assert isinstance(real, np.ndarray) == host
    for i, row in enumerate(every):
        want_rows, want_real = oracle_stack(episodes, row, k)
        assert stacked[i].tolist() == want_rows
        assert real[i].tolist() == want_real
    # windows: each episode from a random start to its end, stacks cut without overlap
    starts = [int(torch.randint(0, len(rows), (), generator=g)) for rows in episodes]
    length = min(len(rows) - s for rows, s in zip(episodes, starts, strict=True))
    obs_rows = torch.tensor(
        [rows[s : s + length] for rows, s in zip(episodes, starts, strict=True)]
    )
    window, window_real = stack_windows(
        arrays(obs_rows[:, 0]), arrays(obs_rows), k, arrays(prev_row)
    )
    assert window.shape == (len(episodes), k - 1 + length)
    assert window.dtype == (np.int64 if host else torch.int64)
    assert window_real.dtype == (np.bool_ if host else torch.bool)
    for b, p in itertools.product(range(len(episodes)), range(length)):
        want_rows, want_real = oracle_stack(episodes, int(obs_rows[b, p]), k)
        assert window[b, p : p + k].tolist() == want_rows
        assert window_real[b, p : p + k].tolist() == want_real


# --------------------------------------------------------------------------- random programs
picks = st.integers(0, 30)
operations = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append"), picks, st.integers(1, 4)),
    st.tuples(st.just("append_batch"), st.lists(picks, min_size=1, max_size=3), st.integers(1, 3)),
    st.tuples(st.just("end"), picks, st.sampled_from(["terminated", "truncated"])),
    st.tuples(st.just("end"), picks, st.sampled_from(["terminated", "truncated"])),
    st.tuples(st.just("sample_all"), st.integers(1, 5), st.sampled_from([1.0, 0.9, 0.5])),
    st.tuples(
        st.just("sample"),
        st.one_of(st.integers(1, 5), st.just((1, 5)), st.just((2, 3))),
        st.just(0.9),
    ),
    st.tuples(st.just("sequences"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("episode"), picks),
    st.tuples(st.just("sample_episodes"), st.integers(1, 3)),
    st.tuples(st.just("epochs"), st.integers(1, 5), st.integers(1, 5)),
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    max_steps=st.integers(2, 14),
    max_episodes=st.one_of(st.none(), st.integers(1, 4)),
    k=st.integers(1, 4),
    padding=st.sampled_from(["reset", "zero"]),
    storage=st.sampled_from(["tensor", "memmap"]),
    ops=st.lists(operations, min_size=8, max_size=40),
)
def test_random_programs_agree_with_the_stacking_reference(
    make, max_steps, max_episodes, k, padding, storage, ops
):
    program = Program(
        make(max_steps, max_episodes, frame_stack=k, frame_stack_padding=padding, storage=storage)
    )
    for name, *args in ops:
        getattr(program, name)(*args)
        program.check()
    for i, _ in enumerate(program.running()):  # finale: end them all, then read everything
        program.end(0, ("terminated", "truncated")[i % 2])
        program.check()
    program.sample_all(5, 0.9)
    program.sequences(3, False)
    for e in range(program.ref.next_id):
        program.episode(e)
    stats = program.buf.stats()
    assert stats["frame_stack"] == k
    assert stats["steps"] <= max_steps  # storage never holds more than it may
    assert max_episodes is None or stats["episodes"] <= max_episodes
    event(f"evicted: {min(stats['evicted_episodes'], 2)}")
    event(f"episode end sampled: {program.ends_sampled}")
    program.buf.close()


# --------------------------------------------------------------------------- the fast path
NO_KERNELS = kernels_unavailable_reason()


def leaves(e: int, t: int) -> dict[str, torch.Tensor]:
    """A dict observation of several leaves (two frame kinds and a vector), never all zeros."""
    return {
        "pixels": frame(e, t),
        "depth": torch.full((3,), 10 * e + t + 1, dtype=torch.int16),
        "pos": torch.tensor([e + 0.5, t + 0.25]),
    }


def general_n_step(buf: SyncEpisodeReplayBuffer, batch_size: int, n: int, gamma: float):
    """``sample_n_step`` through the general path (the fast path's reference)."""
    from replaybuf.sampling.paths import GeneralNStep

    return GeneralNStep(buf._chosen_paths().builder, buf._generator)(batch_size, n, gamma, True)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(np.shares_memory(a.numpy(), b.numpy()))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    episodes=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from(["terminated", "truncated", None])),
        min_size=1,
        max_size=10,
    ),
    max_steps=st.integers(10, 40),  # an episode in progress (<= 9 steps) is never evicted
    k=st.integers(1, 5),
    padding=st.sampled_from(["reset", "zero"]),
    n=st.integers(1, 5),
    batch_size=st.integers(1, 40),
    prioritized=st.booleans(),
    nested=st.booleans(),
    storage=st.sampled_from(["tensor", "memmap"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fast_frame_stacks_are_the_general_paths(
    make, episodes, max_steps, k, padding, n, batch_size, prioritized, nested, storage, seed
):
    """The one-pass paths (each window's k + n frames gathered once where every window of the
    batch is n < k steps long, else both ends' stacks; uniform draws through FrameNStep's
    one compiled call, prioritized ones through HostNStep) against the general path on the same
    buffer, the generator seeded alike: the same batch, key for key, over random episode
    layouts with evictions and episodes in progress, both paddings, k and n in 1..5, flat and
    dict observations, uniform and prioritized draws (priorities made uneven first)."""
    from replaybuf.sampling.host import FrameNStep, HostNStep

    buf = make(
        max_steps,
        frame_stack=k,
        frame_stack_padding=padding,
        prioritized=prioritized,
        storage=storage,
    )
    observed = leaves if nested else frame
    for length, status in episodes:
        e = buf.start_episode()
        for t in range(length):
            buf.append_observation_action_reward(e, observed(e, t), t, reward(e, t))
        if status is not None:
            buf.end_episode(e, status, final_observation=observed(e, length))
    if len(buf) == 0:
        return
    if prioritized:  # priorities that differ, so that the tree's descent matters
        drawn = buf.sample_n_step(16, n=n)
        buf.update_priorities(
            drawn["index"], torch.rand(16, generator=torch.Generator().manual_seed(seed)) + 0.01
        )
    buf._generator.manual_seed(seed)
    got = buf.sample_n_step(batch_size, n=n, gamma=0.9)
    fast = buf._chosen_paths().n_step  # the fast path ran: the one-call one where uniform
    assert type(fast) is (HostNStep if prioritized else FrameNStep)
    buf._generator.manual_seed(seed)
    want = general_n_step(buf, batch_size, n, 0.9)
    assert list(got.keys(include_nested=True)) == list(want.keys(include_nested=True))
    for key in want.keys(include_nested=True, leaves_only=True):
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key
    # one gather for both ends exactly where every window is n < k steps long
    one = n < k and bool((got["actual_n"] == n).all())
    now, after = (
        got[name] if not nested else got[name]["pixels"]
        for name in ("observation", "next_observation")
    )
    assert shares_memory(now, after) == one
    event(f"both stacks from one gather: {one}")


@pytest.mark.parametrize("shared", [True, False])
def test_one_call_batches_are_the_callers_across_calls(make, shared, monkeypatch):
    """The one-call path reuses a scratch tensor for its draws: batches of changing sizes, each
    the general path's for the same seed, and none changed or shared by a later call; built
    from shared attributes, or by ``_new_unsafe`` where none are found."""
    from replaybuf.sampling.host import FrameNStep

    if not shared:
        monkeypatch.setattr("replaybuf.sampling.host.shared_attributes", lambda *args: None)
    buf = make(40, frame_stack=3)
    for e_len in (7, 9, 11):
        e = buf.start_episode()
        for t in range(e_len):
            buf.append_observation_action_reward(e, frame(e, t), t, float(t))
        buf.end_episode(e, "terminated", final_observation=frame(e, e_len))
    got = []
    for i, size in enumerate((8, 16, 8, 1)):
        buf._generator.manual_seed(i)
        got.append(buf.sample_n_step(size, n=2, gamma=0.9))
        assert isinstance(buf._chosen_paths().n_step, FrameNStep)
        buf._generator.manual_seed(i)
        want = general_n_step(buf, size, 2, 0.9)
        leaves = want.keys(include_nested=True, leaves_only=True)
        assert all(torch.equal(got[-1][key], want[key]) for key in leaves), size
    kept = [batch.clone() for batch in got]
    for _ in range(3):
        buf.sample_n_step(16, n=2)
    for batch, before in zip(got, kept, strict=True):
        assert (batch == before).all()
    for key in got[0].keys(include_nested=True, leaves_only=True):
        assert not shares_memory(got[0][key], got[2][key]), key
    # each batch as TensorDict's unchecked constructor builds it, with a leaf dict of its own
    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is not None:
        for batch in got:
            built = unsafe(dict(batch.items()), batch_size=batch.batch_size, device="cpu")
            attributes = {k: v for k, v in vars(batch).items() if k != "_tensordict"}
            assert attributes == {k: v for k, v in vars(built).items() if k != "_tensordict"}
        assert got[0]._tensordict is not got[2]._tensordict
    assert (buf._chosen_paths().n_step.attributes is not None) == shared


def test_batches_are_the_callers_after_later_writes(make):
    """Stacks cut from one gather of k + n frames: nothing of the storage, so writes that
    evict and reuse every row leave a batch as it was; its two stacks share frames (writing
    one shows in the other, as in a sequence batch)."""
    buf = make(12, frame_stack=4)
    e = buf.start_episode()
    for t in range(10):
        buf.append_observation_action_reward(e, frame(e, t), t, 1.0)
    got = buf.sample_n_step(8, n=1)
    kept = got.clone()
    assert shares_memory(got["observation"], got["next_observation"])
    buf.end_episode(e, "truncated", final_observation=frame(e, 10))
    for _ in range(3):  # every row rewritten by later episodes
        e = buf.start_episode()
        for t in range(6):
            buf.append_observation_action_reward(e, frame(e, 100 + t), t, 1.0)
        buf.end_episode(e, "terminated", final_observation=frame(e, 106))
    assert (got == kept).all()
    assert torch.equal(got["observation"][:, 1:], got["next_observation"][:, :-1])


# --------------------------------------------------------------------------- named cases
def test_worked_example_with_n_step_and_truncation(make):
    """k = 3, episode of 3 steps truncated; n = 2 windows; stacks padded with obs_0."""
    buf = make(frame_stack=3)
    e = buf.start_episode()
    for t in range(3):
        buf.append_observation_action_reward(e, frame(e, t), t, 1.0)
    buf.end_episode(e, "truncated", final_observation=frame(e, 3))
    batch = buf.sample_n_step(3, n=2, gamma=0.5, replace=False)
    f = [frame(e, t) for t in range(4)]
    stacks = {  # step -> its stack, written out by hand
        0: [f[0], f[0], f[0]],
        1: [f[0], f[0], f[1]],
        2: [f[0], f[1], f[2]],
        3: [f[1], f[2], f[3]],  # the final observation's stack
    }
    for i in range(3):
        t = int(batch["start_step"][i])
        end = min(t + 2, 3)  # obs_{t+m}: t=0 -> obs_2, t=1 and t=2 -> obs_3 (final)
        assert torch.equal(batch["observation"][i], torch.stack(stacks[t]))
        assert torch.equal(batch["next_observation"][i], torch.stack(stacks[end]))
        assert bool(batch["truncated"][i]) == (end == 3)
        assert float(batch["next_discount"][i]) == 0.5 ** (end - t)  # truncated: bootstrap
    record = buf.get_episode(e)["observation"]  # [4, 3, 2, 2]
    assert record.shape == (4, 3, 2, 2)
    assert torch.equal(record[3], torch.stack([f[1], f[2], f[3]]))  # the final's stack


def test_zero_padding_fills_frames_before_the_episode_start_with_zeros(make):
    buf = make(frame_stack=4, frame_stack_padding="zero")
    e = buf.start_episode()
    for t in range(2):
        buf.append_observation_action_reward(e, frame(e, t), t, 1.0)
    buf.end_episode(e, "terminated", final_observation=frame(e, 2))
    zero = torch.zeros(2, 2, dtype=torch.uint8)
    record = buf.get_episode(e)["observation"]
    assert torch.equal(record[0], torch.stack([zero, zero, zero, frame(e, 0)]))
    assert torch.equal(record[2], torch.stack([zero, frame(e, 0), frame(e, 1), frame(e, 2)]))
    seq = buf.sample_sequences(2, 2, strict=True)
    assert torch.equal(seq["observation"][0], record[:2])
    assert torch.equal(seq["next_observation"][0], record[1:])
    batch = buf.sample_n_step(2, n=1, replace=False)
    for i in range(2):
        t = int(batch["start_step"][i])
        assert torch.equal(batch["observation"][i], record[t])
        assert torch.equal(batch["next_observation"][i], record[t + 1])


def test_a_zero_step_episode_and_a_fresh_one_have_stacked_shapes(make):
    buf = make(frame_stack=3)
    fresh = buf.start_episode()
    assert "observation" not in buf.get_episode(fresh)  # nothing fixed the spec yet
    lone = buf.start_episode()
    buf.end_episode(lone, "terminated", final_observation=frame(lone, 0))
    assert torch.equal(buf.get_episode(lone)["observation"], frame(lone, 0).expand(1, 3, 2, 2))
    e = buf.start_episode()
    buf.append_observation_action_reward(e, frame(e, 0), 0, 1.0)
    assert buf.get_episode(fresh)["observation"].shape == (0, 3, 2, 2)
    zero = make(8, frame_stack=2, frame_stack_padding="zero")
    z = zero.start_episode()
    zero.end_episode(z, "truncated", final_observation=frame(z, 0))
    want = torch.stack([torch.zeros(2, 2, dtype=torch.uint8), frame(z, 0)]).unsqueeze(0)
    assert torch.equal(zero.get_episode(z)["observation"], want)


def test_dict_observations_stack_every_leaf(make):
    buf = make(frame_stack=2)
    e = buf.start_episode()
    for t in range(3):
        observation = {"pixels": frame(e, t), "state": {"pos": torch.tensor([float(t)])}}
        buf.append_observation_action_reward(e, observation, t, 1.0)
    final = {"pixels": frame(e, 3), "state": {"pos": torch.tensor([3.0])}}
    buf.end_episode(e, "terminated", final_observation=final)
    batch = buf.sample_n_step(3, n=1, replace=False)
    for i in range(3):
        t = int(batch["start_step"][i])
        pos = batch["observation", "state", "pos"][i]
        assert pos.tolist() == [[float(max(t - 1, 0))], [float(t)]]
        assert torch.equal(batch["next_observation", "pixels"][i][1], frame(e, t + 1))
    record = buf.get_episode(e)
    assert record["observation", "pixels"].shape == (4, 2, 2, 2)
    assert record["observation", "state", "pos"][:, :, 0].tolist() == [
        [0, 0],
        [0, 1],
        [1, 2],
        [2, 3],
    ]
    seq = buf.sample_sequences(1, 3)
    assert seq["observation", "state", "pos"].shape == (1, 3, 2, 1)


def test_eviction_never_lets_a_stack_reach_into_another_episode(make):
    # 4 steps fit: each new episode evicts the oldest, and its rows are reused at once.
    buf = make(4, 2, frame_stack=4, storage="tensor")
    program = Program(buf)
    for _ in range(6):
        program.start("a")
        e = program.running()[-1]
        program.append(e, 3)
        program.end(0, "truncated")
        program.check()
        program.sample_all(3, 0.9)
        program.sequences(2, False)
    assert buf.stats()["evicted_episodes"] >= 4


def test_fast_append_path_still_applies_with_frame_stacking(make):
    buf = make(frame_stack=4)
    e = buf.start_episode()
    buf.append_observation_action_reward(e, obs(e, 0), action(e, 0), reward(e, 0))
    core = buf._core
    assert core.append_one(core.episodes[e], obs(e, 1), action(e, 1), reward(e, 1), None)
    buf.end_episode(e, "terminated", final_observation=final_obs(e, 2))
    ref = reference_for(buf)
    ref.start()
    ref.append([e], [obs(e, 0)], [action(e, 0)], [reward(e, 0)])
    ref.append([e], [obs(e, 1)], [action(e, 1)], [reward(e, 1)])
    ref.end(e, "terminated", final_obs(e, 2))
    assert_episode_record(buf.get_episode(e), ref, e)
    assert_nstep_batch(buf.sample_n_step(8, n=3, gamma=0.9), ref, 3, 0.9)


@pytest.mark.parametrize("padding", ["reset", "zero"])
def test_prioritized_sampling_returns_stacks_with_index_and_weight(make, padding):
    """Prioritized batches take the general path (the stack rows from the compiled loop where
    numba runs): the reference's stacks, padded as asked, with index and weight."""
    buf = make(frame_stack=3, frame_stack_padding=padding, prioritized=True)
    ref = reference_for(buf)
    for steps in (1, 4):  # episode 1's frames are nonzero: a wrong padding shows
        e = buf.start_episode()
        ref.start()
        for t in range(steps):
            buf.append_observation_action_reward(e, obs(e, t), action(e, t), reward(e, t))
            ref.append([e], [obs(e, t)], [action(e, t)], [reward(e, t)])
        buf.end_episode(e, "truncated", final_observation=final_obs(e, steps))
        ref.end(e, "truncated", final_obs(e, steps))
    batch = buf.sample_n_step(8, n=2)
    assert batch["observation"].shape == (8, 3, 3)
    assert_nstep_batch(batch, ref, 2, 0.99)
    assert buf.update_priorities(batch["index"], torch.ones(8)) == 8
    seq = buf.sample_sequences(2, 3)
    assert seq["observation"].shape == (2, 3, 3, 3)
    assert seq["weight"].shape == (2, 3)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"frame_stack": 0}, ValueError, "frame_stack must be >= 1, got 0"),
        ({"frame_stack": -2}, ValueError, "frame_stack must be >= 1, got -2"),
        ({"frame_stack": 2.0}, TypeError, "frame_stack must be an int, got float 2.0"),
        ({"frame_stack": True}, TypeError, "frame_stack must be an int, got bool"),
        ({"frame_stack": "4"}, TypeError, "frame_stack must be an int, got str"),
        (
            {"frame_stack": 4, "frame_stack_padding": "same"},
            ValueError,
            r"frame_stack_padding must be one of \('reset', 'zero'\), got 'same'",
        ),
        (
            {"frame_stack_padding": "zero"},
            ValueError,
            "frame_stack_padding='zero' needs frame_stack",
        ),
    ],
)
def test_bad_frame_stack_arguments_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        SyncEpisodeReplayBuffer(8, scratch_dir=tmp_path, **kwargs)
    with pytest.raises(error, match=match):
        EpisodeReplayBuffer(8, scratch_dir=tmp_path, **kwargs)
    assert not list(tmp_path.glob("replaybuf-*"))


def test_a_wrong_frame_shape_is_refused_and_changes_nothing(make):
    buf = make(frame_stack=4)
    e = buf.start_episode()
    buf.append_observation_action_reward(e, frame(e, 0), 0, 1.0)
    buf.append_observation_action_reward(e, frame(e, 1), 1, 1.0)
    record = buf.get_episode(e)  # flushes: storage is allocated before `before`
    before = buf.stats()
    stacked = torch.stack([frame(e, 2)] * 4)  # [4, 2, 2]: a stack, not a frame
    with pytest.raises(SchemaError, match=r"expected shape \[2, 2\], got \[4, 2, 2\].*one frame"):
        buf.append_observation_action_reward(e, stacked, 2, 1.0)
    with pytest.raises(SchemaError, match=r"expected shape \[2, 2\], got \[4, 2, 2\].*one frame"):
        buf.append_batch([e], stacked.unsqueeze(0), torch.tensor([2]), torch.tensor([1.0]))
    with pytest.raises(SchemaError, match=r"expected shape \[2, 2\], got \[3\]$"):
        buf.append_observation_action_reward(e, torch.zeros(3, dtype=torch.uint8), 2, 1.0)
    with pytest.raises(SchemaError, match=r"expected shape \[2, 2\], got \[4, 2, 2\].*one frame"):
        buf.end_episode(e, "terminated", final_observation=stacked)
    assert buf.stats() == before
    assert (buf.get_episode(e) == record).all()
    assert buf._core.episodes[e].in_progress
    buf.append_observation_action_reward(e, frame(e, 2), 2, 1.0)  # still appendable
    buf.end_episode(e, "terminated", final_observation=frame(e, 3))
    assert buf.get_episode(e)["observation"].shape == (4, 4, 2, 2)


# --------------------------------------------------------------------------- checkpoints
def fill(buf: SyncEpisodeReplayBuffer) -> None:
    """Interleaved episodes: ended, truncated, in progress, zero-step, and evictions."""
    ids = [buf.start_episode() for _ in range(4)]
    for t in range(7):
        for i, e in enumerate(ids):
            if t < 2 + 2 * i:
                buf.append_observation_action_reward(e, frame(e, t), t, 1.0, {"x": float(t)})
        if t == 3:
            buf.end_episode(ids[0], "terminated", final_observation=frame(ids[0], 2))
            buf.end_episode(ids[1], "truncated", final_observation=frame(ids[1], 4))
    lone = buf.start_episode()
    buf.end_episode(lone, "truncated", final_observation=frame(lone, 0))


@pytest.mark.parametrize("padding", ["reset", "zero"])
def test_checkpoint_round_trip_keeps_frame_stacking(tmp_path: Path, padding: str) -> None:
    kwargs = {"frame_stack": 3, "frame_stack_padding": padding, "scratch_dir": tmp_path}
    with SyncEpisodeReplayBuffer(18, seed=4, **kwargs) as buf:
        fill(buf)
        assert buf.stats()["evicted_episodes"] > 0
        buf.save_checkpoint(tmp_path / "ck")
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path) as back:
            assert (back.frame_stack, back.frame_stack_padding) == (3, padding)
            assert back.stats() | {"bytes": 0} == buf.stats() | {"bytes": 0}
            assert torch.equal(back._core.links.prev_row, buf._core.links.prev_row)
            for e in buf._core.episodes:
                assert (back.get_episode(e) == buf.get_episode(e)).all()
            for _ in range(3):
                assert (buf.sample_n_step(8, n=(1, 4)) == back.sample_n_step(8, n=(1, 4))).all()
                assert (
                    buf.sample_sequences(4, 2, strict=False)
                    == back.sample_sequences(4, 2, strict=False)
                ).all()
            running = [e for e, ep in back._core.episodes.items() if ep.in_progress]
            assert running
            for b in (buf, back):  # appending continues, stacks reaching rows saved before
                for e in running:
                    t = b._core.episodes[e].steps
                    b.append_observation_action_reward(e, frame(e, t), t, 1.0, {"x": 0.5})
                    b.end_episode(e, "truncated", final_observation=frame(e, t + 1))
            for e in running:
                assert (back.get_episode(e) == buf.get_episode(e)).all()


def test_open_and_load_check_the_saved_frame_stacking(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(18, frame_stack=3, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "ck")
    with pytest.raises(
        ValueError,
        match="frame_stack=4, but the checkpoint there holds a buffer with frame_stack=3",
    ):
        SyncEpisodeReplayBuffer.open(tmp_path / "ck", max_steps=18, frame_stack=4)
    with pytest.raises(ValueError, match="frame_stack_padding='zero', but the checkpoint"):
        SyncEpisodeReplayBuffer.open(
            tmp_path / "ck", max_steps=18, frame_stack=3, frame_stack_padding="zero"
        )
    with pytest.raises(TypeError, match="overrides must be among"):
        SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", frame_stack=2)
    with SyncEpisodeReplayBuffer.open(
        tmp_path / "ck", max_steps=18, frame_stack=3, scratch_dir=tmp_path
    ) as same:
        assert same.stats()["frame_stack"] == 3
    manifest_path = tmp_path / "ck" / "MANIFEST.json"
    original = manifest_path.read_text()
    for bad, match in ((0, "frame_stack"), (2.5, "frame_stack"), ("tile", "frame_stack_padding")):
        manifest = json.loads(original)
        manifest["meta"]["frame_stack_padding" if bad == "tile" else "frame_stack"] = bad
        manifest_path.write_text(json.dumps(seal(manifest)))
        with pytest.raises(CorruptCheckpointError, match=match):
            SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
    assert not list(tmp_path.glob("replaybuf-*")), "a refused load left storage behind"


def test_a_checkpoint_without_frame_stacking_loads_without_it(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(18, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "ck")
    manifest_path = tmp_path / "ck" / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["meta"]["frame_stack"], manifest["meta"]["frame_stack_padding"]  # older format
    del manifest["manifest_sha256"]  # as format version 1 wrote it: no checksum either
    manifest["format_version"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path) as back:
        assert back.frame_stack is None
        assert back._core.links.prev_row is None
        assert back.sample_n_step(4)["observation"].shape == (4, 2, 2)


def test_metadata_records_and_checks_frame_stacking(make, tmp_path: Path) -> None:
    buf = make(16, frame_stack=4)
    buf.save(tmp_path / "meta")
    document = json.loads((tmp_path / "meta.metadata").read_text())
    assert (document["frame_stack"], document["frame_stack_padding"]) == (4, "reset")
    assert make(16, frame_stack=4).load(tmp_path / "meta")["frame_stack"] == 4
    with pytest.raises(MetadataError, match=r"frame_stack.*metadata has \(4, 'reset'\)"):
        make(16, frame_stack=None).load(tmp_path / "meta")
    with pytest.raises(MetadataError, match="frame_stack"):
        make(16, frame_stack=4, frame_stack_padding="zero").load(tmp_path / "meta")


def test_async_facade_passes_frame_stacking_through(tmp_path: Path) -> None:
    async def main() -> None:
        async with EpisodeReplayBuffer(
            32, frame_stack=2, frame_stack_padding="zero", scratch_dir=tmp_path, seed=0
        ) as buf:
            assert buf.frame_stack == 2
            e = await buf.start_episode()
            for t in range(3):
                await buf.append_observation_action_reward(e, frame(e, t), t, 1.0)
            await buf.end_episode(e, "terminated", final_observation=frame(e, 3))
            batch = await buf.sample_n_step(3, n=2, replace=False)
            assert batch["next_observation"].shape == (3, 2, 2, 2)
            await buf.save_checkpoint(tmp_path / "ck")
            back = await EpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
            assert (await back.get_episode(e) == await buf.get_episode(e)).all()
            assert (await back.stats())["frame_stack"] == 2
            await back.close()

    asyncio.run(main())


def test_as_dataset_serves_stacked_batches(make):
    buf = make(frame_stack=2)
    e = buf.start_episode()
    for t in range(3):
        buf.append_observation_action_reward(e, frame(e, t), t, 1.0)
    buf.end_episode(e, "terminated", final_observation=frame(e, 3))
    batch = next(iter(buf.as_dataset(5, n=2, gamma=0.9)))
    assert batch["observation"].shape == (5, 2, 2, 2)
    seq = next(iter(buf.as_dataset(2, seq_len=2)))
    assert seq["observation"].shape == (2, 2, 2, 2, 2)


# --------------------------------------------------------------------------- memory
def test_atari_frames_cost_one_frame_per_transition(make):
    """u8[84, 84] frames with k = 4: within 1.02x of one frame plus action and reward."""
    episodes, length = 3, 1000
    buf = make(episodes * length, episodes, frame_stack=4, storage="tensor")
    ids = [buf.start_episode() for _ in range(episodes)]
    frames = torch.zeros(episodes, 84, 84, dtype=torch.uint8)
    for t in range(length):
        frames[:, 0, 0] = t % 256
        buf.append_batch(ids, frames, torch.zeros(episodes, dtype=torch.int64), torch.ones(3))
    for e in ids:
        buf.end_episode(e, "truncated", final_observation=frames[0])
    stats = buf.stats()
    payload = 84 * 84 + 8 + 4  # one frame + int64 action + float32 reward
    per_transition = stats["bytes"] / stats["steps"]
    assert per_transition <= 1.02 * payload, per_transition
    batch = buf.sample_n_step(32, n=3)
    assert batch["observation"].shape == (32, 4, 84, 84)
    starts = batch["start_step"]
    newest = batch["observation"][:, -1, 0, 0].long()
    assert torch.equal(newest, starts % 256)
    oldest = batch["observation"][:, 0, 0, 0].long()
    assert torch.equal(oldest, (starts - 3).clamp(min=0) % 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("storing_device", "storage"), [("cpu", "memmap"), ("cuda", "tensor")])
def test_cuda_delivery_matches_the_cpu_buffer(make, storing_device: str, storage: str) -> None:
    """Stacks built on (or delivered to) CUDA equal a CPU buffer's, padding included."""
    kwargs = {"frame_stack": 3, "frame_stack_padding": "zero"}
    cpu = make(18, **kwargs, storage="tensor")
    gpu = make(18, **kwargs, device="cuda", storing_device=storing_device, storage=storage)
    for buf in (cpu, gpu):
        fill(buf)
    for e in cpu._core.episodes:
        assert (gpu.get_episode(e).cpu() == cpu.get_episode(e)).all()
    records = {e: cpu.get_episode(e)["observation"] for e in cpu._core.episodes}
    batch = gpu.sample_n_step(64, n=3).cpu()
    for i in range(64):
        e, t, m = (int(batch[name][i]) for name in ("episode_id", "start_step", "actual_n"))
        assert torch.equal(batch["observation"][i], records[e][t])
        assert torch.equal(batch["next_observation"][i], records[e][t + m])
    seq = gpu.sample_sequences(16, 3, strict=False).cpu()
    for b, p in itertools.product(range(16), range(3)):
        if seq["mask"][b, p]:
            e, t = int(seq["episode_id"][b, p]), int(seq["step"][b, p])
            assert torch.equal(seq["observation"][b, p], records[e][t])
            assert torch.equal(seq["next_observation"][b, p], records[e][t + 1])
        else:
            assert not seq["observation"][b, p].any()
