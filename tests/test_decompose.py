"""Decomposers (lists, generators, async generators, async functions), streaming with
backpressure, `ctx.spawn`, and the helpers `chunked`, `by_type` and `by_priority`."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    ConfigError,
    Context,
    InputError,
    Orchestrator,
    RetryPolicy,
    Task,
    agent,
    by_priority,
    by_type,
    chunked,
)
from tests.helpers import assert_no_leaks, live_tasks

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from orchestra.testing import FakeClock


class Doubler:
    """Returns twice its payload after `latency` (or a seeded random latency); records the calls
    and how many calls have finished."""

    def __init__(
        self, kinds: tuple[str, ...] = ("work",), *, latency: float | None = 0.0, seed: int = 0
    ) -> None:
        self.name = "doubler"
        self.kinds = kinds
        self.latency = latency
        self.rng = random.Random(seed)
        self.calls: list[str] = []
        self.finished = 0
        self.running = 0
        self.peak = 0

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.calls.append(str(task.id))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            delay = self.rng.uniform(0.1, 2.0) if self.latency is None else self.latency
            if delay:
                await anyio.sleep(delay)
        finally:
            self.running -= 1
        self.finished += 1
        payload = task.payload
        return payload * 2 if isinstance(payload, int) else payload


def numbered(n: int) -> list[Task]:
    return [Task("work", i, id=f"t{i}") for i in range(n)]


EXPECTED = {f"t{i}": 2 * i for i in range(5)}


class TestDecomposerShapes:
    async def test_a_function_returning_a_list(self) -> None:
        seen: list[Any] = []

        def split(data: dict[str, int]) -> list[Task]:
            seen.append(data)
            return numbered(data["n"])

        result = await Orchestrator(agents=[Doubler()], decomposer=split).run({"n": 5})
        assert seen == [{"n": 5}]
        assert result.data == EXPECTED

    async def test_a_function_returning_a_tuple(self) -> None:
        orch = Orchestrator(agents=[Doubler()], decomposer=lambda n: tuple(numbered(n)))
        assert (await orch.run(5)).data == EXPECTED

    async def test_a_generator(self) -> None:
        def split(n: int) -> Iterator[Task]:
            yield from numbered(n)

        result = await Orchestrator(agents=[Doubler()], decomposer=split).run(5)
        assert result.data == EXPECTED

    async def test_an_async_generator(self, clock: FakeClock) -> None:
        async def split(n: int) -> AsyncIterator[Task]:
            for task in numbered(n):
                await anyio.sleep(0.5)
                yield task

        result = await Orchestrator(agents=[Doubler()], decomposer=split).run(5)
        assert result.data == EXPECTED

    async def test_an_async_function_like_a_planner(self, clock: FakeClock) -> None:
        async def plan(n: int) -> list[Task]:
            await anyio.sleep(1.0)  # thinking
            return numbered(n)

        result = await Orchestrator(agents=[Doubler()], decomposer=plan).run(5)
        assert result.data == EXPECTED

    async def test_a_single_task(self) -> None:
        orch = Orchestrator(agents=[Doubler()], decomposer=lambda x: Task("work", x, id="one"))
        assert (await orch.run(21)).data == {"one": 42}

    async def test_tasks_given_directly_skip_the_decomposer(self) -> None:
        called: list[Any] = []

        def split(x: Any) -> list[Task]:
            called.append(x)
            return []

        result = await Orchestrator(agents=[Doubler()], decomposer=split).run(tasks=numbered(5))
        assert called == []
        assert result.data == EXPECTED

    async def test_an_iterable_of_tasks_without_a_decomposer(self) -> None:
        assert (await Orchestrator(agents=[Doubler()]).run(numbered(5))).data == EXPECTED

    async def test_an_empty_decomposition_is_an_empty_success(self) -> None:
        result = await Orchestrator(agents=[Doubler()], decomposer=lambda x: []).run("nothing")
        assert result.status == "success"
        assert result.metadata.total == 0

    @pytest.mark.parametrize("garbage", [42, "tasks", {"kind": "work"}, None], ids=repr)
    async def test_a_decomposer_returning_garbage(self, garbage: Any) -> None:
        doubler = Doubler()
        orch = Orchestrator(agents=[doubler], decomposer=lambda x: garbage)
        with pytest.raises(InputError, match=type(garbage).__name__):
            await orch.run("input")
        assert doubler.calls == []

    async def test_a_whole_list_is_checked_before_any_work(self) -> None:
        doubler = Doubler()
        tasks = [*numbered(3), Task("nokind", id="bad")]
        with pytest.raises(InputError, match="bad"):
            await Orchestrator(agents=[doubler], decomposer=lambda x: tasks).run("x")
        assert doubler.calls == []

    async def test_a_decomposer_that_raises_reaches_the_caller_as_is(self) -> None:
        def broken(x: Any) -> list[Task]:
            raise LookupError("the input is unreadable")

        with pytest.raises(LookupError, match="unreadable"):
            await Orchestrator(agents=[Doubler()], decomposer=broken).run("x")

    async def test_a_streamed_input_that_raises_midway_reaches_the_caller_as_is(
        self, clock: FakeClock
    ) -> None:
        async def broken(x: Any) -> AsyncIterator[Task]:
            yield Task("work", 1, id="first")
            await anyio.sleep(1.0)
            raise LookupError("the source went away")

        caught: BaseException | None = None
        try:
            await Orchestrator(agents=[Doubler(latency=10.0)], decomposer=broken).run("x")
        except BaseException as exc:
            caught = exc
        assert type(caught) is LookupError

    @pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
    async def test_sys_exit_or_ctrl_c_in_a_streamed_input_reaches_the_caller_after_the_run_ends(
        self, clock: FakeClock, stop: type[BaseException]
    ) -> None:
        # Raised in the task that reads the input, it would leave the event loop and abandon the
        # caller's `await` with the run half torn down.
        async def exits(x: Any) -> AsyncIterator[Task]:
            yield Task("work", 1, id="first")
            await anyio.sleep(1.0)
            raise stop

        before = live_tasks()
        orch = Orchestrator(agents=[Doubler(latency=10.0)], decomposer=exits)
        caught: BaseException | None = None
        try:
            await orch.run("x")
        except BaseException as exc:
            caught = exc
        assert type(caught) is stop
        await assert_no_leaks(before)


class TestBackpressure:
    @pytest.mark.parametrize(("window", "concurrency"), [(1, 4), (3, 2), (3, 10), (5, 5)])
    async def test_a_streamed_input_never_has_more_than_window_tasks_unfinished(
        self, window: int, concurrency: int, clock: FakeClock
    ) -> None:
        doubler = Doubler(latency=None, seed=window)
        unfinished_at_pull: list[int] = []

        async def source(n: int) -> AsyncIterator[Task]:
            for i in range(n):
                unfinished_at_pull.append(i - doubler.finished)  # yielded so far - finished
                yield Task("work", i, id=f"t{i}")

        orch = Orchestrator(
            agents=[doubler], decomposer=source, window=window, concurrency=concurrency
        )
        result = await orch.run(30)
        assert result.status == "success"
        assert len(result.data) == 30
        assert max(unfinished_at_pull) <= window
        assert max(unfinished_at_pull) == window  # the window is used, not just respected
        assert doubler.peak <= min(window, concurrency)

    async def test_tasks_waiting_for_a_dependency_count_against_the_window(
        self, clock: FakeClock
    ) -> None:
        # Everything waits for a slow first task: the input must still not be read ahead of the
        # window (those waiting tasks are admitted and unfinished; they can all make progress).
        finished: list[str] = []

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> None:
            await anyio.sleep(100.0 if task.id == "t0" else 1.0)
            finished.append(str(task.id))

        unfinished_at_pull: list[int] = []

        async def source(n: int) -> AsyncIterator[Task]:
            for i in range(n):
                unfinished_at_pull.append(i - len(finished))
                yield Task("work", i, id=f"t{i}", depends_on=["t0"] if i else [])

        orch = Orchestrator(agents=[work], decomposer=source, window=3)
        result = await orch.run(20)
        assert result.status == "success"
        assert max(unfinished_at_pull) <= 3

    async def test_a_sync_generator_is_pulled_lazily_too(self, clock: FakeClock) -> None:
        doubler = Doubler(latency=1.0)
        unfinished_at_pull: list[int] = []

        def source(n: int) -> Iterator[Task]:
            for i in range(n):
                unfinished_at_pull.append(i - doubler.finished)
                yield Task("work", i, id=f"t{i}")

        result = await Orchestrator(agents=[doubler], decomposer=source, window=2).run(10)
        assert len(result.data) == 10
        assert max(unfinished_at_pull) <= 2

    async def test_the_streamed_input_is_closed_when_the_run_ends_early(
        self, clock: FakeClock
    ) -> None:
        closed: list[bool] = []

        async def source(x: Any) -> AsyncIterator[Task]:
            try:
                yield Task("work", 1, id="a")
                yield Task("work", 2, id="a")  # a duplicate id ends the run
                yield Task("work", 3, id="never")
            finally:
                closed.append(True)

        with pytest.raises(InputError):
            await Orchestrator(agents=[Doubler()], decomposer=source).run("x")
        assert closed == [True]

    async def test_a_sync_generator_is_closed_when_the_run_is_cancelled(
        self, clock: FakeClock
    ) -> None:
        closed: list[bool] = []

        def source(x: Any) -> Iterator[Task]:
            try:
                for i in range(1000):
                    yield Task("work", i, id=f"t{i}")
            finally:
                closed.append(True)

        orch = Orchestrator(agents=[Doubler(latency=10.0)], decomposer=source, window=2)
        with anyio.move_on_after(5.0):
            await orch.run("x")
        assert closed == [True]


class TestSpawn:
    async def test_spawned_tasks_run_after_their_spawner_succeeded(self, clock: FakeClock) -> None:
        events: list[str] = []

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> str:
            for i in range(3):
                ctx.spawn(Task("child", i, id=f"child{i}"))
            events.append("parent spawned")
            await anyio.sleep(5.0)
            events.append("parent done")
            return "p"

        @agent(kinds=["child"])
        async def child(task: Task, ctx: Context) -> int:
            events.append(f"{task.id} started")
            return int(task.payload)

        result = await Orchestrator(agents=[parent, child]).run(tasks=[Task("parent", id="p")])
        assert result.status == "success"
        assert events[:2] == ["parent spawned", "parent done"]
        assert sorted(events[2:]) == ["child0 started", "child1 started", "child2 started"]
        assert list(result.data.items()) == [
            ("p", "p"),
            ("child0", 0),
            ("child1", 1),
            ("child2", 2),
        ]

    async def test_a_failed_attempts_spawns_are_dropped(self, clock: FakeClock) -> None:
        children: list[str] = []

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> str:
            ctx.spawn(Task("child", ctx.attempt, id="child"))
            if ctx.attempt == 1:
                raise ConnectionError("lost the connection after spawning")
            return "ok"

        @agent(kinds=["child"])
        async def child(task: Task, ctx: Context) -> int:
            children.append(f"{task.id}@{task.payload}")
            return int(task.payload)

        orch = Orchestrator(agents=[parent, child], retry=RetryPolicy(max_attempts=2, base=0.0))
        result = await orch.run(tasks=[Task("parent", id="p")])
        assert result.status == "success"
        assert children == ["child@2"]  # only the successful attempt's spawn was admitted
        assert result.data == {"p": "ok", "child": 2}

    async def test_a_permanently_failed_spawner_admits_nothing(self, clock: FakeClock) -> None:
        children: list[str] = []

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> None:
            ctx.spawn(Task("child", 1, id="child"))
            raise ValueError("gave up")

        @agent(kinds=["child"])
        async def child(task: Task, ctx: Context) -> None:
            children.append(str(task.id))

        orch = Orchestrator(
            agents=[parent, child],
            retry=RetryPolicy(max_attempts=3, base=0.0),
            success_threshold=0.0,
        )
        result = await orch.run(tasks=[Task("parent", id="p")])
        assert children == []
        assert result.metadata.total == 1
        error = result.error_for("p")
        assert error is not None
        assert len(error.attempts) == 3

    async def test_spawned_tasks_may_depend_on_the_spawner_and_on_each_other(self) -> None:
        seen: dict[str, dict[str, Any]] = {}

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> str:
            first = ctx.spawn(Task("child", None, id="c1", depends_on=[str(task.id)]))
            ctx.spawn(Task("child", None, id="c2", depends_on=[str(first.id)]))
            return "parent-output"

        @agent(kinds=["child"])
        async def child(task: Task, ctx: Context) -> str:
            seen[str(task.id)] = dict(ctx.deps)
            return f"{task.id}-output"

        result = await Orchestrator(agents=[parent, child]).run(tasks=[Task("parent", id="p")])
        assert result.status == "success"
        assert seen == {"c1": {"p": "parent-output"}, "c2": {"c1": "c1-output"}}

    async def test_spawn_names_the_task_after_its_parent(self) -> None:
        # `<parent id>/<kind>#<n>`, n counting the attempt's spawns (one it names itself too),
        # skipping an id taken: the same ids in every run, whatever order the attempts end in
        # (they were `<kind>#<n>` from the run's counter, in the order the spawns were made).
        ids: list[str | None] = []

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> None:
            await anyio.sleep(0.01 if task.id == "p" else 0.0)  # "q" spawns first
            ids.append(ctx.spawn(Task("child", None)).id)
            ids.append(ctx.spawn(Task("child", None, id=f"{task.id}/child#2")).id)
            ids.append(ctx.spawn(Task("child", None)).id)

        @agent(kinds=["child"])
        async def child(task: Task, ctx: Context) -> None:
            return None

        tasks = [Task("parent", id="p"), Task("parent", id="q")]
        result = await Orchestrator(agents=[parent, child]).run(tasks=tasks)
        assert ids == [f"{p}/child#{n}" for p in "qp" for n in (1, 2, 3)]
        assert list(result.data) == ["p", *ids[3:], "q", *ids[:3]]


class TestChunked:
    def test_chunks_with_ids_and_fields(self) -> None:
        tasks = list(chunked(range(10), 4, kind="sum", priority=2, tags=["batch"]))
        assert [t.payload for t in tasks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert [t.id for t in tasks] == ["sum-0", "sum-1", "sum-2"]
        assert {t.kind for t in tasks} == {"sum"}
        assert {t.priority for t in tasks} == {2}
        assert all(list(t.tags) == ["batch"] for t in tasks)

    def test_id_prefix(self) -> None:
        assert [t.id for t in chunked("abc", 2, kind="k", id_prefix="doc")] == ["doc-0", "doc-1"]

    def test_nothing_in_nothing_out(self) -> None:
        assert list(chunked([], 3, kind="k")) == []

    @pytest.mark.parametrize("size", [0, -1, 1.5, True], ids=repr)
    def test_a_bad_size(self, size: Any) -> None:
        with pytest.raises(ConfigError):
            list(chunked(range(3), size, kind="k"))

    async def test_as_a_decomposer(self) -> None:
        @agent(kinds=["sum"])
        async def total(task: Task, ctx: Context) -> int:
            return sum(task.payload)

        orch = Orchestrator(agents=[total], decomposer=lambda xs: chunked(xs, 3, kind="sum"))
        result = await orch.run(list(range(10)))
        assert result.data == {"sum-0": 3, "sum-1": 12, "sum-2": 21, "sum-3": 9}


class _Invoice:
    pass


class _UrgentInvoice(_Invoice):
    pass


class TestByType:
    def test_routes_by_class_including_subclasses(self) -> None:
        items: list[Any] = [_Invoice(), _UrgentInvoice(), 3]
        tasks = list(by_type(items, {_Invoice: "invoice", int: "number"}))
        assert [t.kind for t in tasks] == ["invoice", "invoice", "number"]
        assert [t.payload for t in tasks] == items

    def test_routes_dicts_by_a_field(self) -> None:
        items = [{"type": "memo"}, {"type": "invoice", "n": 1}, {"kind": "memo"}]
        tasks = list(by_type(items[:2], {"memo": "read", "invoice": "pay"}))
        assert [t.kind for t in tasks] == ["read", "pay"]
        other = list(by_type(items[2:], {"memo": "read"}, field="kind"))
        assert [t.kind for t in other] == ["read"]

    def test_routes_with_a_function_and_priorities(self) -> None:
        tasks = list(
            by_type(["a", "bb", "ccc"], lambda s: f"len{len(s)}", priority=lambda s: -len(s))
        )
        assert [(t.kind, t.priority) for t in tasks] == [("len1", -1), ("len2", -2), ("len3", -3)]

    def test_an_item_without_a_route(self) -> None:
        route: dict[type, str] = {str: "text"}
        with pytest.raises(InputError, match="no route"):
            list(by_type([1.5], route))

    def test_an_unhashable_field_value_is_no_route(self) -> None:
        # It raised TypeError: unhashable type: 'list'.
        with pytest.raises(InputError, match=r"item 0 .* no route"):
            list(by_type([{"type": ["memo"]}], {"memo": "read"}))

    @pytest.mark.parametrize("route", ["memo", 3, ["memo"]], ids=repr)
    def test_a_route_that_is_neither_a_mapping_nor_a_function(self, route: Any) -> None:
        with pytest.raises(ConfigError, match="route") as info:
            list(by_type([{"type": "memo"}], route))
        assert repr(route) in str(info.value)

    def test_by_priority_needs_a_function(self) -> None:
        with pytest.raises(ConfigError, match="priority must be a function"):
            list(by_priority([1], kind="k", priority=3))  # type: ignore[arg-type]

    async def test_as_a_decomposer(self) -> None:
        @agent(kinds=["number", "text"])
        async def describe(task: Task, ctx: Context) -> str:
            return f"{task.kind}:{task.payload}"

        orch = Orchestrator(
            agents=[describe], decomposer=lambda xs: by_type(xs, {int: "number", str: "text"})
        )
        result = await orch.run([1, "a"])
        assert sorted(result.data.values()) == ["number:1", "text:a"]


class TestByPriority:
    def test_priorities_come_from_the_function(self) -> None:
        tasks = list(by_priority([5, 1, 3], kind="k", priority=lambda x: x))
        assert [(t.kind, t.payload, t.priority) for t in tasks] == [
            ("k", 5, 5),
            ("k", 1, 1),
            ("k", 3, 3),
        ]

    async def test_dispatch_follows_them(self) -> None:
        order: list[Any] = []

        @agent(kinds=["k"])
        async def record(task: Task, ctx: Context) -> None:
            order.append(task.payload)

        orch = Orchestrator(
            agents=[record],
            concurrency=1,
            decomposer=lambda xs: list(by_priority(xs, kind="k", priority=lambda c: -c["size"])),
        )
        await orch.run([{"size": 1}, {"size": 9}, {"size": 5}, {"size": 9}])
        assert [c["size"] for c in order] == [9, 9, 5, 1]
