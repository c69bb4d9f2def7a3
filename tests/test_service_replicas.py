"""Replicas: several `orchestra serve --dsn` processes (real uvicorn processes) on one PostgreSQL
database (the session's real server, tests/pg.py) serve the same runs: the events of a run on any
of them, its control from any of them, and a replica killed (a real SIGKILL) mid-run loses
nothing: another takes its run over, runs what was left once, and answers its result. A SQLite
file is served by one process: a second `serve` on it is refused, saying why."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from orchestra._service._replicas import POLL
from orchestra._service._tokens import Tokens
from tests.helpers import spawn
from tests.service_kit import free_port, told_in_order

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from orchestra.stores._postgres._store import PostgresStore

pytestmark = [pytest.mark.subprocess]

REPO = Path(__file__).resolve().parent.parent
AGENTS = str(REPO / "tests" / "replica_agents.py") + ":build"
LEASE = 2.0  # the replicas' --lease: a killed one's runs are taken over this long after
TASKS = 2000


def _tasks(n: int = TASKS) -> list[dict[str, Any]]:
    return [{"kind": "work", "id": f"t{i}", "payload": i} for i in range(n)]


@dataclass
class Replica:
    """One `orchestra serve` process: its base URL and the process."""

    url: str
    process: subprocess.Popen[str]

    @property
    def prefix(self) -> str:
        """The beginning of the name its runs' leases carry (host:pid:)."""
        return f"{socket.gethostname()}:{self.process.pid}:"


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    from orchestra.stores._postgres._store import PostgresStore

    made = PostgresStore(pg_dsn, poll=0.2)
    try:
        yield made
    finally:
        await anyio.to_thread.run_sync(made.close)


@pytest.fixture
async def token(store: PostgresStore) -> str:
    text, _ = await anyio.to_thread.run_sync(Tokens(store).create, "admin", "test")
    return str(text)


@pytest.fixture
def executions(tmp_path: Path) -> Path:
    """The file the replicas' agents note each execution in (a task id a line)."""
    return tmp_path / "executions.txt"


@pytest.fixture
def start(pg_dsn: str, executions: Path) -> Callable[..., Any]:
    async def start_replica(delay: float = 0.02) -> Replica:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "REPLICA_EXECUTIONS": str(executions),
            "REPLICA_DELAY": str(delay),
        }
        process = spawn(
            [sys.executable, "-m", "orchestra", "serve", "--agents", AGENTS, "--dsn", pg_dsn,
             "--port", str(port), "--lease", str(LEASE), "--grace", "1"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        replica = Replica(f"http://127.0.0.1:{port}", process)
        async with httpx.AsyncClient(base_url=replica.url, timeout=5) as client:
            with anyio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/ready")).status_code == 200:
                            return replica
                    except httpx.TransportError:
                        pass
                    if process.poll() is not None:
                        raise AssertionError(process.communicate()[1])
                    await anyio.sleep(0.05)

    return start_replica


def _noted(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def _until(check: Callable[[], Any], within: float = 30.0, every: float = 0.02) -> Any:
    with anyio.fail_after(within):
        while not (found := await check()):
            await anyio.sleep(every)
        return found


async def _events(url: str, run_id: str, auth: dict[str, str]) -> list[dict[str, Any]]:
    """A run's events as an SSE client of `url` receives them, to the stream's end."""
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("GET", f"{url}/api/runs/{run_id}/events", headers=auth) as stream,
    ):
        assert stream.status_code == 200
        data = [json.loads(line[6:]) async for line in stream.aiter_lines()
                if line.startswith("data: ")]  # fmt: skip
    assert data[-1]["run_id"] == run_id  # the end
    assert data[-1]["state"] == "closed"
    return data[:-1]


async def _result(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    """The run's `RunResult` once it ended (409 while it runs)."""

    async def ended() -> dict[str, Any] | None:
        answer = await client.get(f"/api/runs/{run_id}/result")
        if answer.status_code == 409:
            return None
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()
        return found

    result: dict[str, Any] = await _until(ended, within=60, every=0.1)
    return result


async def _held_by(store: PostgresStore, run_id: str, replica: Replica) -> bool:
    """Whether `replica` holds the run now (its coordinator's lease)."""
    run = await anyio.to_thread.run_sync(store.run_info, run_id)
    return bool(run and run["held"] and str(run["owner"]).startswith(replica.prefix))


@contextlib.asynccontextmanager
async def _connected(dsn: str) -> AsyncIterator[Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _lease_of(conn: Any, run_id: str, replica: Replica) -> float:
    """When the lease of `replica` on the run expires (the database's clock, epoch seconds), and
    within `LEASE` of now: it holds the run."""
    row = await conn.fetchrow(
        "SELECT owner, extract(epoch FROM expires)::float8 AS expires, "
        "extract(epoch FROM now())::float8 AS now FROM orchestra.runs WHERE id = $1",
        run_id,
    )
    assert row is not None
    assert str(row["owner"]).startswith(replica.prefix)
    assert row["expires"] <= row["now"] + LEASE
    return float(row["expires"])


async def _taken_over_at(dsn: str, run_id: str, replica: Replica) -> float:
    """When `replica`'s coordinator took the run over (the database's clock, epoch seconds)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        at = await conn.fetchval(
            "SELECT extract(epoch FROM min(at))::float8 FROM orchestra.events "
            "WHERE run_id = $1 AND event = 'coordinator' AND starts_with(agent, $2)",
            run_id,
            replica.prefix,
        )
    finally:
        await conn.close()
    assert at is not None, "no take-over in the journal"
    return float(at)


async def _states(dsn: str, run_id: str) -> dict[str, str]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, state FROM orchestra.tasks WHERE run_id = $1", run_id)
    finally:
        await conn.close()
    return {row["id"]: row["state"] for row in rows}


@pytest.mark.postgres
class TestEvents:
    async def test_sse_clients_of_either_replica_see_every_event_of_a_run_the_other_runs(
        self, start: Callable[..., Any], store: PostgresStore, token: str
    ) -> None:
        a, b = await start(delay=0.005), await start(delay=0.005)
        auth = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as client:
            answer = await client.post("/api/runs", json={"tasks": _tasks(), "run_id": "watched"})
            assert answer.status_code == 202, answer.text
        async with anyio.create_task_group() as tg:
            seen: dict[str, list[dict[str, Any]]] = {}

            async def watch(name: str, url: str) -> None:
                seen[name] = await _events(url, "watched", auth)

            tg.start_soon(watch, "a", a.url)
            tg.start_soon(watch, "b", b.url)
        journal = await anyio.to_thread.run_sync(store.events, "watched")
        told_in_order(seen["a"], journal)
        told_in_order(seen["b"], journal)
        ended = Counter(e["task_id"] for e in seen["b"] if e["event"] == "succeeded")
        assert ended == {f"t{i}": 1 for i in range(TASKS)}


@pytest.mark.postgres
class TestControl:
    async def test_pause_resume_cancel_and_stop_sent_to_one_replica_act_on_the_others_run(
        self, start: Callable[..., Any], executions: Path, token: str, pg_dsn: str
    ) -> None:
        a, b = await start(delay=0.05), await start(delay=0.05)
        auth = {"Authorization": f"Bearer {token}"}
        async with (
            httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b.url, headers=auth, timeout=30) as on_b,
        ):
            answer = await on_a.post("/api/runs", json={"tasks": _tasks(), "run_id": "steered"})
            assert answer.status_code == 202, answer.text
            assert (await on_a.get("/api/runs/steered")).json()["live"] is True
            assert (await on_b.get("/api/runs/steered")).json()["live"] is False
            await _until(lambda: anyio.to_thread.run_sync(lambda: len(_noted(executions)) > 20))

            paused = await on_b.post("/api/runs/steered/pause")
            assert paused.status_code == 200, paused.text
            assert paused.json() == {"run_id": "steered", "paused": True}
            status = await on_b.get("/api/runs/steered/status")  # asked of A too
            assert status.status_code == 200, status.text
            assert status.json()["state"] == "paused"
            for replica in (on_a, on_b):  # where it runs, and where it does not
                assert (await replica.get("/api/runs/steered")).json()["paused"] is True
            await anyio.sleep(0.5)  # the attempts under way (0.05 s each) end
            before = len(_noted(executions))
            await anyio.sleep(1.0)
            assert len(_noted(executions)) == before  # no attempt started while paused

            resumed = await on_b.post("/api/runs/steered/resume")
            assert resumed.json() == {"run_id": "steered", "paused": False}
            assert (await on_b.get("/api/runs/steered")).json()["paused"] is False
            await _until(
                lambda: anyio.to_thread.run_sync(lambda: len(_noted(executions)) > before + 10)
            )

            last = [f"t{i}" for i in range(TASKS - 100, TASKS)]  # still waiting: FIFO order
            cancelled = await on_b.post("/api/runs/steered/cancel", json={"task_id": last})
            assert cancelled.status_code == 200, cancelled.text
            assert sorted(cancelled.json()["cancelled"]) == sorted(last)
            moved = await on_b.post(
                "/api/runs/steered/reprioritize", json={"task_id": "t1800", "priority": -1}
            )
            assert moved.json() == {"changed": True}
            waited = await on_b.post(  # A's answer, passed on as it is
                "/api/runs/steered/reprioritize", json={"task_id": "t1", "priority": -1}
            )
            assert waited.json() == {"changed": False}  # t1 does not wait any more

            stopped = await on_b.post("/api/runs/steered/stop", json={"grace": 1})
            assert stopped.status_code == 200, stopped.text
            result = stopped.json()
            assert result["status"] == "cancelled"
            assert result["metadata"]["run_id"] == "steered"
            assert (await on_a.get("/api/runs/steered/result")).json() == result
            assert (await on_b.get("/api/runs/steered/result")).json() == result
        states = await _states(pg_dsn, "steered")
        assert {states[t] for t in last} == {"cancelled"}
        assert not set(last) & set(_noted(executions))  # never run


@pytest.mark.postgres
class TestTakeOver:
    async def test_a_replica_killed_mid_run_has_its_run_taken_over_with_nothing_lost_or_redone(
        self,
        start: Callable[..., Any],
        executions: Path,
        token: str,
        store: PostgresStore,
        pg_dsn: str,
    ) -> None:
        a, b = await start(), await start()
        auth = {"Authorization": f"Bearer {token}"}
        async with (
            httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b.url, headers=auth, timeout=30) as on_b,
            anyio.create_task_group() as tg,
        ):
            answer = await on_a.post("/api/runs", json={"tasks": _tasks(), "run_id": "survives"})
            assert answer.status_code == 202, answer.text
            seen: list[dict[str, Any]] = []

            async def watch() -> None:  # an SSE client of B, through the take-over
                seen.extend(await _events(b.url, "survives", auth))

            tg.start_soon(watch)
            # Killed a quarter of the way in, past a lease since it started the run.
            await _until(
                lambda: anyio.to_thread.run_sync(lambda: len(_noted(executions)) >= TASKS // 4)
            )
            # (connected before: the lease is read at once, long before it can lapse)
            async with _connected(pg_dsn) as conn:
                a.process.send_signal(signal.SIGKILL)
                await anyio.to_thread.run_sync(a.process.wait)
                lapses = await _lease_of(conn, "survives", a)  # A renews it no more
            before = await _states(pg_dsn, "survives")
            done_before = {t for t, state in before.items() if state == "succeeded"}
            assert 0 < len(done_before) < TASKS
            asked: list[httpx.Response] = []

            async def ask() -> None:  # while no replica runs the run: B answers once it took it
                asked.append(await on_b.get("/api/runs/survives/status"))

            tg.start_soon(ask)
            await _until(partial(_held_by, store, "survives", b), within=LEASE + 10)
            # Taken over once A's lease lapsed, never before, and within a look of B's (every
            # `POLL`) after it, on the database's clock: what B did, not how soon this test,
            # polling on a loaded machine, saw it. A's lease lapses within `LEASE` of the kill.
            taken = await _taken_over_at(pg_dsn, "survives", b)
            assert lapses < taken <= lapses + POLL + 1.0, f"taken {taken - lapses:.2f} s late"

            result = await _result(on_b, "survives")
        assert asked[0].status_code == 200, asked[0].text
        assert asked[0].json()["run_id"] == "survives"
        assert result["status"] == "success", result["errors"]
        assert result["metadata"]["total"] == TASKS
        assert result["metadata"]["resumed"] == len(done_before)
        assert result["data"] == {f"t{i}": i for i in range(TASKS)}
        # Every task's result recorded once; what had succeeded was not run again; what ran twice
        # was running when A was killed (its result never written), at most A's concurrency.
        assert set((await _states(pg_dsn, "survives")).values()) == {"succeeded"}
        journal = await anyio.to_thread.run_sync(store.events, "survives")
        ends = Counter(e["task_id"] for e in journal if e["event"] == "succeeded")
        assert ends == {f"t{i}": 1 for i in range(TASKS)}
        runs = Counter(_noted(executions))
        assert set(runs) == {f"t{i}" for i in range(TASKS)}
        twice = {t for t, n in runs.items() if n > 1}
        assert not twice & done_before
        assert max(runs.values()) <= 2
        assert len(twice) <= 10
        # B's SSE client saw every event of the run, A's and B's.
        told_in_order(seen, journal)
        assert b.process.poll() is None

    async def test_a_replica_stopped_gracefully_leaves_its_run_to_another_paused_as_it_was(
        self,
        start: Callable[..., Any],
        executions: Path,
        token: str,
        store: PostgresStore,
        pg_dsn: str,
    ) -> None:
        a, b = await start(), await start()
        auth = {"Authorization": f"Bearer {token}"}
        async with (
            httpx.AsyncClient(base_url=a.url, headers=auth, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b.url, headers=auth, timeout=30) as on_b,
        ):
            answer = await on_a.post("/api/runs", json={"tasks": _tasks(), "run_id": "handed"})
            assert answer.status_code == 202, answer.text
            await _until(lambda: anyio.to_thread.run_sync(lambda: len(_noted(executions)) >= 300))
            assert (await on_b.post("/api/runs/handed/pause")).json()["paused"] is True
            a.process.send_signal(signal.SIGTERM)  # a rolling restart: A leaves, B goes on
            _, err = await anyio.to_thread.run_sync(lambda: a.process.communicate(timeout=30))
            assert a.process.returncode == -signal.SIGTERM, err
            before = await _states(pg_dsn, "handed")
            assert "cancelled" not in before.values()  # stopped, not cancelled: left to resume
            await _until(partial(_held_by, store, "handed", b), within=LEASE + 10)
            status = (await on_b.get("/api/runs/handed/status")).json()
            assert status["state"] == "paused"  # taken over as it was left
            noted = len(_noted(executions))
            await anyio.sleep(1.0)
            assert len(_noted(executions)) == noted
            assert (await on_b.post("/api/runs/handed/resume")).json()["paused"] is False
            result = await _result(on_b, "handed")
        assert result["status"] == "success", result["errors"]
        assert result["data"] == {f"t{i}": i for i in range(TASKS)}
        done_before = {t for t, state in before.items() if state == "succeeded"}
        assert result["metadata"]["resumed"] == len(done_before)
        runs = Counter(_noted(executions))
        assert not {t for t, n in runs.items() if n > 1} & done_before


@pytest.mark.postgres
class TestOneTaker:
    async def test_replicas_looking_at_once_take_each_run_once_and_only_a_lapsed_one(
        self, pg_dsn: str
    ) -> None:
        import asyncpg

        from orchestra._service._replicas import _take_over

        conn = await asyncpg.connect(pg_dsn)
        lookers = [await asyncpg.connect(pg_dsn) for _ in range(3)]
        try:
            # 30 runs left by a dead replica (their leases lapsed), one it still holds, one it
            # started a moment ago (its lease not taken yet), one that ended.
            await conn.execute(
                "INSERT INTO orchestra.runs (id, owner, expires) SELECT 'r' || i, 'dead', "
                "now() - interval '1 second' FROM generate_series(1, 30) AS i"
            )
            await conn.execute(
                "INSERT INTO orchestra.runs (id, owner, expires, state) VALUES "
                "('held', 'dead', now() + interval '1 hour', 'open'), "
                "('young', NULL, NULL, 'open'), ('ended', NULL, NULL, 'closed')"
            )
            await conn.execute(
                "INSERT INTO orchestra.service_runs (id, replica, since, submission) "
                "SELECT id, 'dead', now() - interval '1 minute', '{}' FROM orchestra.runs"
            )
            await conn.execute("UPDATE orchestra.service_runs SET since = now() WHERE id = 'young'")
            taken = await asyncio.gather(
                *(_take_over(looker, f"replica{i}", 2.0) for i, looker in enumerate(lookers))
            )
            ids = [row["id"] for rows in taken for row in rows]
            assert sorted(ids) == sorted(f"r{i}" for i in range(1, 31))  # each once
            again = await asyncio.gather(
                *(_take_over(looker, f"replica{i}", 2.0) for i, looker in enumerate(lookers))
            )
            assert again == [[], [], []]  # taken: served now, since a moment
        finally:
            for one in (conn, *lookers):
                await one.close()


class TestSQLite:
    def test_a_second_serve_on_one_file_is_refused_naming_the_first(self, tmp_path: Path) -> None:
        db = tmp_path / "orchestra.db"
        env = {**os.environ, "PYTHONPATH": str(REPO), "REPLICA_EXECUTIONS": str(tmp_path / "x")}
        command = [sys.executable, "-m", "orchestra", "serve", "--agents", AGENTS, "--db", str(db)]
        first = spawn(
            [*command, "--port", str(free_port())],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lock = tmp_path / "orchestra.db.serve.lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first server did not start"
            time.sleep(0.05)
        second = subprocess.run(
            [*command, "--port", str(free_port())],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert "--dsn" in second.stderr
        first.send_signal(signal.SIGKILL)
        first.wait()
        # The lock goes with the process, however it ended: a new server starts.
        third = spawn(
            [*command, "--port", str(free_port())],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while lock.read_text().strip() != str(third.pid):
            assert third.poll() is None, third.communicate()[1]
            assert time.monotonic() < deadline, "the new server did not start"
            time.sleep(0.05)
        third.send_signal(signal.SIGTERM)
        third.communicate(timeout=30)
