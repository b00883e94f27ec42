"""One lock per sync buffer, so that collector, learner and prefetch threads can share it.

Every public call of :class:`~replaybuf.ReplayBuffer` and
:class:`~replaybuf.SyncEpisodeReplayBuffer` runs under the buffer's re-entrant lock: a write or
a sample is atomic with respect to every other call, as TorchRL's own ``ReplayBuffer`` takes a
lock around its writes and samples. The per-step appends and the hot samples take the lock
inline instead of through :func:`synchronized`, which saves a Python call per step or batch.

A public call is never run inside another on the same thread: code that runs in the middle of
a call (a signal handler, a garbage-collection callback, a torch function mode, a dict key's
``__eq__``) and calls the buffer again would find its state half-changed (a staging row chosen
and not yet filled, rows being evicted), so the inner call raises :func:`reentered`'s error
before it touches anything. Each call marks the buffer as in a call (``_calling``) while the
lock is held; the integrations that take the lock themselves to make several calls atomic
(the SB3 adapter, the Ray shard actor) do not mark it. The buffers' own code may still make
one public call inside another (``save_checkpoint`` calls ``begin_checkpoint``): a
synchronized call made inside another is let through when its caller is that code (the
caller's module, read only then), and the hot calls taking the lock inline are never made so.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from replaybuf.errors import InvalidStateError

P = ParamSpec("P")
R = TypeVar("R")


class HasLock(Protocol):
    _lock: Any
    _calling: bool


S = TypeVar("S", bound=HasLock)


def reentered(what: str) -> InvalidStateError:
    """The error of a call made while another call on the same buffer runs on this thread."""
    return InvalidStateError(
        f"{what}: called while another call on this buffer runs on the same thread (from "
        "code run during that call: a signal handler, a garbage-collection callback, a torch "
        "function mode, a dict key's __eq__); nothing was done. Call it after that call returns"
    )


# The modules whose public calls on a buffer may be made inside another of its calls: the
# buffers' own (a call made of others) and the checkpoint code they call; not the asyncio
# facade, whose `_nowait` calls a signal handler may make.
_OWN_CODE = ("replaybuf.buffers.", "replaybuf.persist.")
_FACADE = "replaybuf.buffers.aio"


def synchronized(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` under ``self._lock``, refusing a call made inside another by code other
    than the buffers' own (see above)."""

    @functools.wraps(method)
    def locked(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        lock = self._lock
        lock.acquire()  # by hand: a `with` block costs about twice as much
        if self._calling:  # inside another call: part of it, or refused
            try:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if not caller.startswith(_OWN_CODE) or caller.startswith(_FACADE):
                    raise reentered(method.__name__)
                return method(self, *args, **kwargs)
            finally:
                lock.release()
        self._calling = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._calling = False
            lock.release()

    return locked
