"""`ClaudeAgent`: an agent that asks Claude through the Messages API, and the errors of its calls.

What a call does, in order:

1. Before it: the dispatcher reserves the agent's `estimate(task)` (one request, the prompt's
   tokens estimated locally, `max_tokens` output tokens) on the `ClaudeLimits` of its key and model
   family, shared by every Claude agent on them (`ClaudeAccount`). With ``count_tokens=True`` the
   attempt first asks the API's `count_tokens` and trues that reservation up to the count before
   the call is sent (`Context.reserve`: it waits for room rather than overrun the budget).
2. The request goes through a client with `max_retries=0`: orchestra's retry policy is the only
   retry. Raw-response access gives the `anthropic-ratelimit-*` headers of every answer, successful
   ones too, and they adapt the shared limits (`ClaudeLimits.observe_headers`).
3. With `stream=True`, the answer streams under a time-to-first-token and an idle timeout
   (`StreamTimeout`), so a stalled stream fails its attempt long before the whole-call timeout.
4. The usage of every answer (failed attempts too: an output that fails validation, a stream that
   stalls after its first event) is recorded through `ctx.record_usage` with its cost from the price
   table (`PRICES`, overridable), which trues up the reserved estimate; cache writes (and cache
   reads on 3.x models) are taken from the input-token budget too, as the API counts them.
5. With `output=` a pydantic model, the request asks for that JSON schema (the SDK's own structured
   output: the schema `messages.parse` sends) and the answer is validated; an invalid answer fails
   the attempt with `StructuredOutputError`, and the next attempt's conversation holds the rejected
   answer and the validation errors.

Errors are the SDK's own: the core classifies them (429 / 529 / 5xx / connection errors / timeouts
retryable, other 4xx permanent, Retry-After honoured and shared by everyone on the key) and the
error record keeps the status, the API's error type and message and the request id, never the key.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
from anthropic import APIError, APIResponseValidationError, APIStatusError
from anthropic.lib._parse._transform import transform_schema
from pydantic import BaseModel, ValidationError

from .._agent import check_options
from .._clock import current_clock
from .._config import check_int, check_number
from .._exceptions import ConfigError, PermanentError, RetryableError, VerificationError
from .._failure import bound
from .._log import get_logger
from ._claude_account import ClaudeAccount
from ._claude_limits import ClaudeLimits, model_family
from ._claude_prices import Usage, check_prices, cost_of, price_of

log = get_logger("orchestra")

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic
    from anthropic.types import Message, MessageParam, Model

    from .._concurrency import Concurrency
    from .._core._context import Context
    from .._limits import Limiter
    from .._retry import RetryPolicy
    from .._task import Task
    from ._claude_prices import Price

__all__ = ("ClaudeAgent", "Prompt", "StreamTimeout", "StructuredOutputError")

Prompt = str | Callable[["Task", "Context"], str]
"""A `str.format` template over ``payload``, ``deps`` and ``task``, or a function of both."""

_TOOL: Final = "answer"  # the one tool a model without structured outputs answers through
_CHARS_PER_TOKEN: Final = 3.5  # a cheap, slightly generous local estimate of a prompt's tokens
_MAX_ANSWER: Final = 1_500  # characters of a rejected answer carried into the next conversation
_REJECTED: Final = "Your previous answer did not match the required JSON schema: "
_ANSWER_MARK: Final = "\n\nYour previous answer was:\n"
# What `messages.count_tokens` accepts of a Messages request.
_COUNTED: Final = frozenset(
    ("model", "messages", "system", "output_config", "tools", "tool_choice", "thinking")
)
# A feedback entry the runtime noted for a failed attempt reads "ErrorType: message"; those of
# the API (a 429, a timeout) are no news to the model, only rejections (this module's and a
# verifier's) are put into the conversation.
_ERROR_NOTE = re.compile(r"^[A-Z]\w*(Error|Timeout|Exception|Exceeded|Refused)?: ")
# Messages API parameters the agent sets from its own arguments: `params=` may not override them.
_OWN_PARAMS: Final = frozenset(("model", "messages", "max_tokens", "system", "stream"))
_OUTPUT_PARAMS: Final = frozenset(("output_config", "tools", "tool_choice"))


class StreamTimeout(RetryableError):
    """A streamed answer gave no first token, or no next event, within its timeout (retryable: the
    attempt is abandoned and the connection closed)."""


class StructuredOutputError(VerificationError):
    """Claude's answer did not validate against the agent's output model. Retryable, without
    counting against the agent's breaker; the feedback (the answer and the validation errors) goes
    into the next attempt's conversation."""


class ClaudeAgent:
    """An agent that asks Claude through the Messages API.

    Args:
        name: the agent's name (fallback chains, limits, events and errors refer to it by it).
        kinds: the task kinds it serves.
        model: a model id (`anthropic.types.Model` lists the current ones).
        system: the system prompt.
        prompt: the user turn: a `str.format` template over ``payload`` (the task's payload),
            ``deps`` (the outputs of its dependencies, by id) and ``task``, such as
            ``"Clause: {payload[text]}"``; or a function ``(task, ctx) -> str``.
        output: a pydantic model: the answer is asked for as that JSON schema and validated; the
            agent returns the model instance. None: the answer's text.
        max_tokens: the answer's token limit, reserved on the output-token budget before the call.
        account: the API key's `ClaudeAccount` (default: `ClaudeAccount.shared()`, or
            `ClaudeAccount.of(client)`).
        client: an `AsyncAnthropic` (used with `max_retries=0`) instead of `account`: agents
            given the same client share one account (`ClaudeAccount.of`).
        rate_limits: the `ClaudeLimits` to reserve on (default: the account's for the model's
            family).
        cache_system: mark the system prompt for prompt caching (`cache_control` ephemeral).
        stream: stream the answer, under `first_token_timeout` and `idle_timeout`.
        first_token_timeout: seconds from the request to the first token of a streamed answer.
        idle_timeout: seconds between two events of a streamed answer.
        timeout, retry, concurrency: as for any agent (seconds per attempt; its `RetryPolicy`;
            the most attempts at once, or a shared `Concurrency`).
        prices: price rows over the account's (`{"claude-...": Price(3, 15)}`).
        count_tokens: before each call, ask the API's `count_tokens` for the prompt's input
            tokens and true the attempt's reservation up to them (waiting for room on the
            input-token budget if they are more than the local estimate) before the call is sent.
        structured: how `output` is asked for: "json_schema" (the API's structured outputs, the
            schema `messages.parse(output_format=...)` sends), "tool" (one tool whose input is the
            schema, forced with `tool_choice`: for models without structured outputs), or "auto"
            (the default: "tool" for the 3.x models, "json_schema" for the others).
        params: more Messages API parameters for every request (``temperature``, ``metadata``).
    """

    __slots__ = (
        "_cost_logged",
        "_reads_count",
        "_schema",
        "_tool",
        "account",
        "cache_system",
        "concurrency",
        "count_tokens",
        "first_token_timeout",
        "idle_timeout",
        "kinds",
        "limits",
        "max_tokens",
        "model",
        "name",
        "output",
        "params",
        "price",
        "prompt",
        "rate_limits",
        "retry",
        "spent",
        "stream",
        "system",
        "timeout",
    )

    def __init__(
        self,
        *,
        name: str,
        kinds: Sequence[str],
        model: Model,
        system: str | None = None,
        prompt: Prompt = "{payload}",
        output: type[BaseModel] | None = None,
        max_tokens: int = 1024,
        account: ClaudeAccount | None = None,
        client: AsyncAnthropic | None = None,
        rate_limits: ClaudeLimits | None = None,
        cache_system: bool = False,
        stream: bool = False,
        first_token_timeout: float | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        concurrency: int | Concurrency | None = None,
        prices: Mapping[str, Price] | None = None,
        count_tokens: bool = False,
        structured: Literal["auto", "json_schema", "tool"] = "auto",
        params: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"ClaudeAgent name must be a non-empty string, got {name!r}")
        where = f"agent {name!r}: "
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}model must be a model id, got {model!r}")
        if not (isinstance(prompt, str) or callable(prompt)):
            raise ConfigError(f"{where}prompt must be a str template or a function, got {prompt!r}")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{where}system must be a str, got {system!r}")
        check_int(f"{where}max_tokens", max_tokens)
        check_number(
            f"{where}first_token_timeout", first_token_timeout, positive=True, optional=True
        )
        check_number(f"{where}idle_timeout", idle_timeout, positive=True, optional=True)
        if (first_token_timeout is not None or idle_timeout is not None) and not stream:
            raise ConfigError(f"{where}first_token_timeout and idle_timeout need stream=True")
        if account is not None and client is not None:
            raise ConfigError(f"{where}give account= or client=, not both")
        if account is None:
            account = ClaudeAccount.shared() if client is None else ClaudeAccount.of(client)
        if rate_limits is None:
            rate_limits = account.limits(model)
        elif not isinstance(rate_limits, ClaudeLimits):
            raise ConfigError(f"{where}rate_limits must be a ClaudeLimits, got {rate_limits!r}")
        limits = rate_limits.limiters
        check_options(name, kinds, concurrency, timeout, retry=retry, output=output, limits=limits)
        self.name = name
        self.kinds = tuple(kinds)
        self.model = model
        self.system = system
        self.prompt = prompt
        self.output = output
        self.max_tokens = max_tokens
        self.account = account
        self.rate_limits = rate_limits
        self.limits: tuple[Limiter, ...] = limits
        self.cache_system = cache_system
        self.stream = stream
        self.first_token_timeout = first_token_timeout
        self.idle_timeout = idle_timeout
        self.timeout = timeout
        self.retry = retry
        self.concurrency = concurrency
        for flag, value in (("cache_system", cache_system), ("stream", stream)):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}{flag} must be a bool, got {value!r}")
        if params is not None and not isinstance(params, Mapping):
            raise ConfigError(f"{where}params must be a mapping of Messages API parameters")
        owned = _OWN_PARAMS | (_OUTPUT_PARAMS if output is not None else frozenset())
        if clash := sorted(owned.intersection(params or {})):
            raise ConfigError(
                f"{where}params may not set {', '.join(clash)}: the agent's own arguments "
                "(model=, prompt=, max_tokens=, system=, stream=, output=) set them"
            )
        check_prices(f"{where}prices", prices)
        self.params: dict[str, Any] = dict(params or {})
        if not isinstance(count_tokens, bool):
            raise ConfigError(f"{where}count_tokens must be a bool, got {count_tokens!r}")
        self.count_tokens = count_tokens
        self.price = price_of(model, {**account.prices, **(prices or {})})
        self.spent: dict[str, float] = {}
        """Tokens (by usage field) and ``"cost"`` (USD) of every answer this agent received."""
        self._cost_logged = False
        # Models before the 4 generation (marked with a dagger on the rate-limits page) count
        # cache reads against the input-token budget too; later ones count only cache writes.
        self._reads_count = model_family(model).endswith("-3")
        if structured not in ("auto", "json_schema", "tool"):
            raise ConfigError(
                f"{where}structured must be 'auto', 'json_schema' or 'tool', got {structured!r}"
            )
        if structured == "auto":  # structured outputs came with the 4 generation
            structured = "tool" if model_family(model).endswith("-3") else "json_schema"
        # The schema `messages.parse(output_format=...)` would send, made once; or, for a model
        # without structured outputs, the one tool the answer must call, its input the schema.
        self._schema = None if output is None else transform_schema(output)
        self._tool: dict[str, Any] | None = None
        if output is not None and structured == "tool":
            self._tool = {
                "name": _TOOL,
                "description": f"Give the answer as {output.__name__}.",
                "input_schema": output.model_json_schema(),
            }

    # -- the agent protocol ----------------------------------------------------------------------

    def estimate(self, task: Task) -> dict[str, float]:
        """What a call reserves before it is sent: the prompt's input tokens, estimated locally
        (its characters over 3.5, with the system prompt and the payload), and `max_tokens`."""
        chars = len(self.system or "") + len(str(task.payload))
        if isinstance(self.prompt, str):
            chars += len(self.prompt)
        return {
            "input_tokens": math.ceil(chars / _CHARS_PER_TOKEN) + 8,
            "output_tokens": self.max_tokens,
        }

    def cost_of(self, units: Mapping[str, float]) -> float:
        """USD of these token counts at this agent's price (0 without one): what the run's budget
        prices an attempt's reservation with before it starts."""
        if self.price is None:
            return 0.0
        return cost_of(self.price, Usage(units))

    async def __call__(self, task: Task, ctx: Context) -> Any:
        message = await self.send(self.request(self.conversation(task, ctx)), ctx)
        return self.read(message)

    # -- the parts, for agents built on this one (a planner, a verifier, batches) ----------------

    def conversation(self, task: Task, ctx: Context) -> list[MessageParam]:
        """The messages of this attempt: the prompt, then, after a rejected answer, that answer
        and what was wrong with it (the feedback of earlier attempts)."""
        messages: list[MessageParam] = [{"role": "user", "content": self.render(task, ctx)}]
        for note in ctx.feedback:
            if _ERROR_NOTE.match(note):
                continue
            if note.startswith(_REJECTED) and _ANSWER_MARK in note:
                errors, answer = note[len(_REJECTED) :].split(_ANSWER_MARK, 1)
                messages.append({"role": "assistant", "content": answer or "(empty)"})
                messages.append(
                    {
                        "role": "user",
                        "content": f"{_REJECTED}{errors}\nAnswer again, with JSON that matches it.",
                    }
                )
            else:
                messages.append({"role": "user", "content": f"Feedback on your answer: {note}"})
            if messages[-2]["role"] == "user":  # two user turns in a row: keep them one turn
                last = messages.pop()
                messages[-1] = {
                    "role": "user",
                    "content": f"{messages[-1]['content']}\n\n{last['content']}",
                }
        return messages

    def render(self, task: Task, ctx: Context) -> str:
        """The user prompt of `task`. A template that names what the task does not have fails
        the attempt permanently, naming the task."""
        prompt = self.prompt
        try:
            if isinstance(prompt, str):
                return prompt.format(payload=task.payload, deps=ctx.deps, task=task)
            text = prompt(task, ctx)
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise PermanentError(
                f"agent {self.name!r}: the prompt of task {task.id!r} cannot be built: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise PermanentError(
                f"agent {self.name!r}: the prompt function returned {type(text).__name__}, not str"
            )
        return text

    def request(self, messages: Sequence[MessageParam]) -> dict[str, Any]:
        """The Messages API parameters of a call with `messages`."""
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": list(messages),
            **self.params,
        }
        if self.system is not None:
            params["system"] = (
                [{"type": "text", "text": self.system, "cache_control": {"type": "ephemeral"}}]
                if self.cache_system
                else self.system
            )
        if self._tool is not None:
            params["tools"] = [self._tool]
            params["tool_choice"] = {"type": "tool", "name": _TOOL}
        elif self._schema is not None:
            params["output_config"] = {"format": {"type": "json_schema", "schema": self._schema}}
        return params

    async def send(self, params: dict[str, Any], ctx: Context) -> Message:
        """One call: the answer, its rate-limit headers observed and its usage recorded. API errors
        are the SDK's own, raised after their headers were observed."""
        refusal = self.account.refusal(current_clock().now())
        if refusal is not None:
            ctx.record_usage(model=self.model, input_tokens=0, output_tokens=0)  # nothing spent
            raise PermanentError(f"agent {self.name!r}: not sent: {refusal}")
        counted = await self._count(params, ctx) if self.count_tokens else None
        await self._check_fits(params, ctx, counted)
        try:
            if self.stream:
                return await self._stream(params, ctx)
            raw = await self.account.client.messages.with_raw_response.create(**params)
            self._observe(raw.headers)
            message: Message = await raw.parse()
            if not _is_message(message):
                # The client validates leniently: a proxy's 200 that is no Message would fail
                # later as an AttributeError. It is a retryable glitch of the answer, as the
                # SDK itself would raise it with strict validation, carrying its request id.
                raise APIResponseValidationError(
                    raw.http_response,
                    bound(raw.http_response.text, 200),
                    message=f"agent {self.name!r}: the API answered 200 with a body that is"
                    " not a Message (no content or usage)",
                )
        except APIStatusError as exc:
            self._observe(exc.response.headers)
            if exc.status_code == 401:
                self.account.refused(exc, current_clock().now())
            # An error answer costs no tokens: the reserved estimate is given back.
            ctx.record_usage(model=self.model, input_tokens=0, output_tokens=0)
            raise
        self._record(message.usage, ctx)
        return message

    def read(self, message: Message) -> Any:
        """The answer: the output model's instance, or the text. A refusal is permanent; an
        answer that fails the output model raises `StructuredOutputError`; a text cut at
        `max_tokens` is the answer, with a warning."""
        if message.stop_reason == "refusal":
            raise PermanentError(f"agent {self.name!r}: Claude declined to answer (refusal)")
        text = "".join(block.text for block in message.content if block.type == "text")
        if self.output is None:
            if message.stop_reason == "max_tokens":
                log.warning("answer cut at max_tokens", agent=self.name, max_tokens=self.max_tokens)
            return text
        if self._tool is not None:  # the answer is the forced tool call's input
            calls = [b for b in message.content if b.type == "tool_use" and b.name == _TOOL]
            text = json.dumps(calls[0].input) if calls else text
        try:
            return self.output.model_validate_json(text)
        except ValidationError as exc:
            errors = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            if message.stop_reason == "max_tokens":
                errors += f" (the answer was cut at max_tokens={self.max_tokens})"
            feedback = f"{_REJECTED}{bound(errors, 500)}{_ANSWER_MARK}{bound(text, _MAX_ANSWER)}"
            raise StructuredOutputError(feedback, output=text) from None

    # -- internals -------------------------------------------------------------------------------

    async def _stream(self, params: dict[str, Any], ctx: Context) -> Message:
        first, idle = self.first_token_timeout, self.idle_timeout
        started = anyio.current_time()
        async with contextlib.AsyncExitStack() as stack:
            # The answer's headers come before its first event: waiting for them counts
            # against the first-token (and idle) timeout too, or a server that never answers
            # would hold the attempt until its own timeout.
            opening = math.inf if first is None else first
            if idle is not None:
                opening = min(opening, idle)
            with anyio.move_on_after(opening) as scope:
                stream = await stack.enter_async_context(
                    self.account.client.messages.stream(**params)
                )
            if scope.cancelled_caught:
                raise StreamTimeout(
                    f"agent {self.name!r}: the stream gave no first token in {opening:.3g}s"
                )
            self._observe(stream.response.headers)
            events = stream.__aiter__()
            got_token = False
            try:
                while True:
                    if got_token:
                        wait = math.inf if idle is None else idle
                    else:
                        wait = math.inf if first is None else started + first - anyio.current_time()
                        if idle is not None:
                            wait = min(wait, idle)
                    with anyio.move_on_after(wait) as scope:
                        event = await anext(events, None)
                    if scope.cancelled_caught:
                        what = "next event" if got_token else "first token"
                        raise StreamTimeout(
                            f"agent {self.name!r}: the stream gave no {what} in {wait:.3g}s"
                        )
                    if event is None:
                        break
                    if event.type == "content_block_delta":
                        got_token = True
            except BaseException:
                # A stream cut short: what the API reported so far (the input tokens of its
                # first event) was spent all the same.
                with contextlib.suppress(Exception):  # no first event: nothing reported
                    self._record(stream.current_message_snapshot.usage, ctx)
                raise
            message: Message = await stream.get_final_message()
        self._record(message.usage, ctx)
        return message

    async def _check_fits(self, params: dict[str, Any], ctx: Context, counted: int | None) -> None:
        """Refuse, unsent, a request whose input tokens alone exceed the key's whole known
        input-token budget per minute: the API answers it 429 however long it waits, and each
        429's Retry-After would hold every agent on the key. Permanent, with the reservation
        given back. The local estimate is generous, so an estimate over the budget is confirmed
        by `count_tokens` (free) first; a request with a cache mark is let through, as cache
        reads do not count against the budget on current models and cannot be known before."""
        limit = self.rate_limits.known("input_tokens")
        if limit is None or self.cache_system:
            return
        tokens = counted
        if tokens is None:
            chars = len(str(params.get("system", "")))
            chars += sum(len(str(message["content"])) for message in params["messages"])
            if chars / _CHARS_PER_TOKEN <= limit:
                return
            tokens = await self._count_request(params, ctx)
        if tokens is None or tokens <= limit:
            return
        ctx.record_usage(model=self.model, input_tokens=0, output_tokens=0)  # nothing was spent
        raise PermanentError(
            f"agent {self.name!r}: the request holds {tokens} input tokens, more than the key's"
            f" whole budget of {limit:g} input tokens per minute for {model_family(self.model)}:"
            " the API would refuse it every time; shorten the prompt or raise the limit"
        )

    async def _count_request(self, params: dict[str, Any], ctx: Context) -> int | None:
        """The request's input tokens by `count_tokens`, or None when counting failed."""
        try:
            counted = await self.account.client.messages.count_tokens(
                **{key: value for key, value in params.items() if key in _COUNTED}
            )
        except APIError as exc:
            ctx.log.info(
                "count_tokens failed; keeping the local estimate", error=type(exc).__name__
            )
            return None
        return counted.input_tokens

    async def _count(self, params: dict[str, Any], ctx: Context) -> int | None:
        """True the attempt's input-token reservation up to what `count_tokens` says the request
        holds, before it is sent: a prompt much longer than the local estimate waits for room on
        the input-token budget instead of overrunning it (`Context.reserve`). Returns the count
        (None: not counted).

        Token counting has its own requests-per-minute limit at the API, apart from the Messages
        budget, and it is free: its calls are not metered here, and their failures (a 429 of
        that separate limit included) are no reason to fail or delay the attempt: the local
        estimate stays, and the call goes on. Its headers describe that other budget and are not
        observed."""
        held = ctx.reserved.get("input_tokens")
        if held is None:
            return None  # nothing reserved (a limiter-free setup): nothing to true up
        counted = await self._count_request(params, ctx)
        if counted is not None and counted <= (self.rate_limits.known("input_tokens") or counted):
            # (one over the whole budget is refused by `_check_fits`: no wait for its room)
            await ctx.reserve(input_tokens=counted - held)
        return counted

    def _observe(self, headers: Any) -> None:
        try:
            self.rate_limits.observe_headers(headers, current_clock())
        except Exception:  # the headers are a help, never a reason to fail the call
            return

    def _record(self, usage: Any, ctx: Context) -> None:
        tokens = {
            "input_tokens": usage.input_tokens or 0,
            "output_tokens": usage.output_tokens or 0,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens or 0,
            "cache_read_input_tokens": usage.cache_read_input_tokens or 0,
        }
        cost = 0.0
        if self.price is not None:
            cost = cost_of(self.price, usage)
        elif not self._cost_logged:
            self._cost_logged = True
            ctx.log.warning("no price for the model: its cost counts 0", model=self.model)
        # The input-token budget counts cache writes, and on older models cache reads, with the
        # uncached input (the rate-limits page): the dispatcher trues the meter up to
        # `input_tokens` only, so the rest is taken here.
        cached = tokens["cache_creation_input_tokens"]
        if self._reads_count:
            cached += tokens["cache_read_input_tokens"]
        if cached:
            self.rate_limits.input_tokens.reconcile(0, cached, anyio.current_time())
        spent = self.spent
        for unit, n in tokens.items():
            spent[unit] = spent.get(unit, 0) + n
        spent["cost"] = spent.get("cost", 0.0) + cost
        ctx.record_usage(cost=cost, model=self.model, **tokens)

    def __repr__(self) -> str:
        return f"ClaudeAgent(name={self.name!r}, kinds={list(self.kinds)!r}, model={self.model!r})"


def _is_message(message: Any) -> bool:
    """Whether a leniently parsed answer has what `read` and the accounting need."""
    usage = getattr(message, "usage", None)
    return isinstance(getattr(message, "content", None), list) and isinstance(
        getattr(usage, "input_tokens", None), int
    )


for _public in (ClaudeAgent, StreamTimeout, StructuredOutputError):
    _public.__module__ = "orchestra.agents"
