"""ReplayBuffer.save_checkpoint / load_checkpoint / open: everything comes back, or nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from buffer_crash_helper import make_source
from replay_helpers import rows

from replaybuf import ReplayBuffer, SchemaError
from replaybuf.errors import CheckpointKindError, CorruptCheckpointError, NoCheckpointError
from replaybuf.persist.format import CRASH_ENV, read_checkpoint, write_checkpoint
from replaybuf.persist.format.names import seal

HELPER = Path(__file__).with_name("buffer_crash_helper.py")
CAPACITY = 8
# rows written before saving: empty, partial, exactly full, wrapped twice (pointer 3)
FILLS = {"empty": 0, "partial": 5, "full": 8, "wrapped_twice": 19}


def fill(buf: ReplayBuffer, count: int) -> None:
    """``count`` rows in uneven batches (and single adds), then a few samples to move the RNG."""
    start = 0
    for size in (3, 1, 6, 9, 2):
        size = min(size, count - start)
        if size == 1:
            buf.add(rows(start, 1)[0])
        elif size > 0:
            buf.add_batch(rows(start, size))
        start += max(size, 0)
    if count:
        buf.add_batch(rows(start, count - start))
        for _ in range(3):
            buf.sample_batch(4)


def contents(buf: ReplayBuffer) -> dict:
    """Every stored slot of every field, by slot (not oldest first: the layout must match)."""
    if not len(buf):
        return {}
    td = buf.sample_by_index(range(len(buf)))
    return {k: v.clone() for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_same_buffer(loaded: ReplayBuffer, original: ReplayBuffer) -> None:
    assert (loaded.size, loaded.pointer, loaded.buffer_size) == (
        original.size,
        original.pointer,
        original.buffer_size,
    )
    assert loaded.spec == original.spec
    assert (loaded.device, loaded.storing_device) == (original.device, original.storing_device)
    got, expected = contents(loaded), contents(original)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert loaded.memory.writer.state_dict() == original.memory.writer.state_dict()
    assert len(loaded.memory) == len(original.memory)


def assert_same_draws(a: ReplayBuffer, b: ReplayBuffer, calls: int = 20) -> None:
    for i in range(calls):
        x, y = a.sample_batch(5), b.sample_batch(5)
        assert (x == y).all(), f"sample_batch call {i} differs"


def scratch_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("replaybuf-*"))


@pytest.fixture
def scratch(tmp_path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


@pytest.fixture
def saved(make_buffer, tmp_path) -> tuple[ReplayBuffer, Path]:
    """A partly filled memmap buffer and its checkpoint."""
    buf = make_buffer(CAPACITY)
    fill(buf, 5)
    return buf, buf.save_checkpoint(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("case", FILLS)
def test_round_trip_restores_rows_ring_and_sampler(make_buffer, storage, scratch, tmp_path, case):
    original = make_buffer(CAPACITY, storage=storage)
    fill(original, FILLS[case])
    directory = original.save_checkpoint(tmp_path / "ckpt")
    with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as loaded:
        assert loaded.storage_kind == storage
        assert_same_buffer(loaded, original)
        if len(original):
            assert_same_draws(loaded, original)
            assert loaded.memory.sample(3)["obs"].shape == (3, 4)  # TorchRL's view works too
        more = rows(100, 5)  # later writes land in the same slots on both
        loaded.add_batch(more)
        original.add_batch(more)
        assert_same_buffer(loaded, original)
        assert_same_draws(loaded, original, calls=3)
    assert scratch_folders(scratch) == []


@pytest.mark.parametrize(
    ("saved_kind", "loaded_kind"), [("tensor", "memmap"), ("memmap", "tensor")]
)
def test_storage_override_loads_into_the_other_storage_kind(
    make_buffer, scratch, tmp_path, saved_kind, loaded_kind
):
    original = make_buffer(CAPACITY, storage=saved_kind)
    fill(original, FILLS["wrapped_twice"])
    directory = original.save_checkpoint(tmp_path / "ckpt")
    with ReplayBuffer.load_checkpoint(directory, storage=loaded_kind, scratch_dir=scratch) as buf:
        assert buf.storage_kind == loaded_kind
        assert_same_buffer(buf, original)
        assert_same_draws(buf, original)
        assert read_checkpoint(buf.save_checkpoint(tmp_path / "again")).meta["storage"] == (
            loaded_kind
        )


def test_device_overrides_change_where_batches_are_served(saved, scratch):
    original, directory = saved
    with ReplayBuffer.load_checkpoint(
        directory, device="cpu", storing_device="cpu", print_gc_warning=True, scratch_dir=scratch
    ) as buf:
        assert buf.print_gc_warning is True
        assert_same_buffer(buf, original)


def test_save_load_save_load_is_identical(saved, scratch, tmp_path):
    original, first = saved
    with ReplayBuffer.load_checkpoint(first, scratch_dir=scratch) as loaded:
        second = loaded.save_checkpoint(tmp_path / "second")
    with read_checkpoint(first) as a, read_checkpoint(second) as b:
        assert a.meta == b.meta
        assert {n: (i.shape, i.dtype, i.sha256) for n, i in a.tensors.items()} == {
            n: (i.shape, i.dtype, i.sha256) for n, i in b.tensors.items()
        }
    with ReplayBuffer.load_checkpoint(second, scratch_dir=scratch) as again:
        assert_same_buffer(again, original)
        assert_same_draws(again, original)


def test_a_spec_without_rows_comes_back(make_buffer, tmp_path, scratch):
    buf = make_buffer(CAPACITY)
    fill(buf, 3)
    buf.save(tmp_path / "meta")
    empty = make_buffer(CAPACITY)
    empty.load(tmp_path / "meta")  # adopts the spec, holds no rows
    directory = empty.save_checkpoint(tmp_path / "ckpt")
    with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as loaded:
        assert (len(loaded), loaded.spec) == (0, buf.spec)
        with pytest.raises(SchemaError, match="obs"):
            loaded.add({"obs": torch.zeros(3)})


def test_checkpoint_files_are_named_after_the_fields(saved):
    _, directory = saved
    with read_checkpoint(directory) as checkpoint:
        assert sorted(checkpoint.tensors) == [
            "rows/action",
            "rows/done",
            "rows/next/obs",
            "rows/obs",
            "rows/reward",
            "sampler/generator_state",
        ]
        assert checkpoint.tensors["rows/obs"].shape == (5, 4)
        assert checkpoint.meta["size"] == 5
        assert checkpoint.meta["pointer"] == 5


def test_fields_that_are_not_safe_file_names_round_trip(make_buffer, tmp_path, scratch):
    buf = make_buffer(4)
    buf.add_batch({"Obs": torch.ones(2, 1), "obs": torch.zeros(2, 1), "a b": torch.arange(2)})
    directory = buf.save_checkpoint(tmp_path / "ckpt")
    with read_checkpoint(directory) as checkpoint:
        assert sorted(checkpoint.tensors) == [
            "rows-by-index/1",
            "rows-by-index/2",
            "rows/Obs",
            "sampler/generator_state",
        ]
    with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as loaded:
        assert_same_buffer(loaded, buf)


# ---------------------------------------------------------------------------------------------
# open(): create or load


def test_open_creates_an_empty_buffer_then_loads_what_it_saved(tmp_path, scratch):
    directory = tmp_path / "run" / "buffer"
    kwargs = {"device": "cpu", "storing_device": "cpu", "buffer_size": CAPACITY, "seed": 3}
    with ReplayBuffer.open(directory, scratch_dir=scratch, **kwargs) as buf:
        assert len(buf) == 0
        assert not directory.exists()
        fill(buf, 11)
        assert buf.save_checkpoint() == directory
        with ReplayBuffer.open(directory, scratch_dir=scratch, **kwargs) as resumed:
            assert_same_buffer(resumed, buf)
            assert_same_draws(resumed, buf)
            resumed.add_batch(rows(50, 2))
            resumed.save_checkpoint()  # back to the same place
        with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as latest:
            assert (len(latest), latest.pointer) == (CAPACITY, (11 + 2) % CAPACITY)
    assert scratch_folders(scratch) == []


def test_open_refuses_a_checkpoint_of_another_capacity(saved, scratch):
    _, directory = saved
    with pytest.raises(ValueError, match=r"buffer_size=9, but the checkpoint .* capacity 8"):
        ReplayBuffer.open(directory, device="cpu", storing_device="cpu", buffer_size=9)
    assert scratch_folders(scratch) == []


def test_save_checkpoint_without_a_directory_needs_open(make_buffer):
    with pytest.raises(ValueError, match=r"needs a directory.*not made by open\(directory\)"):
        make_buffer().save_checkpoint()


# ---------------------------------------------------------------------------------------------
# refusals leave nothing half-made


def edit_meta(directory: Path, **changes) -> None:
    path = directory / "MANIFEST.json"
    document = json.loads(path.read_text())
    document["meta"].update(changes)
    path.write_text(json.dumps(seal(document)))


def spec_with(directory: Path, name: str, **changes) -> dict:
    spec = json.loads((directory / "MANIFEST.json").read_text())["meta"]["spec"]
    spec[name].update(changes)
    return spec


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"size": 9}, r"meta 'size' expected in \[0, 8\], got 9"),
        ({"size": -1}, r"meta 'size' expected in \[0, 8\], got -1"),
        ({"pointer": 8}, r"meta 'pointer' expected in \[0, 7\], got 8"),
        ({"pointer": 2}, r"pointer expected 5 .*not full.*got 2"),
        ({"capacity": 0}, r"meta 'capacity' expected >= 1, got 0"),
        ({"capacity": "8"}, r"meta 'capacity' expected an int, got '8'"),
        ({"storage": "disk"}, r"meta 'storage' expected 'memmap' or 'tensor', got 'disk'"),
        ({"spec": None}, r"size 5 expected 0 with no spec"),
        ({"spec": {"obs": {"shape": [4]}}}, r"meta 'spec' is malformed"),
        ({"torchrl_write_count": True}, r"'torchrl_write_count' expected an int"),
    ],
)
def test_bad_meta_is_refused_before_a_buffer_is_made(saved, scratch, changes, match):
    _, directory = saved
    edit_meta(directory, **changes)
    with pytest.raises(CorruptCheckpointError, match=match):
        ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch)
    assert scratch_folders(scratch) == []


@pytest.mark.parametrize(
    ("field", "changes", "match"),
    [
        ("obs", {"shape": [5]}, r"'obs' \(rows/obs\) expected shape \[5, 5\].*got shape \[5, 4\]"),
        ("reward", {"dtype": "torch.float64"}, r"'reward'.*dtype torch\.float64.*torch\.float32"),
    ],
)
def test_a_spec_that_disagrees_with_the_tensors_names_the_field(
    saved, scratch, field, changes, match
):
    _, directory = saved
    edit_meta(directory, spec=spec_with(directory, field, **changes))
    with pytest.raises(CorruptCheckpointError, match=match):
        ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch)
    assert scratch_folders(scratch) == []


def test_missing_and_stray_tensors_are_refused(tmp_path, scratch):
    spec = {"obs": {"key": ["obs"], "shape": [], "dtype": "torch.float32"}}
    meta = {
        "capacity": 4,
        "size": 2,
        "pointer": 2,
        "storage": "tensor",
        "device": "cpu",
        "storing_device": "cpu",
        "print_gc_warning": False,
        "torchrl_write_count": 2,
        "generator_device": "cpu",
        "spec": spec,
        "writes": 2,
        "priority": None,
    }
    state = torch.Generator().get_state()
    write_checkpoint(tmp_path / "a", "ReplayBuffer", meta, {"sampler/generator_state": state})
    with pytest.raises(CorruptCheckpointError, match=r"field 'obs' expected tensor 'rows/obs'"):
        ReplayBuffer.load_checkpoint(tmp_path / "a", scratch_dir=scratch)
    tensors = {"rows/obs": torch.ones(2), "rows/x": torch.ones(2)}
    write_checkpoint(tmp_path / "b", "ReplayBuffer", meta, tensors)
    with pytest.raises(CorruptCheckpointError, match=r"\['rows/x'\] belong to no field"):
        ReplayBuffer.load_checkpoint(tmp_path / "b", scratch_dir=scratch)
    del tensors["rows/x"]
    tensors["sampler/generator_state"] = torch.zeros(3, dtype=torch.uint8)
    write_checkpoint(tmp_path / "c", "ReplayBuffer", meta, tensors)
    with pytest.raises(CorruptCheckpointError, match=r"generator_state is not a cpu generator"):
        ReplayBuffer.load_checkpoint(tmp_path / "c", scratch_dir=scratch)
    tensors["sampler/generator_state"] = state
    write_checkpoint(tmp_path / "d", "ReplayBuffer", meta, tensors)
    with ReplayBuffer.load_checkpoint(tmp_path / "d", scratch_dir=scratch) as buf:
        assert buf.sample_by_index([0, 1])["obs"].tolist() == [1.0, 1.0]
    assert scratch_folders(scratch) == []


def test_an_episode_buffer_checkpoint_is_refused_by_kind(tmp_path, scratch):
    write_checkpoint(tmp_path / "ckpt", "EpisodeReplayBuffer", {"max_steps": 4}, {})
    with pytest.raises(CheckpointKindError, match=r"'EpisodeReplayBuffer' checkpoint; expected"):
        ReplayBuffer.load_checkpoint(tmp_path / "ckpt", scratch_dir=scratch)
    assert scratch_folders(scratch) == []


def test_a_damaged_row_file_is_found_while_streaming_and_the_new_buffer_removed(saved, scratch):
    _, directory = saved
    path = directory / "data" / "rows" / "next" / "obs.bin"
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x40
    path.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=r"data/rows/next/obs\.bin: sha256 expected"):
        ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch)
    os.truncate(path, 10)
    with pytest.raises(CorruptCheckpointError, match=r"data/rows/next/obs\.bin: expected 80 bytes"):
        ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch)
    assert scratch_folders(scratch) == []


def test_bad_arguments_and_missing_checkpoints_are_clear(saved, tmp_path, scratch):
    _, directory = saved
    with pytest.raises(TypeError, match=r"overrides must be among .*got \['buffer_size'\]"):
        ReplayBuffer.load_checkpoint(directory, buffer_size=4)
    with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
        ReplayBuffer.load_checkpoint(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"cannot load here: storage must be one of"):
        ReplayBuffer.load_checkpoint(directory, storage="disk")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no CUDA device.*pass device="):
            ReplayBuffer.load_checkpoint(directory, storing_device="cuda")
    assert scratch_folders(scratch) == []


# ---------------------------------------------------------------------------------------------
# streaming: a memmap buffer is saved and loaded without holding it in RAM


def anon_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def peak_anon_growth(action) -> tuple[int, object]:
    """The largest anonymous-RSS growth seen (every millisecond) while ``action()`` runs."""
    base, peak, done = anon_rss(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], anon_rss() - base)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = action()
    finally:
        done.set()
        watcher.join()
    return max(peak[0], anon_rss() - base), result


def test_a_200_mb_memmap_buffer_streams_with_bounded_ram(tmp_path, scratch):
    rows_total, row_bytes = 50_000, 4096  # 205 MB of uint8 observations
    buf = ReplayBuffer("cpu", "cpu", rows_total, storage="memmap", scratch_dir=scratch, seed=0)
    with buf:
        for start in range(0, rows_total, 5_000):
            obs = torch.full((5_000, row_bytes), start % 251, dtype=torch.uint8)
            buf.add_batch({"obs": obs, "step": torch.arange(start, start + 5_000)})
            del obs
        saved_growth, directory = peak_anon_growth(
            lambda: buf.save_checkpoint(tmp_path / "ckpt", durable=False)
        )
        loaded_growth, loaded = peak_anon_growth(
            lambda: ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch)
        )
        with loaded:
            steps = loaded.sample_by_index([0, 49_999])["step"]
            assert steps.tolist() == [0, 49_999]
    buffer_bytes = rows_total * (row_bytes + 8)
    print(
        f"\npeak extra anonymous RSS: save {saved_growth >> 20} MiB,"
        f" load {loaded_growth >> 20} MiB, buffer {buffer_bytes >> 20} MiB"
    )
    assert saved_growth < buffer_bytes / 4
    assert loaded_growth < buffer_bytes / 4


# ---------------------------------------------------------------------------------------------
# crash safety: SIGKILL while save_checkpoint overwrites an older checkpoint

KILL_PHASES = [
    ("after_tmp_created", 1),
    ("after_data_chunk:3", 1),
    ("after_data_file:2", 1),
    ("before_manifest", 1),
    ("after_manifest", 1),
    ("after_old_renamed", 2),
    ("after_publish_rename", 2),
    ("before_old_removed", 2),
    ("during_old_removal", 2),
]


def test_a_save_killed_at_any_phase_leaves_the_old_or_the_new_buffer(tmp_path):
    phases = [phase for phase, _ in KILL_PHASES]
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    result = subprocess.run(
        [sys.executable, str(HELPER), "ring", str(tmp_path), *phases],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    trials = json.loads(result.stdout.splitlines()[-1])  # after TorchRL's log lines
    scratch = tmp_path / "expected"
    scratch.mkdir()
    expected = {seed: make_source(seed, scratch) for seed in (1, 2)}
    draws = {seed: [buf.sample_batch(5) for _ in range(3)] for seed, buf in expected.items()}
    for i, ((phase, seed), trial) in enumerate(zip(KILL_PHASES, trials, strict=True)):
        assert trial["signal"] == 9, (trial, result.stderr)
        directory = tmp_path / str(i) / "ckpt"
        with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as loaded:
            assert_same_buffer(loaded, expected[seed])
            for draw in draws[seed]:  # the sampler goes on as the saved buffer's would have
                assert (loaded.sample_batch(5) == draw).all(), phase
        assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt", "scratch"], phase
    for buf in expected.values():
        buf.close()


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("saved_on", "loaded_on"),
    [(("cuda", "tensor"), ("cpu", "memmap")), (("cpu", "memmap"), ("cuda", "tensor"))],
)
def test_cuda_and_cpu_checkpoints_load_into_each_other(tmp_path, scratch, saved_on, loaded_on):
    storing, kind = saved_on
    original = ReplayBuffer("cuda", storing, CAPACITY, storage=kind, scratch_dir=scratch, seed=0)
    with original:
        fill(original, FILLS["wrapped_twice"])
        directory = original.save_checkpoint(tmp_path / "ckpt")
        overrides = {"storing_device": loaded_on[0], "storage": loaded_on[1]}
        with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch, **overrides) as buf:
            assert buf.storing_device.type == loaded_on[0]
            assert buf.storage_kind == loaded_on[1]
            got, expected = contents(buf), contents(original)
            assert all(torch.equal(got[k].cpu(), expected[k].cpu()) for k in expected)
            assert (buf.size, buf.pointer) == (original.size, original.pointer)
            a, b = buf.sample_batch(64), buf.sample_batch(64)
            assert a.device.type == "cuda"
            assert not (a == b).all()  # reseeded from the saved state, still random
        with ReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as same:
            assert_same_draws(same, original)
    assert scratch_folders(scratch) == []
