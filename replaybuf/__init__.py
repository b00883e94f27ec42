"""replaybuf: a TorchRL-backed replay buffer that is correct, fast, and never loses data."""

from replaybuf.buffer import ReplayBuffer
from replaybuf.errors import (
    BufferClosedError,
    EmptyBufferError,
    EpisodeStateError,
    InsufficientSpaceError,
    MetadataError,
    ReplayBufError,
    SchemaError,
)
from replaybuf.schema import Field, FieldSpec

__version__ = "0.1.0"

__all__ = [
    "BufferClosedError",
    "EmptyBufferError",
    "EpisodeStateError",
    "Field",
    "FieldSpec",
    "InsufficientSpaceError",
    "MetadataError",
    "ReplayBufError",
    "ReplayBuffer",
    "SchemaError",
    "__version__",
]
