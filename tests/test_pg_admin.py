"""A PostgreSQL database read and repaired for its user (`PostgresStore.runs`, `.events`,
`.workers`, `.dead_letters`, `.retry`), on the session's real server.

Histories are made as processes make them: the coordinator's lease on the run (`acquire`), its
tasks admitted (`_graph.admit`), claimed and completed by a worker (`_leases.claim`, `fail`,
`complete`), a worker registered (`_processes.register`). The reads are compared with the SQLite
store's answers for the same history made through its public API; a retry is followed by the
reopened tasks claimed and completed like any worker's, and what waited for them runs too."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from orchestra import (
    Context,
    InputError,
    Orchestrator,
    PermanentError,
    RunResult,
    Task,
    agent,
)
from orchestra._admission import Admission
from orchestra._task import FAILED
from orchestra.stores import SQLiteStore
from orchestra.stores._postgres import _admin as admin
from orchestra.stores._postgres import _keyed as keyed
from orchestra.stores._postgres import _keys as keys
from orchestra.stores._postgres._coordinator import acquire
from orchestra.stores._postgres._graph import admit
from orchestra.stores._postgres._leases import End, Failed, claim, complete, fail, release
from orchestra.stores._postgres._listen import channel_of
from orchestra.stores._postgres._processes import deregister, register
from orchestra.stores._postgres._settle import close_input
from orchestra.stores._postgres._store import PostgresStore
from orchestra.stores._sqlite import _leases as sqlite_leases

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence
    from pathlib import Path

    from tests.pg import PgDatabases

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

WORKER = "host-a:101:w1"


def admission() -> Admission:
    return Admission(("work",), {})


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a new database with orchestra's schema, and run ``r`` held by a
    coordinator."""
    conn = await asyncpg.connect(pg_dsn)
    assert await acquire(conn, "r", owner="coordinator", lease=30) is not None
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
def store(pg_dsn: str) -> Iterator[PostgresStore]:
    store = PostgresStore(pg_dsn)
    try:
        yield store
    finally:
        store.close()


async def run_one(
    conn: asyncpg.Connection,
    task_id: str,
    *,
    fails: int = 0,
    ends: str = "succeeded",
    run_id: str = "r",
) -> None:
    """Claim the ready task `task_id` as the worker, fail `fails` attempts (each retried at
    once), then end it `ends` (a failure carries its last failed attempt, as a worker's does)."""
    for _ in range(fails + 1):
        claimed = await claim(conn, run_id, {"work": 100}, owner=WORKER, lease=30)
        [mine] = [c for c in claimed if c.id == task_id]
        # The others are not this test's to run now: handed back as they were.
        others = [(run_id, c.id, c.token) for c in claimed if c.id != task_id]
        assert len(await release(conn, WORKER, others)) == len(others)
        began = time.time()
        if mine.attempts <= fails:
            assert await fail(
                conn, run_id, mine.id, mine.token, owner=WORKER, agent="work",
                error_type="ConnectionError", message="reset", duration=0.001,
            )  # fmt: skip
            continue
        failures = {}
        if ends == "failed":
            failures[mine.id] = [
                Failed(
                    mine.attempts, "work", "PermanentError", "refused", began, 0.001,
                    traceback="Traceback (most recent call last):\nPermanentError: refused\n",
                )
            ]  # fmt: skip
        end = End(
            mine.id, mine.token, ends,
            output=f'{{"id": "{mine.id}"}}' if ends == "succeeded" else None,
            agent="work",
            error="refused" if ends == "failed" else None,
            error_type="PermanentError" if ends == "failed" else None,
            started=began,
        )  # fmt: skip
        assert await complete(conn, run_id, WORKER, [end], failures=failures) == [True]


async def states(conn: asyncpg.Connection, run_id: str = "r") -> dict[str, str]:
    rows = await conn.fetch("SELECT id, state FROM orchestra.tasks WHERE run_id = $1", run_id)
    return {row[0]: row[1] for row in rows}


async def ready(conn: asyncpg.Connection, run_id: str = "r") -> list[str]:
    rows = await conn.fetch(
        "SELECT id FROM orchestra.tasks WHERE run_id = $1 AND state = 'ready' ORDER BY id", run_id
    )
    return [row[0] for row in rows]


# -- the simple history, on both stores ----------------------------------------------------------


def simple_tasks() -> list[Task]:
    """`ok` succeeds, `d` fails for good, `after` (waiting for `d`) is skipped."""
    return [
        Task("work", 1, id="ok"),
        Task("work", "bad", id="d"),
        Task("work", 2, id="after", depends_on=["d"]),
    ]


async def simple_pg(conn: asyncpg.Connection) -> None:
    await admit(conn, "r", simple_tasks(), admission=admission())
    await close_input(conn, "r")
    await run_one(conn, "ok")
    await run_one(conn, "d", ends="failed")


async def simple_sqlite(path: Path) -> SQLiteStore:
    @agent(kinds=["work"])
    async def work(task: Task, ctx: Context) -> Any:
        if task.payload == "bad":
            raise PermanentError("refused")
        return {"id": task.id}

    result = await Orchestrator(agents=[work], store=SQLiteStore(path, window=0.01)).run(
        simple_tasks(), run_id="r"
    )
    assert result.metadata.counts["failed"] == 1
    return SQLiteStore(path)


class TestTheReadsHaveTheSQLiteStoresShapes:
    async def test_runs_count_the_same_tasks_with_the_same_fields(
        self, conn: asyncpg.Connection, store: PostgresStore, tmp_path: Path
    ) -> None:
        await simple_pg(conn)
        sqlite = await simple_sqlite(tmp_path / "runs.db")
        [theirs] = sqlite.runs()
        [ours] = store.runs()
        sqlite.close()
        assert ours["counts"] == theirs["counts"] == {"succeeded": 1, "failed": 1, "skipped": 1}
        shared = {"id", "created", "updated", "state", "opened", "owner", "counts"}
        assert shared <= theirs.keys()
        assert shared <= ours.keys()
        assert ours["id"] == "r"
        assert ours["owner"] == "coordinator"
        assert ours["held"] is True
        assert isinstance(ours["created"], float)
        assert abs(ours["created"] - time.time()) < 60

    async def test_a_tasks_journal_runs_from_its_admission_to_its_end_as_on_sqlite(
        self, conn: asyncpg.Connection, store: PostgresStore, tmp_path: Path
    ) -> None:
        await simple_pg(conn)
        sqlite = await simple_sqlite(tmp_path / "runs.db")
        theirs = sqlite.events("r", "d")
        sqlite.close()
        ours = store.events("r", "d")
        assert (
            [e["event"] for e in ours]
            == [e["event"] for e in theirs]
            == [
                "admitted",
                "started",
                "attempt_failed",
                "failed",
            ]
        )
        assert [set(e) for e in ours] == [set(e) for e in theirs]
        failed = ours[2]
        assert (failed["agent"], failed["attempt"], failed["detail"]) == (
            "work",
            1,
            "PermanentError: refused",
        )
        assert ours[-1]["detail"] == "refused"
        assert all(isinstance(e["at"], float) for e in ours)
        assert [e["at"] for e in ours] == sorted(e["at"] for e in ours)

    async def test_the_runs_journal_holds_every_task_and_the_coordinators_lease(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await simple_pg(conn)
        journal = store.events("r")
        assert {(e["task_id"], e["event"]) for e in journal if e["event"] != "admitted"} == {
            (None, "coordinator"),
            ("ok", "started"),
            ("ok", "succeeded"),
            ("d", "started"),
            ("d", "attempt_failed"),
            ("d", "failed"),
            ("after", "skipped"),
        }
        [took] = [e for e in journal if e["event"] == "coordinator"]
        assert isinstance(took["seq"], int)  # a row of the journal, not of a task
        assert "took the run" in took["detail"]

    async def test_a_retried_attempt_is_in_the_journal_before_the_end(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await admit(conn, "r", [Task("work", 1, id="t")], admission=admission())
        await run_one(conn, "t", fails=2)
        trace = [(e["event"], e["attempt"]) for e in store.events("r", "t")]
        assert trace == [
            ("admitted", None),
            ("attempt_failed", 1),
            ("attempt_failed", 2),
            ("started", 3),
            ("succeeded", 3),
        ]

    async def test_a_worker_whose_clock_is_ahead_dates_nothing_after_the_tasks_end(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        # Its failed attempt says it ended ten minutes from now; the task ended on the
        # database's clock, and the journal keeps that order, before a retry and after it.
        await admit(
            conn, "r", [Task("work", 0, id="t"), Task("work", 0, id="u")], admission=admission()
        )
        claimed = {c.id: c for c in await claim(conn, "r", {"work": 2}, owner=WORKER, lease=30)}
        ahead = time.time() + 600
        failed = Failed(1, "work", "PermanentError", "refused", ahead, 0.001)
        ended = [
            End("t", claimed["t"].token, "failed", agent="work", error="refused", started=ahead),
            End("u", claimed["u"].token, "succeeded", output="0", agent="work"),
        ]
        await complete(conn, "r", WORKER, ended, failures={"t": [failed]})
        journal = store.events("r")
        assert max(e["at"] for e in journal) < time.time() + 60
        trace = [e["event"] for e in journal if e["task_id"] == "t"]
        assert trace == ["admitted", "started", "attempt_failed", "failed"]
        store.retry("r")
        [t] = await claim(conn, "r", {"work": 1}, owner=WORKER, lease=30)
        await complete(conn, "r", WORKER, [End("t", t.token, "succeeded", output="0")])
        trace = [e["event"] for e in store.events("r", "t")]
        assert trace == ["admitted", "started", "attempt_failed", "failed", "retried", "succeeded"]

    async def test_dead_letters_carry_every_attempt_as_on_sqlite(
        self, conn: asyncpg.Connection, store: PostgresStore, tmp_path: Path
    ) -> None:
        await simple_pg(conn)
        sqlite = await simple_sqlite(tmp_path / "runs.db")
        [theirs] = sqlite.dead_letters("r")
        sqlite.close()
        [ours] = store.dead_letters("r")
        assert ours.keys() == theirs.keys()
        # (`error` is the text its process wrote: the engine's there, this test's here)
        for field in ("run_id", "task_id", "kind", "payload", "attempts", "error_type"):
            assert ours[field] == theirs[field], field
        assert [a.keys() for a in ours["attempts_list"]] == [
            a.keys() for a in theirs["attempts_list"]
        ]
        [attempt] = ours["attempts_list"]
        assert (attempt["number"], attempt["agent"], attempt["message"]) == (1, "work", "refused")
        assert attempt["traceback"].startswith("Traceback")
        assert isinstance(attempt["started"], float)

    async def test_workers_are_listed_live_or_gone_with_what_they_hold(
        self, conn: asyncpg.Connection, store: PostgresStore, tmp_path: Path
    ) -> None:
        await admit(
            conn, "r", [Task("work", i, id=f"t{i}") for i in range(3)], admission=admission()
        )
        await register(conn, WORKER, host="host-a", pid=101, lease=30, kinds=["work"], run_id="r")
        await register(conn, "host-b:7:w2", host="host-b", pid=7, lease=30)
        await claim(conn, "r", {"work": 2}, owner=WORKER, lease=30)
        await deregister(conn, "host-b:7:w2")
        found = {w["owner"]: w for w in store.workers()}
        assert found[WORKER]["live"] is True
        assert found[WORKER]["holding"] == 2
        assert found[WORKER]["kinds"] == ["work"]
        assert found[WORKER]["run_id"] == "r"
        assert found["host-b:7:w2"]["live"] is False
        assert found["host-b:7:w2"]["kinds"] is None
        assert isinstance(found["host-b:7:w2"]["gone"], float)
        # The fields SQLite's list has for the same worker, with the same types.
        sqlite = SQLiteStore(tmp_path / "runs.db")
        try:
            sqlite.call(sqlite_leases.register, WORKER, "r", ["work"], time.time())
            [theirs] = sqlite.workers()
        finally:
            sqlite.close()
        ours = found[WORKER]
        assert theirs.keys() <= ours.keys()
        assert {k: type(v) for k, v in theirs.items()} == {k: type(ours[k]) for k in theirs}
        assert {k: theirs[k] for k in ("owner", "host", "pid", "run_id", "kinds", "live")} == {
            k: ours[k] for k in ("owner", "host", "pid", "run_id", "kinds", "live")
        }


class TestTheJournalFollowed:
    """`events(since=...)`, as a follower of the journal (the service's event stream) reads it:
    what is new, built from the tasks that can have something new only."""

    async def history(self, conn: asyncpg.Connection, store: PostgresStore) -> None:
        """Retries, a failure, a skip, a retry of the run (journal rows), a task never run."""
        more = [Task("work", 3, id="flaky"), Task("work", 4, id="idle")]
        await admit(conn, "r", [*simple_tasks(), *more], admission=admission())
        await close_input(conn, "r")
        await run_one(conn, "ok")
        await run_one(conn, "d", ends="failed")
        await run_one(conn, "flaky", fails=2)
        assert store.retry("r", ["d"]) == ["d"]
        await run_one(conn, "d")
        await run_one(conn, "after")

    async def test_a_read_since_any_moment_is_the_journal_from_that_moment_on(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await self.history(conn, store)
        journal = store.events("r")
        assert {e["event"] for e in journal} >= {"attempt_failed", "retried", "skipped"}
        times = sorted({e["at"] for e in journal})
        # Between every two times of the journal (never on one: a float's rounding).
        cuts = [times[0] - 1, *((a + b) / 2 for a, b in itertools.pairwise(times)), times[-1] + 1]
        for cut in cuts:
            assert store.events("r", since=cut) == [e for e in journal if e["at"] >= cut]

    async def test_a_read_since_a_moment_ago_builds_no_journal_of_older_tasks(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        # 2,000 tasks that ended an hour ago: a follower's poll built their journal (three
        # events each), then kept none of it (3 to 4 s a poll at 1,000,000 tasks).
        await conn.execute(
            "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, priority, "
            "state, attempts, admitted, started, finished, output, agent) "
            "SELECT 'r', 'old' || g, g, g, true, 'work', 'null', 0, 'succeeded', 1, "
            "now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour', "
            "'null', 'work' FROM generate_series(1, 2000) AS g"
        )
        since = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        await admit(
            conn,
            "r",
            [Task("work", 1, id="new"), Task("work", 2, id="next")],
            admission=admission(),
        )
        await run_one(conn, "new")
        assert {(e["task_id"], e["event"]) for e in store.events("r", since=since)} == {
            ("new", "admitted"), ("new", "started"), ("new", "succeeded"), ("next", "admitted"),
        }  # fmt: skip
        [plan] = json.loads(
            await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {admin._JOURNAL}", "r", None, since
            )
        )
        [read] = [node for node in plan["Plan"]["Plans"] if node.get("Subplan Name") == "CTE t"]
        assert read["Actual Rows"] == 2  # the journal is built from these two tasks


class TestUnknownIds:
    async def test_an_unknown_run_is_refused_naming_the_runs_there(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await simple_pg(conn)
        for read in (
            lambda: store.events("nope"),
            lambda: store.dead_letters("nope"),
            lambda: store.retry("nope"),
        ):
            with pytest.raises(
                InputError, match=r"no run 'nope' in this database \(its runs: 'r'\)"
            ):
                read()

    async def test_an_unknown_task_is_refused(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await simple_pg(conn)
        with pytest.raises(InputError, match="run 'r' has no task 'nope'") as raised:
            store.events("r", "nope")
        assert raised.value.task_id == "nope"

    @pytest.mark.parametrize(
        ("task", "says"),
        [("ok", "task 'ok' of run 'r' is succeeded, not failed"), ("nope", "has no task 'nope'")],
    )
    async def test_retrying_a_task_that_is_not_a_failed_one_is_refused_and_changes_nothing(
        self, conn: asyncpg.Connection, store: PostgresStore, task: str, says: str
    ) -> None:
        await simple_pg(conn)
        before = await states(conn)
        with pytest.raises(InputError, match=says):
            store.retry("r", ["d", task])
        assert await states(conn) == before

    def test_one_string_for_the_ids_is_refused(self, store: PostgresStore) -> None:
        with pytest.raises(InputError, match="a collection of ids, not one string"):
            store.retry("r", "d")


# -- retry ---------------------------------------------------------------------------------------


def graph_tasks() -> list[Task]:
    """`d` and `x` fail; `after` waits for `d`, `both` for `d` and `x`; the group `g` has members
    `m1` and `m2` (which waits for `d`), `summary` waits for the group."""
    return [
        Task("work", 0, id="ok"),
        Task("work", "bad", id="d"),
        Task("work", "bad", id="x"),
        Task("work", 0, id="after", depends_on=["d"]),
        Task("work", 0, id="both", depends_on=["d", "x"]),
        Task("work", 0, id="m1", tags=["g"]),
        Task("work", 0, id="m2", tags=["g"], depends_on=["d"]),
        Task("work", 0, id="summary", depends_on_tags=["g"]),
    ]


async def graph_pg(conn: asyncpg.Connection) -> None:
    await admit(conn, "r", graph_tasks(), admission=admission())
    await close_input(conn, "r")
    await run_one(conn, "ok")
    await run_one(conn, "m1")
    await run_one(conn, "d", fails=1, ends="failed")
    await run_one(conn, "x", ends="failed")
    # Admitted once `d` had failed: skipped at once, with no edge from `d` to wake it.
    await admit(
        conn, "r", [Task("work", 0, id="late", depends_on=["d"])],
        admission=admission(), forward=False,
    )  # fmt: skip
    assert await states(conn) == {
        "ok": "succeeded", "d": "failed", "x": "failed", "after": "skipped", "both": "skipped",
        "m1": "succeeded", "m2": "skipped", "summary": "skipped", "late": "skipped",
    }  # fmt: skip
    await conn.execute("UPDATE orchestra.runs SET state = 'closed' WHERE id = 'r'")


async def group(conn: asyncpg.Connection, tag: str = "g") -> tuple[int, bool, str | None]:
    row = await conn.fetchrow(
        "SELECT open, closed, failed FROM orchestra.groups WHERE run_id = 'r' AND tag = $1", tag
    )
    assert row is not None
    return row["open"], row["closed"], row["failed"]


class TestRetry:
    async def test_a_failed_task_is_ready_and_its_skipped_dependents_wait_for_it(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await graph_pg(conn)
        assert await group(conn) == (0, True, "group 'g' member 'm2' skipped")
        assert store.retry("r", ["d"]) == ["d"]
        assert await states(conn) == {
            "ok": "succeeded", "d": "ready", "x": "failed", "after": "pending",
            "both": "skipped", "m1": "succeeded", "m2": "pending", "summary": "pending",
            "late": "pending",
        }  # fmt: skip
        rows = await conn.fetch("SELECT id, waiting FROM orchestra.tasks WHERE state = 'pending'")
        waiting = {row["id"]: row["waiting"] for row in rows}
        assert waiting == {"after": 1, "m2": 1, "summary": 1, "late": 1}
        assert await group(conn) == (1, False, None)  # m2 open again; nothing failed it now
        [run] = store.runs()
        assert run["state"] == "open"
        assert run["counts"] == {
            "succeeded": 2, "ready": 1, "failed": 1, "pending": 4, "skipped": 1
        }  # fmt: skip

    async def test_the_reopened_tasks_run_to_success_through_workers_alone(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await graph_pg(conn)
        store.retry("r", ["d"])
        await run_one(conn, "d")
        assert await ready(conn) == ["after", "late", "m2"]
        for task_id in ("after", "late", "m2"):
            await run_one(conn, task_id)
        assert await ready(conn) == ["summary"]  # the group closed with its last member
        await run_one(conn, "summary")
        assert await states(conn) == {
            "ok": "succeeded", "d": "succeeded", "x": "failed", "after": "succeeded",
            "both": "skipped", "m1": "succeeded", "m2": "succeeded", "summary": "succeeded",
            "late": "succeeded",
        }  # fmt: skip
        assert await group(conn) == (0, True, None)
        # Its attempts kept: two failed before the retry, the success the third.
        attempts = await conn.fetchval("SELECT attempts FROM orchestra.tasks WHERE id = 'd'")
        assert attempts == 3
        assert [e["event"] for e in store.events("r", "d")] == [
            "admitted", "attempt_failed", "started", "attempt_failed", "failed", "retried",
            "started", "succeeded",
        ]  # fmt: skip
        assert [e["event"] for e in store.events("r", "late")] == [
            "admitted", "skipped", "retried", "started", "succeeded",
        ]  # fmt: skip
        assert store.dead_letters("r")[0]["task_id"] == "x"

    async def test_every_failed_task_without_ids_and_what_only_they_doomed(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await graph_pg(conn)
        assert store.retry("r") == ["d", "x"]
        assert await ready(conn) == ["d", "x"]
        await run_one(conn, "x")
        await run_one(conn, "d")
        assert await ready(conn) == ["after", "both", "late", "m2"]
        assert store.retry("r") == []  # nothing failed any more
        assert store.dead_letters("r") == []

    async def test_a_task_doomed_by_another_failure_stays_skipped_until_that_one_is_retried(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await graph_pg(conn)
        store.retry("r", ["d"])
        await run_one(conn, "d")
        assert (await states(conn))["both"] == "skipped"
        store.retry("r", ["x"])
        assert (await states(conn))["both"] == "pending"
        await run_one(conn, "x")
        assert "both" in await ready(conn)

    async def test_a_reopened_task_fails_again_and_skips_its_dependents_again(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await graph_pg(conn)
        store.retry("r", ["d"])
        await run_one(conn, "d", ends="failed")
        found = await states(conn)
        assert {t: found[t] for t in ("d", "after", "m2", "summary", "late")} == {
            "d": "failed", "after": "skipped", "m2": "skipped", "summary": "skipped",
            "late": "skipped",
        }  # fmt: skip
        assert await group(conn) == (0, True, "group 'g' member 'm2' skipped")
        [letter] = [x for x in store.dead_letters("r") if x["task_id"] == "d"]
        assert [a["number"] for a in letter["attempts_list"]] == [1, 2, 3]

    async def test_a_worker_listening_on_the_run_is_woken(
        self, conn: asyncpg.Connection, store: PostgresStore, pg_dsn: str
    ) -> None:
        await graph_pg(conn)
        heard: list[tuple[str, str]] = []
        listener = await asyncpg.connect(pg_dsn)

        def hear(_: Any, pid: int, channel: str, payload: object) -> None:
            heard.append((channel, str(payload)))

        try:
            await listener.add_listener(channel_of("r"), hear)
            await listener.add_listener("orchestra", hear)
            store.retry("r", ["d"])
            await listener.execute("SELECT 1")  # notifications arrive before its answer
        finally:
            await listener.close()
        assert {channel for channel, _ in heard} == {channel_of("r"), "orchestra"}
        assert any('"work"' in payload for channel, payload in heard if channel == channel_of("r"))

    async def test_a_task_lost_too_often_gets_its_leases_budget_back(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await admit(conn, "r", [Task("work", 0, id="poison")], admission=admission())
        await conn.execute(
            "UPDATE orchestra.tasks SET state = 'failed', lost = 3, attempts = 3, "
            "finished = now(), error_type = 'LeaseExpired', error = 'lost' WHERE id = 'poison'"
        )
        assert store.retry("r") == ["poison"]
        row = await conn.fetchrow("SELECT state, lost, attempts FROM orchestra.tasks")
        assert row is not None
        assert tuple(row) == ("ready", 0, 3)

    async def test_a_group_named_after_a_retried_spawner_waits_for_it_again(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        # `p` fails: the group named after it (its spawns') had a member fail too, and its
        # waiter was skipped. Retrying both reopens the group until `p` ends again.
        await admit(
            conn, "r",
            [Task("work", "bad", id="p"), Task("work", "bad", id="c", tags=["p"]),
             Task("work", 0, id="w", depends_on_tags=["p"])],
            admission=admission(),
        )  # fmt: skip
        await close_input(conn, "r")
        await run_one(conn, "c", ends="failed")
        await run_one(conn, "p", ends="failed")
        assert await group(conn, "p") == (0, True, "group 'p' member 'c' failed")
        assert store.retry("r") == ["p", "c"]
        assert await group(conn, "p") == (1, False, None)
        await run_one(conn, "c")
        assert "w" not in await ready(conn)  # its group closes once `p` ended
        await run_one(conn, "p")
        assert await ready(conn) == ["w"]

    async def test_a_group_closed_by_its_retried_spawners_end_opens_for_its_spawns_again(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        # `p` failed, which closed the group named after it (its spawns'): nothing more could
        # come. Retried, `p` may spawn into it again, and `w` waits for what it spawns.
        await admit(
            conn, "r",
            [Task("work", "bad", id="p"),
             Task("work", 0, id="w", depends_on=["p"], depends_on_tags=["p"])],
            admission=admission(),
        )  # fmt: skip
        await close_input(conn, "r")
        await run_one(conn, "p", ends="failed")
        assert await group(conn, "p") == (0, True, None)
        store.retry("r")
        assert await group(conn, "p") == (0, False, None)
        [p] = await claim(conn, "r", {"work": 1}, owner=WORKER, lease=30)
        spawned = {"p": [Task("work", 0, id="c", tags=["p"])]}
        ended = End("p", p.token, "succeeded", output="0", agent="work")
        assert await complete(
            conn, "r", WORKER, [ended], spawned=spawned, admission=admission()
        ) == [True]  # fmt: skip
        assert await ready(conn) == ["c"]  # `w` waits for the group, open with `c`
        await run_one(conn, "c")
        assert await ready(conn) == ["w"]

    async def test_a_group_that_may_close_is_not_waited_for_as_at_admission(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        # `g`'s only member succeeded and the input is closed, but nobody waited for it: it
        # never closed. `w`, admitted then, waits only for `d` (failed), as admission counted.
        await admit(
            conn, "r", [Task("work", 0, id="m", tags=["g"]), Task("work", "bad", id="d")],
            admission=admission(),
        )  # fmt: skip
        await close_input(conn, "r")
        await run_one(conn, "m")
        await run_one(conn, "d", ends="failed")
        await admit(
            conn, "r", [Task("work", 0, id="w", depends_on=["d"], depends_on_tags=["g"])],
            admission=admission(), forward=False,
        )  # fmt: skip
        assert (await states(conn))["w"] == "skipped"
        assert await group(conn) == (0, False, None)
        store.retry("r")
        assert await conn.fetchval("SELECT waiting FROM orchestra.tasks WHERE id = 'w'") == 1
        await run_one(conn, "d")
        assert await ready(conn) == ["w"]


async def key_row(conn: asyncpg.Connection, key: str = "K") -> tuple[Any, ...]:
    row = await conn.fetchrow(
        "SELECT run_id, state, owner, output::text FROM orchestra.keys WHERE key = $1", key
    )
    assert row is not None
    return tuple(row)


class TestRetryOfKeyedTasks:
    """A reopened task with an idempotency key claims it again for its run, as its admission did:
    its end is the key's again; a key that succeeded in another run since ends it with that
    result; a key another run holds now keeps it back."""

    async def keyed_failure(self, conn: asyncpg.Connection) -> None:
        """Run ``r``: `k` (key ``K``) fails, `after` (waiting for it) is skipped."""
        tasks = [
            Task("work", "bad", id="k", key="K"),
            Task("work", 0, id="after", depends_on=["k"]),
        ]
        await admit(conn, "r", tasks, admission=admission())
        await keyed.admit_keys(conn, "r", [("K", "k")], owner="coordinator", lease=30)
        await run_one(conn, "k", ends="failed")
        assert (await key_row(conn))[:2] == ("r", "failed")

    async def other_run(self, conn: asyncpg.Connection, *, ends: str | None) -> None:
        """Run ``r2`` takes key ``K`` over for its task `k2`, which ends `ends` (None: runs on)."""
        assert await acquire(conn, "r2", owner="other", lease=30) is not None
        await admit(conn, "r2", [Task("work", 0, id="k2", key="K")], admission=admission())
        answers = await keyed.admit_keys(conn, "r2", [("K", "k2")], owner="other", lease=30)
        assert isinstance(answers["k2"], keys.Mine)
        if ends is not None:
            await run_one(conn, "k2", ends=ends, run_id="r2")

    async def test_the_key_is_the_runs_again_and_the_retried_success_is_written_to_it(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await self.keyed_failure(conn)
        store.retry("r")
        assert await key_row(conn) == ("r", "claimed", "coordinator", None)
        await run_one(conn, "k")
        assert await key_row(conn) == ("r", "succeeded", "coordinator", '{"id": "k"}')
        assert await ready(conn) == ["after"]

    async def test_a_key_that_succeeded_in_another_run_since_ends_the_task_with_its_result(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await self.keyed_failure(conn)
        await self.other_run(conn, ends="succeeded")
        store.retry("r")
        row = await conn.fetchrow("SELECT state, output::text FROM orchestra.tasks WHERE id = 'k'")
        assert row is not None
        assert tuple(row) == ("succeeded", '{"id": "k2"}')  # unexecuted: the key's result
        assert await ready(conn) == ["after"]

    async def test_a_key_another_run_holds_keeps_the_task_back(
        self, conn: asyncpg.Connection, store: PostgresStore
    ) -> None:
        await self.keyed_failure(conn)
        await self.other_run(conn, ends=None)
        store.retry("r")
        row = await conn.fetchrow("SELECT state, waiting FROM orchestra.tasks WHERE id = 'k'")
        assert row is not None
        assert tuple(row) == ("pending", 1)  # no worker claims it
        assert await ready(conn) == []
        assert await keyed.held_back(conn, "r") == [("K", "k")]


class TestRetryBesideACompletion:
    async def test_a_dependency_that_ends_while_the_retry_waits_is_seen_done(
        self, conn: asyncpg.Connection, store: PostgresStore, pg_dsn: str
    ) -> None:
        # `x` waits for `a` (failed: retried) and `b` (running). `b`'s completion holds its row
        # while the retry starts: the retry waits for it, then counts `b` done. Had it counted
        # `b` as running, `b`'s settling (which saw `x` skipped) would never free it.
        await admit(
            conn, "r",
            [Task("work", "bad", id="a"), Task("work", 0, id="b"),
             Task("work", 0, id="x", depends_on=["a", "b"])],
            admission=admission(),
        )  # fmt: skip
        claimed = {c.id: c for c in await claim(conn, "r", {"work": 2}, owner=WORKER, lease=30)}
        b = claimed["b"]
        await release(conn, WORKER, [("r", "a", claimed["a"].token)])
        await run_one(conn, "a", ends="failed")
        assert (await states(conn))["x"] == "skipped"
        completing = await asyncpg.connect(pg_dsn)
        try:
            transaction = completing.transaction()
            await transaction.start()
            ended = End("b", b.token, "succeeded", output="0", agent="work")
            assert await complete(completing, "r", WORKER, [ended]) == [True]
            retrying = asyncio.ensure_future(asyncio.to_thread(store.retry, "r"))
            while not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ):
                assert not retrying.done(), retrying
                await asyncio.sleep(0.01)
            await transaction.commit()
            assert await retrying == ["a"]
        finally:
            await completing.close()
        assert await conn.fetchval("SELECT waiting FROM orchestra.tasks WHERE id = 'x'") == 1
        await run_one(conn, "a")
        assert await ready(conn) == ["x"]


# -- the model: a repaired run ends as if the retried tasks had never failed ---------------------

TAGS = ("g1", "g2", "t0")  # (`t0` names a group its task owns: it closes once `t0` ended)


@st.composite
def histories(draw: st.DrawFn) -> dict[str, Any]:
    """A DAG with groups admitted whole, a streamed batch (waiters only: a member of a group that
    closed is refused) admitted after some steps, the tasks whose first attempt fails for good,
    and which of them are retried (None: all)."""
    specs: list[dict[str, Any]] = []
    n = draw(st.integers(1, 7))
    for i in range(n + draw(st.integers(0, 3))):
        first = i < n
        before = [s["id"] for s in specs]
        specs.append({
            "id": f"t{i}",
            "first": first,
            "depends_on": draw(st.lists(st.sampled_from(before), unique=True, max_size=2))
            if before else [],
            "tags": draw(st.lists(st.sampled_from(TAGS), unique=True, max_size=1)) if first else [],
            "depends_on_tags": draw(st.lists(st.sampled_from(TAGS), unique=True, max_size=1)),
        })  # fmt: skip
    ids = [s["id"] for s in specs]
    bad = draw(st.lists(st.sampled_from(ids), unique=True))
    some = st.lists(st.sampled_from(bad), unique=True) if bad else st.just([])
    retried = draw(st.one_of(st.none(), some))
    return {"specs": specs, "bad": bad, "retried": retried, "stream_at": draw(st.integers(0, 8))}


def model_tasks(specs: Sequence[dict[str, Any]]) -> list[Task]:
    return [
        Task("work", 0, id=s["id"], depends_on=s["depends_on"], tags=s["tags"],
             depends_on_tags=s["depends_on_tags"])
        for s in specs
    ]  # fmt: skip


@pytest.fixture
def model_dsn(pg: PgDatabases) -> Iterator[str]:
    """A database with orchestra's schema for every example of a model test (a run each)."""
    dsn = asyncio.run(pg.create())
    yield dsn
    asyncio.run(pg.drop(dsn))


class TestARepairedRun:
    """Hypothesis draws DAGs with groups, a streamed batch, tasks that fail, and the failed ones
    retried (all, or some). A run played to its end, retried, and played again by workers alone
    ends in the states (and group counts) of a run in which only the tasks not retried failed."""

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(history=histories())
    def test_ends_as_if_the_retried_tasks_had_never_failed(
        self, model_dsn: str, history: dict[str, Any]
    ) -> None:
        asyncio.run(self._check(model_dsn, history))

    async def _check(self, dsn: str, history: dict[str, Any]) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            n = await conn.fetchval("SELECT count(*) FROM orchestra.runs")
            repaired, reference = f"a{n}", f"b{n}"
            bad = set(history["bad"])
            await self._play(conn, repaired, history, failing=bad)
            failed = {t for t, state in (await states(conn, repaired)).items() if state == FAILED}
            # (a task drawn to fail that never ran, skipped, is not a failed one to name)
            named = None if history["retried"] is None else [
                t for t in history["retried"] if t in failed
            ]  # fmt: skip
            reopened = await admin.retry(conn, repaired, named, owner="admin", lease=30)
            assert set(reopened) == (failed if named is None else set(named))
            # What never ran before fails at its first attempt, as it would have.
            await self._play(conn, repaired, history, failing=bad - failed, admitted=True)
            await self._play(conn, reference, history, failing=bad - set(reopened))
            assert await states(conn, repaired) == await states(conn, reference)
            assert await self._groups(conn, repaired) == await self._groups(conn, reference)
        finally:
            await conn.close()

    async def _play(
        self,
        conn: asyncpg.Connection,
        run: str,
        history: dict[str, Any],
        *,
        failing: set[str],
        admitted: bool = False,
    ) -> None:
        """Admit the run (unless `admitted`) and claim its ready tasks one by one until none is,
        failing those of `failing`; the streamed batch goes in after `stream_at` steps."""
        first = [s for s in history["specs"] if s["first"]]
        streamed = [s for s in history["specs"] if not s["first"]]
        if not admitted:
            await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1)", run)
            try:
                await admit(conn, run, model_tasks(first), admission=admission())
            except InputError:  # a cycle through a group: nothing to play
                reject()
            await close_input(conn, run)
        step = 0
        while True:
            if not admitted and streamed and step == history["stream_at"]:
                with contextlib.suppress(InputError):  # refused in both runs alike
                    await admit(
                        conn, run, model_tasks(streamed), admission=admission(), forward=False
                    )
                streamed = []
            claimed = await claim(conn, run, {"work": 1}, owner=WORKER, lease=30)
            if not claimed:
                if streamed and not admitted:
                    step = history["stream_at"]
                    continue
                return
            [task] = claimed
            state = "failed" if task.id in failing else "succeeded"
            await complete(conn, run, WORKER, [End(task.id, task.token, state, "0")])
            step += 1

    async def _groups(self, conn: asyncpg.Connection, run: str) -> dict[str, Any]:
        """Each group's members, open ones, and whether it failed. (Not whether it closed: a
        group closes when an end concerns it and somebody waits for it, and one run's waiter may
        come after the last end, the other's before; with the input closed and nothing open, its
        waiters are freed or skipped alike.)"""
        rows = await conn.fetch(
            "SELECT tag, members, open, failed IS NOT NULL FROM orchestra.groups WHERE run_id = $1",
            run,
        )
        return {row[0]: tuple(row[1:]) for row in rows}


class TestARetriedRunResumed:
    """The orchestrator's own run on PostgreSQL: a task fails for good and skips what waits for
    it; `retry` reopens them in the database; the run's next coordinator (the same
    ``orch.run(..., run_id=...)``) runs them, and nothing that succeeded runs again."""

    @pytest.mark.parametrize("key", [None, "K"], ids=["no key", "keyed"])
    async def test_the_next_run_of_its_id_runs_the_reopened_tasks_with_their_attempts_kept(
        self, pg_dsn: str, key: str | None
    ) -> None:
        healed = False
        calls: list[str] = []

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            calls.append(task.id)
            if task.payload == "bad" and not healed:
                raise PermanentError("refused")
            return {"id": task.id}

        async def run() -> RunResult:
            store = PostgresStore(pg_dsn, poll=0.2)
            try:
                tasks = simple_tasks()
                tasks[1] = Task("work", "bad", id="d", key=key)
                return await Orchestrator(agents=[work], store=store).run(tasks, run_id="r")
            finally:
                store.close()

        first = await run()
        assert first.metadata.counts["failed"] == 1
        store = PostgresStore(pg_dsn)
        try:
            assert store.retry("r") == ["d"]
            healed = True
            calls.clear()
            again = await run()
            assert again.status == "success", again.errors
            assert sorted(calls) == ["after", "d"]  # `ok` is not executed again
            assert again.data == {"ok": {"id": "ok"}, "d": {"id": "d"}, "after": {"id": "after"}}
            trace = [e["event"] for e in store.events("r", "d")]
            assert trace[:5] == ["admitted", "started", "attempt_failed", "failed", "retried"]
            assert trace[-1] == "succeeded"
            assert store.events("r", "d")[-1]["attempt"] == 2  # the first attempt is counted
            assert store.dead_letters("r") == []
            assert store.retry("r") == []
        finally:
            store.close()
        if key is not None:  # the key says the retried success, for the next run that has it
            conn = await asyncpg.connect(pg_dsn)
            try:
                assert (await key_row(conn))[:2] == ("r", "succeeded")
            finally:
                await conn.close()
