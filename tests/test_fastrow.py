"""The per-step fast path stores exactly what the general path stores, and declines the rest.

Every case appends the same values to two buffers: one whose appends take the fast path
(:mod:`replaybuf.storage.fastrow`) and one forced onto the general path; their episodes must be
equal
bit for bit. Declined values must reach the general path, which converts or raises as before.
"""

from __future__ import annotations

import os
import re
from functools import partial
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replaybuf import EpisodeStateError, InvalidStateError, SchemaError, SyncEpisodeReplayBuffer
from replaybuf.storage.fastrow import RowPlan, fast_value
from replaybuf.storage.schema import FieldSpec
from replaybuf.storage.staging import RowStager
from replaybuf.storage.tensorguard import GUARD_ENV


def spec_of(leaves: dict) -> FieldSpec:
    return FieldSpec.of(leaves, 0)


def general_path_only(buf: SyncEpisodeReplayBuffer) -> SyncEpisodeReplayBuffer:
    buf._core.append_one = lambda *args: False  # every append converts through to_leaves
    buf._core.append_many = lambda *args: False
    buf._core.end_one = lambda *args: False  # final observations too
    return buf


def small_staging():
    """Staging buffers of 3 rows, so that the tests reach the full-stager branches and
    batches larger than a stager."""
    return mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=3, _FLUSH_BYTES=0)


def fields_equal(a, b) -> bool:
    keys = set(a.keys(include_nested=True, leaves_only=True))
    if keys != set(b.keys(include_nested=True, leaves_only=True)):
        return False
    return all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in keys)


def same_outcome(fast, slow, method: str, *args) -> None:
    """``method(*args)`` on both buffers: both store, or both refuse with the same message (an
    episode longer than max_steps cannot be stored)."""
    outcomes = []
    for buf in (fast, slow):
        try:
            getattr(buf, method)(*args)
            outcomes.append(None)
        except ValueError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


def assert_same_contents(fast, slow, last_id: int) -> None:
    """Equal stats, episodes 0..last_id equal or evicted in both, equal seeded samples, and
    the same bits in every stored row (final rows' zero-filled fields too, which no read
    returns but checkpoints keep)."""
    assert fast.stats() == slow.stats()
    held = []
    for buf in (fast, slow):
        buf._core.flush()
        episodes = buf._core.episodes.values()
        held.append(
            [[*e.rows, *([e.final_row] if e.final_row is not None else [])] for e in episodes]
        )
    assert held[0] == held[1]
    rows = torch.tensor([row for rows in held[1] for row in rows], dtype=torch.long)
    for key in slow.spec or {}:
        a, b = fast._core.slots.column(key), slow._core.slots.column(key)
        if a.dtype is torch.bool:  # their bytes: indexing and torch.equal take any nonzero
            a, b = a.view(torch.uint8), b.view(torch.uint8)  # byte as True (as 1)
        assert torch.equal(a[rows], b[rows]), key
    for e in range(last_id + 1):
        try:
            want = slow.get_episode(e)
        except EpisodeStateError:
            with pytest.raises(EpisodeStateError, match="evicted"):
                fast.get_episode(e)
            continue
        assert fields_equal(fast.get_episode(e), want)
    if len(slow):
        a = fast.sample_n_step(16, n=2, gamma=0.9)
        b = slow.sample_n_step(16, n=2, gamma=0.9)
        assert fields_equal(a, b)


def final_of(kind: str, rng: np.random.Generator):
    """A final observation (obs f32[5]) as the fast path takes it (numpy, a tensor) or not (a
    tensor that requires grad, float64: the general path detaches or refuses those)."""
    obs = rng.standard_normal(5).astype(np.float32)
    return {
        "numpy": obs,
        "torch": torch.from_numpy(obs),
        "grad": torch.from_numpy(obs).requires_grad_(),
        "float64": obs.astype(np.float64),
    }[kind]


FINAL_KINDS = ["numpy", "torch", "grad", "float64"]


def values_of(kind: str, rng: np.random.Generator):
    obs = rng.standard_normal(5).astype(np.float32)
    act = rng.integers(0, 4, ()).astype(np.int64)
    reward = float(rng.standard_normal())
    if kind == "numpy":
        return obs, np.array(act), reward
    if kind == "torch":
        return torch.from_numpy(obs), torch.tensor(int(act)), torch.tensor(reward).float()
    if kind == "torch, float":  # what a torch-wrapped gymnasium env gives: a Python reward
        return torch.from_numpy(obs), torch.tensor(int(act)), reward
    if kind == "grad":  # a tensor that requires grad is stored detached
        return torch.from_numpy(obs).requires_grad_(), torch.tensor(int(act)), reward
    if kind == "views":  # a view at an offset; a 0-d view with torch's negative bit
        doubled = torch.from_numpy(np.concatenate([obs, obs]))
        negative = torch.complex(torch.tensor(0.0), torch.tensor(-reward)).conj().imag
        return doubled[5:], torch.tensor(int(act)), negative
    return obs.tolist(), int(act), reward  # lists: always the general path


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(
        st.sampled_from(["numpy", "torch", "torch, float", "grad", "views", "lists", "end"]),
        min_size=1,
        max_size=60,
    ),
    seed=st.integers(0, 2**16),
    max_steps=st.sampled_from([6, 13, 64]),
)
def test_fast_and_general_paths_store_the_same_rows(by_address, kinds, seed, max_steps):
    """Including appends that must evict first (small ``max_steps``): the fast path checks the
    values, flushes, evicts and stages in the order the general path does; tensors copied
    from their addresses or through numpy() alike."""
    rng = np.random.default_rng(seed)
    final = np.zeros(5, np.float32)
    with (
        small_staging(),
        SyncEpisodeReplayBuffer(max_steps, storage="tensor", seed=0) as fast,
        general_path_only(SyncEpisodeReplayBuffer(max_steps, storage="tensor", seed=0)) as slow,
    ):
        first = values_of("numpy", rng)  # fixes the spec: obs f32[5], action i64, reward f32
        for buf in (fast, slow):
            ep = buf.start_episode()
            buf.append_observation_action_reward(ep, *first)
        plan = fast._core._plan
        assert plan is not None
        assert (plan.copy_row is not None) is by_address
        assert plan.guarded is (by_address and os.environ.get(GUARD_ENV) != "0")
        for kind in kinds:
            assert not plan.sources.any()  # no address stays from one call to the next
            if kind == "end":
                last = final_of(FINAL_KINDS[int(rng.integers(len(FINAL_KINDS)))], rng)
                same_outcome(fast, slow, "end_episode", ep, "truncated", last)
                ep = fast.start_episode()
                assert slow.start_episode() == ep
                continue
            values = values_of(kind, rng)
            if kind == "lists":
                values = (np.asarray(values[0], np.float32), values[1], values[2])
            same_outcome(fast, slow, "append_observation_action_reward", ep, *values)
        for buf in (fast, slow):
            buf.end_episode(ep, "truncated", final_observation=final)
        assert_same_contents(fast, slow, ep)


def batch_values_of(kind: str, rng: np.random.Generator, envs: int):
    obs = rng.standard_normal((envs, 5)).astype(np.float32)
    act = rng.integers(0, 4, envs).astype(np.int64)
    reward = rng.standard_normal(envs).astype(np.float32)
    if kind == "numpy":
        return obs, act, reward
    if kind == "torch":
        return torch.from_numpy(obs), torch.from_numpy(act), torch.from_numpy(reward)
    if kind == "strided":  # a non-contiguous view: copied like any other
        return torch.from_numpy(obs.T.copy()).T, torch.from_numpy(act), reward
    if kind == "torch strided":  # every value a tensor (one _foreach_copy_), one a view
        return torch.from_numpy(obs.T.copy()).T, torch.from_numpy(act), torch.from_numpy(reward)
    if kind == "inference":  # made in inference mode, appended outside it
        with torch.inference_mode():
            return tuple(torch.from_numpy(v).clone() for v in (obs, act, reward))
    # requires grad: the fast path declines (no numpy view), the general path detaches
    return torch.from_numpy(obs).requires_grad_(), act, torch.from_numpy(reward)


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["numpy", "torch", "strided", "torch strided", "inference", "grad", "end"]),
        min_size=1,
        max_size=30,
    ),
    seed=st.integers(0, 2**16),
    envs=st.integers(1, 4),
    max_steps=st.sampled_from([9, 24, 128]),
)
# A batch run's bookkeeping packed after a full stager's write on one path and after the
# final row's on the other: the anchor order, so the seeded draws, differed.
@example(kinds=["numpy", "numpy", "end"], seed=0, envs=1, max_steps=9)
def test_batched_appends_store_what_the_general_path_stores(kinds, seed, envs, max_steps):
    """append_batch's fast path (values sliced into the staging columns, rows assigned in one
    loop), including batches that evict first, against the general path."""
    rng = np.random.default_rng(seed)
    with (
        small_staging(),
        SyncEpisodeReplayBuffer(max_steps, storage="tensor", seed=0) as fast,
        general_path_only(SyncEpisodeReplayBuffer(max_steps, storage="tensor", seed=0)) as slow,
    ):
        ids = [fast.start_episode() for _ in range(envs)]
        assert [slow.start_episode() for _ in range(envs)] == ids
        first = batch_values_of("numpy", rng, envs)  # fixes the spec
        for buf in (fast, slow):
            buf.append_batch(ids, *first)
        for kind in kinds:
            if kind == "end":  # the first env's episode ends; a new one takes its place
                last = final_of(FINAL_KINDS[int(rng.integers(len(FINAL_KINDS)))], rng)
                same_outcome(fast, slow, "end_episode", ids[0], "terminated", last)
                ids[0] = fast.start_episode()
                assert slow.start_episode() == ids[0]
                continue
            values = batch_values_of(kind, rng, envs)
            same_outcome(fast, slow, "append_batch", ids, *values)
        assert_same_contents(fast, slow, max(ids))


def odd_bools(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Bools viewed from random bytes 0..3: a True byte may be 2 or 3."""
    return rng.integers(0, 4, shape).astype(np.uint8).view(np.bool_)


def bool_forms(flags: np.ndarray) -> list:
    """``flags`` as every per-step path takes it: a numpy array, a contiguous tensor (copied
    by address where the kernels run), a strided tensor (through ``numpy()``), a strided
    array."""
    wide = np.repeat(flags[..., None], 2, axis=-1)
    return [flags, torch.from_numpy(flags), torch.from_numpy(wide)[..., 0], wide[..., 0]]


def test_bools_of_any_true_byte_are_stored_as_one_on_every_path(by_address):
    """A bool observation whose True bytes are not all 1 (a uint8 buffer viewed as bool) is
    stored as 0 and 1 by every fast path (one step, a batch, final observations one by one
    and in bulk), as the general path stores it: numpy's bool-to-bool copy would keep the
    bytes."""
    rng = np.random.default_rng(3)
    with (
        small_staging(),
        SyncEpisodeReplayBuffer(256, storage="tensor", seed=0) as fast,
        general_path_only(SyncEpisodeReplayBuffer(256, storage="tensor", seed=0)) as slow,
    ):
        for buf in (fast, slow):
            buf.start_episode()
            buf.append_observation_action_reward(0, np.zeros(4, np.bool_), 0, 0.0)  # the spec
        for flags in bool_forms(odd_bools((4,), rng)):
            for buf in (fast, slow):
                buf.append_observation_action_reward(0, flags, 1, 1.0)
        for buf in (fast, slow):
            ids = [buf.start_episode() for _ in range(3)]
        for flags in bool_forms(odd_bools((3, 4), rng)):
            for buf in (fast, slow):
                buf.append_batch(ids, flags, np.arange(3), np.ones(3, np.float32))
        for episode, final in zip([0, *ids], bool_forms(odd_bools((4,), rng)), strict=True):
            for buf in (fast, slow):
                buf.end_episode(episode, "truncated", final)
        assert_same_contents(fast, slow, max(ids))
        for finals in bool_forms(odd_bools((3, 4), rng))[:2]:  # end_episodes' bulk finals
            ids = fast.start_episodes(3)
            fast.append_batch(ids, np.zeros((3, 4), np.bool_), np.arange(3), np.ones(3, np.float32))
            fast.end_episodes(ids, "truncated", finals)
            stored = [fast.get_episode(e)["observation"][-1] for e in ids]  # the final
            assert [s.tolist() for s in stored] == torch.as_tensor(finals).tolist()
        core = fast._core
        core.flush()
        held = [row for e in core.episodes.values() for row in [*e.rows, e.final_row]]
        stored = core.slots.column(("observation",)).view(torch.uint8)[torch.tensor(held)]
        assert set(stored.unique().tolist()) == {0, 1}


def test_an_append_made_by_user_code_inside_an_append_is_refused(by_address):
    """An extras key of a ``str`` subclass runs user code when looked up (here its ``__eq__``
    appends a step to another episode of the same buffer). That append is refused
    (``InvalidStateError``, see tests/test_reentry.py) and the outer step is stored whole:
    each episode holds exactly its own steps. (Staged into a row chosen before the lookup, the
    nested step's values were overwritten by the outer's.)"""
    with SyncEpisodeReplayBuffer(64, storage="tensor") as buf:
        ep, other = buf.start_episode(), buf.start_episode()
        first = (np.zeros(3, np.float32), 0, 0.0, {"k": 0.0})
        for episode in (ep, other):
            buf.append_observation_action_reward(episode, *first)
        refused = []

        class Key(str):
            __hash__ = str.__hash__

            def __eq__(self, other_key):
                step = (np.full(3, 7, np.float32), 7, 7.0, {"k": 7.0})
                try:
                    buf.append_observation_action_reward(other, *step)
                except InvalidStateError as error:
                    refused.append(str(error))
                return str.__eq__(self, other_key)

        step = (np.full(3, 5, np.float32), 5, 5.0, {Key("k"): 5.0})
        buf.append_observation_action_reward(ep, *step)
        assert refused
        for episode, steps in ((ep, [0, 5]), (other, [0])):
            buf.end_episode(episode, "truncated", np.zeros(3, np.float32))
            got = buf.get_episode(episode)
            values = [float(s) for s in steps]
            assert got["action"].tolist() == steps
            assert got["reward"].tolist() == got["k"].tolist() == values
            assert got["observation"][:, 0].tolist() == [*values, 0.0]


def test_the_stored_row_is_a_copy_of_the_callers_array():
    with SyncEpisodeReplayBuffer(16, storage="tensor") as buf:
        ep = buf.start_episode()
        obs = np.ones(3, np.float32)
        buf.append_observation_action_reward(ep, obs, np.int64(0), 1.0)  # general: fixes spec
        buf.append_observation_action_reward(ep, obs, np.array(1), 2.0)  # fast path
        obs[:] = 7.0  # a vectorized env reuses its arrays
        buf.end_episode(ep, "terminated", final_observation=obs)
        stored = buf.get_episode(ep)["observation"]
        assert stored[:2].tolist() == [[1.0] * 3] * 2


def test_extras_take_the_fast_path_when_their_keys_match():
    spec = spec_of(
        {
            ("observation",): torch.zeros(2),
            ("action",): torch.zeros((), dtype=torch.int64),
            ("reward",): torch.zeros(()),
            ("extras", "logp"): torch.zeros(()),
        }
    )
    stager = RowStager(spec, 4)
    plan = RowPlan.of(spec, stager.arrays)
    obs = np.ones(2, np.float32)
    assert plan.stage(1, (obs, np.array(3), 0.5, {"logp": -1.0}))
    staged = {key: a[1].tolist() for key, a in zip(stager.keys, stager.arrays, strict=True)}
    assert staged == {
        ("action",): 3,
        ("observation",): [1.0, 1.0],
        ("reward",): 0.5,
        ("extras", "logp"): -1.0,
    }
    assert not plan.stage(1, (obs, np.array(1), 0.5, None))  # missing extras: general path
    assert not plan.stage(1, (obs, np.array(1), 0.5, {"logp": -1.0, "x": 1.0}))
    assert not plan.stage(1, (obs, np.array(1), 0.5, {"other": -1.0}))


def test_a_value_the_fast_path_declines_before_an_eviction_evicts_nothing():
    with SyncEpisodeReplayBuffer(4, storage="tensor") as buf:
        old = buf.start_episode()
        for t in range(3):
            buf.append_observation_action_reward(old, np.full(3, t, np.float32), np.int64(t), 1.0)
        buf.end_episode(old, "terminated", final_observation=np.zeros(3, np.float32))
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, np.zeros(3, np.float32), np.int64(0), 1.0)
        before = buf.stats()  # full: the next step must evict episode `old` first
        with pytest.raises(SchemaError, match=r"field 'observation' expected dtype torch.float32"):
            buf.append_observation_action_reward(ep, np.zeros(3, np.float64), np.int64(1), 1.0)
        assert buf.stats() == before
        assert buf.get_episode(old)["action"].tolist() == [0, 1, 2]
        buf.append_observation_action_reward(ep, np.ones(3, np.float32), np.int64(1), 2.0)
        assert buf.stats()["evicted_episodes"] == 1
        buf.end_episode(ep, "terminated", final_observation=np.zeros(3, np.float32))
        assert buf.get_episode(ep)["action"].tolist() == [0, 1]


def test_an_interrupt_inside_a_staging_leaves_no_address_for_the_next_step(monkeypatch):
    """Tensors' addresses noted before an interrupt (here raised where a Python int reward, the
    last field, is checked) are cleared as the interrupt leaves: the next step, whose values
    are numpy, stores its own values, not bytes read from the old addresses."""
    with SyncEpisodeReplayBuffer(16, storage="tensor") as buf:
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, np.zeros(3, np.float32), 0, 1.0)
        plan = buf._core._plan
        if plan is None or plan.copy_row is None:
            pytest.skip("the compiled kernels do not run here")

        def interrupted(*args):
            raise KeyboardInterrupt

        monkeypatch.setattr("replaybuf.storage.fastrow.fast_value", interrupted)
        with pytest.raises(KeyboardInterrupt):
            buf.append_observation_action_reward(ep, torch.full((3,), 9.0), torch.tensor(1), 1)
        assert not plan.sources.any()
        monkeypatch.undo()
        buf.append_observation_action_reward(ep, np.full(3, 2.0, np.float32), np.array(2), 1.0)
        buf.end_episode(ep, "terminated", np.zeros(3, np.float32))
        assert buf.get_episode(ep)["observation"].tolist() == [[0.0] * 3, [2.0] * 3, [0.0] * 3]


def test_nested_fields_get_no_plan():
    spec = spec_of(
        {
            ("observation", "pixels"): torch.zeros(2, dtype=torch.uint8),
            ("action",): torch.zeros((), dtype=torch.int64),
            ("reward",): torch.zeros(()),
        }
    )
    assert RowPlan.of(spec, RowStager(spec, 4).arrays) is None


@pytest.mark.parametrize(
    ("value", "shape", "dtype"),
    [
        (np.zeros(3, np.float64), (3,), torch.float32),  # dtype differs
        (np.zeros(4, np.float32), (3,), torch.float32),  # shape differs
        (np.zeros((1, 3), np.float32), (3,), torch.float32),  # no broadcasting
        (torch.zeros(3, dtype=torch.float64), (3,), torch.float32),
        (torch.zeros(2, dtype=torch.complex64).conj(), (2,), torch.complex64),
        (1.5, (), torch.int64),  # a float never goes into an integer field
        (300, (), torch.uint8),  # out of range
        (-1, (), torch.uint8),
        (True, (), torch.float32),  # bool into a float field: the general path decides
        (1e10, (), torch.float16),  # numpy would warn on the overflow: the general path
        (torch.ones(3).to_sparse(), (3,), torch.float32),  # no numpy view: the general path
        (1, (), torch.float32),  # ints into floats: the general path checks exactness
        (np.float32(1.0), (), torch.float32),  # numpy scalars: the general path
        ([1.0, 2.0, 3.0], (3,), torch.float32),
        (2.0, (1,), torch.float32),
    ],
)
def test_fast_value_declines_anything_inexact(value, shape, dtype):
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    assert fast_value(value, shape, dtype, np_dtype) is None


def test_a_declined_bad_value_still_gets_the_general_paths_error_and_changes_nothing():
    with SyncEpisodeReplayBuffer(16, storage="tensor") as buf:
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, np.zeros(3, np.float32), np.int64(0), 1.0)
        before = buf.stats()
        with pytest.raises(SchemaError, match=r"field 'observation' expected dtype torch.float32"):
            buf.append_observation_action_reward(ep, np.zeros(3, np.float64), np.int64(0), 1.0)
        with pytest.raises(SchemaError, match=r"field 'action' expected dtype torch.int64"):
            buf.append_observation_action_reward(ep, np.zeros(3, np.float32), 1.5, 1.0)
        assert buf.stats() == before


def test_batched_appends_check_every_episode_id_as_single_appends_do():
    batch = (np.zeros((2, 3), np.float32), np.zeros(2, np.int64), np.zeros(2, np.float32))
    with SyncEpisodeReplayBuffer(16, storage="tensor") as buf:
        a, b = buf.start_episode(), buf.start_episode()
        buf.append_batch([a, b], *batch)
        before = buf.stats()
        for ids, message in (
            ([True, a], "episode_id must be an int, got True"),  # True would hash like 1
            ([a, 1.0], "episode_id must be an int, got 1.0"),
            ([a, 99], "cannot append to episode 99: unknown episode id"),
        ):
            with pytest.raises(EpisodeStateError, match=re.escape(message)):
                buf.append_batch(ids, *batch)
        buf.end_episode(b, "terminated", final_observation=np.zeros(3, np.float32))
        with pytest.raises(EpisodeStateError, match=f"cannot append to episode {b}: it has ended"):
            buf.append_batch([a, b], *batch)
        assert buf.stats()["steps"] == before["steps"]
        buf.append_batch([np.int64(a)], *(v[:1] for v in batch))  # numpy ids work as before
        assert buf.stats()["steps"] == before["steps"] + 1
    with SyncEpisodeReplayBuffer(4, storage="tensor") as buf:  # an evicted id
        old = buf.start_episode()
        buf.append_batch([old], *(v[:1] for v in batch))
        buf.end_episode(old, "terminated", final_observation=np.zeros(3, np.float32))
        new = buf.start_episode()
        for _ in range(4):
            buf.append_batch([new], *(v[:1] for v in batch))
        with pytest.raises(EpisodeStateError, match=f"cannot append to episode {old}: it was"):
            buf.append_batch([new, old], *batch)


@pytest.mark.parametrize("batched", [False, True])
def test_sparse_tensors_are_refused_by_name_and_change_nothing(batched):
    """Tensor.numpy() raises TypeError for sparse tensors: the fast paths decline them and the
    general path refuses them before it assigns rows."""
    with SyncEpisodeReplayBuffer(16, storage="tensor") as buf:
        a, b = buf.start_episode(), buf.start_episode()
        buf.append_batch([a, b], torch.ones(2, 3), torch.zeros(2, dtype=torch.long), torch.ones(2))
        before = buf.stats()
        if batched:
            sparse = torch.ones(2, 3).to_sparse()
            call = partial(buf.append_batch, [a, b], sparse, torch.zeros(2, dtype=torch.long))
            values: tuple = (torch.ones(2),)
        else:
            call = partial(buf.append_observation_action_reward, a, torch.ones(3).to_sparse())
            values = (0, 1.0)
        with pytest.raises(TypeError, match="field 'observation' expected a dense"):
            call(*values)
        assert buf.stats() == before


def test_a_batch_of_tensors_is_copied_in_one_call_and_anything_else_through_numpy():
    """batch_values hands back the tensors themselves when every value is a strided CPU tensor
    of the exact dtype and shape that needs no grad (one torch._foreach_copy_ stages them),
    numpy arrays when any value is an array, None for what needs the general path; without
    torch._foreach_copy_ tensors go through numpy views, and the rows stored are the same."""
    spec = spec_of(
        {
            ("observation",): torch.zeros(2),
            ("action",): torch.zeros((), dtype=torch.int64),
            ("reward",): torch.zeros(()),
        }
    )
    plan = RowPlan.of(spec, RowStager(spec, 4).arrays)
    obs, act, reward = torch.ones(3, 2), torch.zeros(3, dtype=torch.int64), torch.ones(3)
    tensors = plan.batch_values(3, (obs, act, reward, None))
    # In the spec's column order (its keys sorted).
    assert all(a is b for a, b in zip(tensors, (act, obs, reward), strict=True))
    mixed = plan.batch_values(3, (obs, act.numpy(), reward, None))
    assert all(type(v) is np.ndarray for v in mixed)
    assert plan.batch_values(3, (obs.requires_grad_(), act, reward, None)) is None
    assert plan.batch_values(3, (obs.detach().double(), act, reward, None)) is None
    assert plan.batch_values(2, (obs.detach(), act, reward, None)) is None  # 3 rows, not 2
    stored, copies = [], []
    for foreach in (True, False):
        with (
            mock.patch(
                "replaybuf.storage.fastrow._FOREACH_COPY", torch._foreach_copy_ if foreach else None
            ),
            mock.patch("torch._foreach_copy_", wraps=torch._foreach_copy_) as copy,
            SyncEpisodeReplayBuffer(32, storage="tensor", seed=0) as buf,
        ):
            ids = [buf.start_episode() for _ in range(3)]
            for t in range(4):
                buf.append_batch(ids, torch.full((3, 2), float(t)), act, torch.arange(3.0) + t)
            stored.append([buf.get_episode(i) for i in ids])
            copies.append(copy.call_count)
    assert copies == [3, 0]  # the first batch fixes the spec through the general path
    for a, b in zip(*stored, strict=True):
        assert fields_equal(a, b)
    assert stored[0][2]["reward"].tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(17, dtype=torch.float32),
        lambda: torch.arange(34, dtype=torch.float32)[::2],  # strided
        lambda: torch._neg_view(torch.arange(17, dtype=torch.float32)),  # neg bit
        lambda: torch._efficientzerotensor(17),  # no memory
        lambda: torch.arange(17, dtype=torch.float32).requires_grad_(),  # declined: detached
    ],
)
def test_tensor_observations_are_copied_as_the_general_path_stores_them(by_address, make):
    """The per-step path copies a CPU tensor into its staging row (from its address, or
    through numpy()); whatever the tensor's strides, neg bit, memory or grad, the stored row
    is the general path's."""
    fast = SyncEpisodeReplayBuffer(100, storage="tensor")
    slow = general_path_only(SyncEpisodeReplayBuffer(100, storage="tensor"))
    for buf in (fast, slow):
        e = buf.start_episode()
        for t in range(3):
            buf.append_observation_action_reward(e, torch.full((17,), float(t)), t, 0.5)
        obs = make()
        buf.append_observation_action_reward(e, obs, 3, 1.0)
        buf.end_episode(e, "terminated", torch.zeros(17))
    assert fields_equal(fast.get_episode(0), slow.get_episode(0))
    expected = make().detach().clone()  # a zero tensor materialized
    assert torch.equal(fast.get_episode(0)["observation"][3], expected)
    assert not fast._core.slots.memory.storage["observation"].requires_grad
