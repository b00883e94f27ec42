"""The SB3 adapter's public calls are never run inside one another on a thread.

The adapter keeps rows of its own beside the episode buffer (steps staged by ``add``, each
env's newest transition held aside) and changes them only while it holds the episode
buffer's lock. Code that runs in the middle of such a change and calls the adapter again on
the same thread (a signal handler, a garbage-collection callback, a torch function mode)
would find them half-written, as the buffers' own calls would (:mod:`replaybuf.buffers.locking`):
it gets the same ``InvalidStateError`` before it touches anything. The test is whether this
thread holds that lock already: another thread's call waits for it as before, and ``add``
pays one C call for it. The adapter's own calls made of others (``size`` reading
``transitions`` under the lock) pass, told apart by the caller's module, read only then.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from replaybuf.buffers.locking import reentered

R = TypeVar("R")
_OWN_CODE = "replaybuf.integrations.sb3."  # the adapter's modules


def one_call(method: Callable[..., R]) -> Callable[..., R]:
    """Run ``method`` unless this thread is inside one of the adapter's changes already and
    the call comes from code other than the adapter's (see the module docstring)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> R:
        buffer = self.__dict__.get("_buffer")  # absent while __init__ has not made it
        if (
            buffer is not None
            and buffer._lock._is_owned()
            and not sys._getframe(1).f_globals.get("__name__", "").startswith(_OWN_CODE)
        ):
            raise reentered(f"SB3ReplayBuffer.{method.__name__}")
        return method(self, *args, **kwargs)

    return call
