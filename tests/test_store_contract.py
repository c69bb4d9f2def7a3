"""The store contract: what every `Store` must do, driven directly (no orchestrator, no agents).

Every test runs once per store factory in `STORES`; a new store (SQLite, PostgreSQL) joins the
suite with one line there. The tests touch a store only through the `RunStore` protocol: states are
read with `state_of`, a task's fields from the record that `claim` (or the listener) hands out, and
outcomes from the `TaskResult`s the listener hears, so a store whose records are snapshots passes as
well as one whose records are live objects. One exception, because the dispatcher relies on it:
`start` updates the record it is given (`attempts`, `agent_tries`, `target`), which the attempt's
context then reads.

Time is a manual clock (`Harness.t`, a float the test moves); the store reads it through `clock`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
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
from pydantic import BaseModel

from orchestra import InputError, Task
from orchestra._admission import Admission
from orchestra._task import (
    CANCELLED,
    CLAIMED,
    FAILED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Attempt,
)
from orchestra.stores import MemoryStore
from orchestra.stores._protocol import KEEP, Selector
from tests.helpers import sqlite_store
from tests.pg import postgres_store

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra.stores import RunStore, Store

# The stores under contract: one factory per store (a durable one builds its store on a fresh file
# or schema). Adding a store to the suite is adding it here.
STORES: list[Callable[[], Store]] = [MemoryStore, sqlite_store, postgres_store]

KINDS = ("a", "b")


class Typed(BaseModel):
    """The payload model of the kind "typed" (admission validates it)."""

    n: int


class Heard:
    """A `Listener` that records what it hears, in order: ("ready" | "finished", task id)."""

    quiet = None  # every end is heard

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.records: dict[str, Any] = {}  # id -> the last record heard ready
        self.tokens: dict[str, int] = {}  # id -> its token when last heard ready
        self.results: dict[str, Any] = {}  # id -> its TaskResult
        self.ended: list[str] = []  # ids in the order they ended (a repeat is a defect)

    def ready(self, record: Any) -> None:
        self.events.append(("ready", record.id))
        self.records[record.id] = record
        self.tokens[record.id] = record.token

    def ready_all(self, records: Any) -> None:
        for record in records:
            self.ready(record)

    def finished(self, record: Any) -> None:
        self.events.append(("finished", record.task_id))
        self.results[record.task_id] = record
        self.ended.append(record.task_id)

    def wake(self) -> None:
        self.events.append(("wake", ""))

    def stop(self, reason: str) -> None:
        self.events.append(("stop", reason))

    def hold(self, held: bool) -> None:
        pass

    def room(self, kind: str, *, hold: bool = True) -> int:
        return 1 << 30  # no agent of its own to fill: no limit

    def stalled(self, longer_than: float) -> list[str]:
        return []

    def since(self, mark: int) -> list[tuple[str, str]]:
        return self.events[mark:]


class Harness:
    """One run of a store under test, with its listener and its manual clock."""

    def __init__(
        self,
        store: Store,
        *,
        task_timeout: float | None = None,
        compact: bool = False,
        kinds: Sequence[str] = KINDS,
    ) -> None:
        self.t = [0.0]
        self.heard = Heard()
        self.run: RunStore = store.open_run(
            "run-1",
            admission=Admission([*kinds, "typed"], {"typed": [Typed]}),
            listener=self.heard,
            clock=lambda: self.t[0],
            task_timeout=task_timeout,
            compact=compact,
        )

    def admit(self, *tasks: Task, forward: bool = True) -> int:
        return self.run.admit(tasks, where="tasks", forward=forward)

    def claim(self) -> Any:
        record = self.run.claim()
        assert record is not None, "nothing ready to claim"
        return record

    def claim_all(self) -> list[str]:
        ids = []
        while (record := self.run.claim()) is not None:
            ids.append(record.id)
        return ids

    def running(self, agent: str = "x") -> Any:
        """Claim the best ready task and start its attempt on `agent`."""
        record = self.claim()
        assert self.run.start(record, record.token, agent)
        return record

    def succeed(self, task_id: str, output: Any = None, agent: str = "x") -> None:
        """Claim, start and settle `task_id` (which must be the best ready task)."""
        record = self.running(agent)
        assert record.id == task_id
        assert self.run.settle(record, record.token, SUCCEEDED, output, agent=agent)

    def fail_now(self, task_id: str, error: str = "boom") -> None:
        record = self.running()
        assert record.id == task_id
        assert self.run.settle(record, record.token, FAILED, error=error, error_type="Boom")

    def snapshot(self, *ids: str) -> tuple[Any, ...]:
        """What a refused write must leave unchanged."""
        run = self.run
        return (
            run.unfinished,
            run.pending,
            len(self.heard.events),
            tuple(run.state_of(i) for i in ids),
        )


def attempt(agent: str = "x", number: int = 1, message: str = "boom") -> Attempt:
    return Attempt(
        number=number,
        agent=agent,
        error_type="Boom",
        message=message,
        started=0.0,
        duration=0.1,
    )


@pytest.fixture(
    params=[
        pytest.param(f, marks=[pytest.mark.postgres, pytest.mark.subprocess])
        if f is postgres_store
        else f
        for f in STORES
    ],
    ids=lambda factory: getattr(factory, "__name__", repr(factory)),
)
def store_factory(request: pytest.FixtureRequest) -> Callable[[], Store]:
    factory: Callable[[], Store] = request.param
    if factory is postgres_store:  # on the session's server: a database per store it makes
        request.getfixturevalue("pg_stores")
    return factory


@pytest.fixture
def make_run(store_factory: Callable[[], Store]) -> Callable[..., Harness]:
    """`make_run(task_timeout=..., compact=...)`: a fresh run of the store under test."""

    def make(**options: Any) -> Harness:
        return Harness(store_factory(), **options)

    return make


@pytest.fixture
def h(make_run: Callable[..., Harness]) -> Harness:
    return make_run()


# -- ordering --------------------------------------------------------------------------------------


class TestOrdering:
    def test_claim_takes_the_smallest_priority_first_then_fifo(self, h: Harness) -> None:
        h.admit(
            Task("a", id="low1", priority=5),
            Task("b", id="high1", priority=1),
            Task("a", id="low2", priority=5),
            Task("b", id="high2", priority=1),
            Task("a", id="mid", priority=3),
        )
        assert h.claim_all() == ["high1", "high2", "mid", "low1", "low2"]
        assert h.run.claim() is None

    def test_ready_is_heard_in_admission_order(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2", priority=-1), Task("b", id="t3"))
        assert h.heard.events == [("ready", "t1"), ("ready", "t2"), ("ready", "t3")]

    def test_a_task_made_ready_again_goes_behind_its_equals(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        first = h.running()
        assert h.run.fail(first, first.token, attempt())
        assert h.claim_all() == ["t2", "t1"]

    def test_claim_gives_a_fresh_token_each_time(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        one, two = h.claim(), h.claim()
        tokens = {(one.id, one.token), (two.id, two.token)}
        assert h.run.start(one, one.token, "x")
        assert h.run.fail(one, one.token, attempt())
        again = h.claim()
        assert again.id == "t1"
        assert (again.id, again.token) not in tokens
        assert h.run.state_of("t1") == CLAIMED

    def test_a_claimed_token_is_never_the_one_the_task_had_while_ready(self, h: Harness) -> None:
        # The token a task holds while it waits is the one its run uses to end it (a deadline):
        # the lease a claim hands out must differ, or the two could not be told apart.
        h.admit(Task("a", id="t1"))
        first = h.claim()
        assert first.token != h.heard.tokens["t1"]
        assert h.run.start(first, first.token, "x")
        assert h.run.fail(first, first.token, attempt(), retry_at=1.0)
        h.run.due(1.0)
        second = h.claim()
        assert second.token != h.heard.tokens["t1"]

    def test_claim_on_an_empty_store_is_none(self, h: Harness) -> None:
        assert h.run.claim() is None
        h.admit(Task("a", id="t1"))
        h.claim()
        assert h.run.claim() is None


# -- fencing ---------------------------------------------------------------------------------------


class TestFencing:
    def test_start_fail_and_settle_with_a_wrong_token_are_refused(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.claim()
        stale = record.token + 1000
        before = h.snapshot("t1")
        assert not h.run.start(record, stale, "x")
        assert not h.run.fail(record, stale, attempt(), retry_at=1.0)
        assert not h.run.settle(record, stale, SUCCEEDED, "late")
        assert h.snapshot("t1") == before == (1, 0, 1, (CLAIMED,))
        assert h.run.next_due() is None  # the refused retry left no timer
        assert h.run.start(record, record.token, "x")
        assert record.attempts == 1

    def test_a_token_is_stale_once_the_task_is_claimed_again(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        first = h.running()
        old = first.token
        assert h.run.fail(first, old, attempt())
        second = h.claim()
        before = h.snapshot("t1")
        assert not h.run.start(second, old, "x")
        assert not h.run.fail(second, old, attempt())
        assert not h.run.settle(second, old, SUCCEEDED, "late")
        assert h.snapshot("t1") == before
        assert h.run.start(second, second.token, "x")
        assert h.run.settle(second, second.token, SUCCEEDED, "new")
        assert h.heard.results["t1"].output == "new"

    def test_a_token_is_stale_once_its_attempt_failed(self, h: Harness) -> None:
        # The failed attempt's lease holder may write again (late, or twice): the task, back in the
        # queue, must not be failed or ended by it.
        h.admit(Task("a", id="t1"))
        record = h.running()
        token = record.token
        assert h.run.fail(record, token, attempt(), retry_at=5.0)
        before = h.snapshot("t1")
        assert not h.run.fail(record, token, attempt(number=2))
        assert not h.run.settle(record, token, SUCCEEDED, "late")
        assert not h.run.start(record, token, "x")
        assert h.snapshot("t1") == before == (1, 0, 1, (RETRY_WAIT,))
        h.run.due(5.0)
        again = h.claim()
        assert again.id == "t1"
        assert [f.number for f in again.failures] == [1]

    def test_a_second_fail_with_the_same_token_does_not_queue_the_task_twice(
        self, h: Harness
    ) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running()
        token = record.token
        assert h.run.fail(record, token, attempt())
        assert not h.run.fail(record, token, attempt(number=2))
        assert h.claim_all() == ["t1"]

    def test_a_heartbeat_holds_only_while_the_lease_is_current(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        claimed = h.claim()
        assert h.run.heartbeat(claimed, claimed.token)
        assert not h.run.heartbeat(claimed, claimed.token + 1000)
        assert h.run.start(claimed, claimed.token, "x")
        assert h.run.heartbeat(claimed, claimed.token)
        token = claimed.token
        assert h.run.fail(claimed, token, attempt())
        assert not h.run.heartbeat(claimed, token)  # handed back: the old holder stops
        other = h.running()
        h.run.cancel(Selector(task_ids=[other.id]), "stop")
        assert not h.run.heartbeat(other, other.token)  # cancelled: its holder stops

    def test_start_is_refused_unless_the_task_is_claimed(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.claim()
        assert h.run.start(record, record.token, "x")
        assert not h.run.start(record, record.token, "x")  # already running
        assert record.attempts == 1

    def test_a_stale_token_never_ends_an_ended_task(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running()
        assert h.run.settle(record, record.token, SUCCEEDED, 1)
        before = h.snapshot("t1")
        assert not h.run.fail(record, record.token, attempt(), retry_at=1.0)
        assert not h.run.start(record, record.token, "x")
        assert h.snapshot("t1") == before
        assert h.run.next_due() is None


# -- settlement ------------------------------------------------------------------------------------


class TestSettlement:
    def test_a_task_settles_exactly_once(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running("x")
        assert h.run.settle(record, record.token, SUCCEEDED, {"v": 1}, agent="x")
        assert not h.run.settle(record, record.token, FAILED, error="again")
        assert not h.run.settle(record, record.token, SUCCEEDED, "again")
        assert h.heard.ended == ["t1"]
        result = h.heard.results["t1"]
        assert (result.status, result.output, result.agent, result.attempts) == (
            SUCCEEDED,
            {"v": 1},
            "x",
            1,
        )
        assert h.run.state_of("t1") == SUCCEEDED
        assert h.run.unfinished == 0

    def test_a_failed_settle_carries_its_error_and_the_last_attempt(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running("x")
        last = attempt("x", message="bad")
        assert h.run.settle(
            record, record.token, FAILED, error="Boom: bad", error_type="Boom", attempt=last
        )
        result = h.heard.results["t1"]
        assert (result.status, result.error, result.error_type) == (FAILED, "Boom: bad", "Boom")
        assert [f.message for f in result.failures] == ["bad"]
        assert not result.ok

    def test_times_are_seconds_since_the_run_opened(self, h: Harness) -> None:
        h.t[0] = 100.0
        h.admit(Task("a", id="t1"))
        h.t[0] = 102.0
        record = h.running()
        h.t[0] = 105.0
        assert h.run.settle(record, record.token, SUCCEEDED, None)
        result = h.heard.results["t1"]
        assert result.finished == pytest.approx(105.0)  # the run opened at t=0
        assert result.started == pytest.approx(102.0)

    def test_a_claimed_task_that_never_started_can_be_settled(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.claim()
        assert h.run.settle(record, record.token, FAILED, error="no agent", error_type="X")
        result = h.heard.results["t1"]
        assert (result.status, result.attempts, result.started) == (FAILED, 0, None)

    def test_results_hold_every_ended_task(self, h: Harness) -> None:
        h.admit(Task("a", id="ok"), Task("a", id="bad"), Task("a", id="dep", depends_on=["bad"]))
        h.succeed("ok", 1)
        h.fail_now("bad")
        statuses = {r.task_id: r.status for r in h.run.results()}
        assert statuses == {"ok": SUCCEEDED, "bad": FAILED, "dep": SKIPPED}

    def test_succeed_is_a_settle_as_succeeded(self, h: Harness) -> None:
        h.t[0] = 1.0
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        h.t[0] = 2.0
        one, two = h.running("x"), h.running("y")
        h.t[0] = 3.0
        assert h.run.succeed(one, one.token, {"v": 1}, "x")
        assert h.run.settle(two, two.token, SUCCEEDED, {"v": 1}, agent="y")
        fields = ("status", "output", "attempts", "started", "finished", "error", "error_type")
        first, second = h.heard.results["t1"], h.heard.results["t2"]
        assert [getattr(first, f) for f in fields] == [getattr(second, f) for f in fields]
        assert (first.agent, first.defaulted, first.failures) == ("x", False, None)
        assert h.run.state_of("t1") == SUCCEEDED
        assert h.run.unfinished == 0

    def test_succeed_refuses_a_stale_token_and_an_ended_task(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        record = h.running()
        before = h.snapshot("t1")
        assert not h.run.succeed(record, record.token - 1, "late", "x")
        assert h.snapshot("t1") == before
        assert h.run.succeed(record, record.token, "first", "x")
        assert not h.run.succeed(record, record.token, "again", "x")
        other = h.running()
        assert h.run.settle(other, other.token, FAILED, error="boom", error_type="Boom")
        assert not h.run.succeed(other, other.token, "after", "x")
        assert h.heard.ended == ["t1", "t2"]
        assert (h.heard.results["t1"].output, h.heard.results["t2"].status) == ("first", FAILED)

    def test_succeed_readies_the_dependents_and_closes_the_groups(self, h: Harness) -> None:
        h.admit(
            Task("a", id="t1", tags=["g"]),
            Task("a", id="dep", depends_on=["t1"]),
            Task("a", id="all", depends_on_tags=["g"]),
        )
        h.run.close_input()
        record = h.running()
        mark = len(h.heard.events)
        assert h.run.succeed(record, record.token, 7, "x")
        assert h.heard.since(mark)[0] == ("finished", "t1")
        assert sorted(h.claim_all()) == ["all", "dep"]

    def test_a_compacting_run_forgets_successes_but_knows_their_state_and_output(
        self, make_run: Callable[..., Harness]
    ) -> None:
        h = make_run(compact=True)
        h.admit(Task("a", id="t1"), forward=False)
        h.succeed("t1", {"v": 1})
        h.admit(Task("a", id="t2", depends_on=["t1"]), forward=False)
        assert h.run.state_of("t1") == SUCCEEDED
        record = h.claim()
        assert h.run.deps_of(record) == {"t1": {"v": 1}}
        with pytest.raises(InputError, match="duplicate task id 't1'"):
            h.admit(Task("a", id="t1"), forward=False)


# -- spawns ----------------------------------------------------------------------------------------


class TestSpawns:
    def test_settle_admits_the_spawns_and_readies_them_in_one_step(self, h: Harness) -> None:
        h.admit(Task("a", id="p"))
        parent = h.running()
        mark = len(h.heard.events)
        children = [Task("b", id="p/1"), Task("b", id="p/2", depends_on=["p/1"])]
        assert h.run.settle(parent, parent.token, SUCCEEDED, "out", spawned=children)
        assert sorted(h.heard.since(mark)) == [("finished", "p"), ("ready", "p/1")]
        assert h.run.state_of("p/2") == PENDING
        assert (h.run.unfinished, h.run.pending) == (2, 1)
        h.succeed("p/1")
        assert h.claim_all() == ["p/2"]

    def test_a_spawn_may_depend_on_its_parent(self, h: Harness) -> None:
        h.admit(Task("a", id="p"))
        parent = h.running()
        child = Task("b", id="c", depends_on=["p"])
        assert h.run.settle(parent, parent.token, SUCCEEDED, 7, spawned=[child])
        assert h.run.state_of("c") == READY
        assert h.run.deps_of(h.claim()) == {"p": 7}

    def test_the_waiters_of_the_parents_group_wait_for_its_spawns(self, h: Harness) -> None:
        h.admit(Task("a", id="p"), Task("b", id="summary", depends_on_tags=["p"]))
        h.run.close_input()
        parent = h.running()
        spawned = [Task("b", id="p/1", tags=["p"]), Task("b", id="p/2", tags=["p"])]
        assert h.run.settle(parent, parent.token, SUCCEEDED, None, spawned=spawned)
        assert h.run.state_of("summary") == PENDING
        h.succeed("p/1")
        assert h.run.state_of("summary") == PENDING
        h.succeed("p/2")
        assert h.run.state_of("summary") == READY

    @pytest.mark.parametrize(
        ("bad", "field"),
        [
            (Task("nope", id="p/bad"), "kind"),
            (Task("b", id="p/bad", depends_on=["ghost"]), "depends_on"),
            (Task("b", id="p"), "id"),
            (Task("typed", {"n": "x"}, id="p/bad"), "payload.n"),
        ],
        ids=["unknown-kind", "unknown-dependency", "duplicate-id", "bad-payload"],
    )
    def test_a_bad_spawn_leaves_the_parent_unsettled_and_nothing_admitted(
        self, h: Harness, bad: Task, field: str
    ) -> None:
        h.admit(Task("a", id="p"), Task("a", id="after", depends_on=["p"]))
        parent = h.running()
        before = h.snapshot("p", "p/good", "p/bad", "after")
        with pytest.raises(InputError) as caught:
            h.run.settle(
                parent,
                parent.token,
                SUCCEEDED,
                "out",
                spawned=[Task("b", id="p/good"), bad],
                attempt=attempt(),
            )
        assert caught.value.field == field
        assert h.snapshot("p", "p/good", "p/bad", "after") == before
        assert before[3] == (RUNNING, None, None, PENDING)
        # The lease still holds: the parent settles (here without spawns) and nothing of the
        # refused step shows, not even its attempt.
        assert h.run.settle(parent, parent.token, SUCCEEDED, "out")
        assert h.heard.results["p"].failures in (None, [])
        assert h.run.state_of("after") == READY

    def test_check_spawn_refuses_what_settle_would(self, h: Harness) -> None:
        h.admit(Task("a", id="p"), Task("a", id="other"))
        parent = h.running()
        pending: dict[str, Task] = {"p/1": Task("b", id="p/1")}
        h.run.check_spawn(Task("b", id="p/2", depends_on=["p/1", "other"]), parent, pending)
        for bad in (
            Task("b", id="p/1"),
            Task("b", id="other"),
            Task("b", id="x", depends_on=["?"]),
        ):
            with pytest.raises(InputError):
                h.run.check_spawn(bad, parent, pending)
        assert h.run.state_of("p/2") is None  # a check admits nothing

    def test_a_spawn_into_a_closed_group_is_refused(self, h: Harness) -> None:
        h.admit(
            Task("a", id="m", tags=["g"]),
            Task("a", id="w", depends_on_tags=["g"]),
            Task("b", id="p"),
        )
        h.run.close_input()
        h.succeed("m")
        assert h.run.state_of("w") == READY  # the group closed: its waiter started
        claimed = {r.id: r for r in (h.claim(), h.claim())}
        parent = claimed["p"]
        assert h.run.start(parent, parent.token, "x")
        with pytest.raises(InputError, match="closed") as caught:
            h.run.settle(parent, parent.token, SUCCEEDED, None, spawned=[Task("a", tags=["g"])])
        assert caught.value.field == "tags"
        assert h.run.state_of("p") == RUNNING


# -- dependencies and groups -----------------------------------------------------------------------


class TestDependencies:
    def test_a_dependent_is_ready_in_the_step_its_last_dependency_succeeds(
        self, h: Harness
    ) -> None:
        h.admit(Task("a", id="x"), Task("a", id="y"), Task("b", id="z", depends_on=["x", "y"]))
        assert (h.run.pending, h.run.state_of("z")) == (1, PENDING)
        h.succeed("x", 1)
        assert h.run.state_of("z") == PENDING
        mark = len(h.heard.events)
        h.succeed("y", 2)
        assert h.heard.since(mark) == [("finished", "y"), ("ready", "z")]
        assert h.run.pending == 0
        assert h.run.deps_of(h.claim()) == {"x": 1, "y": 2}

    def test_a_failed_dependency_skips_its_dependents_transitively(self, h: Harness) -> None:
        h.admit(
            Task("a", id="root"),
            Task("a", id="mid", depends_on=["root"]),
            Task("a", id="leaf", depends_on=["mid"]),
            Task("a", id="free"),
        )
        h.fail_now("root")
        assert h.heard.ended == ["root", "mid", "leaf"]
        mid, leaf = h.heard.results["mid"], h.heard.results["leaf"]
        assert (mid.status, mid.error, mid.error_type) == (
            SKIPPED,
            "dependency 'root' failed",
            "DependencyFailed",
        )
        assert (leaf.status, leaf.error) == (SKIPPED, "dependency 'mid' skipped")
        assert (h.run.unfinished, h.run.pending) == (1, 0)
        assert h.claim_all() == ["free"]

    def test_a_task_admitted_after_its_dependency_failed_is_skipped_at_once(
        self, h: Harness
    ) -> None:
        h.admit(Task("a", id="root"), forward=False)
        h.fail_now("root")
        h.admit(Task("a", id="late", depends_on=["root"]), forward=False)
        assert h.run.state_of("late") == SKIPPED
        assert h.heard.results["late"].error == "dependency 'root' failed"
        assert (h.run.unfinished, h.run.pending) == (0, 0)

    def test_a_task_admitted_after_its_dependency_succeeded_is_ready(self, h: Harness) -> None:
        h.admit(Task("a", id="root"), forward=False)
        h.succeed("root")
        h.admit(Task("a", id="late", depends_on=["root"]), forward=False)
        assert h.run.state_of("late") == READY

    def test_a_whole_list_may_depend_forward(self, h: Harness) -> None:
        h.admit(Task("a", id="late", depends_on=["early"]), Task("a", id="early"))
        assert h.claim_all() == ["early"]


class TestGroups:
    def test_a_waiter_is_ready_after_close_input_and_every_member_succeeded(
        self, h: Harness
    ) -> None:
        h.admit(
            Task("a", id="m1", tags=["g"]),
            Task("a", id="m2", tags=["g"]),
            Task("b", id="w", depends_on_tags=["g"]),
            forward=False,
        )
        h.succeed("m1", 1)
        h.succeed("m2", 2)
        assert h.run.state_of("w") == PENDING  # more members may still come
        h.admit(Task("a", id="m3", tags=["g"]), forward=False)
        h.run.close_input()
        assert h.run.state_of("w") == PENDING
        mark = len(h.heard.events)
        h.succeed("m3", 3)
        assert h.heard.since(mark) == [("finished", "m3"), ("ready", "w")]
        assert h.run.deps_of(h.claim()) == {"m1": 1, "m2": 2, "m3": 3}

    def test_close_input_readies_a_group_already_done(self, h: Harness) -> None:
        h.admit(Task("a", id="m", tags=["g"]), Task("b", id="w", depends_on_tags=["g"]))
        h.succeed("m")
        assert h.run.state_of("w") == PENDING
        h.run.close_input()
        assert h.run.state_of("w") == READY
        assert h.run.pending == 0

    def test_a_waiter_of_an_empty_group_is_ready_once_input_ends(self, h: Harness) -> None:
        h.admit(Task("b", id="w", depends_on_tags=["nobody"]))
        assert h.run.state_of("w") == PENDING
        h.run.close_input()
        assert h.run.state_of("w") == READY

    def test_a_failed_member_skips_the_waiters(self, h: Harness) -> None:
        h.admit(
            Task("a", id="m1", tags=["g"]),
            Task("a", id="m2", tags=["g"]),
            Task("b", id="w", depends_on_tags=["g"]),
            Task("b", id="after", depends_on=["w"]),
        )
        h.fail_now("m1")  # before close_input: a failed member is enough
        assert h.heard.ended == ["m1", "w", "after"]
        w = h.heard.results["w"]
        assert (w.status, w.error, w.error_type) == (
            SKIPPED,
            "group 'g' member 'm1' failed",
            "DependencyFailed",
        )
        assert h.run.state_of("m2") == READY  # a member is not skipped by its sibling
        h.admit(Task("b", id="late", depends_on_tags=["g"]))
        assert h.heard.results["late"].status == SKIPPED

    def test_the_group_named_by_a_task_stays_open_until_that_task_ends(self, h: Harness) -> None:
        h.admit(Task("a", id="owner"), Task("b", id="w", depends_on_tags=["owner"]))
        h.run.close_input()
        assert h.run.state_of("w") == PENDING
        h.succeed("owner")
        assert h.run.state_of("w") == READY


# -- cancellation ----------------------------------------------------------------------------------


def _cancel_scene(h: Harness) -> None:
    """Tasks to cancel: "run" running on agent x, "claim" claimed, "wait" ready (target y after a
    fallback), "pend" pending on "wait", and "other" that no selector below matches."""
    h.admit(
        Task("a", id="run", priority=1, tags=["t"]),
        Task("a", id="claim", priority=2, tags=["t"]),
        Task("a", id="wait", priority=3, tags=["t"]),
        Task("a", id="pend", priority=4, tags=["t"], depends_on=["wait"]),
        Task("b", id="other", priority=9),
    )
    running = h.running("x")
    claimed = h.claim()
    third = h.running("z")
    assert h.run.fail(third, third.token, attempt("z"), next_agent="x")
    assert (running.id, claimed.id) == ("run", "claim")


class TestCancel:
    @pytest.mark.parametrize(
        "selector",
        [
            Selector(task_ids=["run", "claim", "wait", "pend"]),
            Selector(kind="a"),
            Selector(tag="t"),
            Selector(priority=(1, 4)),
            Selector(kind="a", tag="t", priority=(0, 5)),
        ],
        ids=["task_ids", "kind", "tag", "priority", "all-fields"],
    )
    def test_waiting_tasks_end_cancelled_and_running_ones_come_back_flagged(
        self, h: Harness, selector: Selector
    ) -> None:
        _cancel_scene(h)
        flagged = h.run.cancel(selector, "stop it", "Stopped")
        assert sorted(r.id for r in flagged) == ["claim", "run"]
        assert all(r.cancelling == "stop it" for r in flagged)
        assert h.heard.ended == ["wait", "pend"]
        wait, pend = h.heard.results["wait"], h.heard.results["pend"]
        assert (wait.status, wait.error, wait.error_type) == (CANCELLED, "stop it", "Stopped")
        assert (pend.status, pend.error) == (SKIPPED, "dependency 'wait' cancelled")
        assert [h.run.state_of(i) for i in ("run", "claim", "other")] == [RUNNING, CLAIMED, READY]
        assert (h.run.unfinished, h.run.pending) == (3, 0)
        # Their owner ends the flagged ones, with their own tokens.
        for record in flagged:
            assert h.run.settle(record, record.token, CANCELLED, error="stop it")
        assert h.claim_all() == ["other"]

    def test_by_agent_it_takes_the_tasks_running_on_or_bound_for_that_agent(
        self, h: Harness
    ) -> None:
        _cancel_scene(h)
        flagged = h.run.cancel(Selector(agent="x"), "agent x removed")
        assert [r.id for r in flagged] == ["run"]
        assert h.heard.ended == ["wait", "pend"]  # "wait" was bound for x after its fallback
        assert h.run.state_of("claim") == CLAIMED  # claimed, but no agent chosen yet

    def test_a_selector_that_matches_nothing_changes_nothing(self, h: Harness) -> None:
        _cancel_scene(h)
        before = h.snapshot("run", "claim", "wait", "pend", "other")
        assert h.run.cancel(Selector(priority=(100, 200)), "none") == []
        assert h.run.cancel(Selector(task_ids=["ghost"]), "none") == []
        assert h.snapshot("run", "claim", "wait", "pend", "other") == before

    def test_every_unfinished_task_with_an_empty_selector(self, h: Harness) -> None:
        _cancel_scene(h)
        flagged = h.run.cancel(Selector(), "the run was cancelled")
        assert sorted(r.id for r in flagged) == ["claim", "run"]
        assert h.run.state_of("other") == CANCELLED
        assert h.run.unfinished == 2
        assert h.run.claim() is None

    def test_a_cancelled_retry_is_not_made_ready_by_its_due_time(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running()
        assert h.run.fail(record, record.token, attempt(), retry_at=3.0)
        assert h.run.cancel(Selector(task_ids=["t1"]), "no") == []
        assert h.run.state_of("t1") == CANCELLED
        assert h.run.due(10.0) == []
        assert h.run.next_due() is None
        assert h.heard.ended == ["t1"]
        assert h.run.claim() is None

    def test_an_ended_task_is_not_cancelled(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        h.succeed("t1")
        assert h.run.cancel(Selector(), "late") == []
        assert h.heard.ended == ["t1"]
        assert h.run.state_of("t1") == SUCCEEDED


# -- due times -------------------------------------------------------------------------------------


class TestDueTimes:
    def test_a_retry_is_ready_exactly_when_its_due_time_is_reached(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running()
        assert h.run.fail(record, record.token, attempt(), retry_at=7.5)
        assert (h.run.state_of("t1"), h.run.next_due()) == (RETRY_WAIT, 7.5)
        assert h.run.claim() is None
        mark = len(h.heard.events)
        assert h.run.due(7.4) == []
        assert h.run.state_of("t1") == RETRY_WAIT
        assert h.heard.since(mark) == []
        assert h.run.due(7.5) == []
        assert h.heard.since(mark) == [("ready", "t1")]
        assert h.run.next_due() is None
        again = h.claim()
        assert (again.id, again.attempts, again.agent_tries) == ("t1", 1, 1)

    def test_retries_come_due_in_time_order(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"), Task("a", id="t3"))
        for retry_at in (3.0, 1.0, 2.0):
            record = h.running()
            assert h.run.fail(record, record.token, attempt(), retry_at=retry_at)
        assert h.run.next_due() == 1.0
        h.run.due(2.0)
        assert h.claim_all() == ["t2", "t3"]
        assert h.run.next_due() == 3.0

    def test_a_task_timeout_is_reported_once_its_deadline_passed(self, h: Harness) -> None:
        h.t[0] = 10.0
        h.admit(Task("a", id="t1", timeout=5.0), Task("a", id="t2"))
        assert h.run.next_due() == 15.0
        assert h.run.due(14.9) == []
        expired = h.run.due(15.0)
        assert [r.id for r in expired] == ["t1"]
        assert h.run.state_of("t1") == READY  # the dispatcher decides how it ends
        record = expired[0]
        assert h.run.settle(record, record.token, FAILED, error="timeout", error_type="TaskTimeout")
        assert h.run.next_due() is None
        assert h.claim_all() == ["t2"]

    def test_the_run_task_timeout_applies_to_every_task_from_when_it_is_ready(
        self, make_run: Callable[..., Harness]
    ) -> None:
        h = make_run(task_timeout=2.0)
        h.admit(Task("a", id="first"), Task("a", id="second", depends_on=["first"]))
        h.t[0] = 1.0
        h.succeed("first")  # second is ready at t=1: its deadline is t=3
        deadlines = {r.id: r.deadline for r in (h.claim(),)}
        assert deadlines == {"second": 3.0}
        assert h.run.next_due() == 3.0
        assert [r.id for r in h.run.due(3.0)] == ["second"]

    def test_next_due_is_never_a_time_already_handled(
        self, make_run: Callable[..., Harness]
    ) -> None:
        h = make_run(task_timeout=10.0)
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        record = h.running()
        assert h.run.fail(record, record.token, attempt(), retry_at=4.0)
        assert h.run.next_due() == 4.0
        h.run.due(4.0)
        assert h.run.next_due() == 10.0  # the deadlines remain
        h.run.due(10.0)
        later = h.run.next_due()
        assert later is None or later > 10.0

    def test_a_deadline_passing_during_a_retry_wait_is_reported(self, h: Harness) -> None:
        h.admit(Task("a", id="t1", timeout=3.0))
        record = h.running()
        assert h.run.fail(record, record.token, attempt(), retry_at=5.0)
        assert h.run.next_due() == 3.0
        assert [r.id for r in h.run.due(3.0)] == ["t1"]


# -- fallback --------------------------------------------------------------------------------------


class TestFallback:
    def test_next_agent_uses_up_the_failed_agent_and_targets_the_next(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running("x")
        assert record.target == "x"
        assert h.run.fail(record, record.token, attempt("x"), next_agent="y")
        again = h.claim()
        assert (again.target, again.tried, again.agent_tries, again.attempts) == ("y", ["x"], 0, 1)
        assert h.run.start(again, again.token, "y")
        assert h.run.fail(again, again.token, attempt("y", 2), next_agent=None)
        third = h.claim()
        assert (third.target, third.tried) == (None, ["x", "y"])
        assert [f.agent for f in third.failures] == ["x", "y"]

    def test_keep_leaves_the_agent_and_its_tries(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running("x")
        assert h.run.fail(record, record.token, attempt("x"), next_agent=KEEP)
        again = h.claim()
        assert (again.target, again.tried, again.agent_tries) == ("x", None, 1)
        assert h.run.start(again, again.token, "x")
        assert (again.agent_tries, again.attempts) == (2, 2)

    def test_starting_on_another_agent_resets_its_tries(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running("x")
        assert h.run.fail(record, record.token, attempt("x"))
        again = h.claim()
        assert h.run.start(again, again.token, "y")
        assert (again.target, again.agent_tries, again.attempts) == ("y", 1, 2)


# -- admission -------------------------------------------------------------------------------------


class TestAdmission:
    def test_the_same_task_admitted_twice_is_admitted_once(self, h: Harness) -> None:
        task = Task("a", {"q": 1}, id="t1", tags=["g"])
        assert h.admit(task, Task("a", id="t2")) == 2
        events = list(h.heard.events)
        assert h.admit(task) == 0
        assert h.admit(Task("a", {"q": 1}, id="t1", tags=["g"]), Task("a", id="t3")) == 1
        h.run.admit_one(Task("a", {"q": 1}, id="t1", tags=["g"]), 9)
        assert h.heard.events == [*events, ("ready", "t3")]
        assert h.run.unfinished == 3
        assert h.claim_all() == ["t1", "t2", "t3"]

    def test_an_ended_task_admitted_again_does_not_run_again(self, h: Harness) -> None:
        h.admit(Task("a", 1, id="t1"))
        h.succeed("t1")
        assert h.admit(Task("a", 1, id="t1")) == 0
        assert h.run.state_of("t1") == SUCCEEDED
        assert h.run.claim() is None

    @pytest.mark.parametrize(
        "other",
        [
            Task("b", {"q": 1}, id="t1"),
            Task("a", {"q": 2}, id="t1"),
            Task("a", {"q": 1}, id="t1", depends_on=["t0"]),
            Task("a", {"q": 1}, id="t1", tags=["other"]),
        ],
        ids=["kind", "payload", "depends_on", "tags"],
    )
    def test_a_different_task_with_an_admitted_id_is_refused(self, h: Harness, other: Task) -> None:
        h.admit(Task("a", id="t0"), Task("a", {"q": 1}, id="t1"))
        before = h.snapshot("t0", "t1")
        with pytest.raises(InputError, match="duplicate task id 't1'") as caught:
            h.admit(other)
        assert (caught.value.task_id, caught.value.field) == ("t1", "id")
        with pytest.raises(InputError, match="duplicate task id 't1'"):
            h.run.admit_one(other, 0)
        assert h.snapshot("t0", "t1") == before

    def test_tasks_with_the_same_key_execute_once(self, h: Harness) -> None:
        # The first task with a key holds it and runs; the others with it (in its batch, a later
        # one, a streamed item) are the same work: admitted, never ready, they end with its
        # result. A task depending on one of them waits for that result.
        batch = (
            Task("a", id="k1", key="same"),
            Task("a", id="k2", key="same"),
            Task("b", id="d", depends_on=["k2"]),
        )
        assert h.admit(*batch) == 3
        h.run.admit_one(Task("a", id="k3", key="same"), 0)
        assert h.admit(Task("a", id="k4", key="other"), Task("a", id="k5", key="other")) == 2
        assert h.run.unfinished == 6
        assert h.heard.since(0) == [("ready", "k1"), ("ready", "k4")]
        h.succeed("k1", {"v": 1}, agent="x")
        ended = h.heard.results
        for follower in ("k2", "k3"):
            assert h.run.state_of(follower) == SUCCEEDED
            assert (ended[follower].output, ended[follower].agent) == ({"v": 1}, "x")
            assert ended[follower].attempts == 0
        assert h.claim_all() == ["k4", "d"]
        # Once the holder has succeeded, a new task with the key ends at its admission.
        assert h.admit(Task("a", id="k6", key="same")) == 1
        assert h.run.state_of("k6") == SUCCEEDED
        assert ended["k6"].output == {"v": 1}
        assert sorted(h.heard.ended) == ["k1", "k2", "k3", "k6"]

    @pytest.mark.parametrize("how", ["fails", "is cancelled"])
    def test_when_the_holder_of_a_key_does_not_succeed_the_next_task_with_it_runs(
        self, h: Harness, how: str
    ) -> None:
        h.admit(*(Task("a", id=f"k{i}", key="same") for i in (1, 2, 3)))
        mark = len(h.heard.events)
        if how == "fails":
            h.fail_now("k1")
        else:
            assert h.run.cancel(Selector(task_ids=frozenset({"k1"})), "no") == []
        assert h.heard.since(mark) == [("finished", "k1"), ("ready", "k2")]
        assert h.run.state_of("k3") == PENDING
        h.succeed("k2", "second", agent="y")
        assert (h.heard.results["k3"].output, h.heard.results["k3"].agent) == ("second", "y")
        assert h.run.unfinished == 0

    def test_a_task_with_a_key_whose_own_dependency_fails_is_skipped(self, h: Harness) -> None:
        h.admit(
            Task("a", id="p"),
            Task("a", id="k1", key="same"),
            Task("a", id="k2", key="same", depends_on=["p"]),
        )
        h.fail_now("p")
        assert h.run.state_of("k2") == SKIPPED
        h.succeed("k1", 1)
        assert h.heard.ended == ["p", "k2", "k1"]  # each ended once

    @pytest.mark.parametrize(
        "batch",
        [
            (Task("a", id="k1", key="same", depends_on=["k2"]), Task("a", id="k2", key="same")),
            (
                Task("a", id="k1", key="same", depends_on=["x"]),
                Task("a", id="x", depends_on=["k2"]),
                Task("a", id="k2", key="same"),
            ),
            (
                Task("a", id="k1", key="same", depends_on_tags=["g"]),
                Task("a", id="k2", key="same", tags=["g"]),
            ),
            (
                Task("a", id="k1", key="same", depends_on_tags=["g"]),
                Task("a", id="k2", key="same"),
                Task("a", id="x", tags=["g"], depends_on=["k2"]),
            ),
        ],
        ids=["depends-on-it", "through-a-task", "through-its-group", "through-a-member"],
    )
    def test_a_task_with_a_key_that_the_first_waits_for_runs_in_its_place(
        self, h: Harness, batch: tuple[Task, ...]
    ) -> None:
        # k1 waits (through its dependencies or groups) for k2, which has its key: had k2 waited
        # for k1 as its follower, neither would ever run. k2 runs, k1 ends with its output.
        h.admit(*batch)
        h.run.close_input()
        h.succeed("k2", "once", agent="y")  # the one ready task
        if h.run.state_of("x") is not None:
            h.succeed("x", "x")
        assert h.run.state_of("k1") == SUCCEEDED
        assert (h.heard.results["k1"].output, h.heard.results["k1"].attempts) == ("once", 0)
        assert h.run.unfinished == 0
        assert sorted(h.heard.ended) == sorted(t.id for t in batch)

    def test_a_streamed_member_that_depends_on_a_follower_of_its_groups_waiter_is_refused(
        self, h: Harness
    ) -> None:
        # k2 follows k1 (the same work), and k1 waits for group g: a later member of g that
        # depends on k2 would wait for k1 through it, a cycle nothing would ever end.
        h.run.admit_one(Task("a", id="k1", key="same", depends_on_tags=["g"]), 0)
        h.run.admit_one(Task("a", id="k2", key="same"), 1)
        with pytest.raises(InputError, match="cycle") as caught:
            h.run.admit_one(Task("a", id="m", tags=["g"], depends_on=["k2"]), 2)
        assert caught.value.task_id == "m"
        assert h.run.state_of("m") is None
        h.run.close_input()
        h.succeed("k1", "once")
        assert h.heard.results["k2"].output == "once"
        assert h.run.unfinished == 0

    def test_a_streamed_task_follows_a_key_whose_holder_was_forgotten(
        self, make_run: Callable[..., Harness]
    ) -> None:
        h = make_run(compact=True)
        h.run.admit_one(Task("a", {"n": 1}, key="same"), 0)  # a generated id, compacted
        h.succeed("a#1", "once", agent="y")
        h.run.admit_one(Task("a", {"n": 1}, key="same"), 1)
        # As a follower of a holder still held ends: its output, and the agent that made it.
        assert (h.heard.results["a#2"].output, h.heard.results["a#2"].agent) == ("once", "y")
        assert h.run.unfinished == 0

    @pytest.mark.parametrize(
        "bad",
        [
            Task("nope", id="bad"),
            Task("a", id="bad", depends_on=["ghost"]),
            Task("a", id="ok1"),  # the same id twice in one batch
            Task("a", id="bad", depends_on=["bad"]),
            Task("a", id="bad", priority="high"),  # type: ignore[arg-type]
            Task("a", id="bad", timeout=-1),
            Task("typed", {"n": "not a number"}, id="bad"),
            "not a task",
        ],
        ids=[
            "unknown-kind",
            "unknown-dependency",
            "duplicate-in-batch",
            "self-dependency",
            "priority",
            "timeout",
            "payload",
            "not-a-task",
        ],
    )
    def test_a_batch_with_one_bad_task_leaves_nothing_behind(self, h: Harness, bad: Any) -> None:
        h.admit(Task("a", id="old"))
        before = h.snapshot("old", "ok1", "ok2", "bad")
        batch = [
            Task("a", id="ok1", tags=["g"]),
            Task("a", id="ok2", depends_on=["ok1"], key="k"),
            bad,
        ]
        with pytest.raises(InputError):
            h.run.admit(batch, where="tasks", forward=True)
        assert h.snapshot("old", "ok1", "ok2", "bad") == before
        assert before[3] == (READY, None, None, None)
        # Nothing of the refused batch lingers: not its ids, its key or its group.
        assert h.admit(Task("a", id="ok1"), Task("a", id="ok2", key="k")) == 2
        assert h.claim_all() == ["old", "ok1", "ok2"]

    def test_a_cycle_refuses_the_batch(self, h: Harness) -> None:
        with pytest.raises(InputError, match="cycle"):
            h.admit(
                Task("a", id="x", depends_on=["y"]),
                Task("a", id="y", depends_on=["x"]),
                Task("a", id="z"),
            )
        with pytest.raises(InputError, match="cycle"):
            h.admit(Task("a", id="m", tags=["g"], depends_on_tags=["h"]),
                    Task("a", id="n", tags=["h"], depends_on_tags=["g"]))  # fmt: skip
        assert (h.run.unfinished, h.run.pending, h.heard.events) == (0, 0, [])

    def test_a_streamed_task_may_depend_only_on_tasks_before_it(self, h: Harness) -> None:
        with pytest.raises(InputError, match="before it") as caught:
            h.admit(Task("a", id="x", depends_on=["y"]), Task("a", id="y"), forward=False)
        assert caught.value.field == "depends_on"
        with pytest.raises(InputError, match="before it"):
            h.run.admit_one(Task("a", id="x", depends_on=["y"]), 0)
        h.run.admit_one(Task("a", id="y"), 0)
        h.run.admit_one(Task("a", id="x", depends_on=["y"]), 1)
        assert (h.run.unfinished, h.run.pending) == (2, 1)

    def test_a_task_without_an_id_gets_a_fresh_one(self, h: Harness) -> None:
        h.admit(Task("a", id="a#1"), forward=False)
        task = Task("a")
        assert h.admit(task, forward=False) == 1
        assert task.id not in (None, "a#1")
        assert h.run.state_of(task.id) == READY

    def test_a_generated_id_never_takes_one_given_to_a_streamed_task(self, h: Harness) -> None:
        h.run.admit_one(Task("a", id="a#1"), 0)
        tasks = [Task("a") for _ in range(3)]
        assert h.admit(*tasks, forward=False) == 3
        assert len({t.id for t in tasks} | {"a#1"}) == 4
        assert h.run.unfinished == 4

    def test_a_compacting_run_refuses_a_given_id_that_may_be_a_forgotten_generated_one(
        self, make_run: Callable[..., Harness]
    ) -> None:
        # A streamed run forgets a generated id once its task succeeds (nothing can name it):
        # a given id of that form, within the numbers generated so far, cannot be told apart.
        h = make_run(compact=True)
        h.run.admit_one(Task("a", "generated"), 0)
        h.succeed("a#1", "generated")
        mark = len(h.heard.events)
        with pytest.raises(InputError, match="'a#1'") as caught:
            h.run.admit_one(Task("a", "given", id="a#1"), 1)
        assert (caught.value.task_id, caught.value.field) == ("a#1", "id")
        with pytest.raises(InputError, match="'a#1'"):
            h.admit(Task("a", "given", id="a#1"), forward=False)
        assert (h.run.unfinished, h.heard.since(mark)) == (0, [])
        # Past the numbers generated, or of another form, an id is the user's own.
        h.run.admit_one(Task("a", "given", id="a#2"), 1)
        h.run.admit_one(Task("a", "given", id="a#01"), 2)
        h.admit(Task("b", "given", id="b#x"), Task("a", "again"), forward=False)
        h.admit(Task("a", "generated"), Task("a", "given", id="a#4"), forward=False)
        assert h.claim_all() == ["a#2", "a#01", "b#x", "a#3", "a#5", "a#4"]
        with pytest.raises(InputError, match="'a#1'"):  # a spawn too
            h.run.check_spawn(Task("b", id="a#1"), h.heard.records["a#2"], {})

    def test_a_typed_payload_is_validated_into_its_model(self, h: Harness) -> None:
        h.admit(Task("typed", {"n": 3}, id="t1"))
        assert h.claim().task.payload == Typed(n=3)


# -- reprioritize ----------------------------------------------------------------------------------


class TestFeedback:
    def test_notes_reach_the_next_attempt_and_a_partial_output_survives_failure(
        self, h: Harness
    ) -> None:
        h.admit(Task("a", id="t1"))
        record = h.running()
        assert h.run.note(record, record.token, "too short", partial="draft")
        assert h.run.fail(record, record.token, attempt())
        again = h.running()
        assert again.feedback == ["too short"]
        assert not h.run.note(again, again.token + 1000, "stale")  # a stale lease writes nothing
        assert h.run.note(again, again.token, "still too short")
        assert h.run.settle(again, again.token, FAILED, error="gave up", error_type="X")
        assert again.feedback == ["too short", "still too short"]
        assert h.heard.results["t1"].output == "draft"


class TestReprioritize:
    def test_a_ready_task_moves_in_the_claim_order(self, h: Harness) -> None:
        h.admit(Task("a", id="t1", priority=1), Task("a", id="t2", priority=1))
        assert h.run.reprioritize("t2", 0)
        assert h.claim_all() == ["t2", "t1"]

    def test_a_demoted_task_goes_behind(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"), Task("a", id="t3", priority=1))
        assert h.run.reprioritize("t1", 5)
        assert h.claim_all() == ["t2", "t3", "t1"]

    def test_a_waiting_task_keeps_its_new_priority_when_it_becomes_ready(self, h: Harness) -> None:
        h.admit(Task("a", id="d"), Task("a", id="w", depends_on=["d"]), Task("a", id="o"))
        assert h.run.reprioritize("w", -1)
        d = h.running()
        assert h.run.settle(d, d.token, SUCCEEDED, None)
        assert h.claim_all() == ["w", "o"]

    def test_a_retry_keeps_its_new_priority_when_it_comes_due(self, h: Harness) -> None:
        h.admit(Task("a", id="t1", priority=5), Task("a", id="t2", priority=1))
        h.claim_all()
        for record in (h.heard.records["t1"], h.heard.records["t2"]):
            assert h.run.start(record, record.token, "x")
            assert h.run.fail(record, record.token, attempt(), retry_at=1.0)
        assert h.run.reprioritize("t1", 0)
        h.run.due(1.0)
        assert h.claim_all() == ["t1", "t2"]

    def test_claimed_ended_and_unknown_tasks_are_not_reprioritized(self, h: Harness) -> None:
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        h.claim()
        h.succeed("t2")
        assert not h.run.reprioritize("t1", 9)
        assert not h.run.reprioritize("t2", 9)
        assert not h.run.reprioritize("ghost", 9)

    def test_a_claimed_task_its_holder_keeps_waiting_takes_a_new_priority(self, h: Harness) -> None:
        # The dispatcher holds a claimed task waiting for its agent's slot, and puts it in its
        # new place there; the store keeps the priority (a retry queues the task with it).
        h.admit(Task("a", id="t1"), Task("a", id="t2"))
        claimed = h.claim()
        assert not h.run.reprioritize("t1", -3)
        assert h.run.reprioritize("t1", -3, claimed=True)
        assert claimed.priority == -3
        assert h.run.state_of("t1") == CLAIMED


# -- counters --------------------------------------------------------------------------------------


class TestCounters:
    def test_unfinished_and_pending_follow_every_transition(self, h: Harness) -> None:
        run = h.run
        h.admit(
            Task("a", id="a1"),
            Task("a", id="a2", depends_on=["a1"]),
            Task("a", id="a3", depends_on=["a1"]),
            Task("b", id="g1", tags=["g"]),
            Task("b", id="w", depends_on_tags=["g"]),
        )
        assert (run.unfinished, run.pending) == (5, 3)
        record = h.running()  # a1
        assert run.fail(record, record.token, attempt(), retry_at=1.0)
        assert (run.unfinished, run.pending) == (5, 3)
        run.due(1.0)
        h.claim_all()  # g1, a1
        assert (run.unfinished, run.pending) == (5, 3)
        run.cancel(Selector(task_ids=["a3"]), "no")
        assert (run.unfinished, run.pending) == (4, 2)
        run.close_input()
        assert (run.unfinished, run.pending) == (4, 2)
        for record in run.cancel(Selector(), "all"):
            assert run.settle(record, record.token, CANCELLED, error="all")
        assert (run.unfinished, run.pending) == (0, 0)
        assert sorted(h.heard.ended) == ["a1", "a2", "a3", "g1", "w"]


# -- properties ------------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Random operations on one run, as a dispatcher (or a late, confused lease holder) would send them.

    The machine keeps its own view of every lease: a lease (task, token) is live from the claim
    that gave it until its attempt failed, the task ended, or the task was claimed again; a write
    with a lease that is not live must be refused and change nothing."""

    leases = Bundle("leases")

    factory: Callable[[], Store] = MemoryStore  # set per store by `TestProperties`

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(type(self).factory())
        self.ids: list[str] = []
        self.live: dict[str, int] = {}  # task id -> the token of its live lease
        self.spawned = 0

    @initialize(
        specs=st.lists(
            st.tuples(
                st.sampled_from(KINDS),
                st.integers(0, 3),  # priority
                st.lists(st.integers(0, 30), max_size=2),  # dependencies (on earlier tasks)
                st.sampled_from([(), ("g",), ("h",)]),  # tags
                st.booleans(),  # waits for group "g" (when not a member)
                st.sampled_from([None, 2.0, 6.0]),  # timeout
            ),
            min_size=1,
            max_size=12,
        ),
        close=st.booleans(),
    )
    def admit(self, specs: list[Any], close: bool) -> None:
        tasks = []
        for i, (kind, priority, deps, tags, waits, timeout) in enumerate(specs):
            depends = sorted({f"t{d % i}" for d in deps}) if i else []
            tasks.append(
                Task(
                    kind,
                    id=f"t{i}",
                    priority=priority,
                    depends_on=depends,
                    tags=tags,
                    depends_on_tags=["g"] if waits and "g" not in tags and not tags else [],
                    timeout=timeout,
                )
            )
        try:
            self.h.run.admit(tasks, where="tasks", forward=True)
        except InputError:  # a group cycle: the batch is refused whole; admit a plain one
            assert (self.h.run.unfinished, self.h.heard.events) == (0, [])
            for task in tasks:
                task.depends_on_tags = []
            self.h.run.admit(tasks, where="tasks", forward=True)
        self.ids = [t.id for t in tasks]
        if close:
            self.h.run.close_input()

    # -- the dispatcher's moves

    @rule(target=leases)
    def claim(self) -> Any:
        record = self.h.run.claim()
        if record is None:
            return None
        assert record.id not in self.h.heard.results, f"claimed an ended task {record.id}"
        assert self.h.run.state_of(record.id) == CLAIMED
        assert self.live.get(record.id) != record.token, "a claim reused a live token"
        assert self.h.heard.tokens[record.id] != record.token, "a claim reused a visible token"
        self.live[record.id] = record.token
        return (record, record.token)

    def _is_live(self, lease: Any) -> bool:
        record, token = lease
        return self.live.get(record.id) == token and self.h.run.state_of(record.id) not in TERMINAL

    def _write(self, lease: Any, write: Callable[[], bool], ends_lease: bool) -> bool:
        """Make a write with `lease`; a stale one must be refused and change nothing."""
        if lease is None:
            return False
        record = lease[0]
        live = self._is_live(lease)
        before = self.h.snapshot(*self.ids)
        done = write()
        if not live:
            assert not done, f"a stale token wrote on {record.id}"
            assert self.h.snapshot(*self.ids) == before
        elif done and ends_lease:
            self.live.pop(record.id, None)
        return done

    @rule(lease=leases, agent=st.sampled_from(["x", "y"]))
    def start(self, lease: Any, agent: str) -> None:
        if lease is None:
            return
        record, token = lease
        state = self.h.run.state_of(record.id)
        done = self._write(lease, lambda: self.h.run.start(record, token, agent), False)
        if done:
            assert state == CLAIMED
            assert self.h.run.state_of(record.id) == RUNNING

    @rule(
        lease=leases,
        delay=st.sampled_from([None, 0.0, 1.0, 3.0]),
        next_agent=st.sampled_from([KEEP, None, "y"]),
    )
    def fail(self, lease: Any, delay: float | None, next_agent: Any) -> None:
        if lease is None:
            return
        record, token = lease
        retry_at = None if delay is None else self.h.t[0] + delay
        self._write(
            lease,
            lambda: self.h.run.fail(
                record, token, attempt(), retry_at=retry_at, next_agent=next_agent
            ),
            True,
        )

    @rule(
        lease=consumes(leases),
        status=st.sampled_from([SUCCEEDED, FAILED, CANCELLED]),
        spawn=st.integers(0, 2),
        bad_spawn=st.booleans(),
    )
    def settle(self, lease: Any, status: str, spawn: int, bad_spawn: bool) -> None:
        if lease is None:
            return
        record, token = lease
        children = []
        for _ in range(spawn if status == SUCCEEDED else 0):
            self.spawned += 1
            children.append(Task("b", id=f"s{self.spawned}", depends_on=[record.id]))
        if children and bad_spawn and self._is_live(lease):
            before = self.h.snapshot(*self.ids)
            with pytest.raises(InputError):
                self.h.run.settle(
                    record, token, status, "out", spawned=[*children, Task("nope", id="bad")]
                )
            assert self.h.snapshot(*self.ids) == before
            assert all(self.h.run.state_of(c.id) is None for c in children)
        done = self._write(
            lease,
            lambda: self.h.run.settle(record, token, status, "out", spawned=children),
            True,
        )
        if done:
            self.ids.extend(c.id for c in children)
            assert self.h.run.state_of(record.id) == status

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
        for record in self.h.run.cancel(selector, "cancelled"):
            assert self.h.run.state_of(record.id) in (CLAIMED, RUNNING)
            assert record.cancelling == "cancelled"

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        h = self.h
        h.t[0] += dt
        now = h.t[0]
        for record in h.run.due(now):
            assert record.deadline is not None
            assert record.deadline <= now
            assert h.run.state_of(record.id) not in TERMINAL
            # As the dispatcher does: a task not running is ended at its deadline.
            if h.run.state_of(record.id) != RUNNING:
                assert h.run.settle(record, record.token, FAILED, error="deadline")
                self.live.pop(record.id, None)
        later = h.run.next_due()
        assert later is None or later > now

    @rule(pick=st.integers(0, 40), priority=st.integers(-1, 4))
    def reprioritize(self, pick: int, priority: int) -> None:
        task_id = self.ids[pick % len(self.ids)]
        state = self.h.run.state_of(task_id)
        done = self.h.run.reprioritize(task_id, priority)
        if state in TERMINAL or state in (CLAIMED, RUNNING):
            assert not done

    @precondition(lambda self: bool(self.ids))
    @rule()
    def close(self) -> None:
        self.h.run.close_input()

    # -- invariants

    @invariant()
    def every_task_ends_at_most_once_and_counters_match(self) -> None:
        h = self.h
        ended = h.heard.ended
        assert len(ended) == len(set(ended)), f"a task ended twice: {ended}"
        states = {i: h.run.state_of(i) for i in self.ids}
        assert all(s is not None for s in states.values())
        terminal = {i for i, s in states.items() if s in TERMINAL}
        assert terminal == set(ended)
        assert h.run.unfinished == len(self.ids) - len(terminal)
        assert h.run.pending == sum(s == PENDING for s in states.values())
        for i in terminal:
            assert h.heard.results[i].status == states[i]

    @invariant()
    def ready_is_heard_only_for_unfinished_tasks(self) -> None:
        seen_end: set[str] = set()
        for what, task_id in self.h.heard.events:
            if what == "finished":
                seen_end.add(task_id)
            else:
                assert task_id not in seen_end, f"{task_id} heard ready after it ended"

    def teardown(self) -> None:
        """End everything the way a run ends, and check every task ended exactly once."""
        h = self.h
        if not self.ids:
            return
        h.run.close_input()
        for record in h.run.cancel(Selector(), "end"):
            assert h.run.settle(record, record.token, CANCELLED, error="end")
        assert h.run.unfinished == 0
        assert h.run.pending == 0
        assert sorted(h.heard.ended) == sorted(self.ids)
        assert {r.task_id for r in h.run.results()} == set(self.ids)
        assert h.run.claim() is None


class TestProperties:
    def test_random_operations_keep_the_invariants(
        self, store_factory: Callable[[], Store]
    ) -> None:
        machine = type("StoreMachine", (StoreMachine,), {"factory": staticmethod(store_factory)})
        # A PostgreSQL store makes a database per example and writes every step through: fewer
        # examples (its own model test against the memory store is tests/test_pg_graph.py's).
        examples = 40 if store_factory is postgres_store else 150
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
            ),
        )
