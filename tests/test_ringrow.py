"""``ReplayBuffer.add``'s fast row path (``replaybuf.storage.ringrow``) against the general path.

The general path is the reference: for any input, good or bad, a buffer taking the fast path
must store the same bytes, keep the same TorchRL bookkeeping and raise the same error (leaving
everything as it was) as a buffer whose every add takes the general path.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import replaybuf.storage.ringrow
from replaybuf import InvalidStateError, ReplayBuffer, SchemaError
from replaybuf.storage import row_writer
from replaybuf.storage.ringrow import RingRow, declined
from replaybuf.storage.tensorguard import GUARD_ENV

SPEC = {
    "obs": ((3,), torch.float32),
    "action": ((2,), torch.int64),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
    "count": ((), torch.int16),
    "value": ((), torch.float64),
}
FIRST = {
    "obs": np.zeros(3, np.float32),
    "action": np.zeros(2, np.int64),
    "reward": 0.0,
    "done": False,
    "count": 0,
    "value": 0.0,
}


def general_add(buf: ReplayBuffer, experience) -> None:
    """``add`` through the general path only (the reference)."""
    with buf._lock:
        buf._check_open()
        buf._add(experience)


def state(buf: ReplayBuffer) -> dict:
    """Everything a write may change: the stored bytes, TorchRL's counters, the ring's."""
    slots = buf._slots
    memory = slots.memory
    rows = buf.size  # slots never written hold whatever the allocation left there
    columns = {key: c[:rows].numpy().view(np.uint8).copy() for key, c in slots._leaves}
    index = slots._index_column
    return {
        "columns": columns,
        "index": None if index is None else index[:rows].numpy().copy(),
        "writer": memory.writer.state_dict(),
        "len": len(memory.storage),
        "last": memory.storage._last_cursor_index,
        "known": slots._index_known,
        "ring": (buf.pointer, buf.size, buf._writes),
    }


def same_state(a: dict, b: dict) -> None:
    assert a["columns"].keys() == b["columns"].keys()
    for key in a["columns"]:
        np.testing.assert_array_equal(a["columns"][key], b["columns"][key], err_msg=str(key))
    np.testing.assert_array_equal(a["index"], b["index"])
    assert {k: v for k, v in a.items() if k not in ("columns", "index")} == {
        k: v for k, v in b.items() if k not in ("columns", "index")
    }


def _outcome(add, buf, experience):
    try:
        add(buf, experience)
    except Exception as exc:  # the same error, type and message, on both paths
        return type(exc), str(exc)
    return None


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64) | st.sampled_from(
    [1e39, -1e39, 3.4028235e38, 5e-324, -0.0]
)
INTS = st.integers(-(2**63) - 5, 2**63 + 5) | st.integers(-40000, 40000)


# Tensors only (a row of them meets the whole-row guard first): exact, or any
EXACT_TENSORS = ["tensor", "offset"]
TENSOR_KINDS = [*EXACT_TENSORS, "grad", "strided", "negative", "sparse", "wrong shape",
                "no memory", "wrong dtype"]  # fmt: skip


@st.composite
def values(draw, shape: tuple[int, ...], dtype: torch.dtype, exact: bool, tensors=None):
    """A value for a field: an exact match in any input form, or (unless ``exact``) maybe a
    near miss; or a tensor of one of the kinds ``tensors`` lists."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    numel = int(np.prod(shape))
    exact_kinds = ["numpy", "tensor", "number", "npscalar"]
    kind = draw(
        st.sampled_from(tensors)
        if tensors
        else st.sampled_from(exact_kinds)
        if exact
        else st.sampled_from(
            [
                *exact_kinds,
                "float",
                "int",
                "bool",
                "wrong dtype",
                "wrong shape",
                "grad",
                "strided",
                "offset",
                "negative",
                "sparse",
                "list",
                "none",
                "text",
            ]
        )
    )
    if dtype.is_floating_point:
        raw = np.array(draw(st.lists(FLOATS, min_size=numel, max_size=numel)), np.float64)
        with np.errstate(over="ignore"):
            base = raw.astype(np_dtype).reshape(shape)
    elif dtype is torch.bool:  # any byte: a nonzero one other than 1 is a True stored as 1
        raw = draw(st.lists(st.sampled_from([0, 1, 2, 255]), min_size=numel, max_size=numel))
        base = np.array(raw, np.uint8).view(np.bool_).reshape(shape)
    else:
        info = np.iinfo(np_dtype)
        ints = st.integers(int(info.min), int(info.max))
        base = np.array(draw(st.lists(ints, min_size=numel, max_size=numel)), np_dtype)
        base = base.reshape(shape)
    if kind == "numpy":
        return base.copy()
    if kind == "tensor":
        return torch.from_numpy(base.copy())
    if kind == "number":
        return base.item() if shape == () else base.copy()
    if kind == "npscalar":
        return base[()] if shape == () else base.copy()
    if kind == "float":
        return draw(FLOATS)
    if kind == "int":
        return draw(INTS)
    if kind == "bool":
        return draw(st.booleans())
    if kind == "wrong dtype":
        other = draw(st.sampled_from([np.float16, np.float64, np.int32, np.uint8, np.bool_]))
        with np.errstate(all="ignore"):
            cast = base.astype(other)
        return torch.from_numpy(cast) if tensors or draw(st.booleans()) else cast
    if kind == "no memory":  # data_ptr() 0
        return torch._efficientzerotensor(shape, dtype=dtype)
    if kind == "wrong shape":
        return torch.zeros((*shape, 1), dtype=dtype)
    if kind == "grad":
        if not dtype.is_floating_point:
            return torch.from_numpy(base.copy())
        return torch.from_numpy(base.copy()).requires_grad_()
    if kind == "offset":  # a contiguous view at an offset into a larger tensor
        doubled = torch.from_numpy(np.concatenate([base.reshape(-1), base.reshape(-1)]))
        return doubled[numel:].view(shape)
    if kind == "negative":  # a view with torch's negative bit (numpy() refuses it)
        if dtype not in (torch.float32, torch.float64):
            return torch.from_numpy(base.copy())
        complex_dtype = torch.complex64 if dtype is torch.float32 else torch.complex128
        pairs = torch.complex(torch.zeros(shape, dtype=dtype), -torch.from_numpy(base.copy()))
        return pairs.to(complex_dtype).conj().imag
    if kind == "sparse":
        return torch.from_numpy(base.copy()).to_sparse() if shape else torch.from_numpy(base)
    if kind == "strided":  # a non-contiguous view of the right shape
        wide = np.repeat(base[..., None], 2, axis=-1)[..., 0] if shape else base.copy()
        return torch.from_numpy(wide) if tensors or draw(st.booleans()) else wide
    if kind == "list":
        return base.tolist()
    if kind == "none":
        return None
    return "text"


@st.composite
def experiences(draw):
    """A transition: every field, maybe a key missing, an extra one or a nested dict."""
    exact = draw(st.booleans())  # half the transitions are exact matches throughout
    out = {name: draw(values(shape, dtype, exact)) for name, (shape, dtype) in SPEC.items()}
    change = draw(st.sampled_from(["none"] * 6 + ["missing", "extra", "renamed", "not a dict"]))
    if change == "missing":
        out.pop(draw(st.sampled_from(sorted(out))))
    elif change == "extra":
        out["extra"] = 1.0
    elif change == "renamed":
        out["other"] = out.pop(draw(st.sampled_from(sorted(out))))
    elif change == "not a dict":
        return list(out.values())
    if draw(st.booleans()):  # ObjectRL's form: one transition as a TensorDict
        try:
            return TensorDict(out, batch_size=[])
        except Exception:  # values a TensorDict does not take: the dict as it is
            return out
    return out


@st.composite
def tensor_rows(draw):
    """A transition of tensors alone, as a dict or ObjectRL's TensorDict: half of them exact."""
    kinds = EXACT_TENSORS if draw(st.booleans()) else TENSOR_KINDS
    out = {}
    for name, (shape, dtype) in SPEC.items():
        out[name] = draw(values(shape, dtype, True, tensors=kinds))
    if draw(st.booleans()):
        try:
            return TensorDict(out, batch_size=[])
        except Exception:  # values a TensorDict does not take: the dict as it is
            return out
    return out


def pair(tmp_path, storage: str, capacity: int, prioritized: bool):
    bufs = []
    for name in ("fast", "general"):
        buf = ReplayBuffer(
            "cpu",
            "cpu",
            capacity,
            storage=storage,
            scratch_dir=tmp_path if storage == "memmap" else None,
            seed=0,
            prioritized=prioritized,
            spec=SPEC,
        )
        buf.add(dict(FIRST)) if name == "fast" else general_add(buf, dict(FIRST))
        bufs.append(buf)
    return bufs


@pytest.mark.parametrize(
    ("storage", "capacity", "prioritized"),
    [("tensor", 5, False), ("memmap", 7, False), ("tensor", 4, True)],
)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(experiences(), min_size=1, max_size=12))
def test_fast_path_stores_and_refuses_as_the_general_path(
    tmp_path, by_address, storage, capacity, prioritized, steps
):
    fast, general = pair(tmp_path, storage, capacity, prioritized)
    try:
        writer = row_writer(fast._slots)
        assert isinstance(writer, RingRow)
        assert (writer.copy_row is not None) is by_address
        assert writer.guarded is (by_address and os.environ.get(GUARD_ENV) != "0")
        for experience in steps:
            got = _outcome(ReplayBuffer.add, fast, experience)
            want = _outcome(general_add, general, experience)
            assert got == want
            assert not writer.sources.any()  # no address stays for the next call
            same_state(state(fast), state(general))
        if prioritized:
            assert torch.equal(fast.sample_batch(8)["index"], general.sample_batch(8)["index"])
        else:
            batch, reference = fast.sample_all(), general.sample_all()
            for key in SPEC:
                assert batch[key].numpy().tobytes() == reference[key].numpy().tobytes()
    finally:
        fast.close()
        general.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(tensor_rows(), min_size=1, max_size=12))
def test_rows_of_tensors_store_and_refuse_as_the_general_path(tmp_path, by_address, steps):
    """Rows whose every value is a tensor meet torch's guard over the whole row first (where
    it runs): what it passes, what it refuses and the attribute checks then take or decline,
    all stored or refused as the general path does."""
    fast, general = pair(tmp_path, "tensor", 5, False)
    try:
        writer = row_writer(fast._slots)
        assert isinstance(writer, RingRow)
        assert (writer.row_guard is not None) is writer.guarded
        for experience in steps:
            assert _outcome(ReplayBuffer.add, fast, experience) == _outcome(
                general_add, general, experience
            )
            assert not writer.sources.any()  # no address stays for the next call
            same_state(state(fast), state(general))
    finally:
        fast.close()
        general.close()


def test_the_row_guard_takes_a_row_of_exact_tensors_in_one_call(monkeypatch):
    """A row of exact tensors is checked by one guard call and no per-field one; a row with
    one tensor the guard refuses (needing grad) falls to the field checks and is still taken,
    as the general path takes it."""
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=SPEC) as buf:
        buf.add(dict(FIRST))
        writer = row_writer(buf._slots)
        assert isinstance(writer, RingRow)
        if writer.row_guard is None:
            pytest.skip("no guard here (the kernels or torch's guard do not run)")
        calls = {"row": 0, "field": 0}
        guard = writer.row_guard

        def counted(*values):
            calls["row"] += 1
            return guard(*values)

        monkeypatch.setattr(writer, "row_guard", counted)
        fields = []
        for field in writer.fields:
            field_guard = field[9]

            def counted_field(value, field_guard=field_guard):
                calls["field"] += 1
                return field_guard(value)

            fields.append((*field[:9], counted_field, *field[10:]))
        monkeypatch.setattr(writer, "fields", fields)
        row = {name: torch.ones(shape, dtype=dtype) for name, (shape, dtype) in SPEC.items()}
        buf.add(row)
        assert calls == {"row": 1, "field": 0}
        buf.add({**row, "value": torch.ones((), dtype=torch.float64).requires_grad_()})
        assert calls == {"row": 2, "field": len(SPEC)}
        assert buf.sample_all()["value"].tolist() == [0.0, 1.0, 1.0]


def test_fast_path_is_taken_for_exact_inputs_and_declines_the_rest():
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=SPEC) as buf:
        assert row_writer(buf._slots) is declined  # nothing allocated: the first write is general
        buf.add(dict(FIRST))
        writer = row_writer(buf._slots)
        assert isinstance(writer, RingRow)
        exact = {
            "obs": torch.ones(3),
            "action": np.array([1, 2]),
            "reward": torch.tensor(0.5),
            "done": np.bool_(True),
            "count": 7,
            "value": 2.5,
        }
        assert writer(exact) == 1
        assert writer({**exact, "count": 2.0}) == -1  # a float into an int field: general path
        assert writer({**exact, "obs": torch.ones(3, dtype=torch.float64)}) == -1
        assert buf.memory.writer.state_dict() == {"_cursor": 2, "_write_count": 2}


def test_an_interrupt_before_the_copy_leaves_no_address_for_the_next_add(tmp_path, monkeypatch):
    """Addresses noted before an interrupt (here raised as the memmap files grow) are cleared
    as it leaves: nothing is written, and the next add reads no old address."""
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path, spec=SPEC) as buf:
        buf.add(dict(FIRST))
        writer = row_writer(buf._slots)
        assert isinstance(writer, RingRow)
        if writer.copy_row is None:
            pytest.skip("the compiled kernels do not run here")
        before = state(buf)

        def interrupted(stop):
            raise KeyboardInterrupt

        monkeypatch.setattr(buf._slots, "_reserved", 1)  # the next row must grow the files
        monkeypatch.setattr(buf._slots, "_reserve", interrupted)
        with pytest.raises(KeyboardInterrupt):
            buf.add({**FIRST, "obs": torch.ones(3), "reward": torch.tensor(2.0)})
        assert not writer.sources.any()
        monkeypatch.undo()
        same_state(state(buf), before)
        buf.add(dict(FIRST))
        assert buf.sample_all()["obs"].tolist() == [[0.0] * 3] * 2


def test_a_zero_d_bool_tensor_of_any_nonzero_byte_is_stored_as_true(by_address):
    """A uint8 tensor viewed as a 0-d bool, byte 2, stores 1 (as the general path stores it),
    copied by address or read with item()."""
    odd = torch.tensor(2, dtype=torch.uint8).view(torch.bool)
    assert odd.view(torch.uint8).item() == 2
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=SPEC) as buf:
        buf.add(dict(FIRST))
        assert row_writer(buf._slots)({**FIRST, "done": odd}) == 1  # the fast path took it
        buf._advance(1)
        assert buf.sample_all()["done"].view(torch.uint8).tolist() == [0, 1]


def test_tensors_without_memory_of_their_own_are_never_read_as_bytes(by_address):
    """Inside ``torch.func.functionalize`` a tensor's ``data_ptr()`` is 0 and ``numpy()``
    would view whatever lies there: the fast row and chunk writers decline such tensors, so
    the general path refuses them by name and nothing is stored."""
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=SPEC) as buf:
        buf.add(dict(FIRST))
        before = state(buf)
        refused = []

        def inside(x):
            y = x * 2
            for write in (
                lambda: buf.add({**FIRST, "obs": y}),
                lambda: buf.add_batch({k: torch.as_tensor(v)[None] for k, v in FIRST.items()}
                                      | {"obs": y[None]}),
            ):  # fmt: skip
                try:
                    write()
                except SchemaError as exc:
                    refused.append(str(exc))
            return y

        torch.func.functionalize(inside)(torch.ones(3))
        assert len(refused) == 2
        assert all("field 'obs' is a tensor without memory of its own" in m for m in refused)
        same_state(state(buf), before)


def test_bool_tensors_copied_by_address_store_zero_or_one(by_address):
    """A bool tensor viewed from bytes other than 0 and 1, copied by address, stores 0 and 1,
    as the general path stores it (the kernel converts a bool field's bytes)."""
    if not by_address:
        pytest.skip("the copy by address only")
    spec = {"flags": ((3,), torch.bool), "done": ((), torch.bool)}
    odd = {
        "flags": torch.tensor([2, 0, 255], dtype=torch.uint8).view(torch.bool),
        "done": torch.tensor(7, dtype=torch.uint8).view(torch.bool),
    }
    stored = []
    for add in (ReplayBuffer.add, general_add):
        with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=spec) as buf:
            buf.add({"flags": torch.zeros(3, dtype=torch.bool), "done": torch.tensor(False)})
            add(buf, odd)
            batch = buf.sample_all()
            stored.append([batch[k].view(torch.uint8).tolist() for k in spec])
    assert stored[0] == stored[1] == [[[0, 0, 0], [1, 0, 1]], [0, 1]]


def test_an_add_nested_in_an_add_is_refused_and_the_outer_row_is_intact(by_address):
    """User code run while a transition is checked (here a key's ``__eq__``) that adds another
    transition is refused (``InvalidStateError``, see tests/test_reentry.py), and the outer
    add still stores its own tensors, with no address left behind."""
    refused = []

    class Key(str):
        __hash__ = str.__hash__

        def __eq__(self, other):
            try:
                buf.add({**FIRST, "obs": torch.full((3,), 7.0)})
            except InvalidStateError as error:
                refused.append(str(error))
            return str.__eq__(self, other)

    with ReplayBuffer("cpu", "cpu", 8, storage="tensor", spec=SPEC) as buf:
        buf.add(dict(FIRST))
        outer = {**FIRST, "obs": torch.full((3,), 5.0)}
        del outer["value"]
        outer[Key("value")] = 0.0
        buf.add(outer)
        assert refused
        assert all("add: called while another call" in message for message in refused)
        assert not row_writer(buf._slots).sources.any()
        assert buf.sample_all()["obs"][:, 0].tolist() == [0.0, 5.0]


def test_a_one_transition_tensordict_takes_the_fast_path_and_others_do_not(monkeypatch):
    """ObjectRL's form, one transition as a TensorDict of batch size [], is written by the row
    writer from its leaves; a batch, a nested TensorDict, or any TensorDict where tensordict
    keeps its entries otherwise (simulated), is declined to the general path."""
    exact = {
        "obs": torch.ones(3),
        "action": torch.tensor([1, 2]),
        "reward": torch.tensor(0.5),
        "done": torch.tensor(True),
        "count": torch.tensor(7, dtype=torch.int16),
        "value": torch.tensor(2.5, dtype=torch.float64),
    }
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", spec=SPEC) as buf:
        buf.add(dict(FIRST))
        writer = row_writer(buf._slots)
        assert isinstance(writer, RingRow)
        assert writer(TensorDict(exact, batch_size=[])) == 1
        assert writer(TensorDict(exact, batch_size=[]).unsqueeze(0)) == -1  # a batch of one
        nested = TensorDict({**exact, "obs": TensorDict({"x": torch.ones(3)}, [])}, [])
        assert writer(nested) == -1
        monkeypatch.setattr(replaybuf.storage.ringrow, "_LEAVES_BY_NAME", False)
        assert writer(TensorDict(exact, batch_size=[])) == -1
        monkeypatch.undo()
        buf._advance(1)
        buf.add(TensorDict(exact, batch_size=[]))
        assert buf.sample_all()["obs"].tolist() == [[0.0] * 3, [1.0] * 3, [1.0] * 3]


def test_fast_path_is_chosen_again_after_reset_and_declined_for_bfloat16():
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as buf:
        buf.add({"x": torch.zeros(2)})
        first = row_writer(buf._slots)
        buf.reset()
        buf.add({"x": torch.zeros(3)})
        second = row_writer(buf._slots)
        assert isinstance(second, RingRow)
        assert second is not first
        buf.add({"x": torch.ones(3)})
        assert buf.size == 2
        assert buf.sample_all()["x"].tolist() == [[0.0] * 3, [1.0] * 3]
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as buf:
        buf.add({"x": torch.zeros(2, dtype=torch.bfloat16)})
        assert row_writer(buf._slots) is declined  # numpy has no bfloat16 view
        buf.add({"x": torch.ones(2, dtype=torch.bfloat16)})
        assert buf.size == 2


NEGATIVE = torch.complex(torch.zeros(3), -torch.arange(3.0)).conj().imag  # [0, 1, 2], neg bit


@pytest.mark.parametrize(
    ("obs", "taken"),
    [
        (torch.zeros(3, device="meta"), False),
        (torch.zeros(3).to_sparse(), False),
        (torch.zeros(3, requires_grad=True), "by address"),
        (torch.zeros(3, dtype=torch.bfloat16), False),
        (torch.zeros(3, dtype=torch.float64), False),
        (torch.zeros(3, dtype=torch.int32), False),
        (torch.zeros(1, 3), False),
        (torch.arange(6.0)[::2], True),  # a strided view: numpy reads it as is
        (torch.arange(6.0)[3:], True),  # a contiguous view at an offset
        (NEGATIVE, False),
        (torch._efficientzerotensor(3), False),  # no memory: data_ptr() is 0
    ],
    ids=[
        "meta", "sparse", "grad", "bfloat16", "float64", "int32", "shape", "strided", "offset",
        "negative", "no memory",
    ],
)  # fmt: skip
def test_shaped_tensors_are_checked_as_the_general_path(tmp_path, by_address, obs, taken):
    """The row writer checks a shaped tensor's dtype, shape, device and layout, then copies it
    from its address (contiguous, no negative bit) or through its numpy() array: what it
    refuses is declined with nothing written, and the general path then stores or refuses it
    as it would without the fast path. A tensor needing grad is copied by address (the general
    path stores its values too) but refused by numpy()."""
    fast, general = pair(tmp_path, "tensor", 5, False)
    try:
        writer = row_writer(fast._slots)
        assert isinstance(writer, RingRow)
        experience = {**FIRST, "obs": obs}
        before = state(fast)
        if taken == "by address":
            taken = by_address
        assert (writer(experience) >= 0) is taken
        assert not writer.sources.any()  # no address stays for the next call
        if taken:  # the writer alone wrote it: the ring counts it as add would
            fast._advance(1)
            general_add(general, experience)
        else:
            same_state(state(fast), before)
            assert _outcome(ReplayBuffer.add, fast, experience) == _outcome(
                general_add, general, experience
            )
        same_state(state(fast), state(general))
    finally:
        fast.close()
        general.close()
