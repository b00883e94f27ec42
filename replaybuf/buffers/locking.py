"""One lock per sync buffer, so that collector, learner and prefetch threads can share it.

Every public call of :class:`~replaybuf.ReplayBuffer` and
:class:`~replaybuf.SyncEpisodeReplayBuffer` runs under the buffer's re-entrant lock: a write or
a sample is atomic with respect to every other call, as TorchRL's own ``ReplayBuffer`` takes a
lock around its writes and samples. The per-step appends and ``sample_n_step`` take the lock
inline instead of through :func:`synchronized`, which saves a Python call per step or batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class HasLock(Protocol):
    _lock: Any


S = TypeVar("S", bound=HasLock)


def synchronized(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` under ``self._lock``."""

    @functools.wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        self._lock.acquire()  # by hand: a `with` block costs about twice as much
        try:
            return method(self, *args, **kwargs)
        finally:
            self._lock.release()

    return locked
