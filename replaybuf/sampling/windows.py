"""Each anchor's n-step window: the rows of its two observations and its values.

One math, three implementations with one signature (a :class:`WindowMath`), picked once per
buffer configuration by :mod:`replaybuf.sampling.paths`:

* :class:`HostWindows` for CPU storage: the index math of :mod:`replaybuf.core.index` in numpy
  on the host columns, or, where numba loads and the rewards are a numpy float column, one
  call of :func:`replaybuf.accel.numba_kernels.nstep_windows` for the whole batch;
* :class:`DeviceWindows` for storage off the CPU: the fused Triton kernel
  (:mod:`replaybuf.accel.fused`) where it applies, else the same math in torch ops, with no
  host synchronisation.

Each returns a :class:`Windows`; the numpy paths' values are numpy arrays, the others tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from replaybuf.accel import fused
from replaybuf.accel.graphs import NotCapturable
from replaybuf.core import (
    bootstrap_discount,
    host_powers,
    nstep_windows,
    reward_powers,
    stack_rows,
    window_return,
)
from replaybuf.episodes import HostLinks
from replaybuf.sampling.common import Values, tensor_of
from replaybuf.sampling.view import EpisodeView

# Reward dtypes whose window sums run in numpy on the host path (numpy has no bfloat16, and
# integer rewards sum into the default float dtype, as the torch path does).
HOST_REWARD = (np.float32, np.float64)
NO_N = np.empty(0, np.int64)  # the kernel's "every anchor walks n_max"
Stacks = tuple[torch.Tensor, torch.Tensor]  # stack rows [N, k] and which are real frames
# The compiled kernel's nine results: ends, reward, terminal, truncated, cut, next_discount,
# actual_n, start_step, episode_id (the fields of Windows but stacks).
KernelWindows = tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
    np.ndarray, np.ndarray,
]  # fmt: skip


class Windows(NamedTuple):
    """The n-step windows of a batch of anchors (``B`` of them)."""

    ends: Values  # [2B]: the anchors' rows, then the rows of their windows' last observations
    reward: Values  # [B] discounted reward sum over the window
    terminal: Values  # [B] the window ends at a terminated episode's final observation
    truncated: Values  # [B] ... at a truncated episode's final observation
    cut: Values  # [B] ... short of n because the episode has no later observation yet
    next_discount: Values  # [B] gamma**m, or 0 when terminal
    actual_n: Values  # [B] m, the window's steps
    start_step: Values  # [B] the anchors' step numbers
    episode_id: Values  # [B]
    stacks: Stacks | None = None  # both ends' frame stack rows, where the fused kernel made them

    def values(self) -> list[Values]:
        """``reward`` to ``episode_id``, in the order an n-step batch lists them."""
        return list(self[1:9])


class WindowMath(Protocol):
    """What every implementation offers: windows, and frame stack rows."""

    def __call__(
        self,
        start: torch.Tensor,
        n_each: torch.Tensor | int,
        n_max: int,
        gamma: float,
        table: torch.Tensor | None = None,
        fused_only: bool = False,
        powers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Windows:
        """``start [B]`` anchors (or places in ``table``, the packed anchor rows), each with
        ``n_each`` steps at most (an int, or ``[B]``; ``n_max`` the largest)."""
        ...

    def stack_rows(self, rows: Values, k: int) -> tuple[Values, Values]:
        """The rows of each row's k-frame stack ``[*rows.shape, k]`` and which are real."""
        ...


def compiled_windows(
    kernel: Callable[..., KernelWindows],
    start: np.ndarray,
    n_each: np.ndarray,
    n_max: int,
    host: HostLinks,
    rewards: np.ndarray,
    gamma: float,
) -> Windows:
    """One call of :func:`replaybuf.accel.numba_kernels.nstep_windows` (contiguous int64
    ``start`` and ``n_each``)."""
    return Windows(
        *kernel(
            start,
            n_each,
            n_max,
            host.succ,
            host.end_kind,
            host.step,
            host.episode,
            rewards,
            reward_powers(gamma, n_max, rewards.dtype),
            host_powers(gamma, n_max),
        )
    )


def host_rewards(core: EpisodeView) -> np.ndarray | None:
    """The reward column as a 1-D numpy float array the host paths sum, else None."""
    rewards = core.slots.host_view(("reward",))  # None for bfloat16, say
    if rewards is None or rewards.ndim != 1 or rewards.dtype not in HOST_REWARD:
        return None
    return rewards


class HostWindows:
    """Windows on the host columns (CPU storage): numba where ``compiled``, else numpy."""

    def __init__(self, core: EpisodeView, compiled: bool) -> None:
        self.core = core
        self.compiled = compiled  # the kernels loaded and the rewards are contiguous floats

    def __call__(
        self,
        start: torch.Tensor,
        n_each: torch.Tensor | int,
        n_max: int,
        gamma: float,
        table: torch.Tensor | None = None,
        fused_only: bool = False,
        powers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Windows:
        core = self.core
        host = core.links.host
        assert host is not None, "host windows read the host columns (CPU storage)"
        if table is not None:  # the host paths take anchor rows
            start = table.index_select(0, start)
        rewards = host_rewards(core)
        if self.compiled and rewards is not None:
            kernels = core.kernels
            assert kernels is not None, "compiled windows run with the numba kernels"
            each = NO_N if isinstance(n_each, int) else n_each.numpy()
            return compiled_windows(
                kernels.nstep_windows,
                np.ascontiguousarray(start.numpy(), dtype=np.int64),
                np.ascontiguousarray(each, dtype=np.int64),
                n_max,
                host,
                rewards,
                gamma,
            )
        at = start.numpy()
        host_each = n_each if isinstance(n_each, int) else n_each.numpy()
        # w's fields are numpy arrays here; core.index.Windows types them as either kind.
        w = nstep_windows(at, host_each, n_max, host.succ, host.end_kind)
        if rewards is not None:
            reward = window_return(
                rewards[w.rows[:n_max]],
                w.valid,  # type: ignore[type-var]
                gamma,
            )
        else:
            reward = _gathered_return(core, w.rows, w.valid, n_max, gamma)
        discount = bootstrap_discount(w.m, w.terminal, gamma, n_max)  # type: ignore[type-var]
        ends = np.concatenate([at, w.last_row])
        return Windows(
            ends, reward, w.terminal, w.truncated, w.cut, discount, w.m, host.step[at],
            host.episode[at],
        )  # fmt: skip

    def stack_rows(self, rows: Values, k: int) -> tuple[Values, Values]:
        host = self.core.links.host
        assert host is not None, "host windows read the host columns (CPU storage)"
        assert host.prev_row is not None, "frame stacking keeps prev_row"
        rows = rows if isinstance(rows, np.ndarray) else rows.numpy()
        kernels = self.core.kernels
        if kernels is None:
            return stack_rows(rows, k, host.prev_row)
        # One compiled loop for the whole batch, not a few numpy calls per frame back.
        flat_rows = np.ascontiguousarray(rows.reshape(-1), dtype=np.int64)
        flat, real = kernels.stack_rows(flat_rows, k, host.prev_row)
        return flat.reshape(*rows.shape, k), real.reshape(*rows.shape, k)


class DeviceWindows:
    """Windows on the storing device (storage off the CPU): one fused kernel launch where it
    applies, else torch ops; no host synchronisation either way."""

    def __init__(self, core: EpisodeView) -> None:
        self.core = core

    def __call__(
        self,
        start: torch.Tensor,
        n_each: torch.Tensor | int,
        n_max: int,
        gamma: float,
        table: torch.Tensor | None = None,
        fused_only: bool = False,
        powers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Windows:
        core = self.core
        links = core.links
        reward_column = core.slots.column(("reward",))
        made = fused.nstep_windows(
            start, n_each, n_max, gamma, links, reward_column, table, core.frame_stack, powers
        )
        if made is not None:
            ends, values, stacks = made  # values: the eight fields between ends and stacks
            return Windows(ends, *values, stacks=stacks)  # type: ignore[misc, arg-type]
        if fused_only:
            raise NotCapturable("the fused n-step kernel does not apply")
        if table is not None:
            start = table.index_select(0, start)
        # w's fields are tensors here; core.index.Windows types them as either kind.
        w = nstep_windows(start, n_each, n_max, links.succ, links.end_kind)
        reward = _gathered_return(core, w.rows, w.valid, n_max, gamma)
        discount = bootstrap_discount(w.m, w.terminal, gamma, n_max)  # type: ignore[type-var]
        step, episode = links.step.index_select(0, start), links.episode.index_select(0, start)
        ends = torch.cat([start, w.last_row])  # type: ignore[list-item]
        return Windows(ends, reward, w.terminal, w.truncated, w.cut, discount, w.m, step, episode)

    def stack_rows(self, rows: Values, k: int) -> tuple[Values, Values]:
        prev_row = self.core.links.prev_row
        made = fused.stack_rows(tensor_of(rows), k, prev_row)  # one launch where Triton runs
        return made or stack_rows(tensor_of(rows), k, prev_row)


def _gathered_return(
    core: EpisodeView, rows: Values, valid: Values, n_max: int, gamma: float
) -> torch.Tensor:
    """The window return from one gather of the reward rows of steps t..t+n-1 (``[n, B]``:
    contiguous, no copy), in torch: CUDA storage, and reward dtypes numpy lacks."""
    reward_column = core.slots.column(("reward",))
    taken = torch.as_tensor(rows[:n_max])
    gathered = reward_column.index_select(0, taken.reshape(-1))
    gathered = gathered.reshape(n_max, *taken.shape[1:], *reward_column.shape[1:])
    return window_return(gathered, torch.as_tensor(valid), gamma)


def window_math(core: EpisodeView) -> WindowMath:
    """The implementation for the core's configuration (see the module docstring)."""
    if core.links.host is None:
        return DeviceWindows(core)
    rewards = host_rewards(core)
    compiled = core.kernels is not None and rewards is not None and rewards.flags.c_contiguous
    return HostWindows(core, compiled)
