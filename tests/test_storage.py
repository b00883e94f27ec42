"""Where rows live: private scratch folders, cleanup, space checks and signal hygiene."""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_helpers import ids_of, rows, unchanged

import replaybuf.storage.hugepages
import replaybuf.storage.space
from replaybuf import Field, FieldSpec, InsufficientSpaceError, ReplayBuffer, SchemaError
from replaybuf.accel.numba_loader import NUMBA_ENV, kernels_unavailable_reason
from replaybuf.storage import scratch
from replaybuf.storage.sweep import STAMP

ROW_BYTES = 4 * (4 + 2 + 1 + 4) + 1  # obs, action, reward, next.obs as float32; done as bool
STORED_ROW_BYTES = ROW_BYTES + 8  # and TorchRL's int64 index column, which a ring keeps


def _scratch_folders(parent: Path) -> list[Path]:
    return sorted(parent.glob("replaybuf-*"))


def test_memmap_files_live_in_a_private_folder_inside_scratch_dir(tmp_path):
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))
        (folder,) = _scratch_folders(tmp_path)
        assert list(tmp_path.iterdir()) == [folder]
        assert buf.stats()["scratch_dir"] == str(folder)
        files = {p.name for p in folder.rglob("*.memmap")}
        assert {"obs.memmap", "action.memmap", "reward.memmap", "done.memmap"} <= files


def test_close_removes_the_private_folder_and_keeps_the_users_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    buf = ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path)
    buf.add_batch(rows(0, 3))
    assert len(_scratch_folders(tmp_path)) == 1
    buf.close()
    assert _scratch_folders(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_context_manager_removes_the_private_folder(tmp_path):
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))
    assert list(tmp_path.iterdir()) == []


def test_context_manager_removes_the_private_folder_when_the_block_raises(tmp_path):
    def fail_inside_the_block():
        with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
            buf.add_batch(rows(0, 3))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside_the_block()
    assert list(tmp_path.iterdir()) == []


def test_garbage_collection_removes_the_private_folder(tmp_path):
    buf = ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path)
    buf.add_batch(rows(0, 3))
    del buf
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_reset_replaces_the_private_folder(tmp_path):
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 3))
        before = _scratch_folders(tmp_path)
        buf.reset()
        assert not before[0].exists()  # renamed at once; the background thread removes it
        assert scratch.drain(timeout=60)
        after = _scratch_folders(tmp_path)
        assert len(before) == len(after) == 1
        assert before != after


def test_two_buffers_in_one_scratch_dir_do_not_share_files(tmp_path):
    with (
        ReplayBuffer("cpu", "cpu", 4, storage="memmap", scratch_dir=tmp_path) as a,
        ReplayBuffer("cpu", "cpu", 4, storage="memmap", scratch_dir=tmp_path) as b,
    ):
        a.add_batch(rows(0, 2))
        b.add_batch(rows(10, 2))
        assert len(_scratch_folders(tmp_path)) == 2
        assert ids_of(a.sample_all()) == [0, 1]
        assert ids_of(b.sample_all()) == [10, 11]
        a.close()
        assert ids_of(b.sample_all()) == [10, 11]


def test_default_scratch_folder_is_in_the_temp_dir_and_not_in_dev_shm():
    with ReplayBuffer("cpu", "cpu", 4, storage="memmap") as buf:
        buf.add_batch(rows(0, 2))
        folder = Path(buf.stats()["scratch_dir"]).resolve()
    assert folder.parent == Path(tempfile.gettempdir()).resolve()
    assert not folder.is_relative_to("/dev/shm")
    assert not folder.exists()


def test_tensor_storage_on_cpu_creates_no_files(tmp_path):
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 2))
        assert buf.stats()["scratch_dir"] is None
        assert list(tmp_path.iterdir()) == []


def test_buffers_do_not_replace_the_applications_signal_handlers(tmp_path, storage):
    def handler(signum, frame):  # pragma: no cover - never delivered
        pass

    previous_term = signal.signal(signal.SIGTERM, handler)
    try:
        before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        with ReplayBuffer("cpu", "cpu", 8, storage=storage, scratch_dir=tmp_path) as buf:
            buf.add_batch(rows(0, 10))
            buf.sample_batch(4)
            buf.reset(4)
            buf.add_batch(rows(0, 2))
            during = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        after = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    assert during == before
    assert after == before


@pytest.mark.parametrize(
    ("storage_kind", "where"), [("memmap", r"disk at .*replaybuf-"), ("tensor", "host memory")]
)
def test_too_little_space_raises_before_allocating_and_changes_nothing(
    tmp_path, monkeypatch, storage_kind, where
):
    monkeypatch.setattr(replaybuf.storage.space, "free_bytes", lambda kind, device, folder: 100)
    with ReplayBuffer("cpu", "cpu", 4, storage=storage_kind, scratch_dir=tmp_path) as buf:
        message = (
            rf"not enough space on {where}.*needs {4 * STORED_ROW_BYTES:,} bytes, 100 are free"
        )
        with unchanged(buf), pytest.raises(InsufficientSpaceError, match=message) as info:
            buf.add_batch(rows(0, 2))
        assert (info.value.needed, info.value.free) == (4 * STORED_ROW_BYTES, 100)
        assert buf.spec is None
        assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != STAMP] == []
        monkeypatch.undo()
        buf.add_batch(rows(0, 2))  # still usable once there is room
        assert ids_of(buf.sample_all()) == [0, 1]
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_reservation_raises_and_leaves_the_buffer_empty_and_usable(
    tmp_path, monkeypatch
):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with ReplayBuffer("cpu", "cpu", 4, storage="memmap", scratch_dir=tmp_path) as buf:
        with unchanged(buf), pytest.raises(InsufficientSpaceError, match=r"disk at .*needs 212"):
            buf.add_batch(rows(0, 2))
        assert (buf.spec, len(buf.memory)) == (None, 0)
        # The reset that undid the allocation handed its folder to the background remover:
        # wait for it, or the walk below races the removal it checks.
        assert scratch.drain(timeout=60)
        assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != STAMP] == []
        monkeypatch.undo()
        buf.add_batch(rows(0, 3))
        assert ids_of(buf.sample_all()) == [0, 1, 2]


def test_stats_bytes_cover_the_allocated_rows(tmp_path, storage):
    with ReplayBuffer("cpu", "cpu", 100, storage=storage, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 1))
        assert buf.stats()["planned_bytes"] == 100 * STORED_ROW_BYTES
        assert buf.stats()["bytes"] >= 100 * STORED_ROW_BYTES


_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from replaybuf import ReplayBuffer
    default = ReplayBuffer("cpu", "cpu", 16, storage="memmap")
    mine = ReplayBuffer("cpu", "cpu", 16, storage="memmap", scratch_dir=sys.argv[1])
    for buf in (default, mine):
        buf.add_batch({"obs": torch.zeros(20, 3)})
    print(json.dumps([default.stats()["scratch_dir"], mine.stats()["scratch_dir"]]))
    """
)


def test_a_process_that_exits_normally_leaves_no_scratch_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    default, mine = map(Path, json.loads(done.stdout.strip().splitlines()[-1]))
    assert not default.is_relative_to("/dev/shm")
    assert mine.parent == tmp_path
    assert not default.exists()
    assert not mine.exists()
    assert tmp_path.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_a_relative_scratch_dir_is_cleaned_up_after_a_change_of_directory(tmp_path, monkeypatch):
    (tmp_path / "scratch").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    buf = ReplayBuffer("cpu", "cpu", 4, storage="memmap", scratch_dir="scratch")
    buf.add_batch(rows(0, 2))
    assert Path(buf.stats()["scratch_dir"]).is_absolute()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert ids_of(buf.sample_all()) == [0, 1]
    buf.close()
    assert list((tmp_path / "scratch").iterdir()) == []


def test_a_declared_spec_reports_planned_bytes_and_fails_at_construction(tmp_path, monkeypatch):
    declared = {
        "obs": ((4,), torch.float32),
        "action": ((2,), "float32"),
        "reward": torch.zeros(()),  # an example row works too
        "done": Field((), torch.bool),
        "next": {"obs": ((4,), torch.float32)},
    }
    with ReplayBuffer(
        "cpu", "cpu", 100, storage="memmap", scratch_dir=tmp_path, spec=declared
    ) as buf:
        assert buf.stats()["planned_bytes"] == 100 * STORED_ROW_BYTES  # before any write
        assert buf.stats()["bytes"] == 0
        buf.add_batch(rows(0, 3))  # the first write is checked against the declared spec
        with pytest.raises(SchemaError, match="keys differ"):
            buf.add_batch(rows(3, 1).exclude("done"))
        buf.reset()
        assert buf.spec == FieldSpec.declare(declared)  # a declared spec survives reset
    monkeypatch.setattr(replaybuf.storage.space, "free_bytes", lambda kind, device, folder: 100)
    with pytest.raises(InsufficientSpaceError, match=rf"needs {10**6 * STORED_ROW_BYTES:,} bytes"):
        ReplayBuffer("cpu", "cpu", 10**6, storage="memmap", scratch_dir=tmp_path, spec=declared)
    assert list(tmp_path.iterdir()) == []  # nothing allocated, no folder left


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({}, "spec must be a FieldSpec or a non-empty dict"),
        ([1, 2], "spec must be a FieldSpec or a non-empty dict"),
        ({"obs": (4, torch.float32)}, r"spec field 'obs' expected a Field, \(shape, dtype\)"),
        ({"obs": ((4,), "float99")}, r"spec field 'obs' expected"),
        ({"obs": {"x": ((-1,), torch.float32)}}, r"spec field 'obs.x' expected"),
        ({"obs": "float32"}, r"spec field 'obs' expected"),
    ],
)
def test_a_bad_declared_spec_is_refused_naming_the_field(tmp_path, spec, match):
    with pytest.raises(ValueError, match=match):
        ReplayBuffer("cpu", "cpu", 4, storage="memmap", scratch_dir=tmp_path, spec=spec)
    assert list(tmp_path.iterdir()) == []


def test_direct_row_writes_land_in_torchrl_storage_with_its_bookkeeping(tmp_path, storage):
    # After the first write, staged rows are copied straight into TorchRL's tensors (not via
    # TensorStorage.set); TorchRL's own view must still see them, its length must grow as
    # set() would grow it, and its mutation revision must move (samplers' caches invalidate).
    from replaybuf import SyncEpisodeReplayBuffer

    with SyncEpisodeReplayBuffer(64, storage=storage, scratch_dir=tmp_path, seed=0) as buf:
        ep = buf.start_episode()
        buf.append_observation_action_reward(ep, torch.tensor([0.0, 0.5]), 0, 1.0)
        buf.stats()  # flushes: the first write allocates, through TorchRL's set()
        revision = buf.memory.storage._mutation_revision_value
        before = revision.value if hasattr(revision, "value") else int(revision)
        for t in range(1, 6):
            buf.append_observation_action_reward(ep, torch.tensor([float(t), 0.5]), t, 1.0)
        buf.end_episode(ep, "truncated", final_observation=torch.tensor([6.0, 0.5]))
        episode = buf.get_episode(ep)  # flushes the staged rows
        record = buf._core.episodes[ep]
        rows = torch.tensor([*record.rows, record.final_row])
        stored = buf.memory.storage.get(rows)
        assert torch.equal(stored["observation"], episode["observation"])
        steps = episode["action"].shape[0]
        assert torch.equal(stored["action"][:steps], episode["action"])
        assert len(buf.memory.storage) == 7  # 6 step rows + the final one, as set() counts
        revision = buf.memory.storage._mutation_revision_value
        assert (revision.value if hasattr(revision, "value") else int(revision)) > before
        # The last written slot, as TorchRL's readers (HER, checkpointers) take it.
        assert buf.memory.storage._last_cursor_index == record.final_row
        assert buf.memory.storage._last_cursor == record.final_row


@pytest.mark.parametrize("filled", [1, 5, 60, 64])
@pytest.mark.parametrize("slots", [[7], [3, 40, 2], [63, 0, 5, 9, 11]])
def test_record_slots_leaves_torchrl_s_counters_as_record_write_does(filled, slots):
    # A flush records its rows through the raw counters (RowBookkeeping.wrote_slots), not
    # TorchRL's locked setters: the length (capped at the capacity), the last cursor, its
    # shared index, the writer and the revision's step must come out as record_write's.
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from replaybuf.storage.torchrl_state import RowBookkeeping, record_slots, record_write

    def counters(memory: TensorDictReplayBuffer) -> tuple:
        storage = memory.storage
        revision = storage._mutation_revision_value.value
        last = storage._last_cursor_index  # the shared value; _last_cursor compared apart
        return len(storage), last, memory.writer.state_dict(), revision

    ours, theirs = (TensorDictReplayBuffer(storage=LazyTensorStorage(64)) for _ in range(2))
    for memory in (ours, theirs):
        memory.extend(TensorDict({"x": torch.arange(filled)}, [filled]))
    before = counters(ours)
    assert before == counters(theirs)
    at = torch.tensor(slots)
    derived: dict = {}
    record_slots(derived, ours, at, slots[-1])
    record_write(theirs.storage, slots[-1], at)
    # the raw counters were found, and kept for the next flush
    assert [type(book) for book in derived.values()] == [RowBookkeeping]
    assert counters(ours) == counters(theirs) != before
    assert ours.storage._last_cursor == theirs.storage._last_cursor == slots[-1]
    record_slots(derived, ours, at, None)  # no last slot known: TorchRL's own setters
    record_write(theirs.storage, at, at)
    assert counters(ours) == counters(theirs)
    assert torch.equal(ours.storage._last_cursor, theirs.storage._last_cursor)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_dropping_its_copy_leaves_the_parents_scratch_folder(tmp_path):
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 2))
        scratch = Path(buf.stats()["scratch_dir"])
        pid = os.fork()
        if pid == 0:  # the child: drop its copy of the buffer, as a DataLoader worker would
            del buf
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        assert scratch.is_dir()
        assert ids_of(buf.sample_all()) == [0, 1]
    assert not scratch.exists()  # the owner still removes it


@pytest.mark.parametrize("chunks", [[3, 4, 9], [1] * 13, [12, 1, 5]])
def test_ring_writes_leave_torchrl_s_view_exactly_as_its_own_extend_would(
    tmp_path, storage, chunks
):
    # After the first write, add_batch copies rows straight into TorchRL's tensors and moves
    # its writer by state_dict; a plain TensorDictReplayBuffer fed the same chunks through
    # extend() must end in the same state: rows, "index" column, cursor, write count, length.
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    reference = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
    with ReplayBuffer("cpu", "cpu", 10, storage=storage, scratch_dir=tmp_path) as buf:
        written = 0
        for count in chunks:
            buf.add_batch(rows(written, count))
            reference.extend(rows(written, count))
            written += count
        ours, theirs = buf.memory, reference
        assert ours.writer.state_dict() == theirs.writer.state_dict()
        assert len(ours.storage) == len(theirs.storage)
        # The last written slot (ours records a range where TorchRL records a tensor of slots).
        assert ours.storage._last_cursor_index == theirs.storage._last_cursor_index
        everything = torch.arange(10)
        mine, want = ours.storage.get(everything), theirs.storage.get(everything)
        for key in ("obs", "action", "reward", "done", "index"):
            assert torch.equal(mine[key], want[key]), key
        assert buf.pointer == theirs.writer.state_dict()["_cursor"]
        assert ids_of(buf.sample_all()) == list(range(written))[-10:]


def _torchrl_index(buf: ReplayBuffer) -> torch.Tensor:
    """TorchRL's own "index" column over the rows its storage holds."""
    return buf.memory.storage.get(torch.arange(len(buf.memory.storage)))["index"]


@pytest.mark.parametrize("rows_then_chunks", [(6, [3, 5, 9, 10, 4]), (10, [7, 1, 10, 13])])
def test_torchrl_s_index_column_holds_each_slot_through_wraps_resets_and_loads(
    tmp_path, storage, rows_then_chunks
):
    # add_batch writes TorchRL's "index" column (index[s] == s) only on the ring's first pass:
    # after wrapping, a reset (a fresh storage) and a checkpoint load (which holds only some
    # rows), it must still read arange over the stored rows, and TorchRL's own view must work.
    first, chunks = rows_then_chunks
    with ReplayBuffer("cpu", "cpu", 10, storage=storage, scratch_dir=tmp_path) as buf:
        written = 0
        for count in [first, *chunks]:
            buf.add_batch(rows(written, count))
            written += count
            assert torch.equal(_torchrl_index(buf), torch.arange(len(buf))), written
        for _ in range(2):  # a reset twice: the second storage is fresh again
            buf.reset()
            buf.add_batch(rows(0, first))
            for count in chunks:
                buf.add_batch(rows(0, count))
                assert torch.equal(_torchrl_index(buf), torch.arange(len(buf)))
        buf.reset()
        buf.add_batch(rows(0, first))
        directory = buf.save_checkpoint(tmp_path / "ckpt")
    with ReplayBuffer.load_checkpoint(directory, scratch_dir=tmp_path) as loaded:
        assert torch.equal(_torchrl_index(loaded), torch.arange(first))
        written = first
        for count in chunks:
            loaded.add_batch(rows(written, count))
            written += count
            assert torch.equal(_torchrl_index(loaded), torch.arange(len(loaded)))
        sample = loaded.memory.sample(32)  # TorchRL's own sampling reads every column
        ids = sample["obs"][:, 0].long()  # row k was written to slot k % 10
        assert torch.equal(ids % 10, sample["index"])
        assert bool(((ids >= written - 10) & (ids < written)).all())


NO_KERNELS = kernels_unavailable_reason()
SCATTER_DTYPES = [torch.uint8, torch.bool, torch.int64, torch.float32, torch.bfloat16]


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(SCATTER_DTYPES),
    shape=st.sampled_from([(), (1,), (3,), (2, 5), (4, 3, 3)]),
    slots=st.integers(1, 40),
    data=st.data(),
)
def test_the_compiled_row_scatter_writes_what_a_row_by_row_copy_writes(dtype, shape, slots, data):
    """kernels.scatter_rows on row_words views against the slow obvious way (one row at a
    time), for every dtype and row shape; rows it does not name keep their bytes."""
    from replaybuf.accel import numba_kernels as kernels
    from replaybuf.storage.staging import row_words

    rows = data.draw(st.lists(st.integers(0, slots - 1), max_size=slots, unique=True))
    g = torch.Generator().manual_seed(len(rows))

    def random(count: int) -> torch.Tensor:  # random bytes of the dtype (bools 0 or 1)
        size = torch.empty((), dtype=dtype).element_size()
        high = 2 if dtype == torch.bool else 256
        raw = torch.randint(0, high, (count, *shape, size), generator=g, dtype=torch.uint8)
        return raw.view(dtype).reshape(count, *shape)

    column, staged = random(slots), random(len(rows) + 2)  # staged: two spare rows
    want = column.clone()
    for i, row in enumerate(rows):
        want[row] = staged[i]
    kernels.scatter_rows(row_words(column), row_words(staged), np.array(rows, dtype=np.int64))
    assert torch.equal(column.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_the_compiled_row_scatter_refuses_bad_slots_and_sizes_and_writes_nothing():
    from replaybuf.accel import numba_kernels as kernels
    from replaybuf.storage.staging import row_words

    column, staged = torch.zeros(4, 3), torch.ones(3, 3)
    for bad in (4, -1):
        with pytest.raises(IndexError, match="slot out of range"):
            kernels.scatter_rows(
                row_words(column), row_words(staged), np.array([0, bad, 1], dtype=np.int64)
            )
        assert torch.equal(column, torch.zeros(4, 3))
    for other in (torch.ones(3, 4), torch.ones(2, 3)):  # wider rows; fewer rows than slots
        with pytest.raises(ValueError, match="another width, or fewer than the slots"):
            kernels.scatter_rows(
                row_words(column).view(np.uint8),
                row_words(other).view(np.uint8),
                np.array([0, 2, 1], dtype=np.int64),
            )
        assert torch.equal(column, torch.zeros(4, 3))


@pytest.mark.parametrize(
    ("shape", "dtype", "offset", "word"),
    [
        ((2,), torch.float32, 0, np.uint64),
        ((3,), torch.float32, 0, np.uint32),  # 12 bytes
        ((3,), torch.int16, 0, np.uint16),  # 6 bytes
        ((3,), torch.uint8, 0, np.uint8),
        ((4,), torch.uint8, 1, np.uint8),  # 4 bytes a row, at an odd address
        ((8,), torch.uint8, 2, np.uint16),
        ((8,), torch.uint8, 4, np.uint32),
    ],
)
def test_row_words_views_rows_in_the_widest_word_their_size_and_address_allow(
    shape, dtype, offset, word
):
    from replaybuf.storage.staging import row_words

    flat = torch.arange(5 * math.prod(shape) + offset).to(dtype)
    tensor = flat[offset:].view(5, *shape)
    view = row_words(tensor)
    assert view.dtype == word
    assert view.shape == (5, tensor[0].numel() * tensor.element_size() // view.itemsize)
    assert bytes(view) == bytes(tensor.numpy())  # the same memory, row by row
    view[1] = 0  # a view: writes land in the tensor
    assert not tensor[1].any()
    assert row_words(torch.zeros(5, 0)) is None


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_a_flush_scatters_staged_rows_whose_words_differ_from_the_columns(make_episode_buffer):
    """Staged rows viewed in other words than the stored column's (another address
    alignment) are written as bytes, to the same rows."""
    buf = make_episode_buffer(40, 8, storage="tensor")
    episode = buf.start_episode()
    buf.append_observation_action_reward(episode, np.zeros(4, np.float32), 0, 0.0)
    buf._core.flush()  # writes it: the columns exist
    slots = buf._core.slots
    keys = [key for key, _ in slots._leaves]
    values = [
        torch.full((2, *slots.column(k).shape[1:]), 7).to(slots.column(k).dtype) for k in keys
    ]
    staged = [None if v.numel() == 0 else v.view(2, -1).view(torch.uint8).numpy() for v in values]
    assert any(
        s is not None and s.dtype != w.dtype
        for s, w in zip(staged, slots._row_words.values(), strict=True)
    )
    rows = torch.tensor([5, 9])
    slots.write_rows(rows, keys, values, None, staged)
    for key, value in zip(keys, values, strict=True):
        assert torch.equal(slots.column(key)[rows], value)


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_episode_rows_written_through_the_compiled_scatter_equal_index_copy_s(
    make_episode_buffer, monkeypatch, storage
):
    """Two buffers fed alike, one writing its staged rows through kernels.scatter_rows and
    one through index_copy_ (REPLAYBUF_NUMBA=0): every stored column is the same, byte for
    byte, over batches, single steps, ends and evictions, in every dtype."""
    from replaybuf.accel import numba_kernels as kernels

    bufs = []
    for flag in ("1", "0"):  # chosen when a buffer is built
        monkeypatch.setenv(NUMBA_ENV, flag)
        bufs.append(make_episode_buffer(40, 8, storage=storage))
    calls = []
    scatter = kernels.scatter_rows
    monkeypatch.setattr(kernels, "scatter_rows", lambda *a: calls.append(1) or scatter(*a))
    bufs[0]._core.slots.row_scatter = kernels.scatter_rows  # (the core took it when built)
    assert bufs[1]._core.slots.row_scatter is None
    g = torch.Generator().manual_seed(0)

    def step(n: int) -> tuple:
        return (
            torch.randint(0, 255, (n, 2, 3, 3), generator=g, dtype=torch.uint8),
            torch.randint(-5, 5, (n,), generator=g),
            torch.randn(n, generator=g),
            {
                "flag": torch.rand(n, generator=g) > 0.5,
                "half": torch.randn(n, 2, generator=g).bfloat16(),
            },
        )

    for buf in bufs:
        g.manual_seed(0)
        for _ in range(3):
            ids = [buf.start_episode() for _ in range(3)]
            for _ in range(9):
                obs, action, reward, extras = step(3)
                buf.append_batch(ids, obs, action, reward, extras)
            obs, action, reward, extras = step(1)
            buf.append_observation_action_reward(
                ids[0], obs[0], action[0], reward[0], {k: v[0] for k, v in extras.items()}
            )
            for episode in ids:
                buf.end_episode(episode, "truncated", step(1)[0][0])
        buf._core.flush()
    assert bufs[0].stats()["evicted_episodes"] > 0
    assert calls  # the first buffer's flushes took the kernel ...
    # Rows ever handed out (an allocation number; the others were never written).
    written = bufs[1]._core.links.alloc >= 0
    assert torch.equal(bufs[0]._core.links.alloc >= 0, written)
    assert 0 < int(written.sum()) < written.shape[0]
    stored = [buf.memory.storage._storage for buf in bufs]
    keys = list(stored[1].keys(include_nested=True, leaves_only=True))
    assert len(keys) == 5  # ... and every field is compared
    for key in keys:
        got, want = (column[key][written].view(torch.uint8) for column in stored)
        assert torch.equal(got, want), key


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_a_field_of_no_bytes_is_stored_and_returned_on_every_storage(make_episode_buffer, storage):
    """A zero-size field (an empty extras vector, say) next to real ones: TorchRL makes no
    memmap file for it, and nothing may expect one (the disk reservation looked it up)."""
    buf = make_episode_buffer(16, 4, storage=storage)
    ids = [buf.start_episode() for _ in range(2)]
    for t in range(3):
        observations = np.full((2, 2), t, np.float32)
        extras = {"z": np.zeros((2, 0), np.float32)}
        buf.append_batch(ids, observations, np.zeros(2, np.int64), np.ones(2, np.float32), extras)
    buf.end_episode(ids[0], "terminated", np.zeros(2, np.float32))
    record = buf.get_episode(ids[0])
    assert record["observation"][:, 0].tolist() == [0.0, 1.0, 2.0, 0.0]
    assert record["z"].shape == (3, 0)
    assert buf.sample_n_step(4, n=2)["z"].shape == (4, 0)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_cpu_tensor_columns_are_advised_huge_pages_and_memmap_files_are_not(tmp_path, storage):
    """A CPU tensor column (16 MiB of observations) is advised transparent huge pages once
    TorchRL allocated it (its mapping carries the ``hg`` flag); memmap files are not."""
    probe = torch.empty(4 << 20, dtype=torch.uint8)
    if not replaybuf.storage.hugepages.advise_huge_pages(probe):
        pytest.skip("this kernel takes no MADV_HUGEPAGE advice")
    assert "hg" in _vm_flags(probe.data_ptr() + (2 << 20))
    buf = ReplayBuffer("cpu", "cpu", 4096, storage=storage, scratch_dir=tmp_path, seed=0)
    try:
        buf.add_batch(
            {
                "obs": torch.randn(8, 1024),
                "action": torch.zeros(8),
                "reward": torch.ones(8),
                "done": torch.zeros(8, dtype=torch.bool),
            }
        )
        column = buf._slots.column(("obs",))
        assert column.shape == (4096, 1024)
        middle = column.data_ptr() + column.numel() * column.element_size() // 2
        assert ("hg" in _vm_flags(middle)) == (storage == "tensor")
    finally:
        buf.close()
