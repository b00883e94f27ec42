"""replaybuf: a TorchRL-backed replay buffer that is correct, fast, and never loses data."""

from replaybuf.buffers import (
    EpisodeReplayBuffer,
    ReplayBuffer,
    ReplayDataset,
    SyncEpisodeReplayBuffer,
    as_dataset,
)
from replaybuf.collecting import collect
from replaybuf.core import compute_discounted_return, compute_importance_weights, sequence_priority
from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    BufferClosedError,
    CapacityError,
    CheckpointError,
    CheckpointKindError,
    CorruptCheckpointError,
    EmptyBufferError,
    EpisodeStateError,
    IndexOutOfRangeError,
    InsufficientSpaceError,
    InvalidStateError,
    MetadataError,
    NoCheckpointError,
    ReplayBufError,
    SchemaError,
    UnknownFieldError,
    UnsafeCheckpointError,
    UnsupportedError,
    UnsupportedVersionError,
)
from replaybuf.storage import Field, FieldSpec

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BufferClosedError",
    "CapacityError",
    "CheckpointError",
    "CheckpointKindError",
    "CorruptCheckpointError",
    "EmptyBufferError",
    "EpisodeReplayBuffer",
    "EpisodeStateError",
    "Field",
    "FieldSpec",
    "IndexOutOfRangeError",
    "InsufficientSpaceError",
    "InvalidStateError",
    "MetadataError",
    "NoCheckpointError",
    "ReplayBufError",
    "ReplayBuffer",
    "ReplayDataset",
    "SchemaError",
    "SyncEpisodeReplayBuffer",
    "UnknownFieldError",
    "UnsafeCheckpointError",
    "UnsupportedError",
    "UnsupportedVersionError",
    "__version__",
    "as_dataset",
    "collect",
    "compute_discounted_return",
    "compute_importance_weights",
    "sequence_priority",
]
