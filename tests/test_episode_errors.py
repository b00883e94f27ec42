"""Bad input to the episode buffer: a clear error, and the buffer exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from episode_helpers import action, batch_of, extras, final_obs, obs, reward, step

from replaybuf import (
    EmptyBufferError,
    EpisodeStateError,
    InsufficientSpaceError,
    SchemaError,
    SyncEpisodeReplayBuffer,
)

# The fixture's episodes (see ``populated``).
EVICTED, ENDED, RUNNING, FRESH, UNKNOWN = 0, 1, 2, 3, 99


def plain(value):
    """Tensors and TensorDicts as nested Python lists and dicts, for exact comparison."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    return value


def snapshot(buf: SyncEpisodeReplayBuffer) -> dict:
    """Everything a refused call must leave as it was."""
    state = {"stats": buf.stats(), "len": len(buf), "spec": buf.spec, "episodes": {}}
    for e in (EVICTED, ENDED, RUNNING, FRESH):
        try:
            state["episodes"][e] = plain(buf.get_episode(e))
        except EpisodeStateError as exc:
            state["episodes"][e] = str(exc)
    if len(buf):
        batch = buf.sample_n_step(len(buf) + 1, n=3, gamma=0.9, replace=False)
        rows = [plain(batch[i]) for i in range(batch.batch_size[0])]
        state["sample"] = sorted(rows, key=lambda r: (r["episode_id"], r["start_step"]))
    return state


@pytest.fixture
def populated(tmp_path):
    """Episode 0 evicted, 1 ended (truncated, 3 steps), 2 running (2 steps), 3 fresh."""
    buf = SyncEpisodeReplayBuffer(20, 3, scratch_dir=tmp_path, seed=0)
    assert buf.start_episode() == EVICTED
    for t in range(2):
        buf.append_observation_action_reward(EVICTED, *step(EVICTED, t))
    buf.end_episode(EVICTED, "terminated", final_observation=final_obs(EVICTED, 2))
    assert buf.start_episode() == ENDED
    assert buf.start_episode() == RUNNING
    assert buf.start_episode("b") == FRESH  # max_episodes=3: the finished episode 0 goes
    for t in range(3):
        buf.append_observation_action_reward(ENDED, *step(ENDED, t))
    buf.end_episode(ENDED, "truncated", final_observation=final_obs(ENDED, 3))
    for t in range(2):
        buf.append_observation_action_reward(RUNNING, *step(RUNNING, t))
    assert buf.stats()["evicted_episodes"] == 1
    assert len(buf) == 3 + 1
    yield buf
    buf.close()


def next_step(e=RUNNING):
    return step(e, 2)


def append(buf, e=RUNNING, **changes):
    o, a, r, x = next_step()  # a valid step; only the id may be bad
    args = {"observation": o, "action": a, "reward": r, "extras": x, **changes}
    buf.append_observation_action_reward(e, **args)


BAD_CALLS = [
    # ---- episode ids
    ("append to unknown id", lambda b: append(b, UNKNOWN), EpisodeStateError,
     "cannot append to episode 99: unknown episode id"),
    ("append to ended id", lambda b: append(b, ENDED), EpisodeStateError,
     "cannot append to episode 1: it has ended \\(truncated\\)"),
    ("append to evicted id", lambda b: append(b, EVICTED), EpisodeStateError,
     "cannot append to episode 0: it was evicted"),
    ("append to str id", lambda b: append(b, "2"), EpisodeStateError,
     "episode_id must be an int, got '2'"),
    ("append to bool id", lambda b: append(b, True), EpisodeStateError,
     "episode_id must be an int, got True"),
    ("end unknown id", lambda b: b.end_episode(UNKNOWN, final_observation=obs(0, 0)),
     EpisodeStateError, "cannot end episode 99: unknown"),
    ("end ended id", lambda b: b.end_episode(ENDED, final_observation=obs(0, 0)),
     EpisodeStateError, "cannot end episode 1: it has ended"),
    ("end evicted id", lambda b: b.end_episode(EVICTED, final_observation=obs(0, 0)),
     EpisodeStateError, "cannot end episode 0: it was evicted"),
    ("get unknown id", lambda b: b.get_episode(UNKNOWN), EpisodeStateError,
     "cannot get episode 99: unknown"),
    ("bad agent id", lambda b: b.start_episode(7), TypeError, "agent_id must be a str, got int"),
    # ---- observation structure, shape, dtype
    ("observation shape", lambda b: append(b, observation=torch.zeros(4)), SchemaError,
     "field 'observation' expected shape \\[3\\], got \\[4\\]"),
    ("observation broadcastable shape", lambda b: append(b, observation=torch.zeros(1)),
     SchemaError, "expected shape \\[3\\], got \\[1\\]"),
    ("observation dtype", lambda b: append(b, observation=torch.zeros(3, dtype=torch.float64)),
     SchemaError, "field 'observation' expected dtype torch.float32, got torch.float64"),
    ("observation structure", lambda b: append(b, observation={"x": torch.zeros(3)}),
     SchemaError, "keys differ from the stored spec"),
    ("observation numpy dtype", lambda b: append(b, observation=np.zeros(3, dtype=np.int32)),
     SchemaError, "expected dtype torch.float32, got torch.int32"),
    ("observation string", lambda b: append(b, observation="abc"), TypeError,
     "field 'observation' expected a tensor, array, number or list of numbers, got str"),
    ("action shape", lambda b: append(b, action=torch.zeros(2, dtype=torch.int64)),
     SchemaError, "field 'action' expected shape \\[\\], got \\[2\\]"),
    ("action lossy float", lambda b: append(b, action=0.5), SchemaError,
     "field 'action' expected dtype torch.int64, got 0.5 which it cannot hold"),
    ("reward dtype", lambda b: append(b, reward=torch.tensor(1.0, dtype=torch.float64)),
     SchemaError, "field 'reward' expected dtype torch.float32, got torch.float64"),
    ("reward shape", lambda b: append(b, reward=torch.zeros(2)), SchemaError,
     "field 'reward' expected shape \\[\\], got \\[2\\]"),
    # ---- extras
    ("extras missing", lambda b: append(b, extras=None), SchemaError,
     "missing \\['extras.flag', 'extras.logp'\\]"),
    ("extras extra field", lambda b: append(b, extras={**extras(2), "v": torch.tensor(1.0)}),
     SchemaError, "unexpected \\['extras.v'\\]"),
    ("extras shape", lambda b: append(b, extras={**extras(2), "flag": torch.ones(3).bool()}),
     SchemaError, "field 'extras.flag' expected shape \\[2\\], got \\[3\\]"),
    ("extras dtype", lambda b: append(b, extras={**extras(2), "logp": torch.tensor(1)}),
     SchemaError, "field 'extras.logp' expected dtype torch.float32, got torch.int64"),
    ("extras not a dict", lambda b: append(b, extras=[1]), TypeError,
     "extras must be a dict, got list"),
    ("extras collide", lambda b: append(b, extras={**extras(2), "cut": torch.tensor(True)}),
     SchemaError, "extras names \\['cut'\\] collide"),
    # ---- end_episode
    ("missing final observation", lambda b: b.end_episode(RUNNING, "terminated"), ValueError,
     "final_observation is required \\(episode 2\\), got None"),
    ("missing final observation of fresh", lambda b: b.end_episode(FRESH, "truncated"),
     ValueError, "final_observation is required \\(episode 3\\), got None"),
    ("final observation shape",
     lambda b: b.end_episode(RUNNING, final_observation=torch.zeros(5)),
     SchemaError, "field 'observation' expected shape \\[3\\], got \\[5\\]"),
    ("final observation dtype",
     lambda b: b.end_episode(RUNNING, final_observation=torch.zeros(3).double()),
     SchemaError, "expected dtype torch.float32, got torch.float64"),
    ("bad status", lambda b: b.end_episode(RUNNING, "done", final_observation=obs(2, 2)),
     ValueError, "status must be 'terminated', 'truncated' or 'COMPLETED', got 'done'"),
    ("status None", lambda b: b.end_episode(RUNNING, None, final_observation=obs(2, 2)),
     ValueError, "status must be .*got None"),
    # ---- sampling arguments
    ("n zero", lambda b: b.sample_n_step(4, n=0), ValueError, "n must be >= 1, got 0"),
    ("n negative", lambda b: b.sample_n_step(4, n=-2), ValueError, "n must be >= 1, got -2"),
    ("n float", lambda b: b.sample_n_step(4, n=1.5), TypeError, "n must be an int, got float"),
    ("n low > high", lambda b: b.sample_n_step(4, n=(3, 2)), ValueError,
     "n must have low <= high, got \\(3, 2\\)"),
    ("n low zero", lambda b: b.sample_n_step(4, n=(0, 2)), ValueError,
     "n\\[0\\] \\(low\\) must be >= 1, got 0"),
    ("n triple", lambda b: b.sample_n_step(4, n=(1, 2, 3)), ValueError,
     "n must be an int or a \\(low, high\\) pair"),
    ("gamma zero", lambda b: b.sample_n_step(4, gamma=0.0), ValueError,
     "gamma must lie in \\(0, 1\\], got 0.0"),
    ("gamma above one", lambda b: b.sample_n_step(4, gamma=1.01), ValueError,
     "gamma must lie in \\(0, 1\\], got 1.01"),
    ("gamma negative", lambda b: b.sample_n_step(4, gamma=-0.5), ValueError,
     "gamma must lie in \\(0, 1\\]"),
    ("gamma nan", lambda b: b.sample_n_step(4, gamma=float("nan")), ValueError,
     "gamma must lie in \\(0, 1\\], got nan"),
    ("gamma str", lambda b: b.sample_n_step(4, gamma="0.9"), TypeError,
     "gamma must be a float in \\(0, 1\\]"),
    ("batch size zero", lambda b: b.sample_n_step(0), ValueError,
     "batch_size must be >= 1, got 0"),
    ("sequence batch size zero", lambda b: b.sample_sequences(0, 2), ValueError,
     "batch_size must be >= 1, got 0"),
    ("seq_len zero", lambda b: b.sample_sequences(2, 0), ValueError,
     "seq_len must be >= 1, got 0"),
    ("seq_len longer than any episode", lambda b: b.sample_sequences(2, 4), EmptyBufferError,
     "no stored episode has 4 consecutive steps"),
    ("epoch batch size zero", lambda b: b.iterate_epochs(0), ValueError,
     "batch_size must be >= 1, got 0"),
    ("epoch count zero", lambda b: b.iterate_epochs(2, 0), ValueError,
     "n_epochs must be >= 1, got 0"),
    ("epoch gamma", lambda b: b.iterate_epochs(2, gamma=2.0), ValueError,
     "gamma must lie in \\(0, 1\\]"),
    ("episodes k zero", lambda b: b.sample_episodes(0), ValueError, "k must be >= 1, got 0"),
    # ---- append_batch
    ("batch with one ended id",
     lambda b: b.append_batch([RUNNING, ENDED, FRESH], *batch_of([next_step()] * 3)),
     EpisodeStateError, "cannot append to episode 1: it has ended"),
    ("batch with one evicted id",
     lambda b: b.append_batch([RUNNING, FRESH, EVICTED], *batch_of([next_step()] * 3)),
     EpisodeStateError, "cannot append to episode 0: it was evicted"),
    ("batch with duplicate ids",
     lambda b: b.append_batch([RUNNING, RUNNING], *batch_of([next_step()] * 2)),
     ValueError, "episode_ids must be distinct, got \\[2, 2\\]"),
    ("batch with no ids", lambda b: b.append_batch([], *batch_of([next_step()])), ValueError,
     "episode_ids must name at least one episode"),
    ("batch leading dim", lambda b: b.append_batch([RUNNING, FRESH], *batch_of([next_step()] * 3)),
     ValueError, "leading dimension expected 2 \\(len\\(episode_ids\\)\\), got 3"),
    ("batch row shape",
     lambda b: b.append_batch([RUNNING, FRESH], torch.zeros(2, 4), *batch_of([next_step()] * 2)[1:]),  # noqa: E501
     SchemaError, "field 'observation' expected shape \\[3\\], got \\[4\\]"),
    ("batch of scalars",
     lambda b: b.append_batch([RUNNING], obs(2, 2)[None], 5, torch.zeros(1), None),
     SchemaError, "field 'action' expected a batch of rows, got a scalar 5"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_and_leaves_the_buffer_unchanged(populated, call, error, match):
    before = snapshot(populated)
    with pytest.raises(error, match=match):
        call(populated)
    assert snapshot(populated) == before
    # and the buffer still works: the running episode takes its next step
    append(populated)
    assert len(populated) == before["len"] + 1


def test_sampling_an_empty_buffer_raises_and_changes_nothing(tmp_path):
    with SyncEpisodeReplayBuffer(8, scratch_dir=tmp_path) as buf:
        e = buf.start_episode()
        buf.append_observation_action_reward(e, obs(e, 0), action(e, 0), reward(e, 0))
        before = (buf.stats(), len(buf))
        for call in (
            lambda: buf.sample_n_step(1),
            lambda: buf.sample_sequences(1, 1),
            lambda: buf.iterate_epochs(1),
        ):
            with pytest.raises(
                EmptyBufferError, match=r"0 valid step\(s\) stored, need at least 1"
            ):
                call()
        assert (buf.stats(), len(buf)) == before


def test_sampling_below_min_steps_raises_and_changes_nothing(populated, tmp_path):
    with SyncEpisodeReplayBuffer(20, scratch_dir=tmp_path, min_steps=3) as buf:
        e = buf.start_episode()
        for t in range(3):
            buf.append_observation_action_reward(e, *step(e, t))
        before = (buf.stats(), len(buf))
        with pytest.raises(EmptyBufferError, match=r"2 valid step.*need at least 3.*min_steps=3"):
            buf.sample_n_step(4)
        assert (buf.stats(), len(buf)) == before


def test_a_refused_first_append_fixes_no_fields(tmp_path):
    with SyncEpisodeReplayBuffer(2, scratch_dir=tmp_path) as buf:
        ids = [buf.start_episode() for _ in range(3)]
        with pytest.raises(ValueError, match="leading dimension expected 2"):
            buf.append_batch(ids[:2], torch.zeros(3, 5), torch.zeros(3), torch.zeros(3))
        with pytest.raises(ValueError, match="cannot make room for 3 step"):
            buf.append_batch(ids, torch.zeros(3, 5), torch.zeros(3), torch.zeros(3))
        assert buf.spec is None
        assert buf.stats()["steps"] == 0
        # a step of another shape is now the first step, and fixes the fields
        buf.append_observation_action_reward(ids[0], torch.zeros(2), 0, 0.0)
        assert buf.spec[("observation",)].shape == (2,)


def test_a_refused_eviction_names_the_steps_asked_for_not_a_candidate_s(tmp_path):
    # The candidates looked at before the refusal (here an ended episode with no step, which
    # frees nothing) must not change the count the message gives.
    with SyncEpisodeReplayBuffer(3, scratch_dir=tmp_path) as buf:
        empty = buf.start_episode()
        buf.end_episode(empty, "terminated", torch.zeros(2))
        e = buf.start_episode()
        for t in range(3):
            buf.append_observation_action_reward(e, torch.full((2,), float(t)), 0, 1.0)
        with pytest.raises(ValueError, match=r"cannot make room for 1 step\(s\)") as refused:
            buf.append_observation_action_reward(e, torch.zeros(2), 0, 1.0)
        assert refused.value.argument == "max_steps"
        assert buf.stats()["steps"] == 3


def test_append_batch_with_a_bad_id_changes_no_other_episode(populated):
    running = populated.get_episode(RUNNING)
    fresh = populated.get_episode(FRESH)
    with pytest.raises(EpisodeStateError, match="episode 99: unknown"):
        populated.append_batch([RUNNING, FRESH, UNKNOWN], *batch_of([next_step()] * 3))
    assert plain(populated.get_episode(RUNNING)) == plain(running)
    assert plain(populated.get_episode(FRESH)) == plain(fresh)
    populated.append_batch([RUNNING, FRESH], *batch_of([step(RUNNING, 2), step(FRESH, 0)]))
    assert int(populated.get_episode(RUNNING)["length"]) == 3
    assert int(populated.get_episode(FRESH)["length"]) == 1


def test_closed_buffer_refuses_everything(populated):
    populated.close()
    populated.close()  # idempotent
    for call in (
        lambda: populated.start_episode(),
        lambda: append(populated),
        lambda: populated.sample_n_step(1),
        lambda: populated.stats(),
        lambda: populated.get_episode(RUNNING),
    ):
        with pytest.raises(RuntimeError, match="the buffer is closed"):
            call()


def test_a_zero_step_final_observation_fixes_the_observation_fields(tmp_path):
    with SyncEpisodeReplayBuffer(8, scratch_dir=tmp_path) as buf:
        empty, other, running = (buf.start_episode() for _ in range(3))
        buf.end_episode(empty, final_observation={"a": torch.zeros(5)})
        before = buf.stats()
        with pytest.raises(SchemaError, match="keys differ from the stored spec"):
            buf.end_episode(other, final_observation=torch.zeros(5))
        with pytest.raises(SchemaError, match=r"field 'observation\.a' expected shape \[5\]"):
            buf.append_observation_action_reward(running, {"a": torch.zeros(2)}, 0, 0.0)
        assert buf.stats() == before
        assert buf.spec is None
        buf.append_observation_action_reward(running, {"a": torch.ones(5)}, 0, 0.0)
        assert buf.get_episode(empty)["observation", "a"].shape == (1, 5)


def test_bookkeeping_that_cannot_fit_raises_insufficient_space_before_allocating():
    # 10**11 rows of links and anchors: the allocator's own RuntimeError would name nothing.
    with pytest.raises(InsufficientSpaceError, match=r"host memory \(RAM\), for the rows' book"):
        SyncEpisodeReplayBuffer(10**11, storage="tensor")


def _inside(transform: str, call) -> list[Exception]:
    """Run ``call(o)`` inside a ``torch.func`` transform, ``o`` an observation-shaped tensor
    of that transform (a wrapper without memory of its own); what it raised."""
    raised: list[Exception] = []

    def body(x):
        try:
            call(x * 1)
        except Exception as exc:
            raised.append(exc)
        return x

    if transform == "vmap":
        torch.func.vmap(body)(torch.zeros(2, 3))
    else:
        torch.func.functionalize(body)(torch.zeros(3))
    return raised


@pytest.mark.parametrize("transform", ["vmap", "functionalize"])
@pytest.mark.parametrize("call", ["append", "append_batch", "end"])
def test_a_torch_func_wrapper_is_refused_by_name_and_changes_nothing(populated, transform, call):
    """A tensor of a ``torch.func`` transform (vmap's batched tensor, functionalization's
    wrapper) has no memory of its own to store: refused by name, before any row is taken."""
    _, a, r, x = next_step()
    calls = {
        "append": lambda t: populated.append_observation_action_reward(RUNNING, t, a, r, x),
        "append_batch": lambda t: populated.append_batch([RUNNING], *batch_of([(t, a, r, x)])),
        "end": lambda t: populated.end_episode(RUNNING, "terminated", t),
    }
    before = snapshot(populated)
    raised = _inside(transform, calls[call])
    assert raised  # one per vmapped sample, or one
    for exc in raised:
        assert isinstance(exc, SchemaError), repr(exc)
        assert "field 'observation'" in str(exc)
        assert "torch.func" in str(exc)
    assert snapshot(populated) == before


def test_a_tensor_subclass_without_an_address_of_its_own_is_still_stored(populated):
    """A ``__torch_dispatch__`` wrapper subclass may report ``data_ptr()`` 0 while torch's
    copy reads its values: it is stored as before (only plain tensors of a transform are
    refused as having no memory of their own)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    _, a, r, x = next_step()
    wrapped = two_tensor.TwoTensor(torch.full((3,), 4.0), torch.full((3,), 4.0))
    assert wrapped.data_ptr() == 0
    populated.append_observation_action_reward(RUNNING, wrapped, a, r, x)
    populated.end_episode(RUNNING, "terminated", final_obs(RUNNING, 3))
    assert populated.get_episode(RUNNING)["observation"][2].tolist() == [4.0] * 3
