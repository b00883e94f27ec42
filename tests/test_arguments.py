"""Runaway and out-of-range arguments are refused by name, quickly, before anything is
allocated or drawn, with an error of replaybuf's hierarchy; the buffer, its files and its
random state stay as they were."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import resource
import time
from pathlib import Path

import pytest
import torch

import replaybuf
from replaybuf import (
    ArgumentError,
    ArgumentTypeError,
    CapacityError,
    EmptyBufferError,
    EpisodeReplayBuffer,
    IndexOutOfRangeError,
    InsufficientSpaceError,
    InvalidStateError,
    ReplayBufError,
    ReplayBuffer,
    SchemaError,
    SyncEpisodeReplayBuffer,
    UnknownFieldError,
    UnsupportedError,
)
from replaybuf.cli import main
from replaybuf.sampling import budget

HUGE = 10**12  # a batch no machine holds (10**14 bytes and more)

HIERARCHY = [
    (ArgumentError, ValueError),
    (ArgumentTypeError, TypeError),
    (IndexOutOfRangeError, IndexError),
    (UnknownFieldError, KeyError),
    (CapacityError, ValueError),
    (InvalidStateError, RuntimeError),
    (UnsupportedError, NotImplementedError),
    (InsufficientSpaceError, MemoryError),
]


@pytest.mark.parametrize(("cls", "builtin"), HIERARCHY)
def test_each_error_is_ours_and_the_builtin_it_refines(cls, builtin):
    assert issubclass(cls, ReplayBufError)
    assert issubclass(cls, builtin)
    assert getattr(replaybuf, cls.__name__) is cls
    assert cls.__name__ in replaybuf.__all__


def test_the_named_argument_survives_pickling():
    error = pickle.loads(pickle.dumps(ArgumentError("n must be <= 4, got 9", argument="n")))
    assert (type(error), str(error), error.argument) == (
        ArgumentError,
        "n must be <= 4, got 9",
        "n",
    )
    space = InsufficientSpaceError("host memory (RAM)", 10, 5, "a batch")
    space.argument = "batch_size"
    again = pickle.loads(pickle.dumps(space))
    assert (again.needed, again.free, again.what, again.argument) == (
        10,
        5,
        "a batch",
        "batch_size",
    )
    assert str(UnknownFieldError("unknown field 'x'")) == "unknown field 'x'"  # not repr'd


def test_ares_argument_error_is_the_library_one():
    from replaybuf.compat import ares

    assert ares.ArgumentError is ArgumentError
    assert issubclass(ares.ArgumentError, ReplayBufError)
    assert issubclass(ares.ArgumentError, ValueError)


# ----------------------------------------------------------------- the buffers under attack
def episodes(max_steps: int = 16, **kwargs) -> SyncEpisodeReplayBuffer:
    """Three ended 4-step episodes (12 valid steps), seeded."""
    buf = SyncEpisodeReplayBuffer(max_steps, storage="tensor", seed=7, **kwargs)
    for e in range(3):
        i = buf.start_episode()
        for t in range(4):
            buf.append_observation_action_reward(i, [float(t), 1.0], t % 2, float(e))
        buf.end_episode(i, "terminated", [9.0, 9.0])
    return buf


def ring(tmp_path: Path | None = None) -> ReplayBuffer:
    storage = {"storage": "tensor"} if tmp_path is None else {"scratch_dir": tmp_path}
    buf = ReplayBuffer("cpu", "cpu", 8, seed=7, **storage)
    for t in range(5):
        buf.add({"obs": [float(t)], "action": t, "reward": float(t)})
    return buf


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a.keys(True, True))


def refused(call, error, *names: str, seconds: float = 5.0) -> ReplayBufError:
    """``call()`` raises ``error`` naming every one of ``names``, quickly and without growing
    the process's peak memory by more than 256 MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    began = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    assert time.perf_counter() - began < seconds
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024
    assert isinstance(info.value, ReplayBufError)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    return info.value


@pytest.fixture
def eight_gib_free(monkeypatch):
    """The hostile calls' machine: 8 GiB free (so the refusals do not depend on this host)."""
    monkeypatch.setattr(budget, "free_bytes", lambda kind, device, folder: 8 << 30)


def test_runaway_n_step_calls_are_refused_by_name(eight_gib_free):
    buf, twin = episodes(), episodes()
    before = [buf.get_episode(e) for e in buf.episode_ids()]
    refused(lambda: buf.sample_n_step(4, n=2**63), ArgumentError, "n must be <= 2**63 - 1")
    error = refused(lambda: buf.sample_n_step(10**9), InsufficientSpaceError, "batch_size=")
    assert error.argument == "batch_size"
    assert error.needed > error.free == 8 << 30
    refused(lambda: buf.sample_n_step(2**62), InsufficientSpaceError, "batch_size=")
    refused(lambda: buf.sample_n_step(2**63), ArgumentError, "batch_size", "int64")
    refused(lambda: buf.sample_sequences(2, 17), EmptyBufferError, "17 consecutive steps")
    refused(
        lambda: buf.sample_sequences(2, 10**9), InsufficientSpaceError, "of 1,000,000,000 steps"
    )
    refused(lambda: buf.sample_sequences(10**9, 4), InsufficientSpaceError, "batch_size=")
    refused(lambda: buf.sample_episodes(10**9, replace=True), InsufficientSpaceError, "batch_size=")
    refused(
        lambda: next(iter(buf.as_dataset(4, seq_len=10**9))),
        InsufficientSpaceError,
        "of 1,000,000,000 steps",
    )
    # Nothing stored changed, and the generator drew nothing: the next batch is the twin's.
    assert all(same(a, buf.get_episode(e)) for a, e in zip(before, buf.episode_ids(), strict=True))
    assert same(buf.sample_n_step(4, n=16), twin.sample_n_step(4, n=16))  # n up to max_steps
    buf.close()
    twin.close()


def within_bounds(call):
    """``call()``'s result, which must come quickly and without growing the peak memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    began = time.perf_counter()
    result = call()
    assert time.perf_counter() - began < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024
    return result


def test_an_int_n_beyond_max_steps_is_clamped_to_the_same_windows(eight_gib_free):
    buf, twin = episodes(), episodes()
    for huge in (17, 10**9, 2**62):
        assert same(
            within_bounds(lambda h=huge: buf.sample_n_step(8, n=h)), twin.sample_n_step(8, n=16)
        )
    epochs = within_bounds(lambda: list(buf.iterate_epochs(4, n=10**9, shuffle=False)))
    assert all(
        same(a, b) for a, b in zip(epochs, twin.iterate_epochs(4, n=16, shuffle=False), strict=True)
    )
    # A (low, high) range is drawn as given, each n clamped: a window runs to its episode's end.
    batch = within_bounds(lambda: buf.sample_n_step(64, n=(20, 10**9)))
    assert (batch["actual_n"] == 4 - batch["start_step"]).all()
    # Padded sequences may be longer than any episode (their memory is checked as a batch's).
    padded = buf.sample_sequences(2, 20, strict=False)
    assert padded["mask"].shape == (2, 20)
    assert int(padded["mask"].sum(1).max()) <= 4
    buf.close()
    twin.close()


def test_runaway_ring_calls_are_refused_by_name(tmp_path, eight_gib_free):
    buf, twin = ring(tmp_path), ring()
    files = {
        p: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()
    }
    before = buf.sample_all()
    refused(lambda: buf.sample_batch(10**9), InsufficientSpaceError, "batch_size=")
    refused(lambda: buf.sample_batch(2**62), InsufficientSpaceError, "batch_size=")
    refused(lambda: buf.sample_batch(2**63), ArgumentError, "batch_size must be <= 2**63 - 1")
    refused(
        lambda: buf.add({"obs": [1.0], "action": 2**70, "reward": 0.0}), SchemaError, "'action'"
    )
    refused(lambda: buf.sample_by_index([2**70]), IndexOutOfRangeError, "indices")
    refused(lambda: buf.sample_by_index_fields([0], ["nope"]), UnknownFieldError, "nope")
    assert len(buf) == 5
    assert same(before, buf.sample_all())
    after = {
        p: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()
    }
    assert after == files
    assert same(buf.sample_batch(6), twin.sample_batch(6))
    buf.close()
    twin.close()


def test_an_unchecked_machine_refuses_an_impossible_batch_too():
    """Without a patched memory reading: 10**14 bytes exceed any host's free memory."""
    buf, twin = episodes(), ring()
    refused(lambda: buf.sample_n_step(HUGE), InsufficientSpaceError, "host memory")
    refused(lambda: twin.sample_batch(HUGE), InsufficientSpaceError, "host memory")
    buf.close()
    twin.close()


def test_repeated_n_step_arguments_are_checked_as_the_first_were(monkeypatch):
    """``sample_n_step`` reuses the last call's checks when a call repeats its arguments:
    every batch equals the one a buffer checking every call draws, a bool, a numpy number
    or a changed layout is checked afresh, and a batch big enough for a memory reading reads
    it on every call."""
    import numpy as np

    buf, twin = episodes(), episodes()
    calls = [(4, 2, 0.9, None)] * 3 + [(np.int64(4), 2, 0.9, None), (4, 2, 0.9, "torchrl")]
    calls += [(4, 2, np.float64(0.9), None), (4, 2, 0.9, None), (4, 3, 0.9, None)]
    for batch_size, n, gamma, layout in calls:
        twin._nstep_checked = None  # the twin checks every call
        a = buf.sample_n_step(batch_size, n=n, gamma=gamma, layout=layout)
        b = twin.sample_n_step(batch_size, n=n, gamma=gamma, layout=layout)
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        assert same(a, b)
    assert buf._nstep_checked is not None  # the last call's checks are kept
    refused(lambda: buf.sample_n_step(True, n=3, gamma=0.9), ArgumentTypeError, "batch_size")
    refused(lambda: buf.sample_n_step(4, n=True, gamma=0.9), ArgumentTypeError, "n must be")
    buf.sample_n_step(4, n=3, gamma=0.9)
    buf.layout = "torchrl"  # the buffer's default layout changed: the next batch follows it
    assert ("next", "reward") in buf.sample_n_step(4, n=3, gamma=0.9).keys(True, True)
    buf.layout = "replaybuf"
    # A numpy number's checks are not kept: a Python float it equals after rounding (here
    # above 1) is checked afresh.
    buf.sample_n_step(4, n=3, gamma=np.float32(1.0))
    refused(lambda: buf.sample_n_step(4, n=3, gamma=1.00000003), ArgumentError, "gamma")
    buf.close()
    twin.close()
    # Every batch read against the free memory: nothing is kept, the second call reads again.
    monkeypatch.setattr(budget, "ALWAYS_FITS", 0)
    free = [1 << 40]
    monkeypatch.setattr(budget, "free_bytes", lambda kind, device, folder: free[0])
    buf = episodes()
    buf.sample_n_step(4, n=3, gamma=0.9)
    assert buf._nstep_checked is None
    free[0] = 1
    refused(lambda: buf.sample_n_step(4, n=3, gamma=0.9), InsufficientSpaceError, "batch_size=")
    buf.close()


def test_a_batch_is_measured_against_the_free_memory(monkeypatch):
    """Rows x (fields + overhead) against what is free: refused above it, drawn below."""
    free = [100 << 20]
    monkeypatch.setattr(budget, "free_bytes", lambda kind, device, folder: free[0])
    buf = ring()
    refused(lambda: buf.sample_batch(1_000_000), InsufficientSpaceError, "104,857,600 are free")
    free[0] = 1 << 40
    assert buf.sample_batch(1_000_000).shape == (1_000_000,)
    buf.close()


def test_the_asyncio_buffer_takes_the_same_checks(eight_gib_free):
    async def scenario() -> None:
        buf = EpisodeReplayBuffer(16, storage="tensor", seed=3)
        i = await buf.start_episode()
        for t in range(3):
            await buf.append_observation_action_reward(i, [float(t)], t, 1.0)
        await buf.end_episode(i, "terminated", [0.0])
        with pytest.raises(ArgumentError, match=r"n\[1\] \(high\) must be <= 2\*\*63 - 1"):
            await buf.sample_n_step(4, n=(1, 2**63))
        with pytest.raises(InsufficientSpaceError, match="batch_size="):
            await buf.sample_n_step(10**9)
        with pytest.raises(ArgumentError, match="min_steps must be <= max_steps"):
            await buf.wait_for_steps(17)  # would wait forever
        await buf.close()

    asyncio.run(scenario())


# ----------------------------------------------------------------- construction, values
def test_seeds_beyond_what_a_generator_takes_are_refused_by_name():
    for make in (
        lambda s: ReplayBuffer("cpu", "cpu", 4, storage="tensor", seed=s),
        lambda s: SyncEpisodeReplayBuffer(4, storage="tensor", seed=s),
    ):
        error = refused(lambda m=make: m(2**70), ArgumentError, "seed must be <=")
        assert error.argument == "seed"
        make(2**64 - 1).close()  # torch.Generator.manual_seed's largest


def test_min_steps_above_max_steps_is_refused_naming_both():
    error = refused(
        lambda: SyncEpisodeReplayBuffer(10, min_steps=11), ArgumentError, "min_steps", "max_steps"
    )
    assert error.argument == "min_steps"
    SyncEpisodeReplayBuffer(10, min_steps=10, storage="tensor").close()


def test_appended_ints_over_int64_name_their_field():
    buf = episodes()
    i = buf.start_episode()
    refused(
        lambda: buf.append_observation_action_reward(i, [0.0, 0.0], 2**70, 0.0),
        SchemaError,
        "'action'",
    )
    refused(
        lambda: buf.append_observation_action_reward(i, [0.0, 0.0], 1, 0.0, {"k": 2**64}),
        SchemaError,
        "'extras.k'",
    )
    refused(
        lambda: buf.append_observation_action_reward(i, [0, 2**63], 1, 0.0),
        SchemaError,
        "'observation'",
        "int64",
    )
    assert buf.stats()["steps"] == 12
    buf.close()
    ring_buf = ring()
    refused(
        lambda: ring_buf.add_batch({"obs": [[1.0]], "action": [2**70], "reward": [1.0]}),
        SchemaError,
        "'action'",
        "int64",
    )
    assert len(ring_buf) == 5
    ring_buf.close()


def test_an_episode_longer_than_max_steps_is_a_capacity_error():
    buf = SyncEpisodeReplayBuffer(4, storage="tensor", seed=1)
    i = buf.start_episode()
    for t in range(4):
        buf.append_observation_action_reward(i, [float(t)], t, 1.0)
    before = buf.stats()
    error = refused(
        lambda: buf.append_observation_action_reward(i, [4.0], 4, 1.0), CapacityError, "max_steps=4"
    )
    assert error.argument == "max_steps"
    assert buf.stats() == before
    buf.close()


def test_update_priorities_length_mismatch_is_ours():
    buf = episodes(prioritized=True)
    index = buf.sample_n_step(4)["index"]
    with pytest.raises(ArgumentError, match="one value per index"):
        buf.update_priorities(index, [1.0, 2.0])
    buf.close()
    ring_buf = ReplayBuffer("cpu", "cpu", 8, storage="tensor", prioritized=True)
    ring_buf.add({"obs": [1.0]})
    with pytest.raises(ArgumentError, match="one value per index"):
        ring_buf.update_priorities([0, 0, 0], [1.0])
    ring_buf.close()


# ----------------------------------------------------------------- the command line
def test_populate_names_the_flag_an_episode_outgrows(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = ["populate", "--env", "CartPole-v1", "--steps", "50", "--max-steps", "10"]
    assert main([*args, "--seed", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "replaybuf populate: error: --max-steps: cannot make room" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("flag", [["--seed", str(2**70)], ["--steps", str(2**63)]])
def test_populate_refuses_numbers_past_their_range(tmp_path, capsys, flag):
    args = ["populate", "--env", "CartPole-v1", "--steps", "5", "--out", str(tmp_path), *flag]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert f"argument {flag[0]}: expected an integer <=" in capsys.readouterr().err
