"""Row bookkeeping (links, owners, steps, allocations, anchors, free rows) agrees with the
episode table after any mix of appends, batches, ends and evictions, whether it is read where
the writes land (CPU storage) or through device copies updated when read (the path CUDA
storage takes; mirrored on the CPU here)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
import pytest
import torch
from episode_helpers import mirrored
from hypothesis import example, given, settings
from hypothesis import strategies as st

from replaybuf import EpisodeStateError, SyncEpisodeReplayBuffer
from replaybuf.accel.numba_loader import NUMBA_ENV, kernels_unavailable_reason
from replaybuf.core.index import END_NONE, full_sequence_starts
from replaybuf.episodes.core import EpisodeCore
from replaybuf.episodes.links import RowLinks
from replaybuf.episodes.staging import apply_staged

NO_KERNELS = kernels_unavailable_reason()
COLUMNS = ("next_row", "succ", "episode", "step", "end_kind", "alloc", "prev_row")


def assert_bookkeeping(core: EpisodeCore) -> None:
    """Every column, the anchor set and the free list, rebuilt the slow obvious way from the
    episode table."""
    core.flush()
    capacity = core.slots.capacity
    want = {
        "next_row": [-1] * capacity,
        "episode": [-1] * capacity,
        "end_kind": [END_NONE] * capacity,
        "prev_row": [-1] * capacity,
    }
    anchors, used = set(), []
    for episode in core.episodes.values():
        rows = [*episode.rows] + ([episode.final_row] if episode.final_row is not None else [])
        used += rows
        for i, row in enumerate(rows):
            want["episode"][row] = episode.episode_id
            assert int(core.links.step[row]) == i, "step"
            if i + 1 < len(rows):
                want["next_row"][row] = rows[i + 1]
                want["prev_row"][rows[i + 1]] = row
                anchors.add(row)
        if episode.final_row is not None:
            want["end_kind"][episode.final_row] = episode.end_kind
    links = core.links
    for name, values in want.items():
        column = getattr(links, name)
        if column is not None:
            assert column.tolist() == values, name
    succ = [n if n >= 0 else r for r, n in enumerate(want["next_row"])]
    assert links.succ.tolist() == succ
    assert len(set(used)) == len(used), "a row held twice"
    assert sorted(used + list(core.free) + core.quarantine) == list(range(capacity))
    allocations = links.alloc[torch.tensor(used, dtype=torch.long)].tolist() if used else []
    assert len(set(allocations)) == len(allocations)
    assert all(0 <= a < core.allocations for a in allocations)
    assert sorted(core.anchors.snapshot().tolist()) == sorted(anchors)
    assert core.valid_steps == len(anchors)
    assert core.steps == sum(e.steps for e in core.episodes.values())
    assert set(core.running) == {i for i, e in core.episodes.items() if e.in_progress}


ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "one", "batch", "end", "flush"]),
        st.integers(0, 7),
        st.integers(1, 5),
    ),
    min_size=1,
    max_size=60,
)


def run(
    ops_: list[tuple[str, int, int]],
    frame_stack: int | None,
    storing: str = "cpu",
    max_steps: int = 12,
    batched: bool = True,
    prioritized: bool = False,
) -> EpisodeCore:
    """The ops on a small buffer (evicting) stored on ``storing``, checking the bookkeeping
    after each flush; ``batched`` False: the core's one-by-one reference paths."""
    buf = SyncEpisodeReplayBuffer(
        max_steps,
        5,
        storing_device=storing,
        storage="tensor",
        seed=0,
        frame_stack=frame_stack,
        prioritized=prioritized,
    )
    buf._core.batched = batched
    running: list[int] = []
    table = buf._core.episodes
    for step, (op, pick, width) in enumerate(ops_):
        running = [i for i in running if i in table and table[i].in_progress]  # evictions
        before = (buf._core.steps, buf._core.valid_steps, len(table), len(buf._core.free))
        obs = np.full(3, step, dtype=np.float32)
        refused = None
        try:
            if op == "start" or not running:
                running.append(buf.start_episode())
            elif op == "one":
                buf.append_observation_action_reward(running[pick % len(running)], obs, 0, 1.0)
            elif op == "batch":
                ids = running[: min(width, len(running))]
                many, n = np.stack([obs] * len(ids)), len(ids)
                buf.append_batch(ids, many, np.zeros(n, np.int64), np.ones(n, np.float32))
            elif op == "end":
                episode = running.pop(pick % len(running))
                buf.end_episode(episode, "truncated" if pick % 2 else "terminated", obs)
            else:
                assert_bookkeeping(buf._core)
        except ValueError as exc:  # more steps than fit (max_steps)
            refused = str(exc)
        if refused is not None:  # refused, and nothing changed
            assert "cannot make room" in refused
            after = (buf._core.steps, buf._core.valid_steps, len(table), len(buf._core.free))
            assert after == before
    assert_bookkeeping(buf._core)
    return buf._core


@pytest.mark.parametrize("frame_stack", [None, 2])
@settings(max_examples=60, deadline=None)
@given(ops_=ops, settle=st.sampled_from([1, 2, 256]))
def test_direct_and_mirrored_reads_see_the_same_consistent_bookkeeping(ops_, frame_stack, settle):
    # settle: how many repeated batches a run holds before their rows go to their episodes.
    with (
        mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=3, _FLUSH_BYTES=0),
        mock.patch("replaybuf.episodes.batch_run._SETTLE_BATCHES", settle),
    ):
        host = run(ops_, frame_stack)
        with mirrored():
            slow = run(ops_, frame_stack)
    assert host.links._mirror is None
    assert host.anchors._mirror is None
    assert slow.links._mirror is not None
    assert slow.anchors._mirror is not None
    assert_same_bookkeeping(host, slow)


@settings(max_examples=80, deadline=None)
@given(ops_=ops, flush_rows=st.sampled_from([3, 64]))
# A finished episode evicted while the stager holds other episodes' rows, no flush between.
@example(
    ops_=[("start", 0, 1), ("one", 0, 1), ("one", 0, 1), ("end", 0, 1), ("flush", 0, 1)]
    + [("start", 0, 1)]
    + [("one", 0, 1)] * 12,
    flush_rows=64,
)
def test_evicting_without_a_flush_stores_what_flushing_first_stores(ops_, flush_rows):
    """An eviction flushes only when a victim may hold staged rows (in progress, or ended
    since the last flush). With a flush before every eviction instead: the same columns,
    free list, anchor set (not its order: a removal refills holes from the set's tail) and
    stored observations in every row in use."""
    cores = []
    for always in (False, True):
        flushed = (
            mock.patch("replaybuf.episodes.eviction.flushed", return_value=False)
            if always
            else contextlib.nullcontext()
        )
        with (
            mock.patch.multiple(
                "replaybuf.episodes.staging", _FLUSH_ROWS=flush_rows, _FLUSH_BYTES=0
            ),
            flushed,
        ):
            cores.append(run(ops_, None))
    skip, always = cores
    for name in COLUMNS:
        a, b = getattr(skip.links, name), getattr(always.links, name)
        assert (a is None and b is None) or a.tolist() == b.tolist(), name
    assert list(skip.free) == list(always.free)
    assert sorted(skip.anchors.snapshot().tolist()) == sorted(always.anchors.snapshot().tolist())
    used = torch.tensor(
        [r for e in skip.episodes.values() for r in [*e.rows, e.final_row] if r is not None],
        dtype=torch.long,
    )
    if len(used) and skip.slots.spec is not None:
        key = ("observation",)
        assert torch.equal(skip.slots.column(key)[used], always.slots.column(key)[used])


def test_an_eviction_flushes_only_for_rows_still_staged():
    """A vector env's steady state: the oldest episode ended before the last flush, so
    evicting it needs no flush (its rows are written and placed), and the stager keeps the
    rows staged since. A victim that ended after the last flush is flushed first."""
    buf = SyncEpisodeReplayBuffer(8, 8, storage="tensor", seed=0)
    core = buf._core

    def steps(episode: int, first: float, count: int) -> None:
        for t in range(count):
            buf.append_observation_action_reward(episode, np.full(3, first + t, np.float32), 0, 1.0)

    old = buf.start_episode()
    steps(old, 0.0, 3)
    buf.end_episode(old, "truncated", np.full(3, 3.0, np.float32))
    buf.get_episode(old)  # a read: flushes, so every row of ``old`` is in storage
    new = buf.start_episode()
    steps(new, 10.0, 5)  # 8 steps stored: the next one evicts ``old``
    staged = len(core._stager)
    with mock.patch.object(core, "flush", wraps=core.flush) as flush:
        steps(new, 15.0, 1)
    assert flush.call_count == 0
    assert old not in core.episodes
    assert len(core._stager) == staged + 1
    assert buf.get_episode(new)["observation"][:, 0].tolist() == [10.0 + t for t in range(6)]
    assert_bookkeeping(core)
    # Ended after the last flush (the read above): its rows may still be staged.
    buf.end_episode(new, "terminated", np.full(3, 16.0, np.float32))
    last = buf.start_episode()
    steps(last, 20.0, 2)
    with mock.patch.object(core, "flush", wraps=core.flush) as flush:
        steps(last, 22.0, 1)  # 3 steps more than the 6 + 2 held: evicts ``new``
    assert flush.call_count == 1
    assert new not in core.episodes
    assert buf.get_episode(last)["observation"][:, 0].tolist() == [20.0, 21.0, 22.0]
    assert_bookkeeping(core)


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@pytest.mark.parametrize("frame_stack", [None, 2])
@settings(max_examples=60, deadline=None)
@given(ops_=ops, flush_rows=st.sampled_from([3, 64]))
def test_compiled_and_numpy_bookkeeping_writes_agree(ops_, frame_stack, flush_rows):
    """The compiled place/connect/release and anchor removal (replaybuf.accel.numba_kernels) leave
    every
    column, the anchor order and the free list as the numpy paths do."""
    cores = []
    for flag in ("1", "0"):
        with (
            mock.patch.dict(os.environ, {NUMBA_ENV: flag}),  # read when the core is built
            mock.patch.multiple(
                "replaybuf.episodes.staging", _FLUSH_ROWS=flush_rows, _FLUSH_BYTES=0
            ),
        ):
            cores.append(run(ops_, frame_stack))
    compiled, numpy = cores
    assert compiled.links._kernels is not None
    assert compiled.anchors._kernels is not None
    assert numpy.links._kernels is None
    assert numpy.anchors._kernels is None
    assert_same_bookkeeping(compiled, numpy)


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@pytest.mark.parametrize(("frame_stack", "prioritized"), [(None, False), (2, False), (None, True)])
@settings(max_examples=60, deadline=None)
@given(ops_=ops)
def test_per_step_flushes_in_one_call_agree_with_the_packed_path(ops_, frame_stack, prioritized):
    """A flush of per-step appends and final rows alone places and links them in one compiled
    call (RowLinks.place_steps); the one-by-one reference packs them into columns first (the
    general path): every column, the anchor order, the free list and the priorities agree."""
    fast = run(ops_, frame_stack, prioritized=prioritized)
    packed = run(ops_, frame_stack, batched=False, prioritized=prioritized)
    assert_same_bookkeeping(fast, packed)
    if prioritized:
        assert fast.priorities is not None
        assert packed.priorities is not None
        assert torch.equal(fast.priorities.tree.weights(), packed.priorities.tree.weights())


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_a_read_after_each_append_flushes_through_place_steps():
    """SB3's train_freq=1: an append, then a sample, each step. Each flush places its row in
    one call, and the buffer reads what was appended."""
    buf = SyncEpisodeReplayBuffer(64, storage="tensor", seed=0, frame_stack=2)
    episode = buf.start_episode()
    for t in range(2):  # the first write allocates the storage: its flush packs
        buf.append_observation_action_reward(episode, torch.full((3,), float(t)), t, 1.0)
    buf.sample_n_step(4)
    with buf, mock.patch.object(RowLinks, "place_steps", wraps=buf._core.links.place_steps):
        place_steps = buf._core.links.place_steps
        for t in range(2, 6):
            buf.append_observation_action_reward(episode, torch.full((3,), float(t)), t, 1.0)
            buf.sample_n_step(4)
        assert place_steps.call_count == 4
        assert_bookkeeping(buf._core)
        newest = buf.get_episode(episode)["observation"][:, -1, 0]  # each stack's own frame
        assert newest.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_flush_with_nothing_staged_applies_nothing_and_still_counts():
    """Each kind of staged state (a per-step row, a final row, a batch run's rows) makes a
    flush apply it; a flush right after, with nothing staged, applies nothing. Both count, so
    that an episode ended before either reads as flushed after it."""
    buf = SyncEpisodeReplayBuffer(64, 16, storage="tensor", seed=0)
    core = buf._core
    one = buf.start_episode()
    pair = [buf.start_episode(), buf.start_episode()]
    obs = np.zeros(3, np.float32)
    stagings = [
        lambda: buf.append_observation_action_reward(one, obs, 0, 1.0),  # a per-step row
        lambda: buf.append_batch(pair, np.zeros((2, 3), np.float32), [0, 0], [1.0, 1.0]),
        lambda: buf.append_batch(pair, np.ones((2, 3), np.float32), [0, 0], [1.0, 1.0]),
        lambda: buf.end_episode(one, "terminated", obs),  # a final row
    ]
    for stage in stagings:
        stage()
        before = core.flushes
        with mock.patch("replaybuf.episodes.core.apply_staged", wraps=apply_staged) as applied:
            core.flush()
            assert applied.call_count == 1
            assert core.flushes == before + 1
            core.flush()  # nothing staged now
            assert applied.call_count == 1
            assert core.flushes == before + 2
        assert len(core._stager) == 0
        assert not core._staged_meta
        assert not core._packed.rows
        assert_bookkeeping(core)
    assert core.episodes[one].end_flush < core.flushes  # ended, then flushed: no flush to evict
    assert buf.get_episode(pair[0])["observation"][:, 0].tolist() == [0.0, 1.0]


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_the_bookkeeping_kernels_refuse_bad_rows_and_lengths_and_write_nothing():
    from replaybuf.accel import numba_kernels as kernels

    def columns() -> list[np.ndarray]:  # next_row, succ, episode, end_kind, step, alloc, prev
        long = [np.full(4, -1, np.int64) for _ in range(6)]
        return [*long[:3], np.zeros(4, np.int8), *long[3:]]

    def ints(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    for bad in (4, -1):
        cols = columns()
        with pytest.raises(IndexError, match="row out of range"):
            kernels.place_rows(ints(0, bad), ints(7, 7), ints(0, 1), ints(0, 0), ints(3, 4), *cols)
        with pytest.raises(IndexError, match="row out of range"):
            kernels.connect_rows(ints(0, 1), ints(2, bad), cols[0], cols[1], cols[6])
        with pytest.raises(IndexError, match="row out of range"):
            kernels.release_rows(ints(1, bad), *cols[:4], cols[6])
        with pytest.raises(IndexError, match="row out of range"):  # a placed row, a link's
            kernels.place_steps(ints(0, 7, 0, 0, 3, bad, 7, 1, 0, 4), ints(0, 1), *cols)
        with pytest.raises(IndexError, match="row out of range"):
            kernels.place_steps(ints(0, 7, 0, 0, 3), ints(0, bad), *cols)
        rows, pos = ints(0, 1, -1, -1), ints(0, 1, -1, -1)
        with pytest.raises(IndexError, match="row out of range"):
            kernels.remove_anchors(ints(0, bad), rows, pos, 2)
        assert all((c == f).all() for c, f in zip(cols, columns(), strict=True))
        assert rows.tolist() == pos.tolist() == [0, 1, -1, -1]
    cols = columns()
    with pytest.raises(ValueError, match="differ in length"):
        kernels.place_rows(ints(0, 1), ints(7), ints(0, 1), ints(0, 0), ints(3, 4), *cols)
    with pytest.raises(ValueError, match="differ in length"):
        kernels.connect_rows(ints(0, 1), ints(2), cols[0], cols[1], cols[6])
    with pytest.raises(ValueError, match="count or columns"):
        kernels.remove_anchors(ints(0), ints(0, 1, -1, -1), ints(0, 1, -1, -1), 5)
    for meta, pairs in [(ints(0, 7, 0, 0), ints()), (ints(0, 7, 0, 0, 3), ints(0))]:
        with pytest.raises(ValueError, match="wrong length"):
            kernels.place_steps(meta, pairs, *cols)
    # A batch run's batches: two episodes (ids 7, 8), two batches, linked from rows 0 and 1.
    batch = (ints(7, 8), ints(1, 1), 5, ints(0, 1))
    for rows, sources, bad in [
        (ints(2, 3, 1), ints(0, 0, 0), "not whole batches"),
        (ints(2, 3), ints(0, 0, 0), "sources differ"),
        (ints(2, 4), ints(0, 0), "row out of range"),
    ]:
        with pytest.raises((ValueError, IndexError), match=bad):
            kernels.place_batches(rows, *batch, sources, *cols)
    with pytest.raises(ValueError, match="steps or tail"):
        kernels.place_batches(ints(2, 3), ints(7, 8), ints(1), 5, ints(0, 1), ints(0, 0), *cols)
    with pytest.raises(IndexError, match="row out of range"):
        kernels.place_batches(ints(2, 3), ints(7, 8), ints(1, 1), 5, ints(0, 9), ints(0, 0), *cols)
    assert all((c == f).all() for c, f in zip(cols, columns(), strict=True))
    cols[6][2] = 0  # a stale predecessor: placing row 2 clears it
    kernels.place_rows(ints(2), ints(7), ints(0), ints(0), ints(1), *cols)
    assert cols[6][2] == -1
    sources = ints(-5, -5)
    kernels.place_batches(ints(2, 3), *batch, sources, *cols)  # and what it writes
    next_row, succ, episode, end_kind, step, alloc, prev = cols
    assert end_kind.tolist() == [0, 0, 0, 0]
    assert sources.tolist() == [0, 1]
    assert next_row.tolist() == [2, 3, -1, -1]
    assert succ.tolist() == [2, 3, 2, 3]
    assert episode.tolist()[2:] == [7, 8]
    assert step.tolist()[2:] == [1, 1]
    assert alloc.tolist()[2:] == [5, 6]
    assert prev.tolist() == [-1, -1, 0, 1]


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_the_bookkeeping_kernels_refuse_columns_of_other_lengths():
    """Unchecked writes index every column by rows checked against ``next_row``'s length:
    a column of another length is refused before anything is written."""
    from replaybuf.accel import numba_kernels as kernels

    ints = np.array([0, 1], dtype=np.int64)
    for short in range(1, 7):  # succ, episode, end_kind, step, alloc, prev_row (next_row's
        # length is the size the others are checked against)
        cols = [np.full(4, -1, np.int64) for _ in range(7)]
        cols[3] = np.zeros(4, np.int8)
        cols[short] = cols[short][:3]
        with pytest.raises(ValueError, match="columns differ in length"):
            kernels.place_rows(ints, ints, ints, ints * 0, ints, *cols)
        with pytest.raises(ValueError, match="columns differ in length"):
            kernels.place_batches(ints, ints, ints, 0, ints, ints.copy(), *cols)
        with pytest.raises(ValueError, match="columns differ in length"):
            kernels.place_steps(np.array([0, 7, 0, 0, 3]), ints, *cols)
        if short in (1, 6):
            with pytest.raises(ValueError, match="columns differ in length"):
                kernels.connect_rows(ints, ints[::-1].copy(), cols[0], cols[1], cols[6])
        if short in (1, 2, 3, 6):
            with pytest.raises(ValueError, match="columns differ in length"):
                kernels.release_rows(ints, *cols[:4], cols[6])
        assert all((c[:3] == (0 if c.dtype == np.int8 else -1)).all() for c in cols)


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@pytest.mark.parametrize("form", ["strided", "int32", "read-only", "tensor"])
def test_compiled_writes_take_the_row_arrays_the_numpy_paths_take(form):
    """Rows given strided, as int32, read-only or as a tensor: the compiled writes (which
    take contiguous int64) convert them and write what the numpy paths write."""
    from replaybuf.accel.numba_loader import compiled_kernels
    from replaybuf.episodes.anchors import AnchorSet
    from replaybuf.episodes.links import RowLinks

    def rows(*values: int):
        wide = np.repeat(np.array(values, dtype=np.int64), 2)  # every value twice
        if form == "strided":
            return wide[::2]
        if form == "int32":
            return np.array(values, dtype=np.int32)
        if form == "tensor":
            return torch.tensor(values)
        frozen = np.array(values, dtype=np.int64)
        frozen.setflags(write=False)
        return frozen

    cpu = torch.device("cpu")
    results = []
    for kernels in (compiled_kernels(), None):
        links = RowLinks(8, cpu, backward=True, kernels=kernels)
        anchors = AnchorSet(8, cpu, kernels=kernels)
        place = [rows(1, 4, 6), rows(9, 9, 9), rows(0, 1, 2), rows(0, 0, 1), rows(5, 6, 7)]
        if form == "tensor":  # RowLinks takes numpy rows; AnchorSet either
            place = [p.numpy() for p in place]
        links.place(*place)
        sources, targets = (rows(1, 4), rows(4, 6))
        if form == "tensor":
            sources, targets = sources.numpy(), targets.numpy()
        starts = links.connect(sources, targets)
        anchors.add(starts)
        anchors.add(torch.tensor([0, 3]))
        anchors.remove_present(rows(3, 4, 7))
        links.release(rows(6) if form != "tensor" else rows(6).numpy())
        results.append(
            [getattr(links, n).tolist() for n in COLUMNS] + [anchors.rows.tolist(), len(anchors)]
        )
    assert results[0] == results[1]


def test_an_evicted_episodes_rows_are_handed_out_again_in_its_own_order():
    """Eviction pushes an episode's rows (and final row) so that the next ones handed out are
    its first row, then its second, ...: the free list's order, which checkpoints save and
    which decides where the next steps land."""
    buf = SyncEpisodeReplayBuffer(4, 8, storage="tensor", seed=0)
    core = buf._core
    first = buf.start_episode()
    for t in range(4):
        buf.append_observation_action_reward(first, np.full(3, t, np.float32), 0, 1.0)
    buf.end_episode(first, "truncated", np.full(3, 4.0, np.float32))
    held = [*core.episodes[first].rows, core.episodes[first].final_row]
    second = buf.start_episode()
    buf.append_observation_action_reward(second, np.zeros(3, np.float32), 0, 1.0)  # evicts
    assert first not in core.episodes
    taken = core.episodes[second].rows[0]
    assert list(core.free)[-len(held) + 1 :] == held[:0:-1]  # pops give held[1], held[2], ...
    assert taken == held[0]


@settings(max_examples=40, deadline=None)
@given(
    program=st.lists(
        st.tuples(st.sampled_from(["append", "end", "batch", "clear"]), st.integers(0, 3)),
        max_size=40,
    )
)
def test_holds_steps_says_whether_some_anchor_has_that_many_steps_ahead(program):
    """What a strict sequence draw checks before drawing (its device redraw relies on it),
    against a scan of every anchor, after each append, end, batch append (four envs in
    lockstep), clear and the evictions they make, for lengths 1 to 9."""
    buf = SyncEpisodeReplayBuffer(12, 5, storage="tensor", seed=0)
    core = buf._core
    running: list[int] = []

    def start() -> list[int]:  # a new episode, and the running ones not evicted by it
        return [e for e in [*running, buf.start_episode()] if e in core.episodes]

    for action, pick in program:
        # room for 4 more steps: steps of episodes being written cannot be evicted
        while running and sum(core.episodes[e].steps for e in running) > 8:
            buf.end_episode(running.pop(0), "terminated", np.zeros(3))
        if action == "append" or not running:
            if not running or pick == 0:
                running = start()
            buf.append_observation_action_reward(running[pick % len(running)], np.zeros(3), 0, 1.0)
        elif action == "end":
            buf.end_episode(running.pop(pick % len(running)), "truncated", np.zeros(3))
        elif action == "batch":
            while len(running) < 4:
                running = start()
            ids = running[:4]
            buf.append_batch(ids, np.zeros((4, 3)), np.zeros(4, np.int64), np.ones(4, np.float32))
        else:
            buf.clear()
            running = []
        running = [e for e in running if e in core.episodes]  # evicted ones are gone
        core.flush()
        anchors = core.anchors.snapshot()
        for length in range(1, 10):
            scan = bool(full_sequence_starts(anchors, length, core.links.succ).any())
            assert core.holds_steps(length) == scan, (length, program)


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_a_failed_placement_of_a_batch_run_leaves_it_pending(monkeypatch):
    """If placing a batch run's rows raises, the run keeps its batches: the next flush places
    them, and the bookkeeping is whole."""
    buf = SyncEpisodeReplayBuffer(64, 8, storage="tensor", seed=0)
    core = buf._core
    ids = [buf.start_episode() for _ in range(3)]
    for t in range(4):
        obs = np.full((3, 3), t, np.float32)
        buf.append_batch(ids, obs, np.zeros(3, np.int64), np.ones(3, np.float32))
    assert core._run is not None
    assert core._run.pending() is not None
    place = core.links.place_batches
    monkeypatch.setattr(core.links, "place_batches", mock.Mock(side_effect=IndexError("boom")))
    with pytest.raises(IndexError, match="boom"):
        core.flush()
    assert core._run.pending() is not None
    monkeypatch.setattr(core.links, "place_batches", place)
    assert_bookkeeping(core)  # flushes: the pending batches are placed now
    assert core._run.pending() is None


def assert_same_bookkeeping(core: EpisodeCore, other: EpisodeCore) -> None:
    """Every links column, the anchor set (in draw order) and the free list agree, wherever
    each core reads them (host, mirrored, or on a GPU)."""
    for name in COLUMNS:
        a, b = getattr(core.links, name), getattr(other.links, name)
        assert (a is None and b is None) or a.tolist() == b.tolist(), name
    assert torch.equal(core.anchors.snapshot().cpu(), other.anchors.snapshot().cpu())
    assert list(core.free) == list(other.free)


def test_a_batch_assigns_rows_as_single_appends_would():
    """append_batch hands out the same rows, steps and allocations as one append per episode
    in the same order."""
    bufs = [SyncEpisodeReplayBuffer(40, 8, storage="tensor", seed=0) for _ in range(2)]
    ids = [[buf.start_episode() for _ in range(4)] for buf in bufs]
    for t in range(5):
        obs = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + t
        bufs[0].append_batch(ids[0], obs, np.zeros(4, np.int64), np.ones(4, np.float32))
        for i, episode in enumerate(ids[1]):
            bufs[1].append_observation_action_reward(episode, obs[i], 0, 1.0)
    for buf in bufs:
        assert_bookkeeping(buf._core)
    # The repeated batches took the cached run: they never looked the episodes up again.
    with mock.patch.object(bufs[0]._core, "in_progress_all", side_effect=AssertionError):
        obs = np.zeros((4, 3), dtype=np.float32)
        bufs[0].append_batch(ids[0], obs, np.zeros(4, np.int64), np.ones(4, np.float32))
    for i, episode in enumerate(ids[1]):
        bufs[1].append_observation_action_reward(episode, obs[i], 0, 1.0)
    for name in COLUMNS[:-1]:
        assert torch.equal(getattr(bufs[0]._core.links, name), getattr(bufs[1]._core.links, name))
    assert [[*e.rows] for e in bufs[0]._core.episodes.values()] == [
        [*e.rows] for e in bufs[1]._core.episodes.values()
    ]


def test_ids_in_an_integer_array_take_the_cached_run_and_bad_arrays_are_refused():
    """A vector env keeping its episode ids in a numpy array: repeated calls skip the lookup
    as a list of ints does and store the same; bool, float and 2-D id arrays are refused,
    naming the id, and change nothing."""
    bufs = [SyncEpisodeReplayBuffer(40, 8, storage="tensor", seed=0) for _ in range(2)]
    for buf in bufs:
        ids = [buf.start_episode() for _ in range(3)]  # the same ids in both
    for t in range(4):
        for buf, given_ids in zip(bufs, (np.array(ids), ids), strict=True):
            lookup = mock.patch.object(buf._core, "in_progress_all", side_effect=AssertionError)
            with lookup if t == 3 else contextlib.nullcontext():  # by then a repeat: no lookup
                batch(buf, given_ids, float(t))
    for bad in (np.array([True, False, True]), np.array(ids, np.float64), np.array(ids)[:, None]):
        before = bufs[0]._core.steps
        with pytest.raises(EpisodeStateError, match="episode_id must be an int"):
            batch(bufs[0], bad)
        assert bufs[0]._core.steps == before
    with pytest.raises(TypeError, match="0-d"):  # one id, not a sequence of them
        bufs[0].append_batch(np.array(ids[0]), np.zeros((1, 3), np.float32), [0], [1.0])
    assert bufs[0]._core.steps == before
    for episode in ids:
        assert [*bufs[0]._core.episodes[episode].rows] == [*bufs[1]._core.episodes[episode].rows]
        first, second = (buf.get_episode(episode)["observation"] for buf in bufs)
        assert first[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert torch.equal(first, second)


@pytest.mark.parametrize("settle", [1, 3, 256])
def test_a_long_batch_run_read_midway_stores_what_single_appends_store(settle):
    """A run of repeated batches keeps their rows until read or settled: reads in the middle
    (an episode's record, its step count) see every step, the run goes on after them, and
    rows, links and contents end as one append per episode would leave them."""
    envs, batches = 3, 40
    bufs = [SyncEpisodeReplayBuffer(400, 8, storage="tensor", seed=0) for _ in range(2)]
    ids = [[buf.start_episode() for _ in range(envs)] for buf in bufs]
    with (
        # Staged rows written every 2 batches.
        mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=2 * envs, _FLUSH_BYTES=0),
        mock.patch("replaybuf.episodes.batch_run._SETTLE_BATCHES", settle),
    ):
        for t in range(batches):
            obs = np.arange(envs * 3, dtype=np.float32).reshape(envs, 3) + 10 * t
            bufs[0].append_batch(ids[0], obs, np.full(envs, t), np.ones(envs, np.float32))
            for i, episode in enumerate(ids[1]):
                bufs[1].append_observation_action_reward(episode, obs[i], t, 1.0)
            run = bufs[0]._core._run
            assert run is not None
            assert len(run.batches) <= settle + 2  # bounded, read or not
            if t in (7, 8, 25):  # reads in the middle of the run, which goes on after them
                assert bufs[0]._core.episodes[ids[0][1]].steps == t + 1
                record = bufs[0].get_episode(ids[0][2])
                assert record["observation"].shape == (t + 1, 3)
                assert record["observation"][:, 0].tolist() == [6.0 + 10 * s for s in range(t + 1)]
                assert bufs[0]._core._run is run  # still the same run
    for buf in bufs:
        assert_bookkeeping(buf._core)
    for name in COLUMNS[:-1]:
        assert torch.equal(getattr(bufs[0]._core.links, name), getattr(bufs[1]._core.links, name))
    for a, b in zip(ids[0], ids[1], strict=True):
        assert [*bufs[0]._core.episodes[a].rows] == [*bufs[1]._core.episodes[b].rows]
        first, second = bufs[0].get_episode(a), bufs[1].get_episode(b)
        for key in ("observation", "action", "reward"):
            assert torch.equal(first[key], second[key]), key
    # Ending one episode ends the run; the others' rows are all in their arrays by then.
    bufs[0].end_episode(ids[0][0], "truncated", np.zeros(3, np.float32))
    assert bufs[0]._core._run is None
    assert all(e.run is None for e in bufs[0]._core.episodes.values())
    assert_bookkeeping(bufs[0]._core)


def batch(buf: SyncEpisodeReplayBuffer, ids: list, t: float = 0.0) -> None:
    n = len(ids)
    obs = np.full((n, 3), t, dtype=np.float32)
    buf.append_batch(ids, obs, np.zeros(n, np.int64), np.ones(n, np.float32))


def evict(buf: SyncEpisodeReplayBuffer, episode_id: int) -> None:
    """Evict an episode in progress, as make_room does (after a flush)."""
    core = buf._core
    core.flush()
    core.remove_episode(core.episodes[episode_id])


@pytest.mark.parametrize(
    ("between", "message"),
    [
        (lambda buf, ids: buf.end_episode(ids[1], "terminated", np.zeros(3, np.float32)), "ended"),
        (lambda buf, ids: evict(buf, ids[1]), "evicted"),
        (lambda buf, ids: ids.__setitem__(1, True), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, float(ids[1])), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, ids[0]), "distinct"),
        (lambda buf, ids: ids.__setitem__(1, np.array([1, 2])), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, torch.tensor([1, 2])), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, np.float64(ids[1])), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, torch.tensor(ids[1])), "must be an int"),
        (lambda buf, ids: ids.__setitem__(1, str(ids[1])), "must be an int"),
        (lambda buf, ids: buf.clear(), "evicted or cleared"),
    ],
)
# skipped: episodes started before the batch's, so that its ids are 0, 1, 2 (which a bool
# equals) or 5, 6, 7 (which only the repeat's sum of ints guards).
@pytest.mark.parametrize("skipped", [0, 5])
def test_a_repeated_batch_is_checked_again_after_anything_that_changes_its_episodes(
    between, message, skipped
):
    """The second call names the first call's episodes (the cached run) after a change that
    makes one of them invalid: it gets the same error as any other batch."""
    with SyncEpisodeReplayBuffer(64, 8, storage="tensor", seed=0) as buf:
        for _ in range(skipped):
            buf.start_episode()
        ids = [buf.start_episode() for _ in range(3)]
        batch(buf, ids)
        batch(buf, ids)
        between(buf, ids)
        before = (buf._core.steps, len(buf))
        with pytest.raises((EpisodeStateError, ValueError), match=message):
            batch(buf, ids)
        assert (buf._core.steps, len(buf)) == before
        assert_bookkeeping(buf._core)


def test_a_repeated_batch_after_single_appends_links_each_episode_to_its_latest_row():
    with SyncEpisodeReplayBuffer(64, 8, storage="tensor", seed=0) as buf:
        ids = [buf.start_episode() for _ in range(3)]
        batch(buf, ids, 0)
        batch(buf, ids, 1)
        buf.append_observation_action_reward(ids[2], np.full(3, 9, np.float32), 0, 1.0)
        batch(buf, ids, 2)  # not the cached run any more: rows and steps are read again
        batch(buf, np.array(ids), 3)  # numpy ids: checked, accepted
        batch(buf, ids, 4)
        assert_bookkeeping(buf._core)
        lengths = [int(buf.get_episode(i)["length"]) for i in ids]
        assert lengths == [5, 5, 6]
        observed = buf.get_episode(ids[2])["observation"][:, 0].tolist()
        assert observed == [0, 1, 9, 2, 3, 4]


@pytest.mark.parametrize("mirror", [False, True])
def test_a_repeated_batch_across_a_checkpoint_and_its_restore(tmp_path, mirror):
    """Pinning for a checkpoint leaves the run as it was; a restored buffer has none and
    checks the ids afresh; both go on storing the same steps. Mirrored: the restore's device
    copies follow the restored host columns."""
    with (
        mirrored() if mirror else contextlib.nullcontext(),
        SyncEpisodeReplayBuffer(64, 8, storage="tensor", seed=0) as buf,
    ):
        ids = [buf.start_episode() for _ in range(3)]
        batch(buf, ids, 0)
        batch(buf, ids, 1)
        buf.save_checkpoint(tmp_path / "ck")  # pins, copies, unpins
        batch(buf, ids, 2)
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck") as back:
            assert (back._core.links._mirror is not None) == mirror
            assert back._core._run is None
            batch(back, ids, 2)
            batch(back, ids, 3)
            batch(buf, ids, 3)
            for b in (buf, back):
                assert_bookkeeping(b._core)
            for i in ids:
                assert torch.equal(
                    buf.get_episode(i)["observation"], back.get_episode(i)["observation"]
                )


@pytest.mark.parametrize(
    ("observation_floats", "rows"),
    [(4, 16384), (60, 8322), (256, 2024), (4096, 512)],  # 28 B, 252 B, 1,036 B, 16 KiB rows
)
def test_the_staging_buffer_holds_512_rows_or_2_mib_of_small_rows(observation_floats, rows):
    """Staged rows go to storage in writes of 512 rows, or of as many small rows as fill
    2 MiB (at most 16,384): fewer writes and packs for small rows (several batches of a
    vector env of thousands), no more memory than before for large ones."""
    with SyncEpisodeReplayBuffer(64, 8, storage="tensor") as buf:
        episode = buf.start_episode()
        observation = np.zeros(observation_floats, np.float32)
        buf.append_observation_action_reward(episode, observation, 0, 1.0)
        row_bytes = buf._core.slots.spec.row_bytes
        assert row_bytes == 4 * observation_floats + 8 + 4  # observation, int64 action, reward
        assert buf._core._stager.capacity == rows == max(512, min(16384, 2**21 // row_bytes))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_a_failed_admission_after_place_steps_is_applied_again_at_the_next_flush():
    """The one-call flush keeps the per-step lists until their anchors are admitted: after an
    admission that raises, the next flush places and admits them again, each anchor once."""
    with SyncEpisodeReplayBuffer(50, prioritized=True, storage="tensor", seed=0) as buf:
        episode = buf.start_episode()
        for t in range(3):  # the first write allocates the storage (its flush packs)
            buf.append_observation_action_reward(episode, torch.full((3,), t), t, 1.0)
        buf.sample_n_step(2)
        core = buf._core
        for t in range(3, 8):
            buf.append_observation_action_reward(episode, torch.full((3,), t), t, 1.0)
        failing = mock.patch.object(
            type(core.priorities), "admit", side_effect=RuntimeError("out of memory")
        )
        places = mock.patch.object(RowLinks, "place_steps", wraps=core.links.place_steps)
        with places as place_steps:
            with failing, pytest.raises(RuntimeError, match="out of memory"):
                buf.sample_n_step(4)
            assert len(core.anchors) == 2  # nothing of the failed flush admitted
            buf.sample_n_step(4)
        assert place_steps.call_count == 2
        assert_bookkeeping(core)
        anchors = core.anchors.snapshot()
        assert sorted(core.links.step[anchors].tolist()) == list(range(7))
        assert bool((core.priorities.tree.get(anchors) > 0).all())


@pytest.mark.parametrize("mirror", [False, True])
def test_a_failed_priority_admission_is_applied_again_without_duplicate_anchors(mirror):
    """A flush whose priority admission raises (a device allocation failing, say) keeps the
    staged bookkeeping, and the next flush applies it: every new step becomes an anchor once,
    with its priority."""
    with mirrored() if mirror else contextlib.nullcontext():
        buf = SyncEpisodeReplayBuffer(50, prioritized=True, storage="tensor", seed=0)
    with buf:
        episode = buf.start_episode()
        for t in range(6):
            buf.append_observation_action_reward(episode, torch.full((3,), t), t, 1.0)
        core = buf._core
        failing = mock.patch.object(
            type(core.priorities), "admit", side_effect=RuntimeError("out of memory")
        )
        with failing, pytest.raises(RuntimeError, match="out of memory"):
            buf.sample_n_step(4)
        batch = buf.sample_n_step(4)
        assert_bookkeeping(core)
        anchors = core.anchors.snapshot()
        assert anchors.numel() == 5
        assert bool((core.priorities.tree.get(anchors) > 0).all())
        assert set(batch["start_step"].tolist()) <= set(range(5))
