"""No scratch folder outlives its process, whatever ends it.

Children build memmap buffers and are killed (SIGTERM, SIGHUP, SIGKILL) or leave by
``os._exit``: no finalizer runs, the folder stays, and the next buffer made in the same
``scratch_dir`` sweeps it away. The sweep never touches a running process's folder nor one it
did not stamp. The children import torch (seconds each), so one fixture starts them all at once.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from replaybuf import ReplayBuffer
from replaybuf.cli import main
from replaybuf.storage import owner
from replaybuf.storage.scratch import ScratchFolder
from replaybuf.storage.sweep import FORMAT, STAMP, read_stamp, sweep

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import os, signal, sys, time, torch
# What a signal does by default, whatever the parent ignores (nohup ignores SIGHUP).
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from replaybuf import ReplayBuffer
buf = ReplayBuffer("cpu", "cpu", 64, storage="memmap", scratch_dir=sys.argv[1])
buf.add_batch({"obs": torch.randn(10, 4), "action": torch.arange(10)})
print("SCRATCH", buf.stats()["scratch_dir"], flush=True)
if sys.argv[2] == "exit":
    os._exit(0)
time.sleep(600)
"""
ENDINGS = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP, "SIGKILL": signal.SIGKILL}
LINUX = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """name -> (child process, its scratch_dir, its scratch folder), each child with a buffer
    holding rows; "exit" has left by os._exit (unreaped), the others sleep until killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = {}
    for name in [*ENDINGS, "exit", "live"]:
        parent = tmp_path_factory.mktemp(name)
        mode = "exit" if name == "exit" else "sleep"
        command = [sys.executable, "-c", CHILD, str(parent), mode]
        started[name] = (subprocess.Popen(command, env=env, stdout=subprocess.PIPE), parent)
    found = {}
    try:
        for name, (child, parent) in started.items():
            assert child.stdout is not None
            # TorchRL logs to stdout too: skip to the marked line (or the end of the output).
            # No poll(): it would reap the "exit" child, whose zombie a test needs.
            line = child.stdout.readline()
            while line and not line.startswith(b"SCRATCH "):
                line = child.stdout.readline()
            assert line, f"child {name} printed no scratch folder"
            found[name] = (child, parent, Path(line.decode().split(" ", 1)[1].strip()))
        yield found
    finally:
        for child, _ in started.values():
            if child.poll() is None:
                child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()


def stamp(folder: Path, **changes) -> Path:
    """Make ``folder`` with a file of 1000 bytes and an owner stamp: this process's record
    with ``changes``."""
    (folder / "ragged-0-0").mkdir(parents=True)
    (folder / "ragged-0-0" / "tokens.memmap").write_bytes(b"x" * 1000)
    record = {"format": FORMAT, **owner.current(), **changes}
    (folder / STAMP).write_text(json.dumps(record))
    return folder


def ended_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_killed_process_leaves_its_folder_and_the_next_buffer_sweeps_it(children, ending):
    child, parent, folder = children[ending]
    assert read_stamp(folder) is not None
    assert read_stamp(folder)["pid"] == child.pid
    child.send_signal(ENDINGS[ending])
    assert child.wait(timeout=60) == -ENDINGS[ending]
    assert list(folder.rglob("*.memmap")), "no finalizer ran: the rows' files are still there"
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=parent) as buf:
        assert not folder.exists()
        assert [p.name for p in parent.iterdir()] == [Path(buf.stats()["scratch_dir"]).name]


@LINUX
def test_os_exit_leaves_the_folder_and_even_an_unreaped_child_is_swept(children):
    child, parent, folder = children["exit"]
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, left a zombie
    assert list(folder.rglob("*.memmap"))
    swept = sweep(parent)
    assert [path for path, _ in swept.removed] == [folder]
    assert not folder.exists()
    assert swept.removed[0][1] > 10 * 4 * 4  # the rows' bytes, at least
    assert child.wait(timeout=60) == 0


def test_a_running_process_keeps_its_folder(children):
    child, parent, folder = children["live"]
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=parent):
        assert folder.is_dir()
        assert list(folder.rglob("*.memmap"))
    assert sweep(parent).alive == [folder]
    assert child.poll() is None


def test_a_sweep_keeps_the_folders_of_the_process_sweeping(tmp_path):
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path) as buf:
        mine = Path(buf.stats()["scratch_dir"])
        assert sweep(tmp_path).alive == [mine]
        assert mine.is_dir()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_neither_sweeps_nor_removes_its_parent_folder(tmp_path):
    """A DataLoader worker's case: the child drops its copy of the buffer and makes its own."""
    buf = ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=tmp_path)
    folder = Path(buf.stats()["scratch_dir"])
    pid = os.fork()
    if pid == 0:  # the child: only os._exit, whatever happens
        try:
            del buf
            gc.collect()
            ScratchFolder(tmp_path).remove()
            os._exit(0 if folder.is_dir() else 1)
        except BaseException:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    assert folder.is_dir()
    assert read_stamp(folder)["pid"] == os.getpid()
    buf.close()
    assert list(tmp_path.iterdir()) == []


@LINUX
def test_a_reused_pid_does_not_keep_a_dead_owner_folder(tmp_path):
    # This process's pid, but another start time: the pid was reused since the owner died.
    reused = stamp(tmp_path / "replaybuf-reused", start="1")
    gone = stamp(tmp_path / "replaybuf-gone", pid=ended_pid())
    expected = {
        reused: 1000 + (reused / STAMP).stat().st_size,
        gone: 1000 + (gone / STAMP).stat().st_size,
    }
    swept = sweep(tmp_path)
    assert dict(swept.removed) == expected
    assert list(tmp_path.iterdir()) == []


def test_folders_not_stamped_by_replaybuf_or_not_judgeable_here_are_left(tmp_path):
    unstamped = tmp_path / "replaybuf-photos"
    (unstamped / "album").mkdir(parents=True)
    garbled = tmp_path / "replaybuf-garbled"
    garbled.mkdir()
    (garbled / STAMP).write_text("{not json")
    foreign = stamp(tmp_path / "replaybuf-foreign", pid=ended_pid(), format="someone-else/1")
    other_host = stamp(tmp_path / "replaybuf-other-host", pid=ended_pid(), host="elsewhere")
    other_boot = stamp(tmp_path / "replaybuf-other-boot", pid=ended_pid(), boot="another")
    unrelated = stamp(tmp_path / "checkpoints", pid=ended_pid())  # not a replaybuf-* name
    swept = sweep(tmp_path)
    assert swept.removed == []
    assert swept.unstamped == sorted([unstamped, garbled, foreign])
    assert swept.alive == sorted([other_host, other_boot])
    for folder in [unstamped / "album", garbled, foreign, other_host, other_boot, unrelated]:
        assert folder.is_dir()


def test_the_default_scratch_parent_is_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = stamp(tmp_path / "replaybuf-dead", pid=ended_pid())
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap") as buf:
        assert Path(buf.stats()["scratch_dir"]).parent == tmp_path
        assert not dead.exists()


def test_clean_removes_dead_owners_folders_and_says_how_many_bytes(tmp_path, capsys):
    dead = stamp(tmp_path / "replaybuf-dead", pid=ended_pid())
    size = 1000 + (dead / STAMP).stat().st_size
    unstamped = tmp_path / "replaybuf-notes"
    unstamped.mkdir()
    assert main(["clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {dead} ({size:,} bytes)" in out
    assert f"1 folder(s) removed, {size:,} bytes freed in {tmp_path}" in out
    assert "left 1 replaybuf-* folder(s) without an owner stamp" in out
    assert not dead.exists()
    assert unstamped.is_dir()


def test_clean_defaults_to_the_temp_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = stamp(tmp_path / "replaybuf-dead", pid=ended_pid())
    assert main(["clean"]) == 0
    assert f"bytes freed in {tmp_path}" in capsys.readouterr().out
    assert not dead.exists()


@pytest.mark.parametrize("what", ["missing", "file"])
def test_clean_names_a_dir_that_is_not_a_folder(tmp_path, capsys, what):
    target = tmp_path / what
    if what == "file":
        target.write_text("x")
    assert main(["clean", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"replaybuf clean: error: DIR: {target} is not a folder\n"
    assert "Traceback" not in captured.err
