"""Dependencies and groups: ordering, `ctx.deps`, skipping, and bad graphs rejected before work."""

from __future__ import annotations

import math
import tracemalloc
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    Context,
    InputError,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Task,
    Timeouts,
)
from orchestra._admission import reject_cycles

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Sequence

    from orchestra.testing import FakeClock


class RecordingAgent:
    """An agent that records its calls and what it saw in `ctx.deps`, and returns its payload.

    Tasks whose id is in `fail` fail permanently."""

    def __init__(
        self,
        name: str = "rec",
        kinds: Sequence[str] = ("work",),
        *,
        latency: float = 0.0,
        fail: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.kinds = tuple(kinds)
        self.latency = latency
        self.fail = set(fail)
        self.calls: list[str] = []
        self.done: list[str] = []
        self.deps: dict[str, dict[str, Any]] = {}

    async def __call__(self, task: Task, ctx: Context) -> Any:
        task_id = str(task.id)
        self.calls.append(task_id)
        self.deps[task_id] = dict(ctx.deps)
        if self.latency:
            await anyio.sleep(self.latency)
        if task_id in self.fail:
            raise PermanentError(f"{task_id} cannot be done")
        self.done.append(task_id)
        return task.payload


class TestDependsOn:
    async def test_a_task_starts_only_after_its_dependencies_succeeded(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent(latency=1.0)
        # Listed in reverse: a whole list may refer forward.
        tasks = [
            Task("work", "C", id="c", depends_on=["b"]),
            Task("work", "B", id="b", depends_on=["a"]),
            Task("work", "A", id="a"),
        ]
        result = await make_orchestrator(agents=[rec], concurrency=10).run(tasks=tasks)
        assert result.status == "success"
        assert rec.calls == ["a", "b", "c"]
        assert result.metadata.elapsed == pytest.approx(3.0)

    async def test_deps_holds_the_outputs_of_the_direct_dependencies(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        tasks = [
            Task("work", {"n": 1}, id="a"),
            Task("work", {"n": 2}, id="b", depends_on=["a"]),
            Task("work", {"n": 3}, id="c", depends_on=["a"]),
            Task("work", {"n": 4}, id="d", depends_on=["b", "c"]),
        ]
        result = await make_orchestrator(agents=[rec]).run(tasks=tasks)
        assert result.status == "success"
        assert rec.deps["a"] == {}
        assert rec.deps["b"] == {"a": {"n": 1}}
        assert rec.deps["c"] == {"a": {"n": 1}}
        assert rec.deps["d"] == {"b": {"n": 2}, "c": {"n": 3}}
        assert rec.calls[0] == "a"
        assert rec.calls[-1] == "d"

    async def test_a_failed_dependency_skips_its_dependents_transitively(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent(fail=["a"])
        tasks = [
            Task("work", 1, id="a"),
            Task("work", 2, id="b", depends_on=["a"]),
            Task("work", 3, id="c", depends_on=["b"]),
            Task("work", 4, id="free"),
        ]
        result = await make_orchestrator(agents=[rec], success_threshold=0.0).run(tasks=tasks)
        assert sorted(rec.calls) == ["a", "free"]
        assert result.data == {"free": 4}
        statuses = {e.task_id: e.status for e in result.errors}
        assert statuses == {"a": "failed", "b": "skipped", "c": "skipped"}
        b_error = result.error_for("b")
        assert b_error is not None
        assert "'a'" in b_error.message
        assert b_error.remediation
        assert b_error.attempts == []
        assert result.metadata.counts["skipped"] == 2


class TestGroups:
    async def test_a_waiter_runs_after_every_member_and_sees_their_outputs(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        tasks = [
            Task("work", "sum", id="waiter", depends_on_tags=["g"]),
            Task("work", 1, id="m1", tags=["g"]),
            Task("work", 2, id="m2", tags=["g", "other"]),
            Task("work", 3, id="m3", tags=["g"]),
            Task("work", 4, id="outsider", tags=["other"]),
        ]
        result = await make_orchestrator(agents=[rec], concurrency=1).run(tasks=tasks)
        assert result.status == "success"
        before = set(rec.calls[: rec.calls.index("waiter")])
        assert {"m1", "m2", "m3"} <= before
        assert rec.deps["waiter"] == {"m1": 1, "m2": 2, "m3": 3}

    async def test_members_spawned_by_the_group_owner_are_awaited(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent("rec", kinds=["research", "summarize"], latency=1.0)

        async def split(task: Task, ctx: Context) -> int:
            await anyio.sleep(0.5)
            for i in range(3):
                ctx.spawn(Task("research", i, id=f"doc/{i}", tags=["doc"]))
            return 3

        splitter: Any = split
        splitter.name = "split"  # a plain async function with a name and kinds is an agent
        splitter.kinds = ["split"]
        tasks = [
            Task("summarize", "s", id="summary", depends_on_tags=["doc"]),
            Task("split", "text", id="doc"),
        ]
        result = await make_orchestrator(agents=[rec, splitter]).run(tasks=tasks)
        assert result.status == "success"
        assert rec.calls[-1] == "summary"
        assert rec.deps["summary"] == {"doc/0": 0, "doc/1": 1, "doc/2": 2}
        assert result.data["doc"] == 3

    async def test_a_failed_member_skips_the_waiters(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent(fail=["m2"])
        tasks = [
            Task("work", 1, id="m1", tags=["g"]),
            Task("work", 2, id="m2", tags=["g"]),
            Task("work", 3, id="m3", tags=["g"]),
            Task("work", 0, id="waiter", depends_on_tags=["g"]),
            Task("work", 0, id="after-waiter", depends_on=["waiter"]),
        ]
        result = await make_orchestrator(agents=[rec], success_threshold=0.0).run(tasks=tasks)
        assert "waiter" not in rec.calls
        assert "after-waiter" not in rec.calls
        assert {"m1", "m3"} <= set(rec.done)
        waiter = result.error_for("waiter")
        assert waiter is not None
        assert waiter.status == "skipped"
        assert "m2" in waiter.message
        after = result.error_for("after-waiter")
        assert after is not None
        assert after.status == "skipped"

    async def test_a_group_nobody_joins_does_not_block(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        result = await make_orchestrator(agents=[rec]).run(
            tasks=[Task("work", 1, id="waiter", depends_on_tags=["empty"])]
        )
        assert result.status == "success"
        assert rec.deps["waiter"] == {}

    async def test_streamed_tasks_see_the_outputs_of_long_finished_dependencies(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()

        async def source() -> AsyncIterator[Task]:
            for i in range(30):
                yield Task(
                    "work", f"out{i}", id=f"t{i}", depends_on=[f"t{i - 10}"] if i >= 10 else []
                )
                await anyio.sleep(1.0)  # t{i-10} finished long ago
            yield Task("work", "last", id="last", depends_on=["t0", "t29"])

        result = await make_orchestrator(agents=[rec], window=4).run(tasks=source())
        assert result.status == "success"
        assert len(result.data) == 31
        assert rec.deps["t10"] == {"t0": "out0"}
        assert rec.deps["t29"] == {"t19": "out19"}
        assert rec.deps["last"] == {"t0": "out0", "t29": "out29"}

    async def test_a_streamed_waiter_waits_until_the_input_is_exhausted(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()

        async def source() -> AsyncIterator[Task]:
            yield Task("work", 1, id="m1", tags=["g"])
            yield Task("work", 0, id="waiter", depends_on_tags=["g"])
            await anyio.sleep(5)  # m1 is long done: the group is not, the input may bring more
            yield Task("work", 2, id="m2", tags=["g"])

        result = await make_orchestrator(agents=[rec]).run(tasks=source())
        assert result.status == "success"
        assert rec.calls == ["m1", "m2", "waiter"]
        assert rec.deps["waiter"] == {"m1": 1, "m2": 2}

    async def test_group_waiters_do_not_deadlock_a_streamed_input_under_its_window(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Each contract is a split (spawning its clauses, tagged with the contract id) and a
        # summary waiting for them. A summary's group closes only once the input is exhausted, so
        # finished contracts' summaries must not hold the window shut against the rest of the input.
        rec = RecordingAgent("rec", kinds=["clause", "summarize"], latency=0.1)

        async def split(task: Task, ctx: Context) -> None:
            for i in range(2):
                ctx.spawn(Task("clause", i, id=f"{task.id}/{i}", tags=[str(task.id)]))

        splitter: Any = split
        splitter.name = "split"
        splitter.kinds = ["split"]

        async def contracts() -> AsyncIterator[Task]:
            for n in range(6):
                cid = f"contract-{n}"
                yield Task("split", None, id=cid)
                yield Task(
                    "summarize", None, id=f"{cid}/sum", depends_on=[cid], depends_on_tags=[cid]
                )

        orch = make_orchestrator(agents=[rec, splitter], window=3, timeouts=Timeouts(run=1000.0))
        result = await orch.run(tasks=contracts())
        assert result.status == "success", result.metadata.reason
        assert result.metadata.total == 6 * 4


def _cycle() -> list[Task]:
    return [Task("work", id="a", depends_on=["b"]), Task("work", id="b", depends_on=["a"])]


def _long_cycle() -> list[Task]:
    return [
        Task("work", id="ok"),
        Task("work", id="x", depends_on=["ok", "z"]),
        Task("work", id="y", depends_on=["x"]),
        Task("work", id="z", depends_on=["y"]),
    ]


def _group_cycle() -> list[Task]:
    # "member" carries tag g but depends on "waiter", which waits for the whole group g.
    return [
        Task("work", id="member", tags=["g"], depends_on=["waiter"]),
        Task("work", id="waiter", depends_on_tags=["g"]),
    ]


BAD_GRAPHS: dict[str, tuple[Callable[[], list[Task]], set[str], str, str]] = {
    # name: (tasks, acceptable task_id, field, fragment of the message)
    "two-cycle": (_cycle, {"a", "b"}, "depends_on", "cycle"),
    "three-cycle": (_long_cycle, {"x", "y", "z"}, "depends_on", "cycle"),
    "cycle-through-a-group": (_group_cycle, {"member", "waiter"}, "", "cycle"),
    "unknown-id": (
        lambda: [Task("work", id="ok"), Task("work", id="a", depends_on=["ghost"])],
        {"a"},
        "depends_on",
        "ghost",
    ),
    "duplicate-id": (
        lambda: [Task("work", 1, id="a"), Task("work", 2, id="a")],
        {"a"},
        "id",
        "duplicate",
    ),
    "self-dependency": (
        lambda: [Task("work", id="a", depends_on=["a"])],
        {"a"},
        "depends_on",
        "itself",
    ),
    "unknown-kind": (
        lambda: [Task("work", id="ok"), Task("translate", id="a")],
        {"a"},
        "kind",
        "translate",
    ),
    "depends-on-a-string": (
        lambda: [Task("work", id="b"), Task("work", id="a", depends_on="b")],
        {"a"},
        "depends_on",
        "a",
    ),
    "waits-for-its-own-group": (
        lambda: [Task("work", id="a", tags=["g"], depends_on_tags=["g"])],
        {"a"},
        "depends_on_tags",
        "g",
    ),
}
BAD_PRIORITIES: list[Any] = ["high", 1.5, True, None]
BAD_TIMEOUTS: list[Any] = ["10", -1, 0, True, math.nan, 10**400]  # the last: no float holds it


class ArrayLike:
    """A numpy array's manners: its truth value is ambiguous (raises), and it is no Sequence."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value of an array with more than one element is ambiguous")

    def __iter__(self) -> Iterator[str]:
        return iter(["a", "b"])

    def __repr__(self) -> str:
        return "array(['a', 'b'])"


class Unprintable:
    """A value whose repr and str raise (an error message must not call them bare)."""

    def __repr__(self) -> str:
        raise RuntimeError("repr")

    __str__ = __repr__


class TestBadGraphsAreRejectedBeforeWork:
    @pytest.mark.parametrize("case", sorted(BAD_GRAPHS))
    async def test_bad_graph(
        self, case: str, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        build, task_ids, field, fragment = BAD_GRAPHS[case]
        rec = RecordingAgent()
        with pytest.raises(InputError) as info:
            await make_orchestrator(agents=[rec]).run(tasks=build())
        err = info.value
        assert err.task_id in task_ids
        if field:
            assert err.field == field
        assert fragment in str(err)
        assert str(err.task_id) in str(err)
        assert rec.calls == []

    @pytest.mark.parametrize("priority", BAD_PRIORITIES, ids=repr)
    async def test_bad_priority(
        self, priority: Any, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        with pytest.raises(InputError) as info:
            await make_orchestrator(agents=[rec]).run(
                tasks=[Task("work", id="ok"), Task("work", id="p", priority=priority)]
            )
        assert (info.value.task_id, info.value.field) == ("p", "priority")
        assert "'p'" in str(info.value)
        assert rec.calls == []

    @pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=lambda v: repr(v)[:20])
    async def test_bad_timeout(
        self, bad: Any, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        with pytest.raises(InputError) as info:
            await make_orchestrator(agents=[rec]).run(
                tasks=[Task("work", id="ok"), Task("work", id="t", timeout=bad)]
            )
        assert (info.value.task_id, info.value.field) == ("t", "timeout")
        assert "'t'" in str(info.value)
        assert rec.calls == []

    @pytest.mark.parametrize("bad", ["no", 0, 1, None, [True]], ids=repr)
    @pytest.mark.parametrize("named", [True, False], ids=["named", "plain"])
    async def test_bad_critical(
        self, bad: Any, named: bool, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # "no" is truthy: taken as it was, it made the task critical. A plain batch (no ids)
        # goes through the store's fast path, which must not let it by either.
        rec = RecordingAgent()
        first = Task("work", id="ok") if named else Task("work")
        odd = Task("work", id="c" if named else None, critical=bad)
        with pytest.raises(InputError) as info:
            await make_orchestrator(agents=[rec]).run(tasks=[first, odd])
        task_id = "c" if named else "work#2"
        assert (info.value.task_id, info.value.field) == (task_id, "critical")
        assert repr(task_id) in str(info.value)
        assert rec.calls == []

    @pytest.mark.parametrize(
        "field", ["kind", "id", "priority", "timeout", "depends_on", "tags", "key", "critical"]
    )
    async def test_a_value_whose_repr_raises_is_still_an_input_error(
        self, field: str, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        value = Unprintable()
        options: dict[str, Any] = {"id": "u", field: [value] if field == "tags" else value}
        kind = options.pop("kind", "work")
        if field == "kind":
            del options["id"]  # its id is generated from the kind
        rec = RecordingAgent()
        with pytest.raises(InputError, match="<Unprintable>") as info:
            await make_orchestrator(agents=[rec]).run(tasks=[Task(kind, **options)])
        assert info.value.field == field
        assert rec.calls == []

    @pytest.mark.parametrize("bad_id", [["a"], {"a": 1}, {"a"}], ids=repr)
    async def test_an_unhashable_id_in_a_batch(
        self, bad_id: Any, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # The batch's duplicate-id scan hashed it first: TypeError: unhashable type.
        rec = RecordingAgent()
        with pytest.raises(InputError, match="task id must be a non-empty string") as info:
            await make_orchestrator(agents=[rec]).run(tasks=[Task("work"), Task("work", id=bad_id)])
        assert info.value.field == "id"
        assert rec.calls == []

    @pytest.mark.parametrize("field", ["depends_on", "tags", "depends_on_tags"])
    @pytest.mark.parametrize("named", [True, False], ids=["named", "plain"])
    async def test_a_list_field_whose_truth_value_raises(
        self, field: str, named: bool, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # A numpy array's truth value raised ValueError out of admission.
        rec = RecordingAgent()
        options: dict[str, Any] = {field: ArrayLike()}
        task = Task("work", id="x" if named else None, **options)
        with pytest.raises(InputError, match=f"{field} must be a list of strings") as info:
            await make_orchestrator(agents=[rec]).run(tasks=[task])
        assert (info.value.task_id, info.value.field) == ("x" if named else "work#1", field)
        assert rec.calls == []

    @pytest.mark.parametrize("blank", [None, "", 0, []], ids=repr)
    async def test_a_falsy_list_field_is_none(
        self, blank: Any, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Admitted, then iterated in a batch with dependencies: TypeError ('NoneType' object
        # is not iterable).
        tasks = [
            Task("work", 1, id="a", tags=blank, depends_on=blank, depends_on_tags=blank),
            Task("work", 2, id="b", depends_on=["a"], tags=blank, depends_on_tags=blank),
        ]
        result = await make_orchestrator(agents=[RecordingAgent()]).run(tasks=tasks)
        assert result.status == "success"

    async def test_something_that_is_not_a_task(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        bad: Any = {"kind": "work"}
        with pytest.raises(InputError, match="dict"):
            await make_orchestrator(agents=[rec]).run(tasks=[Task("work", id="ok"), bad])
        assert rec.calls == []

    async def test_a_rejected_input_leaves_the_orchestrator_usable(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent()
        async with make_orchestrator(agents=[rec]) as orch:
            with pytest.raises(InputError):
                await orch.run(tasks=_cycle())
            result = await orch.run(tasks=[Task("work", 1, id="a"), Task("work", 2, id="b")])
        assert result.data == {"a": 1, "b": 2}


class TestCycleCheckScale:
    def test_many_waiters_of_a_big_group_cost_edges_per_task_not_per_pair(self) -> None:
        # 1,000 tasks waiting for a group of 1,000 members were a million edges (one per waiter
        # and member): 10,000 of each took a CPU-bound minute to admit. The group is one node
        # now: the check's memory grows with the tasks, measured (deterministically) by
        # tracemalloc: a million edges were some 9 MB.
        n = 1_000
        batch = [Task("work", id=f"m{i}", tags=["g"]) for i in range(n)]
        batch += [Task("work", id=f"w{i}", depends_on_tags=["g"]) for i in range(n)]
        ids = {t.id for t in batch}
        tracemalloc.start()
        try:
            reject_cycles(batch, ids)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2_000_000

    def test_a_cycle_through_one_of_many_groups_names_its_tasks_only(self) -> None:
        batch = [Task("work", id=f"m{i}", tags=[f"g{i % 3}"]) for i in range(9)]
        batch.append(Task("work", id="w", tags=["g0"], depends_on_tags=["g0"]))
        batch.append(Task("work", id="v", depends_on_tags=["g1"]))
        with pytest.raises(InputError) as info:
            reject_cycles(batch, {t.id for t in batch})
        assert "['w']" in str(info.value)
        assert info.value.task_id == "w"


SPAWNED: dict[str, tuple[Callable[[], Task], str]] = {
    # name: (the task the agent spawns, a fragment of the InputError message)
    "unknown-kind": (lambda: Task("translate", id="child"), "translate"),
    "unknown-dependency": (lambda: Task("work", id="child", depends_on=["ghost"]), "ghost"),
    "duplicate-id": (lambda: Task("work", id="other"), "other"),
    "self-dependency": (lambda: Task("work", id="child", depends_on=["child"]), "itself"),
    "bad-priority": (lambda: Task("work", id="child", priority="urgent"), "priority"),  # type: ignore[arg-type]
    "bad-timeout": (lambda: Task("work", id="child", timeout=-5), "timeout"),
}


class TestBadSpawnsFailTheSpawner:
    @pytest.mark.parametrize("case", sorted(SPAWNED))
    async def test_bad_spawn(
        self, case: str, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        build, fragment = SPAWNED[case]
        rec = RecordingAgent()

        async def spawner(task: Task, ctx: Context) -> str:
            ctx.spawn(build())
            return "spawned"

        agent_: Any = spawner
        agent_.name = "spawner"
        agent_.kinds = ["spawn"]
        orch = make_orchestrator(
            agents=[rec, agent_], retry=RetryPolicy(max_attempts=3, base=0.0), success_threshold=0.0
        )
        result = await orch.run(
            tasks=[Task("work", 0, id="other"), Task("spawn", None, id="parent")]
        )
        error = result.error_for("parent")
        assert error is not None
        assert error.status == "failed"
        assert error.error_type == "InputError"
        assert fragment in error.message
        assert len(error.attempts) == 1  # permanent: not retried
        assert rec.calls == ["other"]  # the spawned task never ran
        assert "child" not in result.data


class TestStreamedInputErrors:
    async def test_a_bad_streamed_task_raises_when_it_arrives(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        rec = RecordingAgent(latency=100.0)

        async def source() -> AsyncIterator[Task]:
            yield Task("work", 1, id="first")
            await anyio.sleep(1)
            yield Task("work", 2, id="bad", depends_on=["nowhere"])

        t0 = anyio.current_time()
        async with make_orchestrator(agents=[rec]) as orch:
            with pytest.raises(InputError) as info:
                await orch.run(tasks=source())
        assert info.value.task_id == "bad"
        assert rec.calls == ["first"]  # it had started; it was cancelled, not awaited
        assert rec.done == []
        assert anyio.current_time() - t0 < 100.0

    @pytest.mark.parametrize("how", ["async", "sync"])
    async def test_a_streamed_cycle_through_a_group_is_refused(
        self, how: str, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # "member" joins g and depends on "waiter", which waits for g: streamed one at a time (an
        # async generator) or in one chunk (a plain one), it waited forever.
        rec = RecordingAgent()
        tasks = _group_cycle()[::-1]  # the waiter first: a streamed task depends backwards

        async def source() -> AsyncIterator[Task]:
            for task in tasks:
                yield task

        async with make_orchestrator(agents=[rec]) as orch:
            with pytest.raises(InputError, match="cycle") as info:
                await orch.run(tasks=source() if how == "async" else iter(tasks))
        assert info.value.task_id == "member"
        assert rec.done == []
