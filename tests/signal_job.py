"""A script for tests/test_signals.py: `run_main` over six tasks of `seconds` each, two at a time.

Usage: ``python tests/signal_job.py SECONDS GRACE``. It says on stderr when each attempt starts
(and orchestra logs there too), and writes the `RunResult` as JSON to stdout, alone.
"""

from __future__ import annotations

import sys

import anyio

from orchestra import Context, Orchestrator, Task, agent, configure_logging, run_main


@agent(kinds=["work"])
async def work(task: Task, ctx: Context) -> float:
    print(f"started {task.id}", file=sys.stderr, flush=True)
    await anyio.sleep(task.payload)
    return float(task.payload)


def main() -> None:
    configure_logging(stream=sys.stderr)
    seconds, grace = float(sys.argv[1]), float(sys.argv[2])
    orch = Orchestrator(agents=[work], concurrency=2)
    tasks = [Task("work", seconds, id=f"t{i}") for i in range(6)]
    result = run_main(orch, tasks=tasks, grace=grace)
    sys.stdout.write(result.model_dump_json())


if __name__ == "__main__":
    main()
