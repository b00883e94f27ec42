"""Build sampled batches from linked episode rows: n-step transitions, sequences, episodes.

The index math lives in :mod:`replaybuf.core.index`; this module turns its rows into TensorDicts:
observations at the window's two ends in one gather, actions and extras at the start, rewards
summed over the window. Everything is computed on the storing device and delivered on
``device``.

With ``frame_stack=k`` every observation leaf comes back as ``[..., k, *frame]``: the row's own
frame last, the k-1 before it in its episode first, padded at the episode start as the core's
``frame_padding`` says (repeating the first frame, or zeros).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replaybuf.accel.fused import Redraw, Walk
from replaybuf.accel.fused import nstep_windows as fused_nstep_windows
from replaybuf.accel.fused import sequences as fused_sequences
from replaybuf.accel.fused import stack_rows as fused_stack_rows
from replaybuf.accel.fused import walks as fused_walks
from replaybuf.accel.graphs import NotCapturable
from replaybuf.args import NArg
from replaybuf.core import (
    END_TERMINATED,
    END_TRUNCATED,
    bootstrap_discount,
    full_sequence_starts_by_jumps,
    host_powers,
    jump_levels,
    nstep_windows,
    reward_powers,
    sequence_rows,
    sequence_rows_by_jumps,
    stack_rows,
    stack_windows,
    window_return,
)
from replaybuf.core import full_sequence_starts as qualifies
from replaybuf.episodes import Episode, EpisodeCore, HostLinks
from replaybuf.errors import EmptyBufferError
from replaybuf.storage import Key, Part, build_tensordict

# Uniform places in the packed anchor rows for a shape, those rows, and the device draws'
# state where the places came from them (a buffer's draw)
Draw = Callable[[tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, Redraw | None]]
Values = torch.Tensor | np.ndarray  # index math results: numpy on the host paths


def _keys(core: EpisodeCore, *groups: str) -> tuple[Key, ...]:
    spec = core.slots.spec  # None only before the first step, when nothing is sampled
    return () if spec is None else spec.group(*groups)


def _zero(value: torch.Tensor) -> bool | int:
    """A Python zero that keeps ``value``'s dtype in ``torch.where`` (no tensor to allocate)."""
    return False if value.dtype == torch.bool else 0


def _pad(value: torch.Tensor, mask: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """``value`` (``[B, L, ...]``) with ``fill`` wherever ``mask`` (``[B, L]``) is False."""
    keep = mask.reshape(*mask.shape, *[1] * (value.dim() - 2))
    return _kept_or_zero(keep, value) if not fill else torch.where(keep, value, fill)


def _kept_or_zero(keep: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``value`` where ``keep`` (broadcast to it) is True, else zero.

    Integer and bool values are multiplied by the mask, exact for them: on the CPU
    ``torch.where`` (and ``masked_fill``) copy uint8 at ~1 GB/s, 3 ms for a padded
    ``[8, 16, 4, 84, 84]`` sequence batch of frames, where the product takes ~0.1 ms.
    Floats keep ``torch.where``: a product would turn a stored NaN or inf into NaN.
    """
    if not _exact_product(value):
        return torch.where(keep, value, _zero(value))
    return value * keep


def _exact_product(value: torch.Tensor) -> bool:
    """Whether multiplying ``value`` by a 0/1 mask is exact: integers and bools, not floats."""
    return not (value.dtype.is_floating_point or value.dtype.is_complex)


def _pad_in_place(value: torch.Tensor, pad: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """:func:`_pad` written into ``value`` (a fresh gather no other field shares) where
    ``pad`` (``[B, L]``) is True: ``masked_fill_`` costs less than half a ``torch.where`` with
    a scalar on CUDA (11 against 25 µs a call on an H100's host). On the CPU integer and bool
    values are multiplied by the mask instead, as in :func:`_kept_or_zero`."""
    pad = pad.reshape(*pad.shape, *[1] * (value.dim() - 2))
    if not fill and value.is_cpu and _exact_product(value):
        return value.mul_(~pad)
    return value.masked_fill_(pad, fill)


def _zero_padding(core: EpisodeCore, value: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Frames at padding positions (``real`` False, its shape leading ``value``'s) zeroed when
    the padding is ``"zero"``; with ``"reset"`` they already repeat the episode's first frame."""
    if core.frame_padding != "zero":
        return value
    keep = real.reshape(*real.shape, *([1] * (value.dim() - real.dim())))
    return _kept_or_zero(keep, value)


def _stacked_observations_at(
    core: EpisodeCore, rows: Values, stacks: tuple[torch.Tensor, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Each observation field's k-frame stacks at ``rows [N]`` (``frame_stack=k`` set), on the
    storing device: ``[N, k, *field]``. The stack rows are found in numpy on the host, or
    given (``stacks``: the fused n-step kernel found them)."""
    keys = _keys(core, "observation")
    k = core.frame_stack
    assert k is not None, "only buffers with frame stacking rebuild stacks"
    host = core.links.host
    if stacks is not None:
        stacked, real = stacks
    elif host is None:  # one launch where Triton runs, else k - 1 steps of torch ops
        prev_row = core.links.prev_row
        fused = fused_stack_rows(_tensor(rows), k, prev_row)
        stacked, real = fused or stack_rows(_tensor(rows), k, prev_row)  # [N, k]
    else:
        rows = rows if isinstance(rows, np.ndarray) else rows.numpy()
        if core.kernels is not None:  # one compiled loop, not ~4 numpy calls per frame back
            flat_rows = np.ascontiguousarray(rows.reshape(-1), dtype=np.int64)
            flat, flat_real = core.kernels.stack_rows(flat_rows, k, host.prev_row)
            stacked, real = flat.reshape(*rows.shape, k), flat_real.reshape(*rows.shape, k)
        else:
            stacked, real = stack_rows(rows, k, host.prev_row)
    values = core.slots.take(_tensor(stacked.reshape(-1)), keys)  # [N * k, *field]
    flat_real = _tensor(real.reshape(-1))
    return [_zero_padding(core, v, flat_real).reshape(*stacked.shape, *v.shape[1:]) for v in values]


def _stacked_observations(
    core: EpisodeCore, start: torch.Tensor, obs_rows: torch.Tensor, device: torch.device
) -> TensorDictBase:
    """The observations at ``obs_rows [B, P]`` (consecutive rows of one episode each, from
    ``start [B]``) as a TensorDict ``[B, P]`` on ``device``; leaves ``[B, P, k, *field]`` with
    frame stacking, cut from one gathered window of k-1+P frames per row."""
    keys = _keys(core, "observation")
    batch, length = obs_rows.shape
    k = core.frame_stack
    if k is None:
        return core.slots.gather(obs_rows.reshape(-1), device, keys).reshape(batch, length)
    host = core.links.host
    if host is None:
        window, real = stack_windows(start, obs_rows, k, core.links.prev_row)  # [B, k - 1 + P]
    else:  # the stack rows in numpy
        window, real = stack_windows(start.numpy(), obs_rows.numpy(), k, host.prev_row)
        window, real = torch.from_numpy(window), torch.from_numpy(real)
    frames = core.slots.gather(window.reshape(-1), device, keys).reshape(window.shape)
    real = real.to(device)

    def cut(value: torch.Tensor) -> torch.Tensor:  # [B, k - 1 + P, *f] -> [B, P, k, *f]
        return _zero_padding(core, value, real).unfold(1, k, 1).movedim(-1, 2)

    return frames.apply(cut, batch_size=[batch, length])


def _put_extras(out: TensorDict, rows: TensorDictBase) -> None:
    """Extras are stored under ``extras`` and returned as top-level keys."""
    extras = rows.get("extras", None)
    if extras is not None:
        # items(), not iteration: iterating a TensorDict walks its batch dim, not its keys.
        for name, value in extras.items():
            out.set(name, value)


def nstep_batch(
    core: EpisodeCore,
    start: torch.Tensor,
    n: NArg,
    gamma: float,
    device: torch.device,
    generator: torch.Generator,
    table: torch.Tensor | None = None,
) -> TensorDict:
    """n-step transitions from anchor rows ``start`` (see :mod:`replaybuf.core.nstep` for the math).

    One gather per field (observations at both window ends together), one TensorDict built.
    ``table``: ``start`` holds places in it (the packed anchor rows, a uniform draw), which the
    fused kernel looks up itself (one gather less).
    """
    values = nstep_values(core, start, n, gamma, device, generator, table)
    return build_tensordict(nstep_keys(core), values, start.shape[0], device)


def nstep_keys(core: EpisodeCore) -> tuple[Key, ...]:
    """The keys of the core's n-step batches, in :func:`nstep_values`' order."""
    return _nstep_keys(_keys(core, "observation"), _keys(core, "action", "extras"))


def nstep_values(
    core: EpisodeCore,
    start: torch.Tensor,
    n: NArg,
    gamma: float,
    device: torch.device,
    generator: torch.Generator | None,
    table: torch.Tensor | None = None,
    fused_only: bool = False,
    powers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """:func:`nstep_batch`'s values, in :func:`nstep_keys`' order (``generator``: a random
    n's draws; None for a fixed n). ``fused_only`` (a graph's capture): raise
    :class:`~replaybuf.accel.graphs.NotCapturable` where the fused kernel declines (the torch ops'
    jump tables and caches are rebuilt outside any graph); ``powers``: the kernel's reward and
    discount powers (see :func:`replaybuf.accel.fused.nstep_windows`)."""
    batch = start.shape[0]
    if isinstance(n, tuple):
        low, high = n
        n_each: torch.Tensor | int = torch.randint(
            low, high + 1, (batch,), generator=generator, device=start.device
        )  # [B], RLlib's random n-step
        n_max = high
    else:
        n_each = n_max = n
    ends, info, stacks = _window_values(
        core, start, n_each, n_max, gamma, table, fused_only, powers
    )
    if table is not None:  # the anchor rows, looked up where start held places in table
        start = _tensor(ends)[:batch]
    obs_keys, step_keys = _keys(core, "observation"), _keys(core, "action", "extras")
    values = _host_nstep_values(core, start, ends, info, obs_keys, step_keys, batch, device)
    if values is not None:
        return values
    slots = core.slots
    if core.frame_stack is None:
        parts: list[Part] = [(slots.column(key), _tensor(ends)) for key in obs_keys]
    else:
        stacked_obs = _stacked_observations_at(core, ends, stacks)
        parts = [(stacked, None) for stacked in stacked_obs]
    parts += [(slots.column(key), start) for key in step_keys]
    parts += [(_tensor(value), None) for value in info]
    delivered = iter(slots.deliver(parts, device))  # one pinned transfer from CPU to CUDA
    values = []
    for _, both in zip(obs_keys, delivered):  # noqa: B905 (a prefix of delivered)
        values += [both[:batch], both[batch:]]
    return values + list(delivered)


@functools.lru_cache(maxsize=64)
def _nstep_keys(obs_keys: tuple[Key, ...], step_keys: tuple[Key, ...]) -> tuple[Key, ...]:
    """The keys of an n-step batch, in :func:`nstep_batch`'s value order (cached per spec:
    the same for every batch)."""
    keys: list[Key] = []
    for key in obs_keys:
        keys += [key, ("next_observation", *key[1:])]
    keys += [key[1:] if key[0] == "extras" else key for key in step_keys]  # extras: top-level
    keys += [("reward",), ("terminal",), ("truncated",), ("cut",), ("next_discount",)]
    keys += [("actual_n",), ("start_step",), ("episode_id",)]
    return tuple(keys)


def _host_nstep_values(
    core: EpisodeCore,
    start: torch.Tensor,
    ends: Values,
    info: list[Values],
    obs_keys: tuple[Key, ...],
    step_keys: tuple[Key, ...],
    batch: int,
    device: torch.device,
) -> list[torch.Tensor] | None:
    """:func:`nstep_batch`'s values gathered in numpy, or None where that does not apply.

    It applies to CPU storage delivering on the CPU, without frame stacking, when every
    gathered column (observations first, at ``ends``, then the step fields, at ``start``) has a
    numpy dtype. Handwritten rather than through ``SlotStorage.deliver``: ``np.take``, numpy
    slices and ``torch.from_numpy`` each cost about 1 µs less than the torch calls they replace
    (``index_select``, slicing), and a batch makes a dozen of them: ``sample_n_step(32)`` on a
    small buffer took 25-35% less time on the 2-core dev VM.
    """
    if device.type != "cpu" or core.frame_stack is not None or not isinstance(ends, np.ndarray):
        return None
    views = [core.slots.host_view(key) for key in obs_keys + step_keys]
    if any(view is None for view in views):
        return None
    observed = len(obs_keys)
    values = _host_gathers(views[:observed], views[observed:], ends, start.numpy(), info)
    return [torch.from_numpy(v) if type(v) is np.ndarray else v for v in values]


class _HostStacks(NamedTuple):
    """The frames of both window ends' k-frame stacks
    (:func:`replaybuf.accel.numba_kernels.stack_rows`
    of ``ends``): their rows and which are real, ``[2B * k]`` each."""

    rows: np.ndarray
    real: np.ndarray
    k: int
    zero: bool  # "zero" padding: frames before an episode's first are zeros, not its first

    def take(self, view: np.ndarray) -> np.ndarray:
        """The stacks ``[2B, k, *field]`` of one observation view (padding as
        :func:`_zero_padding` makes it, written only where a stack has some)."""
        frames = view.take(self.rows, axis=0)  # a fresh array: zeroed in place
        if self.zero and not self.real.all():
            frames[~self.real] = 0
        # the count of stacks given: a field of no elements leaves -1 nothing to divide
        return frames.reshape(self.rows.shape[0] // self.k, self.k, *frames.shape[1:])


def _host_gathers(
    observations: Sequence[np.ndarray],
    steps: Sequence[np.ndarray],
    ends: np.ndarray,
    start: np.ndarray,
    info: list[Values],
    stacks: _HostStacks | None = None,
) -> list[Values]:
    """The host paths' values in :func:`_nstep_keys`' order: each observation view at both
    window ends (one take of ``ends``, or of ``stacks``' frames, split), each step view at
    ``start``, then ``info``."""
    batch = start.shape[0]
    values: list[Values] = []
    for view in observations:
        # [2B]: the window starts, then its ends
        both = view.take(ends, axis=0) if stacks is None else stacks.take(view)
        values += [both[:batch], both[batch:]]
    values += [view.take(start, axis=0) for view in steps]
    return values + info


def _compiled_windows(
    kernel: Callable[..., tuple[np.ndarray, ...]],
    start: np.ndarray,
    n_each: np.ndarray,
    n_max: int,
    host: HostLinks,
    rewards: np.ndarray,
    gamma: float,
) -> tuple[np.ndarray, ...]:
    """One call of :func:`replaybuf.accel.numba_kernels.nstep_windows` (contiguous int64 ``start``
    and
    ``n_each``): the rows of both observations, then the values of ``_window_values``."""
    return kernel(
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


class _HostPlan(NamedTuple):
    """What :func:`uniform_host_nstep` reads of the columns, looked up once per allocation."""

    keys: tuple[Key, ...]  # the batch's keys, in value order (see _nstep_keys)
    observations: tuple[np.ndarray, ...]  # host views, gathered at both window ends
    steps: tuple[np.ndarray, ...]  # host views, gathered at the start (actions, extras)
    rewards: np.ndarray  # the 1-D reward column
    links: HostLinks  # the row links' host columns
    windows: Callable[..., tuple[np.ndarray, ...]]  # kernels.nstep_windows
    stack_rows: Callable[..., tuple[np.ndarray, np.ndarray]]  # kernels.stack_rows
    frame_stack: int | None  # the core's k
    zero_padding: bool  # the core's frame padding is "zero"


def uniform_host_nstep(
    core: EpisodeCore,
    batch_size: int,
    n: NArg,
    gamma: float,
    device: torch.device,
    generator: torch.Generator,
) -> TensorDict | None:
    """A uniform draw with replacement (:func:`draw_anchors`) and its :func:`nstep_batch`, or
    None where this path does not apply: then the caller takes those two.

    It applies to CPU storage delivering on the CPU, without priorities or a random n, where
    the compiled window kernel runs and every gathered column has a numpy view; it makes the
    same draws and returns the same values (frame stacks too: their rows found by one compiled
    loop, where the general path makes ~4 numpy calls per frame back). Handwritten as one
    pass because the general path's per-batch lookups and conversions (views by key, the key
    lists, torch and numpy views of the anchors) weigh on small batches: W3's
    ``sample_n_step(32)`` of 28 KB frames took 8-29 µs less on the 2-core dev VM (1.04-1.47x
    -> 0.94-1.36x the floor over ten paired runs; see benchmarks/RESULTS.md)."""
    if core.priorities is not None or isinstance(n, tuple) or device.type != "cpu":
        return None
    plan = _host_plan(core)
    if plan is None:
        return None
    start = core.anchors.sample_host(batch_size, generator)
    ends, *info = _compiled_windows(plan.windows, start, _NO_N, n, plan.links, plan.rewards, gamma)
    stacks = None
    if plan.frame_stack is not None:
        k = plan.frame_stack
        rows, real = plan.stack_rows(ends, k, plan.links.prev_row)
        stacks = _HostStacks(rows, real, k, plan.zero_padding)
    values = _host_gathers(plan.observations, plan.steps, ends, start, info, stacks)
    tensors = [torch.from_numpy(v) for v in values]
    return build_tensordict(plan.keys, tensors, batch_size, device)


def _host_plan(core: EpisodeCore) -> _HostPlan | None:
    """The core's :class:`_HostPlan` (None: the path does not apply), kept in the storage's
    ``derived`` cache, which the storage empties when it allocates or releases columns."""
    derived = core.slots.derived
    if _HOST_PLAN in derived:
        return derived[_HOST_PLAN]
    plan = derived[_HOST_PLAN] = _new_host_plan(core)
    return plan


def _new_host_plan(core: EpisodeCore) -> _HostPlan | None:
    host = core.links.host
    if core.kernels is None or host is None:
        return None
    if core.frame_stack is not None and host.prev_row is None:
        return None
    if not core.anchors.on_host:
        return None
    slots = core.slots
    rewards = slots.host_view(("reward",))
    if (
        rewards is None
        or rewards.ndim != 1
        or rewards.dtype not in _HOST_REWARD
        or not rewards.flags.c_contiguous
    ):
        return None
    obs_keys, step_keys = _keys(core, "observation"), _keys(core, "action", "extras")
    observations = [slots.host_view(key) for key in obs_keys]
    steps = [slots.host_view(key) for key in step_keys]
    if not obs_keys or any(view is None for view in observations + steps):
        return None
    return _HostPlan(
        _nstep_keys(obs_keys, step_keys),
        tuple(observations),  # type: ignore[arg-type]  # none is None (checked above)
        tuple(steps),  # type: ignore[arg-type]
        rewards,
        host,
        core.kernels.nstep_windows,
        core.kernels.stack_rows,
        core.frame_stack,
        core.frame_padding == "zero",
    )


def _tensor(value: Values) -> torch.Tensor:
    """A host path's numpy result as a tensor (a view, no copy); tensors pass through."""
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _window_values(
    core: EpisodeCore,
    start: torch.Tensor,
    n_each: torch.Tensor | int,
    n_max: int,
    gamma: float,
    table: torch.Tensor | None = None,
    fused_only: bool = False,
    powers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[Values, list[Values], tuple[torch.Tensor, torch.Tensor] | None]:
    """Each anchor's window: the rows of its two observations (``[2B]``, starts then ends),
    its values in ``nstep_batch``'s key order, ``reward`` to ``episode_id``, and the frame
    stacks of both observations where the fused kernel found them (else None). ``table``:
    ``start`` holds places in it (see :func:`nstep_batch`).

    With CPU storage the index math runs in one :mod:`replaybuf.accel.numba_kernels` call where
    numba is
    installed, else in numpy on views of the same columns (see :mod:`replaybuf.core.index`), and
    the results are numpy arrays (a reward numpy lacks, bfloat16 say, a tensor); CUDA storage
    runs it in torch, with no host synchronisation.
    """
    links, host = core.links, core.links.host
    if table is not None and host is not None:  # the host paths take anchor rows
        start, table = table.index_select(0, start), None
    compiled = core.kernels if host is not None else None
    rewards = core.slots.host_view(("reward",))  # None on CUDA storage, and for bfloat16
    if rewards is not None and (rewards.ndim != 1 or rewards.dtype not in _HOST_REWARD):
        rewards = None  # summed by the torch path below
    if compiled is not None and rewards is not None and rewards.flags.c_contiguous:
        # One compiled call for the ~25 numpy ones below (see replaybuf.accel.numba_kernels); the
        # kernel
        # takes contiguous int64 anchors and n (no copy when they already are).
        each = _NO_N if isinstance(n_each, int) else n_each.numpy()
        ends, *values = _compiled_windows(
            compiled.nstep_windows,
            np.ascontiguousarray(start.numpy(), dtype=np.int64),
            np.ascontiguousarray(each, dtype=np.int64),
            n_max,
            host,
            rewards,
            gamma,
        )
        return ends, values, None
    if host is None:
        reward_column = core.slots.column(("reward",))
        fused = fused_nstep_windows(
            start, n_each, n_max, gamma, links, reward_column, table, core.frame_stack, powers
        )
        if fused is not None:  # one launch for the ops below (CUDA storage, Triton installed)
            return fused
        if fused_only:
            raise NotCapturable("the fused n-step kernel does not apply")
        if table is not None:
            start = table.index_select(0, start)
        w = nstep_windows(start, n_each, n_max, links.succ, links.end_kind)
        step, episode = links.step.index_select(0, start), links.episode.index_select(0, start)
        ends = torch.cat([start, w.last_row])
    else:
        at = start.numpy()
        each = n_each if isinstance(n_each, int) else n_each.numpy()
        w = nstep_windows(at, each, n_max, host.succ, host.end_kind)
        step, episode = host.step[at], host.episode[at]
        ends = np.concatenate([at, w.last_row])
    if host is not None and rewards is not None:
        reward = window_return(rewards[w.rows[:n_max]], w.valid, gamma)
    else:  # one gather of the rows of steps t..t+n-1 ([n, B]: contiguous, no copy)
        reward_column = core.slots.column(("reward",))
        rows = torch.as_tensor(w.rows[:n_max])
        gathered = reward_column.index_select(0, rows.reshape(-1))
        gathered = gathered.reshape(n_max, *rows.shape[1:], *reward_column.shape[1:])
        reward = window_return(gathered, torch.as_tensor(w.valid), gamma)
    discount = bootstrap_discount(w.m, w.terminal, gamma, n_max)
    return ends, [reward, w.terminal, w.truncated, w.cut, discount, w.m, step, episode], None


# Reward dtypes whose window sums run in numpy on the host path (numpy has no bfloat16, and
# integer rewards sum into the default float dtype, as the torch path does).
_HOST_REWARD = (np.float32, np.float64)
_NO_N = np.empty(0, np.int64)  # the kernel's "every anchor walks n_max"
_HOST_PLAN = "sampling.uniform_host_nstep"  # its key in SlotStorage.derived


def sequence_batch(
    core: EpisodeCore,
    start: torch.Tensor,
    length: int,
    device: torch.device,
    walk: Walk | None = None,
    full: bool = False,
) -> TensorDict:
    """``[B, length]`` consecutive steps from each anchor; ``mask`` marks real steps.

    Positions past an episode's end are zero-filled, with ``episode_id`` and ``step`` -1;
    ``full`` says no anchor has fewer than ``length`` steps ahead (a strict draw), so nothing
    is filled. ``walk`` is the fused kernel's walk of these anchors, where it drew them.
    Like :func:`nstep_batch`, every field is gathered as a plain tensor and one TensorDict is
    built at the end (frame-stacked observations excepted: they come from
    :func:`_stacked_observations`): TensorDict reshapes, ``apply`` and ``set`` cost more than
    the gathers themselves here (and on CUDA their Python time is what the learner waits for).
    """
    keys, values = sequence_values(core, start, length, device, walk, full)
    return build_tensordict(keys, values, (start.shape[0], length), device)


def sequence_values(
    core: EpisodeCore,
    start: torch.Tensor,
    length: int,
    device: torch.device,
    walk: Walk | None = None,
    full: bool = False,
) -> tuple[list[Key], list[torch.Tensor]]:
    """:func:`sequence_batch`'s keys and values (``[B, length, ...]`` each), in its order."""
    walk = walk or _walk(core, start, length, full)
    padded = not full and _padded(walk.mask)
    slots = core.slots
    # Padded and without frame stacking, the observations at t and t+1 are gathered apart
    # (fresh tensors, filled in place) rather than as two overlapping views of one gather;
    # not from CPU storage to a GPU, where that would copy twice the observations' bytes.
    staged = slots.storing_device.type == "cpu" and device.type != "cpu"
    apart = padded and core.frame_stack is None and not staged
    batch = start.shape[0]
    obs_keys, step_keys = _keys(core, "observation"), _keys(core, "action", "reward", "extras")
    parts: list[Part] = []
    if apart:
        for rows in (walk.step_rows, walk.next_rows):
            parts += [(slots.column(key), rows.reshape(-1)) for key in obs_keys]
    elif core.frame_stack is None:
        parts += [(slots.column(key), walk.obs_rows.reshape(-1)) for key in obs_keys]
    parts += [(slots.column(key), walk.step_rows.reshape(-1)) for key in step_keys]
    flat = (walk.terminal, walk.truncated, walk.step, walk.episode, walk.mask, walk.pad)
    parts += [(value, None) for value in flat]
    # One pinned transfer from CPU storage to CUDA (frame-stacked observations make a second).
    delivered = slots.deliver(parts, device)
    terminal, truncated, step_id, episode_id, mask, pad = delivered[-6:]
    observed = len(obs_keys)
    if apart:  # [B * length, *field] each -> [B, length, *field]
        now_after = [v.reshape(batch, length, *v.shape[1:]) for v in delivered[: 2 * observed]]
        delivered = delivered[2 * observed :]
        observations = list(zip(now_after[:observed], now_after[observed:], strict=True))
    else:
        if core.frame_stack is None:  # [B * (length + 1), *field] -> [B, length + 1, *field]
            both = [v.reshape(batch, length + 1, *v.shape[1:]) for v in delivered[:observed]]
            delivered = delivered[observed:]
        else:  # [B, length + 1, k, *field], rebuilt from one frame per step
            stacked = _stacked_observations(core, start, walk.obs_rows, device)
            both = [stacked.get(key) for key in obs_keys]
        observations = [(value[:, :length], value[:, 1:]) for value in both]
    steps = {  # [B * length, *field] -> [B, length, *field]; a prefix of delivered
        key: value.reshape(batch, length, *value.shape[1:])
        for key, value in zip(step_keys, delivered, strict=False)
    }
    # Key order: observation, action, reward, next_observation, terminal, truncated, step,
    # episode_id, the extras (top-level keys), mask.
    now = [(key, pair[0]) for key, pair in zip(obs_keys, observations, strict=True)]
    after = [
        (("next_observation", *key[1:]), pair[1])
        for key, pair in zip(obs_keys, observations, strict=True)
    ]
    acted = [(key, value) for key, value in steps.items() if key[0] != "extras"]
    extras = [(key[1:], value) for key, value in steps.items() if key[0] == "extras"]
    if padded:  # zeros past the end (the walk's own values already are)
        if apart:  # fresh gathers, like every other field: filled in place
            now, after = (
                [(key, _pad_in_place(value, pad, _zero(value))) for key, value in group]
                for group in (now, after)
            )
        else:  # overlapping views of one gather: new tensors
            now = [(key, _pad(value, mask, _zero(value))) for key, value in now]
            after = [(key, _pad(value, mask, _zero(value))) for key, value in after]
        acted, extras = (
            [(key, _pad_in_place(value, pad, _zero(value))) for key, value in group]
            for group in (acted, extras)
        )
    ends = [(("terminal",), terminal), (("truncated",), truncated)]
    ids = [(("step",), step_id), (("episode_id",), episode_id)]
    keys, values = zip(*now, *acted, *after, *ends, *ids, *extras, (("mask",), mask), strict=True)
    return list(keys), list(values)


def _padded(mask: torch.Tensor) -> bool:
    """Whether a walk's ``mask`` has a position past an episode's end: read on the host for
    CPU tensors; assumed (no device synchronisation) elsewhere."""
    return not mask.is_cpu or not mask.numpy().all()


def _walk(core: EpisodeCore, start: torch.Tensor, length: int, full: bool) -> Walk:
    """The :class:`~replaybuf.accel.fused.Walk` of anchors ``start``: in the fused kernel where it
    runs; else in numpy for CPU storage, or in torch with jump tables (a walk of L links in
    ~log2(L) gathers: on CUDA kernel launches, not bytes, are what a walk costs)."""
    links, host = core.links, core.links.host
    if host is None:
        walk = fused_sequences(start.unsqueeze(1), None, length, links, strict=False)
        if walk is not None:
            return walk
        jumps = links.jumps(jump_levels(length))
        obs_rows, mask = sequence_rows_by_jumps(start, length, jumps)  # [B, L + 1], [B, L]
        step_rows = obs_rows[:, :length].contiguous()
        next_rows = obs_rows[:, 1:].contiguous()
        next_kind = links.end_kind.index_select(0, next_rows.reshape(-1)).view(mask.shape)
        step = links.step.index_select(0, step_rows.reshape(-1)).view(mask.shape)
        episode = links.episode.index_select(0, start).unsqueeze(1).expand(-1, length)
        padded = not full  # unknown without a device synchronisation: filled as if
        pad = ~mask
    else:
        at = start.numpy()
        rows, real = sequence_rows(at, length, host.succ)
        step_rows, next_rows = (np.ascontiguousarray(r) for r in (rows[:, :length], rows[:, 1:]))
        next_kind, step = host.end_kind[next_rows], host.step[step_rows]
        episode = np.broadcast_to(host.episode[at][:, None], real.shape)
        padded = not full and not real.all()
        pad = ~real
        obs_rows, mask = torch.from_numpy(rows), torch.from_numpy(real)
    terminal, truncated = next_kind == END_TERMINATED, next_kind == END_TRUNCATED
    if padded:  # False and -1 past the end
        real = mask.numpy() if host is not None else mask
        terminal, truncated = terminal & real, truncated & real
        where = np.where if host is not None else torch.where
        step, episode = where(real, step, -1), where(real, episode, -1)
    else:  # its own array (a caller may write into a batch)
        episode = episode.copy() if host is not None else episode.clone()
    values = (step_rows, next_rows, pad, terminal, truncated, step, episode)
    step_rows, next_rows, pad, terminal, truncated, step, episode = (_tensor(v) for v in values)
    return Walk(
        start, obs_rows, step_rows, next_rows, mask, pad, terminal, truncated, step, episode, None
    )


def episode_record(core: EpisodeCore, episode: Episode, device: torch.device) -> TensorDict:
    """A whole stored episode, time-major, in a TensorDict with empty batch size.

    ``observation`` holds obs_0 .. obs_T (T+1 rows, the final observation last) for an ended
    episode and obs_0 .. obs_{T-1} for one in progress (each a ``[k, ...]`` stack with frame
    stacking); ``action``, ``reward`` and extras hold T rows.
    """
    steps = episode.rows
    obs_rows = [*steps, *([episode.final_row] if episode.final_row is not None else [])]
    spec = core.slots.spec
    out = TensorDict({}, batch_size=[], device=device)
    if spec is not None and obs_rows:
        rows = torch.tensor(obs_rows, dtype=torch.long, device=core.slots.storing_device)
        stacked = _stacked_observations(core, rows[:1], rows.unsqueeze(0), device)  # [1, T + 1]
        out.set("observation", stacked.get("observation")[0])
        step_td = core.slots.gather(
            rows[: len(steps)], device, _keys(core, "action", "reward", "extras")
        )
    elif spec is not None:  # no step yet: empty fields of the stored shapes
        empty = spec.zeros(0, device)
        observation = empty.get("observation")
        if core.frame_stack is not None:  # [0, *field] -> [0, k, *field]
            k = core.frame_stack
            observation = _apply(observation, lambda v: v.new_zeros((0, k, *v.shape[1:])), 0)
        out.set("observation", observation)
        step_td = empty.exclude("observation")
    else:
        step_td = TensorDict({}, batch_size=[0], device=device)
    if episode.final_observation is not None:  # a zero-step episode's only observation
        final = episode.final_observation.get("observation").to(device)
        out.set("observation", _apply(final, lambda v: _lone_stack(core, v).unsqueeze(0), 1))
    for name in ("action", "reward"):
        if name in step_td:
            out.set(name, step_td.get(name))
    _put_extras(out, step_td)
    out.set("episode_id", torch.tensor(episode.episode_id, device=device))
    out.set("terminated", torch.tensor(episode.end_kind == END_TERMINATED, device=device))
    out.set("truncated", torch.tensor(episode.end_kind == END_TRUNCATED, device=device))
    out.set("length", torch.tensor(episode.steps, device=device))
    return out


def _apply(
    value: torch.Tensor | TensorDictBase,
    fn: Callable[[torch.Tensor], torch.Tensor],
    rows: int,
) -> torch.Tensor | TensorDictBase:
    """``fn`` on a tensor, or on each leaf of a (nested) observation TensorDict, giving ``rows``
    time steps."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value.apply(fn, batch_size=[rows])


def _lone_stack(core: EpisodeCore, frame: torch.Tensor) -> torch.Tensor:
    """The stack of an episode's first frame (``[k, *frame]``), or the frame without stacking."""
    k = core.frame_stack
    if k is None:
        return frame
    if core.frame_padding == "zero":
        return torch.cat([frame.new_zeros((k - 1, *frame.shape)), frame.unsqueeze(0)])
    return frame.unsqueeze(0).expand(k, *frame.shape).clone()  # [k, *frame]


def draw_anchors(
    core: EpisodeCore, batch_size: int, replace: bool, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Start rows for a batch, uniform over valid steps or ∝ priority; and importance weights.

    Without replacement a prioritized draw uses ``torch.multinomial`` over every row's weight
    (O(rows)); with replacement it descends the priority tree (O(B log rows)).
    """
    priorities = core.priorities
    if priorities is None:
        if replace:
            return core.anchors.sample(batch_size, generator), None
        return core.anchors.sample_distinct(batch_size, generator), None
    if replace:
        return priorities.draw(batch_size, generator)
    weights = priorities.tree.weights().to(device=generator.device, dtype=torch.float64)
    count = min(batch_size, int((weights > 0).sum()))
    start = torch.multinomial(weights, count, replacement=False, generator=generator)
    return start.to(core.slots.storing_device), priorities.importance(start)


def with_priority_keys(
    core: EpisodeCore, batch: TensorDict, start: torch.Tensor, weight: torch.Tensor | None
) -> TensorDict:
    """Add ``index`` (ids for ``update_priorities``) and ``weight`` to a prioritized batch."""
    if core.priorities is None:
        return batch
    if weight is None:  # an exhaustive epoch is not importance-sampled
        weight = torch.ones(start.shape, dtype=torch.float32, device=start.device)
    device = batch.device
    ids = core.row_ids(start)
    if batch.batch_dims == 2:  # sequences: the priority belongs to the start step
        length = batch.batch_size[1]
        ids = ids.unsqueeze(1).expand(-1, length)
        weight = weight.unsqueeze(1).expand(-1, length)
    batch.set("index", ids.to(device))
    batch.set("weight", weight.to(device))
    return batch


def _full_starts(core: EpisodeCore, anchors: torch.Tensor, length: int) -> torch.Tensor:
    """:func:`replaybuf.core.index.full_sequence_starts` of ``anchors``, in numpy for CPU
    storage."""
    host = core.links.host
    if host is None:
        return full_sequence_starts_by_jumps(anchors, length, core.links.jumps(jump_levels(length)))
    return torch.from_numpy(qualifies(anchors.numpy(), length, host.succ))


def draw_sequences(
    core: EpisodeCore,
    batch_size: int,
    length: int,
    strict: bool,
    generator: torch.Generator,
    draw: Draw | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Walk | None]:
    """Anchors for a sequence batch, their importance weights (prioritized buffers), and the
    fused kernel's walk of them where it drew them (CUDA storage, uniform draws; ``draw``
    gives its places, else :meth:`AnchorSet.draw_places` with ``generator``).

    ``strict`` draws only anchors with ``length`` steps ahead (:func:`sample_sequence_starts`),
    else any valid step (the batch is padded).
    """
    if strict:
        require_full_sequences(core, length)
    walk = _fused_draw(core, batch_size, length, strict, generator, draw)
    if walk is not None:
        return walk.start, None, walk
    if not strict:
        start, weight = draw_anchors(core, batch_size, True, generator)
        return start, weight, None
    start = sample_sequence_starts(core, batch_size, length, generator)
    priorities = core.priorities
    return start, None if priorities is None else priorities.importance(start), None


STRICT_TRIES = 8  # a strict draw's candidates per slot in the fused kernel


def _fused_draw(
    core: EpisodeCore,
    batch_size: int,
    length: int,
    strict: bool,
    generator: torch.Generator,
    draw: Draw | None = None,
) -> Walk | None:
    """A uniform draw and its walk in one kernel launch, or None where the kernel does not
    apply (CPU storage, priorities, no Triton).

    Not strict, each slot draws one place in the packed anchor rows (``draw``'s, else the
    same draws as :meth:`AnchorSet.sample`). Strict, each slot takes the first of
    ``STRICT_TRIES`` draws with ``length`` steps ahead: rejection sampling, exact. The few
    slots that find none (each with probability (1 - p)^8 where p is the share of anchors that
    qualify) are drawn again: on the device by the kernel's redraw where the places are device
    draws (no host synchronisation), else after one synchronisation that reads which they are,
    by :func:`sample_sequence_starts`, which continues the same rejection.
    """
    anchors = core.anchors
    if core.priorities is not None or core.links.host is not None or anchors.count == 0:
        return None
    if not fused_walks(core.links, anchors.rows, length):
        return None
    tries = STRICT_TRIES if strict else 1
    redraw = None
    if draw is None:
        places, table = anchors.draw_places((batch_size, tries), generator)
    else:
        places, table, redraw = draw((batch_size, tries))
    walk = fused_sequences(places, table, length, core.links, strict, redraw)
    if walk is None or not strict or redraw is not None:
        return walk
    assert walk.found is not None, "the kernel's walks say which slots found a start"
    if walk.found.cpu().numpy().all():  # the one host synchronisation of a strict draw
        return walk
    return redraw_missing(core, walk.start, walk.found, length, generator)


def redraw_missing(
    core: EpisodeCore,
    start: torch.Tensor,
    found: torch.Tensor,
    length: int,
    generator: torch.Generator,
) -> Walk:
    """The fused kernel's strict walk completed: the slots whose tries all fell short
    (``found`` False) drawn again by :func:`sample_sequence_starts`, and every slot walked."""
    missing = ~found
    start = start.clone()
    start[missing] = sample_sequence_starts(core, int(missing.sum()), length, generator)
    walk = fused_sequences(start.unsqueeze(1), None, length, core.links, strict=False)
    assert walk is not None, "the kernel that drew these starts walks them"
    return walk


def require_full_sequences(core: EpisodeCore, length: int) -> None:
    """Raise :class:`EmptyBufferError` unless some anchor has ``length`` steps ahead in its
    episode (before a strict draw: a redraw on the device relies on one existing)."""
    if not core.holds_steps(length):
        raise _no_full_sequences(length)


def _no_full_sequences(length: int) -> EmptyBufferError:
    return EmptyBufferError(
        f"cannot sample sequences: no stored episode has {length} consecutive steps "
        "(use strict=False to pad shorter ones)"
    )


def sample_sequence_starts(
    core: EpisodeCore, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` anchors with ``length`` steps ahead in their episode, drawn uniformly (or
    ∝ priority) among those.

    Rejection from the unrestricted draw is exact and O(B · length) when most anchors qualify;
    when few do, an exact scan over all anchors takes over.
    """
    anchors, priorities = core.anchors, core.priorities
    found: list[torch.Tensor] = []
    need = batch_size
    for _ in range(4):
        draws = max(2 * need, 64)
        if priorities is None:
            candidates = anchors.sample(draws, generator)
        else:
            candidates = priorities.tree.sample(draws, generator)
        ok = candidates[_full_starts(core, candidates, length)]
        found.append(ok[:need])
        need -= int(found[-1].shape[0])
        if need <= 0:
            return torch.cat(found)
    every = anchors.snapshot()
    eligible = every[_full_starts(core, every, length)]
    if eligible.shape[0] == 0:
        raise _no_full_sequences(length)
    if priorities is None:
        picks = torch.randint(
            0, eligible.shape[0], (need,), generator=generator, device=eligible.device
        )
    else:
        weights = priorities.tree.get(eligible).to(torch.float64)
        picks = torch.multinomial(weights, need, replacement=True, generator=generator)
    found.append(eligible[picks])
    return torch.cat(found)
