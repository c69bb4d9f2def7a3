"""The live view of a run, for people: a progress bar with ETA, the agents, the recent errors.

`render_status(status)` turns one `RunStatus` into a rich renderable (pure: no I/O, no clock), and
`progress(source)` redraws it in place while the run goes on — or, when the console is not a
terminal (CI, a pipe, a file), writes one plain line every few seconds instead, so logs stay
readable. The view goes to stderr unless given another console: a library leaves stdout to the
application (``python job.py > out.json`` stays valid JSON).

rich is the `cli` extra's; it is imported when a view is made, and its absence is an `ImportError`
that names the extra. rich's own `Progress` is not used: it drives its own clock and tasks, while
here every number comes from the run's snapshot (virtual time under a `FakeClock` included).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio

from .._exceptions import ConfigError
from .._extras import missing_extra
from .._failure import with_type

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from rich.console import Console, RenderableType

    from .._core._status import RunStatus

__all__ = ("Watchable", "progress", "render_status", "status_line")

_BAR = 40  # characters of the bar


@runtime_checkable
class Watchable(Protocol):
    """What `progress` can watch besides a plain callable: anything with a `status()` (a run
    handle). If it also has `done` (a method or a property, as a run handle has), the view ends when it
    is true."""

    def status(self) -> RunStatus: ...


def _rich() -> Any:
    try:
        import rich
    except ImportError as exc:
        raise missing_extra("the live view", "cli", exc) from exc
    return rich


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes:02}:{secs:02}"


def status_line(status: RunStatus) -> str:
    """One plain line: what a non-terminal gets every few seconds."""
    counts = status.counts
    paused = f" ({status.state})" if status.state in ("paused", "stopping") else ""
    line = (
        f"run {status.run_id}{paused}: {status.progress:5.1f}% {status.completed}/{status.total} "
        f"| running {status.active} queued {counts['queued'] + counts['waiting']} "
        f"| ok {counts['succeeded']} failed {counts['failed']}"
    )
    if counts["skipped"] or counts["cancelled"]:
        line += f" skipped {counts['skipped']} cancelled {counts['cancelled']}"
    line += (
        f" | {status.throughput:.1f}/s | elapsed {_duration(status.elapsed)} "
        f"eta {_duration(status.eta)}"
    )
    if status.bottleneck is not None and status.state != "finished":
        line += f" | waiting on {status.bottleneck.describe()}"
    if status.cost:
        line += f" | cost {status.cost:.4f}"
    return line


def render_status(status: RunStatus, *, errors: int = 5) -> RenderableType:
    """The live view of one `RunStatus` as a rich renderable: header, progress bar with ETA, the
    agents table, the kinds table, and the last `errors` failed tasks."""
    _rich()
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    counts = status.counts
    header = Text.assemble(
        ("orchestra ", "bold"),
        (f"run {status.run_id} ", "cyan"),
        (status.state, "green" if status.state == "finished" else "yellow"),
        f"   elapsed {_duration(status.elapsed)}",
        f"   {status.throughput:.1f} tasks/s",
        f"   utilisation {status.utilisation:.0%} of {status.concurrency}",
    )
    if status.cost or status.tokens:
        tokens = sum(status.tokens.values())
        header.append(f"   cost {status.cost:.4f}  tokens {tokens:,}")
    fraction = status.completed / status.total if status.total else 0.0
    filled = round(max(0.0, min(1.0, fraction)) * _BAR)
    bar = Text.assemble(
        ("━" * filled, "green"),
        ("━" * (_BAR - filled), "grey37"),
        f" {status.progress:5.1f}%  {status.completed:,}/{status.total:,}",
        f"  eta {_duration(status.eta)}",
        "" if status.input_complete else "  (input still arriving)",
    )
    states = Text.assemble(
        ("running ", "bold"),
        str(counts["running"]),
        ("  queued ", "bold"),
        str(counts["queued"]),
        ("  waiting ", "bold"),
        str(counts["waiting"]),
        ("  retrying ", "bold"),
        str(counts["retrying"]),
        ("  pending ", "bold"),
        str(counts["pending"]),
        ("  ok ", "bold green"),
        str(counts["succeeded"]),
        ("  failed ", "bold red"),
        str(counts["failed"]),
        ("  skipped ", "bold"),
        str(counts["skipped"]),
        ("  cancelled ", "bold"),
        str(counts["cancelled"]),
    )
    parts: list[Any] = [header, bar, states]
    if status.queue_by_priority:
        parts.append(
            Text(
                "queue by priority  "
                + "  ".join(f"p{p}: {n:,}" for p, n in status.queue_by_priority.items())
            )
        )
    if status.bottleneck is not None and status.state != "finished":
        parts.append(Text.assemble(("bottleneck  ", "bold"), status.bottleneck.describe()))

    agents = Table(title="agents", title_justify="left", expand=False)
    for column, justify in (
        ("agent", "left"),
        ("state", "left"),
        ("load", "right"),
        ("util", "right"),
        ("waiting", "right"),
        ("ok", "right"),
        ("failures", "right"),
        ("last error", "left"),
    ):
        agents.add_column(column, justify=justify)  # type: ignore[arg-type]
    style = {"idle": "grey50", "busy": "green", "failing": "yellow", "open": "bold red"}
    for agent in status.agents:
        state: str = "breaker open" if agent.state == "open" else agent.state
        if agent.next_probe_in is not None:
            probe = agent.next_probe_in
            state += f" (probe in {probe:.1f}s)" if probe > 0 else " (probing)"
        if agent.paused_for > 0:
            state += f" (paused {agent.paused_for:.0f}s)"
        agents.add_row(
            Text(agent.name),  # a Text, not a str: names and ids are never read as rich markup
            Text(state, style=style.get(agent.state, "")),
            f"{agent.in_flight}/{agent.limit if agent.limit is not None else '∞'}",
            f"{agent.utilisation:.0%}",
            str(agent.waiting),
            f"{agent.succeeded:,}",
            f"{agent.failures:,}",
            Text((agent.last_error or "")[:60], style="red"),
        )
    parts.append(agents)

    if status.kinds:
        kinds = Table(title="kinds", title_justify="left", expand=False)
        for column in ("kind", "done", "left", "mean", "p95", "eta"):
            kinds.add_column(column, justify="left" if column == "kind" else "right")
        for kind in status.kinds:
            kinds.add_row(
                Text(kind.kind),
                f"{kind.total - kind.remaining:,}/{kind.total:,}",
                f"{kind.remaining:,}",
                "-" if kind.mean is None else f"{kind.mean:.2f}s",
                "-" if kind.p95 is None else f"{kind.p95:.2f}s",
                _duration(kind.eta),
            )
        parts.append(kinds)

    if status.errors and errors > 0:
        recent = Table(title="recent errors", title_justify="left", expand=False)
        for column in ("at", "task", "kind", "agent", "error"):
            recent.add_column(column)
        for error in list(status.errors)[-errors:]:
            recent.add_row(
                _duration(error.at),
                Text(error.task_id),
                Text(error.kind),
                Text(error.agent or "-"),
                Text(with_type(error.error_type, error.message)[:100], style="red"),
            )
        parts.append(recent)
    return Group(*parts)


async def progress(
    source: Callable[[], RunStatus] | Watchable,
    *,
    console: Console | None = None,
    refresh: float = 0.25,
    every: float = 5.0,
    until: Callable[[], bool] | Awaitable[Any] | None = None,
    errors: int = 5,
) -> RunStatus:
    """Show the run behind `source` until it finishes; return its last status.

    `source` is a function returning a `RunStatus` (``lambda: snapshot(run)``) or an object with
    `status()` (a run handle). The view ends when `until` says so — a function returning True,
    or an awaitable (a task, a future, a coroutine, awaited here) that completes — or, without
    `until`, when the source's `done()` is true or its status is finished. What an awaitable
    `until` raises is raised here once the view ends. Cancelling `progress` ends the view (and a
    coroutine given as `until`); the run itself is not touched.

    On a terminal, the view is redrawn in place every `refresh` seconds (rich's `Live`); on
    anything else (`console.is_terminal` false), one plain line is written every `every` seconds,
    and a last one at the end. The default console writes to stderr.
    """
    _rich()
    from rich.console import Console
    from rich.live import Live

    if refresh <= 0 or every <= 0:
        raise ConfigError(f"refresh and every must be > 0, got {refresh!r} and {every!r}")
    console = console if console is not None else Console(stderr=True)
    status_of = source.status if isinstance(source, Watchable) else source
    if not callable(status_of):
        raise ConfigError(f"progress() needs a status function or a run handle, got {source!r}")
    done_of = getattr(source, "done", None) if isinstance(source, Watchable) else None

    waiter: asyncio.Future[Any] | None = None
    if until is not None and inspect.isawaitable(until):
        waiter = asyncio.ensure_future(until)
        finished: Callable[[], bool] = waiter.done
    elif until is not None:
        finished = until
    elif callable(done_of):
        finished = done_of
    elif done_of is not None:  # a property (a run handle's `done`)

        def finished() -> bool:
            return bool(source.done)  # type: ignore[union-attr]

    else:

        def finished() -> bool:
            return False  # the status's own state decides (below)

    def over(status: RunStatus) -> bool:
        return bool(finished()) or (until is None and status.state == "finished")

    status = status_of()
    try:
        if console.is_terminal:
            with Live(
                render_status(status, errors=errors), console=console, auto_refresh=False
            ) as live:
                while not over(status):
                    await _pause(refresh, waiter)
                    status = status_of()
                    live.update(render_status(status, errors=errors), refresh=True)
        else:
            if status.state != "starting":  # a run with no tasks yet has nothing to say
                console.print(status_line(status), markup=False, highlight=False, soft_wrap=True)
            # Looked at every `refresh` seconds (the end is seen at once), printed every `every`.
            # One due time for both the wait and the check: `now - printed >= every` after a
            # sleep of `every` was false whenever `printed + every` rounded down (at some loop
            # times, every other line), and a real timer may fire a hair early too.
            line_at = anyio.current_time() + every
            while not over(status):
                await _pause(min(refresh, line_at - anyio.current_time()), waiter)
                status = status_of()
                now = anyio.current_time()
                if now >= line_at or over(status):
                    line_at = now + every
                    console.print(
                        status_line(status), markup=False, highlight=False, soft_wrap=True
                    )
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([waiter])
    if waiter is not None and not waiter.cancelled() and waiter.exception() is not None:
        raise waiter.exception()  # type: ignore[misc]  # what `until` raised reaches its caller
    return status


async def _pause(seconds: float, waiter: asyncio.Future[Any] | None) -> None:
    """Sleep `seconds`, or less if `waiter` completes first."""
    if waiter is None:
        await anyio.sleep(seconds)
        return
    with anyio.move_on_after(seconds):
        await asyncio.wait([waiter])


for _public in (progress, render_status, status_line):
    _public.__module__ = "orchestra"
