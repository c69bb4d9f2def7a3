"""Workers over HTTP: ``orchestra worker --url`` processes working for runs submitted to the
service (a real uvicorn process, tests/service_work_job.py, on 127.0.0.1), on a SQLite file and on
PostgreSQL; and the workers' routes' authorization, against the app in this process.

The service's runs start paused (``--paused``): it coordinates them, and the HTTP workers run every
task, so that what each worker reports adds up to the run."""

from __future__ import annotations

import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from orchestra._service._tokens import Tokens
from orchestra.stores import SQLiteStore
from orchestra.stores._http._wire import worker_name
from tests.helpers import spawn
from tests.service_kit import free_port, server, serving

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

REPO = Path(__file__).resolve().parent.parent
REPORT = re.compile(r"(\d+) claimed, (\d+) completed, (\d+) refused, (\d+) lost, (\d+) handed back")


async def until(condition: Callable[[], bool], within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(0.02)


def ran(calls: Path) -> list[tuple[str, str]]:
    """Every agent call so far: (task id, the pid of the worker, or ``service``)."""
    if not calls.exists():
        return []
    return [(t, p) for t, p in (line.split() for line in calls.read_text().splitlines())]


def rows(db: Path, sql: str, *args: Any) -> list[Any]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, args).fetchall()


@dataclass
class Service:
    """The service as a process of its own (tests/service_work_job.py), its tokens, its calls
    file, and the workers started for it."""

    store: list[str]  # ["--db", FILE] or ["--dsn", URL]
    lease: float
    tmp: Path
    port: int = field(default_factory=free_port)
    worker_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    process: subprocess.Popen[Any] | None = None
    started: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def calls(self) -> Path:
        return self.tmp / "calls"

    async def start(self) -> None:
        self.started += 1
        log = (self.tmp / f"service-{self.started}.log").open("w")
        self.process = spawn(
            [sys.executable, str(REPO / "tests" / "service_work_job.py"), *self.store,
             "--port", str(self.port), "--lease", str(self.lease),
             # (joined with "=": a random token may start with "-", which argparse reads as an option)
             f"--token={self.worker_token}", f"--admin={self.admin_token}", "--paused"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "WORKER_CALLS": str(self.calls)},
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        async with httpx.AsyncClient(base_url=self.url) as client:
            with anyio.fail_after(30):
                while True:
                    assert self.process.poll() is None, self.log()
                    try:
                        if (await client.get("/health")).status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def log(self) -> str:
        return (self.tmp / f"service-{self.started}.log").read_text()

    async def submit(self, run_id: str, n: int, prefix: str = "t") -> None:
        tasks = [{"kind": "work", "payload": i, "id": f"{prefix}{i}"} for i in range(n)]
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            answer = await client.post(
                "/api/runs",
                json={"tasks": tasks, "run_id": run_id},
                headers={"Authorization": f"Bearer {self.admin_token}"},
            )
        assert answer.status_code in (200, 202), answer.text

    async def get(self, path: str) -> Any:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            answer = await client.get(path, headers={"Authorization": f"Bearer {self.admin_token}"})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def worker(self, name: str, *, concurrency: int = 50, **env: str) -> Worker:
        """``orchestra worker --url`` with tests/worker_job.py's agents, serving run "r" (it exits
        when the run is over); its token from $ORCHESTRA_TOKEN. `env`: tests/worker_job.py's
        settings (WORKER_DELAY, WORKER_HOLD)."""
        out = self.tmp / f"worker-{name}.err"
        with out.open("w") as err:
            process = spawn(
                [sys.executable, "-m", "orchestra", "worker", "--url", self.url, "--agents",
                 "tests/worker_job.py:agents", "--run-id", "r", "--grace", "0"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                env={**os.environ, "PYTHONPATH": str(REPO), "WORKER_CALLS": str(self.calls),
                     "WORKER_CONCURRENCY": str(concurrency), "ORCHESTRA_TOKEN": self.worker_token,
                     **env},
            )  # fmt: skip
        return Worker(process, out)


@dataclass
class Worker:
    process: subprocess.Popen[Any]
    err: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    async def ended(self, within: float = 90.0) -> dict[str, int]:
        """Wait for its exit (0); what it reported: claimed, completed, refused, lost, released."""
        with anyio.fail_after(within):
            while self.process.poll() is None:
                await anyio.sleep(0.05)
        text = self.err.read_text()
        assert self.process.returncode == 0, text
        found = REPORT.search(text)
        assert found is not None, text
        keys = ("claimed", "completed", "refused", "lost", "released")
        return dict(zip(keys, map(int, found.groups()), strict=True))


def sqlite_service(tmp_path: Path, lease: float) -> Service:
    db = tmp_path / "runs.db"
    SQLiteStore(db).runs()  # the file, with its schema
    return Service(["--db", str(db)], lease, tmp_path)


def registered(db: Path, n: int) -> Callable[[], bool]:
    return lambda: rows(db, "SELECT count(*) FROM workers")[0][0] == n


def mine(calls: Path, worker: Worker) -> list[str]:
    return [t for t, p in ran(calls) if p == str(worker.pid)]


async def three_workers_run_a_run(
    service: Service, n: int, present: Callable[[], Awaitable[int]]
) -> None:
    """Three HTTP workers, present before the run is submitted, run its n tasks: each task run
    and recorded once, the workers' completions adding up to the run."""
    workers = [service.worker(str(i)) for i in range(3)]
    with anyio.fail_after(30):
        while await present() < 3:
            await anyio.sleep(0.05)
    await service.submit("r", n)
    reports = [await w.ended() for w in workers]
    assert sum(r["completed"] for r in reports) == n
    assert all(r["completed"] > 0 for r in reports), reports
    assert [(r["refused"], r["lost"]) for r in reports] == [(0, 0)] * 3
    calls = ran(service.calls)
    assert sorted(t for t, _ in calls) == sorted(f"t{i}" for i in range(n))  # each once
    assert {p for _, p in calls} == {str(w.pid) for w in workers}  # none by the service
    run = await service.get("/api/runs/r")
    assert (run["state"], run["counts"]) == ("closed", {"succeeded": n})
    result = await service.get("/api/runs/r/result")
    assert result["data"] == {f"t{i}": 2 * i for i in range(n)}


@pytest.mark.subprocess
class TestHttpWorkersOnSQLite:
    async def test_three_workers_run_3000_tasks_each_recorded_exactly_once(
        self, tmp_path: Path
    ) -> None:
        service = sqlite_service(tmp_path, lease=10.0)
        await service.start()
        db = tmp_path / "runs.db"

        async def present() -> int:
            return int(rows(db, "SELECT count(*) FROM workers")[0][0])

        await three_workers_run_a_run(service, 3000, present)
        claimed = rows(db, "SELECT count(*) FROM events WHERE event = 'claimed'")[0][0]
        assert claimed == 3000

    async def test_a_worker_killed_mid_run_has_its_leases_taken_back_and_the_run_completes(
        self, tmp_path: Path
    ) -> None:
        service = sqlite_service(tmp_path, lease=2.0)
        await service.start()
        db = tmp_path / "runs.db"
        victim = service.worker("victim", concurrency=4, WORKER_DELAY="60")
        await until(registered(db, 1))
        await service.submit("r", 20)
        await until(lambda: len(mine(service.calls, victim)) == 4)  # it holds four, mid-call
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        held = set(mine(service.calls, victim))
        survivor = service.worker("survivor", concurrency=8)
        report = await survivor.ended()
        assert report["completed"] == 20
        again = [t for t, p in ran(service.calls) if p == str(survivor.pid)]
        assert sorted(again) == sorted(f"t{i}" for i in range(20))
        run = await service.get("/api/runs/r")
        assert (run["state"], run["counts"]) == ("closed", {"succeeded": 20})
        attempts = dict(rows(db, "SELECT id, attempts FROM tasks WHERE run_id = 'r'"))
        assert {t for t, n in attempts.items() if n == 2} == held  # the lost attempt counted
        assert {n for t, n in attempts.items() if t not in held} == {1}

    async def test_a_worker_paused_past_its_lease_has_its_late_completions_refused_and_counted(
        self, tmp_path: Path
    ) -> None:
        service = sqlite_service(tmp_path, lease=1.5)
        await service.start()
        db = tmp_path / "runs.db"
        hold = tmp_path / "hold"
        hold.touch()
        sleeper = service.worker("sleeper", concurrency=4, WORKER_HOLD=str(hold))
        await until(registered(db, 1))
        await service.submit("r", 4)
        await until(lambda: len(mine(service.calls, sleeper)) == 4)  # it holds all four
        sleeper.process.send_signal(signal.SIGSTOP)
        hold.unlink()  # its calls return as soon as it wakes
        await anyio.sleep(3.5)  # past its lease: the coordinator takes the tasks back
        other = service.worker("other")
        await until(lambda: len(mine(service.calls, other)) == 4)
        sleeper.process.send_signal(signal.SIGCONT)  # it wakes and completes: too late
        late, fresh = await sleeper.ended(), await other.ended()
        assert (late["completed"], late["refused"]) == (0, 4)
        assert (fresh["completed"], fresh["refused"]) == (4, 0)
        refused = rows(db, "SELECT task_id FROM events WHERE event = 'refused'")
        assert sorted(t for (t,) in refused) == [f"t{i}" for i in range(4)]
        run = await service.get("/api/runs/r")
        assert (run["state"], run["counts"]) == ("closed", {"succeeded": 4})
        result = await service.get("/api/runs/r/result")
        assert result["data"] == {f"t{i}": 2 * i for i in range(4)}
        assert set(rows(db, "SELECT attempts FROM tasks WHERE run_id = 'r'")) == {(2,)}

    async def test_a_service_killed_and_restarted_loses_nothing_of_what_a_worker_holds(
        self, tmp_path: Path
    ) -> None:
        service = sqlite_service(tmp_path, lease=5.0)
        await service.start()
        db = tmp_path / "runs.db"
        worker = service.worker("w", concurrency=4, WORKER_DELAY="2")
        await until(registered(db, 1))
        await service.submit("r", 8)
        await until(lambda: len(mine(service.calls, worker)) == 4)  # it holds four, mid-call
        service.kill()  # the run's coordinator with it
        await anyio.sleep(0.5)
        await service.start()  # the same file and port
        await service.submit("r", 8)  # the same run: resumed here
        report = await worker.ended()
        assert report["claimed"] == report["completed"] + report["refused"] + report["lost"]
        assert report["completed"] >= 1
        calls = ran(service.calls)
        assert {t for t, _ in calls} == {f"t{i}" for i in range(8)}
        assert {p for _, p in calls} == {str(worker.pid)}
        run = await service.get("/api/runs/r")
        assert (run["state"], run["counts"]) == ("closed", {"succeeded": 8})
        # Each task's end written once: by the worker's completion the store took.
        journal = await anyio.to_thread.run_sync(SQLiteStore(db).events, "r")
        ends = [e["task_id"] for e in journal if e["event"] == "succeeded"]
        assert sorted(ends) == sorted(f"t{i}" for i in range(8))


@pytest.mark.subprocess
@pytest.mark.postgres
class TestHttpWorkersOnPostgres:
    async def test_three_workers_run_a_run_each_task_recorded_exactly_once(
        self, tmp_path: Path, pg_dsn: str
    ) -> None:
        import asyncpg

        service = Service(["--dsn", pg_dsn], 10.0, tmp_path)
        await service.start()

        async def present() -> int:
            conn = await asyncpg.connect(pg_dsn)
            try:
                return int(
                    await conn.fetchval("SELECT count(*) FROM orchestra.workers WHERE gone IS NULL")
                )
            finally:
                await conn.close()

        await three_workers_run_a_run(service, 1000, present)


@pytest.mark.postgres
@pytest.mark.subprocess
class TestWakeUps:
    async def test_a_long_poll_is_answered_when_the_database_says_work_is_ready(
        self, pg_dsn: str
    ) -> None:
        from orchestra.stores._postgres._store import PostgresStore

        store = PostgresStore(pg_dsn, poll=0.2)
        try:
            async with serving(store) as api:
                headers = api.auth("worker")
                name = worker_name("host", 1, await _hello(api.client, api.tokens["worker"]), "x")
                present = {"run_id": "r", "kinds": ["echo"]}
                answer = await api.client.post(
                    f"/api/workers/{name}", json=present, headers=headers
                )
                assert answer.status_code == 200
                waited: list[float] = []

                async def wait() -> None:
                    answer = await api.client.post(
                        f"/api/workers/{name}/wait", json={"poll": 30}, headers=headers
                    )
                    waited.append(answer.json()["waited"])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait)
                    await anyio.sleep(0.3)  # the request waits
                    await api.submit({"run_id": "r", "tasks": [{"kind": "echo", "id": "a"}]})
                assert waited[0] < 30  # woken by the run's NOTIFY, not its poll's end
                await api.handle("r")
        finally:
            await anyio.to_thread.run_sync(store.close)


# -- the routes' authorization, against the app in this process ----------------------------------


async def _hello(client: httpx.AsyncClient, token: str) -> str:
    answer = await client.get("/api/workers/hello", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    token_id: str = answer.json()["token_id"]
    return token_id


class TestWorkerTokens:
    async def test_a_worker_token_cannot_act_for_another_tokens_worker_nor_write_its_leases(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteStore(tmp_path / "runs.db", lease=30.0)
        async with serving(store, concurrency=1) as api:
            client = api.client
            other = (await anyio.to_thread.run_sync(Tokens(store).create, "worker", "b"))[0]
            mine_ = {"Authorization": f"Bearer {api.tokens['worker']}"}
            theirs = {"Authorization": f"Bearer {other}"}
            a = worker_name("host", 1, await _hello(client, api.tokens["worker"]), "a")
            b = worker_name("host", 2, await _hello(client, other), "b")
            present = {"run_id": "r", "kinds": ["wait"]}
            assert (await client.post(f"/api/workers/{a}", json=present, headers=mine_)).is_success
            await api.submit(
                {"run_id": "r", "tasks": [{"kind": "wait", "id": f"w{i}"} for i in range(3)]}
            )
            claimed: list[dict[str, Any]] = []
            with anyio.fail_after(20):  # once the run is shared with the worker
                while not claimed:
                    answer = await client.post(
                        f"/api/workers/{a}/claim",
                        json={"run_id": "r", "rooms": {"wait": 1}, "room": 1},
                        headers=mine_,
                    )
                    claimed = answer.json()["tasks"]
                    await anyio.sleep(0.05)
            (task,) = claimed
            lease = {"run_id": "r", "id": task["id"], "token": task["token"]}
            end = {"lease": lease, "kind": "wait", "status": "succeeded", "output": "1",
                   "agent": "x", "attempts": 1}  # fmt: skip
            for method, path, body in [
                ("POST", f"/api/workers/{a}", present),
                ("DELETE", f"/api/workers/{a}", None),
                ("POST", f"/api/workers/{a}/claim", {"rooms": {"wait": 1}, "room": 1}),
                ("POST", f"/api/workers/{a}/heartbeat", {"held": [lease]}),
                ("POST", f"/api/workers/{a}/complete", {"wall0": 0.0, "ends": [end]}),
                ("POST", f"/api/workers/{a}/release", {"held": [lease]}),
                ("POST", f"/api/workers/{a}/wait", {"poll": 0.1}),
            ]:
                answer = await client.request(method, path, json=body, headers=theirs)
                assert answer.status_code == 403, (path, answer.text)
                assert answer.json()["error"] == "forbidden"
            # Under its own name, the other token's worker names the lease: the store refuses.
            assert (await client.post(f"/api/workers/{b}", json=present, headers=theirs)).is_success
            answer = await client.post(
                f"/api/workers/{b}/complete", json={"wall0": 0.0, "ends": [end]}, headers=theirs
            )
            assert answer.json() == {"accepted": [False]}
            answer = await client.post(
                f"/api/workers/{b}/heartbeat", json={"held": [lease]}, headers=theirs
            )
            assert answer.json() == {"lost": [{"run_id": "r", "id": task["id"]}]}
            # The lease is still the first worker's, and its completion is taken.
            answer = await client.post(
                f"/api/workers/{a}/heartbeat", json={"held": [lease]}, headers=mine_
            )
            assert answer.json() == {"lost": []}
            answer = await client.post(
                f"/api/workers/{a}/complete", json={"wall0": 0.0, "ends": [end]}, headers=mine_
            )
            assert answer.json() == {"accepted": [True]}
            api.gate.set()

    async def test_every_worker_route_refuses_a_missing_a_wrong_and_an_under_privileged_token(
        self, tmp_path: Path
    ) -> None:
        async with serving(SQLiteStore(tmp_path / "runs.db")) as api:
            name = worker_name("host", 1, "abcd1234", "x")
            routes = [
                (method.upper(), path.replace("{name}", name))
                for path, methods in api.app.openapi()["paths"].items()
                if path.startswith("/api/workers")
                for method in methods
            ]
            assert len(routes) == 9
            refusals = [
                ({}, 401, "bearer token"),
                ({"Authorization": "Bearer orch_not-a-token"}, 401, "not known"),
                *[
                    (api.auth(role), 403, "needs 'worker'")
                    for role in ("submit", "read", "control")
                ],
            ]
            for method, path in routes:
                for headers, status, why in refusals:
                    answer = await api.client.request(method, path, headers=headers)
                    assert answer.status_code == status, (method, path, answer.text)
                    assert why in answer.json()["message"]
            for role in ("worker", "admin"):
                answer = await api.client.get("/api/workers/hello", headers=api.auth(role))
                assert answer.status_code == 200

    async def test_a_worker_not_present_is_told_so_and_present_again_it_is_served(
        self, tmp_path: Path
    ) -> None:
        async with serving(SQLiteStore(tmp_path / "runs.db")) as api:
            token_id = await _hello(api.client, api.tokens["worker"])
            name = worker_name("host", 1, token_id, "x")
            headers = api.auth("worker")
            beat: dict[str, list[Any]] = {"held": []}
            answer = await api.client.post(
                f"/api/workers/{name}/heartbeat", json=beat, headers=headers
            )
            assert (answer.status_code, answer.json()["error"]) == (409, "unknown_worker")
            present = {"kinds": ["echo"]}
            answer = await api.client.post(f"/api/workers/{name}", json=present, headers=headers)
            assert answer.status_code == 200
            answer = await api.client.post(
                f"/api/workers/{name}/heartbeat", json=beat, headers=headers
            )
            assert answer.json() == {"lost": []}
            answer = await api.client.delete(f"/api/workers/{name}", headers=headers)
            assert answer.status_code == 204
            answer = await api.client.post(
                f"/api/workers/{name}/heartbeat", json=beat, headers=headers
            )
            assert answer.status_code == 409


class TestTheWorkerCommand:
    def test_it_takes_exactly_one_of_db_dsn_and_url_and_url_needs_a_token(
        self, tmp_path: Path
    ) -> None:
        from typer.testing import CliRunner

        from orchestra._cli._app import app

        def worker(*args: str) -> tuple[int, str]:
            done = CliRunner().invoke(
                app, ["worker", "--agents", "tests/worker_job.py:agents", *args],
                env={"ORCHESTRA_TOKEN": ""},
            )  # fmt: skip
            return done.exit_code, " ".join(done.output.split())

        db = tmp_path / "runs.db"
        SQLiteStore(db).runs()
        code, said = worker("--db", str(db), "--url", "http://127.0.0.1:9")
        assert code == 2
        assert "exactly one of --db FILE (SQLite), --dsn" in said
        code, said = worker("--url", "http://127.0.0.1:9")
        assert code == 2
        assert "--url needs a worker token" in said
        code, said = worker("--url", "127.0.0.1:9", "--token", "x" * 40)
        assert code == 2
        assert "http:// or https://" in said

    @pytest.mark.subprocess
    async def test_a_token_without_the_worker_role_stops_it_with_the_services_refusal(
        self, tmp_path: Path
    ) -> None:
        async with serving(SQLiteStore(tmp_path / "runs.db")) as api, server(api.app) as url:
            process = spawn(
                [sys.executable, "-m", "orchestra", "worker", "--url", url, "--agents",
                 "tests/worker_job.py:agents"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRA_TOKEN": api.tokens["read"]},
            )  # fmt: skip
            with anyio.fail_after(30):
                while process.poll() is None:
                    await anyio.sleep(0.05)
            assert process.stderr is not None
            said = " ".join(process.stderr.read().split())
            assert process.returncode == 2, said
            assert "refused GET /api/workers/hello (403)" in said
            assert "has the role 'read'" in said
            assert api.tokens["read"] not in said

    @pytest.mark.subprocess
    async def test_a_token_read_from_a_file_with_its_newline_is_the_token(
        self, tmp_path: Path
    ) -> None:
        # A secret mounted as a file, or `ORCHESTRA_TOKEN="$(<file)"$'\n'`, keeps its newline:
        # no token holds whitespace, so it is not the token's; sent, it was an illegal header
        # that the worker retried as a lost service for its whole budget.
        async with serving(SQLiteStore(tmp_path / "runs.db")) as api, server(api.app) as url:
            run_id = await api.submit({"tasks": [{"kind": "echo", "payload": 1}]})
            await api.handle(run_id)
            process = spawn(
                [sys.executable, "-m", "orchestra", "worker", "--url", url, "--agents",
                 "tests/worker_job.py:agents", "--run-id", run_id],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO),
                     "ORCHESTRA_TOKEN": api.tokens["worker"] + "\n"},
            )  # fmt: skip
            with anyio.fail_after(20):
                while process.poll() is None:
                    await anyio.sleep(0.05)
            assert process.stderr is not None
            said = " ".join(process.stderr.read().split())
            assert process.returncode == 0, said
            assert REPORT.search(said) is not None, said


class TestInOneProcess:
    async def test_a_worker_through_the_service_writes_its_spawns_and_its_retries(
        self, tmp_path: Path
    ) -> None:
        """A worker in this process, over the app's ASGI transport: the task it runs fails once
        (the failed attempt written as it fails, fenced), then spawns two tasks and succeeds; the
        coordinator admits the spawns, names them, and the run ends with every output."""
        from orchestra import Context, Orchestrator, RetryableError, RetryPolicy, Task, agent
        from orchestra._core._orchestrator import LocalRuns
        from orchestra.stores._http._worker import ServiceBackend
        from orchestra.stores._worker import Worker

        @agent(kinds=["wait"], name="splitter")
        async def splitter(task: Task, ctx: Context) -> Any:
            if ctx.attempt == 1:
                raise RetryableError("not yet")
            ctx.spawn(Task("echo", "x"))
            ctx.spawn(Task("echo", "y", id="named"))
            return "split"

        @agent(kinds=["echo"], name="echo")
        async def echo(task: Task, ctx: Context) -> Any:
            return task.payload

        store = SQLiteStore(tmp_path / "runs.db")
        async with serving(store, concurrency=1) as api:
            tasks = [{"kind": "wait", "id": "b0", "payload": 0},  # the coordinator's one slot
                     {"kind": "wait", "id": "p", "priority": 1}]  # fmt: skip
            await api.submit({"run_id": "r", "tasks": tasks})
            transport = httpx.ASGITransport(app=api.app)
            orch = Orchestrator(
                agents=[splitter, echo], retry=RetryPolicy(base=0.01, cap=0.01), seed=1
            )
            async with (
                orch,
                ServiceBackend("http://service", api.tokens["worker"], transport=transport) as rb,
            ):
                with anyio.fail_after(30):
                    await until(lambda: "b0" in api.calls)
                    worker = Worker(LocalRuns(orch), rb, "r", None, rb.poll)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(worker.run)
                        await until(lambda: worker.report.completed >= 3)
                        api.gate.set()  # the coordinator's blocker ends: so does the run
            assert (worker.report.claimed, worker.report.refused) == (3, 0)
            result = await api.handle("r")
            assert result.data == {"b0": 0, "p": "split", "p/echo#1": "x", "named": "y"}
        failed = rows(
            tmp_path / "runs.db", "SELECT task_id, number, agent, error_type, message FROM attempts"
        )
        assert failed == [("p", 1, "splitter", "RetryableError", "not yet")]
        assert rows(tmp_path / "runs.db", "SELECT attempts FROM tasks WHERE id = 'p'") == [(2,)]


class TestALostService:
    async def test_a_call_it_never_answers_is_retried_for_the_budget_then_a_store_error(
        self,
    ) -> None:
        import time

        from orchestra import StoreError
        from orchestra.stores._http._worker import ServiceBackend

        url = f"http://127.0.0.1:{free_port()}"  # nobody listens
        began = time.monotonic()
        with pytest.raises(
            StoreError, match=r"has not answered for [\d.]+ s \(GET /api/workers/hello\)"
        ):
            async with ServiceBackend(url, "x" * 40, retry_for=0.5):
                pass
        assert time.monotonic() - began >= 0.5  # retried until its budget was spent

    async def test_a_request_that_cannot_be_sent_is_an_error_at_once_not_a_lost_service(
        self, tmp_path: Path
    ) -> None:
        from orchestra import StoreError
        from orchestra.stores._http._worker import ServiceBackend

        async with serving(SQLiteStore(tmp_path / "runs.db")) as api, server(api.app) as url:
            with anyio.fail_after(5), pytest.raises(StoreError, match="could not send GET"):
                async with ServiceBackend(url, "x" * 20 + "\n" + "x" * 20, retry_for=30):
                    pass


@pytest.mark.subprocess
class TestSeveralAddresses:
    async def test_an_address_that_cannot_be_reached_is_passed_for_the_next_which_serves_it(
        self, tmp_path: Path
    ) -> None:
        from orchestra.stores._http._worker import ServiceBackend

        store = SQLiteStore(tmp_path / "runs.db")
        try:
            async with serving(store) as api, server(api.app) as url:
                dead = f"http://127.0.0.1:{free_port()}"  # nobody listens
                async with ServiceBackend([dead, url], api.tokens["worker"]) as backend:
                    assert backend.url == url  # moved on at the first call
                    name = backend.name("w")
                    async with backend.present(name, None, ["echo"]):
                        held = rows(tmp_path / "runs.db", "SELECT owner FROM workers")
                        assert [owner for (owner,) in held] == [name]
        finally:
            store.close()

    def test_the_worker_command_takes_several_urls_and_checks_each(self, tmp_path: Path) -> None:
        answer = subprocess.run(
            [sys.executable, "-m", "orchestra", "worker", "--agents", "tests/worker_job.py:agents",
             "--url", "http://127.0.0.1:1", "--url", "ftp://elsewhere", "--token", "x" * 40],
            cwd=REPO, capture_output=True, text=True, check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert answer.returncode == 2
        assert "'ftp://elsewhere'" in answer.stderr


class TestTheWire:
    def test_a_failed_attempt_crosses_with_every_field_of_the_results_attempt_record(
        self,
    ) -> None:
        from pydantic import ValidationError

        from orchestra.result import AttemptRecord
        from orchestra.stores._http._wire import FailedAttempt

        record = AttemptRecord(
            number=2, agent="claude", error_type="RateLimitError", message="slow down",
            started=1.5, duration=0.25, retry_in=3.0, traceback="Traceback ...",
            status_code=429, api_error_type="rate_limit_error", request_id="req_1",
        )  # fmt: skip
        wire = FailedAttempt.model_validate_json(record.model_dump_json())
        assert wire.model_dump() == record.model_dump()
        with pytest.raises(ValidationError, match="number"):
            FailedAttempt.model_validate({**record.model_dump(), "number": 0})
        with pytest.raises(ValidationError, match="extra"):
            FailedAttempt.model_validate({**record.model_dump(), "retries": 1})
