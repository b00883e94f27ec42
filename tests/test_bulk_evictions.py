"""Evictions taken straight off the finished heap (``make_room``'s fast path) and freed in
C-level passes: what the one-by-one reference (``core.batched = False``) does, for random
episode layouts, checkpoint pins included; and a refused eviction leaves everything as it was.
"""

from __future__ import annotations

import dataclasses
import heapq
from unittest import mock

import numpy as np
import pytest
import torch
from episode_helpers import action, batch_of, final_obs, obs, step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bulk_episodes import Driver, apply, ops, snapshot

from replaybuf import CapacityError, SyncEpisodeReplayBuffer
from replaybuf.accel.numba_loader import compiled_kernels, kernels_unavailable_reason
from replaybuf.episodes.episode import Episode
from replaybuf.episodes.eviction import make_room
from replaybuf.episodes.finished import FinishedOrder
from replaybuf.episodes.spares import Spares

KERNELS = compiled_kernels()


class PinningDriver(Driver):
    """A bulk driver that can also open and close a checkpoint's pin on the rows."""

    def pin(self) -> None:
        if not self.buf._core.pinned:
            self.buf._core.pin()

    def unpin(self) -> None:
        if self.buf._core.pinned:
            self.buf._core.unpin()


def full_snapshot(buf: SyncEpisodeReplayBuffer) -> dict:
    core = buf._core
    out = snapshot(buf)
    out["quarantine"] = list(core.quarantine)
    out["pinned"] = core.pinned
    out["counts"] = (core.steps, core.valid_steps, core.evicted, core.allocations)
    out["rows"] = {e: (list(ep.rows), ep.final_row, ep.end_kind) for e, ep in core.episodes.items()}
    out["running"] = sorted(core.running)
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_steps=st.integers(4, 30),
    max_episodes=st.one_of(st.none(), st.integers(2, 10)),
    program=ops,
    pin_at=st.lists(st.tuples(st.integers(0, 29), st.sampled_from(["pin", "unpin"])), max_size=4),
)
def test_fast_evictions_agree_with_one_by_one(max_steps, max_episodes, program, pin_at):
    bufs = [
        SyncEpisodeReplayBuffer(max_steps, max_episodes, storage="tensor", seed=0) for _ in range(2)
    ]
    bufs[1]._core.batched = False
    drivers = [PinningDriver(bufs[0], True), PinningDriver(bufs[1], True)]
    pinning = dict(pin_at)
    for at, (name, *args) in enumerate(program):
        if at in pinning:
            apply(drivers, pinning[at], ())
        outcomes = apply(drivers, name, tuple(args))
        assert outcomes[0] == outcomes[1]
        assert full_snapshot(bufs[0]) == full_snapshot(bufs[1])
    for buf in bufs:
        buf.close()


@pytest.mark.parametrize("envs", [1, 7, 40])
def test_vector_env_cycles_agree_with_one_by_one(envs):
    """A vector env's steady state: bulk starts, lockstep batches, bulk ends, evictions."""
    bufs = [SyncEpisodeReplayBuffer(6 * envs, 4 * envs, storage="tensor", seed=0) for _ in "ab"]
    bufs[1]._core.batched = False
    ids = [buf.start_episodes(envs) for buf in bufs]
    for cycle in range(12):
        length = 1 + cycle % 4
        for buf, own in zip(bufs, ids, strict=True):
            for t in range(length):
                buf.append_batch(own, *batch_of([step(e, t) for e in own]))
            buf.end_episodes(own, "truncated", torch.stack([final_obs(e, length) for e in own]))
        ids = [buf.start_episodes(envs) for buf in bufs]
        assert full_snapshot(bufs[0]) == full_snapshot(bufs[1])
    assert bufs[0].stats()["evicted_episodes"] > 0


@pytest.mark.parametrize("batched", [True, False])
def test_evicted_rows_are_handed_out_in_storage_order(batched):
    """The rows one eviction frees go out lowest first, so a vector env's batch after it gets
    runs of neighbouring rows rather than one row of each evicted episode in turn."""
    envs, length = 8, 4
    buf = SyncEpisodeReplayBuffer(envs * length * 3, 10 * envs, storage="tensor", seed=0)
    buf._core.batched = batched
    own = buf.start_episodes(envs)
    checked = 0
    for _ in range(6):
        for t in range(length):
            free = len(buf._core.free)
            evicted = buf.stats()["evicted_episodes"]
            buf.append_batch(own, *batch_of([step(e, t) for e in own]))
            rows = [buf._core.episodes[e].rows[-1] for e in own]
            if buf.stats()["evicted_episodes"] > evicted:
                # The eviction's rows went on top of the free stack and were popped first.
                fresh = rows[: len(buf._core.free) - free + envs]
                assert fresh == sorted(fresh)
                checked += len(fresh) > 1
        buf.end_episodes(own, "truncated", torch.stack([final_obs(e, length) for e in own]))
        own = buf.start_episodes(envs)
    assert checked > 0
    free = list(buf._core.free)
    assert free == sorted(free, reverse=True)  # popped from the end: lowest first


def test_refused_flush_puts_the_victims_heap_entries_back():
    """make_room takes its victims' entries off the finished heap; when the flush before
    freeing them raises, they go back and nothing is evicted."""
    buf = SyncEpisodeReplayBuffer(12, None, storage="tensor", seed=0)
    ids = buf.start_episodes(3)
    for t in range(3):
        buf.append_batch(ids, *batch_of([step(e, t) for e in ids]))
    buf.end_episodes(ids, "terminated", torch.stack([final_obs(e, 3) for e in ids]))
    core = buf._core  # ended after the last flush: an eviction flushes first
    before = (sorted(core.finished), dict(core.episodes), core.steps, list(core.free))
    with (
        mock.patch.object(core, "flush", side_effect=RuntimeError("disk")),
        pytest.raises(RuntimeError, match="disk"),
    ):
        make_room(core, 9, 0, 0, set())
    assert (sorted(core.finished), dict(core.episodes), core.steps, list(core.free)) == before
    make_room(core, 9, 0, 0, set())  # and now it evicts the two oldest
    assert sorted(core.episodes) == [ids[2]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.tuples(st.just("push"), st.integers(0, 60)), st.just(("pop", 0))),
        max_size=80,
    )
)
def test_finished_order_pops_as_a_heap_does(program):
    """FIFO for in-order pushes, heap for the rest: the same pops as one heap."""
    order, heap, seen = FinishedOrder(), [], set()
    for op, seq in program:
        if op == "push":
            if seq in seen:
                continue  # entries are unique (one per episode)
            seen.add(seq)
            order.push((seq, seq + 100))
            heapq.heappush(heap, (seq, seq + 100))
        elif heap:
            assert order.pop() == heapq.heappop(heap)
        else:
            assert not order
            with pytest.raises(IndexError):
                order.pop()
        assert len(order) == len(heap)
        assert sorted(order) == sorted(heap)
    for entries in ([(1000, 1), (999, 2), (1001, 3)], [(1002, 4), (1003, 5)], [(998, 6)]):
        order.extend(entries)  # out of order, in order after the last, before the last
        for entry in entries:
            heapq.heappush(heap, entry)
    while heap:
        assert order.pop() == heapq.heappop(heap)
    assert not order


def _vector_env_cycle(buf: SyncEpisodeReplayBuffer, own: list[int], length: int) -> list[int]:
    """``length`` lockstep steps of ``own``, their bulk end, and the next episodes' bulk start."""
    for t in range(length):
        buf.append_batch(own, *batch_of([step(e, t) for e in own]))
    buf.end_episodes(own, "truncated", torch.stack([final_obs(e, length) for e in own]))
    return buf.start_episodes(len(own))


def test_a_vector_env_reuses_evicted_records_and_reads_its_episodes_back():
    """Once evictions keep pace with starts, bulk starts make no new episode records (the
    garbage collector gets nothing new to track), and every episode still reads back as
    written."""
    envs, length = 12, 5
    buf = SyncEpisodeReplayBuffer(envs * length * 2, None, storage="tensor", seed=0)
    own = buf.start_episodes(envs)
    for _ in range(4):  # until the buffer is full and evicts every cycle
        own = _vector_env_cycle(buf, own, length)
    with mock.patch("replaybuf.episodes.spares.Episode", wraps=Episode) as made:
        for _ in range(6):
            ended = own
            own = _vector_env_cycle(buf, own, length)
            for e in own:  # every field as a new record's, the id, agent and order its own
                record = buf._core.episodes[e]
                new = Episode(e, "default", record.seq)
                for field in dataclasses.fields(Episode):
                    assert getattr(record, field.name) == getattr(new, field.name), field.name
            assert [buf._core.episodes[e].seq for e in own] == list(
                range(buf._core.next_seq - envs, buf._core.next_seq)
            )
        ended = own
        for t in range(length):  # and reused records take the agent they are started for
            buf.append_batch(own, *batch_of([step(e, t) for e in own]))
        buf.end_episodes(own, "truncated", torch.stack([final_obs(e, length) for e in own]))
        others = buf.start_episodes(envs, agent_id="other")
        assert {buf._core.episodes[e].agent_id for e in others} == {"other"}
    assert made.call_count == 0
    assert buf.stats()["evicted_episodes"] >= 8 * envs
    for e in ended:
        episode = buf.get_episode(e)
        written = [*(obs(e, t) for t in range(length)), final_obs(e, length)]
        assert episode["observation"].tolist() == [o.tolist() for o in written]
        assert episode["action"].tolist() == [action(e, t).item() for t in range(length)]
    assert [buf._core.episodes[e].steps for e in others] == [0] * envs
    buf.close()


def test_an_evicted_record_held_elsewhere_is_never_reused():
    """A record something else still references (a snapshot, a caller) is left as it was
    when evicted, not emptied and handed to a new episode."""
    envs, length = 6, 3
    buf = SyncEpisodeReplayBuffer(envs * length * 2, None, storage="tensor", seed=0)
    own = buf.start_episodes(envs)
    own = _vector_env_cycle(buf, own, length)
    held = buf._core.episodes[own[0] - envs]  # an episode of the first cycle, finished
    before = (held.episode_id, list(held.own), held.final_row, held.end_kind)
    for _ in range(5):
        own = _vector_env_cycle(buf, own, length)
    assert held.episode_id not in buf._core.episodes  # evicted ...
    assert (held.episode_id, list(held.own), held.final_row, held.end_kind) == before
    records = [*buf._core.episodes.values(), *buf._core.spares.records]
    assert all(record is not held for record in records)  # ... and never handed out again
    buf.close()


def test_spares_hand_out_no_record_for_no_episodes():
    spares = Spares()
    spares.records = [Episode(1, "a", 1)]
    assert spares.episodes(range(5, 5), "b", 9) == []
    assert [record.episode_id for record in spares.records] == [1]


@pytest.mark.skipif(KERNELS is None, reason=f"{kernels_unavailable_reason()}")
@settings(max_examples=150, deadline=None)
@given(data=st.data(), backward=st.booleans())
def test_evict_rows_agrees_with_the_general_eviction(data, backward):
    size = data.draw(st.integers(4, 60))
    perm = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(size)
    anchors = perm[: data.draw(st.integers(0, size))]
    held = data.draw(st.integers(1, size))
    victims = np.random.default_rng(int(perm[0])).permutation(size)[:held]
    finals_count = data.draw(st.integers(0, held - 1))
    stepped, finals = (
        victims[finals_count:].astype(np.int64),
        victims[:finals_count].astype(np.int64),
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stepped)), max_size=5)))
    ends = np.array([*cuts, len(stepped)], np.int64)

    def columns() -> list[np.ndarray]:
        rng = np.random.default_rng(size)
        rows, pos = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
        rows[: len(anchors)] = anchors
        pos[anchors] = np.arange(len(anchors))
        links = [rng.integers(-1, size, size), rng.integers(0, size, size)]
        links += [rng.integers(-1, 9, size), rng.integers(0, 3, size).astype(np.int8)]
        prev = rng.integers(-1, size, size) if backward else np.empty(0, np.int64)
        return [rows, pos, *links, prev]

    fused = columns()
    freed = np.empty(held, np.int64)
    count = KERNELS.evict_rows(stepped, ends, finals, *fused[:2], len(anchors), *fused[2:], freed)
    general = columns()
    want = KERNELS.remove_anchor_groups(stepped, ends, *general[:2], len(anchors))
    KERNELS.release_rows(np.concatenate((stepped, finals)), *general[2:])
    assert count == want
    assert [c.tolist() for c in fused] == [c.tolist() for c in general]
    assert freed.tolist() == np.concatenate((stepped, finals)).tolist()


def test_a_refusal_names_many_protected_episodes_briefly():
    """A vector env's thousand episodes in one refusal: the first few ids, the last, the count."""
    buf = SyncEpisodeReplayBuffer(1500, 2000, storage="tensor", seed=0)
    ids = buf.start_episodes(1000)
    buf.append_batch(ids, *batch_of([step(e, 0) for e in ids]))
    with pytest.raises(CapacityError, match="max_steps") as refused:
        buf.append_batch(ids, *batch_of([step(e, 1) for e in ids]))
    message = str(refused.value)
    assert "[0, 1, 2, 3, 4, 5, 6, ..., 999] (1000 in all) being written" in message
    assert len(message) < 400
    assert buf.stats()["steps"] == 1000  # the refusal changed nothing
    assert len(buf) == 0  # (a first step each: none has a next observation yet)
    buf.close()


def test_a_refusal_names_a_few_protected_episodes_in_full():
    buf = SyncEpisodeReplayBuffer(4, 10, storage="tensor", seed=0)
    ids = buf.start_episodes(3)
    buf.append_batch(ids, *batch_of([step(e, 0) for e in ids]))
    with pytest.raises(CapacityError, match=r"episode\(s\) \[0, 1, 2\] being written"):
        buf.append_batch(ids, *batch_of([step(e, 1) for e in ids]))
    buf.close()
