"""replaybuf: a TorchRL-backed replay buffer that is correct, fast, and never loses data."""

from replaybuf.aio import EpisodeReplayBuffer
from replaybuf.buffer import ReplayBuffer
from replaybuf.collect import collect
from replaybuf.dataset import ReplayDataset, as_dataset
from replaybuf.episode_buffer import SyncEpisodeReplayBuffer
from replaybuf.errors import (
    BufferClosedError,
    CheckpointError,
    CheckpointKindError,
    CorruptCheckpointError,
    EmptyBufferError,
    EpisodeStateError,
    InsufficientSpaceError,
    MetadataError,
    NoCheckpointError,
    ReplayBufError,
    SchemaError,
    UnsafeCheckpointError,
    UnsupportedVersionError,
)
from replaybuf.nstep import compute_discounted_return
from replaybuf.per import compute_importance_weights, sequence_priority
from replaybuf.schema import Field, FieldSpec

__version__ = "0.1.0"

__all__ = [
    "BufferClosedError",
    "CheckpointError",
    "CheckpointKindError",
    "CorruptCheckpointError",
    "EmptyBufferError",
    "EpisodeReplayBuffer",
    "EpisodeStateError",
    "Field",
    "FieldSpec",
    "InsufficientSpaceError",
    "MetadataError",
    "NoCheckpointError",
    "ReplayBufError",
    "ReplayBuffer",
    "ReplayDataset",
    "SchemaError",
    "SyncEpisodeReplayBuffer",
    "UnsafeCheckpointError",
    "UnsupportedVersionError",
    "__version__",
    "as_dataset",
    "collect",
    "compute_discounted_return",
    "compute_importance_weights",
    "sequence_priority",
]
