"""Which anchors a batch starts from: uniform or prioritized, n-step or sequence draws."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from replaybuf.accel.fused import Walk
from replaybuf.accel.fused import sequences as fused_sequences
from replaybuf.accel.fused import walks as fused_walks
from replaybuf.core import full_sequence_starts as qualifies
from replaybuf.core import (
    full_sequence_starts_by_jumps,
    jump_levels,
)
from replaybuf.errors import EmptyBufferError
from replaybuf.sampling.common import Draw
from replaybuf.sampling.view import EpisodeView


def draw_anchors(
    core: EpisodeView, batch_size: int, replace: bool, generator: torch.Generator
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
    core: EpisodeView, batch: TensorDict, start: torch.Tensor, weight: torch.Tensor | None
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


def _full_starts(core: EpisodeView, anchors: torch.Tensor, length: int) -> torch.Tensor:
    """:func:`replaybuf.core.index.full_sequence_starts` of ``anchors``, in numpy for CPU
    storage."""
    host = core.links.host
    if host is None:
        return full_sequence_starts_by_jumps(anchors, length, core.links.jumps(jump_levels(length)))
    return torch.from_numpy(qualifies(anchors.numpy(), length, host.succ))


def draw_sequences(
    core: EpisodeView,
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
    core: EpisodeView,
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
    core: EpisodeView,
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


def require_full_sequences(core: EpisodeView, length: int) -> None:
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
    core: EpisodeView, batch_size: int, length: int, generator: torch.Generator
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
