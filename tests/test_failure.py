"""Failures: `describe` takes any exception down safely (bounded, scrubbed, never raising), and
`check_returned` refuses an awaitable (a forgotten `await`) and keeps any other output."""

from __future__ import annotations

import asyncio
import gc
import inspect
from typing import Any, ClassVar

import anthropic
import httpx2
import pytest

from orchestra import (
    Context,
    InvalidOutput,
    Orchestrator,
    Reduce,
    RetryPolicy,
    Task,
    agent,
)
from orchestra._failure import (
    MAX_CHAIN,
    MAX_FRAMES,
    MAX_MESSAGE,
    MAX_TRACEBACK,
    check_returned,
    describe,
    scrub,
)

FAKE_KEY = (
    "sk-ant-api03-" + "Zm9vYmFyYmF6cXV4" * 4
)  # built here so no line of this file holds it whole


def raised(exc: BaseException) -> BaseException:
    """`exc` after it was raised and caught, so it carries a traceback."""
    try:
        raise exc
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


def api_error(
    status: int, headers: dict[str, str] | None = None, body: Any = None
) -> anthropic.APIStatusError:
    request = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    if body is None:
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    cls = anthropic.RateLimitError if status == 429 else anthropic.APIStatusError
    return cls(f"Error code: {status} - {body}", response=response, body=body)


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class StrAndReprRaise(StrRaises):
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken too")


class StrReturnsInt(Exception):
    def __str__(self) -> Any:
        return 42


def recurse(n: int) -> None:
    if n == 0:
        raise ValueError("the innermost frame")
    recurse(n - 1)


class TestMessage:
    def test_the_type_and_message(self) -> None:
        failure = describe(KeyError("payload.title"))
        assert failure.error_type == "KeyError"
        assert failure.message == "'payload.title'"

    def test_an_empty_message_is_the_class_name(self) -> None:
        assert describe(TimeoutError()).message == "TimeoutError"

    @pytest.mark.parametrize(
        ("cls", "error"), [(StrRaises, "RuntimeError"), (StrReturnsInt, "TypeError")]
    )
    def test_an_exception_whose_str_fails_is_described(
        self, cls: type[Exception], error: str
    ) -> None:
        failure = describe(raised(cls("x")))
        name = cls.__name__
        assert failure.error_type == name
        assert failure.message == f"{name} whose str() raised {error}; repr: {name}('x')"
        assert failure.traceback is not None
        assert failure.traceback.endswith(f"{name}: {failure.message}\n")

    def test_an_exception_whose_str_and_repr_raise_is_described(self) -> None:
        failure = describe(raised(StrAndReprRaise()))
        assert failure.error_type == "StrAndReprRaise"
        assert failure.message == "<StrAndReprRaise whose str() and repr() raise>"

    def test_a_long_message_is_cut_with_a_marker(self) -> None:
        failure = describe(RuntimeError("x" * 100_000))
        assert len(failure.message) == MAX_MESSAGE
        assert failure.message.startswith("xxx")
        assert failure.message.endswith(f"[... {100_000 - MAX_MESSAGE} more characters cut]")


class TestTraceback:
    def test_none_for_an_exception_never_raised(self) -> None:
        assert describe(ValueError("built, not raised")).traceback is None

    def test_it_names_the_frame_and_line_that_raised(self) -> None:
        tb = describe(raised(ValueError("boom"))).traceback
        assert tb is not None
        assert tb.startswith("Traceback (most recent call last):\n")
        assert "in raised" in tb
        assert "raise exc" in tb  # the source line
        assert tb.endswith("ValueError: boom\n")

    def test_a_deep_traceback_keeps_its_innermost_frames(self) -> None:
        exc = raised_from(lambda: recurse(200))
        tb = describe(exc).traceback
        assert tb is not None
        assert tb.count("in recurse") == MAX_FRAMES
        assert "outer frames cut" in tb
        assert 'raise ValueError("the innermost frame")' in tb
        assert len(tb) <= MAX_TRACEBACK

    def test_a_long_chain_keeps_the_end_of_the_traceback(self) -> None:
        exc: BaseException | None = None
        for n in range(MAX_CHAIN):
            cause = exc
            exc = raised(RuntimeError(f"{n}:" + "y" * 50_000))
            exc.__cause__ = cause
        assert exc is not None
        tb = describe(exc).traceback
        assert tb is not None
        assert len(tb) <= MAX_TRACEBACK
        assert tb.startswith("[... traceback cut]")
        assert f"RuntimeError: {MAX_CHAIN - 1}:yyy" in tb  # the outermost exception, last
        assert tb.endswith("more characters cut]\n")

    def test_the_cause_comes_first_as_python_prints_it(self) -> None:
        def wrap() -> None:
            try:
                recurse(0)
            except ValueError as exc:
                raise RuntimeError("the agent gave up") from exc

        tb = describe(raised_from(wrap)).traceback
        assert tb is not None
        cause = tb.index("ValueError: the innermost frame")
        link = tb.index("direct cause of the following exception")
        effect = tb.index("RuntimeError: the agent gave up")
        assert cause < link < effect

    def test_a_cycle_of_contexts_ends(self) -> None:
        first, second = raised(ValueError("a")), raised(KeyError("b"))
        first.__context__, second.__context__ = second, first
        tb = describe(first).traceback
        assert tb is not None
        assert tb.count("ValueError: a") == 1


def raised_from(fn: Any) -> BaseException:
    try:
        fn()
    except BaseException as caught:
        return caught
    raise AssertionError("did not raise")


class TestSecrets:
    def test_an_api_key_in_the_message_is_redacted(self) -> None:
        failure = describe(RuntimeError(f"bad key {FAKE_KEY} for the workspace"))
        assert FAKE_KEY[8:] not in failure.message
        assert failure.message == "bad key [redacted] for the workspace"

    def test_an_api_key_in_the_traceback_is_redacted(self) -> None:
        def leak() -> None:
            raise PermissionError("rejected")  # Anthropic(api_key="sk-ant-api03-not-a-key")

        tb = describe(raised_from(leak)).traceback
        assert tb is not None
        assert "not-a-key" not in tb
        assert '# Anthropic(api_key="[redacted]")' in tb

    @pytest.mark.parametrize(
        ("text", "kept"),
        [
            (
                "headers: {'x-api-key': 'abc123secret', 'accept': 'json'}",
                "'x-api-key': '[redacted]'",
            ),
            ("Authorization: Bearer abc.def.ghi", "Authorization: Bearer [redacted]"),
            ('client(api_key="hunter2hunter2")', 'api_key="[redacted]"'),
            ("auth_token=t0ps3cr3t&x=1", "auth_token=[redacted]"),
            ('{"access_token": "ya29.a0Af-secret"}', '"access_token": "[redacted]"'),
            ("refresh_token=1//0g-secret", "refresh_token=[redacted]"),
            ("client_secret: GOCSPX-secret", "client_secret: [redacted]"),
            # A bearer token alone, with no header name before it.
            ("sent with bearer eyJhbGciOi.secret.sig== to the proxy", "bearer [redacted] to"),
            ("curl -H 'Bearer abc-secret'", "'Bearer [redacted]'"),
            # The password of a URL's userinfo, user, host and path kept.
            (
                "connect to postgresql://orchestra:s3cret-pw@db.internal:5432/runs failed",
                "postgresql://orchestra:[redacted]@db.internal:5432/runs failed",
            ),
            ("redis://:hunter2-pw@cache:6379/0", "redis://:[redacted]@cache:6379/0"),
            ("dsn='host=db user=app password=pa55-secret'", "password=[redacted]'"),
            # A password with an @ in it: everything up to the host's @ is the password.
            ("postgresql://app:pa@ss-secret@db:5432/x", "postgresql://app:[redacted]@db:5432/x"),
            # A bare `token` name, a cookie header (every pair of it), a key of another API.
            ("GET /v1?token=t0ps3cr3t&page=2", "token=[redacted]&page=2"),
            ("Cookie: session=abc123secret; theme=dark-secret", "Cookie: [redacted]"),
            ("{'set-cookie': 'sid=abc123secret; Path=/'}", "'set-cookie': '[redacted]'"),
            ("openai key sk-proj-AbC123secretXyZ987qq rejected", "key [redacted] rejected"),
        ],
    )
    def test_credential_values_are_redacted_and_their_names_kept(
        self, text: str, kept: str
    ) -> None:
        message = describe(RuntimeError(text)).message
        assert kept in message
        leaks = ("abc123secret", "abc.def", "hunter2", "t0ps3cr3t", "-secret", ".secret", "eyJ")
        assert not any(s in message for s in (*leaks, "s3cret"))

    @pytest.mark.parametrize(
        ("text", "kept"),
        [
            ('login(password="correct horse s3cret staple")', 'password="[redacted]")'),
            ("{'password': 'my s3cret phrase', 'user': 'ann'}", "'password': '[redacted]', 'user'"),
            ("Authorization: Token ghp_s3cret", "Authorization: Token [redacted]"),
            ("{'authorization': 'ApiKey s3cret'}", "'authorization': 'ApiKey [redacted]'"),
            # JSON inside a JSON string, its quotes escaped.
            ('{"body": "{\\"api_key\\": \\"s3cret\\"}"}', '\\"api_key\\": \\"[redacted]\\"'),
        ],
    )
    def test_a_value_is_redacted_whole_past_its_first_word(self, text: str, kept: str) -> None:
        message = describe(RuntimeError(text)).message
        assert kept in message
        assert "s3cret" not in message
        assert scrub(message) == message

    @pytest.mark.parametrize(
        "text",
        [
            "POST https://api.anthropic.com:443/v1/messages failed",
            "mail ann@example.com about http://host:8080/path",
            "ssh://git@github.com/org/repo.git",
        ],
    )
    def test_a_url_without_a_password_is_kept_whole(self, text: str) -> None:
        assert describe(RuntimeError(text)).message == text

    @pytest.mark.parametrize(
        "text",
        [
            "usage: input_tokens=120 output_tokens=80 max_tokens=1024",
            "tokenizer: cl100k, token_count=3",
            "the task-1 skipped",
        ],
    )
    def test_words_that_only_look_like_credentials_are_kept(self, text: str) -> None:
        assert describe(RuntimeError(text)).message == text

    def test_a_cut_message_keeps_no_part_of_a_secret(self) -> None:
        # The cut falls inside the password: scrubbed first, then cut, nothing of it is kept.
        url = "postgresql://app:" + "pw-secret-" * 20 + "@db/runs"
        failure = describe(RuntimeError("x" * (MAX_MESSAGE - 100) + f" {url} " + "y" * 500))
        assert len(failure.message) == MAX_MESSAGE
        assert "pw-secret" not in failure.message
        assert failure.message.endswith("more characters cut]")

    def test_the_request_id_and_the_api_error_type_are_scrubbed(self) -> None:
        class ProxyError(Exception):
            status_code = 401
            request_id = f"req_1 for authorization: Bearer {FAKE_KEY}"
            body: ClassVar = {"error": {"type": f"invalid x-api-key {FAKE_KEY}"}}

        failure = describe(ProxyError("unauthorized"))
        assert failure.request_id == "req_1 for authorization: Bearer [redacted]"
        assert failure.api_error_type == "invalid x-api-key [redacted]"


class TestNothingLeaksIntoAResult:
    async def test_errors_events_and_the_json_of_a_result_hold_no_secret(self) -> None:
        dsn = "postgresql://app:s3cret-pw@db.internal/runs"

        class ProxyError(Exception):
            status_code = 401
            request_id = f"req_1 {FAKE_KEY}"
            body: ClassVar = {"error": {"type": f"key {FAKE_KEY}"}}

        @agent(kinds=["w"])
        async def leaky(task: Task, ctx: Context) -> int:
            if task.payload == 2:
                return 2
            raise ProxyError(f"cannot reach {dsn} with x-api-key {FAKE_KEY}")

        def boom(acc: Any, x: Any) -> Any:
            raise ValueError(f"aggregating with {dsn}")

        events: list[Any] = []
        orch = Orchestrator(
            agents=[leaky],
            retry=RetryPolicy(max_attempts=2, base=0),
            breaker=None,
            aggregate=Reduce(boom, 0),
        )
        orch.subscribe(events.append)
        result = await orch.run(tasks=[Task("w", 1), Task("w", 2)])
        assert result.status == "failed"
        assert "aggregator raised ValueError" in str(result.metadata.reason)
        [attempt, *_] = result.errors[0].attempts
        assert attempt.request_id == "req_1 [redacted]"
        dumped = result.model_dump_json() + repr(result) + repr(events)
        assert FAKE_KEY[13:] not in dumped
        assert "s3cret" not in dumped


class TestHTTPErrors:
    def test_an_anthropic_error_gives_status_type_and_request_id(self) -> None:
        error = api_error(429, {"request-id": "req_011CKX7"})
        failure = describe(error)
        assert failure.error_type == "RateLimitError"
        assert failure.status_code == 429
        assert failure.api_error_type == "rate_limit_error"
        assert failure.request_id == "req_011CKX7"
        assert "slow down" in failure.message  # the API's own message, whole

    def test_an_overloaded_529(self) -> None:
        body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        failure = describe(api_error(529, body=body))
        assert (failure.status_code, failure.api_error_type, failure.request_id) == (
            529,
            "overloaded_error",
            None,
        )

    def test_an_httpx_status_error_gives_status_and_request_id(self) -> None:
        request = httpx2.Request("GET", "https://example.com/")
        response = httpx2.Response(503, headers={"request-id": "abc"}, request=request)
        failure = describe(httpx2.HTTPStatusError("503", request=request, response=response))
        assert (failure.status_code, failure.api_error_type, failure.request_id) == (
            503,
            None,
            "abc",
        )

    def test_another_clients_error_body_gives_the_api_error_type(self) -> None:
        class ClientError(Exception):
            status_code = 400
            body: ClassVar = {"error": {"type": "invalid_request_error", "message": "max"}}

        assert describe(ClientError("bad")).api_error_type == "invalid_request_error"

    def test_a_plain_exception_has_no_http_fields(self) -> None:
        failure = describe(ValueError("x"))
        assert (failure.status_code, failure.api_error_type, failure.request_id) == (None,) * 3

    def test_attributes_that_raise_are_skipped(self) -> None:
        class Weird(Exception):
            status_code = 500

            @property
            def request_id(self) -> str:
                raise RuntimeError("no")

            @property
            def type(self) -> str:
                raise RuntimeError("no")

        failure = describe(Weird("x"))
        assert (failure.status_code, failure.api_error_type, failure.request_id) == (
            500,
            None,
            None,
        )


class TestCheckReturned:
    @pytest.mark.parametrize(
        "output",
        [object(), {"a": object()}, iter([1]), map(str, [1]), {1, 2}, b"\xff", None],
        ids=["object", "nested-object", "iterator", "map", "set", "bad-bytes", "None"],
    )
    def test_keeps_what_is_not_awaitable_without_reading_it(self, output: Any) -> None:
        check_returned(output, "writer")  # no InvalidOutput
        if isinstance(output, map):
            assert list(output) == ["1"]  # unread

    async def test_a_coroutine_is_refused_and_closed(self) -> None:
        async def summarize() -> str:
            return "done"

        coro = summarize()
        with pytest.raises(
            InvalidOutput, match=r"agent 'writer' returned a coroutine: did you forget `await`\?"
        ):
            check_returned(coro, "writer")
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        del coro
        gc.collect()  # a coroutine never awaited nor closed would warn here (warnings are errors)

    async def test_an_asyncio_task_is_refused_and_cancelled(self) -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(InvalidOutput, match=r"returned an awaitable .*Task"):
            check_returned(task, "writer")
        with pytest.raises(asyncio.CancelledError):
            await task

    def test_an_invalid_output_is_permanent(self) -> None:
        from orchestra import PermanentError

        assert issubclass(InvalidOutput, PermanentError)
