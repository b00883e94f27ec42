"""The sync episode core: lifecycle, row links, anchors, eviction, staging."""

from replaybuf.episodes.checks import RETURNED_KEYS
from replaybuf.episodes.core import EpisodeCore
from replaybuf.episodes.episode import FRAME_PADDINGS, STATUSES, Episode, RowsPinned
from replaybuf.episodes.links import SAVED, HostLinks
from replaybuf.episodes.state import COUNTERS, core_state, restore_core

__all__ = [
    "COUNTERS",
    "FRAME_PADDINGS",
    "RETURNED_KEYS",
    "SAVED",
    "STATUSES",
    "Episode",
    "EpisodeCore",
    "HostLinks",
    "RowsPinned",
    "core_state",
    "restore_core",
]
