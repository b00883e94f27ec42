"""Device copies of host bookkeeping columns, brought up to date lazily.

Row links and the anchor set are written on every flush and eviction, a few hundred rows at a
time. On CUDA each torch index write is a kernel launch plus a host-to-device copy of its
indices (10-30 µs each, and a boolean mask costs a device synchronisation), where the same
write on numpy columns costs about a microsecond. So the columns live on the host, where every
write goes, and their device copy (which sampling reads without synchronising) is updated only
when it is read: the indices written since go over in one copy and land in one ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class DeviceMirror:
    """An int64 ``[len(columns), n]`` table on ``device`` that follows equal-length host
    ``columns`` (numpy; any integer dtype). Writers call :meth:`touched` with the indices they
    changed; readers call :meth:`publish` before using :attr:`table`."""

    def __init__(self, columns: Sequence[np.ndarray], device: torch.device) -> None:
        self.columns = list(columns)
        shape = (len(self.columns), len(self.columns[0]))
        self.table = torch.empty(shape, dtype=torch.long, device=device)
        self._pending: list[np.ndarray] = []
        self._count = 0
        # Past this many pending indices the whole table goes over instead (and touched
        # publishes early, so that the pending list stays bounded without reads).
        self._limit = max(len(self.columns[0]) // 4, 4096)
        self.publish_all()

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def touched(self, indices: np.ndarray) -> None:
        """Note indices whose host values changed (a copy is kept: callers reuse buffers)."""
        if indices.shape[0] == 0:
            return
        self._pending.append(np.array(indices, dtype=np.int64))
        self._count += indices.shape[0]
        if self._count > self._limit:
            self.publish()

    def publish(self) -> None:
        """Send the values at every pending index: one host-to-device copy, one kernel."""
        if not self._pending:
            return
        if self._count > self._limit:
            self.publish_all()
            return
        at = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        values = np.empty((len(self.columns) + 1, at.shape[0]), dtype=np.int64)
        values[0] = at
        for i, column in enumerate(self.columns, 1):
            values[i] = column[at]  # a repeated index gets the same (final) value each time
        sent = torch.from_numpy(values).to(self.table.device)
        self.table.index_copy_(1, sent[0], sent[1:])
        self._pending.clear()
        self._count = 0

    def publish_all(self) -> None:
        """Send every column whole (at construction, after a restore, or when most changed)."""
        whole = np.stack([column.astype(np.int64, copy=False) for column in self.columns])
        self.table.copy_(torch.from_numpy(whole))
        self._pending.clear()
        self._count = 0
