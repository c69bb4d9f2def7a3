"""The app factory: `create_app` builds the FastAPI app over one orchestrator, and its lifespan
holds the orchestrator open (its task group runs the submitted runs) and stops the live runs
gracefully at shutdown.

More routers join through `routers=` (each carrying its own ``require(role)`` dependencies); the
ones built here: health and readiness (open), metrics (``read``), the runs (`_runs.py`), their
events (`_events.py`), single tasks (`_tasks.py`), the HTTP workers (`_work.py`) and the
dashboard (`_dashboard.py`, open: its page holds no data).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Annotated, Any, Final

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .._exceptions import ConfigError
from .._version import __version__
from . import _errors as errors
from ._auth import require
from ._dashboard import router as dashboard_router
from ._events import router as events_router
from ._models import ErrorBody, Health
from ._runs import router as runs_router
from ._state import Service
from ._tasks import router as tasks_router
from ._tokens import TOKEN_TTL
from ._work import router as work_router

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .._core._orchestrator import Orchestrator

__all__ = ("MAX_BODY", "create_app")

MAX_BODY: Final = 4 * 1024 * 1024
"""The largest request body accepted by default, in bytes (a run of some thousand tasks)."""


def create_app(
    orchestrator: Orchestrator,
    *,
    routers: Sequence[APIRouter] = (),
    cors_origin: str | None = None,
    max_body: int = MAX_BODY,
    grace: float = 10.0,
    metrics: Any = None,
    token_ttl: float = TOKEN_TTL,
) -> FastAPI:
    """The service's app over `orchestrator`, whose store must be durable.

    Args:
        orchestrator: runs the submitted runs (entered for the app's lifespan).
        routers: more routers to include after the service's own.
        cors_origin: the one origin browsers may call the API from (CORS is off without it).
        max_body: the largest request body accepted, in bytes (413 past it).
        grace: at shutdown, seconds the live runs' running attempts may take to finish.
        metrics: what ``GET /metrics`` serves (``exposition() -> bytes``); by default the first
            of the orchestrator's instruments that has one (`PrometheusMetrics`).
        token_ttl: seconds a token the database found live is trusted without asking the
            database again (a revoked token is refused within this long; 0: every request asks).
    """
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise ConfigError(f"max_body must be a positive number of bytes, got {max_body!r}")
    if metrics is None:
        metrics = next(
            (i for i in orchestrator.instruments if callable(getattr(i, "exposition", None))),
            None,
        )
    service = Service(orchestrator, grace=grace, metrics=metrics, token_ttl=token_ttl)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with orchestrator, anyio.create_task_group() as tg:
            if service.replicas is not None:  # PostgreSQL: the other replicas' requests, take-over
                await tg.start(service.replicas.serve)
            try:
                yield
            finally:
                await service.shutdown()
                tg.cancel_scope.cancel()

    app = FastAPI(
        title="orchestra",
        version=__version__,
        summary="Submit, watch and steer orchestra runs.",
        lifespan=lifespan,
    )
    app.state.service = service
    errors.install(app)
    for router in (
        _system,
        runs_router,
        events_router,
        tasks_router,
        work_router,
        dashboard_router,
        *routers,
    ):
        # The body limit (Starlette's, through FastAPI) on each route, where `_JsonTooLarge`
        # sees its 413: an app-wide one runs outside every middleware of the app.
        app.router.include_router(router, max_body_size=max_body)
    if cors_origin is not None:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[cors_origin],
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
        )
    app.add_middleware(_JsonTooLarge, max_body=max_body)
    return app


class _JsonTooLarge:
    """Starlette's body limit (FastAPI's ``max_body_size``) answers 413 in plain text; this says it
    in the service's JSON. Written by hand because neither lets the response be chosen: it
    rewrites only that one response, whatever route it came from."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def sending(message: Message) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 413:
                replaced = True
                response = JSONResponse(
                    errors.body(
                        "too_large",
                        f"the request body is larger than this service accepts "
                        f"({self.max_body} bytes): send less (fewer tasks per run)",
                    ),
                    status_code=413,
                )
                await response(scope, receive, send)
                return
            if replaced:  # the plain-text body of the response replaced
                return
            await send(message)

        await self.app(scope, receive, sending)


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


_system = APIRouter(tags=["service"])


@_system.get("/health", response_model=Health)
async def health() -> Health:
    """Liveness: the process serves requests (no token needed)."""
    return Health(status="ok")


@_system.get(
    "/ready",
    response_model=Health,
    responses={503: {"model": ErrorBody, "description": "The store cannot be read now."}},
)
async def ready(service: Annotated[Service, Depends(_service)]) -> Health:
    """Readiness: the store answers (no token needed)."""
    await service.ping()  # a StoreError is a 503
    return Health(status="ready")


@_system.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus' text format."},
        **errors.responses(401, 403, 404),
    },
    dependencies=[Depends(require("read"))],
)
async def metrics(service: Annotated[Service, Depends(_service)]) -> Response:
    """The orchestrator's Prometheus metrics (`orchestra.metrics.PrometheusMetrics`)."""
    if service.metrics is None:
        raise errors.Refused(
            404,
            "not_found",
            "this service has no metrics: install the metrics extra (pip install "
            "'orchestra-runtime[metrics]') or give the orchestrator "
            "instruments=[PrometheusMetrics()]",
        )
    return Response(
        service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
