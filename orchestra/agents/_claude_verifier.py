"""`ClaudeVerifier`: Claude judges an attempt's output against criteria; a fail's feedback reaches
the next attempt in `ctx.feedback` (and a `ClaudeAgent` puts it into its conversation), which closes
the executor → verifier → retry loop.

```python
orch = Orchestrator(agents=[...], verify={"summarize": ClaudeVerifier(
    model="claude-haiku-4-5", criteria="cites every high-risk clause")})
```
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from .._config import check_instance
from .._exceptions import ConfigError, RetryableError
from .._retry import RetryPolicy
from .._verify import Verdict
from ._claude_agent import ClaudeAgent, StructuredOutputError
from ._claude_calls import DEFAULT_RETRY, Tab, ask

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from anthropic import AsyncAnthropic
    from anthropic.types import Model

    from .._core._context import Context
    from .._task import Task
    from ._claude_account import ClaudeAccount
    from ._claude_limits import ClaudeLimits
    from ._claude_prices import Price

__all__ = ("ClaudeVerifier", "Judgement")

_SYSTEM = (
    "You are a strict reviewer. You receive a task and a worker's output for it, and criteria. "
    "Decide whether the output meets every criterion. If it does not, say precisely what is "
    "wrong and what to change, in a few sentences the worker can act on."
)
_MAX_OUTPUT_CHARS = 60_000  # an output longer than this is cut (its start is what is judged)


class Judgement(BaseModel):
    """What the verifier asks Claude for."""

    passed: bool = Field(description="true when the output meets every criterion")
    feedback: str = Field(description="what is wrong and how to fix it; empty when passed")


class ClaudeVerifier:
    """A verifier (`Orchestrator(verify={kind: ...})`) that asks Claude whether an output meets
    `criteria`. Returns a `Verdict`: a fail fails the attempt with its feedback, which the next
    attempt receives in `ctx.feedback`.

    Its calls reserve on the key's shared limits like any Claude agent's, are retried on 429 /
    529 / 5xx, and their usage and cost go into the run's metadata under the verifier's `name`
    and its model (and count against the run's budget). A verifier whose calls keep failing
    fails the attempt with the API's error.

    Args:
        model: a model id (a small fast one serves well: `"claude-haiku-4-5"`).
        criteria: what a good output does, in plain words.
        name: the name its usage is recorded under.
        evidence: ``fn(task, ctx) -> str``: what the reviewer needs besides the task and the
            output to judge it (the outputs of the task's dependencies, say: ``ctx.deps``).
        system: replaces the reviewer's system prompt.
        max_tokens, account, client, rate_limits, prices: as for `ClaudeAgent`.
        retry: how its own calls are retried (default: 4 attempts, backoff from 1 s).
    """

    takes_context = True
    """`verify` passes the attempt's `Context` as a third argument (for the run's accounting)."""

    __slots__ = ("_agent", "criteria", "evidence", "name", "retry")

    def __init__(
        self,
        *,
        model: Model,
        criteria: str,
        name: str = "claude-verifier",
        evidence: Callable[[Task, Context | None], str] | None = None,
        system: str | None = None,
        max_tokens: int = 1024,
        account: ClaudeAccount | None = None,
        client: AsyncAnthropic | None = None,
        rate_limits: ClaudeLimits | None = None,
        prices: Mapping[str, Price] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        if not isinstance(criteria, str) or not criteria.strip():
            raise ConfigError(f"ClaudeVerifier: criteria must be a non-empty str, got {criteria!r}")
        # Else an AttributeError at the first verdict.
        check_instance("ClaudeVerifier: retry", retry, RetryPolicy, optional=False)
        self.name = name
        self.criteria = criteria
        self.retry = retry
        if evidence is not None and not callable(evidence):
            raise ConfigError(f"ClaudeVerifier: evidence must be a function, got {evidence!r}")
        self.evidence = evidence
        self._agent = ClaudeAgent(
            name=name,
            kinds=["verify"],
            model=model,
            system=system or _SYSTEM,
            output=Judgement,
            max_tokens=max_tokens,
            account=account,
            client=client,
            rate_limits=rate_limits,
            prices=prices,
        )

    @property
    def spent(self) -> dict[str, float]:
        """Tokens (by usage field) and ``"cost"`` of every answer this verifier received."""
        return self._agent.spent

    def prompt(self, task: Task, output: Any, ctx: Context | None = None) -> str:
        """What Claude is asked about `output`."""
        evidence = ""
        if self.evidence is not None:
            evidence = f"<evidence>\n{self.evidence(task, ctx)}\n</evidence>\n\n"
        return (
            f"<criteria>\n{self.criteria}\n</criteria>\n\n"
            f"<task kind={json.dumps(task.kind)} id={json.dumps(task.id)}>\n"
            f"{_text(task.payload)}\n</task>\n\n{evidence}"
            f"<output>\n{_text(output)[:_MAX_OUTPUT_CHARS]}\n</output>\n\n"
            "Does the output meet every criterion?"
        )

    async def __call__(self, task: Task, output: Any, ctx: Context | None = None) -> Verdict:
        tab = Tab(self.name, ctx)
        messages: list[Any] = [{"role": "user", "content": self.prompt(task, output, ctx)}]
        tries = max(1, self.retry.max_attempts)
        for _ in range(tries):
            message = await ask(self._agent, messages, tab, retry=self.retry)
            try:
                judgement: Judgement = self._agent.read(message)
                break
            except StructuredOutputError as exc:
                # The reviewer's own answer is malformed: ask the reviewer again. Raised as it
                # is, it would reach the worker as *its* rejected answer (`ctx.feedback`) and
                # become the task's partial output.
                problem = exc.feedback.split("\n\nYour previous answer was:", 1)[0]
                tab.log.warning("invalid judgement; asking again", problem=problem)
                messages += [
                    {"role": "assistant", "content": str(exc.output or "") or "(empty)"},
                    {
                        "role": "user",
                        "content": f"{problem}\nAnswer again, as JSON that matches it.",
                    },
                ]
        else:
            raise RetryableError(
                f"verifier {self.name!r} gave no valid judgement in {tries} tries: {problem}"
            )
        if judgement.passed:
            return Verdict.ok()
        return Verdict.fail(judgement.feedback.strip() or "the reviewer rejected the output")

    def __repr__(self) -> str:
        return f"ClaudeVerifier(model={self._agent.model!r}, criteria={self.criteria!r})"


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json(indent=1)
    try:
        return json.dumps(value, indent=1, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


ClaudeVerifier.__module__ = "orchestra.agents"
