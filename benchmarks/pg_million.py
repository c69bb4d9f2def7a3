"""A million tasks through PostgreSQL: one streamed run watched every second.

    python -m benchmarks.pg_million [N] [--workers W] [--kill-at K] [--collect] [--json FILE]

A coordinator process (``orch.run(gen(), run_id=R)`` on ``PostgresStore(dsn)``, the tasks coming
from a generator of N no-op tasks, ``aggregate=Discard()``) and W worker processes
(``orch.work(store, run_id=R)``, a no-op agent, concurrency 100) on one embedded durable server
(`benchmarks.postgres.shared_server`), a fresh database. With workers, the coordinator's own agent
takes almost nothing (one slot, 10 ms a call), as in ``pg_orchestra_W``; alone (W = 0), it runs
every task with a no-op agent at the run's limit.

Sampled every second: the coordinator's RSS, how many tasks its generator handed over, what
`handle.status()` says and what it cost; the workers' RSS (``/proc``); the database's size, each
table's live and dead tuples and autovacuum runs (``pg_stat_user_tables``). Reported: tasks/s per
slice of N/10, the peak RSS of every process, the database's size at the end, the status's cost.

``--kill-at K`` SIGKILLs the coordinator once K tasks ended and starts a standby with the same
run id and the same generator: how long it takes to open the run again (its RSS then) and to end it.

Not in the suite's runner (a run takes minutes): ``python -m benchmarks --only pg-million`` would
hold the runner for ~5 minutes a repetition; run this by hand, its numbers go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .postgres import BATCH, KIND, Processes, drop_database, fresh_database, shared_server

if TYPE_CHECKING:
    import subprocess

RUN_ID = "million"
TABLES = ("tasks", "ended", "events", "attempts", "edges", "runs", "workers")


def _rss_mb(pid: int | None = None) -> float:
    """The resident set of `pid` (this process by default) in MB, from ``/proc``."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _hwm_mb(pid: int) -> float:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --------------------------------------------------------------------------- the coordinator


def graph(parents: int, children: int) -> list[Any]:
    """The fan-out/fan-in graph: `parents` tasks, each with `children` tasks depending on it and
    one verifier depending on its children, listed parent by parent."""
    from orchestra import Task

    tasks = []
    for p in range(parents):
        tasks.append(Task(KIND, p, id=f"p{p}"))
        kids = [f"p{p}.c{c}" for c in range(children)]
        tasks.extend(Task(KIND, c, id=kid, depends_on=[f"p{p}"]) for c, kid in enumerate(kids))
        tasks.append(Task(KIND, -1, id=f"p{p}.verify", depends_on=kids))
    return tasks


async def coordinate(
    dsn: str, n: int, workers: int, collect: bool, shape: str = "stream", fail_every: int = 0
) -> None:
    """The coordinator process: one JSON line a second, and the result's at the end."""
    from orchestra import Discard, Orchestrator, PermanentError, Task, agent
    from orchestra.stores import PostgresStore

    @agent(kinds=[KIND], name=KIND, concurrency=1 if workers else None)
    async def own(task: Any, ctx: Any) -> None:
        if workers:  # the workers' run: this one takes almost nothing
            await asyncio.sleep(0.010)
        if fail_every and task.payload % fail_every == 0:
            raise PermanentError("a dead letter")

    pulled = 0

    async def tasks() -> Any:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield Task(KIND, i)

    store = PostgresStore(dsn)
    orch = Orchestrator(
        agents=[own], store=store, concurrency=BATCH, aggregate=None if collect else Discard()
    )
    print("ready", flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
        raise SystemExit("no go")
    began = time.perf_counter()
    async with orch:
        if shape == "graph":  # n parents x 100 children + a verifier each, as one list
            listed = graph(n // 102, 100)
            pulled = len(listed)
            handle = orch.start(tasks=listed, run_id=RUN_ID)
        else:
            handle = orch.start(tasks=tasks(), run_id=RUN_ID)

        async def watch() -> None:
            while True:
                t0 = time.perf_counter()
                try:
                    status = handle.status()
                except Exception:  # not started yet
                    status = None
                cost = (time.perf_counter() - t0) * 1e3
                line = {
                    "t": time.time(),
                    "pulled": pulled,
                    "rss": _rss_mb(),
                    "status_ms": cost,
                    "completed": status.completed if status else 0,
                    "total": status.total if status else 0,
                }
                print("sample " + json.dumps(line), flush=True)
                await asyncio.sleep(1.0)

        watcher = asyncio.create_task(watch())
        result = await handle
        run_s = time.perf_counter() - began
        watcher.cancel()
        rss_result = _rss_mb()
    store.close()
    out = {
        "status": result.status,
        "counts": dict(result.metadata.counts),
        "run_s": run_s,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_at_result": rss_result,
        "finished": time.time(),
    }
    print(json.dumps(out), flush=True)


async def work(dsn: str, fail_every: int) -> None:
    """A worker process: a no-op agent at concurrency 100 (with `fail_every` K > 0, the tasks
    whose payload is a multiple of K fail for good: dead letters)."""
    from orchestra import Orchestrator, PermanentError, agent
    from orchestra.stores import PostgresStore

    @agent(kinds=[KIND], name=KIND)
    async def noop(task: Any, ctx: Any) -> None:
        if fail_every and task.payload % fail_every == 0:
            raise PermanentError("a dead letter")

    store = PostgresStore(dsn)
    orch = Orchestrator(agents=[noop], concurrency=BATCH)
    print("ready", flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
        raise SystemExit("no go")
    try:
        report = await orch.work(store, run_id=RUN_ID)
    finally:
        store.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"done": report.completed, "peak_rss": peak}), flush=True)


# --------------------------------------------------------------------------- the watcher


class Lines:
    """A process's stdout read in a thread: its ``sample`` lines kept, the others too."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.samples: list[dict[str, Any]] = []
        self.other: list[str] = []
        self.proc = proc
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("sample "):
                self.samples.append(json.loads(line[7:]))
            else:
                self.other.append(line.strip())

    @property
    def last(self) -> dict[str, Any]:
        return self.samples[-1] if self.samples else {}


async def _db_sample(conn: Any) -> dict[str, Any]:
    rows = await conn.fetch(
        "SELECT relname, n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count, "
        "pg_total_relation_size(relid) AS bytes "
        "FROM pg_stat_user_tables WHERE schemaname = 'orchestra' AND relname = ANY ($1::text[])",
        list(TABLES),
    )
    size = await conn.fetchval("SELECT pg_database_size(current_database())")
    return {
        "db_mb": size / 2**20,
        "tables": {
            r["relname"]: {
                "live": r["n_live_tup"],
                "dead": r["n_dead_tup"],
                "autovacuum": r["autovacuum_count"],
                "mb": r["bytes"] / 2**20,
            }
            for r in rows
        },
    }


async def measure(
    n: int,
    workers: int,
    kill_at: int | None,
    collect: bool,
    shape: str = "stream",
    fail_every: int = 0,
) -> dict[str, Any]:
    import asyncpg

    dsn = await fresh_database()
    aggregate = "collect" if collect else "discard"
    coord_args = ["coordinate", dsn, str(n), str(workers), aggregate, shape, str(fail_every)]
    mod = "benchmarks.pg_million"
    coordinator = Processes([coord_args], module=mod)
    pool = Processes([["work", dsn, str(fail_every)] for _ in range(workers)], module=mod)
    standby: Processes | None = None
    probe = await asyncpg.connect(dsn)
    samples: list[dict[str, Any]] = []
    events: dict[str, Any] = {}
    try:
        await coordinator.ready()
        await pool.ready()
        (cproc,) = coordinator.procs
        lines = Lines(cproc)
        start = time.time()
        coordinator.go()
        pool.go()
        watched: Lines | None = lines
        while True:
            await asyncio.sleep(1.0)
            sample: dict[str, Any] = {"t": time.time() - start}
            if watched is not None:
                sample["coordinator"] = watched.last
            sample["workers_rss"] = [_rss_mb(p.pid) for p in pool.procs if p.poll() is None]
            with contextlib.suppress(Exception):
                sample.update(await _db_sample(probe))
            samples.append(sample)
            done = sample.get("coordinator", {}).get("completed", 0)
            print(
                f"{sample['t']:7.1f}s done {done:>8} pulled "
                f"{sample.get('coordinator', {}).get('pulled', 0):>8} "
                f"rss {sample.get('coordinator', {}).get('rss', 0):6.0f} "
                f"w {[round(r) for r in sample['workers_rss']]} db {sample.get('db_mb', 0):6.0f}MB "
                f"dead {sample.get('tables', {}).get('tasks', {}).get('dead', 0)} "
                f"ended {sample.get('tables', {}).get('ended', {}).get('live', 0)}",
                file=sys.stderr,
                flush=True,
            )
            if kill_at is not None and standby is None and done >= kill_at:
                events["killed_at"] = done
                events["killed_rss"] = sample["coordinator"].get("rss")
                events["killed_hwm"] = _hwm_mb(cproc.pid)
                cproc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(cproc.wait)
                killed = time.time()
                standby = Processes([coord_args], module=mod)
                await standby.ready()
                (sproc,) = standby.procs
                watched = Lines(sproc)
                standby.go()
                events["standby_started"] = time.time() - killed
                continue
            if watched is not None and watched.proc.poll() is not None:
                watched.thread.join(5)
                break
        final = json.loads(watched.other[-1]) if watched and watched.other else {}
        if kill_at is not None and standby is None:
            # The coordinator ended (or died) before the kill point: no take-over to time.
            events["error"] = (
                f"the coordinator exited with code {cproc.returncode} at {done} tasks, before "
                f"the kill point {kill_at}"
            )
        elif kill_at is not None:
            first = next((s for s in watched.samples if s["total"]), {}) if watched else {}
            events["standby_first_status_s"] = (first.get("t", 0) - killed) if first else None
        out_w = await pool.outputs()
        peaks_w = [o.get("peak_rss") for o in out_w]
        final_db = await _db_sample(probe)
        counted = await probe.fetchrow(
            "SELECT count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER "
            "(WHERE attempts > 1) FROM orchestra.tasks WHERE run_id = $1",
            RUN_ID,
        )
        assert counted is not None  # an aggregate's one row
    finally:
        coordinator.kill()
        pool.kill()
        if standby is not None:
            standby.kill()
        await probe.close()
        await drop_database(dsn)
    return {
        "n": n,
        "workers": workers,
        "final": final,
        "workers_done": out_w,
        "workers_peak": peaks_w,
        "db_end": final_db,
        "succeeded_rows": counted[0],
        "retried_rows": counted[1],
        "events": events,
        "samples": samples,
    }


def slices(out: dict[str, Any], parts: int = 10) -> list[float]:
    """Tasks/s over each tenth of the run, from the coordinator's own samples (its clock) and its
    end (a resumed run's standby counts the tasks it took back as ended)."""
    n = out["n"]
    points = [
        (s["coordinator"]["t"], s["coordinator"]["completed"])
        for s in out["samples"]
        if s.get("coordinator")
    ]
    if out["final"].get("finished"):
        points.append((out["final"]["finished"], n))
    points.sort()
    rates = []
    for k in range(parts):
        lo, hi = n * k / parts, n * (k + 1) / parts
        t_lo = next((t for t, c in points if c >= lo), None)
        t_hi = next((t for t, c in points if c >= hi), None)
        if t_lo is None or t_hi is None or t_hi <= t_lo:
            rates.append(float("nan"))
        else:
            rates.append((hi - lo) / (t_hi - t_lo))
    return rates


def main(argv: list[str]) -> int:
    if argv and argv[0] == "work":
        asyncio.run(work(argv[1], int(argv[2])))
        return 0
    if argv and argv[0] == "coordinate":
        dsn, n, workers, agg, shape, fail_every = argv[1:7]
        asyncio.run(coordinate(dsn, int(n), int(workers), agg == "collect", shape, int(fail_every)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_million")
    parser.add_argument("n", nargs="?", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--collect", action="store_true")
    parser.add_argument(
        "--graph", action="store_true", help="N/102 parents x 100 children + verifiers"
    )
    parser.add_argument("--fail-every", type=int, default=0, help="every K-th task fails for good")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with shared_server():
        shape = "graph" if args.graph else "stream"
        out = asyncio.run(
            measure(args.n, args.workers, args.kill_at, args.collect, shape, args.fail_every)
        )
    out["slices"] = slices(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
