"""Aggregation into `RunResult.data`, the run's metadata and error records, and their JSON."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    Aggregator,
    ByKind,
    Collect,
    ConfigError,
    Context,
    Discard,
    Merge,
    Orchestrator,
    PermanentError,
    Reduce,
    RetryPolicy,
    RunResult,
    Task,
    TaskResult,
    Transform,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra.testing import FakeClock


class Worker:
    """Returns `payload["out"]` after `payload["delay"]` seconds (default: a random delay drawn
    from `seed`); a payload with `"fail": True` fails permanently; `"flaky": True` fails its first
    attempt."""

    def __init__(
        self, name: str = "worker", kinds: Sequence[str] = ("work",), *, seed: int = 0
    ) -> None:
        self.name = name
        self.kinds = tuple(kinds)
        self.rng = random.Random(seed)
        self.finished: list[str] = []

    async def __call__(self, task: Task, ctx: Context) -> Any:
        payload = task.payload
        delay = payload.get("delay")
        await anyio.sleep(self.rng.uniform(0.0, 5.0) if delay is None else delay)
        if payload.get("fail"):
            raise PermanentError(f"cannot do {task.id}")
        if payload.get("flaky") and ctx.attempt == 1:
            raise ConnectionError("flaky network")
        self.finished.append(str(task.id))
        return payload.get("out")


def work(out: Any, task_id: str, kind: str = "work", **payload: Any) -> Task:
    return Task(kind, {"out": out, **payload}, id=task_id)


async def run_with(
    aggregate: Aggregator | dict[str, Aggregator] | None,
    tasks: list[Task],
    *,
    seed: int = 0,
    kinds: Sequence[str] = ("work",),
    **options: Any,
) -> RunResult:
    options.setdefault("success_threshold", 0.0)
    orch = Orchestrator(
        agents=[Worker(kinds=kinds, seed=seed)], aggregate=aggregate, seed=seed, **options
    )
    return await orch.run(tasks=tasks)


class TestCollect:
    async def test_data_is_outputs_by_id_in_admission_order(self, clock: FakeClock) -> None:
        # The last task finishes first: the order of `data` is the input's, not completion's.
        tasks = [work(f"out{i}", f"t{i}", delay=10 - i) for i in range(5)]
        worker = Worker()
        result = await Orchestrator(agents=[worker]).run(tasks=tasks)
        assert worker.finished == ["t4", "t3", "t2", "t1", "t0"]
        assert list(result.data.items()) == [(f"t{i}", f"out{i}") for i in range(5)]

    async def test_only_succeeded_tasks_are_collected(self, clock: FakeClock) -> None:
        tasks = [work(1, "a", delay=1), work(2, "b", delay=1, fail=True), work(3, "c", delay=1)]
        result = await run_with(Collect(), tasks)
        assert result.data == {"a": 1, "c": 3}


class TestMerge:
    async def test_lists_are_concatenated_in_admission_order(self, clock: FakeClock) -> None:
        tasks = [
            work([1, 2], "a", delay=3),
            work(3, "b", delay=2),  # a single item counts as one
            work(None, "c", delay=1),  # None adds nothing
            work([4], "d", delay=0),
        ]
        result = await run_with(Merge(), tasks)
        assert result.data == [1, 2, 3, 4]

    async def test_dedupe_keeps_the_first_of_equal_items(self, clock: FakeClock) -> None:
        tasks = [work([3, 1, 3], "a", delay=2), work([1, 2], "b", delay=1)]
        result = await run_with(Merge(dedupe=True), tasks)
        assert result.data == [3, 1, 2]

    async def test_dedupe_by_key(self, clock: FakeClock) -> None:
        tasks = [
            work([{"id": 1, "v": "first"}, {"id": 2, "v": "x"}], "a", delay=2),
            work([{"id": 1, "v": "second"}], "b", delay=1),
        ]
        result = await run_with(Merge(dedupe=True, key=lambda c: c["id"]), tasks)
        assert result.data == [{"id": 1, "v": "first"}, {"id": 2, "v": "x"}]

    async def test_sort_by_is_stable(self, clock: FakeClock) -> None:
        tasks = [
            work([{"k": 2, "n": "a2"}, {"k": 1, "n": "a1"}], "a", delay=1),
            work([{"k": 1, "n": "b1"}, {"k": 2, "n": "b2"}], "b", delay=2),
        ]
        result = await run_with(Merge(sort_by=lambda c: c["k"]), tasks)
        assert [c["n"] for c in result.data] == ["a1", "b1", "a2", "b2"]

    async def test_dedupe_and_sort_together(self, clock: FakeClock) -> None:
        tasks = [work([5, 3, 5], "a", delay=1), work([3, 9, 1], "b", delay=0)]
        result = await run_with(Merge(dedupe=True, sort_by=lambda x: -x), tasks)
        assert result.data == [9, 5, 3, 1]


class TestReduce:
    @pytest.mark.parametrize(
        ("how", "expected"),
        [("sum", 16.0), ("mean", 4.0), ("max", 7), ("min", 1), ("count", 4)],
    )
    async def test_builtins(self, how: Any, expected: Any, clock: FakeClock) -> None:
        values = [3, 7, 1, 5]
        tasks = [work(v, f"t{i}", delay=4 - i) for i, v in enumerate(values)]
        tasks.append(work(100, "failed", fail=True, delay=0))
        result = await run_with(Reduce(how), tasks)
        assert result.data == expected

    async def test_sum_is_exact_whatever_the_order(self, clock: FakeClock) -> None:
        values = [1e16, 1.0, -1e16, 1.0]
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
            tasks = [work(values[i], f"t{i}", delay=order.index(i)) for i in range(4)]
            result = await run_with(Reduce("sum"), tasks)
            assert result.data == 2.0

    async def test_a_sum_of_ints_is_an_int_and_a_mix_is_exact(self, clock: FakeClock) -> None:
        ints = await run_with(Reduce("sum"), [work(i, f"t{i}", delay=0) for i in range(20)])
        assert (ints.data, type(ints.data)) == (190, int)
        big = 2**60 + 1  # not a float exactly: the ints are summed as ints first
        values = [big, 1, 0.5, -big]
        mixed = await run_with(
            Reduce("sum"), [work(v, f"m{i}", delay=0) for i, v in enumerate(values)]
        )
        assert mixed.data == 1.5

    async def test_a_function_folds_in_admission_order_from_initial(self, clock: FakeClock) -> None:
        tasks = [work(ch, f"t{i}", delay=5 - i) for i, ch in enumerate("abcde")]
        result = await run_with(Reduce(lambda acc, x: acc + x, ">"), tasks)
        assert result.data == ">abcde"

    async def test_select_picks_the_value(self, clock: FakeClock) -> None:
        tasks = [work({"score": s}, f"t{i}", delay=0) for i, s in enumerate([2, 9, 4])]
        result = await run_with(Reduce("max", select=lambda o: o["score"]), tasks)
        assert result.data == 9

    async def test_empty_runs(self, clock: FakeClock) -> None:
        tasks = [work(1, "only", fail=True, delay=0)]
        assert (await run_with(Reduce("count"), tasks)).data == 0
        assert (await run_with(Reduce("sum"), tasks)).data == 0
        assert (await run_with(Reduce(lambda a, x: a + x, 10), tasks)).data == 10

    def test_an_unknown_builtin_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="median"):
            Reduce("median")  # type: ignore[arg-type]


class TestTransform:
    async def test_maps_then_collects(self, clock: FakeClock) -> None:
        tasks = [work(i, f"t{i}", delay=3 - i) for i in range(3)]
        result = await run_with(Transform(lambda x: x * 10), tasks)
        assert result.data == {"t0": 0, "t1": 10, "t2": 20}

    async def test_maps_then_reduces(self, clock: FakeClock) -> None:
        tasks = [work(s, f"t{i}", delay=0) for i, s in enumerate(["ab", "cde", ""])]
        result = await run_with(Transform(len, then=Reduce("sum")), tasks)
        assert result.data == 5


class TestByKind:
    async def test_a_mapping_aggregates_each_kind_on_its_own(self, clock: FakeClock) -> None:
        tasks = [
            work(2, "a1", kind="a", delay=0),
            work([1], "b1", kind="b", delay=2),
            work(5, "a2", kind="a", delay=1),
            work([2, 1], "b2", kind="b", delay=1),
            work("x", "c1", kind="c", delay=0),
        ]
        result = await run_with(
            {"a": Reduce("sum"), "b": Merge(dedupe=True)}, tasks, kinds=["a", "b", "c"]
        )
        # kinds without an entry are collected
        assert result.data == {"a": 7.0, "b": [1, 2], "c": {"c1": "x"}}

    async def test_by_kind_with_a_default(self, clock: FakeClock) -> None:
        tasks = [work(1, "a1", kind="a", delay=0), work(2, "b1", kind="b", delay=0)]
        result = await run_with(
            ByKind({"a": Collect()}, default=Reduce("count")), tasks, kinds=["a", "b"]
        )
        assert result.data == {"a": {"a1": 1}, "b": 1}

    async def test_every_mapped_kind_has_an_entry_even_without_successes(
        self, clock: FakeClock
    ) -> None:
        # The shape of `data` must not depend on which tasks happened to fail.
        tasks = [work(1, "a1", kind="a", delay=0), work(2, "b1", kind="b", delay=0, fail=True)]
        result = await run_with(
            {"a": Reduce("count"), "b": Reduce("count")}, tasks, kinds=["a", "b"]
        )
        assert result.data == {"a": 1, "b": 0}


class TestDiscard:
    async def test_keeps_only_the_count(self, clock: FakeClock) -> None:
        tasks = [work(i, f"t{i}", delay=0) for i in range(7)]
        tasks.append(work(0, "bad", fail=True, delay=0))
        assert (await run_with(Discard(), tasks)).data == 7


class TestAggregatorErrors:
    def test_something_that_is_not_an_aggregator_is_a_config_error(self) -> None:
        bad: Any = object()
        with pytest.raises(ConfigError):
            Orchestrator(agents=[Worker()], aggregate=bad)

    async def test_a_reducer_that_raises_keeps_the_rest_of_the_result(
        self, clock: FakeClock
    ) -> None:
        def boom(acc: Any, x: Any) -> Any:
            raise ZeroDivisionError("reducer bug")

        result = await run_with(Reduce(boom, 0), [work(1, "a", delay=0)])
        assert result.data is None
        assert result.metadata.counts["succeeded"] == 1
        assert "ZeroDivisionError" in str(result.metadata.reason)

    async def test_an_output_a_builtin_cannot_fold_does_not_crash_the_run(
        self, clock: FakeClock
    ) -> None:
        # "sum" meets a string: the run must still end with a RunResult that says why.
        tasks = [work(1, "a", delay=0), work("two", "b", delay=1), work(3, "c", delay=2)]
        result = await run_with(Reduce("sum"), tasks)
        assert result.metadata.counts["succeeded"] == 3
        assert "TypeError" in str(result.metadata.reason)

    async def test_an_accumulator_whose_add_raises_does_not_crash_the_run(
        self, clock: FakeClock
    ) -> None:
        class Fragile:
            def add(self, result: TaskResult) -> None:
                if result.task_id == "b":
                    raise KeyError("b")

            def finish(self) -> Any:
                return "done"

        class FragileAggregator:
            def begin(self) -> Fragile:
                return Fragile()

        tasks = [work(1, "a", delay=0), work(2, "b", delay=1), work(3, "c", delay=2)]
        result = await run_with(FragileAggregator(), tasks)
        assert result.metadata.counts["succeeded"] == 3
        assert "KeyError" in str(result.metadata.reason)


AGGREGATORS: dict[str, Callable[[], Aggregator | dict[str, Aggregator]]] = {
    "collect": Collect,
    "merge": lambda: Merge(dedupe=True),
    "reduce-fn": lambda: Reduce(lambda acc, x: [*acc, x], []),
    "reduce-mean": lambda: Reduce("mean", select=lambda o: o[0] if isinstance(o, list) else o),
    "transform": lambda: Transform(str, then=Reduce(lambda a, x: a + x, "")),
    "by-kind": lambda: {"a": Merge(), "b": Reduce(lambda acc, x: [*acc, x], [])},
}


class TestDeterminism:
    @pytest.mark.parametrize("name", sorted(AGGREGATORS))
    async def test_same_data_whatever_the_completion_order(
        self, name: str, clock: FakeClock
    ) -> None:
        def tasks() -> list[Task]:
            return [
                Task("ab"[i % 2], {"out": [i * 0.1, i % 3] if i % 4 else i / 7}, id=f"t{i}")
                for i in range(30)
            ]

        data_of_runs = []
        finish_orders = []
        for seed in (1, 2):
            worker = Worker(kinds=["a", "b"], seed=seed)
            orch = Orchestrator(agents=[worker], aggregate=AGGREGATORS[name](), concurrency=30)
            result = await orch.run(tasks=tasks())
            assert result.status == "success"
            data_of_runs.append(result.data)
            finish_orders.append(worker.finished)
        assert finish_orders[0] != finish_orders[1]  # the latencies really did differ
        assert data_of_runs[0] == data_of_runs[1]
        if isinstance(data_of_runs[0], dict):
            assert list(data_of_runs[0]) == list(data_of_runs[1])

    @pytest.mark.parametrize("name", ["collect", "reduce-fn"])
    async def test_spawned_tasks_fold_in_the_same_order_whatever_the_completion_order(
        self, name: str, clock: FakeClock
    ) -> None:
        # Children are admitted when their parent succeeds, so the order in which parents finish
        # must not decide where their children's outputs land in `data`.
        async def once(seed: int) -> Any:
            rng = random.Random(seed)

            class Parent:
                name = "parent"
                kinds = ("parent",)

                async def __call__(self, task: Task, ctx: Context) -> str:
                    await anyio.sleep(rng.uniform(0.0, 5.0))
                    for i in range(3):
                        ctx.spawn(Task("child", f"{task.id}.{i}", id=f"{task.id}/c{i}"))
                    return str(task.id)

            class Child:
                name = "child"
                kinds = ("child",)

                async def __call__(self, task: Task, ctx: Context) -> str:
                    await anyio.sleep(rng.uniform(0.0, 5.0))
                    return str(task.payload)

            orch = Orchestrator(agents=[Parent(), Child()], aggregate=AGGREGATORS[name]())
            result = await orch.run(tasks=[Task("parent", None, id=f"p{i}") for i in range(4)])
            assert result.status == "success"
            return result.data

        first, second = await once(1), await once(2)
        assert first == second
        if isinstance(first, dict):
            assert list(first) == list(second)


class TestRunResultJson:
    async def test_round_trips(self, clock: FakeClock) -> None:
        tasks = [
            work({"text": "ok", "n": [1, 2.5]}, "a", delay=1.25),
            work(None, "b", delay=0.5, flaky=True),
            work(3, "c", delay=0.1, fail=True),
            Task("work", {"out": 4, "delay": 0}, id="d", depends_on=["c"]),
        ]
        result = await run_with(None, tasks, retry=RetryPolicy(max_attempts=2, base=0.1))
        assert result.errors
        assert result.metadata.time_per_kind
        again = RunResult.model_validate_json(result.model_dump_json())
        assert again == result
        assert again.errors[0].attempts == result.errors[0].attempts


class TestMetadata:
    async def test_counts_rates_agents_and_attempts(self, clock: FakeClock) -> None:
        tasks = [
            work(1, "a1", kind="a", delay=1),
            work(2, "a2", kind="a", delay=1, flaky=True),
            work(3, "b1", kind="b", delay=1, fail=True),
            Task("b", {"out": 4, "delay": 1}, id="b2", depends_on=["b1"]),
            work(5, "b3", kind="b", delay=1),
        ]
        worker_a = Worker("wa", ["a"])
        worker_b = Worker("wb", ["b"])
        orch = Orchestrator(
            agents=[worker_a, worker_b],
            retry=RetryPolicy(max_attempts=3, base=0.0),
            success_threshold=0.5,
            seed=1,
        )
        result = await orch.run(tasks=tasks)
        m = result.metadata
        assert result.status == "partial"
        assert m.total == 5
        assert m.counts == {"succeeded": 3, "failed": 1, "skipped": 1, "cancelled": 0}
        assert m.counts_by_kind == {
            "a": {"succeeded": 2},
            "b": {"failed": 1, "skipped": 1, "succeeded": 1},
        }
        assert m.success_rate == pytest.approx(0.6)
        assert m.success_threshold == 0.5
        assert m.attempts == 5  # a1, a2 twice, b1, b3; b2 never ran
        assert m.retries == 1
        assert m.agents_used == ["wa", "wb"]
        assert m.tasks_per_agent == {"wa": 2, "wb": 1}
        assert m.run_id
        assert m.finished_at >= m.started_at
        assert m.elapsed == pytest.approx(2.0)

    async def test_time_per_kind_and_peak_concurrency(self, clock: FakeClock) -> None:
        tasks = [work(i, f"t{i}", delay=float(i)) for i in range(1, 10)]
        tasks += [work(0, f"q{i}", kind="quick", delay=0.5) for i in range(3)]
        orch = Orchestrator(agents=[Worker(kinds=["work", "quick"])], concurrency=3)
        result = await orch.run(tasks=tasks)
        stats = result.metadata.time_per_kind
        assert set(stats) == {"work", "quick"}
        work_stats = stats["work"]
        assert work_stats.count == 9
        assert work_stats.mean == pytest.approx(5.0)
        assert work_stats.p50 == pytest.approx(5.0)
        assert 8.0 <= work_stats.p95 <= 9.0 + 1e-9
        assert work_stats.max == pytest.approx(9.0)
        assert stats["quick"].mean == pytest.approx(0.5)
        assert stats["quick"].p95 == pytest.approx(0.5)
        assert result.metadata.peak_concurrency == 3


class TestErrorRecords:
    async def test_every_failed_task_has_a_record(self, clock: FakeClock) -> None:
        tasks = [work(1, "ok", delay=0), work(2, "broken", delay=0.5, fail=True)]
        result = await run_with(None, tasks)
        [error] = result.errors
        assert error.task_id == "broken"
        assert error.kind == "work"
        assert error.status == "failed"
        assert error.error_type == "PermanentError"
        assert "cannot do broken" in error.message
        assert error.remediation
        [attempt] = error.attempts
        assert attempt.number == 1
        assert attempt.agent == "worker"
        assert attempt.error_type == "PermanentError"
        assert "cannot do broken" in attempt.message
        assert attempt.duration == pytest.approx(0.5)
        assert result.error_for("ok") is None

    async def test_every_attempt_is_listed(self, clock: FakeClock) -> None:
        class AlwaysDown:
            name = "down"
            kinds = ("work",)

            async def __call__(self, task: Task, ctx: Context) -> None:
                raise ConnectionError(f"attempt {ctx.attempt} refused")

        orch = Orchestrator(
            agents=[AlwaysDown()], retry=RetryPolicy(max_attempts=3, base=0.0), seed=1
        )
        result = await orch.run(tasks=[Task("work", None, id="x")])
        assert result.status == "failed"
        [error] = result.errors
        assert [a.number for a in error.attempts] == [1, 2, 3]
        assert [a.message for a in error.attempts] == [f"attempt {n} refused" for n in (1, 2, 3)]
        assert error.error_type == "ConnectionError"
        assert "refused" in error.message
        assert error.remediation


class TestStatus:
    async def test_success_when_every_task_succeeded(self, clock: FakeClock) -> None:
        result = await run_with(None, [work(1, "a", delay=0)])
        assert result.status == "success"
        assert result.ok

    async def test_partial_at_or_above_the_threshold(self, clock: FakeClock) -> None:
        tasks = [work(i, f"t{i}", delay=0) for i in range(3)] + [work(0, "x", fail=True, delay=0)]
        result = await run_with(None, tasks, success_threshold=0.75)
        assert result.status == "partial"
        assert result.ok

    async def test_failed_below_the_threshold(self, clock: FakeClock) -> None:
        tasks = [work(1, "t", delay=0), work(0, "x", fail=True, delay=0)]
        result = await run_with(None, tasks, success_threshold=0.8)
        assert result.status == "failed"
        assert not result.ok
        assert result.metadata.reason

    async def test_a_failed_critical_task_fails_the_run(self, clock: FakeClock) -> None:
        tasks = [work(i, f"t{i}", delay=0) for i in range(9)]
        tasks.append(Task("work", {"out": 0, "fail": True, "delay": 0}, id="key", critical=True))
        result = await run_with(None, tasks, success_threshold=0.5)
        assert result.status == "failed"
        assert "key" in str(result.metadata.reason)
        error = result.error_for("key")
        assert error is not None
        assert error.critical
