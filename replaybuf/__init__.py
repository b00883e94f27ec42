"""replaybuf: a TorchRL-backed replay buffer that is correct, fast, and never loses data."""

from replaybuf.buffers import (
    EpisodeReplayBuffer,
    ReplayBuffer,
    ReplayDataset,
    SyncEpisodeReplayBuffer,
    as_dataset,
)
from replaybuf.collect import collect
from replaybuf.core import compute_discounted_return, compute_importance_weights, sequence_priority
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
from replaybuf.storage import Field, FieldSpec

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
