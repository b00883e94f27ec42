"""The one-pass n-step paths for CPU storage: draw, windows and gathers in numpy and numba."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.args import NArg
from replaybuf.core import host_powers, reward_powers
from replaybuf.episodes import HostLinks
from replaybuf.sampling.common import keys_of, nstep_key_order
from replaybuf.sampling.draws import draw_anchors, with_priority_keys
from replaybuf.sampling.frames import HostStacks, take_stacks
from replaybuf.sampling.nstep import host_gathers
from replaybuf.sampling.view import EpisodeView
from replaybuf.sampling.windows import (
    NO_N,
    KernelWindows,
    Windows,
    compiled_windows,
    host_rewards,
)
from replaybuf.storage import Key, build_tensordict
from replaybuf.storage.tensordicts import NEW_UNSAFE, shared_attributes, with_attributes


class _HostPlan(NamedTuple):
    """What :class:`HostNStep` reads of the columns, looked up once per configuration."""

    keys: tuple[Key, ...]  # the batch's keys, in value order (see nstep_key_order)
    observations: tuple[np.ndarray, ...]  # host views, gathered at both window ends
    steps: tuple[np.ndarray, ...]  # host views, gathered at the start (actions, extras)
    rewards: np.ndarray  # the 1-D reward column
    links: HostLinks  # the row links' host columns
    windows: Callable[..., KernelWindows]  # kernels.nstep_windows
    window_stacks: Callable[..., tuple[np.ndarray, np.ndarray, int]]  # kernels.window_stacks
    frame_nstep: Callable[..., tuple]  # kernels.frame_nstep
    frame_stack: int | None  # the core's k
    zero_padding: bool  # the core's frame padding is "zero"


class HostNStep:
    """The one-pass n-step path for CPU storage delivering on the CPU: uniform draws, and
    prioritized ones for frame-stacked buffers.

    A draw with replacement and its windows, gathered in one pass: the same draws and the same
    values as the general path (frame stacks too, their rows found by one compiled loop, each
    window's frames gathered once: see :func:`_stacks`), which is its reference in the tests.
    Written as one pass because the general path's per-batch lookups and conversions (views by
    key, the key lists, torch and numpy views of the anchors) weigh on small batches, and its
    frame stacks gather 2k frames per window. Draws without replacement and a random n go to
    ``general``.
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
        plan, core = self.plan, self.core
        drawn, weight = None, None
        if core.priorities is None:
            start = core.anchors.sample_host(batch_size, self.generator)
        else:  # the general path's draw: a descent of the priority tree
            drawn, weight = draw_anchors(core, batch_size, replace, self.generator)
            start = np.ascontiguousarray(drawn.numpy(), dtype=np.int64)
        w = compiled_windows(plan.windows, start, NO_N, n, plan.links, plan.rewards, gamma)
        stacks = None
        if plan.frame_stack is not None:
            stacks = _stacks(plan, plan.frame_stack, w, n)
        # The compiled windows are numpy arrays, though Windows types its fields as either kind.
        values = host_gathers(
            plan.observations,
            plan.steps,
            w.ends,  # type: ignore[arg-type]
            start,
            w.values(),
            stacks,
        )
        tensors = list(map(torch.from_numpy, values))  # no comprehension frame (CPython 3.11)
        batch = build_tensordict(plan.keys, tensors, batch_size, _CPU)
        if drawn is None:
            return batch
        return with_priority_keys(core, batch, drawn, weight)


def _stacks(plan: _HostPlan, k: int, w: Windows, n: int) -> HostStacks:
    """The rows of both window ends' k-frame stacks, found by one compiled call: where every
    window is n < k steps long (none cut short by its episode's end), the two stacks are the
    first and last k rows of one stack k + n deep at the window's last observation (k + n
    frames gathered per window, not 2k); else each end's stack on its own."""
    prev_row = plan.links.prev_row
    assert prev_row is not None, "frame stacking keeps prev_row"
    rows, real, shift = plan.window_stacks(w.ends, w.actual_n, n, k, prev_row)
    return HostStacks(rows, real, k + shift, plan.zero_padding, shift)


class FrameNStep(HostNStep):
    """:class:`HostNStep` for uniform frame-stacked buffers: the drawn anchors looked up,
    their windows walked and their stack rows found by one compiled call
    (:func:`replaybuf.accel.numba_kernels.frame_nstep`), then one gather per field; the same
    batches. Draws without replacement and a random n go to ``general``, as in HostNStep.

    The draw is the buffer generator's ``randint`` over the anchor set, written into a scratch
    tensor (the same numbers, without a new tensor and its numpy view per call); the kernel
    looks the anchors up, walks their windows and finds the stack rows, and one ``np.take``
    per observation field gathers each window's frames once (see :class:`HostStacks`). One
    call because a small batch's gather costs only a few times the numpy calls, conversions
    and kernel dispatches around it.
    """

    def __init__(
        self,
        core: EpisodeView,
        plan: _HostPlan,
        generator: torch.Generator,
        general: NStepPath,
    ) -> None:
        super().__init__(core, plan, generator, general)
        # the draws' scratch (the buffer's lock keeps one call at a time)
        self.picks = torch.empty(0, dtype=torch.long, device=_CPU)
        self.picks_host = self.picks.numpy()
        self.anchors: object = None  # the anchor set whose rows anchor_rows views
        self.anchor_rows = np.empty(0, np.int64)
        self.powers: dict[tuple[float, int], tuple[np.ndarray, np.ndarray]] = {}
        # The batch's flat keys, built without build_tensordict's lookups (None: nested keys).
        flat = NEW_UNSAFE is not None and all(len(key) == 1 for key in plan.keys)
        self.names = tuple(key[0] for key in plan.keys) if flat else None
        self.size = torch.Size([0])
        self.attributes: dict[str, Any] | None = None  # shared_attributes(self.size, _CPU)

    def __call__(self, batch_size: int, n: NArg, gamma: float, replace: bool) -> TensorDict:
        if not replace or isinstance(n, tuple):
            return self.general(batch_size, n, gamma, replace)
        plan = self.plan
        anchors = self.core.anchors
        if anchors is not self.anchors:
            self.anchors, self.anchor_rows = anchors, anchors.rows.numpy()
        if self.size[0] != batch_size:
            self.picks = torch.empty(batch_size, dtype=torch.long, device=_CPU)
            self.picks_host, self.size = self.picks.numpy(), torch.Size([batch_size])
            self.attributes = shared_attributes(self.size, _CPU)
        self.picks.random_(0, anchors.count, generator=self.generator)  # = torch.randint's
        powers = self.powers.get((gamma, n))
        if powers is None:
            if len(self.powers) > 16:
                self.powers.clear()
            dtype = plan.rewards.dtype
            powers = self.powers[gamma, n] = (reward_powers(gamma, n, dtype), host_powers(gamma, n))
        links, k = plan.links, plan.frame_stack
        rows, real, shift, ints, flags, reward, discount = plan.frame_nstep(
            self.picks_host, self.anchor_rows, n, k, links.succ, links.end_kind, links.step,
            links.episode, plan.rewards, *powers, links.prev_row,
        )  # fmt: skip
        start, actual_n, step, episode = ints  # rows of fresh arrays: the caller's
        terminal, truncated, cut = flags
        # The step fields' small gathers before the frames': the frames' copy evicts the caches
        # that these would otherwise find the code and columns in.
        steps = [view.take(start, axis=0) for view in plan.steps]
        values: list[np.ndarray] = []
        for view in plan.observations:
            values += take_stacks(view, rows, real, k + shift, shift, plan.zero_padding)
        values += steps
        values += [reward, terminal, truncated, cut, discount, actual_n, step, episode]
        tensors = list(map(torch.from_numpy, values))  # no comprehension frame (CPython 3.11)
        if self.names is None:  # nested keys
            return build_tensordict(plan.keys, tensors, batch_size, _CPU)
        leaves = dict(zip(self.names, tensors, strict=True))
        if self.attributes is None:
            return NEW_UNSAFE(leaves, batch_size=self.size, device=_CPU)  # type: ignore[misc]
        return with_attributes(leaves, self.attributes)  # _new_unsafe's, without its checks


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
        core.kernels.window_stacks,
        core.kernels.frame_nstep,
        core.frame_stack,
        core.frame_padding == "zero",
    )
