"""A buffer's draws on the device, and the captured batch graphs that replay them.

Uniform draws from CUDA storage are Philox bits for (slot, round) under a key derived from the
buffer's seed, apart from its torch generator, made on the device by a kernel that a CUDA
graph replays (see :mod:`replaybuf.accel.graphs`). A checkpoint saves the key and how many
rounds were drawn, so that a resumed buffer draws what the saved one would have.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replaybuf.accel.graphs import BatchGraphs
from replaybuf.sampling.view import EpisodeView

Places = tuple[torch.Tensor, torch.Tensor, Any]  # places, the packed anchor rows, redraw state


def seed_key(seed: int | None) -> int:
    """The device draws' Philox key for a buffer seed (under 2^63; fresh entropy for None)."""
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0] >> 1)


class DeviceDraws:
    """The device draws' key and round, and the batch graphs (made on first use)."""

    def __init__(self, device: torch.device, seed: int, rounds: int = 0) -> None:
        self.device = device
        self.seed = seed
        self._rounds = rounds  # the round the graphs start from, once made
        self.made: BatchGraphs | None = None

    @property
    def graphs(self) -> BatchGraphs:
        """The captured batch graphs and their draws, made on first use."""
        if self.made is None:
            self.made = BatchGraphs(self.device, self.seed, self._rounds)
        return self.made

    def rounds(self) -> int:
        """How many rounds were drawn (reads the device once the graphs exist)."""
        return self._rounds if self.made is None else self.made.round()

    def state_dict(self) -> dict[str, int]:
        """The key and the rounds drawn: what a resumed buffer needs to draw on."""
        return {"seed": self.seed, "rounds": self.rounds()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; the graphs are made again, from it, on first use."""
        self.clear()
        self.seed, self._rounds, self.made = int(state["seed"]), int(state["rounds"]), None

    def places(
        self, core: EpisodeView, shape: tuple[int, ...], generator: torch.Generator
    ) -> Places:
        """Uniform places in the packed anchor rows, those rows, and the device draws' state
        where they made them: drawn on the device where the draw kernel runs, as a graph's
        replay draws them (a batch does not depend on whether a graph served it), else from
        ``generator``."""
        anchors = core.anchors
        table = anchors.rows
        places = self.graphs.places(shape, anchors.count)
        if places is None:
            return *anchors.draw_places(shape, generator), None
        return places, table, self.graphs.redraw

    def clear(self) -> None:
        """Drop the captured graphs (their memory goes back to torch's allocator)."""
        if self.made is not None:
            self.made.clear()
