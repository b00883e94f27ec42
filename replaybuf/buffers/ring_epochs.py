"""A ``ReplayBuffer``'s epochs (every stored transition once per epoch, ObjectRL's iterator API)
and its endless dataset.

A part of :class:`~replaybuf.buffers.ring.ReplayBuffer` (which inherits it), kept apart so that
each module holds one concern. Each epoch is planned from the transitions stored when it
starts; each batch is gathered under the buffer's lock, released before the batch is handed
over, so writers and other threads go on between batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from replaybuf.args import NArg, int_at_least, positive_int
from replaybuf.buffers.dataset import ReplayDataset, check_dataset_args, transitions_dataset
from replaybuf.buffers.locking import synchronized
from replaybuf.buffers.prefetch import Prefetcher, prefetching
from replaybuf.core import epoch_batches, num_batches
from replaybuf.errors import ArgumentTypeError, InvalidStateError
from replaybuf.priority import Prioritizer, ring_keys
from replaybuf.storage import (
    SlotStorage,
)


class RingEpochs:
    """Epoch iterators of a :class:`ReplayBuffer` (its base class)."""

    # What the buffer provides (set in ReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _slots: SlotStorage
    _priorities: Prioritizer | None
    _generator: torch.Generator
    _size: int
    _pointer: int
    _writes: int
    _resets: int
    _iterator: Iterator[TensorDict] | None
    device: torch.device

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def storing_device(self) -> torch.device: ...

        @property
        def buffer_size(self) -> int: ...

        def _check_open(self) -> None: ...

        def _require(self, batch_size: Any = ...) -> None: ...

        def _oldest_first(self) -> torch.Tensor: ...

        def sample_batch(self, batch_size: int) -> TensorDict: ...

    # ----------------------------------------------------------------- epochs
    @property
    def epoch_iterator(self) -> Iterator[TensorDict] | None:
        """The iterator :meth:`get_next_batch` draws from (ObjectRL's attribute): the one
        :meth:`create_epoch_iterator` or :meth:`get_steps_and_iterator` installed, ``None``
        when there is none (or it was exhausted). Assign ``None`` to drop it, so that
        ``get_next_batch`` samples at random, or any iterator of batches to draw from it."""
        return self._iterator

    @epoch_iterator.setter
    def epoch_iterator(self, value: Iterator[TensorDict] | None) -> None:
        if value is not None and not isinstance(value, Iterator):
            raise ArgumentTypeError(
                f"epoch_iterator must be None or an iterator, got {type(value).__name__}",
                argument="epoch_iterator",
            )
        with self._lock:
            self._iterator = value

    @synchronized
    def create_epoch_iterator(
        self,
        batch_size: int,
        n_epochs: int = 1,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        prefetch: int = 0,
    ) -> Iterator[TensorDict]:
        """Batches over ``n_epochs`` epochs; each visits every stored transition exactly once.

        Each epoch is planned from the transitions stored when it starts (a fresh permutation,
        or oldest first with ``shuffle=False``); rows written meanwhile into a planned slot are
        served with their new contents. The iterator is also installed for
        :meth:`get_next_batch`. After ``reset()`` it raises ``RuntimeError`` instead of serving
        rows that are no longer stored. ``prefetch=k`` gathers the next ``k`` batches on a
        background thread (the same batches; see :mod:`replaybuf.buffers.prefetch`), whose
        ``close()`` stops it.
        """
        self._require(batch_size)
        n_epochs = int_at_least(n_epochs, "n_epochs", 1)
        batches = self._epochs(batch_size, n_epochs, shuffle, drop_last)
        self._iterator = prefetching(batches, prefetch, self._check_open, self.device)
        return self._iterator

    def _epochs(
        self, batch_size: int, n_epochs: int, shuffle: bool, drop_last: bool
    ) -> Iterator[TensorDict]:
        resets = self._resets
        oldest = 0
        for _ in range(n_epochs):
            with self._lock:
                order, oldest = self._epoch_plan(shuffle)
            for number, slots in enumerate(epoch_batches(order, batch_size, drop_last)):
                with self._lock:  # released before the yield: the learner holds no lock
                    batch = self._epoch_batch(resets, slots, shuffle, oldest, number, batch_size)
                yield batch

    def _epoch_plan(self, shuffle: bool) -> tuple[torch.Tensor, int]:
        """One epoch's slots, and the first of them where they are oldest first."""
        self._check_open()
        if shuffle:
            # The ring fills from slot 0, so the stored slots are always 0 .. size-1 and a
            # permutation of them is randperm itself (the same draw epoch_order makes): no
            # arange, rotation or gather of a million indices per epoch.
            order = torch.randperm(
                self._size, generator=self._generator, device=self.storing_device
            )
            return order, 0
        oldest = self._pointer if self._size == self.buffer_size else 0  # order[0]
        return self._oldest_first(), oldest

    def _epoch_batch(
        self,
        resets: int,
        slots: torch.Tensor,
        shuffle: bool,
        oldest: int,
        number: int,
        batch_size: int,
    ) -> TensorDict:
        self._check_open()
        if self._resets != resets:
            raise InvalidStateError(
                "epoch iterator expected the rows it planned, got a buffer reset since; "
                "create a new iterator"
            )
        if self._priorities is not None:
            extra = ring_keys(slots, None, self._writes, self.buffer_size, self.device)
            return self._slots.gather(slots, self.device, extra=extra)
        if shuffle:
            return self._slots.gather(slots, self.device)
        # Consecutive slots unless the batch wraps: one copy per field.
        first = (oldest + number * batch_size) % self.buffer_size
        count = slots.shape[0]
        if first + count <= self.buffer_size:
            return self._slots.gather(slice(first, first + count), self.device)
        return self._slots.gather(slots, self.device)

    def get_next_batch(self, batch_size: int) -> TensorDict:
        """The next batch of the installed epoch iterator, else a uniform random batch.

        When the installed iterator is exhausted it is dropped and this falls back to
        :meth:`sample_batch`, exactly as when no iterator was ever created (ObjectRL's
        ``n_epochs=0`` mode).
        """
        positive_int(batch_size, "batch_size")
        with self._lock:
            iterator = self._iterator
            if iterator is not None and not isinstance(iterator, Prefetcher):
                try:
                    return next(iterator)
                except StopIteration:
                    self._iterator = iterator = None
        if iterator is not None:
            try:  # a prefetcher: wait for its thread without holding the lock that thread takes
                return next(iterator)
            except StopIteration:
                with self._lock:
                    if self._iterator is iterator:
                        self._iterator = None
        return self.sample_batch(batch_size)

    def calculate_num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """Batches in one epoch over what is stored: rounded up, or down with ``drop_last``."""
        return num_batches(self._size, positive_int(batch_size, "batch_size"), drop_last)

    @synchronized
    def get_steps_and_iterator(self, n_epochs: int, max_iter: int, batch_size: int) -> int:
        """Training steps to run, installing an epoch iterator when ``n_epochs > 0``.

        ``n_epochs=0`` means random sampling for ``max_iter`` steps (no iterator).
        """
        n_epochs = int_at_least(n_epochs, "n_epochs", 0)
        positive_int(batch_size, "batch_size")
        if n_epochs == 0:
            max_iter = int_at_least(max_iter, "max_iter", 0)
            self._iterator = None
            return max_iter
        self.create_epoch_iterator(batch_size, n_epochs)
        return n_epochs * self.calculate_num_batches(batch_size)

    def as_dataset(
        self,
        batch_size: int,
        *,
        n: NArg | None = None,
        seq_len: int | None = None,
        gamma: float | None = None,
        strict: bool = True,
        prefetch: int = 0,
    ) -> ReplayDataset:
        """An endless ``torch.utils.data.IterableDataset`` of ``sample_batch(batch_size)``
        batches; ``.loader()`` gives the ``DataLoader`` (see :mod:`replaybuf.buffers.dataset`).
        ``n``, ``seq_len`` and ``gamma`` are refused: a ring of transitions has no episodes.
        ``prefetch=k`` draws ``k`` batches ahead on a thread (:mod:`replaybuf.buffers.prefetch`)."""
        batch_size = check_dataset_args(batch_size, strict)
        ahead = {"prefetch": prefetch, "check": self._check_open, "device": self.device}
        return transitions_dataset(self.sample_batch, batch_size, n, seq_len, gamma, **ahead)
