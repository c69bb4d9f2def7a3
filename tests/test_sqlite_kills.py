"""Durable runs killed with a real SIGKILL at 31 seeded points, and resumed (some killed twice).

Each seed runs tests/killed_run.py's run (dependencies, a fan-out with `ctx.spawn`, a group awaited
by tag, retries, a fallback, a task that fails for good, a streamed or a listed input) in a forked
child killed at the seed's point, reads what the database file committed, resumes the run (killed
again, for some seeds) and finally runs it to its end. Every agent call is in a side file (task id,
attempt, pid). The checks:

(a) the final `RunResult` equals an uninterrupted run's (status, data, errors, counts);
(b) no task that had ended in a commit before a kill executed again;
(c) a task that ran but had not ended in a commit ran again, its attempts counted: every call's
    attempt number continues from the attempts committed before the kill, and the file's final
    count is the committed one plus the calls after it;
(d) no spawned or decomposed task is duplicated: the file holds each expected task once.

The children are forked from one server process (tests/killed_run.py) that imported orchestra
once, so a seed costs its runs (tens of milliseconds each), not three interpreter start-ups.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from orchestra import RunResult
from tests.helpers import spawn

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX fork and signals"),
]

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "tests" / "killed_run.py"

WORK = [f"w{i}" for i in range(16)]
EXPECTED = {*WORK, "total", "split", "s0", "s1", "s2", "gather", "r0", "r1", "bad", "after"}
TERMINAL = {"succeeded", "failed", "skipped", "cancelled"}
NEW = ("new", 0)  # a task the file did not hold: (state, attempts)

# The seed is the index: each plan is the kill points of one seed's processes, in order.
PLANS: list[tuple[str, ...]] = [
    ("calls:1",),
    ("calls:4",),
    ("calls:8",),
    ("calls:13",),
    ("calls:19",),
    ("calls:24",),
    ("calls:28",),
    ("input:2",),
    ("input:9",),
    ("input:16",),
    ("input:22",),
    ("commit:1",),
    ("commit:3",),
    ("committed:2",),
    ("committed:4",),
    ("spawned:split",),
    ("after:split",),
    ("in:s1",),
    ("in:gather",),
    ("retry:w3",),
    ("retry:w12",),
    ("fallback:r0",),
    ("end",),
    ("external",),
    ("external",),
    ("external",),
    ("external",),
    ("calls:5", "calls:6"),
    ("input:6", "commit:2"),
    ("retry:w7", "calls:1"),
    ("external", "end"),
]


def streams(seed: int) -> bool:
    """Whether the seed's input is streamed (an async generator) or a list."""
    return any(kill.startswith("input:") for kill in PLANS[seed]) or seed % 2 == 1


def delay(seed: int) -> float:
    """When the seed process sends its SIGKILL, for an ``external`` kill (10 to 120 ms in)."""
    return random.Random(seed).uniform(0.01, 0.12)


class Server:
    """tests/killed_run.py, serving one request at a time."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._stderr = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def run(self, folder: Path, plan: tuple[str, ...], stream: bool, after: float) -> Report:
        request = {"dir": str(folder), "plan": list(plan), "stream": stream, "delay": after}
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer == "done 0\n", f"{answer!r}\n{self.log.read_text()[-3000:]}"
        return Report(folder, json.loads((folder / "report.json").read_text()), self.log)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.close()


class Report:
    """What one seed left: its processes (kill point, pid, exit code, what the file committed
    when it ended), the calls each made, and the final `RunResult`."""

    def __init__(self, folder: Path, report: dict[str, Any], log: Path) -> None:
        self.phases: list[dict[str, Any]] = report["phases"]
        self.log = log
        text = report["result"]
        assert text is not None, f"the last process wrote no result\n{log.read_text()[-3000:]}"
        self.result = RunResult.model_validate_json(text)
        phase_of = {phase["pid"]: n for n, phase in enumerate(self.phases)}
        # calls[n][task id] = the attempt numbers of that task's calls in process n, in order
        self.calls: list[dict[str, list[int]]] = [defaultdict(list) for _ in self.phases]
        for line in (folder / "calls.txt").read_text().splitlines():
            task_id, attempt, pid = line.split()
            self.calls[phase_of[int(pid)]][task_id].append(int(attempt))

    def committed(self, n: int) -> dict[str, tuple[str, int]]:
        """What the file held when process n ended: task id -> (state, attempts)."""
        return {
            t: (state, attempts) for t, (state, attempts) in self.phases[n]["committed"].items()
        }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    serving = Server(tmp_path_factory.mktemp("server") / "stderr.txt")
    yield serving
    serving.close()


@pytest.fixture(scope="module")
def uninterrupted(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> dict[bool, RunResult]:
    """The run to its end, never killed: with a listed input and with a streamed one."""
    return {
        stream: server.run(tmp_path_factory.mktemp(f"whole-{stream}"), (), stream, 0.0).result
        for stream in (False, True)
    }


def errors(result: RunResult) -> list[tuple[Any, ...]]:
    """The errors, without timings and attempt numbers (a resumed task's count goes on)."""
    return sorted(
        (
            e.task_id,
            e.kind,
            e.status,
            e.error_type,
            e.message,
            tuple((a.agent, a.error_type, a.message) for a in e.attempts),
        )
        for e in result.errors
    )


class TestKilledAndResumed:
    def test_the_uninterrupted_run_is_the_same_listed_or_streamed(
        self, uninterrupted: dict[bool, RunResult]
    ) -> None:
        listed, streamed = uninterrupted[False], uninterrupted[True]
        assert listed.status == streamed.status == "partial"  # "bad" fails, "after" is skipped
        assert listed.data == streamed.data
        assert set(listed.data) == EXPECTED - {"bad", "after"}
        assert listed.data["gather"] == {"id": "gather", "value": 2 * (10 + 11 + 12)}
        assert errors(listed) == errors(streamed)
        assert listed.metadata.retries == 3  # the three flaky tasks
        assert listed.metadata.fallbacks == 2  # r0 and r1 went to "lenient"

    @pytest.mark.parametrize(
        "seed",
        range(len(PLANS)),
        ids=[f"{seed}-{'+'.join(plan)}" for seed, plan in enumerate(PLANS)],
    )
    def test_resumed_run_redoes_nothing_committed_and_ends_as_the_uninterrupted_one(
        self, server: Server, uninterrupted: dict[bool, RunResult], tmp_path: Path, seed: int
    ) -> None:
        plan = PLANS[seed]
        stream = streams(seed)
        report = server.run(tmp_path, plan, stream, delay(seed))
        kills = len(plan)
        assert [p["code"] for p in report.phases] == [-9] * kills + [0], report.log.read_text()

        for n in range(kills + 1):
            before = report.committed(n - 1) if n else {}
            for task_id, numbers in report.calls[n].items():
                state, count = before.get(task_id, NEW)
                # (b) nothing that had ended in a commit runs again
                assert state not in TERMINAL, (n, task_id, before)
                # (c) the attempt numbers go on from the committed count
                assert numbers == list(range(count + 1, count + 1 + len(numbers))), (n, task_id)
        for n in range(kills):
            # (c) what ran (in this process or before) but had not ended in a commit runs again
            at_kill = report.committed(n)
            ran = {t for calls in report.calls[: n + 1] for t in calls}
            later = {t for calls in report.calls[n + 1 :] for t in calls}
            unfinished = {t for t in ran if at_kill.get(t, NEW)[0] not in TERMINAL}
            assert unfinished <= later, (n, unfinished - later)

        # (c) the last process's count: the attempts committed before it, plus its own calls
        last, final = report.committed(kills - 1), report.committed(kills)
        for task_id, (state, attempts) in final.items():
            assert state in TERMINAL, task_id
            earlier = last.get(task_id, NEW)[1]
            assert attempts == earlier + len(report.calls[kills].get(task_id, [])), task_id
        # (d) each task once in the file: no spawn, no decomposed task twice
        assert sorted(final) == sorted(EXPECTED)

        # (a) the uninterrupted run's result
        whole, result = uninterrupted[stream], report.result
        assert result.status == whole.status
        assert result.data == whole.data
        assert errors(result) == errors(whole)
        assert result.metadata.counts == whole.metadata.counts
        assert result.metadata.counts_by_kind == whole.metadata.counts_by_kind
        assert result.metadata.total == whole.metadata.total == len(EXPECTED)
        assert result.metadata.resumed == sum(s in TERMINAL for s, _ in last.values())


# A long fast streamed run that writes one byte to a side file for each result it reads: a SIGKILL
# cannot lose it (the kernel has it), so the side file's size is what the caller had read.
BEHIND = textwrap.dedent("""
    import os, sys
    import anyio
    from orchestra import Discard, Orchestrator, Task, agent
    from orchestra.stores import SQLiteStore

    db, read, concurrency, pause, window = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
    fd = os.open(read, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    @agent(kinds=["work"], concurrency=int(concurrency))
    async def quick(task, ctx):
        await anyio.sleep(pause)
        return task.payload

    async def source():
        for i in range(20_000):
            yield Task("work", i, id=f"t{i}")

    async def main():
        store = SQLiteStore(db, window=window, busy_timeout=600)
        async with Orchestrator(agents=[quick], store=store, aggregate=Discard()) as orch:
            async for _ in orch.stream(tasks=source(), run_id="behind"):
                os.write(fd, b".")

    anyio.run(main)
""")


def _committed_successes(conn: sqlite3.Connection) -> int:
    try:
        (n,) = conn.execute(
            "SELECT count(*) FROM tasks WHERE run_id = 'behind' AND state = 'succeeded'"
        ).fetchone()
    except sqlite3.OperationalError:  # no schema yet
        return 0
    return int(n)


class TestKilledWhileTheWriterIsBehind:
    def test_a_kill_loses_at_most_the_results_of_three_windows(self, tmp_path: Path) -> None:
        db, read = tmp_path / "runs.db", tmp_path / "read.txt"
        concurrency, pause, window = 8, 0.002, 0.05
        child = spawn(
            [sys.executable, "-c", BEHIND, str(db), str(read), str(concurrency), str(pause),
             str(window)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        holder = sqlite3.connect(db, isolation_level=None, timeout=60)  # another writer
        try:
            deadline = time.monotonic() + 60
            while _committed_successes(holder) < 1_000:  # the run is under way
                assert child.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # The file is locked from here: the child's writer thread waits for it, for good.
            holder.execute("BEGIN IMMEDIATE")
            at_lock = _committed_successes(holder)
            # The child runs on until it waits for its writer: what it read stops growing.
            seen, still = -1, 0
            while still < 5:
                assert child.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.1)
                size = read.stat().st_size
                seen, still = size, still + 1 if size == seen else 0
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            if holder.in_transaction:
                holder.execute("ROLLBACK")
            holder.close()
        # What the caller had read and the file does not hold runs again on resume: the results
        # of the window being gathered and the two handed to the writer, no more. Each worker ends
        # a task at most every `pause`; a window gathers for `window` seconds (twice that allows
        # for its timer firing late on a busy machine).
        per_window = concurrency * (2 * window / pause + 1)
        assert 0 < seen - at_lock <= 3 * per_window, (seen, at_lock)
