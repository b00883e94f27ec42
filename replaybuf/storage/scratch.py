"""A private scratch folder for memmap files, removed on close, garbage collection or exit.

TorchRL's default is anonymous files in ``/dev/shm`` (that is, RAM), cleaned up by process-wide
SIGINT/SIGTERM handlers; ours lives on disk and is removed by a ``weakref.finalize``, which
touches no signal handler.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path


def _remove_if_owner(path: Path, owner: int) -> None:
    """Remove ``path`` only in the process that created it: a forked child (a DataLoader
    worker, multiprocessing) that drops its copy of a buffer must not delete the parent's."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


class ScratchFolder:
    """A private folder for memmap files, removed on close, garbage collection or exit."""

    def __init__(self, parent: str | os.PathLike | None) -> None:
        if parent is not None and not Path(parent).is_dir():
            raise ValueError(f"scratch_dir must be an existing directory, got {str(parent)!r}")
        # Absolute, so cleanup still finds it after the process changes directory.
        self.path = Path(tempfile.mkdtemp(prefix="replaybuf-", dir=parent)).absolute()
        # weakref.finalize also runs at interpreter exit, and never touches signal handlers.
        self._finalizer = weakref.finalize(self, _remove_if_owner, self.path, os.getpid())

    def remove(self) -> None:
        """Remove the folder and its files now (later calls do nothing)."""
        self._finalizer()
