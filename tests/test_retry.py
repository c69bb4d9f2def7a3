"""Retries: attempts per agent, exponential backoff with seeded full jitter, Retry-After, the error
classification, policies per run / kind / agent, and retry waits that hold no slot. All in fake time."""

from __future__ import annotations

import itertools
import math
from random import Random
from typing import TYPE_CHECKING, Any

import anthropic
import httpx2
import pydantic
import pytest

from orchestra import Context, InputError, PermanentError, RetryableError, RetryPolicy, Task, agent
from orchestra._retry import MAX_RETRY_AFTER, backoff, classify, retry_after_from
from orchestra.events import AttemptFailed, AttemptStarted, RetryScheduled
from orchestra.testing import FakeClock, Recorder, scripted
from tests.helpers import NEVER_OPENS, run_recorded

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra import Orchestrator

pytestmark = pytest.mark.usefixtures("clock")


# -- helpers ---------------------------------------------------------------------------------------


def _response(status: int, headers: dict[str, str] | None = None) -> httpx2.Response:
    request = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")
    return httpx2.Response(status, headers=headers or {}, request=request)


def api_error(status: int, headers: dict[str, str] | None = None) -> anthropic.APIStatusError:
    """A real anthropic error carrying a real HTTP response, as the SDK raises it."""
    response = _response(status, headers)
    body = {"type": "error", "error": {"type": "test", "message": f"HTTP {status}"}}
    classes: dict[int, type[anthropic.APIStatusError]] = {
        400: anthropic.BadRequestError,
        401: anthropic.AuthenticationError,
        403: anthropic.PermissionDeniedError,
        404: anthropic.NotFoundError,
        409: anthropic.ConflictError,
        422: anthropic.UnprocessableEntityError,
        429: anthropic.RateLimitError,
        500: anthropic.InternalServerError,
    }
    cls = classes.get(status, anthropic.APIStatusError)
    return cls(f"HTTP {status}", response=response, body=body)


def validation_error() -> pydantic.ValidationError:
    class Answer(pydantic.BaseModel):
        score: int

    try:
        Answer.model_validate({"score": "high"})
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("unreachable")


class Raiser:
    """An agent that raises the given errors, one per call, then succeeds."""

    def __init__(
        self,
        name: str,
        kinds: Sequence[str],
        errors: Sequence[BaseException],
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.name = name
        self.kinds = tuple(kinds)
        self.errors = list(errors)
        self.retry = retry
        self.calls = 0

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"by": self.name, "task": task.id}


# -- tests -----------------------------------------------------------------------------------------


class TestAttempts:
    async def test_max_attempts_counts_the_first_try(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        bad = scripted("bad", ["work"], then="error", latency=1)
        orch = make_orchestrator(agents=[bad], retry=RetryPolicy(max_attempts=4, base=0.1))
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert len(bad.calls) == 4
        assert [c.attempt for c in bad.calls] == [1, 2, 3, 4]
        assert result.status == "failed"
        assert result.metadata.attempts == 4
        assert result.metadata.retries == 3
        record = result.error_for("t")
        assert record is not None
        assert [a.number for a in record.attempts] == [1, 2, 3, 4]
        assert {a.error_type for a in record.attempts} == {"ConnectionError"}
        assert rec.results()["t"].attempts == 4

    async def test_one_attempt_means_no_retry(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        bad = scripted("bad", ["work"], then="error")
        orch = make_orchestrator(agents=[bad], retry=RetryPolicy(max_attempts=1))
        result, _, rec = await run_recorded(orch, [make_task("work")])
        assert len(bad.calls) == 1
        assert result.status == "failed"
        assert rec.of(RetryScheduled) == []

    async def test_the_last_attempt_may_succeed(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["work"], fail_first=3)
        orch = make_orchestrator(agents=[flaky], retry=RetryPolicy(max_attempts=4, base=0.1))
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert result.status == "success"
        assert flaky.outcomes() == ["error", "error", "error", "ok"]
        done = rec.results()["t"]
        assert done.attempts == 4
        assert done.failures is not None
        assert len(done.failures) == 3

    async def test_failed_attempts_record_the_delay_before_the_retry(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["work"], fail_first=2)
        policy = RetryPolicy(max_attempts=3, base=1, cap=10, jitter="none")
        orch = make_orchestrator(agents=[flaky], retry=policy)
        _, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        failures = rec.results()["t"].failures
        assert failures is not None
        assert [a.retry_in for a in failures] == [1.0, 2.0]


class TestBackoffSchedule:
    def test_exponential_and_capped_without_jitter(self) -> None:
        policy = RetryPolicy(base=0.5, cap=3, jitter="none")
        assert [backoff(policy, n, Random(0)) for n in range(6)] == [0.5, 1, 2, 3, 3, 3]

    def test_the_cap_holds_for_any_number_of_retries(self) -> None:
        # base * 2**n overflows a float from n = 1024 on; the cap must still apply.
        policy = RetryPolicy(max_attempts=5000, base=0.5, cap=30, jitter="none")
        assert [backoff(policy, n, Random(0)) for n in (1023, 1024, 4999)] == [30, 30, 30]

    async def test_a_long_retry_budget_does_not_crash_the_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["work"], fail_first=1030)
        orch = make_orchestrator(
            agents=[flaky],
            retry=RetryPolicy(max_attempts=1100, base=0.001, cap=0.01),
            breaker=NEVER_OPENS,
        )
        result = await orch.run(tasks=[make_task("work")])
        assert result.status == "success"
        assert len(flaky.calls) == 1031

    def test_full_jitter_is_uniform_below_the_envelope(self) -> None:
        policy = RetryPolicy(base=0.5, cap=30, jitter="full")
        rng = Random(3)
        for n in range(10):
            ceiling = min(30, 0.5 * 2**n)
            draws = [backoff(policy, n, rng) for _ in range(200)]
            assert all(0 <= d <= ceiling for d in draws)
            assert max(draws) > ceiling * 0.8  # spread over the range, not a fixed value
            assert min(draws) < ceiling * 0.2

    def test_equal_jitter_keeps_half_of_the_backoff(self) -> None:
        policy = RetryPolicy(base=1, cap=30, jitter="equal")
        rng = Random(5)
        for n in range(6):
            ceiling = min(30, 2**n)
            draws = [backoff(policy, n, rng) for _ in range(100)]
            assert all(ceiling / 2 <= d <= ceiling for d in draws)

    async def test_schedule_is_exactly_the_seeded_recomputation(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        clock: FakeClock,
    ) -> None:
        policy = RetryPolicy(max_attempts=6, base=0.5, cap=4, jitter="full")
        flaky = scripted("flaky", ["work"], fail_first=5, latency=0.25)
        orch = make_orchestrator(agents=[flaky], retry=policy, seed=2024, breaker=NEVER_OPENS)
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert result.status == "success"

        rng = Random(2024)
        expected = [backoff(policy, n, rng) for n in range(5)]
        assert rec.delays() == expected  # exact: same formula, same draws, same order
        assert len(set(expected)) == 5  # the jitter did draw
        # ... and the retries really waited that long, in virtual time: to the float step of
        # the loop's times, which is 2.4e-7 s at a loop time of 1.7e9 (1e-9 held below 2**23)
        starts = [e.at for e in rec.of(AttemptStarted)]
        step = max(1e-9, math.ulp(clock.now()))
        for n in range(5):
            assert starts[n + 1] - starts[n] == pytest.approx(0.25 + expected[n], abs=2 * step)
        assert result.metadata.elapsed == pytest.approx(6 * 0.25 + sum(expected), abs=12 * step)

    async def test_schedule_of_many_tasks_follows_the_draw_order(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        policy = RetryPolicy(max_attempts=5, base=1, cap=8, jitter="full")
        flaky = scripted("flaky", ["work"], failure_rate=0.5, seed=11, latency=0.5, jitter=0.4)
        # Half the calls fail: an outage the default breaker would answer with its own waits.
        orch = make_orchestrator(agents=[flaky], retry=policy, seed=99, breaker=NEVER_OPENS)
        _, _, rec = await run_recorded(orch, [make_task("work") for _ in range(20)])
        scheduled = rec.of(RetryScheduled)
        assert len(scheduled) >= 10

        rng = Random(99)
        retries_of: dict[str, int] = {}
        for event in scheduled:  # RetryScheduled is emitted right after its draw
            n = retries_of.get(event.task_id, 0)
            retries_of[event.task_id] = n + 1
            assert event.delay == backoff(policy, n, rng), event

    async def test_same_seed_same_schedule_other_seed_other_schedule(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def schedule(seed: int) -> list[float]:
            flaky = scripted("flaky", ["work"], fail_first=4)
            orch = make_orchestrator(
                agents=[flaky], retry=RetryPolicy(max_attempts=5, base=1), seed=seed
            )
            _, _, rec = await run_recorded(orch, [make_task("work")])
            return rec.delays()

        first = await schedule(7)
        assert first == await schedule(7)
        assert first != await schedule(8)

    async def test_every_run_of_an_orchestrator_replays_its_seed(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["work"], script=["error", "ok", "error", "ok"])
        orch = make_orchestrator(agents=[flaky], retry=RetryPolicy(base=2), seed=31)
        rec = Recorder()
        orch.subscribe(rec, RetryScheduled)
        async with orch:
            await orch.run(tasks=[make_task("work")])
            await orch.run(tasks=[make_task("work")])
        first, second = rec.delays()
        assert first == second == backoff(RetryPolicy(base=2), 0, Random(31))

    async def test_equal_jitter_schedule_is_exactly_recomputed(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        policy = RetryPolicy(max_attempts=5, base=2, cap=10, jitter="equal")
        flaky = scripted("flaky", ["work"], fail_first=4)
        orch = make_orchestrator(agents=[flaky], retry=policy, seed=5)
        _, _, rec = await run_recorded(orch, [make_task("work")])
        rng = Random(5)
        assert rec.delays() == [backoff(policy, n, rng) for n in range(4)]


class TestRetryAfter:
    async def test_a_longer_retry_after_wins_and_the_jitter_is_still_drawn(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        policy = RetryPolicy(max_attempts=4, base=0.5, cap=30, jitter="full")
        limited = scripted("limited", ["work"], script=["rate_limit"] * 3, retry_after=5)
        orch = make_orchestrator(agents=[limited], retry=policy, seed=17)
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert result.status == "success"
        assert rec.delays() == [5.0, 5.0, 5.0]
        failures = rec.results()["t"].failures
        assert failures is not None
        assert {a.error_type for a in failures} == {"RateLimitError"}
        starts = [e.at for e in rec.of(AttemptStarted)]
        assert [b - a for a, b in itertools.pairwise(starts)] == pytest.approx([5, 5, 5])

    async def test_precedence_checked_exactly_against_seeded_jitter(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # Retry-After 0.6 s against full-jitter backoffs in [0, 1], [0, 2], ...: some draws are
        # shorter (the hint wins), some longer (the backoff wins); the schedule is recomputed.
        policy = RetryPolicy(max_attempts=7, base=1, cap=8, jitter="full")
        limited = scripted("limited", ["work"], script=["rate_limit"] * 6, retry_after=0.6)
        orch = make_orchestrator(agents=[limited], retry=policy, seed=4, breaker=NEVER_OPENS)
        _, _, rec = await run_recorded(orch, [make_task("work")])
        rng = Random(4)
        expected = [backoff(policy, n, rng, 0.6) for n in range(6)]
        assert rec.delays() == expected
        draws = Random(4)
        raw = [backoff(policy, n, draws) for n in range(6)]
        assert any(r < 0.6 for r in raw), "the seed must exercise the hint winning"
        assert any(r > 0.6 for r in raw), "the seed must exercise the backoff winning"
        assert expected == [max(r, 0.6) for r in raw]

    async def test_a_longer_backoff_wins_over_a_short_retry_after(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        policy = RetryPolicy(max_attempts=3, base=8, cap=60, jitter="none")
        limited = scripted("limited", ["work"], script=["rate_limit"] * 2, retry_after=1)
        orch = make_orchestrator(agents=[limited], retry=policy)
        _, _, rec = await run_recorded(orch, [make_task("work")])
        assert rec.delays() == [8.0, 16.0]

    @pytest.mark.parametrize(
        ("headers", "expected"),
        [
            ({"retry-after": "7"}, 7.0),
            ({"retry-after": "2.5"}, 2.5),
            ({"retry-after-ms": "1500"}, 1.5),
            ({"retry-after-ms": "2500", "retry-after": "9"}, 2.5),  # the precise header wins
            ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.01),  # a date in the past
        ],
    )
    async def test_headers_of_a_real_429_set_the_delay(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        headers: dict[str, str],
        expected: float,
    ) -> None:
        raiser = Raiser("api", ["work"], [api_error(429, headers)])
        policy = RetryPolicy(max_attempts=2, base=0.01, jitter="none")
        orch = make_orchestrator(agents=[raiser], retry=policy)
        result, _, rec = await run_recorded(orch, [make_task("work")])
        assert result.status == "success"
        assert rec.delays() == [pytest.approx(expected)]

    async def test_overloaded_529_is_retried_after_its_hint(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        raiser = Raiser("api", ["work"], [api_error(529, {"retry-after": "3"})])
        orch = make_orchestrator(agents=[raiser], retry=RetryPolicy(base=0.01, jitter="none"))
        result, _, rec = await run_recorded(orch, [make_task("work")])
        assert result.status == "success"
        assert rec.delays() == [3.0]

    async def test_retryable_error_carries_its_own_retry_after(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        raiser = Raiser("api", ["work"], [RetryableError("busy", retry_after=4)])
        orch = make_orchestrator(agents=[raiser], retry=RetryPolicy(base=0.01, jitter="none"))
        _, _, rec = await run_recorded(orch, [make_task("work")])
        assert rec.delays() == [4.0]

    async def test_scripted_rate_limit_is_a_real_429_with_its_header(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        seen: list[BaseException] = []
        limited = scripted("limited", ["work"], script=["rate_limit"], retry_after=12)

        @agent(kinds=["work"], name="spy")
        async def spy(task: Task, ctx: Context) -> Any:
            try:
                return await limited(task, ctx)
            except Exception as exc:
                seen.append(exc)
                raise

        orch = make_orchestrator(agents=[spy], retry=RetryPolicy(base=0.01, jitter="none"))
        _, _, rec = await run_recorded(orch, [make_task("work")])
        (exc,) = seen
        assert isinstance(exc, anthropic.RateLimitError)
        assert exc.status_code == 429
        assert exc.response.headers["retry-after"] == "12"
        assert rec.delays() == [12.0]


RETRYABLE: list[tuple[str, BaseException]] = [
    ("TimeoutError", TimeoutError("read timed out")),
    ("ConnectionError", ConnectionError("reset by peer")),
    (
        "APIConnectionError",
        anthropic.APIConnectionError(request=httpx2.Request("POST", "https://x")),
    ),
    ("APITimeoutError", anthropic.APITimeoutError(request=httpx2.Request("POST", "https://x"))),
    ("RateLimitError", api_error(429)),
    ("APIStatusError", api_error(529)),
    ("InternalServerError", api_error(500)),
    ("APIStatusError", api_error(502)),
    ("APIStatusError", api_error(503)),
    ("RetryableError", RetryableError("try again")),
    ("ConnectError", httpx2.ConnectError("refused")),
    ("ReadTimeout", httpx2.ReadTimeout("slow")),
    (
        "HTTPStatusError",
        httpx2.HTTPStatusError("503", request=_response(503).request, response=_response(503)),
    ),
    # A 200 whose body failed the client's validation: a glitch of the response, worth a retry.
    (
        "APIResponseValidationError",
        anthropic.APIResponseValidationError(_response(200), body={"content": None}),
    ),
    # The API itself says so, whatever the status.
    ("BadRequestError", api_error(400, {"x-should-retry": "true"})),
]

PERMANENT: list[tuple[str, BaseException]] = [
    ("BadRequestError", api_error(400)),
    ("AuthenticationError", api_error(401)),
    ("PermissionDeniedError", api_error(403)),
    ("NotFoundError", api_error(404)),
    ("UnprocessableEntityError", api_error(422)),
    ("ValidationError", validation_error()),
    ("PermanentError", PermanentError("no such document")),
    ("InputError", InputError("bad payload")),
    (
        "HTTPStatusError",
        httpx2.HTTPStatusError("404", request=_response(404).request, response=_response(404)),
    ),
    ("RateLimitError", api_error(429, {"x-should-retry": "false", "retry-after": "1"})),
    ("InternalServerError", api_error(500, {"x-should-retry": "false"})),
]


class TestMalformedRetryAfter:
    """A server's hint is data from outside: garbage never raises, and never makes a task wait
    forever."""

    @pytest.mark.parametrize(
        ("headers", "expected"),
        [
            ({"retry-after": "soon"}, None),
            ({"retry-after": ""}, None),
            ({"retry-after": "   "}, None),
            ({"retry-after": "-5"}, None),
            ({"retry-after": "nan"}, None),
            ({"retry-after": "inf"}, None),
            ({"retry-after": "-inf"}, None),
            ({"retry-after": "1e400"}, None),  # inf once parsed
            ({"retry-after": "99999999"}, MAX_RETRY_AFTER),
            ({"retry-after": "Fri, 31 Dec 9999 23:59:59 GMT"}, MAX_RETRY_AFTER),
            ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),  # in the past: now
            ({"retry-after": "tomorrow at noon"}, None),
            (
                {"retry-after-ms": "soon", "retry-after": "4"},
                4.0,
            ),  # a bad precise header: the other
            ({"retry-after-ms": "nan"}, None),
            ({"retry-after-ms": "-100"}, None),
            ({"retry-after": "12"}, 12.0),
        ],
    )
    def test_retry_after_from_never_raises(
        self, headers: dict[str, str], expected: float | None
    ) -> None:
        assert retry_after_from(api_error(429, headers)) == expected

    @pytest.mark.parametrize("hint", ["soon", float("nan"), float("inf"), -1.0, True, None])
    def test_a_retryable_errors_bad_hint_is_ignored(self, hint: Any) -> None:
        assert classify(RetryableError("x", retry_after=hint), RetryPolicy()) == (True, None)

    def test_a_retryable_errors_huge_hint_is_capped(self) -> None:
        error = RetryableError("x", retry_after=1e12)
        assert classify(error, RetryPolicy()) == (True, MAX_RETRY_AFTER)

    @pytest.mark.parametrize("value", ["soon", "", "nan", "-3"])
    async def test_a_429_with_a_malformed_retry_after_falls_back_to_the_backoff(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        value: str,
    ) -> None:
        raiser = Raiser("api", ["work"], [api_error(429, {"retry-after": value})])
        policy = RetryPolicy(max_attempts=2, base=0.25, jitter="none")
        orch = make_orchestrator(agents=[raiser], retry=policy)
        result, _, rec = await run_recorded(orch, [make_task("work")])
        assert result.status == "success"
        assert rec.delays() == [0.25]


class TestClassification:
    @pytest.mark.parametrize(("name", "error"), RETRYABLE, ids=[r[0] for r in RETRYABLE])
    async def test_transient_errors_are_retried(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        name: str,
        error: BaseException,
    ) -> None:
        raiser = Raiser("api", ["work"], [error])
        orch = make_orchestrator(agents=[raiser], retry=RetryPolicy(max_attempts=2, base=0.1))
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert raiser.calls == 2
        assert result.status == "success"
        (failed,) = rec.of(AttemptFailed)
        assert failed.retryable
        assert failed.error_type == name

    @pytest.mark.parametrize(("name", "error"), PERMANENT, ids=[p[0] for p in PERMANENT])
    async def test_permanent_errors_are_not_retried(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        name: str,
        error: BaseException,
    ) -> None:
        raiser = Raiser("api", ["work"], [error])
        orch = make_orchestrator(agents=[raiser], retry=RetryPolicy(max_attempts=5, base=0.1))
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert raiser.calls == 1
        assert result.status == "failed"
        assert rec.of(RetryScheduled) == []
        (failed,) = rec.of(AttemptFailed)
        assert not failed.retryable
        record = result.error_for("t")
        assert record is not None
        assert record.error_type == name

    @pytest.mark.parametrize(
        ("error", "retryable", "hint"),
        [
            (api_error(429, {"retry-after": "20"}), True, 20.0),
            (api_error(529, {"retry-after-ms": "750"}), True, 0.75),
            (api_error(408), True, None),
            (api_error(500), True, None),
            (api_error(404, {"retry-after": "20"}), False, None),
            (RetryableError("x", retry_after=3), True, 3.0),
            (PermanentError("x"), False, None),
            (validation_error(), False, None),
            (TimeoutError(), True, None),
        ],
    )
    def test_classify(self, error: BaseException, retryable: bool, hint: float | None) -> None:
        assert classify(error, RetryPolicy()) == (retryable, hint)

    @pytest.mark.parametrize(
        ("header", "status", "retryable"),
        [
            ("false", 429, False),
            ("false", 529, False),
            (" FALSE ", 503, False),
            ("true", 400, True),
            ("true", 404, True),
            ("maybe", 429, True),  # not a verdict: the status decides
            ("maybe", 400, False),
        ],
    )
    def test_the_servers_x_should_retry_header_decides(
        self, header: str, status: int, retryable: bool
    ) -> None:
        error = api_error(status, {"x-should-retry": header})
        assert classify(error, RetryPolicy())[0] is retryable

    def test_a_policys_own_types_win_over_the_header(self) -> None:
        error = api_error(429, {"x-should-retry": "false"})
        policy = RetryPolicy(retryable=(anthropic.RateLimitError,))
        assert classify(error, policy) == (True, None)

    def test_an_exception_whose_attributes_raise_is_classified(self) -> None:
        class Weird(Exception):
            @property
            def status_code(self) -> int:
                raise RuntimeError("no status here")

            @property
            def response(self) -> Any:
                raise RuntimeError("no response either")

        assert classify(Weird(), RetryPolicy()) == (True, None)

    def test_policy_can_declare_more_permanent_and_retryable_types(self) -> None:
        policy = RetryPolicy(permanent=(KeyError,), retryable=(anthropic.BadRequestError,))
        assert classify(KeyError("k"), policy) == (False, None)
        assert classify(api_error(400), policy) == (True, None)
        assert classify(KeyError("k"), RetryPolicy()) == (True, None)  # unknown: retried

    async def test_a_policys_permanent_types_are_not_retried_in_a_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        raiser = Raiser("api", ["work"], [KeyError("missing field")])
        policy = RetryPolicy(max_attempts=3, base=0.1, permanent=(KeyError,))
        orch = make_orchestrator(agents=[raiser], retry=policy)
        result, _, _ = await run_recorded(orch, [make_task("work")])
        assert raiser.calls == 1
        assert result.status == "failed"


class TestPolicyPrecedence:
    async def test_agent_over_kind_over_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        own = RetryPolicy(max_attempts=2, base=1, jitter="none")
        per_kind = RetryPolicy(max_attempts=3, base=2, jitter="none")
        run_wide = RetryPolicy(max_attempts=4, base=3, jitter="none")
        with_own = scripted("with_own", ["a"], then="error", retry=own)
        kind_only = scripted("kind_only", ["b"], then="error")
        defaults = scripted("defaults", ["c"], then="error")
        orch = make_orchestrator(
            agents=[with_own, kind_only, defaults],
            retry=run_wide,
            retry_per_kind={"a": per_kind, "b": per_kind},
        )
        _, _, rec = await run_recorded(
            orch, [make_task("a", id="a"), make_task("b", id="b"), make_task("c", id="c")]
        )
        assert len(with_own.calls) == 2  # the agent's own policy beats the kind's
        assert len(kind_only.calls) == 3  # the kind's beats the run's
        assert len(defaults.calls) == 4  # the run's default
        by_task: dict[str, list[float]] = {}
        for event in rec.of(RetryScheduled):
            by_task.setdefault(event.task_id, []).append(event.delay)
        assert by_task == {"a": [1.0], "b": [2.0, 4.0], "c": [3.0, 6.0, 12.0]}

    async def test_each_agent_of_a_chain_uses_its_own_policy(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        first = scripted("first", ["work"], then="error", retry=RetryPolicy(max_attempts=2))
        second = scripted("second", ["work"], then="error", retry=RetryPolicy(max_attempts=3))
        orch = make_orchestrator(
            agents=[first, second],
            fallbacks={"work": ["first", "second"]},
            retry=RetryPolicy(max_attempts=5, base=0.1),
        )
        result, _, _ = await run_recorded(orch, [make_task("work", id="t")])
        assert (len(first.calls), len(second.calls)) == (2, 3)
        record = result.error_for("t")
        assert record is not None
        assert [a.agent for a in record.attempts] == ["first"] * 2 + ["second"] * 3


class TestRetryWaitHoldsNoSlot:
    async def test_a_waiting_retry_lets_another_task_run_and_finish_first(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # concurrency=1: A is rate limited for 10 s at t=1; B runs in the meantime (t=1..2).
        api = scripted(
            "api", ["work"], script=["rate_limit", "ok", "ok"], retry_after=10, latency=1
        )
        orch = make_orchestrator(agents=[api], concurrency=1, retry=RetryPolicy(base=0.1))
        result, _, rec = await run_recorded(
            orch, [make_task("work", id="A"), make_task("work", id="B")]
        )
        assert result.status == "success"
        assert [(c.task_id, c.attempt, c.outcome) for c in api.calls] == [
            ("A", 1, "rate_limit"),
            ("B", 1, "ok"),
            ("A", 2, "ok"),
        ]
        done = rec.results()
        assert done["B"].finished == pytest.approx(2)
        assert done["A"].finished == pytest.approx(12)
        assert result.metadata.peak_concurrency == 1

    async def test_many_waiting_retries_do_not_starve_fresh_tasks(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # Two slots, four tasks rate limited for 100 s each: the other four run meanwhile.
        script = ["rate_limit"] * 4 + ["ok"] * 8
        api = scripted("api", ["work"], script=script, retry_after=100, latency=1)
        orch = make_orchestrator(agents=[api], concurrency=2, retry=RetryPolicy(base=0.1))
        tasks = [make_task("work", id=f"t{i}") for i in range(8)]
        result, _, rec = await run_recorded(orch, tasks)
        assert result.status == "success"
        done = rec.results()
        limited = {c.task_id for c in api.calls if c.outcome == "rate_limit"}
        fresh = set(done) - limited
        assert len(limited) == len(fresh) == 4
        assert max(done[t].finished for t in fresh) < 100 < min(done[t].finished for t in limited)
        assert result.metadata.peak_concurrency == 2
