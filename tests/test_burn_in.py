"""``sample_sequences(..., burn_in=k)``: the k steps before each sequence, checked against whole
episodes read back with ``get_episode`` and indexed by hand.

A batch is ``[B, k + L]``: position ``k`` is the drawn start (step t of episode e), position j
is step ``t - k + j``. A step that does not exist (before the episode's first, or past its last
valid step) is padding: ``mask`` False, zeros, ``step`` and ``episode_id`` -1, no end flags.
The draw must be the one a call without a burn-in makes: from the same generator state, the
last L positions are that call's batch, and the generator ends in the same state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from episode_helpers import mirrored
from episode_program import Program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from test_cuda import PLACEMENTS, Arrived

from replaybuf import (
    ArgumentError,
    ArgumentTypeError,
    EpisodeReplayBuffer,
    Field,
    SyncEpisodeReplayBuffer,
)
from replaybuf.sampling.sequences import rows_before, rows_before_by_episode

STEP_FIELDS = ("observation", "action", "reward", "next_observation", "logp", "flag")


def expected_sequences(
    buf: SyncEpisodeReplayBuffer, batch: TensorDictBase, burn_in: int, length: int
) -> None:
    """Every row of ``batch`` equals the steps around its start, read from ``get_episode``."""
    assert batch.batch_size == (batch.batch_size[0], burn_in + length)
    records: dict[int, TensorDict] = {}
    for b in range(batch.batch_size[0]):
        e, t = int(batch["episode_id"][b, burn_in]), int(batch["step"][b, burn_in])
        if e not in records:
            records[e] = buf.get_episode(e)
        record = records[e]
        steps = int(record["length"])
        terminated, truncated = bool(record["terminated"]), bool(record["truncated"])
        valid = steps if terminated or truncated else steps - 1
        assert 0 <= t < valid, f"row {b} starts at ({e}, {t}), not a valid step"
        for j in range(burn_in + length):
            s = t - burn_in + j
            where = f"row {b} position {j}: episode {e} step {s}"
            real = 0 <= s < valid
            assert bool(batch["mask"][b, j]) == real, where
            if burn_in:
                assert bool(batch["is_burn_in"][b, j]) == (j < burn_in), where
            if not real:
                assert int(batch["step"][b, j]) == -1, where
                assert int(batch["episode_id"][b, j]) == -1, where
                assert not batch["terminated"][b, j], where
                assert not batch["truncated"][b, j], where
                for key in STEP_FIELDS:
                    if key in batch:
                        assert not batch[key][b, j].any(), f"{where}: {key} not zero"
                continue
            assert int(batch["step"][b, j]) == s, where
            assert int(batch["episode_id"][b, j]) == e, where
            last = s + 1 == steps
            assert bool(batch["terminated"][b, j]) == (terminated and last), where
            assert bool(batch["truncated"][b, j]) == (truncated and last), where
            want = {
                "observation": record["observation"][s],
                "next_observation": record["observation"][s + 1],
                "action": record["action"][s],
                "reward": record["reward"][s],
            }
            for name in ("logp", "flag"):
                if name in record:
                    want[name] = record[name][s]
            for key, value in want.items():
                assert torch.equal(batch[key][b, j], value), f"{where}: {key}"


def same_draw(
    buf: SyncEpisodeReplayBuffer, batch_size: int, length: int, strict: bool, burn_in: int
) -> TensorDictBase:
    """A burn-in batch, after checking that a call without burn-in from the same generator
    state draws the same starts (its batch is the burn-in batch's last ``length`` positions)
    and leaves the generator in the same state."""
    generator = buf._generator
    before = generator.get_state().clone()
    plain = buf.sample_sequences(batch_size, length, strict=strict)
    after = generator.get_state().clone()
    generator.set_state(before)
    batch = buf.sample_sequences(batch_size, length, strict=strict, burn_in=burn_in)
    assert torch.equal(generator.get_state(), after)
    tail = batch[:, burn_in:]
    assert set(tail.keys(True, True)) - set(plain.keys(True, True)) <= {"is_burn_in"}
    for key in plain.keys(True, True):
        assert torch.equal(tail[key], plain[key]), key
    if "weight" in plain:  # prioritized: the start's id and weight, at every position
        assert torch.equal(batch["weight"], plain["weight"][:, :1].expand_as(batch["weight"]))
        assert torch.equal(batch["index"], plain["index"][:, :1].expand_as(batch["index"]))
    return batch


operations = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("append"), st.integers(0, 30), st.integers(1, 5)),
    st.tuples(st.just("append"), st.integers(0, 30), st.integers(1, 5)),
    st.tuples(
        st.just("append_batch"),
        st.lists(st.integers(0, 30), min_size=1, max_size=3),
        st.integers(1, 3),
    ),
    st.tuples(st.just("end"), st.integers(0, 30), st.sampled_from(["terminated", "truncated"])),
)
stacks = st.sampled_from([(None, "reset"), (1, "reset"), (3, "reset"), (3, "zero")])


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    max_steps=st.integers(2, 12),
    ops=st.lists(operations, min_size=3, max_size=25),
    stack=stacks,
    prioritized=st.booleans(),
    torch_index=st.booleans(),
    data=st.data(),
)
def test_burn_in_steps_agree_with_the_stored_episodes(
    make_episode_buffer, max_steps, ops, stack, prioritized, torch_index, data
):
    frame_stack, padding = stack
    kwargs: dict[str, Any] = {"frame_stack": frame_stack, "prioritized": prioritized}
    if frame_stack is not None:
        kwargs["frame_stack_padding"] = padding
    if torch_index:  # CUDA storage's path (device copies, torch index math), on the CPU
        with mirrored():
            buf = make_episode_buffer(max_steps, 6, storage="tensor", **kwargs)
    else:
        buf = make_episode_buffer(max_steps, 6, **kwargs)
    program = Program(buf)
    for name, *args in ops:
        getattr(program, name)(*args)
    if not program.ref.valid_steps:
        return
    if prioritized:  # unequal priorities, so that the draw is not uniform
        everything = buf.sample_n_step(len(buf), replace=False)
        ranks = torch.arange(1, everything.batch_size[0] + 1, dtype=torch.float64)
        buf.update_priorities(everything["index"], ranks)
    length = data.draw(st.integers(1, min(4, max_steps)), "length")
    strict = data.draw(st.booleans(), "strict") and bool(program.ref.sequence_starts(length))
    burn_in = data.draw(st.integers(0, max_steps), "burn_in")
    batch = same_draw(buf, 6, length, strict, burn_in)
    expected_sequences(buf, batch, burn_in, length)
    if not burn_in:
        assert "is_burn_in" not in batch


@pytest.mark.parametrize("strict", [True, False])
def test_burn_in_zero_is_the_batch_without_one(make_episode_buffer, strict):
    buf = make_episode_buffer(50, seed=3)
    program = Program(buf)
    for _ in range(3):
        program.append(0, 6)
        program.end(0, "truncated")
    program.append(0, 3)
    generator = buf._generator
    before = generator.get_state().clone()
    plain = buf.sample_sequences(8, 3, strict=strict)
    generator.set_state(before)
    zero = buf.sample_sequences(8, 3, strict=strict, burn_in=0)
    assert list(zero.keys(True, True)) == list(plain.keys(True, True))
    assert (zero == plain).all()


def test_a_worked_example(make_episode_buffer):
    """One 5-step episode; every start of 2 steps with a burn-in of 3 (see the docs)."""
    buf = make_episode_buffer(50)
    ep = buf.start_episode()
    for t in range(5):
        buf.append_observation_action_reward(ep, torch.tensor([float(t)]), t, float(t))
    buf.end_episode(ep, "terminated", torch.tensor([5.0]))
    batch = buf.sample_sequences(64, 2, burn_in=3)  # strict: starts 0 .. 3
    rows = {tuple(steps) for steps in batch["step"].tolist()}
    assert rows == {(-1, -1, -1, 0, 1), (-1, -1, 0, 1, 2), (-1, 0, 1, 2, 3), (0, 1, 2, 3, 4)}
    for b in range(64):
        step = batch["step"][b]
        assert torch.equal(batch["mask"][b], step >= 0)
        assert torch.equal(batch["action"][b], torch.where(step >= 0, step, 0))
        assert batch["is_burn_in"][b].tolist() == [True] * 3 + [False] * 2
    assert bool(batch["terminated"][:, -1].any())  # the start at step 3 reaches the end


@pytest.mark.parametrize("frame_stack", [None, 2])
@pytest.mark.parametrize("torch_index", [False, True])
def test_rows_before_from_prev_row_and_from_the_episode_lists_agree(
    make_episode_buffer, frame_stack, torch_index
):
    """The two ways :func:`rows_before` finds the steps before a start: along ``prev_row``
    (kept with frame stacking) and from the episodes' row lists."""
    if torch_index:
        with mirrored():
            buf = make_episode_buffer(60, 8, storage="tensor", frame_stack=frame_stack)
    else:
        buf = make_episode_buffer(60, 8, frame_stack=frame_stack)
    program = Program(buf)
    for _ in range(4):  # interleaved episodes, so that an episode's rows are not contiguous
        program.append_batch([0, 1, 2], 3)
        program.end(1, "terminated")
        program.start("a")
    program.append_batch([0, 1], 2)
    buf._core.flush()
    core = buf._core
    start = core.anchors.snapshot()
    for count in (1, 4, 9):
        rows, real = rows_before(core, start, count)
        by_episode = rows_before_by_episode(core, start, count)
        assert torch.equal(rows, by_episode[0])
        assert torch.equal(real, by_episode[1])
        links = core.links
        step = links.step.index_select(0, start)
        episode = links.episode.index_select(0, start)
        for j in range(count):  # each real row is the step count - j before, same episode
            at = rows[:, j]
            back = count - j
            assert torch.equal(real[:, j], step >= back)
            ok = real[:, j]
            assert torch.equal(links.step.index_select(0, at)[ok], (step - back)[ok])
            assert torch.equal(links.episode.index_select(0, at)[ok], episode[ok])
            assert torch.equal(links.step.index_select(0, at)[~ok], torch.zeros_like(at[~ok]))


@pytest.mark.parametrize("bad", [-1, -(2**70)])
def test_a_negative_burn_in_is_refused_leaving_the_generator(make_episode_buffer, bad):
    refused(make_episode_buffer, bad, ArgumentError, ">= 0")


@pytest.mark.parametrize("bad", [1.5, "2", True, None, np.float32(2.0), torch.tensor(2)])
def test_a_burn_in_that_is_no_int_is_refused_leaving_the_generator(make_episode_buffer, bad):
    refused(make_episode_buffer, bad, ArgumentTypeError, "be an int")


def test_a_burn_in_over_max_steps_is_refused_leaving_the_generator(make_episode_buffer):
    refused(make_episode_buffer, 13, ArgumentError, "<= 12 \\(max_steps")
    refused(make_episode_buffer, 2**70, ArgumentError, "<= 2\\*\\*63 - 1")


def refused(make_episode_buffer, bad: Any, error: type[Exception], match: str) -> None:
    buf = make_episode_buffer(12)
    Program(buf).append(0, 6)
    before = buf._generator.get_state().clone()
    with pytest.raises(error, match=f"burn_in must .*{match}") as caught:
        buf.sample_sequences(4, 2, burn_in=bad)
    assert caught.value.argument == "burn_in"
    assert torch.equal(buf._generator.get_state(), before)
    assert buf.sample_sequences(4, 2, burn_in=np.int64(12)).batch_size == (4, 14)  # numpy ints


def test_the_largest_burn_in_is_max_steps(make_episode_buffer):
    buf = make_episode_buffer(6)
    program = Program(buf)
    program.append(0, 6)
    program.end(0, "terminated")
    batch = buf.sample_sequences(5, 1, burn_in=6)
    expected_sequences(buf, batch, 6, 1)
    assert not batch["mask"][:, 0].any()  # six steps before a start never exist here


def test_burn_in_in_torchrl_layout(make_episode_buffer):
    buf = make_episode_buffer(40)
    program = Program(buf)
    program.append(0, 7)
    program.end(0, "terminated")
    batch = buf.sample_sequences(4, 3, strict=False, burn_in=2, layout="torchrl")
    assert batch.batch_size == (4, 5)
    assert batch["is_burn_in"][:, :2].all()
    assert not batch["is_burn_in"][:, 2:].any()
    assert batch["next", "reward"].shape == (4, 5, 1)
    both = batch["mask"][:, :-1] & batch["mask"][:, 1:]  # steps t and t + 1 both real
    assert torch.equal(
        batch["next", "observation"][:, :-1][both], batch["observation"][:, 1:][both]
    )


def test_burn_in_of_ragged_and_text_fields(make_episode_buffer):
    spec = {"observation": {"tokens": Field.ragged(torch.int64)}, "extras": {"note": "text"}}
    buf = make_episode_buffer(40, spec=spec)
    ep = buf.start_episode()
    for t in range(4):
        tokens = [t + 1] * (t % 3 + 1)
        buf.append_observation_action_reward(ep, {"tokens": tokens}, t, 0.0, {"note": f"s{t}"})
    buf.end_episode(ep, "terminated", {"tokens": [9]})
    batch = buf.sample_sequences(16, 2, burn_in=2)
    for b in range(16):
        for j in range(4):
            s = int(batch["step"][b, j])
            tokens = batch["observation", "tokens"][b, j]
            count = int(batch["observation", "tokens_length"][b, j])
            if s < 0:
                assert count == 0
                assert not tokens.any()
                assert batch["note"][b][j] is None
            else:
                assert count == s % 3 + 1
                assert tokens[:count].tolist() == [s + 1] * count
                assert not tokens[count:].any()
                assert batch["note"][b][j] == f"s{s}"


def test_the_asyncio_buffer_passes_burn_in_on(tmp_path):
    async def main() -> TensorDictBase:
        async with EpisodeReplayBuffer(40, scratch_dir=tmp_path, seed=0) as buf:
            ep = await buf.start_episode()
            for t in range(5):
                await buf.append_observation_action_reward(ep, torch.tensor([float(t)]), t, 1.0)
            await buf.end_episode(ep, "truncated", torch.tensor([5.0]))
            return await buf.sample_sequences(3, 2, burn_in=4)

    batch = asyncio.run(main())
    assert batch.batch_size == (3, 6)
    assert torch.equal(batch["mask"], batch["step"] >= 0)


def test_datasets_pass_burn_in_on(make_episode_buffer):
    buf = make_episode_buffer(50, seed=5)
    program = Program(buf)
    for _ in range(3):
        program.append(0, 6)
        program.end(0, "truncated")
    generator = buf._generator
    before = generator.get_state().clone()
    batch = next(iter(buf.as_dataset(8, seq_len=3, strict=False, burn_in=2)))
    generator.set_state(before)
    assert (batch == buf.sample_sequences(8, 3, strict=False, burn_in=2)).all()
    assert batch.batch_size == (8, 5)
    with pytest.raises(ArgumentError, match="burn_in applies to sequences") as info:
        buf.as_dataset(8, burn_in=2)
    assert info.value.argument == "burn_in"
    with pytest.raises(ArgumentError, match="burn_in must be <= 50"):
        buf.as_dataset(8, seq_len=3, burn_in=51)


def test_the_asyncio_buffers_dataset_passes_burn_in_on(tmp_path):
    async def main() -> TensorDictBase:
        async with EpisodeReplayBuffer(40, scratch_dir=tmp_path, seed=0) as buf:
            ep = await buf.start_episode()
            for t in range(5):
                await buf.append_observation_action_reward(ep, torch.tensor([float(t)]), t, 1.0)
            await buf.end_episode(ep, "truncated", torch.tensor([5.0]))
            return next(iter(buf.as_dataset(3, seq_len=2, burn_in=4)))

    batch = asyncio.run(main())
    assert batch.batch_size == (3, 6)
    assert batch["is_burn_in"][:, :4].all()


def rounds_with_graphs(program: Program) -> None:
    """Rounds of appends and ends, each followed by sequence batches with and without a
    burn-in (enough of the latter for graphs to capture them on CUDA storage)."""
    for _ in range(3):
        program.start("a")
    for r in range(6):
        program.append_batch([0, 1, 2], 4)
        if r % 2:
            program.end(r, "terminated")
            program.start("a")
        for strict in (True, False):
            for _ in range(4):  # past the graphs' capture of the batches without one
                program.buf.sample_sequences(6, 3, strict=strict)
                batch = program.buf.sample_sequences(6, 3, strict=strict, burn_in=4)
                expected_sequences(program.buf, batch, 4, 3)


@pytest.mark.parametrize("frame_stack", [None, 2])
def test_burn_in_between_appends_on_the_torch_index_path(tmp_path, frame_stack):
    with mirrored():
        buf = SyncEpisodeReplayBuffer(
            40, 8, storage="tensor", scratch_dir=tmp_path, seed=0, frame_stack=frame_stack
        )
    with buf:
        rounds_with_graphs(Program(buf))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("frame_stack", [None, 2])
@pytest.mark.parametrize(("device", "storing", "storage"), PLACEMENTS)
def test_burn_in_on_cuda_agrees_with_the_stored_episodes(
    tmp_path, device, storing, storage, frame_stack
):
    """On CUDA storage (the fused walk, graphs captured for the batches without a burn-in)
    and between the CPU and a GPU; every batch arrives on ``device``."""
    buf = SyncEpisodeReplayBuffer(
        40, 8, device=device, storing_device=storing, storage=storage, scratch_dir=tmp_path,
        seed=0, frame_stack=frame_stack,
    )  # fmt: skip
    with buf:
        rounds_with_graphs(Program(Arrived(buf)))  # type: ignore[arg-type]
