"""The priority ready-queue of a run: smallest priority number first, FIFO within a priority.

One bucket queue for the whole run: a FIFO deque per priority and a heap of the priorities present.
Pushing is a deque append (no tuple per entry, no comparison); popping is a deque popleft. Priorities
are few in practice (a handful of levels), so the heap of priorities stays tiny, and the cost of a
push or a pop does not depend on the number of kinds or agents.

An entry that leaves the queue for good without being popped (cancelled, timed out) is not searched
for: `discard` marks it stale (`qseq` = -1) and it is dropped when it reaches the front. Nor is a
reprioritized one (`move`): it joins its new bucket, and its old slot, a *ghost* counted by entry
and priority, is dropped when it reaches the front (searching its bucket made k moves among n
ready tasks O(k * n)). While a ghost is queued, `front` is None: takers go through `pop`, which
knows a ghost from a live slot (an entry's slots in one bucket are in push order: its ghosts
there come first).

Dead slots (stale and ghost) that never reach the front would stay forever: a durable store's
coordinator keeps a mirror of its run whose ready tasks are claimed through the database, each
taken out with `discard`, and its queue is never popped; a million-task run kept a million records
that way. So once the slots that died since the last look are as many as the live entries (and at
least `SWEEP`), the queue counts its slots (O(priority levels)), and when at least half of that
many are dead, rebuilds its buckets without them: O(slots), paid for by as many discards, so O(1)
amortized, and the dead slots stay about as few as the live ones (or `SWEEP`).
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from typing import Generic, Protocol, TypeVar

__all__ = ("Queued", "ReadyQueue")


class Queued(Protocol):
    """What the queue needs of an entry: its priority and a slot for its queue sequence number."""

    priority: int
    qseq: int


T = TypeVar("T", bound=Queued)


class ReadyQueue(Generic[T]):
    """Entries by priority, FIFO within one; `len()` counts the live ones."""

    __slots__ = ("_buckets", "_dead", "_ghosts", "_prios", "_seq", "front", "size")

    SWEEP = 1024  # the fewest dead slots that call for a rebuild

    def __init__(self) -> None:
        self._buckets: dict[int, deque[T]] = {}
        self._prios: list[int] = []  # heap of the priorities that have a bucket
        self._seq = 0
        self.size = 0  # live entries
        # The bucket of the best priority present (None: none yet). A store may take its front
        # entry itself (`MemoryRun.claim`): an entry whose `qseq` is -1 is stale and dropped.
        self.front: deque[T] | None = None
        # (id(entry), priority) -> the entry's ghost slots in that priority's bucket (`move`).
        self._ghosts: dict[tuple[int, int], int] = {}
        # Slots made dead (discarded, moved away from) since the last look, and the dead ones it
        # found: more than are there when a taker dropped some at the front meanwhile.
        self._dead = 0

    def push(self, entry: T) -> None:
        bucket = self._buckets.get(entry.priority)
        if bucket is None:
            bucket = self._buckets[entry.priority] = deque()
            heappush(self._prios, entry.priority)
            self.front = None if self._ghosts else self._buckets[self._prios[0]]
        self._seq += 1
        entry.qseq = self._seq
        bucket.append(entry)
        self.size += 1

    def push_all(self, entries: list[T]) -> None:
        """`push` each of `entries` in order (a batch admitted at once: most share one priority)."""
        buckets = self._buckets
        seq = self._seq
        last: int | None = None
        bucket: deque[T] | None = None
        for entry in entries:
            priority = entry.priority
            if priority != last:
                bucket = buckets.get(priority)
                if bucket is None:
                    bucket = buckets[priority] = deque()
                    heappush(self._prios, priority)
                    self.front = None if self._ghosts else buckets[self._prios[0]]
                last = priority
            seq += 1
            entry.qseq = seq
            bucket.append(entry)  # type: ignore[union-attr]
        self._seq = seq
        self.size += len(entries)

    def pop(self) -> T | None:
        """The best live entry, taken out of the queue (None when empty)."""
        if not self.size:
            return None
        prios = self._prios
        buckets = self._buckets
        ghosts = self._ghosts
        while prios:
            priority = prios[0]
            bucket = buckets[priority]
            while bucket:
                entry = bucket.popleft()
                if ghosts and self._ghost((id(entry), priority)):
                    if not ghosts:
                        self.front = bucket
                    continue
                if entry.qseq >= 0:
                    entry.qseq = -1
                    self.size -= 1
                    return entry
            del buckets[heappop(prios)]
            self.front = buckets[prios[0]] if prios and not ghosts else None
        return None  # pragma: no cover - `size` counts live entries

    def discard(self, entry: T) -> None:
        """`entry` leaves without being popped; its stale slot is dropped when it reaches the front."""
        if entry.qseq >= 0:
            entry.qseq = -1
            self.size -= 1
            self._dead += 1
            if self._dead >= self.size and self._dead >= self.SWEEP:
                self._sweep()

    def move(self, entry: T, priority: int) -> None:
        """Change the priority of a queued entry (it goes to the back of its new priority). O(1):
        its old slot stays, a ghost, dropped when it reaches the front."""
        if entry.qseq >= 0:
            key = (id(entry), entry.priority)
            self._ghosts[key] = self._ghosts.get(key, 0) + 1
            self.front = None
            self.size -= 1
            self._dead += 1
        entry.priority = priority
        self.push(entry)
        if self._dead >= self.size and self._dead >= self.SWEEP:
            self._sweep()

    def _ghost(self, key: tuple[int, int]) -> bool:
        """Whether the slot of `key` (an entry's id and a priority) is one it left when it moved
        (`move`): then spent, one of that entry's ghosts at that priority fewer. Asked only while
        there are ghosts (none in a run that never changes a queued task's priority)."""
        ghosts = self._ghosts
        left = ghosts.get(key)
        if left is None:
            return False
        if left > 1:
            ghosts[key] = left - 1
        else:
            del ghosts[key]
        return True

    def _sweep(self) -> None:
        """Count the dead slots; rebuild the buckets without them when they are at least half
        as many as the live entries (or `SWEEP`)."""
        dead = sum(len(bucket) for bucket in self._buckets.values()) - self.size
        if 2 * dead < max(self.size, self.SWEEP):
            self._dead = dead
            return
        self._dead = 0
        ghosts = self._ghosts
        for priority, bucket in self._buckets.items():
            live: deque[T] = deque()
            for entry in bucket:
                if ghosts and self._ghost((id(entry), priority)):
                    continue
                if entry.qseq >= 0:
                    live.append(entry)
            bucket.clear()
            bucket.extend(live)  # the same deque: `front` may be it
        self.front = self._buckets[self._prios[0]] if self._prios and not ghosts else None

    def depths(self) -> dict[int, int]:
        """Entries by priority, for status reports: O(priority levels). A discarded entry (a task
        cancelled or timed out while ready) or a moved one's ghost counts until it reaches the
        front."""
        return {prio: len(self._buckets[prio]) for prio in sorted(self._prios)}

    def __len__(self) -> int:
        return self.size
