"""Fault injection for the crash tests: ``REPLAYBUF_CRASH_AT=<phase>[:<k>]``.

The process SIGKILLs itself the k-th time (default 1) it reaches ``phase``, one of
:data:`CRASH_PHASES`. Unset (always, outside tests), :func:`crash_point` only reads the variable.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "REPLAYBUF_CRASH_AT"
CRASH_PHASES = (
    "after_tmp_created",
    "after_data_chunk",
    "after_data_file",
    "before_manifest",
    "after_manifest",
    "after_old_renamed",
    "after_publish_rename",
    "before_old_removed",
    "during_old_removal",
    "recover_after_rename",
)
_crash_counts: dict[str, int] = {}


def crash_point(phase: str) -> None:
    """SIGKILL this process at ``phase`` when ``REPLAYBUF_CRASH_AT`` asks for it (tests only)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != phase:
        return
    _crash_counts[phase] = _crash_counts.get(phase, 0) + 1
    if _crash_counts[phase] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
