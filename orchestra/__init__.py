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

from ._agent import Agent as Agent, AgentLike as AgentLike, agent as agent
from ._aggregate import (
    Aggregator as Aggregator,
    ByKind as ByKind,
    Collect as Collect,
    Discard as Discard,
    Merge as Merge,
    Reduce as Reduce,
    Transform as Transform,
)
from ._breaker import BreakerPolicy as BreakerPolicy
from ._context import Context as Context
from ._decompose import by_priority as by_priority, by_type as by_type, chunked as chunked
from ._events import (
    AttemptFailed as AttemptFailed,
    AttemptStarted as AttemptStarted,
    AttemptSucceeded as AttemptSucceeded,
    BreakerChanged as BreakerChanged,
    Event as Event,
    FallbackUsed as FallbackUsed,
    RetryScheduled as RetryScheduled,
    RunFinished as RunFinished,
    RunStarted as RunStarted,
    TaskFinished as TaskFinished,
    TaskReady as TaskReady,
)
from ._exceptions import (
    AgentError as AgentError,
    AttemptTimeout as AttemptTimeout,
    ConfigError as ConfigError,
    InputError as InputError,
    OrchestraError as OrchestraError,
    PermanentError as PermanentError,
    Rejected as Rejected,
    RetryableError as RetryableError,
    RunError as RunError,
    TaskTimeout as TaskTimeout,
    VerificationError as VerificationError,
)
from ._orchestrator import (
    Orchestrator as Orchestrator,
    RecoveryStatus as RecoveryStatus,
    ResultStream as ResultStream,
)
from ._result import (
    AttemptRecord as AttemptRecord,
    ErrorRecord as ErrorRecord,
    RunMetadata as RunMetadata,
    RunResult as RunResult,
    TimingStats as TimingStats,
)
from ._retry import RetryPolicy as RetryPolicy, Timeouts as Timeouts
from ._task import Attempt as Attempt, Task as Task, TaskResult as TaskResult
from ._verify import Verdict as Verdict

__version__ = "0.1.0"

__all__ = (
    "Agent",
    "AgentError",
    "AgentLike",
    "Aggregator",
    "Attempt",
    "AttemptFailed",
    "AttemptRecord",
    "AttemptStarted",
    "AttemptSucceeded",
    "AttemptTimeout",
    "BreakerChanged",
    "BreakerPolicy",
    "ByKind",
    "Collect",
    "ConfigError",
    "Context",
    "Discard",
    "ErrorRecord",
    "Event",
    "FallbackUsed",
    "InputError",
    "Merge",
    "OrchestraError",
    "Orchestrator",
    "PermanentError",
    "RecoveryStatus",
    "Reduce",
    "Rejected",
    "ResultStream",
    "RetryPolicy",
    "RetryScheduled",
    "RetryableError",
    "RunError",
    "RunFinished",
    "RunMetadata",
    "RunResult",
    "RunStarted",
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
    "agent",
    "by_priority",
    "by_type",
    "chunked",
)
