"""The context an agent receives with each attempt: dependencies' outputs, feedback, spawning, logging."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Protocol

from .._budget import BudgetLimiter
from .._config import finite
from .._exceptions import InputError
from .._limits import REQUESTS
from .._log import get_logger
from .._rate import Rate
from ._routing import DEFAULT_COST

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .._limits import Cost, Limiter
    from .._record import Record
    from .._task import Task
    from ..stores._protocol import RunStore

__all__ = ("Context", "Owner")


class Owner(Protocol):
    """What a context asks of its run: its id, its store (for the dependencies' outputs and to
    check a spawn) and its report (for what the attempt spent)."""

    run_id: str
    store: RunStore

    def record_usage(
        self,
        cost: float,
        tokens: Mapping[str, int],
        agent: str | None = None,
        model: str | None = None,
    ) -> None: ...


class Context:
    """What an agent knows of the run while it handles one attempt.

    Attributes:
        run_id: the run's id.
        task: the task being handled.
        agent: the name of the agent called.
        attempt: the attempt number of this task, from 1, across every agent of its chain.
        feedback: what went wrong in earlier attempts (verifier feedback and error messages), oldest
            first; empty on the first attempt.
    """

    # The attempt's side (`_attempt.py`, and the runner's reuse of a context in `_dispatch.py`)
    # reads and sets the underscored fields directly, on purpose: a context is built or reused
    # for every attempt, and an accessor call per field there costs more than the budget of a
    # no-op task's dispatch allows. They are `_spawned`, `_usage` (what the agent did: spawns,
    # usage), `_reserved` (set when the attempt reserved on limits), `_judging` (set while its
    # output is judged), `_threads` / `_on_end` (`keep_slot`'s count and what ends it).
    __slots__ = (
        "_judging",
        "_on_end",
        "_record",
        "_reserved",
        "_run",
        "_spawned",
        "_threads",
        "_usage",
        "agent",
        "attempt",
        "feedback",
        "run_id",
        "task",
    )

    # Set by the attempt once the call returned and its output is being judged (the output
    # model, the verifier): what raises then is not the agent's failure. Unset until then, and
    # read with a default, so building a context costs nothing more.
    _judging: bool

    def __init__(
        self, run: Owner, record: Record, agent: str, attempt: int, feedback: Sequence[str]
    ) -> None:
        self._run = run
        self._record = record
        self._spawned: dict[str, Task] | None = None  # by id: checking a spawn is O(1)
        self._usage: dict[str, int] | None = None  # this attempt's, for the agent's limits
        self._threads = 0  # threads of this attempt still running (see `keep_slot`)
        self._on_end: Callable[[], None] | None = None
        # What the attempt reserved before its call, and on which limiters (set by the
        # attempt when it reserved anything): `reserve` trues it up.
        self._reserved: tuple[Cost, tuple[Limiter, ...]] | None = None
        self.run_id = run.run_id
        self.task: Task = record.task
        self.agent = agent
        self.attempt = attempt
        self.feedback = feedback

    @property
    def deps(self) -> Mapping[str, Any]:
        """The outputs of this task's dependencies (and of the members of the groups it waits for), by id."""
        return self._run.store.deps_of(self._record)

    def spawn(self, task: Task) -> Task:
        """Add a task to the run. It is checked now (an `InputError` names what is wrong) and admitted
        when this attempt succeeds; a failed attempt's spawns are dropped, so a retry may spawn the
        same ids again."""
        spawned = self._spawned
        if spawned is None:
            spawned = self._spawned = {}
        self._run.store.check_spawn(task, self._record, spawned)
        spawned[task.id] = task
        return task

    def record_usage(self, *, cost: float = 0.0, model: str | None = None, **tokens: int) -> None:
        """Count tokens (input_tokens=..., output_tokens=...) and cost of this attempt in the run's
        metadata, in total, per agent and, given `model`, per model. The agent's limits
        (`@agent(limits=[Rate(..., unit="input_tokens")])`) are trued up with them when the
        attempt ends; a run budget (`max_cost=`, `max_tokens=`) is checked against them.

        Raises `InputError` (failing the attempt, not the run) for a cost or count that is not a
        finite number >= 0, or a `model` that is not a str: counted, a NaN or a negative cost
        would defeat the budget, and a NaN count or a non-str model failed the run's result."""
        for name, value in (("cost", cost), *tokens.items()):
            if (
                type(value) is bool
                or not isinstance(value, int | float)
                or not finite(value)
                or value < 0
            ):
                raise InputError(
                    f"record_usage: {name} must be a finite number >= 0, got {value!r}",
                    field=name,
                )
        if model is not None and not isinstance(model, str):
            raise InputError(
                f"record_usage: model must be a str or None, got {model!r}", field="model"
            )
        self._run.record_usage(cost, tokens, self.agent, model)
        usage = self._usage
        if usage is None:
            usage = self._usage = {}
        for unit, n in tokens.items():
            usage[unit] = usage.get(unit, 0) + n

    @property
    def reserved(self) -> Mapping[str, float]:
        """What this attempt holds on its agent's limits (``{"requests": 1, "input_tokens": ...}``:
        its estimate, as `reserve` trued it up); empty when it reserved nothing."""
        reserved = self._reserved
        if reserved is None or isinstance(reserved[0], int | float):
            return {}
        return dict(reserved[0])

    async def reserve(self, **units: float) -> None:
        """Reserve `units` more (``input_tokens=800``; negative: give back) of this attempt on its
        agent's limits, now, before the call they are for: for an agent that learns what the call
        will cost during the attempt (the Claude agent's ``count_tokens=True``).

        Waits until every rate of the agent has room for the increase (a rate is never overrun
        by a correction; a Retry-After hold is waited out too), then takes it; a decrease is
        given back at once. The attempt's reservation is trued up in place, so its end reconciles
        against what was really held, and the run's budget counts the new amount. Nothing to do
        when the attempt reserved nothing (an agent without limits, in a run without a budget).
        """
        for unit, n in units.items():  # a NaN would poison the shared limiter's meter for good
            if type(n) is bool or not isinstance(n, int | float) or not finite(n):
                raise InputError(f"reserve: {unit} must be a finite number, got {n!r}", field=unit)
        reserved = self._reserved
        if reserved is None:
            return
        cost, limiters = reserved
        if not isinstance(cost, dict) or cost is DEFAULT_COST:  # the shared default: read-only
            raise InputError(
                f"agent {self.agent!r}: ctx.reserve needs an agent with an estimate(task) of "
                "the units it reserves"
            )
        new = dict(cost)
        more: dict[str, float] = {REQUESTS: 0}
        for unit, n in units.items():
            new[unit] = new.get(unit, 0) + n
            if n > 0 and unit != REQUESTS:
                more[unit] = n
        rates = [limiter for limiter in limiters if isinstance(limiter, Rate)]
        budget = limiters[-1] if limiters and isinstance(limiters[-1], BudgetLimiter) else None
        grower = budget if len(more) > 1 else None  # the budget has a say only on growth
        # Written by hand on the limiters' own `peek` (they never sleep: see `_limits`): the
        # attempt holds its other slots meanwhile, which is what it would hold on a slow call.
        loop = asyncio.get_running_loop()
        while True:
            if grower is not None:  # the run's budget first: it may end the run instead
                await grower.grow(cost, new)
            now = loop.time()
            room = max((rate.peek(now, more) for rate in rates), default=0.0)
            if room > now:
                await asyncio.sleep(room - now)
                continue
            if grower is None or grower.fits(cost, new) is None:
                break
        for limiter in limiters:  # no await since the peek: nobody took the room meanwhile
            limiter.reconcile(cost, new, now)
        if budget is not None:
            budget.retake(cost, new)
        cost.clear()
        cost.update(new)

    def keep_slot(self) -> Callable[[], None]:
        """Keep this attempt's slots (the agent's, the orchestrator's, its limits') taken after
        the attempt ends, until the returned function is called, once, from any thread: for
        work the event loop cannot interrupt and may abandon on a timeout or a cancel (a thread
        of the agent's own: ``asyncio.to_thread``), so that it keeps counting against the limits
        until it really ends. Call it before that work starts and the function when it ends,
        however it ends (a ``finally`` in the thread); the ready-made thread agents do."""
        self._threads += 1
        loop = asyncio.get_running_loop()

        def release() -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing is left to free
                loop.call_soon_threadsafe(self._released)

        return release

    def _on_released(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the loop once every slot kept by `keep_slot` is released."""
        self._on_end = fn

    def _released(self) -> None:
        self._threads -= 1
        on_end = self._on_end
        if not self._threads and on_end is not None:
            self._on_end = None
            on_end()  # the dispatcher frees the slot the ended attempt kept

    @property
    def log(self) -> Any:
        """A structlog logger bound to the run, task, kind, agent and attempt."""
        return get_logger("orchestra.agent").bind(
            run_id=self.run_id,
            task_id=self.task.id,
            kind=self.task.kind,
            agent=self.agent,
            attempt=self.attempt,
        )

    def __repr__(self) -> str:
        return f"Context(run_id={self.run_id!r}, task={self.task.id!r}, attempt={self.attempt})"
