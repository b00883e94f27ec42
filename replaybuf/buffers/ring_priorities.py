"""A prioritized ``ReplayBuffer``'s priority updates and importance-weight exponent.

A part of :class:`~replaybuf.buffers.ring.ReplayBuffer` (which inherits it), kept apart so that
each module holds one concern: the ring's writes and uniform reads stay in ``ring``, what only
``prioritized=True`` uses lives here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from replaybuf.buffers.locking import synchronized
from replaybuf.errors import ArgumentError
from replaybuf.priority import Prioritizer, check_beta, update_ring


class RingPriorities:
    """Priority updates of a :class:`ReplayBuffer` (its base class)."""

    # What the buffer provides (set in ReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _priorities: Prioritizer | None
    _size: int
    _writes: int

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def storing_device(self) -> torch.device: ...

        @property
        def buffer_size(self) -> int: ...

        def _check_open(self) -> None: ...

    @synchronized
    def update_priorities(self, index: Any, priority: Any) -> int:
        """Set the priorities of sampled items; returns how many were applied.

        ``index`` holds ids from a batch's ``index``. An item overwritten since it was sampled
        is skipped (never applied to its slot's new occupant). Raises ``IndexError`` for an id
        that was never written, ``ValueError`` for a negative, NaN or infinite priority or a
        length mismatch; then nothing is applied.
        """
        self._check_open()
        if self._priorities is None:
            raise ArgumentError("update_priorities needs a buffer made with prioritized=True")
        return update_ring(
            self._priorities,
            index,
            priority,
            self._writes,
            self._size,
            self.buffer_size,
            self.storing_device,
        )

    @synchronized
    def set_beta(self, beta: float) -> None:
        """Change the importance-weight exponent (anneal it towards 1 during training)."""
        if self._priorities is None:
            raise ArgumentError("set_beta needs a buffer made with prioritized=True")
        self._priorities.beta = check_beta(beta)
