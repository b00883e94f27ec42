"""An episode buffer's configuration: the rows it reserves and its frame stacking."""

from __future__ import annotations

import math
from typing import Any

from replaybuf.args import positive_int
from replaybuf.episodes.episode import FRAME_PADDINGS
from replaybuf.errors import ArgumentError, SchemaError
from replaybuf.storage import FieldSpec


def final_rows_for(max_steps: int, max_episodes: int | None) -> int:
    """Rows reserved for final observations beside the ``max_steps`` step rows.

    One per stored episode that has steps, so never more than ``max_steps`` (a huge
    ``max_episodes`` must not allocate rows that can never be used); without ``max_episodes`` we
    reserve max_steps/16 (at least 16), so episodes shorter than 16 steps on average can be
    evicted before ``max_steps`` is reached.
    """
    if max_episodes is not None:
        return min(max_episodes, max_steps)
    return min(max(16, math.ceil(max_steps / 16)), max_steps)


def check_frame_stack(frame_stack: Any, padding: Any) -> tuple[int | None, str]:
    """``frame_stack`` (None or an int >= 1) and its padding (``"reset"`` or ``"zero"``)."""
    if padding not in FRAME_PADDINGS:
        raise ArgumentError(f"frame_stack_padding must be one of {FRAME_PADDINGS}, got {padding!r}")
    if frame_stack is None:
        if padding != "reset":
            raise ArgumentError(
                f"frame_stack_padding={padding!r} needs frame_stack (an int >= 1), got None"
            )
        return None, padding
    return positive_int(frame_stack, "frame_stack"), padding


def check_stackable(spec: FieldSpec) -> None:
    """Frame stacks need one fixed shape per frame: a declared spec whose observation is
    ragged (token ids, text, JSON) is refused at construction, naming the field."""
    for key in spec.ragged_keys:
        if key[0] == "observation":
            raise SchemaError(
                f"spec[{'.'.join(key)!r}] must be a fixed-shape field with frame_stack, "
                f"got {spec[key].describe()} (stack fixed-shape frames; keep ragged data in "
                "extras)"
            )
