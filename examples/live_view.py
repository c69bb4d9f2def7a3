"""Watch a run: 300 tasks of three kinds on four agents, one of them flaky, with the live view.

    python examples/live_view.py               # in virtual time: the whole run takes a second or two
    python examples/live_view.py --svg out.svg # also save the view at 40% done (rich's SVG export)

Needs the `cli` extra (rich). The view goes to stderr; on a terminal it is redrawn in place, in CI
it is a line every few seconds. No API key needed: the agents are simulated.
"""

from __future__ import annotations

import argparse
import io
import random

import anyio

from orchestra import BreakerPolicy, Context, Orchestrator, RetryPolicy, Task, agent, progress
from orchestra.status import render_status
from orchestra.testing import FakeClock

rng = random.Random(7)


@agent(kinds=["research"], concurrency=8)
async def researcher(task: Task, ctx: Context) -> str:
    await anyio.sleep(rng.uniform(2, 4))
    ctx.record_usage(cost=0.003, input_tokens=900, output_tokens=200)
    return "notes"


@agent(kinds=["research"], concurrency=4)
async def backup_researcher(task: Task, ctx: Context) -> str:
    await anyio.sleep(rng.uniform(3, 6))
    if rng.random() < 0.35:
        raise ConnectionError("upstream reset the connection")
    ctx.record_usage(cost=0.001, input_tokens=900, output_tokens=150)
    return "notes"


@agent(kinds=["summarize"], concurrency=4)
async def summarizer(task: Task, ctx: Context) -> str:
    await anyio.sleep(rng.uniform(4, 8))
    if task.payload % 23 == 0:
        raise ValueError(f"summary of contract {task.payload} is empty")
    ctx.record_usage(cost=0.01, input_tokens=3000, output_tokens=500)
    return "summary"


@agent(kinds=["classify"], concurrency=6)
async def classifier(task: Task, ctx: Context) -> str:
    await anyio.sleep(rng.uniform(0.5, 1.5))
    return "low"


async def main(svg: str | None) -> None:
    from rich.console import Console

    tasks = (
        [Task("research", i, priority=1) for i in range(150)]
        + [Task("summarize", i, priority=2) for i in range(60)]
        + [Task("classify", i, priority=0) for i in range(90)]
    )
    async with (
        FakeClock(),
        Orchestrator(
            agents=[researcher, backup_researcher, summarizer, classifier],
            concurrency=16,
            retry=RetryPolicy(max_attempts=2, base=1, cap=5),
            breaker=BreakerPolicy(min_calls=3, cooldown=5, max_cooldown=20),
            seed=7,
        ) as orch,
    ):
        handle = orch.start(tasks=tasks)
        if svg is not None:
            while handle.status().progress < 40:  # noqa: ASYNC110 (a poll: nothing signals it)
                await anyio.sleep(0.5)
            shot = Console(record=True, width=104, file=io.StringIO())
            shot.print(render_status(handle.status()))
            shot.save_svg(svg, title="orchestra: a run mid-way")
        await progress(handle, every=10)
        result = await handle
    print(f"status: {result.status}, {result.metadata.counts}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--svg", help="save the view at 40%% done as SVG here")
    anyio.run(main, parser.parse_args().svg)
