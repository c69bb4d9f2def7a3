"""The HTTP service (the `service` extra: FastAPI and uvicorn): submit, watch and steer runs.

```python
from orchestra import Orchestrator
from orchestra.service import create_app
from orchestra.stores import SQLiteStore

app = create_app(Orchestrator(agents=[...], store=SQLiteStore("orchestra.db")))
# uvicorn module:app, or `orchestra serve --agents module:registry`
```

See docs/service.md for the endpoints, the tokens (``orchestra tokens create --role ROLE``) and
the roles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._extras import missing_extra

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastapi import APIRouter, FastAPI

    from ._core._orchestrator import Orchestrator

__all__ = ("create_app",)


def create_app(
    orchestrator: Orchestrator,
    *,
    routers: Sequence[APIRouter] = (),
    cors_origin: str | None = None,
    max_body: int = 4 * 1024 * 1024,
    grace: float = 10.0,
    metrics: Any = None,
    token_ttl: float = 5.0,
) -> FastAPI:
    """The service's FastAPI app over `orchestrator` (whose store must be a `SQLiteStore` or a
    `PostgresStore`): the REST API under ``/api``, Server-Sent Events of a run's journal,
    ``/health``, ``/ready``, ``/metrics``, every route but health and readiness behind a bearer
    token with a role.

    Args:
        orchestrator: runs the submitted runs; the app's lifespan enters it.
        routers: more FastAPI routers to include.
        cors_origin: the one origin browsers may call the API from (CORS is off without it).
        max_body: the largest request body accepted, in bytes (413 past it).
        grace: at shutdown, seconds the live runs' running attempts may take to finish.
        metrics: what ``/metrics`` serves; by default the orchestrator's `PrometheusMetrics`
            instrument, if it has one.
        token_ttl: seconds a token the database found live is trusted without asking the
            database again: a revoked token is refused within this long (0: every request asks).

    Raises:
        ModuleNotFoundError: the `service` extra is not installed (the message says how).
        ConfigError: the orchestrator's store is not durable, or a setting is wrong.
    """
    # Imported here, not at the top: `import orchestra` never imports FastAPI.
    try:
        from ._service._app import create_app as build
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in _SERVICE_PACKAGES:
            raise
        raise missing_extra("orchestra.service", "service", exc) from exc
    return build(
        orchestrator,
        routers=routers,
        cors_origin=cors_origin,
        max_body=max_body,
        grace=grace,
        metrics=metrics,
        token_ttl=token_ttl,
    )


_SERVICE_PACKAGES = frozenset({"fastapi", "starlette", "uvicorn", "pydantic_core"})
