"""Scenario 8's variants: tasks that agents add while the run goes on, and a group being waited for.

Each is orchestra as a user writes it (`Orchestrator(agents=..., concurrency=limit)`, its default
policy and aggregation) through the public API only, so the rows keep measuring the same thing
whatever the core does underneath. ``spec.n`` counts the tasks the shape is about (children,
links, members); the one parent or waiter besides them is not counted.

- ``orchestra_fanout``: one attempt spawns ``n`` no-op children with ``ctx.spawn``: the cost of a
  spawn, per child, from the parent's call to the last child's end.
- ``orchestra_chain``: each task spawns the next, ``n`` deep: time and peak RSS of a long chain
  of spawns (every spawn is admitted when its spawner's attempt succeeds).
- ``orchestra_group_chain``: a task waits for the group ``"g"`` (``depends_on_tags``), then ``n``
  members of ``"g"`` follow in the same list, each depending on the one before: every member
  joining an awaited group is checked for a cycle through its waiter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import Spec
    from .variants import Workload


def _run_orchestra(spec: Spec, agents: list[Any], make_tasks: Any, counted: list[int]) -> Workload:
    from orchestra import Orchestrator

    async def run() -> dict[str, Any]:
        async with Orchestrator(agents=agents, concurrency=spec.limit) as orch:
            result = await orch.run(tasks=make_tasks())
        out: dict[str, Any] = {"status": str(result.status), "completed": counted[0]}
        if result.status != "success":
            out["error"] = f"run ended {result.status!r}"
        return out

    return run


def fanout(spec: Spec) -> Workload:
    """One parent attempt spawning ``spec.n`` children, each with its own id."""
    from orchestra import Task, agent

    n = spec.n
    counted = [0]

    # Parameters typed ``Any``: orchestra is imported inside the builder (see variants.py).
    @agent(kinds=["parent"])
    async def parent(task: Any, ctx: Any) -> int:
        spawn = ctx.spawn
        for i in range(n):
            spawn(Task("child", i, id=f"c{i}"))
        return n

    @agent(kinds=["child"])
    async def child(task: Any, ctx: Any) -> None:
        counted[0] += 1

    return _run_orchestra(spec, [parent, child], lambda: [Task("parent", id="p")], counted)


def chain(spec: Spec) -> Workload:
    """``spec.n`` tasks, each spawned by the one before it."""
    from orchestra import Task, agent

    n = spec.n
    counted = [0]

    @agent(kinds=["link"])
    async def link(task: Any, ctx: Any) -> None:
        counted[0] += 1
        nxt = task.payload + 1
        if nxt < n:
            ctx.spawn(Task("link", nxt, id=f"l{nxt}"))

    return _run_orchestra(spec, [link], lambda: [Task("link", 0, id="l0")], counted)


def group_chain(spec: Spec) -> Workload:
    """A waiter of group ``"g"``, then ``spec.n`` members of ``"g"`` chained by ``depends_on``."""
    from orchestra import Task, agent

    n = spec.n
    counted = [0]

    @agent(kinds=["member"])
    async def member(task: Any, ctx: Any) -> None:
        counted[0] += 1

    @agent(kinds=["wait"])
    async def wait(task: Any, ctx: Any) -> int:
        if len(ctx.deps) != n:
            raise RuntimeError(f"the waiter saw {len(ctx.deps)} of {n} members")
        return n

    def tasks() -> list[Any]:
        out = [Task("wait", id="w", depends_on_tags=["g"])]
        out.append(Task("member", 0, id="g0", tags=["g"]))
        out += [
            Task("member", i, id=f"g{i}", tags=["g"], depends_on=[f"g{i - 1}"]) for i in range(1, n)
        ]
        return out

    return _run_orchestra(spec, [member, wait], tasks, counted)
