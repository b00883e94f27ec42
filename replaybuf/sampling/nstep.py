"""n-step transition batches from anchor rows: one gather per field, one TensorDict."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.args import NArg
from replaybuf.sampling.common import Values, keys_of, nstep_keys, tensor_of
from replaybuf.sampling.frames import HostStacks, stacked_observations_at
from replaybuf.sampling.ragged import ragged_keys_of, ragged_values
from replaybuf.sampling.view import EpisodeView
from replaybuf.sampling.windows import HostWindows, WindowMath
from replaybuf.storage import Key, Part, build_tensordict


class NStepBuilder:
    """n-step transition batches from anchor rows, for one buffer configuration.

    One gather per field (observations at both window ends together), one TensorDict built.
    ``math`` finds the windows (see :mod:`replaybuf.sampling.windows`); ``host_views``: the
    fields are gathered with numpy on their host views (CPU storage delivering on the CPU,
    without frame stacking, every field a numpy dtype), which costs fewer calls than the
    torch gathers of ``SlotStorage.deliver``; the values are the same.
    """

    def __init__(
        self,
        core: EpisodeView,
        device: torch.device,
        math: WindowMath,
        host_views: bool,
        ragged: str = "nested",
    ) -> None:
        self.core = core
        self.device = device
        self.math = math
        self.host_views = host_views
        self.ragged = ragged  # ragged fields: "nested" or "padded" (replaybuf.sampling.ragged)

    def batch(
        self,
        start: torch.Tensor,
        n: NArg,
        gamma: float,
        generator: torch.Generator,
        table: torch.Tensor | None = None,
    ) -> TensorDict:
        """The batch of anchors ``start`` (see :mod:`replaybuf.core.nstep` for the math).

        ``table``: ``start`` holds places in it (the packed anchor rows, a uniform draw), which
        the fused kernel looks up itself (one gather less)."""
        values, ends, start = self._values(start, n, gamma, generator, table)
        batch = build_tensordict(nstep_keys(self.core), values, start.shape[0], self.device)
        ragged = ragged_keys_of(self.core, "observation", "action", "extras")
        if ragged:  # their rows: the window's two ends for observations, the anchor else
            ends_rows, start_rows = np.asarray(tensor_of(ends).cpu()), start.cpu().numpy()
            for key in ragged:
                pairs: tuple[tuple[Key, np.ndarray], ...]
                if key[0] == "observation":
                    both = ends_rows.reshape(2, -1)
                    pairs = ((key, both[0]), (("next_observation", *key[1:]), both[1]))
                else:
                    pairs = ((key[1:] if key[0] == "extras" else key, start_rows),)
                for out_key, rows in pairs:
                    for k, v in ragged_values(
                        self.core, key, out_key, rows, self.device, self.ragged
                    ).items():
                        batch.set(k, v)
        return batch

    def values(
        self,
        start: torch.Tensor,
        n: NArg,
        gamma: float,
        generator: torch.Generator | None,
        table: torch.Tensor | None = None,
        fused_only: bool = False,
        powers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`batch`'s values, in :func:`nstep_keys`' order (``generator``: a random n's
        draws; None for a fixed n). ``fused_only`` (a graph's capture): raise
        :class:`~replaybuf.accel.graphs.NotCapturable` where the fused kernel declines (the
        torch ops' jump tables and caches are rebuilt outside any graph); ``powers``: the
        kernel's reward and discount powers (see :func:`replaybuf.accel.fused.nstep_windows`).
        """
        return self._values(start, n, gamma, generator, table, fused_only, powers)[0]

    def _values(
        self,
        start: torch.Tensor,
        n: NArg,
        gamma: float,
        generator: torch.Generator | None,
        table: torch.Tensor | None = None,
        fused_only: bool = False,
        powers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Values, torch.Tensor]:
        """:meth:`values`, with the rows of both window ends and the anchors."""
        core = self.core
        batch = start.shape[0]
        if isinstance(n, tuple):
            low, high = n
            drawn = torch.randint(
                low, high + 1, (batch,), generator=generator, device=start.device
            )  # [B], RLlib's random n-step
            # No window is longer than max_steps: an n drawn above it gives the same window,
            # and the windows' scratch stays bounded whatever high is.
            n_max = min(high, core.max_steps)
            n_each: torch.Tensor | int = drawn.clamp_(max=n_max)
        else:
            n_each = n_max = n
        windows = self.math(start, n_each, n_max, gamma, table, fused_only, powers)
        ends, info = windows.ends, windows.values()
        if table is not None:  # the anchor rows, looked up where start held places in table
            start = tensor_of(ends)[:batch]
        obs_keys, step_keys = keys_of(core, "observation"), keys_of(core, "action", "extras")
        if self.host_views:
            assert isinstance(ends, np.ndarray), "host windows give numpy rows"
            return host_nstep_values(core, start, ends, info, obs_keys, step_keys), ends, start
        slots = core.slots
        if core.frame_stack is None:
            parts: list[Part] = [(slots.column(key), tensor_of(ends)) for key in obs_keys]
        else:
            stacked_obs = stacked_observations_at(core, ends, self.math, windows.stacks)
            parts = [(stacked, None) for stacked in stacked_obs]
        parts += [(slots.column(key), start) for key in step_keys]
        parts += [(tensor_of(value), None) for value in info]
        delivered = iter(slots.deliver(parts, self.device))  # one pinned copy from CPU to CUDA
        values = []
        for _, both in zip(obs_keys, delivered):  # noqa: B905 (a prefix of delivered)
            values += [both[:batch], both[batch:]]
        return values + list(delivered), ends, start


def host_views_apply(core: EpisodeView, device: torch.device, math: WindowMath) -> bool:
    """Whether :class:`NStepBuilder` gathers with numpy (see its docstring)."""
    if device.type != "cpu" or core.frame_stack is not None or not isinstance(math, HostWindows):
        return False
    keys = keys_of(core, "observation") + keys_of(core, "action", "extras")
    return all(core.slots.host_view(key) is not None for key in keys)


def host_nstep_values(
    core: EpisodeView,
    start: torch.Tensor,
    ends: np.ndarray,
    info: list[Values],
    obs_keys: tuple[Key, ...],
    step_keys: tuple[Key, ...],
) -> list[torch.Tensor]:
    """:class:`NStepBuilder`'s values gathered with numpy on the fields' host views.

    Handwritten rather than through ``SlotStorage.deliver``: ``np.take``, numpy slices and
    ``torch.from_numpy`` each cost less than the torch calls they replace (``index_select``,
    slicing), and a batch makes a dozen of them, which weighs on small batches.
    """
    views = [core.slots.host_view(key) for key in obs_keys + step_keys]
    observed = len(obs_keys)
    values = host_gathers(views[:observed], views[observed:], ends, start.numpy(), info)  # type: ignore[arg-type]
    # The values that are not numpy arrays are tensors already.
    return [torch.from_numpy(v) if type(v) is np.ndarray else v for v in values]  # type: ignore[misc]


def host_gathers(
    observations: Sequence[np.ndarray],
    steps: Sequence[np.ndarray],
    ends: np.ndarray,
    start: np.ndarray,
    info: list[Values],
    stacks: HostStacks | None = None,
) -> list[Values]:
    """The host paths' values in :func:`nstep_key_order`' order: each observation view at both
    window ends (one take of ``ends``, split, or ``stacks``' two stacks), each step view at
    ``start``, then ``info``."""
    batch = start.shape[0]
    values: list[Values] = []
    for view in observations:
        if stacks is not None:
            values += stacks.take(view)
            continue
        both = view.take(ends, axis=0)  # [2B]: the window starts, then their ends
        values += [both[:batch], both[batch:]]
    values += [view.take(start, axis=0) for view in steps]
    return values + info
