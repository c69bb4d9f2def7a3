"""orchestra: run many agent calls in parallel, safely.

```python
from orchestra import Orchestrator, Task, Context, agent

@agent(kinds=["research"], concurrency=20)
async def researcher(task: Task, ctx: Context) -> dict:
    return {"clause": task.payload["text"], "risk": "low"}

async with Orchestrator(agents=[researcher], concurrency=100) as orch:
    result = await orch.run(tasks=[Task("research", {"text": t}) for t in clauses])
```
"""

from ._agent import Agent as Agent
from ._agent import AgentLike as AgentLike
from ._agent import agent as agent
from ._aggregate import (
    Aggregator as Aggregator,
)
from ._aggregate import (
    ByKind as ByKind,
)
from ._aggregate import (
    Collect as Collect,
)
from ._aggregate import (
    Discard as Discard,
)
from ._aggregate import (
    Merge as Merge,
)
from ._aggregate import (
    Reduce as Reduce,
)
from ._aggregate import (
    Transform as Transform,
)
from ._breaker import BreakerPolicy as BreakerPolicy
from ._cli._console import run_main as run_main
from ._cli._progress import progress as progress
from ._cli._progress import render_status as render_status
from ._cli._progress import status_line as status_line
from ._core._context import Context as Context
from ._core._handle import Cancellation as Cancellation
from ._core._handle import ResultStream as ResultStream
from ._core._handle import RunHandle as RunHandle
from ._core._instruments import AttemptInfo as AttemptInfo
from ._core._instruments import Instrument as Instrument
from ._core._instruments import RunInfo as RunInfo
from ._core._orchestrator import (
    Orchestrator as Orchestrator,
)
from ._core._status import AgentStatus as AgentStatus
from ._core._status import Bottleneck as Bottleneck
from ._core._status import ErrorSample as ErrorSample
from ._core._status import KindStatus as KindStatus
from ._core._status import RunStatus as RunStatus
from ._decompose import by_priority as by_priority
from ._decompose import by_type as by_type
from ._decompose import chunked as chunked
from ._events import (
    AttemptFailed as AttemptFailed,
)
from ._events import (
    AttemptStarted as AttemptStarted,
)
from ._events import (
    AttemptSucceeded as AttemptSucceeded,
)
from ._events import (
    BreakerChanged as BreakerChanged,
)
from ._events import (
    Event as Event,
)
from ._events import (
    FallbackUsed as FallbackUsed,
)
from ._events import (
    RetryScheduled as RetryScheduled,
)
from ._events import (
    RunFinished as RunFinished,
)
from ._events import (
    RunStarted as RunStarted,
)
from ._events import (
    TaskFinished as TaskFinished,
)
from ._events import (
    TaskReady as TaskReady,
)
from ._exceptions import (
    AgentError as AgentError,
)
from ._exceptions import (
    AttemptTimeout as AttemptTimeout,
)
from ._exceptions import (
    ConfigError as ConfigError,
)
from ._exceptions import (
    InputError as InputError,
)
from ._exceptions import (
    InvalidOutput as InvalidOutput,
)
from ._exceptions import (
    OrchestraError as OrchestraError,
)
from ._exceptions import (
    PermanentError as PermanentError,
)
from ._exceptions import (
    RateLimited as RateLimited,
)
from ._exceptions import (
    Rejected as Rejected,
)
from ._exceptions import (
    RetryableError as RetryableError,
)
from ._exceptions import (
    RunError as RunError,
)
from ._exceptions import (
    StoreError as StoreError,
)
from ._exceptions import (
    TaskTimeout as TaskTimeout,
)
from ._exceptions import (
    VerificationError as VerificationError,
)
from ._limits import Concurrency as Concurrency
from ._limits import Limiter as Limiter
from ._limits import Rate as Rate
from ._log import configure_logging as configure_logging
from ._result import (
    AttemptRecord as AttemptRecord,
)
from ._result import (
    CancelRecord as CancelRecord,
)
from ._result import (
    ErrorRecord as ErrorRecord,
)
from ._result import (
    RunMetadata as RunMetadata,
)
from ._result import (
    RunResult as RunResult,
)
from ._result import (
    TimingStats as TimingStats,
)
from ._retry import RetryPolicy as RetryPolicy
from ._retry import Timeouts as Timeouts
from ._task import Attempt as Attempt
from ._task import Task as Task
from ._task import TaskResult as TaskResult
from ._verify import Verdict as Verdict
from .stores._worker import WorkReport as WorkReport

__version__ = "0.1.0"

__all__ = (
    "Agent",
    "AgentError",
    "AgentLike",
    "AgentStatus",
    "Aggregator",
    "Attempt",
    "AttemptFailed",
    "AttemptInfo",
    "AttemptRecord",
    "AttemptStarted",
    "AttemptSucceeded",
    "AttemptTimeout",
    "Bottleneck",
    "BreakerChanged",
    "BreakerPolicy",
    "ByKind",
    "CancelRecord",
    "Cancellation",
    "Collect",
    "Concurrency",
    "ConfigError",
    "Context",
    "Discard",
    "ErrorRecord",
    "ErrorSample",
    "Event",
    "FallbackUsed",
    "InputError",
    "Instrument",
    "InvalidOutput",
    "KindStatus",
    "Limiter",
    "Merge",
    "OrchestraError",
    "Orchestrator",
    "PermanentError",
    "Rate",
    "RateLimited",
    "Reduce",
    "Rejected",
    "ResultStream",
    "RetryPolicy",
    "RetryScheduled",
    "RetryableError",
    "RunError",
    "RunFinished",
    "RunHandle",
    "RunInfo",
    "RunMetadata",
    "RunResult",
    "RunStarted",
    "RunStatus",
    "StoreError",
    "Task",
    "TaskFinished",
    "TaskReady",
    "TaskResult",
    "TaskTimeout",
    "Timeouts",
    "TimingStats",
    "Transform",
    "Verdict",
    "VerificationError",
    "WorkReport",
    "agent",
    "by_priority",
    "by_type",
    "chunked",
    "configure_logging",
    "progress",
    "render_status",
    "run_main",
    "status_line",
)

# Public names report the package as their module, as anyio's do: reprs, tracebacks, docs and
# pickles say `orchestra.Task`, not `orchestra._task.Task` (pickle finds them there, re-exported).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("orchestra."):
        _obj.__module__ = __name__
del _name, _obj
