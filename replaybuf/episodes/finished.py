"""The finished episodes' eviction order: ``(seq, episode_id)`` entries, smallest first.

Episodes mostly finish in start order (a vector env ends its oldest first, in bulk), so
entries pushed in increasing order go to a FIFO, which pops in O(1), and only the others to a
heap; a pop takes the smaller of the two heads. Pops come out exactly as from one heap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from itertools import chain
from operator import lt

Entry = tuple[int, int]  # (seq, episode_id)


class FinishedOrder:
    """A min-queue of ``(seq, episode_id)`` entries (a heap's pops, cheaper in order)."""

    def __init__(self) -> None:
        self.fifo: deque[Entry] = deque()  # increasing
        self.heap: list[Entry] = []

    def push(self, entry: Entry) -> None:
        fifo = self.fifo
        if not fifo or entry > fifo[-1]:
            fifo.append(entry)
        else:
            heapq.heappush(self.heap, entry)

    def extend(self, entries: list[Entry]) -> None:
        """:meth:`push` of each entry, in order (increasing ones after the FIFO's last: all
        appended at once)."""
        fifo = self.fifo
        if entries and (not fifo or entries[0] > fifo[-1]) and all(map(lt, entries, entries[1:])):
            fifo.extend(entries)
            return
        push = self.push
        for entry in entries:
            push(entry)

    def pop(self) -> Entry:
        """The smallest entry, removed (``IndexError`` when empty)."""
        fifo, heap = self.fifo, self.heap
        if heap and (not fifo or heap[0] < fifo[0]):
            return heapq.heappop(heap)
        return fifo.popleft()

    def __bool__(self) -> bool:
        return bool(self.fifo) or bool(self.heap)

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def __iter__(self) -> Iterator[Entry]:
        """Every entry, in no particular order."""
        return chain(self.fifo, self.heap)
