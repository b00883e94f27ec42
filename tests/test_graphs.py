"""Captured batch graphs (:mod:`replaybuf.accel.graphs`, :mod:`replaybuf.sampling.graphed`).

On the CPU a stand-in capture (:func:`fake_capture`: a replay runs the build again and writes
its outputs into the static packed bytes, as a CUDA replay does) checks the cache: when a key
is captured, that replays hand out fresh copies, that moved inputs are captured again, the LRU
limit, failed keys and the packing of every dtype. In Triton's interpreter (the child process
of ``test_fused.py``) the same stand-in serves random programs' batches from mirrored CPU
buffers, through the draw kernel and the fused kernels, checked against the reference model
after every operation. On a GPU real graphs do, on the default stream and another.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from episode_helpers import mirrored
from episode_program import Program
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tensordict import TensorDictBase
from test_cuda import Arrived
from test_fused import INTERPRETED

import replaybuf.accel.fused as fused
import replaybuf.accel.graphs as graphs
from replaybuf import SyncEpisodeReplayBuffer
from replaybuf.accel.fused import strict_redraw
from replaybuf.accel.graphs import CAPTURE_AT, LIMIT, BatchGraphs, NotCapturable

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class FakeGraph:
    """A CPU stand-in for a captured graph: a replay runs the build again and copies its
    outputs' bytes into the entry's static packed tensor."""

    def __init__(self, build: graphs.Build, packed: torch.Tensor) -> None:
        self.build, self.packed = build, packed
        self.replays = 0
        self.was_reset = False

    def replay(self) -> None:
        fresh, _ = graphs._pack(self.build()[1])
        self.packed.copy_(fresh)
        self.replays += 1

    def reset(self) -> None:
        self.was_reset = True


def fake_capture(device, build, inputs, signature, rounds) -> graphs._Entry | None:
    # As the real capture: a warm-up run first (its round given back), then the capture (here
    # a run, whose draw the real one makes at its first replay).
    if graphs.warm_up(build, rounds) > graphs.MAX_BYTES:
        return None
    meta, outputs = build()
    packed, parts = graphs._pack(outputs)
    graph = FakeGraph(build, packed)
    return graphs._Entry(graph, inputs, signature, meta, packed, parts, len(outputs))


@pytest.fixture
def cache() -> Iterator[BatchGraphs]:
    with mock.patch.object(graphs, "_capture", fake_capture):
        yield BatchGraphs(torch.device("cpu"), seed=0)


class Source:
    """A build over one input tensor that counts its runs."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.builds = 0

    def __call__(self) -> tuple[str, list[torch.Tensor]]:
        self.builds += 1
        v = self.values
        return "meta", [v * 2, v > 0, v.to(torch.uint8), v.long().view(-1, 1)]


def test_a_key_is_captured_at_its_third_ask_then_replayed_on_current_inputs(cache):
    source = Source(torch.arange(4.0))
    for _ in range(CAPTURE_AT - 1):
        assert cache.run("k", [source.values], 5, source) is None
    assert source.builds == 0  # asked, not captured: the caller did the work
    meta, values = cache.run("k", [source.values], 5, source)
    assert meta == "meta"
    assert source.builds == 2  # a warm-up run, then the capture
    assert values[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    source.values.copy_(torch.tensor([3.0, -1.0, 0.0, 1.0]))  # written in place: same input
    _, values = cache.run("k", [source.values], 5, source)
    assert cache._entries["k"].graph.replays == 1
    assert values[0].tolist() == [6.0, -2.0, 0.0, 2.0]
    assert values[1].tolist() == [True, False, False, True]
    assert values[1].dtype == torch.bool
    assert values[3].shape == (4, 1)
    assert int(cache.count) == 5


def test_replays_hand_out_fresh_copies_that_later_replays_leave_alone(cache):
    source = Source(torch.arange(6.0))
    for _ in range(CAPTURE_AT):
        cache.run("k", [source.values], 1, source)
    _, kept = cache.run("k", [source.values], 1, source)
    copies = [v.clone() for v in kept]
    kept[0].fill_(-7.0)  # the caller writes into its batch: another field must not change
    assert torch.equal(kept[3], copies[3])
    assert torch.equal(kept[2], copies[2])
    source.values.add_(10.0)
    _, later = cache.run("k", [source.values], 1, source)
    assert later[0].tolist() == [20.0, 22.0, 24.0, 26.0, 28.0, 30.0]
    assert (kept[0] == -7.0).all()  # untouched by the replay
    assert all(torch.equal(a, b) for a, b in zip(kept[1:], copies[1:], strict=True))
    packed = cache._entries["k"].packed.untyped_storage().data_ptr()
    assert packed not in {v.untyped_storage().data_ptr() for v in later}


def test_an_input_that_moved_is_captured_again_at_once(cache):
    source = Source(torch.arange(3.0))
    for _ in range(CAPTURE_AT):
        cache.run("k", [source.values], 1, source)
    old = cache._entries["k"]
    moved = Source(torch.tensor([5.0, 6.0, 7.0]))  # a reallocated column
    _, values = cache.run("k", [moved.values], 1, moved)
    assert old.graph.was_reset
    assert cache._entries["k"] is not old
    assert moved.builds == 2  # a warm-up run, then the capture
    assert values[0].tolist() == [10.0, 12.0, 14.0]
    assert cache._entries["k"].inputs[0] is moved.values  # kept alive with its graph


def test_at_most_limit_graphs_are_kept_least_recently_used_dropped(cache):
    source = Source(torch.arange(2.0))
    keys = list(range(LIMIT + 1))
    for key in keys[:LIMIT]:
        for _ in range(CAPTURE_AT):
            cache.run(key, [source.values], 1, source)
    first = cache._entries[0]
    cache.run(0, [source.values], 1, source)  # key 0 used last: key 1 goes next
    for _ in range(CAPTURE_AT):
        cache.run(keys[-1], [source.values], 1, source)
    assert len(cache._entries) == LIMIT
    assert 1 not in cache._entries
    assert 0 in cache._entries
    assert not first.graph.was_reset
    cache.clear()
    assert not cache._entries
    assert first.graph.was_reset


def test_a_key_that_cannot_be_captured_is_never_tried_again(cache):
    calls = []

    def build() -> tuple[None, list[torch.Tensor]]:
        calls.append(1)
        raise NotCapturable("reads the host")

    for _ in range(CAPTURE_AT + 3):
        assert cache.run("k", [], 1, build) is None
    assert len(calls) == 1
    assert "k" in cache._failed


def test_outputs_past_the_byte_limit_are_not_graphed():
    # The real capture's first step (the build outside the graph) sizes the outputs.
    device = torch.device("cpu")
    big = torch.zeros(graphs.MAX_BYTES // 8 + 1, dtype=torch.long)
    with (
        mock.patch.object(graphs.torch.cuda, "current_stream"),
        mock.patch.object(graphs.torch.cuda, "Stream"),
        mock.patch.object(graphs.torch.cuda, "stream"),
    ):
        cache = BatchGraphs(device, seed=0)
        for _ in range(CAPTURE_AT):
            assert cache.run("k", [], 1, lambda: (None, [big])) is None
    assert "k" in cache._failed
    assert not cache._entries


dtypes = st.sampled_from(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16,
     torch.int32, torch.float32, torch.int64, torch.float64, torch.complex64, torch.complex128]
)  # fmt: skip
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None)
@given(fields=st.lists(st.tuples(dtypes, shapes, st.booleans()), min_size=1, max_size=7))
def test_packing_round_trips_every_dtype_shape_and_layout(fields):
    g = torch.Generator().manual_seed(len(fields))
    outputs = []
    for dtype, shape, transposed in fields:
        value = (torch.randn(shape, generator=g) * 50).to(dtype)
        if transposed and value.dim() >= 2:
            value = value.transpose(0, 1)  # not contiguous: packed all the same
        outputs.append(value)
    packed, parts = graphs._pack(outputs)
    assert packed.dtype == torch.uint8
    assert len(parts) == len({v.dtype for v in outputs})
    assert all(first % graphs.ALIGN == 0 for _, first, *_ in parts)
    entry = graphs._Entry(None, (), (), None, packed, parts, len(outputs))
    got_all = graphs._unpack(entry)
    for got, want in zip(got_all, outputs, strict=True):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert torch.equal(got, want)
    if packed.numel():  # a copy, not the static bytes
        assert got_all[0].untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()


@INTERPRETED
def test_the_draw_kernel_is_uniform_new_each_round_and_seeded():
    graphs_ = BatchGraphs(torch.device("cpu"), seed=11)
    graphs_.count.fill_(7)  # as run writes it before a replay
    draws = graphs_.draw((7_000,))
    assert draws.dtype == torch.long
    assert int(graphs_.rounds) == 1  # advanced on the device, in the graph
    assert int(draws.min()) >= 0
    assert int(draws.max()) < 7
    counts = Counter(draws.tolist())
    assert chisquare([counts[i] for i in range(7)]).pvalue > 1e-4
    again = graphs_.draw((7_000,))
    assert not torch.equal(again, draws)  # a new round, new bits
    same = fused.draw(torch.zeros((), dtype=torch.long), graphs_.count, (7_000,), 11)
    assert torch.equal(same, draws)  # (seed, round) decide the draws
    other = fused.draw(torch.zeros((), dtype=torch.long), graphs_.count, (7_000,), 12)
    assert not torch.equal(other, draws)
    graphs_.count.fill_(2)
    assert set(graphs_.draw((500, 3)).reshape(-1).tolist()) == {0, 1}


@INTERPRETED
@pytest.mark.parametrize("frame_stack", [None, 3])
def test_graphed_batches_in_the_interpreter_agree_with_the_reference(frame_stack):
    # Mirrored CPU buffers take CUDA storage's path; the stand-in capture replays the build.
    with stand_in_graphs():
        buf = SyncEpisodeReplayBuffer(
            60, device="cpu", storing_device="cpu", storage="tensor", seed=0,
            frame_stack=frame_stack,
        )  # fmt: skip
        p = Program(buf)
        with buf:
            rounds(p, 6)
            keys = graph_keys(p)
            assert ("n_step", 16, 3, 0.9) in keys
            assert ("sequences", 6, 4, True) in keys
            assert ("sequences", 6, 4, False) in keys
            replays = sum(e.graph.replays for e in buf._draws.made._entries.values())
            assert replays >= 6 * 2 * 3  # rounds x samples per round x graphed keys, less captures


def stand_in_graphs() -> contextlib.AbstractContextManager:
    """Mirrored CPU buffers (CUDA storage's path) whose batches the stand-in capture serves."""
    cuda_or_cpu = staticmethod(
        lambda device: device.type in ("cuda", "cpu") and os.environ.get(graphs.GRAPHS_ENV) != "0"
    )
    stack = contextlib.ExitStack()
    stack.enter_context(mirrored())
    stack.enter_context(mock.patch.object(graphs, "_capture", fake_capture))
    stack.enter_context(mock.patch.object(BatchGraphs, "enabled", cuda_or_cpu))
    return stack


def add_episode(buf: SyncEpisodeReplayBuffer, e: int, length: int) -> None:
    eid = buf.start_episode()
    for t in range(length):
        buf.append_observation_action_reward(eid, torch.tensor([e, t]), 0, 0.0)
    buf.end_episode(eid, "terminated", torch.tensor([e, length]))


def graphed_draw_counts(buf: SyncEpisodeReplayBuffer, batches: int) -> tuple[set, Counter]:
    """Episodes of 5 and 9 steps, then (graphs captured) one of 13: the graph keys and how
    often each (episode, step) started a graphed n-step or padded sequence batch (a stale
    count would miss the new episode's steps)."""
    with buf:
        add_episode(buf, 0, 5)
        add_episode(buf, 1, 9)
        for _ in range(CAPTURE_AT):
            buf.sample_n_step(64, 1)
            buf.sample_sequences(64, 2, strict=False)
        add_episode(buf, 2, 13)
        counts: Counter = Counter()
        for _ in range(batches):
            batch = buf.sample_n_step(64, 1)
            counts.update(
                zip(batch["episode_id"].tolist(), batch["start_step"].tolist(), strict=True)
            )
            sequences = buf.sample_sequences(64, 2, strict=False)
            starts = zip(
                sequences["episode_id"][:, 0].tolist(),
                sequences["step"][:, 0].tolist(),
                strict=True,
            )
            counts.update(starts)
        return set(buf._draws.made._entries), counts


GRAPHED = {("n_step", 64, 1, 0.99), ("sequences", 64, 2, False)}


def strict_draw_counts(buf: SyncEpisodeReplayBuffer, batches: int) -> tuple[set, Counter, bool]:
    """Episodes of 1 step between two of 9 and 12, and a strict length of 8: 7 of 51
    anchors qualify, so about 3 slots in 10 find no start among their 8 tries and are drawn
    again on the device. The graph keys, how often each (episode, step) started a strict
    batch, and whether every batch was full (its mask all True)."""
    with buf:
        for e, length in enumerate([1] * 10 + [9] + [1] * 10 + [12] + [1] * 10):
            add_episode(buf, e, length)
        counts: Counter = Counter()
        full = True
        for _ in range(batches):
            batch = buf.sample_sequences(64, 8)
            full &= bool(batch["mask"].all())
            first = batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist()
            counts.update(zip(*first, strict=True))
        return set(buf._draws.made._entries), counts, full


STRICT_STARTS = {(10, 0), (10, 1), (21, 0), (21, 1), (21, 2), (21, 3), (21, 4)}


ON_GPU = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=ON_GPU)]
)
def test_graphed_strict_draws_are_uniform_over_full_starts(device, monkeypatch):
    """In the interpreter with the stand-in capture, and on the GPU with real graphs. The
    redraw's scan is cut into 4 parts of 8-anchor steps, so that the compiled loops run
    several steps and the 7 qualifying anchors lie in several parts."""
    monkeypatch.setattr(strict_redraw, "PARTS", 4)
    monkeypatch.setattr(strict_redraw, "SCAN", 8)
    with stand_in_graphs() if device == "cpu" else contextlib.nullcontext():
        buf = SyncEpisodeReplayBuffer(100, device=device, storing_device=device, seed=1)
        keys, counts, full = strict_draw_counts(buf, 30 if device == "cpu" else 100)
    assert keys == {("sequences", 64, 8, True)}
    assert full
    assert set(counts) == STRICT_STARTS
    assert chisquare(list(counts.values())).pvalue > 1e-4


@INTERPRETED
def test_graphed_draws_in_the_interpreter_follow_the_anchor_count():
    with stand_in_graphs():
        buf = SyncEpisodeReplayBuffer(100, device="cpu", storing_device="cpu", seed=1)
        keys, counts = graphed_draw_counts(buf, 60)
    assert keys == GRAPHED
    assert len(counts) == 27  # every valid step, the new episode's too
    assert chisquare(list(counts.values())).pvalue > 1e-4


def test_graphs_are_only_for_cuda_and_can_be_switched_off():
    assert not BatchGraphs.enabled(torch.device("cpu"))
    assert BatchGraphs.enabled(torch.device("cuda"))
    with mock.patch.dict(os.environ, {graphs.GRAPHS_ENV: "0"}):
        assert not BatchGraphs.enabled(torch.device("cuda"))


# --------------------------------------------------------------------------- on a GPU
def program(frame_stack: int | None = None, max_steps: int = 60) -> Program:
    buf = SyncEpisodeReplayBuffer(
        max_steps, device="cuda", storing_device="cuda", storage="tensor", seed=0,
        frame_stack=frame_stack,
    )  # fmt: skip
    return Program(Arrived(buf))  # type: ignore[arg-type]


def rounds(p: Program, count: int) -> None:
    """``count`` rounds of appends, ends and starts (evicting past max_steps), each followed
    by replays of every graphed batch kind, each checked against the reference."""
    for r in range(count):
        p.append_batch([0, 1, 2], 3)
        p.append(r, 2)
        if r % 3 == 2:
            p.end(r, "terminated" if r % 2 else "truncated")
            p.start("a")
        p.check()
        for _ in range(2):
            p.sample(3, 0.9)
            p.sample((1, 3), 0.5)
            p.sample(1, 0.99)
            p.sequences(4, True)
            p.sequences(4, False)
            p.sequences(9, True)  # few starts qualify: redrawn slots, or the error


def graph_keys(p: Program) -> set:
    buf = p.buf if isinstance(p.buf, SyncEpisodeReplayBuffer) else p.buf._buf
    return set(buf._draws.made._entries)


@pytest.mark.parametrize("frame_stack", [None, 3])
@pytest.mark.gpu
@needs_cuda
def test_graphed_batches_agree_with_the_reference(frame_stack):
    p = program(frame_stack)
    with p.buf._buf:
        rounds(p, 10)
        keys = graph_keys(p)
        assert ("n_step", 16, 3, 0.9) in keys
        assert ("n_step", 16, (1, 3), 0.5) not in keys  # a random n takes the torch generator
        assert ("sequences", 6, 4, True) in keys
        assert ("sequences", 6, 4, False) in keys


@pytest.mark.gpu
@needs_cuda
def test_graphed_batches_agree_with_the_reference_on_another_stream():
    p = program()
    with p.buf._buf:
        rounds(p, 3)  # captured on the default stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            rounds(p, 3)
        rounds(p, 2)
        assert ("n_step", 16, 3, 0.9) in graph_keys(p)


def filled(capacity: int = 500) -> SyncEpisodeReplayBuffer:
    p = program(max_steps=capacity)
    rounds(p, 4)
    return p.buf._buf


@pytest.mark.gpu
@needs_cuda
def test_batches_kept_by_the_caller_never_change():
    with filled() as buf:
        for call in (lambda: buf.sample_n_step(32, 3), lambda: buf.sample_sequences(8, 4)):
            kept = [call() for _ in range(CAPTURE_AT + 1)]
            copies = [b.clone() for b in kept]
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            for b, c in zip(kept, copies, strict=True):
                assert (b == c).all()


@pytest.mark.gpu
@needs_cuda
def test_graphed_draws_are_uniform_over_the_valid_steps():
    buf = SyncEpisodeReplayBuffer(100, device="cuda", storing_device="cuda", seed=1)
    keys, counts = graphed_draw_counts(buf, 100)
    assert keys == GRAPHED
    assert len(counts) == 27
    assert chisquare(list(counts.values())).pvalue > 1e-4


@pytest.mark.gpu
@needs_cuda
def test_graphed_batches_never_wait_for_the_gpu():
    with filled() as buf:
        calls = [
            lambda: buf.sample_n_step(32, 3),
            lambda: buf.sample_n_step(32, (1, 3)),
            lambda: buf.sample_sequences(8, 4, strict=False),
            lambda: buf.sample_sequences(8, 4),
        ]
        for call in calls:
            for _ in range(CAPTURE_AT):
                call()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                batch = call()  # raises at a host synchronisation
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert batch.device.type == "cuda"
        entries = buf._draws.made._entries
        assert ("n_step", 32, 3, 0.99) in entries
        assert ("sequences", 8, 4, False) in entries
        assert ("sequences", 8, 4, True) in entries


@pytest.mark.gpu
@needs_cuda
def test_graphed_strict_draws_that_redraw_never_wait_for_the_gpu():
    buf = SyncEpisodeReplayBuffer(100, device="cuda", storing_device="cuda", seed=1)
    with buf:
        for e, length in enumerate([1] * 10 + [9] + [1] * 10 + [12] + [1] * 10):
            add_episode(buf, e, length)
        for _ in range(CAPTURE_AT):
            buf.sample_sequences(64, 8)  # 7 of 51 anchors qualify: every batch redraws
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = buf.sample_sequences(64, 8)  # raises at a host synchronisation
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ("sequences", 64, 8, True) in buf._draws.made._entries
        assert bool(batch["mask"].all())


@pytest.mark.gpu
@needs_cuda
def test_graphs_switched_off_capture_nothing():
    with mock.patch.dict(os.environ, {graphs.GRAPHS_ENV: "0"}), filled() as buf:
        for _ in range(CAPTURE_AT + 2):
            buf.sample_n_step(32, 3)
            buf.sample_sequences(8, 4)
        assert buf._draws.made is not None  # the device draws ran
        assert not buf._draws.made._entries


def fill_for_draws(buf: SyncEpisodeReplayBuffer) -> None:
    """Five episodes of 7 to 30 steps, appended side by side (one still running)."""
    lengths = [7, 30, 12, 25, 18]
    ids = [buf.start_episode() for _ in lengths]
    for t in range(max(lengths)):
        live = [(i, e) for i, e in enumerate(ids) if lengths[i] > t]
        for i, e in live:
            buf.append_observation_action_reward(e, torch.tensor([e, t]), t % 3, float(t))
            if lengths[i] == t + 1 and i != 1:
                buf.end_episode(e, "terminated", torch.tensor([e, t + 1]))


def batches(buf: SyncEpisodeReplayBuffer, calls: int) -> list:
    """``calls`` rounds of the graphed kinds of batch (the first ones uncaptured)."""
    out = []
    for _ in range(calls):
        out.append(buf.sample_n_step(16, 3, 0.9))
        out.append(buf.sample_sequences(6, 4))
        out.append(buf.sample_sequences(6, 9, strict=False))
    return out


def same_batch(a: TensorDictBase, b: TensorDictBase) -> bool:
    return a.batch_size == b.batch_size and bool((a.cpu() == b.cpu()).all())


def draws_with_and_without_graphs(device: str, tmp_path) -> tuple[bool, bool, list, list]:
    """Two buffers of one seed, one without graphs: whether each captured graphs, their
    batches side by side, and the batches after a checkpoint beside the saved buffer's next
    ones."""
    kwargs = {"device": device, "storing_device": device, "storage": "tensor", "seed": 5}
    on, off = (SyncEpisodeReplayBuffer(200, **kwargs) for _ in range(2))
    with on, off:
        fill_for_draws(on)
        fill_for_draws(off)
        with_graphs = batches(on, CAPTURE_AT + 3)
        with mock.patch.dict(os.environ, {graphs.GRAPHS_ENV: "0"}):
            without = batches(off, CAPTURE_AT + 3)
        captured = (bool(on._draws.made._entries), bool(off._draws.made._entries))
        on.save_checkpoint(tmp_path / "ckpt")
        going_on = batches(on, CAPTURE_AT + 2)
    with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ckpt") as loaded:
        resumed = batches(loaded, CAPTURE_AT + 2)
    return (*captured, list(zip(with_graphs, without, strict=True)),
            list(zip(resumed, going_on, strict=True)))  # fmt: skip


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=ON_GPU)]
)
def test_graphs_change_no_batch_and_checkpoints_continue_them(device, tmp_path):
    """The uncaptured batches draw on the device as the graphs do: graphs change no batch (in
    the interpreter with the stand-in capture, and on the GPU with real graphs)."""
    with stand_in_graphs() if device == "cpu" else contextlib.nullcontext():
        on, off, side_by_side, resumed = draws_with_and_without_graphs(device, tmp_path)
    assert on
    assert not off
    assert len(side_by_side) == 3 * (CAPTURE_AT + 3)
    assert all(same_batch(a, b) for a, b in side_by_side)
    assert all(same_batch(a, b) for a, b in resumed)


@pytest.mark.gpu
@needs_cuda
def test_replays_on_two_streams_share_the_draw_round_in_order():
    with filled() as buf:
        side = torch.cuda.Stream()
        for call in range(3 * CAPTURE_AT):  # keys captured on one stream, replayed on both
            with torch.cuda.stream(side) if call % 2 else contextlib.nullcontext():
                buf.sample_n_step(32, 3)
                buf.sample_sequences(8, 4, strict=False)
        torch.cuda.synchronize()
        rounds_now = buf._draws.made.round()
        buf.sample_n_step(32, 3)
        buf.sample_sequences(8, 4, strict=False)
        torch.cuda.synchronize()
        assert buf._draws.made.round() == rounds_now + 2  # every replay drew its own round


@INTERPRETED
@pytest.mark.parametrize("frame_stack", [None, 3])
def test_burn_in_batches_leave_the_graphs_for_the_fused_walk(frame_stack):
    """A burn-in is never graphed: with graphs captured, a burn-in batch comes from the general
    path, whose fused kernel walks the draw, and agrees with the stored episodes."""
    from test_burn_in import expected_sequences

    with stand_in_graphs():
        buf = SyncEpisodeReplayBuffer(
            60, device="cpu", storing_device="cpu", storage="tensor", seed=0,
            frame_stack=frame_stack,
        )  # fmt: skip
        p = Program(buf)
        with buf:
            rounds(p, 3)
            keys = graph_keys(p)
            assert ("sequences", 6, 4, True) in keys
            replays = sum(e.graph.replays for e in buf._draws.made._entries.values())
            walks = mock.patch("replaybuf.sampling.draws.fused_sequences", wraps=fused.sequences)
            with walks as walked:
                for strict in (True, False):
                    for _ in range(CAPTURE_AT + 1):
                        batch = buf.sample_sequences(6, 4, strict=strict, burn_in=3)
                        expected_sequences(buf, batch, 3, 4)
            assert walked.call_count == 2 * (CAPTURE_AT + 1)
            assert graph_keys(p) == keys
            assert sum(e.graph.replays for e in buf._draws.made._entries.values()) == replays
