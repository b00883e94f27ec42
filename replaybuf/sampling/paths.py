"""The one place that picks how an episode buffer builds its batches.

A buffer's configuration (storing and delivery devices, priorities, frame stacking, the field
spec, whether the numba kernels load) decides which path builds its n-step and sequence
batches. :func:`choose` makes that choice once per configuration; every path of a kind has
the same call signature, so the buffer calls whichever it got. The general paths are the
reference that each fast path is tested against (the same batches for the same seed)::

    n-step        HostNStep      CPU storage delivering on the CPU, uniform (or prioritized
                                 with frame stacks), numba kernels: draw, windows and
                                 gathers in one pass, each window's k + n frames once
                  FrameNStep     HostNStep for uniform frame stacks: one compiled call
                                 draws, windows and finds the stack rows, then the gathers
                  DeviceNStep    storage off the CPU, uniform: a CUDA graph's replay, else
                                 device draws looked up inside the fused kernel
                  GeneralNStep   everything else: prioritized, no replacement, random n ...
    sequences     DeviceSequences  storage off the CPU, uniform: a CUDA graph's replay first
                                   (no burn-in: the general path takes those)
                  GeneralSequences

Inside a path, the window math (numba, numpy, Triton or torch) is the one
:func:`~replaybuf.sampling.windows.window_math` picks for the same configuration. A fast path
hands a call it does not take (``replace=False``, a random ``n``) to the general path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from tensordict import TensorDict

from replaybuf.args import NArg
from replaybuf.sampling.device_draws import DeviceDraws
from replaybuf.sampling.draws import draw_anchors, draw_sequences, with_priority_keys
from replaybuf.sampling.graphed import graphed_nstep, graphed_sequences
from replaybuf.sampling.host import FrameNStep, HostNStep, NStepPath, host_plan
from replaybuf.sampling.nstep import NStepBuilder, host_views_apply
from replaybuf.sampling.ragged import ragged_keys_of
from replaybuf.sampling.sequences import sequence_batch
from replaybuf.sampling.view import EpisodeView
from replaybuf.sampling.windows import window_math

PATHS_KEY = "sampling.paths"  # its token in SlotStorage.derived (emptied when the columns change)


class SequencePath(Protocol):
    """A sequence path: ``[batch_size, burn_in + length]`` runs of steps."""

    def __call__(self, batch_size: int, length: int, strict: bool, burn_in: int) -> TensorDict: ...


class GeneralNStep:
    """Anchors drawn uniformly or by priority, then :class:`NStepBuilder`'s batch."""

    def __init__(self, builder: NStepBuilder, generator: torch.Generator) -> None:
        self.builder = builder
        self.generator = generator

    def __call__(self, batch_size: int, n: NArg, gamma: float, replace: bool) -> TensorDict:
        core = self.builder.core
        start, weight = draw_anchors(core, batch_size, replace, self.generator)
        batch = self.builder.batch(start, n, gamma, self.generator)
        return with_priority_keys(core, batch, start, weight)


class DeviceNStep:
    """Uniform batches from storage off the CPU: a graph's replay where one is captured, else
    places drawn on the device and looked up by the fused kernel (one gather less)."""

    def __init__(
        self,
        builder: NStepBuilder,
        generator: torch.Generator,
        draws: DeviceDraws,
        general: NStepPath,
    ) -> None:
        self.builder = builder
        self.generator = generator
        self.draws = draws
        self.general = general

    def __call__(self, batch_size: int, n: NArg, gamma: float, replace: bool) -> TensorDict:
        if not replace:
            return self.general(batch_size, n, gamma, replace)
        builder = self.builder
        graphed = graphed_nstep(builder, self.draws.graphs, batch_size, n, gamma)
        if graphed is not None:  # one replay of the launches below (see replaybuf.accel.graphs)
            return graphed
        places, table, _ = self.draws.places(builder.core, (batch_size,), self.generator)
        return builder.batch(places, n, gamma, self.generator, table)


class GeneralSequences:
    """Anchors drawn for sequences (strict: only where ``length`` steps fit), then
    :func:`~replaybuf.sampling.sequences.sequence_batch`."""

    def __init__(
        self,
        core: EpisodeView,
        device: torch.device,
        generator: torch.Generator,
        draws: DeviceDraws | None = None,
    ) -> None:
        self.core = core
        self.device = device
        self.generator = generator
        self.draws = draws  # the device draws, for the fused kernel's draws (storage off CPU)

    def __call__(self, batch_size: int, length: int, strict: bool, burn_in: int) -> TensorDict:
        core, generator, draws = self.core, self.generator, self.draws
        draw = None if draws is None else lambda shape: draws.places(core, shape, generator)
        start, weight, walk = draw_sequences(core, batch_size, length, strict, generator, draw)
        batch = sequence_batch(core, start, length, self.device, walk, strict, burn_in)
        return with_priority_keys(core, batch, start, weight)


class DeviceSequences:
    """Uniform sequences from storage off the CPU: a graph's replay first. A burn-in is not
    graphed (the steps before a start may be read on the host): the general path, whose draws
    are the graph's, takes it."""

    def __init__(self, general: GeneralSequences, draws: DeviceDraws) -> None:
        self.general = general
        self.draws = draws

    def __call__(self, batch_size: int, length: int, strict: bool, burn_in: int) -> TensorDict:
        general = self.general
        if burn_in:
            return general(batch_size, length, strict, burn_in)
        graphed = graphed_sequences(
            general.core, self.draws.graphs, batch_size, length, strict, general.device
        )
        if graphed is not None:
            return graphed
        return general(batch_size, length, strict, burn_in)


@dataclass(frozen=True)
class Paths:
    """The paths chosen for one configuration, and the builder they share (epochs use it)."""

    n_step: NStepPath
    sequences: SequencePath
    builder: NStepBuilder
    token: object  # what :func:`choose` left in the storage's derived cache


def choose(
    core: EpisodeView,
    device: torch.device,
    generator: torch.Generator,
    draws: DeviceDraws,
    current: Paths | None = None,
    ragged: str = "nested",
) -> Paths:
    """The paths for the core's configuration now: ``current`` while it still applies (the
    storage's columns unchanged since it was chosen), else a new choice."""
    derived = core.slots.derived
    if current is not None and derived.get(PATHS_KEY) is current.token:
        return current
    math = window_math(core)
    builder = NStepBuilder(core, device, math, host_views_apply(core, device, math), ragged)
    general: NStepPath = GeneralNStep(builder, generator)
    # Ragged fields come out of the general paths only (the fast ones gather fixed columns).
    fixed = not ragged_keys_of(core, "observation", "action", "extras")
    uniform = core.priorities is None and fixed
    n_step = general
    sequences: SequencePath = GeneralSequences(core, device, generator)
    if uniform and not core.anchors.on_host:  # storage off the CPU
        n_step = DeviceNStep(builder, generator, draws, general)
        sequences = DeviceSequences(GeneralSequences(core, device, generator, draws), draws)
    elif device.type == "cpu" and fixed and (uniform or core.frame_stack is not None):
        # Prioritized frame stacks too: the general path gathers 2k frames per window.
        plan = host_plan(core)
        if plan is not None:
            one_call = uniform and core.frame_stack is not None
            n_step = (FrameNStep if one_call else HostNStep)(core, plan, generator, general)
    token = derived[PATHS_KEY] = object()
    return Paths(n_step, sequences, builder, token)
