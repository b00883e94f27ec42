"""One episode's host bookkeeping, and the words the episode API takes and returns."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensordict import TensorDict

from replaybuf.core import END_NONE, END_TERMINATED, END_TRUNCATED
from replaybuf.errors import ReplayBufError

if TYPE_CHECKING:
    from replaybuf.episodes.batch_run import BatchRun
    from replaybuf.storage import Key, Ragged

# The statuses end_episode takes, and the end kind each records.
STATUSES = {"terminated": END_TERMINATED, "completed": END_TERMINATED, "truncated": END_TRUNCATED}
FRAME_PADDINGS = ("reset", "zero")  # gymnasium FrameStackObservation's padding_type values


@dataclass(slots=True)
class Episode:
    """One episode's bookkeeping on the host."""

    episode_id: int
    agent_id: str
    seq: int  # start order
    # Rows of obs_0 .. obs_{steps-1}, as far as settled (read :attr:`rows`): int64, so that
    # freeing them is a buffer copy, not a conversion of Python ints.
    own: array = field(default_factory=lambda: array("q"))
    final_row: int | None = None
    end_kind: int = END_NONE  # END_NONE while in progress
    final_observation: TensorDict | None = None  # only for episodes ended with zero steps
    final_ragged: dict[Key, Ragged] | None = None  # its ragged and non-tensor fields
    # The append_batch run this episode is in, which may hold rows not yet in ``own``.
    run: BatchRun | None = field(default=None, repr=False, compare=False)
    # The core's flush count when the episode ended: once a flush follows, every row of it is
    # in storage (-1: restored from a checkpoint, all of it in storage).
    end_flush: int = field(default=-1, repr=False, compare=False)

    @property
    def rows(self) -> array:
        """Rows of obs_0 .. obs_{steps-1} (the batch run's pending rows settled first)."""
        if self.run is not None:
            self.run.settle_rows()
        return self.own

    @property
    def steps(self) -> int:
        return len(self.rows)

    @property
    def in_progress(self) -> bool:
        return self.end_kind == END_NONE

    @property
    def valid_steps(self) -> int:
        """Steps whose next observation exists (sampling anchors)."""
        return self.steps if not self.in_progress else max(self.steps - 1, 0)

    @property
    def status(self) -> str:
        return {END_NONE: "in_progress", END_TERMINATED: "terminated"}.get(
            self.end_kind, "truncated"
        )


class RowsPinned(ReplayBufError, RuntimeError):
    """No free row while a checkpoint snapshot pins evicted rows; retry after it finishes."""
