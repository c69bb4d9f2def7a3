"""Contracts with Claude: documents decomposed by a planner, clauses researched in parallel,
summaries written and verified.

    ANTHROPIC_API_KEY=sk-ant-... uv run python examples/contracts.py    # with Claude
    uv run python examples/contracts.py                                 # without a key

`ClaudePlanner` turns the documents into tasks (one `research` task per clause, one `summarize`
task per document that depends on its clauses); `research` assesses each clause on Sonnet with a
structured answer (falling back to Haiku when Sonnet is overloaded); `summarize` writes each
document's summary from its clauses' assessments, and `ClaudeVerifier` checks it cites every
high-risk clause (a rejected summary is written again with the reviewer's feedback). The run has a
budget of one dollar; the result says what each model cost.

Without `ANTHROPIC_API_KEY` it says so on stderr and runs against the local fake Messages API of
the test suite (tests/fake_messages_api.py) with canned answers, through the same official client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from anthropic.types import Model
from pydantic import BaseModel

from orchestra import Context, Orchestrator, RetryPolicy, RunResult, Task
from orchestra.agents import ClaudeAccount, ClaudeAgent, ClaudePlanner, ClaudeVerifier

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

_IDS = get_args(get_args(Model)[0])  # the SDK's current model ids
SONNET = next(m for m in _IDS if m.startswith("claude-sonnet-"))
HAIKU = next(m for m in _IDS if m.startswith("claude-haiku-"))
REPO = str(Path(__file__).resolve().parent.parent)  # the fake API lives in its tests/

DOCUMENTS = {
    "supply": [
        "The supplier's liability under this agreement is unlimited.",
        "Either party may terminate with 30 days' written notice.",
        "Invoices are payable within 60 days of receipt.",
    ],
    "licence": [
        "The licensee may not sublicense the software.",
        "The licensor may change the fees at any time without notice.",
        "This agreement is governed by the laws of England.",
    ],
    "lease": [
        "The tenant bears all repair costs, including structural repairs.",
        "Rent is reviewed every five years, upwards only.",
    ],
}


class Clause(BaseModel):
    document: str
    text: str


class ClauseRisk(BaseModel):
    risk: Literal["low", "medium", "high"]
    reason: str


def assessments(task: Task, ctx: Context | None) -> str:
    """The clauses' assessments a summary is written from (and checked against)."""
    deps = {} if ctx is None else ctx.deps
    return "\n".join(
        f"- {clause_id}: {risk.risk} risk ({risk.reason})"
        for clause_id, risk in sorted(deps.items())
    )


def summary_prompt(task: Task, ctx: Context) -> str:
    return (
        f"Summarise the risks of the contract {task.payload!r} for a busy lawyer in three "
        "sentences, citing the clause id of every high-risk clause.\n" + assessments(task, ctx)
    )


def build(account: ClaudeAccount) -> Orchestrator:
    research = ClaudeAgent(
        name="research",
        kinds=["research"],
        model=SONNET,
        system="You assess contract clauses for a buyer's lawyer.",
        prompt="Clause of the {payload.document} contract: {payload.text}",
        output=ClauseRisk,
        account=account,
    )
    research_fast = ClaudeAgent(
        name="research-fast",
        kinds=["research"],
        model=HAIKU,
        system="You assess contract clauses for a buyer's lawyer.",
        prompt="Clause of the {payload.document} contract: {payload.text}",
        output=ClauseRisk,
        account=account,
    )
    summarize = ClaudeAgent(
        name="summarize", kinds=["summarize"], model=SONNET, prompt=summary_prompt, account=account
    )
    planner = ClaudePlanner(
        model=SONNET,
        kinds={
            "research": "assess the risk of one clause (payload: its document and its text)",
            "summarize": "summarise one document from its clauses (payload: the document's "
            "name; it depends on the research tasks of every clause of that document)",
        },
        payloads={"research": Clause},
        prompt="Plan the review of these contracts:\n{input}",
        account=account,
    )
    return Orchestrator(
        agents=[research, research_fast, summarize],
        fallbacks={"research": ["research", "research-fast"]},
        decomposer=planner,
        verify={
            "summarize": ClaudeVerifier(
                model=HAIKU,
                criteria="cites the clause id of every high-risk clause",
                evidence=assessments,
                account=account,
            )
        },
        retry=RetryPolicy(max_attempts=3, base=1.0),
        max_cost=1.0,
    )


def report(result: RunResult) -> None:
    meta = result.metadata
    print(
        f"status: {result.status}   tasks: {meta.total}   attempts: {meta.attempts}   "
        f"retries: {meta.retries} (summaries the reviewer sent back, among others)"
    )
    for task_id, output in sorted(result.data.items()):
        if isinstance(output, ClauseRisk):
            print(f"  {task_id:<14} {output.risk:<6} {output.reason}")
    for task_id, output in sorted(result.data.items()):
        if isinstance(output, str):
            print(f"\n{task_id}:\n  {output}")
    print("\ncost per model:")
    for model, usage in result.metadata.usage_per_model.items():
        print(
            f"  {model:<28} ${usage['cost']:.4f}   {int(usage['input_tokens'])} in, "
            f"{int(usage['output_tokens'])} out"
        )
    print(f"total: ${result.metadata.cost:.4f}")
    for error in result.errors:
        print(f"error: {error.task_id}: {error.error_type}: {error.message}")


@contextlib.asynccontextmanager
async def claude() -> AsyncIterator[ClaudeAccount]:
    """The account of ANTHROPIC_API_KEY, or one on the local fake API with canned answers."""
    if os.environ.get("ANTHROPIC_API_KEY"):
        account = ClaudeAccount()
        try:
            yield account
        finally:
            await account.aclose()
        return
    print(
        "ANTHROPIC_API_KEY is not set: running against the local fake Messages API with canned "
        "answers (set the key to ask Claude).",
        file=sys.stderr,
    )
    sys.path.insert(0, REPO)
    from tests.fake_messages_api import FakeMessagesAPI

    async with FakeMessagesAPI(latency=0.3, batch_latency=5.0) as api:
        api.answer(*[canned] * 1_000)
        account = ClaudeAccount(api_key="sk-ant-fake-key", base_url=api.url)
        try:
            yield account
        finally:
            await account.aclose()


_REVIEWED: set[str] = set()


def canned(body: Any) -> str:
    """What Claude might answer, by who asks (the fake API's answer to every request)."""
    system = json.dumps(body.get("system"))
    prompt = body["messages"][0]["content"]
    if "You plan work" in system:
        tasks: list[dict[str, Any]] = []
        for name, clauses in DOCUMENTS.items():
            ids = [f"{name}-{i}" for i in range(len(clauses))]
            tasks += [
                {"id": i, "kind": "research", "payload": {"document": name, "text": text}}
                for i, text in zip(ids, clauses, strict=True)
            ]
            tasks.append(
                {"id": f"{name}-summary", "kind": "summarize", "payload": name, "depends_on": ids}
            )
        return json.dumps({"tasks": tasks})
    if "strict reviewer" in system:
        high = re.findall(r"- (\S+): high risk", prompt)
        summary = prompt.split("<output>", 1)[1].split("</output>", 1)[0]
        missing = [h for h in high if h not in summary]
        if missing:
            return json.dumps({"passed": False, "feedback": f"cite {', '.join(missing)}"})
        return json.dumps({"passed": True, "feedback": ""})
    if "Summarise" in prompt:
        document = re.search(r"contract '(\w+)'", prompt)
        high = re.findall(r"- (\S+): high risk", prompt)
        name = document.group(1) if document else "?"
        first = name not in _REVIEWED
        _REVIEWED.add(name)
        cited = high[:-1] if first and high else high  # the first draft forgets one clause
        return (
            f"The {name} contract has {len(high)} high-risk clause(s)"
            + (f": {', '.join(cited)}." if cited else ".")
            + " The rest is standard."
        )
    text = prompt.lower()
    if any(w in text for w in ("unlimited", "without notice", "all repair", "upwards only")):
        return json.dumps({"risk": "high", "reason": "one-sided and uncapped"})
    if any(w in text for w in ("terminate", "60 days", "sublicense")):
        return json.dumps({"risk": "medium", "reason": "worth negotiating"})
    return json.dumps({"risk": "low", "reason": "market standard"})


async def main() -> None:
    async with claude() as account:
        documents = "\n\n".join(
            f"{name}:\n" + "\n".join(f"- {c}" for c in clauses)
            for name, clauses in DOCUMENTS.items()
        )
        result = await build(account).run(documents)
    report(result)


if __name__ == "__main__":
    asyncio.run(main())
