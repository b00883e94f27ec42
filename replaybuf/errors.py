"""The few exception classes replaybuf raises.

Each subclasses the builtin a caller would expect (``ValueError`` for bad values and so on), so
``except ValueError`` keeps working, while ``except ReplayBufError`` catches everything of ours.
"""

from __future__ import annotations


class ReplayBufError(Exception):
    """Base class of every error replaybuf raises on purpose.

    ``argument``: the parameter (or data field) the error is about, where one is, so that a
    caller such as the command line can name its own flag for it; None otherwise. It survives
    pickling (``BaseException`` pickles the instance dict).
    """

    def __init__(self, *args: object, argument: str | None = None) -> None:
        super().__init__(*args)
        self.argument = argument


class ArgumentError(ReplayBufError, ValueError):
    """An argument whose value cannot work: out of range, over int64, beyond the buffer."""


class ArgumentTypeError(ReplayBufError, TypeError):
    """An argument (or a written value) of a type the call does not take."""


class IndexOutOfRangeError(ReplayBufError, IndexError):
    """An index or id outside the items the buffer stores or ever stored."""


class UnknownFieldError(ReplayBufError, KeyError):
    """A field or key name the buffer (or a batch) does not have."""

    def __str__(self) -> str:  # the message as given, not KeyError's repr of it
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class CapacityError(ReplayBufError, ValueError):
    """More than the buffer's capacity can hold, e.g. an episode longer than ``max_steps``."""


class InvalidStateError(ReplayBufError, RuntimeError):
    """A call the buffer's (or an iterator's) current state does not allow."""


class UnsupportedError(ReplayBufError, NotImplementedError):
    """A combination of options replaybuf does not implement; the message says which."""


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
    """The storing device or disk cannot hold the buffer, or the training device a batch;
    raised before anything is allocated. ``what`` names what needs the space."""

    def __init__(self, where: str, needed: int, free: int, what: str = "the buffer") -> None:
        self.where = where
        self.needed = needed
        self.free = free
        self.what = what
        super().__init__(
            f"not enough space on {where}: {what} needs {needed:,} bytes, {free:,} are free"
        )

    def __reduce__(self) -> tuple:  # picklable (Ray, multiprocessing): rebuild from the fields
        return type(self), (self.where, self.needed, self.free, self.what), self.__dict__


class CheckpointError(ReplayBufError, RuntimeError):
    """A checkpoint that cannot be written or read; the subclasses say why."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint in a directory: nothing saved there yet, or an interrupted save."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file that is missing, truncated, altered or malformed; the message names it."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint entry that points outside the checkpoint or through a symlink; never opened."""


class CheckpointKindError(CheckpointError, ValueError):
    """A checkpoint of another buffer kind than the one asked for; the message names both."""


class UnsupportedVersionError(CheckpointError, ValueError):
    """A checkpoint whose ``format_version`` this replaybuf cannot read."""

    def __init__(
        self, version: object, supported: int | None = None, where: str = "checkpoint"
    ) -> None:
        self.version = version
        self.supported = supported
        self.where = where
        expected = f"expected {supported}, " if supported is not None else ""
        super().__init__(
            f"{where}: format_version {expected}got {version!r}"
            " (written by another replaybuf version?)"
        )

    def __reduce__(self) -> tuple:  # picklable (Ray, multiprocessing): rebuild from the fields
        return type(self), (self.version, self.supported, self.where), self.__dict__
