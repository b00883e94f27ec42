"""The finished episodes' eviction order: ``(seq, episode_id)`` entries, smallest first.

Episodes mostly finish in start order (a vector env ends its oldest first, in bulk), so
entries pushed in increasing order go to a FIFO, which pops in O(1), and only the others to a
heap; a pop takes the smaller of the two heads. Pops come out exactly as from one heap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain

Entry = tuple[int, int]  # (seq, episode_id)


class FinishedOrder:
    """A min-queue of ``(seq, episode_id)`` entries (a heap's pops, cheaper in order)."""

    def __init__(self) -> None:
        self._fifo: deque[Entry] = deque()  # increasing
        self._heap: list[Entry] = []

    def push(self, entry: Entry) -> None:
        fifo = self._fifo
        if not fifo or entry > fifo[-1]:
            fifo.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def extend(self, entries: Iterable[Entry]) -> None:
        """:meth:`push` of each entry, in order."""
        push = self.push
        for entry in entries:
            push(entry)

    def pop(self) -> Entry:
        """The smallest entry, removed (``IndexError`` when empty)."""
        fifo, heap = self._fifo, self._heap
        if heap and (not fifo or heap[0] < fifo[0]):
            return heapq.heappop(heap)
        return fifo.popleft()

    def __bool__(self) -> bool:
        return bool(self._fifo) or bool(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self) -> Iterator[Entry]:
        """Every entry, in no particular order."""
        return chain(self._fifo, self._heap)
