"""An episode buffer's epochs (every step valid at an epoch's start, once, as n-step batches)
and its endless dataset.

A part of :class:`~replaybuf.buffers.episodes.SyncEpisodeReplayBuffer` (which inherits it),
kept apart so that each module holds one concern. Each epoch is planned from the anchors
stored when it starts; each batch is built under the buffer's lock, released before the batch
is handed over, so writers and other threads go on between batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from replaybuf.args import NArg, check_gamma, check_n, positive_int
from replaybuf.buffers.dataset import ReplayDataset, check_dataset_args, episodes_dataset
from replaybuf.buffers.locking import synchronized
from replaybuf.buffers.prefetch import check_depth, prefetching
from replaybuf.core import epoch_batches, epoch_order
from replaybuf.episodes import EpisodeCore
from replaybuf.sampling import Paths, check_layout, torchrl_transitions, with_priority_keys


class EpisodeEpochs:
    """Epoch iterators of a :class:`SyncEpisodeReplayBuffer` (its base class)."""

    # What the buffer provides (set in SyncEpisodeReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _core: EpisodeCore
    _generator: torch.Generator
    max_steps: int
    device: torch.device
    sample_n_step: Callable[..., TensorDict]
    sample_sequences: Callable[..., TensorDict]

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        def _check_open(self) -> None: ...

        def _require_steps(self, what: str) -> None: ...

        def _torchrl(self, layout: str | None) -> bool: ...

        def _chosen_paths(self) -> Paths: ...

    @synchronized
    def iterate_epochs(
        self,
        batch_size: int,
        n_epochs: int = 1,
        *,
        n: NArg = 1,
        gamma: float = 0.99,
        shuffle: bool = True,
        drop_last: bool = False,
        layout: str | None = None,
        prefetch: int = 0,
    ) -> Iterator[TensorDict]:
        """n-step batches; each epoch yields every step valid at its start exactly once.

        A step evicted after its epoch started is skipped (so a batch may come out short);
        steps that become valid mid-epoch wait for the next epoch. ``prefetch=k`` builds the
        next ``k`` batches on a background thread (the same batches; see
        :mod:`replaybuf.buffers.prefetch`), whose ``close()`` stops it.
        """
        batch_size = positive_int(batch_size, "batch_size")
        n_epochs = positive_int(n_epochs, "n_epochs")
        n, gamma = check_n(n, self.max_steps), check_gamma(gamma)
        torchrl = self._torchrl(layout)
        check_depth(prefetch)
        self._require_steps("iterate")
        batches = self._epochs(batch_size, n_epochs, n, gamma, shuffle, drop_last, torchrl)
        return prefetching(batches, prefetch, self._check_open, self.device)

    def _epochs(
        self,
        batch_size: int,
        n_epochs: int,
        n: NArg,
        gamma: float,
        shuffle: bool,
        drop_last: bool,
        torchrl: bool,
    ) -> Iterator[TensorDict]:
        for _ in range(n_epochs):
            with self._lock:  # each step under the lock, released before the yield
                rows, owners, order = self._epoch_plan(shuffle)
            for picks in epoch_batches(order, batch_size, drop_last):
                with self._lock:
                    batch = self._epoch_batch(rows[picks], owners[picks], n, gamma)
                if batch is not None:
                    yield torchrl_transitions(batch, gamma) if torchrl else batch

    def _epoch_plan(self, shuffle: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The anchor rows valid now, their episodes, and the order an epoch visits them."""
        self._check_open()
        core = self._core
        core.flush()
        rows = core.anchors.snapshot()
        owners = core.links.episode[rows]
        order = epoch_order(
            torch.arange(rows.shape[0], device=rows.device), shuffle, self._generator
        )
        return rows, owners, order

    def _epoch_batch(
        self, start: torch.Tensor, owner: torch.Tensor, n: NArg, gamma: float
    ) -> TensorDict | None:
        """The planned steps still stored in their episodes, as a batch (None if none is)."""
        self._check_open()
        core = self._core
        core.flush()
        still = core.anchors.contains(start) & (core.links.episode[start] == owner)
        if not bool(still.any()):
            return None
        start = start[still]
        batch = self._chosen_paths().builder.batch(start, n, gamma, self._generator)
        return with_priority_keys(core, batch, start, None)

    def as_dataset(
        self,
        batch_size: int,
        *,
        n: NArg | None = None,
        seq_len: int | None = None,
        gamma: float | None = None,
        strict: bool = True,
        layout: str | None = None,
        prefetch: int = 0,
        burn_in: int = 0,
    ) -> ReplayDataset:
        """This buffer as an endless ``IterableDataset`` of batches: ``sample_n_step(batch_size,
        n, gamma)`` (``n`` 1 and ``gamma`` 0.99 by default), or with ``seq_len``
        ``sample_sequences(batch_size, seq_len, strict=strict, burn_in=burn_in)``, in
        ``layout`` (see :mod:`replaybuf.buffers.dataset`); ``prefetch=k`` draws ``k`` batches
        ahead on a thread."""
        batch_size = check_dataset_args(batch_size, strict)
        if layout is not None:
            check_layout(layout)
        return episodes_dataset(
            functools.partial(self.sample_n_step, layout=layout),
            functools.partial(self.sample_sequences, layout=layout),
            batch_size,
            n,
            seq_len,
            gamma,
            strict,
            self.max_steps,
            burn_in,
            prefetch=prefetch,
            check=self._check_open,
            device=self.device,
        )
