"""The sync episode core: lifecycle, row links, anchors, eviction, staging."""

from replaybuf.episodes.core import (
    FRAME_PADDINGS,
    RETURNED_KEYS,
    STATUSES,
    Episode,
    EpisodeCore,
    HostLinks,
    RowsPinned,
)

__all__ = [
    "FRAME_PADDINGS",
    "RETURNED_KEYS",
    "STATUSES",
    "Episode",
    "EpisodeCore",
    "HostLinks",
    "RowsPinned",
]
