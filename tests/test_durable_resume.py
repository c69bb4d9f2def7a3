"""What a resumed run reads back of its ended tasks, the same on every durable store (a SQLite
file, the session's PostgreSQL server): the run opened again on the same database."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from orchestra import Context, Orchestrator, PermanentError, Task, agent
from orchestra.stores import SQLiteStore

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from orchestra.stores import PostgresStore


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.subprocess]),
    ]
)
def reopen(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], SQLiteStore | PostgresStore]:
    """A store opened anew, on the same database, at each call."""
    if request.param == "sqlite":
        return lambda: SQLiteStore(tmp_path / "r.db")
    from orchestra.stores import PostgresStore

    dsn: str = request.getfixturevalue("pg_dsn")
    return lambda: PostgresStore(dsn, poll=0.1)


class TestAResumedRunKeepsWhatItsTasksFailed:
    async def test_a_success_by_default_is_listed_and_keeps_its_failed_attempt(
        self, reopen: Callable[[], SQLiteStore | PostgresStore]
    ) -> None:
        @agent(kinds=["fallen", "plain"])
        async def fragile(task: Task, ctx: Context) -> Any:
            if task.kind == "plain":
                return task.payload
            raise PermanentError("never")

        tasks = [Task("fallen", 0, id="d"), Task("plain", 1, id="p")]
        runs = []
        for _ in range(2):  # the second run of the id resumes it: every task read back
            store = reopen()
            try:
                async with Orchestrator(
                    agents=[fragile], store=store, defaults={"fallen": "fallback"}
                ) as orch:
                    # streamed: a resume reads its ended tasks back a page at a time
                    handle = orch.start(iter(tasks), run_id="r")
                    stream = handle.results()
                    result = await handle
                    heard = {r.task.id: r async for r in stream}
            finally:
                store.close()
            runs.append((result, heard))
        (first, heard_first), (again, heard_again) = runs
        assert again.data == first.data == {"d": "fallback", "p": 1}
        assert again.metadata.defaulted == first.metadata.defaulted == ["d"]
        for heard in (heard_first, heard_again):
            assert heard["d"].defaulted
            assert [(a.number, a.error_type) for a in heard["d"].failures or ()] == [
                (1, "PermanentError")
            ]
