"""The exceptions orchestra raises, and the ones agents raise to steer it.

```
OrchestraError
├── ConfigError            bad limits, unknown agent in a fallback chain, a clock that cannot be installed
├── InputError             cycle, duplicate id, unknown kind, payload fails validation (raised before work)
├── RunError               the run could not finish; carries the partial RunResult as `.result`
├── StoreError             a durable store cannot keep the run (corrupt, locked, full, read-only file)
└── AgentError             raised by agents (and by the runtime on their behalf) to steer the retry loop
    ├── RetryableError     retry, optionally after `retry_after` seconds
    │   ├── AttemptTimeout     the attempt ran past its timeout and was cancelled
    │   ├── RateLimited        the service's rate limit: `retry_after` holds every task sharing a limit
    │   └── VerificationError  a verifier rejected the output; its feedback reaches the next attempt
    └── PermanentError     do not retry on this agent; go to the next agent of the fallback chain
        ├── TaskTimeout        the task ran past its own timeout (all attempts together): no fallback
        ├── Rejected           the safety check refused the task before dispatch
        └── InvalidOutput      a coroutine (a forgotten `await`), or what a JSON store cannot keep
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._result import RunResult

__all__ = (
    "AgentError",
    "AttemptTimeout",
    "ConfigError",
    "InputError",
    "InvalidOutput",
    "OrchestraError",
    "PermanentError",
    "RateLimited",
    "Rejected",
    "RetryableError",
    "RunError",
    "StoreError",
    "TaskTimeout",
    "VerificationError",
)


class OrchestraError(Exception):
    """The root of every exception orchestra raises on purpose."""


class ConfigError(OrchestraError, ValueError):
    """The orchestrator was configured with something it cannot run with."""


class InputError(OrchestraError, ValueError):
    """The input of a run is invalid; raised before any agent is called.

    `task_id` and `field` name what is wrong, when one task and one field are at fault.
    """

    def __init__(self, message: str, *, task_id: str | None = None, field: str | None = None):
        super().__init__(message)
        self.task_id = task_id
        self.field = field


class RunError(OrchestraError):
    """The run could not finish. `result` holds what was done until then."""

    def __init__(self, message: str, *, result: RunResult | None = None):
        super().__init__(message)
        self.result = result


class StoreError(OrchestraError):
    """A durable store cannot read or write its database: the message says which file and what is
    wrong (corrupt, locked, full, read-only, a schema newer than this orchestra)."""


class AgentError(OrchestraError):
    """Base of the errors an agent raises to tell the runtime what to do next."""


class RetryableError(AgentError):
    """Retry this task, on the same agent while its attempts last.

    `retry_after` (seconds) is a hint such as an HTTP `Retry-After` header; it wins over the backoff
    when it is longer.
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(RetryableError):
    """The service refused the call for its rate limit (an HTTP 429 of an agent's own client): as
    a 429 with a `Retry-After` does, `retry_after` holds every task that shares one of the
    agent's limits until then, not only this one."""


class PermanentError(AgentError):
    """Do not retry on this agent: the task goes to the next agent of its fallback chain."""


class AttemptTimeout(RetryableError):
    """An attempt ran past its timeout and was cancelled."""


class TaskTimeout(PermanentError):
    """A task ran past its own timeout (all attempts and waits together)."""


class VerificationError(RetryableError):
    """A verifier rejected an attempt's output; `feedback` goes to the next attempt."""

    def __init__(self, feedback: str, *, output: Any = None):
        super().__init__(feedback)
        self.feedback = feedback
        self.output = output


class Rejected(PermanentError):
    """The safety check refused a task before dispatch; it is not retried."""


class InvalidOutput(PermanentError):
    """An agent returned a coroutine (a forgotten `await`), or an output a store that keeps
    outputs as JSON cannot keep (the message names the type). Not retried on that agent."""
