"""What can be observed of a run as it happens: typed events and instruments.

Events go to subscribers (`Orchestrator.subscribe(handler, RunStarted, ...)`), each with its own
bounded buffer, so a slow subscriber drops events rather than slow the run; they are built only
for the types somebody subscribed to. Instruments (`Orchestrator(instruments=[...])`) are called
in line, synchronously, with the run's `RunInfo` and each attempt's `AttemptInfo`: what the
Prometheus (`orchestra.metrics`) and OpenTelemetry (`orchestra.tracing`) integrations build on.

```python
from orchestra.events import AttemptFailed

orch.subscribe(lambda e: print(e.task.id, e.error), AttemptFailed)
```
"""

from ._core._instruments import AttemptInfo, Instrument, RunInfo
from ._events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    BreakerChanged,
    Event,
    FallbackUsed,
    RetryScheduled,
    RunFinished,
    RunStarted,
    TaskFinished,
    TaskReady,
)

__all__ = (
    "AttemptFailed",
    "AttemptInfo",
    "AttemptStarted",
    "AttemptSucceeded",
    "BreakerChanged",
    "Event",
    "FallbackUsed",
    "Instrument",
    "RetryScheduled",
    "RunFinished",
    "RunInfo",
    "RunStarted",
    "TaskFinished",
    "TaskReady",
)

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
