"""Faults that agents suffer: the modes shared by `orchestra.testing.simulate_agent_failure` and the
scripted agents of `orchestra.testing`, and `Faults`, an orchestrator's table of the live ones.

Each mode behaves as the real failure does on the wire, so the runtime's own classification is what
gets tested: a rate limit is an `anthropic.RateLimitError` carrying a real HTTP 429 response with a
`retry-after` header, an overload is a 529, a crash is a `ConnectionError`. Without the anthropic
SDK (the `claude` extra), the HTTP errors are `SimulatedAPIError`s that carry the same status,
headers and body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import anyio

from ._exceptions import ConfigError, PermanentError

if TYPE_CHECKING:
    from ._core._context import Context
    from ._task import Task

__all__ = ("GARBAGE", "Fault", "FaultMode", "Faults", "SimulatedAPIError", "raise_fault")

FaultMode = Literal[
    "error",
    "rate_limit",
    "overloaded",
    "server_error",
    "hang",
    "garbage",
    "permanent",
    "slow",
    "bug",
]
MODES: Final[tuple[str, ...]] = get_args(FaultMode)


class _Garbage(str):
    """What a broken agent returns: valid JSON (a string), but not what anyone asked for. A
    verifier or an output model must catch it; `is GARBAGE` tells it apart."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<garbage>"


GARBAGE: Final = _Garbage("<garbage>")


class SimulatedAPIError(Exception):
    """An HTTP error of the Messages API, for when the anthropic SDK (the `claude` extra) is not
    installed: it carries what the runtime reads of the SDK's `APIStatusError` (`status_code`,
    `type`, `body`, `request_id`, `response.headers` with `retry-after`), so it is classified,
    held and recorded exactly as the real one."""

    def __init__(
        self, message: str, *, status_code: int, headers: dict[str, str], body: dict[str, Any]
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.type: str | None = body["error"]["type"]
        self.request_id: str | None = None
        self.response = _SimulatedResponse(status_code, headers)


class _SimulatedResponse:
    __slots__ = ("headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.headers = headers


def _http_error(status: int, message: str, retry_after: float | None) -> Exception:
    headers = {} if retry_after is None else {"retry-after": f"{retry_after:g}"}
    body = {"type": "error", "error": {"type": "simulated", "message": message}}
    try:
        import anthropic
    except ImportError:
        return SimulatedAPIError(message, status_code=status, headers=headers, body=body)
    try:
        import httpx2 as httpx  # the transport of the anthropic SDK in use
    except ImportError:  # pragma: no cover - older SDKs use httpx
        import httpx  # type: ignore[no-redef]
    request = httpx.Request("POST", "https://api.anthropic.com/v1/messages")
    response = httpx.Response(status, headers=headers, request=request)
    if status == 429:
        return anthropic.RateLimitError(message, response=response, body=body)
    return anthropic.APIStatusError(message, response=response, body=body)


async def raise_fault(
    mode: str, who: str, *, retry_after: float | None = None, latency: float = 0.0
) -> Any:
    """Behave as an agent failing in `mode`: raise, hang, or return garbage."""
    if mode == "error":
        raise ConnectionError(f"simulated failure: {who} is unreachable")
    if mode == "rate_limit":
        raise _http_error(
            429, f"simulated rate limit on {who}", 1.0 if retry_after is None else retry_after
        )
    if mode == "overloaded":
        raise _http_error(529, f"simulated overload of {who}", retry_after)
    if mode == "server_error":
        raise _http_error(500, f"simulated internal error of {who}", None)
    if mode == "hang":
        await anyio.Event().wait()  # never set, and no timer (`sleep_forever` sleeps to math.inf:
        # under a FakeClock, with nothing else pending, time would jump a day at every turn)
    if mode == "garbage":
        return GARBAGE
    if mode == "permanent":
        raise PermanentError(f"simulated permanent failure of {who}")
    if mode == "slow":
        await anyio.sleep(latency)
        return None
    if mode == "bug":  # the agent's own code fails on this payload: not an outage
        raise ValueError(f"simulated bug in {who}")
    raise ConfigError(f"unknown fault mode {mode!r}; use one of {', '.join(MODES)}")


AgentCall = Callable[["Task", "Context"], Awaitable[Any]]
LiveState = Callable[[str], "str | None"]


class Fault:
    """A live fault on one agent until `until` (loop time; None: until cleared).

    `affected` collects the ids of the tasks whose attempt it failed, for the recovery report.
    """

    __slots__ = (
        "affected",
        "agent",
        "ended",
        "latency",
        "mode",
        "retry_after",
        "started",
        "until",
    )

    def __init__(
        self,
        agent: str,
        mode: str,
        *,
        started: float,
        until: float | None,
        retry_after: float | None = None,
        latency: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown fault mode {mode!r}; use one of {', '.join(MODES)}")
        self.agent = agent
        self.mode = mode
        self.started = started
        self.until = until
        self.retry_after = retry_after
        self.latency = latency
        self.affected: set[str] = set()
        self.ended: dict[str, str] = {}  # how the affected tasks ended, by id

    def active(self, now: float) -> bool:
        return self.until is None or now < self.until

    def wrap(self, call: AgentCall) -> AgentCall:
        async def faulty(task: Task, ctx: Context) -> Any:
            if not self.active(anyio.current_time()):
                return await call(task, ctx)
            self.affected.add(task.id)
            if self.mode == "slow":
                await anyio.sleep(self.latency)
                return await call(task, ctx)
            return await raise_fault(
                self.mode, f"agent {self.agent!r}", retry_after=self.retry_after
            )

        return faulty


class Faults:
    """The simulated failures of one orchestrator's agents, the latest `Fault` of each agent taken
    down, kept after it ends for the recovery report (`orchestra.testing.recovery_status`).

    The engine reads it in two places: a run tells `task_ended` how each task ended (only while a
    fault was ever set: `by_agent` is empty otherwise, and then costs one truth test per task), and
    an attempt on an agent with a live fault goes through `Fault.wrap`.
    """

    __slots__ = ("_changed", "_live_state", "by_agent")

    def __init__(self, changed: Callable[[], None], live_state: LiveState) -> None:
        self.by_agent: dict[str, Fault] = {}
        # Called when a fault is set: a run that only counted its successes must now tell each
        # task's end here.
        self._changed = changed
        # The state of a task id in a run still going, if it is unfinished there (else None).
        self._live_state = live_state

    def put(self, fault: Fault) -> None:
        """Set `fault` as its agent's latest; the tasks an earlier fault of that agent hit are
        still to recover, so the new one keeps them."""
        earlier = self.by_agent.get(fault.agent)
        if earlier is not None:
            fault.affected, fault.ended = earlier.affected, earlier.ended
        self.by_agent[fault.agent] = fault
        self._changed()

    def task_ended(self, task_id: str, status: str) -> None:
        """A task ended with `status`: kept if a fault hit it."""
        for fault in self.by_agent.values():
            if task_id in fault.affected:
                fault.ended[task_id] = status

    def state_of(self, task_id: str) -> str | None:
        """Where a task a fault hit stands: unfinished in a run still going, else how it ended
        (None: neither, as for a task whose run raised)."""
        state = self._live_state(task_id)
        if state is not None:
            return state
        for fault in self.by_agent.values():
            state = fault.ended.get(task_id)
            if state is not None:
                return state
        return None
