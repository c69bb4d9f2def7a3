"""The orchestrator's face: configuration errors, its store, the exception tree, failures that stay
in their attempt, and cancelling the caller."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    AgentError,
    AttemptTimeout,
    ConfigError,
    Context,
    InputError,
    OrchestraError,
    Orchestrator,
    PermanentError,
    Rejected,
    RetryableError,
    RetryPolicy,
    RunError,
    RunResult,
    Task,
    TaskTimeout,
    Timeouts,
    VerificationError,
    agent,
)
from orchestra.stores import SQLiteStore
from orchestra.testing import FakeClock, scripted
from tests.helpers import tasks_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path


class Hanging:
    """An agent whose calls never end on their own; it counts calls started and cancelled."""

    def __init__(self, name: str = "hang", kinds: tuple[str, ...] = ("work",)) -> None:
        self.name = name
        self.kinds = kinds
        self.started = 0
        self.cancelled = 0
        self.running = anyio.Event()

    async def __call__(self, task: Task, ctx: Context) -> None:
        self.started += 1
        self.running.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise


def ok_agent() -> Any:
    @agent(kinds=["work"])
    async def fine(task: Task, ctx: Context) -> Any:
        return task.payload

    return fine


BAD_OPTIONS: dict[str, dict[str, Any]] = {
    "concurrency-0": {"concurrency": 0},
    "concurrency-negative": {"concurrency": -1},
    "concurrency-bool": {"concurrency": True},
    "concurrency-float": {"concurrency": 2.5},
    "concurrency-str": {"concurrency": "10"},
    "threshold-above-1": {"success_threshold": 1.5},
    "threshold-negative": {"success_threshold": -0.1},
    "window-0": {"window": 0},
    "window-float": {"window": 2.5},
    "window-bool": {"window": True},
    "decomposer-not-callable": {"decomposer": [1, 2]},
    "negative-attempt-timeout": {"timeouts": {"attempt": -1}},
    "zero-task-timeout": {"timeouts": {"task": 0}},
    "negative-run-timeout": {"timeouts": {"run": -5.0}},
    "nan-attempt-timeout": {"timeouts": {"attempt": math.nan}},
    "unknown-timeout": {"timeouts": {"forever": 1}},
    "unknown-fallback-agent": {"fallbacks": {"work": ["fine", "ghost"]}},
    "empty-fallback-chain": {"fallbacks": {"work": []}},
    "retry-for-unknown-kind": {"retry_per_kind": {"nokind": RetryPolicy()}},
    "verify-for-unknown-kind": {"verify": {"nokind": lambda t, o: True}},
    "defaults-for-unknown-kind": {"defaults": {"nokind": 0}},
}


class TestConfigErrors:
    @pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
    def test_bad_option(self, case: str) -> None:
        with pytest.raises(ConfigError) as info:
            Orchestrator(agents=[ok_agent()], **BAD_OPTIONS[case])
        assert isinstance(info.value, OrchestraError)
        assert str(info.value)

    def test_two_agents_with_one_name(self) -> None:
        with pytest.raises(ConfigError, match="fine"):
            Orchestrator(agents=[ok_agent(), ok_agent()])

    def test_something_that_is_not_an_agent(self) -> None:
        async def no_name(task: Task, ctx: Context) -> None:
            return None

        bad: Any = no_name
        with pytest.raises(ConfigError):
            Orchestrator(agents=[bad])

    @pytest.mark.parametrize(
        "build",
        [
            lambda: Timeouts(attempt=-1),
            lambda: Timeouts(task=0),
            lambda: RetryPolicy(max_attempts=0),
            lambda: RetryPolicy(base=-1),
        ],
    )
    def test_bad_policies(self, build: Callable[[], Any]) -> None:
        with pytest.raises(ConfigError):
            build()

    async def test_run_needs_an_input_or_tasks_but_not_both(self) -> None:
        orch = Orchestrator(agents=[ok_agent()])
        with pytest.raises(ConfigError):
            await orch.run()
        with pytest.raises(ConfigError):
            await orch.run([Task("work")], tasks=[Task("work")])

    def test_the_configured_limit_is_readable(self) -> None:
        assert Orchestrator(agents=[ok_agent()], concurrency=7).concurrency == 7


class TestStore:
    async def test_runs_started_after_a_change_keep_their_tasks_in_the_new_store(
        self, tmp_path: Path
    ) -> None:
        orch = Orchestrator(agents=[ok_agent()])
        first = orch.store
        store = SQLiteStore(tmp_path / "runs.db")
        try:
            orch.store = store
            assert orch.store is store
            result = await orch.run(tasks=[Task("work", 1, id="t")], run_id="kept")
            assert result.status == "success"
            assert [(run["id"], run["counts"]) for run in store.runs()] == [
                ("kept", {"succeeded": 1})
            ]
        finally:
            store.close()
        assert first is not store

    def test_something_that_is_not_a_store_is_refused(self, tmp_path: Path) -> None:
        orch = Orchestrator(agents=[ok_agent()])
        with pytest.raises(ConfigError, match="store must be a store") as info:
            orch.store = tmp_path / "runs.db"  # type: ignore[assignment]
        assert "runs.db" in str(info.value)

    async def test_it_cannot_change_under_a_run(self, clock: FakeClock, tmp_path: Path) -> None:
        orch = Orchestrator(agents=[scripted("slow", ["work"], latency=1)])
        first = orch.store
        store = SQLiteStore(tmp_path / "runs.db")
        try:
            async with orch:
                handle = orch.start(tasks=[Task("work")])
                with pytest.raises(ConfigError, match="no run goes on"):
                    orch.store = store
                await handle
        finally:
            store.close()
        assert orch.store is first


class TestAsyncioOnly:
    @pytest.mark.parametrize("entry", ["async with", "run", "work"])
    def test_another_anyio_backend_is_a_config_error_before_anything_starts(
        self, entry: str, tmp_path: Path
    ) -> None:
        pytest.importorskip("trio")  # in the dev group: installed wherever the suite runs
        store = SQLiteStore(tmp_path / "runs.db")
        orch = Orchestrator(agents=[ok_agent()], store=store)

        async def main() -> None:
            if entry == "async with":
                async with orch:
                    pass
            elif entry == "run":
                await orch.run(tasks=[Task("work")])
            else:
                await orch.work()

        with pytest.raises(ConfigError, match="asyncio only") as info:
            anyio.run(main, backend="trio")
        assert "trio" in str(info.value)
        store.close()


class TestExceptionTree:
    @pytest.mark.parametrize(
        ("child", "parent"),
        [
            (ConfigError, OrchestraError),
            (InputError, OrchestraError),
            (RunError, OrchestraError),
            (AgentError, OrchestraError),
            (RetryableError, AgentError),
            (PermanentError, AgentError),
            (AttemptTimeout, RetryableError),
            (VerificationError, RetryableError),
            (TaskTimeout, PermanentError),
            (Rejected, PermanentError),
            (OrchestraError, Exception),
        ],
    )
    def test_hierarchy(self, child: type[Exception], parent: type[Exception]) -> None:
        assert issubclass(child, parent)

    def test_retryable_and_permanent_are_distinct(self) -> None:
        assert not issubclass(RetryableError, PermanentError)
        assert not issubclass(PermanentError, RetryableError)

    def test_errors_carry_their_details(self) -> None:
        assert RetryableError("slow down", retry_after=2.5).retry_after == 2.5
        err = InputError("task 'a' is bad", task_id="a", field="kind")
        assert (err.task_id, err.field) == ("a", "kind")
        assert RunError("lost", result=None).result is None


class _Custom(Exception):
    pass


AGENT_ERRORS: dict[str, Callable[[], BaseException]] = {
    "ValueError": lambda: ValueError("bad value"),
    "KeyError": lambda: KeyError("missing"),
    "TypeError": lambda: TypeError("wrong type"),
    "RuntimeError": lambda: RuntimeError("boom"),
    "AssertionError": lambda: AssertionError("assumption broken"),
    "NotImplementedError": lambda: NotImplementedError("todo"),
    "ZeroDivisionError": lambda: ZeroDivisionError("division by zero"),
    "custom": lambda: _Custom("custom failure"),
    "ExceptionGroup": lambda: ExceptionGroup("inner task group", [ValueError("child")]),
    "ConfigError": lambda: ConfigError("agent misconfigured"),
    "spontaneous-CancelledError": lambda: asyncio.CancelledError(),
}


class TestAgentFailuresStayInTheAttempt:
    @pytest.mark.parametrize("case", sorted(AGENT_ERRORS))
    async def test_anything_an_agent_raises_fails_that_attempt_only(
        self, case: str, clock: FakeClock
    ) -> None:
        raised = AGENT_ERRORS[case]

        @agent(kinds=["work"])
        async def sometimes(task: Task, ctx: Context) -> Any:
            await anyio.sleep(0.1)
            if task.payload == "bad" and ctx.attempt == 1:
                raise raised()
            return task.payload

        orch = Orchestrator(
            agents=[sometimes],
            retry=RetryPolicy(max_attempts=2, base=0.0),
            timeouts=Timeouts(run=100.0),  # a lost task shows as a timed-out run, not a hang
            success_threshold=0.0,
            seed=1,
        )
        tasks = [Task("work", "bad", id="bad"), *tasks_of(3)]
        result = await orch.run(tasks=tasks)
        assert result.metadata.total == 4
        assert set(result.data) >= {"t0", "t1", "t2"}
        assert result.metadata.reason is None or "timeout" not in result.metadata.reason
        error = result.error_for("bad")
        if error is None:  # retried, and the second attempt succeeded
            assert result.data["bad"] == "bad"
            assert result.metadata.attempts == 5
        else:  # classified as permanent: failed, with the attempt on record
            assert error.status == "failed"
            assert len(error.attempts) == 1

    async def test_an_agent_returning_garbage_does_not_break_the_loop(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        garbage = object()

        @agent(kinds=["work"])
        async def weird(task: Task, ctx: Context) -> Any:
            return garbage

        # An output is the agent's: kept as returned (see tests/test_robustness.py), and the
        # run ends with every task accounted for.
        result = await make_orchestrator(agents=[weird]).run(tasks=tasks_of(2))
        assert result.status == "success"
        assert all(output is garbage for output in result.data.values())
        assert result.metadata.counts["succeeded"] == 2


class TestCancellingTheCaller:
    @pytest.mark.usefixtures("no_leaks")
    async def test_move_on_after_cancels_every_attempt(self, clock: FakeClock) -> None:
        hang = Hanging()
        probe_agent = scripted("quick", ["quick"], latency=0.5)
        orch = Orchestrator(agents=[hang, probe_agent], concurrency=4)
        done: list[RunResult] = []
        with anyio.move_on_after(10.0) as scope:
            done.append(await orch.run(tasks=[*tasks_of(6), *tasks_of(3, "quick", "q")]))
        assert scope.cancelled_caught
        assert done == []
        assert hang.started == 4  # the first four tasks (FIFO) took every slot
        assert hang.cancelled == hang.started
        assert {s["name"]: s["in_flight"] for s in orch.agents_status()} == {
            "hang": 0,
            "quick": 0,
        }

    @pytest.mark.usefixtures("no_leaks")
    async def test_task_cancel_cancels_every_attempt(self) -> None:
        hang = Hanging()
        orch = Orchestrator(agents=[hang], concurrency=3)
        runner = asyncio.ensure_future(orch.run(tasks=tasks_of(5)))
        await hang.running.wait()
        while hang.started < 3:
            await asyncio.sleep(0)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        assert hang.started == 3
        assert hang.cancelled == 3
        assert [s["in_flight"] for s in orch.agents_status()] == [0]

    @pytest.mark.usefixtures("no_leaks")
    async def test_cancelled_while_tasks_wait_for_a_retry(self, clock: FakeClock) -> None:
        down = scripted("down", ["work"], then="error", latency=0.1)
        orch = Orchestrator(agents=[down], retry=RetryPolicy(max_attempts=5, base=50.0, cap=50.0))
        with anyio.move_on_after(5.0):
            await orch.run(tasks=tasks_of(4))
        assert down.calls  # they failed once and were waiting for their retry
        assert down.in_flight == 0

    @pytest.mark.usefixtures("no_leaks")
    async def test_cancelled_while_reading_a_streamed_input(self, clock: FakeClock) -> None:
        hang = Hanging()

        async def endless() -> AsyncIterator[Task]:
            n = 0
            while True:
                yield Task("work", n, id=f"s{n}")
                n += 1
                await anyio.sleep(1.0)

        orch = Orchestrator(agents=[hang])
        with anyio.move_on_after(10.5):
            await orch.run(tasks=endless())
        assert hang.started == 11
        assert hang.cancelled == 11

    @pytest.mark.usefixtures("no_leaks")
    async def test_the_orchestrator_is_usable_after_a_cancelled_run(self, clock: FakeClock) -> None:
        probe_limit = scripted("w", ["work"], latency=5.0)
        async with Orchestrator(agents=[probe_limit], concurrency=2) as orch:
            with anyio.move_on_after(1.0):
                await orch.run(tasks=tasks_of(4, prefix="a"))
            result = await orch.run(tasks=tasks_of(4, prefix="b"))
        assert result.status == "success"
        assert result.metadata.peak_concurrency == 2
        assert probe_limit.max_in_flight == 2
