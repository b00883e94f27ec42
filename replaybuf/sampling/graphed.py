"""Uniform n-step and sequence batches from CUDA storage as replays of captured graphs.

The batches are :class:`~replaybuf.sampling.nstep.NStepBuilder`'s and
:func:`~replaybuf.sampling.sequences.sequence_batch`'s, with the fused kernels' walks (the
torch ops they replace read jump tables rebuilt outside any graph, so they are never
captured), from places drawn by :meth:`~replaybuf.accel.graphs.BatchGraphs.draw`, as the
buffer draws them when no graph serves a batch: the same batches either way. A random n
(``n=(low, high)``) is not graphed: its draw takes the torch generator.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from replaybuf.accel.fused import sequences as fused_sequences
from replaybuf.accel.fused import walks as fused_walks
from replaybuf.accel.graphs import BatchGraphs, NotCapturable
from replaybuf.args import NArg
from replaybuf.core import discount_powers, torch_reward_powers
from replaybuf.sampling.common import nstep_keys
from replaybuf.sampling.draws import STRICT_TRIES, require_full_sequences
from replaybuf.sampling.nstep import NStepBuilder
from replaybuf.sampling.sequences import sequence_values
from replaybuf.sampling.view import EpisodeView
from replaybuf.storage import build_tensordict

_LINKS = ("succ", "end_kind", "step", "episode", "prev_row")  # what the walks read


def graphed_nstep(
    builder: NStepBuilder, graphs: BatchGraphs, batch_size: int, n: NArg, gamma: float
) -> TensorDict | None:
    """A uniform n-step batch by a graph's replay, or None where graphs do not apply (see
    :func:`_table`) or this key is not captured (yet)."""
    core, device = builder.core, builder.device
    if isinstance(n, tuple):
        return None
    table = _table(core, graphs, device)
    if table is None:
        return None
    reward = core.slots.column(("reward",))
    # The kernel reads these, passed in: kept alive with the graph (their caches may drop them)
    powers = (
        torch_reward_powers(gamma, n, reward.dtype, table.device),
        discount_powers(gamma, n, table.device),
    )

    def build() -> tuple[None, list[torch.Tensor]]:
        places = graphs.draw((batch_size,))
        values = builder.values(places, n, gamma, None, table, True, powers)
        return None, values

    key = ("n_step", batch_size, n, float(gamma))
    out = graphs.run(key, [*_inputs(core, table), *powers], core.anchors.count, build)
    if out is None:
        return None
    return build_tensordict(nstep_keys(core), out[1], batch_size, device)


def graphed_sequences(
    core: EpisodeView,
    graphs: BatchGraphs,
    batch_size: int,
    length: int,
    strict: bool,
    device: torch.device,
) -> TensorDict | None:
    """A uniform sequence batch by a graph's replay (strict: the fused kernel's draw of
    ``STRICT_TRIES`` candidates per slot, and its redraw on the device of the slots that found
    none), or None as :func:`graphed_nstep`."""
    table = _table(core, graphs, device, length)
    if table is None:
        return None
    if strict:
        require_full_sequences(core, length)  # what the redraw relies on
    tries = STRICT_TRIES if strict else 1
    redraw = graphs.redraw if strict else None

    def build() -> tuple[list, list[torch.Tensor]]:
        places = graphs.draw((batch_size, tries))
        walk = fused_sequences(places, table, length, core.links, strict, redraw)
        if walk is None:
            raise NotCapturable("the fused sequence kernel does not apply")
        return sequence_values(core, walk.start, length, device, walk, full=strict)

    key = ("sequences", batch_size, length, strict)
    out = graphs.run(key, _inputs(core, table), core.anchors.count, build)
    if out is None:
        return None
    keys, values = out
    return build_tensordict(keys, values, (batch_size, length), device)


def _table(
    core: EpisodeView, graphs: BatchGraphs, device: torch.device, length: int = 1
) -> torch.Tensor | None:
    """The packed anchor rows, brought up to date, where a graph may serve the batch: CUDA
    storage delivering on its own device, uniform draws, the fused kernels running there
    (for sequences of ``length``)."""
    if not graphs.enabled(device) or device != core.slots.storing_device:
        return None
    if core.priorities is not None or core.links.host is not None or core.anchors.on_host:
        return None
    table = core.anchors.rows  # publishes pending anchor writes (never inside a capture)
    return table if fused_walks(core.links, table, length) else None


def _inputs(core: EpisodeView, table: torch.Tensor) -> list[torch.Tensor]:
    """What the graphs read outside themselves: the anchor table, the row links (brought up
    to date here, so that no capture records their copy) and the stored columns."""
    links = [core.links.column(name) for name in _LINKS]
    return [table, *(column for column in links if column is not None), *core.slots.columns()]
