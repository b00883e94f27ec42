"""The adapter refuses pickling without leaving SB3's half-made file behind.

``model.save_replay_buffer(path)`` is SB3's ``save_to_pkl(path, buffer)``: it creates (or
truncates) the ``.pkl`` file, then pickles into it, and it does not remove the file when
pickling raises. The adapter cannot be pickled (its rows live in replaybuf storage), so the
refusal would leave a 0-byte ``.pkl`` that ``load_replay_buffer`` later fails on with an
unrelated error. :func:`discard_partial_pickle` finds the file SB3 opened for this pickle and
removes it before the refusal propagates.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from types import FrameType

# The SB3 function that opens the file from a path, then pickles into it.
_SAVE_TO_PKL = ("stable_baselines3.common.save_util", "save_to_pkl")


def discard_partial_pickle(max_depth: int = 8) -> Path | None:
    """Remove the file SB3's ``save_to_pkl`` opened for the pickle under way, if it did.

    Only a file SB3 opened itself from a ``str`` or ``Path`` (a stream the caller passed is
    theirs, left alone) and into which nothing was written yet. Returns the removed path.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        code = frame.f_code
        if (frame.f_globals.get("__name__"), code.co_name) == _SAVE_TO_PKL:
            break
        frame = frame.f_back
    else:
        return None
    if frame is None:
        return None
    path, file = frame.f_locals.get("path"), frame.f_locals.get("file")
    if not isinstance(path, (str, os.PathLike)) or not isinstance(file, io.BufferedWriter):
        return None
    name = file.name
    if not isinstance(name, (str, os.PathLike)) or file.closed or file.tell() != 0:
        return None
    file.close()
    target = Path(os.fsdecode(name))
    target.unlink(missing_ok=True)
    return target
