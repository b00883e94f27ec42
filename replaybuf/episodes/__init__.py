"""The sync episode core: lifecycle, row links, anchors, eviction, staging."""

from replaybuf.episodes.anchors import AnchorSet
from replaybuf.episodes.checks import RETURNED_KEYS
from replaybuf.episodes.config import check_frame_stack, check_stackable, final_rows_for
from replaybuf.episodes.core import EpisodeCore
from replaybuf.episodes.episode import FRAME_PADDINGS, STATUSES, Episode, RowsPinned
from replaybuf.episodes.links import SAVED, HostLinks, RowLinks
from replaybuf.episodes.priorities import update_priorities
from replaybuf.episodes.state import COUNTERS, core_state, core_stats, restore_core

__all__ = [
    "COUNTERS",
    "FRAME_PADDINGS",
    "RETURNED_KEYS",
    "SAVED",
    "STATUSES",
    "AnchorSet",
    "Episode",
    "EpisodeCore",
    "HostLinks",
    "RowLinks",
    "RowsPinned",
    "check_frame_stack",
    "check_stackable",
    "core_state",
    "core_stats",
    "final_rows_for",
    "restore_core",
    "update_priorities",
]
