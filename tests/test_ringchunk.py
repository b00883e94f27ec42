"""``ReplayBuffer.add_batch``'s fast chunk path (``replaybuf.storage.ringchunk``) against the
general path.

The general path is the reference: for any chunk, good or bad, a buffer taking the fast path
must store the same bytes, keep the same TorchRL bookkeeping and raise the same error (leaving
everything as it was) as a buffer whose every ``add_batch`` takes the general path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from test_ringrow import _outcome, same_state, state

from replaybuf import ReplayBuffer
from replaybuf.storage import chunk_writer
from replaybuf.storage.ringchunk import RingChunk
from replaybuf.storage.ringrow import declined

SPEC = {
    "obs": ((3,), torch.float32),
    "action": ((2,), torch.int64),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
    "value": ((), torch.float64),
}
VARIANTS = ["exact"] * 8 + [
    "numpy",
    "wrong dtype",
    "wrong shape",
    "wrong rows",
    "grad",
    "strided",
    "list",
    "meta",
]


def general_add_batch(buf: ReplayBuffer, batch) -> None:
    """``add_batch`` through the general path only (the reference)."""
    with buf._lock:
        buf._check_open()
        buf._add_batch(batch)


def column(rows: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:  # any byte: a nonzero one other than 1 is a True stored as 1
        raw = torch.randint(0, 4, (rows, *shape), generator=generator, dtype=torch.uint8)
        return raw.view(torch.bool)
    if dtype.is_floating_point:
        return torch.randn((rows, *shape), generator=generator, dtype=dtype)
    return torch.randint(-(10**6), 10**6, (rows, *shape), generator=generator, dtype=dtype)


def field_value(variant: str, rows: int, shape, dtype: torch.dtype, seed: int):
    value = column(rows, shape, dtype, seed)
    if variant == "numpy":
        return value.numpy()
    if variant == "wrong dtype":
        return value.to(torch.float16 if dtype is not torch.float16 else torch.float32)
    if variant == "wrong shape":
        return value.unsqueeze(-1)
    if variant == "wrong rows":
        return column(rows + 1, shape, dtype, seed)
    if variant == "grad":
        return value.requires_grad_() if dtype.is_floating_point else value
    if variant == "strided":  # a non-contiguous view of the right shape
        return torch.stack([value, value], dim=-1)[..., 0]
    if variant == "list":
        return value.tolist()
    if variant == "meta":
        return value.to("meta")
    return value


@st.composite
def chunks(draw, capacity: int):
    """A chunk: every field (each exact or not), maybe a key missing, an extra one or a nested
    dict, as a dict or a TensorDict, of 0 to ``capacity + 3`` rows."""
    rows = draw(st.integers(0, capacity + 3))
    seed = draw(st.integers(0, 2**16))
    exact = draw(st.booleans())  # half the chunks are exact matches throughout
    out = {}
    for i, (name, (shape, dtype)) in enumerate(SPEC.items()):
        variant = "exact" if exact else draw(st.sampled_from(VARIANTS))
        out[name] = field_value(variant, rows, shape, dtype, seed + i)
    change = draw(st.sampled_from(["none"] * 6 + ["missing", "extra", "renamed", "nested"]))
    if change == "missing":
        out.pop(draw(st.sampled_from(sorted(out))))
    elif change == "extra":
        out["extra"] = torch.zeros(rows)
    elif change == "renamed":
        out["other"] = out.pop(draw(st.sampled_from(sorted(out))))
    elif change == "nested":
        out["obs"] = {"inner": out["obs"]}
    if draw(st.booleans()):
        try:  # as a TensorDict where it can be one (tensors of one row count)
            batch = [rows] if draw(st.booleans()) else []
            return TensorDict(out, batch_size=batch)
        except Exception:
            return out
    return out


def pair(tmp_path, storage: str, capacity: int, prioritized: bool):
    bufs = []
    for _ in range(2):
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
        general_add_batch(buf, {k: column(1, s, d, 0) for k, (s, d) in SPEC.items()})
        bufs.append(buf)
    return bufs


@pytest.mark.parametrize(
    ("storage", "capacity", "prioritized"),
    [("tensor", 5, False), ("memmap", 7, False), ("tensor", 4, True), ("tensor", 16, False)],
)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fast_chunks_store_and_refuse_as_the_general_path(
    tmp_path, storage, capacity, prioritized, data
):
    fast, general = pair(tmp_path, storage, capacity, prioritized)
    try:
        assert isinstance(chunk_writer(fast._slots), RingChunk)
        for batch in data.draw(st.lists(chunks(capacity), min_size=1, max_size=8)):
            got = _outcome(ReplayBuffer.add_batch, fast, batch)
            want = _outcome(general_add_batch, general, batch)
            assert got == want
            same_state(state(fast), state(general))
            assert fast._slots.memory.storage._last_cursor == (
                general._slots.memory.storage._last_cursor
            )
        if prioritized:
            assert torch.equal(fast.sample_batch(8)["index"], general.sample_batch(8)["index"])
        else:
            batch, reference = fast.sample_all(), general.sample_all()
            for key in SPEC:
                assert batch[key].numpy().tobytes() == reference[key].numpy().tobytes()
    finally:
        fast.close()
        general.close()


def test_fast_chunks_are_taken_for_exact_tensors_and_decline_the_rest():
    with ReplayBuffer("cpu", "cpu", 8, storage="tensor", spec=SPEC) as buf:
        assert chunk_writer(buf._slots) is declined  # nothing allocated: the first is general
        exact = {k: column(3, s, d, 1) for k, (s, d) in SPEC.items()}
        buf.add_batch(exact)
        writer = chunk_writer(buf._slots)
        assert isinstance(writer, RingChunk)
        assert writer(exact) == 3
        assert writer(TensorDict(exact, batch_size=[3])) == 3
        assert writer({**exact, "obs": exact["obs"].double()}) == -1
        assert writer({**exact, "obs": exact["obs"].numpy()}) == -1  # the general path converts
        assert writer({k: v[:0] for k, v in exact.items()}) == -1  # no rows: general
        assert writer({k: torch.cat([v] * 3) for k, v in exact.items()}) == -1  # > capacity
        # TorchRL's counters moved; the ring's own are ReplayBuffer.add_batch's to advance
        assert buf.memory.writer.state_dict() == {"_cursor": 1, "_write_count": 9}


def test_a_wrapping_chunk_lands_where_rows_one_by_one_would(tmp_path):
    """Chunks that wrap the ring, and the index column TorchRL keeps, against single adds."""
    data = {k: column(23, s, d, 5) for k, (s, d) in SPEC.items()}
    chunked = ReplayBuffer("cpu", "cpu", 10, storage="memmap", scratch_dir=tmp_path, seed=0)
    single = ReplayBuffer("cpu", "cpu", 10, storage="tensor", seed=0)
    with chunked, single:
        for start, stop in [(0, 4), (4, 11), (11, 12), (12, 20), (20, 23)]:
            chunked.add_batch({k: v[start:stop] for k, v in data.items()})
        for i in range(23):
            single.add({k: v[i] for k, v in data.items()})
        same_state(state(chunked), state(single))
        assert chunked._slots._index_column.tolist() == list(range(10))
        for key in SPEC:
            assert torch.equal(chunked.sample_all()[key], data[key][13:])


def test_fast_chunks_are_chosen_again_after_reset_and_declined_for_bfloat16():
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as buf:
        buf.add_batch({"x": torch.zeros(2, 2)})
        first = chunk_writer(buf._slots)
        buf.reset()
        buf.add_batch({"x": torch.zeros(1, 3)})
        second = chunk_writer(buf._slots)
        assert isinstance(second, RingChunk)
        assert second is not first
        buf.add_batch({"x": torch.ones(2, 3)})
        assert buf.sample_all()["x"].tolist() == [[0.0] * 3, [1.0] * 3, [1.0] * 3]
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as buf:
        buf.add_batch({"x": torch.zeros(2, 2, dtype=torch.bfloat16)})
        assert chunk_writer(buf._slots) is declined  # numpy has no bfloat16 view
        buf.add_batch({"x": torch.ones(2, 2, dtype=torch.bfloat16)})
        assert buf.size == 4


def test_the_caller_may_reuse_a_chunk_once_add_batch_returns():
    with ReplayBuffer("cpu", "cpu", 8, storage="tensor") as buf:
        chunk = {"x": torch.ones(4, 2)}
        buf.add_batch(chunk)
        buf.add_batch(chunk)  # the fast path
        chunk["x"].fill_(7.0)
        assert buf.sample_all()["x"].eq(1.0).all()
