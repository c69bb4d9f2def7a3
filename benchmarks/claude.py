"""Scenario 9: Claude calls against the local fake Messages API under a tight RPM / TPM budget.

`ClaudeAgent`s on one key, with the key's limits configured as the API's, send `n` requests to
the fake API (tests/fake_messages_api.py) over real HTTP through the official client; the fake API
enforces the budgets as the real one does (a token bucket per budget, a 429 when there is no
room). The run is in virtual time (`FakeClock`): the latencies and the minute-long budgets are
realistic, and what is measured is the limiter's pacing, not the machine. Reported: throughput
against the budget's theoretical maximum (the binding one of requests and input tokens per minute,
after the bucket's initial burst) and the 429s provoked.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import Spec
    from .variants import Workload

#: The fake API's budget and latency: a tight tier for 1,000 calls.
RPM = 600
INPUT_TPM = 60_000
OUTPUT_TPM = 100_000
LATENCY = 1.0
PROMPT = "Assess this clause for a buyer. " * 12  # ~ 100 tokens by the fake API's count


def claude_calls(spec: Spec) -> Workload:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the fake API
    from anthropic import AsyncAnthropic

    from orchestra import Orchestrator, RetryPolicy, Task
    from orchestra.agents import ClaudeAccount, ClaudeAgent, ClaudeLimits
    from orchestra.testing import FakeClock
    from tests.fake_messages_api import FakeMessagesAPI, _tokens

    async def workload() -> dict[str, Any]:
        async with (
            FakeClock() as clock,
            FakeMessagesAPI(
                latency=LATENCY,
                requests_per_minute=RPM,
                input_tokens_per_minute=INPUT_TPM,
                output_tokens_per_minute=OUTPUT_TPM,
                enforce_limits=True,
            ) as api,
            AsyncAnthropic(api_key="sk-ant-bench", base_url=api.url, max_retries=0) as client,
        ):
            limits = ClaudeLimits(
                requests_per_minute=RPM,
                input_tokens_per_minute=INPUT_TPM,
                output_tokens_per_minute=OUTPUT_TPM,
            )
            account = ClaudeAccount(client=client)
            agent = ClaudeAgent(
                name="claude",
                kinds=["ask"],
                model="claude-sonnet-4-5",
                prompt="{payload}",
                max_tokens=64,
                account=account,
                rate_limits=limits,
            )
            tasks = [Task("ask", f"{PROMPT}#{i}", id=f"q{i}") for i in range(spec.n)]
            orch = Orchestrator(
                agents=[agent], concurrency=spec.limit, retry=RetryPolicy(max_attempts=10)
            )
            t0 = clock.now()
            result = await orch.run(tasks=tasks)
            elapsed = clock.now() - t0
            prompt_tokens = _tokens(f"{PROMPT}#{spec.n - 1}")
            # The API's bucket starts full: a minute's budget may go at once, then the refill
            # rate binds. The fastest a perfect client can finish (its last answer's latency
            # included) is when the refill has paid for what the initial bucket did not.
            per_second = min(RPM / 60, INPUT_TPM / 60 / prompt_tokens)
            burst = min(RPM, INPUT_TPM / prompt_tokens)
            ideal = max(0.0, spec.n - burst) / per_second + LATENCY
            smooth = (spec.n - 1) / per_second + LATENCY  # never a burst: orchestra's pacing
            return {
                "completed": result.metadata.counts["succeeded"],
                "virtual_s": elapsed,
                "ideal_s": ideal,
                "smooth_ideal_s": smooth,
                "throughput_ratio": smooth / elapsed if elapsed else math.nan,
                "rate_limited": len(api.answered(429)),
                "requests": len(api.requests),
            }

    return workload
