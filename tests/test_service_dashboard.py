"""The dashboard, in a real headless Chromium (Debian's ``chromium``, driven by Playwright) against
a real uvicorn server on 127.0.0.1 over a real SQLite file: the page loads with a token, a live
run's progress moves, pause and resume and stop and cancel do what they say (checked through the
API and the run, not only on the page), an error shows with its remediation, a task with its
attempts, and the page stays small for a run of 100,000 tasks. The page itself, its headers and
the status fields it reads are checked through httpx first.

Without ``/usr/bin/chromium`` the browser tests skip, saying how to install it; with ``CI=true``
they fail instead (``make test`` installs it where it can)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
import pytest_asyncio
from playwright.async_api import Page, Request, async_playwright, expect

from orchestra import Orchestrator, PermanentError, Task, agent
from orchestra._service._tokens import Tokens
from orchestra.service import create_app
from orchestra.stores import SQLiteStore
from tests.helpers import REPO
from tests.service_kit import lifespan, server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI
    from playwright.async_api import BrowserContext

    from orchestra._core._handle import RunHandle
    from orchestra._service._state import Service

CHROMIUM: Final = Path("/usr/bin/chromium")
SCREENSHOT: Final = REPO / "docs" / "images" / "dashboard.png"
# The docs' screenshot is written over only when asked (`make screenshot`): a test run leaves the
# working tree as it found it.
UPDATE_SCREENSHOT: Final = os.environ.get("ORCHESTRA_UPDATE_SCREENSHOT") == "1"
# Playwright's wait for what the page shows: the page reads the run's events after the stream's
# settle window (1 s) and its status at most twice a second, on a machine other tests share.
SHOWN: Final = 15_000


# -- the service under the page ------------------------------------------------------------------


@dataclass
class Dash:
    """A service over a real SQLite file behind a real uvicorn server, its tokens, and the
    tickets that let ``step`` tasks end one at a time."""

    app: FastAPI
    url: str
    tokens: dict[str, str]
    tickets: anyio.Semaphore
    calls: list[str] = field(default_factory=list)

    @property
    def service(self) -> Service:
        service: Service = self.app.state.service
        return service

    def handle(self, run_id: str) -> RunHandle:
        handle = self.service.handle(run_id)
        assert handle is not None, f"run {run_id!r} was not started here"
        return handle

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    async def get(self, path: str, role: str = "read") -> Any:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            answer = await client.get(path, headers=self.auth(role))
        assert answer.status_code == 200, answer.text
        return answer.json()

    async def submit(self, body: dict[str, Any]) -> str:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            answer = await client.post("/api/runs", json=body, headers=self.auth("submit"))
        assert answer.status_code == 202, answer.text
        run_id: str = answer.json()["run_id"]
        return run_id

    def release(self, n: int) -> None:
        for _ in range(n):
            self.tickets.release()


def _orchestrator(store: SQLiteStore, dash_calls: list[str], tickets: anyio.Semaphore,
                  **options: Any) -> Orchestrator:  # fmt: skip
    """``step`` tasks end when the test releases a ticket (and spend a cent each); ``other`` ones
    wait for a ticket too; ``fail`` ones fail for good; ``boom`` ones with a timeout-like error."""

    @agent(kinds=["step"])
    async def stepper(task: Task, ctx: Any) -> Any:
        dash_calls.append(task.id)
        await tickets.acquire()
        ctx.record_usage(cost=0.01, input_tokens=120, output_tokens=30)
        return task.payload

    @agent(kinds=["other"])
    async def other(task: Task, ctx: Any) -> Any:
        dash_calls.append(task.id)
        await tickets.acquire()
        return task.payload

    @agent(kinds=["fail"])
    async def checker(task: Task, ctx: Any) -> Any:
        dash_calls.append(task.id)
        raise PermanentError(f"task {task.id}: the contract has no signature page")

    options.setdefault("seed", 1)
    return Orchestrator(agents=[stepper, other, checker], store=store, **options)


@contextlib.asynccontextmanager
async def dashboard(
    tmp_path: Path, page: Page | None = None, **options: Any
) -> AsyncIterator[Dash]:
    """The service over a SQLite file in `tmp_path`, served; `page` (showing it) is taken away
    from it first when it ends, so that no stream of the page is left open. `options`: the
    orchestrator's."""
    store = SQLiteStore(tmp_path / "dashboard.db")
    calls: list[str] = []
    tickets = anyio.Semaphore(0)
    try:
        app = create_app(_orchestrator(store, calls, tickets, **options), grace=0)
        tokens = Tokens(store)
        made = {
            role: tokens.create(role, f"test-{role}")[0] for role in ("read", "admin", "submit")
        }
        # A browser may still hold a run's event stream open when a test ends (a failed one
        # most of all): the server closes it after a while instead of waiting for it.
        async with lifespan(app), server(app, timeout_graceful_shutdown=2) as url:
            try:
                yield Dash(app, url, made, tickets, calls)
            finally:
                if page is not None:
                    await page.goto("about:blank")
    finally:
        store.close()


def _steps(n: int, kind: str = "step", **extra: Any) -> dict[str, Any]:
    return {"tasks": [{"kind": kind, "id": f"{kind}-{i}", "payload": i} for i in range(n)], **extra}


async def _until(check: Any, within: float = 15.0) -> None:
    with anyio.fail_after(within):
        while not await check():
            await anyio.sleep(0.05)


# -- the browser ---------------------------------------------------------------------------------


def _no_chromium() -> str:
    return (
        f"the dashboard's browser tests need Chromium at {CHROMIUM}: install it with "
        "`apt-get install -y chromium` (as root; `make test` does when apt-get is usable)"
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[BrowserContext]:
    """One headless Chromium for the module's tests, in a fresh profile."""
    if not CHROMIUM.exists():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(_no_chromium() + "; CI must run them", pytrace=False)
        pytest.skip(_no_chromium())
    profile = tempfile.mkdtemp(prefix="orchestra-chromium-")
    try:
        async with async_playwright() as playwright:
            # Playwright takes the profile as its own argument (a --user-data-dir would be refused).
            context = await playwright.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=[
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
                viewport={"width": 1280, "height": 900},
            )
            try:
                yield context
            finally:
                await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: BrowserContext) -> AsyncIterator[Page]:
    """A fresh tab (its sessionStorage empty); what the page logs as an error fails the test."""
    tab = await browser.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))

    def console(message: Any) -> None:
        # Not problems: the refusals a test asks for, and the page's reads once a test stopped
        # the server under it.
        expected = ("401", "403", "ERR_CONNECTION_REFUSED")
        if message.type == "error" and not any(e in message.text for e in expected):
            problems.append(f"console: {message.text}")

    tab.on("console", console)
    try:
        yield tab
    finally:
        await tab.close()
    assert problems == []


async def _open(page: Page, dash: Dash, run_id: str | None = None, role: str = "admin") -> None:
    """The dashboard (on `run_id`), signed in with the `role`'s token."""
    await page.goto(dash.url + ("/" if run_id is None else f"/#run={run_id}"))
    await page.fill("#token", dash.tokens[role])
    await page.click("#token-form button[type=submit]")
    await expect(page.locator("#app")).to_be_visible()


def _count(page: Page, state: str) -> Any:
    return page.locator(f"#counts tr[data-state={state}] td.num")


pytestmark = [pytest.mark.subprocess, pytest.mark.asyncio(loop_scope="module")]


# -- the page and what it reads, through httpx ---------------------------------------------------


class TestThePage:
    async def test_is_served_without_a_token_under_a_policy_that_runs_no_inline_script(
        self, tmp_path: Path
    ) -> None:
        async with dashboard(tmp_path) as dash, httpx.AsyncClient(base_url=dash.url) as client:
            page = await client.get("/")
            script = await client.get("/static/dashboard.js")
            style = await client.get("/static/dashboard.css")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy
        assert "default-src 'none'" in policy
        assert "unsafe-inline" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        scripts = re.findall(r"<script\b[^>]*>", page.text)
        assert scripts
        assert all(' src="/static/' in tag for tag in scripts)  # no inline script
        assert " style=" not in page.text  # no inline style either
        assert not re.search(r"<[^>]+\son[a-z]+=", page.text)  # no inline event handler
        assert (script.status_code, style.status_code) == (200, 200)
        assert "javascript" in script.headers["content-type"]
        assert style.headers["content-type"].startswith("text/css")

    async def test_is_not_part_of_the_api_document(self, tmp_path: Path) -> None:
        async with dashboard(tmp_path) as dash:
            paths = dash.app.openapi()["paths"]
        assert "/" not in paths
        assert not any(path.startswith("/static") for path in paths)

    async def test_a_file_it_does_not_have_is_a_json_404(self, tmp_path: Path) -> None:
        async with dashboard(tmp_path) as dash, httpx.AsyncClient(base_url=dash.url) as client:
            answer = await client.get("/static/nothing.js")
        assert answer.status_code == 404
        assert answer.json()["error"] == "not_found"


class TestTheStatusItReads:
    async def test_a_failed_task_carries_the_remediation_its_error_record_gives(
        self, tmp_path: Path
    ) -> None:
        async with dashboard(tmp_path) as dash:
            run_id = await dash.submit({"tasks": [{"kind": "fail", "id": "contract-7"}]})
            result = await dash.handle(run_id)
            status = await dash.get(f"/api/runs/{run_id}/status")
        [error] = status["errors"]
        record = result.error_for("contract-7")
        assert record is not None
        assert error["task_id"] == "contract-7"
        assert error["remediation"]
        assert error["remediation"] == record.remediation

    async def test_spend_is_told_with_the_budget_it_is_spent_against(self, tmp_path: Path) -> None:
        async with dashboard(tmp_path, max_cost=0.5, max_tokens=100_000) as dash:
            run_id = await dash.submit(_steps(3))
            dash.release(3)
            await dash.handle(run_id)
            status = await dash.get(f"/api/runs/{run_id}/status")
        assert status["cost"] == pytest.approx(0.03)
        assert status["tokens"] == {"input_tokens": 360, "output_tokens": 90}
        assert (status["max_cost"], status["max_tokens"]) == (0.5, 100_000)

    async def test_without_a_budget_there_is_none_to_tell(self, tmp_path: Path) -> None:
        async with dashboard(tmp_path) as dash:
            run_id = await dash.submit(_steps(1))
            dash.release(1)
            await dash.handle(run_id)
            status = await dash.get(f"/api/runs/{run_id}/status")
        assert (status["max_cost"], status["max_tokens"]) == (None, None)

    async def test_the_ready_tasks_of_a_sqlite_run_are_queued_by_priority(
        self, tmp_path: Path
    ) -> None:
        tasks = [{"kind": "step", "id": f"s{i}", "priority": i % 3} for i in range(9)]
        async with dashboard(tmp_path, concurrency=1) as dash:
            run_id = await dash.submit({"tasks": tasks})
            await _until(lambda: _running(dash, run_id))
            status = await dash.get(f"/api/runs/{run_id}/status")
            await dash.handle(run_id).stop(0)
        # s0 (priority 0) runs; the rest wait in the queue, not "retrying"
        assert status["queue_by_priority"] == {"0": 2, "1": 3, "2": 3}
        assert status["counts"]["queued"] == 8
        assert status["counts"]["retrying"] == 0


async def _running(dash: Dash, run_id: str) -> bool:
    status = await dash.get(f"/api/runs/{run_id}/status")
    return bool(status["counts"]["running"] == 1)


# -- in the browser ------------------------------------------------------------------------------


class TestSigningIn:
    async def test_the_page_loads_with_a_token_and_every_data_call_carries_it_in_a_header(
        self, tmp_path: Path, page: Page
    ) -> None:
        requests: list[Request] = []
        page.on("request", lambda request: requests.append(request))
        async with dashboard(tmp_path, page) as dash:
            run_id = await dash.submit(_steps(3))
            await _open(page, dash)
            # no run in the address: the newest one is shown
            await expect(page.locator("#run-title")).to_have_text(run_id, timeout=SHOWN)
            await expect(page.locator(f"#runs tr[data-run='{run_id}']")).to_be_visible()
            await expect(page.locator("#progress-text")).to_contain_text("0 / 3", timeout=SHOWN)
            token = dash.tokens["admin"]
            assert await page.evaluate("sessionStorage.getItem('orchestra.token')") == token
            await page.reload()  # the same tab keeps it: not asked again
            await expect(page.locator("#run-title")).to_have_text(run_id, timeout=SHOWN)
            dash.release(3)
            await dash.handle(run_id)
        data = [r for r in requests if "/api/" in r.url]
        paths = [urlsplit(r.url) for r in data]
        assert {p.path.rsplit("/", 1)[-1] for p in paths} >= {"runs", "status", "events"}
        # The runs list reads the newest page only.
        assert {p.query for p in paths if p.path == "/api/runs"} >= {"limit=50"}
        for request in data:
            assert await request.header_value("authorization") == f"Bearer {token}"
        assert not any(token in r.url for r in requests)

    async def test_a_token_the_service_does_not_know_is_refused_and_asked_again(
        self, tmp_path: Path, page: Page
    ) -> None:
        async with dashboard(tmp_path, page) as dash:
            await page.goto(dash.url)
            await page.fill("#token", "orch_not-a-token")
            await page.click("#token-form button[type=submit]")
            await expect(page.locator("#login-error")).to_contain_text("not known")
            assert await page.locator("#app").is_hidden()
            assert await page.evaluate("sessionStorage.getItem('orchestra.token')") is None


class TestTheRunsList:
    async def test_shows_the_newest_page_of_runs_newest_first(
        self, tmp_path: Path, page: Page
    ) -> None:
        import sqlite3

        async with dashboard(tmp_path, page) as dash:
            with contextlib.closing(sqlite3.connect(tmp_path / "dashboard.db")) as conn, conn:
                conn.executemany(
                    "INSERT INTO runs (id, created, updated, state) VALUES (?, ?, ?, 'closed')",
                    [(f"old{i:02}", 1000.0 + i, 1000.0 + i) for i in range(60)],
                )
            run_id = await dash.submit(_steps(1))  # the newest (a run of this service's)
            dash.release(1)
            await dash.handle(run_id)
            await _open(page, dash)
            rows = page.locator("#runs tbody tr")
            await expect(rows).to_have_count(50, timeout=SHOWN)
            assert await rows.first.get_attribute("data-run") == run_id
            assert await rows.nth(1).get_attribute("data-run") == "old59"
            assert await rows.last.get_attribute("data-run") == "old11"
            await expect(page.locator("#runs-more")).to_have_text("the newest 50 runs")


class TestALiveRun:
    async def test_its_progress_moves_as_its_tasks_end(self, tmp_path: Path, page: Page) -> None:
        async with dashboard(tmp_path, page, concurrency=2) as dash:
            run_id = await dash.submit(_steps(20))
            await _open(page, dash, run_id)
            progress = page.locator("#progress-text")
            await expect(progress).to_contain_text("0 / 20 tasks ended", timeout=SHOWN)
            dash.release(5)
            await expect(progress).to_contain_text("5 / 20 tasks ended", timeout=SHOWN)
            await expect(_count(page, "succeeded")).to_have_text("5", timeout=SHOWN)
            assert float(await page.locator("#bar").evaluate("bar => bar.value")) == 25.0
            # the journal's events arrive live over the stream
            await expect(page.locator("#events td", has_text="succeeded").first).to_be_visible(
                timeout=SHOWN
            )
            dash.release(15)
            await expect(progress).to_contain_text("20 / 20 tasks ended", timeout=SHOWN)
            await expect(page.locator("#run-state")).to_have_text("finished", timeout=SHOWN)
            await dash.handle(run_id)

    async def test_pause_starts_no_new_attempt_and_resume_starts_them_again(
        self, tmp_path: Path, page: Page
    ) -> None:
        async with dashboard(tmp_path, page, concurrency=2) as dash:
            run_id = await dash.submit(_steps(6))
            await _open(page, dash, run_id)
            await expect(page.locator("#run-state")).to_have_text("running", timeout=SHOWN)
            await page.click("#pause")
            await expect(page.locator("#control-message")).to_contain_text("Paused")
            await expect(page.locator("#run-state")).to_have_text("paused", timeout=SHOWN)
            summary = await dash.get(f"/api/runs/{run_id}")
            assert summary["paused"] is True
            assert dash.handle(run_id).paused
            started = len(dash.calls)  # the attempts running when it paused (2)
            dash.release(started + 2)  # they end; two tickets are left for tasks to come
            await _until(lambda: _ended(dash, run_id, started))
            await anyio.sleep(0.3)  # room for a dispatch a pause failed to hold back
            assert len(dash.calls) == started  # nothing new started while paused
            assert await page.locator("#resume").is_enabled()
            await page.click("#resume")
            await expect(page.locator("#control-message")).to_contain_text("Resumed")
            await expect(page.locator("#run-state")).to_have_text("running", timeout=SHOWN)
            assert (await dash.get(f"/api/runs/{run_id}"))["paused"] is False
            await _until(lambda: _ended(dash, run_id, started + 2))
            assert len(dash.calls) > started
            dash.release(6)
            await dash.handle(run_id)

    async def test_stop_ends_the_run_within_its_grace(self, tmp_path: Path, page: Page) -> None:
        async with dashboard(tmp_path, page, concurrency=2) as dash:
            run_id = await dash.submit(_steps(10))
            await _open(page, dash, run_id)
            await expect(page.locator("#run-state")).to_have_text("running", timeout=SHOWN)
            await page.fill("#grace", "0")
            await page.click("#stop")
            await expect(page.locator("#control-message")).to_contain_text(
                "Stopped: the run ended cancelled", timeout=SHOWN
            )
            handle = dash.handle(run_id)
            assert handle.done
            result = await handle
            assert result.status == "cancelled"
            await expect(page.locator("#run-state")).to_have_text("finished", timeout=SHOWN)
            assert await page.locator("#pause").is_disabled()
            # Stopped, not closed: submitted again it resumes, and the page follows it live again.
            dash.release(10)
            async with httpx.AsyncClient(base_url=dash.url, timeout=60) as client:
                again = await client.post(
                    "/api/runs", json={**_steps(10), "run_id": run_id}, headers=dash.auth("submit")
                )
            assert again.json() == {"run_id": run_id, "created": False}  # the same run, resumed
            await dash.handle(run_id)
            await expect(page.locator("#progress-text")).to_contain_text(
                "10 / 10 tasks ended", timeout=SHOWN
            )
            told = page.locator("#events td", has_text="succeeded")
            await expect(told.first).to_be_visible(timeout=SHOWN)  # over the reopened stream

    async def test_cancel_removes_the_tasks_that_match_its_selector(
        self, tmp_path: Path, page: Page
    ) -> None:
        tasks = [*_steps(4)["tasks"], *_steps(5, "other")["tasks"]]
        async with dashboard(tmp_path, page, concurrency=1) as dash:
            run_id = await dash.submit({"tasks": tasks})
            await _open(page, dash, run_id)
            await expect(page.locator("#run-state")).to_have_text("running", timeout=SHOWN)
            await page.select_option("#cancel-by", "kind")
            await page.fill("#cancel-value", "other")
            await page.click("#cancel")
            await expect(page.locator("#control-message")).to_have_text("Cancelled 5 tasks.")
            await expect(_count(page, "cancelled")).to_have_text("5", timeout=SHOWN)
            dash.release(4)
            result = await dash.handle(run_id)
        for i in range(5):
            record = result.error_for(f"other-{i}")
            assert record is not None
            assert record.status == "cancelled"
        assert not any(call.startswith("other-") for call in dash.calls)  # none ever ran
        assert sorted(dash.calls) == [f"step-{i}" for i in range(4)]

    async def test_an_error_shows_with_its_remediation_and_the_task_s_attempts(
        self, tmp_path: Path, page: Page
    ) -> None:
        tasks = [{"kind": "fail", "id": "contract-7"}, *_steps(2)["tasks"]]
        async with dashboard(tmp_path, page, concurrency=1) as dash:
            run_id = await dash.submit({"tasks": tasks})
            await _open(page, dash, run_id)
            error = page.locator("#errors li", has_text="contract-7")
            await expect(error).to_contain_text("the contract has no signature page", timeout=SHOWN)
            dash.release(2)
            result = await dash.handle(run_id)
            record = result.error_for("contract-7")
            assert record is not None
            await expect(error.locator(".remedy")).to_have_text(record.remediation)
            await error.locator("button", has_text="contract-7").click()
            await expect(page.locator("#task-summary")).to_have_text(
                re.compile(r"^contract-7: failed, 1 attempt\b")
            )
            rows = page.locator("#task tbody tr")
            await expect(rows.filter(has_text="started").filter(has_text="checker")).to_have_count(
                1
            )
            await expect(rows.filter(has_text="failed")).not_to_have_count(0)


async def _ended(dash: Dash, run_id: str, n: int) -> bool:
    status = await dash.get(f"/api/runs/{run_id}/status")
    return bool(status["completed"] >= n)


class TestARunOf100000Tasks:
    async def test_the_page_stays_small(self, tmp_path: Path, page: Page) -> None:
        def split(n: int) -> list[Task]:
            return [Task("step", i, id=f"t{i}", priority=i % 3) for i in range(n)]

        async with dashboard(tmp_path, page, concurrency=4, decomposer=split) as dash:
            run_id = await dash.submit({"input": 100_000})
            await _open(page, dash, run_id)
            progress = page.locator("#progress-text")
            await expect(progress).to_contain_text("0 / 100,000 tasks ended", timeout=SHOWN)
            # the stream delivered the journal's 100,000 admissions; the page keeps the latest
            await expect(page.locator("#events tbody tr")).to_have_count(20, timeout=SHOWN)
            dash.release(10)
            await expect(progress).to_contain_text("10 / 100,000 tasks ended", timeout=SHOWN)
            await expect(_count(page, "queued")).to_have_text("99,986", timeout=SHOWN)
            elements = await page.evaluate("document.getElementsByTagName('*').length")
            await dash.handle(run_id).stop(0)
        # aggregates and a recent window: a row per task would be 100,000 elements and more
        assert elements < 1_000


class TestTheScreenshot:
    async def test_of_a_run_under_way_is_saved_for_the_docs(
        self, tmp_path: Path, page: Page
    ) -> None:
        tasks = [
            *({"kind": "fail", "id": f"contract-{i}"} for i in (7, 31)),
            *_steps(160)["tasks"],
            *({"kind": "other", "id": f"summary-{i}", "priority": 2} for i in range(40)),
        ]
        async with dashboard(tmp_path, page, concurrency=8, max_cost=2.5) as dash:
            run_id = await dash.submit({"tasks": tasks, "run_id": "contracts-2026-11"})
            await _open(page, dash, run_id)
            dash.release(150)
            await expect(page.locator("#errors li", has_text="contract-31")).to_be_visible(
                timeout=SHOWN
            )
            await expect(page.locator("#progress-text")).to_contain_text("152 / 202", timeout=SHOWN)
            await expect(page.locator("#events td", has_text="succeeded").first).to_be_visible(
                timeout=SHOWN
            )
            shot = SCREENSHOT if UPDATE_SCREENSHOT else tmp_path / "dashboard.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(shot), full_page=True)
            await dash.handle(run_id).stop(0)
        assert shot.read_bytes().startswith(b"\x89PNG")
        assert shot.stat().st_size > 10_000
