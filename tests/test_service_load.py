"""The service under load, with a replica killed: two `orchestra serve --dsn` replicas (real
uvicorn processes) on one PostgreSQL database (the session's real server, tests/pg.py), three
`orchestra worker --url A --url B` processes running a run of 10,000 tasks through them, and the
replica that coordinates the run killed (a real SIGKILL) mid-run. The workers that used it move to
the other replica by themselves (no balancer), which takes the run over: every task's result is
recorded exactly once, every task run, and only what was in flight at the kill run twice.

The replicas' runs are paused (tests/load_agents.py): the workers run every task, each call noted
in a file (tests/worker_job.py), so that executions can be counted."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from orchestra._service._tokens import Tokens
from tests.helpers import spawn
from tests.service_kit import free_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from orchestra.stores._postgres._store import PostgresStore

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

REPO = Path(__file__).resolve().parent.parent
TASKS = 10_000
LEASE = 2.0  # the replicas' --lease: the killed one's run is taken over this long after
CONCURRENCY = 64  # each worker's
WORKERS_TOKEN = secrets.token_urlsafe(32)
REPORT = re.compile(r"(\d+) claimed, (\d+) completed, (\d+) refused, (\d+) lost, (\d+) handed back")
REPORT_KEYS = ("claimed", "completed", "refused", "lost", "released")


@dataclass
class Process:
    process: subprocess.Popen[Any]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    from orchestra.stores._postgres._store import PostgresStore

    made = PostgresStore(pg_dsn)
    try:
        yield made
    finally:
        await anyio.to_thread.run_sync(made.close)


@pytest.fixture
async def auth(store: PostgresStore) -> dict[str, str]:
    text, _ = await anyio.to_thread.run_sync(Tokens(store).create, "admin", "test")
    return {"Authorization": f"Bearer {text}"}


async def replica(pg_dsn: str, tmp: Path, name: str) -> tuple[str, Process]:
    """An `orchestra serve` replica on the database, ready; its URL and process."""
    port = free_port()
    log = tmp / f"replica-{name}.log"
    with log.open("w") as out:
        process = spawn(
            [sys.executable, "-m", "orchestra", "serve", "--agents", "tests/load_agents.py:build",
             "--dsn", pg_dsn, "--port", str(port), "--lease", str(LEASE), "--grace", "1"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=out,
            env={**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRA_WORKERS_TOKEN": WORKERS_TOKEN},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        with anyio.fail_after(30):
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    if (await client.get("/ready")).status_code == 200:
                        return url, Process(process, log)
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.05)


def worker(urls: list[str], calls: Path, tmp: Path, name: str) -> Process:
    """``orchestra worker --url U --url V ...`` for run "r" (it exits once the run is over)."""
    log = tmp / f"worker-{name}.log"
    with log.open("w") as out:
        process = spawn(
            [sys.executable, "-m", "orchestra", "worker", *(a for u in urls for a in ("--url", u)),
             "--agents", "tests/worker_job.py:agents", "--run-id", "r", "--grace", "0"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=out,
            env={**os.environ, "PYTHONPATH": str(REPO), "WORKER_CALLS": str(calls),
                 "WORKER_CONCURRENCY": str(CONCURRENCY), "ORCHESTRA_TOKEN": WORKERS_TOKEN},
        )  # fmt: skip
    return Process(process, log)


def ran(calls: Path) -> list[tuple[str, str]]:
    """Every agent call so far: (task id, the worker's pid)."""
    if not calls.exists():
        return []
    return [(t, p) for t, p in (line.split() for line in calls.read_text().splitlines())]


async def until(check: Callable[[], Any], within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while not check():
            await anyio.sleep(0.05)


class TestAReplicaKilledUnderLoad:
    async def test_10000_tasks_through_three_workers_survive_it_each_result_recorded_once(
        self, pg_dsn: str, store: PostgresStore, auth: dict[str, str], tmp_path: Path
    ) -> None:
        (a, on_a), (b, on_b) = (
            await replica(pg_dsn, tmp_path, "a"),
            await replica(pg_dsn, tmp_path, "b"),
        )
        calls = tmp_path / "calls"
        # Two workers use A (B their fallback), one uses B (A its fallback).
        workers = [
            worker([a, b], calls, tmp_path, "0"),
            worker([a, b], calls, tmp_path, "1"),
            worker([b, a], calls, tmp_path, "2"),
        ]
        tasks = [{"kind": "work", "id": f"t{i}", "payload": i} for i in range(TASKS)]
        async with httpx.AsyncClient(base_url=a, headers=auth, timeout=60) as client:
            answer = await client.post("/api/runs", json={"tasks": tasks, "run_id": "r"})
        assert answer.status_code == 202, answer.text

        # A (the run's coordinator, and two workers' service) killed a quarter of the way in.
        await until(lambda: len(ran(calls)) >= TASKS // 4)
        on_a.process.send_signal(signal.SIGKILL)
        on_a.process.wait()
        at_kill = Counter(p for _, p in ran(calls))

        reports = []
        for w in workers:
            with anyio.fail_after(60):
                while w.process.poll() is None:
                    await anyio.sleep(0.05)
            assert w.process.returncode == 0, w.text()
            found = REPORT.search(w.text())
            assert found is not None, w.text()
            reports.append(dict(zip(REPORT_KEYS, map(int, found.groups()), strict=True)))
        assert on_b.process.poll() is None, on_b.text()

        # The workers of A went on through B: they ran tasks after the kill.
        after = Counter(p for _, p in ran(calls))
        for w in workers[:2]:
            assert after[str(w.pid)] > at_kill[str(w.pid)], w.text()
        # Every task's result recorded once, and the run's result is every task's.
        async with httpx.AsyncClient(base_url=b, headers=auth, timeout=60) as client:
            run = (await client.get("/api/runs/r")).json()
            result = (await client.get("/api/runs/r/result")).json()
        assert (run["state"], run["counts"]) == ("closed", {"succeeded": TASKS}), run
        assert result["data"] == {f"t{i}": 2 * i for i in range(TASKS)}
        journal = await anyio.to_thread.run_sync(store.events, "r")
        ends = Counter(e["task_id"] for e in journal if e["event"] == "succeeded")
        assert ends == {f"t{i}": 1 for i in range(TASKS)}
        # What the workers report adds up: each claim completed, refused (a completion repeated
        # on B whose first answer was lost with A) or lost; the completions the store took are
        # the run's tasks, less those repeated.
        for r in reports:
            assert r["claimed"] == r["completed"] + r["refused"] + r["lost"] + r["released"], r
        assert TASKS - sum(r["refused"] for r in reports) <= sum(r["completed"] for r in reports)
        assert sum(r["completed"] for r in reports) <= TASKS
        # Every task run; twice only what the workers held when A died (a claim or a completion
        # whose answer was lost with A), never more than twice.
        runs = Counter(t for t, _ in ran(calls))
        assert set(runs) == {f"t{i}" for i in range(TASKS)}
        twice = [t for t, n in runs.items() if n > 1]
        assert max(runs.values()) <= 2
        assert len(twice) <= 2 * CONCURRENCY, (len(twice), reports)
