"""Keep TorchRL's "Initialized Lazy...Storage" INFO line off the console for replaybuf's storages.

TorchRL logs one INFO line, colored, on its own stdout handler, each time a lazy storage
allocates (at its first write). A buffer creating its storage is not news to the user, and the
line breaks progress bars (``replaybuf populate``). So a filter on the ``torchrl`` logger drops
exactly that message, and only while the current thread is inside :func:`quiet_allocation`,
which wraps replaybuf's own first writes. The user's logging configuration is left alone: the
logger's level and handlers are untouched, and a TorchRL storage the user makes still logs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

_MESSAGES = ("Initialized LazyMemmapStorage", "Initialized LazyTensorStorage")


class _AllocationFilter(logging.Filter):
    """Drops TorchRL's storage initialization message inside :func:`quiet_allocation`."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.local, "depth", 0):
            return True
        return not (isinstance(record.msg, str) and record.msg.startswith(_MESSAGES))


_FILTER = _AllocationFilter()
_INSTALL = threading.Lock()


def _install() -> None:
    """Put the filter on the ``torchrl`` logger (once; again if someone removed it)."""
    logger = logging.getLogger("torchrl")
    if _FILTER not in logger.filters:
        with _INSTALL:
            if _FILTER not in logger.filters:
                logger.addFilter(_FILTER)


@contextlib.contextmanager
def quiet_allocation() -> Iterator[None]:
    """Within the block, this thread's TorchRL storage initialization messages are dropped."""
    _install()
    local = _FILTER.local
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1
