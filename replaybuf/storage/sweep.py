"""Owner stamps in scratch folders, and the sweep that removes the folders of dead processes.

A process killed by a signal, or ended by ``os._exit``, never runs the finalizer that removes its
scratch folder. Each folder therefore holds a stamp naming its owner (:mod:`.owner`), and every
new scratch folder sweeps its parent: a ``replaybuf-*`` folder whose stamp names a process that
has certainly ended is removed. A folder without a readable, valid stamp (one being created,
another user's, one made by an older replaybuf, or not replaybuf's at all) is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from replaybuf.storage import owner

PREFIX = "replaybuf-"
STAMP = ".replaybuf-owner"
FORMAT = "replaybuf-scratch-owner/1"


@dataclass
class Swept:
    """What a sweep of one parent folder did."""

    removed: list[tuple[Path, int]] = field(default_factory=list)  # (folder, bytes it held)
    alive: list[Path] = field(default_factory=list)  # owners running (or not judged dead)
    unstamped: list[Path] = field(default_factory=list)  # no readable, valid stamp: left


def write_stamp(folder: Path) -> None:
    """Record this process as ``folder``'s owner, atomically: a sweep reads either no stamp
    (and leaves the folder) or a whole one, never half of one."""
    record = {"format": FORMAT, **owner.current()}
    partial = folder / f"{STAMP}.{os.getpid()}.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, folder / STAMP)


def read_stamp(folder: Path) -> dict | None:
    """The owner record in ``folder``'s stamp, or None where there is no valid one."""
    try:
        record = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.pop("format", None) != FORMAT:
        return None
    return record if owner.is_valid(record) else None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (files vanishing meanwhile count as 0)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def remove_stamped(folder: Path) -> None:
    """Remove ``folder``, its stamp last and only once nothing else is left: a removal cut
    short (the process killed, a file that would not go) leaves a stamped folder that the
    next sweep finishes, never an unstamped one nobody may remove. Errors are ignored (another
    process may be sweeping the same folder)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name == STAMP:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        if os.listdir(folder) == [STAMP]:
            os.unlink(folder / STAMP)
        os.rmdir(folder)
    except OSError:
        pass


def sweep(parent: str | os.PathLike) -> Swept:
    """Remove the ``replaybuf-*`` folders in ``parent`` whose stamped owner has ended.

    Raises OSError where ``parent`` cannot be listed."""
    swept = Swept()
    here = owner.current()
    with os.scandir(str(parent)) as entries:
        candidates = [
            Path(e.path)
            for e in entries
            if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)
        ]
    for folder in sorted(candidates):
        record = read_stamp(folder)
        if record is None:
            swept.unstamped.append(folder)
        elif record == here or not owner.is_dead(record, here):  # this process's: no look-up
            swept.alive.append(folder)
        else:
            size = folder_bytes(folder)
            remove_stamped(folder)
            if not folder.exists():
                swept.removed.append((folder, size))
    return swept
