"""A live run's status: what it has done, what it is doing, what it waits on, when it ends.

`handle.status()` (and `orchestra runs show`, and the live view) return a frozen `RunStatus`:
counts by state, throughput, ETA, per-kind and per-agent rows, the bottleneck and the recent
errors. Taking one costs O(kinds + agents), never O(tasks). `status_line` and `render_status`
turn one into a line of text or a rich renderable (the `cli` extra).

```python
from orchestra.status import status_line

handle = orch.start(tasks=tasks)
print(status_line(handle.status()))
```
"""

from ._cli._progress import render_status, status_line
from ._core._status import AgentStatus, Bottleneck, ErrorSample, KindStatus, RunStatus

__all__ = (
    "AgentStatus",
    "Bottleneck",
    "ErrorSample",
    "KindStatus",
    "RunStatus",
    "render_status",
    "status_line",
)

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
