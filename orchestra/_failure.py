"""Failures: what an attempt's exception says, taken down safely, and what an agent must not return.

`describe(exc)` turns anything an agent raised into a `Failure`: its type, its message, its traceback
and, for an HTTP error, the status code, the API's error type and the request id. It never raises,
even for an exception whose `__str__` or `__repr__` does, bounds every text, and scrubs secrets (API
keys, `authorization` / `x-api-key` values) out of them, so a failure record is safe to store and log.

`check_returned(output, agent)` fails an attempt whose agent returned an awaitable (a forgotten
`await`): a bug of the agent, so the error is permanent (`InvalidOutput`) and the task moves down its
fallback chain. Any other output is kept as returned.

A leaf module: it imports only `_exceptions`, `_output` and the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import linecache
import re
from types import NoneType
from typing import TYPE_CHECKING, Any, Final

from ._exceptions import InvalidOutput
from ._output import type_name

if TYPE_CHECKING:
    from collections.abc import Awaitable

__all__ = ("Failure", "cancel_pending", "check_returned", "describe", "http_status")


def cancel_pending() -> bool:
    """Whether the current task is being cancelled. A `CancelledError` that user code (an agent, a
    check, a subscriber, a hook) raises while none is pending is a stray one: that code's failure,
    never the run's cancellation."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


MAX_MESSAGE: Final = 2_000
"""The longest message kept, in characters; a longer one is cut with a marker saying how much."""
MAX_TRACEBACK: Final = 8_000
"""The longest traceback kept, in characters: its end (where the error was raised) is kept."""
MAX_FRAMES: Final = 16
"""Frames kept per exception of a traceback: the innermost ones."""
MAX_CHAIN: Final = 4
"""Exceptions of a `__cause__` / `__context__` chain shown in a traceback."""
_MAX_ID: Final = 200

# An Anthropic key (`sk-ant-api03-...`, `sk-ant-admin01-...`), the value after a header or
# argument name that holds a credential (`x-api-key: ...`, `'authorization': 'Bearer ...'`,
# `api_key="..."`, `access_token=...`, `password=...`), a bearer token wherever it stands, and the
# password of a URL's userinfo (`postgresql://user:password@host`), in a message or a traceback's
# source lines.
# Other APIs' secret keys (`sk-proj-...`, `sk-live-...`) start with `sk-` too, at a word's start.
_KEY = re.compile(r"sk-ant-[A-Za-z0-9_\-]{4,}|\bsk-[A-Za-z0-9_\-]{16,}")
# A quoted value is redacted up to its closing quote (a passphrase has spaces); an `authorization`
# value keeps its scheme (`Token`, `Digest`, ...) and loses the rest; a quote escaped by a backslash
# (JSON inside a JSON string) counts as a quote.
_SCHEME = r"(?:bearer|basic|token|digest|negotiate|ntlm|apikey|dpop)\s+"
_CREDENTIAL = re.compile(
    r"(?i)(?P<name>x-api-key|authorization|api[_-]?key|(?:[a-z]+[_-])?token"
    r"|client[_-]?secret|passw(?:or)?d)"
    r"""(?P<sep>\\?['"]?\s*[:=]\s*)(?:(?P<sq>\\?')|(?P<dq>\\?"))?"""
    rf"(?!(?:{_SCHEME})?\[redacted\])(?P<scheme>{_SCHEME})?"
    r"""(?(sq)[^'\n\\]+|(?(dq)[^"\n\\]+|[^\s'",;&)}\]\\]+))"""
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!\[redacted\])[A-Za-z0-9._~+/\-]+=*")
# From the literal `://` (which the search skips to), user and password bounded in length: every
# match attempt costs at most a few hundred steps, so scrubbing stays linear in the text.
# The password may hold an `@` itself: it runs to the last one before the host.
_USERINFO = re.compile(r"""(://[^\s:/@'"]{0,256}:)(?!\[redacted\]@)[^\s/'"]{1,256}@""")
# A cookie header's value is every pair of it (`a=1; b=2`): redacted to its closing quote or the
# line's end.
_COOKIE = re.compile(
    r"""(?i)\b(?P<name>(?:set-)?cookie\\?['"]?\s*[:=]\s*)(?P<quote>\\?['"])?"""
    r"""(?!\[redacted\])(?(quote)[^'"\n\\]+|[^'"\n]+)"""
)
_REDACTED: Final = "[redacted]"


class Failure:
    """What one exception says, safe to keep: every text bounded and scrubbed of secrets.

    Attributes:
        error_type: the exception's class name (``"RateLimitError"``).
        message: its message, at most `MAX_MESSAGE` characters; the class name when it has none.
        traceback: the formatted traceback (with its causes), at most `MAX_TRACEBACK` characters
            from the end; None when the exception was never raised.
        status_code: the HTTP status of an HTTP error (anthropic's `APIStatusError`, httpx's
            `HTTPStatusError`, anything with `.status_code` or `.response.status_code`).
        api_error_type: the API's own error type: `error.type` of an Anthropic error body
            (``"rate_limit_error"``, ``"overloaded_error"``).
        request_id: the `request-id` the API gave the response, to quote to its support.
    """

    __slots__ = (
        "api_error_type",
        "error_type",
        "message",
        "request_id",
        "status_code",
        "traceback",
    )

    def __init__(
        self,
        error_type: str,
        message: str,
        traceback: str | None = None,
        status_code: int | None = None,
        api_error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        self.status_code = status_code
        self.api_error_type = api_error_type
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"Failure({self.error_type}: {self.message!r}, status_code={self.status_code})"


def describe(exc: BaseException) -> Failure:
    """The `Failure` of `exc`. Never raises, whatever `exc` does when asked about itself."""
    error_type = _type_name(exc)
    message = scrubbed(_text(exc) or error_type, MAX_MESSAGE)
    status = http_status(exc)
    return Failure(
        error_type,
        message,
        format_traceback(exc),
        status,
        api_error_type(exc) if status is not None else None,
        _request_id(exc) if status is not None else None,
    )


def bound(text: str, limit: int, *, more: int = 0) -> str:
    """`text` cut to `limit` characters, its end replaced by a marker that says how much was cut
    (`more`: characters of the original already cut off before `text`)."""
    if len(text) <= limit and not more:
        return text
    marker = f" [... {len(text) + more - limit} more characters cut]"
    return text[: max(0, limit - len(marker))] + marker


def scrubbed(text: str, limit: int) -> str:
    """`text` scrubbed, then cut to `limit` characters: scrubbed first, so that a cut never parts a
    secret from what marks it as one (a URL's password from its ``@``, a key from its name). Only
    twice `limit` is scrubbed, so the cost is bounded however long `text` is."""
    head = text[: 2 * limit]
    return bound(scrub(head), limit, more=len(text) - len(head))


def scrub(text: str) -> str:
    """`text` with API keys, credential values and URL passwords replaced by ``[redacted]``."""
    if "sk-" in text:
        text = _KEY.sub(_REDACTED, text)
    # The case-insensitive pattern costs ~80 ns a character; most texts name no credential at all.
    lowered = text.lower()
    if (
        "key" in lowered
        or "auth" in lowered
        or "token" in lowered
        or "secret" in lowered
        or "passw" in lowered
    ):
        text = _CREDENTIAL.sub(_redact_value, text)
    if "bearer" in lowered:
        text = _BEARER.sub(_redact_bearer, text)
    if "cookie" in lowered:
        text = _COOKIE.sub(_redact_cookie, text)
    if "://" in text and "@" in text:
        text = _USERINFO.sub(_redact_password, text)
    return text


def _redact_cookie(match: re.Match[str]) -> str:
    return f"{match['name']}{match['quote'] or ''}{_REDACTED}"


def with_type(error_type: str | None, message: str) -> str:
    """``"<error_type>: <message>"`` for a display, unless the message begins with its type already
    (as most do: a task's error is its failed attempt's "ValueError: ...")."""
    if not error_type or message.startswith(f"{error_type}:"):
        return message
    return f"{error_type}: {message}"


def _redact_value(match: re.Match[str]) -> str:
    name, sep, sq, dq, scheme = match.group("name", "sep", "sq", "dq", "scheme")
    return f"{name}{sep}{sq or dq or ''}{scheme or ''}{_REDACTED}"


def _redact_bearer(match: re.Match[str]) -> str:
    return f"{match[1]}{_REDACTED}"


def _redact_password(match: re.Match[str]) -> str:
    return f"{match[1]}{_REDACTED}@"


def _type_name(exc: BaseException) -> str:
    name = getattr(type(exc), "__name__", None)
    return name if isinstance(name, str) else "Exception"


def _text(exc: BaseException) -> str:
    # str() runs the exception's own __str__, which may raise (or be a property that does); then
    # repr(), which may raise too; then a placeholder that says so.
    try:
        return str(exc)
    except Exception as error:
        try:
            return f"{_type_name(exc)} whose str() raised {_type_name(error)}; repr: {exc!r}"
        except Exception:
            return f"<{_type_name(exc)} whose str() and repr() raise>"


def format_traceback(exc: BaseException) -> str | None:
    """The traceback of `exc` and of its causes, innermost frames kept, at most `MAX_TRACEBACK`
    characters from the end; None when `exc` was never raised.

    Formatted by hand rather than by `traceback.format_exception`: on Python 3.11 that re-parses
    every source line to draw the ``^^^^`` markers under the failing expression, ~300 µs for a
    20-frame traceback against ~10 µs here, paid on every failed attempt.
    """
    try:
        if exc.__traceback__ is None and exc.__cause__ is None and exc.__context__ is None:
            return None
        parts: list[str] = []
        seen: set[int] = set()
        current: BaseException | None = exc
        link = ""
        while current is not None and id(current) not in seen and len(seen) < MAX_CHAIN:
            seen.add(id(current))
            block = _format_one(current)
            if link:
                block += link
            parts.append(block)
            if current.__cause__ is not None:
                link = "\nThe above exception was the direct cause of the following exception:\n\n"
                current = current.__cause__
            elif current.__context__ is not None and not current.__suppress_context__:
                link = "\nDuring handling of the above exception, another exception occurred:\n\n"
                current = current.__context__
            else:
                current = None
        # The root cause first, as Python prints it. Its messages and source lines were scrubbed
        # as they were formatted, before this cut, which could part a credential's name from its
        # value.
        text = "".join(reversed(parts))
        if len(text) > MAX_TRACEBACK:
            text = "[... traceback cut]\n" + text[-MAX_TRACEBACK + 20 :]
        return text
    except Exception:  # a traceback is a help, never a reason to fail
        return None


def _format_one(exc: BaseException) -> str:
    lines = ["Traceback (most recent call last):\n"]
    tbs = []
    tb = exc.__traceback__
    while tb is not None:
        tbs.append(tb)
        tb = tb.tb_next
    if len(tbs) > MAX_FRAMES:
        lines.append(f"  [... {len(tbs) - MAX_FRAMES} outer frames cut]\n")
        tbs = tbs[-MAX_FRAMES:]
    for tb in tbs:
        code = tb.tb_frame.f_code
        filename, lineno = code.co_filename, tb.tb_lineno
        lines.append(f'  File "{filename}", line {lineno}, in {code.co_qualname}\n')
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {scrubbed(source, 300)}\n")
    lines.append(f"{_type_name(exc)}: {scrubbed(_text(exc), MAX_MESSAGE)}\n")
    return "".join(lines)


# -- HTTP errors -----------------------------------------------------------------------------------


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of an HTTP error: anthropic's errors have `.status_code`, httpx's
    `HTTPStatusError` has `.response.status_code`. None for anything else; never raises."""
    try:
        status = getattr(exc, "status_code", None)
        if status is None:
            status = getattr(getattr(exc, "response", None), "status_code", None)
    except Exception:  # a property of the agent's own exception that raises
        return None
    return status if type(status) is int else None


def response_header(exc: BaseException, name: str) -> str | None:
    """Header `name` of the HTTP response `exc` carries, or None; never raises."""
    try:
        headers: Any = getattr(getattr(exc, "response", None), "headers", None)
        value = None if headers is None else headers.get(name)
    except Exception:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) else None


def api_error_type(exc: BaseException) -> str | None:
    # anthropic's APIStatusError reads `error.type` of the body into `.type`; other clients' errors
    # may only carry the body.
    try:
        kind = getattr(exc, "type", None)
        if not isinstance(kind, str):
            body = getattr(exc, "body", None)
            error = body.get("error") if isinstance(body, dict) else None
            kind = error.get("type") if isinstance(error, dict) else None
    except Exception:
        return None
    return scrubbed(kind, _MAX_ID) if isinstance(kind, str) else None


def _request_id(exc: BaseException) -> str | None:
    try:
        request_id = getattr(exc, "request_id", None)
    except Exception:
        request_id = None
    if not isinstance(request_id, str):
        request_id = response_header(exc, "request-id")
    return scrubbed(request_id, _MAX_ID) if request_id else None


# -- outputs ---------------------------------------------------------------------------------------

# Never awaitable.
_KEPT: Final = frozenset((str, int, float, bool, NoneType, dict, list, tuple))


def check_returned(output: Any, agent: str) -> None:
    """Raise `InvalidOutput` if `output`, what agent `agent` returned, is an awaitable: a
    forgotten `await`, never a result.

    A coroutine is closed, so Python never warns that it was not awaited; an asyncio task or
    future is cancelled. Anything else is the agent's to return and is kept as it is (an object,
    an iterator: `orchestra._output` says what JSON makes of it). Plain JSON scalars and the
    usual containers cost one set lookup.
    """
    cls = type(output)
    if cls in _KEPT or not inspect.isawaitable(output):
        return
    _discard(output)
    what = "a coroutine" if inspect.iscoroutine(output) else f"an awaitable {type_name(output)}"
    raise InvalidOutput(f"agent {agent!r} returned {what}: did you forget `await`?")


def _discard(awaitable: Awaitable[Any]) -> None:
    # Closing it is a courtesy (no "never awaited" warning, no orphan task): the attempt fails
    # either way, so an awaitable that refuses to close is left alone.
    with contextlib.suppress(Exception):
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        elif asyncio.isfuture(awaitable):
            awaitable.cancel()
