"""A run's spending budget: `Orchestrator(max_cost=..., max_tokens=...)`, in three parts: the
user's `BudgetPolicy` (the limits), a run's `BudgetAccount` (what its attempts in flight reserved,
against what its report says was spent), and a `BudgetLimiter` per agent of the run (the account
as one more limiter on that agent, pricing reservations with the agent's `cost_of`).

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

The budget is one more limiter on every agent of the run (`BudgetAccount.limiters`), reserved after
the agent's own, so it reuses the dispatcher's waiting (a task the budget refuses waits at the
head of its agent's lane and is woken when an attempt ends). A run without a budget has no
account: nothing is reserved, checked or counted for it.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any, Protocol

from ._config import check_int, check_number
from ._limits import REQUESTS
from ._log import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._limits import Cost, Limiter

__all__ = (
    "BUDGET_EXCEEDED",
    "BudgetAccount",
    "BudgetLimiter",
    "BudgetPolicy",
    "LimitedAgent",
    "Spent",
)

BUDGET_EXCEEDED = "BudgetExceeded"
"""The `error_type` of the tasks a spent budget ended."""

log = get_logger("orchestra")

_SLACK = 1e-9  # relative: N calls of c USD fit a budget of N * c USD despite float rounding


class Spent(Protocol):
    """What a run has spent so far, as its report counts it (`ctx.record_usage` adds to it)."""

    @property
    def cost(self) -> float: ...

    @property
    def tokens(self) -> Mapping[str, int]: ...


class LimitedAgent(Protocol):
    """An agent of a run as the account sees it (the registry's `AgentSlot`): the agent, whose
    `cost_of` (if it has one) prices a reservation, and its own limiters."""

    @property
    def agent(self) -> object: ...

    @property
    def limiters(self) -> tuple[Limiter, ...]: ...


class BudgetPolicy:
    """The user's budget: the most a run may spend, in USD (`max_cost`) and in tokens of every kind
    together (`max_tokens`)."""

    __slots__ = ("max_cost", "max_tokens")

    def __init__(self, *, max_cost: float | None = None, max_tokens: int | None = None) -> None:
        check_number("max_cost", max_cost, positive=True, optional=True)
        check_int("max_tokens", max_tokens, optional=True)
        self.max_cost = max_cost
        self.max_tokens = max_tokens

    @classmethod
    def of(cls, *, max_cost: float | None, max_tokens: int | None) -> BudgetPolicy | None:
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
        return f"BudgetPolicy(max_cost={self.max_cost!r}, max_tokens={self.max_tokens!r})"


class BudgetAccount:
    """One run's spending account against its `BudgetPolicy` (see the module docstring).

    `spent` is the run's report (the spend so far); the account holds what the attempts in
    flight reserved. `on_spent(reason)` is called once, when an attempt does not fit and none is
    in flight: the run ends."""

    __slots__ = (
        "_limiters",
        "in_flight",
        "on_spent",
        "policy",
        "reserved_cost",
        "reserved_tokens",
        "spent",
        "waiting",
        "watchers",
    )

    def __init__(self, policy: BudgetPolicy, spent: Spent, on_spent: Callable[[str], None]) -> None:
        self.policy = policy
        self.spent = spent
        self.on_spent = on_spent
        self.in_flight = 0
        self.reserved_cost = 0.0
        self.reserved_tokens = 0.0
        self.waiting = 0  # attempts in flight waiting in `BudgetLimiter.grow`
        self.watchers: dict[Callable[[], None], None] = {}  # refused attempts' lanes
        self._limiters: dict[LimitedAgent, tuple[Limiter, ...]] = {}

    def limiters(self, slot: LimitedAgent) -> tuple[Limiter, ...]:
        """What an attempt of `slot` reserves in this run: the agent's limits, then the budget
        (last: it is never taken and given back because a rate had no room)."""
        limiters = self._limiters.get(slot)
        if limiters is None:
            budget = BudgetLimiter(self, getattr(slot.agent, "cost_of", None))
            limiters = self._limiters[slot] = (*slot.limiters, budget)
        return limiters


class BudgetLimiter:
    """A run's budget as one agent's limiter: it prices a reservation with the agent's `cost_of`.

    Reservations are kept by identity (an attempt's cost is its own mapping, trued up in place by
    `Context.reserve`), so what comes back at the end is what was taken, however it was trued up.
    """

    __slots__ = ("account", "held", "price")

    def __init__(
        self, account: BudgetAccount, price: Callable[[Mapping[str, float]], float] | None
    ) -> None:
        self.account = account
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
        account = self.account
        entry = self.held.get(id(reserved))
        had_usd, had_tokens = (0.0, 0.0) if entry is None else (entry[1], entry[2])
        usd, tokens = self._amounts(new)
        spent = account.spent
        return account.policy.refuses(
            spent.cost + account.reserved_cost - had_usd,
            sum(spent.tokens.values()) + account.reserved_tokens - had_tokens,
            usd,
            tokens,
        )

    async def grow(self, reserved: Cost, new: Cost) -> None:
        """Wait until the reservation of an attempt in flight may grow to `new` before its call
        (`Context.reserve`): while it does not fit, the attempts in flight may make room as they
        end; when every other one waits too, none can, and the run ends (it cancels this
        attempt: its task ends cancelled with ``BudgetExceeded``, its call never sent)."""
        account = self.account
        while (reason := self.fits(reserved, new)) is not None:
            if account.in_flight - account.waiting <= 1:
                account.on_spent(reason)
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()

            def wake(woken: asyncio.Future[None] = woken) -> None:
                if not woken.done():
                    woken.set_result(None)

            account.watchers[wake] = None
            account.waiting += 1
            try:
                await woken  # the run's end cancels it when on_spent was called
            finally:
                account.waiting -= 1
                account.watchers.pop(wake, None)

    def reserve(self, now: float, cost: Cost) -> float:
        account = self.account
        usd, tokens = self._amounts(cost)
        spent = account.spent
        reason = account.policy.refuses(
            spent.cost + account.reserved_cost,
            sum(spent.tokens.values()) + account.reserved_tokens,
            usd,
            tokens,
        )
        if reason is not None:
            if not account.in_flight:
                account.on_spent(reason)  # nothing in flight can make room: no attempt ever will
            return math.inf
        account.in_flight += 1
        account.reserved_cost += usd
        account.reserved_tokens += tokens
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
        account = self.account
        if not account.in_flight:
            return 0.0
        usd, tokens = self._amounts(cost)
        spent = account.spent
        refused = account.policy.refuses(
            spent.cost + account.reserved_cost,
            sum(spent.tokens.values()) + account.reserved_tokens,
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
        account = self.account
        account.reserved_cost += usd - entry[1]
        account.reserved_tokens += tokens - entry[2]
        entry[1], entry[2] = usd, tokens

    def release(self, reserved: Cost, now: float) -> None:
        key = id(reserved)
        entry = self.held.get(key)
        if entry is None:
            return
        account = self.account
        account.in_flight -= 1
        account.reserved_cost -= entry[1]
        account.reserved_tokens -= entry[2]
        entry[0] -= 1
        if not entry[0]:
            del self.held[key]
        if account.watchers:  # an attempt ended: a waiting one may fit now, or learn it never will
            waiting, account.watchers = account.watchers, {}
            for wake in waiting:
                wake()

    def hold_until(self, until: float) -> None:
        """A budget is not a rate: a Retry-After does not concern it."""

    def watch(self, wake: Callable[[], None]) -> None:
        self.account.watchers[wake] = None

    def snapshot(self, now: float) -> dict[str, Any]:
        account = self.account
        return {
            "type": "budget",
            "max_cost": account.policy.max_cost,
            "max_tokens": account.policy.max_tokens,
            "in_flight": account.in_flight,
            "reserved_cost": account.reserved_cost,
            "reserved_tokens": account.reserved_tokens,
        }
