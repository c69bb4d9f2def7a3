"""The service on PostgreSQL (the session's real server, tests/pg.py): a run submitted, read back
and streamed, and tokens kept in the database, hashed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from orchestra import Orchestrator, Task, agent
from orchestra._service._events import key_of
from orchestra._service._tokens import Tokens
from tests.service_kit import Api, server, serving, told_in_order

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from orchestra.stores._postgres._store import PostgresStore

pytestmark = [pytest.mark.postgres, pytest.mark.subprocess]


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    from orchestra.stores._postgres._store import PostgresStore

    made = PostgresStore(pg_dsn, poll=0.2)
    try:
        yield made
    finally:
        await anyio.to_thread.run_sync(made.close)


class TestOnPostgres:
    async def test_a_run_submitted_ends_with_its_result_and_its_journal_streams(
        self, store: PostgresStore
    ) -> None:
        async with serving(store) as api:
            body = {"tasks": [{"kind": "echo", "id": "a", "payload": 1},
                              {"kind": "fail", "id": "b"}], "run_id": "pg-1"}  # fmt: skip
            answer = await api.client.post("/api/runs", json=body, headers=api.auth("submit"))
            assert answer.status_code == 202
            await api.handle("pg-1")
            result = (await api.client.get("/api/runs/pg-1/result", headers=api.auth())).json()
            assert result["status"] in ("partial", "failed")
            assert result["data"] == {"a": 1}
            runs = (await api.client.get("/api/runs", headers=api.auth())).json()["runs"]
            assert [(r["id"], r["counts"]) for r in runs] == [
                ("pg-1", {"succeeded": 1, "failed": 1})
            ]
            letters = (
                await api.client.get("/api/runs/pg-1/dead-letters", headers=api.auth())
            ).json()
            assert [(d["task_id"], d["agent"]) for d in letters] == [("b", "fail")]
            task = (await api.client.get("/api/runs/pg-1/tasks/b", headers=api.auth())).json()
            assert (task["state"], task["agent"]) == ("failed", "fail")  # its last attempt's
            async with (
                server(api.app) as url,
                httpx.AsyncClient(timeout=30) as client,
                client.stream("GET", f"{url}/api/runs/pg-1/events", headers=api.auth()) as stream,
            ):
                lines = [line async for line in stream.aiter_lines()]
            data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            assert data[-1] == {"run_id": "pg-1", "state": "closed", "status": result["status"]}
            journal = await anyio.to_thread.run_sync(store.events, "pg-1")
            assert [key_of(e) for e in data[:-1]] == sorted(key_of(e) for e in journal)
            mid = journal[len(journal) // 2]["at"]
            later = await anyio.to_thread.run_sync(lambda: store.events("pg-1", since=mid))
            assert later == [e for e in journal if e["at"] >= mid]

    async def test_an_idempotency_key_with_another_request_is_a_409_and_a_refused_run_runs_fixed(
        self, store: PostgresStore
    ) -> None:
        async with serving(store) as api:
            headers = {**api.auth("submit"), "Idempotency-Key": "k-pg"}
            body = {"tasks": [{"kind": "echo", "id": "a", "payload": 1}]}
            first = await api.client.post("/api/runs", json=body, headers=headers)
            assert first.status_code == 202
            other = {"tasks": [{"kind": "echo", "id": "a", "payload": 2}]}
            reused = await api.client.post("/api/runs", json=other, headers=headers)
            assert (reused.status_code, reused.json()["error"]) == (409, "idempotency_key_reused")
            again = await api.client.post("/api/runs", json=body, headers=headers)
            assert again.json() == {"run_id": first.json()["run_id"], "created": False}
            await api.handle(first.json()["run_id"])
            # A run refused at admission lets go of its lease: the same id, fixed, runs now.
            typo = {"tasks": [{"kind": "ecoh", "id": "a", "payload": 1}], "run_id": "typo"}
            refused = await api.client.post("/api/runs", json=typo, headers=api.auth("submit"))
            assert refused.status_code == 400
            fixed = {"tasks": [{"kind": "echo", "id": "a", "payload": 1}], "run_id": "typo"}
            started = await api.client.post("/api/runs", json=fixed, headers=api.auth("submit"))
            assert started.json() == {"run_id": "typo", "created": True}
            with anyio.fail_after(10):
                assert (await api.handle("typo")).data == {"a": 1}

    async def test_tokens_are_kept_hashed_in_the_database_and_revoked_within_their_ttl(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        import asyncpg

        async with serving(store, app_token_ttl=0.05) as api:
            tokens = Tokens(store)
            text, info = await anyio.to_thread.run_sync(tokens.create, "read", "dashboard")
            assert info.role == "read"
            ok = await api.client.get("/api/runs", headers={"Authorization": f"Bearer {text}"})
            assert ok.status_code == 200
            conn = await asyncpg.connect(pg_dsn)
            try:
                kept = await conn.fetchval(
                    "SELECT hash FROM orchestra.tokens WHERE id = $1", info.id
                )
            finally:
                await conn.close()
            assert kept != text
            assert len(kept) == 64
            revoked = await anyio.to_thread.run_sync(tokens.revoke, "dashboard")
            assert [r.id for r in revoked] == [info.id]
            await anyio.sleep(0.06)  # past the time to live of the service's trust in it
            refused = await api.client.get("/api/runs", headers={"Authorization": f"Bearer {text}"})
            assert refused.status_code == 401

    async def test_lists_the_newest_runs_first_a_page_at_a_time(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        import asyncpg

        # Seven runs, three created at the same instant (a page ends between two of them), and
        # one with tasks: counted.
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.executemany(
                "INSERT INTO orchestra.runs (id, created, state) "
                "VALUES ($1, to_timestamp($2), $3)",
                [(f"r{i}", 1000.0 + min(i, 4) + 0.000001, "closed" if i % 2 else "open")
                 for i in range(7)],
            )  # fmt: skip
        finally:
            await conn.close()
        async with serving(store) as api:
            api.gate.set()
            await api.submit({"tasks": [{"kind": "echo", "id": "a"}], "run_id": "now"})
            await api.handle("now")
            newest_first = ["now", "r6", "r5", "r4", "r3", "r2", "r1", "r0"]
            seen: list[dict[str, Any]] = []
            cursor: str | None = None
            while True:
                params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
                page = (await api.client.get("/api/runs", params=params, headers=api.auth())).json()
                seen += page["runs"]
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            assert [r["id"] for r in seen] == newest_first
            assert seen[0]["counts"] == {"succeeded": 1}
            assert all(r["counts"] == {} for r in seen[1:])
            closed = await api.client.get(
                "/api/runs", params={"state": "closed", "cursor": "r5"}, headers=api.auth()
            )
            assert [r["id"] for r in closed.json()["runs"]] == ["r3", "r1"]
            unknown = await api.client.get(
                "/api/runs", params={"cursor": "nope"}, headers=api.auth()
            )
            assert (unknown.status_code, unknown.json()["field"]) == (400, "cursor")


class TestTwoProcessesOnOneDatabase:
    async def test_the_other_streams_the_run_and_controls_it_through_its_holder(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        from orchestra.stores._postgres._store import PostgresStore

        other_store = PostgresStore(pg_dsn, poll=0.2)
        try:
            async with serving(store) as first, serving(other_store) as second:
                run_id = await first.submit({"tasks": [{"kind": "wait", "id": "a"}]})
                paused = await second.client.post(
                    f"/api/runs/{run_id}/pause", headers=second.auth("control")
                )
                assert paused.status_code == 200, paused.text
                assert paused.json() == {"run_id": run_id, "paused": True}
                assert first.handle(run_id).paused
                resumed = await second.client.post(
                    f"/api/runs/{run_id}/resume", headers=second.auth("control")
                )
                assert resumed.json() == {"run_id": run_id, "paused": False}
                assert not first.handle(run_id).paused
                refused = await second.client.post(  # the first's refusal, passed on as it is
                    f"/api/runs/{run_id}/cancel", json={"priority": [5, 1]}, headers=second.auth()
                )
                assert refused.status_code == 400
                assert refused.json()["field"] == "priority"
                assert "low <= high" in refused.json()["message"]
                listed = (await second.client.get("/api/runs", headers=second.auth())).json()
                assert [(r["id"], r["live"], r["held_by"] is not None) for r in listed["runs"]] == [
                    (run_id, False, True)
                ]
                async with (
                    server(second.app) as url,
                    httpx.AsyncClient(timeout=30) as client,
                    client.stream(
                        "GET", f"{url}/api/runs/{run_id}/events", headers=second.auth()
                    ) as stream,
                ):
                    first.gate.set()  # the run ends in the first process
                    lines = [line async for line in stream.aiter_lines()]
                data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
                assert ("a", "succeeded") in {(d.get("task_id"), d.get("event")) for d in data}
                assert data[-1] == {"run_id": run_id, "state": "closed", "status": None}
        finally:
            await anyio.to_thread.run_sync(other_store.close)

    async def test_a_request_no_replica_answers_is_a_503_and_withdrawn(
        self, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import asyncpg

        from orchestra._service import _replicas
        from orchestra.stores._postgres._store import PostgresStore

        monkeypatch.setattr(_replicas, "ANSWER_WITHIN", 0.5)
        gate = anyio.Event()

        @agent(kinds=["wait"])
        async def wait(task: Task, ctx: object) -> None:
            await gate.wait()

        # A run a program holds (its lease renewed: nobody takes it over), written down as a
        # replica's that is gone: a control request for it waits for an answer that never comes.
        program_store = PostgresStore(pg_dsn, poll=0.2)
        store = PostgresStore(pg_dsn, poll=0.2, lease=1.0)
        conn = await asyncpg.connect(pg_dsn)
        try:
            async with (
                Orchestrator(agents=[wait], store=program_store) as orch,
                serving(store) as api,
            ):
                handle = orch.start(tasks=[Task(kind="wait", id="a")], run_id="orphan")
                await handle.admitted()
                await conn.execute(
                    "INSERT INTO orchestra.service_runs (id, replica, submission) "
                    "VALUES ('orphan', 'gone:1:x', '{}')"
                )
                answer = await api.client.post("/api/runs/orphan/pause", headers=api.auth())
                assert answer.status_code == 503
                assert answer.headers["Retry-After"] == "5"
                assert "did not answer" in answer.json()["message"]
                assert await conn.fetchval("SELECT count(*) FROM orchestra.service_control") == 0
                assert not handle.paused
                gate.set()
                await handle
        finally:
            await conn.close()
            await anyio.to_thread.run_sync(store.close)
            await anyio.to_thread.run_sync(program_store.close)

    async def test_control_of_a_run_a_program_holds_is_a_409_naming_it(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        from orchestra.stores._postgres._store import PostgresStore

        gate = anyio.Event()

        @agent(kinds=["wait"])
        async def wait(task: Task, ctx: object) -> None:
            await gate.wait()

        program_store = PostgresStore(pg_dsn, poll=0.2)
        try:
            async with (
                Orchestrator(agents=[wait], store=program_store) as orch,
                serving(store) as api,
            ):
                handle = orch.start(tasks=[Task(kind="wait", id="a")], run_id="program")
                await handle.admitted()
                with anyio.fail_after(10):
                    while (await anyio.to_thread.run_sync(store.run_info, "program")) is None:
                        await anyio.sleep(0.05)
                held = await api.client.post("/api/runs/program/pause", headers=api.auth("control"))
                assert held.status_code == 409
                assert held.json()["error"] == "held_elsewhere"
                assert "another process" in held.json()["message"]
                gate.set()
                await handle
        finally:
            await anyio.to_thread.run_sync(program_store.close)


class TestTheEventStreamOnPostgres:
    async def test_an_event_a_long_open_transaction_commits_late_comes_in_order_once(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        """A transaction dates its rows by its start: one held open past the settle window, while
        a later one commits a later-dated event, commits its own behind it. The stream holds the
        later event back until then, and delivers both in the journal's order, once each."""
        insert = (
            "INSERT INTO orchestra.events (run_id, task_id, event, detail) "
            "VALUES ('held', 'a', 'note', $1)"
        )
        async with serving(store) as api:
            await api.submit({"tasks": [{"kind": "wait", "id": "a"}], "run_id": "held"})
            got: list[tuple[str, dict[str, object]]] = []

            async def read(url: str) -> None:
                event_id, data = "", None
                async with (
                    httpx.AsyncClient(timeout=30) as client,
                    client.stream("GET", f"{url}/api/runs/held/events", headers=api.auth()) as s,
                ):
                    async for line in s.aiter_lines():
                        if line.startswith("id: "):
                            event_id = line[4:]
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                        elif line == "" and data is not None:
                            got.append((event_id, data))
                            event_id, data = "", None

            def notes() -> list[object]:
                return [e["detail"] for _, e in got if e.get("event") == "note"]

            early, late = await _orchestra_session(pg_dsn), await _orchestra_session(pg_dsn)
            try:
                async with server(api.app) as url, anyio.create_task_group() as tg:
                    tg.start_soon(read, url)
                    with anyio.fail_after(10):
                        while not got:  # the stream runs: a's admission came
                            await anyio.sleep(0.02)
                    held = early.transaction()
                    await held.start()
                    await early.execute(insert, "early")  # dated now: its transaction's start
                    await anyio.sleep(0.05)
                    await late.execute(insert, "later")  # dated later, committed at once
                    await anyio.sleep(1.5)  # past the settle window
                    assert notes() == []  # the later one waits for what may precede it
                    await held.commit()
                    with anyio.fail_after(10):
                        while len(notes()) < 2:
                            await anyio.sleep(0.02)
                    api.gate.set()  # the run ends, and its stream
            finally:
                await early.close()
                await late.close()
        assert notes() == ["early", "later"]
        journal = await anyio.to_thread.run_sync(store.events, "held")
        events = [(i, e) for i, e in got if "event" in e]
        told_in_order([e for _, e in events], journal)
        # Nothing late: a's start is told while it runs (no journal row says it until it ended).
        ids = [json.loads(i) for i, _ in events]
        assert ids == sorted(ids)
        assert len({tuple(i) for i in ids}) == len(ids)


async def _orchestra_session(dsn: str, name: str = "orchestra test:1") -> Any:
    """A connection named as orchestra names its sessions (one that may write the journal)."""
    import asyncpg

    return await asyncpg.connect(dsn, server_settings={"application_name": name})


class TestTheHorizonOnPostgres:
    """A stream waits only for orchestra's own transactions, and for those only so long."""

    @staticmethod
    async def _read(api: Api, url: str, run_id: str, got: list[tuple[str, dict[str, Any]]]) -> None:
        event_id, data = "", None
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("GET", f"{url}/api/runs/{run_id}/events", headers=api.auth()) as s,
        ):
            async for line in s.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                elif line == "" and data is not None:
                    got.append((event_id, data))
                    event_id, data = "", None

    async def test_another_applications_open_transaction_holds_no_stream_back(
        self, store: PostgresStore, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import asyncpg

        from orchestra._service import _events

        monkeypatch.setattr(_events, "BOUND", 60.0)  # not let go for its age: not ours
        other = await asyncpg.connect(pg_dsn)  # as psql would: no orchestra name
        try:
            held = other.transaction()
            await held.start()
            await other.fetchval("SELECT txid_current()")  # a transaction id: it writes
            async with serving(store) as api, server(api.app) as url:
                body = {"tasks": [{"kind": "echo", "id": "a"}, {"kind": "wait", "id": "w"}],
                        "run_id": "psql"}  # fmt: skip
                await api.submit(body)
                got: list[tuple[str, dict[str, Any]]] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read, api, url, "psql", got)
                    with anyio.fail_after(10):  # told while the run goes on, w waiting
                        while ("a", "succeeded") not in {
                            (e.get("task_id"), e.get("event")) for _, e in got
                        }:
                            await anyio.sleep(0.02)
                    api.gate.set()
            await held.rollback()
        finally:
            await other.close()
        *events, end = got
        assert end[1]["state"] == "closed"
        journal = await anyio.to_thread.run_sync(store.events, "psql")
        told_in_order([e for _, e in events], journal)

    async def test_a_transaction_of_ours_held_past_the_bound_is_let_go_and_told_late_once(
        self, store: PostgresStore, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An orchestra session that keeps a transaction open (its process stopped) holds the
        stream back for `BOUND` seconds, not for ever; the event it commits afterwards, dated by
        its start, comes late, once."""
        from orchestra._service import _events

        monkeypatch.setattr(_events, "BOUND", 1.0)
        stalled = await _orchestra_session(pg_dsn, "orchestra stalled:1")
        try:
            async with serving(store) as api, server(api.app) as url:
                body = {"tasks": [{"kind": "echo", "id": "a"}, {"kind": "wait", "id": "w"}],
                        "run_id": "stalled"}  # fmt: skip
                await api.submit(body)
                held = stalled.transaction()
                await held.start()
                await stalled.execute(
                    "INSERT INTO orchestra.events (run_id, task_id, event, detail) "
                    "VALUES ('stalled', 'a', 'note', 'from a stalled process')"
                )
                got: list[tuple[str, dict[str, Any]]] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read, api, url, "stalled", got)
                    with anyio.fail_after(10):  # told once the bound passed
                        while ("a", "succeeded") not in {
                            (e.get("task_id"), e.get("event")) for _, e in got
                        }:
                            await anyio.sleep(0.02)
                    await held.commit()
                    with anyio.fail_after(10):
                        while "note" not in {e.get("event") for _, e in got}:
                            await anyio.sleep(0.02)
                    api.gate.set()
        finally:
            await stalled.close()
        *events, end = got
        assert end[1]["state"] == "closed"
        journal = await anyio.to_thread.run_sync(store.events, "stalled")
        keys = [key_of(e) for _, e in events if e["event"] != "started"]
        assert sorted(keys) == sorted(key_of(e) for e in journal if e["event"] != "started")
        starts = sorted(e["task_id"] for _, e in events if e["event"] == "started")
        assert starts == ["a", "w"]  # each once (told live, or by its row once it ended)
        (note,) = [(i, e) for i, e in events if e["event"] == "note"]
        assert key_of(note[1]) < tuple(
            json.loads(note[0])
        )  # late: behind the cursor it was sent with

    async def test_a_running_tasks_start_is_told_while_it_runs_and_once(
        self, store: PostgresStore
    ) -> None:
        """No journal row says a task started until it ended: the stream tells the start of a
        task it sees leased, and not again when the ended task's row says it."""
        async with serving(store) as api, server(api.app) as url:
            body = {"tasks": [{"kind": "echo", "id": "a"}, {"kind": "wait", "id": "w"}],
                    "run_id": "live"}  # fmt: skip
            await api.submit(body)
            got: list[tuple[str, dict[str, Any]]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, api, url, "live", got)
                with anyio.fail_after(10):  # told while w waits for its gate
                    while ("w", "started") not in {
                        (e.get("task_id"), e.get("event")) for _, e in got
                    }:
                        await anyio.sleep(0.02)
                api.gate.set()
        *events, end = got
        assert end[1]["state"] == "closed"
        journal = await anyio.to_thread.run_sync(store.events, "live")
        starts = [e["task_id"] for _, e in events if e["event"] == "started"]
        assert sorted(starts) == ["a", "w"]  # each once, whether told live or from its row
        assert sorted(key_of(e) for _, e in events if e["event"] != "started") == sorted(
            key_of(e) for e in journal if e["event"] != "started"
        )
        (w_start,) = [e for _, e in events if e["task_id"] == "w" and e["event"] == "started"]
        (w_end,) = [e for _, e in events if e["task_id"] == "w" and e["event"] == "succeeded"]
        assert key_of(w_start) < key_of(w_end)
        ids = [json.loads(i) for i, _ in events]
        assert ids == sorted(ids)
