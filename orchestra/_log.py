"""Logging as a library does it: orchestra's structlog lines go through the standard `logging` module.

Every logger of the runtime comes from `get_logger(name)`: a `structlog.stdlib.BoundLogger` over
``logging.getLogger(name)`` (``"orchestra"``, ``"orchestra.agent"``, ``"orchestra.events"``) with a
fixed processor chain of our own. We never call `structlog.configure()`: that is global and would
replace the application's own structlog set-up. The ``"orchestra"`` logger has a `NullHandler`, so
an application that configures nothing sees nothing (not even logging's last-resort WARNING lines
on stderr), and the application's `logging` configuration (levels, handlers, filters) decides the
rest. Why `logging` and not stderr: only `logging` lets the application silence, raise, filter,
redirect or ship our lines with the rest of its own, with the tools it already uses.

A line is one `logging.LogRecord` whose `msg` is the event dict, in a `dict` subclass that prints as
``run started run_id=1a2b tasks=10``. So a plain `logging.Formatter` (``logging.basicConfig()``)
shows the event and its fields, and structlog's `ProcessorFormatter` (the application's, or the one
`configure_logging` installs) sees the record exactly as `ProcessorFormatter.wrap_for_formatter`
makes it and renders every field as structured data (JSON, console).

Secrets never reach a record: every value is scrubbed of API keys, credential values and URL
passwords (the scrubber `_failure.scrub` applies to failure texts): strings as they are, containers
rebuilt `MAX_DEPTH` levels deep, anything else (and anything deeper) as its scrubbed repr. Values
of fields named like credentials (``authorization``, ``x-api-key``, ``api_key``, ...) are replaced
whole, and a traceback is formatted and scrubbed here (`_failure.format_traceback`) rather than
left to the handler.
`configure_logging(redact=...)` redacts more fields by name.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any, Final, Literal

import structlog
from structlog.stdlib import BoundLogger, ProcessorFormatter

from ._exceptions import ConfigError
from ._failure import describe, format_traceback, scrub, with_type

if TYPE_CHECKING:
    from structlog.typing import EventDict, Processor

__all__ = ("configure_logging", "get_logger")

# The id of the task whose attempt is running, on every log line of that attempt: ours, and an
# application's own structlog lines that merge context variables (named as
# `structlog.contextvars.bind_contextvars` names its variables, so `merge_contextvars` finds it).
TASK_ID: Final = contextvars.ContextVar[Any]("structlog_task_id", default=...)


class CurrentTask:
    """The value of `TASK_ID` in a dispatcher's runner: it reads as the id of the task the runner
    works on now. A runner sets the variable once and points `record` at each attempt's task (a
    `ContextVar.set` per attempt cost 0.25 µs, a twentieth of a no-op task). It prints, and
    serializes through structlog's ``__structlog__`` hook, as that id."""

    __slots__ = ("cancels", "record")

    def __init__(self) -> None:
        self.record: Any = None  # the task's record while an attempt runs, else None
        self.cancels = 0  # the dispatcher's cancellations of that attempt alone, not taken back

    @property
    def id(self) -> str | None:
        record = self.record
        return None if record is None else record.id

    def __structlog__(self) -> str | None:
        return self.id

    def __str__(self) -> str:
        return str(self.id)

    __repr__ = __str__


ROOT: Final = "orchestra"
REDACTED: Final = "[redacted]"

# Field names whose whole value is a credential, compared lower-cased with `-` read as `_`.
SECRET_FIELDS: Final = frozenset(
    {
        "authorization",
        "proxy_authorization",
        "x_api_key",
        "api_key",
        "apikey",
        "auth_token",
        "access_token",
        "refresh_token",
        "id_token",
        "client_secret",
        "password",
        "secret",
    }
)
# Containers are rebuilt with their values scrubbed this many levels deep (headers, request
# options, configurations); below that a value is logged as its scrubbed repr, which bounds the
# work and the recursion for a cyclic or absurdly deep structure.
MAX_DEPTH: Final = 16
_EXACT_CONTAINERS: Final = frozenset((list, tuple, set, frozenset))

logging.getLogger(ROOT).addHandler(logging.NullHandler())


def _normal(name: str) -> str:
    return name.lower().replace("-", "_")


def _is_secret(name: Any, secret: frozenset[str]) -> bool:
    """Whether `name`, a field's or a header's name (str or bytes), names a credential."""
    if isinstance(name, bytes):
        name = name.decode("latin-1")
    return isinstance(name, str) and _normal(name) in secret


def _clean(value: Any, secret: frozenset[str], depth: int) -> Any:
    """`value` safe to log: strings scrubbed, credential fields replaced, containers rebuilt
    `MAX_DEPTH` levels deep, and anything else (an exception, an object, a deeper structure)
    replaced by its scrubbed repr, the text a renderer would print for it."""
    if isinstance(value, str):
        return scrub(value)
    if value is None or isinstance(value, int | float):  # bool and int enums too
        return value
    if depth < MAX_DEPTH:
        depth += 1
        if isinstance(value, Mapping):
            return {
                _clean(k, secret, depth): REDACTED
                if _is_secret(k, secret)
                else _clean(v, secret, depth)
                for k, v in value.items()
            }
        cls = type(value)
        if cls is tuple and len(value) == 2 and _is_secret(value[0], secret):
            # A header as a (name, value) pair: `Headers.raw`, an ASGI scope's, a list of headers.
            return (_clean(value[0], secret, depth), REDACTED)
        if cls in _EXACT_CONTAINERS:  # a subclass (a namedtuple) may not rebuild from items
            return cls(_clean(v, secret, depth) for v in value)
    return _as_text(value)


def _as_text(value: Any) -> str:
    """What structlog's renderers print for `value` (its `__structlog__()`, else its repr),
    scrubbed; a placeholder when that raises (a repr too deep for the stack, a broken one)."""
    try:
        hook = getattr(value, "__structlog__", None)
        text = hook() if callable(hook) else repr(value)
        if not isinstance(text, str):
            text = repr(text)
    except Exception as exc:
        return f"<{type(value).__name__}: its repr raised {type(exc).__name__}>"
    return scrub(text)


def _redact(event_dict: EventDict, secret: frozenset[str]) -> EventDict:
    for key, value in event_dict.items():
        # ProcessorFormatter's own `_record`, `_from_structlog`; `exc_info`, which `_to_record`
        # formats and scrubs.
        if key.startswith("_") or key == "exc_info":
            continue
        if _normal(key) in secret:
            event_dict[key] = REDACTED
        else:
            event_dict[key] = _clean(value, secret, 0)
    return event_dict


def redact_secrets(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """A structlog processor: scrubs API keys and credential values out of every field."""
    return _redact(event_dict, SECRET_FIELDS)


class _EventMessage(dict[str, Any]):
    """A record's `msg`: the event dict, printed as ``event key=value ...`` by plain formatters.

    `ProcessorFormatter` reads it as a dict (its `.copy()` is a plain dict), `LogRecord.getMessage`
    calls `str()` on it. Written by hand because structlog's `render_to_log_kwargs` turns fields
    into `extra` record attributes, which a plain formatter does not show and which raise on a field
    named like a `LogRecord` attribute (``name``, ``args``, ``message``).
    """

    __slots__ = ()

    def __str__(self) -> str:
        fields = " ".join(
            f"{k}={_text(v)}" for k, v in self.items() if k not in ("event", "exception")
        )
        text = str(self.get("event", ""))
        if fields:
            text = f"{text} {fields}"
        exception = self.get("exception")
        if exception:
            text = f"{text}\n{str(exception).rstrip()}"
        return text


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    if not text or any(c in text for c in ' ="\n'):
        return repr(text)
    return text


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple):
        return exc_info[1]  # type: ignore[no-any-return]
    return sys.exc_info()[1]  # exc_info=True: the exception being handled


def _merge_contextvars(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """structlog's `merge_contextvars`, with a runner's `CurrentTask` read as its task's id."""
    event_dict = structlog.contextvars.merge_contextvars(logger, method, event_dict)
    task = event_dict.get("task_id")
    if type(task) is CurrentTask:
        task_id = task.id
        if task_id is None:
            del event_dict["task_id"]  # between attempts
        else:
            event_dict["task_id"] = task_id
    return event_dict


def _to_record(logger: Any, method: str, event_dict: EventDict) -> Any:
    """The last processor: the arguments of the `logging.Logger` call (see `_EventMessage`)."""
    exc_info = event_dict.pop("exc_info", None)
    if exc_info:
        exc = _exception(exc_info)
        if exc is not None:
            # Formatted here, bounded and scrubbed, rather than by the handler, which would not.
            event_dict["exception"] = format_traceback(exc) or _one_line(exc)
    return (_EventMessage(event_dict),), {"extra": {"_logger": logger, "_name": method}}


def _one_line(exc: BaseException) -> str:
    failure = describe(exc)  # an exception never raised: no traceback to format
    return with_type(failure.error_type, failure.message)


_PROCESSORS: Final[list[Processor]] = [
    structlog.stdlib.filter_by_level,  # first: a dropped level costs nothing more
    _merge_contextvars,  # run_id (bound by the run), task_id (the runner's)
    redact_secrets,
    _to_record,
]


def get_logger(name: str = ROOT) -> BoundLogger:
    """A structlog logger over ``logging.getLogger(name)``, independent of structlog's global
    configuration. `name` should be ``"orchestra"`` or below it."""
    return BoundLogger(logging.getLogger(name), _PROCESSORS, {})


# -- output for people who want it --------------------------------------------------------------


class _OrchestraHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` installs; a second call replaces it."""


def configure_logging(
    format: Literal["console", "json"] = "console",
    level: int | str = "INFO",
    *,
    stream: IO[str] | None = None,
    redact: Iterable[str] = (),
) -> logging.Handler:
    """Show orchestra's log lines on `stream` (standard error by default), as console lines or JSON.

    Gives the ``"orchestra"`` logger a handler of its own at `level` and stops its lines from
    propagating to the root logger (so they are not printed twice); calling it again replaces
    that handler. Every line carries the run id, and lines of an attempt its task id, kind and
    agent. Values of the fields named in `redact` become ``"[redacted]"``, as do API keys and
    credential headers always. Returns the handler (remove it with
    ``logging.getLogger("orchestra").removeHandler(handler)``).

    Leave it uncalled to keep orchestra silent, or to route its lines through your own `logging`
    configuration (the ``"orchestra"`` logger and its children).
    """
    if format not in ("console", "json"):
        raise ConfigError(f"configure_logging: format must be 'console' or 'json', got {format!r}")
    if isinstance(level, str):
        number = logging.getLevelNamesMapping().get(level.upper())
        if number is None:
            raise ConfigError(f"configure_logging: unknown level {level!r}")
        level = number
    out = sys.stderr if stream is None else stream
    secret = SECRET_FIELDS | {_normal(name) for name in redact}

    def redact_named(logger: Any, method: str, event_dict: EventDict) -> EventDict:
        return _redact(event_dict, secret)

    renderer: Processor
    if format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_is_terminal(out))
    formatter = ProcessorFormatter(
        processors=[
            ProcessorFormatter.remove_processors_meta,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,  # a foreign record's exc_info
            redact_named,
            renderer,
        ],
    )
    handler = _OrchestraHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger(ROOT)
    for old in [h for h in root.handlers if isinstance(h, _OrchestraHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return handler


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or bare stream
        return False
