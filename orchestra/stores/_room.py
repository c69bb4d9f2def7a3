"""A coordinator's claims sized by its agents' room: the ready tasks they cannot start now, set aside.

A run whose store other processes claim from (a durable one's, with workers) must not hold more of
its tasks than its own agents can start: a task claimed here waits in a lane of this process's
dispatcher while a worker with room idles. So its coordinator takes a ready task only while the
run's agents of its kind have room (`Listener.room`, less the tasks taken here and not yet handed
to the dispatcher); one they have none for is *set aside*: ready in the run's state (and in the
file, claimable by a worker), out of the ready queue, in a heap of its kind, and taken first once
its kind has room again (a slot freed: the runner that freed it asks). The claim size of a process
is then, for each kind, ``room(kind) - taken(kind)``, where

- ``room(kind)`` = min(the global limit's free places, the sum over the agents of the kind (and of
  its fallback chain) of their free places (an agent's own limit less its attempts in flight, or
  a shared `Concurrency`'s free places when fewer) less the tasks already waiting in their lanes),
- ``taken(kind)`` = the tasks of the kind claimed here and not yet handed to the dispatcher (asked
  of the file, or granted and not picked up yet).

A store that shares nothing (the memory store) never asks: what its runners claim and cannot start
waits in their lanes, at no cost.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING, Protocol

from .._task import READY

if TYPE_CHECKING:
    from .._record import Record
    from ._protocol import Listener

__all__ = ("Owner", "Room")


class Owner(Protocol):
    """What the room asks of its run."""

    def taken(self, kind: str) -> int:
        """The tasks of `kind` claimed here and not handed to the dispatcher yet."""
        ...

    def take(self, record: Record) -> int:
        """Claim this very task (ready, out of the queue): returns its new token."""
        ...


class Room:
    """The ready tasks of one run that its agents had no room for, by kind, best first."""

    __slots__ = ("_aside", "_listener", "_order", "_owner")

    def __init__(self, owner: Owner, listener: Listener) -> None:
        self._owner = owner
        self._listener = listener
        # kind -> heap of (priority, order, record, token): set aside, ready, not in the queue
        self._aside: dict[str, list[tuple[int, int, Record, int]]] = {}
        self._order = 0

    def _free(self, kind: str) -> int:
        return self._listener.room(kind) - self._owner.taken(kind)

    def fits(self, record: Record) -> bool:
        """Whether `record` (just claimed from the ready queue) can start here now; if not, it is
        set aside, ready again (its row stays claimable)."""
        kind = record.kind
        heap = self._aside.get(kind)
        # Behind the ones of its kind set aside before it, whatever the room: they go first.
        if not heap and self._free(kind) > 0:
            return True
        record.state = READY  # out of the queue (`qseq` -1): `take` claims it from here
        self._order += 1
        if heap is None:
            heap = self._aside[kind] = []
        heappush(heap, (record.priority, self._order, record, record.token))
        return False

    def take(self) -> Record | None:
        """The best task set aside whose kind has room now, claimed (None: none). O(kinds with
        tasks set aside)."""
        aside = self._aside
        if not aside:
            return None
        best: tuple[int, int, Record, int] | None = None
        best_kind = ""
        for kind, heap in list(aside.items()):
            while heap:
                _, _, record, token = heap[0]
                if record.token == token and record.state is READY:
                    break
                heappop(heap)  # it ended (a cancel, a deadline) or was claimed otherwise
            if not heap:
                del aside[kind]
                continue
            if (best is None or heap[0] < best) and self._free(kind) > 0:
                best = heap[0]
                best_kind = kind
        if best is None:
            return None
        heap = aside[best_kind]
        heappop(heap)
        if not heap:
            del aside[best_kind]
        record = best[2]
        self._owner.take(record)
        return record
