"""Bounded memory: what a run keeps, and for how long (issue 13, point 8). Sizes are not timed or
weighed here (that is the benchmarks' job): these tests check *what* is kept."""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import Context, Orchestrator, Task, agent
from orchestra._admission import Admission
from orchestra._task import SUCCEEDED
from orchestra.stores import MemoryStore
from orchestra.stores._protocol import NoListener, Selector

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@agent(kinds=["work"])
async def echo(task: Task, ctx: Context) -> Any:
    return task.payload


class Payload:
    """A payload a weak reference can follow."""


class TestFinishedRuns:
    async def test_a_long_lived_orchestrator_keeps_no_finished_runs_tasks(self) -> None:
        refs: list[weakref.ref[Payload]] = []

        @agent(kinds=["work"])
        async def remember(task: Task, ctx: Context) -> int:
            refs.append(weakref.ref(task.payload))  # every task and its payload are the run's
            return 1

        async with Orchestrator(agents=[remember]) as orch:
            result = await orch.run(tasks=[Task("work", Payload(), id=f"t{i}") for i in range(50)])
            assert result.status == "success"
            del result
            gc.collect()
            # The orchestrator is still open: nothing of the finished run is alive any more.
            assert len(refs) == 50
            assert [r for r in refs if r() is not None] == []


def open_run(listener: Any, *, compact: bool) -> Any:
    """A run of a `MemoryStore` for tasks of kind "work", on a clock that stands still."""
    return MemoryStore().open_run(
        "r",
        admission=Admission(["work"], {}),
        listener=listener,
        clock=lambda: 0.0,
        task_timeout=None,
        compact=compact,
    )


class TestStreamedRuns:
    def _store(self) -> Any:
        return open_run(NoListener(), compact=True)

    def _succeed(self, store: Any) -> None:
        record = store.claim()
        assert store.start(record, record.token, "a")
        assert store.settle(record, record.token, SUCCEEDED, record.task.payload, agent="a")

    def test_a_succeeded_task_with_a_generated_id_is_forgotten_whole(self) -> None:
        store = self._store()
        store.admit_one(Task("work", 1), 0)
        store.admit_one(Task("work", 2, id="named"), 1)
        generated = next(r.id for r in store.results() if r.id != "named")
        self._succeed(store)
        self._succeed(store)
        assert store.state_of(generated) is None  # nothing left of it
        assert store.state_of("named") == SUCCEEDED  # later input may still depend on it
        assert list(store.results()) == []

    def test_a_task_someone_waits_for_keeps_its_output(self) -> None:
        store = self._store()
        store.admit_one(Task("work", "out"), 0)
        first = next(iter(store.results()))
        store.admit_one(Task("work", 2, id="after", depends_on=[first.id]), 1)
        self._succeed(store)
        waiting = next(r for r in store.results() if r.id == "after")
        assert store.deps_of(waiting) == {first.id: "out"}

    async def test_a_slow_reader_slows_admission(self) -> None:
        pulled = 0

        async def source() -> AsyncIterator[Task]:
            nonlocal pulled
            for i in range(200):
                pulled += 1
                yield Task("work", i)

        orch = Orchestrator(agents=[echo], window=10)
        behind: list[int] = []
        read = 0
        async with orch, orch.stream(tasks=source()) as results:
            async for _ in results:
                read += 1
                behind.append(pulled - read)
                await anyio.sleep(0.001)  # a slow reader
        assert read == 200
        # What was pulled from the input but not read yet never grows past the window.
        assert max(behind) <= 10 + 1


class TestSpawnOrder:
    @pytest.mark.parametrize("depth", [1, 3, 2_000])
    async def test_a_chain_of_spawns_comes_out_in_spawn_order(self, depth: int) -> None:
        @agent(kinds=["chain"])
        async def chain(task: Task, ctx: Context) -> int:
            n = task.payload
            if n < depth:
                ctx.spawn(Task("chain", n + 1, id=f"c{n + 1}"))
            return int(n)

        result = await Orchestrator(agents=[chain]).run(
            tasks=[Task("chain", 0, id="c0"), Task("chain", depth, id="last")]
        )
        assert list(result.data) == [f"c{i}" for i in range(depth + 1)] + ["last"]

    async def test_spawns_follow_their_spawner_in_input_order(self) -> None:
        @agent(kinds=["split"])
        async def split(task: Task, ctx: Context) -> str:
            if "/" not in task.id:
                for i in range(3):
                    ctx.spawn(Task("split", None, id=f"{task.id}/{i}"))
            return task.id

        result = await Orchestrator(agents=[split]).run(
            tasks=[Task("split", None, id=x) for x in ("a", "b")]
        )
        assert list(result.data) == ["a", "a/0", "a/1", "a/2", "b", "b/0", "b/1", "b/2"]


async def freeze_counts(tasks: Any) -> list[int]:
    """Run `tasks`; what `gc.get_freeze_count()` said during the first three attempts and every
    thousandth (it walks every frozen object: not at every task)."""
    seen: list[int] = []

    @agent(kinds=["work"])
    async def look(task: Task, ctx: Context) -> None:
        if len(seen) < 3 or (task.payload or 0) % 1_000 == 0:
            seen.append(gc.get_freeze_count())

    async with Orchestrator(agents=[look]) as orch:
        result = await orch.run(tasks)
    assert result.status == "success"
    return seen


class TestTheCollector:
    """What a large admission allocates is frozen out of the cyclic GC's sight while runs are under
    way (`orchestra._gc`), and handed back when the last one ends; nobody else's frozen objects
    are touched."""

    @pytest.fixture(autouse=True)
    def _thawed(self) -> Any:
        assert gc.isenabled()
        gc.unfreeze()
        yield
        gc.unfreeze()
        gc.enable()

    async def test_a_large_run_is_frozen_while_it_runs_and_thawed_after(self) -> None:
        seen = await freeze_counts([Task("work", i) for i in range(2_000)])
        assert min(seen) >= 2_000  # at least the run's records
        assert gc.get_freeze_count() == 0

    async def test_a_streamed_run_freezes_nothing(self) -> None:
        seen = await freeze_counts(iter([Task("work", i) for i in range(5_000)]))
        assert set(seen) == {0}

    async def test_a_small_run_freezes_nothing(self) -> None:
        assert set(await freeze_counts([Task("work", i) for i in range(10)])) == {0}

    async def test_what_the_application_froze_stays_frozen_and_is_not_added_to(self) -> None:
        kept = [[object()] for _ in range(100)]
        gc.freeze()
        frozen = gc.get_freeze_count()
        seen = await freeze_counts([Task("work", i) for i in range(2_000)])
        # Not added to (the run's 2,000 records would be), not thawed (a frozen object that
        # dies meanwhile leaves the count, hence the slack).
        assert frozen - 100 < min(seen) <= max(seen) <= frozen
        assert frozen - 100 < gc.get_freeze_count() <= frozen
        del kept

    async def test_the_freeze_lasts_until_the_last_of_two_runs_ends(self) -> None:
        release = anyio.Event()

        @agent(kinds=["slow"])
        async def slow(task: Task, ctx: Context) -> None:
            await release.wait()

        async with Orchestrator(agents=[slow, echo]) as orch, anyio.create_task_group() as tg:
            tg.start_soon(orch.run, [Task("slow")])
            await anyio.sleep(0.01)
            await orch.run(tasks=[Task("work") for _ in range(2_000)])
            assert gc.get_freeze_count() > 0  # the slow run is still under way
            release.set()
        assert gc.get_freeze_count() == 0

    async def test_a_disabled_collector_is_left_alone(self) -> None:
        gc.disable()
        async with Orchestrator(agents=[echo]) as orch:
            result = await orch.run(tasks=[Task("work") for _ in range(2_000)])
        assert result.status == "success"
        assert not gc.isenabled()
        assert gc.get_freeze_count() == 0


class _Quiet(NoListener):
    """A listener that takes plain successes in `quiet` and records what it hears."""

    def __init__(self) -> None:
        self.quiet: list[Any] | None = []
        self.heard: list[str] = []

    def finished(self, record: Any) -> None:
        self.heard.append(record.task_id)


class TestQuietSuccesses:
    def _store(self, listener: Any) -> Any:
        return open_run(listener, compact=False)

    def _run_one(self, store: Any) -> Any:
        record = store.claim()
        assert store.start(record, record.token, "a")
        assert store.succeed(record, record.token, record.task.payload, "a")
        return record

    def test_plain_successes_are_put_aside_and_the_last_is_heard(self) -> None:
        listener = _Quiet()
        store = self._store(listener)
        store.admit([Task("work", i, id=f"t{i}") for i in range(3)], where="tasks", forward=True)
        ended = [self._run_one(store) for _ in range(3)]
        assert listener.quiet == ended[:2]  # in the order they ended, nothing else told
        assert listener.heard == ["t2"]  # it leaves nothing unfinished: the run must hear it
        assert [r.status for r in ended] == [SUCCEEDED] * 3

    def test_a_success_that_readies_a_dependent_is_heard(self) -> None:
        listener = _Quiet()
        store = self._store(listener)
        store.admit(
            [Task("work", 1, id="a"), Task("work", 2, id="b", depends_on=["a"])],
            where="tasks",
            forward=True,
        )
        self._run_one(store)
        assert listener.heard == ["a"]
        assert listener.quiet == []

    def test_without_quiet_every_end_is_heard(self) -> None:
        listener = _Quiet()
        listener.quiet = None
        store = self._store(listener)
        store.admit([Task("work", i, id=f"t{i}") for i in range(3)], where="tasks", forward=True)
        for _ in range(3):
            self._run_one(store)
        assert listener.heard == ["t0", "t1", "t2"]


class _Hearing(NoListener):
    """A listener that records the ends it hears, and the tasks made ready."""

    def __init__(self) -> None:
        self.heard: list[str] = []
        self.readied: list[str] = []

    def ready(self, record: Any) -> None:
        self.readied.append(record.task_id)

    def finished(self, record: Any) -> None:
        self.heard.append(record.task_id)


class TestSuccessesWrittenElsewhere:
    """`MemoryRun.succeeded_elsewhere`: the ends a durable store's coordinator hears, by the batch."""

    def _run(self, *, compact: bool = False) -> tuple[Any, _Hearing]:
        listener = _Hearing()
        store = open_run(listener, compact=compact)
        store.admit(
            [
                Task("work", 1, id="a"), Task("work", 2, id="b"),
                Task("work", 3, id="c", depends_on=["a"]), Task("work", 4, id="d"),
            ],
            where="tasks", forward=True,
        )  # fmt: skip
        return store, listener

    def test_each_ends_as_written_in_order_and_readies_what_waited_for_it(self) -> None:
        store, listener = self._run()
        a, b, c = (store.record_of(i) for i in "abc")
        assert store.claim() is a  # claimed here: another process ended it since
        store.succeeded_elsewhere([(b, {"v": 2}, "w1"), (a, 1, "w2")])
        assert listener.heard == ["b", "a"]
        assert (a.status, a.output, a.agent, b.status, b.output, b.agent) == (
            SUCCEEDED, 1, "w2", SUCCEEDED, {"v": 2}, "w1",
        )  # fmt: skip
        assert listener.readied[-1] == "c"  # what waited for "a" is ready now
        assert c.state == "ready"
        assert store.unfinished == 2
        assert not store.settle(a, a.token, SUCCEEDED, 5, agent="here")  # its end is final
        # "b" left the ready queue; "c" waits behind "d", ready before it.
        assert [store.claim(), store.claim(), store.claim()] == [store.record_of("d"), c, None]

    def test_a_task_ended_here_meanwhile_keeps_its_end(self) -> None:
        store, listener = self._run()
        d = store.record_of("d")
        store.cancel(Selector(task_ids=["d"]), "stop")
        heard = list(listener.heard)
        store.succeeded_elsewhere([(d, 4, "w1")])
        assert listener.heard == heard
        assert d.status == "cancelled"

    def test_a_streamed_run_forgets_them_as_it_forgets_its_own(self) -> None:
        store, listener = self._run(compact=True)
        b = store.record_of("b")
        store.succeeded_elsewhere([(b, 2, "w1")])
        assert listener.heard == ["b"]
        assert store.record_of("b") is None
        assert store.state_of("b") == SUCCEEDED
