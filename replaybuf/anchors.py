"""A dense set of anchor rows supporting O(1) uniform draws. Imports torch only.

Uniform sampling over valid steps must not scan episodes (ARES does, per sample), and a boolean
mask would need a scan per draw. So the valid rows are kept packed in ``rows[:count]`` with
``pos[row]`` giving each row's place (-1 when absent): a draw is ``rows[randint(count)]``, an add
appends, and a removal fills each hole with a survivor from the tail. ``count`` lives on the host
so no update or draw needs a device synchronisation.
"""

from __future__ import annotations

import torch


class AnchorSet:
    """The set of rows that may start a sample, packed for uniform draws."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.rows = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.pos = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def contains(self, rows: torch.Tensor) -> torch.Tensor:
        """Bool per row: is it in the set."""
        return self.pos[rows] >= 0

    def add(self, new_rows: torch.Tensor) -> None:
        """Add rows that are not in the set yet."""
        k = new_rows.shape[0]
        if k == 0:
            return
        places = torch.arange(self.count, self.count + k, device=self.rows.device)
        self.rows[places] = new_rows
        self.pos[new_rows] = places
        self.count += k

    def remove(self, old_rows: torch.Tensor) -> None:
        """Remove rows that are in the set (each once)."""
        k = old_rows.shape[0]
        if k == 0:
            return
        new_count = self.count - k
        holes = self.pos[old_rows]
        self.pos[old_rows] = -1
        holes = holes[holes < new_count]  # holes inside the kept prefix must be refilled
        tail = self.rows[new_count : self.count]
        movers = tail[self.pos[tail] >= 0]  # tail rows that stay; as many as holes
        self.rows[holes] = movers
        self.pos[movers] = holes
        self.rows[new_count : self.count] = -1
        self.count = new_count

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
