"""An episode buffer's whole episodes: one by id, k drawn at random, the stored ids.

A part of :class:`~replaybuf.buffers.episodes.SyncEpisodeReplayBuffer` (which inherits it),
kept apart so that each module holds one concern.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from replaybuf.args import positive_int
from replaybuf.buffers.locking import synchronized
from replaybuf.episodes import EpisodeCore
from replaybuf.errors import EmptyBufferError
from replaybuf.sampling import episode_record, torchrl_episode
from replaybuf.sampling.budget import transition_bytes
from replaybuf.storage import FieldSpec


class EpisodeRecords:
    """Whole episodes of a :class:`SyncEpisodeReplayBuffer` (its base class)."""

    # What the buffer provides (set in SyncEpisodeReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _core: EpisodeCore
    _generator: torch.Generator
    device: torch.device
    storing_device: torch.device
    ragged: str
    frame_stack: int | None

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def spec(self) -> FieldSpec | None: ...

        def _check_open(self) -> None: ...

        def _torchrl(self, layout: str | None) -> bool: ...

        def _ensure_fits(self, count: int, row_bytes: int, what: str = "batch") -> None: ...

    @synchronized
    def get_episode(self, episode_id: int, *, layout: str | None = None) -> TensorDict:
        """The whole stored episode (see :func:`replaybuf.sampling.records.episode_record`;
        with ``layout="torchrl"``, its transitions: :func:`~replaybuf.sampling.layout.
        torchrl_episode`)."""
        torchrl = self._torchrl(layout)
        self._check_open()
        episode = self._core.live(episode_id, "get")
        self._core.flush()
        record = episode_record(self._core, episode, self.device, self.ragged)
        return torchrl_episode(record) if torchrl else record

    @synchronized
    def sample_episodes(
        self, k: int, *, replace: bool = False, layout: str | None = None
    ) -> list[TensorDict]:
        """``k`` whole episodes drawn uniformly (distinct unless ``replace``; fewer if fewer)."""
        k = positive_int(k, "k")
        torchrl = self._torchrl(layout)
        self._check_open()
        ids = list(self._core.episodes)
        if not ids:
            raise EmptyBufferError("cannot sample episodes: the buffer holds none")
        if replace:  # k draws of episodes of the mean stored length
            length = -(-self._core.steps // len(ids)) + 1
            self._ensure_fits(k, length * transition_bytes(self.spec, self.frame_stack or 1))
            picks = torch.randint(
                0, len(ids), (k,), generator=self._generator, device=self.storing_device
            )
        else:
            picks = torch.randperm(len(ids), generator=self._generator, device=self.storing_device)[
                :k
            ]
        self._core.flush()
        records = [
            episode_record(self._core, self._core.episodes[ids[i]], self.device, self.ragged)
            for i in picks.tolist()
        ]
        return [torchrl_episode(r) for r in records] if torchrl else records

    @synchronized
    def episode_ids(self) -> list[int]:
        """The ids of the stored episodes (evicted ones are gone), in start order."""
        self._check_open()
        return sorted(self._core.episodes, key=lambda e: self._core.episodes[e].seq)
