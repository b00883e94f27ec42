"""The one-pass n-step path for CPU storage: draw, windows and gathers in numpy and numba."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.args import NArg
from replaybuf.episodes import HostLinks
from replaybuf.sampling.common import keys_of, nstep_key_order
from replaybuf.sampling.frames import HostStacks
from replaybuf.sampling.nstep import host_gathers
from replaybuf.sampling.view import EpisodeView
from replaybuf.sampling.windows import NO_N, KernelWindows, compiled_windows, host_rewards
from replaybuf.storage import Key, build_tensordict


class _HostPlan(NamedTuple):
    """What :class:`HostNStep` reads of the columns, looked up once per configuration."""

    keys: tuple[Key, ...]  # the batch's keys, in value order (see nstep_key_order)
    observations: tuple[np.ndarray, ...]  # host views, gathered at both window ends
    steps: tuple[np.ndarray, ...]  # host views, gathered at the start (actions, extras)
    rewards: np.ndarray  # the 1-D reward column
    links: HostLinks  # the row links' host columns
    windows: Callable[..., KernelWindows]  # kernels.nstep_windows
    stack_rows: Callable[..., tuple[np.ndarray, np.ndarray]]  # kernels.stack_rows
    frame_stack: int | None  # the core's k
    zero_padding: bool  # the core's frame padding is "zero"


class HostNStep:
    """The one-pass n-step path for CPU storage delivering on the CPU, uniform draws.

    A uniform draw with replacement and its windows, gathered in one pass: the same draws and
    the same values as the general path (frame stacks too, their rows found by one compiled
    loop), which is its reference in the tests. Written as one pass because the general
    path's per-batch lookups and conversions (views by key, the key lists, torch and numpy
    views of the anchors) weigh on small batches. Draws without replacement and a random n
    go to ``general``.
    """

    def __init__(
        self, core: EpisodeView, plan: _HostPlan, generator: torch.Generator, general: NStepPath
    ) -> None:
        self.core = core
        self.plan = plan
        self.generator = generator
        self.general = general

    def __call__(self, batch_size: int, n: NArg, gamma: float, replace: bool) -> TensorDict:
        if not replace or isinstance(n, tuple):
            return self.general(batch_size, n, gamma, replace)
        plan = self.plan
        start = self.core.anchors.sample_host(batch_size, self.generator)
        w = compiled_windows(plan.windows, start, NO_N, n, plan.links, plan.rewards, gamma)
        stacks = None
        if plan.frame_stack is not None:
            k = plan.frame_stack
            rows, real = plan.stack_rows(w.ends, k, plan.links.prev_row)
            stacks = HostStacks(rows, real, k, plan.zero_padding)
        # The compiled windows are numpy arrays, though Windows types its fields as either kind.
        values = host_gathers(
            plan.observations,
            plan.steps,
            w.ends,  # type: ignore[arg-type]
            start,
            w.values(),
            stacks,
        )
        tensors = [torch.from_numpy(v) for v in values]
        return build_tensordict(plan.keys, tensors, batch_size, _CPU)


class NStepPath(Protocol):
    """An n-step path: ``batch_size`` transitions for ``n`` and ``gamma``."""

    def __call__(self, batch_size: int, n: NArg, gamma: float, replace: bool) -> TensorDict: ...


_CPU = torch.device("cpu")


def host_plan(core: EpisodeView) -> _HostPlan | None:
    """What :class:`HostNStep` reads of the columns, or None where it does not apply: the
    compiled window kernel, host links and anchors, a 1-D contiguous float reward column and a
    numpy view of every gathered field (priorities and the delivery device are the caller's)."""
    host = core.links.host
    if core.kernels is None or host is None:
        return None
    if core.frame_stack is not None and host.prev_row is None:
        return None
    if not core.anchors.on_host:
        return None
    slots = core.slots
    rewards = host_rewards(core)
    if rewards is None or not rewards.flags.c_contiguous:
        return None
    obs_keys, step_keys = keys_of(core, "observation"), keys_of(core, "action", "extras")
    observations = [slots.host_view(key) for key in obs_keys]
    steps = [slots.host_view(key) for key in step_keys]
    if not obs_keys or any(view is None for view in observations + steps):
        return None
    return _HostPlan(
        nstep_key_order(obs_keys, step_keys),
        tuple(observations),  # type: ignore[arg-type]  # none is None (checked above)
        tuple(steps),  # type: ignore[arg-type]
        rewards,
        host,
        core.kernels.nstep_windows,
        core.kernels.stack_rows,
        core.frame_stack,
        core.frame_padding == "zero",
    )
