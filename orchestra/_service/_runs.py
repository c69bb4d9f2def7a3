"""The runs routes, under ``/api/runs``: submit a run, list and read runs (from the store),
control the live ones (from their `RunHandle`), a task with its attempts, the dead letters and
their retry, the journal as JSON lines.

Roles: ``submit`` to start a run, ``read`` to read, ``control`` to pause, resume, cancel, stop,
reprioritize and retry. A run's `run_id` in a path is checked by `known_run` before a streamed
answer begins, so an unknown run is a 404, not a stream that breaks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Body, Depends, Header, Path, Query, Request, Response

from .._exceptions import InputError
from .._result import RunResult
from ._auth import require
from ._errors import Refused, responses
from ._keys import request_digest
from ._models import (
    Cancelled,
    CancelRequest,
    Control,
    DeadLetter,
    JournalEvent,
    Reopened,
    Reprioritized,
    ReprioritizeRequest,
    RetryRequest,
    RunAccepted,
    RunList,
    RunSummary,
    StatusOut,
    StopRequest,
    SubmitRun,
    TaskDetail,
)
from ._state import Service, holder

__all__ = ("ServiceDep", "known_run", "router")


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(_service)]
RunPath = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


async def known_run(run_id: RunPath, service: ServiceDep) -> dict[str, Any]:
    """The store's record of the run in the path; 404 when there is none."""
    return await service.run_record(run_id)


KnownRun = Annotated[dict[str, Any], Depends(known_run)]

router = APIRouter(prefix="/api/runs", tags=["runs"])
_read = [Depends(require("read"))]
_control = [Depends(require("control"))]


@router.post(
    "",
    status_code=202,
    response_model=RunAccepted,
    dependencies=[Depends(require("submit"))],
    responses={
        200: {"model": RunAccepted, "description": "The run this id or key had started."},
        **responses(400, 401, 403, 409, 413),
    },
)
async def submit(
    body: SubmitRun,
    service: ServiceDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=200,
            description="The same key always answers the same run, never a second one; "
            "sent with another request than the one that started its run, a 409.",
        ),
    ] = None,
) -> RunAccepted:
    """Start a run: its `tasks`, or an `input` for the orchestrator's decomposer. Answers 202 with
    the run's id once its input is admitted (a bad task is a 400 naming it and its field), or 200
    with the run an earlier request with the same `run_id` or `Idempotency-Key` started."""
    digest = None if idempotency_key is None else request_digest(body.model_dump(mode="json"))
    run_id, created = await service.submit(
        tasks=body.tasks, input=body.input, run_id=body.run_id, key=idempotency_key, digest=digest
    )
    if not created:
        response.status_code = 200
    return RunAccepted(run_id=run_id, created=created)


def _summary(run: dict[str, Any], service: Service) -> RunSummary:
    handle = service.handle(run["id"])
    live = handle is not None and not handle.done
    return RunSummary(
        id=run["id"],
        state=run.get("state", "open"),
        created=run.get("created"),
        updated=run.get("updated"),
        counts=run.get("counts", {}),
        live=live,
        paused=live and handle is not None and handle.paused,
        held_by=holder(run),
    )


PAGE: Final = 50
"""Runs a page of ``GET /api/runs`` holds unless `limit` says otherwise."""
MAX_PAGE: Final = 500
"""The most runs one page holds."""


@router.get("", response_model=RunList, dependencies=_read, responses=responses(400, 401, 403))
async def list_runs(
    service: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="runs in the page")] = PAGE,
    cursor: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=200,
            pattern=r"^[A-Za-z0-9._:-]+$",
            description="the `next_cursor` of the page before (none: the newest runs)",
        ),
    ] = None,
    state: Annotated[
        Literal["open", "closed"] | None, Query(description="only the runs of this state")
    ] = None,
) -> RunList:
    """The runs in the store, newest first, a page at a time: those started here, earlier, or
    by other processes. `next_cursor` asks for the next (older) page; null on the last."""
    # One run more than the page: whether there is a next page, without counting the runs.
    runs = await service.read(
        partial(service.store.latest_runs, limit + 1, after=cursor, state=state)
    )
    service.prune()
    page = runs[:limit]
    return RunList(
        runs=[_summary(run, service) for run in page],
        next_cursor=page[-1]["id"] if len(runs) > limit else None,
    )


@router.get(
    "/{run_id}", response_model=RunSummary, dependencies=_read, responses=responses(401, 403, 404)
)
async def get_run(run: KnownRun, service: ServiceDep) -> RunSummary:
    """A run: its state, its tasks counted by state, whether it runs here now, and whether it is
    paused (where it runs)."""
    summary = _summary(run, service)
    if not summary.live and summary.held_by is not None and service.replicas is not None:
        summary.paused = await service.replicas.is_paused(summary.id)
    return summary


@router.get(
    "/{run_id}/result",
    response_model=RunResult,
    dependencies=_read,
    responses=responses(401, 403, 404, 409),
)
async def get_result(run_id: RunPath, run: KnownRun, service: ServiceDep) -> RunResult:
    """The run's `RunResult`: 409 while it runs, or when no service process on the store ran it
    to its end (the store keeps every task's end, not the aggregate: read its journal and dead
    letters). On PostgreSQL, every replica answers the result of a run any of them ran."""
    handle = service.handle(run_id)
    if handle is None and service.replicas is not None:
        kept = await service.replicas.result(run_id)
        if kept is not None:
            return RunResult.model_validate(kept)
    if handle is None:
        raise Refused(
            409,
            "result_not_here",
            f"run {run_id!r} was not run by this service process, which keeps the results of "
            "the runs it ran: read its tasks (/journal, /dead-letters) instead",
            field="run_id",
        )
    if not handle.done:
        raise Refused(409, "running", f"run {run_id!r} is still running: ask again once it ended")
    try:
        return await handle
    except Exception as exc:
        raise Refused(
            409, "run_failed", f"run {run_id!r} ended without a result: {exc}", field="run_id"
        ) from None


@router.get(
    "/{run_id}/status",
    response_model=StatusOut,
    dependencies=_read,
    responses=responses(401, 403, 404, 409, 503),
)
async def get_status(run_id: RunPath, run: KnownRun, service: ServiceDep) -> dict[str, Any]:
    """The run's `RunStatus` (as ``handle.status()``): counts, progress, throughput, ETA,
    agents, queue by priority, bottleneck, recent errors. For a run this process runs or ran, or
    (on PostgreSQL) one another replica runs, asked of it."""
    handle = service.handle(run_id)
    if (
        handle is None
        and service.replicas is not None
        and run.get("state") == "open"
        and await service.replicas.passes_on(run_id)
    ):
        return await service.replicas.ask(run_id, "status", {}, within=0.0)
    if handle is None:
        raise Refused(
            409,
            "status_not_here",
            f"run {run_id!r} is not run by this service process: its status lives where it "
            "runs; its tasks' counts are in GET /api/runs/{run_id}",
            field="run_id",
        )
    return handle.status().to_dict()


_CONTROL_ERRORS = responses(400, 401, 403, 404, 409, 503)


@router.post(
    "/{run_id}/pause", response_model=Control, dependencies=_control, responses=_CONTROL_ERRORS
)
async def pause(run_id: RunPath, service: ServiceDep) -> Control:
    """Start no new attempt (the running ones finish)."""
    return Control.model_validate(await service.control(run_id, "pause", {}))


@router.post(
    "/{run_id}/resume", response_model=Control, dependencies=_control, responses=_CONTROL_ERRORS
)
async def resume(run_id: RunPath, service: ServiceDep) -> Control:
    """Start attempts again after a pause."""
    return Control.model_validate(await service.control(run_id, "resume", {}))


@router.post(
    "/{run_id}/cancel", response_model=Cancelled, dependencies=_control, responses=_CONTROL_ERRORS
)
async def cancel(run_id: RunPath, body: CancelRequest, service: ServiceDep) -> Cancelled:
    """Cancel the unfinished tasks that match every selector given (as `RunHandle.cancel`):
    running attempts are cancelled, waiting tasks removed, their dependents skipped."""
    args = body.model_dump(mode="json", exclude_unset=True)
    return Cancelled.model_validate(await service.control(run_id, "cancel", args))


@router.post(
    "/{run_id}/stop", response_model=RunResult, dependencies=_control, responses=_CONTROL_ERRORS
)
async def stop(
    run_id: RunPath, service: ServiceDep, body: Annotated[StopRequest | None, Body()] = None
) -> RunResult:
    """End the run gracefully: no new attempt, the running ones get `grace` seconds, then the
    rest is cancelled. Answers its `RunResult` (status "cancelled") once it ended."""
    body = body or StopRequest()
    args = body.model_dump(mode="json")
    return RunResult.model_validate(await service.control(run_id, "stop", args, within=body.grace))


@router.post(
    "/{run_id}/reprioritize",
    response_model=Reprioritized,
    dependencies=_control,
    responses=_CONTROL_ERRORS,
)
async def reprioritize(
    run_id: RunPath, body: ReprioritizeRequest, service: ServiceDep
) -> Reprioritized:
    """Change the priority of a task that waits (smaller runs first)."""
    answer = await service.control(run_id, "reprioritize", body.model_dump(mode="json"))
    return Reprioritized.model_validate(answer)


_TASK_PATH = Annotated[str, Path(min_length=1, max_length=1000)]


@router.get(
    "/{run_id}/tasks/{task_id}",
    response_model=TaskDetail,
    dependencies=_read,
    responses=responses(401, 403, 404),
)
async def get_task(
    run_id: RunPath, task_id: _TASK_PATH, run: KnownRun, service: ServiceDep
) -> TaskDetail:
    """One task of the run with every event of it (each attempt's start and failure, its end),
    from the store's journal."""
    try:
        events = await service.read(service.store.events, run_id, task_id)
    except InputError:
        raise Refused(
            404, "not_found", f"run {run_id!r} has no task {task_id!r}", field="task_id"
        ) from None
    ended = [e for e in events if e["event"] in _ENDS]
    started = [e for e in events if e["event"] == "started"]
    last = ended[-1] if ended else None
    state = last["event"] if last else ("running" if started else "waiting")
    attempts = max((e["attempt"] or 0 for e in events), default=0)
    # The agent of its last attempt: a failed task's end names none (no agent gave its output),
    # its attempts' starts and failures do.
    agent = next((e["agent"] for e in reversed(events) if e["agent"] is not None), None)
    return TaskDetail(
        run_id=run_id,
        task_id=task_id,
        state=state,
        attempts=attempts,
        agent=agent,
        events=[JournalEvent(**e) for e in events],
    )


_ENDS = frozenset({"succeeded", "failed", "skipped", "cancelled"})


@router.get(
    "/{run_id}/dead-letters",
    response_model=list[DeadLetter],
    dependencies=_read,
    responses=responses(401, 403, 404),
)
async def dead_letters(run_id: RunPath, run: KnownRun, service: ServiceDep) -> list[DeadLetter]:
    """The tasks of the run that failed for good, each with every failed attempt."""
    letters = await service.read(service.store.dead_letters, run_id)
    # The stores keep a payload as the JSON text it was written as: answered as that JSON value.
    return [
        DeadLetter(**{**letter, "payload": json.loads(letter["payload"])})
        if isinstance(letter.get("payload"), str)
        else DeadLetter(**letter)
        for letter in letters
    ]


@router.post(
    "/{run_id}/dead-letters/retry",
    response_model=Reopened,
    dependencies=_control,
    responses=_CONTROL_ERRORS,
)
async def retry(
    run_id: RunPath,
    run: KnownRun,
    service: ServiceDep,
    body: Annotated[RetryRequest | None, Body()] = None,
) -> Reopened:
    """Make failed tasks runnable again (all of them, or `task_ids`), with the tasks they had
    skipped. Submitting the run again (the same `run_id` and tasks) runs them; on PostgreSQL,
    workers serving the run do at once."""
    handle = service.handle(run_id)
    if handle is not None and not handle.done:
        raise Refused(
            409,
            "running",
            f"run {run_id!r} is still running here: retry its failed tasks once it ended",
            field="run_id",
        )
    held = holder(run)
    if held is not None and handle is None:
        raise Refused(
            409,
            "held_elsewhere",
            f"run {run_id!r} is run by another process ({held}): retry once it ended",
            field="run_id",
        )
    ids = None if body is None else body.task_ids
    return Reopened(reopened=await service.read(service.store.retry, run_id, ids))


@router.get(
    "/{run_id}/journal",
    dependencies=_read,
    responses={
        200: {
            "content": {"application/jsonl": {"itemSchema": JournalEvent.model_json_schema()}},
            "description": "One JSON object a line, in the journal's order.",
        },
        **responses(401, 403, 404),
    },
)
async def journal(
    run_id: RunPath, run: KnownRun, service: ServiceDep
) -> AsyncIterator[JournalEvent]:
    """The run's journal as JSON lines, in order: every event of every task (admitted, ready,
    started, attempt_failed, retried, its end), streamed."""
    for event in await service.read(service.store.events, run_id):
        yield JournalEvent(**event)
