"""Running a writer's buffer calls: the writer yields each call as ``(method, args)`` and gets
its result (or its error) back, so one generator serves a sync buffer and an asyncio one."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

# One buffer call: (method name, positional arguments); its result is sent back.
Call = tuple[str, tuple[Any, ...]]


def drive(buffer: Any, calls: Generator[Call, Any, int]) -> int:
    """Make the buffer calls ``calls`` yields, sending back results and throwing back errors."""
    try:
        call = next(calls)
        while True:
            try:
                result = getattr(buffer, call[0])(*call[1])
            except Exception as exc:
                call = calls.throw(exc)
            else:
                call = calls.send(result)
    except StopIteration as stop:
        return stop.value


async def adrive(buffer: Any, calls: Generator[Call, Any, int]) -> int:
    """:func:`drive` for an :class:`~replaybuf.EpisodeReplayBuffer`: each call is awaited."""
    try:
        call = next(calls)
        while True:
            try:
                result = await getattr(buffer, call[0])(*call[1])
            except Exception as exc:
                call = calls.throw(exc)
            else:
                call = calls.send(result)
    except StopIteration as stop:
        return stop.value
