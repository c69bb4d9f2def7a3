"""The priority ready-queue: smallest priority number first, FIFO within a priority.

A bucket queue: per kind, one FIFO deque per priority and a heap of the priorities present. Pushing
is a deque append (no tuple per entry, no comparisons); the dispatcher reads each kind's head and
picks the best (priority, then ready order) among the kinds whose agents have room, so one busy
agent never blocks the others. Priorities are few in practice (a handful of levels), so the heap
of priorities stays tiny.

A node that leaves the queue without being taken (it was cancelled or timed out) stays in its deque
and is dropped when it reaches the front (its state is no longer ready); a reprioritized node is
moved at once (rare, O(bucket)).
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from typing import TYPE_CHECKING

from ._task import READY

if TYPE_CHECKING:
    from ._graph import Node

__all__ = ("KindQueue", "ReadyQueue")


class KindQueue:
    """The ready nodes of one kind."""

    __slots__ = ("buckets", "prios")

    def __init__(self) -> None:
        self.buckets: dict[int, deque[Node]] = {}
        self.prios: list[int] = []  # heap of the priorities that have a bucket

    def head(self) -> Node | None:
        """The best ready node of this kind (left in place), dropping stale entries."""
        prios = self.prios
        buckets = self.buckets
        while prios:
            bucket = buckets[prios[0]]
            while bucket:
                node = bucket[0]
                if node.state is READY:
                    return node
                bucket.popleft()
            del buckets[heappop(prios)]
        return None


class ReadyQueue:
    """Ready nodes by kind; `size` counts the live ones."""

    __slots__ = ("_seq", "kinds", "size")

    def __init__(self) -> None:
        self.kinds: dict[str, KindQueue] = {}
        self._seq = 0
        self.size = 0

    def push(self, node: Node) -> None:
        queue = self.kinds.get(node.kind)
        if queue is None:
            queue = self.kinds[node.kind] = KindQueue()
        bucket = queue.buckets.get(node.priority)
        if bucket is None:
            bucket = queue.buckets[node.priority] = deque()
            heappush(queue.prios, node.priority)
        bucket.append(node)
        self._seq += 1
        node.qseq = self._seq  # ready order, to compare heads of different kinds
        self.size += 1

    def take(self, queue: KindQueue) -> Node:
        """Remove the head of `queue` (the node `queue.head()` returned)."""
        node = queue.buckets[queue.prios[0]].popleft()
        node.qseq = -1
        self.size -= 1
        return node

    def discard(self, node: Node) -> None:
        """A ready node leaves without being taken; its entry is dropped when it reaches the front."""
        if node.qseq >= 0:
            node.qseq = -1
            self.size -= 1

    def move(self, node: Node, priority: int) -> None:
        """Change the priority of a ready node (it goes to the back of its new priority)."""
        queue = self.kinds[node.kind]
        bucket = queue.buckets.get(node.priority)
        if bucket is not None and node in bucket:
            bucket.remove(node)
        self.size -= 1
        node.priority = priority
        self.push(node)

    def __len__(self) -> int:
        return self.size
