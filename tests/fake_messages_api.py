"""A fake Anthropic Messages API on a real local socket, with faults a test scripts.

The official client (`anthropic.AsyncAnthropic(base_url=api.url, max_retries=0)`) talks to it over
real HTTP/1.1 on 127.0.0.1 with keep-alive, so what a test sees is what a run against the real API
sees: the SDK's own exception types (`RateLimitError`, `APIStatusError`, `APIConnectionError`), its
headers (`retry-after`, `retry-after-ms`, `request-id`) and real connection set-up and teardown.

```python
async with FakeMessagesAPI() as api:
    api.fail("rate_limit", times=20, retry_after=1)          # the next 20 requests get a 429
    api.fail("prompt_too_long", match=lambda body: "long" in prompt_of(body))
    api.refuse_connections(at_request=41, duration=1.0)    # a network blip: nobody listens
    ...                                                    # run the client against api.url
    assert [r.status for r in api.requests][:20] == [429] * 20
    api.assert_no_key_in(result.model_dump_json())
```

Faults (`Fault`): "rate_limit" (429 rate_limit_error with `retry-after` and, if asked,
`retry-after-ms`), "overloaded" (529 overloaded_error), "server_error" (500 api_error),
"prompt_too_long" (400 invalid_request_error), "drop" (the request is read, then the socket is
closed without a response), "hang" (no answer until the client gives up and disconnects), "slow"
(a normal answer, late), "stall" (a streamed answer that sends its first `events` events, then
nothing until the client gives up), "authentication" (401 authentication_error: a revoked key),
"refusal" (a 200 answer with `stop_reason: "refusal"`), "garbage" (a 200 whose JSON body is no
Message: what a misbehaving proxy may answer) and "cut" (a 200 whose body stops half-way: the
connection is reset mid-body). A rule's `headers` are added to (or replace) its answer's headers:
`x-should-retry: false` on a 500, say. A 429 with `ratelimit_reset=` carries no `retry-after`, only
`anthropic-ratelimit-requests-remaining: 0` and the reset time, as the real API may. A rule applies by count (`times`), by a predicate on the request
body (`match`) and in a time window (`after`, `duration`); the first rule that applies answers. With
no rule, the request succeeds after the server's `latency`. Prompts longer than `max_input_tokens`
(estimated at 4 characters a token) get the real API's 400 "prompt is too long".

Answers echo the prompt unless a test scripts them (`answer("...", '{"risk": "low"}')`, or a function
of the request body); a request with `"stream": true` is answered with the API's server-sent events.
The `anthropic-ratelimit-*-reset` times are on orchestra's clock (`current_clock().wall()`), so they
agree with a `FakeClock` as they do with real time.

Written on `asyncio.start_server` with `h11` for the HTTP/1.1 framing rather than on uvicorn or
starlette: those are not installed (the `service` extra is not part of the test environment), while
h11 is the same HTTP/1.1 state machine httpx's transport (and so the anthropic client) already runs
on, so requests, bodies and keep-alive are parsed by a library, not by hand. What is ours is only what
a fault needs and an ASGI server hides: closing a socket mid-request, not listening for a while, and
seeing the moment a client disconnects.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal, Self, get_args

import h11

from orchestra._clock import current_clock

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from types import TracebackType

__all__ = (
    "RATE_LIMIT_MESSAGE",
    "BatchOutcome",
    "FakeMessagesAPI",
    "Fault",
    "Request",
    "Rule",
    "prompt_of",
)

Fault = Literal[
    "rate_limit",
    "overloaded",
    "server_error",
    "prompt_too_long",
    "authentication",
    "drop",
    "hang",
    "slow",
    "stall",
    "refusal",
    "garbage",
    "cut",
]

RATE_LIMIT_MESSAGE: Final = (
    "This request would exceed the rate limit for your organization of 50 requests per minute. "
    "Please try again later."
)

# status, error type, message: the bodies the real API sends for each failure.
_ERRORS: Final[dict[str, tuple[int, str, str]]] = {
    "rate_limit": (429, "rate_limit_error", RATE_LIMIT_MESSAGE),
    "overloaded": (529, "overloaded_error", "Overloaded"),
    "server_error": (500, "api_error", "Internal server error"),
    "prompt_too_long": (400, "invalid_request_error", "prompt is too long"),
    "authentication": (401, "authentication_error", "invalid x-api-key or authorization header"),
    "not_found": (404, "not_found_error", "Not found"),
    "invalid": (400, "invalid_request_error", "the request body is not a valid Messages request"),
}
_REASONS: Final = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    529: b"Overloaded",
}
_CHUNK: Final = 65536
_COUNT_TOKENS: Final = "/v1/messages/count_tokens"
_WINDOW: Final = 60.0  # the rate-limit headers describe a one-minute budget


def prompt_of(body: Any) -> str:
    """The text of a Messages request: its system prompt and every message's text, joined."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        parts.append(system)
    elif isinstance(system, list):
        parts.extend(
            b["text"] for b in system if isinstance(b, dict) and isinstance(b.get("text"), str)
        )
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                block["text"]
                for block in content
                if isinstance(block, dict) and isinstance(block.get("text"), str)
            )
    return "\n".join(parts)


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


@dataclass(slots=True)
class Request:
    """One request as the server saw it. Times are the event loop's clock (`loop.time()`, the
    clock `anyio.current_time()` and orchestra read), in seconds.

    `outcome` is "ok", the name of the fault that answered, "invalid" / "authentication" /
    "not_found" for a malformed request, or "disconnected" when the connection closed before an
    answer was written (the client gave up, or the server stopped listening).
    """

    number: int
    connection: int
    received: float
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    status: int | None = None
    outcome: str = "pending"
    answered: float | None = None

    @property
    def prompt(self) -> str:
        return prompt_of(self.body)

    @property
    def api_key(self) -> str | None:
        """The key the request carried: `x-api-key`, or `authorization: Bearer <key>` (which the
        newer SDKs send)."""
        key = self.headers.get("x-api-key")
        if key:
            return key
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(slots=True, eq=False)
class Rule:
    """A scripted fault (see `FakeMessagesAPI.fail`); `hits` counts the requests it answered."""

    fault: Fault
    times: int | None
    match: Callable[[Any], bool] | None
    start: float
    end: float
    retry_after: float | None
    retry_after_ms: float | None
    delay: float
    ratelimit_reset: float | None = None
    events: int = 0
    hits: int = 0
    path: str = "/v1/messages"
    headers: dict[str, str] = field(default_factory=dict)

    def applies(self, body: Any, now: float) -> bool:
        if not self.start <= now < self.end:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        return self.match is None or bool(self.match(body))


BatchOutcome = Literal["errored", "expired", "canceled"]


@dataclass(slots=True)
class _Batch:
    id: str
    created: float
    ends: float
    entries: list[tuple[str, Any, str]]  # custom_id, params, outcome
    canceled: bool = False


@dataclass(slots=True)
class _Connection:
    number: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.SERVER))


class FakeMessagesAPI:
    """A Messages API server on 127.0.0.1 and an ephemeral port, for one test.

    Use it as ``async with FakeMessagesAPI() as api:``; `api.url` is the client's `base_url`.

    Args:
        latency: seconds a successful answer takes. Errors come at once (see `fail`'s `delay`),
            as the real API rejects on sight what it will not serve (an over-long prompt, a
            request over the rate limit), so they overtake the answers in flight.
        max_input_tokens: longer prompts get a 400 "prompt is too long", as the real API's
            context window does.
        requests_per_minute, input_tokens_per_minute, output_tokens_per_minute: the budget the
            `anthropic-ratelimit-*` headers describe. Reported only, never enforced: a test
            scripts its 429s with `fail("rate_limit", ...)`, so they come exactly when it says.
        enforce_limits: enforce the per-minute budgets as the API does, with a token bucket per
            budget (full at the start, refilled continuously at the limit per minute): a request
            with no room gets a 429 with `retry-after`. For benchmarks; tests script their 429s.
        batch_latency: seconds a Message Batch takes to end (`/v1/messages/batches`: create,
            retrieve, results as JSONL, cancel; `batch_outcome` scripts errored / expired
            requests).
    """

    def __init__(
        self,
        *,
        latency: float = 0.0,
        max_input_tokens: int = 200_000,
        requests_per_minute: int = 4_000,
        input_tokens_per_minute: int = 400_000,
        output_tokens_per_minute: int = 80_000,
        batch_latency: float = 60.0,
        enforce_limits: bool = False,
    ) -> None:
        self.latency = latency
        self.max_input_tokens = max_input_tokens
        self.limits = {
            "requests": requests_per_minute,
            "input-tokens": input_tokens_per_minute,
            "output-tokens": output_tokens_per_minute,
        }
        self.requests: list[Request] = []
        self.rules: list[Rule] = []
        self.connections = 0
        """How many connections were accepted, in all."""
        self._used = dict.fromkeys(self.limits, 0)
        self._window_start = 0.0
        self._port = 0
        self._generation = 0  # which listening socket is current; a blip starts a new one
        self._server: asyncio.base_events.Server | None = None
        self._open: dict[int, _Connection] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._blips_at: dict[int, float] = {}  # request number -> how long the blip lasts
        self._numbers = itertools.count(1)
        self._connection_numbers = itertools.count(1)
        self._ids = itertools.count(1)
        self._answers: list[str | Callable[[Any], str]] = []
        self.batch_latency = batch_latency
        self.enforce_limits = enforce_limits
        self._buckets = {unit: float(limit) for unit, limit in self.limits.items()}
        self._filled = 0.0
        self.batches: dict[str, _Batch] = {}
        """Every batch created, by id."""
        self._batch_rules: list[tuple[str, Callable[[Any], bool] | None]] = []
        self.cached: set[tuple[Any, str]] = set()
        """The cached prompt prefixes (model, text): see `_cache`."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._window_start = self._now()
        await self._listen()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening, close every connection and wait for every handler to end."""
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._stop_listening()
        await self._drain_handlers()

    @property
    def url(self) -> str:
        """The client's `base_url`: ``http://127.0.0.1:<port>``."""
        if not self._port:
            raise RuntimeError("the server is not started: use `async with FakeMessagesAPI()`")
        return f"http://127.0.0.1:{self._port}"

    @property
    def listening(self) -> bool:
        return self._server is not None

    # -- scripting -------------------------------------------------------------------------------

    def fail(
        self,
        fault: Fault,
        *,
        times: int | None = None,
        match: Callable[[Any], bool] | None = None,
        after: float = 0.0,
        duration: float | None = None,
        retry_after: float | None = None,
        retry_after_ms: float | None = None,
        delay: float | None = None,
        ratelimit_reset: float | None = None,
        events: int = 0,
        path: str = "/v1/messages",
        headers: dict[str, str] | None = None,
    ) -> Rule:
        """Answer the requests this rule selects with `fault`; returns the rule (see `Rule.hits`).

        Args:
            fault: what to answer; see the module docstring.
            times: at most this many requests (None: every one that matches).
            match: only requests whose parsed JSON body it accepts.
            after, duration: only requests that arrive between `after` and `after + duration`
                seconds from now (`duration` None: from `after` on).
            retry_after: the `retry-after` header of a 429 or 529, in seconds.
            retry_after_ms: the `retry-after-ms` header, in milliseconds.
            delay: seconds before answering. By default an error or a drop comes at once (the
                API rejects a request it will not serve on sight) and "slow" takes ten times
                the server's latency; "hang" ignores it.
            ratelimit_reset: a 429's budget resets in this many seconds: its headers say
                `requests-remaining: 0` and that reset time.
            events: how many events a "stall" sends before it stalls.
            path: the endpoint it applies to: the Messages API, or
                ``"/v1/messages/count_tokens"`` (its calls are answered by their own rules); a
                path ending in ``*`` is a prefix (``"/v1/messages/batches/*"``: polls and
                results of every batch answer with the error fault).
            headers: response headers added to the answer, replacing any of the same name.
        """
        if fault not in get_args(Fault):
            raise ValueError(f"unknown fault {fault!r}; known: {get_args(Fault)}")
        now = self._now()
        rule = Rule(
            fault,
            times,
            match,
            start=now + after,
            end=math.inf if duration is None else now + after + duration,
            retry_after=retry_after,
            retry_after_ms=retry_after_ms,
            delay=_default_delay(fault, self.latency) if delay is None else delay,
            ratelimit_reset=ratelimit_reset,
            events=events,
            path=path,
            headers={name.lower(): value for name, value in (headers or {}).items()},
        )
        self.rules.append(rule)
        return rule

    def refuse_connections(
        self, *, duration: float, after: float | None = None, at_request: int | None = None
    ) -> None:
        """A network blip: stop listening and reset every open connection (requests in flight
        get no answer), then listen again on the same port `duration` seconds later. Connections
        are refused meanwhile (the client's `APIConnectionError`).

        It starts `after` seconds from now, or when request number `at_request` arrives (that
        request is cut too): counting requests keeps a test's story exact on a slow machine.
        """
        if at_request is not None:
            if after is not None:
                raise ValueError("give `after` or `at_request`, not both")
            self._blips_at[at_request] = duration
            return
        self._spawn(self._blip(after or 0.0, duration))

    def answer(self, *texts: str | Callable[[Any], str]) -> None:
        """The texts of the next successful answers, in order (a function gets the request body);
        after them, answers echo the prompt again."""
        self._answers.extend(texts)

    # -- what the test asserts on ----------------------------------------------------------------

    @property
    def api_keys(self) -> set[str]:
        """Every API key a request carried."""
        return {key for r in self.requests if (key := r.api_key) is not None}

    def assert_no_key_in(self, *texts: str) -> None:
        """Fails when any API key a request carried appears in any of `texts` (results, logs)."""
        keys = self.api_keys
        assert keys, "no request carried an API key: nothing to look for"
        for text in texts:
            for key in keys:
                assert key not in text, "the API key leaked into the text under test"

    def answered(self, status: int) -> list[Request]:
        """The requests answered with `status`, in arrival order."""
        return [r for r in self.requests if r.status == status]

    # -- serving ---------------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _listen(self) -> None:
        self._generation += 1
        serve = functools.partial(self._serve, self._generation)
        self._server = await asyncio.start_server(serve, "127.0.0.1", self._port)
        if not self._port:
            self._port = self._server.sockets[0].getsockname()[1]

    def _cut(self) -> asyncio.base_events.Server | None:
        """Stop accepting and reset every open connection, at once; the old server is returned
        for `wait_closed`."""
        server, self._server = self._server, None
        self._generation += 1  # a connection accepted before the close but not yet served is cut
        if server is not None:
            server.close()
        for conn in list(self._open.values()):
            conn.writer.transport.abort()  # the network is gone: no FIN, no answer
        return server

    async def _stop_listening(self) -> None:
        server = self._cut()
        if server is not None:
            await server.wait_closed()

    async def _blip(self, after: float, duration: float) -> None:
        await asyncio.sleep(after)
        await self._stop_listening()
        await asyncio.sleep(duration)
        await self._listen()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drain_handlers(self) -> None:
        # Handlers end by themselves once their transport is aborted (every wait in them races the
        # socket). They are not cancelled: asyncio's stream protocol reports a cancelled handler
        # task as an error from its done-callback on Python 3.11.
        await asyncio.sleep(0)  # a handler whose task was created but has not started yet
        if self._handlers:
            await asyncio.wait(set(self._handlers))

    async def _serve(
        self, generation: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if generation != self._generation:
            writer.transport.abort()
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = _Connection(next(self._connection_numbers), reader, writer)
        self._open[conn.number] = conn
        self.connections += 1
        try:
            while await self._one_exchange(conn):
                conn.h11.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass  # the client went away, or sent what is not HTTP/1.1: close its connection
        finally:
            del self._open[conn.number]
            writer.transport.abort()
            writer.close()
            self._handlers.discard(task)

    async def _one_exchange(self, conn: _Connection) -> bool:
        """Read one request and answer it; whether the connection stays open for another."""
        event = await self._next_event(conn)
        if not isinstance(event, h11.Request):
            return False
        chunks: list[bytes] = []
        while True:
            part = await self._next_event(conn)
            if isinstance(part, h11.Data):
                chunks.append(bytes(part.data))
            elif isinstance(part, h11.EndOfMessage):
                break
            else:
                return False
        raw = b"".join(chunks)
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        now = self._now()
        request = Request(
            number=next(self._numbers),
            connection=conn.number,
            received=now,
            method=event.method.decode(),
            path=event.target.decode(),
            headers={k.decode().lower(): v.decode() for k, v in event.headers},
            body=body,
        )
        self.requests.append(request)
        blip = self._blips_at.pop(request.number, None)
        if blip is not None:
            self._cut()
            self._spawn(self._blip(0.0, blip))
            request.outcome, request.answered = "disconnected", now
            return False
        return await self._answer(conn, request, now)

    async def _answer(self, conn: _Connection, request: Request, now: float) -> bool:
        path = request.path.split("?")[0]
        if path.startswith("/v1/messages/batches") and request.api_key is not None:
            return await self._batches(conn, request, path, now)
        rule = self._rule_for(request, now)
        fault: str
        if path == _COUNT_TOKENS and request.method == "POST" and request.api_key is not None:
            return await self._count_tokens(conn, request, rule)
        if path != "/v1/messages" or request.method != "POST":
            fault, delay = "not_found", 0.0
        elif request.api_key is None:
            fault, delay = "authentication", 0.0
        elif not _is_messages_request(request.body):
            fault, delay = "invalid", 0.0
        elif rule is not None:
            rule.hits += 1
            fault, delay = rule.fault, rule.delay
        elif self.enforce_limits and (wait := self._take(request, now)) > 0:
            rule = Rule("rate_limit", None, None, now, now, math.ceil(wait), None, 0.0)
            fault, delay = "rate_limit", 0.0
        elif _tokens(request.prompt) > self.max_input_tokens:
            fault, delay = "prompt_too_long", 0.0  # checked before inference: answered at once
        else:
            fault, delay = "ok", self.latency
        if fault == "hang":
            delay = math.inf
        streamed = isinstance(request.body, dict) and request.body.get("stream") is True
        if fault == "stall" and not streamed:
            fault = "hang"
            delay = math.inf
        if delay > 0 and await self._client_leaves_within(conn, delay):
            request.outcome, request.answered = "disconnected", self._now()
            return False
        if fault == "drop":
            request.outcome, request.answered = "drop", self._now()
            return False
        status, payload, extra = self._response(request, fault, rule)
        if status == 200 and streamed:
            return await self._stream(conn, request, payload, fault, rule)
        headers = [
            ("content-type", "application/json"),
            ("request-id", f"req_{next(self._ids):024d}"),
            *self._ratelimit_headers(
                request,
                payload if status == 200 else None,
                None if rule is None else rule.ratelimit_reset,
            ),
            *extra,
        ]
        if rule is not None and rule.headers:
            headers = [(k, v) for k, v in headers if k not in rule.headers]
            headers += list(rule.headers.items())
        body = json.dumps(payload).encode()
        if fault == "garbage":  # valid JSON, but no Message: no id, no content, no usage
            body = json.dumps({"type": "message", "note": "a proxy's idea of an answer"}).encode()
        if fault == "cut":  # the headers promise the whole body; half of it comes, then a reset
            await self._send(conn, status, headers, body, cut=len(body) // 2)
            request.status, request.outcome, request.answered = status, fault, self._now()
            return False
        await self._send(conn, status, headers, body)
        request.status, request.outcome, request.answered = status, fault, self._now()
        return conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    # -- the Message Batches API ---------------------------------------------------------------

    def batch_outcome(
        self, outcome: BatchOutcome, *, match: Callable[[Any], bool] | None = None
    ) -> None:
        """Requests of later batches whose params `match` accepts (None: all) end with `outcome`
        ("errored": an overloaded_error, "expired", "canceled") instead of succeeding."""
        self._batch_rules.append((outcome, match))

    async def _batches(self, conn: _Connection, request: Request, path: str, now: float) -> bool:
        parts = path.removeprefix("/v1/messages/batches").strip("/").split("/")
        status, lines = 200, None
        payload: Any
        extra: list[tuple[str, str]] = []
        rule = self._rule_for(request, now)
        if rule is not None and rule.fault in _ERRORS:  # a scripted error of a batch endpoint
            rule.hits += 1
            status, payload, extra = self._response(request, rule.fault, rule)
        elif request.method == "POST" and parts == [""]:
            payload = self._create_batch(request, now)
        elif parts[0] in self.batches and request.method == "GET" and len(parts) == 1:
            payload = self._batch_json(parts[0], now)
        elif parts[0] in self.batches and request.method == "POST" and parts[1:] == ["cancel"]:
            self.batches[parts[0]].canceled = True
            payload = self._batch_json(parts[0], now)
        elif parts[0] in self.batches and request.method == "GET" and parts[1:] == ["results"]:
            lines = "".join(json.dumps(r) + "\n" for r in self._batch_results(parts[0]))
            payload = None
        else:
            status, error_type, message = _ERRORS["not_found"]
            payload = {"type": "error", "error": {"type": error_type, "message": message}}
            status = 404
        body = lines.encode() if lines is not None else json.dumps(payload).encode()
        kind = "application/binary" if lines is not None else "application/json"
        headers = [("content-type", kind), ("request-id", f"req_{next(self._ids):024d}"), *extra]
        await self._send(conn, status, headers, body)
        request.status, request.outcome, request.answered = status, "batch", self._now()
        return conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    def _create_batch(self, request: Request, now: float) -> dict[str, Any]:
        batch_id = f"msgbatch_{next(self._ids):024d}"
        entries: list[tuple[str, Any, str]] = []
        for item in (request.body or {}).get("requests", []):
            params = item["params"]
            outcome = "succeeded"
            for rule_outcome, match in self._batch_rules:
                if match is None or match(params):
                    outcome = rule_outcome
                    break
            entries.append((item["custom_id"], params, outcome))
        self.batches[batch_id] = _Batch(batch_id, now, now + self.batch_latency, entries)
        return self._batch_json(batch_id, now)

    def _batch_json(self, batch_id: str, now: float) -> dict[str, Any]:
        batch = self.batches[batch_id]
        ended = batch.canceled or now >= batch.ends
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        for _, _, outcome in batch.entries:
            counts["canceled" if batch.canceled else outcome if ended else "processing"] += 1
        wall = current_clock().wall()
        stamp = datetime.fromtimestamp(wall - (now - batch.created), UTC).isoformat()
        return {
            "id": batch_id,
            "type": "message_batch",
            "processing_status": "ended" if ended else "in_progress",
            "request_counts": counts,
            "created_at": stamp,
            "expires_at": stamp,
            "ended_at": stamp if ended else None,
            "archived_at": None,
            "cancel_initiated_at": stamp if batch.canceled else None,
            "results_url": f"{self.url}/v1/messages/batches/{batch_id}/results" if ended else None,
        }

    def _batch_results(self, batch_id: str) -> list[dict[str, Any]]:
        batch = self.batches[batch_id]
        results: list[dict[str, Any]] = []
        for custom_id, params, outcome in reversed(batch.entries):  # any order, says the API
            result: dict[str, Any]
            if batch.canceled:
                result = {"type": "canceled"}
            elif outcome == "succeeded":
                fake = Request(0, 0, 0.0, "POST", "/v1/messages", {}, params)
                result = {"type": "succeeded", "message": self._message(fake)}
            elif outcome == "errored":
                error = {"type": "overloaded_error", "message": "Overloaded"}
                result = {"type": "errored", "error": {"type": "error", "error": error}}
            else:
                result = {"type": outcome}
            results.append({"custom_id": custom_id, "result": result})
        return results

    def _take(self, request: Request, now: float) -> float:
        """Take one request and its input tokens from the buckets; 0, or the seconds until
        there is room (nothing taken). Output tokens are taken when the answer is made."""
        buckets = self._buckets
        for unit, limit in self.limits.items():
            buckets[unit] = min(limit, buckets[unit] + (now - self._filled) * limit / _WINDOW)
        self._filled = now
        need = {"requests": 1, "input-tokens": _tokens(request.prompt), "output-tokens": 0}
        wait = 0.0
        for unit, n in need.items():
            short = n - buckets[unit]
            if short > 0 or buckets[unit] < 0:
                wait = max(wait, max(short, -buckets[unit]) * _WINDOW / self.limits[unit])
        if wait > 0:
            return wait
        for unit, n in need.items():
            buckets[unit] -= n
        return 0.0

    async def _count_tokens(self, conn: _Connection, request: Request, rule: Rule | None) -> bool:
        """`/v1/messages/count_tokens`: the prompt's input tokens, as a Messages call of it would
        use them (cached or not), or the error its rule scripts. It has no rate-limit headers of
        the Messages budget: the API limits these calls separately."""
        if rule is not None:
            rule.hits += 1
            status, payload, extra = self._response(request, rule.fault, rule)
        else:
            status, payload, extra = 200, {"input_tokens": _tokens(request.prompt)}, []
        headers = [("content-type", "application/json"), *extra]
        await self._send(conn, status, headers, json.dumps(payload).encode())
        request.status, request.answered = status, self._now()
        request.outcome = "ok" if rule is None else rule.fault
        return conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    def counted(self) -> list[Request]:
        """The `count_tokens` requests, in arrival order."""
        return [r for r in self.requests if r.path.split("?")[0] == _COUNT_TOKENS]

    def _rule_for(self, request: Request, now: float) -> Rule | None:
        path = request.path.split("?")[0]
        for rule in self.rules:
            wanted = rule.path
            here = path.startswith(wanted[:-1]) if wanted.endswith("*") else path == wanted
            if here and rule.applies(request.body, now):
                return rule
        return None

    def _response(
        self, request: Request, fault: str, rule: Rule | None
    ) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
        if fault in ("ok", "slow", "stall", "garbage", "cut"):
            return 200, self._message(request), []
        if fault == "refusal":
            refused = self._message(request)
            refused["content"], refused["stop_reason"] = [], "refusal"
            return 200, refused, []
        status, error_type, message = _ERRORS[fault]
        if fault == "prompt_too_long":
            message = (
                f"prompt is too long: {max(_tokens(request.prompt), self.max_input_tokens + 1)} tokens > "
                f"{self.max_input_tokens} maximum"
            )
        extra: list[tuple[str, str]] = []
        if rule is not None and rule.retry_after is not None:
            extra.append(("retry-after", _number(rule.retry_after)))
        if rule is not None and rule.retry_after_ms is not None:
            extra.append(("retry-after-ms", _number(rule.retry_after_ms)))
        if status >= 500:
            extra.append(("x-should-retry", "true"))
        body = {"type": "error", "error": {"type": error_type, "message": message}}
        return status, body, extra

    def _message(self, request: Request) -> dict[str, Any]:
        prompt = request.prompt
        max_tokens = int(request.body.get("max_tokens", 1))
        stop_reason = "end_turn"
        if self._answers:
            answer = self._answers.pop(0)
            text = answer(request.body) if callable(answer) else answer
            words = text.split()
        else:
            words = f"echo: {prompt}".split()
            text = " ".join(words)
        if len(words) > max_tokens:  # a word a token: cut where the API would stop
            words = words[:max_tokens]
            text = " ".join(words)
            stop_reason = "max_tokens"
        written, read = self._cache(request.body)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        choice = request.body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "tool":
            # A forced tool call: the scripted answer (JSON) is the tool's input, an object.
            try:
                given = json.loads(text)
            except ValueError:
                given = {"text": text}
            content = [
                {
                    "type": "tool_use",
                    "id": f"toolu_{next(self._ids):024d}",
                    "name": choice["name"],
                    "input": given if isinstance(given, dict) else {"value": given},
                }
            ]
            stop_reason = "tool_use"
        return {
            "id": f"msg_{next(self._ids):024d}",
            "type": "message",
            "role": "assistant",
            "model": request.body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": max(1, _tokens(prompt) - written - read),
                "output_tokens": len(words),
                "cache_creation_input_tokens": written,
                "cache_read_input_tokens": read,
            },
        }

    def _cache(self, body: Any) -> tuple[int, int]:
        """Prompt caching of the system prompt: the tokens of its blocks up to the last one
        marked ``cache_control``, written on first sight, read after; (written, read)."""
        system = body.get("system")
        if not isinstance(system, list):
            return 0, 0
        marked = [i for i, block in enumerate(system) if block.get("cache_control")]
        if not marked:
            return 0, 0
        prefix = "\n".join(block.get("text", "") for block in system[: marked[-1] + 1])
        key = (body.get("model"), prefix)
        if key in self.cached:
            return 0, _tokens(prefix)
        self.cached.add(key)
        return _tokens(prefix), 0

    def _ratelimit_headers(
        self, request: Request, message: dict[str, Any] | None, reset_in: float | None = None
    ) -> list[tuple[str, str]]:
        now = self._now()
        if now - self._window_start >= _WINDOW:
            self._window_start = now
            self._used = dict.fromkeys(self.limits, 0)
        used = self._used
        used["requests"] += 1
        if message is not None:
            used["input-tokens"] += message["usage"]["input_tokens"]
            used["output-tokens"] += message["usage"]["output_tokens"]
            if self.enforce_limits:
                self._buckets["output-tokens"] -= message["usage"]["output_tokens"]
        wall = datetime.fromtimestamp(current_clock().wall(), UTC)
        reset = wall + timedelta(seconds=self._window_start + _WINDOW - now)
        stamp = reset.isoformat().replace("+00:00", "Z")
        headers: list[tuple[str, str]] = []
        for unit, limit in self.limits.items():
            prefix = f"anthropic-ratelimit-{unit}"
            remaining = max(0, limit - used[unit])
            until = stamp
            if self.enforce_limits:  # the bucket's level, full again at `until`
                level = self._buckets[unit]
                remaining = max(0, math.floor(level))
                full_in = (limit - level) * _WINDOW / limit
                until = (wall + timedelta(seconds=full_in)).isoformat().replace("+00:00", "Z")
            if reset_in is not None and unit == "requests":
                remaining = 0
                until = (wall + timedelta(seconds=reset_in)).isoformat().replace("+00:00", "Z")
            headers += [
                (f"{prefix}-limit", str(limit)),
                (f"{prefix}-remaining", str(remaining)),
                (f"{prefix}-reset", until),
            ]
        return headers

    async def _stream(
        self,
        conn: _Connection,
        request: Request,
        message: dict[str, Any],
        fault: str,
        rule: Rule | None,
    ) -> bool:
        """Answer with server-sent events, as the API streams; a "stall" stops after
        `rule.events` of them and waits for the client to give up."""
        headers = [
            ("content-type", "text/event-stream"),
            ("request-id", f"req_{next(self._ids):024d}"),
            *self._ratelimit_headers(request, message),
        ]
        response = h11.Response(status_code=200, headers=headers, reason=b"OK")
        conn.writer.write(conn.h11.send(response) or b"")
        request.status = 200
        usage = message["usage"]
        head = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**usage, "output_tokens": 1},
        }
        events: list[dict[str, Any]] = [
            {"type": "message_start", "message": head},
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ]
        text = message["content"][0]["text"]
        events += [
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": piece},
            }
            for piece in re.findall(r"\S+\s*", text) or [text]
        ]
        events += [
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
            {"type": "message_stop"},
        ]
        if fault == "stall" and rule is not None:
            events = events[: rule.events]
        for event in events:
            data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            conn.writer.write(conn.h11.send(h11.Data(data=data)) or b"")
            await conn.writer.drain()
        if fault == "stall":
            await self._client_leaves_within(conn, math.inf)
            request.outcome, request.answered = "stall", self._now()
            return False
        conn.writer.write(conn.h11.send(h11.EndOfMessage()) or b"")
        await conn.writer.drain()
        request.outcome, request.answered = fault, self._now()
        return conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    # -- the socket ------------------------------------------------------------------------------

    async def _next_event(self, conn: _Connection) -> Any:
        while True:
            event = conn.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.h11.receive_data(await conn.reader.read(_CHUNK))  # b"" tells h11 it was closed

    async def _client_leaves_within(self, conn: _Connection, seconds: float) -> bool:
        """Wait `seconds` while watching the socket: True as soon as it closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(None if math.isinf(left) else left):
                    data = await conn.reader.read(_CHUNK)
            except TimeoutError:
                return False
            if not data:
                return True
            conn.h11.receive_data(data)  # a pipelined request: h11 keeps it for the next cycle

    async def _send(
        self,
        conn: _Connection,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        cut: int | None = None,
    ) -> None:
        """Write a whole response; with `cut`, only its first `cut` bytes of body, then reset
        the connection (the client reads a truncated body)."""
        response = h11.Response(
            status_code=status,
            headers=[*headers, ("content-length", str(len(body)))],
            reason=_REASONS.get(status, b""),
        )
        out = conn.h11.send(response) or b""
        if cut is not None:
            out += conn.h11.send(h11.Data(data=body[:cut])) or b""
            conn.writer.write(out)
            await conn.writer.drain()
            conn.writer.transport.abort()
            return
        out += conn.h11.send(h11.Data(data=body)) or b""
        out += conn.h11.send(h11.EndOfMessage()) or b""
        conn.writer.write(out)
        await conn.writer.drain()


def _is_messages_request(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("model"), str)
        and isinstance(body.get("max_tokens"), int)
        and isinstance(body.get("messages"), list)
    )


def _default_delay(fault: Fault, latency: float) -> float:
    return 10 * latency if fault == "slow" else 0.0


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
