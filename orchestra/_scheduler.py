"""The priority ready-queue: smallest priority number first, FIFO within a priority.

One heap per kind, so the dispatcher can skip a kind whose agents are all busy and still take the
best task of another kind (one busy agent never blocks the rest). Entries are `(priority, seq, node)`;
`seq` is unique, so nodes are never compared, and the node remembers the `seq` of its one live entry:
a node that was reprioritized, cancelled or picked leaves its old entry behind, recognised as stale
when it reaches the top (lazy deletion, as the `heapq` documentation recommends).
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import count
from typing import TYPE_CHECKING, Protocol

from ._task import READY

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ("Queued", "ReadyQueue")


class Queued(Protocol):
    state: str
    priority: int
    kind: str
    qseq: int


Entry = tuple[int, int, Queued]


class ReadyQueue:
    """Ready nodes by kind. `heads()` gives each kind's best live entry, for the dispatcher to choose."""

    __slots__ = ("_heaps", "_seq", "size")

    def __init__(self) -> None:
        self._heaps: dict[str, list[Entry]] = {}
        self._seq = count()
        self.size = 0  # live entries (stale ones excluded)

    def push(self, node: Queued) -> None:
        heap = self._heaps.get(node.kind)
        if heap is None:
            heap = self._heaps[node.kind] = []
        seq = node.qseq = next(self._seq)
        heappush(heap, (node.priority, seq, node))
        self.size += 1

    def heads(self) -> Iterator[tuple[list[Entry], Entry]]:
        """Each non-empty kind's heap with its best live entry, dropping stale entries on the way."""
        for heap in self._heaps.values():
            while heap:
                entry = heap[0]
                node = entry[2]
                if entry[1] == node.qseq and node.state is READY:
                    yield heap, entry
                    break
                heappop(heap)

    def take(self, heap: list[Entry]) -> Queued:
        """Remove the head of `heap` (as returned by `heads`)."""
        self.size -= 1
        node = heappop(heap)[2]
        node.qseq = -1
        return node

    def discard(self, node: Queued) -> None:
        """A ready node leaves the queue without being taken (cancelled, reprioritized); its entry
        stays behind, stale."""
        if node.qseq >= 0:
            node.qseq = -1
            self.size -= 1

    def __len__(self) -> int:
        return self.size
