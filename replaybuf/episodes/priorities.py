"""The learner's priority update of an episode buffer: sampled ids back to rows, then weights.

A batch's ``index`` holds row ids (``allocation * rows + row``, unique for the buffer's life,
see :meth:`RowLinks.ids`), so an update of a step evicted since it was sampled, or whose row
now holds another step, is skipped.
"""

from __future__ import annotations

from typing import Any

from replaybuf.episodes.core import EpisodeCore
from replaybuf.priority import check_priorities, host_update_inputs, parse_ids


def update_priorities(core: EpisodeCore, index: Any, priority: Any) -> int:
    """Set the priorities of the steps ``index`` names; returns how many were stored still.

    Well-formed numpy or CPU input is checked and written in numpy on the host columns where
    the tree writes on the host (CPU storage, numba) and every id was a row's; anything else
    takes the checked torch path, the reference, which raises ``IndexError`` for an id no
    step ever had and ``ValueError`` for a bad priority, applying nothing then.
    """
    priorities = core.priorities
    assert priorities is not None, "the caller checks that the buffer is prioritized"
    fast = priorities.tree.host_writes and core.links.host is not None
    host = host_update_inputs(index, priority) if fast else None
    if host is not None:
        core.flush()
        found = core.live_rows_host(host[0])
        if found is not None and priorities.update_host(found[0], host[1][found[1]]):
            return int(found[1].sum())
    device = core.slots.storing_device
    ids = parse_ids(index, device)
    values = check_priorities(priority, ids.numel(), device)
    core.flush()
    rows, live = core.live_rows(ids)
    priorities.update(rows[live], values[live])
    return int(live.sum())
