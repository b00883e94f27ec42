"""Device copies of host bookkeeping columns, brought up to date lazily.

Row links and the anchor set are written on every flush and eviction, a few hundred rows at a
time. On CUDA each torch index write is a kernel launch plus a host-to-device copy of its
indices (and a boolean mask costs a device synchronisation), where the same write on numpy
columns is a plain memory write. So the columns live on the host, where every
write goes, and their device copy (which sampling reads) is updated only when it is read: the
indices written since go over in one copy and land in one ``index_copy_``. Writers never touch
the device. The copies go through pinned memory without blocking, so an update does not wait
for the GPU's queued work either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from replaybuf.errors import InvalidStateError
from replaybuf.storage.delivery import to_device_async


class DeviceMirror:
    """An int64 ``[len(columns), n]`` table on ``device`` that follows equal-length host
    ``columns`` (numpy; any integer dtype). Writers call :meth:`touched` with the indices they
    changed; readers call :meth:`publish` before using :attr:`table`, which is allocated once
    and only ever written in place (views of its rows stay valid)."""

    def __init__(self, columns: Sequence[np.ndarray], device: torch.device) -> None:
        self.columns = list(columns)
        shape = (len(self.columns), len(self.columns[0]))
        self.table = torch.empty(shape, dtype=torch.long, device=device)
        self._pending: list[np.ndarray] = []
        self._count = 0
        # Past this many pending indices the next publish sends the whole table instead, and
        # touched stops keeping them: the pending list stays bounded without reads.
        self._limit = max(len(self.columns[0]) // 4, 4096)
        self._everything = True  # the table holds nothing yet

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def touched(self, indices: np.ndarray) -> None:
        """Note indices whose host values changed (a copy is kept: callers reuse buffers)."""
        if indices.shape[0] == 0 or self._everything:
            return
        self._count += indices.shape[0]
        if self._count > self._limit:
            self.changed_all()
        else:
            self._pending.append(np.array(indices, dtype=np.int64))

    def changed_all(self) -> None:
        """Note that any host value may have changed (a restore): the next publish sends all."""
        self._everything = True
        self._pending.clear()
        self._count = 0

    def publish(self) -> None:
        """Send the values at every pending index: one copy to the device, one kernel."""
        if not self._everything and not self._pending:
            return
        if self.table.is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph would replay this copy of values from now (replaybuf.accel.graphs publishes
            # before it captures): refuse, and the capture fails instead.
            raise InvalidStateError("a device copy of host columns was published during a capture")
        if self._everything:
            self._publish_all()
            return
        at = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        sent = torch.empty((len(self.columns) + 1, at.shape[0]), dtype=torch.long)
        values = sent.numpy()
        values[0] = at
        for i, column in enumerate(self.columns, 1):
            values[i] = column[at]  # a repeated index gets the same (final) value each time
        sent = to_device_async(sent, self.table.device)
        self.table.index_copy_(1, sent[0], sent[1:])
        self._pending.clear()
        self._count = 0

    def _publish_all(self) -> None:
        """Send every column whole, one at a time (no host copy of the whole table)."""
        for row, column in zip(self.table, self.columns, strict=True):
            row.copy_(to_device_async(torch.from_numpy(column), self.table.device))
        self._everything = False
        self._pending.clear()
        self._count = 0
