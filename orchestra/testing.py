"""The fault kit: what you need to test code that runs on orchestra, shipped for users.

- `FakeClock`: virtual time; backoff, timeouts and breaker cool-downs take microseconds.
- `ScriptedAgent` / `scripted(...)`: agents that fail the first N calls, raise 429 with Retry-After,
  hang, return garbage, fail at random with a seed, or die for good — and record every call.
- `Probe`: counts how many calls run at once across agents, to check limits.
- `Recorder`: subscribe it to an orchestrator; it keeps every event, in order.
- `simulate_agent_failure(orch, agent, ...)`, `restore_agent(orch, agent)` and
  `recovery_status(orch)` take a live agent of an orchestrator down, bring it back, and report
  whether the tasks it failed recovered.

```python
from orchestra import Orchestrator, Task
from orchestra.testing import FakeClock, scripted

flaky = scripted("flaky", kinds=["research"], script=["rate_limit", "error"], latency=0.05)
async with Orchestrator(agents=[flaky], clock=FakeClock(), seed=1) as orch:
    result = await orch.run(tasks=[Task("research", i) for i in range(10)])
assert result.status == "success" and flaky.calls[0].outcome == "rate_limit"
```
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from ._agent import check_options
from ._clock import FakeClock
from ._config import check_int, check_number, shown
from ._events import Event, RetryScheduled, TaskFinished
from ._exceptions import ConfigError
from ._faults import GARBAGE, MODES, Fault, FaultMode, Faults, SimulatedAPIError, raise_fault
from ._log import get_logger
from ._task import SUCCEEDED, TERMINAL

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from ._concurrency import Concurrency
    from ._core._context import Context
    from ._registry import AgentSlot, Registry
    from ._retry import RetryPolicy
    from ._task import Task, TaskResult

__all__ = (
    "GARBAGE",
    "Call",
    "FakeClock",
    "Faulty",
    "Probe",
    "Recorder",
    "RecoveryStatus",
    "ScriptedAgent",
    "SimulatedAPIError",
    "recovery_status",
    "restore_agent",
    "scripted",
    "simulate_agent_failure",
)

log = get_logger("orchestra")

E = TypeVar("E", bound=Event)

OUTCOMES = ("ok", *MODES)


@dataclass(slots=True)
class Call:
    """One call of a scripted agent: which task, which attempt, what it did, when (loop time)."""

    task_id: str
    attempt: int
    outcome: str
    started: float
    ended: float | None = None


class Probe:
    """Counts calls in progress across every agent that shares it; `peak` is the most at once.

    A scripted agent given `probe=` counts its calls itself; your own agent counts its work with
    ``with probe.track("name"):``.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.by_agent: dict[str, int] = {}
        self.peak_by_agent: dict[str, int] = {}

    @contextlib.contextmanager
    def track(self, agent: str) -> Iterator[None]:
        """Count the block as one call of `agent` in progress (however it ends)."""
        self.enter(agent)
        try:
            yield
        finally:
            self.exit(agent)

    def enter(self, agent: str) -> None:
        """A call of `agent` began (pair it with `exit`, or use `track`)."""
        self.current += 1
        self.peak = max(self.peak, self.current)
        n = self.by_agent[agent] = self.by_agent.get(agent, 0) + 1
        self.peak_by_agent[agent] = max(self.peak_by_agent.get(agent, 0), n)

    def exit(self, agent: str) -> None:
        """A call of `agent` ended."""
        self.current -= 1
        self.by_agent[agent] -= 1


class Recorder:
    """Every event of the runs it is subscribed to, in order: ``orch.subscribe(recorder := Recorder())``.

    Events are delivered before `run()` returns (or before `async with` ends), so a test reads them
    right after the run.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        """The events of one type, in order."""
        return [e for e in self.events if isinstance(e, kind)]

    def results(self) -> dict[str, TaskResult]:
        """The result of every finished task, by id."""
        return {e.result.task_id: e.result for e in self.of(TaskFinished)}

    def delays(self) -> list[float]:
        """The backoff of every scheduled retry, in order."""
        return [e.delay for e in self.of(RetryScheduled)]


class ScriptedAgent:
    """An agent that plays a script of outcomes, one per call, then `then` for every later call;
    every call is recorded in `calls`. Build it with `scripted(...)` (the same thing).

    Outcomes: "ok", "error" (connection error), "rate_limit" (HTTP 429 with Retry-After
    `retry_after`), "overloaded" (529), "server_error" (500), "hang" (never returns: set a timeout),
    "garbage" (returns `GARBAGE`), "permanent" (`PermanentError`), "slow" (`latency` more),
    "bug" (`ValueError`: a bug of the agent's own code, which no breaker counts).

    Args:
        fail_first: shorthand for a script of that many "error"s.
        failure_rate: after the script, fail this fraction of calls (seeded by `seed`) in `failure_mode`.
        dies_after: after this many calls, every call fails in `die_mode`.
        output: the output (or ``output(task)``); default ``{"agent": name, "task": task.id}``.
        latency, jitter: seconds each call takes (uniform ± jitter), in the loop's time.
        probe: a `Probe` shared with other agents, to measure concurrency.
        concurrency, timeout, retry: the agent's own limit, attempt timeout and retry policy.
    """

    def __init__(
        self,
        name: str,
        kinds: Sequence[str],
        *,
        script: Sequence[str] = (),
        then: str = "ok",
        output: Any | Callable[[Task], Any] = None,
        latency: float = 0.0,
        jitter: float = 0.0,
        fail_first: int = 0,
        failure_rate: float = 0.0,
        failure_mode: str = "error",
        dies_after: int | None = None,
        die_mode: str = "error",
        retry_after: float | None = None,
        seed: int | None = None,
        probe: Probe | None = None,
        concurrency: int | Concurrency | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        # Checked here, as `@agent`'s options are: `kinds="work"` would serve "w", "o", "r" and
        # "k", a negative latency or a string rate fail only inside the first call.
        if not isinstance(name, str) or not name:
            raise ConfigError(f"scripted agent's name must be a non-empty string, got {name!r}")
        check_options(name, kinds, concurrency, timeout, retry=retry)
        where = f"scripted {name!r}: "
        if isinstance(script, str):
            raise ConfigError(f"{where}script must be a list of outcomes, got {script!r}")
        for outcome in (*script, then, failure_mode, die_mode):
            if outcome not in OUTCOMES:
                raise ConfigError(f"{where}unknown outcome {outcome!r}; use one of {OUTCOMES}")
        check_number(f"{where}failure_rate", failure_rate, maximum=1.0)
        check_number(f"{where}latency", latency)
        check_number(f"{where}jitter", jitter)
        check_number(f"{where}retry_after", retry_after, optional=True)
        check_int(f"{where}fail_first", fail_first, minimum=0)
        check_int(f"{where}dies_after", dies_after, minimum=0, optional=True)
        check_int(f"{where}seed", seed, minimum=None, optional=True)
        played = [*script, then]  # the outcomes it can play: "slow" is `latency` more, so 0 is none
        if failure_rate:
            played.append(failure_mode)
        if dies_after is not None:
            played.append(die_mode)
        if "slow" in played and not latency > 0:
            raise ConfigError(f"{where}the 'slow' outcome needs a latency > 0")
        self.name = name
        self.kinds = tuple(kinds)
        self.script = list(script) if script else ["error"] * fail_first
        self.then = then
        self.returns = output  # not `output`: that attribute names an agent's output model
        self.latency = latency
        self.jitter = jitter
        self.failure_rate = failure_rate
        self.failure_mode = failure_mode
        self.dies_after = dies_after
        self.die_mode = die_mode
        self.retry_after = retry_after
        self.rng = random.Random(seed)
        self.probe = probe
        self.concurrency = concurrency
        self.timeout = timeout
        self.retry = retry
        self.calls: list[Call] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def next_outcome(self) -> str:
        n = len(self.calls)
        if self.dies_after is not None and n >= self.dies_after:
            return self.die_mode
        if n < len(self.script):
            return self.script[n]
        if self.failure_rate and self.rng.random() < self.failure_rate:
            return self.failure_mode
        return self.then

    async def __call__(self, task: Task, ctx: Context) -> Any:
        outcome = self.next_outcome()
        delay = self.latency + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        call = Call(task.id or "", ctx.attempt, outcome, anyio.current_time())
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.probe is not None:
            self.probe.enter(self.name)
        try:
            if delay > 0:
                await anyio.sleep(delay)
            if outcome == "ok":
                return self._output(task)
            result = await raise_fault(
                outcome, f"agent {self.name!r}", retry_after=self.retry_after, latency=self.latency
            )
            return self._output(task) if outcome == "slow" else result
        finally:
            call.ended = anyio.current_time()
            self.in_flight -= 1
            if self.probe is not None:
                self.probe.exit(self.name)

    def _output(self, task: Task) -> Any:
        if callable(self.returns):
            return self.returns(task)
        if self.returns is not None:
            return self.returns
        return {"agent": self.name, "task": task.id}

    def outcomes(self) -> list[str]:
        """What each call did, in call order."""
        return [c.outcome for c in self.calls]

    def __repr__(self) -> str:
        return f"ScriptedAgent({self.name!r}, kinds={list(self.kinds)!r}, calls={len(self.calls)})"


scripted = ScriptedAgent
"""`scripted(name, kinds, script=[...], ...)`: build a `ScriptedAgent` (the class's docstring has it all)."""


# -- live faults ----------------------------------------------------------------------------------


class Faulty(Protocol):
    """What the fault kit needs of an orchestrator: its agents, and its table of simulated
    failures (which its runs tell how the tasks a failure hit ended). An `Orchestrator` is one."""

    @property
    def registry(self) -> Registry: ...
    @property
    def faults(self) -> Faults: ...


def simulate_agent_failure(
    orch: Faulty,
    agent: str,
    *,
    mode: FaultMode = "error",
    duration: float | None = None,
    retry_after: float | None = None,
    latency: float = 1.0,
) -> None:
    """Take a live agent of `orch` down: its calls fail in `mode` for `duration` seconds (None:
    until `restore_agent`). Modes: "error" (connection error), "rate_limit" (HTTP 429 with
    Retry-After), "overloaded" (529), "server_error" (500), "hang" (needs an attempt timeout),
    "garbage", "permanent", "slow" (adds `latency`), "bug" (a `ValueError`: the agent's own
    failure, which no breaker counts). Call it from async code, before or during a run."""
    slot = _slot(orch, agent)
    if mode not in MODES:
        raise ConfigError(f"unknown fault mode {shown(mode)}; use one of {', '.join(MODES)}")
    where = "simulate_agent_failure: "
    check_number(f"{where}duration", duration, optional=True)
    check_number(f"{where}retry_after", retry_after, optional=True)
    check_number(f"{where}latency", latency)
    try:
        now = anyio.current_time()
    except RuntimeError:  # anyio's NoEventLoopError
        raise ConfigError(
            "simulate_agent_failure() needs a running event loop: call it from async code"
        ) from None
    fault = Fault(
        agent,
        mode,
        started=now,
        until=None if duration is None else now + duration,
        retry_after=retry_after,
        latency=latency,
    )
    slot.fault = fault
    orch.faults.put(fault)
    log.warning("simulated agent failure", agent=agent, mode=mode, duration=duration)


def restore_agent(orch: Faulty, agent: str) -> None:
    """End a simulated failure of `orch`'s `agent` now."""
    slot = _slot(orch, agent)
    if slot.fault is not None:
        slot.fault.until = anyio.current_time()
        slot.fault = None


def recovery_status(orch: Faulty) -> RecoveryStatus:
    """ "recovered" when every task that a simulated failure of `orch`'s agents hit finished
    successfully through retries or fallbacks; "degraded" while some are unfinished; "failed" if
    some failed. The returned string carries the details: `.pending`, `.failed`, `.agents`."""
    faults = orch.faults
    pending: list[str] = []
    failed: list[str] = []
    for fault in faults.by_agent.values():
        for task_id in sorted(fault.affected):
            state = faults.state_of(task_id)
            if state is None or state not in TERMINAL:
                pending.append(task_id)
            elif state != SUCCEEDED:
                failed.append(task_id)
    state = "failed" if failed else "degraded" if pending else "recovered"
    return RecoveryStatus(state, agents=sorted(faults.by_agent), pending=pending, failed=failed)


def _slot(orch: Faulty, agent: str) -> AgentSlot:
    slot = orch.registry.slots.get(agent)
    if slot is None:
        raise ConfigError(f"unknown agent {shown(agent)}; known: {sorted(orch.registry.slots)}")
    return slot


class RecoveryStatus(str):
    """A str ("recovered", "degraded" or "failed") with the details of what is not recovered."""

    agents: list[str]
    pending: list[str]
    failed: list[str]

    def __new__(
        cls, state: str, *, agents: list[str], pending: list[str], failed: list[str]
    ) -> RecoveryStatus:
        self = super().__new__(cls, state)
        self.agents = agents
        self.pending = pending
        self.failed = failed
        return self

    def describe(self) -> str:
        if self == "recovered":
            if not self.agents:
                return "recovered: no simulated failure is injected"
            return f"recovered: every task hit by failures of {self.agents} succeeded"
        return (
            f"{self}: pending {self.pending}, failed {self.failed} (faulty agents: {self.agents})"
        )
