"""A run's spending budget: `Orchestrator(max_cost=..., max_tokens=...)`.

Spend is what agents report through `ctx.record_usage` (a Claude agent reports every answer's
usage and cost, failed attempts too). The budget is predictive: before an attempt starts, the
spend so far, plus what the attempts in flight may still cost, plus what this one may cost must
fit, or the attempt does not start. What an attempt "may cost" is what it reserves on its agent's
limits (the agent's `estimate(task)`: a Claude agent's input-token estimate and its `max_tokens`),
in tokens, and in USD at the agent's price (its `cost_of(units)`, if it has one; an agent without
an estimate or a price may cost 0 more, and only the spend so far stops it).

An attempt that does not fit waits while attempts are in flight (they may cost less than they
reserved: their real cost is counted when they end); when none is left and it still does not fit,
no attempt will: the run ends. Attempts already running are never cut short by the budget. Every
unfinished task ends cancelled with ``error_type="BudgetExceeded"``, and the run ends "partial"
or "failed" by its success threshold, with `metadata.reason` naming the budget.

The budget is one more limiter on every agent of the run (`BudgetGate.limiters`), reserved after
the agent's own, so it reuses the dispatcher's waiting (a task the budget refuses waits at the
head of its agent's lane and is woken when an attempt ends). A run without a budget has no gate:
nothing is reserved, checked or counted for it.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from ._config import check_int, check_number
from ._limits import REQUESTS
from ._log import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._core._report import Report
    from ._limits import Cost, Limiter
    from ._registry import AgentSlot

__all__ = ("BUDGET_EXCEEDED", "Budget", "BudgetGate")

BUDGET_EXCEEDED = "BudgetExceeded"
"""The `error_type` of the tasks a spent budget ended."""

log = get_logger("orchestra")

_SLACK = 1e-9  # relative: N calls of c USD fit a budget of N * c USD despite float rounding


class Budget:
    """The most a run may spend: USD (`max_cost`) and tokens of every kind together (`max_tokens`)."""

    __slots__ = ("max_cost", "max_tokens")

    def __init__(self, *, max_cost: float | None = None, max_tokens: int | None = None) -> None:
        check_number("max_cost", max_cost, positive=True, optional=True)
        check_int("max_tokens", max_tokens, optional=True)
        self.max_cost = max_cost
        self.max_tokens = max_tokens

    @classmethod
    def of(cls, *, max_cost: float | None, max_tokens: int | None) -> Budget | None:
        """The budget of these limits, or None when there is none (nothing to check)."""
        if max_cost is None and max_tokens is None:
            return None
        return cls(max_cost=max_cost, max_tokens=max_tokens)

    def refuses(
        self, cost: float, tokens: float, more_cost: float, more_tokens: float
    ) -> str | None:
        """Why an attempt that may cost `more_cost` USD and `more_tokens` tokens may not start
        when `cost` and `tokens` are spent or reserved already, or None: it fits. A spent budget
        refuses every attempt, even one that claims to cost nothing."""
        limit = self.max_cost
        if limit is not None and (cost >= limit or cost + more_cost > limit * (1 + _SLACK)):
            return (
                f"the budget of max_cost={limit:g} USD would be exceeded "
                f"(${cost:.4f} spent or reserved, the next attempt may cost ${more_cost:.4f})"
            )
        limit = self.max_tokens
        if limit is not None and (tokens >= limit or tokens + more_tokens > limit):
            return (
                f"the budget of max_tokens={limit} would be exceeded ({tokens:.0f} tokens spent "
                f"or reserved, the next attempt may use {more_tokens:.0f})"
            )
        return None

    def __repr__(self) -> str:
        return f"Budget(max_cost={self.max_cost!r}, max_tokens={self.max_tokens!r})"


class BudgetGate:
    """The budget of one run, as a limiter on each of its agents (see the module docstring).

    `report` holds the spend so far (`ctx.record_usage` adds to it); the gate holds what the
    attempts in flight reserved. `on_spent(reason)` is called once, when an attempt does not fit
    and none is in flight: the run ends."""

    __slots__ = (
        "_doors",
        "budget",
        "in_flight",
        "on_spent",
        "report",
        "reserved_cost",
        "reserved_tokens",
        "waiting",
        "watchers",
    )

    def __init__(self, budget: Budget, report: Report, on_spent: Callable[[str], None]) -> None:
        self.budget = budget
        self.report = report
        self.on_spent = on_spent
        self.in_flight = 0
        self.reserved_cost = 0.0
        self.reserved_tokens = 0.0
        self.waiting = 0  # attempts in flight waiting in `BudgetDoor.grow`
        self.watchers: dict[Callable[[], None], None] = {}  # refused attempts' lanes
        self._doors: dict[AgentSlot, tuple[Limiter, ...]] = {}

    def limiters(self, slot: AgentSlot) -> tuple[Limiter, ...]:
        """What an attempt of `slot` reserves in this run: the agent's limits, then the budget
        (last: it is never taken and given back because a rate had no room)."""
        limiters = self._doors.get(slot)
        if limiters is None:
            door = BudgetDoor(self, getattr(slot.agent, "cost_of", None))
            limiters = self._doors[slot] = (*slot.limiters, door)
        return limiters


class BudgetDoor:
    """The budget as one agent's limiter: it prices a reservation with the agent's `cost_of`.

    Reservations are kept by identity (an attempt's cost is its own mapping, trued up in place by
    `Context.reserve`), so what comes back at the end is what was taken, however it was trued up.
    """

    __slots__ = ("gate", "held", "price")

    def __init__(
        self, gate: BudgetGate, price: Callable[[Mapping[str, float]], float] | None
    ) -> None:
        self.gate = gate
        self.price = price
        self.held: dict[int, list[Any]] = {}  # id(cost) -> [count, usd, tokens]

    def _amounts(self, cost: Cost) -> tuple[float, float]:
        if not isinstance(cost, dict):  # a plain number: one request, no tokens
            return 0.0, 0.0
        tokens = sum(n for unit, n in cost.items() if unit != REQUESTS)
        price = self.price
        if price is None:
            return 0.0, float(tokens)
        try:
            usd = float(price(cost))
        except Exception:  # an agent's price is a help: a broken one prices the attempt at 0
            log.warning("an agent's cost_of raised; pricing the attempt at 0", exc_info=True)
            usd = 0.0
        return usd, float(tokens)

    def fits(self, reserved: Cost, new: Cost) -> str | None:
        """Why the reservation `reserved` of an attempt in flight may not grow to `new`, or None."""
        gate = self.gate
        entry = self.held.get(id(reserved))
        had_usd, had_tokens = (0.0, 0.0) if entry is None else (entry[1], entry[2])
        usd, tokens = self._amounts(new)
        report = gate.report
        return gate.budget.refuses(
            report.cost + gate.reserved_cost - had_usd,
            sum(report.tokens.values()) + gate.reserved_tokens - had_tokens,
            usd,
            tokens,
        )

    async def grow(self, reserved: Cost, new: Cost) -> None:
        """Wait until the reservation of an attempt in flight may grow to `new` before its call
        (`Context.reserve`): while it does not fit, the attempts in flight may make room as they
        end; when every other one waits too, none can, and the run ends (it cancels this
        attempt: its task ends cancelled with ``BudgetExceeded``, its call never sent)."""
        gate = self.gate
        while (reason := self.fits(reserved, new)) is not None:
            if gate.in_flight - gate.waiting <= 1:
                gate.on_spent(reason)
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()

            def wake(woken: asyncio.Future[None] = woken) -> None:
                if not woken.done():
                    woken.set_result(None)

            gate.watchers[wake] = None
            gate.waiting += 1
            try:
                await woken  # the run's end cancels it when on_spent was called
            finally:
                gate.waiting -= 1
                gate.watchers.pop(wake, None)

    def reserve(self, now: float, cost: Cost) -> float:
        gate = self.gate
        usd, tokens = self._amounts(cost)
        report = gate.report
        reason = gate.budget.refuses(
            report.cost + gate.reserved_cost,
            sum(report.tokens.values()) + gate.reserved_tokens,
            usd,
            tokens,
        )
        if reason is not None:
            if not gate.in_flight:
                gate.on_spent(reason)  # nothing in flight can make room: no attempt ever will
            return math.inf
        gate.in_flight += 1
        gate.reserved_cost += usd
        gate.reserved_tokens += tokens
        entry = self.held.get(id(cost))
        if entry is None:
            self.held[id(cost)] = [1, usd, tokens]
        else:  # a shared constant cost (no estimate): several attempts hold it at once
            entry[0] += 1
        return 0.0

    def peek(self, now: float, cost: Cost) -> float:
        """Room now, or math.inf while attempts are in flight (their end may make some). With
        none in flight the answer is "now": the reservation itself then finds the budget spent
        and ends the run (a math.inf with nobody to wake it would wait forever)."""
        gate = self.gate
        if not gate.in_flight:
            return 0.0
        usd, tokens = self._amounts(cost)
        report = gate.report
        refused = gate.budget.refuses(
            report.cost + gate.reserved_cost,
            sum(report.tokens.values()) + gate.reserved_tokens,
            usd,
            tokens,
        )
        return 0.0 if refused is None else math.inf

    def reconcile(self, reserved: Cost, actual: Cost, now: float) -> None:
        """Nothing: the real spend of an attempt is counted by the run's report as it is
        recorded, and `release` gives its reservation back."""

    def retake(self, reserved: Cost, new: Cost) -> None:
        """Hold `new` instead of `reserved` for an attempt in flight (`Context.reserve`, after
        `grow` said it fits)."""
        entry = self.held.get(id(reserved))
        if entry is None or entry[0] != 1:
            return  # not held here, or a shared constant: never trued up
        usd, tokens = self._amounts(new)
        gate = self.gate
        gate.reserved_cost += usd - entry[1]
        gate.reserved_tokens += tokens - entry[2]
        entry[1], entry[2] = usd, tokens

    def release(self, reserved: Cost, now: float) -> None:
        key = id(reserved)
        entry = self.held.get(key)
        if entry is None:
            return
        gate = self.gate
        gate.in_flight -= 1
        gate.reserved_cost -= entry[1]
        gate.reserved_tokens -= entry[2]
        entry[0] -= 1
        if not entry[0]:
            del self.held[key]
        if gate.watchers:  # an attempt ended: a waiting one may fit now, or learn it never will
            waiting, gate.watchers = gate.watchers, {}
            for wake in waiting:
                wake()

    def hold_until(self, until: float) -> None:
        """A budget is not a rate: a Retry-After does not concern it."""

    def watch(self, wake: Callable[[], None]) -> None:
        self.gate.watchers[wake] = None

    def snapshot(self, now: float) -> dict[str, Any]:
        gate = self.gate
        return {
            "type": "budget",
            "max_cost": gate.budget.max_cost,
            "max_tokens": gate.budget.max_tokens,
            "in_flight": gate.in_flight,
            "reserved_cost": gate.reserved_cost,
            "reserved_tokens": gate.reserved_tokens,
        }
