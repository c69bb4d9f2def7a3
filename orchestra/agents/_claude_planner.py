"""`ClaudePlanner`: Claude as the decomposer — the run's input in, a checked task list out.

The answer is asked for as a JSON schema in which a task's kind can only be one of the kinds
given (with its payload model, when one is given), then checked with the admission checks every
input goes through (kinds, ids, payloads, known dependencies, no cycles). An invalid plan is sent
back with the error as feedback and planned again; no task of an invalid plan ever runs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from random import Random
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, create_model

from .._admission import Admission
from .._config import check_instance, check_int, check_mapping, check_names
from .._exceptions import ConfigError, InputError
from .._retry import RetryPolicy
from .._task import Task
from ..stores._memory import MemoryStore
from ..stores._protocol import NoListener
from ._claude_agent import ClaudeAgent, StructuredOutputError
from ._claude_calls import DEFAULT_RETRY, Tab, ask

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic
    from anthropic.types import MessageParam, Model

    from ._claude_account import ClaudeAccount
    from ._claude_limits import ClaudeLimits
    from ._claude_prices import Price

__all__ = ("ClaudePlanner",)

_SYSTEM = (
    "You plan work for a pool of workers. Split the job you are given into tasks, each of one "
    "of the kinds listed, with a short unique id and the payload its worker needs. A task that "
    "needs the output of others lists their ids in depends_on; tasks without dependencies run in "
    "parallel, so prefer many small independent tasks to a few large ones.\n\nKinds:\n"
)


class ClaudePlanner:
    """A decomposer (`Orchestrator(decomposer=ClaudePlanner(...))`) that asks Claude for the tasks
    of `run(input)`.

    Args:
        model: a model id.
        kinds: the kinds it may plan: a list, or a mapping of kind to a description of what its
            agents do (the planner plans better with one).
        payloads: per kind, the pydantic model of its payload (the schema asks for it, and the
            check validates it); other kinds get a string payload.
        prompt: the user turn: a `str.format` template over ``input``, or a function of the input.
        system: replaces the planner's system prompt (the kinds are appended to it).
        max_plans: how many plans to ask for before giving up (an `InputError` naming the last
            problem: the run does not start).
        max_tasks: the most tasks a plan may hold.
        name: the name its calls log under.
        max_tokens, account, client, rate_limits, prices: as for `ClaudeAgent`.
        retry: how its own calls are retried on 429 / 529 / 5xx (default: 4 attempts).
    """

    __slots__ = (
        "_agent",
        "_plan_model",
        "descriptions",
        "kinds",
        "max_plans",
        "max_tasks",
        "name",
        "payloads",
        "prompt",
        "retry",
    )

    def __init__(
        self,
        *,
        model: Model,
        kinds: Sequence[str] | Mapping[str, str],
        payloads: Mapping[str, type[BaseModel]] | None = None,
        prompt: str | Any = "{input}",
        system: str | None = None,
        max_plans: int = 3,
        max_tasks: int = 1_000,
        name: str = "claude-planner",
        max_tokens: int = 8192,
        account: ClaudeAccount | None = None,
        client: AsyncAnthropic | None = None,
        rate_limits: ClaudeLimits | None = None,
        prices: Mapping[str, Price] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        # Every option is checked here: a wrong one failed inside pydantic's schema building
        # (a kind or a payload model of the wrong type) or at the first plan (retry, max_tasks).
        if isinstance(kinds, Mapping):
            check_mapping("ClaudePlanner: kinds", kinds, optional=False)
            for kind, text in kinds.items():
                if not isinstance(text, str):
                    raise ConfigError(
                        f"ClaudePlanner: kinds[{kind!r}] must be a description (str), got {text!r}"
                    )
        else:
            check_names("ClaudePlanner: kinds", kinds)
        self.descriptions = dict(kinds) if isinstance(kinds, Mapping) else dict.fromkeys(kinds, "")
        self.kinds = tuple(self.descriptions)
        check_mapping("ClaudePlanner: payloads", payloads)
        self.payloads = dict(payloads or {})
        unknown = set(self.payloads) - set(self.kinds)
        if unknown:
            raise ConfigError(f"ClaudePlanner: payloads name kinds it does not plan: {unknown}")
        for kind, given in self.payloads.items():
            payload: Any = given  # typed a model class; any value until checked
            if not (isinstance(payload, type) and issubclass(payload, BaseModel)):
                raise ConfigError(
                    f"ClaudePlanner: payloads[{kind!r}] must be a pydantic model class, "
                    f"got {payload!r}"
                )
        if not (isinstance(prompt, str) or callable(prompt)):
            raise ConfigError(f"ClaudePlanner: prompt must be a str or a function, got {prompt!r}")
        check_int("ClaudePlanner: max_plans", max_plans)
        check_int("ClaudePlanner: max_tasks", max_tasks)
        check_instance("ClaudePlanner: retry", retry, RetryPolicy, optional=False)
        self.prompt = prompt
        self.max_plans = max_plans
        self.max_tasks = max_tasks
        self.name = name
        self.retry = retry
        self._plan_model = _plan_model(self.kinds, self.payloads, max_tasks)
        listing = "\n".join(
            f"- {kind}" + (f": {text}" if text else "") for kind, text in self.descriptions.items()
        )
        self._agent = ClaudeAgent(
            name=name,
            kinds=["plan"],
            model=model,
            system=(system or _SYSTEM) + listing,
            output=self._plan_model,
            max_tokens=max_tokens,
            account=account,
            client=client,
            rate_limits=rate_limits,
            prices=prices,
        )

    @property
    def spent(self) -> dict[str, float]:
        """Tokens (by usage field) and ``"cost"`` of every plan asked for. A run counts what its
        plan spent (its `metadata.cost`, `tokens`, `usage_per_agent` under this planner's name,
        `usage_per_model`, and its budget); plans made at once for two runs share these totals,
        so each run may count the other's."""
        return self._agent.spent

    @property
    def model(self) -> str:
        """The model id the plans are asked of."""
        return str(self._agent.model)

    async def __call__(self, input: Any) -> list[Task]:
        text = (
            self.prompt.format(input=input) if isinstance(self.prompt, str) else self.prompt(input)
        )
        messages: list[MessageParam] = [{"role": "user", "content": text}]
        tab = Tab(self.name)
        rng = Random()
        problem = ""
        for number in range(1, self.max_plans + 1):
            message = await ask(self._agent, messages, tab, retry=self.retry, rng=rng)
            answer = "".join(b.text for b in message.content if b.type == "text")
            try:
                plan = self._agent.read(message)
                return self.check(plan.tasks)
            except (StructuredOutputError, InputError) as exc:
                problem = str(exc).split("\n\nYour previous answer was:", 1)[0]
            tab.log.warning("invalid plan; planning again", plan=number, problem=problem)
            messages += [
                {"role": "assistant", "content": answer or "(empty)"},
                {
                    "role": "user",
                    "content": f"That plan is invalid: {problem}\nAnswer again with a corrected "
                    "plan, as JSON that matches the schema.",
                },
            ]
        raise InputError(f"the planner gave no valid plan in {self.max_plans} tries: {problem}")

    def check(self, planned: Sequence[Any]) -> list[Task]:
        """The planned tasks as `Task`s, checked as any run's input is (an `InputError` names the
        first problem): kinds, ids, payloads, dependencies that exist, no cycles."""
        tasks = [
            Task(
                p.kind,
                p.payload,
                id=p.id,
                depends_on=list(p.depends_on),
                priority=p.priority,
            )
            for p in planned
        ]
        if not tasks:
            raise InputError("the plan holds no task")
        if len(tasks) > self.max_tasks:
            raise InputError(f"the plan holds {len(tasks)} tasks, more than {self.max_tasks}")
        # The checks of a real admission, into a scratch store: the same code any input meets.
        scratch = MemoryStore().open_run(
            "plan",
            admission=Admission(self.kinds, {k: [m] for k, m in self.payloads.items()}),
            listener=NoListener(),
            clock=lambda: 0.0,
            task_timeout=None,
            compact=False,
        )
        scratch.admit(tasks, where="plan", forward=True)
        return tasks

    def __repr__(self) -> str:
        return f"ClaudePlanner(model={self._agent.model!r}, kinds={list(self.kinds)!r})"


def _plan_model(
    kinds: Sequence[str], payloads: Mapping[str, type[BaseModel]], max_tasks: int
) -> type[BaseModel]:
    """The plan's schema: tasks whose kind is one of `kinds`, with each kind's payload model."""
    common: dict[str, Any] = {
        "id": (str, Field(description="a short unique id, such as 'research-3'")),
        "depends_on": (list[str], Field(default_factory=list, description="ids it needs first")),
        "priority": (int, Field(default=0, description="smaller runs first")),
    }
    plain = [k for k in kinds if k not in payloads]
    variants: list[type[BaseModel]] = []
    if plain:
        variants.append(
            create_model(
                "PlannedTask",
                kind=(_literal(plain), ...),
                payload=(str, Field(description="what the worker needs to do its task")),
                **common,
            )
        )
    for kind, model in payloads.items():
        variants.append(
            create_model(
                f"Planned_{kind}",
                kind=(_literal([kind]), ...),
                payload=(model, ...),
                **common,
            )
        )
    item: Any = functools.reduce(operator.or_, variants)
    return create_model("Plan", tasks=(list[item], Field(description="the tasks of the plan")))


ClaudePlanner.__module__ = "orchestra.agents"


def _literal(values: Sequence[str]) -> Any:
    """`Literal[values...]`, built at run time (the kinds are the user's)."""
    return Literal[tuple(values)]
