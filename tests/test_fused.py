"""The fused kernels (:mod:`replaybuf.accel.fused`) against the torch ops they replace.

On the CPU the kernels run in Triton's interpreter, which must be switched on before Triton is
imported: :func:`test_the_kernel_in_the_interpreter` runs the interpreted tests below in a
child process with ``TRITON_INTERPRET=1``. Buffers read their bookkeeping through device copies
(``mirrored``), so that sampling takes CUDA storage's path, on the CPU. On a GPU the same
comparison runs on CUDA storage (``test_cuda.py`` checks whole programs against the reference
model there).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from episode_helpers import mirrored
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tensordict import TensorDictBase

import replaybuf.accel.fused as fused
from replaybuf import SyncEpisodeReplayBuffer
from replaybuf.accel.fused import common as fused_common
from replaybuf.accel.fused import sequence_walk, strict_redraw, windows
from replaybuf.core.index import full_sequence_starts, stack_rows
from replaybuf.errors import EmptyBufferError
from replaybuf.sampling.draws import STRICT_TRIES, draw_sequences
from replaybuf.sampling.nstep import NStepBuilder, host_views_apply
from replaybuf.sampling.sequences import sequence_batch
from replaybuf.sampling.windows import window_math

# An episode: its length and how it ends (None: still running).
episodes = st.lists(
    st.tuples(st.integers(1, 9), st.sampled_from(["terminated", "truncated", None])),
    min_size=1,
    max_size=8,
)


def nstep_batch(core, start, n, gamma, device, generator, table=None):
    """The general n-step builder's batch of anchors ``start`` (places in ``table``)."""
    math = window_math(core)
    builder = NStepBuilder(core, device, math, host_views_apply(core, device, math))
    return builder.batch(start, n, gamma, generator, table)


def filled(
    layout: list[tuple[int, str | None]],
    dtype: torch.dtype,
    capacity: int,
    device: str,
    frame_stack: int | None = None,
) -> SyncEpisodeReplayBuffer:
    """A buffer holding ``layout``'s episodes, two at a time interleaved (rows not contiguous),
    evicting the oldest when ``capacity`` steps are exceeded."""
    buf = SyncEpisodeReplayBuffer(
        capacity, device=device, storing_device=device, storage="tensor", seed=0,
        frame_stack=frame_stack,
    )  # fmt: skip
    g = torch.Generator().manual_seed(len(layout))
    for pair in range(0, len(layout), 2):
        running = [(buf.start_episode(), *spec) for spec in layout[pair : pair + 2]]
        for t in range(max(length for _, length, _ in running)):
            for episode, length, _ in running:
                if t < length:
                    reward = torch.randn((), generator=g, dtype=dtype)
                    buf.append_observation_action_reward(episode, torch.full((3,), t), t, reward)
        for episode, length, end in running:
            if end is not None:
                buf.end_episode(episode, end, final_observation=torch.full((3,), length))
    return buf


def assert_same(want: TensorDictBase, got: TensorDictBase) -> None:
    """Equal batches; returns and discounts to rounding (the kernel may fuse a product and a
    sum, and CUDA's sum may add in another order)."""
    assert set(want.keys(True, True)) == set(got.keys(True, True))
    for key in want.keys(True, True):
        a, b = want.get(key), got.get(key)
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), key
        if a.dtype == torch.float64:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=str(key))
        elif a.dtype.is_floating_point:  # float32 sums of up to ~50 rewards of order 1
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=str(key))
        else:
            assert torch.equal(a, b), (key, a, b)


def generator(device: torch.device) -> torch.Generator:
    """The same draws (a random n) for both paths, on the device that draws them."""
    return torch.Generator(device=device).manual_seed(2)


class Counting:
    """Counts the launches (their program counts) of one of ``fused``'s kernels while on
    (``name`` in ``module``, the module that launches it)."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name, self.calls = module, name, []
        self.kernel = getattr(module, name)

    def __getitem__(self, grid: tuple[int]) -> object:
        self.calls.append(grid[0])
        return self.kernel[grid]

    def __enter__(self) -> list[int]:
        setattr(self.module, self.name, self)
        return self.calls

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.kernel)


def torch_ops() -> mock._patch_dict:
    """The kernels switched off (``REPLAYBUF_TRITON=0``) inside."""
    return mock.patch.dict(os.environ, {fused.TRITON_ENV: "0"})


def compare(
    buf: SyncEpisodeReplayBuffer, n: int | tuple[int, int], gamma: float, batch: int = 64
) -> list[int]:
    """Asserts that the same anchors through the kernel and through the torch ops give the
    same batch (frame stacks too, where the buffer stacks), both from anchor rows and from
    places in the packed anchor rows (a uniform draw, looked up in the kernel); returns the
    n-step kernel's launches (their program counts)."""
    core = buf._core
    g = torch.Generator(device=buf.device).manual_seed(1)
    places, table = core.anchors.draw_places(batch, g)
    start = table.index_select(0, places)
    with Counting(windows, "_nstep_windows_kernel") as calls, torch_ops():
        want = nstep_batch(core, start, n, gamma, buf.device, generator(buf.device))
        looked_up = nstep_batch(core, places, n, gamma, buf.device, generator(buf.device), table)
    assert not calls
    assert_same(want, looked_up)
    with Counting(windows, "_nstep_windows_kernel") as calls:
        got = nstep_batch(core, start, n, gamma, buf.device, generator(buf.device))
        picked = nstep_batch(core, places, n, gamma, buf.device, generator(buf.device), table)
    assert_same(want, got)
    assert_same(want, picked)
    return calls


def compare_sequences(
    buf: SyncEpisodeReplayBuffer, length: int, strict: bool, batch: int, device_draws: bool
) -> list[int]:
    """Asserts that a sequence draw through the kernel and the batch built from it match the
    torch ops on the same anchors (and, not strict, that both draw the same anchors; strict,
    that each slot took the first of its draws with ``length`` steps ahead, where it had one);
    returns the sequence kernel's launches. ``device_draws``: the buffer's own draw (the
    device draws, and a strict draw's redraw on the device), else the generator's."""
    core, device = buf._core, buf.device
    draw = None
    if device_draws:
        draw = lambda shape: buf._draws.places(core, shape, buf._generator)  # noqa: E731
    with torch_ops():
        qualify = full_sequence_starts(core.anchors.snapshot(), length, core.links.succ)
    if strict and not qualify.any():
        before = buf._draws.state_dict()
        for switch in (contextlib.nullcontext(), torch_ops()):
            with switch, pytest.raises(EmptyBufferError, match="consecutive steps"):
                draw_sequences(core, batch, length, True, generator(device), draw)
        assert buf._draws.state_dict() == before  # nothing drawn
        return []
    with Counting(sequence_walk, "_sequence_kernel") as calls:
        start, weight, walk = draw_sequences(core, batch, length, strict, generator(device), draw)
        got = sequence_batch(core, start, length, device, walk, full=strict)
        from_start = sequence_batch(core, start, length, device, None, full=strict)
    assert weight is None
    assert walk is not None
    with torch_ops():
        torch_start, _, torch_walk = draw_sequences(core, batch, length, strict, generator(device))
        want = sequence_batch(core, start, length, device, None, full=strict)
    assert torch_walk is None
    assert_same(want, got)
    assert_same(want, from_start)
    if not strict:
        if not device_draws:
            assert torch.equal(torch_start, start)
        return calls
    assert full_sequence_starts(start, length, core.links.succ).all()
    assert walk.found is not None
    assert bool(walk.found.all())
    if device_draws:
        return calls  # the places are the draw kernel's (test_graphs.py checks those)
    picks = torch.randint(
        0, core.anchors.count, (batch, STRICT_TRIES), generator=generator(device), device=device
    )
    candidates = core.anchors.rows[picks]
    ok = full_sequence_starts(candidates.reshape(-1), length, core.links.succ).view(picks.shape)
    had = ok.any(1)
    first = candidates.gather(1, ok.int().argmax(1, keepdim=True)).squeeze(1)
    assert torch.equal(start[had], first[had])
    return calls


def launches(batch: int) -> list[int]:
    """One launch of one program per BLOCK anchors; none for an empty batch."""
    return [fused.triton_cdiv(batch, fused.BLOCK)] if batch else []


CHILD = "REPLAYBUF_TEST_FUSED_CHILD"  # set in the child: it never starts another
INTERPRETED = pytest.mark.skipif(
    not fused.INTERPRET, reason="runs in a child process with TRITON_INTERPRET=1"
)


@INTERPRETED
@settings(max_examples=60, deadline=None)
@given(
    layout=episodes,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    capacity=st.integers(24, 60),  # room for the two episodes being written
    n=st.one_of(
        st.integers(1, 12),
        st.tuples(st.integers(1, 3), st.integers(1, 6)).filter(lambda n: n[0] <= n[1]),
    ),
    gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    batch=st.sampled_from([1, 64, 129, 300]),  # BLOCK is 128: one to three programs
    frame_stack=st.sampled_from([None, 1, 3]),
)
def test_the_kernel_matches_the_torch_ops(layout, dtype, capacity, n, gamma, batch, frame_stack):
    with mirrored():
        buf = filled(layout, dtype, capacity, "cpu", frame_stack)
    with buf:
        buf._core.flush()
        if buf._core.anchors.count == 0:
            return  # nothing to sample yet (one running episode of one step, say)
        assert compare(buf, n, gamma, batch) == launches(batch) * 2


@INTERPRETED
def test_an_empty_batch_launches_nothing():
    with mirrored():
        buf = filled([(5, "terminated")], torch.float32, 20, "cpu")
    with buf:
        buf._core.flush()
        assert compare(buf, 3, 0.9, batch=0) == []


@INTERPRETED
def test_the_kernel_declines_what_it_does_not_take():
    """2-D, integer, float16 and strided rewards, int32 or strided rows, outputs past int32
    offsets and REPLAYBUF_TRITON=0 leave the batch to the torch ops."""
    start = torch.zeros(4, dtype=torch.long)
    with mirrored():
        buf = filled([(5, "terminated")], torch.float32, 20, "cpu")
    with buf:
        links = buf._core.links
        assert fused.nstep_windows(start, 2, 2, 0.9, links, torch.zeros(20)) is not None
        assert fused.nstep_windows(start, 2, 2, 0.9, links, torch.zeros(20, 2)) is None
        for rewards in (
            torch.zeros(20, dtype=torch.int64),
            torch.zeros(20, dtype=torch.float16),
            torch.zeros(40)[::2],  # not contiguous
        ):
            assert fused.nstep_windows(start, 2, 2, 0.9, links, rewards) is None
        rewards = torch.zeros(20)
        assert fused.nstep_windows(start.int(), 2, 2, 0.9, links, rewards) is None
        assert fused.nstep_windows(start.repeat(2)[::2], 2, 2, 0.9, links, rewards) is None
        prev_row = torch.full((20,), -1)
        assert fused.stack_rows(start, 3, prev_row) is not None
        assert fused.stack_rows(start.int(), 3, prev_row) is None
        assert fused.stack_rows(start, 3, prev_row.int()) is None
        walk_draws = start.unsqueeze(1)
        assert fused.sequences(walk_draws, None, 3, links, strict=False) is not None
        with mock.patch.object(fused_common, "int32_offsets", return_value=False):  # too big
            assert fused.nstep_windows(start, 2, 2, 0.9, links, rewards) is None
            assert fused.stack_rows(start, 3, prev_row) is None
            assert fused.sequences(walk_draws, None, 3, links, strict=False) is None
        os.environ[fused.TRITON_ENV] = "0"
        try:
            assert fused.nstep_windows(start, 2, 2, 0.9, links, torch.zeros(20)) is None
            assert fused.sequences(walk_draws, None, 3, links, strict=False) is None
        finally:
            del os.environ[fused.TRITON_ENV]


@INTERPRETED
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6),
    k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(1,), (2, 9), (2, 150)]),  # one or three programs of BLOCK rows
)
def test_the_stack_kernel_matches_the_torch_ops(lengths, k, seed, shape):
    """Frame-stack rows over episodes laid out in shuffled rows (prev_row -1 at each first)."""
    g = torch.Generator().manual_seed(seed)
    place = torch.randperm(sum(lengths), generator=g)  # row of the i-th step overall
    prev_row = torch.full((sum(lengths),), -1, dtype=torch.long)
    first = 0
    for length in lengths:
        steps = place[first : first + length]
        prev_row[steps[1:]] = steps[:-1]
        first += length
    rows = torch.randint(0, sum(lengths), shape, generator=g)
    got = fused.stack_rows(rows, k, prev_row)
    assert got is not None
    want = stack_rows(rows, k, prev_row)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), (a, b)


@INTERPRETED
@settings(max_examples=60, deadline=None)
@given(
    layout=episodes,
    capacity=st.integers(24, 60),
    length=st.integers(1, 12),
    strict=st.booleans(),
    batch=st.sampled_from([1, 64, 129, 300]),
    frame_stack=st.sampled_from([None, 2]),
    device_draws=st.booleans(),
)
def test_the_sequence_kernel_matches_the_torch_ops(
    layout, capacity, length, strict, batch, frame_stack, device_draws
):
    with mirrored():
        buf = filled(layout, torch.float32, capacity, "cpu", frame_stack)
    with buf:
        buf._core.flush()
        if buf._core.anchors.count == 0:
            return
        calls = compare_sequences(buf, length, strict, batch, device_draws)
        # the draw, a redraw of slots with no fitting start among their draws (on the
        # device: always launched, walking only those slots), the walk of given anchors
        programs = [fused.triton_cdiv(batch, fused.sequence_tile(length)[1])]
        if strict and device_draws and calls:
            assert calls == programs * 3
        else:
            assert calls in ([], programs * 2, programs * 3)


def fitting(layout: list[tuple[int, str | None]], capacity: int) -> tuple[Any, torch.Tensor]:
    """A mirrored CPU buffer holding ``layout`` (flushed), and its anchors with 3 steps ahead."""
    with mirrored():
        buf = filled(layout, torch.float32, capacity, "cpu")
    core = buf._core
    core.flush()
    anchors = core.anchors.snapshot()
    return buf, anchors[full_sequence_starts(anchors, 3, core.links.succ)]


@INTERPRETED
@pytest.mark.parametrize("few", [False, True])
def test_strict_sequence_draws_in_the_kernel_are_uniform(few):
    """Over the anchors with 3 steps ahead: 9 of 13 (a slot's first draw mostly fits), and 3
    of 155 (slots mostly find none among their 8 draws and are drawn again)."""
    layout = [(1, "terminated")] * 150 + [(5, "truncated")] if few else [(9, None), (6, None)]
    buf, fitting_rows = fitting(layout, 200)
    with buf:
        core = buf._core
        fits = fitting_rows.tolist()
        assert len(fits) == (3 if few else 9)
        g = torch.Generator().manual_seed(4)
        counts = Counter()
        with Counting(sequence_walk, "_sequence_kernel") as calls:
            for _ in range(10):
                start, _, walk = draw_sequences(core, 300, 3, True, g)
                assert walk is not None
                assert bool(walk.mask.all())
                counts.update(start.tolist())
        assert set(counts) == set(fits)
        assert chisquare([counts[row] for row in fits]).pvalue > 0.001
        assert len(calls) == (20 if few else 10)  # few: every batch has slots drawn again


@INTERPRETED
@pytest.mark.parametrize("few", [False, True])
def test_strict_draws_redrawn_on_the_device_are_uniform(few, monkeypatch):
    """The buffer's strict draws (device draws, the redraw in the kernels, no host sync) over
    the anchors with 3 steps ahead: 9 of 13, and 9 of 165 in three episodes between one-step
    ones (most slots redrawn). The redraw's scan is cut into 4 parts of 8-anchor steps, so
    that the 9 lie in several parts and steps."""
    monkeypatch.setattr(strict_redraw, "PARTS", 4)
    monkeypatch.setattr(strict_redraw, "SCAN", 8)
    spaced = ([(1, "terminated")] * 50 + [(5, "truncated")]) * 3
    buf, fits = fitting(spaced if few else [(9, None), (6, None)], 400)
    with buf:
        core = buf._core
        owners, steps = core.links.episode[fits].tolist(), core.links.step[fits].tolist()
        want = set(zip(owners, steps, strict=True))
        assert len(want) == 9
        counts: Counter = Counter()
        picking = Counting(strict_redraw, "_pick_kernel")
        with picking as picks, Counting(strict_redraw, "_count_full_kernel") as parts:
            for _ in range(12):
                batch = buf.sample_sequences(40, 3)
                assert bool(batch["mask"].all())
                first = batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist()
                counts.update(zip(*first, strict=True))
        assert set(counts) == want
        assert chisquare(list(counts.values())).pvalue > 0.001
        assert picks == [40] * 12  # one program per slot, every batch
        assert parts == [4] * 12
        # not strict: every slot takes its one draw, and no redraw is launched
        with Counting(strict_redraw, "_pick_kernel") as picks:
            buf.sample_sequences(40, 3, strict=False)
        assert picks == []


def compiled_on_cuda(test: Any) -> Any:
    """The marks of a test of the compiled kernels: a GPU test, with CUDA and Triton."""
    test = pytest.mark.skipif(fused_common.triton is None, reason="needs Triton")(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    return pytest.mark.gpu(test)


GRAPHS = str(Path(__file__).with_name("test_graphs.py"))  # its interpreted tests too


def test_the_kernel_in_the_interpreter():
    """The tests above (and test_graphs.py's), in a child process where Triton's interpreter
    is on."""
    pytest.importorskip("triton")
    if fused.INTERPRET or CHILD in os.environ:
        pytest.skip("already in the interpreter's child process")
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, GRAPHS],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # The interpreted tests ran: none was skipped for want of the interpreter (-ra lists skips).
    assert re.search(r"^\d+ passed", done.stdout, re.MULTILINE), done.stdout[-2000:]
    assert "runs in a child process" not in done.stdout, done.stdout[-2000:]


@compiled_on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3, (1, 4), 20])
def test_the_compiled_kernel_matches_the_torch_ops_on_cuda(dtype, n):
    layout = [(9, "terminated"), (4, None), (7, "truncated"), (1, "terminated"), (12, None)]
    with filled(layout, dtype, 30, "cuda") as buf:
        buf._core.flush()
        assert compare(buf, n, 0.9) == launches(64) * 2


def test_outputs_past_int32_offsets_are_declined():
    """The kernels index their outputs in int32: 2^31 elements an output is one too many."""
    assert fused_common.int32_offsets(2**31 - 1)
    assert not fused_common.int32_offsets(2**31)


@pytest.mark.parametrize(
    ("capability", "builds"), [((6, 1), False), ((7, 0), True), ((9, 0), True)]
)
def test_gpus_triton_does_not_build_for_keep_the_torch_ops(monkeypatch, capability, builds):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    fused_common.triton_compiles_for.cache_clear()
    try:
        assert fused_common.triton_compiles_for(0) is builds
    finally:
        fused_common.triton_compiles_for.cache_clear()


@compiled_on_cuda
@pytest.mark.parametrize("device_draws", [False, True])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("length", [80, 300, 1000])
def test_long_sequences_in_the_compiled_kernel_match_the_torch_ops(strict, length, device_draws):
    # Rows of one slot span several warps: the guessed rows, a break and the walk from it,
    # and an episode end all land in one program.
    layout = [(1200, "terminated"), (700, None), (90, "truncated"), (400, None)]
    with filled(layout, torch.float32, 2_000, "cuda") as buf:
        buf._core.flush()
        core = buf._core
        with torch_ops():
            fits = full_sequence_starts(core.anchors.snapshot(), length, core.links.succ).any()
        calls = compare_sequences(buf, length, strict, 64, device_draws)
    # strict with no episode that long: both paths raise and nothing launches
    programs = [fused.triton_cdiv(64, fused.sequence_tile(length)[1])]
    assert calls[:1] == ([] if strict and not fits else programs)


@compiled_on_cuda
@pytest.mark.parametrize("device_draws", [False, True])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("length", [1, 4, 13])
def test_the_compiled_sequence_kernel_matches_the_torch_ops_on_cuda(strict, length, device_draws):
    layout = [(9, "terminated"), (4, None), (7, "truncated"), (1, "terminated"), (12, None)]
    with filled(layout, torch.float32, 30, "cuda") as buf:
        buf._core.flush()
        calls = compare_sequences(buf, length, strict, 200, device_draws)
        # strict with no episode of 13 steps: both paths raise, nothing launches
        programs = [fused.triton_cdiv(200, fused.sequence_tile(length)[1])]
        assert calls[:1] == ([] if strict and length > 12 else programs)
