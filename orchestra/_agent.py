"""Agents: anything with `async def __call__(task, ctx)`, a name and the kinds it serves.

`@agent(kinds=[...])` turns a function into an `Agent`. Classes (the Claude agents of
`orchestra.agents`, an HTTP agent, a user's own) fit the `AgentLike` protocol without inheriting
from anything.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload, runtime_checkable

import anyio
import anyio.to_process
import anyio.to_thread
from pydantic import BaseModel

from ._concurrency import Concurrency
from ._config import check_instance, check_int, check_names, check_number
from ._exceptions import ConfigError
from ._limits import Limiter
from ._log import TASK_ID
from ._retry import RetryPolicy

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._core._context import Context
    from ._task import Task

__all__ = ("Agent", "AgentLike", "agent")

Executor = Literal["thread", "process"]
T = TypeVar("T")


@runtime_checkable
class AgentLike(Protocol):
    """What the registry needs of an agent. Optional attributes, read when present:
    `concurrency` (int or a shared `Concurrency`), `limits` (a list of `Rate` / `Concurrency`),
    `input` and `output` (pydantic models), `retry` (RetryPolicy),
    `timeout` (seconds per attempt)."""

    @property
    def name(self) -> str: ...
    @property
    def kinds(self) -> Sequence[str]: ...

    def __call__(self, task: Task, ctx: Context, /) -> Awaitable[Any]: ...


class Agent:
    """A function registered as an agent. Build it with `@agent(...)`.

    Args:
        fn: `async def fn(task, ctx)`; with `executor=`, a plain `def fn(task)` run off the loop.
        kinds: the task kinds it serves.
        name: how fallback chains, limits, events and the registry refer to it (default: the function's name).
        concurrency: the most tasks it runs at once (its own limit, under the global one).
        input: a pydantic model that every payload of its kinds must validate against, before work starts.
        output: a pydantic model its output must validate against; garbage fails the attempt (retryable).
        executor: "thread" or "process" to run a CPU-bound sync function without blocking the loop.
        retry: its own `RetryPolicy`, over the run's and the kind's.
        timeout: seconds per attempt on this agent, over the run's default.
        limits: more limits every attempt of this agent reserves first (`Rate`, a shared
            `Concurrency`): give the same objects to every agent that uses one API key, and they
            share its budget, its 429s included.
    """

    __slots__ = (
        "__wrapped__",
        "concurrency",
        "executor",
        "fn",
        "input",
        "kinds",
        "limits",
        "name",
        "output",
        "retry",
        "timeout",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        kinds: Sequence[str],
        name: str | None = None,
        concurrency: int | Concurrency | None = None,
        input: type[BaseModel] | None = None,
        output: type[BaseModel] | None = None,
        executor: Executor | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        limits: Sequence[Limiter] = (),
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"@agent decorates a function, got {fn!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"agent name must be a non-empty string, got {name!r}")
        label = name or getattr(fn, "__name__", None) or repr(fn)
        check_options(
            label,
            kinds,
            concurrency,
            timeout,
            retry=retry,
            input=input,
            output=output,
            limits=limits,
        )
        if executor not in (None, "thread", "process"):
            raise ConfigError(
                f"agent {label!r}: executor must be 'thread' or 'process', got {executor!r}"
            )
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004  (a callable object's async __call__)
        )
        if executor is None and not is_async:
            raise ConfigError(
                f"agent {label!r}: a plain function needs executor='thread' or 'process'; "
                "an agent without one must be `async def fn(task, ctx)`"
            )
        if executor is not None and is_async:
            raise ConfigError(
                f"agent {label!r}: executor={executor!r} runs sync functions; this one is async"
            )
        if executor is None:
            check_call(label, fn)
        elif not _takes(fn, 1):
            raise ConfigError(
                f"agent {label!r}: executor={executor!r} calls `fn(task)`, with no ctx "
                "(it runs off the loop); this one does not take one argument"
            )
        qualname = getattr(fn, "__qualname__", "")
        if executor == "process" and (not isinstance(qualname, str) or "<" in qualname):
            # The worker process finds the function by module and name (see `__call__`): a lambda
            # or a nested function has none, and every attempt failed with an AttributeError.
            raise ConfigError(
                f"agent {label!r}: executor='process' needs a function defined at the top of a "
                f"module (it is imported by name in the worker process), got {qualname or fn!r}"
            )
        self.fn = fn
        self.__wrapped__ = fn
        self.kinds = tuple(kinds)
        self.name = label
        self.concurrency = concurrency
        self.input = input
        self.output = output
        self.executor = executor
        self.retry = retry
        self.timeout = timeout
        self.limits = tuple(limits)

    async def __call__(self, task: Task, ctx: Context) -> Any:
        if self.executor is None:
            return await self.fn(task, ctx)
        if self.executor == "thread":
            gate = _Gate()
            try:
                return await anyio.to_thread.run_sync(
                    _in_thread, self.fn, task, gate, abandon_on_cancel=True
                )
            except BaseException:
                gate.abandon(ctx)
                raise
        # The function travels to the worker process by module and name: the module attribute is
        # this Agent, not the function, so pickling the function itself would fail.
        return await anyio.to_process.run_sync(
            _call_in_process, self.fn.__module__, self.fn.__qualname__, task, cancellable=True
        )

    def direct(self) -> Callable[[Task, Context], Awaitable[Any]]:
        """The coroutine function the dispatcher awaits: the user's own for async agents (one frame less)."""
        return self.fn if self.executor is None else self.__call__

    def __repr__(self) -> str:
        return f"Agent(name={self.name!r}, kinds={list(self.kinds)!r})"


def check_options(
    label: str,
    kinds: Any,
    concurrency: Any,
    timeout: Any,
    *,
    retry: Any = None,
    input: Any = None,
    output: Any = None,
    limits: Any = (),
) -> None:
    """The checks every agent's options pass, `@agent` functions and agent objects alike."""
    where = f"agent {label!r}: "
    check_names(f"{where}kinds", kinds)
    if not isinstance(concurrency, Concurrency):
        check_int(f"{where}concurrency", concurrency, optional=True)
    if isinstance(limits, str | bytes) or not isinstance(limits, Sequence):
        raise ConfigError(
            f"{where}limits must be a list of limits (Rate, Concurrency), got {limits!r}"
        )
    for limit in limits:
        if not isinstance(limit, Limiter):
            raise ConfigError(f"{where}limits must hold limits (Rate, Concurrency), got {limit!r}")
    check_number(f"{where}timeout", timeout, positive=True, optional=True)
    check_instance(f"{where}retry", retry, RetryPolicy)
    for field, model in (("input", input), ("output", output)):
        if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"{where}{field} must be a pydantic model class, got {model!r}")


class _Gate:
    """Who ends a thread agent's call: the thread, or the loop that abandoned it on a timeout or a
    cancel (a thread cannot be interrupted). An abandoned call that has not begun never begins; one
    that runs keeps its attempt's slot taken (`Context.keep_slot`) until it really ends, so an
    agent's limit bounds the threads that run, not only the attempts that wait for them."""

    __slots__ = ("lock", "release", "state")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = _WAITING
        self.release: Callable[[], None] | None = None

    def begin(self) -> bool:
        with self.lock:
            if self.state is _ABANDONED:
                return False
            self.state = _RUNNING
            return True

    def end(self) -> None:
        with self.lock:
            self.state = _DONE
            release, self.release = self.release, None
        if release is not None:
            release()

    def abandon(self, ctx: Context) -> None:
        with self.lock:
            if self.state is _WAITING:
                self.state = _ABANDONED
            elif self.state is _RUNNING and self.release is None:
                self.release = ctx.keep_slot()


_WAITING, _RUNNING, _DONE, _ABANDONED = "waiting", "running", "done", "abandoned"


def check_call(label: str, agent: Callable[..., Any]) -> None:
    """`ConfigError` unless `agent(task, ctx)` binds: checked when the agent is made, since a
    wrong signature would otherwise fail every attempt with a TypeError, each one retried."""
    if not _takes(agent, 2):
        raise ConfigError(
            f"agent {label!r}: an agent is called as `agent(task, ctx)` and must take those two "
            f"arguments (`async def {_called(agent)}(task: Task, ctx: Context)`); "
            f"its signature is {_signature(agent)}"
        )


def _takes(fn: Callable[..., Any], count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (a signature Python cannot
    read, as some builtins', passes)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*(None,) * count)
    except TypeError:
        return False
    return True


def _called(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() else "__call__"


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):  # pragma: no cover - `_takes` passed it
        return "unknown"


def _in_thread(fn: Callable[[Task], Any], task: Task, gate: _Gate) -> Any:
    if not gate.begin():
        return None  # the attempt was abandoned before the thread took it up
    # The thread runs in a copy of its runner's context, which goes on to other tasks: its log
    # lines keep this task's id.
    TASK_ID.set(task.id)
    try:
        return fn(task)
    finally:
        gate.end()


def _call_in_process(module: str, qualname: str, task: Task) -> Any:
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    if isinstance(target, Agent):
        target = target.fn
    return target(task)


@overload
def agent(
    fn: Callable[..., Any],
    *,
    kinds: Sequence[str],
    name: str | None = ...,
    concurrency: int | Concurrency | None = ...,
    input: type[BaseModel] | None = ...,
    output: type[BaseModel] | None = ...,
    executor: Executor | None = ...,
    retry: RetryPolicy | None = ...,
    timeout: float | None = ...,
    limits: Sequence[Limiter] = ...,
) -> Agent: ...
@overload
def agent(
    fn: None = ...,
    *,
    kinds: Sequence[str],
    name: str | None = ...,
    concurrency: int | Concurrency | None = ...,
    input: type[BaseModel] | None = ...,
    output: type[BaseModel] | None = ...,
    executor: Executor | None = ...,
    retry: RetryPolicy | None = ...,
    timeout: float | None = ...,
    limits: Sequence[Limiter] = ...,
) -> Callable[[Callable[..., Any]], Agent]: ...
def agent(
    fn: Callable[..., Any] | None = None,
    *,
    kinds: Sequence[str],
    name: str | None = None,
    concurrency: int | Concurrency | None = None,
    input: type[BaseModel] | None = None,
    output: type[BaseModel] | None = None,
    executor: Executor | None = None,
    retry: RetryPolicy | None = None,
    timeout: float | None = None,
    limits: Sequence[Limiter] = (),
) -> Agent | Callable[[Callable[..., Any]], Agent]:
    """Register a function as an agent: ``@agent(kinds=["research"], concurrency=20)``.

    See `Agent` for the arguments.
    """

    def wrap(f: Callable[..., Any]) -> Agent:
        return Agent(
            f,
            kinds=kinds,
            name=name,
            concurrency=concurrency,
            input=input,
            output=output,
            executor=executor,
            retry=retry,
            timeout=timeout,
            limits=limits,
        )

    return wrap if fn is None else wrap(fn)
