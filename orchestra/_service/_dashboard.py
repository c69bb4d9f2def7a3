"""The dashboard: one static page at ``/`` and its script and style under ``/static/``, served
from the package (``orchestra/_service/static/``), with no build step.

The page holds no data, so it is served without a token; everything it shows it reads from the
REST API and its Server-Sent Events with the token the user pastes once (kept in the tab's
`sessionStorage`, sent in the ``Authorization`` header, never in a URL). Its Content Security
Policy allows scripts, styles and requests from this origin only, and no inline script: a task id
or an error message the page shows can never run as code.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

__all__ = ("CSP", "router")

CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy."""

_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is small and names its script by a fixed path: always asked again, so that an
    # upgraded service never runs with the previous version's script.
    "Cache-Control": "no-cache",
}

_STATIC = resources.files(__package__) / "static"

router = APIRouter(tags=["dashboard"])
router.mount(
    "/static",
    StaticFiles(packages=[(__package__, "static")]),
    name="static",
)


@router.get("/", include_in_schema=False, response_class=FileResponse)
async def dashboard() -> FileResponse:
    """The dashboard's page (no token needed: it holds no data)."""
    return FileResponse(str(_STATIC / "index.html"), media_type="text/html", headers=_HEADERS)
