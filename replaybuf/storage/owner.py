"""Who owns a scratch folder, and whether that process is still running.

An owner is a pid plus what tells a reused pid apart (the process's start time) and where that
pid means something (the kernel boot and the PID namespace). A folder's owner is judged dead only
when that is certain; anything unclear (another host or container, an unreadable process) reads
as alive, so a sweep can leave a dead process's folder behind but never removes a live one's.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

# The fields of a stamp, besides its format tag, and their types (None: unknown on this system).
FIELDS = ("pid", "start", "boot", "pidns", "host")


def _read(path: str) -> str | None:
    """A small system file's text, or None where it is missing or unreadable."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time in clock ticks since boot)`` from ``/proc/<pid>/stat`` (Linux), or
    None where the process or ``/proc`` is missing. The name (field 2) may hold spaces and
    parentheses, so the fields are counted from its last ``)``."""
    text = _read(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    fields = text.rpartition(")")[2].split()
    if len(fields) < 20:
        return None
    return fields[0], fields[19]  # fields 3 and 22


def _psutil_start(pid: int) -> tuple[str, str] | None:
    """``(status, creation time)`` from psutil where it is installed and ``/proc`` is not."""
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    try:
        process = psutil.Process(pid)
        return ("Z" if process.status() == "zombie" else "R"), repr(process.create_time())
    except psutil.Error:
        return None


def _state(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time, by whichever source this system has."""
    if os.path.isdir("/proc/self"):
        return _proc_stat(pid)
    return _psutil_start(pid)


def current() -> dict[str, Any]:
    """This process's owner record: what a stamp written now holds."""
    state = _state(os.getpid())
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "pid": os.getpid(),
        "start": None if state is None else state[1],
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
        "host": socket.gethostname(),
    }


def is_valid(record: Any) -> bool:
    """Whether ``record`` has an owner record's fields and types (a stamp we wrote)."""
    if not isinstance(record, dict) or set(FIELDS) - set(record):
        return False
    pid = record["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    return all(record[k] is None or isinstance(record[k], str) for k in FIELDS[1:])


def is_dead(record: dict[str, Any], here: dict[str, Any] | None = None) -> bool:
    """True only when the process ``record`` names has certainly ended: same host, boot and PID
    namespace as this process (``here``, default :func:`current`), and its pid is free, a zombie,
    or now held by a process that started at another time (a reused pid)."""
    here = current() if here is None else here
    if any(record[k] != here[k] for k in ("boot", "pidns", "host")):
        return False  # its pid means another process here, or nothing we can check
    pid = record["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's: its state below may still say zombie or reused
    except OSError:
        return False
    state = _state(pid)
    if state is None:
        return False  # alive, and nothing more can be read: keep it
    letter, start = state
    if letter in ("Z", "X"):
        return True  # exited, not yet reaped: it can no longer use the folder
    return record["start"] is not None and start != record["start"]
