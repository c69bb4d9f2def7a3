"""Instruments: metrics and tracing hooks, called in line by the run, free when there are none.

An `Instrument` hears a run start and end, every attempt start and end, every retry and fallback
and every task end, synchronously, from the code that makes them happen. The event bus
(`_events.py`) is the other way to watch a run, and the wrong one here, for two reasons:

- Its buffers are bounded and drop when full, so that a slow dashboard never slows a run: right for
  a progress bar, wrong for a counter that must be exact (`orchestra_attempts_total` must equal
  `metadata.attempts`, whatever the load).
- It delivers later, from another task. A tracing span must be the *current* context while the
  agent runs, in the dispatcher's runner that awaits the call, so that the spans the agent's code
  makes (an httpx or anthropic instrumentation) nest under the attempt's span. Only a hook that
  runs in the runner, around the agent call, can do that (as `_dispatch.py` sets the structlog
  task id: each runner runs in its own copy of the context, so what a hook attaches there never
  leaks out).

Zero cost when off: an orchestrator without instruments has `instruments=None` in its run config,
and the dispatcher reads that one attribute per attempt (and the run once per task end); nothing
is built, nothing is called. With instruments, one `AttemptInfo` is built per attempt and only the
hooks an instrument overrides are called.

A hook that raises is logged once (per instrument and hook; later ones are only counted in
`Instruments.errors`) and never breaks the run: an instrument is an observer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from .._clock import current_clock
from .._failure import cancel_pending
from .._log import get_logger

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._task import Task, TaskResult
    from ._context import Context
    from ._orchestrator import Orchestrator

__all__ = ("AttemptInfo", "Instrument", "Instruments", "Owner", "RunInfo")

log = get_logger("orchestra.instruments")

T = TypeVar("T")

SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"

_HOOKS: Final = (
    "on_run_start",
    "on_attempt_start",
    "on_attempt_end",
    "on_retry",
    "on_fallback",
    "on_task_end",
    "on_run_end",
)


class Instrument:
    """Base class of metrics and tracing instruments: override the hooks you need.

    ``Orchestrator(instruments=[...])`` takes any object with some of these methods; subclassing
    this class documents the signatures and lets mypy check them. Only the hooks an instrument
    overrides are called (a hook left as the base's no-op costs nothing).

    Every hook is called synchronously by the run, in the order things happen: `on_attempt_start`
    and `on_attempt_end` in the task that awaits the agent call, around it (the attempt's context
    is the agent's), `on_attempt_end` before the retry, fallback or task end it leads to. Hooks must
    be quick (they run on the run's path) and must not block; what they raise is logged once and
    ignored.
    """

    def on_attach(self, orchestrator: Orchestrator) -> None:
        """The instrument was given to `orchestrator` (at its construction): read its agents."""

    def on_run_start(self, run: RunInfo) -> None:
        """A run started (after a whole input was admitted: an input error starts no run)."""

    def on_attempt_start(self, attempt: AttemptInfo) -> None:
        """An agent is about to be called on a task, in the task that will await the call."""

    def on_attempt_end(self, attempt: AttemptInfo) -> None:
        """The attempt ended: `attempt.outcome` is "succeeded", "failed" (`attempt.error` says
        what it raised) or "cancelled" (the run was cancelled or the task's deadline passed)."""

    def on_retry(self, run: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        """`task`'s failed attempt number `attempt` on `agent` will be followed by another on the
        same agent in `delay` seconds."""

    def on_fallback(
        self, run: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        """`task` moves from `from_agent` to the next agent of its chain (None: none is left)."""

    def on_task_end(self, run: RunInfo, result: TaskResult) -> None:
        """A task reached its terminal state (`result.status`); exactly once per task."""

    def on_run_end(self, run: RunInfo, status: str, elapsed: float) -> None:
        """The run ended with `status` ("success", "partial", "failed", "cancelled")."""


class Owner(Protocol):
    """What `RunInfo` reads of its run: its clock and its live counts."""

    def now(self) -> float: ...
    @property
    def running(self) -> int: ...
    @property
    def unfinished(self) -> int: ...
    @property
    def waiting(self) -> int: ...


class RunInfo:
    """What an instrument sees of a run: its id, its clock, and its live counts (read them at
    scrape time: each is an attribute read, cheap enough to poll)."""

    __slots__ = ("_offset", "_run", "run_id", "started")

    def __init__(self, run_id: str, started: float, run: Owner) -> None:
        self._run = run
        self.run_id = run_id
        self.started = started
        # Loop time -> epoch seconds, fixed at the start (virtual under a FakeClock).
        self._offset = current_clock().to_wall(0.0)

    def now(self) -> float:
        """The run's clock (the event loop's, in seconds): the times of `AttemptInfo`."""
        return self._run.now()

    def to_wall(self, t: float) -> float:
        """Epoch seconds for the run clock's `t` (what exporters want)."""
        return t + self._offset

    @property
    def running(self) -> int:
        """Attempts running now."""
        return self._run.running

    @property
    def unfinished(self) -> int:
        """Admitted tasks not yet terminal."""
        return self._run.unfinished

    @property
    def waiting(self) -> int:
        """Admitted tasks waiting for their dependencies (never ready yet)."""
        return self._run.waiting

    @property
    def queued(self) -> int:
        """Tasks ready or due later (a retry, a rate limit, a breaker) that no attempt runs: the
        queue depth."""
        return max(0, self.unfinished - self.waiting - self.running)

    def __repr__(self) -> str:
        return f"RunInfo(run_id={self.run_id!r})"


class AttemptInfo:
    """One attempt, as instruments see it. Built only when an orchestrator has instruments.

    `number` counts the task's attempts from 1; `started` and `ended` are run-clock times
    (`RunInfo.now()`); `outcome`, `error`, `error_type` and `usage` are set when it ends.
    `state` is free for one instrument to keep what it needs until the end (a span, say); with
    several instruments, each keys its own entry: `state` starts as None.
    """

    __slots__ = (
        "agent",
        "ctx",
        "ended",
        "error",
        "error_type",
        "kind",
        "number",
        "outcome",
        "run",
        "started",
        "state",
        "task",
    )

    def __init__(
        self, run: RunInfo, task: Task, agent: str, number: int, started: float, ctx: Context
    ) -> None:
        self.run = run
        self.task = task
        self.kind: str = task.kind
        self.agent = agent
        self.number = number
        self.started = started
        self.ctx = ctx
        self.ended = started
        self.outcome: str | None = None
        self.error: BaseException | None = None
        self.error_type: str | None = None
        self.state: dict[Any, Any] | None = None

    @property
    def duration(self) -> float:
        return self.ended - self.started

    @property
    def usage(self) -> dict[str, int] | None:
        """The units the agent recorded with `ctx.record_usage` (tokens), if any."""
        return self.ctx._usage

    def __repr__(self) -> str:
        return (
            f"AttemptInfo(task_id={self.task.id!r}, agent={self.agent!r}, number={self.number}, "
            f"outcome={self.outcome!r})"
        )


class Instruments:
    """The instruments of one orchestrator, hook by hook (only the overridden ones), each call
    guarded. Built by `Instruments.of`, which gives None when there are none: the run's one check."""

    __slots__ = (
        "_attempt_end",
        "_attempt_start",
        "_fallback",
        "_logged",
        "_retry",
        "_run_end",
        "_run_start",
        "_task_end",
        "errors",
        "instruments",
    )

    def __init__(self, instruments: Sequence[object]) -> None:
        self.instruments = tuple(instruments)
        hooks: dict[str, list[Callable[..., None]]] = {name: [] for name in _HOOKS}
        for instrument in self.instruments:
            for name in _HOOKS:
                hook = _overridden(instrument, name)
                if hook is not None:
                    hooks[name].append(hook)
        self._run_start = tuple(hooks["on_run_start"])
        self._attempt_start = tuple(hooks["on_attempt_start"])
        # Ends in reverse order of starts: what an instrument attached to the context at the
        # start (a span) is detached in the order contexts nest.
        self._attempt_end = tuple(reversed(hooks["on_attempt_end"]))
        self._retry = tuple(hooks["on_retry"])
        self._fallback = tuple(hooks["on_fallback"])
        self._task_end = tuple(hooks["on_task_end"])
        self._run_end = tuple(reversed(hooks["on_run_end"]))
        self._logged: set[tuple[int, str]] = set()
        self.errors = 0

    @classmethod
    def of(cls, instruments: Sequence[object] | None) -> Instruments | None:
        """The fan-out of `instruments`, or None when there are none (nothing to call, ever)."""
        return cls(instruments) if instruments else None

    def attach(self, orchestrator: Orchestrator) -> None:
        for instrument in self.instruments:
            hook = _overridden(instrument, "on_attach")
            if hook is not None:
                hook(orchestrator)  # at construction: a failure here is the caller's to see

    # -- the run's calls ---------------------------------------------------------------------------

    def run_started(self, info: RunInfo) -> None:
        for hook in self._run_start:
            try:
                hook(info)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    def run_ended(self, info: RunInfo, status: str, elapsed: float) -> None:
        for hook in self._run_end:
            try:
                hook(info, status, elapsed)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    def task_ended(self, info: RunInfo, result: TaskResult) -> None:
        for hook in self._task_end:
            try:
                hook(info, result)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    def retried(self, info: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        for hook in self._retry:
            try:
                hook(info, task, agent, attempt, delay)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    def fell_back(
        self, info: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        for hook in self._fallback:
            try:
                hook(info, task, from_agent, to_agent, reason)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    async def attempt(self, call: Awaitable[T], attempt: AttemptInfo) -> T:
        """Await `call` (the agent call with its checks) between the attempt's start and end
        hooks, in the caller's task: the context a start hook attaches is the agent's."""
        for hook in self._attempt_start:
            try:
                hook(attempt)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)
        try:
            output = await call
        except BaseException as exc:
            attempt.ended = attempt.run.now()
            if isinstance(exc, asyncio.CancelledError) and cancel_pending():
                attempt.outcome = CANCELLED  # ours: the run's cancel or the task's deadline
            else:
                attempt.outcome = FAILED
                attempt.error = exc
                attempt.error_type = _type_name(exc)
            self._ended(attempt)
            raise
        attempt.ended = attempt.run.now()
        attempt.outcome = SUCCEEDED
        self._ended(attempt)
        return output

    def _ended(self, attempt: AttemptInfo) -> None:
        for hook in self._attempt_end:
            try:
                hook(attempt)
            except (Exception, asyncio.CancelledError):
                self._raised(hook)

    def _raised(self, hook: Callable[..., None]) -> None:
        """A hook raised: log it the first time (per instrument and hook), count it always."""
        self.errors += 1
        owner = getattr(hook, "__self__", hook)
        key = (id(owner), getattr(hook, "__name__", "?"))
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning(
            "instrument raised; its later errors are only counted",
            instrument=repr(owner),
            hook=key[1],
            exc_info=True,
        )


def _overridden(instrument: object, name: str) -> Callable[..., None] | None:
    """`instrument`'s `name` hook, unless it is missing or the base class's no-op."""
    hook = getattr(instrument, name, None)
    if hook is None or not callable(hook):
        return None
    if getattr(type(instrument), name, None) is getattr(Instrument, name):
        return None
    return hook  # type: ignore[no-any-return]


def last_agent(result: TaskResult) -> str:
    """The agent a task ended on: the one that succeeded, else the last one tried ("" if none)."""
    if result.agent is not None:
        return result.agent
    failures = result.failures
    return failures[-1].agent if failures else ""


def has_hooks(instrument: object) -> bool:
    """Whether `instrument` overrides at least one hook (what `instruments=` checks)."""
    return any(_overridden(instrument, name) for name in (*_HOOKS, "on_attach"))


def _type_name(exc: BaseException) -> str:
    name = getattr(type(exc), "__name__", None)
    return name if isinstance(name, str) else "Exception"
