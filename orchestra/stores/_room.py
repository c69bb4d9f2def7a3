"""A coordinator's claims sized by its agents' room: the ready tasks they cannot start now, set aside.

A run whose store other processes claim from (a durable one's, with workers) must not hold more
of its tasks than its own agents can start: a task claimed here waits in a lane of this process's
dispatcher while a worker with room idles. So its coordinator takes a ready task only while the
run's agents of its kind have room (`Listener.room`, less the tasks taken here and not yet handed
to the dispatcher); one they have none for is *set aside*: ready in the run's state (and in the
file, claimable by a worker), out of the ready queue, in a heap of its kind, and taken first once
its kind has room again (a slot freed: the runner that freed it asks). The claim size of a process
is then, for each kind, ``room(kind) - taken(kind)``, where

- ``room(kind)`` = min(the global limit's free places, the sum of the free places of the agents of
  the kind and of its fallback chain) less the tasks already waiting in those agents' lanes and
  in the kind's. An agent's free places: its own limit, or a shared `Concurrency`'s free places
  when fewer (agents that share one count its free places once), less its attempts in flight;
  at most one while it has other limits (a rate, a budget: how many they let through, only
  reserving tells), and while one of them has no room now (a rate, a Retry-After pause), one if
  no task waits for it yet (it waits in the agent's lane, whose timer wakes the run), else none.
  While an agent of the kind is down (its breaker not closed), the room has no bound: its tasks
  are claimed as they come and wait for its probe, each charged an attempt when it fails, so an
  agent down for good fails them fast (a worker does not get them meanwhile).
- ``taken(kind)`` = the tasks of the kind claimed here and not yet handed to the dispatcher (asked
  of the file, or granted and not picked up yet).

It is asked once per batch of claims, not per claim (`credit`): a room of n lets the next n
claims of the kind through without asking again (at most `_CREDIT` of them).

A worker process sizes its claims by the same room less what a wait would hold (`_worker.py`
asks its local run with ``hold=False``, less the tasks it holds and has not started): none for a
rate with no room now, only a probe's task for a down agent; what a wait catches after its claim
it hands back to the file at its next heartbeat (`Listener.stalled`). A store that shares nothing (the memory store) never asks: what its runners claim and cannot start
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

# The most claims one answer of the room lets through: it is asked again at least this often.
_CREDIT = 64


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

    __slots__ = ("_listener", "_order", "_owner", "aside", "credit")

    def __init__(self, owner: Owner, listener: Listener) -> None:
        self._owner = owner
        self._listener = listener
        # kind -> heap of (priority, order, record, token): set aside, ready, not in the queue
        # (a kind is here only while its heap has entries)
        self.aside: dict[str, list[tuple[int, int, Record, int]]] = {}
        self._order = 0
        # kind -> claims left of the room last asked for: the room is asked again once they are
        # spent, not at every claim (asking costs about a microsecond, a tenth of a durable
        # no-op task). Room that frees meanwhile is found at the next ask; room another run
        # takes meanwhile (one sharing the agent) is over-claimed by at most one ask's worth.
        self.credit: dict[str, int] = {}

    def _free(self, kind: str) -> int:
        return self._listener.room(kind) - self._owner.taken(kind)

    def fits(self, record: Record) -> bool:
        """Whether `record` (just claimed from the ready queue) can start here now; if not, it is
        set aside, ready again (its row stays claimable). The caller spends a credit left
        itself, inline, when its kind has none set aside (`SQLiteRun.claim`)."""
        kind = record.kind
        heap = self.aside.get(kind)
        # Behind the ones of its kind set aside before it, whatever the room: they go first.
        if heap is None:
            credit = self.credit.get(kind, 0)
            if credit <= 0:
                credit = min(self._free(kind), _CREDIT)
            if credit > 0:
                self.credit[kind] = credit - 1
                return True
            self.credit[kind] = 0
            heap = self.aside[kind] = []
        record.state = READY  # out of the queue (`qseq` -1): `take` claims it from here
        self._order += 1
        heappush(heap, (record.priority, self._order, record, record.token))
        return False

    def take(self) -> Record | None:
        """The best task set aside whose kind has room now, claimed (None: none). O(kinds with
        tasks set aside)."""
        aside = self.aside
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
