"""The service's REST API through httpx against the real app on a real SQLite file: submitting
runs (idempotently), reading them from the store, controlling the live ones, single tasks, the
tokens and roles of every route, and bad input answered with a 4xx JSON body, never a 500."""

from __future__ import annotations

import contextlib
import json
import re
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import InputError
from orchestra._service._tokens import TokenInfo, Tokens, Verified
from orchestra.stores import SQLiteStore
from tests.service_kit import Api, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    store = SQLiteStore(tmp_path / "service.db")
    try:
        async with serving(store, concurrency=1) as api:
            yield api
    finally:
        store.close()


def _tasks(*specs: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"tasks": [{"kind": kind, "id": task_id, "payload": task_id} for kind, task_id in specs],
            **extra}  # fmt: skip


async def _until(check: Any, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not check():
            await anyio.sleep(0.01)


class TestSubmittingARun:
    async def test_answers_202_with_the_run_id_and_the_run_ends_with_every_result(
        self, api: Api
    ) -> None:
        answer = await api.client.post(
            "/api/runs",
            json=_tasks(("echo", "a"), ("echo", "b"), run_id="r1"),
            headers=api.auth("submit"),
        )
        assert answer.status_code == 202
        assert answer.json() == {"run_id": "r1", "created": True}
        await api.handle("r1")
        result = await api.client.get("/api/runs/r1/result", headers=api.auth("read"))
        assert result.status_code == 200
        assert result.json()["status"] == "success"
        assert result.json()["data"] == {"a": "a", "b": "b"}

    async def test_the_same_idempotency_key_twice_is_one_run(self, api: Api) -> None:
        body = _tasks(("echo", "a"), ("echo", "b"))
        first = await api.client.post(
            "/api/runs", json=body, headers={**api.auth("submit"), "Idempotency-Key": "k-1"}
        )
        second = await api.client.post(
            "/api/runs", json=body, headers={**api.auth("submit"), "Idempotency-Key": "k-1"}
        )
        assert first.status_code == 202
        assert second.status_code == 200
        assert second.json() == {"run_id": first.json()["run_id"], "created": False}
        await api.handle(first.json()["run_id"])
        third = await api.client.post(
            "/api/runs", json=body, headers={**api.auth("submit"), "Idempotency-Key": "k-1"}
        )
        assert third.json() == {"run_id": first.json()["run_id"], "created": False}
        assert sorted(api.calls) == ["a", "b"]  # each task ran once: one run
        runs = (await api.client.get("/api/runs", headers=api.auth("read"))).json()["runs"]
        assert [r["id"] for r in runs] == [first.json()["run_id"]]

    async def test_the_same_key_with_another_request_is_a_409_and_starts_nothing(
        self, api: Api, tmp_path: Path
    ) -> None:
        headers = {**api.auth("submit"), "Idempotency-Key": "k-1"}
        first = await api.client.post("/api/runs", json=_tasks(("echo", "a")), headers=headers)
        assert first.status_code == 202
        other = await api.client.post("/api/runs", json=_tasks(("echo", "b")), headers=headers)
        assert other.status_code == 409
        assert other.json()["error"] == "idempotency_key_reused"
        assert other.json()["field"] == "Idempotency-Key"
        assert "k-1" in other.json()["message"]
        await api.handle(first.json()["run_id"])
        assert api.calls == ["a"]
        # The same request (its objects' fields in another order) is still the same run; and
        # a process serving the file afresh knows the key's request too.
        same = {"tasks": [{"payload": "a", "id": "a", "kind": "echo"}]}
        again = await api.client.post("/api/runs", json=same, headers=headers)
        assert again.json() == {"run_id": first.json()["run_id"], "created": False}
        fresh = SQLiteStore(tmp_path / "service.db")
        try:
            async with serving(fresh, concurrency=1) as other_api:
                reused = await other_api.client.post(
                    "/api/runs",
                    json=_tasks(("echo", "b")),
                    headers={**other_api.auth("submit"), "Idempotency-Key": "k-1"},
                )
                assert reused.status_code == 409
        finally:
            fresh.close()

    async def test_the_same_key_sent_twice_at_once_is_one_run(self, api: Api) -> None:
        body = _tasks(("echo", "a"))
        headers = {**api.auth("submit"), "Idempotency-Key": "together"}
        answers: list[Any] = []

        async def send() -> None:
            answers.append(await api.client.post("/api/runs", json=body, headers=headers))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(send)
        assert sorted(a.status_code for a in answers) == [200, 202]
        assert len({a.json()["run_id"] for a in answers}) == 1
        await api.handle(answers[0].json()["run_id"])
        assert api.calls == ["a"]

    async def test_another_idempotency_key_is_another_run(self, api: Api) -> None:
        one = await api.submit(_tasks(("echo", "a")), **{"Idempotency-Key": "k-1"})
        two = await api.submit(_tasks(("echo", "a")), **{"Idempotency-Key": "k-2"})
        assert one != two

    async def test_an_input_goes_to_the_decomposer(self, tmp_path: Path) -> None:
        store = SQLiteStore(tmp_path / "d.db")

        def split(text: str) -> list[Any]:
            from orchestra import Task

            return [Task("echo", word, id=word) for word in text.split()]

        try:
            async with serving(store, decomposer=split) as api:
                run_id = await api.submit({"input": "x y"})
                result = await api.handle(run_id)
                assert result.data == {"x": "x", "y": "y"}
        finally:
            store.close()

    async def test_a_task_of_a_kind_no_agent_serves_is_a_400_naming_it(self, api: Api) -> None:
        answer = await api.client.post(
            "/api/runs", json=_tasks(("nobody", "t9")), headers=api.auth("submit")
        )
        assert answer.status_code == 400
        assert "t9" in answer.json()["message"]
        assert "nobody" in answer.json()["message"]

    @pytest.mark.parametrize("by", ["run_id", "Idempotency-Key"])
    async def test_a_run_refused_at_admission_runs_once_submitted_again_corrected(
        self, api: Api, by: str
    ) -> None:
        name = {"run_id": "typo"} if by == "run_id" else {}
        headers = {**api.auth("submit"), "Idempotency-Key": "typo"} if by != "run_id" else None
        headers = headers or api.auth("submit")
        refused = await api.client.post(
            "/api/runs", json=_tasks(("ecoh", "a"), **name), headers=headers
        )
        assert refused.status_code == 400
        fixed = await api.client.post(
            "/api/runs", json=_tasks(("echo", "a"), **name), headers=headers
        )
        assert fixed.status_code == 202
        run_id = fixed.json()["run_id"]
        assert fixed.json() == {"run_id": run_id, "created": True}
        assert (await api.handle(run_id)).data == {"a": "a"}
        assert api.calls == ["a"]

    async def test_an_input_without_a_decomposer_is_a_400(self, api: Api) -> None:
        answer = await api.client.post("/api/runs", json={"input": 1}, headers=api.auth("submit"))
        assert answer.status_code == 400
        assert answer.json()["field"] == "input"


class TestReadingRuns:
    async def test_lists_runs_of_the_store_with_their_counts(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("echo", "a"), ("fail", "b")))
        await api.handle(run_id)
        runs = (await api.client.get("/api/runs", headers=api.auth("read"))).json()["runs"]
        (run,) = runs
        assert run["id"] == run_id
        assert run["counts"] == {"succeeded": 1, "failed": 1}
        assert run["live"] is False
        one = await api.client.get(f"/api/runs/{run_id}", headers=api.auth("read"))
        assert one.json() == run

    async def test_lists_the_newest_runs_first_a_page_at_a_time(
        self, api: Api, tmp_path: Path
    ) -> None:
        import sqlite3

        # Seven runs, three of them created at the same instant: a page ends between two of them.
        with contextlib.closing(sqlite3.connect(tmp_path / "service.db")) as conn, conn:
            conn.executemany(
                "INSERT INTO runs (id, created, updated, state) VALUES (?, ?, ?, ?)",
                [(f"r{i}", 1000.0 + min(i, 4), 1000.0, "closed" if i % 2 else "open")
                 for i in range(7)],
            )  # fmt: skip
        newest_first = ["r6", "r5", "r4", "r3", "r2", "r1", "r0"]
        seen: list[str] = []
        cursor: str | None = None
        for _ in range(4):
            params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
            page = (await api.client.get("/api/runs", params=params, headers=api.auth())).json()
            seen += [r["id"] for r in page["runs"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == newest_first
        everything = (await api.client.get("/api/runs", headers=api.auth())).json()
        assert [r["id"] for r in everything["runs"]] == newest_first
        assert everything["next_cursor"] is None
        last = await api.client.get(
            "/api/runs", params={"limit": 6, "cursor": "r6"}, headers=api.auth()
        )
        assert ([r["id"] for r in last.json()["runs"]], last.json()["next_cursor"]) == (
            newest_first[1:],
            None,
        )
        closed = await api.client.get(
            "/api/runs", params={"state": "closed", "limit": 2}, headers=api.auth()
        )
        assert [r["id"] for r in closed.json()["runs"]] == ["r5", "r3"]
        after = await api.client.get(
            "/api/runs",
            params={"state": "closed", "cursor": closed.json()["next_cursor"]},
            headers=api.auth(),
        )
        assert [r["id"] for r in after.json()["runs"]] == ["r1"]

    async def test_a_page_of_runs_refuses_an_unknown_cursor_and_a_limit_out_of_range(
        self, api: Api
    ) -> None:
        unknown = await api.client.get("/api/runs", params={"cursor": "nope"}, headers=api.auth())
        assert unknown.status_code == 400
        assert unknown.json()["field"] == "cursor"
        assert "nope" in unknown.json()["message"]
        for limit in (0, 501):
            answer = await api.client.get("/api/runs", params={"limit": limit}, headers=api.auth())
            assert answer.status_code == 422
        state = await api.client.get("/api/runs", params={"state": "gone"}, headers=api.auth())
        assert state.status_code == 422

    async def test_lists_a_run_another_process_wrote_to_the_file(
        self, api: Api, tmp_path: Path
    ) -> None:
        from orchestra import Orchestrator, Task, agent

        @agent(kinds=["echo"])
        async def echo(task: Task, ctx: object) -> Any:
            return task.payload

        other = SQLiteStore(tmp_path / "service.db")  # another store object: as another process
        try:
            await Orchestrator(agents=[echo], store=other).run(
                tasks=[Task("echo", 1, id="x")], run_id="elsewhere"
            )
        finally:
            other.close()
        runs = (await api.client.get("/api/runs", headers=api.auth("read"))).json()["runs"]
        assert [r["id"] for r in runs] == ["elsewhere"]
        answer = await api.client.get("/api/runs/elsewhere/result", headers=api.auth("read"))
        assert answer.status_code == 409  # the aggregate is kept only where the run ran
        task = await api.client.get("/api/runs/elsewhere/tasks/x", headers=api.auth("read"))
        assert task.json()["state"] == "succeeded"

    async def test_an_unknown_run_is_a_404_on_every_read(self, api: Api) -> None:
        for path in ("", "/result", "/status", "/tasks/t1", "/dead-letters", "/journal"):
            answer = await api.client.get(f"/api/runs/nope{path}", headers=api.auth("read"))
            assert answer.status_code == 404, path
            assert answer.json()["error"] == "not_found"

    async def test_the_result_is_a_409_while_the_run_goes_on(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("wait", "a")))
        answer = await api.client.get(f"/api/runs/{run_id}/result", headers=api.auth("read"))
        assert answer.status_code == 409
        assert answer.json()["error"] == "running"
        api.gate.set()
        await api.handle(run_id)

    async def test_the_status_is_the_handles(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("wait", "a"), ("echo", "b")))
        await _until(lambda: "a" in api.calls)
        status = (await api.client.get(f"/api/runs/{run_id}/status", headers=api.auth())).json()
        assert status["run_id"] == run_id
        assert status["total"] == 2
        assert status["active"] == 1
        api.gate.set()
        await api.handle(run_id)
        status = (await api.client.get(f"/api/runs/{run_id}/status", headers=api.auth())).json()
        assert status["completed"] == 2
        assert status == json.loads(json.dumps(api.handle(run_id).status().to_dict()))

    async def test_a_task_comes_with_its_attempts_from_the_journal(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("fail", "b")))
        await api.handle(run_id)
        task = (await api.client.get(f"/api/runs/{run_id}/tasks/b", headers=api.auth())).json()
        assert task["state"] == "failed"
        assert task["attempts"] == 1
        assert task["agent"] == "fail"  # its last attempt's, though its end names none
        assert next(e["event"] for e in task["events"]) == "admitted"
        assert task["events"][-1]["event"] == "failed"
        missing = await api.client.get(f"/api/runs/{run_id}/tasks/zz", headers=api.auth())
        assert missing.status_code == 404
        assert missing.json()["field"] == "task_id"

    async def test_the_journal_is_json_lines_in_order(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("echo", "a"), ("echo", "b")))
        await api.handle(run_id)
        answer = await api.client.get(f"/api/runs/{run_id}/journal", headers=api.auth("read"))
        assert answer.headers["content-type"].startswith("application/jsonl")
        lines = [json.loads(line) for line in answer.text.splitlines()]
        ats = [line["at"] for line in lines]
        assert ats == sorted(ats)
        assert {(line["task_id"], line["event"]) for line in lines} >= {
            ("a", "admitted"), ("a", "succeeded"), ("b", "admitted"), ("b", "succeeded")
        }  # fmt: skip


class TestDeadLetters:
    async def test_lists_the_failed_tasks_and_retry_runs_them_when_submitted_again(
        self, api: Api
    ) -> None:
        body = _tasks(("echo", "a"), ("fail", "b"), run_id="dl")
        await api.submit(body)
        await api.handle("dl")
        letters = (await api.client.get("/api/runs/dl/dead-letters", headers=api.auth())).json()
        assert [(d["task_id"], d["error_type"]) for d in letters] == [("b", "PermanentError")]
        assert letters[0]["attempts_list"][0]["agent"] == "fail"
        assert letters[0]["agent"] == "fail"  # the agent of its last attempt
        assert letters[0]["payload"] == "b"  # the task's payload, as JSON
        retried = await api.client.post(
            "/api/runs/dl/dead-letters/retry", json={"task_ids": ["b"]}, headers=api.auth("control")
        )
        assert retried.json() == {"reopened": ["b"]}
        api.service.ended.clear()  # (as a new process would: the run only in the file)
        again = await api.client.post("/api/runs", json=body, headers=api.auth("submit"))
        assert again.json() == {"run_id": "dl", "created": False}
        await api.handle("dl")
        assert api.calls == ["a", "b", "b"]  # a is not run again, b is

    async def test_retrying_a_task_that_did_not_fail_is_a_400_naming_it(self, api: Api) -> None:
        await api.submit(_tasks(("echo", "a"), run_id="ok"))
        await api.handle("ok")
        answer = await api.client.post(
            "/api/runs/ok/dead-letters/retry", json={"task_ids": ["a"]}, headers=api.auth()
        )
        assert answer.status_code == 400
        assert "'a'" in answer.json()["message"]
        assert answer.json()["field"] == "task_ids"


class TestControl:
    async def test_pause_holds_new_attempts_and_resume_lets_them_go(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("wait", "a"), ("echo", "b"), ("echo", "c")))
        await _until(lambda: "a" in api.calls)
        paused = await api.client.post(f"/api/runs/{run_id}/pause", headers=api.auth("control"))
        assert paused.json() == {"run_id": run_id, "paused": True}
        api.gate.set()  # a ends; b and c would start now if the run were not paused
        await _until(lambda: api.handle(run_id).status().completed == 1)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert api.calls == ["a"]
        summary = (await api.client.get(f"/api/runs/{run_id}", headers=api.auth())).json()
        assert summary["live"] is True
        assert summary["paused"] is True
        resumed = await api.client.post(f"/api/runs/{run_id}/resume", headers=api.auth("control"))
        assert resumed.json() == {"run_id": run_id, "paused": False}
        result = await api.handle(run_id)
        assert result.status == "success"
        assert api.calls == ["a", "b", "c"]

    async def test_cancel_ends_the_matching_tasks_and_skips_their_dependents(
        self, api: Api
    ) -> None:
        body = {
            "tasks": [
                {"kind": "wait", "id": "a"},
                {"kind": "echo", "id": "b", "depends_on": ["a"]},
                {"kind": "echo", "id": "c"},
            ]
        }
        run_id = await api.submit(body)
        await _until(lambda: "a" in api.calls)
        answer = await api.client.post(
            f"/api/runs/{run_id}/cancel", json={"task_id": "a"}, headers=api.auth("control")
        )
        assert answer.status_code == 200
        assert answer.json()["cancelled"] == ["a"]
        assert answer.json()["skipped"] == ["b"]
        result = await api.handle(run_id)
        assert {e.task_id: e.status for e in result.errors} == {"a": "cancelled", "b": "skipped"}
        assert "b" not in api.calls

    async def test_stop_ends_the_run_and_answers_its_result(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("wait", "a"), ("echo", "b")))
        await _until(lambda: "a" in api.calls)
        answer = await api.client.post(
            f"/api/runs/{run_id}/stop", json={"grace": 0}, headers=api.auth("control")
        )
        assert answer.status_code == 200
        assert answer.json()["status"] == "cancelled"
        assert api.handle(run_id).done

    async def test_reprioritize_moves_a_waiting_task_ahead(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("wait", "a"), ("echo", "b"), ("echo", "c")))
        await _until(lambda: "a" in api.calls)
        answer = await api.client.post(
            f"/api/runs/{run_id}/reprioritize",
            json={"task_id": "c", "priority": -5},
            headers=api.auth("control"),
        )
        assert answer.json() == {"changed": True}
        api.gate.set()
        await api.handle(run_id)
        assert api.calls == ["a", "c", "b"]

    async def test_control_of_a_run_another_process_runs_is_a_409_naming_it(
        self, api: Api, tmp_path: Path
    ) -> None:
        run_id = await api.submit(_tasks(("wait", "a")))
        other = SQLiteStore(tmp_path / "service.db")  # another store object: as another process
        try:
            async with serving(other) as second:
                answer = await second.client.post(
                    f"/api/runs/{run_id}/cancel", json={"kind": "wait"}, headers=second.auth()
                )
                assert answer.status_code == 409
                assert answer.json()["error"] == "held_elsewhere"
                assert "another process" in answer.json()["message"]
        finally:
            other.close()
        api.gate.set()
        await api.handle(run_id)

    async def test_control_of_a_run_that_ended_is_a_409(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("echo", "a")))
        await api.handle(run_id)
        answer = await api.client.post(f"/api/runs/{run_id}/pause", headers=api.auth("control"))
        assert answer.status_code == 409
        assert answer.json()["error"] == "not_running"


class TestSingleTasks:
    async def test_a_task_submitted_alone_runs_in_a_run_of_its_own(self, api: Api) -> None:
        answer = await api.client.post(
            "/tasks", json={"kind": "echo", "payload": {"x": 1}, "id": "solo"},
            headers=api.auth("submit"),
        )  # fmt: skip
        assert answer.status_code == 202
        assert answer.json() == {"task_id": "solo", "run_id": "task-solo"}
        await api.handle("task-solo")
        outcome = (await api.client.get("/tasks/solo", headers=api.auth("read"))).json()
        assert outcome["status"] == "succeeded"
        assert outcome["output"] == {"x": 1}
        again = await api.client.post(
            "/tasks", json={"kind": "echo", "id": "solo"}, headers=api.auth("submit")
        )
        assert again.status_code == 200
        assert api.calls == ["solo"]

    async def test_a_failed_task_says_why(self, api: Api) -> None:
        answer = await api.client.post("/tasks", json={"kind": "fail"}, headers=api.auth("submit"))
        task_id = answer.json()["task_id"]
        await api.handle(answer.json()["run_id"])
        outcome = (await api.client.get(f"/tasks/{task_id}", headers=api.auth("read"))).json()
        assert outcome["status"] == "failed"
        assert outcome["error_type"] == "PermanentError"
        assert "fails on purpose" in outcome["error"]

    async def test_an_unknown_task_is_a_404(self, api: Api) -> None:
        answer = await api.client.get("/tasks/none", headers=api.auth("read"))
        assert answer.status_code == 404


# Every route, the role it needs, and a request that would otherwise be good.
_ROUTES: list[tuple[str, str, str, Any]] = [
    ("POST", "/api/runs", "submit", {"tasks": [{"kind": "echo"}]}),
    ("GET", "/api/runs", "read", None),
    ("GET", "/api/runs/r", "read", None),
    ("GET", "/api/runs/r/result", "read", None),
    ("GET", "/api/runs/r/status", "read", None),
    ("POST", "/api/runs/r/pause", "control", None),
    ("POST", "/api/runs/r/resume", "control", None),
    ("POST", "/api/runs/r/cancel", "control", {"kind": "echo"}),
    ("POST", "/api/runs/r/stop", "control", {"grace": 0}),
    ("POST", "/api/runs/r/reprioritize", "control", {"task_id": "t", "priority": 1}),
    ("GET", "/api/runs/r/tasks/t", "read", None),
    ("GET", "/api/runs/r/dead-letters", "read", None),
    ("POST", "/api/runs/r/dead-letters/retry", "control", {}),
    ("GET", "/api/runs/r/journal", "read", None),
    ("GET", "/api/runs/r/events", "read", None),
    ("POST", "/tasks", "submit", {"kind": "echo"}),
    ("GET", "/tasks/t", "read", None),
    ("GET", "/metrics", "read", None),
]


class TestAuth:
    def test_the_matrix_covers_every_route_but_health_readiness_and_the_docs(
        self, api: Api
    ) -> None:
        served = {
            (method.upper(), path)
            for path, operations in api.app.openapi()["paths"].items()
            for method in operations
        }
        templated = {
            (
                method,
                re.sub(
                    r"/tasks/t$",
                    "/tasks/{task_id}",
                    re.sub(r"^/api/runs/r(?=/|$)", "/api/runs/{run_id}", path),
                ),
            )
            for method, path, _, _ in _ROUTES
        }
        # The workers' routes have their own matrix (tests/test_service_workers.py): a worker
        # token is let through only for the workers named with its id.
        workers = {(method, path) for method, path in served if path.startswith("/api/workers")}
        assert served - {("GET", "/health"), ("GET", "/ready")} - workers == templated

    @pytest.mark.parametrize(("method", "path", "role", "body"), _ROUTES)
    async def test_refuses_a_missing_a_wrong_and_an_under_privileged_token(
        self, api: Api, method: str, path: str, role: str, body: Any
    ) -> None:
        async def ask(headers: dict[str, str]) -> Any:
            return await api.client.request(method, path, json=body, headers=headers)

        missing = await ask({})
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert "bearer token" in missing.json()["message"]
        wrong = await ask({"Authorization": "Bearer orch_not-a-token"})
        assert wrong.status_code == 401
        for other in ("submit", "read", "control", "worker"):
            if other == role or (role, other) == ("read", "control"):
                continue
            under = await ask(api.auth(other))
            assert under.status_code == 403, other
            assert role in under.json()["message"]
        if role == "read":  # a controller sees what it steers
            assert (await ask(api.auth("control"))).status_code not in (401, 403)
        allowed = await ask(api.auth(role))
        assert allowed.status_code not in (401, 403)
        admin = await ask(api.auth("admin"))
        assert admin.status_code not in (401, 403)

    async def test_a_revoked_token_is_refused_once_its_time_to_live_passed(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteStore(tmp_path / "ttl.db")
        try:
            async with serving(store, app_token_ttl=0.05) as api:
                assert (await api.client.get("/api/runs", headers=api.auth())).status_code == 200
                api.service.tokens.revoke("test-admin")
                await anyio.sleep(0.06)
                answer = await api.client.get("/api/runs", headers=api.auth())
                assert answer.status_code == 401
        finally:
            store.close()

    async def test_a_token_found_live_is_trusted_for_its_time_to_live(self, api: Api) -> None:
        assert (await api.client.get("/api/runs", headers=api.auth())).status_code == 200
        api.service.tokens.revoke("test-admin")
        # Within the default time to live (seconds): the database is not asked again.
        assert (await api.client.get("/api/runs", headers=api.auth())).status_code == 200

    async def test_a_token_time_to_live_out_of_range_is_a_config_error(
        self, tmp_path: Path
    ) -> None:
        from orchestra import ConfigError
        from orchestra.service import create_app
        from tests.service_kit import orchestrator

        store = SQLiteStore(tmp_path / "bad.db")
        try:
            for ttl in (-1, 3600, float("nan")):
                with pytest.raises(ConfigError, match="token_ttl"):
                    create_app(orchestrator(store, [], anyio.Event()), token_ttl=ttl)
        finally:
            store.close()

    async def test_a_token_given_by_hand_is_kept_once_with_its_role(self, api: Api) -> None:
        text = "w" * 40
        headers = {"Authorization": f"Bearer {text}"}
        assert (await api.client.get("/api/runs", headers=headers)).status_code == 401
        first = api.service.tokens.ensure(text, "worker", "workers")
        again = api.service.tokens.ensure(text, "worker", "workers")
        assert first.id == again.id
        assert (await api.client.get("/api/runs", headers=headers)).status_code == 403
        with pytest.raises(InputError, match="32 characters"):
            api.service.tokens.ensure("short", "worker", "workers")

    async def test_a_token_given_by_hand_with_a_newline_is_kept_without_it(self, api: Api) -> None:
        # As `--workers-token "$(<file)"$'\n'` or a mounted secret gives it: the header that
        # carries it reaches the service stripped, so the token kept must be the same text.
        text = "v" * 40
        api.service.tokens.ensure(text + "\n", "worker", "workers")
        hello = await api.client.get(
            "/api/workers/hello", headers={"Authorization": f"Bearer {text}"}
        )
        assert hello.status_code == 200, hello.text

    async def test_health_and_readiness_need_no_token(self, api: Api) -> None:
        assert (await api.client.get("/health")).json() == {"status": "ok"}
        assert (await api.client.get("/ready")).json() == {"status": "ready"}

    async def test_tokens_are_kept_hashed_never_as_text(self, api: Api, tmp_path: Path) -> None:
        import sqlite3

        with sqlite3.connect(tmp_path / "service.db") as conn:
            rows = conn.execute("SELECT hash FROM tokens").fetchall()
        conn.close()
        kept = {row[0] for row in rows}
        assert len(kept) == len(api.tokens)
        assert not kept & set(api.tokens.values())
        assert all(len(h) == 64 for h in kept)


# Requests that are wrong, each answered with a 4xx and a JSON body saying what is wrong.
_BAD: list[tuple[str, str, Any, int, str]] = [
    ("POST", "/api/runs", b"{not json", 422, ""),
    ("POST", "/api/runs", {}, 422, "tasks"),
    ("POST", "/api/runs", {"tasks": []}, 422, "tasks"),
    ("POST", "/api/runs", {"tasks": [{"payload": 1}]}, 422, "kind"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo", "priority": "high"}]}, 422, "priority"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo", "colour": 1}]}, 422, "colour"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo", "timeout": -1}]}, 422, "timeout"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo"}], "input": 1}, 422, "exactly one"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo"}], "run_id": "a/b"}, 422, "run_id"),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo", "id": "x", "depends_on": ["x"]}]}, 400, "x"),
    (
        "POST",
        "/api/runs",
        {"tasks": [{"kind": "echo", "id": "x"}, {"kind": "echo", "id": "x"}]},
        400,
        "x",
    ),
    ("POST", "/api/runs", {"tasks": [{"kind": "echo", "depends_on": ["ghost"]}]}, 400, "ghost"),
    ("POST", "/api/runs", [1, 2], 422, ""),
    # Python's json reads NaN and Infinity; JSON has neither, and a store could not keep them.
    ("POST", "/api/runs", b'{"tasks": [{"kind": "echo", "payload": NaN}]}', 422, "NaN"),
    (
        "POST",
        "/api/runs",
        b'{"tasks": [{"kind": "echo", "metadata": {"w": -Infinity}}]}',
        422,
        "metadata",
    ),
    ("POST", "/api/runs", b'{"input": [1, Infinity]}', 422, "inf"),
    ("POST", "/tasks", b'{"kind": "echo", "payload": {"x": [NaN]}}', 422, "payload"),
    ("POST", "/api/runs/live/cancel", {}, 422, "at least one"),
    ("POST", "/api/runs/live/cancel", {"priority": [1]}, 422, "priority"),
    ("POST", "/api/runs/live/stop", {"grace": -1}, 422, "grace"),
    ("POST", "/api/runs/live/reprioritize", {"task_id": "a"}, 422, "priority"),
    ("POST", "/api/runs/live/dead-letters/retry", {"task_ids": "a"}, 422, "task_ids"),
    ("GET", "/api/runs/bad%20id", None, 422, "run_id"),
    ("POST", "/tasks", {"kind": "echo", "id": "a b"}, 400, "id"),
    ("POST", "/tasks", {"kind": 3}, 422, "kind"),
]


class _CountedTokens(Tokens):
    """The store's tokens, counting the database reads of `find`."""

    reads = 0

    async def find(self, token: str) -> TokenInfo | None:
        self.reads += 1
        return await super().find(token)


class TestVerifiedTokens:
    """The service's map of the tokens the database found live (`Verified`), on a fake clock."""

    @pytest.fixture
    def tokens(self, tmp_path: Path) -> Iterator[_CountedTokens]:
        store = SQLiteStore(tmp_path / "tokens.db")
        try:
            yield _CountedTokens(store)
        finally:
            store.close()

    async def test_a_live_token_is_read_from_the_database_once_a_time_to_live(
        self, tokens: _CountedTokens
    ) -> None:
        now = [100.0]
        verified = Verified(tokens, ttl=2.0, clock=lambda: now[0])
        text, info = tokens.create("worker", "w")
        for _ in range(3):
            assert await verified.find(text) == info
        assert tokens.reads == 1
        now[0] += 2.0
        assert await verified.find(text) == info
        assert tokens.reads == 2

    async def test_a_revoked_token_is_trusted_until_its_entry_expires_then_refused(
        self, tokens: _CountedTokens
    ) -> None:
        now = [100.0]
        verified = Verified(tokens, ttl=2.0, clock=lambda: now[0])
        text, _ = tokens.create("worker", "w")
        assert await verified.find(text) is not None
        tokens.revoke("w")
        now[0] += 1.999
        found = await verified.find(text)
        assert found is not None
        assert found.revoked is None  # the entry, not the database
        now[0] += 0.001
        found = await verified.find(text)
        assert found is not None
        assert found.revoked is not None  # read again: refused (`TokenInfo.allows`)
        assert not found.allows("worker")

    async def test_an_unknown_or_revoked_token_is_never_kept(self, tokens: _CountedTokens) -> None:
        verified = Verified(tokens, ttl=60.0, clock=lambda: 0.0)
        text, _ = tokens.create("read", "r")
        tokens.revoke("r")
        for _ in range(2):
            assert await verified.find("orch_" + "x" * 43) is None
            found = await verified.find(text)
            assert found is not None
            assert found.revoked is not None
        assert tokens.reads == 4
        made = "y" * 40
        assert await verified.find(made) is None
        tokens.ensure(made, "read", "late")  # known from now on: the miss was not kept
        assert await verified.find(made) is not None

    async def test_no_more_than_its_size_are_kept_the_oldest_going_first(
        self, tokens: _CountedTokens
    ) -> None:
        verified = Verified(tokens, ttl=60.0, size=2, clock=lambda: 0.0)
        texts = [tokens.create("read", f"r{i}")[0] for i in range(3)]
        for text in texts:
            await verified.find(text)
        assert tokens.reads == 3
        await verified.find(texts[2])
        await verified.find(texts[1])
        assert tokens.reads == 3
        await verified.find(texts[0])  # dropped for the third
        assert tokens.reads == 4

    def test_no_time_to_live_keeps_nothing(self, tokens: _CountedTokens) -> None:
        text, _ = tokens.create("read", "r")
        verified = Verified(tokens, ttl=0, clock=lambda: 0.0)

        async def twice() -> None:
            await verified.find(text)
            await verified.find(text)

        anyio.run(twice)
        assert tokens.reads == 2


class TestBadInput:
    @pytest.mark.parametrize(("method", "path", "body", "status", "says"), _BAD)
    async def test_is_a_4xx_with_a_json_body_that_says_what_is_wrong(
        self, api: Api, method: str, path: str, body: Any, status: int, says: str
    ) -> None:
        live = await api.submit(_tasks(("wait", "w"), run_id="live"))
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = await api.client.request(
            method,
            path,
            content=None if body is None else content,
            headers={**api.auth(), "Content-Type": "application/json"},
        )
        assert answer.status_code == status, answer.text
        assert says in answer.text
        assert isinstance(answer.json(), dict)
        api.gate.set()
        await api.handle(live)

    async def test_a_json_body_sent_as_a_form_says_to_send_its_content_type(self, api: Api) -> None:
        # `curl -d @run.json` without `-H 'Content-Type: application/json'` sends it as a form.
        answer = await api.client.post(
            "/api/runs",
            content=json.dumps(_tasks(("echo", "a"))).encode(),
            headers={**api.auth(), "Content-Type": "application/x-www-form-urlencoded"},
        )
        assert answer.status_code == 422
        (problem,) = answer.json()["detail"]
        assert problem["loc"] == ["body"]
        assert "Content-Type: application/json" in problem["msg"]
        assert "application/x-www-form-urlencoded" in problem["msg"]

    async def test_a_body_that_is_not_utf8_json_says_so(self, api: Api) -> None:
        answer = await api.client.post(
            "/api/runs",
            content=b'{"tasks": [{"kind": "echo", "payload": "na\xefve"}]}',
            headers={**api.auth(), "Content-Type": "application/json"},
        )
        assert answer.status_code == 400
        assert answer.json()["error"] == "invalid"
        assert "UTF-8" in answer.json()["message"]

    async def test_a_body_past_the_limit_is_a_413_in_json(self, tmp_path: Path) -> None:
        store = SQLiteStore(tmp_path / "small.db")
        try:
            async with serving(store, app_max_body=1000) as api:
                tasks = [{"kind": "echo", "payload": "x" * 100} for _ in range(20)]
                answer = await api.client.post(
                    "/api/runs", json={"tasks": tasks}, headers=api.auth("submit")
                )
                assert answer.status_code == 413
                assert answer.json()["error"] == "too_large"
                assert "1000 bytes" in answer.json()["message"]
                small = await api.client.post(
                    "/api/runs", json=_tasks(("echo", "a")), headers=api.auth("submit")
                )
                assert small.status_code == 202
                await api.handle(small.json()["run_id"])
        finally:
            store.close()

    async def test_a_bad_last_event_id_is_a_400(self, api: Api) -> None:
        run_id = await api.submit(_tasks(("echo", "a")))
        await api.handle(run_id)
        answer = await api.client.get(
            f"/api/runs/{run_id}/events", headers={**api.auth(), "Last-Event-ID": "42"}
        )
        assert answer.status_code == 400
        assert answer.json()["field"] == "Last-Event-ID"


class TestCors:
    async def test_is_off_by_default(self, api: Api) -> None:
        answer = await api.client.options(
            "/api/runs",
            headers={"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "GET"},
        )
        assert "access-control-allow-origin" not in answer.headers

    async def test_allows_the_one_origin_given(self, tmp_path: Path) -> None:
        store = SQLiteStore(tmp_path / "cors.db")
        try:
            async with serving(store, app_cors_origin="https://ui.example") as api:
                answer = await api.client.options(
                    "/api/runs",
                    headers={
                        "Origin": "https://ui.example",
                        "Access-Control-Request-Method": "GET",
                        "Access-Control-Request-Headers": "Authorization",
                    },
                )
                assert answer.headers["access-control-allow-origin"] == "https://ui.example"
                other = await api.client.options(
                    "/api/runs",
                    headers={"Origin": "https://x.example", "Access-Control-Request-Method": "GET"},
                )
                assert "access-control-allow-origin" not in other.headers
        finally:
            store.close()


class TestMetrics:
    async def test_serves_the_orchestrators_prometheus_metrics(self, tmp_path: Path) -> None:
        from prometheus_client import CollectorRegistry

        from orchestra.metrics import PrometheusMetrics

        store = SQLiteStore(tmp_path / "m.db")
        metrics = PrometheusMetrics(registry=CollectorRegistry())
        try:
            async with serving(store, instruments=[metrics]) as api:
                run_id = await api.submit(_tasks(("echo", "a")))
                await api.handle(run_id)
                answer = await api.client.get("/metrics", headers=api.auth("read"))
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/plain")
                assert 'orchestra_runs_total{status="success"} 1.0' in answer.text
        finally:
            store.close()

    async def test_without_metrics_it_says_how_to_get_them(self, api: Api) -> None:
        answer = await api.client.get("/metrics", headers=api.auth("read"))
        assert answer.status_code == 404
        assert "PrometheusMetrics" in answer.json()["message"]
