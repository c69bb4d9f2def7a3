"""Leases on PostgreSQL (`orchestra.stores._postgres._leases`), on the session's real server and real
connections: claims by kinds, rooms, priority and admission order; concurrent claimers never
sharing a task; heartbeats, completions and failures fenced by the lease token; expired leases
taken back once, poison tasks failed; hand-backs; every time on the database's clock.

Tasks are written straight into the tables (`admit`): the store that admits them is not here yet.
A lease is made to run out by moving its expiry into the past on the server, not by waiting."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

from orchestra import Task
from orchestra._admission import Admission
from orchestra.stores._postgres import _follow as follow
from orchestra.stores._postgres import _graph as graph
from orchestra.stores._postgres._leases import (
    _COMPLETE,
    MAX_LOST,
    End,
    NextClaim,
    claim,
    complete,
    complete_and_claim,
    connect,
    fail,
    heartbeat,
    release,
    take_back_expired,
)
from orchestra.stores._postgres._listen import ENDED, channel_of, notify
from orchestra.stores._postgres._settle import _WAITED_FOR

if TYPE_CHECKING:
    from collections.abc import Sequence

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
def conn(pg_conn: asyncpg.Connection) -> asyncpg.Connection:
    return pg_conn


async def admit(
    conn: asyncpg.Connection,
    run_id: str,
    tasks: Sequence[tuple[str, str, int]],
    *,
    state: str = "ready",
    **columns: Sequence[Any],
) -> None:
    """Write tasks (id, kind, priority) of `run_id` in this order, ready; `columns`: more columns,
    a value per task (``depends_on=[...]``)."""
    await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1) ON CONFLICT DO NOTHING", run_id)
    first = await conn.fetchval(
        "SELECT coalesce(max(seq), 0) + 1 FROM orchestra.tasks WHERE run_id = $1", run_id
    )
    names = ", ".join(columns)
    values = ", ".join(f"${i}" for i in range(7, 7 + len(columns)))
    for offset, (task_id, kind, priority) in enumerate(tasks):
        extra = [column[offset] for column in columns.values()]
        await conn.execute(
            "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, priority, "
            f"state{', ' + names if names else ''}) VALUES ($1, $2, $3::bigint, $3::integer, true, $4, '0', $5, "
            f"$6{', ' + values if values else ''})",
            run_id, task_id, first + offset, kind, priority, state, *extra,
        )  # fmt: skip


async def expire(conn: asyncpg.Connection, *task_ids: str) -> None:
    """The leases of these tasks run out (their expiry a second ago, on the server's clock)."""
    await conn.execute(
        "UPDATE orchestra.tasks SET lease_expires = now() - interval '1 second' "
        "WHERE id = ANY ($1)",
        list(task_ids),
    )


async def row(conn: asyncpg.Connection, task_id: str) -> asyncpg.Record:
    found = await conn.fetchrow("SELECT * FROM orchestra.tasks WHERE id = $1", task_id)
    assert found is not None
    return found


class TestClaimOrder:
    async def test_the_kinds_asked_for_by_priority_then_admission_order(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [("a1", "a", 5), ("b1", "b", 1), ("c1", "c", 0), ("a2", "a", 1), ("b2", "b", 5),
             ("a3", "a", 1)],
        )  # fmt: skip
        claimed = await claim(conn, "r", {"a": 10, "b": 10}, owner="w", lease=30)
        assert [task.id for task in claimed] == ["b1", "a2", "a3", "a1", "b2"]

    async def test_each_kind_at_most_its_room_and_the_limit_in_all(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [(f"a{i}", "a", 0) for i in range(5)])
        await admit(conn, "r", [(f"b{i}", "b", 1) for i in range(5)])
        first = await claim(conn, "r", {"a": 2, "b": 5}, owner="w", lease=30, limit=4)
        assert [task.id for task in first] == ["a0", "a1", "b0", "b1"]
        rest = await claim(conn, "r", {"a": 0, "b": 1}, owner="w", lease=30)
        assert [task.id for task in rest] == ["b2"]

    async def test_only_ready_tasks_of_the_run(self, conn: asyncpg.Connection) -> None:
        await admit(conn, "r", [("pending", "a", 0)], state="pending")
        await admit(conn, "r", [("waiting", "a", 0)], state="retry_wait")
        await admit(conn, "other", [("elsewhere", "a", 0)])
        await admit(conn, "r", [("ready", "a", 9)])
        claimed = await claim(conn, "r", {"a": 10}, owner="w", lease=30)
        assert [task.id for task in claimed] == ["ready"]
        assert await claim(conn, "r", {"a": 10}, owner="w", lease=30) == []

    async def test_each_claim_a_fresh_lease_and_its_attempt_counted(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0), ("t2", "a", 0)])
        (one,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=30)
        (two,) = await claim(conn, "r", {"a": 1}, owner="w2", lease=30)
        assert two.token > one.token > 0
        assert one.attempts == two.attempts == 1
        assert (await row(conn, "t1"))["lease_owner"] == "w1"
        assert (await row(conn, "t2"))["state"] == "claimed"

    async def test_a_claim_brings_its_dependencies_outputs(self, conn: asyncpg.Connection) -> None:
        await admit(
            conn, "r", [("d1", "a", 0), ("m1", "a", 0), ("m2", "a", 0)], state="succeeded",
            output=['"one"', "1", "2"], tags=[None, ["g"], ["g"]],
        )  # fmt: skip
        await admit(
            conn, "r", [("w", "sum", 0), ("plain", "sum", 0)],
            depends_on=[["d1"], None], depends_on_tags=[["g"], None],
        )  # fmt: skip
        claimed = {
            task.id: task for task in await claim(conn, "r", {"sum": 5}, owner="w", lease=30)
        }
        assert claimed["w"].deps == {"d1": '"one"', "m1": "1", "m2": "2"}
        assert claimed["plain"].deps == {}


class TestConcurrentClaimers:
    async def test_never_get_the_same_task(self, pg_dsn: str, conn: asyncpg.Connection) -> None:
        ids = [f"t{i}" for i in range(2000)]
        await admit(
            conn, "r", [(task_id, "a" if i % 3 else "b", i % 4) for i, task_id in enumerate(ids)]
        )

        async def claimer(worker: asyncpg.Connection, name: str) -> list[str]:
            mine: list[str] = []
            while batch := await claim(worker, "r", {"a": 20, "b": 7}, owner=name, lease=30):
                mine += [task.id for task in batch]
                ends = [End(task.id, task.token, "succeeded", "null") for task in batch]
                assert all(await complete(worker, "r", name, ends))
            return mine

        workers = [await asyncpg.connect(pg_dsn) for _ in range(8)]  # all connected, then go
        try:
            got = await asyncio.gather(*(claimer(w, f"w{i}") for i, w in enumerate(workers)))
        finally:
            for worker in workers:
                await worker.close()
        every = [task_id for mine in got for task_id in mine]
        assert sorted(every) == sorted(ids)  # each once: none twice, none left
        assert sum(1 for mine in got if mine) > 1  # they did claim side by side
        states = await conn.fetch("SELECT DISTINCT state FROM orchestra.tasks")
        assert [state[0] for state in states] == ["succeeded"]


class TestHeartbeat:
    async def test_extends_only_the_leases_whose_token_matches(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("kept", "a", 0), ("lost", "a", 1)])
        kept, lost = await claim(conn, "r", {"a": 2}, owner="w1", lease=5)
        await expire(conn, "lost")
        await take_back_expired(conn, "r")
        (again,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=5)  # re-leased to w1 itself
        assert again.id == "lost"
        before = (await row(conn, "lost"))["lease_expires"]

        gone = await heartbeat(
            conn, "w1", [("r", "kept", kept.token), ("r", "lost", lost.token)], lease=60
        )
        assert gone == {("r", "lost")}
        assert (await row(conn, "lost"))["lease_expires"] == before
        left = await conn.fetchval(
            "SELECT lease_expires - now() FROM orchestra.tasks WHERE id = 'kept'"
        )
        assert 55 < left.total_seconds() <= 60

    async def test_another_owner_cannot_extend_a_lease(self, conn: asyncpg.Connection) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (task,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=5)
        assert await heartbeat(conn, "w2", [("r", "t", task.token)], lease=60) == {("r", "t")}


class TestFencing:
    async def test_a_stale_tokens_completion_is_refused_and_journaled(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (old,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=5)
        await expire(conn, "t")
        await take_back_expired(conn, "r")
        (new,) = await claim(conn, "r", {"a": 1}, owner="w2", lease=5)

        late = End("t", old.token, "succeeded", '"late"', agent="a1")
        assert await complete(conn, "r", "w1", [late]) == [False]
        task = await row(conn, "t")
        assert (task["state"], task["lease_owner"], task["output"]) == ("claimed", "w2", None)
        refused = await conn.fetch(
            "SELECT agent, detail FROM orchestra.events WHERE event = 'refused' AND task_id = 't'"
        )
        assert [tuple(event) for event in refused] == [
            ("a1", f"succeeded from w1 refused: its lease (token {old.token}) is no longer held")
        ]

        assert await complete(conn, "r", "w2", [End("t", new.token, "succeeded", '"on time"')]) == [
            True
        ]
        task = await row(conn, "t")
        assert (task["state"], task["output"], task["lease_owner"]) == (
            "succeeded", '"on time"', None,
        )  # fmt: skip

    async def test_the_same_token_for_another_owner_is_refused(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (task,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=5)
        assert await complete(conn, "r", "w2", [End("t", task.token, "succeeded")]) == [False]

    async def test_an_ended_task_refuses_a_second_completion(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0), ("u", "a", 0)])
        t, u = await claim(conn, "r", {"a": 2}, owner="w", lease=5)
        first = [End("t", t.token, "succeeded", "1"), End("u", u.token, "failed", error="boom")]
        assert await complete(conn, "r", "w", first) == [True, True]
        assert await complete(conn, "r", "w", [End("t", t.token, "succeeded", "2")]) == [False]
        assert (await row(conn, "t"))["output"] == "1"
        assert (await row(conn, "u"))["error"] == "boom"

    async def test_a_batch_writes_the_ends_it_holds_and_journals_only_the_refused_ones(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0), ("u", "a", 0), ("v", "a", 0)])
        await conn.execute("UPDATE orchestra.runs SET owner = 'coordinator' WHERE id = 'r'")
        t, u, v = await claim(conn, "r", {"a": 3}, owner="w1", lease=5)
        await expire(conn, "u")
        await take_back_expired(conn, "r")
        ends = [
            End("t", t.token, "succeeded", "1", agent="a1"),
            End("u", u.token, "failed", agent="a2", error="late"),
            End("v", v.token, "succeeded", "3", agent="a3"),
        ]
        assert await complete(conn, "r", "w1", ends) == [True, False, True]
        refused = await conn.fetch(
            "SELECT task_id, agent, detail FROM orchestra.events WHERE event = 'refused'"
        )
        assert [tuple(event) for event in refused] == [
            ("u", "a2", f"failed from w1 refused: its lease (token {u.token}) is no longer held")
        ]
        assert (await row(conn, "u"))["state"] == "ready"
        assert [row[0] for row in (await follow.heard(conn, "r")).ends] == ["t", "v"]

    async def test_a_stale_tokens_failure_is_refused(self, conn: asyncpg.Connection) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (old,) = await claim(conn, "r", {"a": 1}, owner="w1", lease=5)
        await expire(conn, "t")
        await take_back_expired(conn, "r")
        (new,) = await claim(conn, "r", {"a": 1}, owner="w2", lease=5)

        refused = await fail(
            conn, "r", "t", old.token, owner="w1", agent="a1", error_type="ValueError",
            message="late", retry_in=10,
        )  # fmt: skip
        assert not refused
        task = await row(conn, "t")
        assert (task["state"], task["lease_owner"], task["token"]) == ("claimed", "w2", new.token)
        errors = await conn.fetch("SELECT error_type FROM orchestra.attempts WHERE task_id = 't'")
        assert [e[0] for e in errors] == ["LeaseExpired"]  # the late failure is not recorded
        assert (
            await conn.fetchval("SELECT count(*) FROM orchestra.events WHERE event = 'refused'")
            == 1
        )


class TestCompleteAndClaim:
    async def test_the_ends_and_the_claim_of_the_room_they_give_back_commit_together(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [(f"t{i}", "a", 0) for i in range(1, 6)])
        t1, t2 = await claim(conn, "r", {"a": 2}, owner="w", lease=30)
        ends = [End("t1", t1.token, "succeeded", "1"), End("t2", t2.token + 1, "succeeded", "2")]
        written, claimed = await complete_and_claim(
            conn, "r", "w", ends, NextClaim({"a": 2}, None, 30)
        )
        assert written == [True, False]  # t2's end carried a token it was not given
        assert [task.id for task in claimed] == ["t3", "t4"]
        t3, t4 = claimed
        # One token for the claim, greater than any lease of these tasks had.
        assert t3.token == t4.token > t1.token
        rows = await conn.fetch(
            "SELECT id, xmin::text AS tx, state, lease_owner FROM orchestra.tasks "
            "WHERE id IN ('t1', 't3', 't4') ORDER BY id"
        )
        assert [(r["id"], r["state"], r["lease_owner"]) for r in rows] == [
            ("t1", "succeeded", None), ("t3", "claimed", "w"), ("t4", "claimed", "w"),
        ]  # fmt: skip
        assert len({r["tx"] for r in rows}) == 1  # one transaction wrote them

    async def test_what_the_ends_make_ready_is_claimed_with_them_its_dependencies_outputs_too(
        self, conn: asyncpg.Connection
    ) -> None:
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r')")
        tasks = [Task("a", 1, id="x"), Task("a", 2, id="y", depends_on=["x"])]
        await graph.admit(conn, "r", tasks, admission=Admission(["a"], {}))
        (x,) = await claim(conn, "r", {"a": 2}, owner="w", lease=30)
        written, claimed = await complete_and_claim(
            conn, "r", "w", [End("x", x.token, "succeeded", '"out"')], NextClaim({"a": 2}, 1, 30)
        )
        assert written == [True]
        assert [(task.id, task.deps) for task in claimed] == [("y", {"x": '"out"'})]


class TestTheCoordinatorHearsOfEnds:
    """A run's coordinator follows the ends other processes write (`orchestra.ended`); a NOTIFY
    on the run's channel tells it at their commit, even when they ready nothing."""

    async def heard(self, pg_dsn: str, conn: asyncpg.Connection, owner: str) -> list[str]:
        """The payloads on run r's channel from `owner`'s completion of two tasks, up to a
        sentinel sent after it commits (notifications arrive in commit order)."""
        payloads: list[str] = []
        sentinel = asyncio.Event()

        def heard(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
            if payload == "sentinel":
                sentinel.set()
            else:
                payloads.append(str(payload))

        listener = await asyncpg.connect(pg_dsn)
        try:
            await listener.add_listener(channel_of("r"), heard)
            claimed = await claim(conn, "r", {"a": 2}, owner=owner, lease=5)
            ends = [End(task.id, task.token, "succeeded") for task in claimed]
            assert await complete(conn, "r", owner, ends) == [True, True]
            await notify(conn, "r", "sentinel")
            await asyncio.wait_for(sentinel.wait(), 10)
        finally:
            await listener.close()
        return payloads

    async def test_another_processs_completion_notifies_the_runs_channel_once(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0), ("t2", "a", 0)])
        await conn.execute("UPDATE orchestra.runs SET owner = 'coordinator' WHERE id = 'r'")
        assert await self.heard(pg_dsn, conn, "worker") == [ENDED]

    async def test_a_completion_in_a_run_nobody_holds_notifies_nobody(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0), ("t2", "a", 0)])
        assert await self.heard(pg_dsn, conn, "worker") == []

    async def test_the_coordinators_own_completion_notifies_nobody(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0), ("t2", "a", 0)])
        await conn.execute("UPDATE orchestra.runs SET owner = 'coordinator' WHERE id = 'r'")
        assert await self.heard(pg_dsn, conn, "coordinator") == []

    async def test_a_completion_writes_one_row_of_the_feed_for_its_batch(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [(f"t{i}", "a", 0) for i in range(3)])
        await conn.execute("UPDATE orchestra.runs SET owner = 'coordinator' WHERE id = 'r'")
        claimed = await claim(conn, "r", {"a": 3}, owner="worker", lease=5)
        ends = [End(task.id, task.token, "succeeded") for task in claimed]
        assert await complete(conn, "r", "worker", ends) == [True, True, True]
        rows = await conn.fetch("SELECT ids, spawned FROM orchestra.ended")
        # (nothing spawned: the coordinator's read looks for no spawns of these)
        assert [(sorted(r["ids"]), r["spawned"]) for r in rows] == [(["t0", "t1", "t2"], False)]

    async def test_the_feed_is_vacuumed_by_the_reader_of_every_nth_row_each_end_heard_once(
        self, conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(follow, "SWEEP_EVERY", 2)
        await admit(conn, "r", [(f"t{i}", "a", 0) for i in range(6)])
        await conn.execute("UPDATE orchestra.runs SET owner = 'coordinator' WHERE id = 'r'")
        heard: list[str] = []
        vacuums: list[int] = []
        for _ in range(3):  # the feed's rows (one per completion) numbered 1, 2, 3
            claimed = await claim(conn, "r", {"a": 2}, owner="worker", lease=5)
            ends = [End(task.id, task.token, "succeeded") for task in claimed]
            assert await complete(conn, "r", "worker", ends) == [True, True]
            heard += [row[0] for row in (await follow.heard(conn, "r")).ends]
            vacuums.append(
                await conn.fetchval("SELECT pg_stat_get_vacuum_count('orchestra.ended'::regclass)")
            )
        assert heard == [f"t{i}" for i in range(6)]
        assert vacuums == [0, 1, 1]
        assert await conn.fetchval("SELECT count(*) FROM orchestra.ended") == 0


class TestFailure:
    async def test_a_retry_waits_until_its_due_time_on_the_database_clock(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (task,) = await claim(conn, "r", {"a": 1}, owner="w", lease=5)
        assert await fail(
            conn, "r", "t", task.token, owner="w", agent="a1", error_type="ConnectionError",
            message="dropped", duration=0.5, retry_in=30, next_agent="a2",
        )  # fmt: skip
        failed = await row(conn, "t")
        assert (failed["state"], failed["lease_owner"], failed["target"]) == (
            "retry_wait", None, "a2",
        )  # fmt: skip
        wait = await conn.fetchval("SELECT due - now() FROM orchestra.tasks WHERE id = 't'")
        assert 25 < wait.total_seconds() <= 30
        attempt = await conn.fetchrow("SELECT * FROM orchestra.attempts WHERE task_id = 't'")
        assert attempt is not None
        assert (attempt["number"], attempt["agent"], attempt["message"], attempt["retry_in"]) == (
            1, "a1", "dropped", 30.0,
        )  # fmt: skip
        assert await claim(conn, "r", {"a": 1}, owner="w", lease=5) == []

    async def test_a_retry_without_a_wait_is_claimable_again_with_the_attempt_counted(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        (first,) = await claim(conn, "r", {"a": 1}, owner="w", lease=5)
        assert await fail(
            conn, "r", "t", first.token, owner="w", agent="a1", error_type="E", message="m"
        )
        assert (await row(conn, "t"))["target"] is None  # kept: it had none
        (second,) = await claim(conn, "r", {"a": 1}, owner="w", lease=5)
        assert second.token > first.token
        assert second.attempts == 2

    async def test_a_retry_without_a_wait_goes_behind_the_tasks_ready_at_its_priority(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("first", "a", 0), ("second", "a", 0), ("later", "a", 1)])
        (task,) = await claim(conn, "r", {"a": 1}, owner="w", lease=5)
        assert task.id == "first"
        await fail(
            conn, "r", "first", task.token, owner="w", agent="a1", error_type="E", message="m"
        )
        claimed = await claim(conn, "r", {"a": 5}, owner="w", lease=5)
        assert [t.id for t in claimed] == ["second", "first", "later"]  # as the memory queue


class TestTakingBack:
    async def test_an_expired_lease_is_taken_back_once_by_processes_looking_at_once(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        ids = [f"t{i}" for i in range(40)]
        await admit(conn, "r", [(task_id, "a", 0) for task_id in ids])
        await claim(conn, "r", {"a": 40}, owner="dead", lease=5)
        await expire(conn, *ids)

        async def looker() -> list[str]:
            other = await asyncpg.connect(pg_dsn)
            try:
                taken: list[str] = []
                while batch := await take_back_expired(other, limit=3):
                    taken += [back.id for back in batch]
                return taken
            finally:
                await other.close()

        got = await asyncio.gather(*(looker() for _ in range(6)))
        assert sorted(task_id for taken in got for task_id in taken) == sorted(ids)
        counts = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE state = 'ready' AND lost = 1 AND attempts = 1 "
            "AND lease_owner IS NULL) AS ready, (SELECT count(*) FROM orchestra.attempts "
            "WHERE error_type = 'LeaseExpired' AND agent = 'dead') AS attempts, "
            "(SELECT count(*) FROM orchestra.events WHERE event = 'lease_expired') AS events "
            "FROM orchestra.tasks"
        )
        assert counts is not None
        assert tuple(counts) == (40, 40, 40)

    async def test_a_live_lease_is_not_taken_back(self, conn: asyncpg.Connection) -> None:
        await admit(conn, "r", [("t", "a", 0)])
        await claim(conn, "r", {"a": 1}, owner="w", lease=5)
        assert await take_back_expired(conn) == []
        assert (await row(conn, "t"))["lease_owner"] == "w"

    async def test_a_task_lost_too_often_fails_to_the_dead_letters(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("poison", "a", 0)])
        for lost in range(1, MAX_LOST + 1):
            (task,) = await claim(conn, "r", {"a": 1}, owner=f"w{lost}", lease=5)
            await expire(conn, "poison")
            (back,) = await take_back_expired(conn, "r")
            assert (back.owner, back.token, back.attempts) == (f"w{lost}", task.token, lost)
            assert back.failed == (lost == MAX_LOST)
        dead = await conn.fetchrow("SELECT * FROM orchestra.dead_letters")
        assert dead is not None
        assert (dead["task_id"], dead["attempts"], dead["error_type"]) == (
            "poison", MAX_LOST, "LeaseExpired",
        )  # fmt: skip
        assert f"expired {MAX_LOST} times" in dead["error"]
        assert await claim(conn, "r", {"a": 1}, owner="w", lease=5) == []


class TestRelease:
    async def test_a_handed_back_task_is_ready_at_once_its_attempt_not_counted(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t", "a", 0), ("u", "a", 0)])
        t, u = await claim(conn, "r", {"a": 2}, owner="w", lease=5)
        handed = await release(conn, "w", [("r", "t", t.token), ("r", "u", u.token + 1)])
        assert handed == {("r", "t")}  # u's token is not the one it holds
        task = await row(conn, "t")
        assert (task["state"], task["attempts"], task["lease_owner"]) == ("ready", 0, None)
        (again,) = await claim(conn, "r", {"a": 1}, owner="w2", lease=5)
        assert (again.id, again.attempts) == ("t", 1)


class TestClocks:
    @pytest.mark.parametrize("skew", [-3600.0, 3600.0], ids=["an hour behind", "an hour ahead"])
    async def test_a_claimers_clock_changes_no_lease(
        self, conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch, skew: float
    ) -> None:
        await admit(conn, "r", [("t", "a", 0), ("u", "a", 0)])
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + skew)
        monkeypatch.setattr(time, "time_ns", lambda: int((real() + skew) * 1e9))

        (task,) = await claim(conn, "r", {"a": 1}, owner="w", lease=30)
        left = await conn.fetchval(
            "SELECT lease_expires - now() FROM orchestra.tasks WHERE id = 't'"
        )
        assert 25 < left.total_seconds() <= 30
        assert await take_back_expired(conn) == []  # not expired, whatever this clock says
        await heartbeat(conn, "w", [("r", "t", task.token)], lease=60)
        left = await conn.fetchval(
            "SELECT lease_expires - now() FROM orchestra.tasks WHERE id = 't'"
        )
        assert 55 < left.total_seconds() <= 60
        await expire(conn, "t")
        assert [back.id for back in await take_back_expired(conn)] == ["t"]


class TestConnections:
    async def test_a_statement_is_planned_for_its_batch_but_those_with_one_plan_for_all(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        # asyncpg prepares each statement once; left to itself, PostgreSQL plans the sixth run
        # and later ones generically, for an array of 10 rows and whatever the statistics said.
        # The completion and its check of what the ends concern have a generic plan that serves
        # every batch (tests/test_pg_plans.py): they run under it once it costs no more.
        await admit(conn, "r", [(f"t{i}", "a", 0) for i in range(400)])
        await conn.execute("ANALYZE orchestra.tasks")  # while nothing is leased
        worker = await connect(pg_dsn)
        try:
            for _ in range(8):
                batch = await claim(worker, "r", {"a": 50}, owner="w", lease=30)
                held = [("r", task.id, task.token) for task in batch]
                assert await heartbeat(worker, "w", held, lease=30) == set()
                ends = [End(task.id, task.token, "succeeded", "null") for task in batch]
                assert all(await complete(worker, "r", "w", ends))
            rows = await worker.fetch(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%orchestra.%' "
                "AND statement NOT LIKE '%pg_prepared_statements%'"
            )
        finally:
            await worker.close()
        generic = {_COMPLETE.strip(), _WAITED_FOR.strip()}
        plans = {row[0].strip(): (row[1], row[2]) for row in rows}
        assert generic <= set(plans)
        assert all(plans[statement][0] > 0 for statement in generic)
        custom = [counts for statement, counts in plans.items() if statement not in generic]
        assert sum(generic for generic, _ in custom) == 0
        assert sum(custom for _, custom in custom) >= 2 * 8

    async def test_in_a_callers_transaction_the_plans_stay_the_sessions(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        # A completion and a read of the ends heard run under generic plans by SET LOCAL, which
        # lasts until the transaction ends: in a caller's, it would reach the caller's statements.
        await admit(conn, "r", [("t", "a", 0)])
        worker = await connect(pg_dsn)
        try:
            (task,) = await claim(worker, "r", {"a": 1}, owner="w", lease=30)
            async with worker.transaction():
                end = End(task.id, task.token, "succeeded", "null")
                assert await complete(worker, "r", "w", [end]) == [True]
                after_complete = await worker.fetchval("SHOW plan_cache_mode")
                assert [row[0] for row in (await follow.heard(worker, "r")).ends] == ["t"]
                after_heard = await worker.fetchval("SHOW plan_cache_mode")
        finally:
            await worker.close()
        assert (after_complete, after_heard) == ("force_custom_plan", "force_custom_plan")
