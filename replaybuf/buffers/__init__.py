"""The public buffers: ReplayBuffer, SyncEpisodeReplayBuffer, the asyncio facade, datasets."""

from replaybuf.buffers.aio import EpisodeReplayBuffer
from replaybuf.buffers.dataset import ReplayDataset, as_dataset
from replaybuf.buffers.episodes import SyncEpisodeReplayBuffer
from replaybuf.buffers.ring import ReplayBuffer

__all__ = [
    "EpisodeReplayBuffer",
    "ReplayBuffer",
    "ReplayDataset",
    "SyncEpisodeReplayBuffer",
    "as_dataset",
]
