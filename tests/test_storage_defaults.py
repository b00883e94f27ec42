"""Storage defaults: no TorchRL log line, planned bytes that match what is stored, the
``storage="auto"`` choice, and memmap files that grow with the data."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from replay_helpers import ids_of, rows, unchanged
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import replaybuf.storage.devices
import replaybuf.storage.space
from replaybuf import (
    Field,
    InsufficientSpaceError,
    ReplayBuffer,
    SyncEpisodeReplayBuffer,
)
from replaybuf.persist.format import read_checkpoint
from replaybuf.storage.quiet import quiet_allocation
from replaybuf.storage.space import RESERVE_SLICES
from replaybuf.storage.torchrl_state import allocated

ROW_BYTES = 4 * (4 + 2 + 1 + 4) + 1  # replay_helpers.rows: float32 fields and a bool
INDEX = 8  # TorchRL's int64 index column, which a ring's writes through extend keep


class Records(logging.Handler):
    """The messages logged to the handler's logger, kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def torchrl_records():
    logger = logging.getLogger("torchrl")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # TorchRL's own level (another module may have raised it)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _first_steps(buf: SyncEpisodeReplayBuffer) -> None:
    ep = buf.start_episode()
    buf.append_observation_action_reward(ep, {"x": torch.zeros(3), "tokens": [1, 2]}, 1, 0.5)
    buf.end_episode(ep, "terminated", {"x": torch.ones(3), "tokens": [3, 4]})
    buf.sample_n_step(2)  # staged steps are written (and storage allocated) by now


# ---------------------------------------------------------------- TorchRL's log line
@pytest.mark.parametrize("storage", ["auto", "memmap", "tensor"])
def test_creating_and_first_writes_log_nothing_from_torchrl(tmp_path, storage, torchrl_records):
    with ReplayBuffer("cpu", "cpu", 8, storage=storage, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))
        buf.reset(16)
        buf.add(rows(3, 1)[0])
    spec = {"observation": {"x": ((3,), torch.float32), "tokens": Field.ragged(torch.int64)}}
    with SyncEpisodeReplayBuffer(32, storage=storage, scratch_dir=tmp_path, spec=spec) as ep_buf:
        _first_steps(ep_buf)  # rows, and a ragged field's arena: two TorchRL storages
    assert torchrl_records == []


def test_a_users_own_torchrl_storage_still_logs(tmp_path, torchrl_records):
    with ReplayBuffer("cpu", "cpu", 8, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 2))
    for storage in (LazyTensorStorage(4), LazyMemmapStorage(4, scratch_dir=tmp_path / "own")):
        storage.set(torch.arange(2), TensorDict({"a": torch.zeros(2)}, batch_size=[2]))
    assert [m.split(" with")[0] for m in torchrl_records] == [
        "Initialized LazyTensorStorage",
        "Initialized LazyMemmapStorage",
    ]
    assert logging.getLogger("torchrl").level == logging.INFO  # the configuration untouched


def test_another_threads_torchrl_storage_logs_while_a_buffer_allocates(torchrl_records):
    inside, done = threading.Event(), threading.Event()

    def allocate() -> None:
        with quiet_allocation():  # as a buffer's first write is, held open meanwhile
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=allocate)
    thread.start()
    try:
        assert inside.wait(10)
        LazyTensorStorage(4).set(torch.arange(1), TensorDict({"a": torch.zeros(1)}, [1]))
    finally:
        done.set()
        thread.join()
    assert len(torchrl_records) == 1


def test_no_torchrl_line_reaches_the_console(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch
        from replaybuf import ReplayBuffer
        for storage in ("auto", "memmap", "tensor"):
            with ReplayBuffer("cpu", "cpu", 100, storage=storage, scratch_dir=sys.argv[1]) as b:
                b.add_batch({"obs": torch.zeros(4, 3), "done": torch.zeros(4, dtype=torch.bool)})
        print("done")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    assert out.stdout == "done\n"
    assert "torchrl" not in out.stderr
    assert "Initialized" not in out.stderr


# ---------------------------------------------------------------- planned bytes
SPECS = {
    "flat": {"obs": ((17,), torch.float32), "action": ((6,), torch.float32)},
    "mixed": {
        "pixels": ((3, 8, 8), torch.uint8),
        "action": ((), torch.int64),
        "done": ((), torch.bool),
        "next": {"pixels": ((3, 8, 8), torch.uint8), "h": ((2, 5), torch.float16)},
    },
    "scalar": {"reward": ((), torch.float64)},
}


def _memmap_bytes(folder: Path) -> tuple[int, int]:
    """Sizes and allocated bytes of the rows' memmap files (ragged arenas apart)."""
    files = [
        p for p in folder.rglob("*.memmap") if not any(q.startswith("ragged-") for q in p.parts)
    ]
    return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


def _zero_rows(spec: dict, count: int) -> TensorDict:
    def build(tree: dict) -> dict:
        return {
            k: build(v) if isinstance(v, dict) else torch.zeros((count, *v[0]), dtype=v[1])
            for k, v in tree.items()
        }

    return TensorDict(build(spec), batch_size=[count])


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_planned_bytes_are_the_bytes_stored(tmp_path, name, storage):
    spec = SPECS[name]
    with ReplayBuffer("cpu", "cpu", 1000, storage=storage, scratch_dir=tmp_path) as buf:
        buf.add_batch(_zero_rows(spec, 3))
        planned = buf.stats()["planned_bytes"]
        assert planned == 1000 * (buf.spec.row_bytes + INDEX)
        leaves = allocated(buf.memory).values(include_nested=True, leaves_only=True)
        assert planned == sum(v.numel() * v.element_size() for v in leaves)
        assert planned == buf.stats()["bytes"]
        if storage == "memmap":
            assert _memmap_bytes(Path(buf.stats()["scratch_dir"]))[0] == planned


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_an_episode_buffers_planned_bytes_hold_its_columns_and_ragged_spans(tmp_path, storage):
    spec = {"observation": {"x": ((3,), torch.float32), "tokens": Field.ragged(torch.int64)}}
    with SyncEpisodeReplayBuffer(100, storage=storage, scratch_dir=tmp_path, spec=spec) as buf:
        _first_steps(buf)
        stats, slots = buf.stats(), buf._core.slots
        row = 4 * 3 + 8 + 4  # x, the int64 action, the float32 reward (no index column)
        spans = stats["rows"] * 8  # one 8-byte span a row for the one ragged field (host)
        assert stats["planned_bytes"] == stats["rows"] * row + spans
        leaves = allocated(slots.memory).values(include_nested=True, leaves_only=True)
        assert sum(v.numel() * v.element_size() for v in leaves) == stats["rows"] * row
        arenas = sum(c.nbytes - c.spans.nbytes for c in slots.ragged.values())
        assert arenas > 0  # the arena grows with the values: in bytes, not planned
        assert slots.stored_bytes() == stats["planned_bytes"] + arenas
        if storage == "memmap":
            on_disk = _memmap_bytes(Path(slots.scratch_path))[0]
            assert on_disk == stats["planned_bytes"] - spans


def test_the_preflight_asks_for_the_planned_bytes(tmp_path, monkeypatch):
    free = {"memmap": 10**12, "tensor": 10**12}
    monkeypatch.setattr(
        replaybuf.storage.space, "free_bytes", lambda kind, device, folder: free[kind]
    )
    with ReplayBuffer("cpu", "cpu", 1000, storage="memmap", scratch_dir=tmp_path) as buf:
        free["memmap"] = 1000 * (ROW_BYTES + INDEX) - 1  # one byte short of every column
        with unchanged(buf), pytest.raises(InsufficientSpaceError) as info:
            buf.add_batch(rows(0, 2))
        assert info.value.needed == 1000 * (ROW_BYTES + INDEX)
        free["memmap"] += 1
        buf.add_batch(rows(0, 2))
        assert buf.stats()["planned_bytes"] == info.value.needed


def test_ragged_spans_are_checked_against_ram_for_memmap_storage(tmp_path, monkeypatch):
    free = {"memmap": 10**12, "tensor": 100}
    monkeypatch.setattr(
        replaybuf.storage.space, "free_bytes", lambda kind, device, folder: free[kind]
    )
    spec = {"observation": {"x": ((3,), torch.float32), "tokens": Field.ragged(torch.int64)}}
    with SyncEpisodeReplayBuffer(100, storage="memmap", scratch_dir=tmp_path, spec=spec) as buf:
        with pytest.raises(InsufficientSpaceError, match="host memory") as info:
            _first_steps(buf)  # the columns fit on disk; the spans, on the host, do not
        assert info.value.needed == buf.stats()["rows"] * 8


# ---------------------------------------------------------------- storage="auto"
def test_auto_is_the_default_and_keeps_a_small_buffer_in_ram(tmp_path):
    with ReplayBuffer("cpu", "cpu", 1000, scratch_dir=tmp_path) as buf:
        assert buf.stats()["storage"] == buf.storage_kind == "auto"  # chosen at the first write
        assert buf.stats()["planned_bytes"] == 0
        buf.add_batch(rows(0, 3))
        assert buf.stats()["storage"] == "tensor"
        assert buf.stats()["scratch_dir"] is None
        assert list(tmp_path.iterdir()) == []  # no scratch folder for RAM storage
        assert "storage='tensor'" in repr(buf)
        assert ids_of(buf.sample_all()) == [0, 1, 2]


def test_auto_puts_a_buffer_over_the_threshold_in_memmap_files(tmp_path, monkeypatch):
    threshold = 1000 * (ROW_BYTES + INDEX) - 1
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", threshold)
    with ReplayBuffer("cpu", "cpu", 1000, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))  # 1000 rows and their index column: one byte over
        assert buf.stats()["storage"] == "memmap"
        assert Path(buf.stats()["scratch_dir"]).parent == tmp_path
        assert ids_of(buf.sample_all()) == [0, 1, 2]
    with ReplayBuffer("cpu", "cpu", 999, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))  # 999 rows: under it
        assert buf.stats()["storage"] == "tensor"
    assert list(tmp_path.iterdir()) == []


def test_auto_takes_memmap_when_ram_is_short(tmp_path, monkeypatch):
    monkeypatch.setattr(replaybuf.storage.space, "free_ram", lambda: 1000 * (ROW_BYTES + INDEX))
    with ReplayBuffer("cpu", "cpu", 1000, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 1))
        assert buf.stats()["storage"] == "memmap"  # the rows would take all of it


def test_a_declared_spec_decides_at_construction(tmp_path, monkeypatch):
    spec = {"obs": ((4,), torch.float32)}
    with ReplayBuffer("cpu", "cpu", 100, scratch_dir=tmp_path, spec=spec) as buf:
        assert buf.stats()["storage"] == "tensor"
        assert buf.stats()["planned_bytes"] == 100 * (16 + INDEX)
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 0)
    with ReplayBuffer("cpu", "cpu", 100, scratch_dir=tmp_path, spec=spec) as buf:
        assert buf.stats()["storage"] == "memmap"


def test_reset_chooses_again_for_the_new_size(tmp_path, monkeypatch):
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 100 * 64)
    with ReplayBuffer("cpu", "cpu", 10, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))
        assert buf.stats()["storage"] == "tensor"
        buf.reset(1000)
        assert buf.stats()["storage"] == "auto"
        buf.add_batch(rows(0, 3))
        assert buf.stats()["storage"] == "memmap"


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_explicit_kinds_are_kept_at_any_size(tmp_path, monkeypatch, storage):
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 0)
    with ReplayBuffer("cpu", "cpu", 4, storage=storage, scratch_dir=tmp_path) as buf:
        assert buf.stats()["storage"] == storage  # known before any write
        buf.add_batch(rows(0, 3))
        assert buf.stats()["storage"] == storage


def test_checkpoints_and_state_record_the_kind_chosen(tmp_path, monkeypatch):
    with ReplayBuffer("cpu", "cpu", 100, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 5))
        assert buf.state_dict()["meta"]["storage"] == "tensor"
        path = buf.save_checkpoint(tmp_path / "ckpt")
    assert read_checkpoint(path).meta["storage"] == "tensor"
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 0)  # no matter
    with ReplayBuffer.load_checkpoint(path, scratch_dir=tmp_path) as back:
        assert back.stats()["storage"] == "tensor"
        assert ids_of(back.sample_all()) == [0, 1, 2, 3, 4]
        state = back.state_dict()
    with ReplayBuffer("cpu", "cpu", 100, scratch_dir=tmp_path) as other:
        other.load_state_dict(state)  # an auto buffer chooses for the state's rows
        assert other.stats()["storage"] == "memmap"
        assert ids_of(other.sample_all()) == [0, 1, 2, 3, 4]


def test_an_episode_buffer_chooses_at_its_first_step(tmp_path, monkeypatch):
    spec = {"observation": {"x": ((3,), torch.float32), "tokens": Field.ragged(torch.int64)}}
    with SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path) as buf:
        assert buf.stats()["storage"] == "auto"
        _first_steps(buf)
        assert buf.stats()["storage"] == "tensor"
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 0)
    with SyncEpisodeReplayBuffer(100, scratch_dir=tmp_path, spec=spec) as buf:
        _first_steps(buf)
        assert buf.stats()["storage"] == "memmap"
        assert list(Path(buf._core.slots.scratch_path).glob("ragged-*"))  # arenas there too
        batch = buf.sample_n_step(4)
        assert batch["observation", "tokens"].shape[0] == 4


def test_auto_checks_scratch_dir_at_construction(tmp_path):
    with pytest.raises(ValueError, match="scratch_dir must be an existing directory"):
        ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path / "missing")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_is_tensor_storage(monkeypatch):
    monkeypatch.setattr(replaybuf.storage.devices, "AUTO_TENSOR_MAX_BYTES", 0)
    with ReplayBuffer("cuda", "cuda", 100) as buf:
        assert buf.stats()["storage"] == "tensor"
        buf.add_batch(rows(0, 2))
        assert buf.stats()["storage"] == "tensor"
        assert buf.stats()["planned_bytes"] == 100 * (ROW_BYTES + INDEX)


# ---------------------------------------------------------------- memmap files grow
CAPACITY = 64 * 100  # RESERVE_SLICES slices of 100 rows


def _allocated_rows(buf: ReplayBuffer) -> float:
    """Rows' worth of disk blocks the memmap files hold (allocated bytes / row bytes)."""
    size, used = _memmap_bytes(Path(buf.stats()["scratch_dir"]))
    return used / (size / buf.buffer_size)


def _fallocate_works(folder: Path) -> bool:
    probe = folder / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        return os.fstat(fd).st_blocks * 512 >= 1 << 20
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def test_memmap_files_take_disk_blocks_as_rows_are_written(tmp_path):
    assert CAPACITY // RESERVE_SLICES == 100
    if not _fallocate_works(tmp_path):
        pytest.skip("this filesystem does not reserve blocks with posix_fallocate")
    wide = {"obs": torch.zeros(1, 1024)}  # 4 KiB a row, so blocks count in rows
    with ReplayBuffer("cpu", "cpu", CAPACITY, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(wide)
        assert buf.stats()["planned_bytes"] == CAPACITY * (4096 + INDEX)
        assert 100 <= _allocated_rows(buf) < 110  # one slice ahead, not the capacity
        buf.add_batch({"obs": torch.zeros(250, 1024)})
        assert 251 <= _allocated_rows(buf) < 360  # the rows written and at most a slice more
        for _ in range(CAPACITY // 1000 + 1):
            buf.add_batch({"obs": torch.zeros(1000, 1024)})
        assert _allocated_rows(buf) >= CAPACITY  # full: every row's blocks


def test_a_disk_full_past_the_preflight_fails_a_write_and_keeps_the_rows(tmp_path, monkeypatch):
    with ReplayBuffer("cpu", "cpu", CAPACITY, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 50))  # blocks reserved for the first slice of 100 rows

        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        buf.add_batch(rows(50, 50))  # still within the reserved slice
        with unchanged(buf), pytest.raises(InsufficientSpaceError, match="disk at"):
            buf.add_batch(rows(100, 10))  # would need the next slice's blocks
        monkeypatch.undo()
        buf.add_batch(rows(100, 10))
        assert ids_of(buf.sample_all()) == list(range(110))
