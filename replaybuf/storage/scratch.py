"""A private scratch folder for memmap files, removed on close, reset, garbage collection or
exit, and by the next buffer in the same parent folder where its process was killed.

TorchRL's default is anonymous files in ``/dev/shm`` (that is, RAM), cleaned up by process-wide
SIGINT/SIGTERM handlers; ours lives on disk and is removed by a ``weakref.finalize``, which
touches no signal handler. A process ended by SIGKILL, SIGTERM, SIGHUP or ``os._exit`` runs no
finalizer, so each folder is stamped with its owner and every new one sweeps its parent
(:mod:`replaybuf.storage.sweep`).

Removing a folder of freshly written memmap files is the kernel's work (unmapping the columns
and unlinking the files' dirty pages), and grows with the bytes written, not with anything
Python holds. A reset, which makes a new folder at once, hands the old one to one shared
background thread instead (:meth:`ScratchFolder.remove` with ``wait=False``): the folder is
renamed ``replaybuf-discarded-*`` (still stamped, so if the process dies before the thread is
done the next sweep removes it), and the thread drops the last references to its columns and
removes the files. Interpreter exit waits for that thread (``atexit``), so a normal exit
leaves nothing; :func:`drain` waits for it on demand. A closing buffer (``wait=True``) waits
for its own folder and every removal queued before it, so ``close()`` gives the space back
before it returns.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

from replaybuf.errors import ArgumentError
from replaybuf.storage.sweep import PREFIX, remove_stamped, sweep, write_stamp

DISCARDED = f"{PREFIX}discarded-"  # a removed folder's name while the background removes it


def _remove_if_owner(path: Path, owner: int) -> None:
    """Remove ``path`` only in the process that created it: a forked child (a DataLoader
    worker, multiprocessing) that drops its copy of a buffer must not delete the parent's."""
    if os.getpid() == owner:
        remove_stamped(path)


class _Removal:
    """A folder the background thread removes, and the columns it drops first."""

    def __init__(self, path: Path, owner: int, held: list[Any]) -> None:
        self.path, self.owner, self.held = path, owner, held
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.held.clear()  # the last references to the mapped columns: unmapped here
            _remove_if_owner(self.path, self.owner)
        finally:
            self.done.set()


class _Remover:
    """One daemon thread, started on first use, that runs queued removals in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.queue: queue.SimpleQueue[_Removal | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.pending = 0  # removals queued and not yet done
        self.stopped = False  # after the exit drain: removals run in the caller

    def submit(self, removal: _Removal) -> None:
        with self.lock:
            if not self.stopped:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._work, name="replaybuf-scratch-remover", daemon=True
                    )
                    self.thread.start()
                self.pending += 1
                self.queue.put(removal)
                return
        removal.run()

    def _work(self) -> None:
        while (removal := self.queue.get()) is not None:
            with contextlib.suppress(Exception):  # one failed removal must not stop the rest
                removal.run()
            with self.lock:
                self.pending -= 1
                if not self.pending:
                    self.idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued removal is done; whether they are (False: timed out)."""
        with self.lock:
            return self.idle.wait_for(lambda: not self.pending, timeout)

    def stop(self) -> None:
        """Finish every queued removal and end the thread (interpreter exit)."""
        with self.lock:
            self.stopped, thread = True, self.thread
            if thread is not None:
                self.queue.put(None)
        if thread is not None:
            thread.join()


_remover = _Remover()


def _forget_parents_removals() -> None:
    """In a forked child: a remover of its own. The parent's thread does not exist here, and
    its queue (and lock, which the fork may have caught held) are the parent's business."""
    global _remover
    _remover = _Remover()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_removals)
atexit.register(lambda: _remover.stop())


def drain(timeout: float | None = None) -> bool:
    """Wait until the folders handed to the background thread are removed; whether they are
    (False only where ``timeout`` seconds passed first)."""
    return _remover.drain(timeout)


def pending() -> int:
    """How many folders the background thread has yet to remove."""
    return _remover.pending


def drain_if_pending() -> bool:
    """:func:`drain` where removals are pending (a check of free disk space, which counts
    their files until they are gone); whether there were any."""
    if not _remover.pending:
        return False
    _remover.drain()
    return True


def check_scratch_dir(parent: str | os.PathLike | None) -> None:
    """``scratch_dir`` None (the temp folder) or an existing folder, else ArgumentError."""
    if parent is not None and not Path(parent).is_dir():
        raise ArgumentError(
            f"scratch_dir must be an existing directory, got {str(parent)!r}",
            argument="scratch_dir",
        )


class ScratchFolder:
    """A private folder for memmap files, removed on close, garbage collection or exit."""

    def __init__(self, parent: str | os.PathLike | None) -> None:
        check_scratch_dir(parent)
        # Absolute, so cleanup still finds it after the process changes directory.
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent)).absolute()
        # weakref.finalize also runs at interpreter exit, and never touches signal handlers.
        self._finalizer = weakref.finalize(self, _remove_if_owner, self.path, os.getpid())
        write_stamp(self.path)  # before any file: a sweep leaves an unstamped folder alone
        # The folders of processes killed before their cleanup; a parent that cannot be listed
        # only keeps what it held.
        with contextlib.suppress(OSError):
            sweep(self.path.parent)

    def remove(self, held: list[Any] | None = None, *, wait: bool = True) -> None:
        """Remove the folder and its files (later calls do nothing), after emptying ``held``
        (the columns mapped from its files: the list that holds their last references).

        ``wait=False``: the folder is renamed at once and removed by the background thread,
        which also drops ``held``; nothing must use those columns after. ``wait=True``: done
        before this returns, as is every removal queued before it. In a forked child that did
        not create the folder, nothing is removed or renamed."""
        detached = self._finalizer.detach()
        held = [] if held is None else held
        if detached is None:
            return
        _, _, (path, owner), _ = detached
        if os.getpid() != owner:
            return
        if wait and not _remover.pending:
            _Removal(path, owner, held).run()
            return
        target = path.with_name(DISCARDED + path.name[len(PREFIX) :])
        with contextlib.suppress(OSError):  # a folder that cannot be renamed goes where it is
            if not target.exists():
                path = path.rename(target)
        removal = _Removal(path, owner, held)
        _remover.submit(removal)
        if wait:
            removal.done.wait()
