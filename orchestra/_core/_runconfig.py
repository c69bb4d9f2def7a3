"""What a run's parts share of the run: `RunConfig`, what a run takes from its orchestrator, and
`RunView`, what its dispatcher, attempts and recovery read of the run they work for.

Both live below those parts and the run (`_run.py`), which imports them: so none of them has to
name the run's module, even for its types, and the engine's imports stay one way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from .._budget import BudgetPolicy
    from .._concurrency import Capacity
    from .._events import EventBus
    from .._faults import Faults
    from .._registry import Registry
    from .._retry import RetryPolicy, Timeouts
    from .._task import Task
    from .._verify import Check
    from ..stores._protocol import RunStore
    from ._instruments import Instruments, RunInfo
    from ._report import Report

__all__ = ("RunConfig", "RunView")


class RunConfig:
    """What a run takes from its orchestrator (built once per orchestrator)."""

    __slots__ = (
        "aggregate",
        "budget",
        "bus",
        "capacity",
        "defaults",
        "faults",
        "instruments",
        "keeps_history",
        "on_threshold_missed",
        "registry",
        "retry",
        "retry_per_kind",
        "safety",
        "seed",
        "store",
        "success_threshold",
        "timeouts",
        "verify",
        "window",
    )

    def __init__(
        self,
        *,
        registry: Registry,
        capacity: Capacity,
        bus: EventBus,
        store: Any,
        retry: RetryPolicy,
        retry_per_kind: Mapping[str, RetryPolicy],
        timeouts: Timeouts,
        defaults: Mapping[str, Any],
        verify: Mapping[str, Check],
        safety: Callable[[Task], Any] | None,
        success_threshold: float,
        window: int,
        aggregate: Any,
        seed: int | None,
        on_threshold_missed: Callable[..., Any] | None,
        faults: Faults,
        instruments: Instruments | None = None,
        budget: BudgetPolicy | None = None,
    ) -> None:
        self.registry = registry
        self.instruments = instruments  # metrics and tracing hooks; None: none, nothing to call
        self.budget = budget
        self.faults = faults  # the simulated failures (the fault kit's): they hear how tasks end
        self.capacity = capacity
        self.bus = bus
        self.store = store
        self.retry = retry
        self.retry_per_kind = retry_per_kind
        self.timeouts = timeouts
        self.defaults = defaults
        self.verify = verify
        self.safety = safety
        self.success_threshold = success_threshold
        self.window = window
        self.aggregate = aggregate
        self.seed = seed
        self.on_threshold_missed = on_threshold_missed
        # Whether the `RunResult` lists every task that did not succeed (`errors`) and every
        # cancel (`metadata.cancellations`): a worker's local run does not (its ends go to the
        # shared store, its cancels are hand-backs; over days they would pile up).
        self.keeps_history = True


class RunView(Protocol):
    """What a run's dispatcher, attempts and recovery read of the run (`Run`): its id,
    configuration and store, its report, its zero on the loop's clock, whether debug logs are
    on, what the instruments see of it, whether more input may come; how to stop it, and (for
    an attempt's `Context`) how to count what an attempt spent."""

    run_id: str
    config: RunConfig
    store: RunStore
    report: Report
    t0: float
    debug: bool
    info: RunInfo

    @property
    def input_open(self) -> bool:
        """Whether more input may come (a streamed input not over yet)."""
        ...

    def stop(self, reason: str) -> None: ...

    def record_usage(
        self,
        cost: float,
        tokens: Mapping[str, int],
        agent: str | None = None,
        model: str | None = None,
    ) -> None: ...
