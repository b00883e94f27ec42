"""A vector env's batches written straight into storage (``SlotStorage.write_batch``, by
address): what the stager leaves, for random episode layouts and inputs of every kind.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from episode_helpers import batch_of, step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bulk_episodes import Driver, apply, op
from test_bulk_evictions import full_snapshot

from replaybuf import SyncEpisodeReplayBuffer
from replaybuf.accel.numba_loader import compiled_kernels, kernels_unavailable_reason
from replaybuf.storage.addresses import layout

KERNELS = compiled_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"{kernels_unavailable_reason()}")
FORMS = ["tensor", "numpy", "strided", "negative", "offset"]
batch = st.tuples(st.just("batch"), st.lists(st.integers(0, 20), min_size=1, max_size=5))
# test_bulk_episodes' programs, from four episodes started, with batches (what goes straight)
# three times as likely
programs = st.lists(st.one_of(batch, batch, batch, op), min_size=4, max_size=30).map(
    lambda program: [("start", 4), *program]
)


def reshape(value: torch.Tensor, form: str) -> object:
    """``value`` (a contiguous ``[n, ...]`` tensor) with the same values in another form."""
    if form == "numpy":
        return value.numpy()
    if form == "strided":  # every other element of a wider tensor: not contiguous
        wide = torch.stack([value, torch.zeros_like(value)], dim=-1)
        return wide[..., 0]
    if form == "negative" and value.dtype is not torch.bool:
        return torch._neg_view(-value)  # the negative bit set: the bytes hold -value
    if form == "offset":  # contiguous, one element into a larger tensor (4-byte aligned)
        flat = torch.cat([torch.zeros(1, dtype=value.dtype), value.reshape(-1)])
        return flat[1:].view(value.shape)
    return value


class FormDriver(Driver):
    """A bulk driver whose batches come in the forms it is given, one per batch in turn."""

    def __init__(self, buf: SyncEpisodeReplayBuffer, forms: list[str]) -> None:
        super().__init__(buf, True)
        self.forms, self.at = forms, 0

    def batch(self, picks: list[int]) -> None:
        running = self.running()
        ids = sorted({running[p % len(running)] for p in picks}) if running else []
        if not ids:
            return
        form = self.forms[self.at % len(self.forms)]
        self.at += 1
        obs, action, reward, extras = batch_of(
            [step(e, self.buf._core.episodes[e].steps) for e in ids]
        )
        self.buf.append_batch(
            ids,
            reshape(obs, form),
            reshape(action, form),
            reshape(reward, form),
            {k: reshape(v, form) for k, v in extras.items()},
        )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_steps=st.integers(4, 24),
    max_episodes=st.one_of(st.none(), st.integers(2, 8)),
    program=programs,
    forms=st.lists(st.sampled_from(FORMS), min_size=1, max_size=4),
    small_stager=st.booleans(),
)
def test_batches_written_straight_agree_with_the_stager(
    max_steps, max_episodes, program, forms, small_stager
):
    rows = 6 if small_stager else 512  # 6: flushes every batch or two
    with mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=rows, _FLUSH_BYTES=0):
        bufs = [
            SyncEpisodeReplayBuffer(max_steps, max_episodes, storage="tensor", seed=0)
            for _ in range(2)
        ]
    drivers = [FormDriver(bufs[0], forms), FormDriver(bufs[1], forms)]
    # The second buffer writes every batch through the stager: the general path.
    with mock.patch.object(bufs[1]._core.slots, "write_batch", return_value=False):
        for name, *args in program:
            outcomes = apply(drivers, name, tuple(args))
            assert outcomes[0] == outcomes[1]
            assert full_snapshot(bufs[0]) == full_snapshot(bufs[1])
    for buf in bufs:
        buf.close()


def started(storage: str = "tensor", tmp_path=None) -> tuple[SyncEpisodeReplayBuffer, list[int]]:
    kwargs = {"scratch_dir": tmp_path} if tmp_path is not None else {}
    buf = SyncEpisodeReplayBuffer(200, 20, storage=storage, seed=0, **kwargs)
    ids = buf.start_episodes(4)
    buf.append_batch(ids, *batch_of([step(e, 0) for e in ids]))
    buf._core.flush()  # the first write allocates the storage
    return buf, ids


@needs_kernels
@pytest.mark.parametrize(
    ("form", "straight"),
    [("tensor", True), ("numpy", True), ("offset", True), ("strided", False), ("negative", False)],
)
def test_which_batches_go_straight(form, straight):
    buf, ids = started()
    stager = buf._core._stager
    obs, action, reward, extras = batch_of([step(e, 1) for e in ids])
    before = (len(stager.rows), stager.direct)
    values = [reshape(v, form) for v in (obs, action, reward)]
    buf.append_batch(ids, *values, {k: reshape(v, form) for k, v in extras.items()})
    staged, direct = len(stager.rows) - before[0], stager.direct - before[1]
    assert (staged, direct) == ((0, 4) if straight else (4, 0))
    record = buf.get_episode(ids[2])
    assert record["observation"][1].tolist() == obs[2].tolist()
    assert record["action"][1].item() == action[2].item()
    assert record["reward"][1].item() == pytest.approx(reward[2].item())
    assert record["flag"][1].tolist() == extras["flag"][2].tolist()
    assert stager.direct == 0  # get_episode flushed: the rows' bookkeeping is placed
    buf.close()


def test_no_straight_writes_without_the_kernels(monkeypatch):
    monkeypatch.setenv("REPLAYBUF_NUMBA", "0")  # read when the buffer is built
    buf, ids = started()
    buf.append_batch(ids, *batch_of([step(e, 1) for e in ids]))
    assert buf._core._stager.direct == 0
    assert len(buf._core._stager.rows) == 4
    assert buf.get_episode(ids[0])["observation"][1].tolist() == [ids[0], 1, 0]
    buf.close()


@needs_kernels
def test_memmap_batches_go_straight_once_the_files_are_reserved(tmp_path):
    buf, ids = started("memmap", tmp_path)
    slots = buf._core.slots
    stager = buf._core._stager
    for t in range(1, 40):
        if t == 10:
            buf.end_episodes(ids, "truncated", torch.zeros(4, 3))
            ids = buf.start_episodes(4)
        reserved = slots._reserved >= slots.capacity
        direct = stager.direct
        buf.append_batch(ids, *batch_of([step(e, t % 10) for e in ids]))
        assert (stager.direct > direct) == reserved  # only once no write needs the disk
    buf.close()


@needs_kernels
def test_a_straight_write_counts_toward_the_flush_as_staged_rows_do():
    """Flushes come at the same calls either way (they order the anchors, so seeded draws)."""
    firsts = []
    for straight in (True, False):
        with mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=30, _FLUSH_BYTES=0):
            buf, ids = started()
        general = mock.patch.object(buf._core.slots, "write_batch", return_value=False)
        with contextlib.nullcontext() if straight else general:
            flushes, calls = buf._core.flushes, 0
            while buf._core.flushes == flushes:
                buf.append_batch(ids, *batch_of([step(e, 1 + calls) for e in ids]))
                calls += 1
        assert (buf._core._stager.direct > 0) == straight
        firsts.append(calls)
        capacity = buf._core._stager.capacity
        buf.close()
    assert firsts[0] == firsts[1]
    assert 4 * firsts[0] > capacity >= 4 * (firsts[0] - 1)


@needs_kernels
@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.int16, np.bool_]),
    shape=st.sampled_from([(), (1,), (3,), (2, 5), (8,)]),
    capacity=st.integers(1, 40),
    data=st.data(),
)
def test_scatter_from_agrees_with_numpy(dtype, shape, capacity, data):
    rows = np.array(
        data.draw(
            st.lists(st.integers(0, capacity - 1), min_size=1, max_size=capacity, unique=True)
        ),
        np.int64,
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    column = rng.integers(0, 200, (capacity, *shape)).astype(dtype)
    raw = rng.integers(0, 4, (len(rows), *shape)).astype(np.uint8)
    # bool sources as raw bytes (any nonzero byte is True), stored as 0 or 1
    values = raw.view(np.bool_) if dtype == np.bool_ else raw.astype(dtype)
    want = column.copy()
    want[rows] = raw.astype(bool) if dtype == np.bool_ else values
    sources = np.array([values.__array_interface__["data"][0]], np.int64)
    KERNELS.scatter_from(layout([column]), sources, rows, capacity)
    assert column.view(np.uint8).tolist() == want.view(np.uint8).tolist()


@needs_kernels
def test_scatter_from_refuses_a_row_out_of_range_before_writing():
    column = np.zeros((4, 2), np.float32)
    values = np.ones((2, 2), np.float32)
    sources = np.array([values.__array_interface__["data"][0]], np.int64)
    with pytest.raises(IndexError, match="slot out of range"):
        KERNELS.scatter_from(layout([column]), sources, np.array([1, 4], np.int64), 4)
    assert not column.any()
