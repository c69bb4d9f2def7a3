"""The variants: each builds one workload and returns the coroutine function that runs it.

A builder does its set-up (imports, agents, per-task latencies, a LangGraph graph's nodes) before
the clock starts and returns ``run``: an async callable the child times from its first line to
its return. Whatever a user pays per task is inside ``run``: building orchestra's `Task`s, creating
the coroutines handed to ``gather``, the ``functools.partial`` objects aiometer wants, the ``Send``
packets of LangGraph.

Every variant runs the same work: a "noop" subtask returns at once, a "sleep" subtask awaits
``asyncio.sleep`` for its seeded latency (`spec.latencies`). Heavy libraries are imported inside
the builder that needs them, so a child pays only for its own variant.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
import resource
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

from . import claude, durable, failures, postgres, service, spawning
from .spec import Spec, latencies

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

Workload = Callable[[], Coroutine[Any, Any, dict[str, Any]]]
Builder = Callable[[Spec], Workload]
SubtaskFn = Callable[[Any], Awaitable[object]]


def _items(spec: Spec) -> list[Any]:
    """The argument each subtask gets: its index for a no-op, its latency for a sleep."""
    if spec.work == "noop":
        return list(range(spec.n))
    if spec.work == "sleep":
        return latencies(spec)
    raise ValueError(f"unknown work {spec.work!r}")


def _subtask(spec: Spec) -> SubtaskFn:
    """The plain coroutine function every bare-asyncio variant awaits once per item."""
    if spec.work == "noop":

        async def noop(item: Any) -> None:
            return None

        return noop

    sleep = asyncio.sleep

    async def simulated(item: Any) -> None:
        await sleep(item)

    return simulated


# --------------------------------------------------------------------------- bare asyncio


def bare_gather(spec: Spec) -> Workload:
    """``asyncio.Semaphore`` + ``asyncio.gather``: one coroutine and one asyncio.Task per subtask."""
    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def run() -> dict[str, Any]:
        sem = asyncio.Semaphore(limit)

        async def limited(item: Any) -> object:
            async with sem:
                return await fn(item)

        results = await asyncio.gather(*[limited(item) for item in items])
        return {"completed": len(results)}

    return run


def taskgroup(spec: Spec) -> Workload:
    """``asyncio.TaskGroup`` + semaphore: structured, still one asyncio.Task per subtask."""
    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def run() -> dict[str, Any]:
        sem = asyncio.Semaphore(limit)

        async def limited(item: Any) -> object:
            async with sem:
                return await fn(item)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(limited(item)) for item in items]
        return {"completed": sum(1 for t in tasks if t.done())}

    return run


def worker_queue(spec: Spec) -> Workload:
    """The physical floor: ``limit`` worker coroutines draining a queue, awaiting each subtask directly."""
    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def run() -> dict[str, Any]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for pair in enumerate(items):
            queue.put_nowait(pair)
        results: list[object] = [None] * len(items)
        done = 0

        async def worker() -> None:
            nonlocal done
            get = queue.get_nowait
            while True:
                try:
                    index, item = get()
                except asyncio.QueueEmpty:
                    return
                results[index] = await fn(item)
                done += 1

        await asyncio.gather(*[worker() for _ in range(limit)])
        return {"completed": done}

    return run


# --------------------------------------------------------------------------- peers


def anyio_limiter(spec: Spec) -> Workload:
    """anyio task group + ``CapacityLimiter``: one task per subtask under anyio's limiter."""
    import anyio

    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def run() -> dict[str, Any]:
        limiter = anyio.CapacityLimiter(limit)
        results: list[object] = [None] * len(items)

        async def limited(index: int, item: Any) -> None:
            async with limiter:
                results[index] = await fn(item)

        async with anyio.create_task_group() as tg:
            for index, item in enumerate(items):
                tg.start_soon(limited, index, item)
        return {"completed": len(results)}

    return run


def aiometer_run_all(spec: Spec) -> Workload:
    """aiometer.run_all with ``max_at_once``, as its README shows."""
    import aiometer

    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def run() -> dict[str, Any]:
        jobs = [functools.partial(fn, item) for item in items]
        results = await aiometer.run_all(jobs, max_at_once=limit)
        return {"completed": len(results)}

    return run


class _FanOutState(TypedDict):
    items: list[Any]
    results: Annotated[list[int], operator.add]


class _WorkState(TypedDict):
    i: int
    item: Any


def langgraph_send(spec: Spec) -> Workload:
    """LangGraph map-reduce: START fans out one ``Send("work", ...)`` per subtask.

    The ``work`` node awaits the subtask and returns ``{"results": [i]}`` into an
    ``Annotated[list, operator.add]`` key; ``max_concurrency`` is LangGraph's limit.
    """
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    items, fn, limit = _items(spec), _subtask(spec), spec.limit

    async def work(state: _WorkState) -> dict[str, list[int]]:
        await fn(state["item"])
        return {"results": [state["i"]]}

    # Annotations stay resolvable at module level: LangGraph calls get_type_hints on them.
    def fan_out(state: _FanOutState) -> list[Any]:
        return [Send("work", {"i": i, "item": item}) for i, item in enumerate(state["items"])]

    async def run() -> dict[str, Any]:
        builder = StateGraph(_FanOutState)
        builder.add_node("work", work)
        builder.add_conditional_edges(START, fan_out, ["work"])
        builder.add_edge("work", END)
        graph = builder.compile()
        out = await graph.ainvoke({"items": items, "results": []}, {"max_concurrency": limit})
        return {"completed": len(out["results"])}

    return run


# --------------------------------------------------------------------------- orchestra

#: Scenario 6's features, each added alone to the plain orchestra run.
FEATURES = (
    "default", "plain", "retry", "subscriber", "structlog", "verifier", "prometheus", "otel",
    "sqlite",
)  # fmt: skip


def _orchestra_agents(
    spec: Spec, on_done: Callable[[], None] | None = None
) -> tuple[list[Any], list[str]]:
    """``spec.agents`` orchestra agents per kind, doing the spec's work on ``task.payload``.

    Several agents of one kind get no ``fallbacks=``: the registry picks the least loaded one and
    the others are its fallbacks by default, as a user who just lists them gets.
    """
    kinds = [f"k{j}" for j in range(spec.kinds)]
    agents = [
        _orchestra_agent(spec, kind, on_done, f"{spec.work}_{kind}" + (f"_a{a}" if a else ""))
        for kind in kinds
        for a in range(spec.agents)
    ]
    return agents, kinds


def _orchestra_agent(spec: Spec, kind: str, on_done: Callable[[], None] | None, name: str) -> Any:
    from orchestra import agent

    # Parameters typed ``Any``: whatever the decorator reads from the annotations must resolve
    # from this module's globals, and orchestra is imported only by the variants that use it.
    fn: Callable[[Any, Any], Awaitable[None]]
    if on_done is not None:
        tick = on_done

        async def counting(task: Any, ctx: Any) -> None:
            tick()

        fn = counting
    elif spec.work == "noop":

        async def noop(task: Any, ctx: Any) -> None:
            return None

        fn = noop
    else:
        sleep = asyncio.sleep

        async def simulated(task: Any, ctx: Any) -> None:
            await sleep(task.payload)

        fn = simulated
    return agent(kinds=[kind], name=name)(fn)


def _orchestra(spec: Spec, feature: str) -> Workload:
    """orchestra with the in-memory store, ``concurrency=limit``; the Tasks are built on the clock.

    "default" is orchestra as a user runs it (its default policy allows 3 attempts); scenario 6's
    variants start from "plain" (retries off, ``max_attempts=1``) and turn one feature on each,
    "retry" turning retries back on: what each costs when nothing fails. "sqlite" is "default" on
    a `SQLiteStore` (a new file in a temporary directory): scenario 3's durable row.
    """
    from orchestra import Orchestrator, RetryPolicy, Task

    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}")
    items = _items(spec)
    agents, kinds = _orchestra_agents(spec)
    options: dict[str, Any] = {}
    events = 0

    def on_event(event: object) -> None:
        nonlocal events
        events += 1

    if feature == "sqlite":
        options["store"] = durable.temporary_store()
    elif feature != "default":
        options["retry"] = RetryPolicy(max_attempts=3 if feature == "retry" else 1)
    if feature == "verifier":

        def accept(task: object, output: object) -> bool:
            return True

        options["verify"] = dict.fromkeys(kinds, accept)
    elif feature == "structlog":
        # orchestra logs through `logging`: an application that shows its INFO lines.
        logging.getLogger("orchestra").setLevel(logging.INFO)
    elif feature == "prometheus":
        from prometheus_client import CollectorRegistry

        from orchestra.metrics import PrometheusMetrics

        options["instruments"] = [PrometheusMetrics(registry=CollectorRegistry())]
    elif feature == "otel":
        # The SDK's provider with no exporter: what building and ending the spans costs.
        from opentelemetry.sdk.trace import TracerProvider

        from orchestra.tracing import OpenTelemetryTracing

        options["instruments"] = [OpenTelemetryTracing(tracer_provider=TracerProvider())]
    n_kinds = len(kinds)

    async def run() -> dict[str, Any]:
        async with Orchestrator(agents=agents, concurrency=spec.limit, **options) as orch:
            if feature == "subscriber":
                orch.subscribe(on_event)
            # Built as the README and the examples build them (positional: keywords cost a
            # third more per Task, 0.42 µs against 0.27, measured).
            tasks = [Task(kinds[i % n_kinds], item) for i, item in enumerate(items)]
            result = await orch.run(tasks=tasks)
        data = result.data
        out: dict[str, Any] = {
            "status": str(result.status),
            "completed": len(data) if hasattr(data, "__len__") else None,
        }
        if feature == "subscriber":
            out["events"] = events
        if result.status != "success":
            out["error"] = f"run ended {result.status!r}"
        return out

    return run


def current_rss_kb() -> int:
    """The resident set size now (``/proc/self/statm``), not the peak: whether memory stays flat.

    Falls back to the peak (``ru_maxrss``) where ``/proc`` is missing (macOS).
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return pages * _PAGE_KB


_PAGE_KB = resource.getpagesize() // 1024


def _orchestra_stream(spec: Spec) -> Workload:
    """Scenario 5: ``spec.n`` Tasks from an async generator, ``Discard()`` aggregation.

    The agent notes the clock, the RSS and the peak RSS each time another ``spec.slice`` tasks
    complete, so the report shows throughput per slice and whether memory keeps growing.
    """
    from orchestra import Discard, Orchestrator, Task

    slice_size = spec.slice or spec.n
    marks: list[float] = []
    rss_kb: list[int] = []
    peak_kb: list[int] = []
    done = 0

    def on_done() -> None:
        nonlocal done
        done += 1
        if done % slice_size == 0:
            marks.append(time.perf_counter())
            rss_kb.append(current_rss_kb())
            peak_kb.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

    agents, kinds = _orchestra_agents(spec, on_done)
    n, n_kinds = spec.n, len(kinds)

    async def tasks() -> AsyncIterator[Task]:
        for i in range(n):
            yield Task(kinds[i % n_kinds], i)

    async def run() -> dict[str, Any]:
        start = time.perf_counter()
        async with Orchestrator(agents=agents, concurrency=spec.limit, aggregate=Discard()) as orch:
            result = await orch.run(tasks=tasks())
        out: dict[str, Any] = {
            "status": str(result.status),
            "completed": done,
            "slice": slice_size,
            "slice_s": [b - a for a, b in zip([start, *marks], marks, strict=False)],
            "slice_rss_kb": rss_kb,
            "slice_peak_rss_kb": peak_kb,
        }
        if result.status != "success":
            out["error"] = f"run ended {result.status!r}"
        return out

    return run


def _bare_stream(spec: Spec) -> Workload:
    """Reference for scenario 5: ``limit`` workers pulling from the same async generator."""
    fn = _subtask(spec)
    n, limit = spec.n, spec.limit
    slice_size = spec.slice or spec.n

    async def run() -> dict[str, Any]:
        async def source() -> AsyncIterator[int]:
            for i in range(n):
                yield i

        it = aiter(source())
        marks: list[float] = []
        rss_kb: list[int] = []
        peak_kb: list[int] = []
        done = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal done
            while True:
                try:
                    item = await anext(it)
                except StopAsyncIteration:
                    return
                await fn(item)
                done += 1
                if done % slice_size == 0:
                    marks.append(time.perf_counter())
                    rss_kb.append(current_rss_kb())
                    peak_kb.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

        await asyncio.gather(*[worker() for _ in range(limit)])
        return {
            "completed": done,
            "slice": slice_size,
            "slice_s": [b - a for a, b in zip([start, *marks], marks, strict=False)],
            "slice_rss_kb": rss_kb,
            "slice_peak_rss_kb": peak_kb,
        }

    return run


def _orchestra_feature(feature: str) -> Builder:
    return functools.partial(_orchestra, feature=feature)


#: Every variant by name. Scenario 6 names the orchestra feature variants ``orchestra_<feature>``.
VARIANTS: dict[str, Builder] = {
    "orchestra": _orchestra_feature("default"),
    "gather": bare_gather,
    "taskgroup": taskgroup,
    "worker_queue": worker_queue,
    "anyio": anyio_limiter,
    "aiometer": aiometer_run_all,
    "langgraph": langgraph_send,
    "orchestra_stream": _orchestra_stream,
    "worker_stream": _bare_stream,
    **{f"orchestra_{f}": _orchestra_feature(f) for f in FEATURES if f != "default"},
    "orchestra_claude": claude.claude_calls,
    "orchestra_fanout": spawning.fanout,
    "orchestra_chain": spawning.chain,
    "orchestra_group_chain": spawning.group_chain,
    "memory_noop": functools.partial(durable.transitions, store_name="memory", fail_every=0),
    "sqlite_noop": functools.partial(durable.transitions, store_name="sqlite", fail_every=0),
    "memory_retry": functools.partial(
        durable.transitions, store_name="memory", fail_every=durable.FAIL_EVERY
    ),
    "sqlite_retry": functools.partial(
        durable.transitions, store_name="sqlite", fail_every=durable.FAIL_EVERY
    ),
    "sqlite_resume": durable.resume,
    **{
        f"sqlite_workers_{k}": functools.partial(durable.claim_complete, workers=k)
        for k in (1, 2, 3)
    },
    **dict.fromkeys(failures.VARIANTS, failures.failures),
    **dict.fromkeys(postgres.VARIANTS, postgres.build),
    **dict.fromkeys(service.VARIANTS, service.build),
}


def build(spec: Spec) -> Workload:
    """Set up ``spec``'s variant and return its timed workload."""
    try:
        builder = VARIANTS[spec.variant]
    except KeyError:
        raise ValueError(f"unknown variant {spec.variant!r}; known: {sorted(VARIANTS)}") from None
    return builder(spec)
