"""Routing: which agent a claimed task goes to, and where it waits when that agent has no room.

The dispatcher's choosing half. A claimed task goes to its target (the agent it retries on), the
only agent of its kind, the first usable agent of its chain, or the next agent with room in its
kind's rotation — without a scan over kinds or agents. When that agent has no room (its limit is
reached, its limits say "room at T", or its breaker is open with no usable agent left), the task
waits in a *lane*: a small heap of claimed tasks per agent (or per kind), looked at again when
the agent frees a slot, its limits free up, or it recovers. Nothing here changes a task's state:
what cannot be routed goes back to the dispatcher (`chain_end`), which asks the store.
"""

from __future__ import annotations

import math
from collections import deque
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Any, Final, Protocol

from .._breaker import CLOSED, HALF_OPEN
from .._limits import Cost, reserve_all
from .._log import get_logger
from .._task import CLAIMED

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from .._budget import BudgetAccount
    from .._limits import Limiter, Waiter
    from .._record import Record
    from .._registry import AgentSlot, Registry

__all__ = ("NONE_LEFT", "Lane", "Router")

log = get_logger("orchestra")

NONE_LEFT: Final[Any] = object()  # `next_agent`: the chain has run out
# What an attempt costs by default: one object, shared by every such attempt (never trued up in
# place: see `Context.reserve`).
DEFAULT_COST: Final[Mapping[str, float]] = {"requests": 1}
_REQUEST: Final = DEFAULT_COST


class Owner(Protocol):
    """What the router asks of its dispatcher."""

    def now(self) -> float: ...
    def schedule(self) -> None: ...
    def wake_one(self) -> None: ...
    def chain_end(
        self, record: Any, token: int, reason: str, error_type: str | None = None
    ) -> None: ...
    def emit_fallback(self, record: Any, slot: AgentSlot, nxt: Any, reason: str) -> None: ...
    def moved(self, record: Any, slot: AgentSlot) -> None: ...


class Lane:
    """Claimed tasks waiting for room at one agent (or at any agent of one kind), best first."""

    __slots__ = ("heap", "kind", "queued", "slot")

    def __init__(self, slot: AgentSlot | None, kind: str | None) -> None:
        self.slot = slot
        self.kind = kind
        self.heap: list[tuple[int, int, Record, int]] = []  # (priority, order, record, token)
        self.queued = False  # in the router's `recheck` queue


class Router:
    """The agent choice of one run, and the lanes of claimed tasks waiting for room."""

    def __init__(self, owner: Owner, registry: Registry) -> None:
        self._owner = owner
        self._time: Callable[[], float] = owner.now
        self._slots = registry.slots
        self.chains = {k: [s.name for s in c] for k, c in registry.chains.items()}
        self.kind_slots = registry.by_kind
        # Kinds served by one agent and no chain: no choice to make at dispatch.
        self.only: dict[str, AgentSlot] = {
            kind: slots[0]
            for kind, slots in registry.by_kind.items()
            if len(slots) == 1 and kind not in registry.chains
        }
        # The rotation of each kind served by several agents: the registry's, so that concurrent
        # runs spread their tasks over the agents together.
        self._cursor = registry.cursor
        self._lanes: dict[Any, Lane] = {}  # by slot (an agent's lane) or by kind (any agent's)
        self.recheck: deque[Lane] = deque()  # lanes whose agents may have room now
        self.wakeups: list[tuple[float, int, Lane]] = []  # (loop time, order, lane)
        self._order = 0
        self._front = 0  # lane order of tasks put back at the head (counts down)
        self.held = 0  # tasks waiting in lanes
        self.reached = 0.0  # the time of the last timer that fired (see `reserve`)
        self._wakers: dict[AgentSlot, Waiter] = {}
        # For each agent, the others a task waiting in its lane may go to (`_others_of`).
        self._others: dict[AgentSlot, list[AgentSlot]] = {}
        self.budget: BudgetAccount | None = None  # the run's budget, a limiter on every agent

    def limiters(self, slot: AgentSlot) -> tuple[Limiter, ...]:
        """What an attempt of `slot` reserves in this run: its limits (and the run's budget)."""
        budget = self.budget
        return slot.limiters if budget is None else budget.limiters(slot)

    def bind_clock(self, time: Callable[[], float]) -> None:
        self._time = time

    def _now(self) -> float:
        """The clock's time, or the time of the timer that just fired if later: asyncio runs a
        timer up to its clock's resolution early, and a task woken for "room at T" must find
        room, or it would be put back for T and woken again at once, with time standing still."""
        now = self._time()
        reached = self.reached
        return now if now >= reached else reached

    def take_held(self) -> tuple[Record, int, AgentSlot, Cost | None] | None:
        """The best waiting task whose agent has room now (reserved on its limits), or None."""
        recheck = self.recheck
        while recheck:
            picked = self.from_lane(recheck[0])
            if picked is not None:
                self._owner.wake_one()  # the lane may hold more that can go now: pass it on
                record, token, slot = picked
                if not slot.limiters and self.budget is None:
                    return record, token, slot, None
                cost = self.reserve(record, token, slot)
                if cost is not None:
                    return record, token, slot, cost
            recheck.popleft().queued = False
        return None

    def due(self, now: float) -> int:
        """Lanes whose wait ended by `now` are looked at again; how many."""
        wakeups = self.wakeups
        while wakeups and wakeups[0][0] <= now:
            lane = heappop(wakeups)[2]
            if lane.heap and not lane.queued:
                lane.queued = True
                self.recheck.append(lane)
        return len(self.recheck)

    def next_wakeup(self) -> float:
        return self.wakeups[0][0] if self.wakeups else math.inf

    def route(self, record: Record, token: int) -> AgentSlot | None:
        """The agent for a claimed task if it has room now; else the task waits in a lane (or
        ends: its deadline passed) and None is returned."""
        deadline = record.deadline
        if deadline is not None and self._now() >= deadline:
            self._owner.chain_end(
                record,
                token,
                f"the deadline passed before attempt {record.attempts + 1} started",
                "TaskTimeout",
            )
            return None
        target = record.target
        slot = None if target is None else self._slots.get(target)
        if slot is None:
            if target is not None:
                # An agent this process does not have (a resumed run's task, started by an
                # earlier process with other agents): routed anew, by its kind.
                record.target = None
                record.agent_tries = 0
            slot = self.only.get(record.kind)
            if slot is None:
                return self._route_kind(record, token)
        if slot.breaker.state is not CLOSED:
            return self._route_unwell(record, token, slot)
        if slot.in_flight < slot.limit:
            lane = self._lanes.get(slot)
            if lane is None or not lane.heap:
                return slot
        self._hold(record, token, self.lane(slot, None))
        return None

    def _route_kind(self, record: Record, token: int, join: bool = True) -> AgentSlot | None:
        """A task that may go to any agent of its kind not used up: its chain's first, or the next
        in the kind's rotation that has room. With `join`, it queues behind the kind's waiting
        tasks rather than overtake them."""
        kind = record.kind
        chain = self.chains.get(kind)
        if chain is not None:
            tried = record.tried
            for name in chain:
                if tried is None or name not in tried:
                    return self._route_unwell(record, token, self._slots[name])
            self._owner.chain_end(record, token, "every agent of the chain was used up")
            return None
        tried = record.tried
        lane = self._lanes.get(kind)
        if join and tried is None and lane is not None and lane.heap:
            self._hold(record, token, lane)  # others wait already: join them (O(1))
            return None
        slots = self.kind_slots[kind]
        n = len(slots)
        first = self._cursor.get(kind, 0)
        slot = slots[first]
        if tried is None and slot.breaker.state is CLOSED and slot.in_flight < slot.limit:
            self._cursor[kind] = (first + 1) % n  # the common case: the next in turn has room
            return slot
        now = self._now()
        usable: AgentSlot | None = None
        for i in range(n):
            slot = slots[(first + i) % n]
            if tried is not None and slot.name in tried:
                continue
            if not self.usable(slot, now):
                continue
            usable = usable or slot
            if slot.in_flight < slot.limit:
                self._cursor[kind] = (first + i + 1) % n
                if tried is not None:  # it left an agent: this is where it goes
                    self._owner.moved(record, slot)
                return slot
        if usable is not None:
            self._hold(record, token, self.lane(None, kind))
            return None
        left = [s for s in slots if not _used(record, s)]
        if not left:
            self._owner.chain_end(record, token, "every agent of the kind was used up")
            return None
        return self.wait_for_recovery(record, token, left)

    def _route_unwell(self, record: Record, token: int, slot: AgentSlot) -> AgentSlot | None:
        """`slot` may have an open breaker: go to the next usable agent of the task's chain (in
        the chain's order), or of its kind (whichever has room first), or wait for the first of
        them to recover."""
        now = self._now()
        if self.usable(slot, now):
            if slot.in_flight < slot.limit:
                return slot
            self._hold(record, token, self.lane(slot, None))
            return None
        candidates = self._untried(record, slot)
        chained = record.kind in self.chains
        usable: AgentSlot | None = None
        for other in candidates:
            if other is not slot and self.usable(other, now):
                if other.in_flight < other.limit:
                    self._owner.emit_fallback(record, slot, other, "circuit breaker open")
                    return other
                if chained:  # the chain's order: wait for its next usable agent
                    self._owner.emit_fallback(record, slot, other, "circuit breaker open")
                    self._hold(record, token, self.lane(other, None))
                    return None
                usable = usable or other
        if usable is not None:  # no chain: whichever usable agent of the kind has room first
            self._owner.emit_fallback(record, slot, usable, "circuit breaker open")
            self._hold(record, token, self.lane(None, record.kind))
            return None
        return self.wait_for_recovery(record, token, candidates or [slot], slot)

    def _untried(self, record: Record, slot: AgentSlot) -> list[AgentSlot]:
        """The agents `record` may still go to, `slot` first, in chain (or registry) order."""
        chain = self.chains.get(record.kind)
        names = chain if chain is not None else [s.name for s in self.kind_slots[record.kind]]
        tried = record.tried
        out = [slot]
        for name in names:
            if name != slot.name and (tried is None or name not in tried):
                out.append(self._slots[name])
        return out

    def usable(self, slot: AgentSlot, now: float) -> bool:
        return slot.breaker.state is CLOSED or slot.breaker.available(now)

    def wait_for_recovery(
        self, record: Record, token: int, slots: list[AgentSlot], origin: AgentSlot | None = None
    ) -> AgentSlot | None:
        """Every agent the task may go to is unwell: it waits (within its deadline) in the lane of
        the one that recovers first, never fails for it. Another agent than `origin` (the one it
        was bound for) is a fallback, told as one: the task's next attempt is there."""
        now = self._now()
        best = min(slots, key=lambda s: _recovers_at(s, now))
        if origin is not None and best is not origin:
            self._owner.emit_fallback(record, origin, best, "circuit breaker open")
        elif origin is None and record.tried is not None:
            self._owner.moved(record, best)  # it left an agent: it goes to this one next
        lane = self.lane(best, None)
        self._hold(record, token, lane)
        at = _recovers_at(best, now)
        if at < math.inf:
            self._order += 1
            heappush(self.wakeups, (at, self._order, lane))
            self._owner.schedule()
        return None

    def stranded(self, slot: AgentSlot) -> list[tuple[Record, int]]:
        """The tasks waiting in `slot`'s lane that have no other usable agent to go to, best
        first, taken out of the lane (its probe just failed: they spend an attempt on it); those
        that have one are routed to it."""
        lane = self._lanes.get(slot)
        if lane is None or not lane.heap:
            return []
        waiting = sorted(lane.heap)
        lane.heap = []
        self.held -= len(waiting)
        now = self._now()
        out = []
        for _, _, record, token in waiting:
            if record.token != token or record.state is not CLAIMED:
                continue
            if any(
                other is not slot and self.usable(other, now)
                for other in self._untried(record, slot)
            ):
                self._route_again(record, token)
            else:
                out.append((record, token))
        return out

    def waiting(self) -> list[tuple[AgentSlot | None, str | None, int]]:
        """The non-empty lanes as (agent or None, kind or None, tasks held): for the run's status.
        O(lanes); a task that ended while it waited is counted until its lane is looked at."""
        return [
            (lane.slot, lane.kind, len(lane.heap)) for lane in self._lanes.values() if lane.heap
        ]

    def holding(self, task_id: str) -> Lane | None:
        """The lane where `task_id` waits for room, if it does. O(tasks in lanes)."""
        for lane in self._lanes.values():
            for _, _, record, token in lane.heap:
                if record.id == task_id and record.token == token and record.state is CLAIMED:
                    return lane
        return None

    def moved(self, lane: Lane, task_id: str) -> None:
        """`task_id`, waiting in `lane`, has a new priority: it goes behind those that have it
        already, as in the store's queue."""
        heap = lane.heap
        for i, (_, _, record, token) in enumerate(heap):
            if record.id == task_id:
                self._order += 1
                heap[i] = (record.priority, self._order, record, token)
                heapify(heap)
                return

    def held_for(self, agent: str) -> list[str]:
        """The ids of the claimed tasks waiting in `agent`'s own lane (for a cancel by agent).
        O(tasks in that lane)."""
        slot = self._slots.get(agent)
        lane = None if slot is None else self._lanes.get(slot)
        if lane is None:
            return []
        return [
            record.id
            for _, _, record, token in lane.heap
            if record.token == token and record.state is CLAIMED
        ]

    def stalled(self, longer_than: float) -> list[Record]:
        """The claimed tasks waiting in a lane whose agent cannot take a task for more than
        `longer_than` seconds: it is down (until its probe may go, or while a probe is out), or
        its limits have no room until then (a rate refills, a Retry-After pause ends). Not
        the ones waiting for a slot only: an attempt's end frees it. O(lanes + agents of the
        kinds' lanes + the tasks returned)."""
        now = self._now()
        out: list[Record] = []
        for lane in self._lanes.values():
            if not lane.heap:
                continue
            slot = lane.slot
            if slot is not None:
                free_at = self._free_at(slot, now)
            else:  # any agent of the kind may take it: the first one free
                free_at = min(self._free_at(s, now) for s in self.kind_slots[lane.kind])  # type: ignore[index]
            if free_at - now > longer_than:
                out.extend(
                    record
                    for _, _, record, token in lane.heap
                    if record.token == token and record.state is CLAIMED
                )
        return out

    def _free_at(self, slot: AgentSlot, now: float) -> float:
        """When `slot` may take a task, as far as its health and its limits' times say (`now`:
        it may, or it waits for a slot only)."""
        if not self.usable(slot, now):
            return _recovers_at(slot, now)
        at = now
        for limiter in self.limiters(slot):
            room = limiter.peek(now, DEFAULT_COST)
            if at < room < math.inf:  # (math.inf: a slot, or a budget, that an end frees)
                at = room
        return at

    def leads(self, agent: str) -> list[str]:
        """The kinds whose tasks go to `agent` first: it is their only agent, or the head of their
        fallback chain (for a cancel by agent: their ready tasks wait for it). O(kinds)."""
        only = [kind for kind, slot in self.only.items() if slot.name == agent]
        return only + [kind for kind, chain in self.chains.items() if chain[0] == agent]

    def lane(self, slot: AgentSlot | None, kind: str | None) -> Lane:
        key: Any = slot if slot is not None else kind
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(slot, kind)
        return lane

    def _hold(self, record: Record, token: int, lane: Lane) -> None:
        self._order += 1
        heappush(lane.heap, (record.priority, self._order, record, token))
        self.held += 1

    def from_lane(self, lane: Lane) -> tuple[Record, int, AgentSlot] | None:
        """The best task of `lane` if its agent has room now (the task is routed again: its agent
        may have changed while it waited)."""
        heap = lane.heap
        slot = lane.slot
        if slot is None:
            return self._from_kind_lane(lane)
        now = self._now()
        while heap:
            _, _, record, token = heap[0]
            if record.token != token or record.state is not CLAIMED:
                heappop(heap)  # it ended (deadline, cancel) while it waited
                self.held -= 1
                continue
            if not self.usable(slot, now):
                self._unwell(lane, slot, now)  # its agent went down while they waited
                return None
            if slot.in_flight >= slot.limit:
                return None
            heappop(heap)
            self.held -= 1
            return record, token, slot
        return None

    def _from_kind_lane(self, lane: Lane) -> tuple[Record, int, AgentSlot] | None:
        """`from_lane` for a kind's lane, whose tasks may go to any agent of the kind they have
        not used up. A task at its head that cannot go now does not hold back the tasks behind
        it when they could: one whose agents are all down waits for the first to recover (on a
        timer), and one whose agents are full steps aside while an agent it used up has room
        for the others. Each such look is O(tasks stepped aside + agents of the kind)."""
        heap = lane.heap
        slots = self.kind_slots[lane.kind]  # type: ignore[index]
        now = self._now()
        aside: list[tuple[int, int, Record, int]] = []
        picked: tuple[Record, int, AgentSlot] | None = None
        while heap:
            _, _, record, token = heap[0]
            if record.token != token or record.state is not CLAIMED:
                heappop(heap)  # it ended (deadline, cancel) while it waited
                self.held -= 1
                continue
            if not any(
                s.in_flight < s.limit and self.usable(s, now) and not _used(record, s)
                for s in slots
            ):
                if not any(self.usable(s, now) and not _used(record, s) for s in slots):
                    heappop(heap)  # its agents are all down: it waits for a probe
                    self.held -= 1
                    self._route_kind(record, token, join=False)
                    continue
                if record.tried is not None and any(
                    s.in_flight < s.limit and self.usable(s, now) for s in slots
                ):
                    aside.append(heappop(heap))  # full where it may go: others may go
                    continue
                break  # its agents are full: the lane is looked at again when one frees
            heappop(heap)
            self.held -= 1
            chosen = self._route_kind(record, token, join=False)
            if chosen is not None:
                picked = record, token, chosen
                break
        for entry in aside:
            heappush(heap, entry)
        return picked

    def _others_of(self, slot: AgentSlot) -> list[AgentSlot]:
        """The other agents a task waiting in `slot`'s lane may go to: those of its kinds, and of
        the chains that name it."""
        others = self._others.get(slot)
        if others is None:
            kinds = set(slot.kinds)
            kinds.update(k for k, chain in self.chains.items() if slot.name in chain)
            found = {s for k in kinds for s in self.kind_slots.get(k, ())}
            found.update(self._slots[n] for k in kinds for n in self.chains.get(k, ()))
            found.discard(slot)
            others = self._others[slot] = list(found)
        return others

    def _unwell(self, lane: Lane, slot: AgentSlot, now: float) -> None:
        """`slot`, the agent of `lane`, is unwell. Its tasks go elsewhere if another agent they may
        go to is usable; else they stay in the lane, looked at again when the first of those agents
        recovers (or the probe ends): routing each again would put it back in a lane of the same
        agents, at every attempt's end, O(n^2) over a run whose breaker stays open. O(agents)."""
        others = self._others_of(slot)
        if any(self.usable(other, now) for other in others):
            self._reroute(lane)
            return
        at = min(_recovers_at(s, now) for s in (slot, *others))
        if at < math.inf:
            self._order += 1
            heappush(self.wakeups, (at, self._order, lane))
            self._owner.schedule()

    def reserve(self, record: Record, token: int, slot: AgentSlot) -> Cost | None:
        """Reserve the attempt's cost on `slot`'s limits (all or none). Without room, the task
        waits at the head of the agent's lane until the limits say there is: at a time (a rate
        refills, a Retry-After ends: the run's timer), or at a release (a shared `Concurrency`:
        its watcher)."""
        cost = _REQUEST if slot.estimate is None else _estimate(slot, record)
        now = self._now()
        # The task's turn on limits other agents share: the run's order, across their lanes.
        turn = (record.priority, record.order)
        room = reserve_all(self.limiters(slot), now, cost, self._waker(slot), turn)
        if not room:
            return cost
        lane = self.lane(slot, None)
        self._front -= 1  # it was first in line: it stays ahead of its priority's others
        heappush(lane.heap, (record.priority, self._front, record, token))
        self.held += 1
        if room < math.inf:
            self._order += 1
            heappush(self.wakeups, (room, self._order, lane))
            self._owner.schedule()
        return None

    def _waker(self, slot: AgentSlot) -> Waiter:
        """What a shared limit of `slot` calls when room may come: look at the agent's lane again
        now, or at loop time `at` (the run's timer; one still to come does for a later one: the
        lane asks then, and one refused then is told when to ask again)."""
        waker = self._wakers.get(slot)
        if waker is None:
            pending = -math.inf

            def waker(at: float | None = None) -> None:
                nonlocal pending
                if at is None:
                    self.room(slot)
                    self._owner.wake_one()
                elif pending <= self._now():
                    pending = at
                    self._order += 1
                    heappush(self.wakeups, (at, self._order, self.lane(slot, None)))
                    self._owner.schedule()

            self._wakers[slot] = waker
        return waker

    def pause(self, slot: AgentSlot, until: float) -> None:
        """No task starts before `until` (a rate limit's Retry-After) on any agent that shares
        one of `slot`'s limits: each of them finds no room until then when it reserves."""
        for limiter in slot.limiters:
            limiter.hold_until(until)
        if until > slot.paused_until:  # what its status shows (`paused_for`)
            slot.paused_until = until
        self._order += 1
        heappush(self.wakeups, (until, self._order, self.lane(slot, None)))
        self._owner.schedule()

    def _reroute(self, lane: Lane) -> None:
        """Route again every task waiting in `lane` (its agent became unusable): each goes to
        another agent's lane, or waits for the first of its agents to recover."""
        waiting = lane.heap
        lane.heap = []
        self.held -= len(waiting)
        for _, _, record, token in waiting:
            if record.token == token and record.state is CLAIMED:
                self._route_again(record, token)

    def _route_again(self, record: Record, token: int) -> None:
        """Route a waiting task again: to another agent's lane, or to wait for the first of its
        agents to recover."""
        slot = self.route(record, token)
        if slot is not None:  # room now: it waits at the head of that agent's lane
            other = self.lane(slot, None)
            self._hold(record, token, other)
            if not other.queued:
                other.queued = True
                self.recheck.append(other)

    def room(self, slot: AgentSlot) -> None:
        """`slot` may have room now (a slot freed, its breaker closed): look at its lanes again."""
        lane = self._lanes.get(slot)
        if lane is not None and lane.heap and not lane.queued:
            lane.queued = True
            self.recheck.append(lane)
        for kind in slot.kinds:
            lane = self._lanes.get(kind)
            if lane is not None and lane.heap and not lane.queued:
                lane.queued = True
                self.recheck.append(lane)

    def queued(self, key: AgentSlot | str) -> int:
        """The tasks waiting in the lane of an agent (or of a kind), not ended while they waited.
        O(tasks in it)."""
        lane = self._lanes.get(key)
        if lane is None or not lane.heap:
            return 0
        return sum(
            1 for _, _, rec, token in lane.heap if rec.token == token and rec.state is CLAIMED
        )

    def next_agent(self, record: Record, slot: AgentSlot) -> Any:
        """The name of the agent after `slot` in `record`'s chain (without an explicit chain: the
        least loaded usable agent of the kind not used up), or `NONE_LEFT`."""
        tried = record.tried or ()
        chain = self.chains.get(record.kind)
        if chain is not None:
            for name in chain:
                if name != slot.name and name not in tried:
                    return name
            return NONE_LEFT
        untried = [s for s in self.kind_slots[record.kind] if s is not slot and s.name not in tried]
        if not untried:
            return NONE_LEFT
        now = self._now()
        usable = [s for s in untried if self.usable(s, now)]
        return min(usable, key=_load).name if usable else untried[0].name


def _estimate(slot: AgentSlot, record: Record) -> Mapping[str, float]:
    """The agent's own estimate of an attempt's cost (tokens, say), plus its one request."""
    try:
        estimate = slot.estimate(record.task)  # type: ignore[misc]
    except Exception:
        log.warning("an agent's cost estimate raised; reserving one request", exc_info=True)
        return _REQUEST
    return {"requests": 1, **estimate}


def _load(slot: AgentSlot) -> float:
    return slot.load


def _used(record: Record, slot: AgentSlot) -> bool:
    tried = record.tried
    return tried is not None and slot.name in tried


def _recovers_at(slot: AgentSlot, now: float) -> float:
    """The loop time at which `slot`'s breaker lets a task through again."""
    breaker = slot.breaker
    if breaker.state is HALF_OPEN and breaker.probing:
        return math.inf  # the probe's outcome will wake it
    return breaker.recovers_at(now)  # not `now + reopens_in(now)`: that may round below it
