"""The service's refusals: every bad request is answered with a 4xx and a JSON body that says
what is wrong (`ErrorBody`), never a 500.

Routes raise `Refused`; the app's exception handlers (`install`) turn it, and what the layers
below raise for bad input (`InputError`, `ConfigError`) or an unreachable database (`StoreError`),
into that body. FastAPI's own 422 for a request that fails validation keeps its shape: its
``detail`` lists each field at fault (``loc``) and why (``msg``), a body sent with another
Content-Type than JSON's told so.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .._exceptions import ConfigError, InputError, OrchestraError, StoreError
from ._models import ErrorBody

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fastapi import FastAPI, Request

__all__ = ("Refused", "install", "responses")


class Refused(OrchestraError):
    """A request the service refuses: its HTTP `status`, a short `code` for programs
    (``not_found``, ``conflict``, ``unauthorized``, ...), the `message` for people, and the
    `field` at fault when one is."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


def body(code: str, message: str, field: str | None = None) -> dict[str, str | None]:
    return ErrorBody(error=code, message=message, field=field).model_dump()


def _response(
    status: int,
    code: str,
    message: str,
    field: str | None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(body(code, message, field), status_code=status, headers=headers)


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refused)
    return _response(exc.status, exc.code, exc.message, exc.field, exc.headers)


async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
    # What the library refused of the request's content (a task that depends on an unknown
    # task, a cycle, a bad selector): the library's message names the task and the field.
    field = getattr(exc, "field", None)
    return _response(400, "invalid", str(exc), field if isinstance(field, str) else None)


async def _store_down(request: Request, exc: Exception) -> JSONResponse:
    # The database cannot be reached or used now: the client may try again later.
    return _response(503, "unavailable", str(exc), None, {"Retry-After": "5"})


async def _http(request: Request, exc: Exception) -> JSONResponse:
    # What the framework refuses itself (a body it cannot read, no such path, a method the path
    # does not take): its status and message, in the service's body.
    assert isinstance(exc, HTTPException)
    code = _CODES.get(exc.status_code, "refused" if exc.status_code < 500 else "error")
    message = str(exc.detail)
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):  # FastAPI's "error parsing the body" says no more
        message = (
            f"the body is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset "
            f"{cause.start}): send JSON encoded in UTF-8"
        )
    return _response(exc.status_code, code, message, None, exc.headers)


def _is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI reads a body as JSON only when its Content-Type says so (or says nothing): JSON sent
    # as a form (curl's `-d` without `-H 'Content-Type: application/json'`) fails as "not a
    # dictionary", which does not say why. The 422 stays FastAPI's; its message says why.
    assert isinstance(exc, RequestValidationError)
    sent = request.headers.get("content-type")
    errors = [{**error, "input": _echo(error.get("input"))} for error in exc.errors()]
    if sent is not None and not _is_json(sent):
        errors = [
            {**error, "msg": f"the body was sent as {sent}, not JSON: send it with the header "
             "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')"}
            if tuple(error.get("loc", ())) == ("body",) else error
            for error in errors
        ]  # fmt: skip
    return await request_validation_exception_handler(
        request, RequestValidationError(errors, body=exc.body)
    )


def _echo(value: Any) -> Any:
    """A refused value as the 422 echoes it: as it came, unless JSON cannot write it (the NaN
    Python's `json` read, which the answer would fail on), then as its repr."""
    try:
        json.dumps(value, allow_nan=False, default=str)
    except ValueError:
        return repr(value)
    return value


_CODES: Final = {400: "invalid", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def install(app: FastAPI) -> None:
    """Answer `Refused`, the framework's refusals, bad input and an unusable store with
    `ErrorBody` JSON."""
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Refused, _refused)
    app.add_exception_handler(InputError, _bad_input)
    app.add_exception_handler(ConfigError, _bad_input)
    app.add_exception_handler(StoreError, _store_down)


# What each status a route may answer means, for the OpenAPI document.
_MEANINGS: Final = {
    400: "The request's content is refused (the message names the task and field).",
    401: "No bearer token, or one the service does not know (or revoked).",
    403: "The token's role does not allow this.",
    404: "No such run or task.",
    409: "The run is in a state that does not allow this (still running, held elsewhere).",
    413: "The request body is larger than the service accepts (--max-body).",
    503: "The store's database cannot be used now (or the replica that runs the run did not "
    "answer in time).",
}


def responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """The OpenAPI `responses=` of a route: each status with `ErrorBody` and its meaning."""
    return {s: {"model": ErrorBody, "description": _MEANINGS[s]} for s in statuses}
