"""The registry: the agents of an orchestrator by name and by kind, with their health and load.

An `AgentSlot` is the runtime side of one agent: how many tasks it runs now and may run, its circuit
breaker, its policies and counters. Slots live as long as the orchestrator, so per-agent limits and
breakers hold across concurrent runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Literal

from ._agent import Agent, AgentLike, check_call, check_options
from ._breaker import CLOSED, OPEN, Breaker, BreakerPolicy
from ._concurrency import Concurrency
from ._config import shown
from ._exceptions import ConfigError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from pydantic import BaseModel

    from ._core._context import Context
    from ._limits import Limiter
    from ._retry import RetryPolicy
    from ._task import Task

__all__ = ("AgentSlot", "AgentState", "Registry")

# What an agent is doing now: `AgentStatus.state` of a run's status, `agents_status()`.
AgentState = Literal["idle", "busy", "failing", "open"]
UNLIMITED = sys.maxsize


class AgentSlot:
    """One registered agent at run time."""

    __slots__ = (
        "agent",
        "attempts",
        "bare",
        "breaker",
        "call",
        "estimate",
        "failures",
        "fault",
        "in_flight",
        "input",
        "kinds",
        "last_error",
        "limit",
        "limiters",
        "name",
        "output",
        "paused_until",
        "retry",
        "succeeded",
        "timeout",
    )

    def __init__(self, agent: AgentLike, breaker: BreakerPolicy | None) -> None:
        concurrency = getattr(agent, "concurrency", None)
        timeout = getattr(agent, "timeout", None)
        limits = getattr(agent, "limits", None) or ()
        check_options(
            agent.name,
            agent.kinds,
            concurrency,
            timeout,
            retry=getattr(agent, "retry", None),
            input=getattr(agent, "input", None),
            output=getattr(agent, "output", None),
            limits=limits,
        )
        self.agent = agent
        self.name: str = agent.name
        self.kinds: tuple[str, ...] = tuple(agent.kinds)
        # An `Agent`'s own function is awaited directly: one frame less per call.
        self.call: Callable[[Task, Context], Awaitable[Any]] = (
            agent.direct() if isinstance(agent, Agent) else agent
        )
        # An agent's own int limit is a plain counter (`in_flight < limit`: the hot path); limit
        # objects, which may be shared with other agents and orchestrators, are reserved through
        # the `Limiter` protocol before each attempt.
        shared = isinstance(concurrency, Concurrency)
        self.limit: int = UNLIMITED if concurrency is None or shared else concurrency
        self.limiters: tuple[Limiter, ...] = ((concurrency,) if shared else ()) + tuple(limits)
        # What an attempt reserves on `limiters` before its call (its true cost is reconciled after
        # it from `ctx.record_usage`): one request, and the agent's own estimate if it has one.
        self.estimate: Callable[[Task], Mapping[str, float]] | None = getattr(
            agent, "estimate", None
        )
        self.input = _model(agent, "input")
        self.output = _model(agent, "output")
        self.retry: RetryPolicy | None = getattr(agent, "retry", None)
        self.timeout: float | None = timeout
        self.bare = timeout is None and self.output is None  # nothing of its own around a call
        self.breaker = Breaker(breaker)
        self.in_flight = 0
        # A rate limit's Retry-After: no task starts on this agent before this loop time (0: none).
        self.paused_until = 0.0
        self.attempts = 0
        self.succeeded = 0
        self.failures = 0
        self.last_error: str | None = None
        self.fault: Any = None  # set by orchestra.testing.simulate_agent_failure

    def status(self) -> AgentState:
        if self.breaker.state is OPEN:
            return "open"
        if self.breaker.state is not CLOSED or self.breaker.failing:
            return "failing"
        return "busy" if self.in_flight else "idle"

    @property
    def concurrent(self) -> int:
        """How many attempts it can run at once: its own limit, or a shared `Concurrency`'s when
        that is lower (`UNLIMITED`: neither). What the ETA and a worker process's claims count."""
        limit = self.limit
        for limiter in self.limiters:
            if isinstance(limiter, Concurrency) and limiter.limit < limit:
                limit = limiter.limit
        return limit

    @property
    def load(self) -> float:
        """In-flight tasks over the agent's limit (0 for an agent without a limit and nothing running)."""
        return self.in_flight / self.limit if self.limit != UNLIMITED else float(self.in_flight)

    def next_probe_in(self, now: float) -> float | None:
        """Seconds until its open breaker lets a probe through (0: due, or under way); None
        while the breaker is closed."""
        breaker = self.breaker
        if breaker.state is CLOSED:
            return None
        return breaker.reopens_in(now)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "kinds": list(self.kinds),
            "status": self.status(),
            "breaker": self.breaker.state,
            "next_probe_in": self.next_probe_in(now),
            "health_failures": self.breaker.health_failures,
            "in_flight": self.in_flight,
            "limit": None if self.limit == UNLIMITED else self.limit,
            "attempts": self.attempts,
            "succeeded": self.succeeded,
            "failures": self.failures,
            "last_error": self.last_error,
        }


def _model(agent: AgentLike, field: str) -> type[BaseModel] | None:
    model: type[BaseModel] | None = getattr(agent, field, None)  # checked by `check_options`
    return model


class Registry:
    """Agents by name and by kind, and the fallback chain of each kind."""

    __slots__ = ("by_kind", "chains", "cursor", "slots")

    def __init__(
        self,
        agents: Sequence[AgentLike],
        breaker: BreakerPolicy | None,
        fallbacks: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.slots: dict[str, AgentSlot] = {}
        self.by_kind: dict[str, list[AgentSlot]] = {}
        self.cursor: dict[str, int] = {}  # where each kind's rotation of agents stands
        for agent in agents:
            if not isinstance(agent, AgentLike) or not isinstance(
                getattr(agent, "name", None), str
            ):
                raise ConfigError(
                    f"{shown(agent)} is not an agent: decorate a function with @agent(kinds=[...]) "
                    "or give the object `name`, `kinds` and `async def __call__(task, ctx)`"
                )
            if not isinstance(agent, Agent):  # `@agent` checked its function when it was made
                check_call(agent.name, agent)
            if agent.name in self.slots:
                raise ConfigError(f"two agents are named {agent.name!r}; give one another name=")
            slot = AgentSlot(agent, breaker)
            self.slots[slot.name] = slot
            for kind in slot.kinds:
                self.by_kind.setdefault(kind, []).append(slot)
        # An explicit chain is followed in order. Without one, the agents serving the kind share the
        # load (least loaded first) and the others are the fallbacks of the one picked.
        self.chains: dict[str, tuple[AgentSlot, ...]] = {}
        for kind, names in (fallbacks or {}).items():
            if isinstance(names, str) or not names:
                raise ConfigError(f"fallbacks[{kind!r}] must be a non-empty list of agent names")
            chain = []
            for name in names:
                if name not in self.slots:
                    raise ConfigError(
                        f"fallbacks[{kind!r}] names unknown agent {name!r}; known: {sorted(self.slots)}"
                    )
                chain.append(self.slots[name])
            self.chains[kind] = tuple(chain)
            self.by_kind.setdefault(kind, [])
            for slot in chain:
                if slot not in self.by_kind[kind]:
                    self.by_kind[kind].append(slot)

    def input_models(self) -> dict[str, list[type[BaseModel]]]:
        """The input models declared by the agents of each kind (payloads are validated at admission)."""
        models: dict[str, list[type[BaseModel]]] = {}
        for kind, slots in self.by_kind.items():
            found = list(dict.fromkeys(s.input for s in slots if s.input is not None))
            if found:
                models[kind] = found
        return models

    def serves(self, kind: str) -> bool:
        return bool(self.by_kind.get(kind))

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """Every agent's `AgentSlot.snapshot` at loop time `now`."""
        return [slot.snapshot(now) for slot in self.slots.values()]
