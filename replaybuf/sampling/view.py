"""What samplers read of the episode core: a narrow, read-only view of it.

Samplers take an :class:`EpisodeView` rather than the core itself: they read the stored rows,
the row links, the anchor set and the priorities, and never write through them (writes are
the core's, under the buffer's lock). :class:`~replaybuf.episodes.EpisodeCore` satisfies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Protocol

import torch

from replaybuf.episodes import AnchorSet, Episode, RowLinks
from replaybuf.priority import Prioritizer
from replaybuf.storage import SlotStorage


class EpisodeView(Protocol):
    """The episode core as samplers see it."""

    @property
    def slots(self) -> SlotStorage: ...  # the stored rows

    @property
    def links(self) -> RowLinks: ...  # each row's episode, step, successor, end kind

    @property
    def anchors(self) -> AnchorSet: ...  # the rows a sample may start from

    @property
    def priorities(self) -> Prioritizer | None: ...

    @property
    def episodes(self) -> Mapping[int, Episode]: ...  # the stored episodes by id: their rows

    @property
    def kernels(self) -> ModuleType | None: ...  # the numba kernels, on CPU storage

    @property
    def frame_stack(self) -> int | None: ...

    @property
    def max_steps(self) -> int: ...  # the longest an episode, so a window, can be

    @property
    def frame_padding(self) -> str: ...

    def row_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Ids of the rows' current contents (what ``update_priorities`` takes)."""
        ...

    def holds_steps(self, length: int) -> bool:
        """Whether some stored episode has ``length`` valid steps."""
        ...
