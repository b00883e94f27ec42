"""replaybuf: a TorchRL-backed replay buffer that is correct, fast, and never loses data."""

from replaybuf.aio import EpisodeReplayBuffer
from replaybuf.buffer import ReplayBuffer
from replaybuf.episode_buffer import SyncEpisodeReplayBuffer
from replaybuf.errors import (
    BufferClosedError,
    EmptyBufferError,
    EpisodeStateError,
    InsufficientSpaceError,
    MetadataError,
    ReplayBufError,
    SchemaError,
)
from replaybuf.nstep import compute_discounted_return
from replaybuf.schema import Field, FieldSpec

__version__ = "0.1.0"

__all__ = [
    "BufferClosedError",
    "EmptyBufferError",
    "EpisodeReplayBuffer",
    "EpisodeStateError",
    "Field",
    "FieldSpec",
    "InsufficientSpaceError",
    "MetadataError",
    "ReplayBufError",
    "ReplayBuffer",
    "SchemaError",
    "SyncEpisodeReplayBuffer",
    "__version__",
    "compute_discounted_return",
]
