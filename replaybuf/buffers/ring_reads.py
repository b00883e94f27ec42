"""A ring buffer's reads: uniform and prioritized batches, rows by slot, every row in order.

A part of :class:`~replaybuf.buffers.ring.ReplayBuffer` (which inherits it), kept apart so that
each module holds one concern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from replaybuf.args import INT64_MAX, index_tensor, positive_int
from replaybuf.buffers.locking import reentered, synchronized
from replaybuf.errors import ArgumentTypeError, EmptyBufferError
from replaybuf.priority import Prioritizer, ring_keys
from replaybuf.sampling.budget import ensure_batch_fits
from replaybuf.storage import FieldSpec, Key, SlotStorage, field_key, uniform_batch

_NO_BATCH_SIZE = object()  # `_require()` without a batch size to check (None is a bad one)


class RingReads:
    """The reads of a :class:`ReplayBuffer` (which inherits this class)."""

    # What the buffer provides (set in ReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _closed: bool
    _slots: SlotStorage
    _generator: torch.Generator
    _priorities: Prioritizer | None
    _device: torch.device
    _storing_device: torch.device
    _size: int
    _pointer: int
    _writes: int

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def device(self) -> torch.device: ...

        @property
        def storing_device(self) -> torch.device: ...

        @property
        def buffer_size(self) -> int: ...

        @property
        def spec(self) -> FieldSpec | None: ...

        def _check_open(self) -> None: ...

    def _require(self, batch_size: Any = _NO_BATCH_SIZE) -> None:
        self._check_open()
        if batch_size is not _NO_BATCH_SIZE:
            positive_int(batch_size, "batch_size")
        if self._size == 0:
            raise EmptyBufferError("cannot sample: the buffer is empty")

    def _oldest_first(self) -> torch.Tensor:
        """Slots of the stored transitions, oldest first."""
        order = torch.arange(self._size, device=self.storing_device)
        if self._size == self.buffer_size:
            order = (order + self._pointer) % self.buffer_size
        return order

    def sample_batch(self, batch_size: int) -> TensorDict:
        """``batch_size`` transitions drawn uniformly with replacement, on ``device``."""
        lock = self._lock  # inline, as the per-step appends: the sampling hot path
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered("sample_batch")
        self._calling = True
        try:
            # One check of what a batch size usually is; anything else gets _require's verdict.
            ok = type(batch_size) is int and 0 < batch_size <= INT64_MAX and self._size
            if self._closed or not ok:
                self._require(batch_size)
            device, slots = self._device, self._slots
            spec = slots.spec
            if spec is not None:  # before the draws: a refusal leaves the generator as it was
                ensure_batch_fits(batch_size, spec.row_bytes, (device, self._storing_device))
            if self._priorities is not None:
                drawn, weight = self._priorities.draw(batch_size, self._generator)
                extra = ring_keys(drawn, weight, self._writes, self.buffer_size, device)
                return slots.gather(drawn, device, extra=extra)
            batch = uniform_batch(slots)  # on the host: the same draw, gathered in fewer calls
            if batch is not None and device == self._storing_device:
                return batch(self._size, batch_size, self._generator)
            drawn = torch.randint(
                0, self._size, (batch_size,), generator=self._generator, device=self._storing_device
            )
            return slots.gather(drawn, device)
        finally:
            self._calling = False
            lock.release()

    def sample_random(self, batch_size: int) -> TensorDict:
        """Alias of :meth:`sample_batch` (ObjectRL's name)."""
        return self.sample_batch(batch_size)

    @synchronized
    def sample_by_index(self, indices: Sequence[int] | range | torch.Tensor) -> TensorDict:
        """The transitions in the given storage slots (each in ``[0, size)``), on ``device``."""
        self._require()
        slots = index_tensor(indices, "indices", self._size, self.storing_device)
        return self._slots.gather(slots, self.device)

    @synchronized
    def sample_by_index_fields(
        self, indices: Sequence[int] | range | torch.Tensor, fields: Sequence[str | Key]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Some fields of the transitions in the given slots: a tensor, or a tuple in order."""
        self._require()
        if isinstance(fields, str) or not fields:
            raise ArgumentTypeError(
                f"fields must be a non-empty list of field names, got {fields!r}"
            )
        keys = [field_key(self.spec, f) for f in fields]
        slots = index_tensor(indices, "indices", self._size, self.storing_device)
        td = self._slots.gather(slots, self.device, keys=keys)
        values = tuple(td.get(k) for k in keys)
        return values[0] if len(values) == 1 else values

    @synchronized
    def sample_all(self) -> TensorDict:
        """Every stored transition, oldest first, on ``device``."""
        self._require()
        return self._slots.gather(self._oldest_first(), self.device)
