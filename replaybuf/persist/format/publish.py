"""The commit protocol: publish a finished folder by rename, recover an interrupted one, lock.

``P`` is the checkpoint ``D``'s parent and ``u`` a fresh uuid; ``[lock P]`` is an ``flock`` on P
held only for the short steps, while the writer keeps its tmp folder locked as proof that it is
alive::

    [lock P] recover(D)
    write P/.D.replaybuf-tmp-u/data/*.bin, then its MANIFEST.json; fsync each file and folder
    [lock P] rename D -> P/.D.replaybuf-old-u       (only when D exists)
             rename P/.D.replaybuf-tmp-u -> D;  fsync P;  remove P/.D.replaybuf-old-u

    killed while writing the tmp folder  ->  D is the previous checkpoint, tmp an orphan
    killed between the two renames       ->  D is missing, tmp is complete: recovery renames it in
    killed after the second rename       ->  D is the new checkpoint, old an orphan

:func:`recover` (which every reader and writer runs first) puts a complete checkpoint back at D
and then deletes the dead ``.D.replaybuf-tmp-*`` / ``.D.replaybuf-old-*`` siblings, and nothing
else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from replaybuf.errors import CheckpointError, UnsupportedVersionError
from replaybuf.persist.format.crash import crash_point
from replaybuf.persist.format.manifest import read_manifest, scan
from replaybuf.persist.format.names import MANIFEST, target_path
from replaybuf.persist.format.streams import close_all, fsync_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process locking
    fcntl = None  # type: ignore[assignment]


def recover(directory: str | os.PathLike[str]) -> list[str]:
    """Finish or undo an interrupted save at ``directory`` and delete its dead siblings.

    With ``directory`` missing, the newest complete ``.<name>.replaybuf-tmp-*`` (a save killed
    between its two renames) is renamed in, else the newest complete ``-old-*`` backup. Then
    every ``.<name>.replaybuf-tmp-*`` / ``-old-*`` folder whose writer is gone is removed; a tmp
    folder still locked by a live writer is left alone. Returns what was done, one line each.
    """
    target = target_path(directory)
    if not siblings(target):
        return []
    with parent_lock(target.parent):
        return recover_locked(target)


def publish(tmp: Path, target: Path, durable: bool) -> None:
    """Replace ``target`` by the complete folder ``tmp``; the caller holds the parent lock."""
    old = sibling(target, "old", tmp.name.rsplit("-", 1)[1])
    had_old = os.path.lexists(target)
    if had_old:
        os.rename(target, old)
        crash_point("after_old_renamed")
    os.rename(tmp, target)
    crash_point("after_publish_rename")
    if durable:
        fsync_dir(target.parent)
    crash_point("before_old_removed")
    if had_old:
        remove_tree(old, crash_phase="during_old_removal")


def refuse_foreign(target: Path) -> None:
    """Only a replaybuf checkpoint or an empty folder may be replaced."""
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir():
        raise CheckpointError(
            f"{str(target)!r} exists and is a file or symlink, not a checkpoint folder;"
            " refusing to replace it"
        )
    if not any(target.iterdir()):
        return
    try:
        read_manifest(target)
    except UnsupportedVersionError:
        return  # ours, from another version
    except CheckpointError as exc:
        raise CheckpointError(
            f"{str(target)!r} exists and is not a replaybuf checkpoint ({exc});"
            " refusing to replace a folder replaybuf did not write"
        ) from None


def recover_locked(target: Path, keep: Path | None = None) -> list[str]:
    """Make ``target`` whole and delete dead siblings; the caller holds the parent lock."""
    done: list[str] = []
    dead = [(p, role) for p, role in siblings(target) if p != keep and not _alive(p)]
    if not os.path.lexists(target):
        for role in ("tmp", "old"):  # a finished tmp is newer than any backup
            complete = [p for p, r in dead if r == role and _is_complete(p)]
            if complete:
                best = max(complete, key=lambda p: (_created(p), p.name))
                try:
                    os.rename(best, target)
                    fsync_dir(target.parent)
                except OSError as exc:
                    raise CheckpointError(
                        f"cannot recover {str(target)!r} from {best.name}: {exc}"
                    ) from exc
                dead = [(p, r) for p, r in dead if p != best]
                done.append(f"renamed {best.name} to {target.name}")
                crash_point("recover_after_rename")
                break
    for path, _ in dead:
        remove_tree(path)  # best effort: a read-only parent still lets a checkpoint load
        done.append(f"{'left' if os.path.lexists(path) else 'removed'} {path.name}")
    return done


def siblings(target: Path) -> list[tuple[Path, str]]:
    """The ``.<name>.replaybuf-tmp-<hex>`` / ``-old-<hex>`` folders next to ``target``."""
    pattern = re.compile(re.escape(f".{target.name}.replaybuf-") + r"(tmp|old)-[0-9a-f]{32}")
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return []
    return [
        (Path(e.path), m.group(1))
        for e in entries
        if (m := pattern.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)
    ]


def sibling(target: Path, role: str, token: str) -> Path:
    return target.parent / f".{target.name}.replaybuf-{role}-{token}"


def _alive(path: Path) -> bool:
    """Whether a live writer holds ``path`` (a tmp folder) locked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return not flock(fd, blocking=False)
    finally:
        os.close(fd)


def _is_complete(path: Path) -> bool:
    """A manifest that parses and every file it lists present at its size (hashes not read)."""
    try:
        _, _, fds, problems = scan(path, None, stop_early=True)
    except CheckpointError:
        return False
    close_all(list(fds.values()))
    return not problems


def _created(path: Path) -> str:
    try:
        return str(read_manifest(path).get("created", ""))
    except CheckpointError:
        return ""


@contextlib.contextmanager
def parent_lock(parent: Path, *, best_effort: bool = False) -> Iterator[None]:
    """An exclusive ``flock`` on ``parent``: publishing, recovery and opening never overlap."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        if not best_effort:  # a reader of a missing or unreadable parent goes on unlocked
            raise
        yield
        return
    try:
        flock(fd, blocking=True)
        yield
    finally:
        os.close(fd)


def flock(fd: int, *, blocking: bool) -> bool:
    """Lock ``fd`` exclusively; False when another holder has it (non-blocking only)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: proceed unlocked
        return True
    return True


def remove_tree(path: Path, crash_phase: str | None = None) -> None:
    """Delete a folder we created: the manifest first, so a half-deleted one reads incomplete."""
    with contextlib.suppress(OSError):  # best effort: a leftover is retried by the next recover
        os.unlink(path / MANIFEST)
    if crash_phase:
        crash_point(crash_phase)
    shutil.rmtree(path, ignore_errors=True)
