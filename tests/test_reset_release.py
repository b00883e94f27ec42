"""A reset hands its old memmap folder to a background thread; nothing is left behind.

``ReplayBuffer.reset()`` renames the old scratch folder ``replaybuf-discarded-*`` (still
stamped) and returns; one shared thread drops the last references to its columns and removes
the files. These tests check that the folder goes, that a live buffer's files never do, that
``close()`` waits, that a free-space check waits for the pending removals, that a process
killed before the thread is done leaves a folder the next buffer sweeps, that a forked child
removes nothing of its parent's, and that a normal exit waits for the thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from replay_helpers import rows

import replaybuf.storage.space
from replaybuf import ReplayBuffer
from replaybuf.storage import scratch
from replaybuf.storage.scratch import DISCARDED
from replaybuf.storage.sweep import read_stamp

ROOT = Path(__file__).resolve().parent.parent
LINUX = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
# A child with a buffer in sys.argv[1] that resets it while its removals are held up (each
# takes sys.argv[3] seconds, or forever), then ends as sys.argv[2] says.
CHILD = """
import os, signal, sys, time, torch
import replaybuf.storage.scratch as scratch
from replaybuf import ReplayBuffer
original = scratch.remove_stamped
def slow(path):
    time.sleep(float(sys.argv[3]))
    original(path)
scratch.remove_stamped = slow
buf = ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=sys.argv[1])
for _ in range(2):
    buf.add_batch({"obs": torch.randn(10, 4), "action": torch.arange(10)})
    buf.reset()
buf.add_batch({"obs": torch.randn(10, 4), "action": torch.arange(10)})
print("PENDING", scratch.pending(), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
# "exit": a normal exit, the buffer still open and two removals under way
"""


def _folders(parent: Path) -> list[Path]:
    return sorted(parent.glob("replaybuf-*"))


def _run_child(parent: Path, ending: str, delay: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", CHILD, str(parent), ending, delay]
    return subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)


@pytest.fixture
def held_up(monkeypatch):
    """Removals wait until the returned event is set (set again at the end of the test)."""
    gate = threading.Event()
    original = scratch.remove_stamped

    def gated(path: Path) -> None:
        gate.wait(60)
        original(path)

    monkeypatch.setattr(scratch, "remove_stamped", gated)
    yield gate
    gate.set()
    assert scratch.drain(timeout=60)


def _mapped(folder: Path) -> list[str]:
    """This process's mappings of files under ``folder`` (Linux)."""
    text = Path("/proc/self/maps").read_text()
    return [line for line in text.splitlines() if str(folder) in line]


def test_reset_renames_the_old_folder_at_once_and_the_thread_removes_it(tmp_path, held_up):
    with ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 20))
        old = Path(buf.stats()["scratch_dir"])
        buf.reset()
        new = Path(buf.stats()["scratch_dir"])
        assert not old.exists()
        assert new.is_dir()
        assert new != old
        discarded = [f for f in _folders(tmp_path) if f.name.startswith(DISCARDED)]
        assert len(discarded) == 1
        assert read_stamp(discarded[0]) is not None
        assert scratch.pending() == 1
        held_up.set()
        assert scratch.drain(timeout=60)
        assert _folders(tmp_path) == [new]
        buf.add_batch(rows(20, 5))  # the new storage is whole
        assert len(buf) == 5


@LINUX
def test_the_old_columns_are_unmapped_once_the_thread_is_done(tmp_path):
    with ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 20))
        buf.sample_batch(8)
        assert _mapped(tmp_path)
        buf.reset()
        assert scratch.drain(timeout=60)
        assert _mapped(tmp_path) == []
        assert _folders(tmp_path) == [Path(buf.stats()["scratch_dir"])]


def test_a_live_buffers_files_are_never_removed(tmp_path):
    with (
        ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path) as kept,
        ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path) as reset,
    ):
        kept.add_batch(rows(0, 20))
        for start in range(0, 60, 20):
            reset.add_batch(rows(start, 20))
            reset.reset()
        reset.add_batch(rows(100, 3))
        assert scratch.drain(timeout=60)
        live = [Path(kept.stats()["scratch_dir"]), Path(reset.stats()["scratch_dir"])]
        assert _folders(tmp_path) == sorted(live)
        assert all(list(folder.rglob("*.memmap")) for folder in live)
        assert len(kept) == 20
        assert len(reset) == 3


def test_close_waits_for_its_folder_and_the_removals_before_it(tmp_path, monkeypatch):
    original = scratch.remove_stamped

    def slow(path: Path) -> None:
        time.sleep(0.2)
        original(path)

    monkeypatch.setattr(scratch, "remove_stamped", slow)
    buf = ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path)
    for start in range(0, 40, 20):
        buf.add_batch(rows(start, 20))
        buf.reset()
    assert scratch.pending()
    buf.close()
    assert scratch.pending() == 0
    assert list(tmp_path.iterdir()) == []


def test_a_space_check_waits_for_the_files_a_reset_left(tmp_path, monkeypatch, held_up):
    """A disk that looks full only while the old files remain is not full."""
    free = replaybuf.storage.space.free_bytes
    monkeypatch.setattr(
        replaybuf.storage.space,
        "free_bytes",
        lambda kind, *a: 0 if kind == "memmap" and scratch.pending() else free(kind, *a),
    )
    with ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 20))
        buf.reset()
        threading.Timer(0.2, held_up.set).start()
        buf.add_batch(rows(20, 5))  # checks the space: waits for the removal, then fits
        assert scratch.pending() == 0
        assert len(buf) == 5


def test_a_process_killed_right_after_a_reset_leaves_folders_the_next_buffer_sweeps(tmp_path):
    child = _run_child(tmp_path, "kill", "1e6")
    assert child.returncode == -9, child.stderr.decode()
    assert b"PENDING 2" in child.stdout
    left = _folders(tmp_path)
    assert len([f for f in left if f.name.startswith(DISCARDED)]) == 2
    assert len(left) == 3
    assert all(read_stamp(f) is not None for f in left)
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        assert _folders(tmp_path) == [Path(buf.stats()["scratch_dir"])]


def test_a_normal_exit_waits_for_the_removals(tmp_path):
    child = _run_child(tmp_path, "exit", "0.3")
    assert child.returncode == 0, child.stderr.decode()
    assert b"PENDING 2" in child.stdout  # both removals were under way at exit
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_removes_none_of_its_parents_folders(tmp_path, held_up):
    """A DataLoader worker's case, with the parent's removal still queued at the fork: the
    child resets and closes its copy and runs the exit drain, and every folder stays."""
    buf = ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=tmp_path)
    buf.add_batch(rows(0, 20))
    buf.reset()
    buf.add_batch(rows(20, 20))
    before = _folders(tmp_path)
    assert len(before) == 2
    assert scratch.pending() == 1
    pid = os.fork()
    if pid == 0:  # the child: only os._exit, whatever happens
        try:
            held_up.set()  # the child's copy: its own removals run (the parent's stay held)
            buf.reset()
            buf.close()
            scratch.drain(timeout=10)
            scratch._remover.stop()  # what the child's interpreter exit runs
            os._exit(0 if _folders(tmp_path) == before else 1)
        except BaseException:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    assert _folders(tmp_path) == before
    held_up.set()
    assert scratch.drain(timeout=60)
    assert _folders(tmp_path) == [Path(buf.stats()["scratch_dir"])]
    buf.close()
    assert list(tmp_path.iterdir()) == []
