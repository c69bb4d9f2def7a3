"""Quickstart: analyse contracts with simulated agents, sequentially and in parallel.

Runs with no API key. Four kinds of agents with realistic latencies: `split` turns a contract into
clauses (spawning one `research` task per clause), `research` assesses a clause, `summarize` waits for
every clause of its contract, `verify` checks the summary. One research agent is rate limited at
first and another goes down mid-run: retries and the fallback chain carry its tasks.

    make demo          # or: python examples/quickstart.py, or: orchestra demo

The code is orchestra/_cli/_demo.py: the package ships it, so that `orchestra demo` runs the same
quickstart from an install, with no checkout. Read it there.
"""

from __future__ import annotations

import asyncio

from orchestra._cli._demo import main

if __name__ == "__main__":
    asyncio.run(main())
