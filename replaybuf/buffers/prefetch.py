"""``prefetch=k``: draw the next ``k`` batches on a background thread while the learner trains.

:class:`Prefetcher` wraps an iterator of batches (an endless dataset's, an epoch iterator's)
and advances it on one daemon thread, at most ``k`` batches ahead of the consumer. The sync
buffers take their lock in every public call, so that thread samples the buffer as any other
thread may; torch releases the GIL inside its ops, so the draws overlap the learner's step.

What holds, and what cannot:

* **Same batches, same order.** The thread calls the wrapped iterator exactly as the consumer
  would, in order, so a seeded buffer yields the batches it yields without ``prefetch``, as long
  as nothing else draws from the buffer's generator while the prefetcher runs (a
  ``sample_batch`` of the learner's own would interleave with draws made ahead). An epoch
  iterator's first epoch is planned when the prefetcher starts, not at the first ``next()``.
* **Staleness, inherent.** Up to ``k`` batches are drawn before the learner sees them: writes
  and ``update_priorities`` made meanwhile reach only the batches drawn after them. A
  prioritized learner reads priorities up to ``k`` steps old (``k=1`` or ``2`` keeps that small).
* **Errors at their batch.** An exception raised by a draw is re-raised by the ``next()`` that
  would have returned that batch, after the batches drawn before it; the iterator then ends.
* **Closing.** ``close()`` (or leaving a ``with`` block, or dropping the last reference to the
  iterator) stops the thread; ``close()`` waits for it to finish its draw in flight. A closed
  buffer ends the iterator with ``BufferClosedError`` at the next ``next()``, batches already
  drawn included (they may view storage the close released).
* **Devices.** Batches come from the buffer's sampling calls, already on its ``device``
  (pinned, non-blocking copies for CUDA). The thread uses its current CUDA stream, the default
  stream, as the learner usually does, so copies are ordered with the buffer's writes and the
  learner's kernels as without prefetch; what overlaps is the host work (index draws, gathers,
  launching copies). A consumer on another stream waits for the batch's copies (an event) and
  the batch's memory is recorded on that stream.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from replaybuf.args import int_at_least

MAX_DEPTH = 1024  # batches held ahead; more is a runaway argument, not a pipeline
_END = object()  # the wrapped iterator is exhausted
# Bounds of a full producer's re-check for room (seconds; see _Channel).
POLL_SHORTEST, POLL_LONGEST = 50e-6, 2e-3


class _Failure:
    """An exception raised by a draw, delivered at that draw's place in the sequence."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Channel:
    """A bounded hand-over between the drawing thread and the consumer, which can be stopped.

    The producer reserves room *before* it draws, so at most ``depth`` batches are ever drawn
    and not yet taken (a ``queue.Queue`` would hold a ``depth + 1``-th while it waits to put).

    The consumer wakes a waiting producer only when it takes the last ready batch. Otherwise a
    full producer re-checks for room on its own, every ``poll`` seconds (a quarter of its last
    draw): waking a sleeping thread is a system call that can cost the consumer as much as a
    small draw, and the consumer is the learner, whose time the prefetcher exists to save.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.items: deque[Any] = deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.poll = POLL_LONGEST
        self._producer_waits = False

    def wait_for_room(self) -> bool:
        """Block until fewer than ``depth`` batches wait; False once stopped."""
        with self.cond:
            while len(self.items) >= self.depth and not self.stopped:
                self._producer_waits = True
                self.cond.wait(self.poll)
                self._producer_waits = False
            return not self.stopped

    def put(self, item: Any) -> None:
        with self.cond:
            if not self.stopped:
                self.items.append(item)
                self.cond.notify_all()

    def get(self) -> Any:
        """The next item; ``_END`` once stopped (a ``next()`` racing ``close()`` returns)."""
        with self.cond:
            while not self.items and not self.stopped:
                self.cond.wait()
            if not self.items:
                return _END
            item = self.items.popleft()
            if not self.items and self._producer_waits:
                self.cond.notify_all()  # none ready now: the producer must not wait a poll
            return item

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.items.clear()
            self.cond.notify_all()


def _draw_ahead(source: Iterator[TensorDict], channel: _Channel, cuda: bool) -> None:
    """The background thread: advance ``source`` while there is room, until it ends or fails.

    It holds no reference to the :class:`Prefetcher`, so dropping the prefetcher stops it.
    """
    try:
        while channel.wait_for_room():
            started = time.perf_counter()
            try:
                batch = next(source)
            except StopIteration:
                channel.put(_END)
                return
            except BaseException as error:  # delivered to the consumer, at this batch
                channel.put(_Failure(error))
                return
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()  # on this thread's current stream, after the batch's copies
            took = time.perf_counter() - started
            channel.poll = min(max(took / 4, POLL_SHORTEST), POLL_LONGEST)
            channel.put((batch, event))
    finally:
        close = getattr(source, "close", None)
        if close is not None:  # a generator: run its cleanup on the thread that ran it
            close()


class Prefetcher(Iterator[TensorDict]):
    """An iterator of the batches ``source`` yields, drawn up to ``depth`` ahead on a thread.

    ``check`` (the buffer's open check) runs at every ``next()``, so a closed buffer ends the
    iteration with its error even while drawn batches wait. ``device`` is where the batches
    are delivered (CUDA: the consumer's stream waits for their copies). A context manager;
    see the module docstring for the guarantees.
    """

    def __init__(
        self,
        source: Iterator[TensorDict],
        depth: int,
        *,
        check: Callable[[], None] | None = None,
        device: torch.device | str | None = None,
        name: str = "replaybuf-prefetch",
    ) -> None:
        self.depth = int_at_least(depth, "prefetch", 1, MAX_DEPTH)
        self._check = check
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._channel = _Channel(self.depth)
        self._done = False
        self._thread = threading.Thread(
            target=_draw_ahead, args=(source, self._channel, self._cuda), name=name, daemon=True
        )
        self._thread.start()
        # Dropped without close() (an abandoned DataLoader iterator): stop the thread anyway.
        self._finalizer = weakref.finalize(self, self._channel.stop)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> TensorDict:
        if self._done:
            raise StopIteration
        if self._check is not None:
            try:
                self._check()
            except BaseException:
                self.close()
                raise
        item = self._channel.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        batch, event = item
        if event is not None:
            _hand_over(batch, event)
        return batch

    def close(self) -> None:
        """Stop drawing, drop the batches drawn ahead and wait for the thread to end."""
        self._done = True
        self._channel.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the drawing thread still runs."""
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._done else "running"
        return f"Prefetcher(depth={self.depth}, {state})"


def _hand_over(batch: TensorDict, event: torch.cuda.Event) -> None:
    """Make the consumer's CUDA stream wait for the batch's copies; when that stream is not
    the one the batch was made on, tell the allocator the batch's memory is used there."""
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():
        return  # the copies were queued on this very stream: already ordered
    stream.wait_event(event)
    for value in batch.values(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor) or not value.is_cuda:
            continue  # non-tensor data (text, JSON) lives in host memory
        parts = (value.values(), value.offsets()) if value.is_nested else (value,)  # type: ignore[attr-defined]
        for part in parts:
            part.record_stream(stream)


def check_depth(depth: Any) -> int:
    """``prefetch`` as an int in ``[0, MAX_DEPTH]``."""
    return int_at_least(depth, "prefetch", 0, MAX_DEPTH)


def prefetching(
    source: Iterator[TensorDict],
    depth: Any,
    check: Callable[[], None],
    device: torch.device,
) -> Iterator[TensorDict]:
    """``source`` itself for ``depth`` 0, else a :class:`Prefetcher` over it (``depth`` is
    checked: an int >= 0, ``prefetch``)."""
    depth = check_depth(depth)
    if depth == 0:
        return source
    return Prefetcher(source, depth, check=check, device=device)
