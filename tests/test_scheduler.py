"""The ready-queue: smallest priority first, FIFO within a priority; reprioritize while waiting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import Context, InputError, Orchestrator, Task

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class Gate:
    """An agent that records the order in which tasks start; tasks in `hold` wait for `release`."""

    def __init__(
        self,
        name: str = "gate",
        kinds: Sequence[str] = ("work",),
        *,
        hold: Sequence[str] = (),
        concurrency: int | None = None,
        order: list[str] | None = None,
    ) -> None:
        self.name = name
        self.kinds = tuple(kinds)
        self.concurrency = concurrency
        self.hold = set(hold)
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.order: list[str] = [] if order is None else order

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.order.append(str(task.id))
        if task.id in self.hold:
            self.started.set()
            await self.release.wait()
        return task.payload


def expected_order(priorities: Sequence[int]) -> list[str]:
    return [f"t{i}" for _, i in sorted((p, i) for i, p in enumerate(priorities))]


class TestPriorityOrder:
    @pytest.mark.parametrize(
        "priorities",
        [[5, 0, 5, -1, 0, 3], [0, 0, 0, 0], [3, 2, 1, 0], [-10, 10, -10, 10, 0]],
        ids=str,
    )
    async def test_smallest_priority_first_fifo_within(
        self, priorities: list[int], make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        gate = Gate()
        tasks = [Task("work", i, id=f"t{i}", priority=p) for i, p in enumerate(priorities)]
        result = await make_orchestrator(agents=[gate], concurrency=1).run(tasks=tasks)
        assert result.status == "success"
        assert gate.order == expected_order(priorities)

    async def test_priority_orders_across_kinds(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        order: list[str] = []
        a = Gate("a", ["a"], order=order)
        b = Gate("b", ["b"], order=order)
        kinds = ["a", "b", "a", "b", "b", "a"]
        priorities = [3, 1, 2, 0, 3, 1]
        tasks = [
            Task(k, None, id=f"t{i}", priority=p)
            for i, (k, p) in enumerate(zip(kinds, priorities, strict=True))
        ]
        await make_orchestrator(agents=[a, b], concurrency=1).run(tasks=tasks)
        assert order == expected_order(priorities)

    async def test_a_task_that_becomes_ready_jumps_ahead_of_worse_waiting_ones(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        gate = Gate()
        tasks = [
            Task("work", id="first", priority=5),
            *(Task("work", id=f"low{i}", priority=5) for i in range(3)),
            Task("work", id="urgent", priority=0, depends_on=["first"]),
        ]
        await make_orchestrator(agents=[gate], concurrency=1).run(tasks=tasks)
        assert gate.order == ["first", "urgent", "low0", "low1", "low2"]

    async def test_a_busy_agent_does_not_block_other_kinds(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        order: list[str] = []
        slow = Gate("slow", ["slow"], hold=["s0"], concurrency=1, order=order)
        fast = Gate("fast", ["fast"], order=order)
        tasks = [
            Task("slow", id="s0", priority=0),
            Task("slow", id="s1", priority=0),
            *(Task("fast", id=f"f{i}", priority=9) for i in range(3)),
        ]
        orch = make_orchestrator(agents=[slow, fast], concurrency=2)
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(lambda: orch.run(tasks=tasks))
            await slow.started.wait()
            while len(order) < 4:  # s0 and the three fast tasks
                await anyio.lowlevel.checkpoint()
            assert order[1:] == ["f0", "f1", "f2"]
            slow.release.set()
        assert order == ["s0", "f0", "f1", "f2", "s1"]


class TestReprioritize:
    async def _with_blocker(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        tasks: list[Task],
        change: Callable[[Orchestrator], None],
    ) -> list[str]:
        gate = Gate(hold=["blocker"])
        orch = make_orchestrator(agents=[gate], concurrency=1)
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(lambda: orch.run(tasks=[Task("work", id="blocker"), *tasks]))
            await gate.started.wait()
            change(orch)
            gate.release.set()
        return gate.order

    async def test_a_waiting_task_moves_ahead(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        found: list[bool] = []
        order = await self._with_blocker(
            make_orchestrator,
            [Task("work", id=f"q{i}") for i in range(3)],
            lambda orch: found.append(orch.reprioritize("q2", -1)),
        )
        assert found == [True]
        assert order == ["blocker", "q2", "q0", "q1"]

    async def test_a_waiting_task_moves_back(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        found: list[bool] = []
        order = await self._with_blocker(
            make_orchestrator,
            [Task("work", id=f"q{i}") for i in range(3)],
            lambda orch: found.append(orch.reprioritize("q0", 7)),
        )
        assert found == [True]
        assert order == ["blocker", "q1", "q2", "q0"]

    async def test_a_pending_task_keeps_its_new_priority_when_it_becomes_ready(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        found: list[bool] = []
        tasks = [
            Task("work", id="dep", priority=0),
            Task("work", id="later", priority=9, depends_on=["dep"]),
            *(Task("work", id=f"q{i}", priority=5) for i in range(2)),
        ]
        order = await self._with_blocker(
            make_orchestrator, tasks, lambda orch: found.append(orch.reprioritize("later", 1))
        )
        assert found == [True]
        assert order == ["blocker", "dep", "later", "q0", "q1"]

    async def test_running_unknown_and_finished_tasks_are_not_found(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        answers: dict[str, bool] = {}
        gate = Gate(hold=["blocker"])
        orch = make_orchestrator(agents=[gate], concurrency=2)
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: orch.run(tasks=[Task("work", id="blocker"), Task("work", id="quick")])
            )
            await gate.started.wait()
            while "quick" not in gate.order:
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            answers["running"] = orch.reprioritize("blocker", -5)
            answers["unknown"] = orch.reprioritize("nobody", -5)
            answers["finished"] = orch.reprioritize("quick", -5)
            gate.release.set()
        assert answers == {"running": False, "unknown": False, "finished": False}

    @pytest.mark.parametrize("priority", ["high", 1.5, None, True], ids=repr)
    def test_a_priority_that_is_not_an_int_is_refused(
        self, priority: Any, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[Gate()])
        with pytest.raises(InputError) as info:
            orch.reprioritize("t1", priority)
        assert info.value.field == "priority"


class _Entry:
    __slots__ = ("name", "priority", "qseq")

    def __init__(self, name: int, priority: int) -> None:
        self.name = name
        self.priority = priority
        self.qseq = -1


class TestFront:
    """`ReadyQueue.front` is the best priority's bucket whatever came before: a store that takes its
    front entry itself (`MemoryRun.claim`) gets what `pop` would have given."""

    @pytest.mark.parametrize("sweep", [None, 4], ids=["default-sweep", "sweep-every-4"])
    @pytest.mark.parametrize("seed", range(20))
    def test_taking_from_the_front_is_popping(
        self, seed: int, sweep: int | None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import random

        from orchestra.stores._queue import ReadyQueue

        if sweep is not None:  # dead slots swept out often, between every kind of step
            monkeypatch.setattr(ReadyQueue, "SWEEP", sweep)
        rng = random.Random(seed)
        queue: ReadyQueue[_Entry] = ReadyQueue()
        live: list[_Entry] = []  # the reference: best priority first, FIFO within one
        taken: list[_Entry] = []  # popped: may come back (a retry), maybe where it left a ghost
        for step in range(2_000):
            op = rng.random()
            if op < 0.05 and taken:
                back = taken.pop(rng.randrange(len(taken)))
                queue.push(back)
                live.append(back)
            elif op < 0.45:
                entries = [
                    _Entry(step * 10 + i, rng.randrange(-3, 4)) for i in range(rng.randrange(1, 4))
                ]
                if len(entries) > 1:
                    queue.push_all(entries)
                else:
                    queue.push(entries[0])
                live.extend(entries)
            elif op < 0.55 and live:
                gone = live.pop(rng.randrange(len(live)))
                queue.discard(gone)
            elif op < 0.65 and live:
                moved = live.pop(rng.randrange(len(live)))
                queue.move(moved, rng.randrange(-3, 4))
                live.append(moved)
            else:
                expected = min(live, key=lambda e: (e.priority, e.qseq)) if live else None
                took = None
                front = queue.front
                while front:  # as `MemoryRun.claim` takes: stale entries are dropped
                    entry = front.popleft()
                    if entry.qseq >= 0:
                        entry.qseq = -1
                        queue.size -= 1
                        took = entry
                        break
                if took is None:
                    took = queue.pop()
                assert took is expected
                if took is not None:
                    live.remove(took)
                    taken.append(took)
            assert len(queue) == len(live)


class TestDeadSlots:
    """Slots left by `discard` and `move` that never reach the front are let go: a durable
    coordinator's mirror takes every ready task out with `discard` and never pops."""

    def test_entries_discarded_behind_a_live_front_are_not_kept(self) -> None:
        from orchestra.stores._queue import ReadyQueue

        queue: ReadyQueue[_Entry] = ReadyQueue()
        first, *rest = entries = [_Entry(i, 0) for i in range(20_000)]
        queue.push_all(entries)
        for entry in rest:
            queue.discard(entry)
        # `depths` counts the slots the queue holds, live or dead: all 20,000 before.
        assert sum(queue.depths().values()) <= ReadyQueue.SWEEP + 1
        assert queue.pop() is first
        assert queue.pop() is None

    def test_ghosts_of_moved_entries_are_let_go_and_the_order_kept(self) -> None:
        from orchestra.stores._queue import ReadyQueue

        queue: ReadyQueue[_Entry] = ReadyQueue()
        entries = [_Entry(i, 5) for i in range(5_000)]
        queue.push_all(entries)
        for round_ in range(4):  # each entry moved four times: 20,000 ghosts made
            for entry in entries:
                queue.move(entry, round_ % 2)
        assert sum(queue.depths().values()) <= len(entries) + ReadyQueue.SWEEP
        popped = []
        while (out := queue.pop()) is not None:
            popped.append(out.name)
        assert popped == list(range(5_000))


class _Compared(_Entry):
    """An entry that counts how often it is compared (a search of a bucket compares each)."""

    __slots__ = ()
    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _Compared.comparisons += 1
        return self is other

    __hash__ = object.__hash__


class TestMoveCost:
    def test_moving_an_entry_does_not_search_its_bucket(self) -> None:
        # `move` searched the entry's bucket and removed it from there: reprioritizing k of n
        # ready tasks one by one was O(k * n) (2,000 among 100,000: 0.55 s). Counted: the
        # comparisons a move makes; and the order is still the reference's.
        from orchestra.stores._queue import ReadyQueue

        queue: ReadyQueue[_Compared] = ReadyQueue()
        entries = [_Compared(i, 5) for i in range(1_000)]
        queue.push_all(entries)
        _Compared.comparisons = 0
        for entry in reversed(entries[500:]):
            queue.move(entry, 0)
        queue.move(entries[0], 5)  # to the back of its own priority
        assert _Compared.comparisons == 0
        popped = []
        while (out := queue.pop()) is not None:
            popped.append(out.name)
        assert popped == [*range(999, 499, -1), *range(1, 500), 0]
        assert len(queue) == 0
        assert queue.front is None or not queue.front
