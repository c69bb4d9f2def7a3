"""The answer a run returns: `RunResult` (also `orchestra.RunResult`) and the models it is made of.

`result.status` is "success", "partial", "failed" or "cancelled"; `result.data` the aggregate of
the outputs; `result.errors` one `ErrorRecord` per failed task (its attempts as `AttemptRecord`s,
its remediation); `result.metadata` a `RunMetadata` (counts, timings as `TimingStats`, usage,
cancellations as `CancelRecord`s). All are pydantic models: a result round-trips through JSON.
"""

from ._result import AttemptRecord, CancelRecord, ErrorRecord, RunMetadata, RunResult, TimingStats

__all__ = (
    "AttemptRecord",
    "CancelRecord",
    "ErrorRecord",
    "RunMetadata",
    "RunResult",
    "TimingStats",
)

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
