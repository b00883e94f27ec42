"""Prioritized replay: priority structures (backends) and the alpha/beta/eps policy."""

from replaybuf.priority.policy import (
    Prioritizer,
    check_beta,
    check_priorities,
    host_update_inputs,
    parse_ids,
    priority_stats,
    ring_ids,
)
from replaybuf.priority.ring import ring_keys, update_ring
from replaybuf.priority.segment_tree import segment_tree_unavailable_reason

__all__ = [
    "Prioritizer",
    "check_beta",
    "check_priorities",
    "host_update_inputs",
    "parse_ids",
    "priority_stats",
    "ring_ids",
    "ring_keys",
    "segment_tree_unavailable_reason",
    "update_ring",
]
