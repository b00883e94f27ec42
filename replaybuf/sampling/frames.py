"""Frame stacks rebuilt at sampling time from one stored frame per step.

With ``frame_stack=k`` every observation leaf comes back as ``[..., k, *frame]``: the row's own
frame last, the k-1 before it in its episode first, padded at the episode start as the core's
``frame_padding`` says (repeating the first frame, or zeros).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from replaybuf.core import (
    stack_windows,
)
from replaybuf.sampling.common import Values, keys_of, tensor_of
from replaybuf.sampling.padding import kept_or_zero
from replaybuf.sampling.view import EpisodeView
from replaybuf.sampling.windows import Stacks, WindowMath


def zero_padding(core: EpisodeView, value: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Frames at padding positions (``real`` False, its shape leading ``value``'s) zeroed when
    the padding is ``"zero"``; with ``"reset"`` they already repeat the episode's first frame."""
    if core.frame_padding != "zero":
        return value
    keep = real.reshape(*real.shape, *([1] * (value.dim() - real.dim())))
    return kept_or_zero(keep, value)


def stacked_observations_at(
    core: EpisodeView, rows: Values, math: WindowMath, stacks: Stacks | None = None
) -> list[torch.Tensor]:
    """Each observation field's k-frame stacks at ``rows [N]`` (``frame_stack=k`` set), on the
    storing device: ``[N, k, *field]``. The stack rows are found by ``math`` (the buffer's
    window implementation), or given (``stacks``: the fused n-step kernel found them)."""
    keys = keys_of(core, "observation")
    k = core.frame_stack
    assert k is not None, "only buffers with frame stacking rebuild stacks"
    stacked, real = stacks if stacks is not None else math.stack_rows(rows, k)  # [N, k]
    values = core.slots.take(tensor_of(stacked.reshape(-1)), keys)  # [N * k, *field]
    flat_real = tensor_of(real.reshape(-1))
    return [zero_padding(core, v, flat_real).reshape(*stacked.shape, *v.shape[1:]) for v in values]


def stacked_observations(
    core: EpisodeView,
    start: torch.Tensor,
    obs_rows: torch.Tensor,
    device: torch.device,
    present: torch.Tensor | None = None,
) -> TensorDictBase:
    """The observations at ``obs_rows [B, P]`` (consecutive rows of one episode each, from
    ``start [B]``) as a TensorDict ``[B, P]`` on ``device``; leaves ``[B, P, k, *field]`` with
    frame stacking, cut from one gathered window of k-1+P frames per row. ``present [B, P]``:
    False where a row only repeats the next one (a burn-in before the episode's first step),
    so that the stacks after it take it as padding."""
    keys = keys_of(core, "observation")
    batch, length = obs_rows.shape
    k = core.frame_stack
    if k is None:
        return core.slots.gather(obs_rows.reshape(-1), device, keys).reshape(batch, length)
    host = core.links.host
    if host is None:
        window, real = stack_windows(start, obs_rows, k, core.links.prev_row)  # [B, k - 1 + P]
    else:  # the stack rows in numpy
        assert host.prev_row is not None, "frame stacking keeps prev_row"
        window, real = stack_windows(start.numpy(), obs_rows.numpy(), k, host.prev_row)
        window, real = torch.from_numpy(window), torch.from_numpy(real)
    frames = core.slots.gather(window.reshape(-1), device, keys).reshape(window.shape)
    real = real.to(device)
    if present is not None:
        real = torch.cat([real[:, : k - 1], real[:, k - 1 :] & present.to(device)], 1)

    def cut(value: torch.Tensor) -> torch.Tensor:  # [B, k - 1 + P, *f] -> [B, P, k, *f]
        return zero_padding(core, value, real).unfold(1, k, 1).movedim(-1, 2)

    return frames.apply(cut, batch_size=[batch, length])


def lone_stack(core: EpisodeView, frame: torch.Tensor) -> torch.Tensor:
    """The stack of an episode's first frame (``[k, *frame]``), or the frame without stacking."""
    k = core.frame_stack
    if k is None:
        return frame
    if core.frame_padding == "zero":
        return torch.cat([frame.new_zeros((k - 1, *frame.shape)), frame.unsqueeze(0)])
    return frame.unsqueeze(0).expand(k, *frame.shape).clone()  # [k, *frame]


class HostStacks(NamedTuple):
    """The frames of a batch's stacks at both window ends, as rows of the storage and which
    of them are real (:func:`replaybuf.accel.numba_kernels.stack_rows`), in one of two layouts:

    * ``shift`` 0: the stacks of ``ends [2B]``, k rows each (``depth`` = k): ``[2B * k]``;
    * ``shift`` n (every window n steps long, n < k): the stack of each window's last
      observation ``depth`` = k + n rows deep, ``[B * (k + n)]``. The first stack is its
      first k rows and the second its last k (they share k - n), so each frame is read once.
    """

    rows: np.ndarray
    real: np.ndarray
    depth: int
    zero: bool  # "zero" padding: frames before an episode's first are zeros, not its first
    shift: int = 0

    def take(self, view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stacks ``([B, k, *field], [B, k, *field])`` at the window starts and ends of one
        observation view: :func:`take_stacks`."""
        return take_stacks(view, self.rows, self.real, self.depth, self.shift, self.zero)


def take_stacks(
    view: np.ndarray, rows: np.ndarray, real: np.ndarray, depth: int, shift: int, zero: bool
) -> tuple[np.ndarray, np.ndarray]:
    """:class:`HostStacks`' two stacks of one observation view, from its fields (padding as
    :func:`zero_padding` makes it, written only where a stack has some). One fresh array holds
    both: with ``shift``, the two are overlapping views of it (the caller's, like a sequence
    batch's observations and next observations)."""
    frames = view.take(rows, axis=0)  # a fresh array: zeroed in place
    if zero and not real.all():
        frames[~real] = 0
    # the count of stacks given: a field of no elements leaves -1 nothing to divide
    windows = frames.reshape(rows.shape[0] // depth, depth, *frames.shape[1:])
    if shift:
        return windows[:, : depth - shift], windows[:, shift:]
    half = windows.shape[0] // 2
    return windows[:half], windows[half:]
