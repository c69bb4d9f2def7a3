"""SQLiteStore against the in-memory store as its model: random operations, reopened at random.

A hypothesis state machine drives one run of each store side by side, directly through the
`RunStore` protocol as the contract suite does (tests/test_store_contract.py): admit batches (with
dependencies, groups and keys), claim, start, fail (a retry at a time, or the next agent), note,
settle (with spawns), cancel by selector, due times as the clock moves, reprioritize, close the
input. After every step what a user of the store can observe must be the same: each task's state,
what the listener heard (in order, and each ended task's result), the claim answers, and which
writes were refused.

At random points the SQLite run is closed and a fresh `SQLiteStore` on the file reopens the run
id, as a new process would, and the input is admitted again. The model is then moved as the README
documents a resume: ended tasks stay as they ended; claimed and running tasks are ready again, the
attempt counted; a retry waiting for its time is ready at once (the model's records are restored
into a fresh in-memory run, and the test checks that mapping state by state before going on).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from orchestra import InputError, Task
from orchestra._admission import Admission
from orchestra._record import Record
from orchestra._task import (
    CANCELLED,
    CLAIMED,
    FAILED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
)
from orchestra.stores import MemoryStore, SQLiteStore
from orchestra.stores._protocol import KEEP, Selector
from tests.test_store_contract import Heard, attempt

if TYPE_CHECKING:
    from orchestra.stores._protocol import RunStore

KINDS = ("a", "b")
RUN = "model"


def result_of(result: Any) -> tuple[Any, ...]:
    """What a user reads of an ended task's `TaskResult` (times aside)."""
    failures = tuple((f.number, f.agent, f.error_type, f.message) for f in result.failures or ())
    return (
        result.task_id,
        result.status,
        result.output,
        result.agent,
        result.attempts,
        result.error,
        result.error_type,
        result.defaulted,
        failures,
    )


def fresh(records: Any) -> list[Record]:
    """New records holding what the old ones say (as a durable store's rows would give them back),
    with none of the old run's wiring (dependents, waits, queue places)."""
    copies: dict[str, Record] = {}
    for old in records:
        parent = None if old.parent is None else copies[old.parent.id]
        record = copies[old.id] = Record(old.task, old.index, parent, old.named)
        for name in ("priority", "state", "attempts", "agent_tries", "target", "token", "output"):
            setattr(record, name, getattr(old, name))
        record.tried = None if old.tried is None else list(old.tried)
        record.feedback = None if old.feedback is None else list(old.feedback)
        record.failures = None if old.failures is None else list(old.failures)
        record.t_start = old.t_start
        if old.state in TERMINAL:
            for name in ("status", "agent", "started", "finished", "error", "error_type"):
                setattr(record, name, getattr(old, name))
            record.defaulted = old.defaulted
    return list(copies.values())


class Side:
    """One store's run, its listener, and where its comparable events start."""

    def __init__(self, run: RunStore, heard: Heard) -> None:
        self.run = run
        self.heard = heard
        self.mark = 0  # heard.events[mark:] are compared with the other side's

    def events(self) -> list[tuple[str, str]]:
        return self.heard.events[self.mark :]


class ModelMachine(RuleBasedStateMachine):
    """The SQLite run (`self.real`) and the in-memory model (`self.model`), step for step."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="orchestra-model-"))
        self.t = [0.0]
        self.store = SQLiteStore(self.folder / "runs.db")
        self.real = self._open(self.store)
        self.model = self._open(MemoryStore())
        self.ids: list[str] = []
        self.batches: list[tuple[list[Task], bool]] = []  # the input: (tasks, forward)
        self.closed = False
        self.generation = 0  # leases of an earlier generation died with their process
        self.spawned = 0
        self.reopened = 0
        self.ended: dict[str, tuple[Any, ...]] = {}  # task id -> its result, as first heard

    def _open(self, store: Any) -> Side:
        heard = Heard()
        run = store.open_run(
            RUN,
            admission=Admission(KINDS, {}),
            listener=heard,
            clock=lambda: self.t[0],
            task_timeout=None,
            compact=False,
        )
        return Side(run, heard)

    def both(self, call: Any) -> Any:
        """Make one call on both runs: they must answer the same (or both raise `InputError`)."""
        answers = []
        for side in (self.real, self.model):
            try:
                answers.append(("ok", call(side.run)))
            except InputError as exc:
                answers.append(("refused", str(exc)))
        real, model = answers
        assert real[0] == model[0], answers
        return real[1], model[1]

    # -- the input

    @staticmethod
    def tasks(specs: list[Any], first: int, earlier: list[str]) -> list[Task]:
        tasks = []
        for i, (kind, priority, deps, tag, waits, key) in enumerate(specs):
            known = [*earlier, *(f"t{n}" for n in range(first, first + i))]
            depends = sorted({known[d % len(known)] for d in deps}) if known else []
            tasks.append(
                Task(
                    kind,
                    {"n": first + i},
                    id=f"t{first + i}",
                    priority=priority,
                    depends_on=depends,
                    tags=[tag] if tag else [],
                    depends_on_tags=["g"] if waits and tag != "g" else [],
                    key=None if key is None else f"k{key}",
                )
            )
        return tasks

    batch = st.lists(
        st.tuples(
            st.sampled_from(KINDS),
            st.integers(0, 3),  # priority
            st.lists(st.integers(0, 30), max_size=2),  # dependencies
            st.sampled_from([None, "g", "h"]),  # a tag
            st.booleans(),  # waits for group "g"
            st.one_of(st.none(), st.integers(0, 3)),  # an idempotency key, now and then
        ),
        min_size=1,
        max_size=8,
    )

    @initialize(specs=batch)
    def admit_first(self, specs: list[Any]) -> None:
        self._admit(specs, forward=True)

    @precondition(lambda self: not self.closed)
    @rule(specs=batch)
    def admit_more(self, specs: list[Any]) -> None:
        self._admit(specs, forward=False)

    def _admit(self, specs: list[Any], forward: bool) -> None:
        tasks = self.tasks(specs, len(self.ids), [] if forward else list(self.ids))
        if forward:  # a whole list may depend forward: make it so, and keep it acyclic
            for task in tasks:
                task.depends_on = [d for d in task.depends_on if int(d[1:]) < int(task.id[1:])]
        real, model = self.both(lambda run: run.admit(tasks, where="tasks", forward=forward))
        assert real == model
        if not isinstance(real, str):  # admitted (a refused batch leaves nothing)
            self.ids.extend(t.id for t in tasks)
            self.batches.append((tasks, forward))

    @precondition(lambda self: bool(self.ids))
    @rule()
    def close_input(self) -> None:
        self.both(lambda run: run.close_input())
        self.closed = True

    # -- the dispatcher's moves

    @rule(target=leases)
    def claim(self) -> Any:
        real, model = self.both(lambda run: run.claim())
        assert (real is None) == (model is None)
        if real is None:
            return None
        assert (real.id, real.token, real.attempts, real.target) == (
            model.id,
            model.token,
            model.attempts,
            model.target,
        )
        return (self.generation, real, model, real.token)

    def _write(self, lease: Any, write: Any) -> None:
        """`write(run, record, token)` on both with the lease: both accept it or both refuse it."""
        if lease is None or lease[0] != self.generation:
            return
        _, real, model, token = lease
        done = (write(self.real.run, real, token), write(self.model.run, model, token))
        assert done[0] == done[1], done

    @rule(lease=leases, agent=st.sampled_from(["x", "y"]))
    def start(self, lease: Any, agent: str) -> None:
        self._write(lease, lambda run, record, token: run.start(record, token, agent))

    @rule(
        lease=leases,
        delay=st.sampled_from([None, 0.0, 1.0, 3.0]),
        next_agent=st.sampled_from([KEEP, None, "y"]),
    )
    def fail(self, lease: Any, delay: float | None, next_agent: Any) -> None:
        retry_at = None if delay is None else self.t[0] + delay
        self._write(
            lease,
            lambda run, record, token: run.fail(
                record, token, attempt(), retry_at=retry_at, next_agent=next_agent
            ),
        )

    @rule(lease=leases, feedback=st.sampled_from(["too short", "wrong"]))
    def note(self, lease: Any, feedback: str) -> None:
        self._write(lease, lambda run, record, token: run.note(record, token, feedback))

    @rule(
        lease=consumes(leases),
        status=st.sampled_from([SUCCEEDED, SUCCEEDED, FAILED, CANCELLED]),
        spawn=st.integers(0, 2),
    )
    def settle(self, lease: Any, status: str, spawn: int) -> None:
        if lease is None or lease[0] != self.generation:
            return
        parent = lease[1].id
        names = [f"s{self.spawned + i}" for i in range(spawn if status == SUCCEEDED else 0)]
        self.spawned += len(names)

        def write(run: Any, record: Any, token: int) -> bool:
            children = [Task("b", {"of": parent}, id=n, depends_on=[parent]) for n in names]
            error = None if status == SUCCEEDED else "boom"
            return bool(
                run.settle(record, token, status, {"out": parent}, spawned=children, error=error)
            )

        self._write(lease, write)
        if self.real.run.state_of(parent) == status and names:
            self.ids.extend(names)

    @precondition(lambda self: bool(self.ids))
    @rule(
        how=st.sampled_from(["ids", "kind", "tag", "priority", "agent", "all"]),
        pick=st.integers(0, 40),
    )
    def cancel(self, how: str, pick: int) -> None:
        task_id = self.ids[pick % len(self.ids)]
        selector = {
            "ids": Selector(task_ids=[task_id]),
            "kind": Selector(kind=KINDS[pick % 2]),
            "tag": Selector(tag="g"),
            "priority": Selector(priority=(pick % 4, pick % 4 + 1)),
            "agent": Selector(agent="y"),
            "all": Selector(),
        }[how]
        real, model = self.both(lambda run: [r.id for r in run.cancel(selector, "cancelled")])
        assert real == model

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        self.t[0] += dt
        real, model = self.both(lambda run: [r.id for r in run.due(self.t[0])])
        assert real == model
        real, model = self.both(lambda run: run.next_due())
        assert real == model

    @precondition(lambda self: bool(self.ids))
    @rule(pick=st.integers(0, 40), priority=st.integers(-1, 4))
    def reprioritize(self, pick: int, priority: int) -> None:
        task_id = self.ids[pick % len(self.ids)]
        real, model = self.both(lambda run: run.reprioritize(task_id, priority))
        assert real == model

    # -- a new process

    @rule()
    def reopen(self) -> None:
        """Close the SQLite run, reopen the run id from the file with a new store, admit the input
        again; move the model as a resume is documented to."""
        held = {r.id for r in self.model.run.records()}  # type: ignore[attr-defined]
        before = {i: (self.model.run.state_of(i), self._record(i)) for i in self.ids if i in held}
        self.real.run.close()
        self.store.close()
        self.store = SQLiteStore(self.folder / "runs.db")
        self.real = self._open(self.store)
        old = self.model.run
        records = fresh(old.records())  # type: ignore[attr-defined]
        took_keys = [r.id for r in records if old.took_key(r)]  # type: ignore[attr-defined]
        self.model = self._open(MemoryStore())
        self.model.run.restore(records, took_keys)  # type: ignore[attr-defined]
        self.generation += 1
        self.reopened += 1
        for tasks, forward in self.batches:  # the input, given again
            real, model = self.both(
                lambda run, tasks=tasks, forward=forward: run.admit(
                    tasks, where="tasks", forward=forward
                )
            )
            assert real == model == 0
        if self.closed:
            self.both(lambda run: run.close_input())
        # The real run heard its ended tasks again (for the aggregate), the model did not.
        ended = {i for i, (state, _) in before.items() if state in TERMINAL}
        heard = self.real.events()
        again = [i for what, i in heard if what == "finished"]
        assert sorted(again) == sorted(ended)
        for task_id in again:
            assert result_of(self.real.heard.results[task_id]) == self.ended[task_id]
        assert [e for e in heard if e[0] != "finished"] == self.model.events()
        self.real.mark = len(self.real.heard.events)
        self.model.mark = len(self.model.heard.events)
        # What a resume is documented to do, state by state.
        for task_id, (state, (attempts, target)) in before.items():
            now = self.real.run.state_of(task_id)
            if state in TERMINAL or state == PENDING:
                assert now == state, (task_id, state, now)
            elif state in (READY, CLAIMED, RUNNING, RETRY_WAIT):
                assert now in (READY, PENDING), (task_id, state, now)  # pending: on a group
            real = self.real.run._memory.record_of(task_id)  # type: ignore[attr-defined]
            assert (real.attempts, real.target) == (attempts, target), task_id
            assert self._record(task_id) == (attempts, target), task_id

    def _record(self, task_id: str) -> tuple[int, Any]:
        record = self.model.run.record_of(task_id)  # type: ignore[attr-defined]
        return record.attempts, record.target

    # -- what must be the same

    @invariant()
    def the_same_is_observed(self) -> None:
        real, model = self.real, self.model
        assert real.events() == model.events()
        for task_id in self.ids:
            assert real.run.state_of(task_id) == model.run.state_of(task_id), task_id
        assert (real.run.unfinished, real.run.pending) == (model.run.unfinished, model.run.pending)
        for task_id, result in model.heard.results.items():
            seen = result_of(result)
            assert result_of(real.heard.results[task_id]) == seen, task_id
            self.ended[task_id] = seen

    def teardown(self) -> None:
        try:
            self.real.run.close()
        finally:
            self.store.close()
            shutil.rmtree(self.folder, ignore_errors=True)


class TestModel:
    def test_sqlite_behaves_as_the_memory_store_across_reopens(self) -> None:
        run_state_machine_as_test(
            ModelMachine,
            settings=settings(
                max_examples=100,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
            ),
        )


class TestKeysAcrossReopens:
    def test_a_key_taken_over_at_admission_stays_with_its_task_across_a_reopen(
        self, tmp_path: Path
    ) -> None:
        # `held` (key k) waits for group g; `twin` follows it (same key); `later` (key j) waits
        # for `twin`; `member` joins g with key j, and takes j over from `later`, which waits for
        # it. Read back in admission order, `later` would hold j again, `held` would then wait for
        # `twin` (through g, `member`, `later`), and `twin` would take k over and run.
        batches = [
            [
                Task("a", {}, id="waiter", depends_on_tags=["g"]),
                Task("a", {}, id="held", depends_on=["waiter"], key="k"),
                Task("a", {}, id="twin", key="k"),
            ],
            [Task("a", {}, id="after", depends_on=["twin"])],
            [Task("a", {}, id="later", depends_on=["after"], key="j")],
            [Task("a", {}, id="member", tags=["g"], key="j")],
        ]
        t = [0.0]

        def open_run(store: Any) -> Any:
            return store.open_run(
                RUN,
                admission=Admission(KINDS, {}),
                listener=Heard(),
                clock=lambda: t[0],
                task_timeout=None,
                compact=False,
            )

        ids = [task.id for tasks in batches for task in tasks]
        store = SQLiteStore(tmp_path / "runs.db")
        try:
            run = open_run(store)
            for tasks in batches:
                run.admit(tasks, where="tasks", forward=False)
            before = {i: run.state_of(i) for i in ids}
            run.close()
        finally:
            store.close()
        assert before == {
            "waiter": PENDING,
            "held": PENDING,
            "twin": PENDING,
            "after": PENDING,
            "later": PENDING,
            "member": READY,
        }
        store = SQLiteStore(tmp_path / "runs.db")
        try:
            run = open_run(store)
            for tasks in batches:
                assert run.admit(tasks, where="tasks", forward=False) == 0
            assert {i: run.state_of(i) for i in ids} == before
            run.close()
        finally:
            store.close()
