"""Verifiers and the safety check: judging an attempt's output, or a task before it runs.

A verifier is `fn(task, output)` (sync or async) per kind, returning True / None (pass), False, or a
`Verdict` with feedback. A failed check is a retryable failure; its feedback reaches the next attempt
in `ctx.feedback`. An agent's declared `output` model is checked the same way: garbage is retried.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._exceptions import Rejected, VerificationError
from ._failure import cancel_pending, describe

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ._task import Task

__all__ = ("Check", "Verdict", "check_output", "check_safety", "verify")

Check = Callable[["Task", Any], "bool | Verdict | Awaitable[bool | Verdict | None] | None"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer of a verifier or a safety check: passed or not, and why."""

    passed: bool
    feedback: str | None = None

    @classmethod
    def ok(cls) -> Verdict:
        return cls(True)

    @classmethod
    def fail(cls, feedback: str) -> Verdict:
        return cls(False, feedback)


def _judge(verdict: Any) -> tuple[bool, str | None]:
    if verdict is None or verdict is True:
        return True, None
    if verdict is False:
        return False, None
    if isinstance(verdict, Verdict):
        return verdict.passed, verdict.feedback
    raise TypeError(f"a verifier or safety check returned {verdict!r}: return a bool or a Verdict")


async def verify(check: Check, task: Task, output: Any, ctx: Any = None) -> None:
    """Raise `VerificationError` when `check` rejects `output`. A check whose `takes_context` is
    true (a `ClaudeVerifier`) is also given the attempt's `Context` (to count its own spend)."""
    if ctx is not None and getattr(check, "takes_context", False):
        verdict = check(task, output, ctx)  # type: ignore[call-arg]
    else:
        verdict = check(task, output)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    passed, feedback = _judge(verdict)
    if not passed:
        raise VerificationError(feedback or "the verifier rejected the output", output=output)


async def check_safety(check: Callable[[Task], Any], task: Task) -> None:
    """Raise `Rejected` when the safety check refuses `task`, or fails: it fails closed."""
    try:
        verdict = check(task)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        passed, reason = _judge(verdict)
    except (Exception, asyncio.CancelledError) as exc:
        if isinstance(exc, asyncio.CancelledError) and cancel_pending():
            raise  # a real cancel (the task's deadline, the run's end), not the check's failure
        failure = describe(exc)  # its str() may raise too
        raise Rejected(f"the safety check raised {failure.error_type}: {failure.message}") from exc
    if not passed:
        raise Rejected(reason or "refused by the safety check")


def check_output(model: type[BaseModel], output: Any) -> Any:
    """`output` validated as `model`; garbage raises `VerificationError` (retryable, with feedback)."""
    from pydantic import ValidationError

    if isinstance(output, model):
        return output
    try:
        return model.model_validate(output)
    except ValidationError as exc:
        raise VerificationError(
            f"output does not match {model.__name__}: {exc}", output=output
        ) from exc
