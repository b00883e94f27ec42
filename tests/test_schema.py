"""Writes that differ from the stored field spec raise before touching storage.

Every case runs against a buffer holding three rows and asserts that length, pointer, spec and
contents are exactly as before the failed call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from replay_helpers import ids_of, rows, transition, unchanged
from tensordict import TensorDict

from replaybuf import Field, FieldSpec, ReplayBuffer, SchemaError
from replaybuf.storage.convert import to_leaves
from replaybuf.storage.schema import storable


def _row() -> dict:
    """One valid transition as a plain dict (write id 50)."""
    return rows(50, 1)[0].to_dict()


def _batch(n: int = 2) -> dict:
    return rows(50, n).to_dict()


def _with(base: dict, **changes) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


@pytest.fixture
def filled(make_buffer, storage) -> ReplayBuffer:
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 3))
    return buf


ROW_CASES = {
    "missing key": (_with(_row(), action=None), r"missing \['action'\]"),
    "missing nested key": (
        _with(_row(), next={"reward": torch.tensor(0.0)}),
        r"missing \['next\.obs'\]; unexpected \['next\.reward'\]",
    ),
    "extra key": (_with(_row(), aux=torch.zeros(3)), r"unexpected \['aux'\]"),
    "extra nested key": (
        _with(_row(), next={"obs": torch.zeros(4), "done": torch.tensor(True)}),
        r"unexpected \['next\.done'\]",
    ),
    "shape [1] for [4] is not broadcast": (
        _with(_row(), obs=torch.zeros(1)),
        r"field 'obs' expected shape \[4\], got \[1\]",
    ),
    "same numel, other shape": (
        _with(_row(), obs=torch.zeros(2, 2)),
        r"field 'obs' expected shape \[4\], got \[2, 2\]",
    ),
    "nested shape": (
        _with(_row(), next={"obs": torch.zeros(5)}),
        r"field 'next\.obs' expected shape \[4\], got \[5\]",
    ),
    "float64 for float32": (
        _with(_row(), obs=torch.zeros(4, dtype=torch.float64)),
        r"field 'obs' expected dtype torch\.float32, got torch\.float64",
    ),
    "numpy float64 for float32": (
        _with(_row(), action=np.zeros(2)),
        r"field 'action' expected dtype torch\.float32, got torch\.float64",
    ),
    "bfloat16 for float32": (
        _with(_row(), reward=torch.tensor(1.0, dtype=torch.bfloat16)),
        r"field 'reward' expected dtype torch\.float32, got torch\.bfloat16",
    ),
    "python float into bool": (
        _with(_row(), done=0.5),
        r"field 'done' expected dtype torch\.bool, got 0\.5",
    ),
    "python int that bool cannot hold": (
        _with(_row(), done=2),
        r"field 'done' expected dtype torch\.bool, got 2",
    ),
    "float tensor into bool": (
        _with(_row(), done=torch.tensor(1.0)),
        r"field 'done' expected dtype torch\.bool, got torch\.float32",
    ),
    "number for a vector field": (
        _with(_row(), obs=1.0),
        r"field 'obs' expected shape \[4\], got \[\]",
    ),
    "reserved name": (_with(_row(), index=torch.tensor(0)), r"'index' is reserved"),
    "meta tensor": (_with(_row(), obs=torch.zeros(4, device="meta")), r"'obs' is a meta"),
    "empty nested dict": (_with(_row(), next={}), r"'next' is an empty dict"),
    "empty nested tensordict": (
        _with(_row(), next=TensorDict({}, batch_size=[])),
        r"'next' is an empty dict",
    ),
    "no fields": ({}, r"expected at least one field, got none"),
}


@pytest.mark.parametrize("bad", ROW_CASES.values(), ids=ROW_CASES.keys())
def test_add_of_a_mismatching_transition_raises_and_changes_nothing(filled, bad):
    data, message = bad
    with unchanged(filled), pytest.raises(SchemaError, match=message):
        filled.add(data)


BATCH_CASES = {
    "missing key": (_with(_batch(), reward=None), r"missing \['reward'\]"),
    "missing nested key": (_with(_batch(), next=None), r"missing \['next\.obs'\]"),
    "extra key": (_with(_batch(), aux=torch.zeros(2)), r"unexpected \['aux'\]"),
    "shape [1] for [4] is not broadcast": (
        _with(_batch(), obs=torch.zeros(2, 1)),
        r"field 'obs' expected shape \[4\], got \[1\]",
    ),
    "float64 for float32": (
        _with(_batch(), reward=np.zeros(2)),
        r"field 'reward' expected dtype torch\.float32, got torch\.float64",
    ),
    "int64 for bool": (
        _with(_batch(), done=torch.zeros(2, dtype=torch.int64)),
        r"field 'done' expected dtype torch\.bool, got torch\.int64",
    ),
    "fields disagree on the batch dimension": (
        _with(_batch(), reward=torch.zeros(3)),
        r"fields disagree on the batch dimension: .*'obs': 2.*'reward': 3",
    ),
    "nested field disagrees on the batch dimension": (
        _with(_batch(), next={"obs": torch.zeros(5, 4)}),
        r"fields disagree on the batch dimension: .*'next\.obs': 5",
    ),
    "python number is not a batch": (
        _with(_batch(), reward=1.0),
        r"field 'reward' expected a batch of rows, got a scalar 1\.0",
    ),
    "0-d tensor is not a batch": (
        _with(_batch(), reward=torch.tensor(1.0)),
        r"field 'reward' expected a batch of rows, got a 0-d tensor",
    ),
}


@pytest.mark.parametrize("bad", BATCH_CASES.values(), ids=BATCH_CASES.keys())
def test_add_batch_of_mismatching_rows_raises_and_changes_nothing(filled, bad):
    data, message = bad
    with unchanged(filled), pytest.raises(SchemaError, match=message):
        filled.add_batch(data)


def test_a_tensordict_batch_is_checked_like_a_dict(filled):
    bad = rows(50, 2)
    bad["obs"] = torch.zeros(2, 4, dtype=torch.float16)
    with unchanged(filled), pytest.raises(SchemaError, match=r"'obs' expected dtype"):
        filled.add_batch(bad)


def test_add_of_a_batched_tensordict_raises_and_points_to_add_batch(filled):
    with unchanged(filled), pytest.raises(ValueError, match=r"batch_size \[2\]; use add_batch"):
        filled.add(rows(50, 2))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2, 3], r"add: expected a TensorDict or a dict of tensors, got list"),
        (torch.zeros(4), r"add: expected a TensorDict or a dict of tensors, got Tensor"),
        (_with(_row(), obs="abc"), r"'obs' expected a tensor, array, number or list of num"),
        (_with(_row(), obs=["a", 0.0, 0.0, 0.0]), r"field 'obs' expected .* got list"),
        ({**_row(), 3: torch.zeros(1)}, r"field names must be str, got 3"),
        (_with(_row(), obs=np.array([None] * 4)), r"field 'obs' is an object array"),
    ],
    ids=["list", "bare tensor", "string value", "list of text", "int key", "object array"],
)
def test_add_of_an_unsupported_type_raises_type_error_and_changes_nothing(filled, data, message):
    with unchanged(filled), pytest.raises(TypeError, match=message):
        filled.add(data)


def test_lists_of_numbers_are_taken_as_the_tensors_of_their_shape(filled):
    """A (nested) Python list of numbers goes wherever a tensor of its shape goes, in the
    field's dtype; a list that is no tensor, or holds what the dtype cannot, is refused."""
    before = len(filled)
    filled.add(_with(_row(), obs=[1.0, 2.0, 3.0, 4.0]))
    assert len(filled) == before + 1
    assert filled.sample_all()["obs"][-1].tolist() == [1.0, 2.0, 3.0, 4.0]
    with unchanged(filled), pytest.raises(SchemaError, match="'obs' is a list that is no tensor"):
        filled.add(_with(_row(), obs=[[1.0], [2.0, 3.0]]))
    with unchanged(filled), pytest.raises(SchemaError, match="'obs' expected shape"):
        filled.add(_with(_row(), obs=[1.0, 2.0]))


def test_first_write_with_disagreeing_batch_dims_leaves_the_buffer_empty(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    with unchanged(buf), pytest.raises(SchemaError, match="disagree on the batch dimension"):
        buf.add_batch({"obs": torch.zeros(3, 2), "reward": torch.zeros(2)})
    assert buf.spec is None
    buf.add_batch({"other": torch.ones(2)})  # the failed write fixed no spec
    assert buf.sample_all()["other"].tolist() == [1.0, 1.0]


# dtypes this torch cannot write into storage rows (uint16/32/64 and float8 in torch 2.14)
UNSTORABLE = [
    d for d in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn) if not storable(d)
]


def test_every_common_dtype_is_storable():
    """The probe itself: what buffers are written with every day passes it."""
    common = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    common += (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64)
    assert [d for d in common if not storable(d)] == []


@pytest.mark.skipif(not UNSTORABLE, reason="this torch can store every probed dtype")
@pytest.mark.parametrize("as_numpy", [False, True], ids=["tensor", "numpy"])
def test_a_first_write_of_a_dtype_storage_cannot_hold_raises_and_fixes_no_spec(
    make_buffer, storage, as_numpy
):
    """Before, uint16 and the like failed inside TorchRL at the write, after the spec was
    fixed; now the first write names the field and its dtype and leaves the buffer empty."""
    for dtype in UNSTORABLE:
        if as_numpy and dtype.is_floating_point:
            continue  # numpy has no float8
        buf = make_buffer(4, storage=storage)
        bad = torch.zeros(2, 3, dtype=dtype)
        value = (
            torch.zeros(2, 3, dtype=torch.int64).numpy().astype(str(dtype)[6:]) if as_numpy else bad
        )
        with unchanged(buf), pytest.raises(SchemaError, match=rf"field 'code' has dtype {dtype}"):
            buf.add_batch({"obs": torch.zeros(2, 4), "code": value})
        assert buf.spec is None
        buf.add_batch({"obs": torch.zeros(2, 4), "code": torch.ones(2, 3, dtype=torch.int64)})
        assert buf.sample_all()["code"].sum().item() == 6
        for spec in ({"code": ((3,), dtype)}, FieldSpec({("code",): Field((3,), dtype)})):
            with pytest.raises(SchemaError, match=rf"spec field 'code' has dtype {dtype}"):
                ReplayBuffer("cpu", "cpu", 4, storage=storage, spec=spec)


def test_an_episode_step_of_a_dtype_storage_cannot_hold_raises_and_changes_nothing(
    make_episode_buffer,
):
    if not UNSTORABLE:
        pytest.skip("this torch can store every probed dtype")
    buf = make_episode_buffer(16)
    ep = buf.start_episode()
    with pytest.raises(SchemaError, match=rf"field 'action' has dtype {UNSTORABLE[0]}"):
        buf.append_observation_action_reward(
            ep, torch.zeros(2), torch.ones((), dtype=UNSTORABLE[0]), 1.0
        )
    assert buf.stats()["steps"] == 0
    for t in range(2):
        buf.append_observation_action_reward(ep, torch.zeros(2), torch.tensor(t + 1), 1.0)
    assert buf.sample_n_step(4)["action"].tolist() == [1, 1, 1, 1]


def test_first_write_fixes_the_spec(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add(_row())
    spec = {".".join(k): (f.shape, f.dtype) for k, f in buf.spec.items()}
    assert spec == {
        "action": ((2,), torch.float32),
        "done": ((), torch.bool),
        "next.obs": ((4,), torch.float32),
        "obs": ((4,), torch.float32),
        "reward": ((), torch.float32),
    }


def test_python_numbers_take_the_field_dtype_when_lossless(make_buffer):
    buf = make_buffer(4)
    buf.add({"count": torch.tensor(1, dtype=torch.int16), "x": torch.tensor(0.5)})
    buf.add({"count": 7, "x": 3})
    stored = buf.sample_all()
    assert stored["count"].dtype == torch.int16
    assert stored["count"].tolist() == [1, 7]
    assert stored["x"].tolist() == [0.5, 3.0]
    with unchanged(buf), pytest.raises(SchemaError, match=r"'count' expected dtype torch\.int16"):
        buf.add({"count": 70_000, "x": 1.0})
    with unchanged(buf), pytest.raises(SchemaError, match=r"'count' expected dtype torch\.int16"):
        buf.add({"count": 1.5, "x": 1.0})


def test_rows_after_a_rejected_write_are_stored_in_the_right_slots(filled):
    with unchanged(filled), pytest.raises(SchemaError, match="'obs' expected shape"):
        filled.add_batch(_with(_batch(), obs=torch.zeros(2, 1)))
    filled.add_batch(rows(3, 2))
    assert ids_of(filled.sample_all()) == [1, 2, 3, 4]
    assert filled.pointer == 1


def test_a_wrong_shape_in_the_first_nested_level_is_named_in_full(make_buffer):
    buf = make_buffer(4)
    buf.add_batch(TensorDict({"a": {"b": torch.zeros(2, 3)}}, batch_size=[2]))
    with (
        unchanged(buf),
        pytest.raises(SchemaError, match=r"'a\.b' expected shape \[3\], got \[2\]"),
    ):
        buf.add_batch({"a": {"b": torch.zeros(2, 2)}})


def test_a_zero_dim_numpy_array_keeps_its_shape():
    # np.ascontiguousarray(np.array(3)) has shape (1,): a 0-d action must stay a scalar field.
    leaves = to_leaves({"action": np.array(3)}, batched=False, what="add")
    assert leaves[("action",)].shape == ()
    assert leaves[("action",)].item() == 3


# ----------------------------------------------------------------- the fast path (FieldSpec.match)
def _flat(n: int = 3) -> dict:
    """A batch with only top-level fields (the common layout, and the benchmark's)."""
    return {
        "obs": torch.zeros(n, 4),
        "action": torch.zeros(n, 2),
        "reward": torch.zeros(n),
        "done": torch.zeros(n, dtype=torch.bool),
    }


FLAT_CASES = {
    "missing key": _with(_flat(), done=None),
    "extra key": _with(_flat(), aux=torch.zeros(3)),
    "reserved name": _with(_flat(), index=torch.zeros(3)),
    "float64 for float32": _with(_flat(), obs=torch.zeros(3, 4, dtype=torch.float64)),
    "int64 for bool": _with(_flat(), done=torch.zeros(3, dtype=torch.int64)),
    "other shape": _with(_flat(), obs=torch.zeros(3, 5)),
    "same numel, other shape": _with(_flat(), obs=torch.zeros(3, 2, 2)),
    "one row without its batch dim": _with(_flat(), obs=torch.zeros(4)),
    "0-d tensor": _with(_flat(), reward=torch.tensor(1.0)),
    "0-d first field": _with(_flat(), obs=torch.tensor(1.0)),  # before any row count is known
    "rows disagree": _with(_flat(), reward=torch.zeros(2)),
    "first field's rows disagree": _with(_flat(), obs=torch.zeros(2, 4)),
    "python number": _with(_flat(), reward=1.0),
    "meta tensor": _with(_flat(), obs=torch.zeros(3, 4, device="meta")),
    "sparse tensor": _with(_flat(), reward=torch.ones(3).to_sparse()),  # not the first field
    "ragged list value": _with(_flat(), obs=[[0.0] * 4, [0.0] * 3, [0.0] * 4]),
    "string value": _with(_flat(), obs="abc"),
    "object array": _with(_flat(), obs=np.array([[None] * 4] * 3)),
    "int key": {**_flat(), 3: torch.zeros(3)},
    "nested where a leaf is stored": _with(_flat(), obs={"x": torch.zeros(3, 4)}),
    "empty nested dict": _with(_flat(), next={}),
    "no fields": {},
    "tensordict with a wrong dtype": TensorDict(
        _with(_flat(), reward=torch.zeros(3, dtype=torch.float16)), batch_size=[3]
    ),
    "not a mapping": [torch.zeros(3, 4)],
}


@pytest.fixture
def flat(make_buffer, storage) -> ReplayBuffer:
    buf = make_buffer(8, storage=storage)
    buf.add_batch(TensorDict(_flat(), batch_size=[3]))
    return buf


@pytest.mark.parametrize("bad", FLAT_CASES.values(), ids=FLAT_CASES.keys())
def test_a_batch_the_fast_path_declines_gets_the_general_path_s_exact_error(flat, bad):
    spec = flat.spec
    assert spec.match(bad, batched=True) is None
    with pytest.raises((SchemaError, TypeError)) as general:
        spec.check(to_leaves(bad, batched=True, what="add_batch", spec=spec), 1, "add_batch")
    with unchanged(flat), pytest.raises(type(general.value)) as got:
        flat.add_batch(bad)
    assert str(got.value) == str(general.value)


def test_match_takes_the_callers_tensors_of_an_exact_batch_as_they_are():
    batch = rows(0, 3)  # nested: next.obs
    batch["obs"] = batch["obs"].t().contiguous().t()  # not contiguous: still taken
    spec = FieldSpec.of(batch, 1)
    for data in (batch, batch.to_dict()):
        leaves = spec.match(data, batched=True)
        assert leaves is not None
        assert set(leaves) == set(spec)
        assert all(leaves[key] is batch.get(key) for key in spec)
    row = transition(4)
    assert spec.match(row, batched=False) is not None
    assert spec.match(row, batched=True) is None  # 0-d reward and done: not a batch
    assert spec.match(batch, batched=False) is None


def test_match_detaches_tensors_that_require_grad():
    spec = FieldSpec.of(TensorDict(_flat(), batch_size=[3]), 1)
    obs = torch.ones(3, 4, requires_grad=True)
    leaves = spec.match(_with(_flat(), obs=obs), batched=True)
    assert not leaves[("obs",)].requires_grad
    assert leaves[("obs",)].data_ptr() == obs.data_ptr()  # the same data, not a copy


def test_match_declines_what_the_general_path_converts_or_refuses():
    spec = FieldSpec.of(TensorDict(_flat(), batch_size=[3]), 1)
    converted = _with(_flat(), obs=np.zeros((3, 4), np.float32))  # to_leaves takes it
    assert spec.match(converted, batched=True) is None
    assert spec.check(to_leaves(converted, batched=True, what="x", spec=spec), 1, "x") is None
    subclass = _with(_flat(), obs=torch.nn.Parameter(torch.zeros(3, 4)))
    assert spec.match(subclass, batched=True) is None
    reserved = FieldSpec({("index",): Field((), torch.float32)})  # to_leaves refuses the name
    assert reserved.match({"index": torch.zeros(3)}, batched=True) is None
