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

# The grouped public modules: `import orchestra` is enough to reach `orchestra.events.RunStarted`.
from . import events as events
from . import result as result
from . import status as status
from ._agent import Agent, AgentLike, agent
from ._aggregate import Aggregator, ByKind, Collect, Discard, Merge, Reduce, Transform
from ._breaker import BreakerPolicy
from ._cli._console import run_main
from ._cli._progress import progress
from ._concurrency import Concurrency
from ._core._context import Context
from ._core._handle import Cancellation, ResultStream, RunHandle
from ._core._orchestrator import Orchestrator
from ._decompose import by_priority, by_type, chunked
from ._exceptions import (
    AgentError,
    AttemptTimeout,
    ConfigError,
    InputError,
    InvalidOutput,
    OrchestraError,
    PermanentError,
    RateLimited,
    Rejected,
    RetryableError,
    RunError,
    StoreError,
    TaskTimeout,
    VerificationError,
)
from ._limits import Limiter
from ._log import configure_logging
from ._rate import Rate
from ._result import RunResult
from ._retry import RetryPolicy, Timeouts
from ._task import Attempt, Task, TaskResult
from ._verify import Verdict
from ._version import __version__ as __version__
from .stores._worker import WorkReport

__all__ = (
    "Agent",
    "AgentError",
    "AgentLike",
    "Aggregator",
    "Attempt",
    "AttemptTimeout",
    "BreakerPolicy",
    "ByKind",
    "Cancellation",
    "Collect",
    "Concurrency",
    "ConfigError",
    "Context",
    "Discard",
    "InputError",
    "InvalidOutput",
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
    "RetryableError",
    "RunError",
    "RunHandle",
    "RunResult",
    "StoreError",
    "Task",
    "TaskResult",
    "TaskTimeout",
    "Timeouts",
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
    "run_main",
)

# Public names report the package as their module, as anyio's do: reprs, tracebacks, docs and
# pickles say `orchestra.Task`, not `orchestra._task.Task` (pickle finds them there, re-exported).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("orchestra."):
        _obj.__module__ = __name__
del _name, _obj
