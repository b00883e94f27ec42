"""ObjectRL's ``ReplayBuffer`` at first contact: ``reset()`` costs what freeing the storage
costs (no garbage collection unless creating storage fails), ``epoch_iterator`` and ``device``
behave as ObjectRL's attributes, and ``save()`` says at once that it saved metadata only."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import weakref
from pathlib import Path

import pytest
import torch

from replaybuf import (
    ArgumentError,
    ArgumentTypeError,
    EpisodeReplayBuffer,
    ReplayBuffer,
    SyncEpisodeReplayBuffer,
)
from replaybuf.persist import metadata
from replaybuf.persist.metadata import SavedMetadata
from replaybuf.storage import SlotStorage, scratch


@pytest.fixture
def collections(monkeypatch):
    """Counts gc.collect calls (the real collector still runs)."""
    calls = []
    real = gc.collect

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(gc, "collect", counting)
    return calls


def _filled(storage: str = "memmap", rows: int = 64, **kwargs) -> ReplayBuffer:
    buf = ReplayBuffer("cpu", "cpu", rows, storage=storage, seed=0, **kwargs)
    buf.add_batch({"x": torch.arange(float(rows)), "y": torch.zeros(rows, 3)})
    return buf


# ----------------------------------------------------------------- reset
@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_reset_runs_no_garbage_collection(collections, storage):
    with _filled(storage) as buf:
        buf.reset()
        buf.reset(32)
        buf.add_batch({"x": torch.arange(5.0), "y": torch.zeros(5, 3)})
        assert len(buf) == 5
    assert collections == []


def test_reset_releases_the_old_memmap_files_and_storage_without_a_collection():
    gc.disable()
    try:
        with _filled("memmap") as buf:
            old_folder = Path(buf.stats()["scratch_dir"])
            assert any(old_folder.glob("*.memmap"))
            old_column = weakref.ref(buf.memory.storage._storage["y"])
            buf.reset()
            assert not old_folder.exists()  # renamed at once, removed in the background
            assert scratch.drain(timeout=60)  # where the old columns' last references go
            assert old_column() is None  # and their mapping freed, by refcounting alone
            buf.add_batch({"x": torch.arange(3.0), "y": torch.zeros(3, 3)})
            assert Path(buf.stats()["scratch_dir"]) != old_folder
    finally:
        gc.enable()


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_close_frees_the_rows_without_a_collection(storage):
    gc.disable()
    try:
        buf = _filled(storage)
        column = weakref.ref(buf.memory.storage._storage["y"])
        buf.close()
        assert column() is None
    finally:
        gc.enable()


def test_a_failed_storage_creation_is_retried_once_after_a_collection(
    collections, monkeypatch, caplog
):
    with _filled("memmap", print_gc_warning=True) as buf:
        real, failures = buf._slots.reset, []

        def flaky(*args):
            if not failures:
                failures.append(args)
                raise OSError(12, "Cannot allocate memory")
            real(*args)

        monkeypatch.setattr(buf._slots, "reset", flaky)
        with caplog.at_level(logging.WARNING, logger="replaybuf"):
            buf.reset()
        assert len(failures) == 1
        assert len(collections) == 1
        assert "garbage collector" in caplog.text
        assert len(buf) == 0
        assert buf.spec is None


def test_a_second_failure_raises(collections, monkeypatch):
    with _filled("memmap") as buf:
        monkeypatch.setattr(
            buf._slots,
            "reset",
            lambda *a: (_ for _ in ()).throw(OSError(24, "Too many open files")),
        )
        with pytest.raises(OSError, match="Too many open files"):
            buf.reset()
        assert len(collections) == 1


def test_a_first_write_that_fails_to_allocate_is_retried_once_after_a_collection(
    collections, monkeypatch
):
    real, failures = SlotStorage.extend, []

    def flaky(self, data):
        if not failures:
            failures.append(1)
            raise OSError(12, "Cannot allocate memory")
        real(self, data)

    monkeypatch.setattr(SlotStorage, "extend", flaky)
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", spec={"x": ((), torch.float32)}) as buf:
        buf.add({"x": 1.0})
        buf.add({"x": 2.0})  # not the first write: not retried, and needs no retry
        assert len(collections) == 1
        assert len(buf) == 2
        assert buf.sample_all()["x"].tolist() == [1.0, 2.0]


# ----------------------------------------------------------------- attributes
def test_epoch_iterator_is_the_installed_iterator_and_none_resets_it():
    with _filled("tensor", rows=8) as buf:
        assert buf.epoch_iterator is None
        iterator = buf.create_epoch_iterator(4, shuffle=False)
        assert buf.epoch_iterator is iterator
        assert buf.get_next_batch(4)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        buf.epoch_iterator = None  # ObjectRL: drop it, get_next_batch samples at random
        assert buf.epoch_iterator is None
        assert buf.get_next_batch(4).batch_size == torch.Size([4])
        assert buf.get_steps_and_iterator(2, 0, 4) == 4
        assert buf.epoch_iterator is not None
        for _ in range(4):
            buf.get_next_batch(4)
        buf.get_next_batch(4)  # exhausted: dropped, a random batch instead
        assert buf.epoch_iterator is None
        buf.create_epoch_iterator(4)
        buf.reset()
        assert buf.epoch_iterator is None


def test_epoch_iterator_takes_any_iterator_of_batches_and_refuses_other_values():
    with _filled("tensor", rows=8) as buf:
        mine = iter([buf.sample_by_index([5, 6])])
        buf.epoch_iterator = mine
        assert buf.get_next_batch(2)["x"].tolist() == [5.0, 6.0]
        with pytest.raises(ArgumentTypeError, match="epoch_iterator"):
            buf.epoch_iterator = [1, 2]  # an iterable, not an iterator
        assert buf.epoch_iterator is mine


def test_device_is_assignable_and_storing_device_is_not():
    with _filled("tensor", rows=8) as buf:
        buf.device = "cpu"
        assert buf.device == torch.device("cpu")
        assert buf.sample_batch(2).device == torch.device("cpu")
        with pytest.raises(ArgumentError, match="device"):
            buf.device = "nonsense"
        with pytest.raises(AttributeError):
            buf.storing_device = "cpu"  # the rows and the sampler live there
        for name in ("buffer_size", "size", "data_size", "pointer", "memory"):
            with pytest.raises(AttributeError):
                setattr(buf, name, 1)  # derived from the rows: never silently out of step
        buf.print_gc_warning = True  # a plain flag, as ObjectRL's
        assert buf.print_gc_warning is True


# ----------------------------------------------------------------- save
@pytest.fixture
def first_save(monkeypatch):
    """As if no metadata save had happened yet in this process."""
    monkeypatch.setattr(metadata, "_warned", False)


def test_save_says_it_saved_metadata_only_and_warns_once(first_save, tmp_path, caplog):
    with _filled("tensor", rows=8) as buf, caplog.at_level(logging.WARNING, logger="replaybuf"):
        saved = buf.save(tmp_path / "buf")
        again = buf.save(tmp_path / "again")
    assert isinstance(saved, SavedMetadata)
    assert saved.contents_saved is False
    assert "save_checkpoint" in saved.note
    assert saved.path == tmp_path / "buf.metadata"
    assert saved.path.is_file()
    assert os.fspath(again) == str(tmp_path / "again.metadata")
    warnings = [r for r in caplog.records if "metadata only" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "save_checkpoint" in warnings[0].getMessage()


def test_episode_buffers_save_says_so_too(first_save, tmp_path, caplog):
    with SyncEpisodeReplayBuffer(16, seed=0) as buf:
        with caplog.at_level(logging.WARNING, logger="replaybuf"):
            saved = buf.save(tmp_path / "sync")
        assert saved.contents_saved is False
        assert saved.path.is_file()

    async def run() -> SavedMetadata:
        async with EpisodeReplayBuffer(16, seed=0) as abuf:
            return await abuf.save(tmp_path / "aio")

    saved = asyncio.run(run())
    assert saved.contents_saved is False
    assert saved.path.is_file()
    assert sum("metadata only" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_metadata_save_leaves_no_file(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metadata.os, "fsync", failing)
    with _filled("tensor", rows=8) as buf, pytest.raises(OSError, match="No space left"):
        buf.save(tmp_path / "buf")
    assert list(tmp_path.iterdir()) == []
