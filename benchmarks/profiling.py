"""Profile one variant's timed workload with cProfile: where does each subtask's time go?

    python -m benchmarks.profiling [VARIANT] [N] [--top K] [--loop asyncio|uvloop]

Defaults: the orchestra no-op variant of scenario 2 at N=100,000, limit 100, top 15 by tottime.
The warm-up and set-up are run unprofiled, as in a benchmark child.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys

from .child import loop_factory, warmup_spec
from .spec import Spec
from .variants import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiling")
    parser.add_argument("variant", nargs="?", default="orchestra")
    parser.add_argument("n", nargs="?", type=int, default=100_000)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--loop", default="asyncio")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--sort", default="tottime")
    args = parser.parse_args(argv)

    spec = Spec("dispatch", args.variant, args.n, args.limit, loop=args.loop)
    warmup = build(warmup_spec(spec))
    workload = build(spec)
    profiler = cProfile.Profile()
    with asyncio.Runner(loop_factory=loop_factory(spec.loop)) as runner:
        runner.run(warmup())

        async def profiled() -> None:
            profiler.enable()
            try:
                await workload()
            finally:
                profiler.disable()

        runner.run(profiled())
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(f"{spec.label()}, sorted by {args.sort}:")
    print(buffer.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
