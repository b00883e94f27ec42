"""A private scratch folder for memmap files, removed on close, garbage collection or exit, and
by the next buffer in the same parent folder where its process was killed.

TorchRL's default is anonymous files in ``/dev/shm`` (that is, RAM), cleaned up by process-wide
SIGINT/SIGTERM handlers; ours lives on disk and is removed by a ``weakref.finalize``, which
touches no signal handler. A process ended by SIGKILL, SIGTERM, SIGHUP or ``os._exit`` runs no
finalizer, so each folder is stamped with its owner and every new one sweeps its parent
(:mod:`replaybuf.storage.sweep`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from replaybuf.errors import ArgumentError
from replaybuf.storage.sweep import PREFIX, sweep, write_stamp


def _remove_if_owner(path: Path, owner: int) -> None:
    """Remove ``path`` only in the process that created it: a forked child (a DataLoader
    worker, multiprocessing) that drops its copy of a buffer must not delete the parent's."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


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

    def remove(self) -> None:
        """Remove the folder and its files now (later calls do nothing)."""
        self._finalizer()
