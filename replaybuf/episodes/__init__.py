"""The sync episode core: lifecycle, row links, anchors, eviction, staging."""

from replaybuf.episodes.checks import RETURNED_KEYS
from replaybuf.episodes.core import EpisodeCore
from replaybuf.episodes.episode import FRAME_PADDINGS, STATUSES, Episode, RowsPinned
from replaybuf.episodes.links import HostLinks

__all__ = [
    "FRAME_PADDINGS",
    "RETURNED_KEYS",
    "STATUSES",
    "Episode",
    "EpisodeCore",
    "HostLinks",
    "RowsPinned",
]
