"""The host gather of every field (replaybuf.storage.host_gather) against ``torch.index_select``
per field, and where it is chosen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from replaybuf import ReplayBuffer
from replaybuf.storage import UniformBatch, uniform_batch
from replaybuf.storage.host_gather import NumpyTakes, host_gather

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
# A field: its dtype and per-row shape (0-d, one to three dims, some of no elements).
fields = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple)),
    min_size=1,
    max_size=7,
)


def columns_of(layout, slots, seed):
    generator = torch.Generator().manual_seed(seed)
    columns = []
    for dtype, shape in layout:
        if dtype is torch.bool:  # its bytes are 0 or 1
            columns.append(torch.randint(0, 2, (slots, *shape), generator=generator).bool())
            continue
        bits = torch.randint(0, 256, (slots, *shape, dtype.itemsize), generator=generator)
        columns.append(bits.to(torch.uint8).view(dtype).reshape(slots, *shape))
    return columns


def check_equal(got, columns, slots):
    assert len(got) == len(columns)
    for value, column in zip(got, columns, strict=True):
        want = torch.index_select(column, 0, slots)
        assert value.dtype == want.dtype
        assert value.shape == want.shape
        assert value.is_contiguous()
        # bit for bit (NaN payloads and signed zeros included)
        assert value.numpy().tobytes() == want.numpy().tobytes()


@settings(max_examples=200, deadline=None)
@given(
    layout=fields,
    stored=st.integers(1, 40),
    draws=st.lists(st.integers(0, 10**6), max_size=70),
    edges=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_host_gather_equals_index_select(layout, stored, draws, edges, seed):
    """Random layouts, stored rows and draws (repeats; the first and last slot with ``edges``):
    every field equals ``index_select``'s, dtype, shape and bytes."""
    columns = columns_of(layout, stored, seed)
    at = [d % stored for d in draws] + ([0, stored - 1, 0] if edges else [])
    slots = torch.tensor(at, dtype=torch.long)
    gather = host_gather(columns, {id(c): c.numpy() for c in columns})
    assert gather is not None
    check_equal(gather(slots), columns, slots)


def test_a_column_without_a_numpy_view_takes_index_select():
    columns = [torch.randn(5, 2), torch.randn(5).to(torch.bfloat16)]
    assert host_gather(columns, {id(columns[0]): columns[0].numpy()}) is None


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
@pytest.mark.parametrize("prioritized", [False, True])
def test_sampled_batches_own_their_memory(tmp_path, kind, prioritized):
    """A ring's batches (uniform, prioritized, by index) equal the stored rows, and stay
    unchanged when the storage is written afterwards."""
    buf = ReplayBuffer(
        "cpu", "cpu", 64, storage=kind, scratch_dir=tmp_path, seed=0, prioritized=prioritized
    )
    with buf:
        rows = 64
        data = {
            "obs": torch.randn(rows, 3, 2),
            "action": torch.randint(0, 9, (rows,)),
            "reward": torch.randn(rows).double(),
            "done": torch.rand(rows) < 0.5,
            "half": torch.randn(rows, 5).half(),
        }
        buf.add_batch(data)
        batches = [buf.sample_batch(32), buf.sample_by_index(torch.tensor([0, 63, 5, 5]))]
        assert type(buf._slots.derived["storage.host_gather"]) is NumpyTakes  # kept
        kept = [{k: b[k].clone() for k in data} for b in batches]
        for k, v in data.items():
            assert torch.equal(batches[1][k], v[[0, 63, 5, 5]])
        buf.add_batch({k: torch.zeros_like(v) for k, v in data.items()})  # every slot again
        for b, before in zip(batches, kept, strict=True):
            for k in data:
                assert torch.equal(b[k], before[k])


@settings(max_examples=60, deadline=None)
@given(
    layout=fields,
    stored=st.integers(1, 40),
    batch=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_uniform_batch_equals_the_general_draw_and_gather(layout, stored, batch, seed):
    """``sample_batch``'s host path (replaybuf.storage.ringbatch) against the general path: the
    same draw from the same generator, the same rows bit for bit, the same TensorDict."""
    columns = columns_of(layout, stored, seed)
    data = {f"f{i}": column for i, column in enumerate(columns)}
    fast = ReplayBuffer("cpu", "cpu", stored, storage="tensor", seed=seed)
    general = ReplayBuffer("cpu", "cpu", stored, storage="tensor", seed=seed)
    with fast, general:
        fast.add_batch(data)
        general.add_batch(data)
        assert isinstance(uniform_batch(fast._slots), UniformBatch)
        got = fast.sample_batch(batch)
        slots = torch.randint(0, stored, (batch,), generator=general._generator)
        want = general._slots.gather(slots, torch.device("cpu"))
        assert torch.equal(fast._generator.get_state(), general._generator.get_state())
        assert got.batch_size == want.batch_size == torch.Size([batch])
        assert got.device == want.device
        assert list(got.keys()) == list(want.keys())
        check_equal([got[k] for k in data], columns, slots)


def test_uniform_batch_is_declined_where_the_host_path_does_not_apply():
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", seed=0) as buf:
        assert uniform_batch(buf._slots) is None  # nothing allocated
        buf.add_batch({"x": torch.ones(4, 2), "y": torch.ones(4, dtype=torch.bfloat16)})
        assert uniform_batch(buf._slots) is None  # numpy has no bfloat16 view
        assert buf.sample_batch(3)["y"].dtype == torch.bfloat16
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", seed=0) as buf:
        buf.add_batch({"a": {"b": torch.ones(4, 2)}, "c": torch.zeros(4)})
        assert uniform_batch(buf._slots) is None  # nested: the general path builds the nesting
        assert buf.sample_batch(3)["a", "b"].shape == (3, 2)


@pytest.mark.parametrize("shared", [True, False])
def test_uniform_batches_are_new_unsafe_batches_of_their_own(shared, monkeypatch):
    """The fast path's batches carry the attributes ``_new_unsafe`` gives a batch of their
    size, each its own leaf dict: one batch changed leaves every other as it was. Built from
    shared attributes, or by ``_new_unsafe`` itself where none are found (then without the
    device lookup's cached MPS flag, which a batch reads again when asked)."""
    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is None:
        pytest.skip("this tensordict has no _new_unsafe")
    if not shared:
        monkeypatch.setattr("replaybuf.storage.ringbatch.shared_attributes", lambda *args: None)
    with ReplayBuffer("cpu", "cpu", 10, storage="tensor", seed=0) as buf:
        buf.add_batch({"x": torch.arange(10.0), "y": torch.ones(10, 2)})
        got = [buf.sample_batch(size) for size in (4, 4, 3, 4)]
        fast = uniform_batch(buf._slots)
        assert isinstance(fast, UniformBatch)
        assert (fast.attributes is not None) == shared
        for batch in got:
            built = unsafe(dict(batch.items()), batch_size=batch.batch_size, device="cpu")
            skip = {"_tensordict"} if shared else {"_tensordict", "_has_mps_val"}
            assert {k: v for k, v in vars(batch).items() if k not in skip} == {
                k: v for k, v in vars(built).items() if k not in skip
            }
            assert batch.device == torch.device("cpu")
        assert [batch.batch_size for batch in got] == [torch.Size([n]) for n in (4, 4, 3, 4)]
        got[0]["z"] = torch.zeros(4)
        got[0].batch_size = torch.Size([])
        assert set(got[1].keys()) == set(got[3].keys()) == {"x", "y"}
        assert got[1].batch_size == got[3].batch_size == torch.Size([4])
        assert got[1]["x"].device == torch.device("cpu")
