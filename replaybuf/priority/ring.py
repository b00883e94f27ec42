"""Priorities of a ring of transitions: the ids batches carry, and the learner's update.

Row k ever written has id k and lives in slot ``k % capacity``; the ids in ``[writes - size,
writes)`` are stored now. An id handed out with a batch therefore names its transition for
good: once overwritten, an update of it is skipped rather than applied to the new occupant.
"""

from __future__ import annotations

from typing import Any

import torch

from replaybuf.errors import IndexOutOfRangeError
from replaybuf.priority.policy import (
    Prioritizer,
    check_priorities,
    host_update_inputs,
    parse_ids,
    ring_ids,
)
from replaybuf.storage import Key


def ring_keys(
    slots: torch.Tensor,
    weight: torch.Tensor | None,
    writes: int,
    capacity: int,
    device: torch.device,
) -> dict[Key, torch.Tensor]:
    """``index`` (ids for :func:`update_ring`) and ``weight`` of a batch's ``slots`` (an
    exhaustive epoch, ``weight`` None, is not importance-sampled: weights 1)."""
    if weight is None:
        weight = torch.ones(slots.shape, dtype=torch.float32, device=slots.device)
    return {
        ("index",): ring_ids(slots, writes, capacity).to(device),
        ("weight",): weight.to(device),
    }


def update_ring(
    priorities: Prioritizer,
    index: Any,
    priority: Any,
    writes: int,
    size: int,
    capacity: int,
    device: torch.device,
) -> int:
    """Set the priorities of the items ``index`` names; returns how many were stored still.

    Well-formed numpy or CPU input whose ids are all live is checked and written in numpy
    where the tree writes on the host (CPU storage, numba); anything else takes the checked
    torch path, the reference, which raises ``IndexError`` for an id never written and
    ``ValueError`` for a bad priority, applying nothing then.
    """
    if priorities.tree.host_writes:
        host = host_update_inputs(index, priority)
        if host is not None:
            host_ids, host_values = host
            live = host_ids.min() >= writes - size and host_ids.max() < writes
            if live and priorities.update_host(host_ids % capacity, host_values):
                return host_ids.shape[0]
    ids = parse_ids(index, device)
    values = check_priorities(priority, ids.numel(), device)
    if ids.numel() == 0:
        return 0
    lowest, highest = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
    if lowest >= writes - size and highest < writes:  # all live
        priorities.update(ids % capacity, values)
        return ids.numel()
    never = (ids < 0) | (ids >= writes)
    if bool(never.any()):
        raise IndexOutOfRangeError(
            f"index must hold ids of written items (in [0, {writes})), got {int(ids[never][0])}"
        )
    live_ids = ids >= writes - size
    priorities.update(ids[live_ids] % capacity, values[live_ids])
    return int(live_ids.sum())
