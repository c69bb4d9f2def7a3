"""A run handle steers a run while it goes on: `start` returns at once; pause stops new attempts
and resume lets them go; cancel by selector ends running and waiting tasks and skips their
dependents; reprioritize reorders waiting tasks; results stream out to a handle that asked, and
`orch.stream()` is a run read that way; stop drains within its grace and returns a "cancelled"
result that says why. Every control call is safe
before the run has its tasks, while paused, while stopping and after the end, and repeating it
changes nothing."""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import (
    Cancellation,
    ConfigError,
    Context,
    InputError,
    Orchestrator,
    ResultStream,
    RetryableError,
    RetryPolicy,
    RunHandle,
    Task,
    TaskResult,
    agent,
)
from orchestra.result import CancelRecord
from orchestra.status import status_line
from orchestra.stores import SQLiteStore
from orchestra.stores._protocol import Selector
from orchestra.testing import FakeClock, scripted
from tests.helpers import fake_clock, tasks_of
from tests.test_orchestrator import Hanging, ok_agent

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from pathlib import Path

pytestmark = pytest.mark.usefixtures("no_leaks")


class Sleeper:
    """Sleeps `task.payload` seconds (virtual under a FakeClock) and returns the payload; records
    when each attempt starts and ends, how many run at once, and which were cancelled."""

    def __init__(self, name: str = "sleeper", kinds: tuple[str, ...] = ("work",)) -> None:
        self.name = name
        self.kinds = kinds
        self.concurrency = 100
        self.started: list[tuple[str, float]] = []
        self.ended: list[str] = []
        self.cancelled: list[str] = []
        self.now = 0
        self.peak = 0

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.started.append((task.id, anyio.current_time()))
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await anyio.sleep(task.payload)
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(task.id)
            raise
        finally:
            self.now -= 1
        self.ended.append(task.id)
        return task.payload

    def ids(self) -> list[str]:
        return [i for i, _ in self.started]


def work(n: int, seconds: float = 1.0, kind: str = "work", **fields: Any) -> list[Task]:
    return [Task(kind, seconds, id=f"{kind[0]}{i}", **fields) for i in range(n)]


@pytest.fixture
def sleeper() -> Sleeper:
    return Sleeper()


@pytest.fixture
def make(
    clock: FakeClock, sleeper: Sleeper, make_orchestrator: Callable[..., Orchestrator]
) -> Callable[..., Orchestrator]:
    def build(**options: Any) -> Orchestrator:
        options.setdefault("agents", [sleeper])
        options.setdefault("concurrency", 2)
        return make_orchestrator(**options)

    return build


class TestStart:
    async def test_needs_the_orchestrators_async_with(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        with pytest.raises(ConfigError, match="async with"):
            make().start(tasks=work(1))

    async def test_returns_at_once_and_awaiting_gives_the_run_result(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(3), run_id="job-1")
            assert isinstance(handle, RunHandle)
            assert (handle.done, handle.result, sleeper.started) == (False, None, [])
            result = await handle
        assert handle.done
        assert handle.result is result
        assert result.status == "success"
        assert result.metadata.run_id == handle.run_id == "job-1"
        assert result.data == {"w0": 1.0, "w1": 1.0, "w2": 1.0}

    async def test_a_bad_input_is_raised_by_await(self, make: Callable[..., Orchestrator]) -> None:
        async with make() as orch:
            handle = orch.start(tasks=[Task("work", 1, id="a", depends_on=["nope"])])
            with pytest.raises(InputError, match="nope"):
                await handle
        assert handle.done
        assert handle.result is None

    async def test_leaving_async_with_waits_for_the_started_run(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(4))
        assert handle.done
        assert handle.result is not None
        assert handle.result.status == "success"
        assert len(sleeper.ended) == 4

    async def test_run_and_stream_still_work_beside_it(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(2))
            ran = await orch.run(tasks=work(2, kind="work", tags=()))
            streamed = [r.task_id async for r in orch.stream(tasks=work(1))]
            assert (await handle).status == ran.status == "success"
            assert streamed == ["w0"]


class TestPause:
    async def test_no_attempt_starts_while_paused_and_resume_goes_on(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(4))
            handle.pause()  # before the run has its tasks: nothing starts at all
            await anyio.sleep(10)
            assert sleeper.started == []
            assert handle.paused
            handle.resume()
            result = await handle
        assert result.status == "success"
        assert min(t for _, t in sleeper.started) - t0 == pytest.approx(10)

    async def test_running_attempts_finish_and_no_new_one_starts(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(6, seconds=2))
            await anyio.sleep(1)
            handle.pause()
            await anyio.sleep(10)
            assert sorted(sleeper.ended) == ["w0", "w1"]  # the two running ones finished
            assert len(sleeper.started) == 2
            handle.resume()
            await handle
        assert [t - t0 for i, t in sleeper.started if i in ("w2", "w3")] == [pytest.approx(11)] * 2

    async def test_pause_and_resume_are_idempotent(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(4))
            await anyio.sleep(0.5)
            handle.pause()
            handle.pause()
            await anyio.sleep(5)
            handle.resume()
            handle.resume()
            result = await handle
            handle.pause()  # after the end: nothing happens
            handle.resume()
        assert result.status == "success"
        assert sleeper.peak == 2
        assert len(sleeper.started) == 4

    async def test_a_store_catching_up_never_ends_a_pause_and_resume_waits_for_the_store(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        # A durable store holds dispatch while its writes are behind (`Listener.hold`): the end of
        # its hold is not a resume, and a resume does not end its hold.
        async with make() as orch:
            handle = orch.start(tasks=work(4))
            await anyio.sleep(0.5)
            run = handle._run
            assert run is not None
            handle.pause()
            run.hold(True)
            run.hold(False)
            await anyio.sleep(5)
            assert len(sleeper.started) == 2  # still paused
            assert handle.status().state == "paused"
            run.hold(True)
            handle.resume()
            await anyio.sleep(5)
            assert len(sleeper.started) == 2  # still held by the store
            assert handle.status().state == "running"
            run.hold(False)
            result = await handle
        assert result.status == "success"
        assert len(sleeper.started) == 4

    async def test_a_retry_that_comes_due_while_paused_waits_for_resume(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        calls: list[float] = []

        @agent(kinds=["work"], retry=RetryPolicy(max_attempts=2, base=1.0, jitter="none"))
        async def flaky(task: Task, ctx: Context) -> str:
            calls.append(anyio.current_time())
            if ctx.attempt == 1:
                raise RetryableError("again", retry_after=1.0)
            return "ok"

        async with make(agents=[flaky]) as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=[Task("work", None, id="a")])
            await anyio.sleep(0.5)
            handle.pause()
            await anyio.sleep(5)
            assert len(calls) == 1  # the retry was due at 1.0; it waits
            handle.resume()
            result = await handle
        assert result.status == "success"
        assert calls[1] - t0 == pytest.approx(5.5)


class TestCancel:
    async def test_a_running_attempt_is_cancelled_and_its_runner_goes_on(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=[Task("work", 10, id="long"), Task("work", 1, id="next")])
            await anyio.sleep(1)
            cancellation = handle.cancel(task_id="long", reason="not needed")
            assert cancellation == Cancellation("not needed", ("long",), ())
            result = await handle
        assert sleeper.cancelled == ["long"]
        assert sleeper.ended == ["next"]
        assert result.metadata.elapsed == pytest.approx(2)
        error = result.error_for("long")
        assert error is not None
        assert (error.status, error.error_type, error.message) == (
            "cancelled",
            "Cancelled",
            "not needed",
        )
        assert result.status == "failed"  # a cancelled task is not a success; the run went on

    @pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
    async def test_a_task_cancelled_or_stopped_mid_attempt_ends_on_its_agent(
        self, make: Callable[..., Orchestrator], tmp_path: Path, durable: bool
    ) -> None:
        # Was: agent None, so "the last one tried" (a Prometheus label, `orchestra run`'s JSON
        # line) was empty for a task that had run on one. A task that never ran has none.
        store = {"store": SQLiteStore(tmp_path / "runs.db")} if durable else {}
        async with make(concurrency=2, **store) as orch:
            handle = orch.start(tasks=work(3, seconds=10))
            results = handle.results()
            await anyio.sleep(1)
            handle.cancel(task_id="w0")
            await handle.stop(grace=0)
            ended = {r.task_id: (r.status, r.attempts, r.agent) async for r in results}
        assert ended == {
            "w0": ("cancelled", 1, "sleeper"),
            "w1": ("cancelled", 1, "sleeper"),
            "w2": ("cancelled", 0, None),
        }

    @pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
    async def test_the_attempt_a_cancel_cuts_short_is_in_the_tasks_attempts(
        self, make: Callable[..., Orchestrator], tmp_path: Path, durable: bool
    ) -> None:
        # Was: counted in `attempts` and by the metrics, missing from the error record's list of
        # attempts (which DESIGN says lists every one).
        calls: list[str] = []

        @agent(kinds=["work"])
        async def flaky(task: Task, ctx: Context) -> None:
            calls.append(task.id)
            if len(calls) == 1:
                raise RetryableError("once")
            await anyio.sleep(10)

        store = {"store": SQLiteStore(tmp_path / "runs.db")} if durable else {}
        policy = RetryPolicy(max_attempts=3, base=1.0, cap=1.0, jitter="none")
        async with make(agents=[flaky], retry=policy, **store) as orch:
            handle = orch.start(tasks=[Task("work", id="t")])
            await anyio.sleep(3)  # failed at 0, retried at 1, running for 2 s
            handle.cancel(task_id="t")
            result = await handle
        [error] = result.errors
        assert [(a.number, a.error_type, a.agent) for a in error.attempts] == [
            (1, "RetryableError", "flaky"),
            (2, "Cancelled", "flaky"),
        ]
        cut = error.attempts[1]
        assert cut.started == pytest.approx(1.0, abs=0.01)
        assert cut.duration == pytest.approx(2.0, abs=0.01)

    async def test_waiting_tasks_are_removed_and_dependents_skipped_with_the_reason(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        tasks = [
            Task("work", 1, id="a"),
            Task("work", 1, id="b"),
            Task("work", 1, id="c", depends_on=["b"]),
            Task("work", 1, id="d", depends_on=["c"]),
        ]
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=tasks)
            await anyio.sleep(0.5)
            cancellation = handle.cancel(task_id=["b"])
            result = await handle
        assert cancellation.cancelled == ("b",)
        assert set(cancellation.skipped) == {"c", "d"}
        assert sleeper.ids() == ["a"]
        skipped = result.error_for("c")
        assert skipped is not None
        assert skipped.status == "skipped"
        assert "dependency 'b' cancelled" in skipped.message
        (record,) = result.metadata.cancellations
        assert record.selector == {"task_id": ["b"]}
        assert record.cancelled == ["b"]
        assert record.at == pytest.approx(0.5)

    @pytest.mark.parametrize(
        ("selector", "expected"),
        [
            ({"kind": "other"}, {"o0", "o1"}),
            ({"tag": "red"}, {"w1", "o1"}),
            ({"priority": (5, 9)}, {"w2", "o0"}),
            ({"kind": "work", "tag": "red"}, {"w1"}),
        ],
    )
    async def test_selectors(
        self,
        make: Callable[..., Orchestrator],
        selector: dict[str, Any],
        expected: set[str],
    ) -> None:
        tasks = [
            Task("work", 1, id="w0"),
            Task("work", 1, id="w1", tags=["red"]),
            Task("work", 1, id="w2", priority=7),
            Task("other", 1, id="o0", priority=5),
            Task("other", 1, id="o1", tags=["red"]),
        ]
        agents = [Sleeper("first", ("work",)), Sleeper("second", ("other",))]
        async with make(agents=agents, concurrency=1) as orch:
            handle = orch.start(tasks=tasks)
            handle.pause()
            await anyio.lowlevel.checkpoint()
            assert set(handle.cancel(**selector).cancelled) == expected
            handle.resume()
            result = await handle
        assert {e.task_id for e in result.errors} == expected

    async def test_by_agent_it_cancels_what_runs_on_or_is_bound_to_that_agent(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        first, second = Sleeper("first", ("work",)), Sleeper("second", ("work",))
        first.concurrency = second.concurrency = 1
        async with make(agents=[first, second], concurrency=2) as orch:
            handle = orch.start(tasks=work(4, seconds=2))
            await anyio.sleep(1)
            (running,) = second.ids()
            cancellation = handle.cancel(agent="second")
            result = await handle
        assert cancellation.cancelled == (running,)
        assert second.cancelled == [running]
        assert result.metadata.counts["succeeded"] == 3

    @pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
    async def test_by_agent_it_cancels_the_tasks_waiting_for_room_at_that_agent(
        self, make: Callable[..., Orchestrator], tmp_path: Path, durable: bool
    ) -> None:
        # Was: on SQLite, the ready tasks its coordinator set aside for lack of room at the agent
        # (claimable by a worker, in no lane) did not match, and ran after the cancel.
        slow, other = Sleeper("slow", ("slow",)), Sleeper("other", ("other",))
        slow.concurrency = 1
        store = {"store": SQLiteStore(tmp_path / "runs.db")} if durable else {}
        async with make(agents=[slow, other], concurrency=4, **store) as orch:
            handle = orch.start(tasks=work(4, seconds=2, kind="slow") + work(1, kind="other"))
            await anyio.sleep(0.5)
            (held,) = [a for a in handle.status().agents if a.name == "slow"]
            if not durable:  # (a durable run sets them aside, ready, for a worker: not "waiting")
                assert (held.in_flight, held.waiting) == (1, 3)  # the status: waiting for it
            cancellation = handle.cancel(agent="slow")
            result = await handle
        assert set(cancellation.cancelled) == {"s0", "s1", "s2", "s3"}
        assert slow.ids() == ["s0"]  # none of those waiting for it ran after the cancel
        assert result.metadata.counts == {
            "succeeded": 1,
            "failed": 0,
            "skipped": 0,
            "cancelled": 4,
        }

    @pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
    @pytest.mark.parametrize("fallbacks", [False, True], ids=["only-agent", "chain-head"])
    async def test_by_agent_it_cancels_the_ready_tasks_that_go_to_that_agent_first(
        self, make: Callable[..., Orchestrator], tmp_path: Path, durable: bool, fallbacks: bool
    ) -> None:
        """The run's limit is full (one slot, taken by an "other" task): the "slow" tasks are ready,
        claimed by no runner and in no lane. Those whose kind goes to "slow" first (its only
        agent, or the head of its fallback chain) are cancelled by `agent="slow"`, on every store;
        a task of a kind that other agents serve as well is not."""
        slow = Sleeper("slow", ("slow",))
        other = Sleeper("other", ("other", "shared"))
        both = Sleeper("both", ("shared",))
        spare = Sleeper("spare", ("slow",))
        store = {"store": SQLiteStore(tmp_path / "runs.db")} if durable else {}
        agents = [slow, other, both, *([spare] if fallbacks else [])]
        chains = {"fallbacks": {"slow": ["slow", "spare"]}} if fallbacks else {}
        tasks = [
            Task("other", 2, id="o0"),
            *work(3, seconds=1, kind="slow"),
            Task("shared", 1, id="x0"),
        ]
        async with make(agents=agents, concurrency=1, **store, **chains) as orch:
            handle = orch.start(tasks=tasks)
            await anyio.sleep(0.5)
            assert other.ids() == ["o0"]
            cancellation = handle.cancel(agent="slow")
            result = await handle
        assert set(cancellation.cancelled) == {"s0", "s1", "s2"}
        assert slow.ids() == spare.ids() == []
        assert result.metadata.counts["succeeded"] == 2  # "o0", and "x0" that two agents serve

    async def test_cancel_is_idempotent(self, make: Callable[..., Orchestrator]) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(3))
            await anyio.sleep(0.5)
            first = handle.cancel(kind="work")
            second = handle.cancel(kind="work")
            result = await handle
            after = handle.cancel(kind="work")
        assert set(first.cancelled) == {"w0", "w1", "w2"}
        assert first
        assert second.cancelled == second.skipped == ()
        assert not second
        assert not after
        assert len(result.metadata.cancellations) == 1

    async def test_before_the_run_has_its_tasks_the_cancel_is_kept_for_them(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(3))
            cancellation = handle.cancel(task_id="w1")
            result = await handle
        assert cancellation.deferred
        assert cancellation
        assert "w1" not in sleeper.ids()
        assert [c.cancelled for c in result.metadata.cancellations] == [["w1"]]

    @pytest.mark.parametrize("source", ["generator", "async generator"])
    async def test_before_a_streamed_input_arrives_the_cancel_holds_for_its_tasks(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper, source: str
    ) -> None:
        # The README's decomposer is a generator: the run has no task yet when `start` returns,
        # and each arrives later; the deferred cancel ends every one it selects, as it arrives.
        def tasks() -> Iterator[Task]:
            for i in range(4):
                yield Task("work", 0.5, id=f"w{i}")
                yield Task("summarize", 0.5, id=f"s{i}")

        async def arriving() -> AsyncIterator[Task]:
            for task in tasks():
                await anyio.sleep(0.1)
                yield task

        sleeper.kinds = ("work", "summarize")
        async with make() as orch:
            handle = orch.start(tasks=tasks() if source == "generator" else arriving())
            cancellation = handle.cancel(kind="summarize")
            result = await handle
        assert cancellation.deferred
        assert sorted(sleeper.ids()) == ["w0", "w1", "w2", "w3"]
        assert [sorted(c.cancelled) for c in result.metadata.cancellations] == [
            ["s0", "s1", "s2", "s3"]
        ]
        assert result.metadata.counts["cancelled"] == 4

    async def test_by_tag_it_looks_at_the_group_not_at_every_task(
        self, make: Callable[..., Orchestrator], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A cancel by tag searched every task of the run: k small cancels among n tasks were
        # O(k * n) (200 of them among 100,000 waiting tasks: 2.6 s). A tag is a group, and the
        # store has its members: counted, the records a cancel looks at.
        looked = 0
        matches = Selector.matches

        def counted(self: Selector, record: Any, running_agent: str | None = None) -> bool:
            nonlocal looked
            looked += 1
            return matches(self, record, running_agent)

        monkeypatch.setattr(Selector, "matches", counted)
        tasks = [Task("work", 1, id=f"w{i}", tags=[f"g{i % 100}"]) for i in range(2_000)]
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=tasks)
            handle.pause()
            await anyio.lowlevel.checkpoint()
            cancelled = [handle.cancel(tag=f"g{i}").cancelled for i in range(1, 100)]
            handle.resume()
            result = await handle
        assert cancelled[0] == tuple(f"w{i}" for i in range(1, 2_000, 100))
        assert result.metadata.counts["cancelled"] == 99 * 20
        assert looked <= 99 * 20

    async def test_a_cancel_kept_for_a_streamed_input_does_not_copy_its_ids_for_each_task(
        self, make: Callable[..., Orchestrator], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The cancel's record was copied, with every id it had cancelled so far, for each task
        # it cancelled as the input arrived: O(n^2) over a streamed input (80,000 tasks: 6.6 s
        # of 12.7). Counted: the ids copied into new records, and what the run reports.
        copied = 0
        model_copy = CancelRecord.model_copy

        def counted(self: CancelRecord, **options: Any) -> CancelRecord:
            nonlocal copied
            copied += len((options.get("update") or {}).get("cancelled", ()))
            return model_copy(self, **options)

        monkeypatch.setattr(CancelRecord, "model_copy", counted)

        async def tasks() -> AsyncIterator[Task]:  # admitted one by one
            for i in range(1_000):
                yield Task("work", 0, id=f"w{i}")
                yield Task("summarize", 0, id=f"s{i}")

        sleeper = Sleeper(kinds=("work", "summarize"))
        async with make(agents=[sleeper]) as orch:
            handle = orch.start(tasks=tasks())
            handle.cancel(kind="summarize")
            result = await handle
        (record,) = result.metadata.cancellations
        assert record.cancelled == [f"s{i}" for i in range(1_000)]
        assert result.metadata.counts["cancelled"] == 1_000
        assert copied <= 1_000

    @pytest.mark.parametrize(
        ("selector", "match"),
        [
            ({}, "at least one"),
            ({"priority": (3, 1)}, "low <= high"),
            ({"priority": (1,)}, "priority"),
            ({"kind": 3}, "kind must be a str"),
            ({"task_id": [1]}, "task ids must be str"),
            ({"task_id": 5}, "task_id"),
        ],
    )
    async def test_a_bad_selector_is_an_input_error(
        self, make: Callable[..., Orchestrator], selector: dict[str, Any], match: str
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(1))
            with pytest.raises(InputError, match=match):
                handle.cancel(**selector)
            await handle


class TestReprioritize:
    async def test_a_waiting_task_moves_ahead(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=work(4))
            await anyio.sleep(0.5)
            assert handle.reprioritize("w3", -1)
            result = await handle
        assert sleeper.ids() == ["w0", "w3", "w1", "w2"]
        assert result.status == "success"

    async def test_a_task_waiting_for_its_agents_slot_moves_ahead(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        # The run's limit is 10 but the agent's is 1: the runners claimed w1-w4, which wait in
        # the agent's lane (the status's "waiting"), not in the queue.
        sleeper.concurrency = 1
        async with make(concurrency=10) as orch:
            handle = orch.start(tasks=work(5))
            await anyio.sleep(0.5)
            assert handle.status().counts["waiting"] == 4
            assert handle.reprioritize("w4", -1)
            assert orch.reprioritize("w3", -1)  # behind w4, moved there first
            result = await handle
        assert sleeper.ids() == ["w0", "w4", "w3", "w1", "w2"]
        assert result.status == "success"

    async def test_false_for_a_task_that_does_not_wait_and_after_the_end(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=work(2))
            await anyio.sleep(0.5)
            assert not handle.reprioritize("w0", 0)  # running
            assert not handle.reprioritize("missing", 0)
            await handle
            assert not handle.reprioritize("w1", 0)
            with pytest.raises(InputError, match="priority must be an int"):
                handle.reprioritize("w1", 1.5)  # type: ignore[arg-type]

    async def test_before_the_run_has_its_tasks_the_change_is_kept(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=work(3))
            assert handle.reprioritize("w2", -5)
            await handle
        assert sleeper.ids() == ["w2", "w0", "w1"]

    async def test_before_a_streamed_input_arrives_the_change_waits_for_its_task(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async def arriving() -> AsyncIterator[Task]:
            for task in work(3):
                yield task
            await anyio.sleep(0.1)  # w3 arrives once w0 runs and w1, w2 wait
            yield Task("work", 1.0, id="w3")

        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=arriving())
            assert handle.reprioritize("w3", -5)
            await handle
        assert sleeper.ids() == ["w0", "w3", "w1", "w2"]


class TestResults:
    async def test_the_stream_of_a_run_that_raised_ends_and_the_handle_raises(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=[{"not": "a task"}])  # type: ignore[list-item]
            assert [r async for r in handle.results()] == []
            with pytest.raises(InputError, match="not a Task"):
                await handle

    async def test_results_stream_out_as_they_finish(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        tasks = [Task("work", s, id=f"s{s}") for s in (3, 1, 2)]
        async with make(concurrency=3) as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=tasks)
            seen = [(r.task_id, anyio.current_time() - t0) async for r in handle.results()]
            assert handle.results() is handle.results()
            await handle
        assert seen == [("s1", 1.0), ("s2", 2.0), ("s3", 3.0)]

    async def test_asked_for_mid_run_it_gives_what_finishes_from_then_on(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        tasks = [Task("work", s, id=f"s{s}") for s in (1, 2, 3)]
        async with make(concurrency=3) as orch:
            handle = orch.start(tasks=tasks)
            await anyio.sleep(1.5)
            late = [r.task_id async for r in handle.results()]
        assert late == ["s2", "s3"]

    async def test_after_the_end_there_is_nothing_to_read(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(2))
            await handle
            assert [r async for r in handle.results()] == []

    async def test_a_reader_of_a_stopped_run_sees_its_cancelled_tasks_end(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make(concurrency=1) as orch:
            handle = orch.start(tasks=work(3))
            results = handle.results()
            await anyio.sleep(0.5)
            await handle.stop(grace=0)
            statuses = {r.task_id: r.status async for r in results}
        assert statuses == {"w0": "cancelled", "w1": "cancelled", "w2": "cancelled"}

    async def test_closing_a_handles_stream_stops_the_reading_not_the_run(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make(concurrency=3) as orch:
            handle = orch.start(tasks=work(3))
            async with handle.results() as results:
                first = await anext(results)
            assert not handle.done
            assert [r async for r in results] == []
            assert results.result is None  # not over yet
            result = await handle
        assert first.task_id == "w0"
        assert result.status == "success"
        assert results.result is result


class TestStream:
    async def test_results_arrive_as_tasks_finish(self, clock: FakeClock) -> None:
        @agent(kinds=["work"])
        async def timed(task: Task, ctx: Context) -> int:
            await anyio.sleep(float(task.payload))
            return int(task.payload)

        tasks = [Task("work", d, id=f"d{d}") for d in (3, 1, 2)]
        seen: list[tuple[str, float]] = []
        async with Orchestrator(agents=[timed]) as orch:
            t0 = anyio.current_time()
            async with orch.stream(tasks=tasks) as results:
                async for item in results:
                    assert isinstance(item, TaskResult)
                    seen.append((item.task_id, anyio.current_time() - t0))
        assert [tid for tid, _ in seen] == ["d1", "d2", "d3"]
        assert [at for _, at in seen] == pytest.approx([1.0, 2.0, 3.0])
        assert results.result is not None
        assert results.result.status == "success"
        assert results.result.data == {"d3": 3, "d1": 1, "d2": 2}

    async def test_a_stream_read_again_after_its_end_is_empty(self) -> None:
        # The second loop raised anyio.ClosedResourceError.
        async with Orchestrator(agents=[ok_agent()]) as orch:
            stream = orch.stream(tasks=tasks_of(2))
            assert [r.task_id async for r in stream] == ["t0", "t1"]
            assert [r.task_id async for r in stream] == []
            await stream.aclose()
            assert [r.task_id async for r in stream] == []
        assert stream.result is not None
        assert stream.result.status == "success"

    async def test_a_stream_closed_before_it_is_read_never_runs(self) -> None:
        # It started its run when read after the close, as if never closed.
        calls: list[str] = []

        @agent(kinds=["work"])
        async def counted(task: Task, ctx: Context) -> None:
            calls.append(task.id)

        async with Orchestrator(agents=[counted]) as orch:
            stream = orch.stream(tasks=tasks_of(2))
            await stream.aclose()
            assert [r async for r in stream] == []
        assert calls == []
        assert stream.result is None

    async def test_a_fully_read_stream_leaves_nothing_unclosed(self, clock: FakeClock) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            count = 0
            async with Orchestrator(agents=[scripted("w", ["work"], latency=0.1)]) as orch:
                stream = orch.stream(tasks=tasks_of(3))
                async for _ in stream:
                    count += 1
                assert stream.result is not None
            del stream
            gc.collect()
        assert count == 3
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []

    def test_stream_needs_async_with(self) -> None:
        orch = Orchestrator(agents=[ok_agent()])
        with pytest.raises(ConfigError):
            orch.stream(tasks=tasks_of(1))

    @pytest.mark.usefixtures("no_leaks")
    async def test_leaving_the_loop_early_cancels_the_run(self, clock: FakeClock) -> None:
        hang = Hanging("hang", ("slow",))
        quick = scripted("quick", ["work"], latency=1.0)
        got: list[str] = []
        async with Orchestrator(agents=[hang, quick]) as orch:
            async with orch.stream(tasks=[*tasks_of(1, "slow", "s"), *tasks_of(2)]) as results:
                async for item in results:
                    got.append(item.task_id)
                    break
            assert hang.cancelled == 1
        assert got == ["t0"]

    async def test_a_stream_left_early_still_has_its_result(self, clock: FakeClock) -> None:
        quick = scripted("quick", ["work"], latency=1.0)
        orch = Orchestrator(agents=[quick], concurrency=1)
        async with orch, orch.stream(tasks=tasks_of(3)) as results:
            async for _ in results:
                break
        result = results.result
        assert result is not None
        assert result.status == "cancelled"
        assert result.metadata.counts["succeeded"] >= 1
        assert result.metadata.total == 3
        assert result.metadata.reason == "the stream was closed before its end"

    async def test_a_stream_closed_while_its_decomposer_works_ends_cancelled(
        self, clock: FakeClock
    ) -> None:
        async def planner(n: int) -> list[Task]:
            await anyio.sleep(10)  # a slow planner: the run has no tasks yet
            return tasks_of(n)

        async def read(results: ResultStream) -> None:
            async for _ in results:
                pass

        orch = Orchestrator(agents=[ok_agent()], decomposer=planner)
        async with orch, orch.stream(2) as results, anyio.create_task_group() as tg:
            tg.start_soon(read, results)  # the first read starts the run
            await anyio.sleep(1)
            await results.aclose()
        assert results.result is not None
        assert results.result.status == "cancelled"
        assert results.result.metadata.reason == "the stream was closed before its end"
        assert results.result.metadata.total == 0

    async def test_bad_input_raises_from_the_stream(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        got: list[TaskResult] = []

        async def read_all(orch: Orchestrator) -> None:
            async with orch.stream(tasks=[Task("nokind", id="x")]) as results:
                got.extend([item async for item in results])

        async with make_orchestrator(agents=[ok_agent()]) as orch:
            with pytest.raises(InputError):
                await read_all(orch)
        assert got == []


class TestStop:
    async def test_running_attempts_finish_within_the_grace_and_the_rest_is_cancelled(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(5, seconds=2))
            await anyio.sleep(1)
            result = await handle.stop(grace=5)
        assert anyio.current_time() - t0 == pytest.approx(2)  # the drain took 1 s, not the grace
        assert result.status == "cancelled"
        assert result.metadata.reason == "stopped (grace 5s)"
        assert result.metadata.counts["succeeded"] == 2
        assert sorted(sleeper.ended) == ["w0", "w1"]
        assert {e.task_id: e.error_type for e in result.errors} == {
            "w2": "Stopped",
            "w3": "Stopped",
            "w4": "Stopped",
        }
        assert sleeper.ids() == ["w0", "w1"]

    async def test_a_stop_that_cancels_nothing_leaves_the_run_as_it_ends(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(2, seconds=2))  # both run at once (limit 2)
            await anyio.sleep(1)
            result = await handle.stop(grace=5)
        assert result.status == "success"
        assert result.metadata.reason is None
        assert result.metadata.counts["succeeded"] == 2

    async def test_attempts_past_the_grace_are_cancelled(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(3, seconds=10))
            await anyio.sleep(1)
            result = await handle.stop(grace=2, reason="maintenance")
        assert anyio.current_time() - t0 == pytest.approx(3)
        assert sorted(sleeper.cancelled) == ["w0", "w1"]
        assert result.status == "cancelled"
        assert result.metadata.reason == "maintenance"
        assert result.metadata.counts["cancelled"] == 3

    async def test_grace_zero_cancels_at_once(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(3, seconds=10))
            await anyio.sleep(1)
            result = await handle.stop(grace=0)
        assert anyio.current_time() - t0 == pytest.approx(1)
        assert result.status == "cancelled"

    async def test_stop_is_idempotent_and_a_shorter_grace_wins(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make() as orch, anyio.create_task_group() as tg:
            t0 = anyio.current_time()
            handle = orch.start(tasks=work(3, seconds=10))
            await anyio.sleep(1)
            tg.start_soon(handle.stop, None)
            await anyio.sleep(1)
            result = await handle.stop(grace=0)
            assert await handle.stop(grace=3) is result
        assert anyio.current_time() - t0 == pytest.approx(2)
        assert result.metadata.reason == "stopped"  # the first stop's reason

    async def test_stop_while_paused_and_before_the_run_has_its_tasks(
        self, make: Callable[..., Orchestrator], sleeper: Sleeper
    ) -> None:
        async with make() as orch:
            t0 = anyio.current_time()
            paused = orch.start(tasks=work(2))
            paused.pause()
            await anyio.sleep(1)
            first = await paused.stop(grace=5)
            early = orch.start(tasks=work(2))
            second = await early.stop()
        assert sleeper.started == []
        assert first.status == second.status == "cancelled"
        assert first.metadata.counts["cancelled"] == second.metadata.counts["cancelled"] == 2
        assert anyio.current_time() - t0 == pytest.approx(1)

    async def test_a_stop_during_a_slow_decomposer_ends_with_nothing_run(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async def slow(_: Any) -> list[Task]:
            await anyio.sleep(100)
            return work(2)

        async with make(decomposer=slow) as orch:
            t0 = anyio.current_time()
            handle = orch.start("input")
            result = await handle.stop(grace=1)
        assert result.status == "cancelled"
        assert result.metadata.total == 0
        assert anyio.current_time() - t0 == pytest.approx(1)

    async def test_a_bad_grace_is_an_input_error(self, make: Callable[..., Orchestrator]) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(1))
            for grace in (-1, float("nan"), "5", True):
                with pytest.raises(InputError, match="grace"):
                    await handle.stop(grace)  # type: ignore[arg-type]
            assert (await handle).status == "success"

    async def test_after_the_end_stop_returns_the_result_as_it_is(
        self, make: Callable[..., Orchestrator]
    ) -> None:
        async with make() as orch:
            handle = orch.start(tasks=work(2))
            result = await handle
            assert await handle.stop(grace=0) is result
            assert result.status == "success"


# -- random interleavings of control calls -----------------------------------------------------

Op = tuple[str, Any]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("sleep"), st.sampled_from([0, 0.3, 1.0, 2.5])),
        st.tuples(st.just("pause"), st.none()),
        st.tuples(st.just("resume"), st.none()),
        st.tuples(st.just("cancel_id"), st.integers(0, 11)),
        st.tuples(st.just("cancel_kind"), st.sampled_from(["a", "b"])),
        st.tuples(st.just("cancel_priority"), st.integers(0, 3)),
        st.tuples(st.just("reprioritize"), st.tuples(st.integers(0, 11), st.integers(-2, 5))),
        st.tuples(st.just("stop"), st.sampled_from([None, 0, 0.5, 3])),
    ),
    max_size=12,
)


async def _interleave(script: list[Op], concurrency: int) -> None:
    async with fake_clock():
        agents = [Sleeper("alpha", ("a",)), Sleeper("beta", ("b",))]
        agents[0].concurrency = 2
        tasks = [
            Task(
                "a" if i % 2 else "b",
                0.5 + (i % 3),
                id=f"t{i}",
                priority=i % 4,
                depends_on=[f"t{i - 3}"] if i >= 3 and i % 4 == 0 else [],
            )
            for i in range(12)
        ]
        cancelled: set[str] = set()
        stopped = False
        finished: list[str] = []
        async with Orchestrator(agents=agents, concurrency=concurrency, seed=1) as orch:
            handle = orch.start(tasks=tasks)
            results = handle.results()
            for op, arg in script:
                if op == "sleep":
                    await anyio.sleep(arg)
                elif op == "pause":
                    handle.pause()
                elif op == "resume":
                    handle.resume()
                elif op == "cancel_id":
                    cancelled.update(handle.cancel(task_id=f"t{arg}").cancelled)
                elif op == "cancel_kind":
                    cancelled.update(handle.cancel(kind=arg).cancelled)
                elif op == "cancel_priority":
                    cancelled.update(handle.cancel(priority=(arg, arg)).cancelled)
                elif op == "reprioritize":
                    handle.reprioritize(f"t{arg[0]}", arg[1])
                else:
                    await handle.stop(arg)
                    stopped = True
            handle.resume()  # a paused run would never end
            async for r in results:
                finished.append(r.task_id)
            result = await handle
        # Every task ended exactly once, seen once by the reader.
        assert sorted(finished) == sorted(t.id for t in tasks)
        assert result.metadata.total == 12
        by_id = {e.task_id: e for e in result.errors}
        # What a cancel reported it cancelled ended cancelled, never ran again, with its reason.
        for task_id in cancelled:
            assert by_id[task_id].status == "cancelled"
            assert by_id[task_id].error_type == "Cancelled"
        # (A cancel made before the run had its tasks reports only in the metadata.)
        recorded = {i for c in result.metadata.cancellations for i in c.cancelled}
        assert cancelled <= recorded
        for task_id in recorded:
            assert by_id[task_id].status == "cancelled"
        # The limits held: the run's, and each agent's.
        assert result.metadata.peak_concurrency <= concurrency
        assert agents[0].peak <= 2
        if result.status == "cancelled":  # only a stop cancels the run itself
            assert stopped
            assert result.metadata.reason is not None
            assert result.metadata.reason.startswith("stopped")
        else:
            assert result.metadata.reason is None or not result.metadata.reason.startswith("stop")
        ran = agents[0].ids() + agents[1].ids()
        assert len(ran) == len(set(ran))  # no task started twice (none of them retries)


class TestInterleavings:
    @settings(max_examples=60, deadline=None)
    @given(script=ops, concurrency=st.integers(1, 4))
    async def test_every_task_ends_once_and_the_limits_hold(
        self, script: list[Op], concurrency: int
    ) -> None:
        await _interleave(script, concurrency)


class TestStatus:
    async def test_starting_running_and_finished(self, clock: FakeClock) -> None:
        async def slow_plan(count: int) -> list[Task]:
            await anyio.sleep(1)
            return [Task("work", i) for i in range(count)]

        work = scripted("w", ["work"], latency=1.0)
        async with Orchestrator(agents=[work], concurrency=2, decomposer=slow_plan) as orch:
            handle = orch.start(6)
            first = handle.status()
            assert (first.state, first.total, first.concurrency) == ("starting", 0, 2)
            await anyio.sleep(2.5)  # planned at 1 s; 2 done at 2 s, 2 running
            mid = handle.status()
            assert (mid.state, mid.total, mid.completed, mid.active) == ("running", 6, 2, 2)
            result = await handle
        last = handle.status()
        assert (last.state, last.completed, last.progress) == ("finished", 6, 100.0)
        assert result.metadata.total == 6

    async def test_a_paused_run_says_so(self, clock: FakeClock) -> None:
        work = scripted("w", ["work"], latency=1.0)
        async with Orchestrator(agents=[work], concurrency=2) as orch:
            handle = orch.start(tasks=[Task("work", i) for i in range(4)])
            await anyio.sleep(1.5)  # two ended at 1 s: there is an ETA
            assert handle.status().eta is not None
            handle.pause()
            assert handle.status().state == "paused"
            assert "(paused)" in status_line(handle.status())
            assert handle.status().eta is None
            handle.resume()
            assert handle.status().state == "running"
            assert handle.status().eta is not None
            await handle

    async def test_a_stopping_run_says_so(self, clock: FakeClock) -> None:
        work = scripted("w", ["work"], latency=1.0)
        async with Orchestrator(agents=[work], concurrency=2) as orch:
            handle = orch.start(tasks=[Task("work", i) for i in range(4)])
            await anyio.sleep(0.5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(handle.stop, 10.0)  # the two running attempts end at 1 s
                await anyio.sleep(0.1)
                assert (handle.status().state, handle.status().eta) == ("stopping", None)
                assert "(stopping)" in status_line(handle.status())
        assert handle.status().state == "finished"
