"""Scenario 13, workers over HTTP (issue 27's benchmark): claim + complete of no-op tasks through
the service's workers' routes (``orchestra worker --url``), against workers on the database
(``orchestra worker --dsn``), on the same embedded PostgreSQL server, in the same run.

The runner shares scenario 12's server (`postgres.shared_server`, durable); each measurement makes
a fresh database on it. Untimed: the service process (``python -m benchmarks.service serve``:
uvicorn over the app, its store a `PostgresStore` on that database, its runs started paused so its
own no-op agent runs none of their tasks) is started and answers ``/health``; the run of N no-op
tasks is submitted through ``POST /api/runs`` and admitted; W worker processes (``worker-http``:
the `Worker` of ``orchestra worker --url`` over `ServiceBackend`; ``worker-db``: ``orch.work(
PostgresStore(dsn), run_id=...)``, as ``orchestra worker --dsn``), each with a no-op agent at
concurrency 100, are started and connected (the HTTP ones said hello). **Clock**: from ``go`` to
the last worker's end of work: each serves the run only and returns once the service's coordinator
closed it (every claim leased and fenced, every completion committed, every end heard).

- ``svc_http_W``: W workers through the service (one service process, one uvicorn worker).
- ``svc_db_W``: W workers on the database, the same service coordinating.

Checked after: N tasks succeeded, each at its first attempt. The issue's target: the HTTP workers
reach at least half the database workers' throughput, W for W.

- ``svc_events_sse``: **event-to-client latency**. The service process (``serve-events``) runs a
  run of N tasks itself, its agent 30 ms a call at concurrency `EVENTS_CONCURRENCY` (about
  `EVENTS_CONCURRENCY / 0.03` tasks/s, a start and an end each: ~1,000 transitions/s measured), while
  this process reads the run's events as an SSE client (``GET /api/runs/{id}/events``). For each
  event delivered in order: its arrival less its time in the journal (the database's `now()`, its
  transaction's start: no later than its commit, so the sample is an upper bound of commit to
  arrival), p50 / p95 / max, for the tasks' ends (the steady stream) and for their admissions
  (one burst when the run is submitted). A task's start is read from its row once it ended (it is
  dated by the claiming process's clock): the stream tells it late, counted, not sampled. The
  issue's target: p95 ≤ 500 ms. **To the page** as well, when Debian's Chromium and Playwright are
  here: the dashboard open on the run in a headless Chromium, a `MutationObserver` on its events
  table noting when each row first shows; for each end shown (the table holds the latest 20, so a
  sample of them), that time less its time in the journal, the first `PAGE_WARMUP` seconds of the
  page's stream left out (it reads the journal from its start).
- ``svc_events_sse_sqlite``: the same, the service's store a SQLite file (the embedded default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from . import postgres

if TYPE_CHECKING:
    from .spec import Spec

    Workload = postgres.Workload

RUN_ID = "bench"
KIND = postgres.KIND
BATCH = postgres.BATCH
WORKERS = (1, 2)
PATHS = ("http", "db")
EVENTS = "svc_events_sse"
#: The same on the embedded default: the service's store a SQLite file (``orchestra serve --db``).
EVENTS_SQLITE = "svc_events_sse_sqlite"
VARIANTS = (*(f"svc_{path}_{w}" for w in WORKERS for path in PATHS), EVENTS, EVENTS_SQLITE)
#: The events run's agent: this many calls at once, each 30 ms.
EVENTS_CONCURRENCY = 26
EVENTS_CALL = 0.030
CHROMIUM = "/usr/bin/chromium"
#: Seconds of the page's stream not sampled: it opens after the run began and reads it from its start.
PAGE_WARMUP = 2.0


def build(spec: Spec) -> Workload:
    if spec.variant in (EVENTS, EVENTS_SQLITE):
        return events(spec)
    _, path, workers = spec.variant.split("_")
    if path not in PATHS or not workers.isdigit():
        raise ValueError(f"unknown service variant {spec.variant!r}")

    async def run() -> dict[str, Any]:
        dsn = await postgres.fresh_database()
        try:
            return await _measure(dsn, spec.n, path, int(workers))
        finally:
            await postgres.drop_database(dsn)

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_service(
    dsn: str, port: int, worker_token: str, admin_token: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.service", "serve", dsn, str(port), worker_token,
         admin_token],
        cwd=postgres.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


async def _measure(dsn: str, n: int, path: str, workers: int) -> dict[str, Any]:
    import asyncpg
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    worker_token, admin_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    service = _start_service(dsn, port, worker_token, admin_token)
    command = ["worker-http", url, worker_token] if path == "http" else ["worker-db", dsn]
    procs = postgres.Processes([command] * workers, module="benchmarks.service")
    probe = await asyncpg.connect(dsn)
    try:
        async with httpx.AsyncClient(
            base_url=url, timeout=120, headers={"Authorization": f"Bearer {admin_token}"}
        ) as client:
            await _serving(client, service)
            tasks = [{"kind": KIND, "payload": i} for i in range(n)]
            answer = await client.post("/api/runs", json={"tasks": tasks, "run_id": RUN_ID})
            if answer.status_code != 202:
                raise RuntimeError(f"the run was not accepted: {answer.text}")
            await procs.ready()
            start = time.time()
            procs.go()
            outputs = await procs.outputs()
            run_s = max(o["finished"] for o in outputs) - start
            run = (await client.get(f"/api/runs/{RUN_ID}")).json()
        once = await probe.fetchval(
            "SELECT count(*) FROM orchestra.tasks WHERE run_id = $1 AND state = 'succeeded' "
            "AND attempts = 1",
            RUN_ID,
        )
    finally:
        procs.kill()
        await probe.close()
        service.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.communicate(timeout=30)
        if service.poll() is None:
            service.kill()
            service.communicate()
    done = [o["done"] for o in outputs]
    out: dict[str, Any] = {
        "completed": sum(done),
        "workers": workers,
        "path": path,
        "run_s": run_s,
        "tasks_per_s": n / run_s,
        "by_worker": done,
    }
    if run.get("state") != "closed" or once != n:
        out["error"] = f"run {run.get('state')}, {once} of {n} tasks succeeded at their first try"
    return out


def _start_events_service(dsn: str, port: int, token: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.service", "serve-events", dsn, str(port), token],
        cwd=postgres.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


async def _serving(client: Any, service: subprocess.Popen[str]) -> None:
    """Wait, untimed, until the service answers its health check."""
    import httpx

    deadline = time.monotonic() + postgres.WAIT
    while time.monotonic() < deadline:
        if service.poll() is not None:
            raise RuntimeError(f"the service did not start: {service.communicate()[1][-800:]}")
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the service did not answer in {postgres.WAIT:g} s")


def events(spec: Spec) -> Workload:
    """``svc_events_sse``: from each event's time in the journal to its arrival at an SSE
    client, while the run does ~1,000 transitions/s."""

    async def run() -> dict[str, Any]:
        if spec.variant == EVENTS_SQLITE:
            import tempfile

            with tempfile.TemporaryDirectory() as where:
                return await _measure_events(f"sqlite:{where}/events.db", spec.n)
        dsn = await postgres.fresh_database()
        try:
            return await _measure_events(dsn, spec.n)
        finally:
            await postgres.drop_database(dsn)

    return run


async def _measure_events(dsn: str, n: int) -> dict[str, Any]:
    import json

    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    token = secrets.token_urlsafe(32)
    service = _start_events_service(dsn, port, token)
    auth = {"Authorization": f"Bearer {token}"}
    arrivals: list[tuple[float, str, dict[str, Any]]] = []  # (arrival, id, event)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=auth) as client:
            await _serving(client, service)
            tasks = [{"kind": KIND, "payload": i} for i in range(n)]
            answer = await client.post("/api/runs", json={"tasks": tasks, "run_id": RUN_ID})
            if answer.status_code != 202:
                raise RuntimeError(f"the run was not accepted: {answer.text}")
            event_id, data = "", None
            over = asyncio.Event()
            watching = asyncio.ensure_future(_page(url, token, over))
            streamed = time.time()
            async with client.stream("GET", f"/api/runs/{RUN_ID}/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("id: "):
                        event_id = line[4:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                    elif line == "" and data is not None:
                        if "event" in data:
                            arrivals.append((time.time(), event_id, data))
                        event_id, data = "", None
            over.set()
            seen = await watching
            run = (await client.get(f"/api/runs/{RUN_ID}")).json()
    finally:
        service.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.communicate(timeout=30)
        if service.poll() is None:
            service.kill()
            service.communicate()
    # In order: a fresh id. Late: the cursor's id again (a task's start read from its ended row).
    late = sum(1 for k in range(1, len(arrivals)) if arrivals[k][1] == arrivals[k - 1][1])
    # The ends after the stream's first `PAGE_WARMUP` seconds (it opens once the run is admitted
    # and reads the journal from its start), as the page's; a run shorter than that (the smoke
    # size), all of them.
    told = [
        (e["at"], (t - e["at"]) * 1e3)
        for k, (t, i, e) in enumerate(arrivals)
        if e["event"] == "succeeded" and (k == 0 or i != arrivals[k - 1][1])
    ]
    ends = sorted(ms for at, ms in told if at > streamed + PAGE_WARMUP) or sorted(
        ms for _, ms in told
    )
    admitted = sorted((t - e["at"]) * 1e3 for t, _, e in arrivals if e["event"] == "admitted")
    times = sorted(e["at"] for _, _, e in arrivals if e["event"] == "succeeded")
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    q = postgres._quantile
    out: dict[str, Any] = {
        "completed": len(times),
        "samples": len(ends),
        "sse_p50_ms": q(ends, 0.50),
        "sse_p95_ms": q(ends, 0.95),
        "sse_max_ms": ends[-1],
        "admitted_p50_ms": q(admitted, 0.50),
        "admitted_p95_ms": q(admitted, 0.95),
        # Starts and ends over the time the ends span: the run's transitions per second.
        "transitions_per_s": 2 * len(times) / span,
        "late": late,
    }
    if seen is not None:
        opened, rows = seen
        at = {(e["task_id"], e["event"]): e["at"] for _, _, e in arrivals}
        page = sorted(
            (t / 1e3 - at[(task, event)]) * 1e3
            for t, task, event in rows
            if event == "succeeded"
            and (task, event) in at
            and at[(task, event)] > opened + PAGE_WARMUP
        )
        out["page_samples"] = len(page)
        if page:
            out["page_p50_ms"] = q(page, 0.50)
            out["page_p95_ms"] = q(page, 0.95)
    if run.get("state") != "closed" or len(times) != n:
        out["error"] = f"run {run.get('state')}, {len(times)} of {n} ends delivered"
    return out


# The rows the dashboard's events table shows, noted as they first show: [ms since the epoch,
# task id, event] (its cells are time, event, task, ...).
_OBSERVE = """
() => {
  window.__shown = [];
  const seen = new Set();
  const body = document.querySelector("#events tbody");
  new MutationObserver(() => {
    const now = Date.now();
    for (const row of body.rows) {
      const key = row.cells[2].textContent + " " + row.cells[1].textContent;
      if (!seen.has(key)) { seen.add(key); window.__shown.push([now, row.cells[2].textContent, row.cells[1].textContent]); }
    }
  }).observe(body, { childList: true });
}
"""


async def _page(url: str, token: str, over: asyncio.Event) -> tuple[float, list[Any]] | None:
    """The dashboard open on the run in a headless Chromium (beside the SSE client, which it does
    not delay), its events table observed until `over`: when its stream opened and the rows it
    showed; None without Chromium or Playwright here."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        return None
    if not await asyncio.to_thread(os.path.exists, CHROMIUM):
        return None
    import tempfile

    with tempfile.TemporaryDirectory() as profile:
        async with async_playwright() as playwright:
            context = await playwright.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                      "--no-first-run", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync"],
            )  # fmt: skip
            try:
                page = await context.new_page()
                await page.goto(f"{url}/#run={RUN_ID}")
                await page.fill("#token", token)
                await page.click("#token-form button[type=submit]")
                await page.wait_for_selector("#app", state="visible")
                opened = time.time()
                await page.evaluate(_OBSERVE)
                await over.wait()
                await asyncio.sleep(0.5)  # the last events drawn
                rows: list[Any] = await page.evaluate("window.__shown")
                return opened, rows
            finally:
                await context.close()


# --------------------------------------------------------------------------- process modes


def _serve(dsn: str, port: int, worker_token: str, admin_token: str) -> None:
    """The service: uvicorn over the app, its runs started paused (its agent runs none)."""
    import uvicorn

    from orchestra import Orchestrator, RunHandle
    from orchestra._service._tokens import Tokens
    from orchestra.service import create_app
    from orchestra.stores import PostgresStore

    class Paused(Orchestrator):
        def start(self, input: Any = None, **options: Any) -> RunHandle:
            handle = super().start(input, **options)
            handle.pause()
            return handle

    store = PostgresStore(dsn)
    tokens = Tokens(store)
    tokens.ensure(worker_token, "worker", "bench workers")
    tokens.ensure(admin_token, "admin", "bench")
    app = create_app(Paused(agents=[postgres._noop()], store=store), grace=0.0)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    finally:
        store.close()


def _serve_events(dsn: str, port: int, token: str) -> None:
    """The service of ``svc_events_sse``: its runs' agent 30 ms a call, `EVENTS_CONCURRENCY`
    at once; its store PostgreSQL at `dsn`, or the SQLite file of ``sqlite:PATH``."""
    import anyio
    import uvicorn

    from orchestra import Orchestrator, agent
    from orchestra._service._tokens import Tokens
    from orchestra.service import create_app
    from orchestra.stores import PostgresStore, SQLiteStore

    @agent(kinds=[KIND], name=KIND)
    async def call(task: Any, ctx: Any) -> None:
        await anyio.sleep(EVENTS_CALL)

    store: Any = SQLiteStore(dsn[7:]) if dsn.startswith("sqlite:") else PostgresStore(dsn)
    Tokens(store).ensure(token, "admin", "bench")
    orch = Orchestrator(agents=[call], store=store, concurrency=EVENTS_CONCURRENCY)
    app = create_app(orch, grace=0.0)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    finally:
        store.close()


async def _worker_http(url: str, token: str) -> int:
    """``orchestra worker --url URL --run-id bench``, its agent a no-op."""
    from orchestra import Orchestrator
    from orchestra._core._orchestrator import LocalRuns
    from orchestra.stores._http._worker import ServiceBackend
    from orchestra.stores._worker import Worker

    orch = Orchestrator(agents=[postgres._noop()], concurrency=BATCH)
    async with orch, ServiceBackend(url, token) as backend:
        worker = Worker(LocalRuns(orch), backend, RUN_ID, None, backend.poll)
        await postgres._started()
        report = await worker.run()
    return report.completed


async def _worker_db(dsn: str) -> int:
    """``orchestra worker --dsn DSN --run-id bench``, its agent a no-op."""
    from orchestra import Orchestrator
    from orchestra.stores import PostgresStore

    store = PostgresStore(dsn)
    orch = Orchestrator(agents=[postgres._noop()], concurrency=BATCH)
    try:
        await postgres._started()
        report = await orch.work(store, run_id=RUN_ID)
    finally:
        store.close()
    return report.completed


def main(argv: list[str]) -> int:
    import json

    mode, args = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "serve" and len(args) == 4:
        _serve(args[0], int(args[1]), args[2], args[3])
        return 0
    if mode == "serve-events" and len(args) == 3:
        _serve_events(args[0], int(args[1]), args[2])
        return 0
    if mode == "worker-http" and len(args) == 2:
        done = asyncio.run(_worker_http(*args))
    elif mode == "worker-db" and len(args) == 1:
        done = asyncio.run(_worker_db(*args))
    else:
        print(
            "usage: python -m benchmarks.service serve DSN PORT WORKER_TOKEN ADMIN_TOKEN | "
            "serve-events DSN PORT TOKEN | worker-http URL TOKEN | worker-db DSN",
            file=sys.stderr,
        )
        return 2
    print(json.dumps({"done": done, "finished": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
