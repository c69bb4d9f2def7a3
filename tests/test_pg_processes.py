"""Live processes and the sweep (`orchestra.stores._postgres._processes`), on the session's real
server: processes register, beat and stop; a sweep takes back expired task leases (the attempt
counted as ``LeaseExpired``, a task lost too often failed) and marks gone the processes that stopped
beating; one sweep at a time, and each expired lease taken back once however many sweep at once.

Leases and beats are made to run out by moving their expiry into the past on the server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import anyio
import asyncpg
import pytest

from orchestra.stores._postgres._leases import MAX_LOST, claim
from orchestra.stores._postgres._listen import Listener, channel_of
from orchestra.stores._postgres._processes import (
    _SWEEP_LOCK,
    Presence,
    Swept,
    beat,
    deregister,
    live,
    register,
    sweep,
)
from tests.helpers import REPO, spawn
from tests.test_pg_leases import admit, expire

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
def conn(pg_conn: asyncpg.Connection) -> asyncpg.Connection:
    return pg_conn


async def stop_beating(conn: asyncpg.Connection, owner: str) -> None:
    """`owner`'s beat runs out (its expiry a second ago, on the server's clock)."""
    await conn.execute(
        "UPDATE orchestra.workers SET expires = now() - interval '1 second' WHERE owner = $1",
        owner,
    )


async def worker(conn: asyncpg.Connection, owner: str) -> asyncpg.Record:
    found = await conn.fetchrow("SELECT * FROM orchestra.workers WHERE owner = $1", owner)
    assert found is not None
    return found


class TestLiveProcesses:
    async def test_a_registered_process_is_live_with_what_it_serves(
        self, conn: asyncpg.Connection
    ) -> None:
        await register(conn, "w1", host="box", pid=41, lease=30, kinds=["a", "b"], run_id="r")
        await register(conn, "w2", host="box", pid=42, lease=30)
        row = await worker(conn, "w1")
        assert (row["host"], row["pid"], row["kinds"], row["run_id"]) == (
            "box",
            41,
            ["a", "b"],
            "r",
        )
        assert row["gone"] is None
        assert await live(conn) == ["w1", "w2"]
        assert await live(conn, "r") == ["w1", "w2"]  # w2 serves any run
        assert await live(conn, "other") == ["w2"]

    async def test_a_beat_pushes_its_expiry_on_and_adds_to_its_counters(
        self, conn: asyncpg.Connection
    ) -> None:
        await register(conn, "w1", host="box", pid=41, lease=1)
        before = await worker(conn, "w1")
        assert await beat(conn, "w1", lease=30, claimed=5, completed=4, refused=1)
        assert await beat(conn, "w1", lease=30, completed=1)
        after = await worker(conn, "w1")
        assert after["expires"] > before["expires"]
        assert (after["claimed"], after["completed"], after["refused"]) == (5, 5, 1)

    async def test_a_process_that_stops_is_gone_and_its_row_kept(
        self, conn: asyncpg.Connection
    ) -> None:
        await register(conn, "w1", host="box", pid=41, lease=30)
        await beat(conn, "w1", lease=30, completed=3)
        await deregister(conn, "w1")
        assert await live(conn) == []
        row = await worker(conn, "w1")
        assert row["gone"] is not None
        assert row["completed"] == 3
        assert not await beat(conn, "w1", lease=30)

    async def test_a_name_registered_again_starts_over(self, conn: asyncpg.Connection) -> None:
        await register(conn, "w1", host="box", pid=41, lease=30)
        await beat(conn, "w1", lease=30, claimed=2)
        await deregister(conn, "w1")
        await register(conn, "w1", host="other", pid=7, lease=30)
        row = await worker(conn, "w1")
        assert (row["host"], row["pid"], row["claimed"], row["gone"]) == ("other", 7, 0, None)
        assert await live(conn) == ["w1"]

    async def test_a_process_whose_beat_expired_is_not_live(self, conn: asyncpg.Connection) -> None:
        await register(conn, "w1", host="box", pid=41, lease=30)
        await stop_beating(conn, "w1")
        assert await live(conn) == []


class TestSweep:
    async def test_takes_back_expired_leases_counting_the_attempt(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0), ("t2", "a", 0), ("t3", "a", 0)])
        await claim(conn, "r", {"a": 3}, owner="w1", lease=30)
        await expire(conn, "t1", "t2")
        swept = await sweep(conn)
        assert swept is not None
        assert sorted(task.id for task in swept.taken_back) == ["t1", "t2"]
        rows = await conn.fetch("SELECT id, state FROM orchestra.tasks")
        states = {row["id"]: row["state"] for row in rows}
        assert states == {"t1": "ready", "t2": "ready", "t3": "claimed"}
        recorded = await conn.fetch(
            "SELECT task_id, number, agent, error_type FROM orchestra.attempts ORDER BY task_id"
        )
        assert [tuple(row) for row in recorded] == [
            ("t1", 1, "w1", "LeaseExpired"),
            ("t2", 1, "w1", "LeaseExpired"),
        ]

    async def test_a_task_lost_too_often_goes_to_the_dead_letters(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [("poison", "a", 0)])
        for time in range(MAX_LOST):
            assert await claim(conn, "r", {"a": 1}, owner=f"w{time}", lease=30)
            await expire(conn, "poison")
            swept = await sweep(conn)
            assert swept is not None
            assert [task.failed for task in swept.taken_back] == [time == MAX_LOST - 1]
        dead = await conn.fetch("SELECT task_id, error_type FROM orchestra.dead_letters")
        assert [tuple(row) for row in dead] == [("poison", "LeaseExpired")]

    async def test_marks_gone_the_processes_that_stopped_beating_only(
        self, conn: asyncpg.Connection
    ) -> None:
        await register(conn, "alive", host="box", pid=1, lease=30)
        await register(conn, "dead", host="box", pid=2, lease=30)
        await stop_beating(conn, "dead")
        swept = await sweep(conn)
        assert swept == Swept([], ["dead"])
        assert (await worker(conn, "dead"))["gone"] is not None
        assert (await worker(conn, "alive"))["gone"] is None
        assert not await beat(conn, "dead", lease=30)  # told it was given up on
        assert await sweep(conn) == Swept([], [])

    async def test_wakes_the_runs_whose_tasks_are_ready_again(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0)])
        await claim(conn, "r", {"a": 1}, owner="w1", lease=30)
        await expire(conn, "t1")
        heard: list[tuple[str, str]] = []
        async with Listener(pg_dsn, [channel_of("r")], on_notify=lambda *item: heard.append(item)):
            assert await sweep(conn) is not None
            with anyio.fail_after(10):
                while not heard:
                    await anyio.sleep(0.01)
        assert heard == [("orchestra:r", "ready")]

    async def test_returns_at_once_while_another_process_sweeps(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        await admit(conn, "r", [("t1", "a", 0)])
        await claim(conn, "r", {"a": 1}, owner="w1", lease=30)
        await expire(conn, "t1")
        sweeping = await asyncpg.connect(pg_dsn)
        try:
            async with sweeping.transaction():  # another sweep, holding the lock
                await sweeping.fetchval("SELECT pg_try_advisory_xact_lock($1)", _SWEEP_LOCK)
                assert await sweep(conn) is None
            assert (await conn.fetchval("SELECT state FROM orchestra.tasks")) == "claimed"
        finally:
            await sweeping.close()
        swept = await sweep(conn)
        assert swept is not None
        assert [task.id for task in swept.taken_back] == ["t1"]

    async def test_sweepers_at_once_take_back_each_lease_once(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        ids = [f"t{i}" for i in range(300)]
        await admit(conn, "r", [(task_id, "a", 0) for task_id in ids])
        await claim(conn, "r", {"a": len(ids)}, owner="w1", lease=30)
        await expire(conn, *ids)
        sweepers = [await asyncpg.connect(pg_dsn) for _ in range(4)]
        taken: list[str] = []
        skipped = 0

        async def keep_sweeping(own: asyncpg.Connection) -> None:
            nonlocal skipped
            while True:
                swept = await sweep(own, limit=7)
                if swept is None:
                    skipped += 1
                    await asyncio.sleep(0)
                    continue
                if not swept.taken_back:
                    return
                taken.extend(task.id for task in swept.taken_back)

        try:
            async with anyio.create_task_group() as group:
                for own in sweepers:
                    group.start_soon(keep_sweeping, own)
        finally:
            for own in sweepers:
                await own.close()
        assert sorted(taken) == sorted(ids)  # each once, none twice
        counts = await conn.fetchrow(
            "SELECT count(*) AS attempts, count(DISTINCT task_id) AS tasks "
            "FROM orchestra.attempts WHERE error_type = 'LeaseExpired'"
        )
        assert counts is not None
        assert (counts["attempts"], counts["tasks"]) == (300, 300)
        assert await conn.fetchval("SELECT max(lost) FROM orchestra.tasks") == 1
        assert await conn.fetchval(
            "SELECT count(*) FROM orchestra.tasks WHERE state = 'ready'"
        ) == len(ids)


class TestPresence:
    async def test_keeps_a_process_live_carries_its_counters_and_says_when_it_stops(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        async with Presence(pg_dsn, "w1", host="box", pid=1, lease=0.6, kinds=["a"]) as presence:
            presence.claimed += 3
            presence.completed += 2
            await anyio.sleep(1.5)  # two and a half beats' leases
            assert await live(conn) == ["w1"]
            row = await worker(conn, "w1")
            assert (row["kinds"], row["claimed"], row["completed"]) == (["a"], 3, 2)
            assert (presence.claimed, presence.completed) == (0, 0)
        assert await live(conn) == []
        assert (await worker(conn, "w1"))["gone"] is not None

    async def test_a_process_given_up_on_is_told_and_registers_again(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        async with Presence(pg_dsn, "w1", host="box", pid=1, lease=0.6) as presence:
            # As a sweep does once its beat expired (a process paused past it, say).
            await conn.execute("UPDATE orchestra.workers SET gone = now() WHERE owner = 'w1'")
            assert await live(conn) == []
            with anyio.fail_after(10):
                await presence.given_up.wait()
            assert await live(conn) == ["w1"]


class TestAWorkerProcessKilled:
    async def test_its_leases_are_taken_back_by_a_live_process_and_it_is_marked_gone(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        await admit(conn, "r", [(f"t{i}", "a", 0) for i in range(5)])
        child = spawn(
            [sys.executable, str(REPO / "tests" / "pg_worker_job.py"), pg_dsn, "doomed", "1.0"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.stdout is not None
        with anyio.fail_after(30):
            line = await anyio.to_thread.run_sync(child.stdout.readline, abandon_on_cancel=True)
        assert line.strip() == "claimed 5"
        assert await live(conn) == ["doomed"]
        child.send_signal(signal.SIGKILL)
        child.wait()
        swept: list[Swept] = []
        async with Presence(
            pg_dsn, "survivor", host="box", pid=os.getpid(), lease=0.6, on_swept=swept.append
        ):
            with anyio.fail_after(10):
                while not (
                    sum(len(each.taken_back) for each in swept) == 5
                    and any(each.gone for each in swept)
                ):
                    await anyio.sleep(0.05)
            assert await live(conn) == ["survivor"]
        assert sorted(task.id for each in swept for task in each.taken_back) == [
            f"t{i}" for i in range(5)
        ]
        assert [owner for each in swept for owner in each.gone] == ["doomed"]
        assert {task.owner for each in swept for task in each.taken_back} == {"doomed"}
        ready = await conn.fetchval("SELECT count(*) FROM orchestra.tasks WHERE state = 'ready'")
        assert ready == 5
        assert (await worker(conn, "survivor"))["gone"] is not None  # it said it stopped
