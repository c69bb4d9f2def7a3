"""What the service's tests share: an app over a real store with agents a test steers, its
tokens (one per role), and an httpx client on it (the in-process ASGI transport for plain requests;
a real uvicorn server for streams)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import uvicorn

from orchestra import Orchestrator, PermanentError, Task, agent
from orchestra._service._events import key_of
from orchestra._service._tokens import ROLES, Tokens
from orchestra.service import create_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from orchestra._core._handle import RunHandle
    from orchestra._service._state import Service


@dataclass
class Api:
    """The app under test, a client on it, a token per role, and the gate `wait` tasks await."""

    app: FastAPI
    client: httpx.AsyncClient
    tokens: dict[str, str]
    gate: anyio.Event
    calls: list[str] = field(default_factory=list)

    def auth(self, role: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    @property
    def service(self) -> Service:
        service: Service = self.app.state.service
        return service

    def handle(self, run_id: str) -> RunHandle:
        handle = self.service.handle(run_id)
        assert handle is not None, f"run {run_id!r} was not started here"
        return handle

    async def submit(self, body: dict[str, Any], **headers: str) -> str:
        answer = await self.client.post(
            "/api/runs", json=body, headers={**self.auth("submit"), **headers}
        )
        assert answer.status_code in (200, 202), answer.text
        run_id: str = answer.json()["run_id"]
        return run_id


def orchestrator(store: Any, calls: list[str], gate: anyio.Event, **options: Any) -> Orchestrator:
    """Agents of three kinds: ``echo`` returns its payload, ``wait`` returns it once the gate is
    open, ``fail`` fails for good. Each call is noted in `calls` (task ids)."""

    @agent(kinds=["echo"])
    async def echo(task: Task, ctx: object) -> Any:
        calls.append(task.id)
        return task.payload

    @agent(kinds=["wait"])
    async def wait(task: Task, ctx: object) -> Any:
        calls.append(task.id)
        await gate.wait()
        return task.payload

    @agent(kinds=["fail"])
    async def fail(task: Task, ctx: object) -> Any:
        calls.append(task.id)
        raise PermanentError(f"task {task.id} fails on purpose")

    options.setdefault("seed", 1)
    return Orchestrator(agents=[echo, wait, fail], store=store, **options)


@contextlib.asynccontextmanager
async def serving(store: Any, **options: Any) -> AsyncIterator[Api]:
    """An app over `store` (its lifespan entered), with a token per role and a client on it
    through the ASGI transport. `options`: the orchestrator's (``app_`` ones: the app's)."""
    app_options = {k[4:]: options.pop(k) for k in list(options) if k.startswith("app_")}
    calls: list[str] = []
    gate = anyio.Event()
    app = create_app(orchestrator(store, calls, gate, **options), **app_options)
    tokens = Tokens(store)
    made = {role: tokens.create(role, f"test-{role}")[0] for role in ROLES}
    async with lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            yield Api(app, client, made, gate, calls)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan, entered and left in a task of its own (as a server does): a fixture's
    setup and teardown may run in different tasks, and an orchestrator is left in the task that
    entered it."""
    started, stop = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with app.router.lifespan_context(app):
            started.set()
            await stop.wait()

    holder = asyncio.ensure_future(hold())
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait([holder, waiting], return_when=asyncio.FIRST_COMPLETED)
    if holder.done():
        waiting.cancel()
        holder.result()  # what failed the startup
    try:
        yield
    finally:
        stop.set()
        await holder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def server(app: FastAPI, **options: Any) -> AsyncIterator[str]:
    """`app` served by a real uvicorn on 127.0.0.1 (its lifespan already entered by the test):
    its base URL. `options`: more of uvicorn's `Config`."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", log_level="warning", **options
    )
    running = uvicorn.Server(config)
    task = asyncio.ensure_future(running.serve())
    try:
        while not running.started:
            if task.done():
                task.result()  # what stopped it
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        running.should_exit = True
        await task


def told_in_order(delivered: list[dict[str, Any]], journal: list[dict[str, Any]]) -> None:
    """The events a stream `delivered` are the run's `journal`, each once, in its order; but for
    a task's start, which no journal row says on PostgreSQL until the task ended (then its row
    says it, dated by the claiming process's clock): the stream tells it while the task runs,
    dated when it saw it, or late, once it ended; once either way, and before the task's end."""
    keys = [key_of(e) for e in delivered if not _told_by_row(e)]
    assert sorted(keys) == sorted(key_of(e) for e in journal if not _told_by_row(e))
    assert keys == sorted(keys)
    starts = sorted(e["task_id"] for e in delivered if _told_by_row(e))
    assert starts == sorted(e["task_id"] for e in journal if _told_by_row(e))
    ends = {e["task_id"]: e["at"] for e in delivered if e["event"] == "succeeded"}
    for event in delivered:
        if _told_by_row(event) and event["task_id"] in ends:
            assert event["at"] <= ends[event["task_id"]], event


def _told_by_row(event: dict[str, Any]) -> bool:
    return bool(event["event"] == "started" and event["seq"] is None)
