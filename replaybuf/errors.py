"""The few exception classes replaybuf raises.

Each subclasses the builtin a caller would expect (``ValueError`` for bad values and so on), so
``except ValueError`` keeps working, while ``except ReplayBufError`` catches everything of ours.
"""

from __future__ import annotations


class ReplayBufError(Exception):
    """Base class of every error replaybuf raises on purpose."""


class SchemaError(ReplayBufError, ValueError):
    """Data whose keys, shapes or dtypes differ from the buffer's field spec."""


class EmptyBufferError(ReplayBufError, ValueError):
    """Sampling asked of a buffer that holds nothing (or too little) to sample."""


class BufferClosedError(ReplayBufError, RuntimeError):
    """An operation on a buffer after ``close()``."""


class EpisodeStateError(ReplayBufError, ValueError):
    """An episode id that is unknown, already ended or evicted for the operation asked."""


class MetadataError(ReplayBufError, ValueError):
    """A metadata file that is missing, corrupt, of another format or of another buffer."""


class InsufficientSpaceError(ReplayBufError, MemoryError):
    """The storing device or disk cannot hold the buffer; raised before anything is allocated."""

    def __init__(self, where: str, needed: int, free: int) -> None:
        self.where = where
        self.needed = needed
        self.free = free
        super().__init__(
            f"not enough space on {where}: the buffer needs {needed:,} bytes, {free:,} are free"
        )
