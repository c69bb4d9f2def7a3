"""What a failed attempt leaves behind, and what an agent may not return.

Placeholder: replaced by the fuller version (bounded tracebacks, HTTP details, scrubbing).
"""

from __future__ import annotations

import inspect
import traceback as tb
from typing import Any

from ._exceptions import PermanentError

__all__ = ("Failure", "check_returned", "describe")


class Failure:
    __slots__ = ("api_error_type", "error_type", "message", "request_id", "status_code", "traceback")

    def __init__(self, error_type: str, message: str, traceback: str | None) -> None:
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        self.status_code: int | None = None
        self.api_error_type: str | None = None
        self.request_id: str | None = None


def describe(exc: BaseException) -> Failure:
    try:
        text = str(exc) or type(exc).__name__
    except Exception:
        text = f"<{type(exc).__name__}: str() raised>"
    text = text if len(text) <= 2000 else text[:1997] + "..."
    try:
        trace = "".join(tb.format_exception(exc))[-8000:]
    except Exception:
        trace = None
    failure = Failure(type(exc).__name__, text, trace)
    status = getattr(exc, "status_code", None)
    failure.status_code = status if isinstance(status, int) else None
    return failure


def check_returned(output: Any, agent: str) -> Any:
    if inspect.isawaitable(output):
        close = getattr(output, "close", None)
        if close is not None:
            close()
        raise PermanentError(
            f"agent {agent!r} returned {type(output).__name__}: did you forget `await`?"
        )
    return output
