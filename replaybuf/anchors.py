"""A dense set of anchor rows supporting O(1) uniform draws.

Uniform sampling over valid steps must not scan episodes (ARES does, per sample), and a boolean
mask would need a scan per draw. So the valid rows are kept packed in ``rows[:count]`` with
``pos[row]`` giving each row's place (-1 when absent): a draw is ``rows[randint(count)]``, an add
appends, and a removal fills each hole with a survivor from the tail. ``count`` lives on the host
so no update or draw needs a device synchronisation.

On the CPU, adds and removes run on numpy views of the same tensors: a numpy fancy index costs
~0.8 µs against torch's ~5 µs, and each flush of staged steps makes several.
"""

from __future__ import annotations

import numpy as np
import torch

Rows = torch.Tensor | np.ndarray  # int64 rows, on the host or the storing device


class AnchorSet:
    """The set of rows that may start a sample, packed for uniform draws."""

    def __init__(self, capacity: int, device: torch.device, host: bool | None = None) -> None:
        self.rows = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.pos = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.count = 0
        # numpy views of rows and pos for the updates (None: torch on the storing device);
        # ``host`` defaults to whether the set lives on the CPU (False there: torch's path).
        if host is None:
            host = device.type == "cpu"
        if host and device.type != "cpu":
            raise ValueError(f"host=True needs the set on the CPU, got device {device}")
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        if host:
            self._host = (self.rows.numpy(), self.pos.numpy())

    def __len__(self) -> int:
        return self.count

    def contains(self, rows: torch.Tensor) -> torch.Tensor:
        """Bool per row: is it in the set."""
        return self.pos[rows] >= 0

    def add(self, new_rows: Rows) -> None:
        """Add rows that are not in the set yet."""
        k = new_rows.shape[0]
        if k == 0:
            return
        begin, end = self.count, self.count + k
        if self._host is not None:
            rows, pos = self._host
            new = _host(new_rows)
            rows[begin:end] = new
            pos[new] = np.arange(begin, end)
        else:
            new = _device(new_rows, self.rows.device)
            self.rows[begin:end] = new
            self.pos[new] = torch.arange(begin, end, device=self.rows.device)
        self.count = end

    def remove(self, old_rows: Rows) -> None:
        """Remove rows that are in the set (each once)."""
        k = old_rows.shape[0]
        if k == 0:
            return
        new_count = self.count - k
        # The same steps on either side: free the rows' places; holes inside the kept prefix
        # are refilled by the tail rows that stay (as many as holes).
        if self._host is not None:
            rows, pos = self._host
            old = _host(old_rows)
            holes = pos[old]
            pos[old] = -1
            holes = holes[holes < new_count]
            tail = rows[new_count : self.count]
            movers = tail[pos[tail] >= 0]
            rows[holes] = movers
            pos[movers] = holes
            rows[new_count : self.count] = -1
        else:
            old = _device(old_rows, self.rows.device)
            holes = self.pos[old]
            self.pos[old] = -1
            holes = holes[holes < new_count]
            tail = self.rows[new_count : self.count]
            movers = tail[self.pos[tail] >= 0]
            self.rows[holes] = movers
            self.pos[movers] = holes
            self.rows[new_count : self.count] = -1
        self.count = new_count

    def remove_present(self, rows: Rows) -> None:
        """Remove those of ``rows`` that are in the set (each row once)."""
        if self._host is not None:
            rows = _host(rows)
            self.remove(rows[self._host[1][rows] >= 0])
        else:
            rows = _device(rows, self.rows.device)
            self.remove(rows[self.pos[rows] >= 0])

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` rows uniformly with replacement."""
        picks = torch.randint(
            0, self.count, (batch_size,), generator=generator, device=self.rows.device
        )
        return self.rows.index_select(0, picks)

    def sample_distinct(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Up to ``batch_size`` distinct rows, uniformly without replacement."""
        perm = torch.randperm(self.count, generator=generator, device=self.rows.device)
        return self.rows[perm[:batch_size]]

    def snapshot(self) -> torch.Tensor:
        """A copy of the rows in the set now."""
        return self.rows[: self.count].clone()


def _host(rows: Rows) -> np.ndarray:
    """``rows`` as a numpy array (a view of a CPU tensor)."""
    return rows if isinstance(rows, np.ndarray) else rows.numpy()


def _device(rows: Rows, device: torch.device) -> torch.Tensor:
    """``rows`` as a tensor on ``device``."""
    return rows.to(device) if isinstance(rows, torch.Tensor) else torch.from_numpy(rows).to(device)
